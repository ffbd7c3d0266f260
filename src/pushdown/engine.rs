//! Inference workers: one thread per (model, split) owning its ONNX Runtime session (`run` takes
//! `&mut self`; CPU work never runs on tokio threads). Requests enqueue single samples on a bounded
//! queue; the worker takes what is waiting (up to `max_batch`) and runs it as one batch, so
//! samples of one request and of concurrent requests share a run. A sample whose requester has
//! gone is dropped before it runs. A full queue is refused at once (`503 SlowDown`).
//!
//! Before serving, the worker checks its prefix once against the full model with the split tensor
//! exposed, on a deterministic probe input: the outputs must be identical.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

use ort::session::Session;
use ort::value::Tensor as OrtTensor;
use tokio::sync::oneshot;

use super::PushdownError;
use super::prefix;
use super::registry::Model;
use super::tensor::Tensor;
use crate::metrics::{Metrics, ModelSplit, ModelSplitStage};

/// Settings of one engine.
#[derive(Debug, Clone, Copy)]
pub struct EngineConfig {
    /// Samples waiting before new ones are refused.
    pub queue_capacity: usize,
    /// Most samples per inference run.
    pub max_batch: usize,
    /// ONNX Runtime intra-op threads per session (1 is fastest per core on small machines; scale
    /// with `workers` instead).
    pub intra_threads: usize,
    /// Worker threads (each owning a session) per (model, split), sharing one queue.
    pub workers: usize,
}

struct Job {
    input: Vec<f32>,
    reply: oneshot::Sender<Result<Tensor, PushdownError>>,
    enqueued: std::time::Instant,
}

/// A running worker for one (model, split).
#[derive(Debug)]
pub struct Engine {
    tx: SyncSender<Job>,
    depth: Arc<AtomicUsize>,
    sample_len: usize,
    gauges: Gauges,
}

/// The engine's metrics, labelled with its model and split.
#[derive(Debug, Clone)]
struct Gauges {
    queue_depth: prometheus_client::metrics::gauge::Gauge,
    batch_size: prometheus_client::metrics::histogram::Histogram,
    samples: prometheus_client::metrics::counter::Counter,
    /// Time samples wait in the queue (the `queue` stage of the stage histogram).
    queue_wait: prometheus_client::metrics::histogram::Histogram,
}

impl Engine {
    /// Starts the worker thread. Session creation and the prefix check happen on that thread; if
    /// they fail, every request gets the error.
    ///
    /// # Errors
    /// The prefix cannot be cut or the thread cannot start.
    pub fn start(
        env: &ort::environment::Environment,
        model: &Arc<Model>,
        split: &str,
        tensor: &str,
        cfg: EngineConfig,
        metrics: &Metrics,
    ) -> Result<Self, PushdownError> {
        let label = ModelSplit { model: model.manifest.name.clone(), split: split.to_owned() };
        let gauges = Gauges {
            queue_depth: metrics.pushdown_queue_depth.get_or_create(&label).clone(),
            batch_size: metrics.pushdown_batch_size.get_or_create(&label).clone(),
            samples: metrics.pushdown_samples.get_or_create(&label).clone(),
            queue_wait: metrics
                .pushdown_stage_duration
                .get_or_create(&ModelSplitStage {
                    model: label.model.clone(),
                    split: label.split.clone(),
                    stage: "queue",
                })
                .clone(),
        };
        let prefix_bytes = prefix::cut(&model.bytes, &[tensor]).map_err(|e| PushdownError::Model(e.to_string()))?;
        let sample_len = model.manifest.input_shape.iter().product();
        let (tx, rx) = sync_channel(cfg.queue_capacity);
        let depth = Arc::new(AtomicUsize::new(0));
        let rx = Arc::new(Mutex::new(rx));
        let prefix_bytes = Arc::new(prefix_bytes);
        for n in 0..cfg.workers.max(1) {
            let (env, model, tensor, prefix_bytes, rx) =
                (env.clone(), model.clone(), tensor.to_owned(), prefix_bytes.clone(), rx.clone());
            let (worker_depth, worker_gauges) = (depth.clone(), gauges.clone());
            std::thread::Builder::new()
                .name(format!("infer-{}-{split}-{n}", model.manifest.name))
                .spawn(move || worker(&env, &model, &tensor, &prefix_bytes, cfg, &rx, &worker_depth, &worker_gauges))
                .map_err(|e| PushdownError::Internal(format!("cannot start inference thread: {e}")))?;
        }
        Ok(Self { tx, depth, sample_len, gauges })
    }

    /// Runs one sample (per-sample shape, already preprocessed).
    ///
    /// # Errors
    /// Queue full (`Overloaded`), wrong input size, or an inference failure.
    pub async fn infer(&self, input: Vec<f32>) -> Result<Tensor, PushdownError> {
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
        if let Err(e) = self.tx.try_send(Job { input, reply, enqueued: std::time::Instant::now() }) {
            let left = self.depth.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
            self.gauges.queue_depth.set(i64::try_from(left).unwrap_or(i64::MAX));
            return Err(match e {
                TrySendError::Full(_) => PushdownError::Overloaded,
                TrySendError::Disconnected(_) => PushdownError::Internal("inference worker stopped".into()),
            });
        }
        rx.await.map_err(|_| PushdownError::Internal("inference worker dropped the request".into()))?
    }

