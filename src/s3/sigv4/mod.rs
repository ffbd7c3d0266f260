//! AWS Signature Version 4 for S3: the pure pieces shared by every verification path.
//!
//! Spec: <https://docs.aws.amazon.com/AmazonS3/latest/API/sig-v4-authenticating-requests.html>
//! (canonical request, string to sign, signing key) and
//! <https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-streaming.html> (chunk signatures).
//!
//! Everything here is a pure function of its arguments: no clocks, no IO. Verification of a whole
//! request (which needs the credential store and the clock) lives in [`verify`]; decoding of
//! `aws-chunked` bodies in [`chunked`]; signing of requests to the store in [`sign`]. The tests
//! use the official `aws-sigv4` crate as an independent cross-check.

pub mod chunked;
pub(crate) mod sign;
pub mod verify;

use std::borrow::Cow;

use hmac::{Hmac, Mac};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str, utf8_percent_encode};
use sha2::{Digest, Sha256};

/// The only algorithm accepted (SigV4a, `AWS4-ECDSA-P256-SHA256`, is refused as not implemented).
pub(crate) const ALGORITHM: &str = "AWS4-HMAC-SHA256";
/// Hex SHA-256 of the empty string, used in chunk string-to-sign.
pub const EMPTY_SHA256: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// Characters left unescaped by SigV4's `UriEncode()`: the RFC 3986 unreserved set.
const URI_ENCODE_SET: &AsciiSet = &NON_ALPHANUMERIC.remove(b'-').remove(b'_').remove(b'.').remove(b'~');
/// The same, but keeping `/` (used for object key paths).
const PATH_ENCODE_SET: &AsciiSet = &URI_ENCODE_SET.remove(b'/');

type HmacSha256 = Hmac<Sha256>;

/// SigV4 `UriEncode(s, encodeSlash=true)`.
#[must_use]
pub(crate) fn uri_encode(s: &str) -> String {
    Cow::from(utf8_percent_encode(s, URI_ENCODE_SET)).into_owned()
}

/// SigV4 `UriEncode(s, encodeSlash=false)`: the canonical form of an S3 path.
#[must_use]
pub(crate) fn uri_encode_path(s: &str) -> String {
    Cow::from(utf8_percent_encode(s, PATH_ENCODE_SET)).into_owned()
}

/// Appends [`uri_encode_path`]`(s)` to `out`, without a string of its own.
pub(crate) fn push_uri_encoded_path(out: &mut String, s: &str) {
    out.extend(utf8_percent_encode(s, PATH_ENCODE_SET));
}

/// Percent-decodes a URI component (`+` stays literal, as S3 treats it in paths and SigV4 in queries).
/// Invalid UTF-8 after decoding is replaced, which can only make a signature fail, never pass.
#[must_use]
pub(crate) fn uri_decode(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// The decoded value of query parameter `name`.
#[must_use]
pub(crate) fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|p| p.split_once('=').filter(|(k, _)| *k == name).map(|(_, v)| uri_decode(v)))
}

/// Canonical URI of an S3 request: the path decoded once and re-encoded with the spec's rules, so
/// clients that escape more or fewer characters than the spec requires still verify. Borrowed
/// from `raw_path` when it is canonical already (no escapes to decode, none to add).
#[must_use]
pub(crate) fn canonical_uri(raw_path: &str) -> Cow<'_, str> {
    if raw_path.is_empty() {
        return Cow::Borrowed("/");
    }
    match percent_decode_str(raw_path).decode_utf8_lossy() {
        Cow::Borrowed(decoded) => Cow::from(utf8_percent_encode(decoded, PATH_ENCODE_SET)),
        Cow::Owned(decoded) => Cow::Owned(uri_encode_path(&decoded)),
    }
}

/// Canonical query string: every parameter (except `skip`, the presigned signature) decoded,
/// re-encoded and sorted by name then value.
#[must_use]
pub(crate) fn canonical_query(raw_query: Option<&str>, skip: Option<&str>) -> String {
    let Some(q) = raw_query else { return String::new() };
    let mut pairs: Vec<(String, String)> = q
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (uri_encode(&uri_decode(k)), uri_encode(&uri_decode(v)))
        })
        .filter(|(k, _)| skip.is_none_or(|s| k != s))
        .collect();
    pairs.sort();
    let mut out = String::with_capacity(q.len());
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        out.push_str(k);
        out.push('=');
        out.push_str(v);
    }
    out
}

