//! What a backend is sent and why sending can fail: the request (its target, headers, query and
//! body, and the authority it carries), shared by every backend.

use http::{HeaderMap, Method};

use crate::body::{Body, BodyError, find_body_error};
use crate::s3::authority::Authority;
use crate::s3::headers::{CLIENT_AUTH, HOP_BY_HOP, PRESIGN_QUERY, remove_all};
use crate::s3::route::{S3Op, Target};
use crate::s3::sigv4::{uri_decode, uri_encode};

/// A request ready for the backend: authenticated, with the client's auth and hop-by-hop headers
/// removed and the body already wrapped in its checks.
#[derive(Debug)]
pub(crate) struct ForwardRequest {
    pub(crate) op: S3Op,
    pub(crate) method: Method,
    pub(crate) target: Target,
    /// The query, re-encoded, without presigned-URL parameters.
    pub(crate) query: Option<String>,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Body,
    pub(crate) payload: ForwardPayload,
    /// What the request carries to the store: the store's key only for a caller the gateway
    /// authenticated; unsigned for an anonymous one; the caller's own signature in transparent
    /// mode (`crate::s3::authority`).
    pub(crate) authority: Authority,
    /// The client sent `Expect: 100-continue`: the store is asked the same, and the body is held
    /// until it answers `100 Continue` (so a store that refuses the request answers before the
    /// client sends its body, as it would without the gateway).
    pub(crate) expect_continue: bool,
}

/// What the forwarded body is, for the backend signature.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ForwardPayload {
    /// No body at all: the request can be replayed, so idempotent ones are retried.
    Empty,
    /// A body whose SHA-256 the client signed (hex); the backend checks it again.
    Sha256(String),
    /// A body not covered by any signature (or already verified chunk by chunk and decoded).
    Unsigned,
    /// A raw `STREAMING-UNSIGNED-PAYLOAD-TRAILER` body, passed through so the backend sees the
    /// trailing checksum.
    UnsignedTrailer,
}

/// Why the gateway could not get a response from the backend.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackendError {
    #[error("backend unreachable")]
    Unreachable {
        #[source]
        source: crate::body::BoxError,
    },
    #[error("backend did not respond within {secs} s")]
    Timeout { secs: u64 },
    #[error("no backend connection slot freed within backend.permit_timeout_ms ({ms} ms)")]
    Busy { ms: u64 },
    #[error("sending the request to the backend failed")]
    SendBody {
        #[source]
        source: crate::body::BoxError,
    },
    #[error("header {0} cannot be signed for the backend (not visible ASCII)")]
    UnsignableHeader(String),
    #[error("the object key cannot be stored by the fs backend (empty, '.' or '..' path segments, or a leading '/')")]
    UnsafeKey,
    #[error("the fs backend serves anonymous requests read-only")]
    AnonymousWrite,
    #[error("a request the gateway authenticated needs the store's key, and none is configured")]
    NoStoreKey,
    #[error("internal backend error")]
    Internal(#[source] crate::body::BoxError),
}

impl BackendError {
    /// The request-body failure that caused this error, if any (e.g. a bad chunk signature).
    #[must_use]
    pub(crate) fn body_error(&self) -> Option<&BodyError> {
        match self {
            Self::SendBody { source } | Self::Internal(source) | Self::Unreachable { source } => {
                find_body_error(source.as_ref())
            }
            _ => None,
        }
    }
}

/// Rebuilds a path-style request path `/bucket/key` in SigV4's canonical encoding.
#[must_use]
pub(crate) fn path_style_path(target: &Target) -> String {
    use crate::s3::sigv4::push_uri_encoded_path;
    let Some(b) = &target.bucket else { return "/".to_owned() };
    // Room for the common case, names that need no escapes.
    let mut out = String::with_capacity(2 + b.len() + target.key.as_ref().map_or(0, String::len));
    out.push('/');
    push_uri_encoded_path(&mut out, b);
    if let Some(k) = &target.key {
        out.push('/');
        push_uri_encoded_path(&mut out, k);
    }
    out
}

/// Request headers for the backend: everything but hop-by-hop headers, `host` and the client's
/// authentication (replaced by the backend signature). Unknown headers are kept.
#[must_use]
pub(crate) fn forwarded_headers(h: &HeaderMap) -> HeaderMap {
    let mut out = h.clone();
    out.remove(http::header::HOST);
    remove_all(&mut out, HOP_BY_HOP);
    remove_all(&mut out, CLIENT_AUTH);
    out
}

/// The query for the backend: presigned-URL parameters removed, every parameter re-encoded in
/// SigV4's canonical form (so the backend's canonicalization and ours agree), order kept.
#[must_use]
pub(crate) fn forwarded_query(q: Option<&str>) -> Option<String> {
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
    use http::HeaderMap;

    #[test]
    fn path_style_path_escapes_names_and_keeps_the_keys_slashes() {
        use crate::s3::route::Target;
        let t = |b: Option<&str>, k: Option<&str>| Target {
            bucket: b.map(Into::into),
            key: k.map(Into::into),
            virtual_host: false,
        };
        assert_eq!(path_style_path(&t(Some("b"), Some("a b/\u{fc}+c~"))), "/b/a%20b/%C3%BC%2Bc~");
        assert_eq!(path_style_path(&t(Some("b"), None)), "/b");
        assert_eq!(path_style_path(&t(None, None)), "/");
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
