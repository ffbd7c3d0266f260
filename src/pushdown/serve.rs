//! Serving pushdown requests over HTTP: `split=auto` resolved to a plan, the read-through tensor
//! cache (fresh → answer; else one request per key fetches, holding the key's flight; a stale
//! entry is revalidated with a conditional GET), the source fetched from the backend under the
//! memory budget and a deadline, computed ([`super::Pushdown::compute`]), cached, and answered
//! with `HEAD`, `Range` and `If-None-Match` honoured. Every memory reservation a response needs
//! rides its body until the last byte is sent.

use std::sync::Arc;
use std::time::Instant;

use http::{HeaderMap, HeaderValue, Method, Response};
use http_body_util::BodyExt;

use super::spec::{self as pushdown_spec, PushdownSpec};
use super::{Pushdown, PushdownError};
use crate::backend::{Backend, BackendError, ForwardPayload, ForwardRequest};
use crate::body::{Body, Holding};
use crate::cache::{CacheKey, Cached, Entry, Lookup, ObjectId, TensorCache, Tier};
use crate::error::GatewayError;
use crate::metrics::Metrics;
use crate::s3::authority::Authority;
use crate::s3::headers;
use crate::s3::route::{S3Op, Target};
use crate::s3::sigv4::verify::Identity;

/// What serving a pushdown request uses; borrowed from the gateway for one request.
#[derive(Debug, Clone, Copy)]
pub struct Serving<'a> {
    pub pushdown: Option<&'a Pushdown>,
    pub cache: Option<&'a TensorCache>,
    pub backend: &'a Backend,
    pub metrics: &'a Metrics,
}

