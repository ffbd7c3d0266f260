//! The request path, as phases: route → admit ([`admit`]) → authenticate → dispatch (passthrough:
//! prepare the body and forward; pushdown: [`pushdown`], to the owner or through the cache) →
//! respond. Errors of any phase become S3 XML in `crate::error`, and each request is logged once,
//! here.

pub(crate) mod admit;
mod alias;
mod outline;
pub(crate) mod owner;
mod passthrough;
mod post_object;
mod pushdown;
mod source;
mod streamed;
mod transparent;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use http::{HeaderValue, Method, Request, Response};
use time::OffsetDateTime;

use crate::backend::{Backend, forwarded_query};
use crate::body::{Body, Metered};
use crate::cache::TensorCache;
use crate::error::GatewayError;
use crate::metrics::Metrics;
use crate::pushdown::spec::{self as pushdown_spec, PushdownSpec};
use crate::pushdown::{Pushdown, PushdownError};
use crate::s3::credentials::LiveCredentials;
use crate::s3::headers::{HOP_BY_HOP, remove_all};
use crate::s3::route::{self, S3Op, Target};
use crate::s3::sigv4::verify::{self, Verified};

/// Largest body of a non-data operation (tagging, multi-delete, multipart completion, bucket
/// configuration) that the gateway reads whole to verify before forwarding. S3 caps these XML
/// documents well below this (a 1000-key DeleteObjects is about 100 KiB; a 10000-part completion
/// about 1 MiB).
pub(crate) const MAX_BUFFERED_BODY: u64 = 8 * 1024 * 1024;

/// Object bodies up to this size are verified whole before the store sees the request (one SDK
/// chunk; 1024 in flight hold at most 64 MiB); larger ones stream with their tail withheld.
pub(crate) const VERIFY_WHOLE_BELOW: u64 = 64 * 1024;

/// Who a request acts for: the tenant it is accounted to (the verified access key, or
/// `anonymous`) and the authority its store requests carry ([`crate::s3::authority::Authority`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caller<'a> {
    pub(crate) tenant: &'a str,
    pub(crate) authority: &'a crate::s3::authority::Authority,
}

/// What [`Gateway::forward`] resolved for a request it forwards as it is.
pub(super) struct Plain {
    pub(super) op: S3Op,
    /// The store's bucket and key (an alias bucket's target).
    pub(super) target: Target,
    /// The query the store gets (an alias listing's is bounded).
    pub(super) query: Option<String>,
    /// Whose rights the store request carries.
    pub(super) authority: crate::s3::authority::Authority,
    /// `split=auto` planned no pushdown: the answer is marked so.
    pub(super) planned_none: bool,
}

/// The front end's settings in force, replaced whole by a configuration reload (`crate::reload`).
pub(crate) type LiveFront = Arc<arc_swap::ArcSwap<FrontConfig>>;

/// Front-end settings the request path needs.
#[derive(Debug, Clone)]
pub(crate) struct FrontConfig {
    pub(crate) domains: Vec<String>,
    pub(crate) allow_anonymous: bool,
    pub(crate) max_body_bytes: u64,
    pub(crate) max_in_flight: usize,
    /// A request body frame that does not arrive within this ends the request (`RequestTimeout`).
    pub(crate) stall_timeout: Duration,
    /// A body-less request without a response head after this gets `503`.
    pub(crate) request_timeout: Duration,
    /// Alias buckets: reading `bucket/key` from one is a pushdown GET of `target/key`.
    pub(crate) aliases: HashMap<String, AliasBucket>,
    /// What each alias endpoint stands for, by [`AliasEndpoint`] (config order).
    pub(crate) endpoints: Vec<PushdownSpec>,
    /// Transparent identity mode: the store authenticates every request, forwarded as signed
    /// (`transparent.rs`; ADR 0013).
    pub(crate) transparent: bool,
}

