//! The model registry: `models/<name>/manifest.toml` files, read and checked at start and again
//! while serving ([`Registry::load`] with the registry in force: unchanged models are kept as
//! they are, so a rescan costs a directory listing and a `stat` per file). A manifest names the
//! ONNX file and its sha256, the input tensor and its per-sample shape and layout, the ordered
//! split points (name → tensor), the default freeze split, and where the weights come from.
//! Before a model is served its file is bounded ([`LoadLimits::max_model_bytes`], from its size
//! before a byte is read), hash-checked, parsed, and every split's tensor found in its graph.
//! Prefixes are cut from the verified bytes on first use (see `engine`).

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
    /// The ONNX file's sha256 (hex).
    pub(crate) digest: String,
    /// What determines its outputs: the sha256 (hex) of the ONNX file's digest, the manifest
    /// (preprocessing, splits) and the tokenizer. Part of every cache key and ETag, and of its
    /// engines' keys: a model replaced under the same name never serves the old one's outputs.
    pub(crate) version: String,
    pub(crate) dir: PathBuf,
    /// A text model's tokenizer (`[text]`), with the manifest's length.
    pub(crate) tokenizer: Option<Arc<super::text::Encoder>>,
    /// What its files were when it was read: a rescan that finds the same reads nothing again.
    stamp: Stamp,
}

/// A model directory's files as a rescan compares them: the manifest's text, and the size and
/// modification time of the model file and the tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    manifest: String,
    files: Vec<Option<(u64, std::time::SystemTime)>>,
}

impl Stamp {
    fn of(dir: &Path, manifest_text: String, manifest: &Manifest) -> Self {
        let stat = |name: &str| {
            let m = std::fs::metadata(dir.join(name)).ok()?;
            Some((m.len(), m.modified().ok()?))
        };
        let mut files = vec![stat(&manifest.file)];
        files.extend(manifest.text.as_ref().map(|t| stat(&t.tokenizer)));
        Self { manifest: manifest_text, files }
    }
}

/// Default of `pushdown.max_model_bytes`: ONNX files are protobuf, which cannot exceed 2 GiB (a
/// larger model keeps its weights in external data files beside it); room for that and no more.
pub(crate) const DEFAULT_MAX_MODEL_BYTES: u64 = 2 * 1024 * 1024 * 1024;

/// What a model file may cost to load.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoadLimits {
    /// Largest model file read (its size is checked before a byte is read).
    pub(crate) max_model_bytes: u64,
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
    /// Loads every `*/manifest.toml` under `dir`, keeping the models of `previous` whose files
    /// have not changed. A missing directory gives an empty registry; two manifests that name the
    /// same model are both refused (neither may shadow the other). Blocking.
    #[must_use]
    pub(crate) fn load(dir: &Path, limits: LoadLimits, previous: Option<&Self>) -> Self {
        let mut reg = Self::default();
        let Ok(entries) = std::fs::read_dir(dir) else { return reg };
        let mut dirs: Vec<PathBuf> =
            entries.flatten().map(|e| e.path()).filter(|p| p.join("manifest.toml").is_file()).collect();
        dirs.sort();
        let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
        for d in dirs {
            let kept = previous.and_then(|p| p.unchanged(&d));
            match kept.map_or_else(|| load_one(&d, limits).map(Arc::new), Ok) {
                Ok(m) => {
                    let name = m.manifest.name.clone();
                    if let Some(first) = seen.insert(name.clone(), d.clone()) {
                        reg.models.remove(&name);
                        let why =
                            format!("two manifests name model {name:?} ({} and {})", first.display(), d.display());
                        reg.failed.push((d, why));
                        continue;
                    }
                    reg.models.insert(name, m);
                }
                Err(e) => reg.failed.push((d, e)),
            }
        }
        reg
    }

    /// The model read from `dir` before, if its files are as they were.
    fn unchanged(&self, dir: &Path) -> Option<Arc<Model>> {
        let text = std::fs::read_to_string(dir.join("manifest.toml")).ok()?;
        let model = self.models.values().find(|m| m.dir == dir && m.stamp.manifest == text)?;
        (Stamp::of(dir, text, &model.manifest) == model.stamp).then(|| model.clone())
    }

    /// What changed from `before` to this registry, by model name.
    #[must_use]
    pub(crate) fn changes_from(&self, before: &Self) -> Changes {
        let mut c = Changes::default();
        for (name, m) in &self.models {
            match before.models.get(name) {
                None => c.added.push(name.clone()),
                Some(old) if old.version != m.version => c.replaced.push(name.clone()),
                Some(_) => {}
            }
        }
        c.removed = before.models.keys().filter(|n| !self.models.contains_key(*n)).cloned().collect();
        c
    }

    #[must_use]
    pub(crate) fn names(&self) -> Vec<&str> {
        self.models.keys().map(String::as_str).collect()
    }
}

