//! `tensorgate models import MODEL.onnx`: a model directory (the ONNX file and its manifest) written
//! from a model as an exporter left it, so that a user's own model needs no hand-written manifest.
//!
//! - The input: the graph's one float input of four dimensions, `NCHW` (three channels second) or
//!   `NHWC` (three channels last); symbolic height and width take the preprocessing's crop. Or a
//!   text encoder's two int64 inputs, token ids and attention mask, with its `tokenizer.json`
//!   ([`text_input`]): the gateway tokenizes texts to the length the graph, `--length` or the
//!   tokenizer's truncation says.
//! - Candidate splits at block boundaries, named after the module path the exporter kept in node
//!   names (torch's `torch.onnx.export(..., dynamo=False)` writes `/layer1/layer1.0/conv1/Conv`):
//!   the top-level modules in graph order (below a wrapper module that holds every node), each
//!   one's split the output of its last node; a module holding most of the graph (a ViT's
//!   `blocks`, a BERT's `encoder`) is split at its own children instead ([`boundaries`]).
//! - The freeze split: the last candidate before a classifier head (`fc`, `head`, `classifier`).
//! - Preprocessing from a preset (`imagenet`, `clip`, `none`), a Hugging Face
//!   `preprocessor_config.json` or a timm `pretrained_cfg` (JSON) ([`preprocess_from`]).
//! - It checks itself: a prefix cut at every candidate must give what ONNX Runtime computes at
//!   that tensor in the full model (relative L2 at most [`IMPORT_TOLERANCE`]); a candidate that does
//!   not is left out, named in the report.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::engine::OrtArena;
use super::inference::{Inference, SessionSettings};
use super::manifest::{Channels, Layout, Manifest, Preprocess, SplitDef, TextInput};
use super::prefix::{self, ELEM_FLOAT, ELEM_INT64, GraphInput, NamedNode};

/// How far a prefix's output may be from the full model's at the same tensor: the bar pushdowns
/// are held to against onnxruntime.
pub(crate) const IMPORT_TOLERANCE: f64 = 1e-5;

/// Module names that hold a classifier head: the freeze split is the candidate before them.
const HEADS: &[&str] = &["fc", "head", "heads", "classifier", "pre_logits", "lm_head"];

/// How deep [`boundaries`] descends into a module that holds most of the graph.
const MAX_DEPTH: usize = 4;

/// Where the preprocessing comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Preset {
    /// torchvision's ImageNet evaluation transform: shorter side 256, centre crop 224, ImageNet
    /// mean and std, RGB.
    Imagenet,
    /// CLIP's: shorter side 224, centre crop 224, CLIP's mean and std, RGB (CLIP resizes bicubic;
    /// the gateway resizes bilinear, as PIL does).
    Clip,
    /// No `[preprocess]`: the model takes `.npy` tensors.
    None,
}

/// What to import and how.
#[derive(Debug, Clone)]
pub(crate) struct ImportOptions {
    pub(crate) name: String,
    pub(crate) preset: Preset,
    /// A Hugging Face `preprocessor_config.json` or a timm `pretrained_cfg` saved as JSON; over
    /// the preset.
    pub(crate) preprocess_config: Option<PathBuf>,
    /// A text encoder's Hugging Face `tokenizer.json` (copied beside the model).
    pub(crate) tokenizer: Option<PathBuf>,
    /// A text encoder's token length, where the graph does not fix it (default: the tokenizer's
    /// truncation length).
    pub(crate) length: Option<usize>,
    pub(crate) license: String,
    pub(crate) origin: String,
    /// The directory the model's directory is written in (`models`).
    pub(crate) out: PathBuf,
}

/// What an import wrote and found.
#[derive(Debug)]
pub(crate) struct Imported {
    pub(crate) dir: PathBuf,
    pub(crate) manifest: Manifest,
    /// Candidates left out, and why.
    pub(crate) dropped: Vec<(String, String)>,
}

