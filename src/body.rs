//! Request and response body plumbing: the one body type, and the wrappers that enforce limits,
//! verify a signed payload hash while streaming, and count bytes for metrics.
//!
//! No wrapper here ever collects a whole body: every body streams frame by frame, which is what
//! keeps a 1 GiB transfer inside a few MiB of gateway memory.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use pin_project_lite::pin_project;
use prometheus_client::metrics::counter::Counter;
use sha2::{Digest, Sha256};

/// The body type used throughout the gateway (a boxed, streaming body).
pub(crate) type Body = axum::body::Body;
/// A boxed error, as carried by streaming bodies.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a request body was refused while it streamed.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("reading the request body failed: {0}")]
    Read(#[source] BoxError),
    #[error("malformed aws-chunked body: {0}")]
    Malformed(&'static str),
    #[error("the request body ended before the declared length")]
    Incomplete,
    #[error("an aws-chunked chunk exceeds the gateway's limit")]
    ChunkTooLarge,
    #[error("a chunk or trailer signature does not match")]
    ChunkSignature,
    #[error("the decoded body length differs from x-amz-decoded-content-length")]
    LengthMismatch,
    #[error("the body's SHA-256 differs from x-amz-content-sha256")]
    Sha256Mismatch,
    #[error("the body does not match its {0} trailer")]
    ChecksumMismatch(&'static str),
    #[error("the request body exceeds the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("the form does not end right after its file part (parts after the file are not supported)")]
    FormTrailer,
    #[error("the client sent no body bytes for edge.stall_timeout_secs")]
    Stalled,
}

impl BodyError {
    /// A failed read of a body: the gateway's own error when a body layer below failed (a stall),
    /// else the transport's.
    #[must_use]
    pub(crate) fn read(e: BoxError) -> Self {
        // Bodies boxed as `axum::body::Body` carry their error inside an `axum::Error`.
        let e = match e.downcast::<axum::Error>() {
            Ok(a) => a.into_inner(),
            Err(e) => e,
        };
        match e.downcast::<Self>() {
            Ok(b) => *b,
            Err(e) => Self::Read(e),
        }
    }
}

/// Walks an error's `source()` chain looking for a [`BodyError`]: a body failure surfaces wrapped
/// inside the HTTP client's error when the backend request could not finish sending it.
#[must_use]
pub(crate) fn find_body_error<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a BodyError> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(b) = e.downcast_ref::<BodyError>() {
            return Some(b);
        }
        cur = e.source();
    }
    None
}

pin_project! {
    /// An inbound body with a size limit and, optionally, a SHA-256 the bytes must hash to.
    /// The check happens when the last byte arrives; the error then aborts the backend request,
    /// so a tampered upload is never committed.
    pub(crate) struct Guarded<B> {
        #[pin]
        inner: B,
        limit: u64,
        seen: u64,
        expect_sha256: Option<(Sha256, [u8; 32])>,
    }
}

impl<B> Guarded<B> {
    pub(crate) fn new(inner: B, limit: u64, expect_sha256: Option<[u8; 32]>) -> Self {
        Self { inner, limit, seen: 0, expect_sha256: expect_sha256.map(|e| (Sha256::new(), e)) }
    }
}

impl<B> HttpBody for Guarded<B>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.project();
        match ready!(this.inner.poll_frame(cx)) {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    *this.seen += data.len() as u64;
                    if *this.seen > *this.limit {
                        return Poll::Ready(Some(Err(BodyError::TooLarge { limit: *this.limit })));
                    }
                    if let Some((hasher, _)) = this.expect_sha256.as_mut() {
                        hasher.update(data);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(BodyError::read(e.into())))),
            None => {
                if let Some((hasher, expected)) = this.expect_sha256.take()
                    && hasher.finalize().as_slice() != expected
                {
                    return Poll::Ready(Some(Err(BodyError::Sha256Mismatch)));
                }
                Poll::Ready(None)
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // The hash check must still run on the final poll.
        self.expect_sha256.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// A body that keeps `guard` (a memory reservation, an admission place) until it ends, fails
    /// or is dropped, so nothing it accounts for outlives the response or leaks when a client goes
    /// away mid-download.
    #[derive(Debug)]
    pub(crate) struct Holding<B, G> {
        #[pin]
        inner: B,
        guard: Option<G>,
    }
}

