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
