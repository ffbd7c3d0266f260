//! Near-data pushdown: a GET that names a model and a split returns the tensor the model's prefix
//! computes from the object instead of the object's bytes.
//!
//! Pieces: [`spec`] (what the request asks for), [`registry`] (manifests, verified model files),
//! [`prefix`] (cutting the model at the split), [`engine`] (inference threads with batching),
//! [`tensor`] (`.npy` in, `.npy`/safetensors out), [`runtime`] (loading ONNX Runtime).
//! This module ties them together as a service: [`Pushdown::prepare`] resolves a request into a
//! [`Job`], which reads the source under the memory budget and runs the prefix; the proxy's
//! pushdown phase (`crate::proxy::pushdown`) answers it over HTTP through the tensor cache.
//!
//! Inputs understood so far: JPEG and PNG images (preprocessed per the model's manifest) and `.npy`
//! tensors already preprocessed to the model's per-sample input shape (one sample, or a batch with
//! a leading dimension), and WebDataset tar shards of those ([`shard`]), answered as safetensors
//! with `features`, `labels` and the sample keys.

pub mod clock;
pub mod decode;
pub mod engine;
pub mod engines;
pub mod error;
pub mod fair;
pub mod governor;
pub mod manifest;
pub mod memory;
pub mod order;
pub mod planning;
pub mod prefix;
pub mod preprocess;
pub mod queue;
pub mod registry;
pub mod runtime;
pub mod shard;
pub mod spec;
pub mod table;
pub mod tensor;
pub mod text;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::try_join_all;

pub use self::error::PushdownError;

use self::clock::cpu_timed;
use self::engine::{Engine, EngineConfig};
use self::governor::{Governor, GovernorConfig};
use self::registry::{Model, Registry};
use self::spec::{Dtype, Format, PushdownSpec};
use self::tensor::Tensor;

/// Copies of the whole model's ONNX bytes an engine's start holds at once, beside what it keeps:
/// the decoded protobuf while the prefix is cut, then the check's full-model session. Measured:
/// ResNet-18's first engine peaked 181-187 MB while starting against 152 MB reserved without the
/// arena, the model being 45 MB.
const START_TRANSIENT_MODEL_COPIES: u64 = 2;

/// How long stopping the service waits for the inference threads to end once their queues are
/// closed: a thread finishes the batch it runs (seconds at most, at `pushdown.max_batch`) and
/// drops its session.
const ENGINE_STOP_WAIT: Duration = Duration::from_secs(30);

/// Largest source object pushdown reads (it is held in memory while decoded). 64 MiB covers a
/// 128-sample shard of ImageNet-size JPEGs several times over.
pub const DEFAULT_MAX_OBJECT_BYTES: u64 = 64 * 1024 * 1024;

/// Settings of the pushdown service.
#[derive(Debug, Clone)]
pub struct PushdownConfig {
    pub models_dir: PathBuf,
    pub ort_library: Option<PathBuf>,
    pub engine: EngineConfig,
    /// Engines unused this long are evicted ([`engines`]).
    pub engine_idle: Duration,
    pub max_object_bytes: u64,
    /// Longest read of a source object's body.
    pub source_timeout: Duration,
    pub max_image_pixels: u64,
    pub max_request_pixels: u64,
    /// Images preprocessed at once ([`fair`]); 0: one per core this process may use.
    pub preprocess_threads: usize,
    /// Inference runs at once across every engine ([`fair`]); 0: one per core this process may
    /// use, divided by the sessions' intra-op threads.
    pub inference_runs: usize,
    pub governor: GovernorConfig,
    pub metrics: crate::metrics::Metrics,
}

/// A split's measured prefix cost.
#[derive(Debug, Clone)]
pub struct SplitCost {
    pub secs_per_sample: f64,
    pub bytes_per_sample: f64,
    pub shape: Vec<usize>,
    /// A text model's: the length its batches ran at.
    pub text_length: Option<usize>,
}

/// Per-(model, split, text length) measured costs: a text model's at a length its batches may be
/// cut to ([`planning`]), a multiple of [`text::LENGTH_STEP`] up to the model's (so at most
/// `L / LENGTH_STEP` per split); other models' at their input (length 0).
pub type SplitCosts = HashMap<(String, String, usize), std::sync::Arc<tokio::sync::OnceCell<SplitCost>>>;

/// A computed output, ready to send.
#[derive(Debug)]
pub struct Output {
    pub body: Bytes,
    pub content_type: &'static str,
    pub shape: Vec<usize>,
    pub split: String,
    pub model_digest: String,
    pub decode: Duration,
    pub infer: Duration,
    pub encode: Duration,
    /// Memory reserved for the outputs; release it when the response has been sent.
    pub reservation: Vec<governor::Held>,
}

