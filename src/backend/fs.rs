//! The `fs` backend: a local directory served in-process by `s3s-fs`, so `tensorgate serve` works
//! with no store at all. Requests reach it already authenticated and decoded (plain bodies); it
//! sees them as anonymous path-style requests.
//!
//! Path safety: `s3s-fs` joins bucket and key under its root and clamps `..` lexically, which still
//! lets a key like `../other-bucket/x` reach another bucket or its metadata files. So every key
//! is checked here first: no empty, `.` or `..` segments, no leading `/`, no NUL or backslash.
//! Bucket names are already restricted by `s3::route`. Not supported by `s3s-fs`: tagging,
//! versioning, ACLs (answered `501 NotImplemented`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use futures_util::TryStreamExt;
use http::{HeaderValue, Request, Response};
use http_body_util::BodyExt;
use s3s::service::{S3Service, S3ServiceBuilder};

use super::{BackendError, ForwardRequest, path_style_path};
use crate::body::Body;
use crate::s3::headers;
use crate::s3::route::{S3Op, Target};

/// In-process S3 over a local directory.
#[derive(Clone)]
pub struct FsBackend {
    service: Arc<S3Service>,
    root: std::path::PathBuf,
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
        Ok(Self { service: Arc::new(S3ServiceBuilder::new(fs).build()), root: root.to_path_buf() })
    }

    pub async fn send(&self, req: ForwardRequest) -> Result<Response<Body>, BackendError> {
        if req.target.key.as_deref().is_some_and(|k| !is_safe_key(k)) {
            return Err(BackendError::UnsafeKey);
        }
        // A copy reads its source like a GET reads its key: the same check.
        if let Some(source) = req.headers.get(headers::X_AMZ_COPY_SOURCE) {
            let safe = source
                .to_str()
                .ok()
                .and_then(|v| crate::s3::route::copy_source(v).ok())
                .is_some_and(|(_, key)| is_safe_key(&key));
            if !safe {
                return Err(BackendError::UnsafeKey);
            }
        }
        // A key that names a directory (the common prefix of other keys, such as `rc` of `rc/a`)
        // is no object: S3 answers `404 NoSuchKey`, where s3s-fs would fail with `500` (and
        // rclone, which HEADs the destination prefix, would retry for a minute and a half).
        if matches!(req.op, S3Op::GetObject | S3Op::HeadObject)
            && let (Some(bucket), Some(key)) = (&req.target.bucket, &req.target.key)
            && tokio::fs::metadata(self.root.join(bucket).join(key.trim_end_matches('/')))
                .await
                .is_ok_and(|m| m.is_dir())
        {
            return Ok(no_such_key(&req.target, req.method == http::Method::HEAD));
        }
        // A local directory has no ACLs: anonymous requests (allow_anonymous) may read only.
        if req.anonymous && !matches!(req.method, http::Method::GET | http::Method::HEAD) {
            return Err(BackendError::AnonymousWrite);
        }
        let path = path_style_path(&req.target);
        let uri = match &req.query {
            Some(q) if !q.is_empty() => format!("{path}?{q}"),
            _ => path,
        };
        // s3s answers a failed body read with a bare `500`; the failure itself (a stall, a bad
        // signature) is kept here and becomes the client's answer, as with the s3 backend.
        let failed: Arc<Mutex<Option<crate::body::BoxError>>> = Arc::default();
        let seen = failed.clone();
        let body = Body::from_stream(TryStreamExt::map_err(req.body.into_data_stream(), move |e| {
            let (message, e) = (e.to_string(), e.into_inner());
            seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get_or_insert(e);
            std::io::Error::other(message)
        }));
        let mut out = Request::builder()
            .method(req.method)
            .uri(uri)
            .body(s3s::Body::http_body_unsync(body))
            .map_err(|e| BackendError::Internal(e.into()))?;
        *out.headers_mut() = req.headers;
        // The gateway consumed these; s3s-fs must see a plain anonymous request.
        for h in [headers::X_AMZ_DECODED_CONTENT_LENGTH, headers::X_AMZ_TRAILER] {
            out.headers_mut().remove(h);
        }
        strip_aws_chunked(out.headers_mut());
        out.headers_mut().insert(http::header::HOST, HeaderValue::from_static("localhost"));
        let resp = self.call(out).await?;
        if let Some(source) = failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take() {
            return Err(BackendError::SendBody { source });
        }
        if matches!(req.op, S3Op::ListObjects | S3Op::ListObjectsV2) && resp.status().is_success() {
            return self.complete_listing(&req.target, resp).await;
        }
        Ok(resp)
    }

    async fn call(&self, req: Request<s3s::Body>) -> Result<Response<Body>, BackendError> {
        let resp = self.service.call(req).await.map_err(|e| BackendError::Internal(format!("{e:?}").into()))?;
        Ok(resp.map(Body::new))
    }

    /// `s3s-fs` lists objects with key, size and time only; S3 clients expect every entry to carry
    /// its `ETag` and `StorageClass` too (CRT-based clients such as Mountpoint refuse listings
    /// without them). Each entry's ETag is what a HEAD of it answers.
    async fn complete_listing(&self, target: &Target, resp: Response<Body>) -> Result<Response<Body>, BackendError> {
        let (mut parts, body) = resp.into_parts();
        let xml = http_body_util::Limited::new(body, MAX_LISTING_BYTES)
            .collect()
            .await
            .map_err(BackendError::Internal)?
            .to_bytes();
        let bucket = target.bucket.clone().unwrap_or_default();
        let mut etags = HashMap::new();
        for key in listing::keys_without_etag(&xml).map_err(|e| BackendError::Internal(e.into()))? {
            let head = Request::builder()
                .method(http::Method::HEAD)
                .uri(path_style_path(&Target {
                    bucket: Some(bucket.clone()),
                    key: Some(key.clone()),
                    virtual_host: false,
                }))
                .header(http::header::HOST, "localhost")
                .body(s3s::Body::empty())
                .map_err(|e| BackendError::Internal(e.into()))?;
            let etag = self
                .call(head)
                .await?
                .headers()
                .get(http::header::ETAG)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            if let Some(etag) = etag {
                etags.insert(key, etag);
            }
        }
        let xml = listing::complete(&xml, &etags).map_err(|e| BackendError::Internal(e.into()))?;
        parts.headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(xml.len()));
        Ok(Response::from_parts(parts, Body::from(xml)))
    }
}

