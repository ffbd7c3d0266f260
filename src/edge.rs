//! The accept phase: TCP connections in, bounded in number and in time before any request exists.
//!
//! - At most `edge.max_connections` connections are served at once. One more is answered
//!   `503 SlowDown` with `Retry-After` and closed (the answer is a fixed 300-byte write; a few
//!   such answers are in progress at once, beyond which extra connections are simply closed), so a
//!   flood of connections costs sockets and never memory or tasks without bound.
//! - A client must send a request's head within `edge.header_timeout_secs`, counted from when
//!   the gateway starts waiting for it: on a new connection, and between requests on a kept-alive
//!   one (hyper's header-read timer), so a silent or idle connection is closed after it.
//! - A response write that makes no progress for `edge.stall_timeout_secs` (the client stopped
//!   reading) closes the connection; request bodies get the same bound per frame in the request
//!   path ([`crate::body::Stall`]).
//!
//! What happens after the head is read is the request path's business (`crate::proxy`).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Sleep;

use crate::metrics::Metrics;

/// Connection bounds (`[edge]`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct EdgeConfig {
    pub(crate) max_connections: usize,
    pub(crate) header_timeout: Duration,
    pub(crate) stall_timeout: Duration,
}

/// Largest request head (request line and headers). S3 accepts 8 KiB of headers; 64 KiB leaves
/// room for long presigned URLs and metadata while bounding what a slow head can hold.
pub const MAX_HEADER_BYTES: usize = 64 * 1024;
/// The most a client connection reads into its buffer at once. hyper's default (about 400 KiB)
/// makes every read buffer that an upload's body frames still share a fresh allocation above
/// glibc's mmap threshold (128 KiB, `pushdown::memory::MALLOC_TUNABLE`): a new mapping, page
/// faults on each page, an unmap. 64 KiB buffers are recycled from the heap, hold a head of
/// [`MAX_HEADER_BYTES`], and are what nginx relays with. Store connections keep hyper's adaptive
/// default: a download's larger reads cost less than those page faults (both measured in
/// docs/BENCHMARKS.md as of 849469b, "Per-row CPU": `git show 849469b:docs/BENCHMARKS.md`).
pub(crate) const IO_BUFFER_BYTES: usize = 64 * 1024;
// aws-chunked decoding keeps frames of at least half a read buffer (its bound on pending bytes).
const _: () = assert!(crate::s3::sigv4::chunked::KEEP_FRAMES_FROM * 2 == IO_BUFFER_BYTES);
/// Refusals of connections over the limit in progress at once; more are closed without an answer.
/// Each holds a socket for at most [`REFUSAL_LINGER`].
const MAX_REFUSALS: usize = 64;

/// How long a refused connection is kept open so the client can read the `503` before the close
/// (closing with unread request bytes would reset the connection and lose the answer).
const REFUSAL_LINGER: Duration = Duration::from_millis(500);

/// Pause after an accept error (out of file descriptors): retrying at once would spin a core.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves each listener's app on it (the S3 port, and each alias endpoint's) until `stop`
/// resolves, then waits for open connections to finish (the caller bounds that wait). The
/// connection limit counts them all; the listeners are polled in turn, so a flood on one does
/// not starve the others' accepts.
pub(crate) async fn serve<S, B>(
    listeners: Vec<(TcpListener, S)>,
    cfg: EdgeConfig,
    metrics: Metrics,
    stop: impl Future<Output = Duration> + Send + 'static,
) where
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<B>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let slots = Arc::new(Semaphore::new(cfg.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS));
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(cfg.header_timeout)
        .max_header_size(MAX_HEADER_BYTES)
        .max_buf_size(IO_BUFFER_BYTES);
    tokio::pin!(stop);
    let mut turn = 0;
    let linger = loop {
        let (tcp, app) = tokio::select! {
            linger = &mut stop => break linger,
            accepted = accept(&listeners, &mut turn) => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "Accept failed; backing off.");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        // No Nagle delay: small S3 responses (4 KiB GETs, XML) must not wait for an ACK.
        let _ = tcp.set_nodelay(true);
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            metrics.connections_refused.inc();
            if let Ok(r) = refusals.clone().try_acquire_owned() {
                tokio::spawn(async move {
                    refuse(tcp).await;
                    drop(r);
                });
            }
            continue;
        };
        let io = TokioIo::new(Stalling::new(tcp, cfg.stall_timeout));
        let conn = graceful.watch(http.serve_connection(io, app));
        let (open, closed) = (metrics.connections_open.clone(), metrics.connections_closed.clone());
        open.inc();
        tokio::spawn(async move {
            let reason = match conn.await {
                Ok(()) => "done",
                Err(e) if e.is_timeout() => "header_timeout",
                Err(e) if stalled(&e) => "stalled",
                Err(_) => "error",
            };
            closed.get_or_create(&crate::metrics::ReasonLabel { reason }).inc();
            open.dec();
            drop(slot);
        });
    };
    drop(listeners);
    // Connections may finish on their own first (a hand-over's answers close them); the rest
    // finish the request they serve, and idle ones are closed.
    let deadline = tokio::time::Instant::now() + linger;
    while slots.available_permits() < cfg.max_connections && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(LINGER_POLL).await;
    }
    graceful.shutdown().await;
}

/// The next connection of any listener, with the app that serves it; the listener polled first
/// moves on with each accept (`turn`).
async fn accept<S: Clone>(listeners: &[(TcpListener, S)], turn: &mut usize) -> io::Result<(TcpStream, S)> {
    let n = listeners.len();
    let (tcp, i) = std::future::poll_fn(|cx| {
        for k in 0..n {
            let i = (*turn + k) % n;
            if let Poll::Ready(r) = listeners[i].0.poll_accept(cx) {
                return Poll::Ready(r.map(|(tcp, _peer)| (tcp, i)));
            }
        }
        Poll::Pending
    })
    .await?;
    *turn = turn.wrapping_add(1);
    Ok((tcp, listeners[i].1.clone()))
}