/// The pushdown service: registry, ONNX Runtime, and one engine per (model, split) in use.
#[derive(Debug)]
pub struct Pushdown {
    cfg: PushdownConfig,
    registry: Registry,
    env: Result<ort::environment::Environment, String>,
    engines: Arc<engines::EngineTable>,
    /// What every engine shares: the memory governor, the probe lock, the inference threads
    /// (shutdown waits for them) and the inference slots.
    node: engine::Node,
    /// Measured prefix costs per (model, split), for planning.
    split_costs: Mutex<SplitCosts>,
    /// Image preprocessing so far: total nanoseconds and samples (the planner's decode term).
    preprocessed: Arc<(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64)>,
    /// The last plan per (tenant, model) (`split=auto`; tenant "" for plans posted without one).
    plans: Mutex<HashMap<(String, String), crate::planner::Plan>>,
    /// CPU slots for image preprocessing, shared fairly between tenants.
    preprocess_slots: Arc<fair::FairSlots>,
    /// Decode and resize buffers kept between images.
    scratch: Arc<preprocess::ScratchPool>,
    /// Requests' arrival numbers ([`Job::arrival`]), in their clients' order where they say it.
    arrivals: order::Arrivals,
}

/// One engine's memory, for the admin API.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EngineMemory {
    pub model: String,
    pub split: String,
    pub workers: usize,
    /// `None` until the first worker has measured it.
    pub memory: Option<memory::MemoryModel>,
    /// Largest inference batch (`pushdown.max_batch`, or less where the budget could not hold it).
    pub batch_cap: Option<usize>,
    /// Bytes reserved for the engine (all workers).
    pub reserved_bytes: Option<u64>,
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
    pub fn new(cfg: PushdownConfig) -> Self {
        let registry = Registry::load(&cfg.models_dir);
        for (dir, why) in &registry.failed {
            tracing::warn!(dir = %dir.display(), error = %why, "Model not loaded.");
        }
        let env = runtime::environment(cfg.ort_library.as_deref());
        match &env {
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
            registry,
            env,
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
    pub fn governor(&self) -> &Arc<Governor> {
        &self.node.governor
    }

    /// Bytes the preprocessing and batch buffers kept between uses hold now (at most
    /// [`preprocess::SCRATCH_POOL_BYTES`]; outside the budget).
    #[must_use]
    pub fn scratch_kept_bytes(&self) -> usize {
        self.scratch.kept_bytes()
    }

    /// Every started engine's memory model.
    #[must_use]
    pub fn engine_memory(&self) -> Vec<EngineMemory> {
        let mut out: Vec<EngineMemory> = self
            .engines
            .all()
            .into_iter()
            .map(|((model, split), e)| {
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
    pub fn available(&self) -> Result<(), &str> {
        self.env.as_ref().map(|_| ()).map_err(String::as_str)
    }

    #[must_use]
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Resolves a request's model and split once, before any byte of the source is read:
    /// `split=auto` becomes the tenant's planned split (`None` when the plan says no pushdown: a
    /// plain GET), and the model and split are checked against the registry. The job then holds
    /// every reservation the request makes.
    ///
    /// # Errors
    /// Pushdown unavailable, unknown model or split (naming what exists).
    pub fn prepare(&self, mut spec: PushdownSpec, tenant: &str) -> Result<Option<Job<'_>>, PushdownError> {
        let mut plan = None;
        if spec.split == crate::planner::AUTO {
            let (split, chosen) = self.auto_split(tenant, &spec.model).ok_or_else(|| PushdownError::UnknownModel {
                name: spec.model.clone(),
                known: self.registry.names().join(", "),
            })?;
            if split == crate::planner::NO_PUSHDOWN {
                return Ok(None);
            }
            plan = chosen.map(|p| {
                let parts: Vec<String> =
                    p.candidates.iter().filter_map(|c| c.epoch_secs.map(|t| format!("{}={t:.3}", c.split))).collect();
                parts.join(";")
            });
            spec.split = split;
        }
        self.available().map_err(|r| PushdownError::Unavailable(r.to_owned()))?;
        let model = self.model(&spec.model)?;
        let split = split_def(&model, &spec.split)?.name.clone();
        let arrival = self.arrivals.number(spec.seq.as_ref());
        Ok(Some(Job {
            service: self,
            spec,
            model,
            split,
            tenant: tenant.to_owned(),
            plan,
            engine: None,
            engine_wait: Duration::ZERO,
            source: None,
            arrival,
        }))
    }

    fn model(&self, name: &str) -> Result<Arc<Model>, PushdownError> {
        self.registry.models.get(name).cloned().ok_or_else(|| PushdownError::UnknownModel {
            name: name.to_owned(),
            known: self.registry.names().join(", "),
        })
    }

    async fn engine(&self, model: &Arc<Model>, split: &str) -> Result<Arc<Engine>, PushdownError> {
        let env = self.env.as_ref().map_err(|e| PushdownError::Unavailable(e.clone()))?.clone();
        let key = (model.manifest.name.clone(), split.to_owned());
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
        self.engines
            .get_or_start(&key, start_hold, move |start_hold| {
                Engine::start(&env, &model, (&split, &tensor), cfg, &metrics, &node, start_hold)
            })
            .await
    }

    /// Evicts idle engines every quarter of the idle time (at most every 30 s) for as long as the
    /// service exists.
    pub fn spawn_reaper(self: &Arc<Self>) {
        let period = (self.cfg.engine_idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(30));
        let service = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(period).await;
                let Some(service) = service.upgrade() else { break };
                service.engines.evict_idle();
            }
        });
    }

    /// Stops every engine (each when its last request is done) and waits, at most
    /// [`ENGINE_STOP_WAIT`], for their inference threads to end ([`engine::Threads`]); returns
    /// whether they all did.
    pub async fn shutdown(&self) -> bool {
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
        self.engines.running(&(model.to_owned(), split.to_owned())).map(|e| e.inject_panic()).is_some()
    }

    /// Runs the prefix on an object's bytes and encodes the result ([`Job::run`]).
    async fn compute(&self, job: &Job<'_>, input: Input) -> Result<Output, PushdownError> {
        let (spec, model, split, tenant) = (&job.spec, job.model.clone(), job.split.clone(), job.tenant.as_str());
        let (engine, memory, batch_cap) = job.engine().await?;

        let t0 = Instant::now();
        let parse_model = model.clone();
        let limits = (self.cfg.max_image_pixels, self.cfg.max_request_pixels);
        let want_tar = spec.format == Some(Format::Tar);
        let want_parquet = spec.format == Some(Format::Parquet);
        let source = job.limits();
        // A Parquet file's pages are decoded after the governor holds what that takes.
        let (object, table_source, footer) = match input {
            Input::Object(object) => {
                let table = table::is_parquet(&object).then(|| table::Source::whole(object.clone()));
                (object, table, None)
            }
            Input::Table(source, footer) => (Bytes::new(), Some(source), Some(footer)),
        };
        let whole_table = table_source.clone().filter(|_| footer.is_none());
        let (mut parsed, scratch) = tokio::task::spawn_blocking(move || {
            if want_parquet && whole_table.is_none() && footer.is_none() {
                return Err(PushdownError::InvalidArgument {
                    field: "format".into(),
                    message: "parquet is for Parquet sources; this object is not one (use npy or safetensors)".into(),
                });
            }
            let parsed = match footer {
                Some(footer) => Parsed::table(Some(*footer)),
                None => parse(&object, whole_table.as_ref(), &parse_model, &source)?,
            };
            if want_tar && parsed.kind != Kind::Shard {
                return Err(PushdownError::InvalidArgument {
                    field: "format".into(),
                    message: "tar is for WebDataset shards; this object is not one (use npy or safetensors)".into(),
                });
            }
            let mut parsed = parsed;
            parsed.put_in_engine_order(parse_model.manifest.text.is_some());
            // A Parquet file's images are known once its rows are decoded (below).
            let scratch = image_costs(&parsed, &parse_model.manifest, limits)?;
            Ok::<_, PushdownError>((parsed, scratch))
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))??;
        let mut decode_time = t0.elapsed();

        let t1 = Instant::now();
        let samples_n = parsed.table.as_ref().map_or(parsed.items.len(), table::Footer::row_count);
        let n = samples_n as u64;
        // A tar body also holds copies of the samples' other members and its framing; a Parquet
        // file's decoded columns live as long as its samples, and a Parquet body holds its kept
        // columns again.
        let tar_bytes =
            if want_tar { u64::try_from(tar_overhead(&parsed.keys, &parsed.others)).unwrap_or(u64::MAX) } else { 0 };
        let decoded_bytes = parsed.table.as_ref().map_or(0, |t| t.decoded_bytes().saturating_add(t.output_bytes()));
        let (stream, outputs_held) = self
            .node
            .governor
            .open(
                tenant,
                (
                    memory.queued_bytes_per_sample,
                    (memory.held_bytes_per_sample * n).saturating_add(tar_bytes).saturating_add(decoded_bytes),
                ),
                // One request alone never fills its engine's queue (a full queue refuses samples
                // with `503`): at most half of it in flight. Images are paced by their decoding;
                // ready inputs (`.npy` batches, texts) would otherwise all be queued at once.
                (spec.batch, samples_n.min((self.cfg.engine.queue_capacity / 2).max(1))),
                job.source.as_ref(),
            )
            .await?;
        // Adaptive: samples of all requests batch together up to the engine's cap (what its
        // reservation covers). Comparison mode: batches as large as the requested storage batch
        // (HAPI without adaptation runs the training batch as one storage batch).
        let cap = if self.node.governor.config().adaptive { batch_cap } else { stream.allotment() };
        let samples = self
            .cfg
            .metrics
            .tenant_samples
            .get_or_create(&crate::metrics::TenantLabel { tenant: tenant.to_owned() })
            .clone();
        let run = Run {
            engine: &engine,
            model: &model,
            stream: &stream,
            samples: &samples,
            cap,
            tenant,
            arrival: job.arrival,
        };
        // A Parquet file's rows are decoded and run one row group after the other: the governor
        // holds one group's decoded columns (`Footer::decoded_bytes`), which each group reuses.
        let mut outputs = Vec::with_capacity(samples_n);
        match (parsed.table.take().map(Arc::new), table_source) {
            (Some(footer), Some(object)) => {
                let mut kept = footer.kept();
                let mut labels = Vec::with_capacity(samples_n);
                for part in 0..footer.group_count() {
                    let t = Instant::now();
                    let (footer, object, m) = (footer.clone(), object.clone(), model.clone());
                    let (group, scratch, back) = tokio::task::spawn_blocking(move || {
                        let mut kept = kept;
                        let rows = footer.group_rows(&object, part, kept.as_mut())?;
                        let mut group = table_rows(rows, m.tokenizer.as_deref())?;
                        group.put_in_engine_order(m.manifest.text.is_some());
                        let scratch = image_costs(&group, &m.manifest, limits)?;
                        Ok::<_, PushdownError>((group, scratch, kept))
                    })
                    .await
                    .map_err(|e| PushdownError::Internal(e.to_string()))??;
                    kept = back;
                    decode_time += t.elapsed();
                    let Parsed { items, keys, labels: group_labels, order, .. } = group;
                    outputs.extend(self.run_samples(&run, (items, scratch, order), &keys).await?);
                    labels.extend(
                        group_labels.map_or_else(|| vec![None; keys.len()], |l| l.into_iter().map(Some).collect()),
                    );
                    parsed.keys.extend(keys);
                }
                parsed.labels = labels.into_iter().collect();
                parsed.others = vec![Vec::new(); parsed.keys.len()];
                parsed.kept = kept;
            }
            _ => {
                let (items, order) = (std::mem::take(&mut parsed.items), std::mem::take(&mut parsed.order));
                outputs = self.run_samples(&run, (items, scratch, order), &parsed.keys).await?;
            }
        }
        let infer_time = t1.elapsed();

        let t2 = Instant::now();
        let format = spec.format.unwrap_or(if parsed.kind.keyed() || spec.dtype == Dtype::Bf16 {
            Format::Safetensors
        } else {
            Format::Npy
        });
        let dtype = spec.dtype;
        let mut meta =
            HashMap::from([("model".to_owned(), model.manifest.name.clone()), ("split".to_owned(), split.clone())]);
        if parsed.kind.keyed() {
            // A JSON array of the sample keys: any string a tar member name holds, escaped by serde.
            meta.insert("keys".to_owned(), serde_json::to_string(&parsed.keys).expect("strings serialize"));
        }
        let (kind, labels, keys, others, kept) = (parsed.kind, parsed.labels, parsed.keys, parsed.others, parsed.kept);
        let names = (model.manifest.name.clone(), split.clone());
        let (body, shape) = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<usize>), PushdownError> {
            if format == Format::Tar {
                return write_tar(&outputs, &keys, &others, dtype);
            }
            let out = stack(outputs, kind != Kind::Single);
            let body = match format {
                Format::Npy => tensor::write_npy(&out, dtype),
                Format::Safetensors => {
                    tensor::write_safetensors(&[("features", &out)], labels.as_deref(), dtype, meta)?
                }
                Format::Parquet => {
                    let kept = kept.ok_or_else(|| PushdownError::Internal("no kept columns".into()))?;
                    let shape = out.shape.clone();
                    let body = table::write(&kept, &out.data, &shape, dtype, (&names.0, &names.1))?;
                    return Ok((body, shape));
                }
                Format::Tar => unreachable!("written above"),
            };
            Ok((body, out.shape))
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))??;
        tracing::debug!(arrival = job.arrival, bytes = body.len(), "Output encoded.");
        drop(stream);
        let content_type = match format {
            Format::Npy => "application/x-npy",
            Format::Safetensors => "application/vnd.safetensors",
            Format::Tar => "application/x-tar",
            Format::Parquet => "application/vnd.apache.parquet",
        };
        Ok(Output {
            body: Bytes::from(body),
            content_type,
            shape,
            split,
            model_digest: model.digest.clone(),
            decode: decode_time,
            infer: infer_time,
            encode: t2.elapsed(),
            reservation: vec![outputs_held],
        })
    }
}