/// S3's answer for a key that holds no object.
fn no_such_key(target: &Target, head: bool) -> Response<Body> {
    let body = if head {
        Body::empty()
    } else {
        Body::from(crate::s3::xml::error_body(
            "NoSuchKey",
            "The specified key does not exist.",
            &target.resource(),
            "-",
        ))
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = http::StatusCode::NOT_FOUND;
    resp.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
    resp
}

/// Largest listing body read back to complete it (1000 entries of 1 KiB keys, with room).
const MAX_LISTING_BYTES: usize = 4 * 1024 * 1024;

/// Completing `ListObjects` / `ListObjectsV2` XML (pure).
mod listing {
    use std::collections::HashMap;

    use quick_xml::events::{BytesText, Event};
    use quick_xml::{Reader, Writer};

    /// The keys of `<Contents>` entries that have no `<ETag>`.
    pub fn keys_without_etag(xml: &[u8]) -> Result<Vec<String>, quick_xml::Error> {
        let mut missing = Vec::new();
        rewrite(xml, &HashMap::new(), &mut missing)?;
        Ok(missing)
    }

    /// The same XML with `<ETag>` (from `etags`) and `<StorageClass>STANDARD</StorageClass>`
    /// added to every `<Contents>` entry that lacks them.
    pub fn complete(xml: &[u8], etags: &HashMap<String, String>) -> Result<Vec<u8>, quick_xml::Error> {
        rewrite(xml, etags, &mut Vec::new())
    }

    /// One pass over the listing: completes the entries and records the keys without an ETag.
    fn rewrite(
        xml: &[u8],
        etags: &HashMap<String, String>,
        missing: &mut Vec<String>,
    ) -> Result<Vec<u8>, quick_xml::Error> {
        let mut reader = Reader::from_reader(xml);
        let mut writer = Writer::new(Vec::with_capacity(xml.len() + etags.len() * 64));
        let (mut path, mut key, mut has_etag, mut has_class) = (Vec::<Vec<u8>>::new(), String::new(), false, false);
        let mut buf = Vec::new();
        loop {
            let event = reader.read_event_into(&mut buf)?;
            match &event {
                Event::Start(e) => {
                    path.push(e.local_name().as_ref().to_vec());
                    match e.local_name().as_ref() {
                        b"Contents" => (key, has_etag, has_class) = (String::new(), false, false),
                        b"ETag" => has_etag = true,
                        b"StorageClass" => has_class = true,
                        _ => {}
                    }
                }
                Event::Text(t) if path.last().is_some_and(|n| n == b"Key") && in_contents(&path) => {
                    key = t.unescape()?.into_owned();
                }
                Event::End(e) => {
                    path.pop();
                    if e.local_name().as_ref() == b"Contents" {
                        match etags.get(&key) {
                            _ if has_etag => {}
                            Some(etag) => write_text(&mut writer, "ETag", etag)?,
                            None => missing.push(std::mem::take(&mut key)),
                        }
                        if !has_class {
                            write_text(&mut writer, "StorageClass", "STANDARD")?;
                        }
                    }
                }
                Event::Eof => break,
                _ => {}
            }
            writer.write_event(event)?;
            buf.clear();
        }
        Ok(writer.into_inner())
    }

    fn in_contents(path: &[Vec<u8>]) -> bool {
        path.len() >= 2 && path[path.len() - 2] == b"Contents"
    }

    fn write_text(w: &mut Writer<Vec<u8>>, name: &str, value: &str) -> Result<(), quick_xml::Error> {
        w.create_element(name).write_text_content(BytesText::new(value))?;
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn entries_get_their_etag_and_storage_class() {
            let xml = br#"<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><Contents><Key>a&amp;b</Key><Size>3</Size></Contents><Contents><Key>c</Key><ETag>"x"</ETag><StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"#;
            assert_eq!(keys_without_etag(xml).expect("xml"), vec!["a&b".to_owned()]);
            let etags = HashMap::from([("a&b".to_owned(), "\"d41d8cd98f00b204e9800998ecf8427e\"".to_owned())]);
            let out = String::from_utf8(complete(xml, &etags).expect("xml")).expect("utf8");
            assert!(out.contains(r#"<Key>a&amp;b</Key><Size>3</Size><ETag>&quot;d41d8cd98f00b204e9800998ecf8427e&quot;</ETag><StorageClass>STANDARD</StorageClass></Contents>"#), "{out}");
            assert!(
                out.contains(
                    r#"<Key>c</Key><ETag>"x"</ETag><StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"#
                ),
                "{out}"
            );
        }
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
