//! The pushdown phase of the request path, for both identity modes: a GET or HEAD that names a
//! model and a split (resolved to a [`Job`] by the caller) goes to the object's owner when
//! another cluster member owns it, else is served here through the tensor cache's read-through
//! ([`TensorCache::get_or_compute`]: the source read is the store's say for this caller, the
//! job computes on a miss). Every response header of a pushdown answer is set here, with `HEAD`,
//! `Range` and `If-None-Match` applied to the output, not the source.

use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, HeaderValue, Method, Response};

use super::source::{Pin, SourceBody, SourceOutcome, SourceRange, SourceRead, SourceReader};
use super::{Caller, Gateway, owner};
use crate::backend::{forwarded_headers, forwarded_query};
use crate::body::{Body, Holding};
use crate::cache::{CacheKey, Cached, Fetched, ObjectId, ReadThrough, TensorCache, Tier};
use crate::error::GatewayError;
use crate::pushdown::spec::{self as pushdown_spec, PushdownSpec};
use crate::pushdown::stream::Streaming;
use crate::pushdown::{Job, PushdownError, table};
use crate::s3::authority::Authority;
use crate::s3::headers;
use crate::s3::route::Target;

/// How a computation streams its output (`super::streamed`): the job's [`Streaming`], made once
/// the source's version (its ETag and `Last-Modified`) is known.
pub(super) type StreamTo = Box<dyn FnOnce(String, Option<String>) -> Streaming + Send + Sync>;

/// `x-tensorgate-augmented`: what an augmented single image drew (`top,left,height,width,flip`).
const AUGMENTED: http::HeaderName = http::HeaderName::from_static("x-tensorgate-augmented");

/// `x-tensorgate-plan`: what `split=auto` predicted per candidate split.
const PLAN: http::HeaderName = http::HeaderName::from_static("x-tensorgate-plan");

impl Gateway {
    /// Resolves a pushdown request ([`crate::pushdown::Pushdown::prepare`]); `None` when
    /// `split=auto` planned no pushdown (then the request is a plain GET).
    /// A model this gateway does not serve yet may have been added since its last read of the
    /// models (another member of a cluster may serve it already): the directory and the models
    /// store are read again, at most once a second (`UNKNOWN_MODEL_RESCAN`), before the request
    /// is refused.
    pub(super) async fn prepare(&self, spec: PushdownSpec, tenant: &str) -> Result<Option<Job>, GatewayError> {
        let pd =
            self.pushdown.as_ref().ok_or_else(|| PushdownError::Unavailable("disabled by configuration".into()))?;
        if !pd.registry().models.contains_key(&spec.model) && pd.rescan_allowed() {
            pd.refresh().await;
        }
        Ok(pd.prepare(spec, tenant)?)
    }

    /// The phase: to the owner (unless this request is a hop from another member, `hop`), else
    /// served here.
    pub(super) async fn pushdown_phase(
        &self,
        parts: &Parts,
        target: Target,
        job: Job,
        caller: Caller<'_>,
        hop: bool,
    ) -> Result<Response<Body>, GatewayError> {
        let Caller { tenant, authority } = caller;
        let plan = job.plan().and_then(|p| HeaderValue::from_str(p).ok());
        let routed = match self.routing.as_ref().filter(|_| !hop) {
            Some(r) => r.route(parts, &target, job.spec(), tenant, authority).await,
            None => None,
        };
        let mut resp = match routed {
            Some(resp) => resp,
            None => {
                let mut resp = self.serve(parts, target, job, authority).await?;
                if let Some(v) = self.routing.as_ref().and_then(|r| HeaderValue::from_str(r.node_id()).ok()) {
                    resp.headers_mut().insert(owner::COMPUTED_BY, v);
                }
                resp
            }
        };
        // Only on an answer the store allowed: a plan is the tenant's, and in transparent mode the
        // access key is a claim until the store accepted the request.
        if let Some(v) = plan.filter(|_| resp.status().is_success() || resp.status() == http::StatusCode::NOT_MODIFIED)
        {
            resp.headers_mut().insert(PLAN, v);
        }
        Ok(resp)
    }

