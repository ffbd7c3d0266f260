//! Inference workers: one thread per (model, split) owning its ONNX Runtime session (`run` takes
//! `&mut self`; CPU work never runs on tokio threads). Requests enqueue single samples on a bounded
//! queue; the worker takes what is waiting (up to `max_batch`) and runs it as one batch, so
//! samples of one request and of concurrent requests share a run. A sample whose requester has
//! gone is dropped before it runs. A full queue is refused at once (`503 SlowDown`).
//!
//! Before serving, the first worker checks its prefix once against the full model with the split
//! tensor exposed, on a deterministic probe input (the outputs must be identical), and measures the
//! (model, split)'s memory model ([`super::memory`]); the other workers wait for that verdict.
//! By default (`pushdown.ort_arena = "per-run"`) runs allocate from ONNX Runtime's arena and give
//! it back at their end, so memory a run used is returned after it and the governor's accounting
//! matches what the process holds (between two full batches of one size the regions are kept for
//! the next run, within the full batch the engine reserved: [`GiveBack`], ADR 0024); with `"off"`
//! every tensor is its own allocation (the same accounting); with `"kept"` a session keeps its arena between runs and the memory model is
//! measured on what stays ([`memory`]).
//!
//! Supervision: a run that panics answers its batch with an error, the worker logs it, drops the
//! session (its state is unknown) and builds a fresh one; a worker that cannot rebuild exits, and
//! an engine with no worker left reports itself dead so the table (`super::engines`) starts a new
//! one. When the last handle on an engine goes, its queue closes, the workers exit, and the
//! engine's memory reservation returns to the governor.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::clock::CpuTally;
use super::error::PushdownError;
use super::fair::{FairSlots, Slot};
use super::governor::{EngineHold, Governor, Held};
use super::inference::{GiveBack, Inference, Session, SessionSettings};
use super::manifest::Manifest;
use super::memory::{self, MemoryModel, PROBE_BATCHES};
use super::prefix;
use super::queue::{Place, Queue, Refused};
use super::registry::Model;
use super::tensor::Tensor;
use super::text;
use crate::metrics::{Metrics, ModelSplit, ModelSplitStage, ModelSplitTokens, ReasonLabel};

pub use super::inference::OrtArena;

/// How many batches' worth of samples (per worker) may be decoded and waiting for an engine's
/// inference ([`Engine::ahead`]): two keeps its next batch ready while one runs. Without a bound a
/// node decodes every sample of every open request first, on the same cores, and delays the first
/// request's inference by all of that decoding (and holds every decoded input meanwhile): the
/// oldest request's answer came after all requests' decoding.
pub(crate) const LOOKAHEAD_BATCHES: usize = 2;

/// How many times [`LOOKAHEAD_BATCHES`] an engine lends beyond it to a tenant's earlier requests
/// whose later requests' samples took the places first ([`super::fair`], ADR 0021): a client's
/// prefetched requests reach the gateway a few milliseconds apart in any order, and each of the
/// three after the first may have taken places before the first's source came back. Memory is
/// not what this bounds (every sample is admitted by the budget before it asks for a place), but
/// how far decoding may run ahead of inference while they catch up.
pub(crate) const LOOKAHEAD_LOANS: usize = 3;

/// Settings of one engine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineConfig {
    /// Samples waiting before new ones are refused.
    pub(crate) queue_capacity: usize,
    /// Most samples per inference run.
    pub(crate) max_batch: usize,
    /// ONNX Runtime intra-op threads per session (1 is fastest per core on small machines; scale
    /// with `workers` instead).
    pub(crate) intra_threads: usize,
    /// Worker threads (each owning a session) per (model, split), sharing one queue.
    pub(crate) workers: usize,
    /// How sessions use ONNX Runtime's CPU arena (`pushdown.ort_arena`).
    pub(crate) ort_arena: OrtArena,
}

/// What every engine of a node shares.
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub(crate) governor: Arc<Governor>,
    /// Serializes memory probes: the resident peak they read is process-wide.
    pub(crate) probe_lock: Arc<Mutex<()>>,
    /// Every engine's inference threads still running.
    pub(crate) threads: Arc<Threads>,
    /// The inference slots (`pushdown.inference_runs`): a batch runs when they come to its
    /// earliest sample, whichever engine it is on ([`super::fair`]).
    pub(crate) runs: Arc<FairSlots>,
    /// Buffers kept between batches and images: a batch's buffer comes from there and goes back
    /// after its run, with its samples' inputs.
    pub(crate) scratch: Arc<super::preprocess::ScratchPool>,
    /// What first sessions measured and checked, for the engines that start again later.
    pub(crate) measured: Arc<Measured>,
}