/// Models added, replaced (new files under the same name) and removed by a rescan.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize)]
pub(crate) struct Changes {
    pub(crate) added: Vec<String>,
    pub(crate) replaced: Vec<String>,
    pub(crate) removed: Vec<String>,
}

impl Changes {
    #[must_use]
    pub(crate) fn is_empty(&self) -> bool {
        self.added.is_empty() && self.replaced.is_empty() && self.removed.is_empty()
    }
}

fn load_one(dir: &Path, limits: LoadLimits) -> Result<Model, String> {
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
    let stamp = Stamp::of(dir, text, &manifest);
    let unreadable = |e: std::io::Error| {
        format!("cannot read {} ({e}); scripts/models.sh fetches the trained models", path.display())
    };
    let size = std::fs::metadata(&path).map_err(unreadable)?.len();
    if size > limits.max_model_bytes {
        return Err(format!(
            "{} is {size} bytes, more than pushdown.max_model_bytes ({})",
            path.display(),
            limits.max_model_bytes
        ));
    }
    let bytes = std::fs::read(&path).map_err(unreadable)?;
    let digest = hex::encode(Sha256::digest(&bytes));
    if !digest.eq_ignore_ascii_case(&manifest.sha256) {
        return Err(format!("sha256 of {} is {digest}, manifest says {}", path.display(), manifest.sha256));
    }
    let tensors =
        super::prefix::tensor_names(&bytes).map_err(|e| format!("{} is not an ONNX model: {e}", path.display()))?;
    if let Some(s) = manifest.splits.iter().find(|s| !tensors.contains(&s.tensor)) {
        return Err(format!(
            "split {:?} names tensor {:?}, which the model's graph does not produce",
            s.name, s.tensor
        ));
    }
    let mut version = Sha256::new();
    version.update(digest.as_bytes());
    version.update(stamp.manifest.as_bytes());
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
            let file = dir.join(&t.tokenizer);
            version.update(std::fs::read(&file).map_err(|e| format!("cannot read tokenizer {}: {e}", t.tokenizer))?);
            let encoder = super::text::Encoder::from_file(&file, len)
                .map_err(|e| format!("cannot load tokenizer {}: {e}", t.tokenizer))?;
            Some(Arc::new(encoder))
        }
        None => None,
    };
    let version = hex::encode(version.finalize());
    Ok(Model { manifest, bytes: Arc::new(bytes), digest, version, dir: dir.to_path_buf(), tokenizer, stamp })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: LoadLimits = LoadLimits { max_model_bytes: DEFAULT_MAX_MODEL_BYTES };

    /// `models/tiny-cnn` copied to `root/dir`, named `name`, its manifest edited by `edit`.
    fn tiny(root: &Path, dir: &str, name: &str, edit: impl Fn(String) -> String) {
        let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/tiny-cnn");
        let to = root.join(dir);
        std::fs::create_dir_all(&to).expect("dir");
        std::fs::copy(from.join("model.onnx"), to.join("model.onnx")).expect("model");
        let manifest = std::fs::read_to_string(from.join("manifest.toml")).expect("manifest");
        let manifest = manifest.replace("name = \"tiny-cnn\"", &format!("name = \"{name}\""));
        std::fs::write(to.join("manifest.toml"), edit(manifest)).expect("manifest");
    }

    fn failed<'a>(r: &'a Registry, dir: &str) -> &'a str {
        r.failed.iter().find(|(d, _)| d.ends_with(dir)).map_or("", |(_, why)| why.as_str())
    }

    #[test]
    fn a_rescan_keeps_unchanged_models_and_sees_what_changed() {
        let root = tempfile::tempdir().expect("temp dir");
        tiny(root.path(), "a", "tiny-a", |m| m);
        let first = Registry::load(root.path(), LIMITS, None);
        assert_eq!(first.names(), ["tiny-a"]);
        let again = Registry::load(root.path(), LIMITS, Some(&first));
        assert!(Arc::ptr_eq(&first.models["tiny-a"], &again.models["tiny-a"]), "an unchanged model is not read again");
        assert!(again.changes_from(&first).is_empty());

        tiny(root.path(), "b", "tiny-b", |m| m);
        // The same ONNX file with other preprocessing is another version of the model.
        tiny(root.path(), "a", "tiny-a", |m| m.replace("resize_shorter = 36", "resize_shorter = 40"));
        let third = Registry::load(root.path(), LIMITS, Some(&again));
        let changes = third.changes_from(&again);
        assert_eq!((changes.added, changes.replaced), (vec!["tiny-b".to_owned()], vec!["tiny-a".to_owned()]));
        assert_eq!(third.models["tiny-a"].digest, first.models["tiny-a"].digest);
        assert_ne!(third.models["tiny-a"].version, first.models["tiny-a"].version);

        std::fs::remove_dir_all(root.path().join("b")).expect("remove");
        let fourth = Registry::load(root.path(), LIMITS, Some(&third));
        assert_eq!(fourth.changes_from(&third).removed, ["tiny-b"]);
    }

    #[test]
    fn hostile_models_are_refused_before_they_are_served() {
        let root = tempfile::tempdir().expect("temp dir");
        tiny(root.path(), "hash", "bad-hash", |m| m.replace("sha256 = \"457c", "sha256 = \"000c"));
        tiny(root.path(), "split", "bad-split", |m| m.replace("tensor = \"block1\"", "tensor = \"nope\""));
        tiny(root.path(), "twin", "tiny-cnn", |m| m);
        tiny(root.path(), "twin2", "tiny-cnn", |m| m);
        // Not ONNX, with its hash right.
        tiny(root.path(), "garbage", "garbage", |m| {
            m.replace(
                "457cb3721b9f12ca56938a5391fd28d099d9a7b26ece9f047cd0ffffeb850b7e",
                &hex::encode(Sha256::digest(b"hello")),
            )
        });
        std::fs::write(root.path().join("garbage/model.onnx"), b"hello").expect("write");
        // Huge: refused from its size (a sparse file: nothing is read).
        tiny(root.path(), "huge", "huge", |m| m);
        std::fs::File::options()
            .write(true)
            .open(root.path().join("huge/model.onnx"))
            .and_then(|f| f.set_len(10 << 30))
            .expect("sparse");
        let r = Registry::load(root.path(), LIMITS, None);
        assert!(r.models.is_empty(), "{:?}", r.names());
        assert!(failed(&r, "hash").contains("sha256 of"), "{}", failed(&r, "hash"));
        assert!(failed(&r, "split").contains("does not produce"), "{}", failed(&r, "split"));
        assert!(failed(&r, "garbage").contains("not an ONNX model"), "{}", failed(&r, "garbage"));
        assert!(failed(&r, "huge").contains("more than pushdown.max_model_bytes"), "{}", failed(&r, "huge"));
        assert!(failed(&r, "twin2").contains("two manifests name model"), "{}", failed(&r, "twin2"));
    }
}