    /// Serves a pushdown here, in phases: the source read prepared ([`SourceSide::of`]), the cache's
    /// read-through ([`Gateway::read_through`]), then the response ([`respond`]); an outlined
    /// output's from its outline (`super::outline`), a shard's streamed where it can be
    /// (`super::streamed`). Backend answers other than the source (`NoSuchKey`, `AccessDenied`)
    /// pass through as for a plain GET.
    async fn serve(
        &self,
        parts: &Parts,
        target: Target,
        mut job: Job,
        authority: &Authority,
    ) -> Result<Response<Body>, GatewayError> {
        job.name_object(target.key.as_deref().unwrap_or_default());
        let side = SourceSide::of(parts, &job, authority)?;
        if job.outlined() {
            return self.serve_outlined(parts, target, job, authority, side).await;
        }
        let key = CacheKey {
            object: ObjectId {
                bucket: target.bucket.clone().unwrap_or_default(),
                key: target.key.clone().unwrap_or_default(),
                query: side.query.clone().unwrap_or_default(),
            },
            variant: job.variant(),
        };
        if Self::streams(parts, &job) {
            return self.serve_streamed(parts, (target, key), job, authority, side).await;
        }
        let read = self.read_through(parts, (target, &key), job, authority, side, None).await?;
        respond(parts, &key, read)
    }

    /// The cache's read-through of a pushdown output ([`TensorCache::get_or_compute`]): the
    /// first read ([`Gateway::first_read`]) is the store's say for this caller, and on a miss
    /// the computation ([`Gateway::compute`]) runs, streaming where `stream` says. See
    /// `crate::cache` for when a cached output is served without asking the store.
    pub(super) async fn read_through(
        &self,
        parts: &Parts,
        (target, key): (Target, &CacheKey),
        job: Job,
        authority: &Authority,
        side: SourceSide,
        stream: Option<StreamTo>,
    ) -> Result<ReadThrough<Response<Body>, Computed>, GatewayError> {
        // When the store decides who may read (an anonymous reader; any caller in transparent
        // mode; every caller when clients have store keys of their own), an output is never
        // served from the cache before the store said yes to this caller on this request.
        let ask_store = authority.store_decides() || self.backend.has_tenant_keys();
        // The caller signed its own method; the gateway reads the source with a GET.
        let method = if side.as_caller { parts.method.clone() } else { Method::GET };
        let reader = &SourceReader {
            backend: &self.backend,
            method,
            target,
            query: side.query,
            headers: side.headers,
            authority: authority.clone(),
        };
        let ranged = side.ranged;
        let single_use = job.spec().augment.is_some();
        let fetch = async move |cached_etag: Option<&str>| self.first_read(parts, reader, ranged, cached_etag).await;
        let compute =
            async move |source: SourceBody| self.compute(parts, job, reader, side.as_caller, source, stream).await;
        // Objects encrypted with a customer key are never cached: a hit would skip the store's
        // key check. An augmented output is cached only when its request repeats (ADR 0032).
        let cache = self
            .cache
            .as_deref()
            .filter(|_| !parts.headers.contains_key(headers::SSE_CUSTOMER_KEY))
            .filter(|c| !single_use || c.repeated(key));
        match cache {
            Some(cache) => cache.get_or_compute(key, ask_store, fetch, compute).await,
            None => TensorCache::uncached(fetch, compute).await,
        }
    }

