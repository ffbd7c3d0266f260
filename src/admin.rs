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
        .with_state(AdminState { gateway, metrics })
}

async fn metrics_handler(State(s): State<AdminState>) -> impl IntoResponse {
    if let Some(cache) = s.gateway.cache() {
        cache.settle().await;
    }
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render())
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
