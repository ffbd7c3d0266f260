//! The request path, as phases: route → admit ([`admit`]) → authenticate → dispatch (passthrough:
//! prepare the body and forward; pushdown: [`pushdown`], to the owner or through the cache) →
//! respond. Errors of any phase become S3 XML in `crate::error`, and each request is logged once,
//! here.

pub mod admit;
mod alias;
pub mod owner;
mod post_object;
mod pushdown;
mod source;
mod transparent;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::Stream;
use http::{HeaderMap, HeaderValue, Method, Request, Response};
use http_body_util::BodyDataStream;
use time::OffsetDateTime;

use crate::backend::{
    Backend, ForwardPayload, ForwardRequest, forwarded_headers, forwarded_query, fs::strip_aws_chunked,
};
use crate::body::{Body, BodyError, Checksummed, Guarded, Metered, WithholdTail};
use crate::cache::TensorCache;
use crate::error::GatewayError;
use crate::metrics::Metrics;
use crate::pushdown::spec::{self as pushdown_spec, PushdownSpec};
use crate::pushdown::{Pushdown, PushdownError};
use crate::s3::checksum::Algorithm;
use crate::s3::credentials::CredentialStore;
use crate::s3::headers::{self, HOP_BY_HOP};
use crate::s3::route::{self, S3Op, Target};
use crate::s3::sigv4::chunked;
use crate::s3::sigv4::verify::{self, Payload, Verified};

/// Largest body of a non-data operation (tagging, multi-delete, multipart completion, bucket
/// configuration) that the gateway reads whole to verify before forwarding. S3 caps these XML
/// documents well below this (a 1000-key DeleteObjects is about 100 KiB; a 10000-part completion
/// about 1 MiB).
pub const MAX_BUFFERED_BODY: u64 = 8 * 1024 * 1024;

/// Object bodies up to this size are verified whole before the store sees the request (one SDK
/// chunk; 1024 in flight hold at most 64 MiB); larger ones stream with their tail withheld.
pub const VERIFY_WHOLE_BELOW: u64 = 64 * 1024;

/// Front-end settings the request path needs.
#[derive(Debug, Clone)]
pub struct FrontConfig {
    pub domains: Vec<String>,
    pub allow_anonymous: bool,
    pub max_body_bytes: u64,
    pub max_in_flight: usize,
    /// A request body frame that does not arrive within this ends the request (`RequestTimeout`).
    pub stall_timeout: Duration,
    /// A body-less request without a response head after this gets `503`.
    pub request_timeout: Duration,
    /// Alias buckets: reading `bucket/key` from one is a pushdown GET of `target/key`.
    pub aliases: HashMap<String, AliasBucket>,
    /// Transparent identity mode: the store authenticates every request, forwarded as signed
    /// (`transparent.rs`; ADR 0013).
    pub transparent: bool,
}

/// A bucket name that stands for (real bucket, model, split, format, dtype), for loaders that
/// cannot add headers or query parameters. Read-only: object reads become pushdown GETs, listings
/// and bucket HEADs go to the real bucket, anything else is refused.
#[derive(Debug, Clone)]
pub struct AliasBucket {
    pub target: String,
    pub spec: PushdownSpec,
}

/// Shared state of the S3 front end.
#[derive(Debug)]
pub struct Gateway {
    cfg: FrontConfig,
    creds: CredentialStore,
    backend: Backend,
    metrics: Metrics,
    admission: Arc<admit::Admission>,
    request_ids: RequestIds,
    pushdown: Option<Arc<Pushdown>>,
    cache: Option<Arc<TensorCache>>,
    routing: Option<owner::Routing>,
}

/// Request ids: a random per-process prefix and a counter. Unique across restarts and replicas
/// with overwhelming probability, and free of a random-number syscall per request.
#[derive(Debug)]
struct RequestIds {
    prefix: u64,
    next: std::sync::atomic::AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        Self { prefix: rand::random(), next: std::sync::atomic::AtomicU64::new(0) }
    }

    fn next(&self) -> RequestId {
        RequestId { prefix: self.prefix, n: self.next.fetch_add(1, Ordering::Relaxed) }
    }
}

