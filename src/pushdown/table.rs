//! Parquet objects as batches of samples (ADR 0016): the rows of one image column, in
//! the layout Hugging Face `datasets` writes (a struct of `bytes` and `path`, or plain binary),
//! with their labels (an integer `label` column) and keys (the image's `path`, else an `id`
//! column's value, else the row number). Pure: bytes in, samples out.
//!
//! Reading happens in two steps so that the memory governor can hold what decoding costs before
//! it is paid: [`Footer::read`] parses only the footer (its length and its schema's shape checked
//! first) and states how many rows and how many decoded bytes the input columns take;
//! [`Footer::rows`] then decodes those columns alone, and refuses a file whose pages decode to
//! more than its footer claimed.
//!
//! A request may name some row groups ([`RowGroups`]): then only those are counted and decoded,
//! and the bytes need not be the whole file. A [`Source`] is the pieces of the file that were
//! read: its tail ([`TAIL_BYTES`], the footer) and the span of the named groups
//! ([`Footer::span`]), so a file of any size is pushed down a few row groups at a time.
//!
//! The parquet crate's own column readers and file writer do the work, without its Arrow layer
//! (ADR 0022): the input columns are decoded one after the other, and a Parquet output copies
//! the other columns' encoded chunks as they are, without decoding them.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parquet::basic::{Compression, ConvertedType, LogicalType, Repetition, Type as Physical};
use parquet::column::page::{Page, PageMetadata, PageReader};
use parquet::column::reader::{ColumnReader, ColumnReaderImpl};
use parquet::column::writer::ColumnCloseResult;
use parquet::data_type::{ByteArray, DataType, FixedLenByteArray, FixedLenByteArrayType, FloatType};
use parquet::file::metadata::{ColumnChunkMetaData, KeyValue, ParquetMetaData, ParquetMetaDataReader};
use parquet::file::properties::{ReaderProperties, WriterProperties};
use parquet::file::reader::{ChunkReader, Length, RowGroupReader};
use parquet::file::serialized_reader::SerializedRowGroupReader;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::{ColumnPath, SchemaDescriptor, Type, TypePtr};

use super::error::{PushdownError, guarded};
use super::shard::MAX_SAMPLES;
use super::spec::{Dtype, RowGroups};

/// Parquet's magic, at the start and at the end of every file.
const MAGIC: &[u8; 4] = b"PAR1";

/// Largest footer read. The footers of datasets' files are kilobytes to tens of kilobytes (a
/// schema, and `datasets` writes a row group per 100 image rows, each with a few column chunks);
/// the bound caps what a hostile one costs to parse.
pub const MAX_FOOTER_BYTES: usize = 256 * 1024;

/// What a ranged read of a file's footer asks for (`Range: bytes=-TAIL_BYTES`): the largest
/// footer read, its length and the magic.
pub const TAIL_BYTES: u64 = MAX_FOOTER_BYTES as u64 + 8;

/// Most elements (groups and columns) a schema may have, and how deep it may nest. The parquet
/// crate builds the schema recursively, one stack frame per level, and gives every leaf column a
/// copy of its whole path: a footer of [`MAX_FOOTER_BYTES`] nesting tens of thousands of levels
/// overflows a thread's stack (the whole gateway aborts), and one with thousands of leaves under
/// thousands of levels asks for gigabytes of paths. Datasets' schemas have a few columns, a few
/// levels deep (an image struct, a list of captions).
const MAX_SCHEMA_ELEMENTS: usize = 10_000;
const MAX_NESTING: usize = 64;

/// Rows decoded per read: a read that takes the decoded bytes past what the footer claimed is
/// refused before the next one.
const ROWS_PER_BATCH: usize = 256;

/// What decoding may take beyond the footer's uncompressed sizes: every value is held as its own
/// handle beside its bytes ([`VALUE_OVERHEAD`]). Rows that take more than `DECODE_FACTOR x` the
/// claim `+ DECODE_SLACK` are refused (the footer understated its pages); this is also what the
/// governor holds for them.
const DECODE_FACTOR: u64 = 2;
const DECODE_SLACK: u64 = 1024 * 1024;

/// What a decoded value is charged beside its bytes: its handle (a `ByteArray`, a slice of its
/// page's buffer) and its place in the rows.
const VALUE_OVERHEAD: u64 = 16;

/// The image column when the request names none (Hugging Face's `Image` feature's usual name).
pub const DEFAULT_COLUMN: &str = "image";

/// What a panic of the parquet crate is answered with (a `400`, [`guarded`]). The crate panics on
/// some damaged files instead of returning an error: AFL found asserts in its column-chunk
/// metadata, its byte-array and level decoders and Arrow's bit utilities within seconds
/// (`fuzz/regressions/parquet/`).
const UNREADABLE: &str = "not a readable Parquet file";

/// The labels, when the file has an integer column of this name.
const LABEL_COLUMN: &str = "label";

/// The rows' keys, when the file has a string or integer column of this name and a row's input
/// gives none (an image's `path`): text datasets name their rows so, as JSON Lines rows do
/// (`text::jsonl_rows`). Without one a row's key is its number in its file, which repeats across
/// the files of a dataset.
const KEY_COLUMN: &str = "id";

/// The column a Parquet output adds ([`write`]).
pub const FEATURES_COLUMN: &str = "features";

/// The names inside the features column (`features.list.element`, the Parquet format's LIST
/// layout).
const LIST_GROUP: &str = "list";
const LIST_ELEMENT: &str = "element";

/// Feature values written to the output's column at once (whole rows; at least one row).
const WRITE_VALUES: usize = 64 * 1024;

/// What a Parquet output's footer may take beyond its columns (a schema and a few row groups'
/// chunk descriptions, as [`MAX_FOOTER_BYTES`] bounds the source's).
const OUTPUT_FOOTER_BYTES: u64 = MAX_FOOTER_BYTES as u64;

/// Whether the object is a Parquet file (its magic at both ends).
#[must_use]
pub fn is_parquet(object: &[u8]) -> bool {
    object.len() >= 2 * MAGIC.len() + 4 && object.starts_with(MAGIC) && object.ends_with(MAGIC)
}

/// The bytes of a Parquet file that were read: the whole file, or one piece of it (its tail,
/// for the footer; the span of some row groups, for their rows) at its offset in a file of `len`
/// bytes. The parquet crate reads through it ([`ChunkReader`]); a read outside the piece is an
/// error (a footer placing its chunks elsewhere than the span read).
#[derive(Debug, Clone)]
pub struct Source {
    len: u64,
    offset: u64,
    bytes: Bytes,
}

impl Source {
    /// A whole file.
    #[must_use]
    pub fn whole(object: Bytes) -> Self {
        Self { len: object.len() as u64, offset: 0, bytes: object }
    }

    /// The piece `bytes` of a file of `len` bytes, at `offset`.
    #[must_use]
    pub fn piece(len: u64, offset: u64, bytes: Bytes) -> Self {
        Self { len, offset, bytes }
    }

    /// The piece from `start` on, if it holds `start` and `length` bytes after it.
    fn from(&self, start: u64, length: usize) -> Option<Bytes> {
        let from = usize::try_from(start.checked_sub(self.offset)?).ok()?;
        (from.checked_add(length)? <= self.bytes.len()).then(|| self.bytes.slice(from..))
    }

    fn slice(&self, start: u64, length: usize) -> Option<Bytes> {
        self.from(start, length).map(|b| b.slice(..length))
    }

    fn not_read(start: u64, length: usize) -> parquet::errors::ParquetError {
        parquet::errors::ParquetError::General(format!("bytes {start}..+{length} lie outside what was read"))
    }
}

impl Length for Source {
    fn len(&self) -> u64 {
        self.len
    }
}

impl ChunkReader for Source {
    type T = bytes::buf::Reader<Bytes>;

    fn get_read(&self, start: u64) -> parquet::errors::Result<Self::T> {
        use bytes::Buf;
        self.from(start, 0).map(Buf::reader).ok_or_else(|| Self::not_read(start, 0))
    }

    fn get_bytes(&self, start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        self.slice(start, length).ok_or_else(|| Self::not_read(start, length))
    }
}

