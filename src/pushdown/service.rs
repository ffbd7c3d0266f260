//! The pushdown service ([`Pushdown`]): the registry, ONNX Runtime and one engine per (model, split)
//! in use, the memory governor and the CPU slots they share; [`Pushdown::prepare`] resolves a request
//! into a [`Job`].

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use std::time::Duration;

use bytes::Bytes;
use futures_util::TryStreamExt;

use super::clock::{CpuTally, cpu_timed};
use super::engine::{Engine, EngineConfig};
use super::engines::EngineKey;
use super::error::PushdownError;
use super::governor::{Governor, GovernorConfig};
use super::inference::Inference;
use super::models_store::{ModelsStore, ModelsStoreConfig};
use super::registry::{Changes, LoadLimits, Model, Registry};
use super::tensor::Tensor;
use super::{
    engine, engines, fair, governor, memory, order, parse::Item, parse::Planned, parse::name_sample,
    parse::no_preprocess, preprocess, runtime,
};

/// Copies of the whole model's ONNX bytes an engine's start holds at once, beside what it keeps:
/// the decoded protobuf while the prefix is cut, then the check's full-model session. Measured:
/// ResNet-18's first engine peaked 181-187 MB while starting against 152 MB reserved without the
/// arena, the model being 45 MB.
pub(super) const START_TRANSIENT_MODEL_COPIES: u64 = 2;

/// How often requests that name a model this gateway does not serve may have the models directory
/// read again before they are refused (a model just added is then served at once; names that
/// exist nowhere cost at most one directory read per second).
pub(crate) const UNKNOWN_MODEL_RESCAN: Duration = Duration::from_secs(1);

/// How long stopping the service waits for the inference threads to end once their queues are
/// closed: a thread finishes the batch it runs (seconds at most, at `pushdown.max_batch`) and
/// drops its session.
pub(super) const ENGINE_STOP_WAIT: Duration = Duration::from_secs(30);

/// Largest source object pushdown reads (it is held in memory while decoded). 64 MiB covers a
/// 128-sample shard of ImageNet-size JPEGs several times over.
pub const DEFAULT_MAX_OBJECT_BYTES: u64 = 64 * 1024 * 1024;

/// Settings of the pushdown service.
#[derive(Debug, Clone)]
pub(crate) struct PushdownConfig {
    pub(crate) models_dir: PathBuf,
    pub(crate) ort_library: Option<PathBuf>,
    pub(crate) engine: EngineConfig,
    /// Engines unused this long are evicted ([`engines`]).
    pub(crate) engine_idle: Duration,
    pub(crate) max_object_bytes: u64,
    /// What a model file may cost to load (`pushdown.max_model_bytes`).
    pub(crate) load_limits: LoadLimits,
    /// How often the models directory is read again; `None`: only at start and when asked.
    pub(crate) models_refresh: Option<Duration>,
    /// A bucket of the store that models are also read from (`[pushdown.models_store]`).
    pub(crate) models_store: Option<ModelsStoreConfig>,
    /// Longest read of a source object's body.
    pub(crate) source_timeout: Duration,
    pub(crate) max_image_pixels: u64,
    pub(crate) max_request_pixels: u64,
    /// Images preprocessed at once ([`fair`]); 0: one per core this process may use.
    pub(crate) preprocess_threads: usize,
    /// Inference runs at once across every engine ([`fair`]); 0: one per core this process may
    /// use, divided by the sessions' intra-op threads.
    pub(crate) inference_runs: usize,
    pub(crate) governor: GovernorConfig,
    pub(crate) metrics: crate::metrics::Metrics,
}

/// A split's measured prefix cost.
#[derive(Debug, Clone)]
pub(crate) struct SplitCost {
    pub(crate) secs_per_sample: f64,
    pub(crate) bytes_per_sample: f64,
    pub(crate) shape: Vec<usize>,
    /// A text model's: the length its batches ran at.
    pub(crate) text_length: Option<usize>,
}

/// Per-(model version, split, text length) measured costs (a rescan drops a removed or replaced
/// model's): a text model's at a length its batches may be
/// cut to ([`super::planning`]), a multiple of [`super::text::LENGTH_STEP`] up to the model's (so at most
/// `L / LENGTH_STEP` per split); other models' at their input (length 0).
pub(crate) type SplitCosts = HashMap<(String, String, usize), std::sync::Arc<tokio::sync::OnceCell<SplitCost>>>;