    /// The first read of a source, as the cache's read-through asks for it: revalidating a
    /// cached output's source (`cached_etag`) where there is one, and for `row-groups` only the
    /// file's tail. In transparent mode the store may answer the caller's own request `416` or
    /// `412` for the `Range` or `If-Match` it signed for the output (`conditions_only`): it
    /// accepted the caller, and the gateway's key reads (or revalidates) that version instead.
    async fn first_read(
        &self,
        parts: &Parts,
        reader: &SourceReader<'_>,
        ranged: bool,
        cached_etag: Option<&str>,
    ) -> Result<Fetched<SourceBody, Response<Body>>, GatewayError> {
        let range = if ranged { SourceRange::Tail(table::TAIL_BYTES) } else { SourceRange::Whole };
        let read = SourceRead { range, if_none_match: cached_etag, ..SourceRead::WHOLE };
        let accepted = match reader.read(read).await? {
            SourceOutcome::Body(body) => return Ok(Fetched::Source { etag: body.etag.clone(), source: body }),
            SourceOutcome::NotModified(resp) => return Ok(Fetched::NotModified(resp)),
            SourceOutcome::Changed(resp) => return Ok(Fetched::Answer(resp)),
            SourceOutcome::Refused(resp) => match reader.conditions_only(resp) {
                SourceOutcome::Body(accepted) => accepted,
                other => return Ok(Fetched::Answer(other.into_response())),
            },
        };
        let delegated = self.delegated(parts, reader, &accepted)?;
        Ok(match read_for_caller(&delegated, accepted, range, cached_etag).await? {
            SourceOutcome::Body(body) => Fetched::Source { etag: body.etag.clone(), source: body },
            other => Fetched::NotModified(other.into_response()),
        })
    }

