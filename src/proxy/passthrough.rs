//! Passthrough: a request that is not a pushdown, forwarded to the store with its body framed
//! as every store accepts it (ADR 0007). The body is bounded by `max_body_bytes`; a payload hash
//! the client signed, signed `aws-chunked` chunks and checksums the store will not check are
//! verified while it streams, the last byte withheld until they pass. After a write, what it may
//! have changed is invalidated in the tensor cache.

use bytes::Bytes;
use futures_util::Stream;
use http::{HeaderMap, HeaderValue, Response};
use http_body_util::BodyDataStream;

use super::{Gateway, MAX_BUFFERED_BODY, Plain, VERIFY_WHOLE_BELOW};
use crate::backend::{ForwardPayload, ForwardRequest, forwarded_headers, fs::strip_aws_chunked};
use crate::body::{Body, BodyError, Checksummed, Guarded, Metered, WithholdTail};
use crate::cache::TensorCache;
use crate::error::GatewayError;
use crate::s3::checksum::Algorithm;
use crate::s3::headers;
use crate::s3::route::{S3Op, Target};
use crate::s3::sigv4::chunked;
use crate::s3::sigv4::verify::Payload;

impl Gateway {
    /// Forwards a request that is not a pushdown: its body framed for the store
    /// ([`Self::framed_body`]), then sent ([`Self::send_passthrough`]).
    pub(super) async fn passthrough(
        &self,
        parts: http::request::Parts,
        body: Body,
        payload: Payload,
        plain: Plain,
    ) -> Result<Response<Body>, GatewayError> {
        let mut headers = forwarded_headers(&parts.headers);
        // Boxed, and only for a request with a body: framing's future is kilobytes (aws-chunked
        // decoding, checksums), which every body-less request's future would otherwise carry.
        let (body, payload) = if declared_body(&parts.headers)?.1 {
            Box::pin(self.framed_body(plain.op, &parts.headers, body, payload, &mut headers)).await?
        } else {
            (Body::empty(), ForwardPayload::Empty)
        };
        let fwd = ForwardRequest {
            op: plain.op,
            method: parts.method,
            target: plain.target,
            query: plain.query,
            headers,
            body,
            payload,
            authority: plain.authority,
            expect_continue: expects_continue(&parts.headers),
        };
        self.send_passthrough(fwd, plain.planned_none).await
    }

    /// The body as the store gets it, by how the client signed it (`payload`): bounded, verified
    /// while it streams where the gateway must check it, and `headers` (the forwarded ones) set
    /// to match.
    async fn framed_body(
        &self,
        op: S3Op,
        request_headers: &HeaderMap,
        body: Body,
        payload: Payload,
        headers: &mut HeaderMap,
    ) -> Result<(Body, ForwardPayload), GatewayError> {
        let (declared, has_body) = declared_body(request_headers)?;
        let limit = self.cfg.load().max_body_bytes;
        let counted = Metered::new(body, self.metrics.request_bytes.clone(), ());
        // A checksum header on object data that the store will not check: the gateway does.
        let header_checksum = (matches!(op, S3Op::PutObject | S3Op::UploadPart)
            && !self.backend.passes_trailing_checksums())
        .then(|| header_checksum(request_headers))
        .flatten();
        let framed = match payload {
            _ if !has_body => (Body::empty(), ForwardPayload::Empty),
            // A store that requires Content-MD5 here (Swift's s3api) gets one, so clients that no
            // longer send it (boto3 >= 1.36) work; the body is small XML.
            Payload::Unsigned if op == S3Op::DeleteObjects => {
                check_declared(declared, limit)?;
                let data = BodyDataStream::new(Guarded::new(counted, limit, None));
                self.prepared_body(op, data, declared.unwrap_or_default(), headers, None).await?
            }
            Payload::Unsigned if header_checksum.is_some() && declared.is_some() => {
                check_declared(declared, limit)?;
                let data = checked(BodyDataStream::new(Guarded::new(counted, limit, None)), header_checksum);
                self.prepared_body(op, data, declared.unwrap_or_default(), headers, None).await?
            }
            Payload::Unsigned => {
                check_declared(declared, limit)?;
                (Body::new(Guarded::new(counted, limit, None)), ForwardPayload::Unsigned)
            }
            Payload::Sha256(expected) => {
                check_declared(declared, limit)?;
                let data = checked(BodyDataStream::new(Guarded::new(counted, limit, Some(expected))), header_checksum);
                let signed = Some(crate::s3::sigv4::hex32(&expected));
                self.prepared_body(op, data, declared.unwrap_or_default(), headers, signed).await?
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
                let checksum = match (mode.trailer, request_headers.get(headers::X_AMZ_TRAILER)) {
                    (true, Some(v)) => Some(
                        v.to_str()
                            .ok()
                            .and_then(Algorithm::from_header)
                            .ok_or(GatewayError::InvalidHeader(headers::X_AMZ_TRAILER))?,
                    ),
                    _ => None,
                };
                decoded_headers(headers);
                let decoded_length = mode.decoded_length;
                let data = chunked::decode(Guarded::new(counted, limit.saturating_mul(2), None), mode, checksum);
                self.prepared_body(op, checked(data, header_checksum), decoded_length, headers, None).await?
            }
        };
        Ok(framed)
    }

    /// Sends a passthrough request; then what a write may have changed is invalidated in the
    /// cache, and an answer that `split=auto` planned as no pushdown is marked.
    pub(super) async fn send_passthrough(
        &self,
        fwd: ForwardRequest,
        planned_none: bool,
    ) -> Result<Response<Body>, GatewayError> {
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
    pub(super) async fn prepared_body<S>(
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
pub(super) fn expects_continue(h: &HeaderMap) -> bool {
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
    match op {
        S3Op::PutObject | S3Op::CopyObject | S3Op::DeleteObject | S3Op::CompleteMultipartUpload => {
            Some((target.bucket.clone()?, Some(target.key.clone()?)))
        }
        S3Op::DeleteObjects | S3Op::DeleteBucket => Some((target.bucket.clone()?, None)),
        _ => None,
    }
}

pub(super) fn content_length(h: &HeaderMap) -> Result<Option<u64>, GatewayError> {
    match h.get(http::header::CONTENT_LENGTH) {
        None => Ok(None),
        Some(v) => {
            v.to_str().ok().and_then(|s| s.parse().ok()).map(Some).ok_or(GatewayError::InvalidHeader("content-length"))
        }
    }
}

/// The `Content-Length` a request declares, and whether it has a body (a length above zero, or
/// a `Transfer-Encoding`).
pub(super) fn declared_body(h: &HeaderMap) -> Result<(Option<u64>, bool), GatewayError> {
    let declared = content_length(h)?;
    Ok((declared, declared.is_some_and(|n| n > 0) || h.contains_key(http::header::TRANSFER_ENCODING)))
}

pub(super) fn check_declared(declared: Option<u64>, limit: u64) -> Result<(), GatewayError> {
    match declared {
        Some(n) if n > limit => Err(GatewayError::EntityTooLarge { declared: n, limit }),
        _ => Ok(()),
    }
}
