//! Configuration: a TOML file, then `TENSORGATE_*` environment variables, then flags (later wins),
//! parsed into one [`Config`] and validated once at start. Every key is documented in
//! `config/example.toml`; `tensorgate check-config FILE` runs the same validation.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use crate::backend::retry::RetryPolicy;
use crate::backend::s3::S3BackendConfig;
use crate::cluster::ClusterSettings;
use crate::pushdown::engine::OrtArena;
use crate::s3::credentials::{CredentialStore, SecretKey};

/// Largest single PUT S3 accepts (5 GiB); larger objects use multipart upload.
pub(crate) const DEFAULT_MAX_BODY_BYTES: u64 = 5 * 1024 * 1024 * 1024;
/// Concurrent requests before `503 SlowDown`. Each streaming request holds a few 64 KiB buffers, so
/// 1024 keeps worst-case buffer memory well under 128 MiB.
pub(crate) const DEFAULT_MAX_IN_FLIGHT: usize = 1024;
/// Concurrent backend requests. Matches a typical S3 server's per-client comfort zone.
pub(crate) const DEFAULT_BACKEND_CONCURRENCY: usize = 256;
/// Connections served at once. Each costs a socket, a task and at most [`crate::edge::MAX_HEADER_BYTES`] of
/// head buffer, so 4096 bound the heads of a connection flood to 256 MiB; a storage node's S3
/// clients (data loaders, a few dozen workers each) stay far below it.
pub(crate) const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Time to send a request head, on a new connection or between requests on a kept-alive one:
/// 30 s (hyper's default) covers slow links and is below the 60 s that SDK connection pools keep
/// an idle connection for (they reconnect transparently when the gateway closes first).
pub(crate) const DEFAULT_HEADER_TIMEOUT_SECS: u64 = 30;
/// A request-body read or a response write without any progress for this long ends the request:
/// 60 s is the common S3 client read timeout, so a live client never reaches it.
pub(crate) const DEFAULT_STALL_TIMEOUT_SECS: u64 = 60;
/// Longest time from a body-less request's head to its response head (pushdown included: a 64 MiB
/// shard, the longest memory wait of 30 s and a slow store fit well inside 5 minutes). Requests with
/// a body are bounded by the stall timeout instead: an upload may legitimately take hours.
pub(crate) const DEFAULT_REQUEST_TIMEOUT_SECS: u64 = 300;
/// Longest wait for a backend connection slot: past it the client gets `503 SlowDown` rather than
/// a place in an ever longer queue.
pub(crate) const DEFAULT_BACKEND_PERMIT_TIMEOUT_MS: u64 = 10_000;
/// Longest time to read a pushdown source object's body once the store answered: 64 MiB at 2 MB/s.
pub(crate) const DEFAULT_SOURCE_TIMEOUT_SECS: u64 = 30;
/// How long shutdown waits for in-flight requests before exiting anyway.
pub(crate) const DEFAULT_SHUTDOWN_GRACE_SECS: u64 = 30;
/// Most alias endpoints: each is a listening socket handed over on an upgrade in one message
/// (`crate::upgrade`), and an alias per (model, split, format) a node serves is a handful.
pub(crate) const MAX_ALIAS_ENDPOINTS: usize = 32;
/// Access key used when nothing is configured, the gateway only listens on loopback and serves the
/// embedded `fs` backend.
pub(crate) const DEV_ACCESS_KEY: &str = "tensorgate-dev";
/// Its secret. Public by design: it only ever protects a loopback-only development gateway.
pub(crate) const DEV_SECRET_KEY: &str = "tensorgate-dev-secret";
/// Secrets that this project's documents and deployment files have published as examples. A copy of
/// such a file with only the store's address filled in must not give a login that the file itself
/// published, so a configured secret equal to one of these is refused by name (the development
/// secret is refused beyond loopback: [`Config::credential_store`]). Add any secret a document
/// shows.
pub(crate) const PUBLISHED_SECRETS: &[&str] =
    &["example-secret-key", "change-me-client-secret", "change-me-store-secret", "CLIENT_SECRET", "STORE_SECRET"];

/// Prefix of the environment variables that set any key of the file: `TENSORGATE__` then the
/// key's path in upper case, sections joined by `__` (`TENSORGATE__PUSHDOWN__MEMORY_BUDGET=...`
/// sets `pushdown.memory_budget`). Double underscores keep them apart from the named variables of
/// the flags (`TENSORGATE_BACKEND_ENDPOINT`), which win over them.
pub(crate) const ENV_KEY_PREFIX: &str = "TENSORGATE__";

/// A configuration problem, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("invalid value for `{key}`: {message}")]
    Invalid { key: &'static str, message: String },
    #[error("invalid configuration from {ENV_KEY_PREFIX}* environment variables: {0}")]
    Environment(String),
}

fn invalid(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { key, message: message.into() }
}

impl<'de> Deserialize<'de> for SecretKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d).map(SecretKey::new)
    }
}

/// The whole configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    /// Serve model graphs, tokenizers and plans on the admin port without a proof of a client key.
    pub admin_open_reads: bool,
    pub region: String,
    pub domains: Vec<String>,
    pub allow_anonymous: bool,
    pub max_body_bytes: u64,
    pub max_in_flight: usize,
    pub shutdown_grace_secs: u64,
    /// Where the running gateway offers its listening sockets to a new process (an upgrade
    /// without dropping a connection; `crate::upgrade`); `None`: no such offer.
    pub upgrade_socket: Option<PathBuf>,
    pub edge: EdgeSettings,
    pub credentials: Vec<CredentialConfig>,
    pub backend: BackendConfig,
    pub pushdown: PushdownSettings,
    /// Scale-out (`[cluster]`; absent: a single gateway). See `crate::cluster`.
    pub cluster: Option<ClusterSettings>,
    pub log: LogConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9000)),
            admin_listen: SocketAddr::from(([127, 0, 0, 1], 9001)),
            admin_open_reads: false,
            region: "us-east-1".into(),
            domains: Vec::new(),
            allow_anonymous: false,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            shutdown_grace_secs: DEFAULT_SHUTDOWN_GRACE_SECS,
            upgrade_socket: None,
            edge: EdgeSettings::default(),
            credentials: Vec::new(),
            backend: BackendConfig::default(),
            pushdown: PushdownSettings::default(),
            cluster: None,
            log: LogConfig::default(),
        }
    }
}

/// A checked configuration, each section as the runtime type it configures ([`Config::runtime`]).
#[derive(Debug)]
pub(crate) struct Runtime {
    /// Who may sign requests (terminating mode; empty in transparent mode).
    pub(crate) credentials: CredentialStore,
    pub(crate) front: crate::proxy::FrontConfig,
    pub(crate) backend: BackendSetup,
    pub(crate) edge: crate::edge::EdgeConfig,
    /// `None`: no tensor cache.
    pub(crate) cache: Option<crate::cache::CacheConfig>,
    /// The cluster hop secret, if `[cluster]` has one.
    pub(crate) cluster_secret: Option<SecretKey>,
    /// `[pushdown.models_store]`, its key read.
    pub(crate) models_store: Option<crate::pushdown::ModelsStoreConfig>,
}

/// The backend a configuration names, ready to open.
#[derive(Debug)]
pub(crate) enum BackendSetup {
    /// The `fs` backend's directory (created with demo images if missing).
    Fs(PathBuf),
    /// The `s3` backend, its keys read.
    S3(Box<S3BackendConfig>),
}

/// Connection and request bounds at the edge (`[edge]`; see `crate::edge`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EdgeSettings {
    /// Connections served at once; one more is answered `503 SlowDown` and closed.
    pub max_connections: usize,
    /// Seconds to send a request head (also the idle keep-alive limit between requests).
    pub header_timeout_secs: u64,
    /// Seconds a request-body read or a response write may make no progress.
    pub stall_timeout_secs: u64,
    /// Seconds from a body-less request's head to its response head (`503` after).
    pub request_timeout_secs: u64,
}

impl Default for EdgeSettings {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            stall_timeout_secs: DEFAULT_STALL_TIMEOUT_SECS,
            request_timeout_secs: DEFAULT_REQUEST_TIMEOUT_SECS,
        }
    }
}

impl EdgeSettings {
    fn check(&self) -> Result<(), ConfigError> {
        for (key, v) in [
            ("edge.max_connections", self.max_connections as u64),
            ("edge.header_timeout_secs", self.header_timeout_secs),
            ("edge.stall_timeout_secs", self.stall_timeout_secs),
            ("edge.request_timeout_secs", self.request_timeout_secs),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be positive"));
            }
        }
        Ok(())
    }

    /// The accept phase's settings.
    #[must_use]
    pub(crate) fn edge_config(&self) -> crate::edge::EdgeConfig {
        crate::edge::EdgeConfig {
            max_connections: self.max_connections,
            header_timeout: Duration::from_secs(self.header_timeout_secs),
            stall_timeout: Duration::from_secs(self.stall_timeout_secs),
        }
    }
}

