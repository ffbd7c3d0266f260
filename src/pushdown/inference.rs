//! What runs a prefix, as the engines see it: an [`Inference`] makes [`Session`]s of a prefix's
//! ONNX bytes, and a session runs batches. The gateway's is ONNX Runtime
//! ([`super::runtime::OrtInference`]); the request-path tests use a fake that needs no library
//! ([`fake`]). Everything around a run (queues, batching, the memory governor, the prefix check
//! against the full model, supervision) is the engine's ([`super::engine`]) and the same for both.

use std::path::Path;

use serde::{Deserialize, Deserializer};

use super::manifest::Manifest;
use super::tensor::Tensor;

/// How inference sessions use ONNX Runtime's CPU arena (`pushdown.ort_arena`). Memory patterns
/// are off in every mode; the memory budget's promise holds in every mode, because each engine
/// measures its own model (docs/pushdown.md). Measured trade-offs: docs/BENCHMARKS.md ("Engine
/// memory by arena mode"); why the per-run arena is the default: ADR 0015.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OrtArena {
    /// No arena (ADR 0005): every tensor of a run is its own allocation, freed after it; an idle
    /// session holds only its weights, and the engine reserves the least.
    Off,
    /// The default (ADR 0015). Runs allocate from the arena, so tensors freed during a run are
    /// reused by later ones, and give it back at their end (ADR 0012): an idle session still holds
    /// only its weights; a run's measured peak, and so what the engine reserves, is higher than
    /// without the arena, and throughput on one core is close to the kept arena's.
    #[default]
    PerRun,
    /// Sessions keep the arena between runs (ADR 0011): what the largest runs needed stays
    /// resident, measured by one run at every batch size up to `max_batch` when the engine starts.
    Kept,
}

/// `pushdown.ort_arena` as written: a name, or the boolean of earlier versions (`true` is `kept`).
impl<'de> Deserialize<'de> for OrtArena {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Setting;
        impl serde::de::Visitor<'_> for Setting {
            type Value = OrtArena;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#""off", "per-run", "kept", false or true"#)
            }
            fn visit_bool<E: serde::de::Error>(self, kept: bool) -> Result<OrtArena, E> {
                Ok(if kept { OrtArena::Kept } else { OrtArena::Off })
            }
            fn visit_str<E: serde::de::Error>(self, name: &str) -> Result<OrtArena, E> {
                match name {
                    "off" => Ok(OrtArena::Off),
                    "per-run" => Ok(OrtArena::PerRun),
                    "kept" => Ok(OrtArena::Kept),
                    _ => Err(E::invalid_value(serde::de::Unexpected::Str(name), &self)),
                }
            }
        }
        d.deserialize_any(Setting)
    }
}

/// Whether a `PerRun` arena gives its free regions back at the end of a run ([`Session::run_then`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GiveBack {
    Yes,
    /// Kept for the next run, which is known to be a full batch of the same cap.
    KeptForNext,
}

impl GiveBack {
    /// After a batch of `batch` samples, taken at its samples' smallest cap `cap`, with `queued`
    /// more samples waiting: the regions are kept only when the next batch is full too, so it
    /// needs no more than this one did (a smaller batch, or none, gives them back).
    #[must_use]
    pub(crate) fn after(batch: usize, cap: usize, queued: usize) -> Self {
        if batch >= cap && queued >= batch { Self::KeptForNext } else { Self::Yes }
    }
}

/// How a session is made: intra-op threads and the arena mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SessionSettings {
    pub(crate) threads: usize,
    pub(crate) arena: OrtArena,
}

/// Makes sessions of a prefix. Called on inference threads and blocking threads only.
pub(crate) trait Inference: Send + Sync + std::fmt::Debug {
    /// A session of the ONNX model `bytes` (a prefix, or a model with the split tensor exposed),
    /// whose external-data files, if any, lie in `model_dir`.
    ///
    /// # Errors
    /// The bytes do not load.
    fn session(&self, bytes: &[u8], settings: SessionSettings, model_dir: &Path) -> Result<Box<dyn Session>, String>;
}

