//! Finding and starting ONNX Runtime. The library is loaded at run time (`ort` with
//! `load-dynamic`) from, in order: `pushdown.ort_library` in the config, `ORT_DYLIB_PATH`, or the
//! `onnxruntime` wheel in the project's `.venv` (what `scripts/setup.sh` installs). Without it the
//! gateway still serves passthrough; pushdown answers `503` and `/readyz` says why.

use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The process-wide ONNX Runtime environment once one started. ONNX Runtime can be loaded once
/// per process, so a success is kept; a failure is not (a later start, say with a corrected
/// `pushdown.ort_library`, tries again).
static RUNTIME: Mutex<Option<ort::environment::Environment>> = Mutex::new(None);

/// Locates the ONNX Runtime shared library.
///
/// # Errors
/// A message naming where it looked.
pub fn locate(configured: Option<&Path>) -> Result<PathBuf, String> {
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
pub fn environment(configured: Option<&Path>) -> Result<ort::environment::Environment, String> {
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