/// One client credential.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CredentialConfig {
    pub access_key: String,
    pub secret_key: Option<SecretKey>,
    pub secret_key_file: Option<PathBuf>,
    /// This client's own store credential (terminating mode, `s3` backend): its requests reach
    /// the store as this user, so the store's ACLs, policies and logs tell tenants apart. Without
    /// it, the shared `backend.access_key` signs.
    #[serde(default)]
    pub store_access_key: Option<String>,
    #[serde(default)]
    pub store_secret_key: Option<SecretKey>,
    #[serde(default)]
    pub store_secret_key_file: Option<PathBuf>,
}

/// Who authenticates clients (`backend.identity`; ADR 0013).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IdentityMode {
    /// Transparent for an `s3` backend configured without a store key and without client
    /// credentials (the store has its own users and the gateway holds nobody's secret);
    /// terminating otherwise.
    #[default]
    Auto,
    /// The store authenticates and authorises every request: each is forwarded as the client
    /// signed it, and pushdowns read their source with the caller's own request.
    Transparent,
    /// The gateway authenticates clients (`[[credentials]]`) and signs store requests with the
    /// store's key (`backend.access_key`).
    Terminating,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Fs,
    S3,
}

/// Where objects live.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BackendConfig {
    pub kind: BackendKind,
    /// Who authenticates clients: see [`IdentityMode`].
    pub identity: IdentityMode,
    pub root: PathBuf,
    pub endpoint: Option<String>,
    pub(crate) region: String,
    pub access_key: Option<String>,
    pub secret_key: Option<SecretKey>,
    pub(crate) secret_key_file: Option<PathBuf>,
    pub(crate) connect_timeout_ms: u64,
    pub response_timeout_secs: u64,
    pub max_concurrency: usize,
    /// Milliseconds to wait for one of `max_concurrency` slots before `503 SlowDown`.
    pub permit_timeout_ms: u64,
    pub(crate) max_retries: u32,
    pub retry_budget_secs: u64,
    pub ca_file: Option<PathBuf>,
    /// The store checks `aws-chunked` trailing checksums itself (SeaweedFS, MinIO, AWS): unsigned
    /// trailer uploads then pass through untouched, and the store keeps the client's checksum.
    /// Off (the default, right for every store): the gateway decodes them and checks the checksum.
    pub trailing_checksums: bool,
    /// The store checks a signed payload's `x-amz-content-sha256` itself (Ceph RGW, Swift's
    /// s3api, MinIO, AWS): in transparent identity mode the gateway then forwards such uploads
    /// without hashing them, and the store refuses a body that fails. Off (the default, right for
    /// every store, and needed for SeaweedFS, which stores what it is sent): the gateway checks.
    pub checks_payload_hash: bool,
}

impl Default for BackendConfig {
    fn default() -> Self {
        let retry = RetryPolicy::default();
        Self {
            kind: BackendKind::Fs,
            identity: IdentityMode::Auto,
            root: PathBuf::from("tensorgate-data"),
            endpoint: None,
            region: "us-east-1".into(),
            access_key: None,
            secret_key: None,
            secret_key_file: None,
            connect_timeout_ms: 2_000,
            response_timeout_secs: 60,
            max_concurrency: DEFAULT_BACKEND_CONCURRENCY,
            permit_timeout_ms: DEFAULT_BACKEND_PERMIT_TIMEOUT_MS,
            max_retries: retry.max_retries,
            retry_budget_secs: retry.budget.as_secs(),
            ca_file: None,
            trailing_checksums: false,
            checks_payload_hash: false,
        }
    }
}

/// Near-data pushdown (`[pushdown]`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PushdownSettings {
    pub(crate) enabled: bool,
    /// Directory of `<model>/manifest.toml` entries.
    pub models_dir: PathBuf,
    /// The ONNX Runtime shared library; default: `ORT_DYLIB_PATH`, then the `.venv` wheel.
    pub ort_library: Option<PathBuf>,
    /// Samples waiting per (model, split) before `503 SlowDown`.
    pub(crate) queue_capacity: usize,
    /// Most samples per inference run.
    pub(crate) max_batch: usize,
    /// ONNX Runtime intra-op threads per worker session.
    pub(crate) intra_threads: usize,
    /// Inference worker threads per (model, split), each with its own session.
    pub workers: usize,
    /// How sessions use ONNX Runtime's CPU arena: `false` / `"off"`, `"per-run"`, or `true` /
    /// `"kept"` ([`OrtArena`]).
    pub ort_arena: OrtArena,
    /// Seconds an engine (model, split) may go unused before its sessions and memory are freed.
    pub engine_idle_secs: u64,
    /// Seconds between two reads of `models_dir` while serving (models added, replaced and
    /// removed without a restart); 0: read at start only (and on `POST /v1/models/refresh`).
    pub(crate) models_refresh_secs: u64,
    /// Largest model file loaded (its size is checked before it is read).
    pub(crate) max_model_bytes: u64,
    /// A bucket of the store that models are read from too, the same for every member of a
    /// cluster (`[pushdown.models_store]`; absent: `models_dir` only).
    pub(crate) models_store: Option<ModelsStoreSettings>,
    /// Largest source object read for pushdown.
    pub max_object_bytes: u64,
    /// Largest image (pixels, from its header) decoded for pushdown; its resized copy obeys it too.
    pub(crate) max_image_pixels: u64,
    /// Most pixels one request may decode and resample, all its images together (the CPU bound of
    /// a request: a shard of small-but-huge images is refused from its headers).
    pub(crate) max_request_pixels: u64,
    /// Images preprocessed at once (tenants take turns); 0: one per core the process may use.
    pub(crate) preprocess_threads: usize,
    /// Inference runs at once across all engines (tenants take turns, a tenant's requests in
    /// arrival order); 0: one per core the process may use, divided by `intra_threads`.
    pub inference_runs: usize,
    /// Alias buckets (`[[pushdown.aliases]]`).
    pub aliases: Vec<AliasConfig>,
    /// Alias endpoints (`[[pushdown.alias_endpoints]]`): a listener per alias.
    pub alias_endpoints: Vec<AliasEndpointConfig>,
    /// The tensor cache (`[pushdown.cache]`).
    pub cache: CacheSettings,
    /// Bytes pushdown may hold: engines' sessions plus samples in flight (see
    /// `crate::pushdown::governor`). The tensor cache is sized separately.
    pub memory_budget: u64,
    /// Adapt each request's storage batch to the budget (`false`: the comparison mode, in which a
    /// request runs its requested batch whatever the memory).
    pub(crate) adaptation: bool,
    /// How long a sample may wait for memory before its request gets `503 SlowDown`.
    pub(crate) max_wait_ms: u64,
    /// Seconds to read a source object's body once the store answered.
    pub(crate) source_timeout_secs: u64,
}

/// `[pushdown.models_store]`: models as objects `<prefix><model>/manifest.toml` (and the files it
/// names) in a bucket of the backend store, mirrored into `mirror_dir` (ADR 0028). Who may add a
/// model is whoever the store lets write there.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelsStoreSettings {
    pub(crate) bucket: String,
    #[serde(default)]
    pub(crate) prefix: String,
    /// Where the models are mirrored (created, private to the gateway's user): a directory of its
    /// own, apart from `models_dir`, since what the bucket does not hold is removed from it.
    pub(crate) mirror_dir: PathBuf,
    /// A key that may read the bucket; default: `backend.access_key`.
    pub(crate) access_key: Option<String>,
    pub(crate) secret_key: Option<SecretKey>,
    pub(crate) secret_key_file: Option<PathBuf>,
}

/// Largest `pushdown.max_batch` with `pushdown.ort_arena = "kept"`: an engine's first session then runs
/// every batch size from 1 to `max_batch` once to measure what its arena keeps, `b (b + 1) / 2`
/// samples, 528 at 32 (about 13 s for ResNet-18 `pool` on one core, once per engine start); the
/// one-core floor's best batch was 1-32 for every bundled model (docs/BENCHMARKS.md).
pub(crate) const MAX_ARENA_BATCH: usize = 32;

/// An engine unused for 10 minutes is freed: a training job touches its (model, split) every few
/// seconds, so only abandoned ones (a finished job, a one-off split sweep) reach it, and a restart
/// costs its sessions and first runs (0.3-0.4 s for ResNet-sized prefixes: the memory model and
/// prefix check its first start found are kept, `engine::Measured`).
pub(crate) const DEFAULT_ENGINE_IDLE_SECS: u64 = 600;
/// Default pushdown memory budget: 1 GiB, a quarter of a small 4 GiB storage node, enough for two
/// ResNet-18 sessions and a few dozen 224x224 samples in flight at any split.
pub(crate) const DEFAULT_MEMORY_BUDGET: u64 = 1024 * 1024 * 1024;
/// Default bound on waiting for memory: 30 s, below common S3 client read timeouts (60 s).
pub(crate) const DEFAULT_MAX_WAIT_MS: u64 = 30_000;

