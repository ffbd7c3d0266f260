//! Near-data pushdown: a GET that names a model and a split returns the tensor the model's prefix
//! computes from the object instead of the object's bytes.
//!
//! Pieces: [`spec`] (what the request asks for), [`registry`] (manifests, verified model files),
//! [`prefix`] (cutting the model at the split), [`engine`] (inference threads with batching),
//! [`tensor`] (`.npy` in, `.npy`/safetensors out), [`runtime`] (loading ONNX Runtime).
//! This module ties them together; HTTP stays in `crate::proxy`.
//!
//! Inputs understood so far: JPEG and PNG images (preprocessed per the model's manifest) and `.npy`
//! tensors already preprocessed to the model's per-sample input shape (one sample, or a batch with
//! a leading dimension). WebDataset shards are refused with `415` until their reader lands.

pub mod engine;
pub mod prefix;
pub mod preprocess;
pub mod registry;
pub mod runtime;
pub mod spec;
pub mod tensor;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::try_join_all;

use self::engine::{Engine, EngineConfig};
use self::registry::{Model, Registry};
use self::spec::{Format, PushdownSpec};
use self::tensor::Tensor;

/// Largest source object pushdown reads (it is held in memory while decoded). 64 MiB covers a
/// 128-sample shard of ImageNet-size JPEGs several times over.
pub const DEFAULT_MAX_OBJECT_BYTES: u64 = 64 * 1024 * 1024;

/// Why a pushdown request failed. Mapped to S3 codes in `crate::error`.
#[derive(Debug, thiserror::Error)]
pub enum PushdownError {
    #[error("invalid pushdown field {field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("unknown model {name:?}; available: {known}")]
    UnknownModel { name: String, known: String },
    #[error("model {model} has no split {split:?}; splits: {known}")]
    UnknownSplit { model: String, split: String, known: String },
    #[error("pushdown is unavailable: {0}")]
    Unavailable(String),
    #[error("too many pushdown samples queued; retry later")]
    Overloaded,
    #[error("cannot use the object as model input: {0}")]
    BadInput(String),
    #[error("unsupported pushdown input: {0}")]
    Unsupported(String),
    #[error("the object is larger than pushdown.max_object_bytes ({limit} bytes)")]
    ObjectTooLarge { limit: u64 },
    #[error("the model cannot run this split: {0}")]
    Model(String),
    #[error("internal pushdown error: {0}")]
    Internal(String),
}

/// Settings of the pushdown service.
#[derive(Debug, Clone)]
pub struct PushdownConfig {
    pub models_dir: PathBuf,
    pub ort_library: Option<PathBuf>,
    pub engine: EngineConfig,
    pub max_object_bytes: u64,
    pub max_image_pixels: u64,
}

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
}

/// The pushdown service: registry, ONNX Runtime, and one engine per (model, split) in use.
#[derive(Debug)]
pub struct Pushdown {
    cfg: PushdownConfig,
    registry: Registry,
    env: Result<ort::environment::Environment, String>,
    engines: Mutex<HashMap<(String, String), Arc<Engine>>>,
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
        Self { cfg, registry, env, engines: Mutex::new(HashMap::new()) }
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

    #[must_use]
    pub fn max_object_bytes(&self) -> u64 {
        self.cfg.max_object_bytes
    }

    /// Checks the spec against the registry (before any object is fetched).
    ///
    /// # Errors
    /// Unknown model or split, naming what exists.
    pub fn resolve(&self, spec: &PushdownSpec) -> Result<(Arc<Model>, String), PushdownError> {
        let model = self.registry.models.get(&spec.model).ok_or_else(|| PushdownError::UnknownModel {
            name: spec.model.clone(),
            known: self.registry.names().join(", "),
        })?;
        let split = model.split(&spec.split).ok_or_else(|| PushdownError::UnknownSplit {
            model: spec.model.clone(),
            split: spec.split.clone(),
            known: model.split_names().join(", "),
        })?;
        Ok((model.clone(), split.name.clone()))
    }

    fn engine(&self, model: &Arc<Model>, split: &str) -> Result<Arc<Engine>, PushdownError> {
        let env = self.env.as_ref().map_err(|e| PushdownError::Unavailable(e.clone()))?;
        let key = (model.manifest.name.clone(), split.to_owned());
        let mut engines = self.engines.lock().map_err(|_| PushdownError::Internal("engine table poisoned".into()))?;
        if let Some(e) = engines.get(&key) {
            return Ok(e.clone());
        }
        let tensor = model
            .split(split)
            .map(|s| s.tensor.clone())
            .ok_or_else(|| PushdownError::Internal("split vanished".into()))?;
        let engine = Arc::new(Engine::start(env.clone(), model.clone(), tensor, self.cfg.engine)?);
        engines.insert(key, engine.clone());
        Ok(engine)
    }

    /// Runs the prefix on an object's bytes and encodes the result.
    ///
    /// # Errors
    /// Unusable input, overload, or inference failure.
    pub async fn compute(&self, spec: &PushdownSpec, object: Bytes) -> Result<Output, PushdownError> {
        let (model, split) = self.resolve(spec)?;
        let engine = self.engine(&model, &split)?;
        let decode_model = model.clone();
        let max_pixels = self.cfg.max_image_pixels;

        let t0 = Instant::now();
        let (batched, samples) =
            tokio::task::spawn_blocking(move || decode(&object, &decode_model.manifest, max_pixels))
                .await
                .map_err(|e| PushdownError::Internal(e.to_string()))??;
        let decode_time = t0.elapsed();

        let t1 = Instant::now();
        let outputs = try_join_all(samples.into_iter().map(|s| engine.infer(s))).await?;
        let infer_time = t1.elapsed();

        let t2 = Instant::now();
        let (format, dtype) = (spec.format, spec.dtype);
        let meta =
            HashMap::from([("model".to_owned(), model.manifest.name.clone()), ("split".to_owned(), split.clone())]);
        let (body, shape) = tokio::task::spawn_blocking(move || -> Result<(Vec<u8>, Vec<usize>), PushdownError> {
            let out = stack(outputs, batched);
            let body = match format {
                Format::Npy => tensor::write_npy(&out, dtype),
                Format::Safetensors => tensor::write_safetensors(&[("features", &out)], dtype, meta)?,
            };
            Ok((body, out.shape))
        })
        .await
        .map_err(|e| PushdownError::Internal(e.to_string()))??;
        let content_type = match format {
            Format::Npy => "application/x-npy",
            Format::Safetensors => "application/vnd.safetensors",
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
        })
    }
}

/// Splits an object into per-sample model inputs; `true` if it carried a batch dimension.
fn decode(
    object: &[u8],
    manifest: &registry::Manifest,
    max_pixels: u64,
) -> Result<(bool, Vec<Vec<f32>>), PushdownError> {
    let sample_shape = manifest.input_shape.as_slice();
    if preprocess::is_image(object) {
        let p = manifest.preprocess.as_ref().ok_or_else(|| {
            PushdownError::Unsupported(format!(
                "model {} has no [preprocess] in its manifest: send .npy tensors",
                manifest.name
            ))
        })?;
        return Ok((false, vec![preprocess::image_to_input(object, p, manifest.layout, max_pixels)?]));
    }
    if !object.starts_with(b"\x93NUMPY") {
        return Err(PushdownError::Unsupported(
            "the object is not a JPEG or PNG image or a .npy tensor (WebDataset shards are not supported yet)".into(),
        ));
    }
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
