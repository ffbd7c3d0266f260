//! Inbound request authentication: SigV4 in the `Authorization` header or in a presigned URL's
//! query, and the payload mode the client declared (`x-amz-content-sha256`).
//!
//! [`verify`] is pure: the caller passes the clock reading, so expiry and skew are unit-testable.

use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Uri};
use subtle::ConstantTimeEq;
use time::{OffsetDateTime, PrimitiveDateTime, format_description::FormatItem, macros::format_description};

use super::chunked::{ChunkSigner, ChunkedMode};
use super::{
    ALGORITHM, CANONICAL_HEADERS_CAPACITY, CanonicalRequest, canonical_query, canonical_uri, push_canonical_header,
    scope, signature, string_to_sign,
};
use crate::s3::authority::{Authenticated, Authority};
use crate::s3::credentials::CredentialStore;
use crate::s3::{headers, sigv2};

/// How far a request's `x-amz-date` may be from the gateway's clock: S3's own tolerance.
pub(crate) const MAX_CLOCK_SKEW: Duration = Duration::from_secs(15 * 60);
/// Longest presigned-URL lifetime S3 accepts (7 days).
pub(crate) const MAX_PRESIGN_EXPIRES: u64 = 7 * 24 * 3600;

const AMZ_DATE_FORMAT: &[FormatItem<'static>] = format_description!("[year][month][day]T[hour][minute][second]Z");

/// Who made the request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Identity {
    /// No signature; only when the operator allows anonymous access.
    Anonymous,
    /// A verified access key.
    AccessKey(String),
    /// The access key a request names, not verified by the gateway (transparent identity mode):
    /// a claim until the store accepts the request.
    Claimed(String),
}

impl Identity {
    /// Label for logs and metrics: the access key (never the secret) or `anonymous`.
    #[must_use]
    pub(crate) fn name(&self) -> &str {
        match self {
            Self::Anonymous => "anonymous",
            Self::AccessKey(k) | Self::Claimed(k) => k,
        }
    }
}

/// What the body is and how it must be checked.
#[derive(Debug, Clone)]
pub(crate) enum Payload {
    /// The client signed the body's SHA-256; the body is checked against it while it streams.
    Sha256([u8; 32]),
    /// `UNSIGNED-PAYLOAD`: the body is not covered by the signature.
    Unsigned,
    /// One of the `aws-chunked` encodings.
    Chunked(ChunkedMode),
}

/// The outcome of authentication.
#[derive(Debug, Clone)]
pub struct Verified {
    pub(crate) identity: Identity,
    /// What the store request may carry: the store's key only for an authenticated caller.
    pub(crate) authority: Authority,
    pub(crate) payload: Payload,
    /// Whether the credentials came in the query (presigned URL).
    pub(crate) presigned: bool,
}