/// A computed output, ready to send.
#[derive(Debug)]
pub(crate) struct Output {
    pub(crate) body: Bytes,
    pub(crate) content_type: &'static str,
    pub(crate) shape: Vec<usize>,
    pub(crate) split: String,
    pub(crate) decode: Duration,
    pub(crate) infer: Duration,
    pub(crate) encode: Duration,
    /// What a single augmented image drew (ADR 0032).
    pub(crate) augmented: Option<super::augment::Drawn>,
    /// Memory reserved for the outputs; release it when the response has been sent.
    pub(crate) reservation: Vec<governor::Held>,
}

/// The pushdown service: registry, ONNX Runtime, and one engine per (model, split) in use.
#[derive(Debug)]
pub struct Pushdown {
    pub(super) cfg: PushdownConfig,
    /// The models served now, replaced whole by a rescan ([`Self::refresh`]).
    pub(super) registry: ArcSwap<Registry>,
    /// The store's models, mirrored beside `models_dir` (`None`: the directory only).
    pub(super) models_store: Option<ModelsStore>,
    /// One refresh (sync and rescan) at a time.
    pub(super) refreshing: tokio::sync::Mutex<()>,
    /// When a request for an unknown model last had the models directory read again (ms since
    /// `started`).
    pub(super) last_unknown_rescan: std::sync::atomic::AtomicU64,
    pub(super) started: std::time::Instant,
    /// What runs the prefixes (ONNX Runtime), or why nothing can.
    pub(super) inference: Result<Arc<dyn Inference>, String>,
    pub(super) engines: Arc<engines::EngineTable>,
    /// What every engine shares: the memory governor, the probe lock, the inference threads
    /// (shutdown waits for them) and the inference slots.
    pub(super) node: engine::Node,
    /// Measured prefix costs per (model, split), for planning.
    pub(super) split_costs: Mutex<SplitCosts>,
    /// Image preprocessing so far: total nanoseconds and samples (the planner's decode term).
    pub(super) preprocessed: Arc<CpuTally>,
    /// The last plan per (tenant, model) (`split=auto`; tenant "" for plans posted without one).
    pub(super) plans: Mutex<HashMap<(String, String), crate::planner::Plan>>,
    /// CPU slots for image preprocessing, shared fairly between tenants.
    pub(super) preprocess_slots: Arc<fair::FairSlots>,
    /// Decode and resize buffers kept between images.
    pub(super) scratch: Arc<preprocess::ScratchPool>,
    /// Requests' arrival numbers ([`Job::arrival`]), in their clients' order where they say it.
    pub(super) arrivals: order::Arrivals,
}

/// One engine's memory, for the admin API.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct EngineMemory {
    pub(crate) model: String,
    pub(crate) split: String,
    pub(crate) workers: usize,
    /// `None` until the first worker has measured it.
    pub(crate) memory: Option<memory::MemoryModel>,
    /// Largest inference batch (`pushdown.max_batch`, or less where the budget could not hold it).
    pub(crate) batch_cap: Option<usize>,
    /// Bytes reserved for the engine (all workers).
    pub(crate) reserved_bytes: Option<u64>,
}

/// Whatever way the service ends (a graceful shutdown did this already), the process does not go
/// on to exit while an inference thread is inside ONNX Runtime ([`engine::Threads`]).
impl Drop for Pushdown {
    fn drop(&mut self) {
        self.engines.clear();
        self.node.threads.wait_ended(ENGINE_STOP_WAIT);
    }
}

impl Pushdown {
    /// Loads the registry and ONNX Runtime; failures leave pushdown unavailable, never fatal.
    #[must_use]
    pub(crate) fn new(cfg: PushdownConfig) -> Self {
        let ort = runtime::environment(cfg.ort_library.as_deref())
            .map(|env| Arc::new(runtime::OrtInference { env }) as Arc<dyn Inference>);
        Self::with_inference(cfg, ort)
    }