/// A bucket name that stands for (real bucket, model, split, format, dtype), for loaders that
/// cannot add headers or query parameters. Read-only: object reads become pushdown GETs, listings
/// and bucket HEADs go to the real bucket, anything else is refused.
#[derive(Debug, Clone)]
pub(crate) struct AliasBucket {
    pub(crate) target: String,
    pub(crate) spec: PushdownSpec,
}

/// The alias endpoint a request arrived on (`[[pushdown.alias_endpoints]]`, by position): set
/// by its listener, before the request path sees the request (`crate::server`). Every object
/// read there is a pushdown of the same bucket and key, so it is signed as a plain read is (ADR
/// 0029); writes are refused as on an alias bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AliasEndpoint(pub(crate) usize);

/// One S3 listener's service: hands each request to [`Gateway::handle`], marked with the alias
/// endpoint it arrived on. A plain `hyper` service, not a router: every request of a listener has
/// the same handler, and a router's matching, extraction and response mapping cost about 5% of a
/// proxied GET's instructions (docs/adr/0033). Its future is not boxed: hyper keeps one slot per
/// connection for it, where a boxed one was a 7 KiB allocation (past glibc's thread cache) per
/// request.
pub(crate) fn s3_service(
    gateway: Arc<Gateway>,
    alias: Option<AliasEndpoint>,
) -> impl hyper::service::Service<
    Request<hyper::body::Incoming>,
    Response = Response<Body>,
    Error = std::convert::Infallible,
    Future: Send + 'static,
> + Clone
+ Send
+ 'static {
    hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
        let mut req = req.map(Body::new);
        if let Some(a) = alias {
            req.extensions_mut().insert(a);
        }
        let gateway = gateway.clone();
        async move {
            let mut response = gateway.handle(req).await;
            // A body of known length declares it, a HEAD's too (hyper leaves a HEAD's out).
            if !response.headers().contains_key(http::header::CONTENT_LENGTH)
                && let Some(n) = http_body::Body::size_hint(response.body()).exact()
            {
                response.headers_mut().insert(http::header::CONTENT_LENGTH, HeaderValue::from(n));
            }
            Ok::<_, std::convert::Infallible>(response)
        }
    })
}

/// Shared state of the S3 front end.
#[derive(Debug)]
pub struct Gateway {
    /// Replaced whole by a configuration reload (`crate::reload`), as `creds` is.
    cfg: LiveFront,
    creds: LiveCredentials,
    backend: Backend,
    metrics: Metrics,
    admission: Arc<admit::Admission>,
    request_ids: RequestIds,
    pushdown: Option<Arc<Pushdown>>,
    cache: Option<Arc<TensorCache>>,
    routing: Option<owner::Routing>,
    /// This gateway, for work that outlives the request that started it (an outlined output's
    /// row groups, streamed by a task of their own): set by [`Self::shared`].
    me: std::sync::Weak<Gateway>,
}

/// Request ids: a random per-process prefix and a counter. Unique across restarts and replicas
/// with overwhelming probability, and free of a random-number syscall per request.
#[derive(Debug)]
struct RequestIds {
    prefix: u64,
    next: std::sync::atomic::AtomicU64,
}

impl RequestIds {
    fn new() -> Self {
        Self { prefix: rand::random(), next: std::sync::atomic::AtomicU64::new(0) }
    }

    fn next(&self) -> RequestId {
        RequestId { prefix: self.prefix, n: self.next.fetch_add(1, Ordering::Relaxed) }
    }
}

/// One request's id, written out only where it is shown (an error body, a log line), not for
/// every request served.
#[derive(Debug, Clone, Copy)]
struct RequestId {
    prefix: u64,
    n: u64,
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016X}{:08X}", self.prefix, self.n)
    }
}

impl Gateway {
    #[must_use]
    pub(crate) fn new(
        cfg: LiveFront,
        creds: LiveCredentials,
        backend: Backend,
        metrics: Metrics,
        pushdown: Option<Arc<Pushdown>>,
        cache: Option<Arc<TensorCache>>,
    ) -> Self {
        let admission = Arc::new(admit::Admission::new(cfg.load().max_in_flight));
        Self {
            cfg,
            creds,
            backend,
            metrics,
            admission,
            request_ids: RequestIds::new(),
            pushdown,
            cache,
            routing: None,
            me: std::sync::Weak::new(),
        }
    }