/// Default memory tier: 256 MiB holds about 2,600 ResNet-18 `layer4` tensors (100 KiB each in f32),
/// a small dataset's epoch, while leaving most of a small storage node's memory to the store.
pub(crate) const DEFAULT_CACHE_MEMORY_BYTES: u64 = 256 * 1024 * 1024;

/// `[pushdown.cache]`: see `crate::cache` for the freshness rules.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CacheSettings {
    pub enabled: bool,
    /// Memory tier size in bytes (tensors plus a small per-entry charge).
    pub(crate) memory_bytes: u64,
    /// Memory tier policy when full: `pin` (keep what is cached), `tinylfu` or `lru`.
    pub(crate) policy: crate::cache::Policy,
    /// Seconds after which a memory entry nobody read is dropped (lets a finished dataset go).
    pub(crate) idle_expiry_secs: u64,
    /// How long a validated entry is served without asking the backend; 0 asks on every request
    /// (a conditional GET: one round trip, no object bytes).
    pub revalidate_after_ms: u64,
    /// Directory of the disk tier; none disables it.
    pub(crate) disk_dir: Option<PathBuf>,
    /// Disk tier size in bytes.
    pub(crate) disk_bytes: u64,
}

impl Default for CacheSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            memory_bytes: DEFAULT_CACHE_MEMORY_BYTES,
            policy: crate::cache::Policy::default(),
            revalidate_after_ms: 0,
            // An hour: longer than an epoch of the datasets this targets, so a scan keeps its
            // entries alive, short enough that yesterday's dataset does not pin memory today.
            idle_expiry_secs: 3600,
            disk_dir: None,
            disk_bytes: 0,
        }
    }
}

impl CacheSettings {
    /// The cache's configuration, or `None` when disabled.
    #[must_use]
    pub(crate) fn cache_config(&self) -> Option<crate::cache::CacheConfig> {
        self.enabled.then(|| crate::cache::CacheConfig {
            memory_bytes: self.memory_bytes,
            policy: self.policy,
            revalidate_after: Duration::from_millis(self.revalidate_after_ms),
            idle_expiry: Duration::from_secs(self.idle_expiry_secs),
            disk: self.disk_dir.clone().map(|dir| crate::cache::DiskConfig { dir, max_bytes: self.disk_bytes }),
        })
    }
}

/// `[[pushdown.aliases]]`: reading from `bucket` is a pushdown GET on `target` with this model
/// and split (and optionally format and dtype).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AliasConfig {
    pub bucket: String,
    pub target: String,
    pub model: String,
    pub split: String,
    pub format: Option<String>,
    pub dtype: Option<String>,
    /// A Parquet target's input column (default `image`).
    pub column: Option<String>,
}

impl AliasConfig {
    /// The pushdown request this alias stands for (validated like a request's fields).
    ///
    /// # Errors
    /// A bad format or dtype, naming the field.
    pub(crate) fn spec(&self) -> Result<crate::pushdown::spec::PushdownSpec, ConfigError> {
        alias_spec("pushdown.aliases", &self.model, &self.split, [&self.format, &self.dtype, &self.column])
    }
}

/// `[[pushdown.alias_endpoints]]`: every object read on the listener `listen` is a pushdown of the
/// same bucket and key with this model and split (and optionally format and dtype). The path
/// stays the store's, so a request is signed as a plain read of the real bucket is: the store
/// can check the caller's own signature (transparent identity mode), and readers that cannot
/// add a query parameter or header need only an endpoint URL (ADR 0029).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AliasEndpointConfig {
    pub listen: SocketAddr,
    pub model: String,
    pub split: String,
    pub format: Option<String>,
    pub dtype: Option<String>,
    /// A Parquet source's input column (default `image`).
    pub column: Option<String>,
}

impl AliasEndpointConfig {
    /// The pushdown request this endpoint stands for (validated like a request's fields).
    ///
    /// # Errors
    /// A bad format or dtype, naming the field.
    pub(crate) fn spec(&self) -> Result<crate::pushdown::spec::PushdownSpec, ConfigError> {
        alias_spec("pushdown.alias_endpoints", &self.model, &self.split, [&self.format, &self.dtype, &self.column])
    }
}

/// The pushdown request an alias (`key`) stands for, parsed as a request's query would be.
fn alias_spec(
    key: &'static str,
    model: &str,
    split: &str,
    [format, dtype, column]: [&Option<String>; 3],
) -> Result<crate::pushdown::spec::PushdownSpec, ConfigError> {
    let mut q = format!("tensorgate-model={model}&tensorgate-split={split}");
    if let Some(f) = format {
        q.push_str(&format!("&tensorgate-format={f}"));
    }
    if let Some(d) = dtype {
        q.push_str(&format!("&tensorgate-dtype={d}"));
    }
    if let Some(c) = column {
        let c = percent_encoding::utf8_percent_encode(c, percent_encoding::NON_ALPHANUMERIC);
        q.push_str(&format!("&tensorgate-column={c}"));
    }
    crate::pushdown::spec::parse(&http::HeaderMap::new(), Some(&q))
        .map_err(|e| invalid(key, e.to_string()))?
        .ok_or_else(|| invalid(key, "model and split are required"))
}

impl PushdownSettings {
    fn check(&self) -> Result<(), ConfigError> {
        let p = self;
        if p.queue_capacity == 0
            || p.max_batch == 0
            || p.intra_threads == 0
            || p.workers == 0
            || p.max_object_bytes == 0
            || p.max_request_pixels == 0
        {
            return Err(invalid(
                "pushdown",
                "queue_capacity, max_batch, intra_threads, max_object_bytes and max_request_pixels must be positive",
            ));
        }
        for (key, v) in [
            ("pushdown.source_timeout_secs", p.source_timeout_secs),
            ("pushdown.engine_idle_secs", p.engine_idle_secs),
            ("pushdown.memory_budget", p.memory_budget),
            ("pushdown.max_model_bytes", p.max_model_bytes),
        ] {
            if v == 0 {
                return Err(invalid(key, "must be positive"));
            }
        }
        if p.ort_arena == OrtArena::Kept && p.max_batch > MAX_ARENA_BATCH {
            return Err(invalid(
                "pushdown.max_batch",
                format!(
                    "at most {MAX_ARENA_BATCH} with pushdown.ort_arena = \"kept\" (each engine's start runs every batch size once)"
                ),
            ));
        }
        if p.cache.idle_expiry_secs == 0 {
            return Err(invalid("pushdown.cache.idle_expiry_secs", "must be positive"));
        }
        if p.cache.disk_dir.is_some() && p.cache.disk_bytes == 0 {
            return Err(invalid("pushdown.cache.disk_bytes", "must be positive when disk_dir is set"));
        }
        for a in &p.aliases {
            if a.bucket == a.target {
                return Err(invalid("pushdown.aliases", format!("alias {} must differ from its target", a.bucket)));
            }
        }
        Ok(())
    }

    /// The pushdown service's settings, reporting to `metrics`.
    #[must_use]
    pub(crate) fn pushdown_config(&self, metrics: crate::metrics::Metrics) -> crate::pushdown::PushdownConfig {
        crate::pushdown::PushdownConfig {
            models_dir: self.models_dir.clone(),
            ort_library: self.ort_library.clone(),
            engine: crate::pushdown::engine::EngineConfig {
                queue_capacity: self.queue_capacity,
                max_batch: self.max_batch,
                intra_threads: self.intra_threads,
                workers: self.workers,
                ort_arena: self.ort_arena,
            },
            engine_idle: Duration::from_secs(self.engine_idle_secs),
            max_object_bytes: self.max_object_bytes,
            load_limits: crate::pushdown::registry::LoadLimits { max_model_bytes: self.max_model_bytes },
            models_refresh: (self.models_refresh_secs > 0).then(|| Duration::from_secs(self.models_refresh_secs)),
            // Reached through the backend's endpoint: see `Config::models_store`.
            models_store: None,
            source_timeout: Duration::from_secs(self.source_timeout_secs),
            max_image_pixels: self.max_image_pixels,
            max_request_pixels: self.max_request_pixels,
            preprocess_threads: self.preprocess_threads,
            inference_runs: self.inference_runs,
            governor: crate::pushdown::governor::GovernorConfig {
                budget: self.memory_budget,
                adaptive: self.adaptation,
                max_wait: Duration::from_millis(self.max_wait_ms),
            },
            metrics,
        }
    }
}

