//! POST Object: browser uploads (an HTML form with a signed policy; boto3's
//! `generate_presigned_post`). The form fields before the file part are read (bounded by
//! [`MAX_FORM_HEAD`]) and the policy checked (`s3::post_policy`); then the file part streams to
//! the store as a re-signed `PutObject` with its exact length, its last byte withheld until the
//! form's closing boundary has arrived (ADR 0007), so a malformed or cut body stores nothing.

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use http::header::{CONTENT_TYPE, ETAG, HOST, LOCATION};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyDataStream;
use time::OffsetDateTime;

use super::Gateway;
use super::passthrough::{check_declared, content_length};
use crate::backend::ForwardRequest;
use crate::body::{Body, BodyError, Guarded, Metered};
use crate::error::GatewayError;
use crate::s3::form::{self, FormError};
use crate::s3::post_policy::{self, PostError, PostForm, SuccessAction};
use crate::s3::route::{S3Op, Target};
use crate::s3::sigv4::uri_encode_path;

/// Most bytes of a form read before its file part. S3 limits the policy to 20 KiB; the other
/// fields (key, metadata, signature) are small, and this bounds what a client can make the
/// gateway buffer before anything is authenticated.
pub(crate) const MAX_FORM_HEAD: usize = 64 * 1024;

impl Gateway {
    /// Handles a `POST` to a bucket with a `multipart/form-data` body.
    pub(super) async fn post_object(
        &self,
        req: Request<Body>,
        target: Target,
    ) -> Result<(Response<Body>, String), GatewayError> {
        let (parts, body) = req.into_parts();
        let boundary = parts
            .headers
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(form::boundary)
            .ok_or(FormError::Malformed("no multipart boundary"))?;
        let total = content_length(&parts.headers)?.ok_or(GatewayError::MissingContentLength)?;
        let limit = self.cfg.load().max_body_bytes;
        check_declared(Some(total), limit.saturating_add(MAX_FORM_HEAD as u64))?;
        let counted = Metered::new(body, self.metrics.request_bytes.clone(), ());
        let mut body = BodyDataStream::new(Guarded::new(counted, total, None));

        let mut buf = BytesMut::new();
        let head = loop {
            if let Some(head) = form::parse_head(&buf, &boundary, MAX_FORM_HEAD)? {
                break head;
            }
            match body.next().await {
                Some(chunk) => buf.extend_from_slice(&chunk?),
                None => return Err(FormError::Malformed("the body ends inside the form fields").into()),
            }
        };
        let bucket = target.bucket.clone().unwrap_or_default();
        let form = PostForm::new(head.fields)?;
        let auth = post_policy::authorize(
            &form,
            &bucket,
            head.filename.as_deref(),
            &self.creds.load(),
            self.cfg.load().allow_anonymous,
            OffsetDateTime::now_utc(),
        )?;
        let delimiter = form::closing_delimiter(&boundary);
        let len = total
            .checked_sub((head.file_start + delimiter.len()) as u64)
            .ok_or(FormError::Malformed("Content-Length is shorter than the form"))?;
        post_policy::check_length(auth.content_length_range, len)?;
        check_declared(Some(len), limit)?;
        let mut headers = HeaderMap::new();
        for (name, value) in post_policy::object_headers(&form)? {
            let bad = || PostError::InvalidArgument(format!("field {name} cannot be sent as a header"));
            headers.append(
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| bad())?,
                HeaderValue::from_bytes(value.as_bytes()).map_err(|_| bad())?,
            );
        }
        let file = file_part(buf.split_off(head.file_start).freeze(), body, len, delimiter);
        let (body, payload) = self.prepared_body(S3Op::PutObject, file, len, &mut headers, None).await?;
        let object = Target { bucket: Some(bucket.clone()), key: Some(auth.key.clone()), virtual_host: false };
        let fwd = ForwardRequest {
            op: S3Op::PutObject,
            method: Method::PUT,
            target: object,
            query: None,
            headers,
            body,
            payload,
            authority: auth.authority.clone(),
            expect_continue: false,
        };
        let sent = self.backend.send(fwd).await;
        if let Some(cache) = &self.cache {
            cache.object_written(&bucket, &auth.key);
        }
        let stored = sent?;
        let who = auth.identity.name().to_owned();
        if !stored.status().is_success() {
            return Ok((stored, who));
        }
        Ok((answer(&parts.headers, &bucket, &auth, &stored)?, who))
    }
}