/// The memory model and the prefix check's verdict an engine's first session found for a model
/// version's split under one engine configuration, kept for the process's life: an engine of
/// the same that starts again (after `pushdown.engine_idle_secs`, or after its memory was
/// reclaimed) skips the probe runs and the check. Both depend only on the prefix's bytes (the
/// model's digest and the split tensor), the session settings and this machine and ONNX
/// Runtime, none of which changes within a process. Bounded by the registry: one entry per split
/// of a loaded model that ever started.
#[derive(Debug, Default)]
pub(crate) struct Measured(Mutex<HashMap<MeasuredKey, Found>>);

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct MeasuredKey {
    digest: String,
    tensor: String,
    max_batch: usize,
    intra_threads: usize,
    ort_arena: OrtArena,
}

/// What a first session found (after the check passed).
#[derive(Debug, Clone)]
struct Found {
    memory: MemoryModel,
    cut_padding: bool,
}

impl Measured {
    fn key(s: &Shared) -> MeasuredKey {
        MeasuredKey {
            digest: s.model.version.clone(),
            tensor: s.tensor.clone(),
            max_batch: s.cfg.max_batch,
            intra_threads: s.cfg.intra_threads,
            ort_arena: s.cfg.ort_arena,
        }
    }

    fn get(&self, key: &MeasuredKey) -> Option<Found> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).get(key).cloned()
    }

    fn insert(&self, key: MeasuredKey, found: Found) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).insert(key, found);
    }
}

struct QueuedSample {
    input: Vec<f32>,
    /// Largest batch this sample may run in.
    cap: usize,
    /// Whose sample it is and its place: a batch waits for an inference slot
    /// (`pushdown.inference_runs`) as its earliest sample.
    tenant: Arc<str>,
    place: Place,
    reply: oneshot::Sender<Result<Tensor, PushdownError>>,
    enqueued: Instant,
}

/// What the first worker found: the memory model and the batch cap the budget allows, or why
/// the prefix cannot serve.
type Verdict = Option<Result<(MemoryModel, usize), PushdownError>>;

/// A running worker for one (model, split).
#[derive(Debug)]
pub(crate) struct Engine {
    queue: Arc<Queue<QueuedSample>>,
    /// Places for samples between their decoding and the end of their inference
    /// ([`LOOKAHEAD_BATCHES`]), handed out as the preprocessing slots are (tenants in turn, each
    /// tenant's requests by arrival).
    lookahead: Arc<FairSlots>,
    /// Samples waiting for a lookahead place or holding one: what `queue_capacity` bounds
    /// ([`Self::ahead`]).
    pending: Arc<AtomicUsize>,
    queue_capacity: usize,
    depth: Arc<AtomicUsize>,
    sample_len: usize,
    gauges: Gauges,
    verdict: tokio::sync::watch::Receiver<Verdict>,
    workers: usize,
    /// Inference CPU time its workers spent on real batches, and the samples in them: the
    /// measured per-sample prefix cost the split planner prefers over a one-off probe.
    observed: Arc<CpuTally>,
    /// Workers still running.
    alive: Arc<AtomicUsize>,
    /// Fault injection for the supervision tests: the next run panics.
    panic_next: Arc<AtomicBool>,
}

/// A sample's place ahead of its engine's inference ([`Engine::ahead`]), given back on drop.
#[derive(Debug)]
pub(crate) struct Ahead {
    _slot: Slot,
    _pending: Counted,
}

/// One sample counted in [`Engine::ahead`]'s bound while it lives.
#[derive(Debug)]
struct Counted {
    counter: Arc<AtomicUsize>,
    /// The count with this sample.
    count: usize,
}