/// Imports `model` (see the module docs), checking every candidate with `inference`.
///
/// # Errors
/// A model that is not ONNX, has no usable image input or no module path in its node names, or
/// whose every candidate failed its check; an unreadable configuration; a directory that cannot be
/// written (or exists already).
pub(crate) fn import(model: &Path, opts: &ImportOptions, inference: &dyn Inference) -> Result<Imported, String> {
    if opts.name.is_empty()
        || !opts.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        || opts.name.starts_with('.')
    {
        return Err(format!("--name {:?}: letters, digits, '-', '_' and '.' (not first)", opts.name));
    }
    let bytes = std::fs::read(model).map_err(|e| format!("reading {}: {e}", model.display()))?;
    if prefix::has_external_data(&bytes).map_err(|e| e.to_string())? {
        return Err("the model keeps its weights in external data files: export it as one file".into());
    }
    let inputs = prefix::graph_inputs(&bytes).map_err(|e| e.to_string())?;
    let (input, input_shape, layout, preprocess, text) = if let Some(t) = text_input(&inputs, opts)? {
        (
            t.ids,
            vec![2, t.length],
            Layout::Nchw,
            None,
            Some((TextInput { tokenizer: TOKENIZER.into(), mask: t.mask }, t.json)),
        )
    } else {
        let preprocess = match &opts.preprocess_config {
            Some(path) => Some(preprocess_from(path)?),
            None => preset(opts.preset),
        };
        let (input, shape, layout) = image_input(&inputs, preprocess.as_ref())?;
        (input, shape, layout, preprocess, None)
    };
    let candidates = boundaries(&prefix::named_nodes(&bytes).map_err(|e| e.to_string())?);
    if candidates.is_empty() {
        return Err("no module path in the graph's node names: export with torch.onnx.export(..., dynamo=False), \
                    which names nodes after the modules (/layer1/layer1.0/conv1/Conv)"
            .into());
    }
    let mut manifest = Manifest {
        name: opts.name.clone(),
        file: "model.onnx".into(),
        sha256: hex::encode(Sha256::digest(&bytes)),
        input,
        input_shape,
        layout,
        freeze: String::new(),
        license: opts.license.clone(),
        origin: opts.origin.clone(),
        preprocess,
        text: text.as_ref().map(|(t, _)| t.clone()),
        splits: Vec::new(),
    };
    let dir = model.parent().unwrap_or(Path::new("."));
    let mut dropped = Vec::new();
    for (name, tensor) in candidates {
        match check(&bytes, &manifest, &tensor, inference, dir) {
            Ok(()) => manifest.splits.push(SplitDef { name, tensor }),
            Err(why) => dropped.push((name, why)),
        }
    }
    let freeze = manifest.splits.iter().rposition(|s| !HEADS.contains(&s.name.as_str())).unwrap_or(0);
    manifest.freeze = manifest.splits.get(freeze).ok_or("no candidate split passed its check")?.name.clone();
    let out = opts.out.join(&opts.name);
    std::fs::create_dir_all(&opts.out).map_err(|e| format!("creating {}: {e}", opts.out.display()))?;
    std::fs::create_dir(&out).map_err(|e| format!("creating {}: {e}", out.display()))?;
    std::fs::write(out.join("model.onnx"), &bytes).map_err(|e| format!("writing the model: {e}"))?;
    if let Some((_, json)) = &text {
        std::fs::write(out.join(TOKENIZER), json).map_err(|e| format!("writing the tokenizer: {e}"))?;
    }
    // The manifest last, whole (renamed into place): a gateway reading the directory sees the
    // model once it is complete.
    let partial = out.join(".manifest.toml.partial");
    std::fs::write(&partial, manifest_toml(&manifest, model)).map_err(|e| format!("writing the manifest: {e}"))?;
    std::fs::rename(&partial, out.join("manifest.toml")).map_err(|e| format!("writing the manifest: {e}"))?;
    Ok(Imported { dir: out, manifest, dropped })
}

/// A text encoder's tokenizer, as written beside its model.
const TOKENIZER: &str = "tokenizer.json";

/// A text encoder's inputs, length and tokenizer.
#[derive(Debug)]
struct TextModel {
    ids: String,
    mask: String,
    length: usize,
    /// The tokenizer file's text (loaded once to check it).
    json: String,
}

