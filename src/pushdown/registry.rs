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

/// A model directory as a rescan compares it: the manifest's text, and the name, size and
/// modification time of every file in it (the model, its tokenizer, its external data).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    manifest: String,
    files: Vec<(std::ffi::OsString, u64, std::time::SystemTime)>,
}

impl Stamp {
    /// `None`: no readable manifest (not a model directory, or not yet).
    fn of(dir: &Path) -> Option<Self> {
        let manifest =
            String::from_utf8(read_bounded(&dir.join(MANIFEST), (MAX_SIDE_FILE_BYTES, "MAX_SIDE_FILE_BYTES")).ok()?)
                .ok()?;
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .ok()?
            .flatten()
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                (!m.is_dir()).then_some(())?;
                Some((e.file_name(), m.len(), m.modified().ok()?))
            })
            .collect();
        files.sort();
        Some(Self { manifest, files })
    }
}

/// A model directory's manifest.
pub(super) const MANIFEST: &str = "manifest.toml";

/// Largest manifest or tokenizer read (`tokenizer.json` of a large vocabulary is a few MiB).
const MAX_SIDE_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// Reads `path` if it is a regular file (not a FIFO, a device, or a link to one) of at most
/// `limit` bytes (named `limit_name` in errors), and no more than that however it grows while read.
fn read_bounded(path: &Path, (limit, limit_name): (u64, &str)) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let why = |e: &dyn std::fmt::Display| format!("cannot read {}: {e}", path.display());
    let meta = std::fs::metadata(path).map_err(|e| why(&e))?;
    if !meta.is_file() {
        return Err(why(&"not a regular file"));
    }
    if meta.len() > limit {
        return Err(format!("{} is {} bytes, more than {limit_name} ({limit})", path.display(), meta.len()));
    }
    let file = std::fs::File::open(path).map_err(|e| why(&e))?;
    if !file.metadata().map_err(|e| why(&e))?.is_file() {
        return Err(why(&"not a regular file"));
    }
    let mut bytes = Vec::with_capacity(usize::try_from(meta.len()).unwrap_or(0));
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| why(&e))?;
    if bytes.len() as u64 > limit {
        return Err(format!("{} grew past {limit_name} ({limit}) while read", path.display()));
    }
    Ok(bytes)
}