    /// The service with `inference` running its prefixes (ONNX Runtime in [`Self::new`]).
    pub(crate) fn with_inference(cfg: PushdownConfig, inference: Result<Arc<dyn Inference>, String>) -> Self {
        let models_store = cfg.models_store.clone().and_then(|c| {
            ModelsStore::new(c)
                .inspect_err(|e| tracing::error!(error = %e, "pushdown.models_store unusable; models_dir only."))
                .ok()
        });
        // The store's models as last mirrored are served at once (a restart or an upgraded binary
        // does not wait for the store); the first refresh brings them up to date.
        let roots = roots(&cfg.models_dir, models_store.as_ref());
        let registry = Registry::load(&roots, cfg.load_limits, None);
        for (dir, why) in &registry.failed {
            tracing::warn!(dir = %dir.display(), error = %why, "Model not loaded.");
        }
        cfg.metrics.models.set(i64::try_from(registry.models.len()).unwrap_or(i64::MAX));
        match &inference {
            Ok(_) => tracing::info!(models = ?registry.names(), "Pushdown ready."),
            Err(why) => tracing::warn!(reason = %why, "Pushdown unavailable; passthrough still serves."),
        }
        let governor = Arc::new(Governor::new(cfg.governor, cfg.metrics.clone()));
        let engines = Arc::new(engines::EngineTable::new(cfg.engine_idle, &cfg.metrics));
        // Weak: the engines hold the governor.
        let table = Arc::downgrade(&engines);
        governor
            .set_reclaim(governor::Reclaim(Box::new(move || table.upgrade().map_or(0, |t| t.evict_unused().len()))));
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        let preprocess_slots =
            fair::FairSlots::new(if cfg.preprocess_threads == 0 { cores } else { cfg.preprocess_threads });
        let per_run = cfg.engine.intra_threads.max(1);
        let runs = fair::FairSlots::new(if cfg.inference_runs == 0 { cores / per_run } else { cfg.inference_runs });
        let scratch = Arc::new(preprocess::ScratchPool::default());
        Self {
            preprocess_slots,
            scratch: scratch.clone(),
            cfg,
            registry: ArcSwap::from_pointee(registry),
            models_store,
            refreshing: tokio::sync::Mutex::const_new(()),
            last_unknown_rescan: std::sync::atomic::AtomicU64::new(0),
            started: std::time::Instant::now(),
            inference,
            engines,
            node: engine::Node {
                governor,
                probe_lock: Arc::default(),
                threads: Arc::default(),
                runs,
                scratch,
                measured: Arc::default(),
            },
            split_costs: Mutex::default(),
            preprocessed: Arc::default(),
            plans: Mutex::default(),
            arrivals: order::Arrivals::default(),
        }
    }

    #[must_use]
    pub(crate) fn governor(&self) -> &Arc<Governor> {
        &self.node.governor
    }

    /// Bytes the preprocessing and batch buffers kept between uses hold now (at most
    /// [`preprocess::SCRATCH_POOL_BYTES`]; outside the budget).
    #[must_use]
    pub(crate) fn scratch_kept_bytes(&self) -> usize {
        self.scratch.kept_bytes()
    }

    /// Every started engine's memory model.
    #[must_use]
    pub(crate) fn engine_memory(&self) -> Vec<EngineMemory> {
        let mut out: Vec<EngineMemory> = self
            .engines
            .all()
            .into_iter()
            .map(|(EngineKey { model, split, .. }, e)| {
                let now = e.memory_model_now();
                let adaptive = self.node.governor.config().adaptive;
                EngineMemory {
                    model,
                    split,
                    workers: e.workers(),
                    batch_cap: now.as_ref().map(|(_, b)| *b),
                    reserved_bytes: now
                        .as_ref()
                        .map(|(m, b)| m.engine_bytes(e.workers(), if adaptive { *b } else { 0 })),
                    memory: now.map(|(m, _)| m),
                }
            })
            .collect();
        out.sort_by(|a, b| (&a.model, &a.split).cmp(&(&b.model, &b.split)));
        out
    }

    /// `Err(reason)` when pushdown cannot run at all.
    ///
    /// # Errors
    /// Why ONNX Runtime is missing.
    pub(crate) fn available(&self) -> Result<(), &str> {
        self.inference.as_ref().map(|_| ()).map_err(String::as_str)
    }

