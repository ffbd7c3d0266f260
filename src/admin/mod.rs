//! The admin port: `/metrics` (Prometheus text), `/healthz` (the process is alive), `/readyz`
//! (accepting requests: not draining), and the pushdown control API for compute-tier clients:
//! `/v1/memory`, `/v1/models`, `/v1/models/{model}/suffix`, `/v1/models/{model}/tokenizer`,
//! `/v1/storage`, `/v1/plan` (JSON), `POST /v1/models/refresh` and `POST /v1/config/reload`
//! ([`crate::reload`]).
//!
//! Metrics, health, the model list, storage terms, memory and the cluster need no credential (bind
//! the port where operators, Prometheus and the training cluster reach it; it never serves object
//! data). What gives a model or a tenant's choices away, a model's graph (`suffix`), its tokenizer
//! and a tenant's plan (`GET /v1/plan`), is served only with a proof of a client's access key in
//! the [`PROOF_HEADER`] (unless `admin_open_reads`); a change needs the proof too ([`proof`]),
//! and a tenant changes and reads only its own plan.

pub(crate) mod proof;

use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;

use crate::cache::TensorCache;
use crate::metrics::Metrics;
use crate::proxy::admit::Admission;
use crate::pushdown::Pushdown;
use crate::pushdown::spec::Dtype;

/// What the admin API reports on and controls.
#[derive(Debug, Clone)]
pub(crate) struct AdminState {
    /// Whether the S3 side is draining (`/readyz`).
    pub(crate) admission: Arc<Admission>,
    pub(crate) pushdown: Option<Arc<Pushdown>>,
    pub(crate) cache: Option<Arc<TensorCache>>,
    /// The cluster this gateway is a member of (`[cluster]`).
    pub(crate) cluster: Option<Arc<crate::cluster::Cluster>>,
    pub(crate) metrics: Metrics,
    /// Checks who asks for a change (`POST /v1/plan`) or a guarded read.
    pub(crate) prover: Arc<proof::Prover>,
    /// Serve graphs, tokenizers and plans without a proof (`admin_open_reads`).
    pub(crate) open_reads: bool,
    /// Reads the configuration again (`POST /v1/config/reload`).
    pub(crate) reloader: Arc<crate::reload::Reloader>,
}

/// Header of a guarded read carrying its proof: a presigned `GET /` URL ([`proof`]).
pub(crate) const PROOF_HEADER: &str = "x-tensorgate-proof";

impl AdminState {
    /// The access key a change's proof proves (always required, whatever `admin_open_reads`).
    async fn prove_change(&self, headers: &HeaderMap) -> Result<String, proof::ProofError> {
        match headers.get(PROOF_HEADER).map(|v| v.to_str()) {
            None => Err(proof::ProofError::Missing),
            Some(Err(_)) => Err(proof::ProofError::Malformed("not text")),
            Some(Ok(p)) => self.prover.prove(p).await,
        }
    }

    /// The access key a guarded read's proof proves; `None` when reads are open and no proof came.
    async fn prove_read(&self, headers: &HeaderMap) -> Result<Option<String>, Reply> {
        let given = headers.get(PROOF_HEADER).map(|v| v.to_str().map_err(|_| proof::ProofError::Malformed("not text")));
        match given {
            None if self.open_reads => Ok(None),
            None => Err(refused(&proof::ProofError::Missing)),
            Some(Err(e)) => Err(refused(&e)),
            Some(Ok(p)) => self.prover.prove(p).await.map(Some).map_err(|e| refused(&e)),
        }
    }
}

/// The admin router.
pub(crate) fn router(state: AdminState) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/v1/memory", get(memory))
        .route("/v1/models", get(models))
        .route("/v1/models/refresh", post(refresh_models))
        .route("/v1/models/{model}/suffix", get(suffix))
        .route("/v1/models/{model}/tokenizer", get(tokenizer))
        .route("/v1/plan", post(plan).get(last_plan))
        .route("/v1/storage", get(storage))
        .route("/v1/cluster", get(cluster))
        .route("/v1/config/reload", post(reload))
        .with_state(state)
}

async fn metrics_handler(State(s): State<AdminState>) -> impl IntoResponse {
    if let Some(cache) = &s.cache {
        cache.settle().await;
    }
    observe_peak(&s.metrics);
    if let Some(cluster) = &s.cluster {
        observe_members(&s.metrics, &cluster.members());
    }
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render())
}

