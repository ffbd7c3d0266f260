//! Transparent identity mode (`backend.identity`, ADR 0013): the store authenticates and
//! authorises every request. Nothing is verified or re-signed here: each request travels as the
//! client signed it (method, request target, Host, headers, body and its framing), and a pushdown
//! reads its source with that same request, so the store decides for this caller on every request,
//! cached outputs included (`super::pushdown`). The access key a request names is a claim
//! (`Identity::Claimed`) until the store accepted the request.

use http::{Request, Response};

use super::passthrough::{check_declared, declared_body, expects_continue};
use super::{Caller, Gateway, owner};
use crate::backend::{ForwardPayload, ForwardRequest};
use crate::body::{Body, Guarded, Metered};
use crate::error::GatewayError;
use crate::pushdown::spec as pushdown_spec;
use crate::s3::authority::{Authority, claimed_access_key};
use crate::s3::headers::{self, HOP_BY_HOP};
use crate::s3::route::{S3Op, Target};
use crate::s3::sigv4::verify::Identity;

impl Gateway {
    /// Forwards a request as sent, or serves it as a pushdown whose source read is the caller's
    /// own request.
    pub(super) async fn forward_as_sent(
        &self,
        req: Request<Body>,
        target: Target,
        op: S3Op,
    ) -> Result<(Response<Body>, String), GatewayError> {
        let (mut parts, body) = req.into_parts();
        let identity =
            claimed_access_key(&parts.headers, parts.uri.query()).map_or(Identity::Anonymous, Identity::Claimed);
        let authority = Authority::caller(&parts);
        // A caller's request forwarded by another member (unsigned marks, taken off here): served
        // here, never routed again, with the split the first member resolved.
        let hop = parts.headers.remove(owner::HOP).is_some();
        let hop_split = parts.headers.remove(owner::HOP_SPLIT).and_then(|v| v.to_str().ok().map(str::to_owned));
        let mut planned_none = false;
        // An alias endpoint's read is a pushdown of the very object the caller signed a read of.
        let alias = self.alias_of(&parts, &target, op)?.map(|a| a.spec);
        if matches!(op, S3Op::GetObject | S3Op::HeadObject)
            && let Some(mut spec) = match alias {
                Some(spec) => Some(spec),
                None => pushdown_spec::parse(&parts.headers, parts.uri.query())?,
            }
        {
            if let Some(split) = hop_split.filter(|_| hop) {
                spec.split = split;
            }
            match Box::pin(self.prepare(spec, identity.name())).await? {
                Some(job) => {
                    let resp = Box::pin(self.pushdown_phase(
                        &parts,
                        target,
                        job,
                        Caller { tenant: identity.name(), authority: &authority },
                        hop,
                    ))
                    .await?;
                    return Ok((resp, identity.name().to_owned()));
                }
                None => planned_none = true,
            }
        }
        let (declared, has_body) = declared_body(&parts.headers)?;
        // The store checks the payload (hash, chunk signatures, checksums); the gateway bounds its
        // size: the decoded length a streaming upload declares, and twice that for its framing.
        let decoded = parts
            .headers
            .get(headers::X_AMZ_DECODED_CONTENT_LENGTH)
            .map(|v| v.to_str().ok().and_then(|s| s.parse::<u64>().ok()))
            .map(|n| n.ok_or(GatewayError::InvalidHeader(headers::X_AMZ_DECODED_CONTENT_LENGTH)))
            .transpose()?;
        let limit = self.cfg.load().max_body_bytes;
        check_declared(decoded.or(declared), limit)?;
        let framed = if decoded.is_some() { limit.saturating_mul(2) } else { limit };
        let counted = Metered::new(body, self.metrics.request_bytes.clone(), ());
        // A payload hash the client signed is a claim the gateway can check without its secret:
        // a body that does not match never completes at the store (its tail is withheld), also
        // on stores that do not check it themselves (SeaweedFS). A store that checks it
        // (`backend.checks_payload_hash`) is left to do so alone: the body streams unhashed.
        let signed_hash = has_body
            .then(|| parts.headers.get(headers::X_AMZ_CONTENT_SHA256))
            .flatten()
            .and_then(|v| v.to_str().ok())
            .filter(|v| v.len() == 64)
            .and_then(|v| Some((v.to_owned(), <[u8; 32]>::try_from(hex::decode(v).ok()?).ok()?)))
            .filter(|_| !self.backend.checks_payload_hash());
        let expect_continue = expects_continue(&parts.headers);
        // Everything above read the client's headers as sent; they travel on without a copy,
        // less the hop-by-hop ones.
        let mut headers = std::mem::take(&mut parts.headers);
        headers::remove_all(&mut headers, HOP_BY_HOP);
        let (body, payload) = if !has_body {
            (Body::empty(), ForwardPayload::Empty)
        } else if let Some((hex, expected)) = signed_hash.filter(|_| decoded.is_none()) {
            let data = http_body_util::BodyDataStream::new(Guarded::new(counted, limit, Some(expected)));
            Box::pin(self.prepared_body(op, data, declared.unwrap_or_default(), &mut headers, Some(hex))).await?
        } else if op == S3Op::DeleteObjects && decoded.is_none() && !headers.contains_key(headers::CONTENT_MD5) {
            // Swift's s3api requires a Content-MD5 that boto3 >= 1.36 no longer sends: added
            // beside the caller's signature (unsigned; the body is unchanged, small XML).
            let data = http_body_util::BodyDataStream::new(Guarded::new(counted, limit, None));
            Box::pin(self.prepared_body(op, data, declared.unwrap_or_default(), &mut headers, None)).await?
        } else {
            (Body::new(Guarded::new(counted, framed, None)), ForwardPayload::Unsigned)
        };
        let fwd = ForwardRequest {
            op,
            method: parts.method,
            target,
            query: None,
            headers,
            body,
            payload,
            authority,
            expect_continue,
        };
        let resp = self.send_passthrough(fwd, planned_none).await?;
        Ok((resp, identity.name().to_owned()))
    }
}