/// What running a request's samples needs beside them ([`Pushdown::run_samples`]).
struct Run<'a> {
    engine: &'a Arc<Engine>,
    model: &'a Arc<Model>,
    stream: &'a governor::Stream,
    /// The tenant's admitted-samples counter.
    samples: &'a prometheus_client::metrics::counter::Counter,
    /// The engine batch cap the samples ask for.
    cap: usize,
    tenant: &'a str,
    /// The request's arrival number: its samples preprocess after those of the tenant's earlier
    /// requests ([`Job::arrival`]).
    arrival: u64,
}

impl Pushdown {
    /// Runs samples through the engine: each admitted by the request's stream (module docs of
    /// [`governor`]), an image preprocessed on a blocking thread (one per core at a time, tenants
    /// in turn), then inferred. `items[j]` is the source's sample `order[j]`, named by
    /// `keys[order[j]]` in errors; the outputs come back in source order.
    async fn run_samples(
        &self,
        run: &Run<'_>,
        (items, scratch, order): (Vec<Item>, Vec<u64>, Vec<usize>),
        keys: &[String],
    ) -> Result<Vec<Tensor>, PushdownError> {
        let max_pixels = self.cfg.max_image_pixels;
        // When each request's samples start and end: the order requests are computed in (ADR 0019).
        tracing::debug!(arrival = run.arrival, samples = order.len(), "Samples ready.");
        let runs = items.into_iter().zip(scratch).zip(order.iter().copied()).map(|((item, scratch), i)| async move {
            let slot = run.stream.admit(scratch).await?;
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
                            preprocess::image_to_input_with(&bytes, pre, m.manifest.layout, max_pixels, &mut scratch)
                        });
                        pool.give(scratch);
                        let nanos = u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX);
                        tally.0.fetch_add(nanos, std::sync::atomic::Ordering::Relaxed);
                        tally.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
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
            out
        });
        let ran = try_join_all(runs).await?;
        tracing::debug!(arrival = run.arrival, "Samples computed.");
        let mut outputs: Vec<Option<Tensor>> = (0..order.len()).map(|_| None).collect();
        for (i, out) in order.into_iter().zip(ran) {
            outputs[i] = Some(out);
        }
        Ok(outputs.into_iter().flatten().collect())
    }
}