    /// The computation on a cache miss: the source's body read, then the job run on it (for
    /// `row-groups`, after the groups' span was read: [`Gateway::run_row_groups`]), its costs
    /// counted, and the output made cacheable. With `stream`, a shard's output is streamed
    /// while it is computed (`super::streamed`).
    pub(super) async fn compute(
        &self,
        parts: &Parts,
        mut job: Job,
        reader: &SourceReader<'_>,
        as_caller: bool,
        source: SourceBody,
        stream: Option<StreamTo>,
    ) -> Result<(Arc<Cached>, Computed), GatewayError> {
        let ranged = job.ranged();
        let partial = source.partial();
        // The caller's signed HEAD or Range read the store's answer, not the whole source (a
        // Range the store answered with every byte, `bytes=0-` or a block larger than the
        // object as s3fs and pyarrow ask for small objects, is the whole source): the version
        // the store let this caller read is read whole with the gateway's reader key.
        let source = if as_caller && !source.delegated && (parts.method == Method::HEAD || (partial && !ranged)) {
            let delegated = self.delegated(parts, reader, &source)?;
            read_accepted(&delegated, source).await?
        } else {
            source
        };
        let partial = source.partial();
        let declared = source.header(&http::header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
        // The output is as fresh as its source (clients such as `aws s3 cp` require the header).
        let source_last_modified = source.header(&http::header::LAST_MODIFIED).map(str::to_owned);
        let (started, source_etag, content_range) = (source.started, source.etag, source.content_range);
        if let Some(to) = stream {
            job.stream_to(to(source_etag.clone(), source_last_modified.clone()));
        }
        let spec = job.spec().clone();
        let object = job.read_source(source.resp.into_body(), declared).await?;
        let (fetch, source_bytes, out) = match content_range.filter(|_| partial && ranged) {
            // The tail of a larger file: its footer names the row groups' span, read next.
            Some((offset, _, len)) => {
                Self::run_row_groups(job, reader, &source_etag, (len, offset, object), started).await?
            }
            None => {
                let fetch = started.elapsed().saturating_sub(job.engine_wait());
                (fetch, object.len(), job.run(object).await?)
            }
        };
        Ok(self.computed(&spec, out, (fetch, source_bytes), source_etag, source_last_modified))
    }

    /// Runs a `row-groups` job on a Parquet file whose tail (the bytes from `offset` of `len`)
    /// was read from version `etag`: its footer names the groups' span, read next with
    /// `reader`. Returns the fetch time (since `started`), the source bytes read and the output.
    pub(super) async fn run_row_groups(
        mut job: Job,
        reader: &SourceReader<'_>,
        etag: &str,
        (len, offset, tail): (u64, u64, bytes::Bytes),
        started: std::time::Instant,
    ) -> Result<(std::time::Duration, usize, crate::pushdown::Output), GatewayError> {
        let tail_bytes = tail.len();
        let (footer, (start, end)) = job.read_footer((len, offset, tail)).await?;
        let span = Self::read_row_groups(&mut job, reader, etag, (start, end, len)).await?;
        let fetch = started.elapsed().saturating_sub(job.engine_wait());
        let source_bytes = tail_bytes + span.len();
        Ok((fetch, source_bytes, job.run_table(table::Source::piece(len, start, span), footer).await?))
    }

    /// A computed output, its costs counted (`fetch` and the source bytes read, beside the
    /// output's own phases), made cacheable with the source version it came from.
    pub(super) fn computed(
        &self,
        spec: &PushdownSpec,
        out: crate::pushdown::Output,
        (fetch, source_bytes): (std::time::Duration, usize),
        source_etag: String,
        source_last_modified: Option<String>,
    ) -> (Arc<Cached>, Computed) {
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
            augmented: out.augmented.map(|d| d.to_string()),
        });
        (data, Computed { reservation: out.reservation, timing })
    }

    /// Transparent mode, after the store accepted the caller's own signed request of the source
    /// (`accepted`, a `HEAD` or a `Range`): a reader of the same object with the gateway's key
    /// (`backend.access_key`), so that readers which size or sample a file before they read it
    /// (the aws CLI, pyarrow, s3fs) get features on their first read. Both reads need the same
    /// right (S3's `s3:GetObject` covers `HEAD` and ranges); each read asks for the accepted
    /// version ([`Pin`]: `If-Match` its ETag). Without a gateway key such a request is refused
    /// until a whole `GET` computed the output (`WholeReadFirst`).
    pub(super) fn delegated(
        &self,
        parts: &Parts,
        reader: &SourceReader<'_>,
        accepted: &SourceBody,
    ) -> Result<SourceReader<'_>, GatewayError> {
        let caller = crate::s3::authority::claimed_access_key(&parts.headers, parts.uri.query()).unwrap_or_default();
        let proof = crate::s3::authority::Authenticated::store_accepted(&caller, &accepted.resp)
            .filter(|_| self.backend.has_store_key() && Pin::of(accepted).is_some())
            .ok_or(PushdownError::WholeReadFirst)?;
        Ok(SourceReader {
            backend: &self.backend,
            method: Method::GET,
            target: reader.target.clone(),
            query: reader.query.clone(),
            headers: gateway_read_headers(&parts.headers),
            authority: Authority::Gateway(proof),
        })
    }

    /// The row groups' bytes `start..end` of a Parquet file of `len` bytes, from the version its
    /// footer was read from (`etag`).
    async fn read_row_groups(
        job: &mut Job,
        reader: &SourceReader<'_>,
        etag: &str,
        (start, end, len): (u64, u64, u64),
    ) -> Result<bytes::Bytes, GatewayError> {
        let read = SourceRead { range: SourceRange::Span { start, end }, if_match: Some(etag), ..SourceRead::WHOLE };
        let failed = |status: http::StatusCode, why: &str| {
            PushdownError::SourceRead(format!(
                "the store answered the read of the row groups' bytes {start}-{} with {status}{why}",
                end - 1
            ))
        };
        match reader.read(read).await? {
            SourceOutcome::Body(span)
                if span.resp.status() == http::StatusCode::PARTIAL_CONTENT
                    && span.content_range == Some((start, end - 1, len)) =>
            {
                Ok(job.read_source(span.resp.into_body(), Some(end - start)).await?)
            }
            SourceOutcome::Body(SourceBody { resp, .. })
            | SourceOutcome::Refused(resp)
            | SourceOutcome::NotModified(resp) => Err(failed(resp.status(), "").into()),
            SourceOutcome::Changed(resp) => {
                Err(failed(resp.status(), " (the object changed after its footer was read)").into())
            }
        }
    }
}