impl<B, G> Holding<B, G> {
    pub(crate) fn new(inner: B, guard: G) -> Self {
        Self { inner, guard: Some(guard) }
    }
}

impl<B, G> HttpBody for Holding<B, G>
where
    B: HttpBody<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let polled = ready!(this.inner.poll_frame(cx));
        if !matches!(polled, Some(Ok(_))) {
            this.guard.take();
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// A [`Holding`] body that also adds the bytes it yields to a counter.
    pub(crate) struct Metered<B, G> {
        #[pin]
        inner: Holding<B, G>,
        counter: Counter,
    }
}

impl<B, G> Metered<B, G> {
    pub(crate) fn new(inner: B, counter: Counter, guard: G) -> Self {
        Self { inner: Holding::new(inner, guard), counter }
    }
}

impl<B, G> HttpBody for Metered<B, G>
where
    B: HttpBody<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.project();
        let polled = ready!(this.inner.poll_frame(cx));
        if let Some(d) = polled.as_ref().and_then(|f| f.as_ref().ok()).and_then(Frame::data_ref) {
            this.counter.inc_by(d.len() as u64);
        }
        Poll::Ready(polled)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

pin_project! {
    /// Payload bytes checked against the `x-amz-checksum-<alg>` header the client sent, for stores
    /// that do not check it themselves: the mismatch is the stream's last item, so with
    /// [`WithholdTail`] a corrupt body never completes at the store.
    pub(crate) struct Checksummed<S> {
        #[pin]
        inner: S,
        check: Option<(crate::s3::checksum::Algorithm, crate::s3::checksum::Hasher, String)>,
    }
}

impl<S> Checksummed<S> {
    pub(crate) fn new(inner: S, algorithm: crate::s3::checksum::Algorithm, expected: String) -> Self {
        Self { inner, check: Some((algorithm, algorithm.hasher(), expected)) }
    }
}

impl<S> futures_util::Stream for Checksummed<S>
where
    S: futures_util::Stream<Item = Result<Bytes, BodyError>>,
{
    type Item = Result<Bytes, BodyError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.project();
        let item = ready!(this.inner.poll_next(cx));
        match &item {
            Some(Ok(bytes)) => {
                if let Some((_, hasher, _)) = this.check.as_mut() {
                    hasher.update(bytes);
                }
            }
            None => {
                if let Some((algorithm, hasher, expected)) = this.check.take()
                    && hasher.finalize_base64() != expected
                {
                    return Poll::Ready(Some(Err(BodyError::ChecksumMismatch(algorithm.header_name()))));
                }
            }
            Some(Err(_)) => {}
        }
        Poll::Ready(item)
    }
}

pin_project! {
    /// A verified upload on its way to the store: every byte passes through as it arrives, except
    /// the last one seen, which is held back until the stream behind it ends cleanly, i.e. until
    /// every check on the body (signed SHA-256, chunk signatures, trailing checksum) has passed.
    /// On a failure the held byte is dropped and the error ends the body, so the store never
    /// receives the `Content-Length` it was promised and commits nothing (ADR 0007).
    ///
    /// The caller starts the store request only after the first verified bytes arrived (see
    /// `Gateway::prepared_body`), so a refused body has always sent the store at least one byte:
    /// SeaweedFS commits an empty object when a request's connection closes before any byte of
    /// its body (observed on 4.48), but never a partial one.
    pub(crate) struct WithholdTail<S> {
        #[pin]
        inner: S,
        held: Option<Bytes>,
        ready: std::collections::VecDeque<Bytes>,
        done: bool,
    }
}

impl<S> WithholdTail<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self { inner, held: None, ready: std::collections::VecDeque::new(), done: false }
    }
}

