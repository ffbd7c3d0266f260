//! The `s3` backend: forwards to an S3-compatible endpoint over HTTP/1.1 (plain or TLS), re-signing every request
//! with the backend's own credentials (`crate::s3::sigv4::sign`), streaming bodies both ways.
//!
//! Concurrency toward the backend is bounded by a semaphore whose permit lives until the response
//! body is finished, not just until headers arrive (a slow download still holds its slot).

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, Uri};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::request::{BackendError, ForwardPayload, ForwardRequest, path_style_path};
use super::retry::RetryPolicy;
use crate::body::{Body, Metered};
use crate::metrics::{Outcome, UpstreamMetrics};
use crate::s3::authority::Authority;
use crate::s3::credentials::SecretKey;
use crate::s3::sigv4::EMPTY_SHA256;

/// Settings of the `s3` backend.
#[derive(Debug, Clone)]
pub(crate) struct S3BackendConfig {
    /// `http://host:port[/prefix]`.
    pub(crate) endpoint: Uri,
    pub(crate) region: String,
    /// The store's key, which signs requests the gateway authenticated (terminating mode) unless
    /// their client credential has its own. `None` in transparent mode without one, or when every
    /// client credential has its own store key.
    pub(crate) key: Option<(String, SecretKey)>,
    /// Per client access key, the store key its requests are signed with (`[[credentials]]`
    /// `store_access_key`): tenants stay distinct at the store.
    pub(crate) tenant_keys: std::collections::HashMap<String, (String, SecretKey)>,
    pub(crate) connect_timeout: Duration,
    /// Time to response headers for body-less requests. Requests with a body have none: the
    /// backend answers only after the whole upload, which may legitimately take minutes.
    pub(crate) response_timeout: Duration,
    pub(crate) max_concurrency: usize,
    /// Longest wait for one of the `max_concurrency` slots before `503 SlowDown`.
    pub(crate) permit_timeout: Duration,
    pub(crate) retry: RetryPolicy,
    /// Extra PEM CA certificates trusted for an `https` endpoint (besides the system store).
    pub(crate) ca_file: Option<std::path::PathBuf>,
    /// The store decodes `STREAMING-UNSIGNED-PAYLOAD-TRAILER` bodies and checks their trailing
    /// checksum (SeaweedFS, MinIO, AWS; not Ceph RGW 16 or Swift 2.30). See ADR 0007.
    pub(crate) trailing_checksums: bool,
    /// The store checks a signed payload's `x-amz-content-sha256` itself (Ceph RGW, Swift's
    /// s3api, MinIO, AWS; not SeaweedFS): in transparent identity mode the gateway then streams
    /// such bodies without hashing them. See ADR 0013.
    pub(crate) checks_payload_hash: bool,
}

/// Forwarding client for an S3-compatible endpoint.
#[derive(Debug, Clone)]
pub(crate) struct S3Backend {
    cfg: Arc<S3BackendConfig>,
    /// The endpoint's `Host` header, made once.
    host: HeaderValue,
    client: Client<HttpsConnector<HttpConnector>, Body>,
    limit: Arc<Semaphore>,
    metrics: UpstreamMetrics,
}

impl S3Backend {
    /// Builds the client: HTTP/1.1 over plain TCP or TLS (system roots plus `ca_file`).
    ///
    /// # Errors
    /// An unreadable or invalid `ca_file`, or no usable TLS configuration.
    pub(crate) fn new(cfg: S3BackendConfig, metrics: UpstreamMetrics) -> Result<Self, TlsSetupError> {
        let client = http_client(cfg.connect_timeout, cfg.ca_file.as_deref())?;
        let limit = Arc::new(Semaphore::new(cfg.max_concurrency));
        // An authority that parsed as part of a URI is visible ASCII: always a header value.
        let host = cfg.endpoint.authority().and_then(|a| HeaderValue::from_str(a.as_str()).ok());
        let host = host.unwrap_or_else(|| HeaderValue::from_static(""));
        Ok(Self { cfg: Arc::new(cfg), host, client, limit, metrics })
    }

    #[must_use]
    pub(crate) fn has_tenant_keys(&self) -> bool {
        !self.cfg.tenant_keys.is_empty()
    }