/// What a request reads of a Parquet file ([`Footer::read`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct Reading<'a> {
    /// The input column: default [`DEFAULT_COLUMN`], or [`super::text::DEFAULT_FIELD`] for `text`.
    pub column: Option<&'a str>,
    /// The most bytes the decoded columns may claim (`pushdown.max_object_bytes`).
    pub max_decoded: u64,
    /// Every other column is decoded too, for a Parquet output ([`Kept`]).
    pub keep: bool,
    /// A text model's input: the column holds strings.
    pub text: bool,
    /// Only these row groups (default: all).
    pub row_groups: Option<RowGroups>,
}

/// One row: its key, its input (an encoded image, or a text's UTF-8), its label.
#[derive(Debug, Clone)]
pub struct Row {
    pub key: String,
    pub input: Bytes,
    pub label: Option<i64>,
}

/// What a leaf column holds, as the gateway reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaf {
    /// Byte strings (`BYTE_ARRAY` with no annotation).
    Binary,
    /// UTF-8 strings (`BYTE_ARRAY` annotated as a string, an enum or JSON).
    Text,
    /// Integers (`INT32` or `INT64`, unannotated or annotated as integers), signed or not.
    Int { signed: bool },
}

impl Leaf {
    /// The kind of a column that is neither repeated nor a group; `None` for any other.
    fn of(t: &Type) -> Option<Self> {
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
fn repeated(t: &Type) -> bool {
    let info = t.get_basic_info();
    info.has_repetition() && info.repetition() == Repetition::REPEATED
}

/// A column's type as an error message names it.
fn describe(t: &Type) -> String {
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
fn root<'a>(schema: &'a SchemaDescriptor, name: &str) -> Option<(usize, &'a TypePtr)> {
    schema.root_schema().get_fields().iter().enumerate().find(|(_, f)| f.name() == name)
}

/// The index of the leaf column at `path`.
fn leaf_at(schema: &SchemaDescriptor, path: &[&str]) -> Option<usize> {
    schema.columns().iter().position(|c| c.path().parts().iter().map(String::as_str).eq(path.iter().copied()))
}

/// Where a row's input is: the leaf column of its bytes and, for an image struct, of its `path`.
#[derive(Debug, Clone, Copy)]
struct Input {
    leaf: usize,
    path: Option<usize>,
}

impl Input {
    /// Encoded images: binary, or a struct (a plain group, not a list or a map) with a binary
    /// `bytes` field and, if any, a string `path`.
    fn image(schema: &SchemaDescriptor, name: &str, t: &Type) -> Option<Self> {
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
    fn text(schema: &SchemaDescriptor, name: &str, t: &Type) -> Option<Self> {
        Self::plain(schema, name, t, Leaf::Text)
    }

    /// A root column of `kind` itself.
    fn plain(schema: &SchemaDescriptor, name: &str, t: &Type, kind: Leaf) -> Option<Self> {
        (Leaf::of(t) == Some(kind)).then(|| leaf_at(schema, &[name])).flatten().map(|leaf| Self { leaf, path: None })
    }
}

/// A checked footer: which columns to read and what reading them costs.
#[derive(Debug)]
pub struct Footer {
    metadata: Arc<ParquetMetaData>,
    /// Root index of the input column, and where its rows' bytes and paths are.
    image: usize,
    input: Input,
    /// The label and key leaf columns, if any, and their kinds.
    label: Option<(usize, Leaf)>,
    id: Option<(usize, Leaf)>,
    /// The row groups read, in file order, and the number of each one's first row in the file.
    groups: Vec<usize>,
    firsts: Vec<usize>,
    /// Where the footer begins: every column chunk ends before it.
    data_end: u64,
    /// The input column's name.
    column: String,
    /// Whether the input is texts (strings), which must be UTF-8.
    text: bool,
    rows: usize,
    /// What each group's columns to decode take, as the footer states it.
    decoded: Vec<u64>,
    /// Whether the other columns are kept, for a Parquet output ([`Kept`]).
    keep: bool,
    /// What the kept columns' chunks take (copied as they are).
    kept_bytes: u64,
}

impl Footer {
    /// Parses and checks the footer of `object` (its last [`TAIL_BYTES`] at least): the input
    /// column ([`Reading::column`]) is binary or a struct with a binary `bytes` field (strings
    /// when `text`: a text model's input), the row groups named exist, they hold at most
    /// [`MAX_SAMPLES`] rows, and their column chunks to decode claim at most `max_decoded` bytes.
    ///
    /// # Errors
    /// `BadInput` for an unreadable footer, too many rows or too many decoded bytes;
    /// `InvalidArgument` for a missing or mistyped column or a row group the file lacks;
    /// `Unsupported` for a compression this build does not read.
    pub fn read(object: &Source, want: Reading<'_>) -> Result<Self, PushdownError> {
        let Reading { column, max_decoded, keep, text, row_groups } = want;
        let len = object.len;
        let tail = object
            .slice(len.saturating_sub(8), 8)
            .filter(|t| len >= 2 * MAGIC.len() as u64 + 4 && t.ends_with(MAGIC))
            .ok_or_else(|| PushdownError::BadInput("not a Parquet file: no PAR1 magic at its end".into()))?;
        let footer_len = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes"));
        let footer = object
            .slice(len - 8 - u64::from(footer_len).min(len - 8), footer_len as usize)
            .filter(|_| footer_len as usize <= MAX_FOOTER_BYTES && u64::from(footer_len) + 12 <= len)
            .ok_or_else(|| {
                PushdownError::BadInput(format!(
                    "the Parquet footer claims {footer_len} bytes (at most {MAX_FOOTER_BYTES}, within the file)"
                ))
            })?;
        check_schema_shape(&footer)?;
        let metadata = guarded(UNREADABLE, || {
            ParquetMetaDataReader::new().parse_and_finish(object).map_err(|e| parquet_error(&e))
        })?;

        let name = column.unwrap_or(if text { super::text::DEFAULT_FIELD } else { DEFAULT_COLUMN });
        let schema = metadata.file_metadata().schema_descr();
        let (image, field) = root(schema, name).ok_or_else(|| {
            let names: Vec<&str> = schema.root_schema().get_fields().iter().map(|f| f.name()).collect();
            PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!("the Parquet file has no column {name:?}; its columns: {}", names.join(", ")),
            }
        })?;
        let input = if text {
            Input::text(schema, name, field).ok_or_else(|| PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!("column {name:?} is {}, not texts (strings)", describe(field)),
            })?
        } else {
            Input::image(schema, name, field).ok_or_else(|| PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!(
                    "column {name:?} is {}, not encoded images (binary, or a struct with a binary `bytes` field)",
                    describe(field)
                ),
            })?
        };
        // A label or key column: a plain column beside the input, of the right kind.
        let beside = |n: &str, ok: fn(Leaf) -> bool| {
            root(schema, n)
                .filter(|(i, _)| *i != image)
                .and_then(|(_, t)| Leaf::of(t).filter(|k| ok(*k)))
                .and_then(|k| Some((leaf_at(schema, &[n])?, k)))
        };
        let label = beside(LABEL_COLUMN, |k| matches!(k, Leaf::Int { .. }));
        let id = beside(KEY_COLUMN, |k| matches!(k, Leaf::Int { .. } | Leaf::Text));
        if keep && root(schema, FEATURES_COLUMN).is_some_and(|(i, _)| i != image) {
            return Err(PushdownError::InvalidArgument {
                field: "format".into(),
                message: format!(
                    "the Parquet file has a column {FEATURES_COLUMN:?} already, which a Parquet output adds; \
                     use format=safetensors"
                ),
            });
        }

        let count = metadata.num_row_groups();
        let groups: Vec<usize> = match row_groups {
            None => (0..count).collect(),
            Some(g) if g.last < count => g.indices().collect(),
            Some(g) => {
                return Err(PushdownError::InvalidArgument {
                    field: "row-groups".into(),
                    message: format!("{g}: the Parquet file has {count} row groups, numbered from 0"),
                });
            }
        };
        let group_rows = |i: usize| usize::try_from(metadata.row_group(i).num_rows()).unwrap_or(usize::MAX);
        let first_row = (0..groups.first().copied().unwrap_or(0)).map(group_rows).fold(0, usize::saturating_add);
        let rows = groups.iter().map(|&i| group_rows(i)).fold(0, usize::saturating_add);
        // Each group's first row, in the file's numbering (rows without a key are keyed by it).
        let firsts = groups
            .iter()
            .scan(first_row, |next, &i| {
                let first = *next;
                *next = next.saturating_add(group_rows(i));
                Some(first)
            })
            .collect();
        if rows == 0 || rows > MAX_SAMPLES {
            let what = row_groups.map_or_else(|| "file has".to_owned(), |g| format!("file's row groups {g} hold"));
            return Err(PushdownError::BadInput(format!(
                "the Parquet {what} {rows} rows; a pushdown reads 1 to {MAX_SAMPLES} (name fewer row groups: row-groups)"
            )));
        }
        // What decoding the input columns takes: their chunks' uncompressed bytes as the footer
        // states them, and a handle per value beside them. The other columns are copied encoded.
        let decoded_leaves: Vec<usize> =
            [Some(input.leaf), input.path, label.map(|l| l.0), id.map(|l| l.0)].into_iter().flatten().collect();
        let mut kept_bytes = 0u64;
        let mut decoded = Vec::with_capacity(groups.len());
        for group in groups.iter().map(|&i| metadata.row_group(i)) {
            let mut claim = VALUE_OVERHEAD.saturating_mul(u64::try_from(group.num_rows()).unwrap_or(0));
            for (leaf, chunk) in group.columns().iter().enumerate() {
                if keep && schema.get_column_root_idx(leaf) != image {
                    kept_bytes = kept_bytes.saturating_add(u64::try_from(chunk.compressed_size()).unwrap_or(u64::MAX));
                }
                if !decoded_leaves.contains(&leaf) {
                    continue;
                }
                if !matches!(chunk.compression(), Compression::UNCOMPRESSED | Compression::SNAPPY) {
                    return Err(PushdownError::Unsupported(format!(
                        "column {:?} is compressed with {}; this build reads uncompressed and Snappy Parquet \
                         pages (pyarrow's and Hugging Face datasets' default)",
                        chunk.column_path().string(),
                        chunk.compression()
                    )));
                }
                claim = claim.saturating_add(u64::try_from(chunk.uncompressed_size()).unwrap_or(u64::MAX));
            }
            if claim > max_decoded {
                return Err(PushdownError::BadInput(format!(
                    "a row group's input columns decode to {claim} bytes, more than pushdown.max_object_bytes \
                     ({max_decoded})"
                )));
            }
            decoded.push(claim);
        }
        Ok(Self {
            image,
            input,
            id,
            label,
            groups,
            firsts,
            data_end: len - 8 - u64::from(footer_len),
            column: name.to_owned(),
            text,
            rows,
            decoded,
            keep,
            kept_bytes,
            metadata: Arc::new(metadata),
        })
    }

