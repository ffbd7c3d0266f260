//! The one place where errors become HTTP: every domain error maps exhaustively (no catch-all arm)
//! to an S3 error code, a status and a client-safe message, rendered as S3 XML.
//!
//! Errors from the backend that arrive as HTTP responses are not errors here: they pass through to
//! the client exactly as the backend sent them. This module only covers what the gateway itself
//! refuses or fails at.

use http::{HeaderValue, Response, StatusCode};

use crate::backend::BackendError;
use crate::body::{Body, BodyError};
use crate::pushdown::PushdownError;
use crate::s3::form::FormError;
use crate::s3::post_policy::PostError;
use crate::s3::route::RouteError;
use crate::s3::sigv4::verify::AuthError;
use crate::s3::xml::error_body;

/// Everything the gateway can refuse a request for.
#[derive(Debug, thiserror::Error)]
pub(crate) enum GatewayError {
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Pushdown(#[from] PushdownError),
    #[error(transparent)]
    Post(#[from] PostError),
    #[error(transparent)]
    Form(#[from] FormError),
    #[error("the declared body size {declared} exceeds the limit of {limit} bytes")]
    EntityTooLarge { declared: u64, limit: u64 },
    #[error("invalid header {0}")]
    InvalidHeader(&'static str),
    #[error("you must provide the Content-Length HTTP header")]
    MissingContentLength,
    #[error("the requested range is not satisfiable (the object is {size} bytes)")]
    InvalidRange { size: usize },
    #[error("the output's ETag is not the one If-Match names")]
    PreconditionFailed,
    #[error("too many requests in flight; retry later")]
    Overloaded,
    #[error("aliases are read-only: write to the bucket they stand for, through the gateway's S3 endpoint")]
    AliasReadOnly,
    /// Cluster policy: a request signed with the cluster credential that is not a pushdown read.
    #[error("the cluster credential signs only pushdown reads between gateways")]
    PeerOnlyPushdown,
    #[error("the gateway is shutting down")]
    ShuttingDown,
    #[error("no response within edge.request_timeout_secs ({secs} s); retry later")]
    RequestTimeout { secs: u64 },
}

/// How an error is presented to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct S3ErrorSpec {
    pub(crate) status: StatusCode,
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) retry_after: bool,
}

impl S3ErrorSpec {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self { status, code, message: message.into(), retry_after: status == StatusCode::SERVICE_UNAVAILABLE }
    }
}

impl GatewayError {
    /// The S3 code, status and message for this error.
    #[must_use]
    pub(crate) fn spec(&self) -> S3ErrorSpec {
        use StatusCode as S;
        let msg = self.to_string();
        match self {
            Self::Auth(e) => auth_spec(e, msg),
            Self::Body(e) => body_spec(e),
            Self::Post(e) => post_spec(e, msg),
            Self::MissingContentLength => S3ErrorSpec::new(S::LENGTH_REQUIRED, "MissingContentLength", msg),
            Self::Form(e) => match e {
                FormError::Malformed(_) => S3ErrorSpec::new(S::BAD_REQUEST, "MalformedPOSTRequest", msg),
                FormError::NoFile => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidArgument", msg),
                FormError::TooLarge(_) => S3ErrorSpec::new(S::BAD_REQUEST, "MaxPostPreDataLengthExceeded", msg),
            },
            Self::Route(e) => match e {
                RouteError::InvalidBucketName => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidBucketName", msg),
                RouteError::KeyTooLong => S3ErrorSpec::new(S::BAD_REQUEST, "KeyTooLongError", msg),
            },
            Self::Backend(e) => backend_spec(e, msg),
            Self::Pushdown(e) => pushdown_spec(e, msg),
            Self::EntityTooLarge { .. } => S3ErrorSpec::new(S::BAD_REQUEST, "EntityTooLarge", msg),
            Self::InvalidHeader(_) => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidArgument", msg),
            Self::InvalidRange { .. } => S3ErrorSpec::new(S::RANGE_NOT_SATISFIABLE, "InvalidRange", msg),
            Self::PreconditionFailed => S3ErrorSpec::new(S::PRECONDITION_FAILED, "PreconditionFailed", msg),
            Self::Overloaded => S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "SlowDown", "please reduce your request rate"),
            Self::AliasReadOnly => S3ErrorSpec::new(S::METHOD_NOT_ALLOWED, "MethodNotAllowed", msg),
            Self::PeerOnlyPushdown => S3ErrorSpec::new(S::FORBIDDEN, "AccessDenied", msg),
            Self::ShuttingDown => S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "ServiceUnavailable", msg),
            Self::RequestTimeout { .. } => S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "ServiceUnavailable", msg),
        }
    }

    /// The XML error response. `head` requests get the status and headers without a body, as S3 does.
    #[must_use]
    pub(crate) fn into_response(self, resource: &str, request_id: &str, head: bool) -> Response<Body> {
        self.spec().into_response(resource, request_id, head)
    }
}

