//! Signing a request for the store (SigV4 in headers), from the request as it will be sent: the
//! canonical request is built from its method, path, query and headers with the same pure pieces
//! that verification uses, and the signing key comes from the secret's cache
//! ([`SecretKey::signing_key`]), derived once a day rather than with four HMACs per request (ADR
//! 0033). Every header is signed except those a proxy or the transport may change (the same set
//! as the official `aws-sigv4` crate, which the tests use as the reference).

use std::fmt::Write as _;

use http::{HeaderMap, HeaderValue, Method, Uri};
use time::OffsetDateTime;

use super::{super::headers, string_to_sign};
use super::{
    ALGORITHM, CANONICAL_HEADERS_CAPACITY, CanonicalRequest, canonical_query, canonical_uri, push_canonical_header,
    scope, signature,
};
use crate::s3::credentials::SecretKey;

/// Headers never signed: the signature's own, and those that change on the way (a proxy's
/// `User-Agent`, a tracing id, hop-by-hop framing).
const UNSIGNED: &[&str] = &["authorization", "user-agent", "x-amzn-trace-id", "transfer-encoding"];

/// Length of an `x-amz-date` value (`YYYYMMDDTHHMMSSZ`).
const AMZ_DATE_LEN: usize = 16;

/// A header whose value is not visible ASCII cannot be signed (its canonical form is undefined).
#[derive(Debug, thiserror::Error)]
#[error("header {0} cannot be signed (not visible ASCII)")]
pub(crate) struct Unsignable(pub(crate) String);