    /// The bytes `[start, end)` that hold the column chunks of the row groups read (every
    /// column's, which a Parquet output keeps): what a ranged read fetches beside the tail.
    ///
    /// # Errors
    /// `BadInput` for chunks the footer places outside the file or before its magic.
    pub fn span(&self) -> Result<(u64, u64), PushdownError> {
        let (mut start, mut end) = (u64::MAX, 0u64);
        for chunk in self.groups.iter().flat_map(|&i| self.metadata.row_group(i).columns()) {
            let (Ok(first), Ok(size)) = (u64::try_from(chunk_start(chunk)), u64::try_from(chunk.compressed_size()))
            else {
                return Err(PushdownError::BadInput(
                    "the Parquet footer places a column chunk at a negative offset".into(),
                ));
            };
            start = start.min(first);
            end = end.max(first.saturating_add(size));
        }
        if start < MAGIC.len() as u64 || start >= end || end > self.data_end {
            return Err(PushdownError::BadInput("the Parquet footer places its row groups outside the file".into()));
        }
        Ok((start, end))
    }

    /// Rows in the file.
    #[must_use]
    pub fn row_count(&self) -> usize {
        self.rows
    }

    /// Row groups read: the parts a request decodes and runs one after the other
    /// ([`Self::group_rows`]).
    #[must_use]
    pub fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// The most bytes one row group's decoded rows may take (held by the governor while a
    /// request runs; each group reuses it): the largest group's as the footer states it, with
    /// room for the values' handles ([`DECODE_FACTOR`], [`DECODE_SLACK`]).
    #[must_use]
    pub fn decoded_bytes(&self) -> u64 {
        self.decoded.iter().copied().max().unwrap_or(0).saturating_mul(DECODE_FACTOR).saturating_add(DECODE_SLACK)
    }

    /// What a Parquet output's body holds beside the features: the kept columns' chunks, as
    /// they are, and its footer.
    #[must_use]
    pub fn output_bytes(&self) -> u64 {
        if self.keep { self.kept_bytes.saturating_add(OUTPUT_FOOTER_BYTES) } else { 0 }
    }

    /// The other columns, for a Parquet output, with no row groups yet ([`Self::group_rows`]
    /// adds each group's); `None` unless the footer was read to keep them.
    #[must_use]
    pub fn kept(&self) -> Option<Kept> {
        let meta = self.metadata.file_metadata();
        let roots = meta.schema_descr().root_schema();
        self.keep.then(|| Kept {
            name: roots.name().to_owned(),
            roots: roots
                .get_fields()
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != self.image)
                .map(|(_, f)| f.clone())
                .collect(),
            metadata: meta.key_value_metadata().cloned().unwrap_or_default(),
            groups: Vec::new(),
            column: self.column.clone(),
        })
    }

    /// Every row group's rows, one group after the other ([`Self::group_rows`]), and the kept
    /// columns.
    ///
    /// # Errors
    /// As [`Self::group_rows`].
    pub fn rows(&self, object: &Source) -> Result<(Vec<Row>, Option<Kept>), PushdownError> {
        let mut kept = self.kept();
        let mut out = Vec::with_capacity(self.rows);
        for part in 0..self.group_count() {
            out.extend(self.group_rows(object, part, kept.as_mut())?);
        }
        Ok((out, kept))
    }

    /// Decodes the input columns' rows of the `part`-th row group read, and adds its other
    /// columns' chunks to `kept` (from [`Self::kept`]).
    ///
    /// # Errors
    /// `BadInput` for a damaged page, a null input, a text or key that is not UTF-8, or pages
    /// that decode to more bytes or rows than the footer states.
    pub fn group_rows(&self, object: &Source, part: usize, kept: Option<&mut Kept>) -> Result<Vec<Row>, PushdownError> {
        guarded(UNREADABLE, || self.decode(object, part, kept))
    }

    fn decode(&self, object: &Source, part: usize, kept: Option<&mut Kept>) -> Result<Vec<Row>, PushdownError> {
        let (Some(&group), Some(&claimed), Some(&first_row)) =
            (self.groups.get(part), self.decoded.get(part), self.firsts.get(part))
        else {
            return Err(PushdownError::Internal(format!("no row group {part} was read")));
        };
        let meta = self.metadata.row_group(group);
        let expected = usize::try_from(meta.num_rows()).unwrap_or(0);
        let reader = SerializedRowGroupReader::new(
            Arc::new(object.clone()),
            meta,
            self.metadata.page_index_for_row_group(group),
            Arc::new(ReaderProperties::builder().build()),
        )
        .map_err(|e| parquet_error(&e))?;
        let limit = claimed.saturating_mul(DECODE_FACTOR).saturating_add(DECODE_SLACK);
        let mut column = Columns {
            reader: &reader,
            source: object,
            schema: self.metadata.file_metadata().schema_descr(),
            expected,
            decoded: Arc::new(AtomicU64::new(0)),
            limit,
            group,
            claimed,
        };
        let inputs = column.bytes(self.input.leaf)?;
        let paths = self.input.path.map(|leaf| column.strings(leaf)).transpose()?;
        let labels = self.label.map(|(leaf, kind)| column.integers(leaf, kind, LABEL_COLUMN)).transpose()?;
        let ids = match self.id {
            Some((leaf, Leaf::Text)) => Some(column.strings(leaf)?),
            Some((leaf, kind)) => {
                Some(column.integers(leaf, kind, KEY_COLUMN)?.into_iter().map(|v| v.map(|n| n.to_string())).collect())
            }
            None => None,
        };
        let mut out = Vec::with_capacity(expected);
        for (i, input) in inputs.into_iter().enumerate() {
            let n = first_row + i;
            let path = paths.as_ref().and_then(|p| p[i].clone());
            let key = path.or_else(|| ids.as_ref().and_then(|k| k[i].clone())).unwrap_or_else(|| n.to_string());
            let input = input.ok_or_else(|| PushdownError::BadInput(format!("row {n} ({key:?}) has no input")))?;
            if self.text && std::str::from_utf8(&input).is_err() {
                return Err(PushdownError::BadInput(format!("row {n} ({key:?}): its text is not UTF-8")));
            }
            out.push(Row { key, input, label: labels.as_ref().and_then(|l| l[i]) });
        }
        if let Some(kept) = kept {
            let schema = self.metadata.file_metadata().schema_descr();
            let chunks: Vec<ColumnChunkMetaData> = meta
                .columns()
                .iter()
                .enumerate()
                .filter(|(leaf, _)| schema.get_column_root_idx(*leaf) != self.image)
                .map(|(_, c)| c.clone())
                .collect();
            self.check_kept(object, &chunks)?;
            kept.groups.push(KeptGroup { source: object.clone(), rows: expected, chunks });
        }
        Ok(out)
    }
}