/// One pushdown request, resolved ([`Pushdown::prepare`]): the model and split, named once, its
/// engine, and every memory hold the request takes (its source, its samples' outputs), released
/// together when the response has been sent ([`Output::reservation`]).
#[derive(Debug)]
pub struct Job<'a> {
    service: &'a Pushdown,
    /// The request's fields, `split=auto` resolved.
    spec: PushdownSpec,
    model: Arc<Model>,
    /// The split's manifest name (an index in the request names it too).
    split: String,
    tenant: String,
    /// The predicted epoch seconds per candidate when `split=auto` chose the split.
    plan: Option<String>,
    /// The split's engine and its memory model, from before the source is held.
    engine: Option<(Arc<Engine>, memory::MemoryModel, usize)>,
    /// How long [`Self::read_source`] waited for the engine (not part of the source's fetch).
    engine_wait: Duration,
    source: Option<governor::Held>,
    /// When the request arrived, among all pushdown requests, or where its client's order puts it
    /// (`Pushdown::arrivals`): its samples are decoded and run after those of the tenant's earlier
    /// requests (ADR 0019, ADR 0021).
    arrival: u64,
}

impl Job<'_> {
    /// The request's fields with the split resolved.
    #[must_use]
    pub fn spec(&self) -> &PushdownSpec {
        &self.spec
    }

    /// `x-tensorgate-plan`: what `split=auto` predicted per candidate, when it chose.
    #[must_use]
    pub fn plan(&self) -> Option<&str> {
        self.plan.as_deref()
    }

    /// What determines the output beside the source object: the model's digest (which covers
    /// its preprocessing), the split, the format, the dtype and a Parquet input column (the cache
    /// key's variant).
    #[must_use]
    pub fn variant(&self) -> String {
        let mut v = format!("{}|{}|{:?}|{}", self.model.digest, self.split, self.spec.format, self.spec.dtype.name());
        if let Some(c) = &self.spec.column {
            v.push_str(&format!("|column={c}"));
        }
        if let Some(g) = self.spec.row_groups {
            v.push_str(&format!("|row-groups={g}"));
        }
        v
    }

    /// How long reading the source waited for the split's engine to start (a fetch's time
    /// without it is the store's).
    #[must_use]
    pub fn engine_wait(&self) -> Duration {
        self.engine_wait
    }

    /// The split's engine (started if need be) and its memory model and batch cap.
    async fn engine(&self) -> Result<(Arc<Engine>, memory::MemoryModel, usize), PushdownError> {
        if let Some(e) = &self.engine {
            return Ok(e.clone());
        }
        let engine = self.service.engine(&self.model, &self.split).await?;
        let (memory, batch_cap) = engine.memory_model().await?;
        Ok((engine, memory, batch_cap))
    }

    /// Reads a source body under the memory budget and a deadline. The split's engine is started
    /// first, while the request holds nothing (an engine waiting for memory that sources hold
    /// would wait on itself). The object counts against the budget from before its first byte
    /// until the response is sent: at `declared` bytes, or while a source without a length (a
    /// chunked answer from a store or a peer) is read, at the most it may be
    /// (`pushdown.max_object_bytes`), then at what arrived; it is admitted only with room left
    /// for a request's outputs ([`governor::Governor::hold_source`]).
    ///
    /// # Errors
    /// The budget's refusal, a source past `max_object_bytes`, a read that failed or ran past
    /// `pushdown.source_timeout_secs`.
    pub async fn read_source(
        &mut self,
        body: crate::body::Body,
        declared: Option<u64>,
    ) -> Result<Bytes, PushdownError> {
        use http_body_util::BodyExt;
        let limit = self.service.cfg.max_object_bytes;
        let bound = declared.map_or(limit, |n| n.min(limit));
        self.service.node.governor.could_ever_hold(bound)?;
        let waited = Instant::now();
        let engine = self.engine().await?;
        self.engine_wait = waited.elapsed();
        let one_sample = engine.1.queued_bytes_per_sample + engine.1.held_bytes_per_sample;
        self.engine = Some(engine);
        let mut hold = self.service.node.governor.hold_source(bound, one_sample).await?;
        let timeout = self.service.cfg.source_timeout;
        let read = http_body_util::Limited::new(body, usize::try_from(limit).unwrap_or(usize::MAX)).collect();
        let object = match tokio::time::timeout(timeout, read).await {
            Err(_) => return Err(PushdownError::SourceTimeout { secs: timeout.as_secs() }),
            Ok(Ok(c)) => c.to_bytes(),
            Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
                return Err(PushdownError::ObjectTooLarge { limit });
            }
            Ok(Err(e)) => return Err(PushdownError::SourceRead(e.to_string())),
        };
        hold.shrink_to(object.len() as u64);
        self.source = Some(hold);
        Ok(object)
    }

    /// Whether the request reads its source by ranges: a Parquet file's row groups.
    #[must_use]
    pub fn ranged(&self) -> bool {
        self.spec.row_groups.is_some()
    }

    /// Checks the footer in a Parquet file's tail (read by [`Self::read_source`] from a ranged
    /// read of its last [`table::TAIL_BYTES`], at `offset` in a file of `len` bytes) for the row
    /// groups the request names, on a blocking thread, and gives the tail's hold back (the
    /// decoding reads the groups' bytes only). Returns the footer and the bytes of the named
    /// groups (`[start, end)`), to read next ([`Self::read_source`], then [`Self::run_table`]).
    ///
    /// # Errors
    /// What [`table::Footer::read`] refuses.
    pub async fn read_footer(
        &mut self,
        (len, offset, tail): (u64, u64, Bytes),
    ) -> Result<(table::Footer, (u64, u64)), PushdownError> {
        let limits = self.limits();
        let text = self.model.tokenizer.is_some();
        let read = tokio::task::spawn_blocking(move || {
            let footer = table::Footer::read(&table::Source::piece(len, offset, tail), limits.reading(text))?;
            let span = footer.span()?;
            Ok((footer, span))
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))?;
        self.source = None;
        read
    }

    /// Runs the prefix on the row groups of a Parquet file read by ranges: `footer` from
    /// [`Self::read_footer`], `source` the groups' bytes. As [`Self::run`] does on a whole object.
    ///
    /// # Errors
    /// As [`Self::run`].
    pub async fn run_table(mut self, source: table::Source, footer: table::Footer) -> Result<Output, PushdownError> {
        let mut out = self.service.compute(&self, Input::Table(source, Box::new(footer))).await?;
        out.reservation.extend(self.source.take());
        Ok(out)
    }

    /// What parsing the source may take ([`SourceLimits`]), from the request.
    fn limits(&self) -> SourceLimits {
        SourceLimits {
            column: self.spec.column.clone(),
            max_decoded: self.service.cfg.max_object_bytes,
            keep_columns: self.spec.format == Some(Format::Parquet),
            row_groups: self.spec.row_groups,
        }
    }

    /// Runs the prefix on the object's bytes and encodes the result. Samples are preprocessed on
    /// blocking threads and enqueued as they are ready, so decoding sample i+1 overlaps inference
    /// of sample i. Each sample is first admitted by the memory governor for the tenant (module
    /// docs of [`governor`]): at most the request's allotment are in flight at once. The output
    /// carries every hold of the job.
    ///
    /// # Errors
    /// Unusable input, overload (queue full or memory wait too long), or inference failure.
    pub async fn run(mut self, object: Bytes) -> Result<Output, PushdownError> {
        let mut out = self.service.compute(&self, Input::Object(object)).await?;
        out.reservation.extend(self.source.take());
        Ok(out)
    }
}

