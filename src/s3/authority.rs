//! Who a request to the store acts for, as a type the compiler checks.
//!
//! The store's key signs a request only when it carries [`Authority::Gateway`], and that variant
//! needs an [`Authenticated`] proof, which only this module's parent (`crate::s3`: request
//! signatures, POST policies) can make. So no code path can send the store's key on a request that
//! nobody authenticated: an anonymous request travels unsigned, and in transparent identity mode
//! the caller's own signed request travels unchanged for the store to authenticate (ADR 0013).

/// Proof that the gateway itself verified who sent a request (a SigV4 or SigV2 signature, or a
/// POST policy, against a secret it holds), naming the verified access key: the store request is
/// signed with that credential's own store key when it has one (`[[credentials]]`
/// `store_access_key`), else with the gateway's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Authenticated {
    access_key: String,
}

impl Authenticated {
    /// Made only where a signature was checked.
    pub(in crate::s3) fn new(access_key: &str) -> Self {
        Self { access_key: access_key.to_owned() }
    }

    /// The verified access key.
    #[must_use]
    pub(crate) fn access_key(&self) -> &str {
        &self.access_key
    }

    /// Transparent mode: the store accepted the caller's own signed read of an object (`answer`,
    /// a `2xx` to the request the caller signed, forwarded unchanged; or a `416` or `412` to the
    /// `Range` or `If-Match` it signed, which the gateway adds none of to such a request),
    /// naming `claimed`. The store authenticated it, so the gateway's key may read that same
    /// version for it (ADR 0029); any other answer proves nothing. Stores authorize a read before
    /// they evaluate its range and conditions: SeaweedFS, Ceph RGW and Swift answer a caller
    /// without the grant `403` (or `404`) for a range past the object's end or an `If-Match`
    /// that fails, as S3 does (`tests/python/test_alias_endpoints.py`).
    #[must_use]
    pub(crate) fn store_accepted<B>(claimed: &str, answer: &http::Response<B>) -> Option<Self> {
        let status = answer.status();
        (status.is_success()
            || status == http::StatusCode::RANGE_NOT_SATISFIABLE
            || status == http::StatusCode::PRECONDITION_FAILED)
            .then(|| Self { access_key: claimed.to_owned() })
    }

    /// A cluster hop, authenticated by the cluster credential, acts for the tenant it names (the
    /// member that forwarded it verified that tenant): the proof moves to that tenant.
    #[must_use]
    #[expect(clippy::unused_self, reason = "consumes the hop's proof: only an authenticated hop acts for a tenant")]
    pub(crate) fn acting_for(self, tenant: &str) -> Self {
        Self { access_key: tenant.to_owned() }
    }
}

/// What a store request may carry as its credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Authority {
    /// The gateway verified the caller (terminating mode): the store's key signs.
    Gateway(Authenticated),
    /// No signature at all: forwarded unsigned, so the store's ACLs and policies decide.
    Anonymous,
    /// Transparent mode: the caller's request travels as signed (its method, request target, Host,
    /// signed headers and body), and the store authenticates and authorises it.
    Caller(CallerRequest),
}

impl Authority {
    /// The caller's own request, forwarded as sent.
    #[must_use]
    pub(crate) fn caller(parts: &http::request::Parts) -> Self {
        let path_and_query =
            parts.uri.path_and_query().cloned().unwrap_or_else(|| http::uri::PathAndQuery::from_static("/"));
        Self::Caller(CallerRequest { path_and_query })
    }

    /// Whether the store, not the gateway, decides who this is (anonymous or transparent): a
    /// cached output is then never served without asking the store on this request.
    #[must_use]
    pub(crate) fn store_decides(&self) -> bool {
        !matches!(self, Self::Gateway(_))
    }
}

/// The request target exactly as the client sent (and signed) it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallerRequest {
    /// Shares the request head's bytes (no copy).
    path_and_query: http::uri::PathAndQuery,
}

impl CallerRequest {
    #[must_use]
    pub(crate) fn path_and_query(&self) -> &http::uri::PathAndQuery {
        &self.path_and_query
    }
}

/// The access key a request names, read without checking its signature (transparent mode): a
/// claim until the store accepts the request. SigV4 and SigV2, in headers or the query.
#[must_use]
pub(crate) fn claimed_access_key(headers: &http::HeaderMap, query: Option<&str>) -> Option<String> {
    if let Some(auth) = headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        if let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256") {
            let cred = rest.split(',').find_map(|p| p.trim().strip_prefix("Credential="))?;
            return cred.split('/').next().filter(|k| !k.is_empty()).map(str::to_owned);
        }
        if let Some(rest) = auth.strip_prefix("AWS ") {
            return rest.rsplit_once(':').map(|(k, _)| k.to_owned()).filter(|k| !k.is_empty());
        }
        return None;
    }
    let query = query?;
    query.split('&').find_map(|p| {
        let (k, v) = p.split_once('=')?;
        let v = crate::s3::sigv4::uri_decode(v);
        match k {
            "X-Amz-Credential" => v.split('/').next().filter(|k| !k.is_empty()).map(str::to_owned),
            "AWSAccessKeyId" => Some(v).filter(|k| !k.is_empty()),
            _ => None,
        }
    })
}