impl Default for PushdownSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            models_dir: PathBuf::from("models"),
            ort_library: None,
            // 256 samples: a few shards' worth; beyond that, waiting is better done by the client.
            queue_capacity: 256,
            max_batch: 16,
            intra_threads: 1,
            // One per core on the 2-core storage nodes this targets; raise with the core count.
            workers: 2,
            // Per run: the one-core floor at about 1.35x the memory that "off" reserves (ADR 0015).
            ort_arena: OrtArena::default(),
            engine_idle_secs: DEFAULT_ENGINE_IDLE_SECS,
            // A model copied into the directory is served within seconds; a rescan of unchanged
            // models costs a listing and a `stat` per file.
            models_refresh_secs: 5,
            max_model_bytes: crate::pushdown::registry::DEFAULT_MAX_MODEL_BYTES,
            models_store: None,
            max_object_bytes: crate::pushdown::DEFAULT_MAX_OBJECT_BYTES,
            max_image_pixels: crate::pushdown::preprocess::DEFAULT_MAX_PIXELS,
            max_request_pixels: crate::pushdown::preprocess::DEFAULT_MAX_REQUEST_PIXELS,
            preprocess_threads: 0,
            inference_runs: 0,
            aliases: Vec::new(),
            alias_endpoints: Vec::new(),
            cache: CacheSettings::default(),
            memory_budget: DEFAULT_MEMORY_BUDGET,
            adaptation: true,
            max_wait_ms: DEFAULT_MAX_WAIT_MS,
            source_timeout_secs: DEFAULT_SOURCE_TIMEOUT_SECS,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogFormat {
    #[default]
    Plain,
    Json,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    pub(crate) format: LogFormat,
    /// `tracing` filter directive, e.g. `info` or `tensorgate=debug`.
    pub(crate) filter: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self { format: LogFormat::Plain, filter: "info".into() }
    }
}

/// Overrides from flags and environment (clap fills both); `None` leaves the file's value.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct Overrides {
    /// TOML config file.
    #[arg(long, env = "TENSORGATE_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// S3 listen address.
    #[arg(long, env = "TENSORGATE_LISTEN")]
    pub(crate) listen: Option<SocketAddr>,
    /// Admin listen address (/metrics, /healthz, /readyz).
    #[arg(long, env = "TENSORGATE_ADMIN_LISTEN")]
    pub(crate) admin_listen: Option<SocketAddr>,
    /// Domain for virtual-host-style addressing (repeatable).
    #[arg(long = "domain", env = "TENSORGATE_DOMAINS", value_delimiter = ',')]
    pub(crate) domains: Vec<String>,
    /// Allow unsigned requests (a switch; `--allow-anonymous false` turns a file's setting off).
    #[arg(long, env = "TENSORGATE_ALLOW_ANONYMOUS", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) allow_anonymous: Option<bool>,
    /// Client access key (adds one credential).
    #[arg(long, env = "TENSORGATE_ACCESS_KEY")]
    pub(crate) access_key: Option<String>,
    /// Client secret key for --access-key (visible in `ps`: prefer --secret-key-file or the
    /// variable).
    #[arg(long, env = "TENSORGATE_SECRET_KEY", hide_env_values = true, conflicts_with = "secret_key_file")]
    pub(crate) secret_key: Option<String>,
    /// File holding the client secret key for --access-key (its first line).
    #[arg(long, env = "TENSORGATE_SECRET_KEY_FILE", requires = "access_key")]
    pub(crate) secret_key_file: Option<PathBuf>,
    /// Backend kind.
    #[arg(long, env = "TENSORGATE_BACKEND")]
    pub(crate) backend: Option<BackendKind>,
    /// Who authenticates clients: auto, transparent (the store) or terminating (the gateway).
    #[arg(long, env = "TENSORGATE_BACKEND_IDENTITY")]
    pub(crate) backend_identity: Option<IdentityMode>,
    /// Directory served by the fs backend.
    #[arg(long, env = "TENSORGATE_BACKEND_ROOT")]
    pub(crate) backend_root: Option<PathBuf>,
    /// Endpoint URL of the s3 backend (implies --backend s3).
    #[arg(long, env = "TENSORGATE_BACKEND_ENDPOINT")]
    pub(crate) backend_endpoint: Option<String>,
    /// Extra CA certificates (PEM) for an https backend.
    #[arg(long, env = "TENSORGATE_BACKEND_CA_FILE")]
    pub(crate) backend_ca_file: Option<PathBuf>,
    /// The store checks aws-chunked trailing checksums itself (SeaweedFS, MinIO, AWS); a switch.
    #[arg(long, env = "TENSORGATE_BACKEND_TRAILING_CHECKSUMS", num_args = 0..=1, default_missing_value = "true")]
    pub(crate) backend_trailing_checksums: Option<bool>,
    /// Region the backend signs for.
    #[arg(long, env = "TENSORGATE_BACKEND_REGION")]
    pub(crate) backend_region: Option<String>,
    /// Backend access key.
    #[arg(long, env = "TENSORGATE_BACKEND_ACCESS_KEY")]
    pub(crate) backend_access_key: Option<String>,
    /// Backend secret key (visible in `ps`: prefer --backend-secret-key-file or the variable).
    #[arg(
        long,
        env = "TENSORGATE_BACKEND_SECRET_KEY",
        hide_env_values = true,
        conflicts_with = "backend_secret_key_file"
    )]
    pub(crate) backend_secret_key: Option<String>,
    /// File holding the backend secret key (its first line).
    #[arg(long, env = "TENSORGATE_BACKEND_SECRET_KEY_FILE")]
    pub(crate) backend_secret_key_file: Option<PathBuf>,
    /// Directory of model manifests (pushdown).
    #[arg(long, env = "TENSORGATE_MODELS_DIR")]
    pub(crate) models_dir: Option<PathBuf>,
    /// ONNX Runtime shared library (pushdown).
    #[arg(long, env = "TENSORGATE_ORT_LIBRARY")]
    pub(crate) ort_library: Option<PathBuf>,
    /// Unix socket where the running gateway hands its listening sockets to a new process
    /// started with the same setting (upgrades without dropping a connection).
    #[arg(long, env = "TENSORGATE_UPGRADE_SOCKET")]
    pub(crate) upgrade_socket: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "TENSORGATE_LOG_FORMAT")]
    pub(crate) log_format: Option<LogFormat>,
    /// Log filter (overrides the file; RUST_LOG-style).
    #[arg(long, env = "TENSORGATE_LOG")]
    pub(crate) log: Option<String>,
    /// This member's cluster id (overrides `cluster.node_id`).
    #[arg(long, env = "TENSORGATE_CLUSTER_NODE_ID")]
    pub(crate) cluster_node_id: Option<String>,
}

impl Config {
    /// The file's keys (if any), then every `TENSORGATE__*` variable of `env` over them
    /// ([`ENV_KEY_PREFIX`]). A variable's value is read as a TOML value where it is one (`4096`,
    /// `true`, `["a", "b"]`, `"quoted"`), else as a string (`per-run`, `http://host:8333`); keys
    /// are checked as the file's are, so a misspelt variable is refused naming it.
    ///
    /// # Errors
    /// Unreadable file, unknown or mistyped key.
    pub(crate) fn layered(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let text = match path {
            Some(p) => std::fs::read_to_string(p).map_err(|source| ConfigError::Read { path: p.into(), source })?,
            None => String::new(),
        };
        let parse_error = |message| ConfigError::Parse { path: path.unwrap_or(Path::new("")).into(), message };
        let vars: Vec<(String, String)> = env.into_iter().filter(|(n, _)| n.starts_with(ENV_KEY_PREFIX)).collect();
        if vars.is_empty() {
            // The file alone: the parser's errors point at its line and column.
            return Self::from_toml(&text).map_err(parse_error);
        }
        let mut table = text.parse::<toml::Table>().map_err(|e| parse_error(e.to_string()))?;
        let mut from_env = Vec::new();
        for (name, value) in vars {
            let Some(key) = name.strip_prefix(ENV_KEY_PREFIX) else { continue };
            let path: Vec<String> = key.split("__").map(str::to_ascii_lowercase).collect();
            if path.iter().any(String::is_empty) {
                return Err(ConfigError::Environment(format!("{name} does not name a key")));
            }
            set_key(&mut table, &path, env_value(&value)).map_err(ConfigError::Environment)?;
            from_env.push(name);
        }
        toml::Value::Table(table).try_into().map_err(|e: toml::de::Error| {
            ConfigError::Environment(format!("{} (set: {})", e.to_string().trim_end(), from_env.join(", ")))
        })
    }

    /// Parses TOML text.
    ///
    /// # Errors
    /// The parser's message, which names the key.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// File (if any), then `TENSORGATE__*` variables, then the flags and their variables; then
    /// validation.
    ///
    /// # Errors
    /// Any [`ConfigError`].
    pub(crate) fn load(o: &Overrides) -> Result<Self, ConfigError> {
        let mut c = Self::layered(o.config.as_deref(), std::env::vars())?;
        c.apply(o);
        c.validate()?;
        Ok(c)
    }