    /// The gateway, shared, knowing itself ([`Self::me`]).
    #[must_use]
    pub(crate) fn shared(self) -> Arc<Self> {
        Arc::new_cyclic(|me| Self { me: me.clone(), ..self })
    }

    /// Makes this gateway a cluster member that routes pushdowns to their owners.
    #[must_use]
    pub(crate) fn with_routing(mut self, routing: owner::Routing) -> Self {
        self.routing = Some(routing);
        self
    }

    /// Marks the gateway as draining: new requests get `503`, `/readyz` reports not ready.
    pub fn begin_shutdown(&self) {
        self.admission.begin_shutdown();
    }

    /// Admission state (shared with the admin API's `/readyz`).
    #[must_use]
    pub(crate) fn admission(&self) -> &Arc<admit::Admission> {
        &self.admission
    }

    #[must_use]
    pub(crate) fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The tensor cache, when enabled.
    #[must_use]
    pub(crate) fn cache(&self) -> Option<&Arc<TensorCache>> {
        self.cache.as_ref()
    }

    /// The pushdown service, when enabled.
    #[must_use]
    pub fn pushdown(&self) -> Option<&Arc<Pushdown>> {
        self.pushdown.as_ref()
    }

    /// Handles one S3 request. Never fails: errors become S3 XML responses.
    pub(crate) async fn handle(self: Arc<Self>, req: Request<Body>) -> Response<Body> {
        let started = Instant::now();
        let request_id = self.request_ids.next();
        let head = req.method() == Method::HEAD;
        let in_flight = self.metrics.in_flight_guard();
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .or_else(|| req.uri().authority().map(http::uri::Authority::as_str));
        let method = req.method().clone();
        let routed = route::resolve(host, req.uri().path(), &self.cfg.load().domains).map(|t| {
            let op = route::classify(req.method(), &t, req.uri().query(), req.headers());
            (t, op)
        });
        let op = routed.as_ref().map_or(S3Op::Other, |(_, op)| *op);
        // What an error answer and a log line name, resolved again only for them, from the
        // request's URI and Host (shared with its head, not copied).
        let (uri, host) = (req.uri().clone(), req.headers().get(http::header::HOST).cloned());
        let named = || {
            let host = host.as_ref().and_then(|h| h.to_str().ok()).or_else(|| uri.authority().map(|a| a.as_str()));
            route::resolve(host, uri.path(), &self.cfg.load().domains).unwrap_or_default()
        };
        // The admitted request's place rides the response body (released with `in_flight`).
        let mut admitted = None;
        let result = match routed {
            Ok((t, op)) => match self.admission.admit(&self.metrics) {
                Ok(place) if self.finishes_detached(&req, &t, op) => {
                    // Run apart from this connection: if the client goes away, the computation
                    // still finishes into the cache (holding its place, within its deadline), so
                    // the client's retry is served from there instead of computed again.
                    let gateway = self.clone();
                    match tokio::spawn(async move { (gateway.dispatch(req, t, op).await, place) }).await {
                        Ok((result, place)) => {
                            admitted = Some(place);
                            result
                        }
                        Err(e) => Err(PushdownError::Internal(format!("the request's task ended: {e}")).into()),
                    }
                }
                Ok(place) => {
                    admitted = Some(place);
                    self.dispatch(req, t, op).await
                }
                Err(e) => Err(e),
            },
            Err(e) => Err(e.into()),
        };
        let (mut resp, identity, err) = match result {
            Ok((resp, identity)) => (resp, identity, None),
            Err(e) => {
                let msg = e.to_string();
                (e.into_response(&named().resource(), &request_id.to_string(), head), String::from("-"), Some(msg))
            }
        };
        let status = resp.status();
        self.metrics.observe_request(op, status, started.elapsed());
        if status.is_server_error() {
            let target = named();
            tracing::warn!(%request_id, op = op.name(), %method, bucket = target.bucket.as_deref().unwrap_or("-"), %identity, status = status.as_u16(), error = err.as_deref().unwrap_or("-"), "Request failed.");
        } else if tracing::enabled!(tracing::Level::DEBUG) {
            let target = named();
            tracing::debug!(%request_id, op = op.name(), %method, bucket = target.bucket.as_deref().unwrap_or("-"), %identity, status = status.as_u16(), elapsed_ms = started.elapsed().as_millis() as u64, "Request served.");
        }
        remove_all(resp.headers_mut(), HOP_BY_HOP);
        if self.admission.is_closing() {
            // A new process serves the sockets: the client's next request goes to it.
            resp.headers_mut().insert(http::header::CONNECTION, HeaderValue::from_static("close"));
        }
        let counter = self.metrics.response_bytes.clone();
        resp.map(|b| Body::new(Metered::new(b, counter, (in_flight, admitted))))
    }