    /// The models served now.
    #[must_use]
    pub(crate) fn registry(&self) -> Arc<Registry> {
        self.registry.load_full()
    }

    pub(super) fn model(&self, name: &str) -> Result<Arc<Model>, PushdownError> {
        let registry = self.registry.load();
        registry
            .models
            .get(name)
            .cloned()
            .ok_or_else(|| PushdownError::UnknownModel { name: name.to_owned(), known: registry.names().join(", ") })
    }

    /// Whether a request naming an unknown model may make the models directory be read again now
    /// (at most once per [`UNKNOWN_MODEL_RESCAN`], whatever the requests name).
    pub(crate) fn rescan_allowed(&self) -> bool {
        let now = u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.last_unknown_rescan.load(std::sync::atomic::Ordering::Relaxed);
        let every = u64::try_from(UNKNOWN_MODEL_RESCAN.as_millis()).unwrap_or(u64::MAX);
        now.saturating_sub(last) >= every
            && self
                .last_unknown_rescan
                .compare_exchange(last, now, std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed)
                .is_ok()
    }

    /// Brings the store's models' mirror up to date (when there is a store) and reads the models
    /// again ([`Self::rescan`]); one refresh at a time. A store that cannot be listed changes
    /// none of its models (the reason is listed among the refusals).
    pub(crate) async fn refresh(self: &Arc<Self>) -> Changes {
        let _one = self.refreshing.lock().await;
        let store_refused = match &self.models_store {
            Some(store) => match store.sync(self.cfg.load_limits.max_model_bytes).await {
                Ok(refused) => refused,
                Err(why) => {
                    tracing::warn!(store = %store.url(), error = %why, "Models store not read; its models stay as they were.");
                    vec![(PathBuf::from(store.url()), format!("cannot list the models store: {why}"))]
                }
            },
            None => Vec::new(),
        };
        let service = self.clone();
        tokio::task::spawn_blocking(move || service.rescan(store_refused)).await.unwrap_or_default()
    }

    /// Reads the models again and serves what they are now: models added are served from the
    /// next request on; a removed or replaced model takes no new request, and its engines stop
    /// (their memory returning to the budget) once the requests in flight on them are done.
    /// Unchanged models are kept as they are. `store_refused`: what the store holds that cannot
    /// be served, listed with the directories' refusals. Blocking: call it on a blocking thread.
    fn rescan(&self, store_refused: Vec<(PathBuf, String)>) -> Changes {
        let before = self.registry.load_full();
        let roots = roots(&self.cfg.models_dir, self.models_store.as_ref());
        let mut after = Registry::load(&roots, self.cfg.load_limits, Some(&before));
        after.failed.extend(store_refused);
        let after = Arc::new(after);
        let changes = after.changes_from(&before);
        let new_failures: Vec<_> = after.failed.iter().filter(|f| !before.failed.contains(f)).collect();
        for (dir, why) in &new_failures {
            tracing::warn!(dir = %dir.display(), error = %why, "Model not loaded.");
        }
        self.cfg.metrics.models.set(i64::try_from(after.models.len()).unwrap_or(i64::MAX));
        self.registry.store(after.clone());
        if !changes.is_empty() {
            tracing::info!(added = ?changes.added, replaced = ?changes.replaced, removed = ?changes.removed, "Models changed.");
            for (change, names) in
                [("added", &changes.added), ("replaced", &changes.replaced), ("removed", &changes.removed)]
            {
                let label = crate::metrics::ChangeLabel { change };
                self.cfg.metrics.model_changes.get_or_create(&label).inc_by(names.len() as u64);
            }
            self.engines.retire(|k| after.models.get(&k.model).is_some_and(|m| m.version == k.version));
            let served: Vec<&str> = after.models.values().map(|m| m.version.as_str()).collect();
            self.split_costs
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .retain(|k, _| served.contains(&k.0.as_str()));
        }
        let refused = crate::metrics::ChangeLabel { change: "refused" };
        self.cfg.metrics.model_changes.get_or_create(&refused).inc_by(new_failures.len() as u64);
        changes
    }