/// One request's id, written out only where it is shown (an error body, a log line), not for
/// every request served.
#[derive(Debug, Clone, Copy)]
struct RequestId {
    prefix: u64,
    n: u64,
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016X}{:08X}", self.prefix, self.n)
    }
}

impl Gateway {
    #[must_use]
    pub fn new(
        cfg: FrontConfig,
        creds: CredentialStore,
        backend: Backend,
        metrics: Metrics,
        pushdown: Option<Arc<Pushdown>>,
        cache: Option<Arc<TensorCache>>,
    ) -> Self {
        let admission = Arc::new(admit::Admission::new(cfg.max_in_flight));
        Self { cfg, creds, backend, metrics, admission, request_ids: RequestIds::new(), pushdown, cache, routing: None }
    }

    /// Makes this gateway a cluster member that routes pushdowns to their owners.
    #[must_use]
    pub fn with_routing(mut self, routing: owner::Routing) -> Self {
        self.routing = Some(routing);
        self
    }

    /// Marks the gateway as draining: new requests get `503`, `/readyz` reports not ready.
    pub fn begin_shutdown(&self) {
        self.admission.begin_shutdown();
    }

    #[must_use]
    pub fn is_shutting_down(&self) -> bool {
        self.admission.is_draining()
    }

    /// Admission state (shared with the admin API's `/readyz`).
    #[must_use]
    pub fn admission(&self) -> &Arc<admit::Admission> {
        &self.admission
    }

    #[must_use]
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The tensor cache, when enabled.
    #[must_use]
    pub fn cache(&self) -> Option<&Arc<TensorCache>> {
        self.cache.as_ref()
    }

    /// The pushdown service, when enabled.
    #[must_use]
    pub fn pushdown(&self) -> Option<&Arc<Pushdown>> {
        self.pushdown.as_ref()
    }