/// Canonical header value: trimmed, inner runs of spaces collapsed to one.
#[must_use]
pub(crate) fn canonical_header_value(v: &[u8]) -> String {
    let mut out = String::with_capacity(v.len());
    push_canonical_value(&mut out, v);
    out
}

/// Appends `v` in canonical form ([`canonical_header_value`]) to `out`.
fn push_canonical_value(out: &mut String, v: &[u8]) {
    // Most values (hosts, dates, hashes) are ASCII without a space to trim or collapse: copied.
    let space = |b: &u8| matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ');
    let canonical = v.is_ascii()
        && !v.first().is_some_and(space)
        && !v.last().is_some_and(space)
        && !v.iter().any(|b| space(b) && *b != b' ')
        && !v.windows(2).any(|w| w == b"  ");
    if canonical && let Ok(s) = std::str::from_utf8(v) {
        out.push_str(s);
        return;
    }
    for (i, word) in String::from_utf8_lossy(v).split_whitespace().enumerate() {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(word);
    }
}

/// Room reserved for a request's canonical headers block: an SDK's signed headers (host, date,
/// content hash, a few more) fit without growing it.
pub(crate) const CANONICAL_HEADERS_CAPACITY: usize = 512;

/// Appends one canonical header line, `name:value[,value...]\n`, to `out` (the canonical
/// headers block of a [`CanonicalRequest`]). Returns whether the header had a value; `out` is
/// left as it was when it had none.
pub(crate) fn push_canonical_header<'v>(
    out: &mut String,
    name: &str,
    values: impl IntoIterator<Item = &'v [u8]>,
) -> bool {
    let start = out.len();
    out.push_str(name);
    out.push(':');
    let mut any = false;
    for v in values {
        if any {
            out.push(',');
        }
        push_canonical_value(out, v);
        any = true;
    }
    if any {
        out.push('\n');
    } else {
        out.truncate(start);
    }
    any
}

/// The parts of a canonical request, borrowed from the request being checked.
#[derive(Debug)]
pub(crate) struct CanonicalRequest<'a> {
    pub(crate) method: &'a str,
    /// Already canonical (see [`canonical_uri`]).
    pub(crate) uri: &'a str,
    /// Already canonical (see [`canonical_query`]).
    pub(crate) query: &'a str,
    /// The canonical headers, a `name:value\n` line each in the order of `signed_headers`
    /// ([`push_canonical_header`]).
    pub(crate) headers: &'a str,
    /// The `SignedHeaders` list as the client sent it (`;`-joined, sorted).
    pub(crate) signed_headers: &'a str,
    pub(crate) payload_hash: &'a str,
}

impl CanonicalRequest<'_> {
    /// The canonical request's text, piece by piece, exactly as hashed into the string to sign.
    fn pieces(&self) -> [&str; 11] {
        let (nl, m) = ("\n", self);
        [m.method, nl, m.uri, nl, m.query, nl, m.headers, nl, m.signed_headers, nl, m.payload_hash]
    }

    /// Lowercase hex SHA-256 of the canonical request, hashed from its pieces (never assembled).
    #[must_use]
    pub(crate) fn sha256_hex(&self) -> String {
        let mut h = Sha256::new();
        for piece in self.pieces() {
            h.update(piece.as_bytes());
        }
        hex32(&h.finalize().into())
    }

    /// The canonical request text (for tests and diagnostics; signing hashes the pieces).
    #[cfg(test)]
    pub(crate) fn render(&self) -> String {
        self.pieces().concat()
    }
}

/// Credential scope `date/region/service/aws4_request`.
#[must_use]
pub fn scope(date: &str, region: &str, service: &str) -> String {
    [date, "/", region, "/", service, "/aws4_request"].concat()
}

/// String to sign for a request.
#[must_use]
pub(crate) fn string_to_sign(amz_date: &str, scope: &str, canonical_request: &CanonicalRequest<'_>) -> String {
    [ALGORITHM, "\n", amz_date, "\n", scope, "\n", &canonical_request.sha256_hex()].concat()
}

