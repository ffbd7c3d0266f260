//! A shard's output streamed while it is computed (ADR 0031). On a cache miss a shard's output
//! is laid out once the shard is read and parsed, before any feature is computed: a `HEAD` is
//! answered then, and a `GET` whose output is not computed within [`WHOLE_WITHIN`] gets its
//! headers then and each sample's bytes in order as they are computed, so no reader waits for a
//! whole output before its first byte. The read-through runs in a task of its own: the response
//! goes when the layout is known (or, for anything not laid out, when the read-through ends: a
//! hit, the store's answer, a whole output), and the computation goes on into the cache behind
//! it, also after the client went away (under an admission place of its own, or not at all when
//! none is left or the output is not cached).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::request::Parts;
use http::{Method, Request, Response, StatusCode};

use super::Gateway;
use super::pushdown::{OUTPUT_SCOPED, SourceSide, StreamTo, described, output_etag, output_head, respond};
use crate::body::{Body, BoxError};
use crate::cache::CacheKey;
use crate::error::GatewayError;
use crate::pushdown::stream::{Laid, Streaming, WentAway};
use crate::pushdown::{Job, PushdownError};
use crate::s3::authority::Authority;
use crate::s3::route::Target;

/// `x-tensorgate-cache` of a streamed output: computed on this request.
const MISS: &str = "miss";

/// How long a `GET` waits for its laid-out output to be computed whole before its headers go and
/// its bytes stream: well inside the readers' stall limits (pyarrow's S3 client gives up on a
/// transfer under 1 byte/s for 3 s; boto3 and the aws CLI read with a 60 s timeout), while a
/// shard computed within it is answered whole, as any other output.
const WHOLE_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// A laid-out output and the source version it is computed from.
struct Streamed {
    laid: Laid,
    etag: String,
    last_modified: Option<String>,
}

impl Gateway {
    /// Whether a pushdown request may be answered from its layout: a `GET` or `HEAD` of the whole
    /// output with no `Range` or condition (those are evaluated on a whole output, as before) and
    /// no row groups.
    pub(super) fn streams(parts: &Parts, job: &Job) -> bool {
        matches!(parts.method, Method::GET | Method::HEAD)
            && !job.ranged()
            && !OUTPUT_SCOPED.iter().any(|h| parts.headers.contains_key(h))
    }

    /// Serves a pushdown whose output may be streamed ([`Self::streams`]): the read-through in a task
    /// of its own, its computation told where to stream ([`StreamTo`]); the answer is the
    /// layout's, or the read-through's when nothing was laid out.
    pub(super) async fn serve_streamed(
        &self,
        parts: &Parts,
        (target, key): (Target, CacheKey),
        job: Job,
        authority: &Authority,
        side: SourceSide,
    ) -> Result<Response<Body>, GatewayError> {
        let gateway = self.me.upgrade().ok_or_else(|| internal("the gateway is not shared"))?;
        let (answer, laid) = tokio::sync::oneshot::channel();
        let (bytes, rx) = tokio::sync::mpsc::unbounded_channel();
        let head = parts.method == Method::HEAD;
        let own = gateway.clone();
        // Finishing for nobody pays only where the output is cached (the retry is served).
        let cached = self.cache.is_some() && !parts.headers.contains_key(crate::s3::headers::SSE_CUSTOMER_KEY);
        let went_away: WentAway = Box::new(move || {
            let place = cached.then(|| own.admission.admit(&own.metrics).ok()).flatten()?;
            Some(Box::new(place) as Box<dyn std::any::Any + Send>)
        });
        let bytes = (!head).then_some(bytes);
        let to: StreamTo = Box::new(move |etag, last_modified| Streaming {
            laid: Box::new(move |laid| {
                let _ = answer.send(Streamed { laid, etag, last_modified });
            }),
            bytes,
            went_away,
        });
        let split = job.split_name().to_owned();
        let dtype = job.spec().dtype.name();
        let (owned, authority, read_key) = (owned_parts(parts), authority.clone(), key.clone());
        let limit = self.cfg.load().request_timeout;
        let streamed = Arc::new(AtomicBool::new(false));
        let (done_tx, mut done) = tokio::sync::oneshot::channel();
        let unheard = streamed.clone();
        tokio::spawn(async move {
            let through = gateway.read_through(&owned, (target, &read_key), job, &authority, side, Some(to));
            let read = tokio::time::timeout(limit, through)
                .await
                .unwrap_or_else(|_| Err(internal("the streamed output ran past edge.request_timeout_secs")));
            if let Err(e) = &read
                && unheard.load(Ordering::Acquire)
                && !matches!(e, GatewayError::Pushdown(PushdownError::Unwanted))
            {
                tracing::warn!(error = %e, "A streamed pushdown output failed after its headers were sent.");
            }
            let _ = done_tx.send(read);
        });
        let ended = |read: Result<Result<_, GatewayError>, _>| {
            read.map_err(|_| internal("the read-through's task ended"))?.and_then(|read| respond(parts, &key, read))
        };
        let Ok(Streamed { laid, etag, last_modified }) = laid.await else {
            return ended(done.await);
        };
        // A computation that ends soon is answered whole, as any other output (a sample that
        // fails is then the request's S3 error, not a body cut short).
        if !head && let Ok(read) = tokio::time::timeout(WHOLE_WITHIN, &mut done).await {
            return ended(read);
        }
        streamed.store(true, Ordering::Release);
        let resp = output_head(&output_etag(&etag, &key.variant), &split, MISS, last_modified.as_deref());
        let resp =
            described(resp.status(StatusCode::OK), laid.content_type, laid.len, &laid.shape, dtype, laid.source_bytes);
        let body = if head {
            Body::empty()
        } else {
            // A body that ends short of its length (the computation failed) ends the connection.
            // It holds the read-through's end, and with it the output's memory reservation,
            // until it is sent or dropped.
            Body::from_stream(futures_util::stream::unfold((rx, done), |(mut rx, done)| async move {
                rx.recv().await.map(|bytes| (Ok::<_, BoxError>(bytes), (rx, done)))
            }))
        };
        resp.body(body).map_err(internal)
    }
}

/// The request's method, URI, version and headers, owned by the task that reads and computes
/// for it.
fn owned_parts(parts: &Parts) -> Parts {
    let (mut owned, ()) = Request::new(()).into_parts();
    owned.method = parts.method.clone();
    owned.uri = parts.uri.clone();
    owned.version = parts.version;
    owned.headers = parts.headers.clone();
    owned
}

fn internal(e: impl std::fmt::Display) -> GatewayError {
    PushdownError::Internal(format!("a streamed output: {e}")).into()
}