impl Serving<'_> {
    /// Resolves `split=auto` to the model's planned split (`x-tensorgate-plan` lists the predicted
    /// epoch seconds per candidate); `None` when the plan says no pushdown (a plain GET).
    pub fn resolve_auto(
        &self,
        mut spec: PushdownSpec,
        identity: &Identity,
    ) -> Result<Option<(PushdownSpec, Option<String>)>, GatewayError> {
        if spec.split != crate::planner::AUTO {
            return Ok(Some((spec, None)));
        }
        let pd = self.pushdown.ok_or_else(|| PushdownError::Unavailable("disabled by configuration".into()))?;
        let (split, plan) = pd.auto_split(identity.name(), &spec.model).ok_or_else(|| PushdownError::UnknownModel {
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
    pub async fn get(
        &self,
        parts: &http::request::Parts,
        target: Target,
        spec: PushdownSpec,
        identity: &Identity,
        authority: &Authority,
    ) -> Result<Response<Body>, GatewayError> {
        let tenant = identity.name();
        // When the store decides who may read (an anonymous reader; any caller in transparent
        // mode; every caller when clients have store keys of their own), an output is never
        // served from the cache before the store said yes to this caller on this request.
        let ask_store = authority.store_decides() || self.backend.has_tenant_keys();
        // Transparent mode: the source is read with the caller's own signed request.
        let as_caller = matches!(authority, Authority::Caller(_));
        let pd = self.pushdown.ok_or_else(|| PushdownError::Unavailable("disabled by configuration".into()))?;
        pd.available().map_err(|r| PushdownError::Unavailable(r.to_owned()))?;
        let (model, split) = pd.resolve(&spec)?;
        let query =
            crate::backend::forwarded_query(parts.uri.query()).and_then(|q| pushdown_spec::without_trigger_params(&q));
        let mut headers = if as_caller {
            // As signed: the store ignores the triggers, and checks the signature over all of it.
            let mut h = parts.headers.clone();
            for name in headers::HOP_BY_HOP {
                h.remove(*name);
            }
            h
        } else {
            let mut h = crate::backend::forwarded_headers(&parts.headers);
            pushdown_spec::remove_trigger_headers(&mut h);
            for name in OUTPUT_SCOPED {
                h.remove(name);
            }
            h
        };
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
        let cache = self.cache.filter(|_| !parts.headers.contains_key(headers::SSE_CUSTOMER_KEY));

        let mut revalidating = None;
        // Whether the gateway added the `If-None-Match` (a caller's own one refers to the output).
        let mut asked_unchanged = false;
        let (mut _flight, mut generation) = (None, 0);
        if let Some(cache) = cache {
            if let Lookup::Fresh(e, tier) = cache.lookup(&key).await
                && !ask_store
            {
                return served_from(cache, parts, &key, &e, CacheStatus::Hit(tier));
            }
            // One request per key fetches and computes; the rest wait here and then hit.
            _flight = Some(cache.flight(&key).await);
            generation = cache.generation(&key.object);
            match cache.lookup(&key).await {
                Lookup::Fresh(e, tier) if !ask_store => {
                    return served_from(cache, parts, &key, &e, CacheStatus::Hit(tier));
                }
                Lookup::Fresh(e, tier) | Lookup::Stale(e, tier) => {
                    // Unsigned and outside the caller's signature: every store accepts it there.
                    if !headers.contains_key(http::header::IF_NONE_MATCH)
                        && let Ok(v) = HeaderValue::from_str(&e.data.source_etag)
                    {
                        headers.insert(http::header::IF_NONE_MATCH, v);
                        asked_unchanged = true;
                    }
                    revalidating = Some((e, tier));
                }
                Lookup::Miss => {}
            }
        }

        let fetch_start = Instant::now();
        let fwd = ForwardRequest {
            op: S3Op::GetObject,
            // The caller signed its own method; the gateway reads the source with a GET.
            method: if as_caller { parts.method.clone() } else { Method::GET },
            target,
            query,
            headers,
            body: Body::empty(),
            payload: ForwardPayload::Empty,
            authority: authority.clone(),
            expect_continue: false,
        };
        let resp = self.backend.send(fwd).await?;
        let source_etag =
            resp.headers().get(http::header::ETAG).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        if let (Some(cache), Some((entry, tier))) = (cache, revalidating) {
            let outcome = if (resp.status() == http::StatusCode::NOT_MODIFIED && asked_unchanged)
                || (resp.status().is_success() && source_etag == entry.data.source_etag)
            {
                cache.validated(&entry, generation);
                "unchanged"
            } else if resp.status().is_success() {
                "changed"
            } else if ask_store {
                // This caller's refusal says nothing of the object: the entry stays for others.
                "refused"
            } else {
                "gone"
            };
            cache.record_revalidation(outcome);
            if outcome == "unchanged" {
                return served_from(cache, parts, &key, &entry, CacheStatus::Revalidated(tier));
            }
            if outcome != "refused" {
                cache.remove(&key).await;
            }
        }
        if !resp.status().is_success() {
            return Ok(if parts.method == Method::HEAD { resp.map(|_| Body::empty()) } else { resp });
        }
        if as_caller && (parts.method == Method::HEAD || resp.status() == http::StatusCode::PARTIAL_CONTENT) {
            // The caller's signed HEAD or Range read the store's answer, not the whole source.
            return Err(PushdownError::WholeReadFirst.into());
        }
        let limit = pd.max_object_bytes();
        // The object counts against the pushdown memory budget from now until the response is sent.
        // A source without a length (a chunked answer from a store or a peer) is held at the most
        // it may be (`max_object_bytes`) while it is read, then at what arrived.
        let declared = resp
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .map_or(limit, |n| n.min(limit));
        let mut object_hold = pd.governor().hold(declared).await?;
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
        object_hold.shrink_to(source_bytes as u64);
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
        Ok(resp.map(|b| Body::new(Holding::new(b, reservation))))
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

/// Headers beside the triggers that apply to the pushdown output, not to the source object: not
/// forwarded.
const OUTPUT_SCOPED: [http::HeaderName; 5] = [
    http::header::RANGE,
    http::header::IF_MATCH,
    http::header::IF_NONE_MATCH,
    http::header::IF_MODIFIED_SINCE,
    http::header::IF_UNMODIFIED_SINCE,
];

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
