//! Pure routing: which bucket and key a request addresses (path-style or virtual-host-style) and
//! which S3 operation it is. No IO; used for metrics labels, retry decisions and the backend URL.
//!
//! Operation table: <https://docs.aws.amazon.com/AmazonS3/latest/API/API_Operations_Amazon_Simple_Storage_Service.html>

use http::{HeaderMap, Method};

use super::headers::X_AMZ_COPY_SOURCE;
use super::sigv4::uri_decode;

/// Longest bucket name (S3 allows 63; legacy us-east-1 names up to 255).
pub(crate) const MAX_BUCKET_NAME: usize = 255;
/// Longest object key S3 accepts, in bytes.
pub(crate) const MAX_KEY_BYTES: usize = 1024;

/// The bucket and key a request addresses.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Target {
    pub(crate) bucket: Option<String>,
    /// Decoded key; `None` for bucket- and service-level requests.
    pub(crate) key: Option<String>,
    /// The bucket came from the `Host` header (virtual-host style).
    pub(crate) virtual_host: bool,
}

impl Target {
    /// `/bucket/key` for error `Resource` elements and logs.
    #[must_use]
    pub fn resource(&self) -> String {
        match (&self.bucket, &self.key) {
            (Some(b), Some(k)) => format!("/{b}/{k}"),
            (Some(b), None) => format!("/{b}"),
            _ => "/".to_owned(),
        }
    }
}

/// Why a request could not be routed.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("the specified bucket name is not valid")]
    InvalidBucketName,
    #[error("the object key is longer than {MAX_KEY_BYTES} bytes")]
    KeyTooLong,
}

/// Resolves the target from the `Host` header and the raw path. A host equal to `<bucket>.<domain>`
/// for one of the configured `domains` selects virtual-host style; otherwise path style.
///
/// # Errors
/// An invalid bucket name or an over-long key.
pub fn resolve(host: Option<&str>, raw_path: &str, domains: &[String]) -> Result<Target, RouteError> {
    let path = uri_decode(raw_path);
    let path = path.strip_prefix('/').unwrap_or(&path);
    let host =
        host.map(|h| h.rsplit_once(':').filter(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())).map_or(h, |(h, _)| h));
    let vhost_bucket = host.and_then(|h| {
        domains
            .iter()
            .find_map(|d| h.strip_suffix(d.as_str()).and_then(|b| b.strip_suffix('.')).filter(|b| !b.is_empty()))
    });
    let (bucket, key) = match vhost_bucket {
        Some(b) => (Some(b.to_owned()), (!path.is_empty()).then(|| path.to_owned())),
        None => match path.split_once('/') {
            None if path.is_empty() => (None, None),
            None => (Some(path.to_owned()), None),
            Some((b, "")) => (Some(b.to_owned()), None),
            Some((b, k)) => (Some(b.to_owned()), Some(k.to_owned())),
        },
    };
    if let Some(b) = &bucket {
        validate_bucket(b)?;
    }
    if key.as_ref().is_some_and(|k| k.len() > MAX_KEY_BYTES) {
        return Err(RouteError::KeyTooLong);
    }
    Ok(Target { bucket, key, virtual_host: vhost_bucket.is_some() })
}

/// The `(bucket, key)` an `x-amz-copy-source` header names: `[/]bucket/key[?versionId=v]`,
/// percent-encoded as S3 defines it. The bucket is validated like any other.
///
/// # Errors
/// An invalid bucket name or an over-long key.
pub fn copy_source(header: &str) -> Result<(String, String), RouteError> {
    let path = header.split_once('?').map_or(header, |(p, _)| p);
    let path = uri_decode(path);
    let path = path.strip_prefix('/').unwrap_or(&path);
    let (bucket, key) = path.split_once('/').ok_or(RouteError::InvalidBucketName)?;
    validate_bucket(bucket)?;
    if key.len() > MAX_KEY_BYTES {
        return Err(RouteError::KeyTooLong);
    }
    Ok((bucket.to_owned(), key.to_owned()))
}