    pub(super) async fn engine(&self, model: &Arc<Model>, split: &str) -> Result<Arc<Engine>, PushdownError> {
        let inference = self.inference.as_ref().map_err(|e| PushdownError::Unavailable(e.clone()))?.clone();
        let key =
            EngineKey { model: model.manifest.name.clone(), version: model.version.clone(), split: split.to_owned() };
        let tensor = model
            .split(split)
            .map(|s| s.tensor.clone())
            .ok_or_else(|| PushdownError::Internal("split vanished".into()))?;
        let (model, split, cfg, metrics) = (model.clone(), split.to_owned(), self.cfg.engine, self.cfg.metrics.clone());
        let node = self.node.clone();
        // What a start holds before the engine's own reservation: cutting the prefix decodes the
        // whole model, and the first worker checks the prefix against a session of the whole
        // model (docs/BENCHMARKS.md, "Engine memory by arena mode"). Held from before the cut
        // until the first worker has measured (`engine::ready_session`).
        let transient = START_TRANSIENT_MODEL_COPIES * model.bytes.len() as u64;
        let start_hold = self.node.governor.hold(transient);
        let engine = self
            .engines
            .get_or_start(&key, start_hold, move |start_hold| {
                Engine::start(&inference, &model, (&split, &tensor), cfg, &metrics, &node, start_hold)
            })
            .await?;
        // A request prepared before its model was removed or replaced finishes on this engine;
        // the table does not keep it for others (it stops, its memory returned, after the request).
        if self.registry.load().models.get(&key.model).is_none_or(|m| m.version != key.version) {
            self.engines.retire(|k| *k != key);
        }
        Ok(engine)
    }

    /// Evicts idle engines every quarter of the idle time (at most every 30 s), and reads the
    /// models again every `pushdown.models_refresh_secs` ([`Self::refresh`], the first at once),
    /// for as long as the service exists.
    pub(crate) fn spawn_reaper(self: &Arc<Self>) {
        let period = (self.cfg.engine_idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
        let service = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(service) = service.upgrade() else { break };
                service.engines.evict_idle();
            }
        });
        let Some(every) = self.cfg.models_refresh else { return };
        let service = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let Some(service) = service.upgrade() else { break };
                service.refresh().await;
                drop(service);
                tokio::time::sleep(every).await;
            }
        });
    }

    /// Stops every engine (each when its last request is done) and waits, at most
    /// [`ENGINE_STOP_WAIT`], for their inference threads to end ([`engine::Threads`]); returns
    /// whether they all did.
    pub(crate) async fn shutdown(&self) -> bool {
        self.engines.clear();
        let threads = self.node.threads.clone();
        let ended = tokio::task::spawn_blocking(move || threads.wait_ended(ENGINE_STOP_WAIT)).await.unwrap_or(false);
        if !ended {
            tracing::warn!(wait_secs = ENGINE_STOP_WAIT.as_secs(), "Inference threads still running after shutdown.");
        }
        ended
    }

    /// Inference threads of this service's engines that still hold anything of ONNX Runtime.
    #[must_use]
    pub fn inference_threads(&self) -> usize {
        self.node.threads.running()
    }

    /// Fault injection for the supervision tests: the next run of this engine panics. `false` if
    /// it is not running.
    #[doc(hidden)]
    #[must_use]
    pub fn inject_worker_panic(&self, model: &str, split: &str) -> bool {
        let Ok(m) = self.model(model) else { return false };
        let key = EngineKey { model: model.to_owned(), version: m.version.clone(), split: split.to_owned() };
        self.engines.running(&key).map(|e| e.inject_panic()).is_some()
    }
}

/// What running a request's samples needs beside them ([`Pushdown::run_samples`]).
pub(super) struct Run<'a> {
    pub(super) engine: &'a Arc<Engine>,
    pub(super) model: &'a Arc<Model>,
    pub(super) stream: &'a governor::Stream,
    /// The tenant's admitted-samples counter.
    pub(super) samples: &'a prometheus_client::metrics::counter::Counter,
    /// The engine batch cap the samples ask for.
    pub(super) cap: usize,
    pub(super) tenant: &'a str,
    /// The request's arrival number: its samples preprocess after those of the tenant's earlier
    /// requests ([`Job::arrival`]).
    pub(super) arrival: u64,
    /// The request's random augmentation ([`super::augment`]).
    pub(super) augment: Option<super::augment::Augment>,
}

