//! The admin port: `/metrics` (Prometheus text), `/healthz` (the process is alive), `/readyz`
//! (accepting requests: not draining).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;
use crate::proxy::Gateway;

#[derive(Clone)]
struct AdminState {
    gateway: Arc<Gateway>,
    metrics: Metrics,
}

/// The admin router.
pub fn router(gateway: Arc<Gateway>, metrics: Metrics) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/v1/memory", get(memory))
        .with_state(AdminState { gateway, metrics })
}

async fn metrics_handler(State(s): State<AdminState>) -> impl IntoResponse {
    if let Some(cache) = s.gateway.cache() {
        cache.settle().await;
    }
    observe_peak(&s.metrics);
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render())
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

/// The memory governor's view: budget, reservations, and each engine's memory model.
async fn memory(State(s): State<AdminState>) -> impl IntoResponse {
    observe_peak(&s.metrics);
    let Some(pd) = s.gateway.pushdown() else {
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
        "engines": pd.engine_memory(),
    });
    (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], format!("{body:#}\n"))
}

/// Ready while not draining. The body also says whether pushdown can run (passthrough serves
/// either way, so a missing ONNX Runtime does not make the gateway unready).
async fn ready(State(s): State<AdminState>) -> impl IntoResponse {
    if s.gateway.is_shutting_down() {
        return (StatusCode::SERVICE_UNAVAILABLE, "draining\n".to_owned());
    }
    let pushdown = match s.gateway.pushdown() {
        None => "pushdown: disabled".to_owned(),
        Some(p) => match p.available() {
            Ok(()) => format!("pushdown: ready (models: {})", p.registry().names().join(", ")),
            Err(why) => format!("pushdown: unavailable: {why}"),
        },
    };
    (StatusCode::OK, format!("ready\n{pushdown}\n"))
}