/// What a pushdown computes from.
enum Input {
    /// The whole object.
    Object(Bytes),
    /// Row groups of a Parquet file read by ranges, and its checked footer.
    Table(table::Source, Box<table::Footer>),
}

/// What the object held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// One sample: the output has no batch dimension.
    Single,
    /// A `.npy` with a leading batch dimension.
    Batch,
    /// A WebDataset shard.
    Shard,
    /// A Parquet file's rows ([`table`]).
    Table,
}

impl Kind {
    /// Many samples with keys (and labels): safetensors by default, keys in its metadata.
    fn keyed(self) -> bool {
        matches!(self, Self::Shard | Self::Table)
    }
}

/// A sample's model input: ready, or an image still to preprocess.
enum Item {
    Ready(Vec<f32>),
    Image(Bytes),
}

struct Parsed {
    kind: Kind,
    items: Vec<Item>,
    keys: Vec<String>,
    labels: Option<Vec<i64>>,
    /// A shard's samples' other members (`format=tar` writes them back).
    others: Vec<Vec<(String, Bytes)>>,
    /// A Parquet file whose rows are still to decode, once the governor holds what that takes.
    table: Option<table::Footer>,
    /// A Parquet file's other columns, for a Parquet output.
    kept: Option<table::Kept>,
    /// `items[j]` is the source's sample `order[j]` ([`Self::put_in_engine_order`]).
    order: Vec<usize>,
}

