//! Backends: where verified requests go. `s3` forwards to any S3-compatible endpoint, re-signed with
//! the backend's own credentials; `fs` serves a local directory in-process.
//!
//! A backend returns the backend's HTTP response unchanged (status, headers, streaming body): S3
//! errors such as `NoSuchKey` are responses, not [`BackendError`]s, and reach the client as sent.

pub mod fs;
pub(crate) mod request;
pub(crate) mod retry;
pub(crate) mod s3;

use http::Response;

pub(crate) use self::request::{BackendError, ForwardPayload, ForwardRequest, forwarded_headers, forwarded_query};
use crate::body::Body;

/// The configured backend.
#[derive(Debug, Clone)]
pub(crate) enum Backend {
    S3(Box<s3::S3Backend>),
    Fs(fs::FsBackend),
}

impl Backend {
    /// Sends a request and returns the backend's response.
    ///
    /// # Errors
    /// When no response could be obtained (see [`BackendError`]).
    pub(crate) async fn send(&self, req: ForwardRequest) -> Result<Response<Body>, BackendError> {
        match self {
            Self::S3(b) => b.send(req).await,
            // Boxed: the fs backend's future is kilobytes, and every store request's would be.
            Self::Fs(b) => Box::pin(b.send(req)).await,
        }
    }

    /// Whether raw `aws-chunked` unsigned-trailer bodies can be passed through (the store decodes
    /// them and checks the trailing checksum: `backend.trailing_checksums`); otherwise the gateway
    /// decodes them and checks the checksum itself (ADR 0007).
    #[must_use]
    pub(crate) fn passes_trailing_checksums(&self) -> bool {
        match self {
            Self::S3(b) => b.trailing_checksums(),
            Self::Fs(_) => false,
        }
    }

    /// Whether the store checks a signed payload hash itself (`backend.checks_payload_hash`).
    #[must_use]
    pub(crate) fn checks_payload_hash(&self) -> bool {
        match self {
            Self::S3(b) => b.checks_payload_hash(),
            Self::Fs(_) => false,
        }
    }

    /// Whether client credentials have store keys of their own (`[[credentials]]`
    /// `store_access_key`): the store then tells callers apart, so it is asked for each one.
    #[must_use]
    pub(crate) fn has_tenant_keys(&self) -> bool {
        match self {
            Self::S3(b) => b.has_tenant_keys(),
            Self::Fs(_) => false,
        }
    }

    /// Whether the gateway holds a store key of its own (`backend.access_key`).
    #[must_use]
    pub(crate) fn has_store_key(&self) -> bool {
        match self {
            Self::S3(b) => b.has_store_key(),
            Self::Fs(_) => false,
        }
    }

    /// Short name for logs.
    #[must_use]
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Self::S3(_) => "s3",
            Self::Fs(_) => "fs",
        }
    }
}