/// One loaded prefix; runs take `&mut self` (one thread at a time).
pub(crate) trait Session: Send {
    /// Runs one batch of `shape` (the manifest's inputs; a text model's rows as
    /// [`super::text`] lays them out) and returns the tensor named `output`, the arena's free
    /// regions given back at its end unless `give_back` keeps them for the next full batch.
    ///
    /// # Errors
    /// The run failed.
    fn run_then(
        &mut self,
        manifest: &Manifest,
        output: &str,
        shape: &[usize],
        data: &[f32],
        give_back: GiveBack,
    ) -> Result<Tensor, String>;

    /// [`Self::run_then`], giving the arena's regions back.
    ///
    /// # Errors
    /// The run failed.
    fn run(&mut self, manifest: &Manifest, output: &str, shape: &[usize], data: &[f32]) -> Result<Tensor, String> {
        self.run_then(manifest, output, shape, data, GiveBack::Yes)
    }

    /// The length a batch of text rows of `len` tokens runs at (`len` unless padding is cut).
    fn text_length(&self, data: &[f32], len: usize) -> usize;

    /// Cuts text batches' padding from now on where that leaves `output` unchanged; returns
    /// whether it does.
    ///
    /// # Errors
    /// A probe run failed.
    fn cut_padding_where_inert(&mut self, manifest: &Manifest, output: &str) -> Result<bool, String>;

    /// Cuts text batches' padding (as a first session of the same prefix found it may).
    fn set_cut_padding(&mut self, cut: bool);
}

/// A fake [`Inference`] for the request-path tests: each sample's output is
/// `[sum, max, first]` of its input values (shape `[batch, 3]`), whatever the bytes, so a prefix
/// and its full model agree and the expected features follow from the input alone.
#[cfg(test)]
pub(crate) mod fake {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{GiveBack, Inference, Manifest, Path, Session, SessionSettings, Tensor};

    /// Features per sample.
    pub(crate) const FEATURES: usize = 3;

    /// The fake's output for one sample.
    pub(crate) fn features(sample: &[f32]) -> [f32; FEATURES] {
        let sum = sample.iter().sum();
        let max = sample.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        [sum, max, sample.first().copied().unwrap_or(0.0)]
    }

    /// Counts the sessions it made; a test holding `gate` holds every run back.
    #[derive(Debug, Default)]
    pub(crate) struct FakeInference {
        pub(crate) sessions: AtomicUsize,
        pub(crate) gate: std::sync::Arc<std::sync::Mutex<()>>,
    }

    struct FakeSession {
        gate: std::sync::Arc<std::sync::Mutex<()>>,
    }

    impl Inference for FakeInference {
        fn session(&self, _: &[u8], _: SessionSettings, _: &Path) -> Result<Box<dyn Session>, String> {
            self.sessions.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(FakeSession { gate: self.gate.clone() }))
        }
    }

    impl Session for FakeSession {
        fn run_then(
            &mut self,
            _: &Manifest,
            _: &str,
            shape: &[usize],
            data: &[f32],
            _: GiveBack,
        ) -> Result<Tensor, String> {
            drop(self.gate.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
            let batch = shape.first().copied().ok_or("no batch dimension")?;
            if batch == 0 || !data.len().is_multiple_of(batch) {
                return Err(format!("{} values in a batch of {batch}", data.len()));
            }
            let data = data.chunks_exact(data.len() / batch).flat_map(features).collect();
            Ok(Tensor { shape: vec![batch, FEATURES], data })
        }

        fn text_length(&self, _: &[f32], len: usize) -> usize {
            len
        }

        fn cut_padding_where_inert(&mut self, _: &Manifest, _: &str) -> Result<bool, String> {
            Ok(false)
        }

        fn set_cut_padding(&mut self, _: bool) {}
    }
}
