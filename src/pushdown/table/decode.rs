//! Decoding the input columns: what a leaf column holds ([`Leaf`]), the input column found in a
//! schema ([`InputColumns`]), and the column readers over pages checked against their claims
//! ([`Columns`], [`CheckedPages`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parquet::basic::{ConvertedType, LogicalType, Repetition, Type as Physical};
use parquet::column::page::{Page, PageMetadata, PageReader};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::data_type::{ByteArray, DataType};
use parquet::file::metadata::ColumnChunkMetaData;
use parquet::file::reader::RowGroupReader;
use parquet::schema::types::{SchemaDescriptor, Type, TypePtr};

use super::super::error::PushdownError;
use super::layout::{ROWS_PER_BATCH, VALUE_OVERHEAD, parquet_error};
use super::source::Source;

/// What a leaf column holds, as the gateway reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Leaf {
    /// Byte strings (`BYTE_ARRAY` with no annotation).
    Binary,
    /// UTF-8 strings (`BYTE_ARRAY` annotated as a string, an enum or JSON).
    Text,
    /// Integers (`INT32` or `INT64`, unannotated or annotated as integers), signed or not.
    Int { signed: bool },
}

impl Leaf {
    /// The kind of a column that is neither repeated nor a group; `None` for any other.
    pub(super) fn of(t: &Type) -> Option<Self> {
        let info = t.get_basic_info();
        if !t.is_primitive() || repeated(t) {
            return None;
        }
        let (logical, converted) = (info.logical_type_ref(), info.converted_type());
        match t.get_physical_type() {
            Physical::BYTE_ARRAY => match (logical, converted) {
                (Some(LogicalType::String | LogicalType::Enum | LogicalType::Json), _)
                | (None, ConvertedType::UTF8 | ConvertedType::ENUM | ConvertedType::JSON) => Some(Self::Text),
                (None, ConvertedType::NONE) => Some(Self::Binary),
                _ => None,
            },
            Physical::INT32 | Physical::INT64 => match (logical, converted) {
                (Some(LogicalType::Integer(i)), _) => Some(Self::Int { signed: i.is_signed }),
                (
                    None,
                    ConvertedType::NONE
                    | ConvertedType::INT_8
                    | ConvertedType::INT_16
                    | ConvertedType::INT_32
                    | ConvertedType::INT_64,
                ) => Some(Self::Int { signed: true }),
                (
                    None,
                    ConvertedType::UINT_8 | ConvertedType::UINT_16 | ConvertedType::UINT_32 | ConvertedType::UINT_64,
                ) => Some(Self::Int { signed: false }),
                _ => None,
            },
            _ => None,
        }
    }
}

/// Whether a column repeats (a list's elements; the schema's root has no repetition).
pub(super) fn repeated(t: &Type) -> bool {
    let info = t.get_basic_info();
    info.has_repetition() && info.repetition() == Repetition::REPEATED
}

/// A column's type as an error message names it.
pub(super) fn describe(t: &Type) -> String {
    let info = t.get_basic_info();
    let suffix = if repeated(t) { ", repeated" } else { "" };
    if t.is_group() {
        return format!("a group of {} fields{suffix}", t.get_fields().len());
    }
    match (info.logical_type_ref(), info.converted_type()) {
        (Some(l), _) => format!("{} ({l:?}){suffix}", t.get_physical_type()),
        (None, ConvertedType::NONE) => format!("{}{suffix}", t.get_physical_type()),
        (None, c) => format!("{} ({c}){suffix}", t.get_physical_type()),
    }
}

/// The schema's root column named `name`: its index among the roots, and its type.
pub(super) fn root<'a>(schema: &'a SchemaDescriptor, name: &str) -> Option<(usize, &'a TypePtr)> {
    schema.root_schema().get_fields().iter().enumerate().find(|(_, f)| f.name() == name)
}