    /// Whether a request may ask for a pushdown whose output the cache keeps (a GET or HEAD with
    /// pushdown fields, or of an alias bucket): told before it is authenticated, from its shape
    /// alone; a request that is not one after all is served the same way.
    fn finishes_detached(&self, req: &Request<Body>, target: &Target, op: S3Op) -> bool {
        self.cache.is_some()
            && matches!(op, S3Op::GetObject | S3Op::HeadObject)
            && (pushdown_spec::names_fields(req.headers(), req.uri().query())
                || req.extensions().get::<AliasEndpoint>().is_some()
                || target.bucket.as_ref().is_some_and(|b| self.cfg.load().aliases.contains_key(b)))
    }

    /// The alias a request reads through: its bucket's (`[[pushdown.aliases]]`), or the alias
    /// endpoint it arrived on, which stands for the request's own bucket. Checked here, for both
    /// identity modes: an alias already names the model and split (a request naming them too is
    /// refused), and only reads pass (`AliasReadOnly`).
    fn alias_of(
        &self,
        parts: &http::request::Parts,
        target: &Target,
        op: S3Op,
    ) -> Result<Option<AliasBucket>, GatewayError> {
        let cfg = self.cfg.load();
        let alias = match parts.extensions.get::<AliasEndpoint>() {
            Some(AliasEndpoint(i)) => {
                let spec = cfg.endpoints.get(*i).cloned().ok_or(GatewayError::AliasReadOnly)?;
                if op == S3Op::ListBuckets {
                    return Ok(None);
                }
                AliasBucket { target: target.bucket.clone().unwrap_or_default(), spec }
            }
            None => match target.bucket.as_ref().and_then(|b| cfg.aliases.get(b)) {
                Some(a) => a.clone(),
                None => return Ok(None),
            },
        };
        if pushdown_spec::names_fields(&parts.headers, parts.uri.query()) {
            return Err(PushdownError::InvalidArgument {
                field: "model".into(),
                message: "the alias already names the model and split".into(),
            }
            .into());
        }
        if !matches!(
            op,
            S3Op::GetObject
                | S3Op::HeadObject
                | S3Op::ListObjects
                | S3Op::ListObjectsV2
                | S3Op::HeadBucket
                | S3Op::GetBucketLocation
        ) {
            return Err(GatewayError::AliasReadOnly);
        }
        Ok(Some(alias))
    }

    /// Runs an admitted request under its deadline: a request with a body must keep it coming
    /// (each frame within `stall_timeout`); one without must be answered within `request_timeout`,
    /// except server-side copies, which a store may legitimately take longer over for a large
    /// object (the backend's own timeouts bound them).
    async fn dispatch(
        &self,
        req: Request<Body>,
        target: Target,
        op: S3Op,
    ) -> Result<(Response<Body>, String), GatewayError> {
        let has_body = req.headers().contains_key(http::header::TRANSFER_ENCODING)
            || req.headers().get(http::header::CONTENT_LENGTH).is_some_and(|v| v.as_bytes() != b"0");
        if has_body {
            let stall = self.cfg.load().stall_timeout;
            return self.forward(req.map(|b| Body::new(crate::edge::StallingBody::new(b, stall))), target, op).await;
        }
        if matches!(op, S3Op::CopyObject | S3Op::UploadPartCopy) {
            return self.forward(req, target, op).await;
        }
        let limit = self.cfg.load().request_timeout;
        match tokio::time::timeout(limit, self.forward(req, target, op)).await {
            Ok(r) => r,
            Err(_) => {
                self.metrics.request_timeouts.inc();
                Err(GatewayError::RequestTimeout { secs: limit.as_secs() })
            }
        }
    }