impl Footer {
    /// Checks the chunks a Parquet output copies as they are: each lies within the bytes read
    /// and before the footer, its pages within it, its sizes not negative, and their sum within
    /// what the writer counts in (so a footer that lies is a `400` before the output is written,
    /// not a wrapped offset in it).
    fn check_kept(&self, object: &Source, chunks: &[ColumnChunkMetaData]) -> Result<(), PushdownError> {
        let mut total = 0i64;
        for chunk in chunks {
            let data = chunk.data_page_offset();
            let start = chunk_start(chunk);
            let (size, raw) = (chunk.compressed_size(), chunk.uncompressed_size());
            let end = start.checked_add(size);
            let fits = |at: i64, n: i64| {
                u64::try_from(at).ok().zip(usize::try_from(n).ok()).is_some_and(|(at, n)| object.slice(at, n).is_some())
            };
            let within = start >= MAGIC.len() as i64
                && raw >= 0
                && end.is_some_and(|end| {
                    data >= start && data < end && u64::try_from(end).is_ok_and(|e| e <= self.data_end)
                })
                && fits(start, size);
            total = total.saturating_add(raw);
            if !within || total > i64::MAX / 2 {
                return Err(PushdownError::BadInput(format!(
                    "the Parquet footer places column {:?} outside the file, or states sizes it cannot have",
                    chunk.column_path().string()
                )));
            }
        }
        Ok(())
    }
}

/// The leaf columns of one row group, each decoded whole, every read's bytes charged against
/// what the footer claimed.
struct Columns<'a> {
    reader: &'a dyn RowGroupReader,
    /// The bytes read, which hold the group's chunks (their pages are checked before they are
    /// decoded: [`check_pages`]).
    source: &'a Source,
    schema: &'a SchemaDescriptor,
    /// The group's rows, as the footer states them: every column must hold as many.
    expected: usize,
    /// Bytes decoded so far, shared with the columns' page readers ([`CheckedPages`]).
    decoded: Arc<AtomicU64>,
    limit: u64,
    group: usize,
    claimed: u64,
}

