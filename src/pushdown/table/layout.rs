//! What a Parquet file is to the gateway: its magic, the bounds a read keeps to, the columns of the
//! `datasets` layout, what a request reads ([`Reading`]) and what a row is ([`Row`]).

use bytes::Bytes;

use super::super::error::PushdownError;
use super::super::spec::RowGroups;

/// Parquet's magic, at the start and at the end of every file.
pub(super) const MAGIC: &[u8; 4] = b"PAR1";

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
pub(super) const MAX_SCHEMA_ELEMENTS: usize = 10_000;

pub(super) const MAX_NESTING: usize = 64;

/// Rows decoded per read: a read that takes the decoded bytes past what the footer claimed is
/// refused before the next one.
pub(super) const ROWS_PER_BATCH: usize = 256;

/// What decoding may take beyond the footer's uncompressed sizes: every value is held as its own
/// handle beside its bytes ([`VALUE_OVERHEAD`]). Rows that take more than `DECODE_FACTOR x` the
/// claim `+ DECODE_SLACK` are refused (the footer understated its pages); this is also what the
/// governor holds for them.
pub(super) const DECODE_FACTOR: u64 = 2;

pub(super) const DECODE_SLACK: u64 = 1024 * 1024;

/// What a decoded value is charged beside its bytes: its handle (a `ByteArray`, a slice of its
/// page's buffer) and its place in the rows.
pub(super) const VALUE_OVERHEAD: u64 = 16;

/// The image column when the request names none (Hugging Face's `Image` feature's usual name).
pub const DEFAULT_COLUMN: &str = "image";

/// What a panic of the parquet crate is answered with (a `400`, [`guarded`]). The crate panics on
/// some damaged files instead of returning an error: AFL found asserts in its column-chunk
/// metadata, its byte-array and level decoders and Arrow's bit utilities within seconds
/// (`fuzz/regressions/parquet/`).
pub(super) const UNREADABLE: &str = "not a readable Parquet file";

/// The labels, when the file has an integer column of this name.
pub(super) const LABEL_COLUMN: &str = "label";

/// The rows' keys, when the file has a string or integer column of this name and a row's input
/// gives none (an image's `path`): text datasets name their rows so, as JSON Lines rows do
/// (`text::jsonl_rows`). Without one a row's key is its number in its file, which repeats across
/// the files of a dataset.
pub(super) const KEY_COLUMN: &str = "id";

/// The column a Parquet output adds ([`write`]).
pub const FEATURES_COLUMN: &str = "features";

/// The names inside the features column (`features.list.element`, the Parquet format's LIST
/// layout).
pub(super) const LIST_GROUP: &str = "list";

pub(super) const LIST_ELEMENT: &str = "element";

/// Feature values written to the output's column at once (whole rows; at least one row).
pub(super) const WRITE_VALUES: usize = 64 * 1024;

/// What a Parquet output's footer may take beyond its columns (a schema and a few row groups'
/// chunk descriptions, as [`MAX_FOOTER_BYTES`] bounds the source's).
pub(super) const OUTPUT_FOOTER_BYTES: u64 = MAX_FOOTER_BYTES as u64;

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
    /// Each row group is pushed down on its own (a whole file's output served from its
    /// outline, ADR 0030): each group, not all of them together, holds at most
    /// [`super::super::shard::MAX_SAMPLES`] rows.
    pub by_group: bool,
}

/// One row: its key, its input (an encoded image, or a text's UTF-8), its label.
#[derive(Debug, Clone)]
pub struct Row {
    pub(crate) key: String,
    pub(crate) input: Bytes,
    pub(crate) label: Option<i64>,
}

/// A Parquet reader's error: what the reader does not implement is unsupported (`415`), the rest
/// is a damaged or hostile file (`400`).
pub(super) fn parquet_error(e: &parquet::errors::ParquetError) -> PushdownError {
    if matches!(e, parquet::errors::ParquetError::NYI(_)) {
        PushdownError::Unsupported(format!("Parquet: {e}"))
    } else {
        PushdownError::BadInput(format!("{UNREADABLE}: {e}"))
    }
}
