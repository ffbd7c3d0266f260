//! The request path, as phases: route → admit ([`admit`]) → authenticate → dispatch (passthrough:
//! prepare the body and forward; pushdown: `crate::pushdown::serve`) → respond. Errors of any
//! phase become S3 XML in `crate::error`, and each request is logged once, here.

pub mod admit;
mod post_object;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, Method, Request, Response};
use time::OffsetDateTime;

use http_body_util::BodyExt;

use crate::backend::{Backend, BackendError, ForwardPayload, ForwardRequest, fs::strip_aws_chunked};
use crate::pushdown::spec::{self as pushdown_spec, PushdownSpec};
use crate::pushdown::{Pushdown, PushdownError};
use bytes::Bytes;
use futures_util::Stream;
use http_body_util::BodyDataStream;

use crate::body::{Body, BodyError, Checksummed, Guarded, Metered, WithholdTail};
use crate::cache::{CacheKey, Cached, Entry, Lookup, ObjectId, TensorCache, Tier};
use crate::error::GatewayError;
use crate::metrics::Metrics;
use crate::s3::checksum::Algorithm;
use crate::s3::credentials::CredentialStore;
use crate::s3::headers::{self, CLIENT_AUTH, HOP_BY_HOP, PRESIGN_QUERY};
use crate::s3::route::{self, S3Op, Target};
use crate::s3::sigv4::chunked;
use crate::s3::sigv4::verify::{self, Identity, Payload, Verified};
use crate::s3::sigv4::{uri_decode, uri_encode};

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
    admission: admit::Admission,
    request_ids: RequestIds,
    pushdown: Option<Arc<Pushdown>>,
    cache: Option<Arc<TensorCache>>,
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

    fn next(&self) -> String {
        format!("{:016X}{:08X}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
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
        let admission = admit::Admission::new(cfg.max_in_flight);
        Self { cfg, creds, backend, metrics, admission, request_ids: RequestIds::new(), pushdown, cache }
    }

    /// Marks the gateway as draining: new requests get `503`, `/readyz` reports not ready.
    pub fn begin_shutdown(&self) {
        self.admission.begin_shutdown();
    }

    #[must_use]
    pub fn is_shutting_down(&self) -> bool {
        self.admission.is_draining()
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
            .map(str::to_owned)
            .or_else(|| req.uri().authority().map(|a| a.to_string()));
        let method = req.method().clone();
        let routed = route::resolve(host.as_deref(), req.uri().path(), &self.cfg.domains).map(|t| {
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
                (e.into_response(&target.resource(), &request_id, head), String::from("-"), Some(msg))
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
    /// (each frame within `stall_timeout`); one without must be answered within `request_timeout`.
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
        if op == S3Op::PostObject {
            if target.bucket.as_ref().is_some_and(|b| self.cfg.aliases.contains_key(b)) {
                return Err(GatewayError::AliasReadOnly);
            }
            // Authenticated by the form's signed policy, not by headers.
            return self.post_object(req, target).await;
        }
        let (parts, body) = req.into_parts();
        let Verified { identity, payload, .. } = verify::verify(
            &parts.method,
            &parts.uri,
            target.bucket.as_deref().filter(|_| target.virtual_host),
            &parts.headers,
            &self.creds,
            self.cfg.allow_anonymous,
            OffsetDateTime::now_utc(),
        )?;
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
        let spec = match requested.or_else(|| alias.map(|a| a.spec)) {
            Some(spec) if matches!(op, S3Op::GetObject | S3Op::HeadObject) => self.resolve_auto(spec)?,
            _ => None,
        };
        if let Some((spec, plan)) = spec {
            let mut resp = self.pushdown_get(&parts, target, spec, &identity).await?;
            if let Some(v) = plan.and_then(|p| HeaderValue::from_str(&p).ok()) {
                resp.headers_mut().insert("x-tensorgate-plan", v);
            }
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
        let written = self.cache.as_ref().and_then(|c| written_scope(op, &target).map(|w| (c.clone(), w)));
        let fwd = ForwardRequest {
            op,
            method: parts.method,
            target,
            query: forwarded_query(parts.uri.query()),
            headers,
            body,
            payload: fwd_payload,
            anonymous: identity == Identity::Anonymous,
            expect_continue: parts
                .headers
                .get(http::header::EXPECT)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue")),
        };
        let result = self.backend.send(fwd).await;
        // After the backend answered (or failed: the write may still have landed), so any output
        // computed from the old bytes carries an older generation (see `crate::cache`).
        if let Some((cache, (bucket, key))) = written {
            match key {
                Some(k) => cache.object_written(&bucket, &k),
                None => cache.bucket_written(&bucket),
            }
        }
        Ok((result?, identity.name().to_owned()))
    }

    /// Resolves `split=auto` to the model's planned split (`x-tensorgate-plan` lists the predicted
    /// epoch seconds per candidate); `None` when the plan says no pushdown (a plain GET).
    fn resolve_auto(&self, mut spec: PushdownSpec) -> Result<Option<(PushdownSpec, Option<String>)>, GatewayError> {
        if spec.split != crate::planner::AUTO {
            return Ok(Some((spec, None)));
        }
        let pd =
            self.pushdown.as_ref().ok_or_else(|| PushdownError::Unavailable("disabled by configuration".into()))?;
        let (split, plan) = pd.auto_split(&spec.model).ok_or_else(|| PushdownError::UnknownModel {
            name: spec.model.clone(),
            known: pd.registry().names().join(", "),
        })?;
        if split == crate::planner::NO_PUSHDOWN {
            return Ok(None);
        }
        let summary = plan.map(|p| {
            let parts: Vec<String> =
                p.candidates.iter().filter_map(|c| c.epoch_secs.map(|t| format!("{}={t:.3}", c.split))).collect();
            parts.join(";")
        });
        spec.split = split;
        Ok(Some((spec, summary)))
    }

    /// A GET (or HEAD) that names a model and a split: answer from the tensor cache, or fetch the
    /// object, run the prefix and cache the tensor. Backend errors (e.g. `NoSuchKey`) pass through
    /// as for a plain GET. See `crate::cache` for when a cached tensor is served without asking.
    async fn pushdown_get(
        &self,
        parts: &http::request::Parts,
        target: Target,
        spec: PushdownSpec,
        identity: &Identity,
    ) -> Result<Response<Body>, GatewayError> {
        let tenant = identity.name();
        // An anonymous reader may read an object only if the store says so on this request, so
        // its output is never served from the cache without asking (unsigned) first.
        let anonymous = *identity == Identity::Anonymous;
        let pd =
            self.pushdown.as_ref().ok_or_else(|| PushdownError::Unavailable("disabled by configuration".into()))?;
        pd.available().map_err(|r| PushdownError::Unavailable(r.to_owned()))?;
        let (model, split) = pd.resolve(&spec)?;
        let mut headers = forwarded_headers(&parts.headers);
        let names: Vec<http::HeaderName> = headers.keys().filter(|k| is_output_scoped(k.as_str())).cloned().collect();
        for name in names {
            headers.remove(name);
        }
        let query = forwarded_query(parts.uri.query()).and_then(|q| {
            let kept: Vec<&str> = q.split('&').filter(|p| !p.starts_with(pushdown_spec::QUERY_PREFIX)).collect();
            (!kept.is_empty()).then(|| kept.join("&"))
        });
        let key = CacheKey {
            object: ObjectId {
                bucket: target.bucket.clone().unwrap_or_default(),
                key: target.key.clone().unwrap_or_default(),
                query: query.clone().unwrap_or_default(),
            },
            variant: format!("{}|{split}|{:?}|{}", model.digest, spec.format, spec.dtype.name()),
        };
        // Objects encrypted with a customer key are never cached: a hit would skip the backend's
        // key check.
        let cache = self.cache.as_deref().filter(|_| !parts.headers.contains_key(headers::SSE_CUSTOMER_KEY));

        let mut revalidating = None;
        let (mut _flight, mut generation) = (None, 0);
        if let Some(cache) = cache {
            if let Lookup::Fresh(e, tier) = cache.lookup(&key).await
                && !anonymous
            {
                return served_from(cache, parts, &key, &e, CacheStatus::Hit(tier));
            }
            // One request per key fetches and computes; the rest wait here and then hit.
            _flight = Some(cache.flight(&key).await);
            generation = cache.generation(&key.object);
            match cache.lookup(&key).await {
                Lookup::Fresh(e, tier) if !anonymous => {
                    return served_from(cache, parts, &key, &e, CacheStatus::Hit(tier));
                }
                Lookup::Fresh(e, tier) | Lookup::Stale(e, tier) => {
                    if let Ok(v) = HeaderValue::from_str(&e.data.source_etag) {
                        headers.insert(http::header::IF_NONE_MATCH, v);
                    }
                    revalidating = Some((e, tier));
                }
                Lookup::Miss => {}
            }
        }

        let fetch_start = Instant::now();
        let fwd = ForwardRequest {
            op: S3Op::GetObject,
            method: Method::GET,
            target,
            query,
            headers,
            body: Body::empty(),
            payload: ForwardPayload::Empty,
            anonymous,
            expect_continue: false,
        };
        let resp = self.backend.send(fwd).await?;
        let source_etag =
            resp.headers().get(http::header::ETAG).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        if let (Some(cache), Some((entry, tier))) = (cache, revalidating) {
            let outcome = if resp.status() == http::StatusCode::NOT_MODIFIED
                || (resp.status().is_success() && source_etag == entry.data.source_etag)
            {
                cache.validated(&entry, generation);
                "unchanged"
            } else if resp.status().is_success() {
                "changed"
            } else {
                "gone"
            };
            cache.record_revalidation(outcome);
            if outcome == "unchanged" {
                return served_from(cache, parts, &key, &entry, CacheStatus::Revalidated(tier));
            }
            cache.remove(&key).await;
        }
        if !resp.status().is_success() {
            return Ok(if parts.method == Method::HEAD { resp.map(|_| Body::empty()) } else { resp });
        }
        let limit = pd.max_object_bytes();
        // The object counts against the pushdown memory budget from now until the response is sent.
        let declared = content_length(resp.headers()).ok().flatten().unwrap_or(0).min(limit);
        let object_hold = pd.governor().hold(declared).await?;
        // The output is as fresh as its source (clients such as `aws s3 cp` require the header).
        let source_last_modified =
            resp.headers().get(http::header::LAST_MODIFIED).and_then(|v| v.to_str().ok()).map(str::to_owned);
        // The read is bounded in time too: it holds the key's flight and a budget hold.
        let read =
            http_body_util::Limited::new(resp.into_body(), usize::try_from(limit).unwrap_or(usize::MAX)).collect();
        let object = match tokio::time::timeout(pd.source_timeout(), read).await {
            Err(_) => return Err(BackendError::Timeout { secs: pd.source_timeout().as_secs() }.into()),
            Ok(Ok(c)) => c.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(PushdownError::ObjectTooLarge { limit }.into());
            }
            Ok(Err(e)) => return Err(BackendError::SendBody { source: e }.into()),
        };
        let fetch = fetch_start.elapsed();
        let source_bytes = object.len();
        let mut out = pd.compute(&spec, object, tenant).await?;
        let mut reservation = std::mem::take(&mut out.reservation);
        reservation.push(object_hold);
        self.metrics.observe_pushdown(
            &spec.model,
            &out.split,
            source_bytes,
            out.body.len(),
            [fetch, out.decode, out.infer, out.encode],
        );
        let timing = format!(
            "fetch;dur={:.3}, decode;dur={:.3}, infer;dur={:.3}, encode;dur={:.3}",
            fetch.as_secs_f64() * 1e3,
            out.decode.as_secs_f64() * 1e3,
            out.infer.as_secs_f64() * 1e3,
            out.encode.as_secs_f64() * 1e3
        );
        let data = Arc::new(Cached {
            body: out.body,
            content_type: out.content_type.to_owned(),
            shape: out.shape,
            split: out.split,
            dtype: spec.dtype.name().to_owned(),
            source_etag,
            source_last_modified,
            source_bytes: source_bytes as u64,
        });
        if let Some(cache) = cache {
            cache.record_miss();
            cache.insert(key.clone(), data.clone(), generation).await;
        }
        let resp = output_response(parts, &key, &data, CacheStatus::Miss, Some(timing))?;
        // Sending the body ends the reservation (a client gone mid-download ends it too).
        Ok(resp
            .map(|b| Body::new(Metered::new(b, prometheus_client::metrics::counter::Counter::default(), reservation))))
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
    ///   whole, verified, then forwarded with its hash, and a `Content-MD5` when the client sent
    ///   none (Swift's s3api requires one on `DeleteObjects`, which boto3 >= 1.36 omits).
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
        if !headers.contains_key(headers::CONTENT_MD5) {
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

/// Where a pushdown output came from (`x-tensorgate-cache`).
#[derive(Debug, Clone, Copy)]
enum CacheStatus {
    Miss,
    Hit(Tier),
    /// Cached, served after the backend confirmed the source is unchanged.
    Revalidated(Tier),
}

/// Answers from a cache entry and counts the hit.
fn served_from(
    cache: &TensorCache,
    parts: &http::request::Parts,
    key: &CacheKey,
    entry: &Entry,
    status: CacheStatus,
) -> Result<Response<Body>, GatewayError> {
    if let CacheStatus::Hit(tier) | CacheStatus::Revalidated(tier) = status {
        cache.record_hit(tier, entry.data.body.len());
    }
    output_response(parts, key, &entry.data, status, None)
}

/// The response for a pushdown output, honouring `HEAD` and `Range`. The ETag names the source
/// version and the variant, so it changes exactly when the output can.
fn output_response(
    parts: &http::request::Parts,
    key: &CacheKey,
    data: &Cached,
    status: CacheStatus,
    timing: Option<String>,
) -> Result<Response<Body>, GatewayError> {
    let etag = format!(
        "\"{}\"",
        &crate::s3::sigv4::sha256_hex(format!("{}|{}", data.source_etag, key.variant).as_bytes())[..32]
    );
    let (cache, tier) = match status {
        CacheStatus::Miss => ("miss", None),
        CacheStatus::Hit(t) => ("hit", Some(t)),
        CacheStatus::Revalidated(t) => ("revalidated", Some(t)),
    };
    if none_match(&parts.headers, &etag) {
        // The client holds this output already (a compute-tier copy from an earlier epoch).
        let mut resp = Response::builder()
            .status(http::StatusCode::NOT_MODIFIED)
            .header(http::header::ETAG, etag)
            .header("x-tensorgate-split", &data.split)
            .header("x-tensorgate-cache", cache);
        if let Some(lm) = &data.source_last_modified {
            resp = resp.header(http::header::LAST_MODIFIED, lm);
        }
        return resp.body(Body::empty()).map_err(|e| PushdownError::Internal(e.to_string()).into());
    }
    let len = data.body.len();
    let (code, body, range) = match parts.headers.get(http::header::RANGE).and_then(|v| v.to_str().ok()) {
        Some(r) => match byte_range(r, len) {
            Some((a, b)) => {
                (http::StatusCode::PARTIAL_CONTENT, data.body.slice(a..=b), Some(format!("bytes {a}-{b}/{len}")))
            }
            None => return Err(GatewayError::InvalidRange { size: len }),
        },
        None => (http::StatusCode::OK, data.body.clone(), None),
    };
    let shape: Vec<String> = data.shape.iter().map(ToString::to_string).collect();
    let mut resp = Response::builder()
        .status(code)
        .header(http::header::CONTENT_TYPE, &data.content_type)
        .header(http::header::CONTENT_LENGTH, body.len())
        .header(http::header::ETAG, etag)
        .header(http::header::ACCEPT_RANGES, "bytes")
        .header("x-tensorgate-shape", shape.join(","))
        .header("x-tensorgate-dtype", &data.dtype)
        .header("x-tensorgate-split", &data.split)
        .header("x-tensorgate-source-bytes", data.source_bytes)
        .header("x-tensorgate-cache", cache);
    if let Some(t) = tier {
        resp = resp.header("x-tensorgate-cache-tier", t.name());
    }
    if let Some(t) = timing {
        resp = resp.header("server-timing", t);
    }
    if let Some(r) = range {
        resp = resp.header(http::header::CONTENT_RANGE, r);
    }
    if let Some(lm) = &data.source_last_modified {
        resp = resp.header(http::header::LAST_MODIFIED, lm);
    }
    let body = if parts.method == Method::HEAD { Body::empty() } else { Body::from(body) };
    resp.body(body).map_err(|e| PushdownError::Internal(e.to_string()).into())
}

/// Whether an `If-None-Match` header lists `etag` (or is `*`): RFC 9110's weak comparison, so a
/// `W/` prefix on either side is ignored.
fn none_match(headers: &HeaderMap, etag: &str) -> bool {
    let bare = |t: &str| t.trim().trim_start_matches("W/").to_owned();
    headers
        .get_all(http::header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim() == "*" || bare(t) == bare(etag))
}

/// Headers that apply to the pushdown output, not to the source object: not forwarded.
fn is_output_scoped(name: &str) -> bool {
    name.starts_with(pushdown_spec::HEADER_PREFIX)
        || matches!(name, "range" | "if-match" | "if-none-match" | "if-modified-since" | "if-unmodified-since")
}

/// A single `bytes=a-b`, `bytes=a-` or `bytes=-n` range within `len` bytes, inclusive.
fn byte_range(header: &str, len: usize) -> Option<(usize, usize)> {
    let spec = header.strip_prefix("bytes=")?;
    if spec.contains(',') || len == 0 {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: usize = n.parse().ok()?;
            (len.checked_sub(n.min(len))?, len - 1)
        }
        (a, "") => (a.parse().ok()?, len - 1),
        (a, b) => (a.parse().ok()?, b.parse::<usize>().ok()?.min(len - 1)),
    };
    (start <= end && start < len).then_some((start, end))
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

/// Request headers for the backend: everything but hop-by-hop headers, `host` and the client's
/// authentication (replaced by the backend signature). Unknown headers are kept.
fn forwarded_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = h.clone();
    out.remove(http::header::HOST);
    for name in HOP_BY_HOP.iter().chain(CLIENT_AUTH) {
        out.remove(*name);
    }
    out
}

/// The query for the backend: presigned-URL parameters removed, every parameter re-encoded in
/// SigV4's canonical form (so the backend's canonicalization and ours agree), order kept.
fn forwarded_query(q: Option<&str>) -> Option<String> {
    let q = q?;
    let parts: Vec<String> = q
        .split('&')
        .filter(|p| !p.is_empty())
        .filter_map(|p| {
            let (k, v) = match p.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (p, None),
            };
            let k = uri_decode(k);
            if PRESIGN_QUERY.contains(&k.as_str()) {
                return None;
            }
            Some(match v {
                Some(v) => format!("{}={}", uri_encode(&k), uri_encode(&uri_decode(v))),
                None => uri_encode(&k),
            })
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn if_none_match_compares_weakly_and_lists() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(http::header::IF_NONE_MATCH, HeaderValue::from_str(v).unwrap());
            h
        };
        assert!(none_match(&with("\"abc\""), "\"abc\""));
        assert!(none_match(&with("W/\"abc\""), "\"abc\""));
        assert!(none_match(&with("\"x\", \"abc\""), "\"abc\""));
        assert!(none_match(&with("*"), "\"abc\""));
        assert!(!none_match(&with("\"abd\""), "\"abc\""));
        assert!(!none_match(&HeaderMap::new(), "\"abc\""));
    }

    #[test]
    fn byte_ranges() {
        assert_eq!(byte_range("bytes=0-9", 100), Some((0, 9)));
        assert_eq!(byte_range("bytes=90-", 100), Some((90, 99)));
        assert_eq!(byte_range("bytes=-10", 100), Some((90, 99)));
        assert_eq!(byte_range("bytes=50-500", 100), Some((50, 99)));
        assert_eq!(byte_range("bytes=100-", 100), None);
        assert_eq!(byte_range("bytes=0-1,4-5", 100), None);
        assert_eq!(byte_range("lines=1-2", 100), None);
    }

    #[test]
    fn query_drops_presign_params_and_normalizes() {
        assert_eq!(
            forwarded_query(Some("X-Amz-Signature=abc&uploads&prefix=a%2Fb c")).as_deref(),
            Some("uploads&prefix=a%2Fb%20c")
        );
        assert_eq!(forwarded_query(Some("X-Amz-Date=1")), None);
    }

    #[test]
    fn auth_and_hop_headers_are_not_forwarded_but_unknown_ones_are() {
        let mut h = HeaderMap::new();
        for (k, v) in [
            ("authorization", "x"),
            ("x-amz-date", "d"),
            ("connection", "close"),
            ("x-custom-thing", "kept"),
            ("x-amz-meta-a", "b"),
            ("host", "h"),
        ] {
            h.insert(k, v.parse().expect("value"));
        }
        let out = forwarded_headers(&h);
        assert_eq!(out.len(), 2);
        assert_eq!(out["x-custom-thing"], "kept");
    }
}