    /// Samples waiting or running.
    #[must_use]
    pub fn queue_depth(&self) -> usize {
        self.depth.load(Ordering::Relaxed)
    }
}

/// ONNX Runtime's session option naming where external-data files of a model loaded from memory
/// live (the prefix is cut in memory; its initializers may still point at `weights.bin` beside the
/// original model file).
const EXTERNAL_DATA_DIR: &str = "session.model_external_initializers_file_folder_path";

fn session(
    env: &ort::environment::Environment,
    bytes: &[u8],
    threads: usize,
    model_dir: &std::path::Path,
) -> Result<Session, String> {
    let builder = Session::builder(env).map_err(|e| e.to_string())?;
    let builder = builder.with_intra_threads(threads).map_err(|e| e.to_string())?;
    let mut builder =
        builder.with_config_entry(EXTERNAL_DATA_DIR, model_dir.to_string_lossy()).map_err(|e| e.to_string())?;
    builder.commit_from_memory(bytes).map_err(|e| e.to_string())
}

fn run(
    session: &mut Session,
    input_name: &str,
    output: &str,
    shape: &[usize],
    data: Vec<f32>,
) -> Result<Tensor, String> {
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let value = OrtTensor::from_array((dims, data)).map_err(|e| e.to_string())?;
    let outputs = session.run(ort::inputs![input_name => value]).map_err(|e| e.to_string())?;
    let (out_shape, values) = outputs[output].try_extract_tensor::<f32>().map_err(|e| e.to_string())?;
    Ok(Tensor { shape: out_shape.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect(), data: values.to_vec() })
}

/// The once-per-engine check: prefix output == full model output at the split tensor.
fn check_prefix(
    env: &ort::environment::Environment,
    model: &Model,
    tensor: &str,
    prefix_session: &mut Session,
) -> Result<(), String> {
    let exposed = prefix::expose(&model.bytes, &[tensor]).map_err(|e| e.to_string())?;
    let mut full = session(env, &exposed, 1, &model.dir)?;
    let mut shape = vec![1];
    shape.extend(&model.manifest.input_shape);
    let n: usize = shape.iter().product();
    // Deterministic probe values in [-1, 1).
    let probe: Vec<f32> = (0..n).map(|i| ((i * 7919) % 2000) as f32 / 1000.0 - 1.0).collect();
    let input = &model.manifest.input;
    let a = run(prefix_session, input, tensor, &shape, probe.clone())?;
    let b = run(&mut full, input, tensor, &shape, probe)?;
    if a == b { Ok(()) } else { Err(format!("prefix output at {tensor} differs from the full model's")) }
}

/// Waits for a sample, then takes whatever else is queued (up to `max`): one batch. The lock is
/// held only while taking, so other workers run their batches meanwhile. `None`: queue closed.
fn next_batch(rx: &Mutex<Receiver<Job>>, max: usize) -> Option<Vec<Job>> {
    let rx = rx.lock().ok()?;
    let mut jobs = vec![rx.recv().ok()?];
    while jobs.len() < max {
        match rx.try_recv() {
            Ok(j) => jobs.push(j),
            Err(_) => break,
        }
    }
    Some(jobs)
}

#[allow(clippy::too_many_arguments)]
fn worker(
    env: &ort::environment::Environment,
    model: &Model,
    tensor: &str,
    prefix_bytes: &[u8],
    cfg: EngineConfig,
    rx: &Mutex<Receiver<Job>>,
    depth: &AtomicUsize,
    gauges: &Gauges,
) {
    let ready = session(env, prefix_bytes, cfg.intra_threads, &model.dir)
        .and_then(|mut s| check_prefix(env, model, tensor, &mut s).map(|()| s));
    let mut session = match ready {
        Ok(s) => {
            tracing::info!(model = %model.manifest.name, %tensor, "Prefix ready (checked against the full model).");
            s
        }
        Err(e) => {
            tracing::error!(model = %model.manifest.name, %tensor, error = %e, "Prefix unusable.");
            while let Some(job) = next_batch(rx, 1).and_then(|mut b| b.pop()) {
                depth.fetch_sub(1, Ordering::Relaxed);
                let _ = job.reply.send(Err(PushdownError::Model(e.clone())));
            }
            return;
        }
    };
    let sample_shape = &model.manifest.input_shape;
    while let Some(mut jobs) = next_batch(rx, cfg.max_batch) {
        let before = jobs.len();
        jobs.retain(|j| !j.reply.is_closed());
        depth.fetch_sub(before - jobs.len(), Ordering::Relaxed);
        if jobs.is_empty() {
            continue;
        }
        let batch = jobs.len();
        let mut shape = vec![batch];
        shape.extend(sample_shape);
        let mut data = Vec::with_capacity(batch * jobs[0].input.len());
        for j in &mut jobs {
            data.append(&mut j.input);
        }
        gauges.batch_size.observe(batch as f64);
        for j in &jobs {
            gauges.queue_wait.observe(j.enqueued.elapsed().as_secs_f64());
        }
        gauges.samples.inc_by(batch as u64);
        let result = run(&mut session, &model.manifest.input, tensor, &shape, data);
        let left = depth.fetch_sub(batch, Ordering::Relaxed).saturating_sub(batch);
        gauges.queue_depth.set(i64::try_from(left).unwrap_or(i64::MAX));
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
                    let _ = j.reply.send(Err(PushdownError::Internal(format!("inference failed: {e}"))));
                }
            }
        }
    }
}