/// Bucket names: the union of current and legacy S3 rules (letters, digits, `.`, `-`, `_`), and never
/// `.`/`..`-like names, so that no backend can be tricked into a path outside its root. One `:` may
/// precede the name: Ceph RGW's `tenant:bucket` names another tenant's bucket (`:bucket` the
/// global tenant's); the store decides (AWS refuses it).
fn validate_bucket(b: &str) -> Result<(), RouteError> {
    let name =
        b.split_once(':').map_or(b, |(tenant, name)| if valid_name(tenant) || tenant.is_empty() { name } else { "" });
    let ok = b.len() <= MAX_BUCKET_NAME && valid_name(name);
    if ok { Ok(()) } else { Err(RouteError::InvalidBucketName) }
}

fn valid_name(b: &str) -> bool {
    !b.is_empty()
        && b.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_'))
        && !b.contains("..")
        && b != "."
}

macro_rules! ops {
    ($($op:ident),* $(,)?) => {
        /// The S3 operations the gateway distinguishes (for metrics, logs and retry decisions).
        /// Everything else is forwarded as [`S3Op::Other`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum S3Op { $($op,)* Other }

        impl S3Op {
            /// How many operations there are ([`S3Op::Other`] included).
            pub(crate) const COUNT: usize = [$(stringify!($op),)* "Other"].len();

            /// A distinct index below [`S3Op::COUNT`] (for per-operation tables).
            #[must_use]
            pub(crate) fn index(self) -> usize {
                self as usize
            }

            /// Stable name, used as a metrics label and in logs.
            #[must_use]
            pub(crate) fn name(self) -> &'static str {
                match self { $(Self::$op => stringify!($op),)* Self::Other => "Other" }
            }
        }
    };
}

ops!(
    ListBuckets,
    CreateBucket,
    DeleteBucket,
    HeadBucket,
    GetBucketLocation,
    ListObjects,
    ListObjectsV2,
    ListObjectVersions,
    ListMultipartUploads,
    DeleteObjects,
    PostObject,
    BucketSubresource,
    GetObject,
    HeadObject,
    PutObject,
    CopyObject,
    DeleteObject,
    GetObjectTagging,
    PutObjectTagging,
    DeleteObjectTagging,
    ObjectSubresource,
    CreateMultipartUpload,
    UploadPart,
    UploadPartCopy,
    CompleteMultipartUpload,
    AbortMultipartUpload,
    ListParts,
);

impl S3Op {
    /// Whether the operation may be retried after a transport failure: it reads, or repeating it
    /// leaves the same state. Only body-less requests are ever retried (a streamed body cannot be
    /// replayed), so this is checked together with the method.
    #[must_use]
    pub(crate) fn is_idempotent(self) -> bool {
        matches!(
            self,
            Self::ListBuckets
                | Self::HeadBucket
                | Self::GetBucketLocation
                | Self::ListObjects
                | Self::ListObjectsV2
                | Self::ListObjectVersions
                | Self::ListMultipartUploads
                | Self::GetObject
                | Self::HeadObject
                | Self::GetObjectTagging
                | Self::DeleteObject
                | Self::DeleteObjectTagging
                | Self::ListParts
                | Self::BucketSubresource
                | Self::ObjectSubresource
        )
    }
}