    fn apply(&mut self, o: &Overrides) {
        fn set<T: Clone>(dst: &mut T, src: &Option<T>) {
            if let Some(v) = src {
                dst.clone_from(v);
            }
        }
        set(&mut self.listen, &o.listen);
        set(&mut self.admin_listen, &o.admin_listen);
        set(&mut self.allow_anonymous, &o.allow_anonymous);
        set(&mut self.backend.kind, &o.backend);
        set(&mut self.backend.identity, &o.backend_identity);
        set(&mut self.backend.root, &o.backend_root);
        set(&mut self.backend.region, &o.backend_region);
        set(&mut self.backend.trailing_checksums, &o.backend_trailing_checksums);
        set(&mut self.log.format, &o.log_format);
        if let Some(p) = &o.upgrade_socket {
            self.upgrade_socket = Some(p.clone());
        }
        set(&mut self.log.filter, &o.log);
        if !o.domains.is_empty() {
            self.domains.clone_from(&o.domains);
        }
        if let Some(e) = &o.backend_endpoint {
            self.backend.endpoint = Some(e.clone());
            if o.backend.is_none() {
                self.backend.kind = BackendKind::S3;
            }
        }
        set(&mut self.pushdown.models_dir, &o.models_dir);
        if let Some(lib) = &o.ort_library {
            self.pushdown.ort_library = Some(lib.clone());
        }
        if let Some(ca) = &o.backend_ca_file {
            self.backend.ca_file = Some(ca.clone());
        }
        if let Some(k) = &o.backend_access_key {
            self.backend.access_key = Some(k.clone());
        }
        if let Some(s) = &o.backend_secret_key {
            self.backend.secret_key = Some(SecretKey::new(s.clone()));
            self.backend.secret_key_file = None;
        }
        if let Some(f) = &o.backend_secret_key_file {
            self.backend.secret_key_file = Some(f.clone());
            self.backend.secret_key = None;
        }
        if let (Some(c), Some(id)) = (&mut self.cluster, &o.cluster_node_id) {
            c.node_id.clone_from(id);
        }
        if let Some(ak) = &o.access_key {
            self.credentials.push(CredentialConfig {
                access_key: ak.clone(),
                secret_key: o.secret_key.clone().map(SecretKey::new),
                secret_key_file: o.secret_key_file.clone(),
                ..CredentialConfig::default()
            });
        }
    }