/// The graph's text inputs, if it has a text encoder's: two int64 inputs `[batch, length]`, the
/// attention mask the one whose name says `mask`. `None` for any other graph.
///
/// # Errors
/// A text encoder without `--tokenizer`, with a third input (BERT's `token_type_ids`: export without
/// it, its default is zeros), a fixed batch, or no length from the graph, `--length` or the tokenizer.
fn text_input(inputs: &[GraphInput], opts: &ImportOptions) -> Result<Option<TextModel>, String> {
    let int64 = inputs.iter().filter(|i| i.elem_type == ELEM_INT64 && i.dims.len() == 2).count();
    if int64 == 0 || int64 < inputs.len() && opts.tokenizer.is_none() {
        return Ok(None);
    }
    let names = || inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ");
    let (Some(mask), Some(ids), 2) = (
        inputs.iter().find(|i| i.name.contains("mask")),
        inputs.iter().find(|i| !i.name.contains("mask")),
        inputs.len(),
    ) else {
        return Err(format!(
            "a text encoder is fed token ids and an attention mask, and this model's inputs are {}: export it \
             with those two (BERT's token_type_ids default to zeros)",
            names()
        ));
    };
    if [ids, mask].iter().any(|i| i.elem_type != ELEM_INT64 || i.dims.len() != 2 || i.dims[0].is_some()) {
        return Err(format!("inputs {}: a text encoder's are int64 [batch, length] with a symbolic batch", names()));
    }
    let path = opts.tokenizer.as_ref().ok_or("a text encoder needs its tokenizer: --tokenizer tokenizer.json")?;
    let json = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let truncation = serde_json::from_str::<serde_json::Value>(&json)
        .ok()
        .and_then(|v| v.get("truncation")?.get("max_length")?.as_u64())
        .and_then(|n| usize::try_from(n).ok());
    let fixed = ids.dims[1].and_then(|n| usize::try_from(n).ok());
    let length = match (fixed, opts.length) {
        (Some(f), Some(l)) if f != l => {
            return Err(format!("--length {l}, and the graph's inputs are {f} tokens long"));
        }
        (Some(n), _) | (None, Some(n)) => n,
        (None, None) => {
            truncation.ok_or("no length: the graph's is symbolic and the tokenizer truncates to none; give --length")?
        }
    };
    super::text::Encoder::from_json(&json, length).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Some(TextModel { ids: ids.name.clone(), mask: mask.name.clone(), length, json }))
}

/// The graph's image input: its name, per-sample shape and layout.
fn image_input(inputs: &[GraphInput], preprocess: Option<&Preprocess>) -> Result<(String, Vec<usize>, Layout), String> {
    let [input] = inputs else {
        return Err(format!(
            "the model has {} inputs ({}); an image model has one",
            inputs.len(),
            inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ")
        ));
    };
    let &[batch, a, b, c] = input.dims.as_slice() else {
        return Err(format!("input {:?} has {} dimensions; an image batch has 4", input.name, input.dims.len()));
    };
    if batch.is_some() {
        return Err(format!(
            "input {:?} has a fixed batch size: export with dynamic_axes={{\"{}\": {{0: \"batch\"}}}} (the gateway \
             runs batches of several samples)",
            input.name, input.name
        ));
    }
    if input.elem_type != ELEM_FLOAT {
        return Err(format!("input {:?} is not float (ONNX type {})", input.name, input.elem_type));
    }
    let crop = preprocess.map(|p| p.crop);
    let side = |d: Option<u64>, i: usize| -> Result<usize, String> {
        match (d, crop) {
            (Some(v), Some(c)) if v != u64::from(c[i]) => {
                Err(format!("input {:?} is {v} pixels where the preprocessing crops {}", input.name, c[i]))
            }
            (Some(v), _) => usize::try_from(v).map_err(|e| e.to_string()),
            (None, Some(c)) => Ok(c[i] as usize),
            (None, None) => Err(format!("input {:?} has a symbolic size and no preprocessing says it", input.name)),
        }
    };
    match (a, c) {
        (Some(3), _) => Ok((input.name.clone(), vec![3, side(b, 0)?, side(c, 1)?], Layout::Nchw)),
        (_, Some(3)) => Ok((input.name.clone(), vec![side(a, 0)?, side(b, 1)?, 3], Layout::Nhwc)),
        _ => Err(format!("input {:?} has no 3-channel axis second or last: {:?}", input.name, input.dims)),
    }
}