impl Counted {
    fn new(counter: &Arc<AtomicUsize>) -> Self {
        let count = counter.fetch_add(1, Ordering::SeqCst).saturating_add(1);
        Self { counter: counter.clone(), count }
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.counter.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drop for Engine {
    /// The workers take what is queued, then stop (as a channel's receivers do when its last
    /// sender is gone).
    fn drop(&mut self) {
        self.queue.close();
    }
}

/// Samples an engine must have run before its observed cost replaces the planner's probe.
const MIN_OBSERVED_SAMPLES: u64 = 16;

/// `tensorgate_pushdown_tokens_total` of one engine: the token positions its batches ran,
/// attended and padding.
#[derive(Debug, Clone)]
struct TokenCounters {
    attended: prometheus_client::metrics::counter::Counter,
    padding: prometheus_client::metrics::counter::Counter,
}

/// The engine's metrics, labelled with its model and split.
#[derive(Debug, Clone)]
struct Gauges {
    queue_depth: prometheus_client::metrics::gauge::Gauge,
    batch_size: prometheus_client::metrics::histogram::Histogram,
    samples: prometheus_client::metrics::counter::Counter,
    /// Time samples wait in the queue (the `queue` stage of the stage histogram).
    queue_wait: prometheus_client::metrics::histogram::Histogram,
    /// A text model's token positions run.
    tokens: TokenCounters,
}

impl Gauges {
    fn new(metrics: &Metrics, label: &ModelSplit) -> Self {
        Self {
            queue_depth: metrics.pushdown_queue_depth.get_or_create(label).clone(),
            batch_size: metrics.pushdown_batch_size.get_or_create(label).clone(),
            samples: metrics.pushdown_samples.get_or_create(label).clone(),
            queue_wait: metrics
                .pushdown_stage_duration
                .get_or_create(&ModelSplitStage {
                    model: label.model.clone(),
                    split: label.split.clone(),
                    stage: "queue",
                })
                .clone(),
            tokens: {
                let counter = |kind| {
                    let tokens = ModelSplitTokens { model: label.model.clone(), split: label.split.clone(), kind };
                    metrics.pushdown_tokens.get_or_create(&tokens).clone()
                };
                TokenCounters { attended: counter("attended"), padding: counter("padding") }
            },
        }
    }
}

impl Engine {
    /// Starts the worker threads. Session creation, the prefix check and the memory probe happen on
    /// the first one; if they fail (or the engine does not fit the memory budget), every request
    /// gets the error.
    ///
    /// # Errors
    /// The prefix cannot be cut or a thread cannot start.
    pub(crate) fn start(
        inference: &Arc<dyn Inference>,
        model: &Arc<Model>,
        (split, tensor): (&str, &str),
        cfg: EngineConfig,
        metrics: &Metrics,
        node: &Node,
        start_hold: Held,
    ) -> Result<Self, PushdownError> {
        let Node { governor, probe_lock, threads, runs, scratch, measured } = node;
        let label = ModelSplit { model: model.manifest.name.clone(), split: split.to_owned() };
        let gauges = Gauges::new(metrics, &label);
        let prefix_bytes = prefix::cut(&model.bytes, &[tensor]).map_err(|e| PushdownError::Model(e.to_string()))?;
        let sample_len = model.manifest.input_shape.iter().product();
        let queue = Arc::new(Queue::new(cfg.queue_capacity));
        let depth = Arc::new(AtomicUsize::new(0));
        let prefix_bytes = Arc::new(prefix_bytes);
        let (verdict_tx, verdict) = tokio::sync::watch::channel(None);
        let verdict_tx = Arc::new(verdict_tx);
        let workers = cfg.workers.max(1);
        let observed = Arc::new(CpuTally::default());
        let (alive, panic_next, hold) =
            (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)), Arc::default());
        let start_hold = Arc::new(Mutex::new(Some(start_hold)));
        let cut_padding = Arc::new(AtomicBool::new(false));
        let left = Arc::new(AtomicUsize::new(workers));
        for n in 0..workers {
            let shared = Shared {
                inference: inference.clone(),
                model: model.clone(),
                tensor: tensor.to_owned(),
                prefix_bytes: prefix_bytes.clone(),
                cfg,
                queue: queue.clone(),
                depth: depth.clone(),
                gauges: gauges.clone(),
                verdict: verdict_tx.clone(),
                governor: governor.clone(),
                probe_lock: probe_lock.clone(),
                runs: runs.clone(),
                scratch: scratch.clone(),
                measured: measured.clone(),
                starts: metrics.engine_starts.clone(),
                failures: metrics.engine_failures.clone(),
                observed: observed.clone(),
                panic_next: panic_next.clone(),
                hold: Arc::clone(&hold),
                start_hold: Arc::clone(&start_hold),
                cut_padding: Arc::clone(&cut_padding),
                left: Arc::clone(&left),
            };
            alive.fetch_add(1, Ordering::SeqCst);
            *threads.running.lock().unwrap_or_else(PoisonError::into_inner) += 1;
            let running = Running(alive.clone(), threads.clone());
            std::thread::Builder::new()
                .name(format!("infer-{}-{split}-{n}", model.manifest.name))
                .spawn(move || {
                    // Dropped last: the count falls only once the thread holds nothing of ONNX
                    // Runtime (its session in `worker`, the environment handle in `shared`).
                    let _running = running;
                    let shared = shared;
                    worker(&shared, n == 0);
                    if shared.left.fetch_sub(1, Ordering::SeqCst) == 1 {
                        stopped(&shared);
                    }
                })
                .map_err(|e| PushdownError::Internal(format!("cannot start inference thread: {e}")))?;
        }
        let ahead = LOOKAHEAD_BATCHES * workers * cfg.max_batch.max(1);
        let lookahead = FairSlots::lending(ahead, LOOKAHEAD_LOANS * ahead);
        Ok(Self {
            queue,
            lookahead,
            pending: Arc::default(),
            queue_capacity: cfg.queue_capacity,
            depth,
            sample_len,
            gauges,
            verdict,
            workers,
            observed,
            alive,
            panic_next,
        })
    }