    #[must_use]
    pub(crate) fn trailing_checksums(&self) -> bool {
        self.cfg.trailing_checksums
    }

    #[must_use]
    pub(crate) fn has_store_key(&self) -> bool {
        self.cfg.key.is_some()
    }

    #[must_use]
    pub(crate) fn checks_payload_hash(&self) -> bool {
        self.cfg.checks_payload_hash
    }

    /// The store's URI for a request: the endpoint's scheme and authority (the endpoint has no
    /// path: config), then the request target as the client signed it (transparent mode) or the
    /// target's path-style path and query. Assembled from parts, not formatted and parsed again.
    fn uri(&self, req: &ForwardRequest) -> Result<Uri, BackendError> {
        let path_and_query = match &req.authority {
            Authority::Caller(sent) => sent.path_and_query().clone(),
            _ => {
                let mut pq = path_style_path(&req.target);
                if let Some(q) = req.query.as_deref().filter(|q| !q.is_empty()) {
                    pq.push('?');
                    pq.push_str(q);
                }
                PathAndQuery::from_maybe_shared(bytes::Bytes::from(pq)).map_err(|e| BackendError::Internal(e.into()))?
            }
        };
        let mut parts = http::uri::Parts::default();
        parts.scheme = self.cfg.endpoint.scheme().cloned();
        parts.authority = self.cfg.endpoint.authority().cloned();
        parts.path_and_query = Some(path_and_query);
        Uri::from_parts(parts).map_err(|e| BackendError::Internal(e.into()))
    }

    /// The request as sent: `headers` are the forwarded ones (moved in; a request that may be
    /// retried passes a copy).
    fn build(
        &self,
        req: &ForwardRequest,
        uri: Uri,
        headers: HeaderMap,
        body: Body,
    ) -> Result<Request<Body>, BackendError> {
        let mut out = Request::builder()
            .method(req.method.clone())
            .uri(uri)
            .body(body)
            .map_err(|e| BackendError::Internal(e.into()))?;
        *out.headers_mut() = headers;
        let caller = matches!(req.authority, Authority::Caller(_));
        if !caller || !out.headers().contains_key(http::header::HOST) {
            // A caller's own signature covers the Host it sent, so that one is kept (ADR 0013).
            out.headers_mut().insert(http::header::HOST, self.host.clone());
        }
        if req.payload == ForwardPayload::Empty && req.method != http::Method::GET && req.method != http::Method::HEAD {
            out.headers_mut().insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        }
        if req.expect_continue {
            out.headers_mut().insert(http::header::EXPECT, HeaderValue::from_static("100-continue"));
        }
        match &req.authority {
            // The caller's request as signed: the store authenticates it.
            Authority::Caller(_) => {}
            // The store sees the request as the client sent it: unsigned (only the framing of a
            // passed-through aws-chunked body must still be named).
            Authority::Anonymous => {
                if req.payload == ForwardPayload::UnsignedTrailer {
                    out.headers_mut().insert(
                        crate::s3::headers::X_AMZ_CONTENT_SHA256,
                        HeaderValue::from_static("STREAMING-UNSIGNED-PAYLOAD-TRAILER"),
                    );
                }
            }
            Authority::Gateway(proof) => {
                let key = self.cfg.tenant_keys.get(proof.access_key()).or(self.cfg.key.as_ref());
                sign_request(&mut out, &req.payload, key.ok_or(BackendError::NoStoreKey)?, &self.cfg.region)?;
            }
        }
        Ok(out)
    }