impl Columns<'_> {
    /// Every value of a column (`None` for a null), [`ROWS_PER_BATCH`] rows at a time, each
    /// value turned by `map` as it is read (so a read's page buffers are let go before the next).
    fn read<T: DataType, U>(
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
    fn column(&self, leaf: usize) -> Result<ColumnReader, PushdownError> {
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
    fn bytes(&mut self, leaf: usize) -> Result<Vec<Option<Bytes>>, PushdownError> {
        match self.column(leaf)? {
            ColumnReader::ByteArrayColumnReader(r) => {
                self.read(leaf, r, |v: &ByteArray| v.len() as u64, |v| Ok(Bytes::copy_from_slice(v.data())))
            }
            _ => Err(PushdownError::BadInput("the input column is not byte strings".into())),
        }
    }

    /// A string column's values; a value that is not UTF-8 is refused.
    fn strings(&mut self, leaf: usize) -> Result<Vec<Option<String>>, PushdownError> {
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
    fn integers(&mut self, leaf: usize, kind: Leaf, what: &str) -> Result<Vec<Option<i64>>, PushdownError> {
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
struct CheckedPages {
    inner: Box<dyn PageReader>,
    min_bytes: usize,
    handle: u64,
    decoded: Arc<AtomicU64>,
    limit: u64,
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

/// One row group's columns but the input one, encoded as the source holds them.
#[derive(Debug)]
struct KeptGroup {
    /// The bytes read that hold the chunks.
    source: Source,
    rows: usize,
    chunks: Vec<ColumnChunkMetaData>,
}

/// A Parquet source's columns but the input one, as encoded chunks, in its row groups: what a
/// Parquet output ([`write`]) keeps.
#[derive(Debug)]
pub struct Kept {
    /// The schema's root name and its columns but the input one, as the source describes them.
    name: String,
    roots: Vec<TypePtr>,
    /// The source's key-value metadata.
    metadata: Vec<KeyValue>,
    groups: Vec<KeptGroup>,
    /// The input column, which the output leaves out.
    column: String,
}

/// What the output's `tensorgate` metadata entry says of its features.
#[derive(Debug, serde::Serialize)]
pub struct Provenance<'a> {
    pub model: &'a str,
    pub split: &'a str,
    /// One row's feature shape (the column holds it flattened, row-major).
    pub shape: &'a [usize],
    pub dtype: &'a str,
    /// The input column.
    pub column: &'a str,
}

/// A Parquet output: `kept`'s columns, copied as they are encoded, then the features (`rows x
/// per-row values`, row-major) as a list column [`FEATURES_COLUMN`] of `f32` or `f16` (each row's
/// list as long as the per-row values), in the source's row groups, Snappy pages. The file's
/// key-value metadata is kept, without the source's Arrow schema (the columns changed), with
/// Hugging Face `datasets`' feature description updated (the input column gone, the features
/// added as a sequence of that length) and a `tensorgate` entry naming the model, the split and
/// the feature shape.
///
/// # Errors
/// `Internal` if the row counts disagree (a bug) or a kept chunk lies outside the bytes read;
/// `InvalidArgument` for `bf16`.
pub fn write(
    kept: &Kept,
    features: &[f32],
    shape: &[usize],
    dtype: Dtype,
    model: (&str, &str),
) -> Result<Vec<u8>, PushdownError> {
    let internal = |e: &dyn std::fmt::Display| PushdownError::Internal(format!("writing the Parquet output: {e}"));
    let rows = shape.first().copied().unwrap_or(0);
    let per = shape[1..].iter().product::<usize>();
    let element = match dtype {
        Dtype::F32 => Type::primitive_type_builder(LIST_ELEMENT, Physical::FLOAT),
        Dtype::F16 => Type::primitive_type_builder(LIST_ELEMENT, Physical::FIXED_LEN_BYTE_ARRAY)
            .with_length(2)
            .with_logical_type(Some(LogicalType::Float16)),
        Dtype::Bf16 => {
            return Err(PushdownError::InvalidArgument {
                field: "dtype".into(),
                message: "bf16 has no Parquet encoding: use format=safetensors".into(),
            });
        }
    };
    if per == 0
        || features.len() != rows.saturating_mul(per)
        || kept.groups.iter().map(|g| g.rows).sum::<usize>() != rows
    {
        return Err(internal(&format!("{} feature values for {rows} rows of {per}", features.len())));
    }
    let element = element.with_repetition(Repetition::REQUIRED).build().map_err(|e| internal(&e))?;
    let list = Type::group_type_builder(LIST_GROUP)
        .with_repetition(Repetition::REPEATED)
        .with_fields(vec![Arc::new(element)])
        .build()
        .map_err(|e| internal(&e))?;
    let column = Type::group_type_builder(FEATURES_COLUMN)
        .with_repetition(Repetition::REQUIRED)
        .with_logical_type(Some(LogicalType::List))
        .with_fields(vec![Arc::new(list)])
        .build()
        .map_err(|e| internal(&e))?;
    let mut fields = kept.roots.clone();
    fields.push(Arc::new(column));
    let schema = Type::group_type_builder(&kept.name).with_fields(fields).build().map_err(|e| internal(&e))?;

    let provenance =
        Provenance { model: model.0, split: model.1, shape: &shape[1..], dtype: dtype.name(), column: &kept.column };
    let mut metadata: Vec<KeyValue> =
        kept.metadata.iter().filter(|kv| !matches!(kv.key.as_str(), "ARROW:schema" | "tensorgate")).cloned().collect();
    if let Some(at) = metadata.iter().position(|kv| kv.key == HF_METADATA) {
        match metadata[at].value.as_deref().and_then(|hf| hf_features(hf, &kept.column, item_name(dtype))) {
            Some(updated) => metadata[at].value = Some(updated),
            None => {
                metadata.remove(at);
            }
        }
    }
    metadata.push(KeyValue::new("tensorgate".to_owned(), serde_json::to_string(&provenance).expect("serializable")));
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(metadata))
        // Feature values rarely repeat: a dictionary would be tried, then written beside the
        // plain pages it falls back to.
        .set_column_dictionary_enabled(
            ColumnPath::new(vec![FEATURES_COLUMN.into(), LIST_GROUP.into(), LIST_ELEMENT.into()]),
            false,
        )
        .set_compression(Compression::SNAPPY)
        .build();
    let mut writer =
        SerializedFileWriter::new(Vec::new(), Arc::new(schema), Arc::new(props)).map_err(|e| internal(&e))?;
    // The levels of a write's rows: every value present; a row's first value starts its list,
    // the others continue it.
    let rows_per_write = (WRITE_VALUES / per).max(1);
    let defs = vec![1i16; rows_per_write * per];
    let reps: Vec<i16> = (0..rows_per_write * per).map(|i| i16::from(i % per > 0)).collect();
    let mut done = 0usize;
    for group in kept.groups.iter().filter(|g| g.rows > 0) {
        let mut rg = writer.next_row_group().map_err(|e| internal(&e))?;
        for chunk in &group.chunks {
            let close = ColumnCloseResult {
                bytes_written: u64::try_from(chunk.compressed_size()).unwrap_or(0),
                rows_written: group.rows as u64,
                metadata: chunk.clone(),
                bloom_filter: None,
                column_index: None,
                offset_index: None,
            };
            rg.append_column(&group.source, close).map_err(|e| internal(&e))?;
        }
        let mut col = rg.next_column().map_err(|e| internal(&e))?.ok_or_else(|| internal(&"no features column"))?;
        // A slice of whole rows at a time: the levels (and, for f16, a handle per value) beside
        // the features stay bounded, whatever the group's size.
        let mut row = done;
        while row < done + group.rows {
            let n = rows_per_write.min(done + group.rows - row);
            let (from, to) = (row * per, (row + n) * per);
            let (defs, reps) = (&defs[..to - from], &reps[..to - from]);
            let written = if dtype == Dtype::F16 {
                let buf = Bytes::from(
                    features[from..to].iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect::<Vec<u8>>(),
                );
                let halves: Vec<FixedLenByteArray> = (0..to - from)
                    .map(|i| FixedLenByteArray::from(ByteArray::from(buf.slice(2 * i..2 * i + 2))))
                    .collect();
                col.typed::<FixedLenByteArrayType>().write_batch(&halves, Some(defs), Some(reps))
            } else {
                col.typed::<FloatType>().write_batch(&features[from..to], Some(defs), Some(reps))
            };
            written.map_err(|e| internal(&e))?;
            row += n;
        }
        col.close().map_err(|e| internal(&e))?;
        rg.close().map_err(|e| internal(&e))?;
        done += group.rows;
    }
    writer.into_inner().map_err(|e| internal(&e))
}

/// Hugging Face `datasets`' entry in a Parquet file's key-value metadata: `{"info": {"features":
/// {column: feature}}}`, which `datasets` reads the columns' types from.
const HF_METADATA: &str = "huggingface";

/// `datasets`' value type of the features.
fn item_name(dtype: Dtype) -> &'static str {
    if dtype == Dtype::F16 { "float16" } else { "float32" }
}

/// `datasets`' feature description with the input column gone and the features added as a
/// sequence of `item` values (the `Sequence` spelling, which `datasets` reads from 2.x to 5.x;
/// without a length, as the column's Parquet type has none: `datasets` takes a description only
/// where its Arrow type is the column's); `None` when the entry is not in that shape (then it is
/// left out, and `datasets` reads the columns' types from the Parquet schema).
fn hf_features(entry: &str, input: &str, item: &str) -> Option<String> {
    let mut doc: serde_json::Value = serde_json::from_str(entry).ok()?;
    let features = doc.get_mut("info")?.get_mut("features")?.as_object_mut()?;
    features.remove(input);
    features.insert(
        FEATURES_COLUMN.to_owned(),
        serde_json::json!({"feature": {"dtype": item, "_type": "Value"}, "_type": "Sequence"}),
    );
    serde_json::to_string(&doc).ok()
}

/// Reads the footer's schema (Thrift compact protocol, the `thrift` crate) as a flat list of
/// elements with their child counts, before the parquet crate builds a tree of it, and refuses
/// one with more than [`MAX_SCHEMA_ELEMENTS`] elements or nested deeper than [`MAX_NESTING`].
/// What else the footer holds is left to the parquet crate, which checks it.
fn check_schema_shape(footer: &[u8]) -> Result<(), PushdownError> {
    use thrift::protocol::{TCompactInputProtocol, TInputProtocol, TType};
    let bad = |what: String| PushdownError::BadInput(format!("the Parquet footer's schema {what}"));
    let unreadable = |e: thrift::Error| bad(format!("cannot be read: {e}"));
    let mut p = TCompactInputProtocol::new(footer);
    p.read_struct_begin().map_err(unreadable)?;
    loop {
        let field = p.read_field_begin().map_err(unreadable)?;
        match (field.field_type, field.id) {
            // No schema: the parquet crate refuses the footer.
            (TType::Stop, _) => return Ok(()),
            // FileMetaData field 2: list<SchemaElement>.
            (TType::List, Some(2)) => break,
            (t, _) => p.skip(t).map_err(unreadable)?,
        }
    }
    let list = p.read_list_begin().map_err(unreadable)?;
    let n = usize::try_from(list.size).map_err(|_| bad("has a negative length".into()))?;
    if list.element_type != TType::Struct || n > MAX_SCHEMA_ELEMENTS {
        return Err(bad(format!("has {n} elements; at most {MAX_SCHEMA_ELEMENTS}")));
    }
    // The children each open group still expects, outermost first: its length is the depth.
    let mut open: Vec<i64> = Vec::new();
    for i in 0..n {
        // SchemaElement field 5: num_children (absent or 0 for a column).
        let mut children = 0i64;
        p.read_struct_begin().map_err(unreadable)?;
        loop {
            let field = p.read_field_begin().map_err(unreadable)?;
            match (field.field_type, field.id) {
                (TType::Stop, _) => break,
                (TType::I32, Some(5)) => children = i64::from(p.read_i32().map_err(unreadable)?),
                (t, _) => p.skip(t).map_err(unreadable)?,
            }
        }
        p.read_struct_end().map_err(unreadable)?;
        if i > 0 {
            match open.last_mut() {
                Some(left) => *left -= 1,
                None => return Err(bad("has elements outside its root".into())),
            }
        }
        if children < 0 {
            return Err(bad("has a negative child count".into()));
        }
        if children > 0 {
            open.push(children);
            if open.len() > MAX_NESTING + 1 {
                return Err(bad(format!("nests deeper than {MAX_NESTING} levels")));
            }
        }
        while open.last() == Some(&0) {
            open.pop();
        }
    }
    Ok(())
}

/// Where a column chunk's bytes begin, as its footer places them: its dictionary page, else its
/// first data page. Unchecked (a hostile footer may place it anywhere, negative included).
fn chunk_start(chunk: &ColumnChunkMetaData) -> i64 {
    chunk.dictionary_page_offset().unwrap_or_else(|| chunk.data_page_offset())
}

/// Encodings whose decoder in the parquet crate sizes a buffer by a count inside the page data
/// (`DELTA_LENGTH_BYTE_ARRAY`: the lengths' `total value count`; `DELTA_BYTE_ARRAY`: the
/// prefix lengths' count), before any value is read: a page of a few bytes could ask for more
/// memory than the node has, and an allocation failure aborts the process. Nothing checks that
/// count first, so pages in them are refused (`415`). pyarrow and Hugging Face datasets write
/// images and texts PLAIN or dictionary encoded unless told otherwise.
const UNCHECKED_ENCODINGS: [(i32, &str); 2] = [(6, "DELTA_LENGTH_BYTE_ARRAY"), (7, "DELTA_BYTE_ARRAY")];

/// Walks the page headers of a column chunk (`chunk`: its bytes, as the footer places them)
/// before the parquet crate reads them, and refuses a chunk it could not read within `limit`
/// bytes: the crate allocates a page's `uncompressed_page_size` (up to 2 GiB, zero-filled for
/// Snappy) before decompressing it, so a page header of a few bytes could claim more than the
/// whole row group was reserved for. Every page's uncompressed size, and their sum, must be
/// within `limit` (what decoding the group may take); each page must lie within the chunk; no
/// data page may use an [`UNCHECKED_ENCODINGS`] encoding. Only the headers' leading fields are
/// read (Thrift compact protocol, the `thrift` crate; statistics are skipped, not copied).
fn check_pages(chunk: &[u8], limit: u64) -> Result<(), PushdownError> {
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
fn i32_field(p: &mut impl thrift::protocol::TInputProtocol, id: i16) -> thrift::Result<Option<i32>> {
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

/// A Parquet reader's error: what the reader does not implement is unsupported (`415`), the rest
/// is a damaged or hostile file (`400`).
fn parquet_error(e: &parquet::errors::ParquetError) -> PushdownError {
    if matches!(e, parquet::errors::ParquetError::NYI(_)) {
        PushdownError::Unsupported(format!("Parquet: {e}"))
    } else {
        PushdownError::BadInput(format!("{UNREADABLE}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::cast::AsArray;
    use arrow_array::{Array, ArrayRef, BinaryArray, Int64Array, RecordBatch, StringArray, StructArray};
    use arrow_schema::{DataType, Field, Fields};
    use parquet::arrow::ArrowWriter;
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

    fn string_at(array: &dyn Array, i: usize) -> Option<String> {
        (!array.is_null(i)).then(|| array.as_string::<i32>().value(i).to_owned())
    }

    use crate::pushdown::spec::RowGroups;

    fn read(object: &Bytes, column: Option<&str>, max_decoded: u64, keep: bool) -> Result<Footer, PushdownError> {
        Footer::read(&Source::whole(object.clone()), Reading { column, max_decoded, keep, ..Reading::default() })
    }

    /// A file of `columns`, `per_group` rows to a row group, Snappy pages.
    fn file(columns: Vec<(&str, ArrayRef)>, per_group: usize) -> Bytes {
        let batch = RecordBatch::try_from_iter(columns).expect("batch");
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(per_group))
            .set_compression(Compression::SNAPPY)
            .build();
        let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).expect("writer");
        w.write(&batch).expect("write");
        Bytes::from(w.into_inner().expect("close"))
    }

    fn images(paths: &[Option<&str>], data: &[&[u8]]) -> ArrayRef {
        let fields =
            Fields::from(vec![Field::new("bytes", DataType::Binary, true), Field::new("path", DataType::Utf8, true)]);
        let bytes: ArrayRef = Arc::new(BinaryArray::from(data.to_vec()));
        let paths: ArrayRef = Arc::new(StringArray::from(paths.to_vec()));
        Arc::new(StructArray::new(fields, vec![bytes, paths], None))
    }

    #[test]
    fn rows_carry_their_image_key_and_label_in_file_order_whatever_the_column_order() {
        let object = file(
            vec![
                ("label", Arc::new(Int64Array::from(vec![3, 1, 4])) as ArrayRef),
                ("image", images(&[Some("a.jpg"), None, Some("c.png")], &[b"A", b"BB", b"CCC"])),
            ],
            2,
        );
        assert!(is_parquet(&object));
        let footer = read(&object, None, 1 << 20, false).expect("footer");
        assert_eq!(footer.row_count(), 3);
        assert!(footer.decoded_bytes() > 0);
        let (rows, _) = footer.rows(&Source::whole(object)).expect("rows");
        let got: Vec<(&str, &[u8], Option<i64>)> =
            rows.iter().map(|r| (r.key.as_str(), &r.input[..], r.label)).collect();
        assert_eq!(got, [("a.jpg", &b"A"[..], Some(3)), ("1", &b"BB"[..], Some(1)), ("c.png", &b"CCC"[..], Some(4))]);
    }

    #[test]
    fn a_parquet_output_keeps_the_other_columns_and_row_groups_and_adds_the_features() {
        let hf = r#"{"info": {"features": {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": ["a"]}, "caption": {"dtype": "string", "_type": "Value"}}}}"#;
        let captions: ArrayRef =
            Arc::new(StringArray::from(vec![Some("one"), None, Some("three"), Some("four"), Some("five")]));
        let batch = RecordBatch::try_from_iter(vec![
            ("caption", captions.clone()),
            (
                "image",
                images(&[Some("a"), Some("b"), Some("c"), Some("d"), Some("e")], &[b"A", b"B", b"C", b"D", b"E"]),
            ),
            ("label", Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4])) as ArrayRef),
        ])
        .expect("batch");
        // As pyarrow writes `datasets`' entry: a key-value entry of the file (and, here, an
        // uncompressed caption beside Snappy columns: the kept chunks are copied as they are).
        let props = WriterProperties::builder()
            .set_max_row_group_row_count(Some(2))
            .set_key_value_metadata(Some(vec![KeyValue::new("huggingface".to_owned(), hf.to_owned())]))
            .set_column_compression(ColumnPath::from("caption"), Compression::UNCOMPRESSED)
            .build();
        let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props)).expect("writer");
        w.write(&batch).expect("write");
        let object = Bytes::from(w.into_inner().expect("close"));

        let footer = read(&object, None, 1 << 20, true).expect("footer");
        assert!(footer.output_bytes() > OUTPUT_FOOTER_BYTES);
        let (rows, kept) = footer.rows(&Source::whole(object)).expect("rows");
        assert_eq!(rows.len(), 5);
        let features: Vec<f32> = (0..10).map(|v| v as f32 / 4.0).collect();
        let out = write(&kept.expect("kept"), &features, &[5, 2, 1], Dtype::F16, ("m", "pool")).expect("write");

        let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(out)).expect("output");
        let groups: Vec<i64> = reader.metadata().row_groups().iter().map(|g| g.num_rows()).collect();
        assert_eq!(groups, [2, 2, 1]);
        let meta = reader.schema().metadata().clone();
        let names: Vec<String> = reader.schema().fields().iter().map(|f| f.name().clone()).collect();
        assert_eq!(names, ["caption", "label", "features"]);
        let (mut texts, mut values) = (Vec::new(), Vec::new());
        for batch in reader.build().expect("reader") {
            let batch = batch.expect("batch");
            texts.extend((0..batch.num_rows()).map(|i| string_at(batch.column(0).as_ref(), i)));
            // A list per row, as long as a row's features.
            let list = batch.column(2).as_list::<i32>();
            assert!(list.value_offsets().windows(2).all(|w| w[1] - w[0] == 2));
            let half = list.values().as_primitive::<arrow_array::types::Float16Type>();
            values.extend(half.values().iter().map(|v| v.to_f32()));
        }
        let expected: Vec<Option<String>> = (0..5).map(|i| string_at(captions.as_ref(), i)).collect();
        assert_eq!(texts, expected);
        assert_eq!(values, features);
        let hf: serde_json::Value = serde_json::from_str(&meta["huggingface"]).expect("json");
        let described: Vec<&String> = hf["info"]["features"].as_object().expect("features").keys().collect();
        assert_eq!(described, ["caption", "features", "label"]);
        assert_eq!(hf["info"]["features"]["features"]["feature"]["dtype"], "float16");
        let provenance: serde_json::Value = serde_json::from_str(&meta["tensorgate"]).expect("json");
        assert_eq!(provenance["shape"], serde_json::json!([2, 1]));
        assert_eq!(provenance["column"], "image");
    }

    /// A group's features are written a slice of whole rows at a time ([`WRITE_VALUES`]): rows
    /// and values come back whole and in order across the slices, in both dtypes.
    #[test]
    fn features_written_in_slices_read_back_whole() {
        let (rows, per) = (MAX_SAMPLES, 20usize);
        assert!(rows * per > 2 * WRITE_VALUES);
        let object = file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]; rows])) as ArrayRef)], rows);
        let footer = read(&object, None, 1 << 24, true).expect("footer");
        let (_, kept) = footer.rows(&Source::whole(object)).expect("rows");
        let kept = kept.expect("kept");
        // Small integers: exact in f16 too.
        let features: Vec<f32> = (0..rows * per).map(|i| (i % 1000) as f32).collect();
        for dtype in [Dtype::F32, Dtype::F16] {
            let out = write(&kept, &features, &[rows, per], dtype, ("m", "s")).expect("write");
            let reader = ParquetRecordBatchReaderBuilder::try_new(Bytes::from(out)).expect("output");
            let mut values = Vec::new();
            for batch in reader.build().expect("reader") {
                let list = batch.expect("batch").column(0).as_list::<i32>().clone();
                assert!(list.value_offsets().windows(2).all(|w| usize::try_from(w[1] - w[0]) == Ok(per)));
                let items = list.values();
                if dtype == Dtype::F16 {
                    let half = items.as_primitive::<arrow_array::types::Float16Type>();
                    values.extend(half.values().iter().map(|v| v.to_f32()));
                } else {
                    values.extend(items.as_primitive::<arrow_array::types::Float32Type>().values().iter().copied());
                }
            }
            assert!(values == features, "{dtype:?}");
        }
    }

    #[test]
    fn named_row_groups_are_read_from_the_tail_and_their_span_alone() {
        let data: Vec<&[u8]> = vec![b"A", b"BB", b"CCC", b"DDDD", b"EEEEE"];
        let object = file(
            vec![
                ("image", Arc::new(BinaryArray::from(data.clone())) as ArrayRef),
                ("label", Arc::new(Int64Array::from(vec![0, 1, 2, 3, 4])) as ArrayRef),
            ],
            2,
        );
        let len = object.len() as u64;
        let at = |from: u64, to: u64| object.slice(usize::try_from(from).unwrap()..usize::try_from(to).unwrap());
        // A tail longer than the file is the file: a small one's tail is read from its start.
        let tail_at = len.saturating_sub(TAIL_BYTES);
        let tail = Source::piece(len, tail_at, at(tail_at, len));
        let want = |first, last| Reading {
            max_decoded: 1 << 20,
            row_groups: Some(RowGroups { first, last }),
            ..Reading::default()
        };
        let footer = Footer::read(&tail, want(1, 2)).expect("footer");
        assert_eq!(footer.row_count(), 3);
        let (start, end) = footer.span().expect("span");
        assert!(start >= 4 && end <= len - 8 && start < end);
        let (rows, _) = footer.rows(&Source::piece(len, start, at(start, end))).expect("rows");
        let got: Vec<(&str, &[u8], Option<i64>)> =
            rows.iter().map(|r| (r.key.as_str(), &r.input[..], r.label)).collect();
        assert_eq!(got, [("2", data[2], Some(2)), ("3", data[3], Some(3)), ("4", data[4], Some(4))]);

        // Bytes outside what was read are an error, not a panic or other rows.
        let footer = Footer::read(&tail, want(0, 0)).expect("footer");
        let (start, end) = footer.span().expect("span");
        assert!(footer.rows(&Source::piece(len, start + 1, at(start + 1, end))).is_err());
        // A request holds one group's decoded columns at a time: a whole file's hold is its
        // largest group's, not the sum.
        let whole = read(&object, None, 1 << 20, false).expect("footer");
        let each: Vec<u64> = (0..3).map(|g| Footer::read(&tail, want(g, g)).expect("footer").decoded_bytes()).collect();
        assert_eq!(whole.decoded_bytes(), *each.iter().max().expect("groups"));
        assert_eq!(whole.group_count(), 3);
        let err = Footer::read(&tail, want(2, 3)).expect_err("refused").to_string();
        assert!(err.contains("has 3 row groups"), "{err}");
        // The footer alone is not in a piece that ends before it.
        assert!(Footer::read(&Source::piece(len, 0, at(0, len - 9)), want(0, 0)).is_err());
    }

    #[test]
    fn a_missing_or_mistyped_column_and_too_large_columns_are_refused_from_the_footer() {
        let object = file(
            vec![
                ("img", Arc::new(BinaryArray::from(vec![&b"x"[..]; 4])) as ArrayRef),
                ("n", Arc::new(Int64Array::from(vec![1, 2, 3, 4])) as ArrayRef),
            ],
            4,
        );
        let err = |column, max| read(&object, column, max, false).expect_err("refused").to_string();
        assert!(err(None, 1 << 20).contains("no column \"image\"; its columns: img, n"), "{}", err(None, 1 << 20));
        assert!(err(Some("n"), 1 << 20).contains("not encoded images"));
        assert!(err(Some("img"), 10).contains("more than pushdown.max_object_bytes"));
        let (rows, _) = read(&object, Some("img"), 1 << 20, false)
            .expect("footer")
            .rows(&Source::whole(object.clone()))
            .expect("rows");
        assert_eq!(rows.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), ["0", "1", "2", "3"]);
        assert!(rows.iter().all(|r| r.label.is_none()));

        // An `id` column keys the rows an image path does not (strings or integers).
        let ids: [ArrayRef; 2] =
            [Arc::new(StringArray::from(vec![Some("a"), None, Some("c")])), Arc::new(Int64Array::from(vec![7, 8, 9]))];
        for (ids, want) in ids.into_iter().zip([["p0", "1", "c"], ["p0", "8", "9"]]) {
            let object = file(vec![("image", images(&[Some("p0"), None, None], &[b"x", b"y", b"z"])), ("id", ids)], 2);
            let (rows, _) =
                read(&object, None, 1 << 20, false).expect("footer").rows(&Source::whole(object)).expect("rows");
            assert_eq!(rows.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), want);
        }
    }

    /// Columns are told apart by their Parquet types, as Arrow's mapping told them apart: an
    /// unsigned 32-bit label keeps its value, one past `i64` is refused, a date is no label, a
    /// large binary is an image and a list of binaries is not.
    #[test]
    fn columns_are_read_by_their_parquet_types() {
        use arrow_array::{Date32Array, LargeBinaryArray, ListArray, UInt32Array, UInt64Array};
        let labels = |column: ArrayRef| -> Result<Vec<Option<i64>>, PushdownError> {
            let object = file(
                vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]; 2])) as ArrayRef), ("label", column)],
                2,
            );
            let (rows, _) = read(&object, None, 1 << 20, false)?.rows(&Source::whole(object))?;
            Ok(rows.iter().map(|r| r.label).collect())
        };
        let big = u32::MAX - 1;
        assert_eq!(labels(Arc::new(UInt32Array::from(vec![big, 7]))).expect("rows"), [Some(i64::from(big)), Some(7)]);
        let err = labels(Arc::new(UInt64Array::from(vec![u64::MAX, 1]))).expect_err("refused").to_string();
        assert!(err.contains("does not fit in 64 bits"), "{err}");
        assert_eq!(labels(Arc::new(Date32Array::from(vec![1, 2]))).expect("rows"), [None, None]);

        let large = file(vec![("image", Arc::new(LargeBinaryArray::from(vec![&b"ab"[..], b"c"])) as ArrayRef)], 2);
        let (rows, _) = read(&large, None, 1 << 20, false).expect("footer").rows(&Source::whole(large)).expect("rows");
        assert_eq!(rows.iter().map(|r| &r.input[..]).collect::<Vec<_>>(), [&b"ab"[..], b"c"]);
        let lists = ListArray::from_iter_primitive::<arrow_array::types::Int32Type, _, _>(vec![Some(vec![Some(1)])]);
        let listed = file(vec![("image", Arc::new(lists) as ArrayRef)], 1);
        let err = read(&listed, None, 1 << 20, false).expect_err("refused").to_string();
        assert!(err.contains("not encoded images"), "{err}");
    }

    /// A dictionary page that states more values than its bytes can hold is refused before the
    /// crate sizes the dictionary by it (2^31 handles: 64 GiB, an abort); an honest one passes,
    /// its handles charged against the footer's claim.
    #[test]
    fn dictionary_pages_are_checked_before_they_are_decoded() {
        struct Pages(Vec<Page>);
        impl Iterator for Pages {
            type Item = parquet::errors::Result<Page>;
            fn next(&mut self) -> Option<Self::Item> {
                self.get_next_page().transpose()
            }
        }
        impl PageReader for Pages {
            fn get_next_page(&mut self) -> parquet::errors::Result<Option<Page>> {
                Ok((!self.0.is_empty()).then(|| self.0.remove(0)))
            }
            fn peek_next_page(&mut self) -> parquet::errors::Result<Option<PageMetadata>> {
                Ok(None)
            }
            fn skip_next_page(&mut self) -> parquet::errors::Result<()> {
                Ok(())
            }
        }
        let dictionary = |num_values| Page::DictionaryPage {
            buf: Bytes::from_static(b"\x01\0\0\0x\x01\0\0\0y"),
            num_values,
            encoding: parquet::basic::Encoding::PLAIN,
            is_sorted: false,
        };
        let pages = |page, limit| CheckedPages {
            inner: Box::new(Pages(vec![page])),
            min_bytes: 4,
            handle: 32,
            decoded: Arc::new(AtomicU64::new(0)),
            limit,
        };
        assert!(pages(dictionary(2), 1024).get_next_page().expect("honest").is_some());
        assert!(pages(dictionary(u32::MAX >> 1), 1 << 40).get_next_page().is_err(), "more values than bytes");
        assert!(pages(dictionary(2), 63).get_next_page().is_err(), "handles past the claim");
    }

    /// The chunks a Parquet output copies must lie within the bytes read: a piece that lacks one
    /// is a `400` when its group is decoded, before any output is written.
    #[test]
    fn kept_chunks_outside_the_bytes_read_are_refused() {
        let captions: ArrayRef = Arc::new(StringArray::from(vec!["one", "two"]));
        let object = file(
            vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..], b"y"])) as ArrayRef), ("caption", captions)],
            2,
        );
        let len = object.len() as u64;
        let footer = read(&object, None, 1 << 20, true).expect("footer");
        let (start, end) = footer.span().expect("span");
        let caption = footer.metadata.row_group(0).column(1);
        let cut = u64::try_from(caption.dictionary_page_offset().unwrap_or_else(|| caption.data_page_offset()))
            .expect("offset");
        assert!(start < cut && cut < end);
        let piece = |to: u64| {
            Source::piece(len, start, object.slice(usize::try_from(start).unwrap()..usize::try_from(to).unwrap()))
        };
        let mut kept = footer.kept();
        let err = footer.group_rows(&piece(cut), 0, kept.as_mut()).expect_err("refused").to_string();
        assert!(err.contains("outside the file"), "{err}");
        assert_eq!(footer.group_rows(&piece(end), 0, kept.as_mut()).expect("rows").len(), 2);
    }

    #[test]
    fn files_the_parquet_crate_panics_on_are_refused() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions/parquet");
        let mut refused = 0;
        for entry in std::fs::read_dir(dir).expect("regressions") {
            let object = Bytes::from(std::fs::read(entry.expect("entry").path()).expect("read"));
            let outcome = read(&object, None, 1 << 24, true).and_then(|f| f.rows(&Source::whole(object.clone())));
            refused += usize::from(outcome.is_err());
        }
        assert!(refused >= 12, "{refused}");
    }

    #[test]
    fn a_footer_longer_than_its_bound_or_its_file_is_refused_before_parsing() {
        let object = file(vec![("image", Arc::new(BinaryArray::from(vec![&b"x"[..]])) as ArrayRef)], 1);
        let mut long = object[..object.len() - 8].to_vec();
        long.extend_from_slice(&u32::try_from(MAX_FOOTER_BYTES + 1).expect("fits").to_le_bytes());
        long.extend_from_slice(MAGIC);
        for bad in [Bytes::from(long), Bytes::from_static(b"PAR1\0\0\0\0\xff\xff\0\0PAR1")] {
            assert!(is_parquet(&bad));
            assert!(read(&bad, None, 1 << 20, false).expect_err("refused").to_string().contains("footer claims"));
        }
        assert!(!is_parquet(b"PAR1PAR1"));
    }

    /// A data page: its header (Thrift compact, as writers encode it), then `data`.
    fn page(uncompressed: i32, encoding: i32, data: &[u8]) -> Vec<u8> {
        use thrift::protocol::{TCompactOutputProtocol, TFieldIdentifier, TOutputProtocol, TStructIdentifier, TType};
        let mut out = Vec::new();
        {
            let mut p = TCompactOutputProtocol::new(&mut out);
            let field = |p: &mut TCompactOutputProtocol<&mut Vec<u8>>, t, id| {
                p.write_field_begin(&TFieldIdentifier::new("f", t, id)).expect("field");
            };
            let i32s = |p: &mut TCompactOutputProtocol<&mut Vec<u8>>, values: &[(i16, i32)]| {
                for &(id, v) in values {
                    field(p, TType::I32, id);
                    p.write_i32(v).expect("i32");
                    p.write_field_end().expect("end");
                }
            };
            p.write_struct_begin(&TStructIdentifier::new("PageHeader")).expect("struct");
            // type DATA_PAGE, sizes, then the data page header (values, encoding, level encodings).
            i32s(&mut p, &[(1, 0), (2, uncompressed), (3, i32::try_from(data.len()).expect("small"))]);
            field(&mut p, TType::Struct, 5);
            p.write_struct_begin(&TStructIdentifier::new("DataPageHeader")).expect("struct");
            i32s(&mut p, &[(1, 1), (2, encoding), (3, 3), (4, 3)]);
            p.write_field_stop().expect("stop");
            p.write_struct_end().expect("end");
            p.write_field_end().expect("end");
            p.write_field_stop().expect("stop");
            p.write_struct_end().expect("end");
        }
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn page_headers_are_checked_before_the_parquet_crate_reads_a_page() {
        let plain = [page(4, 0, b"abcd"), page(6, 0, b"efghij")].concat();
        check_pages(&plain, 10).expect("within the limit");
        // The sum of the pages' sizes counts, not only each page's.
        assert!(matches!(check_pages(&plain, 9), Err(PushdownError::BadInput(_))));
        // A header of a few bytes claiming 2 GiB (the crate would allocate it before decompressing).
        let bomb = page(i32::MAX, 0, b"abcd");
        let e = check_pages(&bomb, 1 << 20).expect_err("refused");
        assert!(matches!(e, PushdownError::BadInput(_)) && e.to_string().contains("2147483647"), "{e}");
        assert!(matches!(check_pages(&page(-1, 0, b""), 1 << 20), Err(PushdownError::BadInput(_))));
        // Pages running past their chunk, and headers cut short.
        let long = page(4, 0, b"abcd");
        assert!(matches!(check_pages(&long[..long.len() - 1], 1 << 20), Err(PushdownError::BadInput(_))));
        assert!(matches!(check_pages(&long[..3], 1 << 20), Err(PushdownError::BadInput(_))));
        // Encodings whose decoders size buffers by counts inside the page.
        for encoding in [6, 7] {
            let e = check_pages(&page(4, encoding, b"abcd"), 1 << 20).expect_err("refused");
            assert!(matches!(e, PushdownError::Unsupported(_)), "{e}");
        }
    }

    #[test]
    fn a_delta_encoded_input_column_is_refused_before_its_lengths_are_allocated() {
        use parquet::basic::Encoding;
        let batch = RecordBatch::try_from_iter(vec![(
            "image",
            Arc::new(BinaryArray::from(vec![&b"A"[..], b"BB", b"CCC"])) as ArrayRef,
        )])
        .expect("batch");
        let write = |encoding: Option<Encoding>| {
            let mut props = WriterProperties::builder().set_compression(Compression::SNAPPY);
            if let Some(e) = encoding {
                props = props
                    .set_column_dictionary_enabled(ColumnPath::from("image"), false)
                    .set_column_encoding(ColumnPath::from("image"), e);
            }
            let mut w = ArrowWriter::try_new(Vec::new(), batch.schema(), Some(props.build())).expect("writer");
            w.write(&batch).expect("write");
            Bytes::from(w.into_inner().expect("close"))
        };
        for (encoding, readable) in
            [(None, true), (Some(Encoding::DELTA_LENGTH_BYTE_ARRAY), false), (Some(Encoding::DELTA_BYTE_ARRAY), false)]
        {
            let object = write(encoding);
            let footer = read(&object, None, 1 << 20, false).expect("footer");
            match footer.rows(&Source::whole(object)) {
                Ok((rows, _)) => {
                    assert!(readable, "{encoding:?}");
                    assert_eq!(rows.iter().map(|r| &r.input[..]).collect::<Vec<_>>(), [&b"A"[..], b"BB", b"CCC"]);
                }
                Err(e) => assert!(!readable && matches!(e, PushdownError::Unsupported(_)), "{encoding:?}: {e}"),
            }
        }
    }
}