impl Parsed {
    /// A Parquet file's rows: still to decode with `footer`, or none yet.
    fn table(footer: Option<table::Footer>) -> Self {
        Self {
            kind: Kind::Table,
            items: Vec::new(),
            keys: Vec::new(),
            labels: None,
            others: Vec::new(),
            table: footer,
            kept: None,
            order: Vec::new(),
        }
    }

    /// Puts the samples in the order they go to the engine: a text model's shortest first (a
    /// stable sort by attended tokens), so that a batch holds texts of like lengths and runs at
    /// its longest (`engine::feed`); any other model's in source order. A pass over every row: on
    /// the blocking thread that parsed them.
    fn put_in_engine_order(&mut self, text_model: bool) {
        let mut order: Vec<usize> = (0..self.items.len()).collect();
        if text_model {
            order.sort_by_cached_key(|&i| match &self.items[i] {
                Item::Ready(row) => text::attended(row),
                Item::Image(_) => 0,
            });
            let mut items: Vec<Option<Item>> = std::mem::take(&mut self.items).into_iter().map(Some).collect();
            self.items = order.iter().filter_map(|&i| items[i].take()).collect();
        }
        self.order = order;
    }
}

/// A model's split by name (or index), or the error naming the splits it has.
fn split_def<'a>(model: &'a Model, name: &str) -> Result<&'a manifest::SplitDef, PushdownError> {
    model.split(name).ok_or_else(|| PushdownError::UnknownSplit {
        model: model.manifest.name.clone(),
        split: name.to_owned(),
        known: model.split_names().join(", "),
    })
}

