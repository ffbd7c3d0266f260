//! The route phase of a pushdown in a cluster (`crate::cluster`): a member that does not own the
//! object forwards the pushdown to its owner over an authenticated gateway-to-gateway hop, so that
//! every route meets the owner's cache; when the owner cannot answer, it computes locally. Never a
//! redirect: S3 clients that re-sign break on 307s.
//!
//! The hop is an S3 GET (or HEAD) signed with SigV4 by the cluster credential
//! (`cluster.access_key` / `cluster.secret_key`), which every member accepts. It carries the
//! resolved pushdown (`split=auto` already resolved here, so the owner computes exactly what this
//! member would) as `x-tensorgate-*` headers and the client's tenant as `tensorgate-peer-tenant`
//! (signed like every header): the owner accounts memory and fairness to that tenant and never
//! forwards a hop again. Every pushdown response in a cluster says who computed it
//! (`x-tensorgate-computed-by`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Response};

use crate::backend::retry::RetryPolicy;
use crate::backend::s3::{S3Backend, S3BackendConfig};
use crate::backend::{ForwardPayload, ForwardRequest, forwarded_headers, forwarded_query};
use crate::cluster::{Cluster, Member};
use crate::metrics::Metrics;
use crate::pushdown::spec::{
    HEADER_PREFIX, PushdownSpec, names_fields, remove_trigger_headers, without_trigger_params,
};
use crate::s3::authority::{Authenticated, Authority};
use crate::s3::credentials::SecretKey;
use crate::s3::headers::{HOP_BY_HOP, remove_all};
use crate::s3::route::S3Op;
use crate::s3::route::Target;
use crate::s3::sigv4::verify::Identity;

/// The header a hop names its tenant in (outside `x-tensorgate-*`, which are pushdown fields).
pub(crate) const PEER_TENANT: HeaderName = HeaderName::from_static("tensorgate-peer-tenant");
/// Transparent mode: the member a caller's request was forwarded from (unsigned; a client that
/// sets it only makes the member it asked compute).
pub(crate) const HOP: HeaderName = HeaderName::from_static("tensorgate-hop");
/// Transparent mode: the split the forwarding member resolved `split=auto` to (unsigned; a client
/// that sets it only chooses a split it could have asked for).
pub(crate) const HOP_SPLIT: HeaderName = HeaderName::from_static("tensorgate-hop-split");
/// Who computed a pushdown response (a member id).
pub(crate) const COMPUTED_BY: HeaderName = HeaderName::from_static("x-tensorgate-computed-by");
/// A peer that accepts no connection within this is treated as down for the request (the
/// membership refresh takes it out of the order within `cluster.refresh_secs`).
const PEER_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Hops in flight to one peer at once (beyond that, this member computes locally).
const PEER_MAX_CONCURRENCY: usize = 256;

/// Routes pushdowns to their owners.
#[derive(Debug)]
pub(crate) struct Routing {
    cluster: Arc<Cluster>,
    region: String,
    access_key: String,
    secret: Option<SecretKey>,
    /// Longest wait for the owner's response head (the member's own request deadline).
    response_timeout: Duration,
    peers: Mutex<HashMap<String, S3Backend>>,
    metrics: Metrics,
}

impl Routing {
    /// `secret: None`: membership only (no hop; every member computes what it is asked).
    #[must_use]
    pub(crate) fn new(
        cluster: Arc<Cluster>,
        region: String,
        (access_key, secret): (String, Option<SecretKey>),
        response_timeout: Duration,
        metrics: Metrics,
    ) -> Self {
        Self { cluster, region, access_key, secret, response_timeout, peers: Mutex::new(HashMap::new()), metrics }
    }

    #[must_use]
    pub(crate) fn node_id(&self) -> &str {
        self.cluster.node_id()
    }

