//! Listeners and lifecycle: build the parts, bind the S3 and admin ports, serve, and shut down
//! gracefully. Connections are accepted in `crate::edge`; requests go through
//! `proxy::Gateway::handle` (phases in ARCHITECTURE.md).
//!
//! Shutdown: flip `/readyz` to 503 and refuse new requests, stop accepting connections, drain
//! in-flight requests for up to `shutdown_grace_secs`, then return regardless.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::admin;
use crate::backend::s3::S3Backend;
use crate::backend::{Backend, fs::FsBackend};
use crate::cache::TensorCache;
use crate::config::{BackendSetup, Config, ConfigError};
use crate::metrics::Metrics;
use crate::proxy::Gateway;
use crate::pushdown::Pushdown;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("cannot open the fs backend directory {path}: {source}")]
    FsBackend { path: String, source: std::io::Error },
}

/// A running gateway.
#[derive(Debug)]
pub struct Server {
    pub s3_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub gateway: Arc<Gateway>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
    admin_task: JoinHandle<()>,
    grace: Duration,
}

/// Opens the configured backend.
///
/// # Errors
/// An unusable fs directory or CA file.
pub(crate) fn build_backend(setup: BackendSetup, metrics: &Metrics) -> Result<Backend, ServeError> {
    Ok(match setup {
        BackendSetup::Fs(root) => {
            if !root.exists() {
                crate::demo::seed(&root)
                    .map_err(|source| ServeError::FsBackend { path: root.display().to_string(), source })?;
                tracing::info!(root = %root.display(), bucket = crate::demo::DEMO_BUCKET, "Created the data directory with demo images.");
            }
            Backend::Fs(
                FsBackend::new(&root)
                    .map_err(|source| ServeError::FsBackend { path: root.display().to_string(), source })?,
            )
        }
        BackendSetup::S3(c) => Backend::S3(Box::new(
            S3Backend::new(*c, metrics.backend.clone())
                .map_err(|e| ConfigError::Invalid { key: "backend.ca_file", message: e.to_string() })?,
        )),
    })
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })
}

impl Server {
    /// Validates the config, binds both ports and starts serving.
    ///
    /// # Errors
    /// Invalid config, a port in use, an unusable backend directory.
    pub async fn start(config: &Config) -> Result<Self, ServeError> {
        let rt = config.runtime()?;
        let metrics = Metrics::new();
        let backend = build_backend(rt.backend, &metrics)?;
        let creds = rt.credentials;
        let pushdown =
            config.pushdown.enabled.then(|| Arc::new(Pushdown::new(config.pushdown.pushdown_config(metrics.clone()))));
        if let Some(p) = &pushdown {
            p.spawn_reaper();
        }
        let cache = match rt.cache.filter(|_| pushdown.is_some()) {
            Some(c) => Some(Arc::new(
                TensorCache::new(&c, metrics.clone())
                    .map_err(|e| ConfigError::Invalid { key: "pushdown.cache.disk_dir", message: e.to_string() })?,
            )),
            None => None,
        };
        let cluster = config.cluster.clone().map(crate::cluster::Cluster::new);
        let prover = Arc::new(if config.transparent() {
            admin::proof::Prover::Store(backend.clone())
        } else {
            admin::proof::Prover::Gateway(creds.clone())
        });
        let mut gateway = Gateway::new(rt.front, creds, backend, metrics.clone(), pushdown, cache);
        if let (Some(c), Some(settings)) = (&cluster, &config.cluster) {
            let secret = rt.cluster_secret;
            if secret.is_none() && !config.transparent() {
                tracing::warn!("cluster: no cluster.secret_key; pushdowns are computed where they arrive");
            }
            gateway = gateway.with_routing(crate::proxy::owner::Routing::new(
                c.clone(),
                config.region.clone(),
                (settings.access_key.clone(), secret),
                Duration::from_secs(config.edge.request_timeout_secs),
                metrics.clone(),
            ));
        }
        let gateway = Arc::new(gateway);
        let s3_listener = bind(config.listen).await?;
        let admin_listener = bind(config.admin_listen).await?;
        let s3_addr = s3_listener.local_addr().map_err(|source| ServeError::Bind { addr: config.listen, source })?;
        let admin_addr =
            admin_listener.local_addr().map_err(|source| ServeError::Bind { addr: config.admin_listen, source })?;

        let app = Router::new().fallback(handle).with_state(gateway.clone());
        let (stop, stopped) = oneshot::channel::<()>();
        let edge = rt.edge;
        let task = tokio::spawn(crate::edge::serve(s3_listener, app, edge, metrics.clone(), async move {
            let _ = stopped.await;
        }));
        if let Some(c) = &cluster {
            c.spawn_refresh();
        }
        let admin_app = admin::router(admin::AdminState {
            admission: gateway.admission().clone(),
            pushdown: gateway.pushdown().cloned(),
            cache: gateway.cache().cloned(),
            cluster,
            metrics,
            prover,
            open_reads: config.admin_open_reads,
        });
        let admin_task = tokio::spawn(async move {
            if let Err(e) = axum::serve(admin_listener, admin_app).await {
                tracing::error!(error = %e, "Admin listener failed.");
            }
        });
        tracing::info!(%s3_addr, %admin_addr, backend = gateway.backend().kind(), "Listening.");
        Ok(Self {
            s3_addr,
            admin_addr,
            gateway,
            stop: Some(stop),
            task,
            admin_task,
            grace: Duration::from_secs(config.shutdown_grace_secs),
        })
    }

    /// Graceful shutdown: refuse new requests, stop accepting, drain under the deadline.
    /// Returns whether every in-flight request finished in time.
    pub async fn shutdown(mut self) -> bool {
        tracing::info!(grace_secs = self.grace.as_secs(), "Shutdown started: draining in-flight requests.");
        self.gateway.begin_shutdown();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let drained = tokio::time::timeout(self.grace, &mut self.task).await.is_ok();
        if drained {
            tracing::info!("Shutdown finished: all requests drained.");
        } else {
            self.task.abort();
            tracing::warn!("Shutdown deadline reached: abandoning the requests still in flight.");
        }
        self.admin_task.abort();
        // Last: the process may exit as soon as this returns, and must not while an inference
        // thread is inside ONNX Runtime.
        if let Some(p) = self.gateway.pushdown() {
            p.shutdown().await;
        }
        drained
    }
}

async fn handle(State(gateway): State<Arc<Gateway>>, req: Request) -> axum::response::Response {
    gateway.handle(req).await
}

/// Runs until `signal` resolves, then shuts down gracefully.
///
/// # Errors
/// When the server cannot start.
pub async fn run(config: &Config, signal: impl std::future::Future<Output = ()>) -> Result<bool, ServeError> {
    let server = Server::start(config).await?;
    signal.await;
    Ok(server.shutdown().await)
}

/// Resolves on SIGINT or SIGTERM, logging which arrived.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => tracing::info!(signal = "SIGINT", "Signal received."),
        () = term => tracing::info!(signal = "SIGTERM", "Signal received."),
    }
}