/// The index of the leaf column at `path`.
pub(super) fn leaf_at(schema: &SchemaDescriptor, path: &[&str]) -> Option<usize> {
    schema.columns().iter().position(|c| c.path().parts().iter().map(String::as_str).eq(path.iter().copied()))
}

/// Where a row's input is: the leaf column of its bytes and, for an image struct, of its `path`.
#[derive(Debug, Clone, Copy)]
pub(super) struct InputColumns {
    pub(super) leaf: usize,
    pub(super) path: Option<usize>,
}

impl InputColumns {
    /// Encoded images: binary, or a struct (a plain group, not a list or a map) with a binary
    /// `bytes` field and, if any, a string `path`.
    pub(super) fn image(schema: &SchemaDescriptor, name: &str, t: &Type) -> Option<Self> {
        if t.is_primitive() {
            return Self::plain(schema, name, t, Leaf::Binary);
        }
        let info = t.get_basic_info();
        if repeated(t) || info.logical_type_ref().is_some() || info.converted_type() != ConvertedType::NONE {
            return None;
        }
        let field = |n: &str, kind| t.get_fields().iter().any(|f| f.name() == n && Leaf::of(f) == Some(kind));
        if !field("bytes", Leaf::Binary) {
            return None;
        }
        let path = if field("path", Leaf::Text) { leaf_at(schema, &[name, "path"]) } else { None };
        Some(Self { leaf: leaf_at(schema, &[name, "bytes"])?, path })
    }

    /// Texts: a string column.
    pub(super) fn text(schema: &SchemaDescriptor, name: &str, t: &Type) -> Option<Self> {
        Self::plain(schema, name, t, Leaf::Text)
    }

    /// A root column of `kind` itself.
    pub(super) fn plain(schema: &SchemaDescriptor, name: &str, t: &Type, kind: Leaf) -> Option<Self> {
        (Leaf::of(t) == Some(kind)).then(|| leaf_at(schema, &[name])).flatten().map(|leaf| Self { leaf, path: None })
    }
}

/// The leaf columns of one row group, each decoded whole, every read's bytes charged against
/// what the footer claimed.
pub(super) struct Columns<'a> {
    pub(super) reader: &'a dyn RowGroupReader,
    /// The bytes read, which hold the group's chunks (their pages are checked before they are
    /// decoded: [`check_pages`]).
    pub(super) source: &'a Source,
    pub(super) schema: &'a SchemaDescriptor,
    /// The group's rows, as the footer states them: every column must hold as many.
    pub(super) expected: usize,
    /// Bytes decoded so far, shared with the columns' page readers ([`CheckedPages`]).
    pub(super) decoded: Arc<AtomicU64>,
    pub(super) limit: u64,
    pub(super) group: usize,
    pub(super) claimed: u64,
}