/// Sets the cluster-members gauge to what this node's last probes found (every state, zeros too,
/// so a member going away shows as a change, not as a series that vanished).
fn observe_members(metrics: &Metrics, members: &[crate::cluster::MemberState]) {
    for state in crate::cluster::MEMBER_STATES {
        let n = members.iter().filter(|m| m.state == state).count();
        metrics
            .cluster_members
            .get_or_create(&crate::metrics::StateLabel { state })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

/// Raises the peak-resident gauge to the kernel's high-water mark (which memory probes reset, so
/// the gauge keeps the maximum).
fn observe_peak(metrics: &Metrics) {
    if let Some(peak) = crate::pushdown::memory::peak_resident_bytes() {
        let peak = i64::try_from(peak).unwrap_or(i64::MAX);
        if peak > metrics.peak_resident.get() {
            metrics.peak_resident.set(peak);
        }
    }
}

/// `POST /v1/models/refresh`: reads the models (directory and store) again now (as every
/// `pushdown.models_refresh_secs` does) and answers what changed; needs a proof of a client's key.
async fn refresh_models(State(s): State<AdminState>, headers: HeaderMap) -> Reply {
    if let Err(e) = s.prove_change(&headers).await {
        return refused(&e);
    }
    let pd = match pushdown(&s) {
        Ok(p) => p.clone(),
        Err(r) => return r,
    };
    json(StatusCode::OK, &serde_json::json!(pd.refresh().await))
}

/// `POST /v1/config/reload`: reads the configuration again and applies it, as SIGHUP does
/// ([`crate::reload`]); needs a proof of a client's key in [`PROOF_HEADER`] whatever
/// `admin_open_reads` says. `200` with the keys that changed; `409` naming the keys that need a
/// restart, `400` for a file that does not load or check (nothing changed in either case).
async fn reload(State(s): State<AdminState>, headers: HeaderMap) -> Reply {
    if let Err(e) = s.prove_change(&headers).await {
        return refused(&e);
    }
    let reloader = s.reloader.clone();
    let Ok(result) = tokio::task::spawn_blocking(move || reloader.reload()).await else {
        return json(StatusCode::INTERNAL_SERVER_ERROR, &serde_json::json!({ "error": "InternalError" }));
    };
    match result {
        Ok(changed) => json(StatusCode::OK, &serde_json::json!({ "changed": changed })),
        Err(e) => {
            let (status, fixed) = match &e {
                crate::reload::ReloadError::Fixed(keys) => (StatusCode::CONFLICT, keys.clone()),
                crate::reload::ReloadError::NoSource => (StatusCode::NOT_FOUND, Vec::new()),
                crate::reload::ReloadError::Invalid(_) => (StatusCode::BAD_REQUEST, Vec::new()),
            };
            json(status, &serde_json::json!({ "error": e.to_string(), "fixed": fixed }))
        }
    }
}

/// The memory governor's view: budget, reservations, and each engine's memory model.
async fn memory(State(s): State<AdminState>) -> impl IntoResponse {
    observe_peak(&s.metrics);
    let Some(pd) = &s.pushdown else {
        return (StatusCode::NOT_FOUND, [(header::CONTENT_TYPE, "text/plain")], "pushdown: disabled\n".to_owned());
    };
    let g = pd.governor();
    let body = serde_json::json!({
        "budget_bytes": g.config().budget,
        "adaptation": g.config().adaptive,
        "max_wait_ms": g.config().max_wait.as_millis() as u64,
        "reserved_bytes": g.reserved(),
        "resident_bytes": crate::pushdown::memory::resident_bytes(),
        "peak_resident_bytes": s.metrics.peak_resident.get(),
        "scratch_kept_bytes": pd.scratch_kept_bytes(),
        "scratch_bound_bytes": crate::pushdown::preprocess::SCRATCH_POOL_BYTES,
        "engines": pd.engine_memory(),
    });
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], format!("{body:#}\n"))
}

/// Ready while not draining. The body also says whether pushdown can run (passthrough serves
/// either way, so a missing ONNX Runtime does not make the gateway unready).
async fn ready(State(s): State<AdminState>) -> Response {
    if s.admission.is_draining() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n").into_response();
    }
    let pushdown = match &s.pushdown {
        None => "pushdown: disabled".to_owned(),
        Some(p) => match p.available() {
            Ok(()) => format!("pushdown: ready (models: {})", p.registry().names().join(", ")),
            Err(why) => format!("pushdown: unavailable: {why}"),
        },
    };
    let mut resp = (StatusCode::OK, format!("ready\n{pushdown}\n")).into_response();
    // What it serves, for the other members' reports of whether they agree (`crate::cluster`).
    if let Some(digest) = s.pushdown.as_ref().and_then(|p| HeaderValue::from_str(&p.registry().digest()).ok()) {
        resp.headers_mut().insert(crate::cluster::MODELS_HEADER, digest);
    }
    resp
}