fn no_preprocess(model: &str) -> PushdownError {
    PushdownError::Unsupported(format!("model {model} has no [preprocess] in its manifest: send .npy tensors"))
}

fn name_sample(e: PushdownError, key: Option<&String>) -> PushdownError {
    match (e, key) {
        (PushdownError::BadInput(m), Some(k)) => PushdownError::BadInput(format!("sample {k:?}: {m}")),
        (e, _) => e,
    }
}

/// Each item's scratch reservation, from its image header (read once, on a blocking thread).
/// Refuses a request whose images would decode and resample more than `limit` pixels in all,
/// before any is decoded.
fn image_costs(
    parsed: &Parsed,
    manifest: &manifest::Manifest,
    (max_image, limit): (u64, u64),
) -> Result<Vec<u64>, PushdownError> {
    let resize = manifest.preprocess.as_ref().and_then(|p| p.resize_shorter);
    let costs: Vec<preprocess::Cost> = parsed
        .items
        .iter()
        .map(|item| match item {
            Item::Image(bytes) => preprocess::cost(bytes, resize, max_image),
            Item::Ready(_) => preprocess::Cost::default(),
        })
        .collect();
    let total = costs.iter().map(|c| c.pixels).fold(0u64, u64::saturating_add);
    if total > limit {
        return Err(PushdownError::BadInput(format!(
            "the object's images decode and resize to {total} pixels in all, more than the limit of {limit} \
             (pushdown.max_request_pixels)"
        )));
    }
    Ok(costs.into_iter().map(|c| c.scratch_bytes).collect())
}

/// Reads an object into model inputs (images are left encoded; see [`Pushdown::compute`]; texts
/// are tokenized here, on the blocking thread that parses).
/// `table`: the object as a Parquet file, when it is one.
fn parse(
    object: &Bytes,
    table: Option<&table::Source>,
    model: &Model,
    source: &SourceLimits,
) -> Result<Parsed, PushdownError> {
    let manifest = &model.manifest;
    let one = |kind, items| Parsed {
        kind,
        items,
        keys: Vec::new(),
        labels: None,
        others: Vec::new(),
        table: None,
        kept: None,
        order: Vec::new(),
    };
    let lines = model.tokenizer.is_some() && text::is_jsonl(object);
    if source.row_groups.is_some() && table.is_none() {
        return Err(PushdownError::InvalidArgument {
            field: "row-groups".into(),
            message: "names row groups of a Parquet file; this object is not one".into(),
        });
    }
    if source.column.is_some() && table.is_none() && !lines {
        return Err(PushdownError::InvalidArgument {
            field: "column".into(),
            message: "names a Parquet file's input column (or a text model's JSON Lines field); this object is \
                      neither"
                .into(),
        });
    }
    if let Some(table) = table {
        if manifest.preprocess.is_none() && model.tokenizer.is_none() {
            return Err(no_preprocess(&manifest.name));
        }
        let footer = table::Footer::read(table, source.reading(model.tokenizer.is_some()))?;
        return Ok(Parsed::table(Some(footer)));
    }
    if let Some(encoder) = &model.tokenizer {
        if lines {
            let rows = text::jsonl_rows(object, source.column.as_deref())?;
            let items = rows
                .iter()
                .map(|r| encoder.encode(&r.text).map(Item::Ready).map_err(|e| name_sample(e, Some(&r.key))))
                .collect::<Result<Vec<_>, _>>()?;
            let labels = rows.iter().map(|r| r.label).collect();
            let keys = rows.into_iter().map(|r| r.key).collect();
            return Ok(Parsed { keys, labels, others: vec![Vec::new(); items.len()], ..one(Kind::Table, items) });
        }
        // Token rows as `.npy` (`[2, L]` or `[N, 2, L]`) are the model's input as they are.
        if !object.starts_with(b"\x93NUMPY") {
            let row = encoder.encode(&text::plain(object)?)?;
            return Ok(one(Kind::Single, vec![Item::Ready(row)]));
        }
    }
    if preprocess::is_image(object) {
        if manifest.preprocess.is_none() {
            return Err(no_preprocess(&manifest.name));
        }
        return Ok(one(Kind::Single, vec![Item::Image(object.clone())]));
    }
    if object.starts_with(b"\x93NUMPY") {
        let (batched, samples) = npy_samples(object, &manifest.input_shape)?;
        let kind = if batched { Kind::Batch } else { Kind::Single };
        return Ok(one(kind, samples.into_iter().map(Item::Ready).collect()));
    }
    if shard::is_tar(object) {
        let samples = shard::read(object)?;
        let mut items = Vec::with_capacity(samples.len());
        let mut keys = Vec::with_capacity(samples.len());
        let mut others = Vec::with_capacity(samples.len());
        let labels = samples.iter().map(|s| s.label).collect::<Option<Vec<i64>>>();
        for s in samples {
            items.push(match s.input {
                shard::SampleInput::Image(b) => {
                    if manifest.preprocess.is_none() {
                        return Err(no_preprocess(&manifest.name));
                    }
                    Item::Image(b)
                }
                shard::SampleInput::Npy(b) => {
                    let (batched, mut v) =
                        npy_samples(&b, &manifest.input_shape).map_err(|e| name_sample(e, Some(&s.key)))?;
                    if batched || v.len() != 1 {
                        return Err(PushdownError::BadInput(format!(
                            "sample {:?}: a shard's .npy must hold one sample",
                            s.key
                        )));
                    }
                    Item::Ready(v.remove(0))
                }
            });
            keys.push(s.key);
            others.push(s.others);
        }
        return Ok(Parsed {
            kind: Kind::Shard,
            items,
            keys,
            labels,
            others,
            table: None,
            kept: None,
            order: Vec::new(),
        });
    }
    Err(PushdownError::Unsupported(
        "the object is not a JPEG or PNG image, a .npy tensor, a WebDataset tar shard or a Parquet file".into(),
    ))
}