impl S3ErrorSpec {
    /// Renders the response.
    #[must_use]
    pub(crate) fn into_response(self, resource: &str, request_id: &str, head: bool) -> Response<Body> {
        let body =
            if head { Body::empty() } else { Body::from(error_body(self.code, &self.message, resource, request_id)) };
        let mut resp = Response::new(body);
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/xml"));
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert(crate::s3::headers::X_AMZ_REQUEST_ID, v);
        }
        if self.retry_after {
            h.insert(http::header::RETRY_AFTER, HeaderValue::from(crate::s3::headers::RETRY_AFTER_SECS));
        }
        resp
    }
}
fn auth_spec(e: &AuthError, msg: String) -> S3ErrorSpec {
    use StatusCode as S;
    match e {
        // Ceph RGW and the s3-tests suite answer 403 for out-of-range expiries and bad SigV2 dates.
        AuthError::AnonymousDenied | AuthError::Expired | AuthError::ExpiresTooLong | AuthError::InvalidDate => {
            S3ErrorSpec::new(S::FORBIDDEN, "AccessDenied", msg)
        }
        AuthError::MalformedHeader(_) => S3ErrorSpec::new(S::BAD_REQUEST, "AuthorizationHeaderMalformed", msg),
        AuthError::MalformedQuery(_) => S3ErrorSpec::new(S::BAD_REQUEST, "AuthorizationQueryParametersError", msg),
        AuthError::UnsupportedAlgorithm => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidRequest", msg),
        AuthError::UnknownAccessKey => S3ErrorSpec::new(S::FORBIDDEN, "InvalidAccessKeyId", msg),
        AuthError::SignatureDoesNotMatch => S3ErrorSpec::new(S::FORBIDDEN, "SignatureDoesNotMatch", msg),
        AuthError::TimeTooSkewed => S3ErrorSpec::new(S::FORBIDDEN, "RequestTimeTooSkewed", msg),
        AuthError::MissingContentSha256 | AuthError::InvalidContentSha256(_) => {
            S3ErrorSpec::new(S::BAD_REQUEST, "InvalidRequest", msg)
        }
        AuthError::NotImplemented(_) => S3ErrorSpec::new(S::NOT_IMPLEMENTED, "NotImplemented", msg),
    }
}

fn post_spec(e: &PostError, msg: String) -> S3ErrorSpec {
    use StatusCode as S;
    match e {
        PostError::InvalidArgument(_) => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidArgument", msg),
        PostError::AccessDenied(_) => S3ErrorSpec::new(S::FORBIDDEN, "AccessDenied", msg),
        PostError::InvalidAccessKeyId => S3ErrorSpec::new(S::FORBIDDEN, "InvalidAccessKeyId", msg),
        PostError::SignatureDoesNotMatch => S3ErrorSpec::new(S::FORBIDDEN, "SignatureDoesNotMatch", msg),
        PostError::InvalidPolicyDocument(_) => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidPolicyDocument", msg),
        PostError::EntityTooSmall => S3ErrorSpec::new(S::BAD_REQUEST, "EntityTooSmall", msg),
        PostError::EntityTooLarge => S3ErrorSpec::new(S::BAD_REQUEST, "EntityTooLarge", msg),
        PostError::KeyTooLong => S3ErrorSpec::new(S::BAD_REQUEST, "KeyTooLongError", msg),
        PostError::MalformedXml => S3ErrorSpec::new(S::BAD_REQUEST, "MalformedXML", msg),
    }
}