/// How often a hand-over's linger looks whether every connection has closed.
const LINGER_POLL: Duration = Duration::from_millis(20);

/// Whether a connection ended because a write made no progress for the stall timeout.
fn stalled(e: &hyper::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<io::Error>() {
            return io.kind() == io::ErrorKind::TimedOut;
        }
        source = s.source();
    }
    false
}

/// Answers a connection over the limit with `503 SlowDown` and closes it.
async fn refuse(mut tcp: TcpStream) {
    let body = crate::s3::xml::error_body("SlowDown", "too many connections; retry later", "/", "-");
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         Retry-After: {}\r\nConnection: close\r\n\r\n",
        body.len(),
        crate::s3::headers::RETRY_AFTER_SECS
    );
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        tcp.write_all(head.as_bytes()).await?;
        tcp.write_all(body.as_bytes()).await?;
        tcp.shutdown().await?;
        // Read what the client sent until it closes, so the close does not reset the answer.
        let mut sink = [0u8; 1024];
        while tcp.read(&mut sink).await? > 0 {}
        Ok::<_, io::Error>(())
    })
    .await;
}

/// A deadline for progress: armed when an operation is pending, disarmed when it completes, and
/// expired once it stayed armed for the whole limit. One timer is allocated and reset, not one per
/// pending poll.
#[derive(Debug)]
pub(crate) struct StallTimer {
    limit: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
    armed: bool,
}

impl StallTimer {
    #[must_use]
    pub(crate) fn new(limit: Duration) -> Self {
        Self { limit, sleep: None, armed: false }
    }

    /// Passes a completed poll through (disarming); on `Pending`, arms the timer and reports
    /// `Ready(Err(()))` once it has run out.
    pub(crate) fn watch<R>(&mut self, polled: Poll<R>, cx: &mut Context<'_>) -> Poll<Result<R, ()>> {
        match polled {
            Poll::Ready(r) => {
                self.armed = false;
                Poll::Ready(Ok(r))
            }
            Poll::Pending => {
                let deadline = tokio::time::Instant::now() + self.limit;
                let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                if !self.armed {
                    sleep.as_mut().reset(deadline);
                    self.armed = true;
                }
                ready!(sleep.as_mut().poll(cx));
                self.armed = false;
                Poll::Ready(Err(()))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection whose writes fail with `TimedOut` once one has waited the limit without
    /// progress.
    #[derive(Debug)]
    pub(crate) struct Stalling<T> {
        #[pin]
        io: T,
        timer: StallTimer,
    }
}

impl<T> Stalling<T> {
    pub(crate) fn new(io: T, limit: Duration) -> Self {
        Self { io, timer: StallTimer::new(limit) }
    }
}

fn write_stalled<R>(polled: Poll<Result<io::Result<R>, ()>>) -> Poll<io::Result<R>> {
    polled.map(|r| r.unwrap_or_else(|()| Err(io::Error::new(io::ErrorKind::TimedOut, "the client stopped reading"))))
}

impl<T: AsyncRead> AsyncRead for Stalling<T> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<T: AsyncWrite> AsyncWrite for Stalling<T> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.project();
        write_stalled(this.timer.watch(this.io.poll_write(cx, buf), cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.project();
        write_stalled(this.timer.watch(this.io.poll_write_vectored(cx, bufs), cx))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.project();
        write_stalled(this.timer.watch(this.io.poll_flush(cx), cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }
}

pin_project_lite::pin_project! {
    /// A request body whose next frame must arrive within the limit: a client that sent its head
    /// and then stopped sending costs its socket until then, and the request fails with
    /// `RequestTimeout`.
    #[derive(Debug)]
    pub(crate) struct StallingBody<B> {
        #[pin]
        inner: B,
        timer: StallTimer,
    }
}

impl<B> StallingBody<B> {
    pub(crate) fn new(inner: B, limit: Duration) -> Self {
        Self { inner, timer: StallTimer::new(limit) }
    }
}

impl<B> http_body::Body for StallingBody<B>
where
    B: http_body::Body<Data = bytes::Bytes>,
    B::Error: Into<axum::BoxError>,
{
    type Data = bytes::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let this = self.project();
        match ready!(this.timer.watch(this.inner.poll_frame(cx), cx)) {
            Ok(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Err(()) => Poll::Ready(Some(Err(Box::new(crate::body::BodyError::Stalled)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_write_that_never_progresses_times_out_and_one_that_does_not() {
        // A duplex pipe with a 16-byte buffer nobody reads: the second write blocks for good.
        let (a, _b) = tokio::io::duplex(16);
        let mut s = Stalling::new(a, Duration::from_millis(200));
        s.write_all(&[0; 16]).await.expect("fits the buffer");
        let started = tokio::time::Instant::now();
        let e = s.write_all(&[0; 1]).await.expect_err("stalls");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert!(started.elapsed() >= Duration::from_millis(200));

        let (a, mut b) = tokio::io::duplex(16);
        let mut s = Stalling::new(a, Duration::from_millis(200));
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            b.read_to_end(&mut got).await.map(|_| got.len())
        });
        for _ in 0..10 {
            s.write_all(&[1; 16]).await.expect("the reader keeps up");
        }
        drop(s);
        assert_eq!(reader.await.expect("joins").expect("reads"), 160);
    }
}