    /// Handles one S3 request. Never fails: errors become S3 XML responses.
    pub async fn handle(self: Arc<Self>, req: Request<Body>) -> Response<Body> {
        let started = Instant::now();
        let request_id = self.request_ids.next();
        let head = req.method() == Method::HEAD;
        let in_flight = self.metrics.in_flight_guard();
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri().authority().map(http::uri::Authority::as_str));
        let method = req.method().clone();
        let routed = route::resolve(host, req.uri().path(), &self.cfg.domains).map(|t| {
            let op = route::classify(req.method(), &t, req.uri().query(), req.headers());
            (t, op)
        });
        let (target, op) =
            routed.as_ref().map_or_else(|_| (Target::default(), S3Op::Other), |(t, op)| (t.clone(), *op));
        // The admitted request's place rides the response body (released with `in_flight`).
        let mut admitted = None;
        let result = match routed {
            Ok((t, op)) => match self.admission.admit(&self.metrics) {
                Ok(place) => {
                    admitted = Some(place);
                    self.dispatch(req, t, op).await
                }
                Err(e) => Err(e),
            },
            Err(e) => Err(e.into()),
        };
        let (mut resp, identity, err) = match result {
            Ok((resp, identity)) => (resp, identity, None),
            Err(e) => {
                let msg = e.to_string();
                (e.into_response(&target.resource(), &request_id.to_string(), head), String::from("-"), Some(msg))
            }
        };
        let status = resp.status();
        self.metrics.observe_request(op, status, started.elapsed());
        if status.is_server_error() {
            tracing::warn!(%request_id, op = op.name(), %method, bucket = target.bucket.as_deref().unwrap_or("-"), %identity, status = status.as_u16(), error = err.as_deref().unwrap_or("-"), "Request failed.");
        } else {
            tracing::debug!(%request_id, op = op.name(), %method, bucket = target.bucket.as_deref().unwrap_or("-"), %identity, status = status.as_u16(), elapsed_ms = started.elapsed().as_millis() as u64, "Request served.");
        }
        for h in HOP_BY_HOP {
            resp.headers_mut().remove(*h);
        }
        let counter = self.metrics.response_bytes.clone();
        resp.map(|b| Body::new(Metered::new(b, counter, (in_flight, admitted))))
    }

    /// Runs an admitted request under its deadline: a request with a body must keep it coming
    /// (each frame within `stall_timeout`); one without must be answered within `request_timeout`,
    /// except server-side copies, which a store may legitimately take longer over for a large
    /// object (the backend's own timeouts bound them).
    async fn dispatch(
        &self,
        req: Request<Body>,
        target: Target,
        op: S3Op,
    ) -> Result<(Response<Body>, String), GatewayError> {
        let has_body = req.headers().contains_key(http::header::TRANSFER_ENCODING)
            || req.headers().get(http::header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() != b"0");
        if has_body {
            let stall = self.cfg.stall_timeout;
            return self.forward(req.map(|b| Body::new(crate::edge::StallingBody::new(b, stall))), target, op).await;
        }
        if matches!(op, S3Op::CopyObject | S3Op::UploadPartCopy) {
            return self.forward(req, target, op).await;
        }
        let limit = self.cfg.request_timeout;
        match tokio::time::timeout(limit, self.forward(req, target, op)).await {
            Ok(r) => r,
            Err(_) => {
                self.metrics.request_timeouts.inc();
                Err(GatewayError::RequestTimeout { secs: limit.as_secs() })
            }
        }
    }

    async fn forward(
        &self,
        req: Request<Body>,
        target: Target,
        op: S3Op,
    ) -> Result<(Response<Body>, String), GatewayError> {
        if self.cfg.transparent {
            return self.forward_as_sent(req, target, op).await;
        }
        if op == S3Op::PostObject {
            if target.bucket.as_ref().is_some_and(|b| self.cfg.aliases.contains_key(b)) {
                return Err(GatewayError::AliasReadOnly);
            }
            // Authenticated by the form's signed policy, not by headers.
            return self.post_object(req, target).await;
        }
        let (parts, body) = req.into_parts();
        let Verified { identity, authority, payload, .. } = verify::verify(
            &parts.method,
            &parts.uri,
            target.bucket.as_deref().filter(|_| target.virtual_host),
            &parts.headers,
            &self.creds,
            self.cfg.allow_anonymous,
            OffsetDateTime::now_utc(),
        )?;
        let (identity, authority, via_peer) = match &self.routing {
            Some(r) => r.acting_identity(identity, authority, &parts.headers),
            None => (identity, authority, false),
        };
        let requested = pushdown_spec::parse(&parts.headers, parts.uri.query())?;
        let alias = target.bucket.as_ref().and_then(|b| self.cfg.aliases.get(b)).cloned();
        let mut target = target;
        if let Some(alias) = &alias {
            if requested.is_some() {
                return Err(PushdownError::InvalidArgument {
                    field: "model".into(),
                    message: "the alias bucket already names the model and split".into(),
                }
                .into());
            }
            if !matches!(
                op,
                S3Op::GetObject
                    | S3Op::HeadObject
                    | S3Op::ListObjects
                    | S3Op::ListObjectsV2
                    | S3Op::HeadBucket
                    | S3Op::GetBucketLocation
            ) {
                return Err(GatewayError::AliasReadOnly);
            }
            target.bucket = Some(alias.target.clone());
        }
        let (job, planned_none) = match requested.or_else(|| alias.as_ref().map(|a| a.spec.clone())) {
            Some(spec) if matches!(op, S3Op::GetObject | S3Op::HeadObject) => {
                let job = self.prepare(spec, identity.name())?;
                let none = job.is_none();
                (job, none)
            }
            _ => (None, false),
        };
        if via_peer && job.is_none() {
            // Least privilege: the hop credential reaches the store only for a pushdown.
            return Err(GatewayError::PeerOnlyPushdown);
        }
        if let Some(job) = job {
            let resp = self.pushdown_phase(&parts, target, job, (identity.name(), &authority), via_peer).await?;
            return Ok((resp, identity.name().to_owned()));
        }
        let mut headers = forwarded_headers(&parts.headers);
        let declared = content_length(&parts.headers)?;
        let limit = self.cfg.max_body_bytes;
        let has_body = declared.is_some_and(|n| n > 0) || parts.headers.contains_key(http::header::TRANSFER_ENCODING);
        let counted = Metered::new(body, self.metrics.request_bytes.clone(), ());
        // A checksum header on object data that the store will not check: the gateway does.
        let header_checksum = (matches!(op, S3Op::PutObject | S3Op::UploadPart)
            && !self.backend.passes_trailing_checksums())
        .then(|| header_checksum(&parts.headers))
        .flatten();
        let (body, fwd_payload) = match payload {
            _ if !has_body => (Body::empty(), ForwardPayload::Empty),
            // A store that requires Content-MD5 here (Swift's s3api) gets one, so clients that no
            // longer send it (boto3 >= 1.36) work; the body is small XML.
            Payload::Unsigned if op == S3Op::DeleteObjects => {
                check_declared(declared, limit)?;
                let data = BodyDataStream::new(Guarded::new(counted, limit, None));
                self.prepared_body(op, data, declared.unwrap_or_default(), &mut headers, None).await?
            }
            Payload::Unsigned if header_checksum.is_some() && declared.is_some() => {
                check_declared(declared, limit)?;
                let data = checked(BodyDataStream::new(Guarded::new(counted, limit, None)), header_checksum);
                self.prepared_body(op, data, declared.unwrap_or_default(), &mut headers, None).await?
            }
            Payload::Unsigned => {
                check_declared(declared, limit)?;
                (Body::new(Guarded::new(counted, limit, None)), ForwardPayload::Unsigned)
            }
            Payload::Sha256(expected) => {
                check_declared(declared, limit)?;
                let data = checked(BodyDataStream::new(Guarded::new(counted, limit, Some(expected))), header_checksum);
                let signed = Some(hex::encode(expected));
                self.prepared_body(op, data, declared.unwrap_or_default(), &mut headers, signed).await?
            }
            Payload::Chunked(mode)
                if mode.signer.is_none() && declared.is_some() && self.backend.passes_trailing_checksums() =>
            {
                // Unsigned chunks to a store that checks trailing checksums: passed through
                // untouched, so the store checks (and keeps) the client's own checksum. The
                // framing adds little; bound it by twice the limit.
                check_declared(Some(mode.decoded_length), limit)?;
                (Body::new(Guarded::new(counted, limit.saturating_mul(2), None)), ForwardPayload::UnsignedTrailer)
            }
            Payload::Chunked(mode) => {
                check_declared(Some(mode.decoded_length), limit)?;
                // The store will not see the trailer: the gateway checks the client's checksum.
                let checksum = match (mode.trailer, parts.headers.get(headers::X_AMZ_TRAILER)) {
                    (true, Some(v)) => Some(
                        v.to_str()
                            .ok()
                            .and_then(Algorithm::from_header)
                            .ok_or(GatewayError::InvalidHeader(headers::X_AMZ_TRAILER))?,
                    ),
                    _ => None,
                };
                decoded_headers(&mut headers);
                let decoded_length = mode.decoded_length;
                let data = chunked::decode(Guarded::new(counted, limit.saturating_mul(2), None), mode, checksum);
                self.prepared_body(op, checked(data, header_checksum), decoded_length, &mut headers, None).await?
            }
        };
        // An alias listing's entries each may cost a pushdown: its pages are bounded.
        let listing = alias.filter(|_| matches!(op, S3Op::ListObjects | S3Op::ListObjectsV2));
        let query = match &listing {
            Some(_) => Some(Self::alias_listing_query(parts.uri.query())),
            None => forwarded_query(parts.uri.query()),
        };
        let fwd = ForwardRequest {
            op,
            method: parts.method,
            target,
            query,
            headers,
            body,
            payload: fwd_payload,
            authority: authority.clone(),
            expect_continue: expects_continue(&parts.headers),
        };
        let mut resp = self.send_passthrough(fwd, planned_none).await?;
        if let Some(alias) = &listing {
            resp = self.alias_listing(resp, alias, (identity.name(), &authority)).await?;
        }
        Ok((resp, identity.name().to_owned()))
    }

    /// Sends a passthrough request; then what a write may have changed is invalidated in the
    /// cache, and an answer that `split=auto` planned as no pushdown is marked.
    async fn send_passthrough(&self, fwd: ForwardRequest, planned_none: bool) -> Result<Response<Body>, GatewayError> {
        let written = written_scope(fwd.op, &fwd.target);
        let result = self.backend.send(fwd).await;
        invalidate_after(self.cache.as_deref(), written, &result);
        let mut resp = result?;
        if planned_none {
            // The plain object, marked so that a client knows to decode it itself.
            resp.headers_mut().insert("x-tensorgate-split", HeaderValue::from_static(crate::planner::NO_PUSHDOWN));
        }
        Ok(resp)
    }

    /// Prepares a body whose integrity the gateway checks while it streams (a signed payload hash,
    /// signed chunks, a trailing checksum) for the store, framed as every store accepts it: a plain
    /// body with an exact `Content-Length` (ADR 0007).
    /// - object data (`PutObject`, `UploadPart`) over [`VERIFY_WHOLE_BELOW`] streams: the store
    ///   request starts once the first verified bytes are here, and the last byte is withheld
    ///   until every check passed ([`WithholdTail`]), so a body found bad is cut short of its
    ///   `Content-Length` and the store commits nothing. A payload hash the client signed is
    ///   forwarded as the store's `x-amz-content-sha256`, so stores that check it (Ceph RGW,
    ///   Swift, AWS) check it again;
    /// - anything else (XML bodies: tagging, multi-delete, completion; small objects) is read
    ///   whole, verified, then forwarded with its hash, and (except for object data) a
    ///   `Content-MD5` when the client sent none (Swift's s3api requires one on `DeleteObjects`,
    ///   which boto3 >= 1.36 omits).
    async fn prepared_body<S>(
        &self,
        op: S3Op,
        mut data: S,
        decoded_length: u64,
        headers: &mut HeaderMap,
        signed_sha256: Option<String>,
    ) -> Result<(Body, ForwardPayload), GatewayError>
    where
        S: Stream<Item = Result<Bytes, BodyError>> + Send + Unpin + 'static,
    {
        use futures_util::StreamExt;
        if decoded_length > VERIFY_WHOLE_BELOW && matches!(op, S3Op::PutObject | S3Op::UploadPart) {
            // At least two verified bytes before the store hears of the request: one to send, one
            // to withhold (see `WithholdTail` for why the store must see a byte before a refusal).
            let mut head = Vec::new();
            let mut got = 0;
            while got < 2 {
                match data.next().await {
                    Some(chunk) => {
                        let chunk = chunk?;
                        got += chunk.len();
                        head.push(Ok(chunk));
                    }
                    None => break,
                }
            }
            headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(decoded_length));
            let payload = signed_sha256.map_or(ForwardPayload::Unsigned, ForwardPayload::Sha256);
            let body = futures_util::stream::iter(head).chain(data);
            return Ok((Body::from_stream(WithholdTail::new(body)), payload));
        }
        if decoded_length > MAX_BUFFERED_BODY {
            return Err(GatewayError::EntityTooLarge { declared: decoded_length, limit: MAX_BUFFERED_BODY });
        }
        let mut buf = bytes::BytesMut::new();
        while let Some(chunk) = data.next().await {
            buf.extend_from_slice(&chunk?);
            if buf.len() as u64 > MAX_BUFFERED_BODY {
                return Err(BodyError::TooLarge { limit: MAX_BUFFERED_BODY }.into());
            }
        }
        let buf = buf.freeze();
        headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(buf.len()));
        // Object data needs none: its hash is signed below, and stores check that (or the gateway
        // checked the client's hash or checksum already).
        if !headers.contains_key(headers::CONTENT_MD5) && !matches!(op, S3Op::PutObject | S3Op::UploadPart) {
            use base64::Engine;
            use md5::Digest;
            let md5 = base64::engine::general_purpose::STANDARD.encode(md5::Md5::digest(&buf));
            if let Ok(v) = HeaderValue::from_str(&md5) {
                headers.insert(headers::CONTENT_MD5, v);
            }
        }
        let hash = crate::s3::sigv4::sha256_hex(&buf);
        Ok((Body::from(buf), ForwardPayload::Sha256(hash)))
    }
}

