//! Listeners and lifecycle: build the parts, bind the S3 and admin ports, serve, and shut down
//! gracefully. Connections are accepted in `crate::edge`; requests go through
//! `proxy::Gateway::handle` (phases in ARCHITECTURE.md).
//!
//! Shutdown: flip `/readyz` to 503 and refuse new requests, stop accepting connections, drain
//! in-flight requests for up to `shutdown_grace_secs`, then return regardless.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

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
use crate::proxy::LiveFront;
use crate::pushdown::Pushdown;
use crate::reload::Reloader;
use crate::s3::credentials::LiveCredentials;
use crate::upgrade::Inherited;
use arc_swap::ArcSwap;
use std::os::fd::{AsFd, OwnedFd};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot bind {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("cannot open the fs backend directory {path}: {source}")]
    FsBackend { path: String, source: std::io::Error },
    #[error("upgrade: {0}")]
    Upgrade(String),
}

/// A running gateway.
#[derive(Debug)]
pub struct Server {
    pub s3_addr: SocketAddr,
    pub admin_addr: SocketAddr,
    /// Each alias endpoint's address (`[[pushdown.alias_endpoints]]`, in order).
    pub alias_addrs: Vec<SocketAddr>,
    pub gateway: Arc<Gateway>,
    reloader: Arc<Reloader>,
    /// Copies of the listening sockets (S3, admin, alias endpoints), offered to a successor
    /// (`upgrade_socket`).
    offered: Option<Vec<OwnedFd>>,
    /// The gateway these sockets came from, told once this one serves.
    predecessor: Option<crate::upgrade::Predecessor>,
    stop: Option<oneshot::Sender<Duration>>,
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

/// A listening socket taken over from the running gateway, refused unless it listens where this
/// configuration says (a changed address needs a stop and a start, not an upgrade).
fn adopt(listener: std::net::TcpListener, addr: SocketAddr) -> Result<TcpListener, ServeError> {
    let bound = listener.local_addr().map_err(|source| ServeError::Bind { addr, source })?;
    if addr.port() != 0 && bound != addr {
        return Err(ServeError::Upgrade(format!(
            "the running gateway listens on {bound}, this configuration on {addr}: stop it and start this one"
        )));
    }
    TcpListener::from_std(listener).map_err(|source| ServeError::Bind { addr, source })
}

/// The alias endpoints' sockets taken over, each matched to a configured address (a port of 0
/// takes one on the same host address); an endpoint new to this configuration is bound afresh,
/// and one it dropped is closed.
async fn adopt_aliases(
    mut inherited: Vec<std::net::TcpListener>,
    endpoints: &[SocketAddr],
) -> Result<Vec<TcpListener>, ServeError> {
    let mut listeners = Vec::with_capacity(endpoints.len());
    for &addr in endpoints {
        let same = |l: &std::net::TcpListener| {
            l.local_addr().is_ok_and(|a| a == addr || (addr.port() == 0 && a.ip() == addr.ip()))
        };
        listeners.push(match inherited.iter().position(same) {
            Some(i) => adopt(inherited.swap_remove(i), addr)?,
            None => bind(addr).await?,
        });
    }
    for l in inherited {
        tracing::warn!(addr = ?l.local_addr().ok(), "Upgrade: this configuration has no alias endpoint there; closing it.");
    }
    Ok(listeners)
}

impl Server {
    /// Validates the config, binds both ports and starts serving.
    ///
    /// # Errors
    /// Invalid config, a port in use, an unusable backend directory.
    pub async fn start(config: &Config) -> Result<Self, ServeError> {
        Self::start_with(config, None, false).await
    }