    /// The identity (and store authority) a request acts for: a hop signed by the cluster
    /// credential acts for the tenant it names; any other request for whoever signed it (a
    /// client's `tensorgate-peer-*` headers mean nothing).
    #[must_use]
    pub(crate) fn acting_identity(
        &self,
        identity: Identity,
        authority: Authority,
        headers: &HeaderMap,
    ) -> (Identity, Authority, bool) {
        let peer = self.secret.is_some() && matches!(&identity, Identity::AccessKey(k) if *k == self.access_key);
        let Authority::Gateway(proof) = authority.clone() else {
            return (identity, authority, false);
        };
        if !peer {
            return (identity, authority, false);
        }
        match headers.get(&PEER_TENANT).and_then(|v| v.to_str().ok()) {
            Some("anonymous") => (Identity::Anonymous, Authority::Anonymous, true),
            Some(t) if !t.is_empty() => {
                (Identity::AccessKey(t.to_owned()), Authority::Gateway(proof.acting_for(t)), true)
            }
            _ => (identity, authority, true),
        }
    }

    /// The route phase of a pushdown: to the object's owner when that is another member, the
    /// way the request's authority allows ([`Self::forward`] for a caller the gateway
    /// authenticated, [`Self::forward_as_sent`] in transparent mode). `None`: serve it here.
    pub(crate) async fn route(
        &self,
        parts: &Parts,
        target: &Target,
        spec: &PushdownSpec,
        tenant: &str,
        authority: &Authority,
    ) -> Option<Response<Body>> {
        match authority {
            Authority::Caller(_) => self.forward_as_sent(parts, target, spec).await,
            Authority::Gateway(proof) => self.forward(parts, target, spec, tenant, proof).await,
            // An anonymous pushdown is computed where it arrives: the hop credential never
            // acts for a request nobody authenticated.
            Authority::Anonymous => None,
        }
    }

    /// Forwards a pushdown this member does not own to its owner. `None`: serve it here (this
    /// member owns it, there is no hop credential, or the owner did not answer: then the fallback
    /// is counted and logged).
    async fn forward(
        &self,
        parts: &Parts,
        target: &Target,
        spec: &PushdownSpec,
        tenant: &str,
        proof: &Authenticated,
    ) -> Option<Response<Body>> {
        self.secret.as_ref()?;
        let (owner, peer) = self.owner_elsewhere(target)?;
        let req = ForwardRequest {
            op: if parts.method == Method::HEAD { S3Op::HeadObject } else { S3Op::GetObject },
            method: parts.method.clone(),
            target: Target { bucket: target.bucket.clone(), key: target.key.clone(), virtual_host: false },
            query: forwarded_query(parts.uri.query()).and_then(|q| without_trigger_params(&q)),
            headers: hop_headers(&parts.headers, spec, tenant),
            body: Body::empty(),
            payload: ForwardPayload::Empty,
            // The hop is signed by the cluster credential only for a caller the gateway
            // authenticated (the type says so).
            authority: Authority::Gateway(proof.clone()),
            expect_continue: false,
        };
        self.relay(&owner, &peer, req).await
    }

    /// Transparent identity mode: the caller's own signed request goes to the owner unchanged
    /// (no credential that could read every object travels between members), marked as a hop
    /// ([`HOP`], unsigned) so the owner serves it instead of routing it again, with the split
    /// `split=auto` resolved to here ([`HOP_SPLIT`]). The owner reads the source with the
    /// caller's request, so the store decides there as it would here. `None`: serve it here.
    async fn forward_as_sent(&self, parts: &Parts, target: &Target, spec: &PushdownSpec) -> Option<Response<Body>> {
        let (owner, peer) = self.owner_elsewhere(target)?;
        let mut headers = parts.headers.clone();
        remove_all(&mut headers, HOP_BY_HOP);
        if !names_fields(&parts.headers, parts.uri.query()) {
            // Read through an alias endpoint: the fields travel as unsigned headers beside the
            // caller's signature, as the hop marks do (the owner's S3 port is not that endpoint).
            insert_fields(&mut headers, spec);
        }
        headers.insert(HOP, HeaderValue::from_str(self.node_id()).ok()?);
        headers.insert(HOP_SPLIT, HeaderValue::from_str(&spec.split).ok()?);
        let req = ForwardRequest {
            op: if parts.method == Method::HEAD { S3Op::HeadObject } else { S3Op::GetObject },
            method: parts.method.clone(),
            target: target.clone(),
            query: None,
            headers,
            body: Body::empty(),
            payload: ForwardPayload::Empty,
            authority: Authority::caller(parts),
            expect_continue: false,
        };
        self.relay(&owner, &peer, req).await
    }

