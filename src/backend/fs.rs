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

use super::request::{BackendError, ForwardRequest, path_style_path};
use crate::body::Body;
use crate::s3::headers;
use crate::s3::route::{S3Op, Target};

/// In-process S3 over a local directory.
#[derive(Clone)]
pub(crate) struct FsBackend {
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
    pub(crate) fn new(root: &Path) -> Result<Self, std::io::Error> {
        std::fs::create_dir_all(root)?;
        let fs = s3s_fs::FileSystem::new(root).map_err(|e| std::io::Error::other(format!("{e:?}")))?;
        Ok(Self { service: Arc::new(S3ServiceBuilder::new(fs).build()), root: root.to_path_buf() })
    }

    pub(crate) async fn send(&self, req: ForwardRequest) -> Result<Response<Body>, BackendError> {
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
            let head = req.method == http::Method::HEAD;
            return Ok(s3_error(
                http::StatusCode::NOT_FOUND,
                "NoSuchKey",
                "The specified key does not exist.",
                &req.target,
                head,
            ));
        }
        // A suffix range longer than the object is the whole object (RFC 9110 section 14.1.2,
        // as S3 answers it); s3s-fs seeks that far before the file's start and fails with `500`.
        let mut req = req;
        if req.op == S3Op::GetObject
            && let Some(length) = suffix_length(req.headers.get(http::header::RANGE))
            && let (Some(bucket), Some(key)) = (&req.target.bucket, &req.target.key)
            && tokio::fs::metadata(self.root.join(bucket).join(key)).await.is_ok_and(|m| m.len() <= length)
        {
            req.headers.insert(http::header::RANGE, HeaderValue::from_static("bytes=0-"));
        }
        // A local directory has no ACLs: anonymous requests (allow_anonymous) may read only.
        if req.authority.store_decides() && !matches!(req.method, http::Method::GET | http::Method::HEAD) {
            return Err(BackendError::AnonymousWrite);
        }
        // A listing is asked of s3s-fs in the form it understands, and its answer put in the form
        // the client asked for (`listing::Asked`).
        let (query, asked) = match (&req.op, req.query.as_deref()) {
            (S3Op::ListObjects | S3Op::ListObjectsV2, q) => match listing::Asked::parse(q.unwrap_or_default()) {
                Ok((query, asked)) => (Some(query), Some(asked)),
                Err(message) => {
                    return Ok(s3_error(http::StatusCode::BAD_REQUEST, "InvalidArgument", message, &req.target, false));
                }
            },
            (_, q) => (q.map(str::to_owned), None),
        };
        let path = path_style_path(&req.target);
        let uri = match &query {
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
        if let Some(asked) = asked
            && resp.status().is_success()
        {
            return self.complete_listing(&req.target, resp, &asked).await;
        }
        Ok(resp)
    }

    async fn call(&self, req: Request<s3s::Body>) -> Result<Response<Body>, BackendError> {
        let resp = self.service.call(req).await.map_err(|e| BackendError::Internal(format!("{e:?}").into()))?;
        Ok(resp.map(Body::new))
    }

    /// `s3s-fs` lists objects with key, size and time only; S3 clients expect every entry to carry
    /// its `ETag` and `StorageClass` too (CRT-based clients such as Mountpoint refuse listings
    /// without them). Each entry's ETag is what a HEAD of it answers. The names are then put in
    /// the form the client asked for (`listing::Asked`).
    async fn complete_listing(
        &self,
        target: &Target,
        resp: Response<Body>,
        asked: &listing::Asked,
    ) -> Result<Response<Body>, BackendError> {
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
        let xml = listing::complete(&xml, &etags, asked).map_err(|e| BackendError::Internal(e.into()))?;
        parts.headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(xml.len()));
        Ok(Response::from_parts(parts, Body::from(xml)))
    }
}

/// An S3 error answered as the store would (the backend's answer, passed through as such).
fn s3_error(status: http::StatusCode, code: &str, message: &str, target: &Target, head: bool) -> Response<Body> {
    let body = if head {
        Body::empty()
    } else {
        Body::from(crate::s3::xml::error_body(code, message, &target.resource(), "-"))
    };
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
    resp
}

