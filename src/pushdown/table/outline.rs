//! A Parquet output's outline ([`outline`], ADR 0030): its size, its row groups' places and its
//! tail, known from the source's footer alone, before any feature is computed. The output's own
//! writer ([`OutputWriter`]) runs over zeros where the kept chunks and the features would be.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parquet::column::writer::ColumnCloseResult;
use parquet::file::reader::{ChunkReader, Length};

use super::super::error::{PushdownError, guarded};
use super::super::shard::MAX_SAMPLES;
use super::super::spec::Dtype;
use super::footer::Footer;
use super::layout::{MAGIC, UNREADABLE};
use super::write::OutputWriter;

/// A Parquet output's layout, known before its features ([`outline`]): its length, where each
/// row group's chunks lie in it, and its tail (the footer, and the page index before it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outline {
    pub len: u64,
    /// Each row group's bytes `[start, end)`, in the order of the footer's groups (empty for a
    /// group without rows, which the output leaves out).
    pub groups: Vec<(u64, u64)>,
    /// The bytes after the last row group, to the end.
    pub tail: Bytes,
    /// The output's shape: rows, then one row's features.
    pub shape: Vec<usize>,
}

impl Outline {
    /// Where the tail starts.
    #[must_use]
    pub fn tail_start(&self) -> u64 {
        self.len - self.tail.len() as u64
    }

    /// The bytes `[start, end)` known without any features: the leading magic and the tail.
    #[must_use]
    pub fn known(&self, start: u64, end: u64) -> Option<Bytes> {
        let tail_start = self.tail_start();
        if end <= MAGIC.len() as u64 {
            Some(Bytes::from_static(MAGIC).slice(usize::try_from(start).ok()?..usize::try_from(end).ok()?))
        } else if start >= tail_start {
            let at = |n: u64| usize::try_from(n - tail_start).ok();
            Some(self.tail.slice(at(start)?..at(end)?))
        } else {
            None
        }
    }
}

/// The outline of the Parquet output of the file whose footer is `footer` (read to keep the
/// other columns), with `shape` the features of one row: the same writer as [`super::write`], run over
/// zeros where the kept chunks and the features would be (its output discarded but for the
/// tail). A features chunk is encoded once per distinct row count.
///
/// # Errors
/// `BadInput` for kept chunks the footer places outside the file; `InvalidArgument` for `bf16`;
/// `Internal` for what the writer refuses.
pub fn outline(footer: &Footer, shape: &[usize], dtype: Dtype, model: (&str, &str)) -> Result<Outline, PushdownError> {
    // The parquet crate panics on some damaged metadata (`layout::UNREADABLE`).
    guarded(UNREADABLE, || lay_out(footer, shape, dtype, model))
}

fn lay_out(footer: &Footer, shape: &[usize], dtype: Dtype, model: (&str, &str)) -> Result<Outline, PushdownError> {
    let kept = footer.kept().ok_or_else(|| internal(&"the footer was not read to keep the other columns"))?;
    let tail_from = Arc::new(AtomicU64::new(u64::MAX));
    let sink = TailSink { at: 0, from: tail_from.clone(), kept: Vec::new() };
    let mut out = OutputWriter::new(&kept, shape, dtype, model, sink)?;
    let mut encoded: Vec<(usize, ColumnCloseResult)> = Vec::new();
    let (mut groups, mut rows) = (Vec::with_capacity(footer.group_count()), 0usize);
    for part in 0..footer.group_count() {
        let (n, chunks) = footer.kept_chunks(part, None)?;
        rows += n;
        if n == 0 {
            let at = out.position();
            groups.push((at, at));
            continue;
        }
        let close = match encoded.iter().find(|(r, _)| *r == n) {
            Some((_, close)) => close.clone(),
            // Encoding zeros costs what encoding features does: at most a request's rows in all.
            None if encoded.iter().map(|(r, _)| r).sum::<usize>() + n > MAX_SAMPLES => {
                return Err(PushdownError::BadInput(format!(
                    "the Parquet file's row groups have too many different sizes to lay out (more than \
                     {MAX_SAMPLES} rows in groups of distinct sizes): read it by row-groups"
                )));
            }
            None => {
                let (_, close) = out.features_chunk(n, None, std::io::sink())?;
                encoded.push((n, close.clone()));
                close
            }
        };
        groups.push(out.group(&Zeros, &chunks, n, (&Zeros, close))?);
    }
    let tail_start = out.position();
    tail_from.store(tail_start, Ordering::SeqCst);
    let sink = out.finish()?;
    let len = sink.at;
    let tail = Bytes::from(sink.kept);
    if len.checked_sub(tail_start) != Some(tail.len() as u64) {
        return Err(internal(&format!("a tail of {} bytes from {tail_start} of {len}", tail.len())));
    }
    Ok(Outline { len, groups, tail, shape: std::iter::once(rows).chain(shape.iter().copied()).collect() })
}

/// Zeros of any length: what an outline reads in place of chunks it does not have.
struct Zeros;

impl Length for Zeros {
    fn len(&self) -> u64 {
        u64::MAX
    }
}

impl ChunkReader for Zeros {
    type T = std::io::Repeat;

    fn get_read(&self, _start: u64) -> parquet::errors::Result<Self::T> {
        Ok(std::io::repeat(0))
    }

    fn get_bytes(&self, _start: u64, length: usize) -> parquet::errors::Result<Bytes> {
        Ok(Bytes::from(vec![0; length]))
    }
}

/// A sink that counts what is written and keeps it from position `from` on (set once the row
/// groups are written: the writer buffers, so the sink's own count says where a byte lies).
struct TailSink {
    at: u64,
    from: Arc<AtomicU64>,
    kept: Vec<u8>,
}

impl Write for TailSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let from = self.from.load(Ordering::SeqCst);
        let end = self.at + buf.len() as u64;
        if end > from {
            let skip = usize::try_from(from.saturating_sub(self.at)).unwrap_or(buf.len());
            self.kept.extend_from_slice(&buf[skip.min(buf.len())..]);
        }
        self.at = end;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn internal(e: &dyn std::fmt::Display) -> PushdownError {
    PushdownError::Internal(format!("laying out the Parquet output: {e}"))
}