/// A node's module path from its name (`/layer1/layer1.0/conv1/Conv` is `layer1`, `layer1.0`,
/// `conv1`): the name's components but the last, which names the operator.
fn module_path(node: &NamedNode) -> Vec<&str> {
    let mut parts: Vec<&str> = node.name.split('/').filter(|p| !p.is_empty()).collect();
    if node.name.starts_with('/') {
        parts.pop();
        parts
    } else {
        Vec::new()
    }
}

/// Candidate splits: (name, tensor) at block boundaries, in graph order (module docs).
pub(crate) fn boundaries(nodes: &[NamedNode]) -> Vec<(String, String)> {
    let paths: Vec<Vec<&str>> = nodes.iter().map(module_path).collect();
    let members: Vec<usize> = (0..nodes.len()).filter(|&i| !paths[i].is_empty()).collect();
    // Below the modules every node is in (a wrapper around the exported model, `/model/...`).
    let mut base = 0;
    while let Some(&first) = members.first()
        && let Some(key) = paths[first].get(base)
        && members.iter().all(|&i| paths[i].get(base) == Some(key))
        && members.iter().any(|&i| paths[i].len() > base + 1)
    {
        base += 1;
    }
    let mut out = Vec::new();
    split_at(nodes, &paths, &members, (base, base), &mut out);
    out
}

/// The candidates among `members` (nodes inside one module) at `depth` (named from `base`, below
/// any wrapper): a run of nodes in the same child module is one candidate, unless it holds most of
/// the module's nodes and is not a numbered block (then its own children are, if it has at least
/// two).
fn split_at(
    nodes: &[NamedNode],
    paths: &[Vec<&str>],
    members: &[usize],
    (base, depth): (usize, usize),
    out: &mut Vec<(String, String)>,
) {
    let mut runs: Vec<(&str, Vec<usize>)> = Vec::new();
    for &i in members {
        let Some(&key) = paths[i].get(depth) else { continue };
        match runs.last_mut() {
            Some((k, run)) if *k == key => run.push(i),
            _ => runs.push((key, vec![i])),
        }
    }
    for (key, run) in &runs {
        // One of a module's numbered children (`layer.1`, `blocks.3`) is a repeated block: a
        // boundary itself, however much of the graph it holds.
        let numbered =
            key.rsplit_once('.').is_some_and(|(_, i)| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()));
        if run.len() * 2 > members.len() && depth < MAX_DEPTH && !numbered {
            let mut inner = Vec::new();
            split_at(nodes, paths, run, (base, depth + 1), &mut inner);
            if inner.len() >= 2 {
                out.extend(inner);
                continue;
            }
        }
        let last = run.last().copied().unwrap_or_default();
        let Some(tensor) = nodes[last].outputs.first() else { continue };
        // torch names a container's children `layer1.0`: already qualified.
        let name = if key.contains('.') { (*key).to_owned() } else { paths[last][base..=depth].join(".") };
        if !out.iter().any(|(n, _)| *n == name) {
            out.push((name, tensor.clone()));
        }
    }
}

/// Whether a prefix cut at `tensor` gives what the full model computes there.
fn check(bytes: &[u8], manifest: &Manifest, tensor: &str, inference: &dyn Inference, dir: &Path) -> Result<(), String> {
    let cut = prefix::cut(bytes, &[tensor]).map_err(|e| format!("cannot cut: {e}"))?;
    let exposed = prefix::expose(bytes, &[tensor]).map_err(|e| format!("cannot expose: {e}"))?;
    let settings = SessionSettings { threads: 1, arena: OrtArena::Off };
    let (shape, probe) = super::engine::probe_texts(manifest, 1, usize::MAX);
    let a = inference.session(&cut, settings, dir)?.run(manifest, tensor, &shape, &probe)?;
    let b = inference.session(&exposed, settings, dir)?.run(manifest, tensor, &shape, &probe)?;
    if a.shape != b.shape {
        return Err(format!("shape {:?} against the full model's {:?}", a.shape, b.shape));
    }
    let rel = super::runtime::relative_l2(&a.data, &b.data);
    if rel <= IMPORT_TOLERANCE { Ok(()) } else { Err(format!("relative L2 {rel:.2e} from the full model's output")) }
}