/// Largest listing body read back to complete it (1000 entries of 1 KiB keys, with room).
const MAX_LISTING_BYTES: usize = 4 * 1024 * 1024;

/// `ListObjects` / `ListObjectsV2` as S3 answers them, over what `s3s-fs` answers (pure).
///
/// `s3s-fs` 0.14 differs from S3 in five ways, each mended here: an empty `delimiter=` (which
/// S3 treats as none; CRT-based clients always send it) rolls every key up into a one-character
/// common prefix (and panics on a key whose next character is not ASCII); a delimiter of several
/// characters ends common prefixes after its first one; `encoding-type=url` is echoed but the
/// names are not encoded (boto3 always asks for it and decodes them, so keys with `+`, `%` or
/// spaces came back wrong); a v1 `marker` is not echoed; entries lack `ETag` and `StorageClass`.
/// Not answered as S3 does: `fetch-owner=true` (a directory has no owners, so entries carry no
/// `Owner`), and delimiters that start with a non-ASCII character (refused, `400`).
pub mod listing {
    use std::collections::HashMap;

    use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
    use quick_xml::events::{BytesText, Event};
    use quick_xml::{Reader, Writer};

    /// What S3 leaves unencoded in a listing with `encoding-type=url`: the unreserved characters
    /// and `/`. A space becomes `%20` (not `+`), which every SDK's decoder reads back as a space.
    const LISTING_NAME: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~').remove(b'/');

    /// What a listing request asks for beyond what `s3s-fs` does itself.
    #[derive(Debug, Default, PartialEq, Eq)]
    pub struct Asked {
        /// `encoding-type=url`: names in the answer are URL-encoded.
        pub(crate) encode: bool,
        /// The delimiter's characters after its first (`s3s-fs` ends common prefixes after it).
        pub(crate) delimiter_tail: String,
        /// A ListObjects (v1) `marker`, which S3 echoes and `s3s-fs` does not.
        pub(crate) marker: Option<String>,
    }