/// How one request's source is read, decided once from the request before any read: the
/// headers the reads start from, the query forwarded, whether the caller's own signature reads
/// it (transparent mode) and whether it is read by ranges (`row-groups`).
pub(super) struct SourceSide {
    pub(super) headers: HeaderMap,
    pub(super) query: Option<String>,
    pub(super) as_caller: bool,
    ranged: bool,
}

impl SourceSide {
    fn of(parts: &Parts, job: &Job, authority: &Authority) -> Result<Self, GatewayError> {
        // Transparent mode: the source is read with the caller's own signed request.
        let as_caller = matches!(authority, Authority::Caller(_));
        let query = forwarded_query(parts.uri.query()).and_then(|q| pushdown_spec::without_trigger_params(&q));
        let headers = if as_caller {
            // As signed: the store ignores the triggers, and checks the signature over all of it.
            let mut h = parts.headers.clone();
            headers::remove_all(&mut h, headers::HOP_BY_HOP);
            // A Range outside the signature (a presigned URL signs only `host`) refers to the
            // output, as in terminating mode: the source is read whole.
            if !crate::s3::authority::signs_header(&parts.headers, parts.uri.query(), "range") {
                h.remove(http::header::RANGE);
            }
            h
        } else {
            gateway_read_headers(&parts.headers)
        };
        // Row groups of a Parquet file: the source is read by ranges (its tail, then the groups'
        // span), each an unsigned `Range` beside the caller's signature as `If-None-Match` is.
        let ranged = job.ranged();
        if ranged && as_caller && headers.contains_key(http::header::RANGE) {
            return Err(PushdownError::InvalidArgument {
                field: "row-groups".into(),
                message: "the source of a row-groups pushdown is read by ranges, and the Range this request signed \
                          would take their place: send it without Range"
                    .into(),
            }
            .into());
        }
        Ok(Self { headers, query, as_caller, ranged })
    }
}

/// What a computation holds beside its output until the response is sent: the output's memory
/// reservation, and its `server-timing`.
pub(crate) struct Computed {
    pub(super) reservation: Vec<crate::pushdown::governor::Held>,
    timing: String,
}

/// The version the store let the caller read (`accepted`), read whole by `delegated`
/// ([`Gateway::delegated`]).
async fn read_accepted(delegated: &SourceReader<'_>, accepted: SourceBody) -> Result<SourceBody, GatewayError> {
    match read_for_caller(delegated, accepted, SourceRange::Whole, None).await? {
        SourceOutcome::Body(body) if !body.partial() => Ok(body),
        other => Err(PushdownError::SourceRead(format!(
            "the store answered the gateway's read of the accepted version with {}",
            other.into_response().status()
        ))
        .into()),
    }
}

/// The gateway's read of `range` of the version the store let the caller read (`accepted`,
/// [`Pin`]) by `delegated` ([`Gateway::delegated`]), revalidating a cached output's source
/// (`cached_etag`) where there is one: the bytes (marked as read for the caller), or
/// `NotModified`.
///
/// # Errors
/// The object changed since the caller's read (retry), or the store refused the gateway's read.
pub(super) async fn read_for_caller(
    delegated: &SourceReader<'_>,
    accepted: SourceBody,
    range: SourceRange,
    cached_etag: Option<&str>,
) -> Result<SourceOutcome, GatewayError> {
    let pin = Pin::of(&accepted).unwrap_or_default();
    drop(accepted);
    match delegated.read(SourceRead { if_none_match: cached_etag, ..pin.read(range) }).await? {
        SourceOutcome::Body(body) => Ok(SourceOutcome::Body(SourceBody { delegated: true, ..body })),
        SourceOutcome::NotModified(resp) => Ok(SourceOutcome::NotModified(resp)),
        SourceOutcome::Changed(_) => Err(PushdownError::SourceRead(
            "the object changed between the caller's read and the gateway's: retry".into(),
        )
        .into()),
        SourceOutcome::Refused(resp) => Err(PushdownError::SourceRead(format!(
            "the store answered the gateway's read of the accepted version with {}",
            resp.status()
        ))
        .into()),
    }
}