    /// Forwards one request; retries body-less idempotent ones on transport failures and 5xx.
    pub(crate) async fn send(&self, mut req: ForwardRequest) -> Result<Response<Body>, BackendError> {
        // Waiting for a slot is bounded: past the deadline the client hears `503 SlowDown` at once
        // instead of joining an ever longer queue. A free slot is taken without arming the timer
        // (tokio hands released slots to queued waiters first, so this never overtakes one).
        let permit: OwnedSemaphorePermit = match self.limit.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => match tokio::time::timeout(self.cfg.permit_timeout, self.limit.clone().acquire_owned()).await {
                Ok(p) => p.map_err(|e| BackendError::Internal(e.into()))?,
                Err(_) => {
                    return Err(BackendError::Busy {
                        ms: u64::try_from(self.cfg.permit_timeout.as_millis()).unwrap_or(u64::MAX),
                    });
                }
            },
        };
        let uri = self.uri(&req)?;
        let replayable = req.payload == ForwardPayload::Empty && req.op.is_idempotent();
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            let mut body = std::mem::replace(&mut req.body, Body::empty());
            // Only a request that expects `100 Continue` has a body to hold back.
            let gate = req.expect_continue.then(|| Arc::new(tokio::sync::watch::channel(Continue::Waiting).0));
            if let Some(gate) = &gate
                && req.payload != ForwardPayload::Empty
            {
                body = after_continue(body, gate.subscribe());
            }
            // Only a request that may be retried keeps its headers for the next attempt.
            let headers = if replayable { req.headers.clone() } else { std::mem::take(&mut req.headers) };
            let mut outgoing = self.build(&req, uri.clone(), headers, body)?;
            if let Some(gate) = gate.clone() {
                hyper::ext::on_informational(&mut outgoing, move |res| {
                    if res.status() == StatusCode::CONTINUE {
                        gate.send_if_modified(|s| std::mem::replace(s, Continue::Send) == Continue::Waiting);
                    }
                });
            }
            let t0 = Instant::now();
            let result = if req.payload == ForwardPayload::Empty {
                match tokio::time::timeout(self.cfg.response_timeout, self.client.request(outgoing)).await {
                    Ok(r) => r.map_err(classify),
                    Err(_) => Err(BackendError::Timeout { secs: self.cfg.response_timeout.as_secs() }),
                }
            } else {
                self.client.request(outgoing).await.map_err(classify)
            };
            // A final answer before `100 Continue`: the body must never follow on this connection
            // (the store would read it as the next request), so a body still waiting fails and the
            // connection is closed instead of pooled.
            if let Some(gate) = &gate {
                gate.send_if_modified(|s| {
                    let waiting = *s == Continue::Waiting;
                    if waiting {
                        *s = Continue::Answered;
                    }
                    waiting
                });
            }
            let outcome = match &result {
                Ok(r) => Outcome::of(r.status()),
                Err(_) => Outcome::Error,
            };
            self.metrics.observe(req.op, outcome, t0.elapsed());
            let retryable = match &result {
                Ok(r) => matches!(
                    r.status(),
                    StatusCode::INTERNAL_SERVER_ERROR
                        | StatusCode::BAD_GATEWAY
                        | StatusCode::SERVICE_UNAVAILABLE
                        | StatusCode::GATEWAY_TIMEOUT
                ),
                Err(BackendError::Unreachable { .. } | BackendError::Timeout { .. }) => true,
                Err(_) => false,
            };
            attempt += 1;
            if replayable
                && retryable
                && let Some(wait) = self.cfg.retry.backoff(attempt, started)
            {
                self.metrics.retries.inc();
                tracing::debug!(op = req.op.name(), attempt, ?wait, "Retrying backend request.");
                tokio::time::sleep(wait).await;
                continue;
            }
            let resp = result?;
            let counter = self.metrics.bytes_received.clone();
            let refuse = RefuseWhenAnswered(gate);
            return Ok(resp.map(|b| Body::new(Metered::new(b, counter, (permit, refuse)))));
        }
    }
}

/// Signs `req` (SigV4, `x-amz-content-sha256` set from `payload`) with `key` for `region`
/// (`crate::s3::sigv4::sign`).
///
/// # Errors
/// A header that is not visible ASCII.
pub(crate) fn sign_request(
    req: &mut Request<Body>,
    payload: &ForwardPayload,
    (access_key, secret): &(String, SecretKey),
    region: &str,
) -> Result<(), BackendError> {
    let payload_hash = match payload {
        ForwardPayload::Empty => EMPTY_SHA256,
        ForwardPayload::Sha256(hex) => hex,
        ForwardPayload::Unsigned => "UNSIGNED-PAYLOAD",
        ForwardPayload::UnsignedTrailer => "STREAMING-UNSIGNED-PAYLOAD-TRAILER",
    };
    let (method, uri) = (req.method().clone(), req.uri().clone());
    crate::s3::sigv4::sign::sign(
        &method,
        &uri,
        req.headers_mut(),
        payload_hash,
        (access_key, secret),
        region,
        time::OffsetDateTime::now_utc(),
    )
    .map_err(|e| BackendError::UnsignableHeader(e.0))
}

