//! A Parquet output of a whole file (`format=parquet`), served from its outline (ADR 0030): its
//! size, its row groups' places and its footer follow from the source's footer and the split's
//! output shape ([`crate::pushdown::table::outline`]). So a `HEAD`, a listing's sizes and a footer
//! `Range` are answered from the source's tail alone, before any feature is computed; the bytes
//! of row groups are computed a group at a time, each through the cache as that group's own
//! output (the `row-groups=<g>` request's, whose row group has the same bytes), and streamed in
//! file order as each is ready: no reader waits for the whole file before its first byte, and a
//! `Range` computes only the groups it covers.
//!
//! The store decides once per request, on the caller's own request or the gateway's read for it
//! (as for any pushdown), and every read after it asks for the version it allowed (`If-Match`); a
//! group's cached output is served only if it was computed from that version.

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, Method, Response, StatusCode};

use super::Gateway;
use super::pushdown::{
    SourceSide, byte_range, described, header_str, if_match, none_match, output_etag, output_head, read_for_caller,
};
use super::source::{SourceBody, SourceOutcome, SourceRange, SourceRead, SourceReader};
use crate::body::{Body, BoxError};
use crate::cache::{CacheKey, Fetched, ObjectId, ReadThrough, TensorCache};
use crate::error::GatewayError;
use crate::pushdown::governor::Held;
use crate::pushdown::spec::{PushdownSpec, RowGroups};
use crate::pushdown::{Job, PushdownError, table};
use crate::s3::authority::Authority;
use crate::s3::headers;
use crate::s3::route::Target;

/// `x-tensorgate-cache` of an answer from an outline: its row groups may be cached or computed,
/// each on its own.
const OUTLINE: &str = "outline";

/// What computing an outlined output's row groups needs, owned by the task that streams them.
struct Groups {
    spec: PushdownSpec,
    tenant: String,
    object: ObjectId,
    target: Target,
    /// How the source is read after the store's yes (the reader [`Gateway::outline_reads`] gave).
    method: Method,
    headers: HeaderMap,
    authority: Authority,
    /// The version the store let the caller read, and its `Last-Modified`.
    etag: String,
    last_modified: Option<String>,
    /// The file's length, where its tail starts, and the tail.
    tail: (u64, u64, Bytes),
    /// False for an object under a customer key, whose outputs are never cached.
    cacheable: bool,
}