    /// Serves an admitted request by its identity mode. Heavy or rare phases (a pushdown, a
    /// browser form, an alias listing, a body's framing, the fs backend) are awaited boxed: an
    /// async function's future is as large as the largest future it awaits, so inline they made
    /// every plain request's future 24 KiB, allocated and copied on each request (ADR 0033).
    async fn forward(
        &self,
        req: Request<Body>,
        target: Target,
        op: S3Op,
    ) -> Result<(Response<Body>, String), GatewayError> {
        if self.cfg.load().transparent {
            return self.forward_as_sent(req, target, op).await;
        }
        if op == S3Op::PostObject {
            if req.extensions().get::<AliasEndpoint>().is_some()
                || target.bucket.as_ref().is_some_and(|b| self.cfg.load().aliases.contains_key(b))
            {
                return Err(GatewayError::AliasReadOnly);
            }
            // Authenticated by the form's signed policy, not by headers.
            return Box::pin(self.post_object(req, target)).await;
        }
        let (parts, body) = req.into_parts();
        let Verified { identity, authority, payload, .. } = verify::verify(
            &parts.method,
            &parts.uri,
            target.bucket.as_deref().filter(|_| target.virtual_host),
            &parts.headers,
            &self.creds.load(),
            self.cfg.load().allow_anonymous,
            OffsetDateTime::now_utc(),
        )?;
        let (identity, authority, via_peer) = match &self.routing {
            Some(r) => r.acting_identity(identity, authority, &parts.headers),
            None => (identity, authority, false),
        };
        let alias = self.alias_of(&parts, &target, op)?;
        let requested = pushdown_spec::parse(&parts.headers, parts.uri.query())?;
        let mut target = target;
        if let Some(alias) = &alias {
            target.bucket = Some(alias.target.clone());
        }
        let (job, planned_none) = match requested.or_else(|| alias.as_ref().map(|a| a.spec.clone())) {
            Some(spec) if matches!(op, S3Op::GetObject | S3Op::HeadObject) => {
                let job = Box::pin(self.prepare(spec, identity.name())).await?;
                let none = job.is_none();
                (job, none)
            }
            _ => (None, false),
        };
        if via_peer && job.is_none() {
            // Least privilege: the hop credential reaches the store only for a pushdown.
            return Err(GatewayError::PeerOnlyPushdown);
        }
        if let Some(job) = job {
            let resp = Box::pin(self.pushdown_phase(
                &parts,
                target,
                job,
                Caller { tenant: identity.name(), authority: &authority },
                via_peer,
            ))
            .await?;
            return Ok((resp, identity.name().to_owned()));
        }
        // An alias listing's entries each may cost a pushdown: its pages are bounded.
        let listing = alias.filter(|_| matches!(op, S3Op::ListObjects | S3Op::ListObjectsV2));
        let query = match &listing {
            Some(_) => Some(Self::alias_listing_query(parts.uri.query())),
            None => forwarded_query(parts.uri.query()),
        };
        let plain = Plain { op, target, query, authority: authority.clone(), planned_none };
        let mut resp = self.passthrough(parts, body, payload, plain).await?;
        if let Some(alias) = &listing {
            resp = Box::pin(self.alias_listing(resp, alias, Caller { tenant: identity.name(), authority: &authority }))
                .await?;
        }
        Ok((resp, identity.name().to_owned()))
    }
}