    /// The object's owner and a client for it, when that is another member.
    fn owner_elsewhere(&self, target: &Target) -> Option<(Member, S3Backend)> {
        let (bucket, key) = (target.bucket.as_deref()?, target.key.as_deref()?);
        let owner = self.cluster.owner(bucket, key)?;
        if owner.id == self.node_id() {
            return None;
        }
        let peer = self.peer(&owner)?;
        Some((owner, peer))
    }

    /// Sends a hop and relays the owner's answer; `None` (serve here) when the owner failed.
    async fn relay(&self, owner: &Member, peer: &S3Backend, req: ForwardRequest) -> Option<Response<Body>> {
        let label = crate::metrics::PeerLabel { peer: owner.id.clone() };
        match peer.send(req).await {
            Ok(mut resp) if !resp.status().is_server_error() => {
                self.metrics.cluster_forwarded.get_or_create(&label).inc();
                if !resp.headers().contains_key(&COMPUTED_BY)
                    && let Ok(v) = HeaderValue::from_str(&owner.id)
                {
                    resp.headers_mut().insert(COMPUTED_BY, v);
                }
                Some(resp)
            }
            Ok(resp) => {
                self.metrics.cluster_fallbacks.get_or_create(&label).inc();
                tracing::warn!(owner = %owner.id, status = %resp.status(), "cluster: the owner failed; computing here");
                None
            }
            Err(e) => {
                self.metrics.cluster_fallbacks.get_or_create(&label).inc();
                tracing::warn!(owner = %owner.id, error = %e, "cluster: the owner did not answer; computing here");
                None
            }
        }
    }

    fn peer(&self, owner: &Member) -> Option<S3Backend> {
        let mut peers = self.peers.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(p) = peers.get(&owner.s3) {
            return Some(p.clone());
        }
        let cfg = S3BackendConfig {
            endpoint: owner.s3.parse().ok()?,
            region: self.region.clone(),
            // Without a hop secret, only callers' own requests travel (transparent mode).
            key: self.secret.clone().map(|s| (self.access_key.clone(), s)),
            tenant_keys: std::collections::HashMap::new(),
            connect_timeout: PEER_CONNECT_TIMEOUT,
            response_timeout: self.response_timeout,
            max_concurrency: PEER_MAX_CONCURRENCY,
            permit_timeout: Duration::ZERO,
            // A failed hop falls back to computing here at once: no retry, no backoff.
            retry: RetryPolicy { max_retries: 0, base: Duration::ZERO, cap: Duration::ZERO, budget: Duration::ZERO },
            ca_file: None,
            trailing_checksums: false,
            checks_payload_hash: false,
        };
        let backend = S3Backend::new(cfg, self.metrics.cluster_hops.clone()).ok()?;
        peers.insert(owner.s3.clone(), backend.clone());
        Some(backend)
    }
}

/// The client's conditional and range headers, the resolved pushdown fields, and the tenant.
fn hop_headers(client: &HeaderMap, spec: &PushdownSpec, tenant: &str) -> HeaderMap {
    let mut h = forwarded_headers(client);
    remove_trigger_headers(&mut h);
    h.remove(&PEER_TENANT);
    insert_fields(&mut h, spec);
    if let Ok(v) = HeaderValue::from_str(tenant) {
        h.insert(PEER_TENANT, v);
    }
    h
}

/// The pushdown fields of `spec` as trigger headers.
fn insert_fields(h: &mut HeaderMap, spec: &PushdownSpec) {
    for (k, v) in spec.fields() {
        if let (Ok(name), Ok(value)) = (format!("{HEADER_PREFIX}{k}").parse::<HeaderName>(), HeaderValue::from_str(&v))
        {
            h.insert(name, value);
        }
    }
}