    /// The (model, split)'s memory model and batch cap, once the first worker has measured it.
    ///
    /// # Errors
    /// The prefix is unusable or does not fit the memory budget.
    pub(crate) async fn memory_model(&self) -> Result<(MemoryModel, usize), PushdownError> {
        let mut rx = self.verdict.clone();
        let v = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| PushdownError::Internal("inference worker stopped".into()))?;
        match v.as_ref() {
            Some(Ok(m)) => Ok(m.clone()),
            Some(Err(e)) => Err(e.clone()),
            None => Err(PushdownError::Internal("no verdict".into())),
        }
    }

    /// The memory model if measured yet (for the admin API).
    #[must_use]
    pub(crate) fn memory_model_now(&self) -> Option<(MemoryModel, usize)> {
        self.verdict.borrow().as_ref().and_then(|v| v.as_ref().ok().cloned())
    }

    /// Worker threads (each holds a session: the fixed memory counts once per worker).
    #[must_use]
    pub(crate) fn workers(&self) -> usize {
        self.workers
    }

    /// Waits for a place ahead of this engine's inference for sample `place` of `tenant`: taken
    /// before a sample is decoded, kept (the returned guard) until its inference ends
    /// ([`LOOKAHEAD_BATCHES`]). The samples waiting for a place count as queued: past
    /// `queue_capacity` of them a sample is refused at once, as a full queue refuses it.
    ///
    /// # Errors
    /// `Overloaded` when `queue_capacity` samples already wait for this engine.
    pub(crate) async fn ahead(&self, tenant: &str, place: Place) -> Result<Ahead, PushdownError> {
        let pending = Counted::new(&self.pending);
        if pending.count > self.queue_capacity {
            return Err(PushdownError::Overloaded);
        }
        let slot = self.lookahead.acquire(tenant, place).await;
        Ok(Ahead { _slot: slot, _pending: pending })
    }

    /// Runs sample `place` of `tenant` (per-sample shape, already preprocessed) in a batch of at
    /// most `cap`, after the queued samples of earlier places (its request's arrival, its position
    /// in it: [`Queue`]); the batch runs when the node's inference slots come to its earliest
    /// sample (tenants in turn, then by place, across engines: [`super::fair`]).
    ///
    /// # Errors
    /// Queue full (`Overloaded`), wrong input size, or an inference failure.
    pub(crate) async fn infer(
        &self,
        tenant: &str,
        place: Place,
        input: Vec<f32>,
        cap: usize,
    ) -> Result<Tensor, PushdownError> {
        if input.len() != self.sample_len {
            return Err(PushdownError::BadInput(format!(
                "input has {} values, the model takes {}",
                input.len(),
                self.sample_len
            )));
        }
        let (reply, rx) = oneshot::channel();
        // Count the sample before the worker can see it, so the worker's decrement never runs first.
        let d = self.depth.fetch_add(1, Ordering::Relaxed).saturating_add(1);
        self.gauges.queue_depth.set(i64::try_from(d).unwrap_or(i64::MAX));
        let job =
            QueuedSample { input, cap: cap.max(1), tenant: tenant.into(), place, reply, enqueued: Instant::now() };
        if let Err(e) = self.queue.push(place, job) {
            let left = self.depth.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
            self.gauges.queue_depth.set(i64::try_from(left).unwrap_or(i64::MAX));
            return Err(match e {
                Refused::Full(_) => PushdownError::Overloaded,
                Refused::Closed(_) => PushdownError::Internal("inference worker stopped".into()),
            });
        }
        rx.await.map_err(|_| PushdownError::Internal("inference worker dropped the request".into()))?
    }

    /// Mean inference CPU seconds per sample over the batches served so far (one intra-op thread's
    /// worth when `intra_threads` is 1); `None` until [`MIN_OBSERVED_SAMPLES`] have run.
    #[must_use]
    pub(crate) fn observed_secs_per_sample(&self) -> Option<f64> {
        self.observed.secs_per_sample(MIN_OBSERVED_SAMPLES)
    }

    /// Whether any worker still runs (an engine whose workers all died is replaced).
    #[must_use]
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst) > 0
    }

    /// Whether the first worker found the prefix unusable or the engine too large for the budget.
    #[must_use]
    pub(crate) fn failed(&self) -> bool {
        matches!(self.verdict.borrow().as_ref(), Some(Err(_)))
    }

    /// Fault injection for the supervision tests: the next inference run panics.
    #[doc(hidden)]
    pub(crate) fn inject_panic(&self) {
        self.panic_next.store(true, Ordering::SeqCst);
    }
}

/// Counts a worker as running, in its engine and in the service, until its thread ends, however
/// it ends.
struct Running(Arc<AtomicUsize>, Arc<Threads>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
        let mut running = self.1.running.lock().unwrap_or_else(PoisonError::into_inner);
        *running -= 1;
        if *running == 0 {
            self.1.ended.notify_all();
        }
    }
}