/// The answer to a form upload the store stored: `success_action_redirect` or
/// `success_action_status` as the form asked (201 with the XML S3 sends), with the object's
/// location and ETag.
fn answer(
    request: &HeaderMap,
    bucket: &str,
    auth: &post_policy::Authorized,
    stored: &Response<Body>,
) -> Result<Response<Body>, GatewayError> {
    let etag = stored.headers().get(ETAG).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let host = request.get(HOST).and_then(|v| v.to_str().ok()).unwrap_or("localhost");
    let location = format!("http://{host}/{}/{}", uri_encode_path(bucket), uri_encode_path(&auth.key));
    let (status, body) = match &auth.success {
        SuccessAction::Redirect(_) => (StatusCode::SEE_OTHER, None),
        SuccessAction::Status(201) => {
            (StatusCode::CREATED, Some(post_policy::success_xml(&location, bucket, &auth.key, &etag)))
        }
        SuccessAction::Status(200) => (StatusCode::OK, None),
        SuccessAction::Status(_) => (StatusCode::NO_CONTENT, None),
    };
    let location = match &auth.success {
        SuccessAction::Redirect(to) => post_policy::redirect_location(to, bucket, &auth.key, &etag),
        SuccessAction::Status(_) => location,
    };
    let mut resp = Response::builder().status(status).header(LOCATION, location).header(ETAG, &etag);
    for name in ["x-amz-version-id", "x-amz-request-id"] {
        if let Some(v) = stored.headers().get(name) {
            resp = resp.header(name, v);
        }
    }
    let resp = match body {
        Some(xml) => resp.header(CONTENT_TYPE, "application/xml").body(Body::from(xml)),
        None => resp.body(Body::empty()),
    };
    resp.map_err(|e| GatewayError::Backend(crate::backend::BackendError::Internal(e.into())))
}

/// The file part of a form: exactly `len` bytes from `first` and then `rest`, after which the body
/// must hold the closing delimiter and nothing else (a form with parts after its file is refused,
/// so no store ever keeps them as object data).
fn file_part<S>(
    first: Bytes,
    rest: S,
    len: u64,
    delimiter: Vec<u8>,
) -> impl Stream<Item = Result<Bytes, BodyError>> + Send + Unpin + 'static
where
    S: Stream<Item = Result<Bytes, BodyError>> + Send + Unpin + 'static,
{
    struct State<S> {
        pending: Option<Bytes>,
        rest: S,
        left: u64,
        tail: Vec<u8>,
        delimiter: Vec<u8>,
        done: bool,
    }
    let state = State { pending: Some(first), rest, left: len, tail: Vec::new(), delimiter, done: false };
    Box::pin(futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if st.done {
                return None;
            }
            let chunk = match st.pending.take() {
                Some(c) => c,
                None => match st.rest.next().await {
                    Some(Ok(c)) => c,
                    Some(Err(e)) => {
                        st.done = true;
                        return Some((Err(e), st));
                    }
                    None => {
                        st.done = true;
                        if st.left == 0 && st.tail == st.delimiter {
                            return None;
                        }
                        return Some((Err(BodyError::FormTrailer), st));
                    }
                },
            };
            let take = usize::try_from(st.left).unwrap_or(usize::MAX).min(chunk.len());
            st.left -= take as u64;
            st.tail.extend_from_slice(&chunk[take..]);
            if st.tail.len() > st.delimiter.len() {
                st.done = true;
                return Some((Err(BodyError::FormTrailer), st));
            }
            if take > 0 {
                return Some((Ok(chunk.slice(..take)), st));
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn run(frames: Vec<&'static [u8]>, len: u64) -> Result<Vec<u8>, BodyError> {
        let mut frames = frames.into_iter().map(|f| Ok(Bytes::from_static(f)));
        let first = frames.next().and_then(Result::ok).unwrap_or_default();
        let rest = futures_util::stream::iter(frames.collect::<Vec<_>>());
        let mut s = file_part(first, rest, len, form::closing_delimiter("B"));
        let mut out = Vec::new();
        while let Some(item) = s.next().await {
            out.extend_from_slice(&item?);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn the_file_ends_exactly_at_the_closing_delimiter() {
        assert_eq!(run(vec![b"ab", b"c\r\n--B", b"--\r\n"], 3).await.expect("valid"), b"abc");
        assert_eq!(run(vec![b"\r\n--B--\r\n"], 0).await.expect("empty file"), b"");
        // A part after the file, or a cut body, is refused.
        let more: &[u8] = b"abc\r\n--B\r\nContent-Disposition: form-data; name=\"x\"\r\n\r\ny\r\n--B--\r\n";
        assert!(matches!(run(vec![more], 3).await, Err(BodyError::FormTrailer)));
        assert!(matches!(run(vec![b"abc\r\n--B"], 3).await, Err(BodyError::FormTrailer)));
    }
}