/// The answer for how the read-through ended.
pub(super) fn respond(
    parts: &Parts,
    key: &CacheKey,
    read: ReadThrough<Response<Body>, Computed>,
) -> Result<Response<Body>, GatewayError> {
    match read {
        ReadThrough::Cached { entry, tier, revalidated } => {
            let status = if revalidated { CacheStatus::Revalidated(tier) } else { CacheStatus::Hit(tier) };
            output_response(parts, key, &entry.data, status, None)
        }
        ReadThrough::Computed { data, extra: Computed { reservation, timing } } => {
            let resp = output_response(parts, key, &data, CacheStatus::Miss, Some(timing))?;
            // Sending the body ends the reservation (a client gone mid-download ends it too).
            Ok(resp.map(|b| Body::new(Holding::new(b, reservation))))
        }
        ReadThrough::Answer(resp) if parts.method == Method::HEAD => Ok(resp.map(|_| Body::empty())),
        ReadThrough::Answer(resp) => Ok(resp),
    }
}

pub(super) fn header_str<'a>(h: &'a HeaderMap, name: &http::HeaderName) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// Where a pushdown output came from (`x-tensorgate-cache`).
#[derive(Debug, Clone, Copy)]
enum CacheStatus {
    Miss,
    Hit(Tier),
    /// Cached, served after the backend confirmed the source is unchanged.
    Revalidated(Tier),
}

/// The response for a pushdown output, honouring `HEAD`, `Range` and `If-None-Match`. The ETag
/// names the source version and the variant, so it changes exactly when the output can.
fn output_response(
    parts: &Parts,
    key: &CacheKey,
    data: &Cached,
    status: CacheStatus,
    timing: Option<String>,
) -> Result<Response<Body>, GatewayError> {
    let etag = output_etag(&data.source_etag, &key.variant);
    let (cache, tier) = match status {
        CacheStatus::Miss => ("miss", None),
        CacheStatus::Hit(t) => ("hit", Some(t)),
        CacheStatus::Revalidated(t) => ("revalidated", Some(t)),
    };
    let mut resp = output_head(&etag, &data.split, cache, data.source_last_modified.as_deref());
    if !if_match(&parts.headers, &etag) {
        return Err(GatewayError::PreconditionFailed);
    }
    if none_match(&parts.headers, &etag) {
        // The client holds this output already (a compute-tier copy from an earlier epoch).
        return resp
            .status(http::StatusCode::NOT_MODIFIED)
            .body(Body::empty())
            .map_err(|e| PushdownError::Internal(e.to_string()).into());
    }
    let len = data.body.len();
    let (code, body) = match header_str(&parts.headers, &http::header::RANGE) {
        Some(r) => {
            let (a, b) = byte_range(r, len).ok_or(GatewayError::InvalidRange { size: len })?;
            resp = resp.header(http::header::CONTENT_RANGE, format!("bytes {a}-{b}/{len}"));
            (http::StatusCode::PARTIAL_CONTENT, data.body.slice(a..=b))
        }
        None => (http::StatusCode::OK, data.body.clone()),
    };
    let sent = body.len() as u64;
    resp = described(resp.status(code), &data.content_type, sent, &data.shape, &data.dtype, data.source_bytes);
    if let Some(t) = tier {
        resp = resp.header("x-tensorgate-cache-tier", t.name());
    }
    if let Some(a) = &data.augmented {
        resp = resp.header(AUGMENTED, a);
    }
    if let Some(t) = timing {
        resp = resp.header("server-timing", t);
    }
    let body = if parts.method == Method::HEAD { Body::empty() } else { Body::from(body) };
    resp.body(body).map_err(|e| PushdownError::Internal(e.to_string()).into())
}

