//! The model manifest, `models/<name>/manifest.toml`: the ONNX file and its sha256, the input
//! tensor, its per-sample shape and layout, the ordered split points (name → tensor), the default
//! freeze split, where the weights come from, and how images become inputs. Types only (serde);
//! the registry reads and checks them, preprocessing follows `[preprocess]`.

use serde::Deserialize;

/// Memory layout of the model input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum Layout {
    #[serde(rename = "NCHW")]
    Nchw,
    #[serde(rename = "NHWC")]
    Nhwc,
}

/// One split point.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitDef {
    pub name: String,
    pub tensor: String,
}

/// `manifest.toml`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    pub file: String,
    pub sha256: String,
    pub input: String,
    /// Per-sample input shape (no batch dimension).
    pub input_shape: Vec<usize>,
    pub layout: Layout,
    /// The default freeze split: the deepest split the model's users keep frozen.
    pub freeze: String,
    pub license: String,
    pub origin: String,
    /// How images become input tensors; without it the model takes `.npy` inputs only.
    pub preprocess: Option<Preprocess>,
    pub splits: Vec<SplitDef>,
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