/// Signs a request for `region`'s `s3` with `(access_key, secret)` at `now`: sets `x-amz-date`,
/// `x-amz-content-sha256` (`payload_hash`) and `Authorization` in `headers`, which must already
/// hold every other header the request is sent with (`Host` included).
///
/// # Errors
/// A header value that is not visible ASCII.
pub(crate) fn sign(
    method: &Method,
    uri: &Uri,
    headers: &mut HeaderMap,
    payload_hash: &str,
    (access_key, secret): (&str, &SecretKey),
    region: &str,
    now: OffsetDateTime,
) -> Result<(), Unsignable> {
    let mut amz_date = String::with_capacity(AMZ_DATE_LEN);
    let _ = write!(
        amz_date,
        "{:04}{:02}{:02}T{:02}{:02}{:02}Z",
        now.year(),
        u8::from(now.month()),
        now.day(),
        now.hour(),
        now.minute(),
        now.second()
    );
    let date = &amz_date[..8];
    let date_value = HeaderValue::from_str(&amz_date).map_err(|_| Unsignable(headers::X_AMZ_DATE.to_owned()))?;
    headers.insert(headers::X_AMZ_DATE, date_value);
    let hash_value =
        HeaderValue::from_str(payload_hash).map_err(|_| Unsignable(headers::X_AMZ_CONTENT_SHA256.to_owned()))?;
    headers.insert(headers::X_AMZ_CONTENT_SHA256, hash_value);
    // Lowercase names (as `http` keeps them), sorted; a name's values joined by commas.
    let mut names: Vec<&str> = headers.keys().map(http::HeaderName::as_str).filter(|n| !UNSIGNED.contains(n)).collect();
    names.sort_unstable();
    let mut canonical = String::with_capacity(CANONICAL_HEADERS_CAPACITY);
    for name in &names {
        let values = headers.get_all(*name);
        if values.iter().any(|v| v.to_str().is_err()) {
            return Err(Unsignable((*name).to_owned()));
        }
        push_canonical_header(&mut canonical, name, values.iter().map(HeaderValue::as_bytes));
    }
    let signed_headers = names.join(";");
    let path = canonical_uri(uri.path());
    let query = canonical_query(uri.query(), None);
    let request = CanonicalRequest {
        method: method.as_str(),
        uri: &path,
        query: &query,
        headers: &canonical,
        signed_headers: &signed_headers,
        payload_hash,
    };
    let scope = scope(date, region, "s3");
    let key = secret.signing_key(date, region, "s3");
    let sig = signature(&key, &string_to_sign(&amz_date, &scope, &request));
    let auth =
        [ALGORITHM, " Credential=", access_key, "/", &scope, ", SignedHeaders=", &signed_headers, ", Signature=", &sig]
            .concat();
    headers.insert(
        http::header::AUTHORIZATION,
        HeaderValue::from_str(&auth).map_err(|_| Unsignable("authorization".into()))?,
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use aws_credential_types::Credentials;
    use aws_sigv4::http_request::{
        PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SigningSettings,
        UriPathNormalizationMode,
    };
    use aws_sigv4::sign::v4;

    /// The headers `aws-sigv4` sets for the same request (as the backend signed before ADR 0033).
    fn reference(method: &Method, uri: &Uri, headers: &HeaderMap, payload: &str, now: OffsetDateTime) -> HeaderMap {
        let identity = Credentials::new("AKID", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", None, None, "t").into();
        let mut settings = SigningSettings::default();
        settings.percent_encoding_mode = PercentEncodingMode::Single;
        settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
        let params = v4::SigningParams::builder()
            .identity(&identity)
            .region("us-east-1")
            .name("s3")
            .time(now.into())
            .settings(settings)
            .build()
            .expect("params")
            .into();
        let pairs = headers.iter().map(|(k, v)| (k.as_str(), v.to_str().expect("ascii")));
        let uri_s = uri.to_string();
        let signable =
            SignableRequest::new(method.as_str(), &uri_s, pairs, SignableBody::Precomputed(payload.to_owned()))
                .expect("signable");
        let (instructions, _) = aws_sigv4::http_request::sign(signable, &params).expect("sign").into_parts();
        let mut req = http::Request::builder().method(method.clone()).uri(uri.clone()).body(()).expect("req");
        *req.headers_mut() = headers.clone();
        instructions.apply_to_request_http1x(&mut req);
        req.headers().clone()
    }

    #[test]
    fn signs_as_the_official_signer_does() {
        let secret = SecretKey::new("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY".into());
        let now = OffsetDateTime::from_unix_timestamp(1_765_000_000).expect("time");
        // (method, URL, extra headers, payload hash)
        type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a str);
        let cases: &[Case<'_>] = &[
            ("GET", "http://127.0.0.1:8333/b/k", &[], super::super::EMPTY_SHA256),
            ("HEAD", "http://store.example:80/b/a%20b/%E2%82%AC%2B", &[("range", "bytes=0-9")], "UNSIGNED-PAYLOAD"),
            ("GET", "http://127.0.0.1:8333/b?list-type=2&prefix=a%2Fb&max-keys=100", &[], super::super::EMPTY_SHA256),
            (
                "PUT",
                "http://127.0.0.1:8333/b/k?partNumber=2&uploadId=x%2By",
                &[
                    ("content-type", "image/jpeg"),
                    ("content-length", "4096"),
                    ("x-amz-meta-a", "  two   words "),
                    ("x-amz-meta-b", "1"),
                    ("user-agent", "boto3"),
                    ("expect", "100-continue"),
                ],
                "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            ),
            (
                "POST",
                "http://127.0.0.1:8333/b?delete",
                &[("content-md5", "1B2M2Y8AsgTpgAmY7PhCfg==")],
                "UNSIGNED-PAYLOAD",
            ),
        ];
        for (method, url, extra, payload) in cases {
            let method: Method = method.parse().expect("method");
            let uri: Uri = url.parse().expect("uri");
            let mut headers = HeaderMap::new();
            headers
                .insert(http::header::HOST, HeaderValue::from_str(uri.authority().expect("host").as_str()).expect("h"));
            for (k, v) in *extra {
                headers.append(http::HeaderName::from_static(k), HeaderValue::from_static(v));
            }
            let want = reference(&method, &uri, &headers, payload, now);
            sign(&method, &uri, &mut headers, payload, ("AKID", &secret), "us-east-1", now).expect("sign");
            for h in ["authorization", "x-amz-date", "x-amz-content-sha256"] {
                assert_eq!(headers.get(h), want.get(h), "{h} of {method} {url}");
            }
        }
    }

    #[test]
    fn a_value_that_is_not_visible_ascii_is_refused() {
        let secret = SecretKey::new("s".into());
        let mut headers = HeaderMap::new();
        headers.insert("x-amz-meta-a", HeaderValue::from_bytes(b"caf\xc3\xa9").expect("value"));
        let uri: Uri = "http://h/b/k".parse().expect("uri");
        let now = OffsetDateTime::from_unix_timestamp(0).expect("time");
        let err =
            sign(&Method::GET, &uri, &mut headers, "UNSIGNED-PAYLOAD", ("a", &secret), "r", now).expect_err("refused");
        assert_eq!(err.0, "x-amz-meta-a");
    }
}
