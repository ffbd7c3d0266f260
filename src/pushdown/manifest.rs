//! The model manifest, `models/<name>/manifest.toml`: the ONNX file and its sha256, the input
//! tensor, its per-sample shape and layout, the ordered split points (name → tensor), the default
//! freeze split, where the weights come from, and how images (`[preprocess]`) or texts (`[text]`)
//! become inputs. Types only (serde); the registry reads and checks them.

use serde::Deserialize;

/// Memory layout of the model input (an image model's; text models leave it out).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum Layout {
    #[default]
    #[serde(rename = "NCHW")]
    Nchw,
    #[serde(rename = "NHWC")]
    Nhwc,
}

/// One split point.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SplitDef {
    pub(crate) name: String,
    pub(crate) tensor: String,
}

/// `manifest.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Manifest {
    pub(crate) name: String,
    pub(crate) file: String,
    pub(crate) sha256: String,
    pub(crate) input: String,
    /// Per-sample input shape (no batch dimension). A text model's is `[2, L]`: the token ids and
    /// the attention mask of `L` tokens, which the engine feeds as two int64 inputs.
    pub(crate) input_shape: Vec<usize>,
    #[serde(default)]
    pub(crate) layout: Layout,
    /// The default freeze split: the deepest split the model's users keep frozen.
    pub(crate) freeze: String,
    pub(crate) license: String,
    pub(crate) origin: String,
    /// How images become input tensors; without it the model takes `.npy` inputs only.
    pub(crate) preprocess: Option<Preprocess>,
    /// How texts become input tensors: the model is a text encoder.
    pub(crate) text: Option<TextInput>,
    pub(crate) splits: Vec<SplitDef>,
}

/// `[text]` in a manifest: a text encoder's tokenizer and second input. Texts are truncated and
/// padded to the `L` of `input_shape = [2, L]`; `input` names the token ids.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TextInput {
    /// Hugging Face `tokenizer.json`, beside the manifest.
    pub(crate) tokenizer: String,
    /// The attention mask input.
    pub(crate) mask: String,
}

/// Channel order the model expects.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum Channels {
    #[default]
    #[serde(rename = "RGB")]
    Rgb,
    #[serde(rename = "BGR")]
    Bgr,
}

/// `[preprocess]` in a manifest.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preprocess {
    /// Resize so the shorter side has this many pixels (aspect kept); none: no resize.
    pub resize_shorter: Option<u32>,
    /// Center crop `[height, width]`.
    pub crop: [u32; 2],
    /// Multiplier applied to 0-255 pixel values before normalization (e.g. 1/255).
    pub scale: f32,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    #[serde(default)]
    pub channels: Channels,
}