/// The built-in preprocessing presets.
fn preset(p: Preset) -> Option<Preprocess> {
    let image = |resize, crop, mean, std| Preprocess {
        resize_shorter: Some(resize),
        crop: [crop, crop],
        scale: 1.0 / 255.0,
        mean,
        std,
        channels: Channels::Rgb,
    };
    match p {
        Preset::Imagenet => Some(image(256, 224, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])),
        Preset::Clip => {
            Some(image(224, 224, [0.481_454_66, 0.457_827_5, 0.408_210_73], [0.268_629_54, 0.261_302_6, 0.275_777_1]))
        }
        Preset::None => None,
    }
}

/// Preprocessing from a Hugging Face `preprocessor_config.json` (`size.shortest_edge` or
/// `size.height`, `crop_size`, `rescale_factor`, `image_mean`, `image_std`) or a timm
/// `pretrained_cfg` (`input_size`, `crop_pct`, `mean`, `std`).
///
/// # Errors
/// An unreadable file, or one that is neither.
pub(crate) fn preprocess_from(path: &Path) -> Result<Preprocess, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let floats = |key: &str| -> Option<[f32; 3]> {
        let a = v.get(key)?.as_array()?;
        let f: Vec<f32> = a.iter().filter_map(serde_json::Value::as_f64).map(|x| x as f32).collect();
        f.try_into().ok()
    };
    let uint =
        |x: Option<&serde_json::Value>| x.and_then(serde_json::Value::as_u64).and_then(|n| u32::try_from(n).ok());
    let (mean, std) =
        match (floats("image_mean").or_else(|| floats("mean")), floats("image_std").or_else(|| floats("std"))) {
            (Some(m), Some(s)) => (m, s),
            _ => return Err(format!("{}: no mean and std (image_mean/image_std or mean/std)", path.display())),
        };
    if let Some(size) = v.get("input_size").and_then(serde_json::Value::as_array) {
        // timm: input_size [3, H, W]; resize to H / crop_pct, then crop H x W.
        let (h, w) = (uint(size.get(1)).unwrap_or(224), uint(size.get(2)).unwrap_or(224));
        let pct = v.get("crop_pct").and_then(serde_json::Value::as_f64).unwrap_or(0.875);
        let resize = (f64::from(h) / pct).floor() as u32;
        return Ok(Preprocess {
            resize_shorter: Some(resize),
            crop: [h, w],
            scale: 1.0 / 255.0,
            mean,
            std,
            channels: Channels::Rgb,
        });
    }
    let size = v.get("size");
    if size.and_then(|s| s.get("height")).is_some()
        && v.get("do_resize").and_then(serde_json::Value::as_bool) != Some(false)
    {
        return Err(format!(
            "{}: it resizes to height x width, ignoring the aspect ratio, which [preprocess] cannot say (it \
             resizes the shorter side, then crops the centre): use --preset, or write [preprocess] by hand",
            path.display()
        ));
    }
    let shortest = uint(size.and_then(|s| s.get("shortest_edge"))).or_else(|| uint(size));
    let crop = v.get("crop_size");
    let (ch, cw) = match (uint(crop.and_then(|c| c.get("height"))), uint(crop.and_then(|c| c.get("width"))), uint(crop))
    {
        (Some(h), Some(w), _) => (h, w),
        (_, _, Some(c)) => (c, c),
        _ => {
            let s = shortest.ok_or_else(|| format!("{}: no size or crop_size", path.display()))?;
            (s, s)
        }
    };
    let scale = v.get("rescale_factor").and_then(serde_json::Value::as_f64).map_or(1.0 / 255.0, |f| f as f32);
    let resize = if v.get("do_resize").and_then(serde_json::Value::as_bool) == Some(false) { None } else { shortest };
    Ok(Preprocess { resize_shorter: resize, crop: [ch, cw], scale, mean, std, channels: Channels::Rgb })
}