/// A file a manifest names: a plain name inside the model's directory.
fn inside(dir: &Path, name: &str, key: &str) -> Result<PathBuf, String> {
    let plain = Path::new(name).file_name().is_some_and(|n| n == name) && name != "..";
    if plain {
        Ok(dir.join(name))
    } else {
        Err(format!("{key} = {name:?} is not a file name in the model's directory"))
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
    /// The directories that failed, as they were: a rescan does not read them again unchanged.
    failed_stamps: BTreeMap<PathBuf, Stamp>,
}

impl Registry {
    /// Loads every `*/manifest.toml` under each of `roots` (`models_dir`, and the mirror of the
    /// store's models when there is one), keeping the models of `previous` whose files have not
    /// changed. A missing directory holds no model; two manifests that name the same model are
    /// both refused (neither may shadow the other). Blocking.
    #[must_use]
    pub(crate) fn load(roots: &[&Path], limits: LoadLimits, previous: Option<&Self>) -> Self {
        let mut reg = Self::default();
        let mut dirs: Vec<PathBuf> = Vec::new();
        for root in roots {
            let Ok(entries) = std::fs::read_dir(root) else { continue };
            let mut found: Vec<PathBuf> =
                entries.flatten().map(|e| e.path()).filter(|p| p.join(MANIFEST).is_file()).collect();
            found.sort();
            dirs.extend(found);
        }
        let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
        for d in dirs {
            let Some(stamp) = Stamp::of(&d) else {
                reg.failed.push((d, "cannot read its manifest".into()));
                continue;
            };
            if let Some((_, why)) = previous.and_then(|p| p.failed_unchanged(&d, &stamp)) {
                reg.failed.push((d.clone(), why));
                reg.failed_stamps.insert(d, stamp);
                continue;
            }
            let kept = previous.and_then(|p| p.unchanged(&d, &stamp));
            match kept.map_or_else(|| load_one(&d, stamp.clone(), limits).map(Arc::new), Ok) {
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
                Err(e) => {
                    reg.failed.push((d.clone(), e));
                    reg.failed_stamps.insert(d, stamp);
                }
            }
        }
        reg
    }

    /// The model read from `dir` before, if its files are as they were.
    fn unchanged(&self, dir: &Path, stamp: &Stamp) -> Option<Arc<Model>> {
        self.models.values().find(|m| m.dir == dir && m.stamp == *stamp).cloned()
    }

    /// Why `dir` failed before, if its files are as they were then.
    fn failed_unchanged(&self, dir: &Path, stamp: &Stamp) -> Option<(PathBuf, String)> {
        (self.failed_stamps.get(dir) == Some(stamp)).then(|| self.failed.iter().find(|(d, _)| d == dir).cloned())?
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

    /// The models served, as one short hash of every (name, version): members of a cluster that
    /// serve the same models have the same one (`/readyz` sends it, `/v1/cluster` compares).
    #[must_use]
    pub(crate) fn digest(&self) -> String {
        let mut h = Sha256::new();
        for (name, m) in &self.models {
            h.update(name.as_bytes());
            h.update([0]);
            h.update(m.version.as_bytes());
            h.update([b'\n']);
        }
        hex::encode(&h.finalize()[..8])
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

fn load_one(dir: &Path, stamp: Stamp, limits: LoadLimits) -> Result<Model, String> {
    let manifest: Manifest = toml::from_str(&stamp.manifest).map_err(|e| format!("invalid manifest: {e}"))?;
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
    let path = inside(dir, &manifest.file, "file")?;
    let bytes = read_bounded(&path, (limits.max_model_bytes, "pushdown.max_model_bytes"))
        .map_err(|e| format!("{e}; scripts/models.sh fetches the trained models"))?;
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
    // The version covers every other file of the directory too: the tokenizer, external data.
    let mut version = Sha256::new();
    version.update(digest.as_bytes());
    version.update(stamp.manifest.as_bytes());
    let mut others: std::collections::HashMap<std::ffi::OsString, Vec<u8>> = std::collections::HashMap::new();
    for (name, _, _) in &stamp.files {
        if name == MANIFEST || *name == *manifest.file {
            continue;
        }
        let data = read_bounded(&dir.join(name), (limits.max_model_bytes, "pushdown.max_model_bytes"))?;
        version.update(name.as_encoded_bytes());
        version.update(Sha256::digest(&data));
        others.insert(name.clone(), data);
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
            inside(dir, &t.tokenizer, "text.tokenizer")?;
            // The bytes the version hashed, not the file read again.
            let json =
                others.get(std::ffi::OsStr::new(&t.tokenizer)).and_then(|b| std::str::from_utf8(b).ok()).ok_or_else(
                    || format!("cannot read tokenizer {} (at most {MAX_SIDE_FILE_BYTES} bytes of UTF-8)", t.tokenizer),
                )?;
            if json.len() as u64 > MAX_SIDE_FILE_BYTES {
                return Err(format!("tokenizer {} is more than {MAX_SIDE_FILE_BYTES} bytes", t.tokenizer));
            }
            let encoder = super::text::Encoder::from_json(json, len)
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
        let first = Registry::load(&[root.path()], LIMITS, None);
        assert_eq!(first.names(), ["tiny-a"]);
        let again = Registry::load(&[root.path()], LIMITS, Some(&first));
        assert!(Arc::ptr_eq(&first.models["tiny-a"], &again.models["tiny-a"]), "an unchanged model is not read again");
        assert!(again.changes_from(&first).is_empty());

        tiny(root.path(), "b", "tiny-b", |m| m);
        // The same ONNX file with other preprocessing is another version of the model.
        tiny(root.path(), "a", "tiny-a", |m| m.replace("resize_shorter = 36", "resize_shorter = 40"));
        let third = Registry::load(&[root.path()], LIMITS, Some(&again));
        let changes = third.changes_from(&again);
        assert_eq!((changes.added, changes.replaced), (vec!["tiny-b".to_owned()], vec!["tiny-a".to_owned()]));
        assert_eq!(third.models["tiny-a"].digest, first.models["tiny-a"].digest);
        assert_ne!(third.models["tiny-a"].version, first.models["tiny-a"].version);

        std::fs::remove_dir_all(root.path().join("b")).expect("remove");
        let fourth = Registry::load(&[root.path()], LIMITS, Some(&third));
        assert_eq!(fourth.changes_from(&third).removed, ["tiny-b"]);

        // Any other file of the directory (external weights, say) is part of the version.
        std::fs::write(root.path().join("a/weights.bin"), b"new weights").expect("write");
        let fifth = Registry::load(&[root.path()], LIMITS, Some(&fourth));
        assert_eq!(fifth.changes_from(&fourth).replaced, ["tiny-a"]);
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
        // Not regular files: a FIFO (whose read would block) and a link to /dev/zero (endless).
        tiny(root.path(), "fifo", "fifo", |m| m);
        std::fs::remove_file(root.path().join("fifo/model.onnx")).expect("remove");
        let made = std::process::Command::new("mkfifo").arg(root.path().join("fifo/model.onnx")).status();
        assert!(made.expect("mkfifo").success());
        tiny(root.path(), "zero", "zero", |m| m);
        std::fs::remove_file(root.path().join("zero/model.onnx")).expect("remove");
        std::os::unix::fs::symlink("/dev/zero", root.path().join("zero/model.onnx")).expect("symlink");
        // A manifest naming a file outside its directory.
        tiny(root.path(), "escape", "escape", |m| m.replace("file = \"model.onnx\"", "file = \"../hash/model.onnx\""));
        let r = Registry::load(&[root.path()], LIMITS, None);
        assert!(r.models.is_empty(), "{:?}", r.names());
        assert!(failed(&r, "fifo").contains("not a regular file"), "{}", failed(&r, "fifo"));
        assert!(failed(&r, "zero").contains("not a regular file"), "{}", failed(&r, "zero"));
        assert!(failed(&r, "escape").contains("not a file name"), "{}", failed(&r, "escape"));
        // Unchanged, a failed directory is not read again: its failure is kept as it was.
        let again = Registry::load(&[root.path()], LIMITS, Some(&r));
        assert_eq!(again.failed, r.failed);
        assert!(failed(&r, "hash").contains("sha256 of"), "{}", failed(&r, "hash"));
        assert!(failed(&r, "split").contains("does not produce"), "{}", failed(&r, "split"));
        assert!(failed(&r, "garbage").contains("not an ONNX model"), "{}", failed(&r, "garbage"));
        assert!(failed(&r, "huge").contains("more than pushdown.max_model_bytes"), "{}", failed(&r, "huge"));
        assert!(failed(&r, "twin2").contains("two manifests name model"), "{}", failed(&r, "twin2"));
    }
}