impl Pushdown {
    /// Runs samples through the engine ([`Self::sample_runs`]); the outputs come back in source
    /// order.
    pub(super) async fn run_samples(
        &self,
        run: &Run<'_>,
        samples: (Vec<Item>, Vec<Planned>, Vec<usize>),
        keys: &[String],
    ) -> Result<Vec<Tensor>, PushdownError> {
        let count = samples.2.len();
        let ran: Vec<(usize, Tensor)> = self.sample_runs(run, samples, keys).try_collect().await?;
        tracing::debug!(arrival = run.arrival, "Samples computed.");
        let mut outputs: Vec<Option<Tensor>> = (0..count).map(|_| None).collect();
        for (i, out) in ran {
            outputs[i] = Some(out);
        }
        Ok(outputs.into_iter().flatten().collect())
    }

    /// Samples through the engine: each admitted by the request's stream (module docs of
    /// [`governor`]), an image preprocessed on a blocking thread (one per core at a time, tenants
    /// in turn), then inferred; all at once, as the stream admits them. `items[j]` is the
    /// source's sample `order[j]`, named by `keys[order[j]]` in errors. The outputs come in
    /// engine order, each with its place in the source.
    pub(super) fn sample_runs<'r>(
        &'r self,
        run: &'r Run<'_>,
        (items, plans, order): (Vec<Item>, Vec<Planned>, Vec<usize>),
        keys: &'r [String],
    ) -> impl futures_util::Stream<Item = Result<(usize, Tensor), PushdownError>> + 'r {
        let max_pixels = self.cfg.max_image_pixels;
        // When each request's samples start and end: the order requests are computed in (ADR 0019).
        tracing::debug!(arrival = run.arrival, samples = order.len(), "Samples ready.");
        let runs = items.into_iter().zip(plans).zip(order).map(move |((item, plan), i)| async move {
            let slot = run.stream.admit(plan.scratch).await?;
            run.samples.inc();
            // Decoded no further ahead of the engine than it can use: the oldest requests'
            // samples first, the rest wait undecoded.
            let place = (run.arrival, i as u64);
            let _ahead = run.engine.ahead(run.tenant, place).await?;
            let input = match item {
                Item::Ready(v) => v,
                Item::Image(bytes) => {
                    let (m, tally, pool) = (run.model.clone(), self.preprocessed.clone(), self.scratch.clone());
                    // Held until the decode is done: one image per core at a time, tenants in
                    // turn, a tenant's requests in the order they arrived.
                    let _cpu = self.preprocess_slots.acquire(run.tenant, place).await;
                    tokio::task::spawn_blocking(move || {
                        let pre = m.manifest.preprocess.as_ref().ok_or_else(|| no_preprocess(&m.manifest.name))?;
                        // CPU time, not wall time: samples preprocess concurrently, and their
                        // wall times would count the contention many times over.
                        let mut scratch = pool.take();
                        let (out, spent) = cpu_timed(|| {
                            let layout = m.manifest.layout;
                            preprocess::image_to_input_with(&bytes, pre, layout, max_pixels, plan.drawn, &mut scratch)
                        });
                        pool.give(scratch);
                        tally.add(spent, 1);
                        out
                    })
                    .await
                    .map_err(|e| PushdownError::Internal(e.to_string()))?
                    .map_err(|e| name_sample(e, keys.get(i)))?
                }
            };
            let out =
                run.engine.infer(run.tenant, place, input, run.cap).await.map_err(|e| name_sample(e, keys.get(i)));
            drop(slot);
            out.map(|t| (i, t))
        });
        runs.collect::<futures_util::stream::FuturesOrdered<_>>()
    }
}

/// The directories models are read from: `models_dir`, then the store's mirror.
fn roots<'a>(models_dir: &'a std::path::Path, store: Option<&'a ModelsStore>) -> Vec<&'a std::path::Path> {
    std::iter::once(models_dir).chain(store.map(ModelsStore::mirror_dir)).collect()
}