/// The manifest as TOML, with where it came from.
fn manifest_toml(m: &Manifest, model: &Path) -> String {
    let q = |s: &str| toml::Value::String(s.to_owned()).to_string();
    let mut t = format!(
        "# Written by `tensorgate models import {}`: splits at the exported modules' boundaries, each\n\
         # checked against ONNX Runtime on the full model. Edit the freeze split or the splits as needed.\n\
         name = {}\nfile = {}\nsha256 = {}\ninput = {}\ninput_shape = {:?}\nlayout = {}\nfreeze = {}\nlicense = {}\norigin = {}\n",
        model.display(),
        q(&m.name),
        q(&m.file),
        q(&m.sha256),
        q(&m.input),
        m.input_shape,
        q(match m.layout {
            Layout::Nchw => "NCHW",
            Layout::Nhwc => "NHWC",
        }),
        q(&m.freeze),
        q(&m.license),
        q(&m.origin),
    );
    if let Some(p) = &m.preprocess {
        t.push_str("\n[preprocess]\n");
        if let Some(r) = p.resize_shorter {
            t.push_str(&format!("resize_shorter = {r}\n"));
        }
        t.push_str(&format!(
            "crop = {:?}\nscale = {:?}\nmean = {:?}\nstd = {:?}\nchannels = {}\n",
            p.crop,
            p.scale,
            p.mean,
            p.std,
            q(match p.channels {
                Channels::Rgb => "RGB",
                Channels::Bgr => "BGR",
            })
        ));
    }
    if let Some(text) = &m.text {
        t.push_str(&format!("\n[text]\ntokenizer = {}\nmask = {}\n", q(&text.tokenizer), q(&text.mask)));
    }
    for s in &m.splits {
        t.push_str(&format!("\n[[splits]]\nname = {}\ntensor = {}\n", q(&s.name), q(&s.tensor)));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, out: &str) -> NamedNode {
        NamedNode { name: name.into(), outputs: vec![out.into()] }
    }

    #[test]
    fn blocks_are_the_modules_and_a_dominant_module_is_split_at_its_children() {
        // A ResNet's top level.
        let resnet = [
            node("/conv1/Conv", "c1"),
            node("/maxpool/MaxPool", "mp"),
            node("/layer1/layer1.0/conv1/Conv", "a"),
            node("/layer1/layer1.0/relu/Relu", "l1"),
            node("/layer2/layer2.0/conv1/Conv", "b"),
            node("/layer2/layer2.0/relu/Relu", "l2"),
            node("/avgpool/GlobalAveragePool", "gap"),
            node("/Flatten", "flat"),
            node("/fc/Gemm", "logits"),
        ];
        let got = boundaries(&resnet);
        let names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["conv1", "maxpool", "layer1", "layer2", "avgpool", "fc"]);
        assert_eq!(got[2].1, "l1");

        // A ViT: `blocks` holds most of the graph, so its children are the candidates.
        let mut vit = vec![node("/patch_embed/proj/Conv", "pe")];
        for b in 0..3 {
            for op in ["attn/MatMul", "mlp/fc1/MatMul", "Add"] {
                vit.push(node(&format!("/blocks/blocks.{b}/{op}"), &format!("b{b}-{op}")));
            }
        }
        vit.push(node("/norm/LayerNormalization", "n"));
        vit.push(node("/head/Gemm", "h"));
        let names: Vec<String> = boundaries(&vit).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["patch_embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]);
        // A wrapper around the exported model (`/model/...`, with nodes of its own) is looked through.
        let wrapped = [
            node("Identity_1", "w"),
            node("/model/embeddings/word_embeddings/Gather", "e"),
            node("/model/Cast", "mask"),
            node("/model/encoder/layer.0/attention/MatMul", "a0"),
            node("/model/encoder/layer.0/output/Add", "l0"),
            node("/model/encoder/layer.1/attention/MatMul", "a1"),
            node("/model/encoder/layer.1/attention/Softmax", "s1"),
            node("/model/encoder/layer.1/output/Add", "l1"),
        ];
        let got = boundaries(&wrapped);
        assert_eq!(
            got,
            [("embeddings".into(), "e".into()), ("layer.0".into(), "l0".into()), ("layer.1".into(), "l1".into())]
        );
        // Names without a module path (another exporter's) give none.
        assert!(boundaries(&[node("node_Conv_0", "x")]).is_empty());
    }
}
