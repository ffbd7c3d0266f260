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

mod decode;
mod footer;
mod source;
#[cfg(test)]
mod tests;
mod write;

#[allow(clippy::wildcard_imports)]
use self::decode::*;
#[allow(clippy::wildcard_imports)]
pub use self::{footer::*, source::*, write::*};

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

/// A Parquet reader's error: what the reader does not implement is unsupported (`415`), the rest
/// is a damaged or hostile file (`400`).
fn parquet_error(e: &parquet::errors::ParquetError) -> PushdownError {
    if matches!(e, parquet::errors::ParquetError::NYI(_)) {
        PushdownError::Unsupported(format!("Parquet: {e}"))
    } else {
        PushdownError::BadInput(format!("{UNREADABLE}: {e}"))
    }
}
