//! Header names used in more than one place.

pub(crate) const X_AMZ_DATE: &str = "x-amz-date";
pub(crate) const X_AMZ_CONTENT_SHA256: &str = "x-amz-content-sha256";
pub(crate) const X_AMZ_DECODED_CONTENT_LENGTH: &str = "x-amz-decoded-content-length";
pub(crate) const X_AMZ_SECURITY_TOKEN: &str = "x-amz-security-token";
pub(crate) const X_AMZ_COPY_SOURCE: &str = "x-amz-copy-source";
pub(crate) const X_AMZ_REQUEST_ID: &str = "x-amz-request-id";
pub(crate) const X_AMZ_TRAILER: &str = "x-amz-trailer";
pub(crate) const X_AMZ_SDK_CHECKSUM_ALGORITHM: &str = "x-amz-sdk-checksum-algorithm";
pub(crate) const CONTENT_MD5: &str = "content-md5";
/// A customer-provided encryption key (SSE-C): the backend checks it on every read.
pub(crate) const SSE_CUSTOMER_KEY: &str = "x-amz-server-side-encryption-customer-key";

/// Seconds a `Retry-After` asks a client to wait after a `503`: one second spreads a burst
/// without idling a data loader that retries at once.
pub(crate) const RETRY_AFTER_SECS: u64 = 1;

/// Hop-by-hop headers (RFC 9110 section 7.6.1) plus `expect`, which the gateway answers itself:
/// never forwarded in either direction.
pub(crate) const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "expect",
];

/// Removes every header whose name is in `names` (lower case), all its values. One pass over the
/// map's names finds the few present, usually none: a removal per name by `&str` would parse and
/// hash each of them, present or not, on every request and response.
pub(crate) fn remove_all(headers: &mut http::HeaderMap, names: &[&str]) {
    while let Some(name) = headers.keys().find(|k| names.contains(&k.as_str())).cloned() {
        headers.remove(&name);
    }
}

/// Request headers that carry the client's authentication: consumed by the gateway and replaced
/// by the backend signature, never forwarded.
pub(crate) const CLIENT_AUTH: &[&str] = &["authorization", X_AMZ_DATE, X_AMZ_CONTENT_SHA256, X_AMZ_SECURITY_TOKEN];

/// Query parameters of a presigned URL: consumed by the gateway, never forwarded.
pub(crate) const PRESIGN_QUERY: &[&str] = &[
    "X-Amz-Algorithm",
    "X-Amz-Credential",
    "X-Amz-Date",
    "X-Amz-Expires",
    "X-Amz-SignedHeaders",
    "X-Amz-Signature",
    "X-Amz-Security-Token",
    "X-Amz-Content-Sha256",
    // SigV2 presigned URLs.
    "AWSAccessKeyId",
    "Expires",
    "Signature",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remove_all_takes_every_value_of_the_named_headers_only() {
        let mut h = http::HeaderMap::new();
        for (k, v) in [("connection", "close"), ("x-a", "1"), ("te", "trailers"), ("x-a", "2"), ("te", "gzip")] {
            h.append(k, v.parse().expect("value"));
        }
        remove_all(&mut h, HOP_BY_HOP);
        assert_eq!(h.len(), 2);
        assert_eq!(h.get_all("x-a").iter().collect::<Vec<_>>(), ["1", "2"]);
        remove_all(&mut h, HOP_BY_HOP); // nothing left to take
        assert_eq!(h.len(), 2);
        remove_all(&mut h, &["x-a"]);
        assert!(h.is_empty());
    }
}