/// The first `x-amz-checksum-<alg>` header of a known algorithm, with its value.
fn header_checksum(h: &HeaderMap) -> Option<(Algorithm, String)> {
    h.iter().find_map(|(name, value)| Some((Algorithm::from_header(name.as_str())?, value.to_str().ok()?.to_owned())))
}

/// A payload stream, checked against `checksum` when there is one.
fn checked<S>(
    data: S,
    checksum: Option<(Algorithm, String)>,
) -> std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>
where
    S: Stream<Item = Result<Bytes, BodyError>> + Send + 'static,
{
    match checksum {
        Some((algorithm, expected)) => Box::pin(Checksummed::new(data, algorithm, expected)),
        None => Box::pin(data),
    }
}

/// Headers of a request whose `aws-chunked` body the gateway decoded: the framing headers go, and
/// so does `x-amz-sdk-checksum-algorithm` unless a checksum header is still sent with it (S3
/// refuses the algorithm without its value).
fn decoded_headers(headers: &mut HeaderMap) {
    for h in [headers::X_AMZ_DECODED_CONTENT_LENGTH, headers::X_AMZ_TRAILER] {
        headers.remove(h);
    }
    strip_aws_chunked(headers);
    if !headers.keys().any(|k| k.as_str().starts_with("x-amz-checksum-") && k.as_str() != "x-amz-checksum-type") {
        headers.remove(headers::X_AMZ_SDK_CHECKSUM_ALGORITHM);
    }
}

