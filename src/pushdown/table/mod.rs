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
//! A request may name some row groups ([`super::spec::RowGroups`]): then only those are counted and decoded,
//! and the bytes need not be the whole file. A [`Source`] is the pieces of the file that were
//! read: its tail ([`TAIL_BYTES`], the footer) and the span of the named groups
//! ([`Footer::span`]), so a file of any size is pushed down a few row groups at a time.
//!
//! The parquet crate's own column readers and file writer do the work, without its Arrow layer
//! (ADR 0022): the input columns are decoded one after the other, and a Parquet output copies
//! the other columns' encoded chunks as they are, without decoding them.

mod decode;
mod footer;
mod layout;
mod outline;
mod source;
mod write;

pub use self::footer::Footer;
pub use self::layout::{DEFAULT_COLUMN, FEATURES_COLUMN, MAX_FOOTER_BYTES, Reading, Row, TAIL_BYTES, is_parquet};
pub use self::outline::{Outline, outline};
pub use self::source::Source;
pub use self::write::{Kept, Provenance, write};

#[cfg(test)]
mod tests;