    /// [`Self::start`], reloadable from `source` (how `config` was read: the file, the
    /// environment and the flags) on SIGHUP and `POST /v1/config/reload` ([`crate::reload`]).
    ///
    /// # Errors
    /// As [`Self::start`].
    pub(crate) async fn start_with(
        config: &Config,
        source: Option<crate::config::Overrides>,
        take_over: bool,
    ) -> Result<Self, ServeError> {
        let rt = config.runtime()?;
        let metrics = Metrics::new();
        let backend = build_backend(rt.backend, &metrics)?;
        let creds: LiveCredentials = Arc::new(ArcSwap::from_pointee(rt.credentials));
        let front: LiveFront = Arc::new(ArcSwap::from_pointee(rt.front));
        let pushdown = config.pushdown.enabled.then(|| {
            let mut settings = config.pushdown.pushdown_config(metrics.clone());
            settings.models_store = rt.models_store.clone();
            Arc::new(Pushdown::new(settings))
        });
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
        let mut gateway = Gateway::new(front.clone(), creds.clone(), backend, metrics.clone(), pushdown, cache);
        let cluster_secret = rt.cluster_secret.clone();
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
        let gateway = gateway.shared();
        let reloader = Arc::new(Reloader::new(
            source,
            (config.clone(), cluster_secret),
            (creds, front),
            gateway.admission().clone(),
            metrics.clone(),
        ));
        // Last before serving (everything slow is done): a running gateway's sockets, if it
        // offers them (`crate::upgrade`), else bound afresh.
        let taken = match config.upgrade_socket.clone().filter(|_| take_over) {
            Some(path) => tokio::task::spawn_blocking(move || crate::upgrade::take_over(&path))
                .await
                .map_err(|e| ServeError::Upgrade(e.to_string()))?
                .map_err(|e| ServeError::Upgrade(e.to_string()))?,
            None => None,
        };
        let (listeners, predecessor) = taken.map_or((None, None), |(i, p)| (Some(i), Some(p)));
        let endpoints: Vec<SocketAddr> = config.pushdown.alias_endpoints.iter().map(|e| e.listen).collect();
        let (s3_listener, admin_listener, alias_listeners) = match listeners {
            Some(Inherited { s3, admin, aliases }) => (
                adopt(s3, config.listen)?,
                adopt(admin, config.admin_listen)?,
                adopt_aliases(aliases, &endpoints).await?,
            ),
            None => {
                let mut aliases = Vec::with_capacity(endpoints.len());
                for addr in &endpoints {
                    aliases.push(bind(*addr).await?);
                }
                (bind(config.listen).await?, bind(config.admin_listen).await?, aliases)
            }
        };
        let all = [(&s3_listener, config.listen), (&admin_listener, config.admin_listen)]
            .into_iter()
            .chain(alias_listeners.iter().zip(endpoints.iter().copied()));
        // Copies of the listening sockets to offer a successor (`upgrade_socket`).
        let offered = match &config.upgrade_socket {
            Some(_) => Some(
                all.clone()
                    .map(|(l, addr)| l.as_fd().try_clone_to_owned().map_err(|source| ServeError::Bind { addr, source }))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
        let mut addrs = all
            .map(|(l, addr)| l.local_addr().map_err(|source| ServeError::Bind { addr, source }))
            .collect::<Result<Vec<_>, _>>()?
            .into_iter();
        let (s3_addr, admin_addr) =
            (addrs.next().unwrap_or(config.listen), addrs.next().unwrap_or(config.admin_listen));
        let alias_addrs: Vec<SocketAddr> = addrs.collect();

        // Each alias endpoint's requests carry which one they arrived on (`AliasEndpoint`).
        let service = |alias| crate::proxy::s3_service(gateway.clone(), alias);
        let apps = std::iter::once((s3_listener, service(None)))
            .chain(
                alias_listeners
                    .into_iter()
                    .enumerate()
                    .map(|(i, l)| (l, service(Some(crate::proxy::AliasEndpoint(i))))),
            )
            .collect();
        let (stop, stopped) = oneshot::channel::<Duration>();
        let edge = rt.edge;
        let task =
            tokio::spawn(crate::edge::serve(
                apps,
                edge,
                metrics.clone(),
                async move { stopped.await.unwrap_or_default() },
            ));
        if let Some(c) = &cluster {
            let pushdown = gateway.pushdown().cloned();
            c.spawn_refresh(move || pushdown.as_ref().map(|p| p.registry().digest()));
        }
        let admin_app = admin::router(admin::AdminState {
            admission: gateway.admission().clone(),
            pushdown: gateway.pushdown().cloned(),
            cache: gateway.cache().cloned(),
            cluster,
            metrics,
            prover,
            open_reads: config.admin_open_reads,
            reloader: reloader.clone(),
        });
        let admin_task = tokio::spawn(async move {
            if let Err(e) = axum::serve(admin_listener, admin_app).await {
                tracing::error!(error = %e, "Admin listener failed.");
            }
        });
        tracing::info!(%s3_addr, %admin_addr, alias_endpoints = ?alias_addrs, backend = gateway.backend().kind(), "Listening.");
        Ok(Self {
            s3_addr,
            admin_addr,
            alias_addrs,
            gateway,
            reloader,
            offered,
            predecessor,
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
        // The listening sockets close with the accept loop: new connections are refused.
        self.offered = None;
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(Duration::ZERO);
        }
        self.drain().await
    }

    /// Hands the node over to a successor that serves on this process's sockets
    /// (`crate::upgrade`): this process stops accepting (the sockets stay open in the successor),
    /// answers each connection's next request with `Connection: close` for up to
    /// [`HANDOVER_LINGER`], then closes idle connections and drains the rest as a shutdown does.
    /// `/readyz` stays ready: the node serves throughout. Returns whether everything drained.
    pub(crate) async fn hand_over(mut self) -> bool {
        tracing::info!(grace_secs = self.grace.as_secs(), "Handing over: draining in-flight requests.");
        self.gateway.admission().begin_handover();
        self.offered = None;
        // The successor's admin listener takes every new admin connection.
        self.admin_task.abort();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(HANDOVER_LINGER.min(self.grace));
        }
        self.drain().await
    }

    /// Waits for the accept loop's connections to finish, at most `shutdown_grace_secs`, then
    /// stops the admin listener and the engines.
    async fn drain(mut self) -> bool {
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

/// How long a process handing over waits for its kept-alive connections' next requests (answered
/// with `Connection: close`) before it closes the idle ones: SDK pools reuse a connection within
/// seconds when their clients are busy, and an idle connection closed by the server is detected by
/// the client's pool before reuse.
pub(crate) const HANDOVER_LINGER: Duration = Duration::from_secs(5);

/// Runs until `signal` resolves, then shuts down gracefully.
///
/// # Errors
/// When the server cannot start.
pub async fn run(config: &Config, signal: impl std::future::Future<Output = ()>) -> Result<bool, ServeError> {
    let server = Server::start(config).await?;
    signal.await;
    Ok(server.shutdown().await)
}

/// [`run`] for the `serve` command: the configuration is read again from `source` on SIGHUP
/// ([`crate::reload`]).
///
/// # Errors
/// When the server cannot start.
pub(crate) async fn serve(
    config: &Config,
    source: crate::config::Overrides,
    signal: impl std::future::Future<Output = ()>,
) -> Result<bool, ServeError> {
    // Listened for from the start: a reload asked for while starting waits instead of killing.
    let hangups = hangups();
    let mut server = Server::start_with(config, Some(source), true).await?;
    if let Some(p) = server.predecessor.take() {
        tracing::info!("Took the listening sockets over from the running gateway.");
        let told =
            tokio::task::spawn_blocking(move || p.serving()).await.unwrap_or_else(|e| Err(std::io::Error::other(e)));
        if let Err(e) = told {
            // It gave up waiting and serves on: two gateways must not share the sockets.
            tracing::error!(error = %e, "The running gateway did not hear that this one serves; stopping.");
            server.offered = None;
            server.shutdown().await;
            return Err(ServeError::Upgrade(format!("the running gateway did not take the hand-over: {e}")));
        }
    }
    let hangups = tokio::spawn(reload_on_hangup(hangups, server.reloader.clone()));
    let offer = match (&config.upgrade_socket, server.offered.as_ref()) {
        (Some(path), Some(sockets)) => {
            let dup = |fd: &OwnedFd| fd.try_clone().map_err(|e| ServeError::Upgrade(e.to_string()));
            Some(crate::upgrade::offer(path.clone(), sockets.iter().map(dup).collect::<Result<_, _>>()?))
        }
        _ => None,
    };
    let handed = async {
        match offer {
            Some(offer) => offer.await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(signal);
    let result = tokio::select! {
        () = &mut signal => server.shutdown().await,
        handed = handed => match handed {
            Ok(()) => {
                let drained = server.hand_over().await;
                // As nginx's old master does: the operator (or the orchestrator deleting the old
                // pod) ends it, so that no supervisor restarts it to take the sockets back.
                tracing::info!("Handed over to the new process; exiting on SIGTERM or SIGINT.");
                signal.await;
                drained
            }
            Err(e) => {
                tracing::error!(error = %e, "Cannot offer the sockets for upgrades; serving until stopped.");
                server.offered = None;
                signal.await;
                server.shutdown().await
            }
        },
    };
    hangups.abort();
    Ok(result)
}

/// SIGHUP, listened for (`None` where it cannot be).
fn hangups() -> Option<tokio::signal::unix::Signal> {
    let listened = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup());
    if listened.is_err() {
        tracing::warn!("Cannot listen for SIGHUP; reload with POST /v1/config/reload.");
    }
    listened.ok()
}

/// Reloads the configuration on every SIGHUP (the outcome is logged and counted).
async fn reload_on_hangup(hangups: Option<tokio::signal::unix::Signal>, reloader: Arc<Reloader>) {
    {
        let Some(mut hangups) = hangups else { return };
        while hangups.recv().await.is_some() {
            tracing::info!(signal = "SIGHUP", "Signal received: reloading the configuration.");
            let reloader = reloader.clone();
            let _ = tokio::task::spawn_blocking(move || reloader.reload()).await;
        }
    }
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