/// The inference threads still running, of every engine a service started. The service waits for
/// them when it stops: a process that exits while one of them is inside ONNX Runtime (dropping its
/// session after its queue closed) aborts, because the exit destroys the library's static objects
/// under the thread ("pure virtual method called", SIGABRT instead of a clean exit).
#[derive(Debug, Default)]
pub(crate) struct Threads {
    running: Mutex<usize>,
    ended: Condvar,
}

impl Threads {
    /// Inference threads that still hold anything of ONNX Runtime.
    #[must_use]
    pub(crate) fn running(&self) -> usize {
        *self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Blocks until no inference thread runs, at most `within`; returns whether none does.
    pub(crate) fn wait_ended(&self, within: Duration) -> bool {
        let running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let (running, _) =
            self.ended.wait_timeout_while(running, within, |n| *n > 0).unwrap_or_else(PoisonError::into_inner);
        *running == 0
    }
}

/// The once-per-engine check: prefix output == full model output at the split tensor.
fn check_prefix(
    inference: &dyn Inference,
    model: &Model,
    tensor: &str,
    prefix_session: &mut dyn Session,
) -> Result<(), String> {
    let exposed = prefix::expose(&model.bytes, &[tensor]).map_err(|e| e.to_string())?;
    // A one-off session: nothing to keep between runs.
    let mut full = inference.session(&exposed, SessionSettings { threads: 1, arena: OrtArena::Off }, &model.dir)?;
    let (shape, input) = probe_input(model, 1);
    let a = prefix_session.run(&model.manifest, tensor, &shape, &input)?;
    let b = full.run(&model.manifest, tensor, &shape, &input)?;
    if a == b { Ok(()) } else { Err(format!("prefix output at {tensor} differs from the full model's")) }
}

/// A deterministic batch of probe values in [-1, 1); for a text model, token ids below 1,000
/// (within every vocabulary) with every token attended.
pub(crate) fn probe_input(model: &Model, batch: usize) -> (Vec<usize>, Vec<f32>) {
    probe_texts(&model.manifest, batch, usize::MAX)
}

/// [`probe_input`], a text model's rows attended over their first `attended` tokens (padded
/// after, as the tokenizer pads shorter texts).
pub(crate) fn probe_texts(manifest: &Manifest, batch: usize, attended: usize) -> (Vec<usize>, Vec<f32>) {
    let mut shape = vec![batch];
    shape.extend(&manifest.input_shape);
    let n: usize = shape.iter().product();
    if let (Some(_), &[_, 2, len]) = (&manifest.text, shape.as_slice()) {
        let used = |i: usize| i < attended;
        let row = move |r: usize| {
            (0..len)
                .map(move |i| if used(i) { ((r * len + i) * 7919 % 1000) as f32 } else { 0.0 })
                .chain((0..len).map(move |i| f32::from(u8::from(used(i)))))
        };
        return (shape, (0..batch).flat_map(row).collect());
    }
    (shape, (0..n).map(|i| ((i * 7919) % 2000) as f32 / 1000.0 - 1.0).collect())
}

/// Creates the first session, checks the prefix, and measures the memory model (module docs of
/// [`memory`]), unless an earlier engine of the same did ([`Measured`]).
fn first_session(s: &Shared) -> Result<(Box<dyn Session>, MemoryModel), String> {
    let key = Measured::key(s);
    if let Some(Found { memory, cut_padding }) = s.measured.get(&key) {
        let started = Instant::now();
        s.cut_padding.store(cut_padding, Ordering::SeqCst);
        let session = session_for(s)?;
        s.starts.get_or_create(&ReasonLabel { reason: "remembered" }).inc();
        tracing::debug!(
            model = %s.model.manifest.name,
            tensor = %s.tensor,
            session_ms = started.elapsed().as_millis(),
            "First session of an engine, as measured and checked before."
        );
        return Ok((session, memory));
    }
    let (session, found) = measure_and_check(s)?;
    s.measured.insert(key, found.clone());
    s.starts.get_or_create(&ReasonLabel { reason: "measured" }).inc();
    Ok((session, found.memory))
}

/// The first session of a (model, split) in this process: created, run at the probe batches
/// to measure its memory model, its output checked against the full model's, and (a text model)
/// probed for whether padding may be cut. Holds the process-wide probe lock throughout.
fn measure_and_check(s: &Shared) -> Result<(Box<dyn Session>, Found), String> {
    let _probe = s.probe_lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let model = &s.model;
    let before = memory::resident_bytes();
    let started = Instant::now();
    let mut session = s.inference.session(&s.prefix_bytes, s.settings(), &model.dir)?;
    let created = started.elapsed();
    let (shape, input) = probe_input(model, 1);
    let out = session.run(&model.manifest, &s.tensor, &shape, &input)?;
    if s.cfg.ort_arena == OrtArena::PerRun {
        // Once more, into a buffer of ours: the warm-up's output region leaves the arena.
        let (shape, input) = probe_input(model, 1);
        session.run(&model.manifest, &s.tensor, &shape, &input)?;
    }
    let input_bytes = 4 * model.manifest.input_shape.iter().product::<usize>() as u64;
    let output_bytes = 4 * out.data.len() as u64;
    let measured = before.zip(memory::resident_bytes()).filter(|_| memory::reset_peak());
    let memory = match measured {
        Some((before, after)) if s.cfg.ort_arena == OrtArena::Kept => {
            // Every batch size once, ascending: what the arena keeps at each (module docs of
            // memory). Batch 1 is the warm-up run above, which `after` was measured after.
            let mut retained = Vec::with_capacity(s.cfg.max_batch);
            retained.push(0);
            for batch in 2..=s.cfg.max_batch {
                let (shape, input) = probe_input(model, batch);
                session.run(&model.manifest, &s.tensor, &shape, &input)?;
                retained.push(memory::resident_bytes().unwrap_or(after).saturating_sub(after));
            }
            MemoryModel::from_retention(after.saturating_sub(before), &retained, input_bytes, output_bytes)
        }
        Some((before, after)) => {
            let mut peaks = [0u64; 2];
            for (peak, batch) in peaks.iter_mut().zip([PROBE_BATCHES.0, PROBE_BATCHES.1]) {
                let (shape, input) = probe_input(model, batch);
                let base = memory::resident_bytes().unwrap_or(0);
                let _ = memory::reset_peak();
                session.run(&model.manifest, &s.tensor, &shape, &input)?;
                *peak = memory::peak_resident_bytes().unwrap_or(base).saturating_sub(base);
            }
            MemoryModel::from_probes(after.saturating_sub(before), peaks, input_bytes, output_bytes)
        }
        None => MemoryModel::estimate(s.prefix_bytes.len() as u64, input_bytes, output_bytes),
    }
    .with_prefix(s.prefix_bytes.len() as u64)
    .with_output_shape(out.shape.get(1..).unwrap_or_default());
    let measured = started.elapsed();
    check_prefix(&*s.inference, model, &s.tensor, &mut *session)?;
    let checked = started.elapsed();
    let cut_padding = session.cut_padding_where_inert(&model.manifest, &s.tensor)?;
    s.cut_padding.store(cut_padding, Ordering::SeqCst);
    tracing::debug!(
        model = %model.manifest.name,
        tensor = %s.tensor,
        session_ms = created.as_millis(),
        memory_ms = (measured - created).as_millis(),
        check_ms = (checked - measured).as_millis(),
        padding_ms = (started.elapsed() - checked).as_millis(),
        "First session of an engine."
    );
    Ok((session, Found { memory, cut_padding }))
}

/// Waits for a sample, then takes whatever else is queued, up to the smallest cap among the taken
/// samples: one batch. The lock is held only while taking, so other workers run their batches
/// meanwhile. `None`: queue closed.
fn next_batch(queue: &Queue<QueuedSample>) -> Option<Vec<QueuedSample>> {
    queue.next_batch(|j| j.cap)
}

/// After the engine's last worker stopped (its sessions could not be built again, or the engine
/// is gone): nothing more is queued, and what waits is answered.
fn stopped(shared: &Shared) {
    shared.queue.close();
    answer_until_closed(&shared.queue, &shared.depth, &PushdownError::Internal("inference worker stopped".into()));
}

/// Answers every sample queued with `e`, until the queue is closed and empty.
fn answer_until_closed(queue: &Queue<QueuedSample>, depth: &AtomicUsize, e: &PushdownError) {
    while let Some(jobs) = next_batch(queue) {
        depth.fetch_sub(jobs.len(), Ordering::Relaxed);
        for job in jobs {
            let _ = job.reply.send(Err(e.clone()));
        }
    }
}

/// What every worker of an engine shares.
struct Shared {
    inference: Arc<dyn Inference>,
    model: Arc<Model>,
    tensor: String,
    prefix_bytes: Arc<Vec<u8>>,
    cfg: EngineConfig,
    queue: Arc<Queue<QueuedSample>>,
    depth: Arc<AtomicUsize>,
    gauges: Gauges,
    verdict: Arc<tokio::sync::watch::Sender<Verdict>>,
    governor: Arc<Governor>,
    probe_lock: Arc<Mutex<()>>,
    /// The node's inference slots, shared by every engine ([`super::fair`]).
    runs: Arc<FairSlots>,
    scratch: Arc<super::preprocess::ScratchPool>,
    /// The node's [`Measured`], and `tensorgate_pushdown_engine_starts_total`.
    measured: Arc<Measured>,
    starts: prometheus_client::metrics::family::Family<ReasonLabel, prometheus_client::metrics::counter::Counter>,
    /// `tensorgate_pushdown_engine_failures_total`.
    failures: prometheus_client::metrics::family::Family<ReasonLabel, prometheus_client::metrics::counter::Counter>,
    observed: Arc<CpuTally>,
    panic_next: Arc<AtomicBool>,
    /// The engine's memory reservation: released when the last worker's `Shared` goes.
    hold: Arc<Mutex<Option<EngineHold>>>,
    /// What the start holds until the first worker has measured (its transient copies of the
    /// whole model), then released.
    start_hold: Arc<Mutex<Option<Held>>>,
    /// What the first worker found for every session of the engine: [`Session::cut_padding_where_inert`].
    cut_padding: Arc<AtomicBool>,
    /// Workers not yet stopped: the last one closes the queue ([`stopped`]).
    left: Arc<AtomicUsize>,
}

impl Shared {
    /// How the engine's sessions are made.
    fn settings(&self) -> SessionSettings {
        SessionSettings { threads: self.cfg.intra_threads, arena: self.cfg.ort_arena }
    }
}

/// A fresh session of the engine's prefix (after the first worker's verdict).
fn session_for(s: &Shared) -> Result<Box<dyn Session>, String> {
    let mut runner = s.inference.session(&s.prefix_bytes, s.settings(), &s.model.dir)?;
    runner.set_cut_padding(s.cut_padding.load(Ordering::SeqCst));
    Ok(runner)
}

/// The first worker's verdict (with the fixed memory of all workers reserved), or the wait for it.
fn ready_session(s: &Shared, first: bool) -> Result<Box<dyn Session>, PushdownError> {
    if first {
        let measured = first_session(s).map_err(PushdownError::Model);
        // The start's transient copies are gone (the full-model check session included).
        drop(s.start_hold.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take());
        let result = measured.and_then(|(session, memory)| {
            // A refusal keeps its kind: `BudgetBusy` (503, other engines hold the budget) or
            // `ExceedsBudget` (400, this engine never fits).
            let (batch, hold) = s.governor.reserve_engine(&memory, s.cfg.workers.max(1), s.cfg.max_batch)?;
            *s.hold.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(hold);
            if batch < s.cfg.max_batch {
                tracing::warn!(model = %s.model.manifest.name, tensor = %s.tensor, batch, "Batches capped to fit pushdown.memory_budget.");
            }
            Ok((session, (memory, batch)))
        });
        let (session, verdict) = match result {
            Ok((session, memory)) => (Ok(session), Ok(memory)),
            Err(e) => (Err(e.clone()), Err(e)),
        };
        s.verdict.send_replace(Some(verdict));
        return session;
    }
    let mut rx = s.verdict.subscribe();
    loop {
        if let Some(v) = rx.borrow_and_update().as_ref() {
            return match v {
                Ok(_) => session_for(s).map_err(PushdownError::Model),
                Err(e) => Err(e.clone()),
            };
        }
        // Parks this thread until the first worker decides (watch has no blocking wait).
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

fn worker(shared: &Shared, first: bool) {
    let Some(mut session) = start_worker(shared, first) else { return };
    let (model, tensor) = (&shared.model.manifest.name, shared.tensor.as_str());
    while let Some(mut jobs) = next_batch(&shared.queue) {
        let before = jobs.len();
        jobs.retain(|j| !j.reply.is_closed());
        shared.depth.fetch_sub(before - jobs.len(), Ordering::Relaxed);
        if jobs.is_empty() {
            continue;
        }
        let batch = gather(shared, &mut jobs, &*session);
        let ran = run_batch(shared, &mut *session, &jobs, &batch);
        shared.scratch.give_floats(batch.data);
        let Ok((result, spent)) = ran else {
            // Counted before the batch is answered: whoever got the error sees it counted.
            shared.failures.get_or_create(&ReasonLabel { reason: "run_panicked" }).inc();
            answer(shared, jobs, Err(PushdownError::Internal("the inference run failed; retry".into())));
            tracing::error!(%model, %tensor, "Inference run panicked; rebuilding the session.");
            match session_for(shared) {
                Ok(fresh) => session = fresh,
                Err(e) => {
                    tracing::error!(%model, %tensor, error = %e, "Cannot rebuild the session; worker stops.");
                    return;
                }
            }
            continue;
        };
        if result.is_ok() {
            shared.observed.add(spent, jobs.len() as u64);
        }
        answer(shared, jobs, result.map_err(|e| PushdownError::Internal(format!("inference failed: {e}"))));
    }
}

/// The worker's session once the engine's verdict is in; `None` (every queued sample answered
/// with the error) when the prefix cannot serve.
fn start_worker(shared: &Shared, first: bool) -> Option<Box<dyn Session>> {
    let (model, tensor) = (&shared.model.manifest.name, shared.tensor.as_str());
    match ready_session(shared, first) {
        Ok(s) => {
            if first {
                tracing::info!(%model, %tensor, "Prefix ready (checked against the full model).");
            }
            Some(s)
        }
        Err(e) => {
            tracing::error!(%model, %tensor, error = %e, "Prefix unusable.");
            answer_until_closed(&shared.queue, &shared.depth, &e);
            None
        }
    }
}

/// One batch's input, as the session runs it.
struct Batch {
    shape: Vec<usize>,
    /// The samples' inputs one after the other, in a buffer from [`Node::scratch`].
    data: Vec<f32>,
    give_back: GiveBack,
}

/// The samples' inputs as one batch (their buffers go back to the scratch pool), counted in the
/// engine's metrics.
fn gather(shared: &Shared, jobs: &mut [QueuedSample], session: &dyn Session) -> Batch {
    let (sample_shape, gauges, batch) = (&shared.model.manifest.input_shape, &shared.gauges, jobs.len());
    // Samples still queued behind this batch (`depth` counts this batch until it has run).
    let give_back = GiveBack::after(
        batch,
        jobs.iter().map(|j| j.cap).min().unwrap_or(batch),
        shared.depth.load(Ordering::Relaxed).saturating_sub(batch),
    );
    let mut shape = vec![batch];
    shape.extend(sample_shape);
    let mut data = shared.scratch.take_floats(batch * jobs[0].input.len());
    for j in jobs.iter_mut() {
        data.extend_from_slice(&j.input);
        shared.scratch.give_floats(std::mem::take(&mut j.input));
    }
    gauges.batch_size.observe(batch as f64);
    for j in jobs.iter() {
        gauges.queue_wait.observe(j.enqueued.elapsed().as_secs_f64());
    }
    gauges.samples.inc_by(batch as u64);
    if let (Some(_), &[2, len]) = (&shared.model.manifest.text, sample_shape.as_slice()) {
        let run = session.text_length(&data, len);
        let attended: usize = data.chunks_exact(2 * len).map(text::attended).sum();
        gauges.tokens.attended.inc_by(attended as u64);
        gauges.tokens.padding.inc_by((batch * run).saturating_sub(attended) as u64);
    }
    Batch { shape, data, give_back }
}

/// Runs a batch once the node's inference slots come to its earliest sample (the oldest
/// requests first, whichever engine serves them), catching a panic. Returns the run's result
/// and its cost: with one intra-op thread ONNX Runtime runs on this thread and its CPU time is
/// the cost; with more, wall time is.
fn run_batch(
    shared: &Shared,
    session: &mut dyn Session,
    jobs: &[QueuedSample],
    batch: &Batch,
) -> std::thread::Result<(Result<Tensor, String>, Duration)> {
    let manifest = &shared.model.manifest;
    let _core = shared.runs.acquire_blocking(&jobs[0].tenant, jobs[0].place);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if shared.panic_next.swap(false, Ordering::SeqCst) {
            panic!("injected inference panic");
        }
        let mut run = || session.run_then(manifest, &shared.tensor, &batch.shape, &batch.data, batch.give_back);
        if shared.cfg.intra_threads <= 1 {
            super::clock::cpu_timed(run)
        } else {
            let started = Instant::now();
            (run(), started.elapsed())
        }
    }))
}

