//! The bytes of a Parquet file that were read ([`Source`]): the whole file, or its tail and the
//! span of some row groups, read through by the parquet crate.

use bytes::Bytes;
use parquet::file::reader::{ChunkReader, Length};

/// The bytes of a Parquet file that were read: the whole file, or one piece of it (its tail,
/// for the footer; the span of some row groups, for their rows) at its offset in a file of `len`
/// bytes. The parquet crate reads through it ([`ChunkReader`]); a read outside the piece is an
/// error (a footer placing its chunks elsewhere than the span read).
#[derive(Debug, Clone)]
pub struct Source {
    pub(super) len: u64,
    pub(super) offset: u64,
    pub(super) bytes: Bytes,
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
    pub(super) fn from(&self, start: u64, length: usize) -> Option<Bytes> {
        let from = usize::try_from(start.checked_sub(self.offset)?).ok()?;
        (from.checked_add(length)? <= self.bytes.len()).then(|| self.bytes.slice(from..))
    }

    pub(super) fn slice(&self, start: u64, length: usize) -> Option<Bytes> {
        self.from(start, length).map(|b| b.slice(..length))
    }

    pub(super) fn not_read(start: u64, length: usize) -> parquet::errors::ParquetError {
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
