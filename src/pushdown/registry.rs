//! The model registry: `models/<name>/manifest.toml` files, read and hash-checked at start.
//! A manifest names the ONNX file and its sha256, the input tensor and its per-sample shape and
//! layout, the ordered split points (name → tensor), the default freeze split, and where the
//! weights come from. Prefixes are cut from the verified bytes on first use (see `engine`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::manifest::{Layout, Manifest, SplitDef};
use sha2::{Digest, Sha256};

/// A model whose file matched its manifest.
#[derive(Debug)]
pub(crate) struct Model {
    pub(crate) manifest: Manifest,
    /// The ONNX file's bytes.
    pub(crate) bytes: Arc<Vec<u8>>,
    /// Its sha256 (hex), part of every cache key and ETag.
    pub(crate) digest: String,
    pub(crate) dir: PathBuf,
    /// A text model's tokenizer (`[text]`), with the manifest's length.
    pub(crate) tokenizer: Option<Arc<super::text::Encoder>>,
}

impl Model {
    /// The split definition called `name` (or with that index).
    #[must_use]
    pub(crate) fn split(&self, name: &str) -> Option<&SplitDef> {
        self.manifest
            .splits
            .iter()
            .find(|s| s.name == name)
            .or_else(|| name.parse::<usize>().ok().and_then(|i| self.manifest.splits.get(i)))
    }

    #[must_use]
    pub(crate) fn split_names(&self) -> Vec<&str> {
        self.manifest.splits.iter().map(|s| s.name.as_str()).collect()
    }
}

/// All models, by name, plus the manifests that could not be loaded (and why).
#[derive(Debug, Default)]
pub(crate) struct Registry {
    pub(crate) models: BTreeMap<String, Arc<Model>>,
    pub(crate) failed: Vec<(PathBuf, String)>,
}

impl Registry {
    /// Loads every `*/manifest.toml` under `dir`. A missing directory gives an empty registry.
    #[must_use]
    pub(crate) fn load(dir: &Path) -> Self {
        let mut reg = Self::default();
        let Ok(entries) = std::fs::read_dir(dir) else { return reg };
        let mut dirs: Vec<PathBuf> =
            entries.flatten().map(|e| e.path()).filter(|p| p.join("manifest.toml").is_file()).collect();
        dirs.sort();
        for d in dirs {
            match load_one(&d) {
                Ok(m) => {
                    reg.models.insert(m.manifest.name.clone(), Arc::new(m));
                }
                Err(e) => reg.failed.push((d, e)),
            }
        }
        reg
    }

    #[must_use]
    pub(crate) fn names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }
}

fn load_one(dir: &Path) -> Result<Model, String> {
    let text = std::fs::read_to_string(dir.join("manifest.toml")).map_err(|e| format!("cannot read manifest: {e}"))?;
    let manifest: Manifest = toml::from_str(&text).map_err(|e| format!("invalid manifest: {e}"))?;
    if manifest.splits.is_empty() {
        return Err("manifest lists no splits".into());
    }
    if !manifest.splits.iter().any(|s| s.name == manifest.freeze) {
        return Err(format!("freeze split {:?} is not among the splits", manifest.freeze));
    }
    if let Some(p) = &manifest.preprocess {
        let [h, w] = p.crop.map(|v| v as usize);
        let expected = match manifest.layout {
            Layout::Nchw => vec![3, h, w],
            Layout::Nhwc => vec![h, w, 3],
        };
        if manifest.input_shape != expected {
            return Err(format!(
                "input_shape {:?} does not match the {h}x{w} crop in {:?} layout",
                manifest.input_shape, manifest.layout
            ));
        }
    }
    let path = dir.join(&manifest.file);
    let bytes = std::fs::read(&path)
        .map_err(|e| format!("cannot read {} ({e}); scripts/models.sh fetches the trained models", path.display()))?;
    let digest = hex::encode(Sha256::digest(&bytes));
    if !digest.eq_ignore_ascii_case(&manifest.sha256) {
        return Err(format!("sha256 of {} is {digest}, manifest says {}", path.display(), manifest.sha256));
    }
    let tokenizer = match &manifest.text {
        Some(t) => {
            if manifest.preprocess.is_some() {
                return Err("a manifest has [preprocess] or [text], not both".into());
            }
            let [2, len] = manifest.input_shape[..] else {
                return Err(format!(
                    "a text model's input_shape is [2, L] (token ids and attention mask), not {:?}",
                    manifest.input_shape
                ));
            };
            let encoder = super::text::Encoder::from_file(&dir.join(&t.tokenizer), len)
                .map_err(|e| format!("cannot load tokenizer {}: {e}", t.tokenizer))?;
            Some(Arc::new(encoder))
        }
        None => None,
    };
    Ok(Model { manifest, bytes: Arc::new(bytes), digest, dir: dir.to_path_buf(), tokenizer })
}