/// String to sign for one chunk of a `STREAMING-AWS4-HMAC-SHA256-PAYLOAD` body.
#[must_use]
pub fn chunk_string_to_sign(amz_date: &str, scope: &str, previous_signature: &str, chunk_sha256: &str) -> String {
    [ALGORITHM, "-PAYLOAD\n", amz_date, "\n", scope, "\n", previous_signature, "\n", EMPTY_SHA256, "\n", chunk_sha256]
        .concat()
}

/// String to sign for the trailer of a `STREAMING-AWS4-HMAC-SHA256-PAYLOAD-TRAILER` body.
#[must_use]
pub(crate) fn trailer_string_to_sign(
    amz_date: &str,
    scope: &str,
    previous_signature: &str,
    trailer_sha256: &str,
) -> String {
    [ALGORITHM, "-TRAILER\n", amz_date, "\n", scope, "\n", previous_signature, "\n", trailer_sha256].concat()
}

/// The derived signing key `HMAC(HMAC(HMAC(HMAC("AWS4"+secret, date), region), service), "aws4_request")`.
#[must_use]
pub fn signing_key(secret: &[u8], date: &str, region: &str, service: &str) -> [u8; 32] {
    let mut k = Vec::with_capacity(secret.len() + 4);
    k.extend_from_slice(b"AWS4");
    k.extend_from_slice(secret);
    let k = hmac(&k, date.as_bytes());
    let k = hmac(&k, region.as_bytes());
    let k = hmac(&k, service.as_bytes());
    hmac(&k, b"aws4_request")
}

/// Hex signature of `string_to_sign` under `key`.
#[must_use]
pub fn signature(key: &[u8; 32], string_to_sign: &str) -> String {
    hex32(&hmac(key, string_to_sign.as_bytes()))
}

/// Lowercase hex of a digest (a table lookup per byte, where `hex::encode` collects `char`s one
/// by one: a few thousand instructions per signed request).
#[must_use]
pub(crate) fn hex32(digest: &[u8; 32]) -> String {
    let mut buf = [0u8; 64];
    hex::encode_to_slice(digest, &mut buf).expect("64 bytes hold 32 in hex");
    String::from(std::str::from_utf8(&buf).expect("hex digits are ASCII"))
}

/// Lowercase hex SHA-256.
#[must_use]
pub fn sha256_hex(data: &[u8]) -> String {
    hex32(&Sha256::digest(data).into())
}