fn backend_spec(e: &BackendError, msg: String) -> S3ErrorSpec {
    use StatusCode as S;
    match e {
        BackendError::Unreachable { .. } => S3ErrorSpec::new(
            S::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the storage backend is unreachable; retry later",
        ),
        BackendError::Timeout { .. } => S3ErrorSpec::new(
            S::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the storage backend did not answer in time; retry later",
        ),
        BackendError::Busy { .. } => S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "SlowDown", msg),
        BackendError::SendBody { .. } => match e.body_error() {
            Some(b) => body_spec(b),
            None => S3ErrorSpec::new(
                S::SERVICE_UNAVAILABLE,
                "ServiceUnavailable",
                "the connection to the storage backend failed; retry later",
            ),
        },
        BackendError::UnsignableHeader(_) => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidArgument", msg),
        BackendError::UnsafeKey => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidArgument", msg),
        BackendError::AnonymousWrite => S3ErrorSpec::new(S::FORBIDDEN, "AccessDenied", msg),
        BackendError::Internal(_) | BackendError::NoStoreKey => S3ErrorSpec::new(
            S::INTERNAL_SERVER_ERROR,
            "InternalError",
            "we encountered an internal error; please try again",
        ),
    }
}

fn pushdown_spec(e: &PushdownError, msg: String) -> S3ErrorSpec {
    use StatusCode as S;
    match e {
        PushdownError::InvalidArgument { .. }
        | PushdownError::UnknownModel { .. }
        | PushdownError::UnknownSplit { .. } => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidArgument", msg),
        PushdownError::Unavailable(_) => S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "ServiceUnavailable", msg),
        PushdownError::Overloaded | PushdownError::TooManyPlans { .. } | PushdownError::Unwanted => {
            S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "SlowDown", msg)
        }
        PushdownError::ExceedsBudget { .. } => S3ErrorSpec::new(S::BAD_REQUEST, "EntityTooLarge", msg),
        PushdownError::BudgetBusy { .. } => S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "SlowDown", msg),
        PushdownError::BadInput(_) | PushdownError::ObjectTooLarge { .. } | PushdownError::WholeReadFirst => {
            S3ErrorSpec::new(S::BAD_REQUEST, "InvalidRequest", msg)
        }
        PushdownError::Unsupported(_) => S3ErrorSpec::new(S::UNSUPPORTED_MEDIA_TYPE, "InvalidRequest", msg),
        PushdownError::SourceTimeout { .. } | PushdownError::SourceRead(_) => {
            S3ErrorSpec::new(S::SERVICE_UNAVAILABLE, "ServiceUnavailable", msg)
        }
        PushdownError::Model(_) => S3ErrorSpec::new(S::INTERNAL_SERVER_ERROR, "InternalError", msg),
        PushdownError::Internal(_) => S3ErrorSpec::new(
            S::INTERNAL_SERVER_ERROR,
            "InternalError",
            "we encountered an internal error; please try again",
        ),
    }
}

fn body_spec(e: &BodyError) -> S3ErrorSpec {
    use StatusCode as S;
    let msg = e.to_string();
    match e {
        BodyError::Read(_) | BodyError::Incomplete | BodyError::LengthMismatch => {
            S3ErrorSpec::new(S::BAD_REQUEST, "IncompleteBody", msg)
        }
        BodyError::Malformed(_) | BodyError::ChunkTooLarge => S3ErrorSpec::new(S::BAD_REQUEST, "InvalidRequest", msg),
        BodyError::ChunkSignature => S3ErrorSpec::new(S::FORBIDDEN, "SignatureDoesNotMatch", msg),
        BodyError::Sha256Mismatch => S3ErrorSpec::new(S::BAD_REQUEST, "XAmzContentSHA256Mismatch", msg),
        BodyError::ChecksumMismatch(_) => S3ErrorSpec::new(S::BAD_REQUEST, "BadDigest", msg),
        BodyError::FormTrailer => S3ErrorSpec::new(S::BAD_REQUEST, "MalformedPOSTRequest", msg),
        BodyError::Stalled => S3ErrorSpec::new(S::BAD_REQUEST, "RequestTimeout", msg),
        BodyError::TooLarge { .. } => S3ErrorSpec::new(S::BAD_REQUEST, "EntityTooLarge", msg),
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn responses_are_s3_xml() {
        let resp = GatewayError::Auth(AuthError::SignatureDoesNotMatch).into_response("/b/k", "req-1", false);
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        let text = String::from_utf8(body.to_vec()).expect("utf8");
        assert!(
            text.contains("<Code>SignatureDoesNotMatch</Code>") && text.contains("<RequestId>req-1</RequestId>"),
            "{text}"
        );

        let resp = GatewayError::Overloaded.into_response("/", "r", true);
        assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(resp.headers()[http::header::RETRY_AFTER], "1");
        assert!(resp.into_body().collect().await.expect("body").to_bytes().is_empty());
    }
}
