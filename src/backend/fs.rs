//! The `fs` backend: a local directory served in-process by `s3s-fs`, so `tensorgate serve` works
//! with no store at all. Requests reach it already authenticated and decoded (plain bodies); it
//! sees them as anonymous path-style requests.
//!
//! Path safety: `s3s-fs` joins bucket and key under its root and clamps `..` lexically, which still
//! lets a key like `../other-bucket/x` reach another bucket or its metadata files. So every key
//! is checked here first: no empty, `.` or `..` segments, no leading `/`, no NUL or backslash.
//! Bucket names are already restricted by `s3::route`. Not supported by `s3s-fs`: tagging,
//! versioning, ACLs (answered `501 NotImplemented`).

use std::path::Path;
use std::sync::Arc;

use http::{HeaderValue, Request, Response};
use s3s::service::{S3Service, S3ServiceBuilder};

use super::{BackendError, ForwardRequest, path_style_path};
use crate::body::Body;
use crate::s3::headers;

/// In-process S3 over a local directory.
#[derive(Clone)]
pub struct FsBackend {
    service: Arc<S3Service>,
}

impl std::fmt::Debug for FsBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsBackend").finish_non_exhaustive()
    }
}

impl FsBackend {
    /// Serves `root`, creating it if needed.
    ///
    /// # Errors
    /// If the directory cannot be created or opened.
    pub fn new(root: &Path) -> Result<Self, std::io::Error> {
        std::fs::create_dir_all(root)?;
        let fs = s3s_fs::FileSystem::new(root).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
        Ok(Self { service: Arc::new(S3ServiceBuilder::new(fs).build()) })
    }

    pub async fn send(&self, req: ForwardRequest) -> Result<Response<Body>, BackendError> {
        if req.target.key.as_deref().is_some_and(|k| !is_safe_key(k)) {
            return Err(BackendError::UnsafeKey);
        }
        let path = path_style_path(&req.target);
        let uri = match &req.query {
            Some(q) if !q.is_empty() => format!("{path}?{q}"),
            _ => path,
        };
        let mut out = Request::builder()
            .method(req.method)
            .uri(uri)
            .body(s3s::Body::http_body_unsync(req.body))
            .map_err(|e| BackendError::Internal(e.into()))?;
        *out.headers_mut() = req.headers;
        // The gateway consumed these; s3s-fs must see a plain anonymous request.
        for h in [headers::X_AMZ_DECODED_CONTENT_LENGTH, headers::X_AMZ_TRAILER] {
            out.headers_mut().remove(h);
        }
        strip_aws_chunked(out.headers_mut());
        out.headers_mut().insert(http::header::HOST, HeaderValue::from_static("localhost"));
        let resp = self.service.call(out).await.map_err(|e| BackendError::Internal(format!("{e:?}").into()))?;
        Ok(resp.map(Body::new))
    }
}

/// Removes the `aws-chunked` token from `Content-Encoding` (the body has been decoded).
pub fn strip_aws_chunked(h: &mut http::HeaderMap) {
    let Some(v) = h.get(http::header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()) else { return };
    let rest: Vec<&str> =
        v.split(',').map(str::trim).filter(|t| !t.eq_ignore_ascii_case("aws-chunked") && !t.is_empty()).collect();
    if rest.is_empty() {
        h.remove(http::header::CONTENT_ENCODING);
    } else if let Ok(v) = HeaderValue::from_str(&rest.join(", ")) {
        h.insert(http::header::CONTENT_ENCODING, v);
    }
}

/// Whether a key maps to a path strictly inside its bucket directory.
#[must_use]
pub fn is_safe_key(key: &str) -> bool {
    let trimmed = key.strip_suffix('/').unwrap_or(key);
    !trimmed.is_empty()
        && !key.contains(['\0', '\\'])
        && trimmed.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traversal_keys_are_refused() {
        for bad in ["../x", "a/../../b", "./a", "/abs", "a//b", "..", "a/..", "a\\..\\b", "a\0b", ""] {
            assert!(!is_safe_key(bad), "{bad:?}");
        }
        for good in ["a", "a/b/c.jpg", "dir/", "a..b", ".hidden", "x/.y"] {
            assert!(is_safe_key(good), "{good:?}");
        }
    }

    #[test]
    fn aws_chunked_token_is_removed() {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::CONTENT_ENCODING, HeaderValue::from_static("aws-chunked, gzip"));
        strip_aws_chunked(&mut h);
        assert_eq!(h[http::header::CONTENT_ENCODING], "gzip");
        h.insert(http::header::CONTENT_ENCODING, HeaderValue::from_static("aws-chunked"));
        strip_aws_chunked(&mut h);
        assert!(!h.contains_key(http::header::CONTENT_ENCODING));
    }
}
