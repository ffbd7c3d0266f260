//! AWS Signature Version 2 (legacy, HMAC-SHA1), verification only.
//!
//! Spec: <https://docs.aws.amazon.com/AmazonS3/latest/userguide/RESTAuthentication.html>.
//! Still what the aws CLI v1 (`aws s3 presign`) and boto3's `generate_presigned_url` produce by
//! default for S3, so a drop-in gateway must accept it: header form `Authorization: AWS AK:sig`
//! and query form `AWSAccessKeyId=..&Expires=..&Signature=..`. Pure functions; the caller
//! supplies the clock. SigV2 never covers the body (only `Content-MD5`, which the backend checks).

use base64::Engine;
use hmac::{Hmac, Mac};
use http::{HeaderMap, Method};
use sha1::Sha1;

use super::sigv4::uri_decode;

/// Query parameters that are part of the signed resource ("sub-resources"), per the spec's list
/// plus those added since (tagging, object lock, attributes).
const SUBRESOURCES: &[&str] = &[
    "acl",
    "attributes",
    "cors",
    "delete",
    "legal-hold",
    "lifecycle",
    "location",
    "logging",
    "notification",
    "object-lock",
    "partNumber",
    "policy",
    "requestPayment",
    "response-cache-control",
    "response-content-disposition",
    "response-content-encoding",
    "response-content-language",
    "response-content-type",
    "response-expires",
    "restore",
    "retention",
    "select",
    "select-type",
    "tagging",
    "torrent",
    "uploadId",
    "uploads",
    "versionId",
    "versioning",
    "versions",
    "website",
];

/// The other spelling of a bucket's own resource: `/bucket/` for `/bucket` (sub-resources kept),
/// as S3 names a bucket. botocore signs a path-style bucket request (`PUT /bucket`, CreateBucket)
/// with the slash it does not send; clients that sign the path as sent exist too. `None` for any
/// other resource.
#[must_use]
pub(crate) fn bucket_resource_with_slash(resource: &str) -> Option<String> {
    let (path, subs) = resource.split_once('?').map_or((resource, None), |(p, q)| (p, Some(q)));
    let bucket = path.strip_prefix('/').filter(|b| !b.is_empty() && !b.contains('/'))?;
    Some(match subs {
        Some(q) => format!("/{bucket}/?{q}"),
        None => format!("/{bucket}/"),
    })
}

/// `CanonicalizedResource`: `/bucket` for virtual-host requests, the path as sent, then the
/// sub-resources sorted by name.
#[must_use]
pub(crate) fn canonical_resource(vhost_bucket: Option<&str>, raw_path: &str, raw_query: Option<&str>) -> String {
    let mut out = String::new();
    if let Some(b) = vhost_bucket {
        out.push('/');
        out.push_str(b);
    }
    out.push_str(if raw_path.is_empty() { "/" } else { raw_path });
    let mut subs: Vec<(String, Option<String>)> = raw_query
        .unwrap_or_default()
        .split('&')
        .filter_map(|p| {
            let (k, v) = match p.split_once('=') {
                Some((k, v)) => (uri_decode(k), Some(uri_decode(v))),
                None => (uri_decode(p), None),
            };
            SUBRESOURCES.contains(&k.as_str()).then_some((k, v))
        })
        .collect();
    subs.sort();
    for (i, (k, v)) in subs.iter().enumerate() {
        out.push(if i == 0 { '?' } else { '&' });
        out.push_str(k);
        if let Some(v) = v {
            out.push('=');
            out.push_str(v);
        }
    }
    out
}

/// `CanonicalizedAmzHeaders`: `x-amz-*` headers, lowercased, sorted, values comma-joined.
#[must_use]
pub(crate) fn canonical_amz_headers(headers: &HeaderMap) -> String {
    let mut names: Vec<&str> =
        headers.keys().map(http::HeaderName::as_str).filter(|n| n.starts_with("x-amz-")).collect();
    names.sort_unstable();
    names.dedup();
    let mut out = String::new();
    for n in names {
        let values: Vec<String> =
            headers.get_all(n).iter().map(|v| super::sigv4::canonical_header_value(v.as_bytes())).collect();
        out.push_str(n);
        out.push(':');
        out.push_str(&values.join(","));
        out.push('\n');
    }
    out
}

/// The string to sign. `date` is the `Date` header (empty when `x-amz-date` is sent) or, for a
/// presigned URL, the `Expires` value.
#[must_use]
pub(crate) fn string_to_sign(method: &Method, headers: &HeaderMap, date: &str, resource: &str) -> String {
    let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().trim().to_owned();
    format!(
        "{}\n{}\n{}\n{date}\n{}{resource}",
        method.as_str(),
        h("content-md5"),
        h("content-type"),
        canonical_amz_headers(headers)
    )
}

/// Base64 HMAC-SHA1 signature.
#[must_use]
pub(crate) fn signature(secret: &[u8], string_to_sign: &str) -> String {
    let mut mac = Hmac::<Sha1>::new_from_slice(secret).expect("HMAC accepts keys of any length");
    mac.update(string_to_sign.as_bytes());
    base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    //! Examples from the SigV2 documentation (RESTAuthentication), with its example credentials.
    use super::*;

    const SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";

    #[test]
    fn documented_object_get_and_put() {
        let mut h = HeaderMap::new();
        h.insert("date", "Tue, 27 Mar 2007 19:36:42 +0000".parse().expect("v"));
        let r = canonical_resource(Some("johnsmith"), "/photos/puppy.jpg", None);
        let sts = string_to_sign(&Method::GET, &h, "Tue, 27 Mar 2007 19:36:42 +0000", &r);
        assert_eq!(sts, "GET\n\n\nTue, 27 Mar 2007 19:36:42 +0000\n/johnsmith/photos/puppy.jpg");
        assert_eq!(signature(SECRET.as_bytes(), &sts), "bWq2s1WEIj+Ydj0vQ697zp+IXMU=");

        let mut h = HeaderMap::new();
        h.insert("content-type", "image/jpeg".parse().expect("v"));
        let sts = string_to_sign(&Method::PUT, &h, "Tue, 27 Mar 2007 21:15:45 +0000", &r);
        assert_eq!(signature(SECRET.as_bytes(), &sts), "MyyxeRY7whkBe+bq8fHCL/2kKUg=");
    }

    #[test]
    fn subresources_are_sorted_and_filtered() {
        assert_eq!(canonical_resource(None, "/b/k", Some("versionId=3&acl&prefix=x")), "/b/k?acl&versionId=3");
        assert_eq!(canonical_resource(None, "", None), "/");
        assert_eq!(bucket_resource_with_slash("/b").as_deref(), Some("/b/"));
        assert_eq!(bucket_resource_with_slash("/b?acl").as_deref(), Some("/b/?acl"));
        for other in ["/", "/b/", "/b/k", "/b/?acl"] {
            assert_eq!(bucket_resource_with_slash(other), None, "{other}");
        }
    }
}