/// What parsing a source may take beside the source: a Parquet input column (`column`), the
/// most bytes its decoded columns may hold (`pushdown.max_object_bytes`), and whether its other
/// columns are decoded too (a Parquet output).
struct SourceLimits {
    column: Option<String>,
    max_decoded: u64,
    keep_columns: bool,
    /// Some row groups of a Parquet file (`row-groups`).
    row_groups: Option<spec::RowGroups>,
}

impl SourceLimits {
    /// What a Parquet file is read for; `text`: by a text model.
    fn reading(&self, text: bool) -> table::Reading<'_> {
        table::Reading {
            column: self.column.as_deref(),
            max_decoded: self.max_decoded,
            keep: self.keep_columns,
            text,
            row_groups: self.row_groups,
        }
    }
}

/// Rows of a Parquet file (a row group's) as the items, keys and labels of samples: encoded
/// images, or texts tokenized here by a text model's `encoder`.
fn table_rows(rows: Vec<table::Row>, encoder: Option<&text::Encoder>) -> Result<Parsed, PushdownError> {
    let mut parsed = Parsed::table(None);
    parsed.labels = rows.iter().map(|r| r.label).collect();
    parsed.keys = rows.iter().map(|r| r.key.clone()).collect();
    parsed.items = match encoder {
        None => rows.into_iter().map(|r| Item::Image(r.input)).collect(),
        Some(encoder) => rows
            .into_iter()
            .map(|r| {
                let text = std::str::from_utf8(&r.input)
                    .map_err(|e| PushdownError::BadInput(format!("row {:?} is not UTF-8: {e}", r.key)))?;
                encoder.encode(text).map(Item::Ready).map_err(|e| name_sample(e, Some(&r.key)))
            })
            .collect::<Result<_, _>>()?,
    };
    Ok(parsed)
}

/// Splits a `.npy` into per-sample inputs; `true` if it carried a batch dimension.
fn npy_samples(object: &[u8], sample_shape: &[usize]) -> Result<(bool, Vec<Vec<f32>>), PushdownError> {
    let t = tensor::read_npy(object)?;
    let per: usize = sample_shape.iter().product();
    if t.shape == sample_shape {
        Ok((false, vec![t.data]))
    } else if t.shape.len() == sample_shape.len() + 1 && t.shape[1..] == *sample_shape && t.shape[0] > 0 {
        Ok((true, t.data.chunks_exact(per).map(<[f32]>::to_vec).collect()))
    } else {
        Err(PushdownError::BadInput(format!(
            "tensor shape {:?} is neither {sample_shape:?} nor [N, ...] of it",
            t.shape
        )))
    }
}

/// Bytes a `format=tar` body holds beyond the encoded features: copies of the samples' other
/// members and the tar framing.
fn tar_overhead(keys: &[String], others: &[Vec<(String, Bytes)>]) -> usize {
    let members = keys.len() + others.iter().map(Vec::len).sum::<usize>();
    let longest = keys
        .iter()
        .zip(others)
        .map(|(k, o)| k.len() + 1 + o.iter().map(|(e, _)| e.len()).chain([3]).max().unwrap_or(3))
        .max()
        .unwrap_or(0);
    let extra: usize = others.iter().flatten().map(|(_, b)| b.len()).sum();
    extra + shard::framing_bytes(members, longest)
}

/// A shard's outputs as a WebDataset shard (`format=tar`): each sample's features as `.npy`, its
/// other members after it. Returns the body and the shape the features would have stacked.
fn write_tar(
    outputs: &[Tensor],
    keys: &[String],
    others: &[Vec<(String, Bytes)>],
    dtype: Dtype,
) -> Result<(Vec<u8>, Vec<usize>), PushdownError> {
    // An .npy header of a feature map is well under 128 bytes.
    let per = outputs.first().map_or(0, |t| t.data.len() * dtype.size() + 128);
    let capacity = per * outputs.len() + tar_overhead(keys, others);
    let rows =
        outputs.iter().zip(keys).zip(others).map(|((t, k), o)| (k.as_str(), tensor::write_npy(t, dtype), o.as_slice()));
    let body = shard::write(rows, capacity)?;
    let mut shape = vec![outputs.len()];
    shape.extend(outputs.first().map(|t| t.shape.clone()).unwrap_or_default());
    Ok((body, shape))
}

fn stack(outputs: Vec<Tensor>, batched: bool) -> Tensor {
    let mut it = outputs.into_iter();
    let first = it.next().unwrap_or(Tensor { shape: vec![0], data: Vec::new() });
    if !batched {
        return first;
    }
    let mut shape = vec![1];
    shape.extend(&first.shape);
    let mut data = first.data;
    for t in it {
        shape[0] += 1;
        data.extend(t.data);
    }
    Tensor { shape, data }
}