impl Columns<'_> {
    /// Every value of a column (`None` for a null), [`ROWS_PER_BATCH`] rows at a time, each
    /// value turned by `map` as it is read (so a read's page buffers are let go before the next).
    pub(super) fn read<T: DataType, U>(
        &mut self,
        leaf: usize,
        mut reader: ColumnReaderImpl<T>,
        size: impl Fn(&T::T) -> u64,
        map: impl Fn(T::T) -> Result<U, PushdownError>,
    ) -> Result<Vec<Option<U>>, PushdownError> {
        let max_def = self.schema.column(leaf).max_def_level();
        let mut out = Vec::with_capacity(self.expected);
        let (mut values, mut defs) = (Vec::new(), Vec::new());
        loop {
            values.clear();
            defs.clear();
            let (records, _, _) = reader
                .read_records(ROWS_PER_BATCH, (max_def > 0).then_some(&mut defs), None, &mut values)
                .map_err(|e| parquet_error(&e))?;
            if records == 0 {
                break;
            }
            let bytes = values.iter().map(|v| size(v).saturating_add(VALUE_OVERHEAD)).fold(0, u64::saturating_add);
            let decoded = self.decoded.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes);
            if decoded > self.limit || out.len() + records > self.expected {
                return Err(PushdownError::BadInput(format!(
                    "row group {} of the Parquet file decodes to more than its footer states ({} bytes, {} rows)",
                    self.group, self.claimed, self.expected
                )));
            }
            let mut given = values.drain(..);
            for i in 0..records {
                let defined = max_def == 0 || defs.get(i) == Some(&max_def);
                out.push(if defined { given.next().map(&map).transpose()? } else { None });
            }
            if given.next().is_some() {
                return Err(PushdownError::BadInput("a Parquet page's values and levels disagree".into()));
            }
        }
        if out.len() != self.expected {
            return Err(PushdownError::BadInput(format!(
                "row group {} of the Parquet file has {} rows, its footer states {}",
                self.group,
                out.len(),
                self.expected
            )));
        }
        Ok(out)
    }

    /// A column's reader: its page headers checked before any page is read ([`check_pages`]),
    /// its dictionary pages before they are decoded ([`CheckedPages`]).
    pub(super) fn column(&self, leaf: usize) -> Result<ColumnReader, PushdownError> {
        let chunk = self.reader.metadata().column(leaf);
        let pages = u64::try_from(chunk_start(chunk))
            .ok()
            .zip(usize::try_from(chunk.compressed_size()).ok())
            .and_then(|(start, len)| self.source.slice(start, len))
            .ok_or_else(|| {
                PushdownError::BadInput(format!(
                    "the Parquet footer places column {:?} outside the bytes read",
                    chunk.column_path().string()
                ))
            })?;
        check_pages(&pages, self.limit)?;
        let descr = self.schema.column(leaf);
        let (min_bytes, handle) = match descr.physical_type() {
            Physical::INT32 => (4, 4),
            Physical::INT64 => (8, 8),
            _ => (4, std::mem::size_of::<ByteArray>() as u64),
        };
        let pages = CheckedPages {
            inner: self.reader.get_column_page_reader(leaf).map_err(|e| parquet_error(&e))?,
            min_bytes,
            handle,
            decoded: self.decoded.clone(),
            limit: self.limit,
        };
        Ok(parquet::column::reader::get_column_reader(descr, Box::new(pages)))
    }

    /// A byte-string column's values, copied out of their pages.
    pub(super) fn bytes(&mut self, leaf: usize) -> Result<Vec<Option<Bytes>>, PushdownError> {
        match self.column(leaf)? {
            ColumnReader::ByteArrayColumnReader(r) => {
                self.read(leaf, r, |v: &ByteArray| v.len() as u64, |v| Ok(Bytes::copy_from_slice(v.data())))
            }
            _ => Err(PushdownError::BadInput("the input column is not byte strings".into())),
        }
    }

    /// A string column's values; a value that is not UTF-8 is refused.
    pub(super) fn strings(&mut self, leaf: usize) -> Result<Vec<Option<String>>, PushdownError> {
        let utf8 = |v: ByteArray| {
            String::from_utf8(v.data().to_vec())
                .map_err(|_| PushdownError::BadInput("a Parquet string column holds bytes that are not UTF-8".into()))
        };
        match self.column(leaf)? {
            ColumnReader::ByteArrayColumnReader(r) => self.read(leaf, r, |v: &ByteArray| v.len() as u64, utf8),
            _ => Err(PushdownError::BadInput("a string column is not byte strings".into())),
        }
    }

    /// An integer column's values as `i64`.
    pub(super) fn integers(&mut self, leaf: usize, kind: Leaf, what: &str) -> Result<Vec<Option<i64>>, PushdownError> {
        let signed = matches!(kind, Leaf::Int { signed: true });
        match self.column(leaf)? {
            // Unsigned 32-bit integers are stored in INT32's bits.
            ColumnReader::Int32ColumnReader(r) => {
                self.read(leaf, r, |_| 4, |v| Ok(if signed { i64::from(v) } else { i64::from(v.cast_unsigned()) }))
            }
            ColumnReader::Int64ColumnReader(r) => self.read(
                leaf,
                r,
                |_| 8,
                |v| match v.cast_unsigned() {
                    u if !signed && u > i64::MAX as u64 => {
                        Err(PushdownError::BadInput(format!("{what} {u} does not fit in 64 bits")))
                    }
                    _ => Ok(v),
                },
            ),
            _ => Err(PushdownError::BadInput(format!("the {what} column is not integers"))),
        }
    }
}

