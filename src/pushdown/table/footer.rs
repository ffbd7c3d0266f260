//! The footer of a Parquet file ([`Footer`]), read before anything is decoded, and the guards a
//! hostile file meets first: the schema's shape, the chunks' placement, the pages' claims.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use parquet::basic::Compression;
use parquet::file::metadata::{ColumnChunkMetaData, ParquetMetaData, ParquetMetaDataReader};
use parquet::file::properties::ReaderProperties;
use parquet::file::serialized_reader::SerializedRowGroupReader;

use super::super::error::{PushdownError, guarded};
use super::super::shard::MAX_SAMPLES;
use super::decode::{Columns, InputColumns, Leaf, chunk_start, describe, leaf_at, root};
use super::layout::{
    DECODE_FACTOR, DECODE_SLACK, DEFAULT_COLUMN, FEATURES_COLUMN, KEY_COLUMN, LABEL_COLUMN, MAGIC, MAX_FOOTER_BYTES,
    MAX_NESTING, MAX_SCHEMA_ELEMENTS, OUTPUT_FOOTER_BYTES, Reading, Row, UNREADABLE, VALUE_OVERHEAD, parquet_error,
};
use super::source::Source;
use super::write::{Kept, KeptGroup};

/// A checked footer: which columns to read and what reading them costs.
#[derive(Debug)]
pub struct Footer {
    pub(super) metadata: Arc<ParquetMetaData>,
    /// Root index of the input column, and where its rows' bytes and paths are.
    pub(super) image: usize,
    pub(super) input: InputColumns,
    /// The label and key leaf columns, if any, and their kinds.
    pub(super) label: Option<(usize, Leaf)>,
    pub(super) id: Option<(usize, Leaf)>,
    /// The row groups read, in file order, and the number of each one's first row in the file.
    pub(super) groups: Vec<usize>,
    pub(super) firsts: Vec<usize>,
    /// Where the footer begins: every column chunk ends before it.
    pub(super) data_end: u64,
    /// The input column's name.
    pub(super) column: String,
    /// Whether the input is texts (strings), which must be UTF-8.
    pub(super) text: bool,
    pub(super) rows: usize,
    /// What each group's columns to decode take, as the footer states it.
    pub(super) decoded: Vec<u64>,
    /// Whether the other columns are kept, for a Parquet output ([`Kept`]).
    pub(super) keep: bool,
    /// What the kept columns' chunks take (copied as they are).
    pub(super) kept_bytes: u64,
    /// Whether every row group is read (no `row-groups`): the output is the whole file's.
    pub(super) whole: bool,
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
        let Reading { column, max_decoded, keep, text, row_groups, by_group } = want;
        let (metadata, footer_len) = metadata(object)?;
        let schema = metadata.file_metadata().schema_descr();
        let name = column.unwrap_or(if text { super::super::text::DEFAULT_FIELD } else { DEFAULT_COLUMN });
        let found = Found::columns(schema, name, text, keep)?;
        let Groups { groups, firsts, rows } = Groups::select(&metadata, row_groups, by_group)?;
        let (decoded, kept_bytes) = decode_claims(&metadata, &groups, &found, keep, max_decoded)?;
        Ok(Self {
            image: found.image,
            input: found.input,
            id: found.id,
            label: found.label,
            groups,
            firsts,
            data_end: object.len - 8 - u64::from(footer_len),
            column: name.to_owned(),
            text,
            rows,
            decoded,
            keep,
            kept_bytes,
            whole: row_groups.is_none(),
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
    pub(crate) fn group_count(&self) -> usize {
        self.groups.len()
    }

    /// The most bytes one row group's decoded rows may take (held by the governor while a
    /// request runs; each group reuses it): the largest group's as the footer states it, with
    /// room for the values' handles ([`DECODE_FACTOR`], [`DECODE_SLACK`]).
    #[must_use]
    pub(crate) fn decoded_bytes(&self) -> u64 {
        self.decoded.iter().copied().max().unwrap_or(0).saturating_mul(DECODE_FACTOR).saturating_add(DECODE_SLACK)
    }

    /// What a Parquet output's body holds beside the features: the kept columns' chunks, as
    /// they are, and its footer.
    #[must_use]
    pub(crate) fn output_bytes(&self) -> u64 {
        if self.keep { self.kept_bytes.saturating_add(OUTPUT_FOOTER_BYTES) } else { 0 }
    }

    /// The other columns, for a Parquet output, with no row groups yet ([`Self::group_rows`]
    /// adds each group's); `None` unless the footer was read to keep them.
    #[must_use]
    pub(crate) fn kept(&self) -> Option<Kept> {
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
            whole: self.whole,
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
    pub(crate) fn group_rows(
        &self,
        object: &Source,
        part: usize,
        kept: Option<&mut Kept>,
    ) -> Result<Vec<Row>, PushdownError> {
        guarded(UNREADABLE, || self.decode(object, part, kept))
    }

    pub(super) fn decode(
        &self,
        object: &Source,
        part: usize,
        kept: Option<&mut Kept>,
    ) -> Result<Vec<Row>, PushdownError> {
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
            let (rows, chunks) = self.kept_chunks(part, Some(object))?;
            kept.groups.push(KeptGroup { source: object.clone(), rows, chunks });
        }
        Ok(out)
    }
}

impl Footer {
    /// The `part`-th row group read: its rows, and its chunks but the input column's, which a
    /// Parquet output copies as they are, checked ([`Self::check_kept`]) against the bytes
    /// read (`object`), or, without them (an outline), against the file.
    ///
    /// # Errors
    /// As [`Self::check_kept`].
    pub(crate) fn kept_chunks(
        &self,
        part: usize,
        object: Option<&Source>,
    ) -> Result<(usize, Vec<ColumnChunkMetaData>), PushdownError> {
        let group = *self.groups.get(part).ok_or_else(|| PushdownError::Internal(format!("no row group {part}")))?;
        let meta = self.metadata.row_group(group);
        let schema = self.metadata.file_metadata().schema_descr();
        let chunks: Vec<ColumnChunkMetaData> = meta
            .columns()
            .iter()
            .enumerate()
            .filter(|(leaf, _)| schema.get_column_root_idx(*leaf) != self.image)
            .map(|(_, c)| c.clone())
            .collect();
        self.check_kept(object, &chunks)?;
        Ok((usize::try_from(meta.num_rows()).unwrap_or(0), chunks))
    }

    /// Checks the chunks a Parquet output copies as they are: each lies within the bytes read
    /// (when given) and before the footer, its pages within it, its sizes not negative, and their sum within
    /// what the writer counts in (so a footer that lies is a `400` before the output is written,
    /// not a wrapped offset in it).
    pub(super) fn check_kept(
        &self,
        object: Option<&Source>,
        chunks: &[ColumnChunkMetaData],
    ) -> Result<(), PushdownError> {
        let mut total = 0i64;
        for chunk in chunks {
            let data = chunk.data_page_offset();
            let start = chunk_start(chunk);
            let (size, raw) = (chunk.compressed_size(), chunk.uncompressed_size());
            let end = start.checked_add(size);
            let fits = |at: i64, n: i64| {
                u64::try_from(at)
                    .ok()
                    .zip(usize::try_from(n).ok())
                    .is_some_and(|(at, n)| object.is_none_or(|o| o.slice(at, n).is_some()))
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

/// Reads the footer's schema (Thrift compact protocol, the `thrift` crate) as a flat list of
/// elements with their child counts, before the parquet crate builds a tree of it, and refuses
/// one with more than [`MAX_SCHEMA_ELEMENTS`] elements or nested deeper than [`MAX_NESTING`].
/// What else the footer holds is left to the parquet crate, which checks it.
pub(super) fn check_schema_shape(footer: &[u8]) -> Result<(), PushdownError> {
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

/// The file's metadata, its footer's length checked against the file and
/// [`MAX_FOOTER_BYTES`] and its schema's shape against [`check_schema_shape`] before the footer
/// is decoded.
fn metadata(object: &Source) -> Result<(ParquetMetaData, u32), PushdownError> {
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
    let metadata =
        guarded(UNREADABLE, || ParquetMetaDataReader::new().parse_and_finish(object).map_err(|e| parquet_error(&e)))?;
    Ok((metadata, footer_len))
}

/// The columns a pushdown reads: the input (`name`), and a label and a key column beside it.
struct Found {
    image: usize,
    input: InputColumns,
    label: Option<(usize, Leaf)>,
    id: Option<(usize, Leaf)>,
}

impl Found {
    fn columns(
        schema: &parquet::schema::types::SchemaDescriptor,
        name: &str,
        text: bool,
        keep: bool,
    ) -> Result<Self, PushdownError> {
        let (image, field) = root(schema, name).ok_or_else(|| {
            let names: Vec<&str> = schema.root_schema().get_fields().iter().map(|f| f.name()).collect();
            PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!("the Parquet file has no column {name:?}; its columns: {}", names.join(", ")),
            }
        })?;
        let input = if text {
            InputColumns::text(schema, name, field).ok_or_else(|| PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!("column {name:?} is {}, not texts (strings)", describe(field)),
            })?
        } else {
            InputColumns::image(schema, name, field).ok_or_else(|| PushdownError::InvalidArgument {
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
        Ok(Self { image, input, label, id })
    }
}

/// The row groups a pushdown reads, each group's first row in the file's numbering (rows
/// without a key are keyed by it), and their rows in all (1 to [`MAX_SAMPLES`]).
struct Groups {
    groups: Vec<usize>,
    firsts: Vec<usize>,
    rows: usize,
}

impl Groups {
    fn select(
        metadata: &ParquetMetaData,
        row_groups: Option<super::super::spec::RowGroups>,
        by_group: bool,
    ) -> Result<Self, PushdownError> {
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
        let firsts = groups
            .iter()
            .scan(first_row, |next, &i| {
                let first = *next;
                *next = next.saturating_add(group_rows(i));
                Some(first)
            })
            .collect();
        if by_group && rows > 0 {
            if let Some(i) = groups.iter().copied().find(|&i| group_rows(i) > MAX_SAMPLES) {
                return Err(PushdownError::BadInput(format!(
                    "the Parquet file's row group {i} holds {} rows; a pushdown reads 1 to {MAX_SAMPLES} at a time",
                    group_rows(i)
                )));
            }
        } else if rows == 0 || rows > MAX_SAMPLES {
            let what = row_groups.map_or_else(|| "file has".to_owned(), |g| format!("file's row groups {g} hold"));
            return Err(PushdownError::BadInput(format!(
                "the Parquet {what} {rows} rows; a pushdown reads 1 to {MAX_SAMPLES} (name fewer row groups: row-groups)"
            )));
        }
        Ok(Self { groups, firsts, rows })
    }
}

/// What decoding each group's input columns takes (their chunks' uncompressed bytes as the
/// footer states them, and a handle per value beside them; at most `max_decoded`), and the
/// encoded bytes of the other columns a Parquet output keeps.
fn decode_claims(
    metadata: &ParquetMetaData,
    groups: &[usize],
    found: &Found,
    keep: bool,
    max_decoded: u64,
) -> Result<(Vec<u64>, u64), PushdownError> {
    let schema = metadata.file_metadata().schema_descr();
    let decoded_leaves: Vec<usize> =
        [Some(found.input.leaf), found.input.path, found.label.map(|l| l.0), found.id.map(|l| l.0)]
            .into_iter()
            .flatten()
            .collect();
    let mut kept_bytes = 0u64;
    let mut decoded = Vec::with_capacity(groups.len());
    for group in groups.iter().map(|&i| metadata.row_group(i)) {
        let mut claim = VALUE_OVERHEAD.saturating_mul(u64::try_from(group.num_rows()).unwrap_or(0));
        for (leaf, chunk) in group.columns().iter().enumerate() {
            if keep && schema.get_column_root_idx(leaf) != found.image {
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
    Ok((decoded, kept_bytes))
}