type Reply = (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>);

fn json(status: StatusCode, value: &serde_json::Value) -> Reply {
    (status, [(header::CONTENT_TYPE, "application/json")], format!("{value:#}\n").into_bytes())
}

fn failure(e: crate::pushdown::PushdownError) -> Reply {
    let spec = crate::error::GatewayError::Pushdown(e).spec();
    json(spec.status, &serde_json::json!({ "error": spec.code, "message": spec.message }))
}

fn refused(e: &proof::ProofError) -> Reply {
    let code = match e.status() {
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailable",
        StatusCode::BAD_REQUEST => "InvalidArgument",
        _ => "AccessDenied",
    };
    json(e.status(), &serde_json::json!({ "error": code, "message": e.to_string() }))
}

fn pushdown(s: &AdminState) -> Result<&Arc<Pushdown>, Reply> {
    s.pushdown.as_ref().ok_or_else(|| json(StatusCode::NOT_FOUND, &serde_json::json!({ "error": "pushdown disabled" })))
}

/// Every model with its splits in order, its freeze split, input and preprocessing.
async fn models(State(s): State<AdminState>) -> Reply {
    let pd = match pushdown(&s) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let registry = pd.registry();
    let list: Vec<serde_json::Value> = registry
        .models
        .values()
        .map(|m| {
            serde_json::json!({
                "name": m.manifest.name,
                "sha256": m.digest,
                "version": m.version,
                "input": m.manifest.input,
                "input_shape": m.manifest.input_shape,
                "freeze": m.manifest.freeze,
                "license": m.manifest.license,
                "origin": m.manifest.origin,
                "splits": m.manifest.splits.iter().map(|d| serde_json::json!({"name": d.name, "tensor": d.tensor})).collect::<Vec<_>>(),
                "layout": format!("{:?}", m.manifest.layout).to_uppercase(),
                // A text model: its mask input and length (its tokenizer: `tokenizer` below).
                "text": m.manifest.text.as_ref().map(|t| serde_json::json!({
                    "mask": t.mask,
                    "length": m.manifest.input_shape.last(),
                })),
                "preprocess": m.manifest.preprocess.as_ref().map(|p| serde_json::json!({
                    "resize_shorter": p.resize_shorter,
                    "crop": p.crop,
                    "scale": p.scale,
                    "mean": p.mean,
                    "std": p.std,
                    "channels": format!("{:?}", p.channels).to_lowercase(),
                })),
            })
        })
        .collect();
    // What was found and not served: its directory's name and why.
    let failed: Vec<serde_json::Value> = registry
        .failed
        .iter()
        .map(|(dir, why)| {
            let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            serde_json::json!({ "dir": name, "error": why })
        })
        .collect();
    json(StatusCode::OK, &serde_json::json!({ "models": list, "failed": failed }))
}

#[derive(serde::Deserialize)]
struct SuffixQuery {
    from: String,
    to: Option<String>,
}

/// The ONNX graph of the frozen layers between two splits, for the compute tier.
async fn suffix(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(model): Path<String>,
    Query(q): Query<SuffixQuery>,
) -> Reply {
    if let Err(r) = s.prove_read(&headers).await {
        return r;
    }
    let pd = match pushdown(&s) {
        Ok(p) => p,
        Err(r) => return r,
    };
    // Cutting walks the whole model's protobuf: CPU work, off the async workers.
    let pd = pd.clone();
    let cut = tokio::task::spawn_blocking(move || pd.suffix(&model, &q.from, q.to.as_deref())).await;
    match cut.map_err(|e| crate::pushdown::PushdownError::Internal(e.to_string())).and_then(|r| r) {
        Ok(graph) => (StatusCode::OK, [(header::CONTENT_TYPE, "application/octet-stream")], graph),
        Err(e) => failure(e),
    }
}