    /// Semantic checks, each naming its key, and every section built into what it configures.
    ///
    /// # Errors
    /// The first invalid key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.runtime().map(drop)
    }

    /// Each section, checked, as the runtime type it configures, built once: what
    /// `crate::server` wires together (the pushdown service's settings need the metrics it
    /// reports to: [`PushdownSettings::pushdown_config`]).
    ///
    /// # Errors
    /// The first invalid key, or a secret file that cannot be read.
    pub(crate) fn runtime(&self) -> Result<Runtime, ConfigError> {
        self.check()?;
        // Read once: the hop credential both signs this member's hops and verifies its peers'.
        let cluster_secret = self.cluster_secret()?;
        Ok(Runtime {
            credentials: self.credentials_with(cluster_secret.clone())?,
            front: self.front_config()?,
            backend: self.backend_setup()?,
            edge: self.edge.edge_config(),
            cache: self.pushdown.cache.cache_config(),
            cluster_secret,
            models_store: self.models_store()?,
        })
    }

    /// `[pushdown.models_store]` with the backend's endpoint and its key read: its own, or the
    /// backend's (transparent mode holds none, so there it must name one).
    fn models_store(&self) -> Result<Option<crate::pushdown::ModelsStoreConfig>, ConfigError> {
        let Some(m) = &self.pushdown.models_store else { return Ok(None) };
        let b = &self.backend;
        if b.kind != BackendKind::S3 {
            return Err(invalid(
                "pushdown.models_store",
                "needs the s3 backend (the fs backend's models go in models_dir)",
            ));
        }
        if m.bucket.is_empty() || m.bucket.contains('/') {
            return Err(invalid("pushdown.models_store.bucket", "must name a bucket"));
        }
        let models_dir = &self.pushdown.models_dir;
        if m.mirror_dir.starts_with(models_dir) || models_dir.starts_with(&m.mirror_dir) {
            return Err(invalid(
                "pushdown.models_store.mirror_dir",
                "must be a directory of its own, apart from models_dir (the mirror removes what the bucket does not hold)",
            ));
        }
        if !m.prefix.is_empty() && !m.prefix.ends_with('/') {
            return Err(invalid(
                "pushdown.models_store.prefix",
                "must end with '/' (models are <prefix><name>/manifest.toml)",
            ));
        }
        let key = match &m.access_key {
            Some(k) if !k.is_empty() => {
                let secret = read_secret(
                    m.secret_key.as_ref(),
                    m.secret_key_file.as_deref(),
                    "pushdown.models_store.secret_key",
                )?;
                (k.clone(), secret)
            }
            _ => self.backend_key()?.ok_or_else(|| {
                invalid(
                    "pushdown.models_store.access_key",
                    "required: the backend has no key of its own to read the bucket with",
                )
            })?,
        };
        let endpoint = self.backend_endpoint()?;
        Ok(Some(crate::pushdown::ModelsStoreConfig {
            endpoint,
            region: b.region.clone(),
            bucket: m.bucket.clone(),
            prefix: m.prefix.clone(),
            key,
            mirror_dir: m.mirror_dir.clone(),
            connect_timeout: Duration::from_millis(b.connect_timeout_ms),
            response_timeout: Duration::from_secs(b.response_timeout_secs),
            ca_file: b.ca_file.clone(),
        }))
    }

    /// The checks no section's build makes.
    fn check(&self) -> Result<(), ConfigError> {
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be positive"));
        }
        if self.max_in_flight == 0 {
            return Err(invalid("max_in_flight", "must be positive"));
        }
        if self.listen == self.admin_listen && self.listen.port() != 0 {
            return Err(invalid("admin_listen", "must differ from listen"));
        }
        self.check_alias_endpoints()?;
        if let Some(d) = self.domains.iter().find(|d| d.is_empty() || d.contains('/') || d.contains(':')) {
            return Err(invalid("domains", format!("{d:?} is not a host name")));
        }
        if let Some(c) = &self.cluster {
            check_cluster(c)?;
        }
        self.edge.check()?;
        self.pushdown.check()?;
        self.check_backend()
    }

    /// `[[pushdown.alias_endpoints]]`: at most [`MAX_ALIAS_ENDPOINTS`], each on an address of its
    /// own (a port of 0 is never shared: the system picks one per listener), served only with
    /// pushdown on.
    fn check_alias_endpoints(&self) -> Result<(), ConfigError> {
        let endpoints = &self.pushdown.alias_endpoints;
        if endpoints.is_empty() {
            return Ok(());
        }
        if !self.pushdown.enabled {
            return Err(invalid("pushdown.alias_endpoints", "serve pushdowns: set pushdown.enabled = true"));
        }
        if endpoints.len() > MAX_ALIAS_ENDPOINTS {
            return Err(invalid("pushdown.alias_endpoints", format!("at most {MAX_ALIAS_ENDPOINTS}")));
        }
        let mut taken = vec![self.listen, self.admin_listen];
        for e in endpoints {
            if e.listen.port() != 0 && taken.contains(&e.listen) {
                return Err(invalid(
                    "pushdown.alias_endpoints",
                    format!("{} is already listened on (listen, admin_listen or another alias endpoint)", e.listen),
                ));
            }
            taken.push(e.listen);
        }
        Ok(())
    }

    /// `[backend]`, and what the identity mode it resolves to cannot combine with.
    fn check_backend(&self) -> Result<(), ConfigError> {
        let b = &self.backend;
        if b.permit_timeout_ms == 0 {
            return Err(invalid("backend.permit_timeout_ms", "must be positive"));
        }
        if b.max_concurrency == 0 {
            return Err(invalid("backend.max_concurrency", "must be positive"));
        }
        if b.kind == BackendKind::S3 {
            let e = b.endpoint.as_deref().ok_or_else(|| invalid("backend.endpoint", "required for the s3 backend"))?;
            let uri: http::Uri = e.parse().map_err(|err| invalid("backend.endpoint", format!("{e:?}: {err}")))?;
            if !matches!(uri.scheme_str(), Some("http" | "https")) {
                return Err(invalid("backend.endpoint", "must start with http:// or https://"));
            }
            if let Some(ca) = &b.ca_file
                && !ca.is_file()
            {
                return Err(invalid("backend.ca_file", format!("{} is not a readable file", ca.display())));
            }
            if uri.authority().is_none() {
                return Err(invalid("backend.endpoint", "missing host"));
            }
            if self.transparent() {
                self.validate_transparent(&uri)?;
            } else if b.access_key.as_deref().is_none_or(str::is_empty)
                && (self.credentials.is_empty() || self.credentials.iter().any(|c| c.store_access_key.is_none()))
            {
                return Err(invalid(
                    "backend.access_key",
                    "required for the s3 backend in terminating identity mode (backend.identity), unless every [[credentials]] entry has its own store_access_key",
                ));
            }
        } else if b.identity == IdentityMode::Transparent {
            return Err(invalid("backend.identity", "transparent needs the s3 backend (a store with its own users)"));
        }
        Ok(())
    }

    /// The S3 front end's settings: addressing, limits, deadlines, alias buckets, identity mode.
    fn front_config(&self) -> Result<crate::proxy::FrontConfig, ConfigError> {
        Ok(crate::proxy::FrontConfig {
            domains: self.domains.clone(),
            allow_anonymous: self.allow_anonymous,
            max_body_bytes: self.max_body_bytes,
            max_in_flight: self.max_in_flight,
            stall_timeout: Duration::from_secs(self.edge.stall_timeout_secs),
            request_timeout: Duration::from_secs(self.edge.request_timeout_secs),
            transparent: self.transparent(),
            aliases: self
                .pushdown
                .aliases
                .iter()
                .map(|a| {
                    Ok((a.bucket.clone(), crate::proxy::AliasBucket { target: a.target.clone(), spec: a.spec()? }))
                })
                .collect::<Result<_, ConfigError>>()?,
            endpoints: self.pushdown.alias_endpoints.iter().map(AliasEndpointConfig::spec).collect::<Result<_, _>>()?,
        })
    }

    /// `backend.endpoint` as a URI (its form was checked with `[backend]`).
    fn backend_endpoint(&self) -> Result<http::Uri, ConfigError> {
        self.backend
            .endpoint
            .as_deref()
            .unwrap_or_default()
            .parse()
            .map_err(|e| invalid("backend.endpoint", format!("{e}")))
    }

    /// The backend to open: a directory, or a store with its keys read.
    fn backend_setup(&self) -> Result<BackendSetup, ConfigError> {
        let b = &self.backend;
        let tenant_keys = self.tenant_store_keys()?; // refuses store keys for the fs backend
        if b.kind == BackendKind::Fs {
            return Ok(BackendSetup::Fs(b.root.clone()));
        }
        let endpoint = self.backend_endpoint()?;
        Ok(BackendSetup::S3(Box::new(S3BackendConfig {
            endpoint,
            region: b.region.clone(),
            key: self.backend_key()?,
            tenant_keys,
            connect_timeout: Duration::from_millis(b.connect_timeout_ms),
            response_timeout: Duration::from_secs(b.response_timeout_secs),
            max_concurrency: b.max_concurrency,
            permit_timeout: Duration::from_millis(b.permit_timeout_ms),
            retry: self.retry_policy(),
            ca_file: b.ca_file.clone(),
            trailing_checksums: b.trailing_checksums,
            checks_payload_hash: b.checks_payload_hash,
        })))
    }

    /// Whether the store, not the gateway, authenticates clients (`backend.identity`, resolved).
    #[must_use]
    pub(crate) fn transparent(&self) -> bool {
        self.backend.kind == BackendKind::S3
            && match self.backend.identity {
                IdentityMode::Transparent => true,
                IdentityMode::Terminating => false,
                IdentityMode::Auto => self.backend.access_key.is_none() && self.credentials.is_empty(),
            }
    }

    /// What transparent mode cannot combine with (each named, with the reason).
    fn validate_transparent(&self, endpoint: &http::Uri) -> Result<(), ConfigError> {
        if !self.credentials.is_empty() {
            return Err(invalid(
                "credentials",
                "transparent identity mode holds no client secrets: the store authenticates (remove [[credentials]] or set backend.identity = \"terminating\")",
            ));
        }
        if endpoint.path() != "/" && !endpoint.path().is_empty() {
            return Err(invalid(
                "backend.endpoint",
                "a path prefix would change the request target the client signed (transparent identity mode)",
            ));
        }
        if !self.pushdown.aliases.is_empty() {
            return Err(invalid(
                "pushdown.aliases",
                "an alias bucket is not a bucket of the store, so a request signed for it cannot be forwarded as signed (transparent identity mode): use [[pushdown.alias_endpoints]]",
            ));
        }
        Ok(())
    }

    /// The client credentials in force: the configured ones or, when none are configured, anonymous
    /// access is off and the gateway listens on loopback only, the published development pair.
    ///
    /// # Errors
    /// A credential without a readable secret, or no way to authenticate on a non-loopback address.
    #[cfg(test)]
    pub(crate) fn credential_store(&self) -> Result<CredentialStore, ConfigError> {
        self.credentials_with(self.cluster_secret()?)
    }

    /// [`Config::credential_store`], given the cluster hop secret already read.
    fn credentials_with(&self, cluster_secret: Option<SecretKey>) -> Result<CredentialStore, ConfigError> {
        let mut store = CredentialStore::default();
        if self.transparent() {
            // The store authenticates: the gateway holds no client secret, no development key.
            return Ok(store);
        }
        for c in &self.credentials {
            if c.access_key.is_empty() {
                return Err(invalid("credentials.access_key", "must not be empty"));
            }
            let secret = read_secret(c.secret_key.as_ref(), c.secret_key_file.as_deref(), "credentials.secret_key")?;
            if secret.expose() == DEV_SECRET_KEY && !self.listen.ip().is_loopback() {
                return Err(invalid(
                    "credentials.secret_key",
                    "the development secret is published; it is accepted on a loopback listen address only",
                ));
            }
            store.insert(c.access_key.clone(), secret);
        }
        if store.is_empty() && !self.allow_anonymous {
            if !self.listen.ip().is_loopback() {
                return Err(invalid(
                    "credentials",
                    "no client credentials configured and allow_anonymous is false; refusing to listen beyond loopback with the development key",
                ));
            }
            // The published pair never acts with a store's key: a copy of a documented file with
            // only the store filled in must not log anyone in.
            if self.backend.kind != BackendKind::Fs {
                return Err(invalid(
                    "credentials",
                    "terminating mode in front of a store needs client credentials of its own ([[credentials]], or --access-key with --secret-key-file); the development key serves only the embedded fs backend. For a store with its own users, use transparent mode (no backend.access_key)",
                ));
            }
            store.insert(DEV_ACCESS_KEY.to_owned(), SecretKey::new(DEV_SECRET_KEY.to_owned()));
        }
        if let Some(secret) = cluster_secret {
            let key = &self.cluster.as_ref().expect("a secret implies [cluster]").access_key;
            store.insert(key.clone(), secret);
        }
        Ok(store)
    }

    /// The cluster hop secret, if `[cluster]` has one.
    ///
    /// # Errors
    /// An unreadable `cluster.secret_key_file`.
    pub(crate) fn cluster_secret(&self) -> Result<Option<SecretKey>, ConfigError> {
        match &self.cluster {
            Some(c) if c.secret_key.is_some() || c.secret_key_file.is_some() => {
                read_secret(c.secret_key.as_ref(), c.secret_key_file.as_deref(), "cluster.secret_key").map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Each client credential's own store key (`store_access_key`), by client access key.
    ///
    /// # Errors
    /// A store key without a readable secret, or one given for the `fs` backend.
    pub(crate) fn tenant_store_keys(&self) -> Result<HashMap<String, (String, SecretKey)>, ConfigError> {
        let mut out = HashMap::new();
        for c in &self.credentials {
            let Some(store_key) = &c.store_access_key else {
                if c.store_secret_key.is_some() || c.store_secret_key_file.is_some() {
                    return Err(invalid("credentials.store_access_key", "a store secret needs its store_access_key"));
                }
                continue;
            };
            if self.backend.kind != BackendKind::S3 || store_key.is_empty() {
                return Err(invalid("credentials.store_access_key", "a non-empty store key, for the s3 backend only"));
            }
            let secret = read_secret(
                c.store_secret_key.as_ref(),
                c.store_secret_key_file.as_deref(),
                "credentials.store_secret_key",
            )?;
            out.insert(c.access_key.clone(), (store_key.clone(), secret));
        }
        Ok(out)
    }

    /// The store's key, when one is configured (validated before).
    ///
    /// # Errors
    /// Missing or unreadable secret.
    pub(crate) fn backend_key(&self) -> Result<Option<(String, SecretKey)>, ConfigError> {
        match &self.backend.access_key {
            Some(k) if !k.is_empty() => {
                let secret = read_secret(
                    self.backend.secret_key.as_ref(),
                    self.backend.secret_key_file.as_deref(),
                    "backend.secret_key",
                )?;
                Ok(Some((k.clone(), secret)))
            }
            _ => Ok(None),
        }
    }

    /// The backend retry policy.
    #[must_use]
    pub(crate) fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_retries: self.backend.max_retries,
            budget: Duration::from_secs(self.backend.retry_budget_secs),
            ..RetryPolicy::default()
        }
    }
}

/// `[cluster]`: a member named, members or DNS to find them, URLs the probes can use.
fn check_cluster(c: &ClusterSettings) -> Result<(), ConfigError> {
    if c.node_id.is_empty() {
        return Err(invalid("cluster.node_id", "is required"));
    }
    if c.members.is_empty() && c.dns.is_none() {
        return Err(invalid("cluster.members", "list the members, or set cluster.dns"));
    }
    if c.dns.is_none() && !c.members.iter().any(|m| m.id == c.node_id) {
        return Err(invalid("cluster.node_id", format!("{:?} is not one of cluster.members", c.node_id)));
    }
    for m in &c.members {
        for (key, url) in [("cluster.members.s3", &m.s3), ("cluster.members.admin", &m.admin)] {
            if url.parse::<http::Uri>().map_or(true, |u| u.scheme_str() != Some("http") || u.host().is_none()) {
                return Err(invalid(key, format!("{url:?} is not an http://host:port URL")));
            }
        }
    }
    if c.refresh_secs == 0 || c.probe_timeout_ms == 0 {
        return Err(invalid("cluster.refresh_secs", "refresh_secs and probe_timeout_ms must be positive"));
    }
    Ok(())
}

