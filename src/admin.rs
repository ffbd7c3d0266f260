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
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], s.metrics.render())
}

async fn ready(State(s): State<AdminState>) -> impl IntoResponse {
    if s.gateway.is_shutting_down() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::OK, "ready\n")
    }
}