/// A text model's tokenizer as the gateway runs it (`tokenizer.json`, with its truncation and
/// padding to the model's length), for the compute tier's baseline.
async fn tokenizer(State(s): State<AdminState>, headers: HeaderMap, Path(model): Path<String>) -> Reply {
    if let Err(r) = s.prove_read(&headers).await {
        return r;
    }
    let pd = match pushdown(&s) {
        Ok(p) => p.clone(),
        Err(r) => return r,
    };
    match tokio::task::spawn_blocking(move || pd.tokenizer_json(&model)).await {
        Ok(Ok(json)) => (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], json.into_bytes()),
        Ok(Err(e)) => failure(e),
        Err(e) => failure(crate::pushdown::PushdownError::Internal(e.to_string())),
    }
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanRequest {
    model: String,
    profile: crate::planner::ClientProfile,
    /// The asking client's access key: its own open requests do not count as load. When given,
    /// it must be the key the proof proves.
    #[serde(default)]
    tenant: Option<String>,
    /// A presigned `GET /` URL signed with the tenant's key ([`proof`]).
    #[serde(default)]
    proof: Option<String>,
    /// The element type the client will ask for (`dtype` of its GETs): sizes the outputs.
    #[serde(default)]
    dtype: Dtype,
}

/// Plans a model for a client profile and remembers it for `split=auto` of the tenant the proof
/// proves (and no other).
async fn plan(State(s): State<AdminState>, body: Bytes) -> Reply {
    let pd = match pushdown(&s) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let req: PlanRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return json(
                StatusCode::BAD_REQUEST,
                &serde_json::json!({ "error": "InvalidArgument", "message": e.to_string() }),
            );
        }
    };
    let proven = match req.proof.as_deref() {
        None => Err(proof::ProofError::Missing),
        Some(p) => s.prover.prove(p).await,
    };
    let tenant = match proven {
        Ok(t) if req.tenant.as_ref().is_none_or(|named| *named == t) => t,
        Ok(proven) => {
            let named = req.tenant.unwrap_or_default();
            return refused(&proof::ProofError::OtherTenant { proven, named });
        }
        Err(e) => return refused(&e),
    };
    match pd.plan(&req.model, &req.profile, Some(&tenant), req.dtype).await {
        Ok((plan, storage)) => {
            json(StatusCode::OK, &serde_json::json!({ "model": req.model, "plan": plan, "storage": storage }))
        }
        Err(e) => failure(e),
    }
}

#[derive(serde::Deserialize)]
struct ModelQuery {
    model: String,
    /// As in [`PlanRequest`].
    tenant: Option<String>,
    /// As in [`PlanRequest`] (`/v1/storage` only).
    #[serde(default)]
    dtype: Dtype,
    /// A text model's mean attended tokens per sample (`ClientProfile::tokens_per_sample`;
    /// `/v1/storage` only).
    tokens: Option<f64>,
}

/// The storage-side terms of the cost model for a model, measured now (what a client needs to
/// profile its own side without fetching features at every split).
async fn storage(State(s): State<AdminState>, Query(q): Query<ModelQuery>) -> Reply {
    let pd = match pushdown(&s) {
        Ok(p) => p,
        Err(r) => return r,
    };
    match pd.storage_profile(&q.model, q.tenant.as_deref(), (q.dtype, q.tokens)).await {
        Ok(p) => json(StatusCode::OK, &serde_json::json!(p)),
        Err(e) => failure(e),
    }
}

/// The members, their state and the hashing in use (`crate::cluster`); `404` for a single gateway.
async fn cluster(State(s): State<AdminState>) -> Reply {
    match &s.cluster {
        Some(c) => json(StatusCode::OK, &c.report()),
        None => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({ "error": "NotClustered", "message": "this gateway has no [cluster] configuration" }),
        ),
    }
}

/// What `split=auto` means for a model now, for the tenant the proof proves (with open reads and no
/// proof, for the tenant named).
async fn last_plan(State(s): State<AdminState>, headers: HeaderMap, Query(q): Query<ModelQuery>) -> Reply {
    let tenant = match s.prove_read(&headers).await {
        Ok(None) => q.tenant.unwrap_or_default(),
        Ok(Some(proven)) if q.tenant.as_ref().is_none_or(|named| *named == proven) => proven,
        Ok(Some(proven)) => {
            return refused(&proof::ProofError::OtherTenant { proven, named: q.tenant.unwrap_or_default() });
        }
        Err(r) => return r,
    };
    let pd = match pushdown(&s) {
        Ok(p) => p,
        Err(r) => return r,
    };
    match pd.auto_split(&tenant, &q.model) {
        Some((split, plan)) => {
            json(StatusCode::OK, &serde_json::json!({ "model": q.model, "split": split, "plan": plan }))
        }
        None => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({ "error": "InvalidArgument", "message": format!("unknown model {:?}", q.model) }),
        ),
    }
}