/// Whether the caller's signature covers header `name` (lowercase), read without checking it
/// (transparent mode): SigV4 lists what it signs (`SignedHeaders` in `Authorization`, or
/// `X-Amz-SignedHeaders` in a presigned URL, often `host` alone); SigV2 signs `Content-MD5`,
/// `Content-Type`, `Date` and `x-amz-*` headers. Unknown forms count as signed, so that a header
/// is dropped only where the store cannot have checked it.
#[must_use]
pub(crate) fn signs_header(headers: &http::HeaderMap, query: Option<&str>, name: &str) -> bool {
    let listed = |list: &str| list.split(';').any(|h| h.trim().eq_ignore_ascii_case(name));
    if let Some(auth) = headers.get(http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()) {
        if let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256") {
            return rest.split(',').find_map(|p| p.trim().strip_prefix("SignedHeaders=")).is_none_or(listed);
        }
        if auth.starts_with("AWS ") {
            return sigv2_signs(name);
        }
        return true;
    }
    let query = query.unwrap_or_default();
    match crate::s3::sigv4::query_param(query, "X-Amz-SignedHeaders") {
        Some(list) => listed(&list),
        // SigV2 in the query (`Signature=`): as in its header form.
        None if crate::s3::sigv4::query_param(query, "Signature").is_some() => sigv2_signs(name),
        None => true,
    }
}

/// Whether SigV2 signs header `name` (lowercase): `Content-MD5`, `Content-Type`, `Date` and the
/// `x-amz-*` headers.
fn sigv2_signs(name: &str) -> bool {
    ["content-md5", "content-type", "date"].contains(&name) || name.starts_with("x-amz-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_auth(v: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, v.parse().expect("value"));
        h
    }

    #[test]
    fn claims_are_read_from_every_signature_form() {
        let v4 =
            "AWS4-HMAC-SHA256 Credential=AKID/20261203/us-east-1/s3/aws4_request, SignedHeaders=host, Signature=00";
        assert_eq!(claimed_access_key(&with_auth(v4), None).as_deref(), Some("AKID"));
        assert_eq!(claimed_access_key(&with_auth("AWS test:tester:c2ln"), None).as_deref(), Some("test:tester"));
        assert_eq!(claimed_access_key(&with_auth("Bearer x"), Some("AWSAccessKeyId=A")), None);
        let q = "x=1&X-Amz-Credential=test%3Atester%2F20261203%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Signature=0";
        assert_eq!(claimed_access_key(&http::HeaderMap::new(), Some(q)).as_deref(), Some("test:tester"));
        assert_eq!(
            claimed_access_key(&http::HeaderMap::new(), Some("AWSAccessKeyId=K&Signature=s")).as_deref(),
            Some("K")
        );
        assert_eq!(claimed_access_key(&http::HeaderMap::new(), Some("list-type=2")), None);
        assert_eq!(claimed_access_key(&with_auth("AWS4-HMAC-SHA256 Credential=/x"), None), None);
    }

    #[test]
    fn a_header_is_unsigned_only_where_the_signature_says_so() {
        let v4 = "AWS4-HMAC-SHA256 Credential=AK/20261203/us-east-1/s3/aws4_request, \
                  SignedHeaders=host;range;x-amz-date, Signature=00";
        assert!(signs_header(&with_auth(v4), None, "range"));
        assert!(!signs_header(&with_auth(v4), None, "if-match"));
        assert!(!signs_header(&with_auth("AWS AK:c2ln"), None, "range"));
        assert!(signs_header(&with_auth("AWS AK:c2ln"), None, "x-amz-date"));
        let presigned = "X-Amz-Credential=AK%2F20261203&X-Amz-SignedHeaders=host&X-Amz-Signature=00";
        assert!(!signs_header(&http::HeaderMap::new(), Some(presigned), "range"));
        let with_range = "X-Amz-SignedHeaders=host%3Brange&X-Amz-Signature=00";
        assert!(signs_header(&http::HeaderMap::new(), Some(with_range), "range"));
        assert!(!signs_header(&http::HeaderMap::new(), Some("AWSAccessKeyId=K&Signature=s"), "range"));
        // Nothing readable: as if signed.
        assert!(signs_header(&with_auth("Bearer x"), None, "range"));
        assert!(signs_header(&http::HeaderMap::new(), Some("list-type=2"), "range"));
    }

    #[test]
    fn only_the_gateway_variant_lets_the_gateway_decide() {
        assert!(!Authority::Gateway(Authenticated::new("AK")).store_decides());
        assert!(Authority::Anonymous.store_decides());
        let (parts, ()) = http::Request::get("/b/k?tensorgate-model=m").body(()).expect("request").into_parts();
        let caller = Authority::caller(&parts);
        assert!(caller.store_decides());
        assert!(matches!(&caller, Authority::Caller(c) if c.path_and_query() == "/b/k?tensorgate-model=m"));
    }
}
