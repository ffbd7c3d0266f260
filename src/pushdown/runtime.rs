//! ONNX Runtime: finding and starting it, and its sessions as the engines' [`Inference`]. The library is loaded at run time (`ort` with
//! `load-dynamic`) from, in order: `pushdown.ort_library` in the config, `ORT_DYLIB_PATH`, or the
//! `onnxruntime` wheel in the project's `.venv` (what `scripts/setup.sh` installs). Without it the
//! gateway still serves passthrough; pushdown answers `503` and `/readyz` says why.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

use ort::session::{OutputSelector, RunOptions, Session as OrtSession};
use ort::value::Tensor as OrtTensor;

use super::engine::OrtArena;
use super::inference::{GiveBack, Inference, Session, SessionSettings};
use super::manifest::Manifest;
use super::tensor::Tensor;
use super::text;

/// The process-wide ONNX Runtime environment once one started. ONNX Runtime can be loaded once
/// per process, so a success is kept; a failure is not (a later start, say with a corrected
/// `pushdown.ort_library`, tries again).
static RUNTIME: Mutex<Option<ort::environment::Environment>> = Mutex::new(None);

/// Locates the ONNX Runtime shared library.
///
/// # Errors
/// A message naming where it looked.
pub(crate) fn locate(configured: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = configured {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("pushdown.ort_library {} does not exist", p.display()))
        };
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH") {
        let p = PathBuf::from(p);
        return if p.is_file() { Ok(p) } else { Err(format!("ORT_DYLIB_PATH={} does not exist", p.display())) };
    }
    let lib = Path::new(".venv/lib");
    let found =
        std::fs::read_dir(lib).ok().and_then(|entries| {
            entries.flatten().find_map(|py| {
                let capi = py.path().join("site-packages/onnxruntime/capi");
                std::fs::read_dir(&capi).ok()?.flatten().map(|e| e.path()).find(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libonnxruntime.so"))
                })
            })
        });
    found.ok_or_else(|| {
        "ONNX Runtime library not found: set pushdown.ort_library or ORT_DYLIB_PATH, or run scripts/setup.sh (installs the onnxruntime wheel into .venv)".to_owned()
    })
}

/// Starts ONNX Runtime once for the process.
///
/// # Errors
/// Why pushdown is unavailable.
pub(crate) fn environment(configured: Option<&Path>) -> Result<ort::environment::Environment, String> {
    let mut runtime = RUNTIME.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(env) = runtime.as_ref() {
        return Ok(env.clone());
    }
    let path = locate(configured)?;
    let builder =
        ort::init_from(&path).map_err(|e| format!("cannot load ONNX Runtime from {}: {e}", path.display()))?;
    let env = builder
        .with_name("tensorgate")
        .with_telemetry(false)
        .build()
        .map_err(|e| format!("cannot start ONNX Runtime: {e}"))?;
    *runtime = Some(env.clone());
    Ok(env)
}

/// ONNX Runtime's session option naming where external-data files of a model loaded from memory
/// live (the prefix is cut in memory; its initializers may still point at `weights.bin` beside the
/// original model file).
const EXTERNAL_DATA_DIR: &str = "session.model_external_initializers_file_folder_path";

/// ONNX Runtime's run option that gives the CPU arena's free regions back at the end of a run.
const ARENA_SHRINKAGE: &str = "memory.enable_memory_arena_shrinkage";

/// A session of one prefix, and how its runs use ONNX Runtime's CPU arena ([`OrtArena`]).
///
/// `Off`: each tensor of a run is its own allocation. `PerRun`: runs allocate from the arena, so
/// tensors freed during a run are reused by later ones instead of each being a fresh zero-filled
/// mapping, and each run ends by giving the arena's free regions back (run option
/// `memory.enable_memory_arena_shrinkage`), so an idle session holds only its weights and a run's
/// footprint is its peak, which the memory model measures (ADR 0012). `Kept`: the session keeps
/// its arena between runs, holding what its largest runs needed while it lives (ADR 0011).
/// In every mode the output is written into a buffer of ours, not the arena's: a region that still
/// held the output when the run ended would not be given back. The first run learns the output's
/// shape and lets ONNX Runtime allocate it. Memory patterns stay off in every mode: a pattern is
/// planned on the second run of each input shape and allocated as one more block, so an arena
/// with them kept growing long after every batch size had run (up to 1.7x, ADR 0011), past any
/// model measured at start.
#[derive(Debug)]
struct Runner {
    session: OrtSession,
    arena: OrtArena,
    /// The output's shape without the batch dimension, once a run has shown it.
    sample_output: Option<Vec<usize>>,
    /// Whether a batch of texts runs at its longest text ([`text::batch_length`]) rather than the
    /// manifest's length: set where [`Runner::padding_is_inert`] found it exact.
    cut_padding: bool,
}