/// Classifies a request. `query` is the raw query string.
#[must_use]
pub fn classify(method: &Method, target: &Target, query: Option<&str>, headers: &HeaderMap) -> S3Op {
    let present = Subresources::of(query);
    let has = |names: u16| present.0 & names != 0; // any of them
    let copy = headers.contains_key(X_AMZ_COPY_SOURCE);
    let m = method.as_str();
    match (&target.bucket, &target.key) {
        (None, _) => {
            if m == "GET" {
                S3Op::ListBuckets
            } else {
                S3Op::Other
            }
        }
        (Some(_), None) => match m {
            "GET" if has(Subresources::LOCATION) => S3Op::GetBucketLocation,
            "GET" if has(Subresources::UPLOADS) => S3Op::ListMultipartUploads,
            "GET" if has(Subresources::VERSIONS) => S3Op::ListObjectVersions,
            "GET" if query.is_some_and(|q| q.split('&').any(|p| p == "list-type=2")) => S3Op::ListObjectsV2,
            "GET"
                if query.is_none_or(|q| q.split('&').all(|p| is_list_v1_param(p.split('=').next().unwrap_or("")))) =>
            {
                S3Op::ListObjects
            }
            "GET" => S3Op::BucketSubresource,
            "PUT" if query.is_none_or(str::is_empty) => S3Op::CreateBucket,
            "PUT" => S3Op::BucketSubresource,
            "DELETE" if query.is_none_or(str::is_empty) => S3Op::DeleteBucket,
            "DELETE" => S3Op::BucketSubresource,
            "HEAD" => S3Op::HeadBucket,
            "POST" if has(Subresources::DELETE) => S3Op::DeleteObjects,
            // A browser upload: the form carries the key, the policy and its signature.
            "POST"
                if headers
                    .get(http::header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .is_some_and(|v| v.trim_start().to_ascii_lowercase().starts_with("multipart/form-data")) =>
            {
                S3Op::PostObject
            }
            _ => S3Op::Other,
        },
        (Some(_), Some(_)) => match m {
            "GET" if has(Subresources::UPLOAD_ID) => S3Op::ListParts,
            "GET" if has(Subresources::TAGGING) => S3Op::GetObjectTagging,
            "GET"
                if has(Subresources::ACL
                    | Subresources::ATTRIBUTES
                    | Subresources::RETENTION
                    | Subresources::LEGAL_HOLD) =>
            {
                S3Op::ObjectSubresource
            }
            "GET" => S3Op::GetObject,
            "HEAD" => S3Op::HeadObject,
            "PUT" if has(Subresources::TAGGING) => S3Op::PutObjectTagging,
            "PUT" if has(Subresources::UPLOAD_ID) && copy => S3Op::UploadPartCopy,
            "PUT" if has(Subresources::UPLOAD_ID) => S3Op::UploadPart,
            "PUT" if has(Subresources::ACL | Subresources::RETENTION | Subresources::LEGAL_HOLD) => {
                S3Op::ObjectSubresource
            }
            "PUT" if copy => S3Op::CopyObject,
            "PUT" => S3Op::PutObject,
            "DELETE" if has(Subresources::TAGGING) => S3Op::DeleteObjectTagging,
            "DELETE" if has(Subresources::UPLOAD_ID) => S3Op::AbortMultipartUpload,
            "DELETE" => S3Op::DeleteObject,
            "POST" if has(Subresources::UPLOADS) => S3Op::CreateMultipartUpload,
            "POST" if has(Subresources::UPLOAD_ID) => S3Op::CompleteMultipartUpload,
            _ => S3Op::Other,
        },
    }
}

/// Which of the query parameters that choose an operation a query holds, found in one pass
/// (a bit each).
#[derive(Debug, Clone, Copy)]
struct Subresources(u16);

impl Subresources {
    const LOCATION: u16 = 1;
    const UPLOADS: u16 = 1 << 1;
    const VERSIONS: u16 = 1 << 2;
    const DELETE: u16 = 1 << 3;
    const UPLOAD_ID: u16 = 1 << 4;
    const TAGGING: u16 = 1 << 5;
    const ACL: u16 = 1 << 6;
    const ATTRIBUTES: u16 = 1 << 7;
    const RETENTION: u16 = 1 << 8;
    const LEGAL_HOLD: u16 = 1 << 9;

    fn of(query: Option<&str>) -> Self {
        let mut bits = 0;
        for p in query.unwrap_or_default().split('&') {
            bits |= match p.split_once('=').map_or(p, |(name, _)| name) {
                "location" => Self::LOCATION,
                "uploads" => Self::UPLOADS,
                "versions" => Self::VERSIONS,
                "delete" => Self::DELETE,
                "uploadId" => Self::UPLOAD_ID,
                "tagging" => Self::TAGGING,
                "acl" => Self::ACL,
                "attributes" => Self::ATTRIBUTES,
                "retention" => Self::RETENTION,
                "legal-hold" => Self::LEGAL_HOLD,
                _ => 0,
            };
        }
        Self(bits)
    }
}

fn is_list_v1_param(name: &str) -> bool {
    matches!(name, "" | "prefix" | "delimiter" | "marker" | "max-keys" | "encoding-type")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(b: Option<&str>, k: Option<&str>) -> Target {
        Target { bucket: b.map(Into::into), key: k.map(Into::into), virtual_host: false }
    }

    fn vt(b: &str, k: Option<&str>) -> Target {
        Target { virtual_host: true, ..t(Some(b), k) }
    }

    #[test]
    fn path_and_virtual_host_style() {
        let d = vec!["s3.example.com".to_owned()];
        assert_eq!(resolve(Some("localhost:9000"), "/b/a/b%20c", &d).expect("ok"), t(Some("b"), Some("a/b c")));
        assert_eq!(resolve(Some("b.s3.example.com:9000"), "/a/b", &d).expect("ok"), vt("b", Some("a/b")));
        assert_eq!(resolve(Some("b.s3.example.com"), "/", &d).expect("ok"), vt("b", None));
        assert_eq!(resolve(Some("s3.example.com"), "/", &d).expect("ok"), t(None, None));
        assert_eq!(resolve(None, "/b/", &d).expect("ok"), t(Some("b"), None));
        assert!(matches!(resolve(None, "/../x", &d), Err(RouteError::InvalidBucketName)));
        // Ceph RGW's tenant syntax: one `:`, before a valid name.
        assert_eq!(resolve(None, "/s3t:b/k", &d).expect("ok"), t(Some("s3t:b"), Some("k")));
        assert_eq!(resolve(None, "/:b/k", &d).expect("ok"), t(Some(":b"), Some("k")));
        for bad in ["/s3t:/k", "/a:b:c/k", "/..:b/k", "/s3t:../k"] {
            assert!(matches!(resolve(None, bad, &d), Err(RouteError::InvalidBucketName)), "{bad}");
        }
        // A key may contain `..` segments in S3; only the fs backend refuses them (see backend::fs).
        assert_eq!(resolve(None, "/a%2F..%2Fb/x", &d).expect("ok"), t(Some("a"), Some("../b/x")));
        let long = format!("/b/{}", "k".repeat(MAX_KEY_BYTES + 1));
        assert!(matches!(resolve(None, &long, &d), Err(RouteError::KeyTooLong)));
    }

    #[test]
    fn operations() {
        let h = HeaderMap::new();
        let mut copy = HeaderMap::new();
        copy.insert(X_AMZ_COPY_SOURCE, "/b/src".parse().expect("value"));
        let bucket = t(Some("b"), None);
        let object = t(Some("b"), Some("k"));
        let cases = [
            (Method::GET, t(None, None), None, &h, S3Op::ListBuckets),
            (Method::GET, bucket.clone(), Some("list-type=2&prefix=a"), &h, S3Op::ListObjectsV2),
            (Method::GET, bucket.clone(), Some("prefix=a&marker=x"), &h, S3Op::ListObjects),
            (Method::GET, bucket.clone(), Some("location"), &h, S3Op::GetBucketLocation),
            (Method::GET, bucket.clone(), Some("uploads"), &h, S3Op::ListMultipartUploads),
            (Method::PUT, bucket.clone(), None, &h, S3Op::CreateBucket),
            (Method::POST, bucket.clone(), Some("delete"), &h, S3Op::DeleteObjects),
            (Method::HEAD, bucket, None, &h, S3Op::HeadBucket),
            (Method::GET, object.clone(), None, &h, S3Op::GetObject),
            (Method::PUT, object.clone(), None, &copy, S3Op::CopyObject),
            (Method::PUT, object.clone(), Some("partNumber=1&uploadId=u"), &h, S3Op::UploadPart),
            (Method::PUT, object.clone(), Some("partNumber=1&uploadId=u"), &copy, S3Op::UploadPartCopy),
            (Method::POST, object.clone(), Some("uploads"), &h, S3Op::CreateMultipartUpload),
            (Method::POST, object.clone(), Some("uploadId=u"), &h, S3Op::CompleteMultipartUpload),
            (Method::DELETE, object.clone(), Some("uploadId=u"), &h, S3Op::AbortMultipartUpload),
            (Method::GET, object.clone(), Some("tagging"), &h, S3Op::GetObjectTagging),
            (Method::DELETE, object, None, &h, S3Op::DeleteObject),
        ];
        for (m, target, q, hd, want) in cases {
            assert_eq!(classify(&m, &target, q, hd), want, "{m} {target:?} {q:?}");
        }
        assert!(S3Op::GetObject.is_idempotent());
        assert!(!S3Op::CompleteMultipartUpload.is_idempotent());
    }
}