/// A column chunk's pages as the parquet crate reads them, each dictionary page checked before
/// its values are decoded: the crate sizes a dictionary by the count its page header states
/// (`num_values`), so a page of a few bytes claiming 2^31 values asked for 64 GiB of value
/// handles and the allocation failure aborted the process. A dictionary's values are PLAIN
/// encoded, each taking at least `min_bytes` of the page, and its handles (`handle` bytes each)
/// are charged with the column's other decoded bytes against what the footer claimed.
pub(super) struct CheckedPages {
    pub(super) inner: Box<dyn PageReader>,
    pub(super) min_bytes: usize,
    pub(super) handle: u64,
    pub(super) decoded: Arc<AtomicU64>,
    pub(super) limit: u64,
}

impl Iterator for CheckedPages {
    type Item = parquet::errors::Result<Page>;

    fn next(&mut self) -> Option<Self::Item> {
        self.get_next_page().transpose()
    }
}

impl PageReader for CheckedPages {
    fn get_next_page(&mut self) -> parquet::errors::Result<Option<Page>> {
        let page = self.inner.get_next_page()?;
        if let Some(Page::DictionaryPage { buf, num_values, .. }) = &page {
            let n = u64::from(*num_values);
            let cost = n.saturating_mul(self.handle);
            let decoded = self.decoded.fetch_add(cost, Ordering::Relaxed).saturating_add(cost);
            if n > (buf.len() / self.min_bytes) as u64 || decoded > self.limit {
                return Err(parquet::errors::ParquetError::General(format!(
                    "a dictionary page states {n} values in {} bytes, or more than the footer claims",
                    buf.len()
                )));
            }
        }
        Ok(page)
    }

    fn peek_next_page(&mut self) -> parquet::errors::Result<Option<PageMetadata>> {
        self.inner.peek_next_page()
    }

    fn skip_next_page(&mut self) -> parquet::errors::Result<()> {
        self.inner.skip_next_page()
    }

    fn at_record_boundary(&mut self) -> parquet::errors::Result<bool> {
        self.inner.at_record_boundary()
    }
}

/// Where a column chunk's bytes begin, as its footer places them: its dictionary page, else its
/// first data page. Unchecked (a hostile footer may place it anywhere, negative included).
pub(super) fn chunk_start(chunk: &ColumnChunkMetaData) -> i64 {
    chunk.dictionary_page_offset().unwrap_or_else(|| chunk.data_page_offset())
}

/// Encodings whose decoder in the parquet crate sizes a buffer by a count inside the page data
/// (`DELTA_LENGTH_BYTE_ARRAY`: the lengths' `total value count`; `DELTA_BYTE_ARRAY`: the
/// prefix lengths' count), before any value is read: a page of a few bytes could ask for more
/// memory than the node has, and an allocation failure aborts the process. Nothing checks that
/// count first, so pages in them are refused (`415`). pyarrow and Hugging Face datasets write
/// images and texts PLAIN or dictionary encoded unless told otherwise.
pub(super) const UNCHECKED_ENCODINGS: [(i32, &str); 2] = [(6, "DELTA_LENGTH_BYTE_ARRAY"), (7, "DELTA_BYTE_ARRAY")];