impl Session for Runner {
    /// [`Session::run`], the arena's regions kept for the next run where `give_back` says so: an
    /// engine streaming full batches of one size reuses the same regions run after run instead of
    /// faulting them in afresh (the engine's memory reservation holds a full batch's activations
    /// for its whole life, so keeping them between two such runs holds nothing it did not
    /// reserve; ADR 0024).
    fn run_then(
        &mut self,
        manifest: &Manifest,
        output: &str,
        shape: &[usize],
        data: &[f32],
        give_back: GiveBack,
    ) -> Result<Tensor, String> {
        let mut inputs = feed(manifest, shape, data, |data, len| self.text_length(data, len))?;
        // A prefix that ends before an input is used (a text model's embeddings, before the
        // attention mask) has no such input.
        inputs.retain(|(name, _)| self.session.inputs().iter().any(|i| i.name() == name));
        let mut selected = OutputSelector::no_default().with(output);
        if let (Some(sample), Some(&batch)) = (&self.sample_output, shape.first()) {
            let dims: Vec<i64> = std::iter::once(batch).chain(sample.iter().copied()).map(|d| d as i64).collect();
            let len = batch * sample.iter().product::<usize>();
            let buffer = OrtTensor::from_array((dims, vec![0f32; len])).map_err(|e| e.to_string())?;
            selected = selected.preallocate(output, buffer);
        }
        let mut options = RunOptions::new().map_err(|e| e.to_string())?.with_outputs(selected);
        if self.arena == OrtArena::PerRun && give_back == GiveBack::Yes {
            options.set(ARENA_SHRINKAGE, "cpu:0").map_err(|e| e.to_string())?;
        }
        let outputs = self.session.run_with_options(inputs, &options).map_err(|e| e.to_string())?;
        let (out_shape, values) = outputs[output].try_extract_tensor::<f32>().map_err(|e| e.to_string())?;
        let out_shape: Vec<usize> = out_shape.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect();
        if self.sample_output.is_none() {
            self.sample_output = Some(out_shape.iter().skip(1).copied().collect());
        }
        Ok(Tensor { shape: out_shape, data: values.to_vec() })
    }

    /// The length a batch of text rows of `len` tokens runs at: its longest text's
    /// ([`text::batch_length`]) where padding may be cut, else `len`.
    fn text_length(&self, data: &[f32], len: usize) -> usize {
        if self.cut_padding { text::batch_length(data, len) } else { len }
    }

    /// Cuts batches' padding from now on where that leaves `output` unchanged
    /// ([`Self::padding_is_inert`]); returns whether it does.
    fn cut_padding_where_inert(&mut self, manifest: &Manifest, output: &str) -> Result<bool, String> {
        self.cut_padding = self.padding_is_inert(manifest, output)?;
        Ok(self.cut_padding)
    }

    fn set_cut_padding(&mut self, cut: bool) {
        self.cut_padding = cut;
    }
}

impl Runner {
    /// Whether a text prefix's output stays the same when a batch's padding is cut off: its shape
    /// does not have the length and padded positions do not reach it (outputs pooled over the
    /// attended tokens, `pool` and `embedding`; not the sequence outputs `layer*`, nor a model
    /// that ignores its mask). Probed on one row attended over its first half, whole and cut.
    fn padding_is_inert(&mut self, manifest: &Manifest, output: &str) -> Result<bool, String> {
        let (Some(_), &[2, len]) = (&manifest.text, manifest.input_shape.as_slice()) else { return Ok(false) };
        let used = (len / 2).next_multiple_of(text::LENGTH_STEP);
        if used >= len {
            return Ok(false);
        }
        let row: Vec<f32> = (0..len)
            .map(|i| if i < used { ((i * 7919) % 1000) as f32 } else { 0.0 })
            .chain((0..len).map(|i| f32::from(u8::from(i < used))))
            .collect();
        // Neither probe may write into the buffer of the engine's output shape.
        let (sample_output, cut_padding) = (self.sample_output.take(), self.cut_padding);
        let mut probe = |cut: bool| {
            (self.sample_output, self.cut_padding) = (None, cut);
            self.run(manifest, output, &[1, 2, len], &row)
        };
        let (whole, cut) = (probe(false), probe(true));
        (self.sample_output, self.cut_padding) = (sample_output, cut_padding);
        let (whole, cut) = (whole?, cut?);
        Ok(whole.shape == cut.shape && relative_l2(&whole.data, &cut.data) <= PADDING_TOLERANCE)
    }
}