/// The headers every answer of an output starts from: its ETag, the split, where it came from
/// (`x-tensorgate-cache`) and its source's `Last-Modified` (clients such as `aws s3 cp` require it).
pub(super) fn output_head(
    etag: &str,
    split: &str,
    cache: &str,
    last_modified: Option<&str>,
) -> http::response::Builder {
    let resp = Response::builder()
        .header(http::header::ETAG, etag)
        .header("x-tensorgate-split", split)
        .header("x-tensorgate-cache", cache);
    match last_modified {
        Some(lm) => resp.header(http::header::LAST_MODIFIED, lm),
        None => resp,
    }
}

/// The headers that describe the output bytes an answer sends (`sent` of them): their type,
/// `Accept-Ranges`, the features' shape and dtype, and the source bytes they were computed from.
pub(super) fn described(
    resp: http::response::Builder,
    content_type: &str,
    sent: u64,
    shape: &[usize],
    dtype: &str,
    source_bytes: u64,
) -> http::response::Builder {
    let shape: Vec<String> = shape.iter().map(ToString::to_string).collect();
    resp.header(http::header::CONTENT_TYPE, content_type)
        .header(http::header::CONTENT_LENGTH, sent)
        .header(http::header::ACCEPT_RANGES, "bytes")
        .header("x-tensorgate-shape", shape.join(","))
        .header("x-tensorgate-dtype", dtype)
        .header("x-tensorgate-source-bytes", source_bytes)
}

/// An output's ETag: it names the source version and the variant, so it changes exactly when
/// the output can.
pub(super) fn output_etag(source_etag: &str, variant: &str) -> String {
    format!("\"{}\"", &crate::s3::sigv4::sha256_hex(format!("{source_etag}|{variant}").as_bytes())[..32])
}

/// Whether an `If-None-Match` header lists `etag` (or is `*`): RFC 9110's weak comparison, so a
/// `W/` prefix on either side is ignored.
pub(super) fn none_match(headers: &HeaderMap, etag: &str) -> bool {
    lists(headers, &http::header::IF_NONE_MATCH, etag)
}

/// Whether a request's `If-Match` (if any) holds for an output of `etag`: it lists it, or is `*`
/// (s3transfer pins each part of a ranged download so, with the `HEAD`'s ETag).
pub(super) fn if_match(headers: &HeaderMap, etag: &str) -> bool {
    !headers.contains_key(http::header::IF_MATCH) || lists(headers, &http::header::IF_MATCH, etag)
}

fn lists(headers: &HeaderMap, name: &http::HeaderName, etag: &str) -> bool {
    let bare = |t: &str| t.trim().trim_start_matches("W/").to_owned();
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim() == "*" || bare(t) == bare(etag))
}

/// The headers of a source read the gateway signs: the client's forwarded ones, less the triggers
/// and what applies to the output ([`OUTPUT_SCOPED`]).
pub(super) fn gateway_read_headers(client: &HeaderMap) -> HeaderMap {
    let mut h = forwarded_headers(client);
    pushdown_spec::remove_trigger_headers(&mut h);
    for name in OUTPUT_SCOPED {
        h.remove(name);
    }
    h
}

/// Headers beside the triggers that apply to the pushdown output, not to the source object: not
/// forwarded.
pub(super) const OUTPUT_SCOPED: [http::HeaderName; 5] = [
    http::header::RANGE,
    http::header::IF_MATCH,
    http::header::IF_NONE_MATCH,
    http::header::IF_MODIFIED_SINCE,
    http::header::IF_UNMODIFIED_SINCE,
];

/// A single `bytes=a-b`, `bytes=a-` or `bytes=-n` range within `len` bytes, inclusive.
pub(super) fn byte_range(header: &str, len: usize) -> Option<(usize, usize)> {
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
}