    impl Asked {
        /// The query for `s3s-fs` (the client's, without an empty `delimiter`) and what its
        /// answer must become; `Err` with S3's message for a parameter S3 refuses.
        pub fn parse(query: &str) -> Result<(String, Self), &'static str> {
            let (mut asked, mut v2) = (Self::default(), false);
            let mut kept = Vec::new();
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                let value = percent_decode_str(value).decode_utf8_lossy();
                match &*percent_decode_str(name).decode_utf8_lossy() {
                    "delimiter" if value.is_empty() => continue,
                    // s3s-fs slices a key after the delimiter's first byte: one that is not a
                    // whole character would panic there.
                    "delimiter" if !value.starts_with(|c: char| c.is_ascii()) => {
                        return Err("The fs backend takes only delimiters that start with an ASCII character");
                    }
                    "delimiter" => asked.delimiter_tail = value.chars().skip(1).collect(),
                    "encoding-type" if value.is_empty() => continue,
                    "encoding-type" if value == "url" => asked.encode = true,
                    "encoding-type" => return Err("Invalid Encoding Method specified in Request"),
                    "list-type" => v2 = value == "2",
                    "marker" => asked.marker = Some(value.into_owned()),
                    _ => {}
                }
                kept.push(pair);
            }
            if v2 {
                asked.marker = None;
            }
            Ok((kept.join("&"), asked))
        }

        /// A name as the answer carries it: URL-encoded when the client asked for that.
        fn name<'a>(&self, text: &'a str) -> std::borrow::Cow<'a, str> {
            if self.encode { utf8_percent_encode(text, LISTING_NAME).into() } else { text.into() }
        }
    }

    /// The keys of `<Contents>` entries that have no `<ETag>`.
    pub fn keys_without_etag(xml: &[u8]) -> Result<Vec<String>, quick_xml::Error> {
        let mut missing = Vec::new();
        rewrite(xml, &HashMap::new(), &Asked::default(), &mut missing)?;
        Ok(missing)
    }

    /// The same XML with `<ETag>` (from `etags`) and `<StorageClass>STANDARD</StorageClass>`
    /// added to every `<Contents>` entry that lacks them, common prefixes ending with the whole
    /// delimiter, and names encoded when the client asked for it.
    pub fn complete(xml: &[u8], etags: &HashMap<String, String>, asked: &Asked) -> Result<Vec<u8>, quick_xml::Error> {
        rewrite(xml, etags, asked, &mut Vec::new())
    }

    /// One pass over the listing: completes the entries and records the keys without an ETag.
    fn rewrite(
        xml: &[u8],
        etags: &HashMap<String, String>,
        asked: &Asked,
        missing: &mut Vec<String>,
    ) -> Result<Vec<u8>, quick_xml::Error> {
        let mut reader = Reader::from_reader(xml);
        let mut writer = Writer::new(Vec::with_capacity(xml.len() + etags.len() * 64));
        let (mut path, mut key, mut has_etag, mut has_class) = (Vec::<Vec<u8>>::new(), String::new(), false, false);
        let mut has_marker = false;
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
                        b"Marker" if path.len() == 2 => has_marker = true,
                        _ => {}
                    }
                }
                Event::Text(t) if Name::of(&path) != Name::Other => {
                    let name = Name::of(&path);
                    let mut text = t.unescape()?.into_owned();
                    if name == Name::CommonPrefix {
                        text.push_str(&asked.delimiter_tail);
                    }
                    writer.write_event(Event::Text(BytesText::new(&asked.name(&text))))?;
                    if name == Name::Key {
                        key = text;
                    }
                    buf.clear();
                    continue;
                }
                Event::End(e) => {
                    path.pop();
                    if let Some(marker) = asked.marker.as_deref().filter(|_| path.is_empty() && !has_marker) {
                        write_text(&mut writer, "Marker", &asked.name(marker))?;
                    }
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

    /// The elements of a listing whose text is a name (encoded with `encoding-type=url`).
    #[derive(Debug, PartialEq, Eq, Clone, Copy)]
    enum Name {
        Key,
        CommonPrefix,
        /// `Prefix`, `Delimiter`, `StartAfter`, `Marker`, `NextMarker` of the result itself.
        Echo,
        Other,
    }

    impl Name {
        fn of(path: &[Vec<u8>]) -> Self {
            match path {
                [_, parent, leaf] if parent == b"Contents" && leaf == b"Key" => Self::Key,
                [_, parent, leaf] if parent == b"CommonPrefixes" && leaf == b"Prefix" => Self::CommonPrefix,
                [_, leaf]
                    if matches!(&leaf[..], b"Prefix" | b"Delimiter" | b"StartAfter" | b"Marker" | b"NextMarker") =>
                {
                    Self::Echo
                }
                _ => Self::Other,
            }
        }
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
            let out = String::from_utf8(complete(xml, &etags, &Asked::default()).expect("xml")).expect("utf8");
            assert!(out.contains(r#"<Key>a&amp;b</Key><Size>3</Size><ETag>&quot;d41d8cd98f00b204e9800998ecf8427e&quot;</ETag><StorageClass>STANDARD</StorageClass></Contents>"#), "{out}");
            assert!(
                out.contains(
                    r#"<Key>c</Key><ETag>"x"</ETag><StorageClass>STANDARD</StorageClass></Contents></ListBucketResult>"#
                ),
                "{out}"
            );
        }

        #[test]
        fn an_empty_delimiter_is_no_delimiter_and_encoding_is_checked() {
            let (q, asked) = Asked::parse("list-type=2&delimiter=&max-keys=1000&prefix=d%2F").expect("valid");
            assert_eq!(q, "list-type=2&max-keys=1000&prefix=d%2F");
            assert_eq!(asked, Asked::default());
            let (q, asked) = Asked::parse("delimiter&encoding-type=url&prefix=").expect("valid");
            assert_eq!((q.as_str(), asked.encode), ("encoding-type=url&prefix=", true));
            let (q, asked) = Asked::parse("delimiter=%2F%2A&encoding-type=").expect("valid");
            assert_eq!((q.as_str(), asked.delimiter_tail.as_str(), asked.encode), ("delimiter=%2F%2A", "*", false));
            assert_eq!(Asked::parse("").expect("valid"), (String::new(), Asked::default()));
            assert!(Asked::parse("encoding-type=base64").is_err());
            assert!(Asked::parse("delimiter=%C3%A9").is_err());
            assert_eq!(Asked::parse("delimiter=-%C3%A9").expect("valid").1.delimiter_tail, "é");
        }

        #[test]
        fn names_are_encoded_and_prefixes_end_with_the_whole_delimiter() {
            let xml = br#"<ListBucketResult><Name>b k</Name><Prefix>d +/</Prefix><Delimiter>/*</Delimiter><Contents><Key>d +/a%b&amp;c</Key><Size>1</Size><ETag>"e"</ETag><StorageClass>STANDARD</StorageClass></Contents><CommonPrefixes><Prefix>d +/x/</Prefix></CommonPrefixes><EncodingType>url</EncodingType></ListBucketResult>"#;
            let asked = Asked { encode: true, delimiter_tail: "*".to_owned(), marker: None };
            let out = String::from_utf8(complete(xml, &HashMap::new(), &asked).expect("xml")).expect("utf8");
            assert!(out.contains("<Name>b k</Name><Prefix>d%20%2B/</Prefix><Delimiter>/%2A</Delimiter>"), "{out}");
            assert!(out.contains("<Key>d%20%2B/a%25b%26c</Key>"), "{out}");
            assert!(out.contains("<CommonPrefixes><Prefix>d%20%2B/x/%2A</Prefix></CommonPrefixes>"), "{out}");
            // Without encoding only the common prefixes change.
            let plain = Asked { encode: false, delimiter_tail: "*".to_owned(), marker: None };
            let out = String::from_utf8(complete(xml, &HashMap::new(), &plain).expect("xml")).expect("utf8");
            assert!(out.contains("<Key>d +/a%b&amp;c</Key>") && out.contains("<Prefix>d +/x/*</Prefix>"), "{out}");
        }

        #[test]
        fn a_v1_marker_is_echoed_once() {
            let (_, asked) = Asked::parse("marker=d%2F2%20x&encoding-type=url").expect("valid");
            assert_eq!(asked.marker.as_deref(), Some("d/2 x"));
            assert_eq!(Asked::parse("list-type=2&marker=x").expect("valid").1.marker, None);
            let xml = br#"<ListBucketResult><Name>b</Name><IsTruncated>false</IsTruncated></ListBucketResult>"#;
            let out = String::from_utf8(complete(xml, &HashMap::new(), &asked).expect("xml")).expect("utf8");
            assert!(
                out.ends_with("<IsTruncated>false</IsTruncated><Marker>d/2%20x</Marker></ListBucketResult>"),
                "{out}"
            );
            let echoed = br#"<ListBucketResult><Marker>d/2 x</Marker></ListBucketResult>"#;
            let out = String::from_utf8(complete(echoed, &HashMap::new(), &asked).expect("xml")).expect("utf8");
            assert_eq!(out.matches("<Marker>").count(), 1, "{out}");
        }
    }
}

/// Removes the `aws-chunked` token from `Content-Encoding` (the body has been decoded).
pub(crate) fn strip_aws_chunked(h: &mut http::HeaderMap) {
    let Some(v) = h.get(http::header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()) else { return };
    let rest: Vec<&str> =
        v.split(',').map(str::trim).filter(|t| !t.eq_ignore_ascii_case("aws-chunked") && !t.is_empty()).collect();
    if rest.is_empty() {
        h.remove(http::header::CONTENT_ENCODING);
    } else if let Ok(v) = HeaderValue::from_str(&rest.join(", ")) {
        h.insert(http::header::CONTENT_ENCODING, v);
    }
}

/// `n` of a `Range: bytes=-n` header.
fn suffix_length(range: Option<&HeaderValue>) -> Option<u64> {
    range?.to_str().ok()?.strip_prefix("bytes=-")?.trim().parse().ok()
}

/// Whether a key maps to a path strictly inside its bucket directory.
#[must_use]
pub(crate) fn is_safe_key(key: &str) -> bool {
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