/// An HTTP/1.1 client over plain TCP or TLS (the system's roots plus `ca_file`), as every
/// request to the store is sent.
///
/// # Errors
/// An unreadable or invalid `ca_file`, or no usable TLS configuration.
pub(crate) fn http_client(
    connect_timeout: Duration,
    ca_file: Option<&std::path::Path>,
) -> Result<Client<HttpsConnector<HttpConnector>, Body>, TlsSetupError> {
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_nodelay(true);
    connector.enforce_http(false);
    let tls = tls_config(ca_file)?;
    let connector =
        HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http().enable_http1().wrap_connector(connector);
    Ok(Client::builder(TokioExecutor::new()).pool_idle_timeout(Duration::from_secs(30)).build(connector))
}

/// How long a body waits for the store's `100 Continue` before it is sent anyway (curl's default;
/// RFC 9110 lets a client proceed when the interim response does not come).
pub(crate) const EXPECT_CONTINUE_WAIT: Duration = Duration::from_secs(1);

/// Where an `Expect: 100-continue` body stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Continue {
    /// Neither `100 Continue` nor a final answer yet.
    Waiting,
    /// The store said `100 Continue`: send.
    Send,
    /// The store answered first: the body waits (never sent) while the answer streams back.
    Answered,
    /// The answer is delivered: the body fails, so the connection is dropped, not reused.
    Refused,
}

/// Held by the response body of an `Expect: 100-continue` request: once the answer is delivered
/// (or dropped), a body that was never invited is refused, closing that connection. `None` for a
/// request without `Expect: 100-continue`.
#[derive(Debug)]
struct RefuseWhenAnswered(Option<Arc<tokio::sync::watch::Sender<Continue>>>);

impl Drop for RefuseWhenAnswered {
    fn drop(&mut self) {
        let Some(gate) = &self.0 else { return };
        gate.send_if_modified(|s| {
            let answered = *s == Continue::Answered;
            if answered {
                *s = Continue::Refused;
            }
            answered
        });
    }
}

/// `body`, starting only once the store answered `100 Continue` or after [`EXPECT_CONTINUE_WAIT`]
/// without any answer; if the store gave its final answer first, the body fails at once and is
/// never sent, so no byte of it can be read by the store as the start of another request.
fn after_continue(body: Body, mut gate: tokio::sync::watch::Receiver<Continue>) -> Body {
    use futures_util::StreamExt;
    let wait = futures_util::stream::once(async move {
        // Without any answer after the wait, send (RFC 9110); once answered, wait for the verdict.
        if tokio::time::timeout(EXPECT_CONTINUE_WAIT, gate.wait_for(|s| *s != Continue::Waiting)).await.is_err() {
            return Ok(bytes::Bytes::new());
        }
        match gate.wait_for(|s| matches!(s, Continue::Send | Continue::Refused)).await.map(|s| *s) {
            Ok(Continue::Send) => Ok(bytes::Bytes::new()),
            _ => Err(crate::body::BodyError::Incomplete),
        }
    });
    Body::from_stream(
        wait.chain(body.into_data_stream().map(|r| r.map_err(|e| crate::body::BodyError::read(e.into())))),
    )
}

/// Why TLS for the backend could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TlsSetupError {
    #[error("cannot read CA file {path}: {message}")]
    CaFile { path: String, message: String },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

fn tls_config(ca_file: Option<&std::path::Path>) -> Result<rustls::ClientConfig, TlsSetupError> {
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    // The system store; certificates it cannot parse are skipped (as curl does).
    for cert in rustls_native_certs::load_native_certs().certs {
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let err = |message: String| TlsSetupError::CaFile { path: path.display().to_string(), message };
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| err(e.to_string()))?
            .collect::<Result<_, _>>()
            .map_err(|e| err(e.to_string()))?;
        if certs.is_empty() {
            return Err(err("no certificates found".into()));
        }
        for c in certs {
            roots.add(c).map_err(|e| err(e.to_string()))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

fn classify(e: hyper_util::client::legacy::Error) -> BackendError {
    if e.is_connect() {
        BackendError::Unreachable { source: e.into() }
    } else {
        BackendError::SendBody { source: e.into() }
    }
}