/// Answers a batch's samples: each its slice of the output, or every one the error.
fn answer(shared: &Shared, jobs: Vec<QueuedSample>, result: Result<Tensor, PushdownError>) {
    let batch = jobs.len();
    let left = shared.depth.fetch_sub(batch, Ordering::Relaxed).saturating_sub(batch);
    shared.gauges.queue_depth.set(i64::try_from(left).unwrap_or(i64::MAX));
    match result {
        Ok(out) => {
            let per = out.data.len() / batch;
            let sample_out_shape: Vec<usize> = out.shape.iter().skip(1).copied().collect();
            for (i, j) in jobs.into_iter().enumerate() {
                let _ = j.reply.send(Ok(Tensor {
                    shape: sample_out_shape.clone(),
                    data: out.data[i * per..(i + 1) * per].to_vec(),
                }));
            }
        }
        Err(e) => {
            for j in jobs {
                let _ = j.reply.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::inference::GiveBack;

    #[test]
    fn the_arena_is_kept_only_between_full_batches() {
        // A full batch with a full one queued behind it: kept.
        assert_eq!(GiveBack::after(16, 16, 16), GiveBack::KeptForNext);
        assert_eq!(GiveBack::after(16, 16, 100), GiveBack::KeptForNext);
        // Fewer queued than a batch, none, or a batch short of its cap: given back.
        assert_eq!(GiveBack::after(16, 16, 15), GiveBack::Yes);
        assert_eq!(GiveBack::after(16, 16, 0), GiveBack::Yes);
        assert_eq!(GiveBack::after(8, 16, 100), GiveBack::Yes);
    }
}