/// Walks the page headers of a column chunk (`chunk`: its bytes, as the footer places them)
/// before the parquet crate reads them, and refuses a chunk it could not read within `limit`
/// bytes: the crate allocates a page's `uncompressed_page_size` (up to 2 GiB, zero-filled for
/// Snappy) before decompressing it, so a page header of a few bytes could claim more than the
/// whole row group was reserved for. Every page's uncompressed size, and their sum, must be
/// within `limit` (what decoding the group may take); each page must lie within the chunk; no
/// data page may use an [`UNCHECKED_ENCODINGS`] encoding. Only the headers' leading fields are
/// read (Thrift compact protocol, the `thrift` crate; statistics are skipped, not copied).
pub(super) fn check_pages(chunk: &[u8], limit: u64) -> Result<(), PushdownError> {
    use thrift::protocol::{TCompactInputProtocol, TInputProtocol, TType};
    let bad = |what: String| PushdownError::BadInput(format!("a Parquet page header {what}"));
    let unreadable = |e: thrift::Error| bad(format!("cannot be read: {e}"));
    // A page header's fields: its sizes (2, 3) and, in a data page header (5) or a v2 one (8),
    // the values' encoding (field 2 of the first, 4 of the second).
    let mut rest = chunk;
    let mut total = 0u64;
    while !rest.is_empty() {
        let before = rest.len();
        let (mut uncompressed, mut compressed, mut encoding) = (None, None, None);
        let mut p = TCompactInputProtocol::new(&mut rest);
        p.read_struct_begin().map_err(unreadable)?;
        loop {
            let field = p.read_field_begin().map_err(unreadable)?;
            match (field.field_type, field.id) {
                (TType::Stop, _) => break,
                (TType::I32, Some(2)) => uncompressed = Some(p.read_i32().map_err(unreadable)?),
                (TType::I32, Some(3)) => compressed = Some(p.read_i32().map_err(unreadable)?),
                (TType::Struct, Some(5)) => encoding = i32_field(&mut p, 2).map_err(unreadable)?,
                (TType::Struct, Some(8)) => encoding = i32_field(&mut p, 4).map_err(unreadable)?,
                (t, _) => p.skip(t).map_err(unreadable)?,
            }
        }
        p.read_struct_end().map_err(unreadable)?;
        drop(p);
        let (Some(uncompressed), Some(compressed)) = (uncompressed, compressed) else {
            return Err(bad("lacks its sizes".into()));
        };
        let (Ok(uncompressed), Ok(compressed)) = (u64::try_from(uncompressed), usize::try_from(compressed)) else {
            return Err(bad("states a negative size".into()));
        };
        total = total.saturating_add(uncompressed);
        if uncompressed > limit || total > limit {
            return Err(bad(format!(
                "states {uncompressed} uncompressed bytes, more than the row group's chunks claim ({limit} bytes \
                 to decode, with its values)"
            )));
        }
        if let Some((_, name)) = UNCHECKED_ENCODINGS.iter().find(|(e, _)| Some(*e) == encoding) {
            return Err(PushdownError::Unsupported(format!(
                "a Parquet data page of an input column is {name} encoded; this gateway decodes PLAIN and \
                 dictionary encoded pages there (pyarrow's default)"
            )));
        }
        rest = rest.get(compressed..).ok_or_else(|| {
            bad(format!("states {compressed} bytes of page data, more than its column chunk has left"))
        })?;
        debug_assert!(rest.len() < before, "every page header takes at least a byte");
    }
    Ok(())
}

/// Reads a Thrift struct, skipping all but its `i32` field `id`, which it returns if present.
pub(super) fn i32_field(p: &mut impl thrift::protocol::TInputProtocol, id: i16) -> thrift::Result<Option<i32>> {
    use thrift::protocol::TType;
    let mut found = None;
    p.read_struct_begin()?;
    loop {
        let field = p.read_field_begin()?;
        match (field.field_type, field.id) {
            (TType::Stop, _) => break,
            (TType::I32, Some(f)) if f == id => found = Some(p.read_i32()?),
            (t, _) => p.skip(t)?,
        }
    }
    p.read_struct_end()?;
    Ok(found)
}