/// Whether the client asked `Expect: 100-continue` (the store is then asked the same).
fn expects_continue(h: &HeaderMap) -> bool {
    h.get(http::header::EXPECT).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
}

/// After a write's answer: a write that may have landed (the store said yes, or the answer was
/// lost) bumps the cache generation of what it may have changed, so any output computed from the
/// old bytes carries an older generation (see `crate::cache`). A refused write (`4xx`) changed
/// nothing, so it cannot evict anyone's cached outputs.
fn invalidate_after(
    cache: Option<&TensorCache>,
    written: Option<(String, Option<String>)>,
    result: &Result<Response<Body>, crate::backend::BackendError>,
) {
    if matches!(result, Ok(r) if r.status().is_client_error()) {
        return;
    }
    if let (Some(cache), Some((bucket, key))) = (cache, written) {
        match key {
            Some(k) => cache.object_written(&bucket, &k),
            None => cache.bucket_written(&bucket),
        }
    }
}

/// The objects a write may change, for cache invalidation: `(bucket, Some(key))` for one object,
/// `(bucket, None)` for an unknown set (multi-object delete, bucket delete).
fn written_scope(op: S3Op, target: &Target) -> Option<(String, Option<String>)> {
    let bucket = target.bucket.clone()?;
    match op {
        S3Op::PutObject | S3Op::CopyObject | S3Op::DeleteObject | S3Op::CompleteMultipartUpload => {
            Some((bucket, Some(target.key.clone()?)))
        }
        S3Op::DeleteObjects | S3Op::DeleteBucket => Some((bucket, None)),
        _ => None,
    }
}

fn content_length(h: &HeaderMap) -> Result<Option<u64>, GatewayError> {
    match h.get(http::header::CONTENT_LENGTH) {
        None => Ok(None),
        Some(v) => {
            v.to_str().ok().and_then(|s| s.parse().ok()).map(Some).ok_or(GatewayError::InvalidHeader("content-length"))
        }
    }
}

fn check_declared(declared: Option<u64>, limit: u64) -> Result<(), GatewayError> {
    match declared {
        Some(n) if n > limit => Err(GatewayError::EntityTooLarge { declared: n, limit }),
        _ => Ok(()),
    }
}