impl Gateway {
    /// Serves an outlined output: the store's say and the file's tail
    /// ([`Self::outline_reads`]), the outline ([`Job::outline`]), then the answer: headers from
    /// the outline, the bytes of a `Range` from it where they are its magic or tail, else
    /// streamed by a task of their own ([`Self::stream_groups`]).
    pub(super) async fn serve_outlined(
        &self,
        parts: &Parts,
        target: Target,
        mut job: Job,
        authority: &Authority,
        side: SourceSide,
    ) -> Result<Response<Body>, GatewayError> {
        let reader = SourceReader {
            backend: &self.backend,
            method: if side.as_caller { parts.method.clone() } else { Method::GET },
            target: target.clone(),
            query: side.query.clone(),
            headers: side.headers,
            authority: authority.clone(),
        };
        let (reader, tail) = match self.outline_reads(parts, reader, side.as_caller).await? {
            Ok(read) => read,
            Err(answer) if parts.method == Method::HEAD => return Ok(answer.map(|_| Body::empty())),
            Err(answer) => return Ok(answer),
        };
        let declared = tail.header(&http::header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
        let last_modified = tail.header(&http::header::LAST_MODIFIED).map(str::to_owned);
        let (etag, content_range) = (tail.etag.clone(), tail.content_range);
        let bytes = job.read_source(tail.resp.into_body(), declared).await?;
        let (offset, len) = content_range.map_or((0, bytes.len() as u64), |(a, _, n)| (a, n));
        let outline = job.outline((len, offset, bytes.clone())).await?;

        let out_etag = output_etag(&etag, &job.variant());
        let mut resp = output_head(&out_etag, job.split_name(), OUTLINE, last_modified.as_deref());
        if !if_match(&parts.headers, &out_etag) {
            return Err(GatewayError::PreconditionFailed);
        }
        if none_match(&parts.headers, &out_etag) {
            return resp.status(StatusCode::NOT_MODIFIED).body(Body::empty()).map_err(internal);
        }
        let size = usize::try_from(outline.len).map_err(internal)?;
        let (status, (first, last)) = match header_str(&parts.headers, &http::header::RANGE) {
            Some(r) => (StatusCode::PARTIAL_CONTENT, byte_range(r, size).ok_or(GatewayError::InvalidRange { size })?),
            None => (StatusCode::OK, (0, size - 1)),
        };
        if status == StatusCode::PARTIAL_CONTENT {
            resp = resp.header(http::header::CONTENT_RANGE, format!("bytes {first}-{last}/{size}"));
        }
        let (parquet, sent) = ("application/vnd.apache.parquet", (last - first + 1) as u64);
        resp = described(resp.status(status), parquet, sent, &outline.shape, job.spec().dtype.name(), len);
        let (start, end) = (first as u64, last as u64 + 1);
        let body = if parts.method == Method::HEAD {
            Body::empty()
        } else if let Some(known) = outline.known(start, end) {
            Body::from(known)
        } else {
            let groups = Groups {
                spec: job.spec().clone(),
                tenant: job.tenant().to_owned(),
                object: ObjectId {
                    bucket: target.bucket.clone().unwrap_or_default(),
                    key: target.key.clone().unwrap_or_default(),
                    query: side.query.unwrap_or_default(),
                },
                target,
                method: reader.method.clone(),
                headers: reader.headers.clone(),
                authority: reader.authority.clone(),
                etag,
                last_modified,
                tail: (len, offset, bytes),
                cacheable: !parts.headers.contains_key(headers::SSE_CUSTOMER_KEY),
            };
            self.stream_groups(groups, outline, (start, end))?
        };
        resp.body(body).map_err(internal)
    }

    /// The store's answer to this caller, then the file's tail from the version it allowed, and
    /// the reader of the rest; or the store's refusal, to pass on. In terminating mode the
    /// gateway's read is the caller's. In transparent mode a `GET` whose signature leaves
    /// `Range` out reads the tail as the caller signed it (an unsigned `Range` beside the
    /// signature, as `row-groups` reads); a `HEAD`, or a `GET` that signed its `Range`, is sent
    /// as signed, and the store's yes (a `2xx`, or a `416` or `412` to the range or `If-Match`
    /// the caller signed for the output) lets the gateway's key read that version
    /// ([`Gateway::delegated`]).
    async fn outline_reads<'g>(
        &'g self,
        parts: &Parts,
        reader: SourceReader<'g>,
        as_caller: bool,
    ) -> Result<Result<(SourceReader<'g>, SourceBody), Response<Body>>, GatewayError> {
        let tail = SourceRead { range: SourceRange::Tail(table::TAIL_BYTES), ..SourceRead::WHOLE };
        let direct = !as_caller || (parts.method == Method::GET && !reader.headers.contains_key(http::header::RANGE));
        let accepted = match reader.read(if direct { tail } else { SourceRead::WHOLE }).await? {
            SourceOutcome::Body(tail) if direct => return Ok(Ok((reader, tail))),
            SourceOutcome::Body(accepted) => accepted,
            SourceOutcome::Refused(r) => match reader.conditions_only(r) {
                SourceOutcome::Body(accepted) => accepted,
                other => return Ok(Err(other.into_response())),
            },
            SourceOutcome::NotModified(r) | SourceOutcome::Changed(r) => return Ok(Err(r)),
        };
        let delegated = self.delegated(parts, &reader, &accepted)?;
        match read_for_caller(&delegated, accepted, SourceRange::Tail(table::TAIL_BYTES), None).await? {
            SourceOutcome::Body(tail) => Ok(Ok((delegated, tail))),
            other => Ok(Err(other.into_response())),
        }
    }