/// How far a text prefix's output may move when padding is cut for it to be cut
/// ([`Runner::padding_is_inert`]): the bar outputs are held to against the caller's own
/// tokenizer and onnxruntime (ADR 0017). Masked positions weigh exactly 0; only the order of the
/// sums changes.
const PADDING_TOLERANCE: f64 = 1e-5;

/// `|a - b| / |b|` (0 for two zero vectors).
pub(crate) fn relative_l2(a: &[f32], b: &[f32]) -> f64 {
    let (diff, norm) = a
        .iter()
        .zip(b)
        .fold((0f64, 0f64), |(d, n), (&x, &y)| (d + (f64::from(x) - f64::from(y)).powi(2), n + f64::from(y).powi(2)));
    if norm == 0.0 { diff.sqrt() } else { (diff / norm).sqrt() }
}

/// The session inputs of a batch: an image model's one `f32` tensor; a text model's rows
/// (`[ids; L] ++ [mask; L]`, `shape` `[batch, 2, L]`) as its two int64 inputs, token ids and
/// attention mask (`[text]` in the manifest), as long as `text_length` says ([`Runner::text_length`]).
fn feed<'a>(
    manifest: &Manifest,
    shape: &[usize],
    data: &'a [f32],
    text_length: impl Fn(&[f32], usize) -> usize,
) -> Result<Vec<(String, ort::session::SessionInputValue<'a>)>, String> {
    let Some(text) = &manifest.text else {
        // A view of the caller's buffer (kept between batches: [`super::engine::Node::scratch`]), not a copy.
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let value = ort::value::TensorRef::from_array_view((dims, data)).map_err(|e| e.to_string())?;
        return Ok(vec![(manifest.input.clone(), value.into())]);
    };
    let [batch, 2, len] = shape[..] else { return Err(format!("a text batch of shape {shape:?}")) };
    let run = text_length(data, len);
    let (mut ids, mut mask) = (Vec::with_capacity(batch * run), Vec::with_capacity(batch * run));
    for row in data.chunks_exact(2 * len) {
        ids.extend(row[..run].iter().map(|&v| v as i64));
        mask.extend(row[len..len + run].iter().map(|&v| v as i64));
    }
    let dims = vec![batch as i64, run as i64];
    let ids = OrtTensor::from_array((dims.clone(), ids)).map_err(|e| e.to_string())?;
    let mask = OrtTensor::from_array((dims, mask)).map_err(|e| e.to_string())?;
    Ok(vec![(manifest.input.clone(), ids.into()), (text.mask.clone(), mask.into())])
}

/// ONNX Runtime as the engines' [`Inference`], in the process's environment ([`environment`]).
#[derive(Debug, Clone)]
pub(crate) struct OrtInference {
    pub(crate) env: ort::environment::Environment,
}

impl Inference for OrtInference {
    /// A [`Runner`] of `bytes` (see there for the arena).
    fn session(&self, bytes: &[u8], settings: SessionSettings, model_dir: &Path) -> Result<Box<dyn Session>, String> {
        let SessionSettings { threads, arena } = settings;
        Ok(Box::new(runner(&self.env, bytes, threads, arena, model_dir)?))
    }
}

fn runner(
    env: &ort::environment::Environment,
    bytes: &[u8],
    threads: usize,
    arena: OrtArena,
    model_dir: &Path,
) -> Result<Runner, String> {
    let builder = OrtSession::builder(env).map_err(|e| e.to_string())?;
    let builder = builder.with_intra_threads(threads).map_err(|e| e.to_string())?;
    let builder = builder
        .with_execution_providers([ort::ep::CPU::default().with_arena_allocator(arena != OrtArena::Off).build()])
        .map_err(|e| e.to_string())?;
    let builder = builder.with_memory_pattern(false).map_err(|e| e.to_string())?;
    let mut builder =
        builder.with_config_entry(EXTERNAL_DATA_DIR, model_dir.to_string_lossy()).map_err(|e| e.to_string())?;
    let session = builder.commit_from_memory(bytes).map_err(|e| e.to_string())?;
    Ok(Runner { session, arena, sample_output: None, cut_padding: false })
}
