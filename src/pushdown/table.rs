//! Parquet objects as batches of samples (issue 31, ADR 0016): the rows of one image column, in
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

use std::sync::Arc;

use arrow_array::cast::AsArray;
use arrow_array::{Array, ArrayRef, FixedSizeListArray, Float16Array, Float32Array, RecordBatch};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use bytes::Bytes;
use parquet::arrow::arrow_reader::{ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder};
use parquet::arrow::{ArrowWriter, ProjectionMask};
use parquet::basic::Compression;
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{ChunkReader, Length};
use parquet::schema::types::ColumnPath;

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

/// Rows decoded per batch: a batch that decodes to more than the footer claimed is refused
/// before the next one is read.
const ROWS_PER_BATCH: usize = 256;

/// What decoding may take beyond the footer's uncompressed sizes: Arrow's buffers are rounded up
/// and grown in steps, and a row's offsets sit beside its bytes. Rows that take more than
/// `DECODE_FACTOR x` the claim `+ DECODE_SLACK` are refused (the footer understated its pages);
/// this is also what the governor holds for them.
const DECODE_FACTOR: u64 = 2;
const DECODE_SLACK: u64 = 1024 * 1024;

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

/// A checked footer: which columns to read and what reading them costs.
#[derive(Debug)]
pub struct Footer {
    metadata: ArrowReaderMetadata,
    /// Root indices of the image column and, if any, the label and key columns.
    image: usize,
    id: Option<usize>,
    /// The row groups read, in file order, and the number of each one's first row in the file.
    groups: Vec<usize>,
    firsts: Vec<usize>,
    /// Where the footer begins: every column chunk ends before it.
    data_end: u64,
    label: Option<usize>,
    /// The image column's name (a decoded batch's columns are in the file's order).
    column: String,
    rows: usize,
    /// What each group's columns to decode take, as the footer states it.
    decoded: Vec<u64>,
    /// Whether every other column is decoded too, for a Parquet output ([`Kept`]).
    keep: bool,
    /// What the kept columns take decoded, as the footer states it.
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
            ArrowReaderMetadata::load(object, ArrowReaderOptions::new()).map_err(|e| parquet_error(&e))
        })?;

        let name = column.unwrap_or(if text { super::text::DEFAULT_FIELD } else { DEFAULT_COLUMN });
        let schema = metadata.schema();
        let (image, field) = schema.column_with_name(name).ok_or_else(|| {
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!("the Parquet file has no column {name:?}; its columns: {}", names.join(", ")),
            }
        })?;
        if text && !is_text_column(field.data_type()) {
            return Err(PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!("column {name:?} is {}, not texts (strings)", field.data_type()),
            });
        }
        if !text && !is_image_column(field.data_type()) {
            return Err(PushdownError::InvalidArgument {
                field: "column".into(),
                message: format!(
                    "column {name:?} is {}, not encoded images (binary, or a struct with a binary `bytes` field)",
                    field.data_type()
                ),
            });
        }
        let label = schema
            .column_with_name(LABEL_COLUMN)
            .filter(|(i, f)| *i != image && f.data_type().is_integer())
            .map(|(i, _)| i);
        let id = schema
            .column_with_name(KEY_COLUMN)
            .filter(|(i, f)| *i != image && (f.data_type().is_integer() || is_text_column(f.data_type())))
            .map(|(i, _)| i);
        if keep && schema.column_with_name(FEATURES_COLUMN).is_some_and(|(i, _)| i != image) {
            return Err(PushdownError::InvalidArgument {
                field: "format".into(),
                message: format!(
                    "the Parquet file has a column {FEATURES_COLUMN:?} already, which a Parquet output adds; \
                     use format=safetensors"
                ),
            });
        }

        let meta = metadata.metadata();
        let count = meta.num_row_groups();
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
        let group_rows = |i: usize| usize::try_from(meta.row_group(i).num_rows()).unwrap_or(usize::MAX);
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
        // What decoding the columns takes: their chunks' uncompressed bytes as the footer states
        // them, and the offsets arrays beside them.
        let roots: Vec<&str> = if keep {
            schema.fields().iter().map(|f| f.name().as_str()).collect()
        } else {
            std::iter::once(name).chain(label.map(|_| LABEL_COLUMN)).chain(id.map(|_| KEY_COLUMN)).collect()
        };
        let mut kept_bytes = 0u64;
        let mut decoded = Vec::with_capacity(groups.len());
        for group in groups.iter().map(|&i| meta.row_group(i)) {
            let mut claim = 16 * u64::try_from(group.num_rows()).unwrap_or(0);
            for chunk in group.columns() {
                let root = chunk.column_path().parts().first().map(String::as_str);
                if root.is_some_and(|p| roots.contains(&p)) {
                    if root != Some(name) {
                        kept_bytes = kept_bytes.saturating_add(u64::try_from(chunk.uncompressed_size()).unwrap_or(0));
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
            }
            if claim > max_decoded {
                return Err(PushdownError::BadInput(format!(
                    "a row group's input columns decode to {claim} bytes, more than pushdown.max_object_bytes \
                     ({max_decoded})"
                )));
            }
            decoded.push(claim);
        }
        let kept_bytes = if keep { kept_bytes } else { 0 };
        Ok(Self {
            metadata,
            image,
            id,
            label,
            groups,
            firsts,
            data_end: len - 8 - u64::from(footer_len),
            column: name.to_owned(),
            rows,
            decoded,
            keep,
            kept_bytes,
        })
    }

    /// The bytes `[start, end)` that hold the column chunks of the row groups read (every
    /// column's, which a Parquet output keeps): what a ranged read fetches beside the tail.
    ///
    /// # Errors
    /// `BadInput` for chunks the footer places outside the file or before its magic.
    pub fn span(&self) -> Result<(u64, u64), PushdownError> {
        let meta = self.metadata.metadata();
        let (mut start, mut end) = (u64::MAX, 0u64);
        for chunk in self.groups.iter().flat_map(|&i| meta.row_group(i).columns()) {
            let first = chunk.dictionary_page_offset().unwrap_or_else(|| chunk.data_page_offset());
            let (Ok(first), Ok(size)) = (u64::try_from(first), u64::try_from(chunk.compressed_size())) else {
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
    /// room for Arrow's rounding ([`DECODE_FACTOR`], [`DECODE_SLACK`]).
    #[must_use]
    pub fn decoded_bytes(&self) -> u64 {
        self.decoded.iter().copied().max().unwrap_or(0).saturating_mul(DECODE_FACTOR).saturating_add(DECODE_SLACK)
    }

    /// What a Parquet output's body holds beside the features: the kept columns, re-encoded
    /// (at most their decoded size), and its footer.
    #[must_use]
    pub fn output_bytes(&self) -> u64 {
        if self.keep { self.kept_bytes.saturating_add(OUTPUT_FOOTER_BYTES) } else { 0 }
    }

    /// The other columns, for a Parquet output, with no rows yet ([`Self::group_rows`] adds each
    /// group's); `None` unless the footer was read to keep them.
    #[must_use]
    pub fn kept(&self) -> Option<Kept> {
        let schema = self.metadata.schema();
        self.keep.then(|| Kept {
            schema: Arc::new(schema.project(&self.kept_columns()).expect("indices within the schema")),
            batches: Vec::new(),
            group_rows: self
                .groups
                .iter()
                .map(|&i| usize::try_from(self.metadata.metadata().row_group(i).num_rows()).unwrap_or(0))
                .collect(),
            column: self.column.clone(),
        })
    }

    /// The kept columns' indices, in the file's order.
    fn kept_columns(&self) -> Vec<usize> {
        (0..self.metadata.schema().fields().len()).filter(|i| *i != self.image).collect()
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
    /// columns to `kept` (from [`Self::kept`]).
    ///
    /// # Errors
    /// `BadInput` for a damaged page, a null image, or pages that decode to more bytes or rows
    /// than the footer states.
    pub fn group_rows(&self, object: &Source, part: usize, kept: Option<&mut Kept>) -> Result<Vec<Row>, PushdownError> {
        guarded(UNREADABLE, || self.decode(object, part, kept))
    }

    fn decode(&self, object: &Source, part: usize, mut kept: Option<&mut Kept>) -> Result<Vec<Row>, PushdownError> {
        let (Some(&group), Some(&claimed), Some(&first_row)) =
            (self.groups.get(part), self.decoded.get(part), self.firsts.get(part))
        else {
            return Err(PushdownError::Internal(format!("no row group {part} was read")));
        };
        let limit = claimed.saturating_mul(DECODE_FACTOR).saturating_add(DECODE_SLACK);
        let expected = usize::try_from(self.metadata.metadata().row_group(group).num_rows()).unwrap_or(0);
        let (column, labelled, keyed) = (self.column.as_str(), self.label.is_some(), self.id.is_some());
        let mask = if self.keep {
            ProjectionMask::all()
        } else {
            ProjectionMask::roots(
                self.metadata.parquet_schema(),
                std::iter::once(self.image).chain(self.label).chain(self.id).collect::<Vec<_>>(),
            )
        };
        let kept_columns = self.kept_columns();
        let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(object.clone(), self.metadata.clone())
            .with_row_groups(vec![group])
            .with_projection(mask)
            .with_batch_size(ROWS_PER_BATCH)
            .build()
            .map_err(|e| parquet_error(&e))?;
        let mut out = Vec::with_capacity(expected);
        let mut decoded = 0u64;
        for batch in reader {
            let batch = batch.map_err(|e| PushdownError::BadInput(format!("cannot decode the Parquet file: {e}")))?;
            decoded = decoded.saturating_add(batch.get_array_memory_size() as u64);
            if decoded > limit {
                return Err(PushdownError::BadInput(format!(
                    "row group {group} of the Parquet file decodes to more than its footer states ({claimed} bytes)"
                )));
            }
            rows_of(&batch, (column, labelled, keyed), first_row + out.len(), &mut out)?;
            if let Some(kept) = kept.as_deref_mut() {
                let batch = batch
                    .project(&kept_columns)
                    .map_err(|e| PushdownError::BadInput(format!("cannot decode the Parquet file: {e}")))?;
                kept.batches.push(batch);
            }
        }
        if out.len() != expected {
            return Err(PushdownError::BadInput(format!(
                "row group {group} of the Parquet file has {} rows, its footer states {expected}",
                out.len()
            )));
        }
        Ok(out)
    }
}

/// A Parquet source's columns but the input one, decoded, with the row counts of its row groups:
/// what a Parquet output ([`write`]) keeps.
#[derive(Debug)]
pub struct Kept {
    schema: SchemaRef,
    batches: Vec<RecordBatch>,
    group_rows: Vec<usize>,
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

/// A Parquet output: `kept`'s columns, then the features (`rows x per-row values`, row-major) as
/// a fixed-size list column [`FEATURES_COLUMN`] of `f32` or `f16`, in the source's row groups,
/// Snappy pages. The file's key-value metadata is kept, with Hugging Face `datasets`' feature
/// description updated (the input column gone, the features added) and a `tensorgate` entry
/// naming the model, the split and the feature shape.
///
/// # Errors
/// `Internal` if the arrays disagree on their row counts (a bug); `InvalidArgument` for `bf16`.
pub fn write(
    kept: &Kept,
    features: Vec<f32>,
    shape: &[usize],
    dtype: Dtype,
    model: (&str, &str),
) -> Result<Vec<u8>, PushdownError> {
    let internal = |e: &dyn std::fmt::Display| PushdownError::Internal(format!("writing the Parquet output: {e}"));
    let rows = shape.first().copied().unwrap_or(0);
    let per = shape[1..].iter().product::<usize>();
    let (item, values): (DataType, ArrayRef) = match dtype {
        Dtype::F32 => (DataType::Float32, Arc::new(Float32Array::from(features))),
        Dtype::F16 => (
            DataType::Float16,
            Arc::new(Float16Array::from(features.into_iter().map(half::f16::from_f32).collect::<Vec<_>>())),
        ),
        Dtype::Bf16 => {
            return Err(PushdownError::InvalidArgument {
                field: "dtype".into(),
                message: "bf16 has no Parquet encoding: use format=safetensors".into(),
            });
        }
    };
    let item_field = Arc::new(Field::new("item", item, false));
    let size = i32::try_from(per).map_err(|e| internal(&e))?;
    let column = FixedSizeListArray::try_new(item_field.clone(), size, values, None).map_err(|e| internal(&e))?;
    if column.len() != rows || kept.group_rows.iter().sum::<usize>() != rows {
        return Err(internal(&format!("{} feature rows, {rows} expected", column.len())));
    }

    let provenance =
        Provenance { model: model.0, split: model.1, shape: &shape[1..], dtype: dtype.name(), column: &kept.column };
    let mut metadata = kept.schema.metadata().clone();
    metadata.remove("ARROW:schema");
    if let Some(updated) =
        metadata.remove(HF_METADATA).and_then(|hf| hf_features(&hf, &kept.column, (item_name(dtype), per)))
    {
        metadata.insert(HF_METADATA.to_owned(), updated);
    }
    metadata.insert("tensorgate".to_owned(), serde_json::to_string(&provenance).expect("serializable"));
    let mut fields: Vec<Arc<Field>> = kept.schema.fields().iter().cloned().collect();
    fields.push(Arc::new(Field::new(FEATURES_COLUMN, DataType::FixedSizeList(item_field, size), false)));
    let schema = Arc::new(Schema::new_with_metadata(fields, metadata));

    // As key-value entries too: pyarrow (and so `datasets`) reads a schema's metadata from those,
    // not from the Arrow schema the writer embeds.
    let entries = schema.metadata().iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())).collect();
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(entries))
        // Feature values rarely repeat: a dictionary would be tried, then written beside the
        // plain pages it falls back to.
        .set_column_dictionary_enabled(
            ColumnPath::new(vec![FEATURES_COLUMN.into(), "list".into(), "item".into()]),
            false,
        )
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(rows.max(1)))
        .build();
    let mut writer = ArrowWriter::try_new(Vec::new(), schema.clone(), Some(props)).map_err(|e| internal(&e))?;
    let mut groups = kept.group_rows.iter().copied().filter(|n| *n > 0);
    let (mut left, mut done) = (groups.next().unwrap_or(usize::MAX), 0usize);
    for batch in &kept.batches {
        let mut offset = 0;
        while offset < batch.num_rows() {
            let n = (batch.num_rows() - offset).min(left);
            let mut columns = batch.slice(offset, n).columns().to_vec();
            columns.push(Arc::new(column.slice(done, n)));
            writer
                .write(&RecordBatch::try_new(schema.clone(), columns).map_err(|e| internal(&e))?)
                .map_err(|e| internal(&e))?;
            (offset, done, left) = (offset + n, done + n, left - n);
            if left == 0 {
                writer.flush().map_err(|e| internal(&e))?;
                left = groups.next().unwrap_or(usize::MAX);
            }
        }
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
/// sequence of `len` values (the `Sequence` spelling, which `datasets` reads from 2.x to 5.x);
/// `None` when the entry is not in that shape (then it is left out, and `datasets` reads the
/// columns' types from the Arrow schema).
fn hf_features(entry: &str, input: &str, (item, len): (&str, usize)) -> Option<String> {
    let mut doc: serde_json::Value = serde_json::from_str(entry).ok()?;
    let features = doc.get_mut("info")?.get_mut("features")?.as_object_mut()?;
    features.remove(input);
    features.insert(
        FEATURES_COLUMN.to_owned(),
        serde_json::json!({"feature": {"dtype": item, "_type": "Value"}, "length": len, "_type": "Sequence"}),
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

/// Strings.
fn is_text_column(t: &DataType) -> bool {
    matches!(t, DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View)
}

/// Binary, or a struct with a binary `bytes` field.
fn is_image_column(t: &DataType) -> bool {
    let binary = |t: &DataType| matches!(t, DataType::Binary | DataType::LargeBinary | DataType::BinaryView);
    match t {
        DataType::Struct(fields) => fields.iter().any(|f| f.name() == "bytes" && binary(f.data_type())),
        t => binary(t),
    }
}

/// The rows of one decoded batch (the images in `column`, the labels in [`LABEL_COLUMN`] when
/// `labelled`, keys in [`KEY_COLUMN`] when `keyed`), numbered from `first`.
fn rows_of(
    batch: &RecordBatch,
    (column, labelled, keyed): (&str, bool, bool),
    first: usize,
    out: &mut Vec<Row>,
) -> Result<(), PushdownError> {
    let missing = || PushdownError::Internal(format!("the decoded batch has no column {column:?}"));
    let column = batch.column_by_name(column).ok_or_else(missing)?;
    let (images, paths): (ArrayRef, Option<ArrayRef>) = match column.as_struct_opt() {
        Some(s) => (
            s.column_by_name("bytes").cloned().ok_or_else(|| PushdownError::BadInput("no `bytes` field".into()))?,
            s.column_by_name("path").cloned(),
        ),
        None => (column.clone(), None),
    };
    let labels =
        batch.column_by_name(LABEL_COLUMN).filter(|_| labelled).map(|l| integers(l.as_ref(), "label")).transpose()?;
    let ids = match batch.column_by_name(KEY_COLUMN).filter(|_| keyed) {
        Some(a) if a.data_type().is_integer() => {
            Some(integers(a.as_ref(), "id")?.into_iter().map(|v| v.map(|n| n.to_string())).collect::<Vec<_>>())
        }
        Some(a) => Some((0..batch.num_rows()).map(|i| string_at(a.as_ref(), i)).collect()),
        None => None,
    };
    for i in 0..batch.num_rows() {
        let n = first + i;
        let path = paths.as_ref().and_then(|p| string_at(p.as_ref(), i));
        let key = path.or_else(|| ids.as_ref().and_then(|k| k[i].clone())).unwrap_or_else(|| n.to_string());
        if column.is_null(i) || images.is_null(i) {
            return Err(PushdownError::BadInput(format!("row {n} ({key:?}) has no input")));
        }
        let input = binary_at(&images, i)
            .or_else(|| string_at(images.as_ref(), i).map(Bytes::from))
            .ok_or_else(|| PushdownError::BadInput("the input column is neither binary nor strings".into()))?;
        let label = labels.as_ref().and_then(|l| l[i]);
        out.push(Row { key, input, label });
    }
    Ok(())
}

/// Row `i` of a binary array, as a slice of its buffer (no copy).
fn binary_at(array: &ArrayRef, i: usize) -> Option<Bytes> {
    fn slice(values: &arrow_buffer::Buffer, start: usize, end: usize) -> Bytes {
        Bytes::from_owner(values.clone()).slice(start..end)
    }
    if let Some(a) = array.as_binary_opt::<i32>() {
        let o = a.value_offsets();
        return Some(slice(a.values(), o[i] as usize, o[i + 1] as usize));
    }
    if let Some(a) = array.as_binary_opt::<i64>() {
        let o = a.value_offsets();
        return Some(slice(a.values(), o[i] as usize, o[i + 1] as usize));
    }
    array.as_binary_view_opt().map(|a| Bytes::copy_from_slice(a.value(i)))
}

fn string_at(array: &dyn Array, i: usize) -> Option<String> {
    if array.is_null(i) {
        return None;
    }
    if let Some(a) = array.as_string_opt::<i32>() {
        return Some(a.value(i).to_owned());
    }
    if let Some(a) = array.as_string_opt::<i64>() {
        return Some(a.value(i).to_owned());
    }
    array.as_string_view_opt().map(|a| a.value(i).to_owned())
}

/// An integer column's values as `i64` (nulls as `None`).
fn integers(array: &dyn Array, what: &str) -> Result<Vec<Option<i64>>, PushdownError> {
    use arrow_array::types::{
        Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type,
    };
    macro_rules! each {
        ($($t:ty),*) => {$(
            if let Some(a) = array.as_primitive_opt::<$t>() {
                return a.iter().map(|v| v.map(|v| i64::try_from(v).map_err(|_| {
                    PushdownError::BadInput(format!("{what} {v} does not fit in 64 bits"))
                })).transpose()).collect();
            }
        )*};
    }
    each!(Int8Type, Int16Type, Int32Type, Int64Type, UInt8Type, UInt16Type, UInt32Type, UInt64Type);
    Err(PushdownError::BadInput(format!("the {what} column is {}, not integers", array.data_type())))
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
    use arrow_array::{BinaryArray, Int64Array, StringArray, StructArray};
    use arrow_schema::{Field, Fields};

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
        let schema = Arc::new(Schema::new_with_metadata(
            batch.schema().fields().clone(),
            std::collections::HashMap::from([("huggingface".to_owned(), hf.to_owned())]),
        ));
        let batch = batch.with_schema(schema.clone()).expect("schema");
        let props = WriterProperties::builder().set_max_row_group_row_count(Some(2)).build();
        let mut w = ArrowWriter::try_new(Vec::new(), schema, Some(props)).expect("writer");
        w.write(&batch).expect("write");
        let object = Bytes::from(w.into_inner().expect("close"));

        let footer = read(&object, None, 1 << 20, true).expect("footer");
        assert!(footer.output_bytes() > OUTPUT_FOOTER_BYTES);
        let (rows, kept) = footer.rows(&Source::whole(object)).expect("rows");
        assert_eq!(rows.len(), 5);
        let features: Vec<f32> = (0..10).map(|v| v as f32 / 4.0).collect();
        let out = write(&kept.expect("kept"), features.clone(), &[5, 2, 1], Dtype::F16, ("m", "pool")).expect("write");

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
            let list = batch.column(2).as_fixed_size_list();
            assert_eq!(list.value_length(), 2);
            let half = list.values().as_primitive::<arrow_array::types::Float16Type>();
            values.extend(half.values().iter().map(|v| v.to_f32()));
        }
        let expected: Vec<Option<String>> = (0..5).map(|i| string_at(captions.as_ref(), i)).collect();
        assert_eq!(texts, expected);
        assert_eq!(values, features);
        let hf: serde_json::Value = serde_json::from_str(&meta["huggingface"]).expect("json");
        let described: Vec<&String> = hf["info"]["features"].as_object().expect("features").keys().collect();
        assert_eq!(described, ["caption", "features", "label"]);
        assert_eq!(hf["info"]["features"]["features"]["length"], 2);
        let provenance: serde_json::Value = serde_json::from_str(&meta["tensorgate"]).expect("json");
        assert_eq!(provenance["shape"], serde_json::json!([2, 1]));
        assert_eq!(provenance["column"], "image");
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
}