fn hmac(key: &[u8], data: &[u8]) -> [u8; 32] {
    let mut mac = HmacSha256::new_from_slice(key).expect("HMAC accepts keys of any length");
    mac.update(data);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    //! Vectors from the S3 SigV4 documentation ("Examples: Signature Calculations"), with the
    //! documentation's example credentials.
    use super::*;

    pub(crate) const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    const SCOPE_DATE: &str = "20130524";
    const AMZ_DATE: &str = "20130524T000000Z";

    fn headers(list: &[(&str, &str)]) -> String {
        let mut block = String::new();
        for (n, v) in list {
            assert!(push_canonical_header(&mut block, n, [v.as_bytes()]));
        }
        block
    }

    fn sign(cr: &CanonicalRequest<'_>) -> String {
        // The pieces hash to what the assembled text does.
        assert_eq!(cr.sha256_hex(), sha256_hex(cr.render().as_bytes()));
        let scope = scope(SCOPE_DATE, "us-east-1", "s3");
        let sts = string_to_sign(AMZ_DATE, &scope, cr);
        signature(&signing_key(SECRET.as_bytes(), SCOPE_DATE, "us-east-1", "s3"), &sts)
    }

    #[test]
    fn canonical_header_lines() {
        let mut block = String::from("host:h\n");
        assert!(push_canonical_header(&mut block, "x-amz-meta-a", [&b"  one   two "[..], b"three"]));
        assert_eq!(block, "host:h\nx-amz-meta-a:one two,three\n");
        assert!(!push_canonical_header(&mut block, "range", []), "a header without a value adds nothing");
        assert_eq!(block, "host:h\nx-amz-meta-a:one two,three\n");
    }

    #[test]
    fn get_object_with_range() {
        let h = headers(&[
            ("host", "examplebucket.s3.amazonaws.com"),
            ("range", "bytes=0-9"),
            ("x-amz-content-sha256", EMPTY_SHA256),
            ("x-amz-date", AMZ_DATE),
        ]);
        let cr = CanonicalRequest {
            method: "GET",
            uri: &canonical_uri("/test.txt"),
            query: "",
            headers: &h,
            signed_headers: "host;range;x-amz-content-sha256;x-amz-date",
            payload_hash: EMPTY_SHA256,
        };
        assert_eq!(sign(&cr), "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41");
    }

    #[test]
    fn put_object() {
        let payload = sha256_hex(b"Welcome to Amazon S3.");
        let h = headers(&[
            ("date", "Fri, 24 May 2013 00:00:00 GMT"),
            ("host", "examplebucket.s3.amazonaws.com"),
            ("x-amz-content-sha256", &payload),
            ("x-amz-date", AMZ_DATE),
            ("x-amz-storage-class", "REDUCED_REDUNDANCY"),
        ]);
        let cr = CanonicalRequest {
            method: "PUT",
            uri: &canonical_uri("/test%24file.text"),
            query: "",
            headers: &h,
            signed_headers: "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
            payload_hash: &payload,
        };
        assert_eq!(sign(&cr), "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd");
    }

    #[test]
    fn get_bucket_lifecycle_and_list_objects() {
        let h = headers(&[
            ("host", "examplebucket.s3.amazonaws.com"),
            ("x-amz-content-sha256", EMPTY_SHA256),
            ("x-amz-date", AMZ_DATE),
        ]);
        let sh = "host;x-amz-content-sha256;x-amz-date";
        let q = canonical_query(Some("lifecycle"), None);
        let cr = CanonicalRequest {
            method: "GET",
            uri: "/",
            query: &q,
            headers: &h,
            signed_headers: sh,
            payload_hash: EMPTY_SHA256,
        };
        assert_eq!(sign(&cr), "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543");

        let q = canonical_query(Some("prefix=J&max-keys=2"), None);
        assert_eq!(q, "max-keys=2&prefix=J");
        let cr = CanonicalRequest {
            method: "GET",
            uri: "/",
            query: &q,
            headers: &h,
            signed_headers: sh,
            payload_hash: EMPTY_SHA256,
        };
        assert_eq!(sign(&cr), "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7");
    }

    #[test]
    fn presigned_get_object() {
        let q = canonical_query(
            Some(
                "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20130524%2Fus-east-1%2Fs3%2Faws4_request\
                 &X-Amz-Date=20130524T000000Z&X-Amz-Expires=86400&X-Amz-SignedHeaders=host\
                 &X-Amz-Signature=aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404",
            ),
            Some("X-Amz-Signature"),
        );
        let h = headers(&[("host", "examplebucket.s3.amazonaws.com")]);
        let cr = CanonicalRequest {
            method: "GET",
            uri: "/test.txt",
            query: &q,
            headers: &h,
            signed_headers: "host",
            payload_hash: "UNSIGNED-PAYLOAD",
        };
        assert_eq!(sign(&cr), "aeeed9bbccd4d02ee5c0109b86d86835f995330da4c265957d157751f604d404");
    }

    #[test]
    fn encoding_is_canonical_whatever_the_client_escaped() {
        assert_eq!(canonical_uri("/b/a b+c~"), "/b/a%20b%2Bc~");
        assert_eq!(canonical_uri("/b/a%20b%2Bc%7E"), "/b/a%20b%2Bc~");
        assert_eq!(canonical_uri(""), "/");
        assert!(matches!(canonical_uri("/b/k-1_2.x~/y"), Cow::Borrowed("/b/k-1_2.x~/y")), "canonical already");
        assert_eq!(canonical_query(Some("b=2&a=1&a=0&flag"), None), "a=0&a=1&b=2&flag=");
        assert_eq!(canonical_header_value(b"  a   b  "), "a b");
        // Values copied as they are, and those trimmed or collapsed, alike with the general rule.
        for v in [&b"a b"[..], b"a  b", b" a", b"a ", b"a\tb", b"a\x0bb", b"\xc3\xa9 x", b"a\xa0b", b"", b" "] {
            let general = String::from_utf8_lossy(v).split_whitespace().collect::<Vec<_>>().join(" ");
            assert_eq!(canonical_header_value(v), general, "{v:?}");
        }
        assert_eq!(hex32(&[0xab; 32]), "ab".repeat(32));
    }
}