/// Why authentication failed. Mapped to S3 codes in `crate::error`.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("anonymous access is not allowed: sign the request with SigV4")]
    AnonymousDenied,
    #[error("the authorization header is malformed: {0}")]
    MalformedHeader(&'static str),
    #[error("the presigned URL's query parameters are malformed: {0}")]
    MalformedQuery(&'static str),
    #[error("unsupported signature algorithm: use AWS Signature Version 4 (or Version 2)")]
    UnsupportedAlgorithm,
    #[error("the access key does not exist in the gateway's credentials")]
    UnknownAccessKey,
    #[error("the request signature does not match the one computed with the given key")]
    SignatureDoesNotMatch,
    #[error("the difference between the request time and the server's time is too large")]
    TimeTooSkewed,
    #[error("the presigned URL has expired")]
    Expired,
    #[error("X-Amz-Expires must be at most {MAX_PRESIGN_EXPIRES} seconds (7 days)")]
    ExpiresTooLong,
    #[error("AWS authentication requires a valid Date or x-amz-date header")]
    InvalidDate,
    #[error("missing required header: x-amz-content-sha256")]
    MissingContentSha256,
    #[error("invalid x-amz-content-sha256: {0}")]
    InvalidContentSha256(&'static str),
    #[error("the payload signing mode is not implemented: {0}")]
    NotImplemented(&'static str),
}

/// Parsed `Credential=` value.
struct CredentialScope<'a> {
    access_key: &'a str,
    date: &'a str,
    region: &'a str,
    service: &'a str,
}

fn parse_credential(s: &str) -> Option<CredentialScope<'_>> {
    let mut it = s.splitn(5, '/');
    let c = CredentialScope { access_key: it.next()?, date: it.next()?, region: it.next()?, service: it.next()? };
    (it.next()? == "aws4_request").then_some(c)
}

/// An RFC 1123 date (`Tue, 07 Jul 2010 21:53:04 GMT`), as S3 reads it: the weekday is not checked
/// (clients send wrong ones; S3 and Ceph RGW accept them), and dates before 1970 are invalid.
fn parse_http_date(s: &str) -> Option<OffsetDateTime> {
    const RFC1123: &[FormatItem<'static>] =
        format_description!("[day] [month repr:short] [year] [hour]:[minute]:[second]");
    let rest = s.trim().split_once(", ").map_or(s.trim(), |(_, rest)| rest);
    // UTC as RFC 1123 writes it, or as RFC 2822 does (botocore's SigV4 `Date`: `-0000`).
    let rest = ["GMT", "UTC", "+0000", "-0000"].iter().find_map(|z| rest.strip_suffix(z))?.trim_end();
    PrimitiveDateTime::parse(rest, RFC1123).ok().map(PrimitiveDateTime::assume_utc).filter(|t| t.year() >= 1970)
}

fn parse_amz_date(s: &str) -> Option<OffsetDateTime> {
    PrimitiveDateTime::parse(s, AMZ_DATE_FORMAT).ok().map(PrimitiveDateTime::assume_utc)
}

/// Authenticates a request. `vhost_bucket` is the bucket named by the `Host` header (SigV2 signs
/// it as part of the resource). `now` is the gateway's clock.
///
/// # Errors
/// Any [`AuthError`]; the request must then be refused.
pub fn verify(
    method: &Method,
    uri: &Uri,
    vhost_bucket: Option<&str>,
    headers: &HeaderMap,
    creds: &CredentialStore,
    allow_anonymous: bool,
    now: OffsetDateTime,
) -> Result<Verified, AuthError> {
    let query = uri.query();
    let presigned = query.is_some_and(|q| q.split('&').any(|p| p.starts_with("X-Amz-Signature=")));
    // Every `OPTIONS` is a CORS preflight to S3 (without `Origin` the store answers `400`). Browsers
    // never sign them; credentials in the URL belong to the request the preflight asks about. They
    // read nothing but the bucket's CORS rules, which the store applies.
    if method == Method::OPTIONS {
        return Ok(presigned.then(|| preflight_of_presigned(uri, headers, creds, now)).flatten().unwrap_or(Verified {
            identity: Identity::Anonymous,
            authority: Authority::Anonymous,
            payload: Payload::Unsigned,
            presigned: false,
        }));
    }
    if let Some(auth) = headers.get(http::header::AUTHORIZATION) {
        let auth = auth.to_str().map_err(|_| AuthError::MalformedHeader("not ASCII"))?;
        if let Some(v2) = auth.strip_prefix("AWS ") {
            return verify_v2_header(method, uri, vhost_bucket, headers, v2, creds, now);
        }
        return verify_header(method, uri, headers, auth, creds, now);
    }
    if presigned {
        return verify_presigned(method, uri, headers, creds, now);
    }
    if query.is_some_and(|q| q.split('&').any(|p| p.starts_with("AWSAccessKeyId="))) {
        return verify_v2_presigned(method, uri, vhost_bucket, headers, creds, now);
    }
    if allow_anonymous {
        let payload = match headers.get(headers::X_AMZ_CONTENT_SHA256) {
            Some(v) => payload_mode(v.as_bytes(), headers, None)?,
            None => Payload::Unsigned,
        };
        return Ok(Verified {
            identity: Identity::Anonymous,
            authority: Authority::Anonymous,
            payload,
            presigned: false,
        });
    }
    Err(AuthError::AnonymousDenied)
}

fn verify_header(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    auth: &str,
    creds: &CredentialStore,
    now: OffsetDateTime,
) -> Result<Verified, AuthError> {
    let Some(rest) = auth.strip_prefix(ALGORITHM) else {
        return Err(if auth.starts_with("AWS4-ECDSA") {
            AuthError::NotImplemented("SigV4a")
        } else {
            AuthError::UnsupportedAlgorithm
        });
    };
    let (mut credential, mut signed_headers, mut sig) = (None, None, None);
    for part in rest.split(',') {
        let (k, v) = part.trim().split_once('=').ok_or(AuthError::MalformedHeader("expected key=value"))?;
        match k {
            "Credential" => credential = Some(v),
            "SignedHeaders" => signed_headers = Some(v),
            "Signature" => sig = Some(v),
            _ => return Err(AuthError::MalformedHeader("unknown component")),
        }
    }
    let credential = credential.ok_or(AuthError::MalformedHeader("missing Credential"))?;
    let signed_headers = signed_headers.ok_or(AuthError::MalformedHeader("missing SignedHeaders"))?;
    let sig = sig.ok_or(AuthError::MalformedHeader("missing Signature"))?;
    let cs = parse_credential(credential).ok_or(AuthError::MalformedHeader("bad Credential scope"))?;
    if cs.service != "s3" {
        return Err(AuthError::MalformedHeader("credential scope service must be s3"));
    }
    // SigV4 takes the time from x-amz-date or, without it, from Date (RFC 1123), which the
    // string to sign then carries in ISO 8601 basic form.
    let amz_date = match header_str(headers, headers::X_AMZ_DATE) {
        Some(d) => d.to_owned(),
        None => header_str(headers, "date")
            .and_then(parse_http_date)
            .and_then(|t| t.format(AMZ_DATE_FORMAT).ok())
            .ok_or(AuthError::MalformedHeader("missing x-amz-date"))?,
    };
    let amz_date = amz_date.as_str();
    let when = parse_amz_date(amz_date).ok_or(AuthError::MalformedHeader("bad x-amz-date"))?;
    if !amz_date.starts_with(cs.date) {
        return Err(AuthError::MalformedHeader("credential date differs from x-amz-date"));
    }
    if (now - when).unsigned_abs() > MAX_CLOCK_SKEW {
        return Err(AuthError::TimeTooSkewed);
    }
    // S3 requires x-amz-content-sha256. Generic SigV4 signers (curl's --aws-sigv4 among them) omit
    // it and sign the hash of the body instead; for a request without a body that is the hash of
    // the empty string, which covers it completely, so such requests are accepted.
    let payload_hash = match header_str(headers, headers::X_AMZ_CONTENT_SHA256) {
        Some(h) => h,
        None if !has_body(headers) => super::EMPTY_SHA256,
        None => return Err(AuthError::MissingContentSha256),
    };
    let secret = creds.get(cs.access_key).ok_or(AuthError::UnknownAccessKey)?;
    let key = secret.signing_key(cs.date, cs.region, cs.service);
    let scope = scope(cs.date, cs.region, cs.service);
    let expected =
        matching_signature(method, uri, headers, signed_headers, payload_hash, None, amz_date, &scope, &key, sig)?;
    let signer = ChunkSigner { key, amz_date: amz_date.to_owned(), scope, seed_signature: expected };
    let payload = payload_mode(payload_hash.as_bytes(), headers, Some(signer))?;
    Ok(Verified {
        authority: Authority::Gateway(Authenticated::new(cs.access_key)),
        identity: Identity::AccessKey(cs.access_key.to_owned()),
        payload,
        presigned: false,
    })
}

fn has_body(headers: &HeaderMap) -> bool {
    headers.contains_key(http::header::TRANSFER_ENCODING)
        || headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).is_some_and(|v| v.trim() != "0")
}

fn verify_v2_header(
    method: &Method,
    uri: &Uri,
    vhost_bucket: Option<&str>,
    headers: &HeaderMap,
    credential: &str,
    creds: &CredentialStore,
    now: OffsetDateTime,
) -> Result<Verified, AuthError> {
    // The signature is base64 (no ':'); access keys may hold one (Swift's `account:user`).
    let (access_key, sig) =
        credential.rsplit_once(':').ok_or(AuthError::MalformedHeader("expected AWS key:signature"))?;
    let amz_date = header_str(headers, headers::X_AMZ_DATE);
    let date = amz_date.or_else(|| header_str(headers, "date")).ok_or(AuthError::InvalidDate)?;
    let when = parse_http_date(date).or_else(|| parse_amz_date(date)).ok_or(AuthError::InvalidDate)?;
    if (now - when).unsigned_abs() > MAX_CLOCK_SKEW {
        return Err(AuthError::TimeTooSkewed);
    }
    let secret = creds.get(access_key).ok_or(AuthError::UnknownAccessKey)?;
    let resource = sigv2::canonical_resource(vhost_bucket, uri.path(), uri.query());
    let date_line = if amz_date.is_some() { "" } else { date };
    check_v2(&resource, sig, |r| {
        sigv2::signature(secret.expose().as_bytes(), &sigv2::string_to_sign(method, headers, date_line, r))
    })?;
    Ok(Verified {
        authority: Authority::Gateway(Authenticated::new(access_key)),
        identity: Identity::AccessKey(access_key.to_owned()),
        payload: Payload::Unsigned,
        presigned: false,
    })
}

fn verify_v2_presigned(
    method: &Method,
    uri: &Uri,
    vhost_bucket: Option<&str>,
    headers: &HeaderMap,
    creds: &CredentialStore,
    now: OffsetDateTime,
) -> Result<Verified, AuthError> {
    let q = uri.query().unwrap_or_default();
    let param = |name: &str| super::query_param(q, name);
    let access_key = param("AWSAccessKeyId").ok_or(AuthError::MalformedQuery("missing AWSAccessKeyId"))?;
    let expires = param("Expires").ok_or(AuthError::MalformedQuery("missing Expires"))?;
    let sig = param("Signature").ok_or(AuthError::MalformedQuery("missing Signature"))?;
    let expires_at: i64 = expires.parse().map_err(|_| AuthError::MalformedQuery("bad Expires"))?;
    if now.unix_timestamp() > expires_at {
        return Err(AuthError::Expired);
    }
    let secret = creds.get(&access_key).ok_or(AuthError::UnknownAccessKey)?;
    let resource = sigv2::canonical_resource(vhost_bucket, uri.path(), uri.query());
    check_v2(&resource, &sig, |r| {
        sigv2::signature(secret.expose().as_bytes(), &sigv2::string_to_sign(method, headers, &expires, r))
    })?;
    Ok(Verified {
        authority: Authority::Gateway(Authenticated::new(&access_key)),
        identity: Identity::AccessKey(access_key),
        payload: Payload::Unsigned,
        presigned: true,
    })
}

/// Methods a presigned URL's preflight may ask about when it names none
/// (`Access-Control-Request-Method`): what S3 presigns.
const PRESIGNED_METHODS: [Method; 5] = [Method::GET, Method::PUT, Method::HEAD, Method::DELETE, Method::POST];

/// A preflight (`OPTIONS`) of a presigned URL whose signature verifies for the method it asks
/// about (or, when it names none, one that S3 presigns): it comes from that URL's client, and is
/// sent to the store as that client, so a store that keeps each user's buckets apart (Ceph RGW's
/// tenants) finds the bucket the URL names, as it does for the URL sent to it directly. `None`:
/// an anonymous preflight, as before.
fn preflight_of_presigned(
    uri: &Uri,
    headers: &HeaderMap,
    creds: &CredentialStore,
    now: OffsetDateTime,
) -> Option<Verified> {
    let asked = headers
        .get("access-control-request-method")
        .map(|v| Method::from_bytes(v.as_bytes()).ok().into_iter().collect::<Vec<_>>());
    // A URL presigned with `x-amz-acl` among its signed headers: its preflight carries the
    // header's name at most (`Access-Control-Request-Headers`), never its value, so each canned
    // ACL is tried in its place, with the method the preflight names or else `PUT` (a canned ACL
    // is a write's): at most `CANNED_ACLS.len()` checks.
    let signs_acl = super::query_param(uri.query().unwrap_or_default(), "X-Amz-SignedHeaders")
        .is_some_and(|signed| signed.split(';').any(|h| h == ACL));
    let (candidates, methods): (Vec<HeaderMap>, Vec<Method>) = if signs_acl && !headers.contains_key(ACL) {
        let with = |acl| {
            let mut h = headers.clone();
            h.insert(ACL, HeaderValue::from_static(acl));
            h
        };
        (CANNED_ACLS.into_iter().map(with).collect(), asked.unwrap_or_else(|| vec![Method::PUT]))
    } else {
        (vec![headers.clone()], asked.unwrap_or_else(|| PRESIGNED_METHODS.to_vec()))
    };
    let verified =
        methods.iter().find_map(|m| candidates.iter().find_map(|h| verify_presigned(m, uri, h, creds, now).ok()))?;
    Some(Verified { payload: Payload::Unsigned, ..verified })
}

/// The canned-ACL header a presigned URL may sign.
const ACL: &str = "x-amz-acl";

/// The canned ACLs S3 defines: the values of a signed `x-amz-acl` a preflight is checked with.
const CANNED_ACLS: [&str; 8] = [
    "private",
    "public-read",
    "public-read-write",
    "authenticated-read",
    "aws-exec-read",
    "bucket-owner-read",
    "bucket-owner-full-control",
    "log-delivery-write",
];

fn verify_presigned(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    creds: &CredentialStore,
    now: OffsetDateTime,
) -> Result<Verified, AuthError> {
    let q = uri.query().unwrap_or_default();
    let param = |name: &str| super::query_param(q, name);
    if param("X-Amz-Algorithm").as_deref() != Some(ALGORITHM) {
        return Err(AuthError::UnsupportedAlgorithm);
    }
    let credential = param("X-Amz-Credential").ok_or(AuthError::MalformedQuery("missing X-Amz-Credential"))?;
    let amz_date = param("X-Amz-Date").ok_or(AuthError::MalformedQuery("missing X-Amz-Date"))?;
    // A negative lifetime is a URL that expired before it was made (boto3 signs any integer).
    let expires: i64 = param("X-Amz-Expires")
        .and_then(|e| e.parse().ok())
        .ok_or(AuthError::MalformedQuery("missing or bad X-Amz-Expires"))?;
    let expires = u64::try_from(expires).map_err(|_| AuthError::Expired)?;
    let signed_headers =
        param("X-Amz-SignedHeaders").ok_or(AuthError::MalformedQuery("missing X-Amz-SignedHeaders"))?;
    let sig = param("X-Amz-Signature").ok_or(AuthError::MalformedQuery("missing X-Amz-Signature"))?;
    let cs = parse_credential(&credential).ok_or(AuthError::MalformedQuery("bad X-Amz-Credential"))?;
    if cs.service != "s3" {
        return Err(AuthError::MalformedQuery("credential scope service must be s3"));
    }
    if expires > MAX_PRESIGN_EXPIRES {
        return Err(AuthError::ExpiresTooLong);
    }
    let when = parse_amz_date(&amz_date).ok_or(AuthError::MalformedQuery("bad X-Amz-Date"))?;
    if !amz_date.starts_with(cs.date) {
        return Err(AuthError::MalformedQuery("credential date differs from X-Amz-Date"));
    }
    if when - now > MAX_CLOCK_SKEW {
        return Err(AuthError::TimeTooSkewed);
    }
    if now > when + Duration::from_secs(expires) {
        return Err(AuthError::Expired);
    }
    let payload_hash = param("X-Amz-Content-Sha256").unwrap_or_else(|| "UNSIGNED-PAYLOAD".to_owned());
    let secret = creds.get(cs.access_key).ok_or(AuthError::UnknownAccessKey)?;
    let key = secret.signing_key(cs.date, cs.region, cs.service);
    let scope = scope(cs.date, cs.region, cs.service);
    matching_signature(
        method,
        uri,
        headers,
        &signed_headers,
        &payload_hash,
        Some("X-Amz-Signature"),
        &amz_date,
        &scope,
        &key,
        &sig,
    )?;
    let payload = match payload_mode(payload_hash.as_bytes(), headers, None)? {
        Payload::Chunked(_) => return Err(AuthError::NotImplemented("aws-chunked bodies with presigned URLs")),
        p => p,
    };
    Ok(Verified {
        authority: Authority::Gateway(Authenticated::new(cs.access_key)),
        identity: Identity::AccessKey(cs.access_key.to_owned()),
        payload,
        presigned: true,
    })
}

/// Computes the expected signature and compares it with `sent`, returning it on a match.
///
/// Canonical headers and query are built once. The canonical URI is tried as the client sent the
/// path first (SDKs sign exactly the path they send, `%2F` included), then in SigV4's normalized
/// encoding (for clients that send some characters raw that the spec escapes); the second try only
/// runs after a mismatch.
#[allow(clippy::too_many_arguments)]
fn matching_signature(
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    signed_headers: &str,
    payload_hash: &str,
    skip_query: Option<&str>,
    amz_date: &str,
    scope: &str,
    key: &[u8; 32],
    sent: &str,
) -> Result<String, AuthError> {
    if !signed_headers.split(';').any(|h| h == "host") {
        return Err(AuthError::MalformedHeader("host must be a signed header"));
    }
    let mut canon_headers = String::with_capacity(CANONICAL_HEADERS_CAPACITY);
    for name in signed_headers.split(';') {
        let found = if name == "host" && !headers.contains_key(http::header::HOST) {
            // HTTP/2 carries the host in the URI authority instead of a header.
            push_canonical_header(&mut canon_headers, name, uri.authority().map(|a| a.as_str().as_bytes()))
        } else {
            push_canonical_header(&mut canon_headers, name, headers.get_all(name).iter().map(HeaderValue::as_bytes))
        };
        if !found {
            return Err(AuthError::SignatureDoesNotMatch);
        }
    }
    let query = canonical_query(uri.query(), skip_query);
    let raw = if uri.path().is_empty() { "/" } else { uri.path() };
    let normalized = canonical_uri(uri.path());
    let candidates: &[&str] = if normalized == raw { &[raw] } else { &[raw, normalized.as_ref()] };
    for path in candidates {
        let cr = CanonicalRequest {
            method: method.as_str(),
            uri: path,
            query: &query,
            headers: &canon_headers,
            signed_headers,
            payload_hash,
        };
        let expected = signature(key, &string_to_sign(amz_date, scope, &cr));
        if check(&expected, sent).is_ok() {
            return Ok(expected);
        }
    }
    Err(AuthError::SignatureDoesNotMatch)
}

/// A SigV2 signature `sent`, checked against `sign` of the resource as sent and, for a bucket's
/// own resource, of its other spelling (`/bucket/`, [`sigv2::bucket_resource_with_slash`]).
fn check_v2(resource: &str, sent: &str, sign: impl Fn(&str) -> String) -> Result<(), AuthError> {
    check(&sign(resource), sent).or_else(|e| match sigv2::bucket_resource_with_slash(resource) {
        Some(other) => check(&sign(&other), sent),
        None => Err(e),
    })
}

fn check(expected: &str, sent: &str) -> Result<(), AuthError> {
    if bool::from(expected.as_bytes().ct_eq(sent.as_bytes())) { Ok(()) } else { Err(AuthError::SignatureDoesNotMatch) }
}

fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn payload_mode(value: &[u8], headers: &HeaderMap, signer: Option<ChunkSigner>) -> Result<Payload, AuthError> {
    let decoded_length = || -> Result<u64, AuthError> {
        header_str(headers, headers::X_AMZ_DECODED_CONTENT_LENGTH)
            .and_then(|v| v.parse().ok())
            .ok_or(AuthError::InvalidContentSha256("aws-chunked needs x-amz-decoded-content-length"))
    };
    let chunked = |signer: Option<ChunkSigner>, trailer: bool| -> Result<Payload, AuthError> {
        Ok(Payload::Chunked(ChunkedMode { signer, trailer, decoded_length: decoded_length()? }))
    };
    match value {
        b"UNSIGNED-PAYLOAD" => Ok(Payload::Unsigned),
        b"STREAMING-UNSIGNED-PAYLOAD-TRAILER" => chunked(None, true),
        b"STREAMING-AWS4-HMAC-SHA256-PAYLOAD" => {
            let signer = signer.ok_or(AuthError::InvalidContentSha256("signed chunks need header authentication"))?;
            chunked(Some(signer), false)
        }
        b"STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER" => {
            let signer = signer.ok_or(AuthError::InvalidContentSha256("signed chunks need header authentication"))?;
            chunked(Some(signer), true)
        }
        v if v.starts_with(b"STREAMING-AWS4-ECDSA") => Err(AuthError::NotImplemented("SigV4a streaming payloads")),
        v if v.len() == 64 => {
            let mut out = [0u8; 32];
            hex::decode_to_slice(v, &mut out).map_err(|_| AuthError::InvalidContentSha256("not hex"))?;
            Ok(Payload::Sha256(out))
        }
        _ => Err(AuthError::InvalidContentSha256("unknown value")),
    }
}

#[cfg(test)]
mod tests {
    //! Round trips against the official `aws-sigv4` signer: requests it signs must verify, and any
    //! change to a signed part must not.
    use std::time::SystemTime;

    use aws_credential_types::Credentials;
    use aws_sigv4::http_request::{
        PercentEncodingMode, SignableBody, SignableRequest, SignatureLocation, SigningSettings,
        UriPathNormalizationMode, sign,
    };
    use aws_sigv4::sign::v4;

    use super::*;
    use crate::s3::credentials::SecretKey;

    fn store() -> CredentialStore {
        let mut s = CredentialStore::default();
        s.insert("AKID".into(), SecretKey::new("SECRET".into()));
        s
    }

    fn signed(
        method: &str,
        url: &str,
        extra: &[(&str, &str)],
        presign: Option<Duration>,
        at: SystemTime,
    ) -> http::Request<()> {
        let creds = Credentials::new("AKID", "SECRET", None, None, "test");
        let identity = creds.into();
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        if let Some(exp) = presign {
            settings.signature_location = SignatureLocation::QueryParams;
            settings.expires_in = Some(exp);
        } else {
            settings.payload_checksum_kind = aws_sigv4::http_request::PayloadChecksumKind::XAmzSha256;
        }
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region("us-east-1")
            .name("s3")
            .time(at)
            .settings(settings)
            .build()
            .expect("params")
            .into();
        let mut req = http::Request::builder().method(method).uri(url);
        for (k, v) in extra {
            req = req.header(*k, *v);
        }
        let mut req = req.header("host", "gw.example:9000").body(()).expect("request");
        let hdrs: Vec<(&str, &str)> =
            req.headers().iter().map(|(k, v)| (k.as_str(), v.to_str().expect("ascii"))).collect();
        let signable =
            SignableRequest::new(method, url, hdrs.into_iter(), SignableBody::UnsignedPayload).expect("signable");
        let (instructions, _) = sign(signable, &params).expect("sign").into_parts();
        instructions.apply_to_request_http1x(&mut req);
        req
    }

    fn check_req(req: &http::Request<()>, now: SystemTime) -> Result<Verified, AuthError> {
        verify(req.method(), req.uri(), None, req.headers(), &store(), false, now.into())
    }

    #[test]
    fn header_signed_requests_from_aws_sigv4_verify() {
        let now = SystemTime::now();
        let req = signed(
            "GET",
            "http://gw.example:9000/bucket/dir/a%20b.txt?list-type=2&prefix=x%2By",
            &[("x-amz-meta-k", " v  w ")],
            None,
            now,
        );
        let v = check_req(&req, now).expect("valid");
        assert_eq!(v.identity, Identity::AccessKey("AKID".into()));
        assert!(matches!(v.payload, Payload::Unsigned));
    }

    #[test]
    fn tampering_fails() {
        let now = SystemTime::now();
        let mut req = signed("GET", "http://gw.example:9000/bucket/key", &[("x-amz-meta-k", "v")], None, now);
        req.headers_mut().insert("x-amz-meta-k", "changed".parse().expect("value"));
        assert!(matches!(check_req(&req, now), Err(AuthError::SignatureDoesNotMatch)));
        let req = signed("GET", "http://gw.example:9000/bucket/key", &[], None, now);
        let mut other = verify(
            req.method(),
            &"/bucket/other".parse().expect("uri"),
            None,
            req.headers(),
            &store(),
            false,
            now.into(),
        );
        assert!(matches!(other, Err(AuthError::SignatureDoesNotMatch)));
        let mut wrong = CredentialStore::default();
        wrong.insert("AKID".into(), SecretKey::new("WRONG".into()));
        other = verify(req.method(), req.uri(), None, req.headers(), &wrong, false, now.into());
        assert!(matches!(other, Err(AuthError::SignatureDoesNotMatch)));
    }

    #[test]
    fn sigv2_dates_as_s3_reads_them() {
        let at = |s: &str| parse_http_date(s).map(|t| t.unix_timestamp());
        // The weekday is not checked (7 July 2010 was a Wednesday); dates before 1970 are invalid.
        assert_eq!(at("Tue, 07 Jul 2010 21:53:04 GMT"), Some(1_278_539_584));
        assert_eq!(at("07 Jul 2010 21:53:04 GMT"), Some(1_278_539_584));
        assert_eq!(at("Wed, 07 Jul 2010 21:53:04 -0000"), Some(1_278_539_584));
        assert_eq!(at("Wed, 07 Jul 2010 21:53:04 +0200"), None);
        assert_eq!(at("Tue, 07 Jul 1950 21:53:04 GMT"), None);
        assert_eq!(at("Bad Date"), None);
        assert_eq!(at(""), None);
    }

    #[test]
    fn skew_expiry_and_anonymous() {
        let now = SystemTime::now();
        let req = signed("GET", "http://gw.example:9000/bucket/key", &[], None, now);
        assert!(matches!(check_req(&req, now + Duration::from_secs(3600)), Err(AuthError::TimeTooSkewed)));

        let url = signed("GET", "http://gw.example:9000/bucket/key", &[], Some(Duration::from_secs(60)), now);
        assert!(check_req(&url, now + Duration::from_secs(30)).expect("valid").presigned);
        assert!(matches!(check_req(&url, now + Duration::from_secs(61)), Err(AuthError::Expired)));

        let anon = http::Request::get("/bucket/key").body(()).expect("request");
        assert!(matches!(check_req(&anon, now), Err(AuthError::AnonymousDenied)));
        let preflight = http::Request::options("/bucket/key")
            .header("origin", "https://app.example")
            .header("access-control-request-method", "GET")
            .body(())
            .expect("request");
        assert_eq!(check_req(&preflight, now).expect("preflight").identity, Identity::Anonymous);
        // Any OPTIONS is a preflight to S3, even without Origin (the store then answers 400) or
        // with a presigned URL's parameters (they sign the request the preflight asks about).
        let bare_options = http::Request::options("/bucket/key").body(()).expect("request");
        assert_eq!(check_req(&bare_options, now).expect("preflight").identity, Identity::Anonymous);
        // A presigned URL's own preflight acts as its client (so the store finds the bucket in
        // that client's namespace); a preflight asking about another method than the URL signs,
        // or with a forged signature, stays anonymous.
        let presigned_options = http::Request::options(url.uri().clone()).body(()).expect("request");
        let got = check_req(&presigned_options, now).expect("preflight");
        assert!(matches!(got.identity, Identity::AccessKey(ref k) if k == "AKID"), "{:?}", got.identity);
        assert!(matches!(got.authority, Authority::Gateway(_)));
        let other_method = http::Request::options(url.uri().clone())
            .header("access-control-request-method", "DELETE")
            .body(())
            .expect("request");
        assert_eq!(check_req(&other_method, now).expect("preflight").identity, Identity::Anonymous);
        let forged = url.uri().to_string().replace("X-Amz-Signature=", "X-Amz-Signature=0");
        let forged = http::Request::options(forged).body(()).expect("request");
        assert_eq!(check_req(&forged, now).expect("preflight").identity, Identity::Anonymous);
        let ok = verify(anon.method(), anon.uri(), None, anon.headers(), &store(), true, now.into())
            .expect("anonymous allowed");
        assert_eq!(ok.identity, Identity::Anonymous);
    }

    #[test]
    fn a_preflight_of_a_url_presigned_with_a_canned_acl_acts_as_its_client() {
        let now = SystemTime::now();
        let put = |acl: &str| {
            let url = "http://gw.example:9000/bucket/key";
            signed("PUT", url, &[("x-amz-acl", acl)], Some(Duration::from_secs(60)), now)
        };
        let preflight = |url: &http::Request<()>, method: Option<&str>| {
            let mut r = http::Request::options(url.uri().clone()).header("origin", "https://app.example");
            if let Some(m) = method {
                r = r.header("access-control-request-method", m);
            }
            check_req(&r.body(()).expect("request"), now).expect("preflight").identity
        };
        for acl in ["private", "public-read", "bucket-owner-full-control"] {
            let url = put(acl);
            assert!(url.uri().query().expect("query").contains("x-amz-acl"), "signed as a header");
            for method in [Some("PUT"), None] {
                let got = preflight(&url, method);
                assert!(matches!(got, Identity::AccessKey(ref k) if k == "AKID"), "{acl} {method:?}");
            }
            assert_eq!(preflight(&url, Some("GET")), Identity::Anonymous);
        }
        // A value that is not a canned ACL cannot be found: the preflight stays anonymous.
        assert_eq!(preflight(&put("made-up"), Some("PUT")), Identity::Anonymous);
    }

    #[test]
    fn bodyless_requests_may_omit_the_payload_hash() {
        // As curl --aws-sigv4 signs: the empty body's hash in the canonical request, no header.
        let now = SystemTime::now();
        let mut req = signed("GET", "http://gw.example:9000/bucket/key", &[], None, now);
        // Re-sign without the header: aws-sigv4 with PayloadChecksumKind::NoHeader.
        req.headers_mut().remove("x-amz-content-sha256");
        let auth = req.headers()["authorization"].to_str().expect("ascii").to_owned();
        let creds = Credentials::new("AKID", "SECRET", None, None, "test");
        let identity = creds.into();
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region("us-east-1")
            .name("s3")
            .time(now)
            .settings(settings)
            .build()
            .expect("params")
            .into();
        let mut fresh = http::Request::get("http://gw.example:9000/bucket/key")
            .header("host", "gw.example:9000")
            .body(())
            .expect("request");
        let signable = SignableRequest::new(
            "GET",
            "http://gw.example:9000/bucket/key",
            [("host", "gw.example:9000")].into_iter(),
            SignableBody::Bytes(b""),
        )
        .expect("signable");
        sign(signable, &params).expect("sign").into_parts().0.apply_to_request_http1x(&mut fresh);
        assert!(!fresh.headers().contains_key("x-amz-content-sha256"));
        assert_ne!(fresh.headers()["authorization"], auth.as_str());
        assert!(check_req(&fresh, now).is_ok());
        fresh.headers_mut().insert("content-length", "5".parse().expect("v"));
        assert!(matches!(check_req(&fresh, now), Err(AuthError::MissingContentSha256)));
    }

    #[test]
    fn sigv2_header_and_presigned() {
        let now = SystemTime::now();
        let date = httpdate::fmt_http_date(now);
        let mut h = HeaderMap::new();
        h.insert("date", date.parse().expect("date"));
        h.insert("x-amz-meta-a", "b".parse().expect("v"));
        let resource = sigv2::canonical_resource(Some("vb"), "/k", Some("acl"));
        let sig = sigv2::signature(b"SECRET", &sigv2::string_to_sign(&Method::PUT, &h, &date, &resource));
        h.insert("authorization", format!("AWS AKID:{sig}").parse().expect("auth"));
        let uri: Uri = "/k?acl".parse().expect("uri");
        let ok = verify(&Method::PUT, &uri, Some("vb"), &h, &store(), false, now.into()).expect("valid");
        assert!(matches!(ok.payload, Payload::Unsigned));
        let wrong_bucket = verify(&Method::PUT, &uri, Some("other"), &h, &store(), false, now.into());
        assert!(matches!(wrong_bucket, Err(AuthError::SignatureDoesNotMatch)));
        // An access key with a colon (Swift's `account:user`): the signature follows the last one.
        let mut swift = CredentialStore::default();
        swift.insert("test:tester".into(), crate::s3::credentials::SecretKey::new("SECRET".into()));
        h.insert("authorization", format!("AWS test:tester:{sig}").parse().expect("auth"));
        let ok = verify(&Method::PUT, &uri, Some("vb"), &h, &swift, false, now.into()).expect("valid");
        assert_eq!(ok.identity, Identity::AccessKey("test:tester".into()));
        // A path-style bucket request (CreateBucket `PUT /b`) signed as botocore signs it,
        // `/b/`, and as sent, `/b`: both verify; another bucket's does not.
        let mut h = HeaderMap::new();
        h.insert("date", date.parse().expect("date"));
        let bucket: Uri = "/b".parse().expect("uri");
        for signed_as in ["/b/", "/b"] {
            let sig = sigv2::signature(b"SECRET", &sigv2::string_to_sign(&Method::PUT, &h, &date, signed_as));
            h.insert("authorization", format!("AWS AKID:{sig}").parse().expect("auth"));
            verify(&Method::PUT, &bucket, None, &h, &store(), false, now.into()).expect(signed_as);
            let other: Uri = "/c".parse().expect("uri");
            let refused = verify(&Method::PUT, &other, None, &h, &store(), false, now.into());
            assert!(matches!(refused, Err(AuthError::SignatureDoesNotMatch)), "{signed_as}");
        }

        let expires = (now + Duration::from_secs(60))
            .duration_since(SystemTime::UNIX_EPOCH)
            .expect("epoch")
            .as_secs()
            .to_string();
        let resource = sigv2::canonical_resource(None, "/b/k", None);
        let sig =
            sigv2::signature(b"SECRET", &sigv2::string_to_sign(&Method::GET, &HeaderMap::new(), &expires, &resource));
        let q = format!("/b/k?AWSAccessKeyId=AKID&Expires={expires}&Signature={}", crate::s3::sigv4::uri_encode(&sig));
        let uri: Uri = q.parse().expect("uri");
        assert!(
            verify(&Method::GET, &uri, None, &HeaderMap::new(), &store(), false, now.into()).expect("valid").presigned
        );
        let later = now + Duration::from_secs(120);
        assert!(matches!(
            verify(&Method::GET, &uri, None, &HeaderMap::new(), &store(), false, later.into()),
            Err(AuthError::Expired)
        ));
    }

    #[test]
    fn unknown_key_and_other_schemes_are_refused() {
        let now = SystemTime::now();
        let req = signed("GET", "http://gw.example:9000/bucket/key", &[], None, now);
        let r = verify(req.method(), req.uri(), None, req.headers(), &CredentialStore::default(), false, now.into());
        assert!(matches!(r, Err(AuthError::UnknownAccessKey)));
        let other = http::Request::get("/b/k").header("authorization", "Bearer token").body(()).expect("request");
        assert!(matches!(check_req(&other, now), Err(AuthError::UnsupportedAlgorithm)));
    }
}