    /// A body of the output's bytes `[start, end)`, sent by a task of its own in file order: the
    /// magic and the tail from the outline, each row group as [`Self::group_bytes`] gives it.
    /// A client that goes away leaves the task running: the groups it asked for are computed
    /// into the cache (each under the memory budget, the task holding a place among
    /// `max_in_flight` as the request did, or stopping when none is left), so its retry is
    /// served, not computed again. A group that fails ends the body early (the client sees a short read, and retries).
    fn stream_groups(
        &self,
        groups: Groups,
        outline: table::Outline,
        (start, end): (u64, u64),
    ) -> Result<Body, GatewayError> {
        let gateway = self.me.upgrade().ok_or_else(|| internal("the gateway is not shared"))?;
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, BoxError>>(1);
        tokio::spawn(async move {
            let mut place = None;
            let magic = std::iter::once((0, 4, None));
            let parts = outline.groups.iter().enumerate().map(|(g, &(s, e))| (s, e, Some(g)));
            let tail = std::iter::once((outline.tail_start(), outline.len, None));
            for (s, e, group) in magic.chain(parts).chain(tail).filter(|&(s, e, _)| s < e && e > start && s < end) {
                let (from, to) = (start.max(s), end.min(e));
                let piece = match group {
                    None => outline.known(from, to).map(|b| (b, None)).ok_or_else(|| internal("no such bytes")),
                    Some(g) => gateway.group_bytes(&groups, g, e - s).await.map(|(bytes, held)| {
                        let at = |n: u64| usize::try_from(n - s).unwrap_or(usize::MAX);
                        (bytes.slice(at(from)..at(to)), held)
                    }),
                };
                match piece {
                    Ok((bytes, held)) => {
                        // The group's memory is held until its bytes are handed to the connection.
                        if place.is_none() && tx.send(Ok(bytes)).await.is_err() {
                            // The client went away with its request's place: the groups left
                            // are computed under a place of their own, or not at all.
                            match gateway.admission.admit(&gateway.metrics) {
                                Ok(own) => place = Some(own),
                                Err(_) => return,
                            }
                        }
                        drop(held);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, group = ?group, "An outlined Parquet output's row group failed.");
                        let _ = tx.send(Err(std::io::Error::other(e.to_string()).into())).await;
                        return;
                    }
                }
            }
        });
        Ok(Body::from_stream(futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        })))
    }

    /// Row group `g`'s bytes in the output (`len` of them): its own output's (`row-groups=g`,
    /// through the cache: served if computed from the version the store allowed, else computed
    /// from the tail read and the group's span), after that file's magic; and its memory hold.
    async fn group_bytes(
        &self,
        groups: &Groups,
        g: usize,
        len: u64,
    ) -> Result<(Bytes, Option<Vec<Held>>), GatewayError> {
        let mut spec = groups.spec.clone();
        spec.row_groups = Some(RowGroups { first: g, last: g });
        let job = self.prepare(spec, &groups.tenant).await?.ok_or_else(|| internal("no pushdown was planned"))?;
        let key = CacheKey { object: groups.object.clone(), variant: job.variant() };
        let reader = SourceReader {
            backend: &self.backend,
            method: groups.method.clone(),
            target: groups.target.clone(),
            query: Some(groups.object.query.clone()).filter(|q| !q.is_empty()),
            headers: groups.headers.clone(),
            authority: groups.authority.clone(),
        };
        let etag = groups.etag.as_str();
        // The store said yes to this version on this request: no read asks it again.
        let fetch = async |cached: Option<&str>| {
            Ok::<_, GatewayError>(if cached == Some(etag) {
                Fetched::NotModified(())
            } else {
                Fetched::Source { etag: etag.to_owned(), source: () }
            })
        };
        let single_use = job.spec().augment.is_some();
        let compute = async |()| {
            let spec = job.spec().clone();
            let started = std::time::Instant::now();
            let (fetch, read, out) = Self::run_row_groups(job, &reader, etag, groups.tail.clone(), started).await?;
            Ok(self.computed(&spec, out, (fetch, read), etag.to_owned(), groups.last_modified.clone()))
        };
        let read = match self.cache.as_deref().filter(|c| groups.cacheable && (!single_use || c.repeated(&key))) {
            Some(cache) => cache.get_or_compute(&key, true, fetch, compute).await?,
            None => TensorCache::uncached(fetch, compute).await?,
        };
        let (body, held) = match read {
            ReadThrough::Cached { entry, .. } => (entry.data.body.clone(), None),
            ReadThrough::Computed { data, extra } => (data.body.clone(), Some(extra.reservation)),
            ReadThrough::Answer(()) => return Err(internal("the store's answer changed")),
        };
        let len = usize::try_from(len).map_err(internal)?;
        if body.len() < 4 + len {
            return Err(internal(format!("row group {g} is not where its outline places it")));
        }
        Ok((body.slice(4..4 + len), held))
    }
}

fn internal(e: impl std::fmt::Display) -> GatewayError {
    PushdownError::Internal(format!("an outlined Parquet output: {e}")).into()
}