/// An environment variable's value as a TOML value: a number, boolean, array, table or quoted
/// string where it reads as one, else the text itself.
fn env_value(raw: &str) -> toml::Value {
    format!("v = {raw}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_owned()))
}

/// Sets `path` in `table`, making the sections on the way.
fn set_key(table: &mut toml::Table, path: &[String], value: toml::Value) -> Result<(), String> {
    let (last, sections) = path.split_last().ok_or("an empty key")?;
    let mut at = table;
    for s in sections {
        at = match at.entry(s.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new())) {
            toml::Value::Table(t) => t,
            _ => return Err(format!("`{}` is not a section", path.join("."))),
        };
    }
    at.insert(last.clone(), value);
    Ok(())
}

/// A secret from its inline value or its file (first line), refused when a document published it
/// ([`PUBLISHED_SECRETS`]).
fn read_secret(inline: Option<&SecretKey>, file: Option<&Path>, key: &'static str) -> Result<SecretKey, ConfigError> {
    let secret = match (inline, file) {
        (Some(s), None) if !s.expose().is_empty() => Ok(s.clone()),
        (None, Some(p)) => std::fs::read_to_string(p)
            .map(|s| SecretKey::new(s.trim_end().to_owned()))
            .map_err(|e| invalid(key, format!("cannot read secret file {}: {e}", p.display()))),
        (Some(_), Some(_)) => Err(invalid(key, "set either the secret or the secret file, not both")),
        _ => Err(invalid(key, "missing")),
    }?;
    if PUBLISHED_SECRETS.contains(&secret.expose()) {
        return Err(invalid(key, "is an example that tensorgate's documentation publishes; set a secret of your own"));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect()
    }

    #[test]
    fn any_key_can_come_from_the_environment() {
        let dir = std::env::temp_dir().join(format!("tg-config-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("c.toml");
        std::fs::write(&file, "[pushdown]\nmax_batch = 8\nworkers = 2\n").expect("write");
        let c = Config::layered(
            Some(&file),
            env(&[
                ("TENSORGATE__PUSHDOWN__MAX_BATCH", "16"),
                ("TENSORGATE__PUSHDOWN__ORT_ARENA", "per-run"),
                ("TENSORGATE__PUSHDOWN__CACHE__MEMORY_BYTES", "1048576"),
                ("TENSORGATE__DOMAINS", r#"["s3.example.com"]"#),
                ("TENSORGATE__BACKEND__ENDPOINT", "http://127.0.0.1:8333"),
                ("TENSORGATE_LISTEN", "ignored: a flag's variable, applied by clap"),
                ("HOME", "/root"),
            ]),
        )
        .expect("layered");
        // The environment wins over the file; the file's other keys stay.
        assert_eq!((c.pushdown.max_batch, c.pushdown.workers), (16, 2));
        assert_eq!(c.pushdown.ort_arena, OrtArena::PerRun);
        assert_eq!(c.pushdown.cache.memory_bytes, 1_048_576);
        assert_eq!(c.domains, ["s3.example.com"]);
        assert_eq!(c.backend.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        // Without variables, the file's errors keep pointing at its lines.
        std::fs::write(&file, "[pushdown]\nmax_bach = 8\n").expect("write");
        let e = Config::layered(Some(&file), env(&[])).expect_err("typo").to_string();
        assert!(e.contains("max_bach") && e.contains("line 2"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn a_misspelt_or_mistyped_variable_is_refused_naming_it() {
        let e = Config::layered(None, env(&[("TENSORGATE__PUSHDOWN__MAX_BACH", "16")])).expect_err("typo").to_string();
        assert!(e.contains("max_bach") && e.contains("TENSORGATE__PUSHDOWN__MAX_BACH"), "{e}");
        let e =
            Config::layered(None, env(&[("TENSORGATE__PUSHDOWN__MAX_BATCH", "many")])).expect_err("type").to_string();
        assert!(e.contains("TENSORGATE__PUSHDOWN__MAX_BATCH"), "{e}");
        let e = Config::layered(None, env(&[("TENSORGATE__LISTEN__PORT", "1")])).expect_err("not a section");
        assert!(e.to_string().contains("TENSORGATE__LISTEN__PORT"), "{e}");
        let e = Config::layered(None, env(&[("TENSORGATE____X", "1")])).expect_err("empty segment");
        assert!(e.to_string().contains("does not name a key"), "{e}");
    }

    #[test]
    fn the_example_config_states_the_defaults_and_publishes_no_working_login() {
        let text = include_str!("../config/example.toml");
        let c = Config::from_toml(text).expect("parses");
        c.validate().expect("valid");
        assert_eq!(format!("{c:#?}"), format!("{:#?}", Config::default()), "example.toml must state only the defaults");
        // Its commented example credential, uncommented in a copy pointed at a store, is refused.
        let example = "[[credentials]]\naccess_key = \"example-access-key\"\nsecret_key = \"example-secret-key\"\n";
        let commented: String = example.lines().map(|l| format!("# {l}\n")).collect();
        assert!(text.contains(&commented), "example.toml shows the credential commented out");
        let copy = format!(
            "{example}[backend]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:8333\"\naccess_key = \"k\"\nsecret_key = \"own\"\n"
        );
        let e = Config::from_toml(&copy).expect("toml").validate().expect_err("published secret").to_string();
        assert!(e.contains("credentials.secret_key") && e.contains("publishes"), "{e}");
    }

    #[test]
    fn published_secrets_are_refused_wherever_they_are_configured() {
        let base = "[backend]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:8333\"\n";
        for (text, key) in [
            (
                format!(
                    "{base}access_key = \"k\"\nsecret_key = \"change-me-store-secret\"\n[[credentials]]\naccess_key = \"a\"\nsecret_key = \"own\"\n"
                ),
                "backend.secret_key",
            ),
            (
                format!(
                    "{base}access_key = \"k\"\nsecret_key = \"own\"\n[[credentials]]\naccess_key = \"a\"\nsecret_key = \"CLIENT_SECRET\"\n"
                ),
                "credentials.secret_key",
            ),
            (
                format!(
                    "{base}[[credentials]]\naccess_key = \"a\"\nsecret_key = \"own\"\nstore_access_key = \"s\"\nstore_secret_key = \"STORE_SECRET\"\n"
                ),
                "credentials.store_secret_key",
            ),
        ] {
            let e = Config::from_toml(&text).expect("toml").validate().expect_err("published").to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        // The development secret: on loopback only, configured or implied.
        let dev = format!("[[credentials]]\naccess_key = \"{DEV_ACCESS_KEY}\"\nsecret_key = \"{DEV_SECRET_KEY}\"\n");
        Config::from_toml(&dev).expect("toml").validate().expect("loopback");
        let e = Config::from_toml(&format!("listen = \"0.0.0.0:9000\"\n{dev}"))
            .expect("toml")
            .validate()
            .expect_err("beyond");
        assert!(e.to_string().contains("development secret"), "{e}");
    }

    #[test]
    fn unknown_and_bad_keys_are_named() {
        let e = Config::from_toml("listen = \"127.0.0.1:1\"\nlisen = 1").expect_err("unknown key");
        assert!(e.contains("lisen"), "{e}");
        let c = Config::from_toml("[backend]\nkind = \"s3\"").expect("parses");
        let e = c.validate().expect_err("no endpoint").to_string();
        assert!(e.contains("backend.endpoint"), "{e}");
        let c = Config::from_toml("listen = \"0.0.0.0:9000\"").expect("parses");
        assert!(c.validate().expect_err("no creds").to_string().contains("credentials"));
        // The arena's start-up sweep bounds the batch; without the arena it is free.
        let c = Config::from_toml("[pushdown]\nort_arena = true\nmax_batch = 33").expect("parses");
        assert!(c.validate().expect_err("sweep too long").to_string().contains("pushdown.max_batch"));
        let c = Config::from_toml("[pushdown]\nort_arena = false\nmax_batch = 33").expect("parses");
        c.validate().expect("no sweep without the arena");
        // The setting by name; the boolean of earlier versions still means off / kept.
        for (text, mode) in [
            ("\"off\"", OrtArena::Off),
            ("\"per-run\"", OrtArena::PerRun),
            ("\"kept\"", OrtArena::Kept),
            ("true", OrtArena::Kept),
        ] {
            let c = Config::from_toml(&format!("[pushdown]\nort_arena = {text}")).expect("parses");
            assert_eq!(c.pushdown.ort_arena, mode, "{text}");
        }
        let c = Config::from_toml("[pushdown]\nort_arena = \"per-run\"\nmax_batch = 33").expect("parses");
        c.validate().expect("no sweep when the arena is given back");
        let e = Config::from_toml("[pushdown]\nort_arena = \"always\"").expect_err("unknown mode");
        assert!(e.contains("per-run"), "{e}");
    }

    #[test]
    fn a_models_store_needs_a_bucket_of_the_store_and_a_key_to_read_it() {
        let with = |backend: &str, store: &str| {
            let c = Config::from_toml(&format!("{backend}[pushdown.models_store]\nmirror_dir = \"/tmp/m\"\n{store}"))
                .expect("toml");
            c.validate().map(|()| c.runtime().expect("runtime").models_store.expect("a store"))
        };
        let s3 = "[backend]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:8333\"\n";
        let keyed = format!(
            "[[credentials]]\naccess_key = \"c\"\nsecret_key = \"c-secret\"\n{s3}access_key = \"store\"\nsecret_key = \"own\"\n"
        );
        // The backend's key reads it by default; its own key when it names one.
        let m = with(&keyed, "bucket = \"models\"\nprefix = \"tg/\"").expect("valid");
        assert_eq!((m.bucket.as_str(), m.prefix.as_str(), m.key.0.as_str()), ("models", "tg/", "store"));
        let m = with(s3, "bucket = \"models\"\naccess_key = \"reader\"\nsecret_key = \"r\"").expect("valid");
        assert_eq!(m.key.0, "reader");
        let e = |backend: &str, store: &str| with(backend, store).expect_err("invalid").to_string();
        // Transparent mode holds no key of the store's: it must name one.
        assert!(e(s3, "bucket = \"models\"").contains("pushdown.models_store.access_key"));
        assert!(e(&keyed, "bucket = \"models\"\nprefix = \"tg\"").contains("must end with '/'"));
        assert!(e(&keyed, "bucket = \"a/b\"").contains("pushdown.models_store.bucket"));
        assert!(e("", "bucket = \"models\"").contains("needs the s3 backend"));
        // The mirror removes what the bucket does not hold: never the models directory.
        let inside = |dir: &str| format!("[pushdown]\nmodels_dir = \"{dir}\"\n{keyed}");
        assert!(e(&inside("/tmp/m"), "bucket = \"models\"").contains("a directory of its own"));
        assert!(e(&inside("/tmp"), "bucket = \"models\"").contains("a directory of its own"));
    }

    #[test]
    fn identity_mode_resolves_and_transparent_refuses_what_it_cannot_keep() {
        let store = |extra: &str| {
            let mut c =
                Config::from_toml(&format!("[backend]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:8333\"\n{extra}"))
                    .expect("toml");
            c.apply(&Overrides::default());
            c
        };
        // No store key and no client keys: the store has its own users.
        let c = store("");
        assert!(c.transparent());
        c.validate().expect("valid");
        assert!(c.credential_store().expect("store").get(DEV_ACCESS_KEY).is_none(), "no development key");
        // A store key: terminating, with client credentials of its own (never the development pair).
        let c = store("access_key = \"a\"\nsecret_key = \"s\"\n");
        assert!(!c.transparent());
        assert!(c.validate().expect_err("no client key").to_string().contains("development key"));
        let c =
            store("access_key = \"a\"\nsecret_key = \"s\"\n[[credentials]]\naccess_key = \"c\"\nsecret_key = \"cs\"\n");
        c.validate().expect("valid");
        assert!(store("identity = \"transparent\"\naccess_key = \"a\"\nsecret_key = \"s\"\n").transparent());
        let err = |c: Config| c.validate().expect_err("refused").to_string();
        assert!(err(store("identity = \"terminating\"\n")).contains("backend.access_key"));
        let mut c = store("identity = \"transparent\"\n");
        c.credentials.push(CredentialConfig { access_key: "k".into(), ..CredentialConfig::default() });
        assert!(err(c).contains("credentials"));
        let mut c = store("");
        c.backend.endpoint = Some("http://127.0.0.1:8333/prefix".into());
        assert!(err(c).contains("backend.endpoint"));
        let mut c = store("");
        c.pushdown.aliases.push(AliasConfig {
            bucket: "a".into(),
            target: "t".into(),
            model: "tiny-cnn".into(),
            split: "pool".into(),
            format: None,
            dtype: None,
            column: None,
        });
        assert!(err(c).contains("cannot be forwarded as signed"));
        let c = Config::from_toml("[backend]\nidentity = \"transparent\"\n").expect("toml");
        assert!(err(c).contains("backend.identity"));
    }

    #[test]
    fn alias_endpoints_need_an_address_of_their_own_and_serve_in_both_modes() {
        let with = |extra: &str, endpoints: &str| {
            let mut c = Config::from_toml(&format!(
                "listen = \"127.0.0.1:9000\"\nadmin_listen = \"127.0.0.1:9001\"\n[backend]\nkind = \"s3\"\n\
                 endpoint = \"http://127.0.0.1:8333\"\n{extra}{endpoints}"
            ))
            .expect("toml");
            c.apply(&Overrides::default());
            c
        };
        let one = |addr: &str| {
            format!("[[pushdown.alias_endpoints]]\nlisten = \"{addr}\"\nmodel = \"m\"\nsplit = \"pool\"\n")
        };
        // Transparent mode (no key): an endpoint is signed as a plain read of the real bucket.
        let c = with("", &one("127.0.0.1:9101"));
        assert!(c.transparent());
        c.validate().expect("valid in transparent mode");
        let front = c.front_config().expect("front");
        assert_eq!(front.endpoints.len(), 1);
        assert_eq!((front.endpoints[0].model.as_str(), front.endpoints[0].split.as_str()), ("m", "pool"));
        let err = |c: Config| c.validate().expect_err("refused").to_string();
        for taken in ["127.0.0.1:9000", "127.0.0.1:9001"] {
            assert!(err(with("", &one(taken))).contains("already listened on"), "{taken}");
        }
        assert!(err(with("", &format!("{}{}", one("127.0.0.1:9101"), one("127.0.0.1:9101")))).contains("already"));
        // Port 0: the system picks one per listener.
        with("", &format!("{}{}", one("127.0.0.1:0"), one("127.0.0.1:0"))).validate().expect("two free ports");
        assert!(err(with("[pushdown]\nenabled = false\n", &one("127.0.0.1:9101"))).contains("pushdown.enabled"));
        let many: String = (0..=MAX_ALIAS_ENDPOINTS).map(|i| one(&format!("127.0.0.1:{}", 9100 + i))).collect();
        assert!(err(with("", &many)).contains("at most"));
        let bad = "[[pushdown.alias_endpoints]]\nlisten = \"127.0.0.1:9101\"\nmodel = \"m\"\nsplit = \"pool\"\nformat = \"gif\"\n";
        assert!(err(with("", bad)).contains("pushdown.alias_endpoints"));
    }

    #[test]
    fn a_store_key_per_client_replaces_the_shared_one_only_when_every_client_has_one() {
        let base = "[backend]\nkind = \"s3\"\nendpoint = \"http://127.0.0.1:8333\"\n";
        let own = "[[credentials]]\naccess_key = \"a\"\nsecret_key = \"as\"\nstore_access_key = \"sa\"\nstore_secret_key = \"ss\"\n";
        let plain = "[[credentials]]\naccess_key = \"b\"\nsecret_key = \"bs\"\n";
        let parse = |t: String| Config::from_toml(&t).expect("toml");
        let c = parse(format!("{base}{own}"));
        assert!(!c.transparent());
        c.validate().expect("every client has its own store key");
        assert_eq!(c.tenant_store_keys().expect("keys")["a"].0, "sa");
        let err = parse(format!("{base}{own}{plain}")).validate().expect_err("b has no store key");
        assert!(err.to_string().contains("backend.access_key"));
        parse(format!("{base}access_key = \"k\"\nsecret_key = \"s\"\n{own}{plain}"))
            .validate()
            .expect("shared key for b");
        let half = "[[credentials]]\naccess_key = \"c\"\nsecret_key = \"cs\"\nstore_secret_key = \"x\"\n";
        let err = parse(format!("{base}access_key = \"k\"\nsecret_key = \"s\"\n{half}")).validate().expect_err("half");
        assert!(err.to_string().contains("store_access_key"));
        let err = parse(own.to_owned()).validate().expect_err("fs backend");
        assert!(err.to_string().contains("store_access_key"));
    }

    #[test]
    fn overrides_win_and_dev_key_only_on_loopback() {
        let c = Config::default();
        let store = c.credential_store().expect("dev key");
        assert!(store.get(DEV_ACCESS_KEY).is_some());
        let o = Overrides {
            backend_endpoint: Some("http://127.0.0.1:8333".into()),
            backend_access_key: Some("a".into()),
            backend_secret_key: Some("s".into()),
            ..Overrides::default()
        };
        let mut c = Config::default();
        c.apply(&o);
        assert_eq!(c.backend.kind, BackendKind::S3);
        // The development key never acts with a store's key.
        let e = c.validate().expect_err("no client credentials").to_string();
        assert!(e.contains("credentials") && e.contains("development key"), "{e}");
        c.apply(&Overrides { access_key: Some("k".into()), secret_key: Some("own".into()), ..Overrides::default() });
        c.validate().expect("valid");
        assert!(c.credential_store().expect("store").get(DEV_ACCESS_KEY).is_none());
        assert!(!format!("{c:?}").contains("\"s\""));
    }
}
