//! Who is asking the admin API to change something. A tenant proves its access key with a
//! presigned S3 `GET /` (ListBuckets) URL that it signed for the gateway's S3 endpoint: in
//! terminating mode the gateway checks the signature against its `[[credentials]]`; in transparent
//! mode it sends that request, as signed, to the store, and the key is proven when the store
//! answers `2xx` (the gateway holds no secret to check it with). The proof is a read that changes
//! nothing, so a replayed proof gains nothing but the plan it came with.

use std::time::Duration;

use http::{HeaderMap, HeaderValue, Method, Uri};
use time::OffsetDateTime;

use crate::backend::{Backend, ForwardPayload, ForwardRequest};
use crate::body::Body;
use crate::s3::authority::{Authority, claimed_access_key};
use crate::s3::credentials::LiveCredentials;
use crate::s3::route::{S3Op, Target};
use crate::s3::sigv4::verify::{self, Identity};

/// Longest validity a proof may ask for: a proof is made for one admin call, seconds before it.
pub(crate) const MAX_PROOF_EXPIRES_SECS: u64 = 900;

/// How the gateway checks a proof.
#[derive(Debug, Clone)]
pub(crate) enum Prover {
    /// Terminating mode: the gateway's own client credentials (those in force).
    Gateway(LiveCredentials),
    /// Transparent mode: the store, asked with the tenant's own signed request.
    Store(Backend),
}

/// Why a proof was not accepted (`403`, except a store that could not be asked: `503`).
#[derive(Debug, thiserror::Error)]
pub(crate) enum ProofError {
    #[error(
        "this call needs a proof: a presigned GET / (ListBuckets) URL signed with your access key, in the `proof` field"
    )]
    Missing,
    #[error("the proof must be a presigned GET / (ListBuckets) URL, valid for at most {MAX_PROOF_EXPIRES_SECS} s: {0}")]
    Malformed(&'static str),
    #[error("the proof's signature was refused: {0}")]
    Refused(String),
    #[error("the proof names {proven}, the request names tenant {named}")]
    OtherTenant { proven: String, named: String },
    #[error("the store could not be asked to check the proof: {0}")]
    StoreUnavailable(String),
}

impl ProofError {
    #[must_use]
    pub(crate) fn status(&self) -> http::StatusCode {
        match self {
            Self::StoreUnavailable(_) => http::StatusCode::SERVICE_UNAVAILABLE,
            Self::Malformed(_) => http::StatusCode::BAD_REQUEST,
            _ => http::StatusCode::FORBIDDEN,
        }
    }
}

/// The parts of a proof URL: its `Host` and request target (pure).
///
/// # Errors
/// Anything but an absolute `http(s)` URL of `GET /` whose query holds only presigned SigV4
/// parameters (and `x-id`), expiring within [`MAX_PROOF_EXPIRES_SECS`].
pub(crate) fn parse(proof: &str) -> Result<(String, Uri), ProofError> {
    let uri: Uri = proof.parse().map_err(|_| ProofError::Malformed("not a URL"))?;
    let host = uri.authority().ok_or(ProofError::Malformed("no host"))?.as_str().to_owned();
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.path() != "/" {
        return Err(ProofError::Malformed("not a URL of GET /"));
    }
    let query = uri.query().ok_or(ProofError::Malformed("not presigned"))?;
    let mut expires = None;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "X-Amz-Expires" {
            expires = v.parse::<u64>().ok();
        } else if !k.starts_with("X-Amz-") && k != "x-id" {
            return Err(ProofError::Malformed("a query parameter other than the signature's"));
        }
    }
    match expires {
        Some(s) if s <= MAX_PROOF_EXPIRES_SECS => {}
        _ => return Err(ProofError::Malformed("X-Amz-Expires missing or too long")),
    }
    let target: Uri =
        uri.path_and_query().map_or("/", |p| p.as_str()).parse().map_err(|_| ProofError::Malformed("bad target"))?;
    Ok((host, target))
}

impl Prover {
    /// The access key `proof` proves.
    ///
    /// # Errors
    /// See [`ProofError`].
    pub(crate) async fn prove(&self, proof: &str) -> Result<String, ProofError> {
        let (host, target) = parse(proof)?;
        let mut headers = HeaderMap::new();
        headers
            .insert(http::header::HOST, HeaderValue::from_str(&host).map_err(|_| ProofError::Malformed("bad host"))?);
        match self {
            Self::Gateway(creds) => {
                let v = verify::verify(
                    &Method::GET,
                    &target,
                    None,
                    &headers,
                    &creds.load(),
                    false,
                    OffsetDateTime::now_utc(),
                )
                .map_err(|e| ProofError::Refused(e.to_string()))?;
                match v.identity {
                    Identity::AccessKey(k) if v.presigned => Ok(k),
                    _ => Err(ProofError::Malformed("not presigned")),
                }
            }
            Self::Store(backend) => {
                let claimed =
                    claimed_access_key(&headers, target.query()).ok_or(ProofError::Malformed("no access key"))?;
                let (parts, ()) =
                    http::Request::get(target).body(()).map_err(|_| ProofError::Malformed("bad target"))?.into_parts();
                let fwd = ForwardRequest {
                    op: S3Op::ListBuckets,
                    method: Method::GET,
                    target: Target::default(),
                    query: None,
                    headers,
                    body: Body::empty(),
                    payload: ForwardPayload::Empty,
                    authority: Authority::caller(&parts),
                    expect_continue: false,
                };
                let send = backend.send(fwd);
                let resp = tokio::time::timeout(PROOF_TIMEOUT, send)
                    .await
                    .map_err(|_| ProofError::StoreUnavailable("no answer in time".into()))?
                    .map_err(|e| ProofError::StoreUnavailable(e.to_string()))?;
                if resp.status().is_success() {
                    Ok(claimed)
                } else {
                    Err(ProofError::Refused(format!("the store answered {}", resp.status())))
                }
            }
        }
    }
}

/// The store's answer to a proof is awaited at most this long (a ListBuckets on a healthy store
/// takes milliseconds).
const PROOF_TIMEOUT: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    const SIGNED: &str = "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=K%2F20261203%2Fus-east-1%2Fs3%2Faws4_request&X-Amz-Date=20261203T000000Z&X-Amz-Expires=300&X-Amz-SignedHeaders=host&X-Amz-Signature=00";

    #[test]
    fn only_a_short_presigned_get_of_the_root_is_a_proof() {
        let (host, target) = parse(&format!("http://127.0.0.1:9000/?{SIGNED}")).expect("proof");
        assert_eq!(host, "127.0.0.1:9000");
        assert_eq!(target.path(), "/");
        for bad in [
            format!("http://127.0.0.1:9000/bucket?{SIGNED}"),
            format!("http://127.0.0.1:9000/?{SIGNED}&delete"),
            format!("ftp://127.0.0.1:9000/?{SIGNED}"),
            "http://127.0.0.1:9000/".to_owned(),
            format!("http://127.0.0.1:9000/?{}", SIGNED.replace("Expires=300", "Expires=86400")),
            "/?X-Amz-Expires=1".to_owned(),
        ] {
            assert!(matches!(parse(&bad), Err(ProofError::Malformed(_))), "{bad}");
        }
    }
}