impl<S> futures_util::Stream for WithholdTail<S>
where
    S: futures_util::Stream<Item = Result<Bytes, BodyError>>,
{
    type Item = Result<Bytes, BodyError>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let mut this = self.project();
        loop {
            if let Some(next) = this.ready.pop_front() {
                return Poll::Ready(Some(Ok(next)));
            }
            if *this.done {
                return Poll::Ready(this.held.take().map(Ok));
            }
            match ready!(this.inner.as_mut().poll_next(cx)) {
                Some(Ok(mut bytes)) if !bytes.is_empty() => {
                    let last = bytes.split_off(bytes.len() - 1);
                    this.ready.extend(this.held.replace(last));
                    if !bytes.is_empty() {
                        this.ready.push_back(bytes);
                    }
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    *this.done = true;
                    this.held.take();
                    return Poll::Ready(Some(Err(e)));
                }
                None => *this.done = true,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full};

    use super::*;

    #[tokio::test]
    async fn guarded_checks_hash_and_limit() {
        let good: [u8; 32] = Sha256::digest(b"hello").into();
        let ok = Guarded::new(Full::new(Bytes::from_static(b"hello")), 10, Some(good));
        assert_eq!(ok.collect().await.expect("valid").to_bytes(), "hello");

        let bad = Guarded::new(Full::new(Bytes::from_static(b"hellO")), 10, Some(good));
        assert!(matches!(bad.collect().await, Err(BodyError::Sha256Mismatch)));

        let big = Guarded::new(Full::new(Bytes::from_static(b"hello")), 4, None);
        assert!(matches!(big.collect().await, Err(BodyError::TooLarge { limit: 4 })));
    }

    #[tokio::test]
    async fn the_last_byte_waits_for_the_checks() {
        use futures_util::StreamExt;
        let frames = |last: Result<Bytes, BodyError>| {
            let first = [Ok(Bytes::from_static(b"abc")), Ok(Bytes::new()), Ok(Bytes::from_static(b"d"))];
            futures_util::stream::iter(first.into_iter().chain([last]))
        };
        let joined = |items: &[Result<Bytes, BodyError>]| -> Vec<u8> {
            items.iter().filter_map(|r| r.as_ref().ok()).flat_map(|b| b.to_vec()).collect()
        };
        // A clean end releases every byte, in order.
        let ok: Vec<_> = WithholdTail::new(frames(Ok(Bytes::from_static(b"ef")))).collect().await;
        assert!(ok.iter().all(Result::is_ok));
        assert_eq!(joined(&ok), b"abcdef");
        // A failure after the data: all but the last byte went out, then the error.
        let bad: Vec<_> = WithholdTail::new(frames(Err(BodyError::Sha256Mismatch))).collect().await;
        assert_eq!(joined(&bad), b"abc");
        assert!(matches!(bad.last(), Some(Err(BodyError::Sha256Mismatch))));
    }

    #[tokio::test]
    async fn header_checksums_are_checked_at_the_end() {
        use crate::s3::checksum::Algorithm;
        use futures_util::StreamExt;
        let body =
            || futures_util::stream::iter([Ok(Bytes::from_static(b"hello ")), Ok(Bytes::from_static(b"trailer"))]);
        let ok: Vec<_> = Checksummed::new(body(), Algorithm::Crc32, "WzGbuw==".into()).collect().await;
        assert!(ok.iter().all(Result::is_ok) && ok.len() == 2);
        let bad: Vec<_> = Checksummed::new(body(), Algorithm::Crc32, "AAAAAA==".into()).collect().await;
        assert!(matches!(bad.last(), Some(Err(BodyError::ChecksumMismatch("x-amz-checksum-crc32")))));
    }

    #[test]
    fn body_errors_are_found_through_wrappers() {
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] BodyError);
        let e = Outer(BodyError::Sha256Mismatch);
        assert!(matches!(find_body_error(&e), Some(BodyError::Sha256Mismatch)));
    }
}
