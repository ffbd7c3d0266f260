//! Tensor containers: reading `.npy` inputs, writing `.npy` and safetensors outputs. Pure.
//!
//! `.npy` format: <https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html>
//! (versions 1.0-3.0; little-endian `f2`/`f4`/`f8` in C order are accepted as input).

use std::collections::HashMap;

use super::error::PushdownError;
use super::spec::Dtype;

const NPY_MAGIC: &[u8] = b"\x93NUMPY";
/// Largest `.npy` header accepted (numpy writes well under 1 KiB).
const MAX_NPY_HEADER: usize = 64 * 1024;

/// A dense f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

fn bad(msg: impl Into<String>) -> PushdownError {
    PushdownError::BadInput(msg.into())
}

/// Parses a `.npy` file into an f32 tensor.
///
/// # Errors
/// Not `.npy`, unsupported dtype or order, or a length that does not match the shape.
pub fn read_npy(bytes: &[u8]) -> Result<Tensor, PushdownError> {
    if bytes.len() < 10 || &bytes[..6] != NPY_MAGIC {
        return Err(bad("not a .npy file"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        _ => return Err(bad("unsupported .npy version")),
    };
    if header_len > MAX_NPY_HEADER || bytes.len() < start + header_len {
        return Err(bad(".npy header is truncated or too large"));
    }
    let header = std::str::from_utf8(&bytes[start..start + header_len]).map_err(|_| bad(".npy header is not text"))?;
    let field = |key: &str| -> Option<&str> {
        let i = header.find(&format!("'{key}'"))? + key.len() + 2;
        Some(header[i..].trim_start().strip_prefix(':')?.trim_start())
    };
    let descr = field("descr")
        .and_then(|v| v.strip_prefix('\''))
        .and_then(|v| v.split('\'').next())
        .ok_or_else(|| bad(".npy header has no descr"))?;
    if field("fortran_order").is_some_and(|v| v.starts_with("True")) {
        return Err(bad(".npy in Fortran order is not supported; save with C order"));
    }
    let shape_text = field("shape")
        .and_then(|v| v.strip_prefix('('))
        .and_then(|v| v.split(')').next())
        .ok_or_else(|| bad(".npy header has no shape"))?;
    let shape: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| bad(".npy shape is not a tuple of integers")))
        .collect::<Result<_, _>>()?;
    let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad(".npy shape overflows"))?;
    let body = &bytes[start + header_len..];
    let width = match descr {
        "<f4" => 4,
        "<f2" => 2,
        "<f8" => 8,
        other => {
            return Err(bad(format!(
                ".npy dtype {other} is not supported (use float32, float16 or float64, little-endian)"
            )));
        }
    };
    if body.len() != count.checked_mul(width).ok_or_else(|| bad(".npy shape overflows"))? {
        return Err(bad(format!(
            ".npy data is {} bytes; shape {shape:?} of {descr} needs {}",
            body.len(),
            count * width
        )));
    }
    let data = match width {
        4 => body.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        2 => body.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => body.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32).collect(),
    };
    Ok(Tensor { shape, data })
}

/// Little-endian bytes of `data` in `dtype`.
#[must_use]
pub(crate) fn encode_values(data: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::F16 => data.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        Dtype::Bf16 => data.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
    }
}

/// A `.npy` (version 1.0) file holding `t` as `dtype` (`f32` or `f16`).
#[must_use]
pub fn write_npy(t: &Tensor, dtype: Dtype) -> Vec<u8> {
    let mut out = npy_header(&t.shape, dtype);
    out.extend_from_slice(&encode_values(&t.data, dtype));
    out
}

/// The header of a `.npy` (version 1.0) file of `shape` in `dtype`: what precedes its values.
#[must_use]
pub(crate) fn npy_header(shape: &[usize], dtype: Dtype) -> Vec<u8> {
    let descr = if dtype == Dtype::F16 { "<f2" } else { "<f4" };
    let dims: Vec<String> = shape.iter().map(ToString::to_string).collect();
    let shape = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad so that magic + version + length + header is a multiple of 64, ending in '\n'.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len());
    out.extend_from_slice(NPY_MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&u16::try_from(header.len()).expect("short header").to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

/// A safetensors file with the named tensors (all in `dtype`), optional `labels` (i64) and string
/// metadata.
///
/// # Errors
/// Only if the safetensors writer rejects the shapes (a bug).
pub fn write_safetensors(
    tensors: &[(&str, &Tensor)],
    labels: Option<&[i64]>,
    dtype: Dtype,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, PushdownError> {
    let st_dtype = match dtype {
        Dtype::F32 => safetensors::Dtype::F32,
        Dtype::F16 => safetensors::Dtype::F16,
        Dtype::Bf16 => safetensors::Dtype::BF16,
    };
    let mut encoded: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, t)| ((*name).to_owned(), st_dtype, t.shape.clone(), encode_values(&t.data, dtype)))
        .collect();
    if let Some(l) = labels {
        encoded.push((
            "labels".to_owned(),
            safetensors::Dtype::I64,
            vec![l.len()],
            l.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
    }
    let views = encoded
        .iter()
        .map(|(name, dt, shape, bytes)| {
            safetensors::tensor::TensorView::new(*dt, shape.clone(), bytes).map(|v| (name.clone(), v))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PushdownError::Internal(format!("safetensors: {e}")))?;
    let bytes = safetensors::serialize(views, Some(metadata))
        .map_err(|e| PushdownError::Internal(format!("safetensors: {e}")))?;
    canonical_header(&bytes).ok_or_else(|| PushdownError::Internal("safetensors: unreadable header".into()))
}

/// The bytes of a safetensors file of `features` (of `shape`, in `dtype`) and `labels` that
/// precede the features' values: the file [`write_safetensors`] writes for them is these bytes
/// and then the values. The header is in its canonical form ([`canonical_header`]), and the
/// labels' data come first, as the format lays tensors out by descending dtype (`I64` above
/// the float types; a test holds both writers to equal bytes).
///
/// # Errors
/// A shape whose size overflows.
pub(crate) fn safetensors_head(
    shape: &[usize],
    labels: Option<&[i64]>,
    dtype: Dtype,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, PushdownError> {
    use std::collections::BTreeMap;
    let name = match dtype {
        Dtype::F32 => "F32",
        Dtype::F16 => "F16",
        Dtype::Bf16 => "BF16",
    };
    let values = shape
        .iter()
        .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
        .ok_or_else(|| PushdownError::Internal("safetensors: the features' size overflows".into()))?;
    let label_bytes: Vec<u8> = labels.unwrap_or_default().iter().flat_map(|v| v.to_le_bytes()).collect();
    let at = label_bytes.len();
    let mut header: BTreeMap<String, serde_json::Value> = BTreeMap::new();
    if let Some(l) = labels {
        let info = serde_json::json!({ "dtype": "I64", "shape": [l.len()], "data_offsets": [0, at] });
        header.insert("labels".to_owned(), info);
    }
    let info = serde_json::json!({ "dtype": name, "shape": shape, "data_offsets": [at, at + values] });
    header.insert("features".to_owned(), info);
    let sorted: BTreeMap<String, String> = metadata.into_iter().collect();
    header.insert("__metadata__".to_owned(), serde_json::json!(sorted));
    let mut json = serde_json::to_vec(&header).map_err(|e| PushdownError::Internal(format!("safetensors: {e}")))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len() + at);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&label_bytes);
    Ok(out)
}

/// Rewrites a safetensors file's JSON header with its keys sorted. `safetensors::serialize` writes
/// the metadata map in `HashMap` order, which differs between runs: the same output must be the
/// same bytes (its ETag promises so, and ranges of one response are combined with another's).
fn canonical_header(file: &[u8]) -> Option<Vec<u8>> {
    use std::collections::BTreeMap;
    let len = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header = file.get(8..8 + len)?;
    let mut parsed: BTreeMap<String, serde_json::Value> = serde_json::from_slice(header).ok()?;
    if let Some(meta) = parsed.remove("__metadata__") {
        let sorted: BTreeMap<String, String> = serde_json::from_value(meta).ok()?;
        parsed.insert("__metadata__".to_owned(), serde_json::to_value(sorted).ok()?);
    }
    let mut json = serde_json::to_vec(&parsed).ok()?;
    // The format pads the header with spaces to a multiple of 8 bytes (data alignment).
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len() + file.len() - 8 - len);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    out.extend_from_slice(&file[8 + len..]);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safetensors_head_and_values_are_the_written_file() {
        let t = Tensor { shape: vec![3, 2], data: vec![1.0, -2.5, 3.25, 0.0, 7.0, 1e-3] };
        let meta = || HashMap::from([("model".to_owned(), "m".to_owned()), ("keys".to_owned(), "[\"a\"]".to_owned())]);
        for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
            for labels in [None, Some(&[3_i64, -1, 9][..])] {
                let file = write_safetensors(&[("features", &t)], labels, dtype, meta()).expect("write");
                let mut head = safetensors_head(&t.shape, labels, dtype, meta()).expect("head");
                head.extend_from_slice(&encode_values(&t.data, dtype));
                assert_eq!(head, file, "{dtype:?} {labels:?}");
            }
        }
    }

    #[test]
    fn safetensors_bytes_do_not_depend_on_map_order() {
        let t = Tensor { shape: vec![2], data: vec![1.0, 2.0] };
        let meta = || (0..6).map(|i| (format!("key{i}"), format!("value{i}"))).collect::<HashMap<String, String>>();
        let first = write_safetensors(&[("features", &t)], Some(&[3, 4]), Dtype::F32, meta()).expect("write");
        for _ in 0..8 {
            assert_eq!(write_safetensors(&[("features", &t)], Some(&[3, 4]), Dtype::F32, meta()).expect("w"), first);
        }
        let parsed = safetensors::SafeTensors::deserialize(&first).expect("valid file");
        assert_eq!(parsed.tensor("features").expect("features").data(), &[0, 0, 128, 63, 0, 0, 0, 64]);
        let (_, md) = safetensors::SafeTensors::read_metadata(&first).expect("metadata");
        assert_eq!(md.metadata().as_ref().and_then(|m| m.get("key5")).map(String::as_str), Some("value5"));
    }

    #[test]
    fn npy_round_trip_and_alignment() {
        let t = Tensor { shape: vec![2, 3], data: vec![0.0, 1.5, -2.0, 3.25, 4.0, 5.0] };
        let bytes = write_npy(&t, Dtype::F32);
        let header_end = 10 + usize::from(u16::from_le_bytes([bytes[8], bytes[9]]));
        assert_eq!(header_end % 64, 0);
        assert_eq!(read_npy(&bytes).expect("read"), t);
        let half = read_npy(&write_npy(&t, Dtype::F16)).expect("read f16");
        assert_eq!(half, t, "these values are exact in f16");
        let one = Tensor { shape: vec![3], data: vec![1.0, 2.0, 3.0] };
        assert!(String::from_utf8_lossy(&write_npy(&one, Dtype::F32)).contains("'shape': (3,)"));
    }

    #[test]
    fn bad_npy_is_refused() {
        assert!(read_npy(b"hello world").is_err());
        let mut bytes = write_npy(&Tensor { shape: vec![4], data: vec![1.0; 4] }, Dtype::F32);
        bytes.truncate(bytes.len() - 1);
        assert!(read_npy(&bytes).is_err());
        let mut ints = write_npy(&Tensor { shape: vec![1], data: vec![1.0] }, Dtype::F32);
        let at = ints.windows(3).position(|w| w == b"<f4").expect("descr");
        ints[at..at + 3].copy_from_slice(b"<i4");
        assert!(read_npy(&ints).expect_err("int dtype").to_string().contains("<i4"));
    }

    #[test]
    fn safetensors_holds_features_and_metadata() {
        let t = Tensor { shape: vec![2, 2], data: vec![1.0, 2.0, 3.0, 4.0] };
        let meta = HashMap::from([("keys".to_owned(), "a,b".to_owned())]);
        let bytes = write_safetensors(&[("features", &t)], Some(&[4, 2]), Dtype::Bf16, meta).expect("write");
        let (_, parsed) = safetensors::SafeTensors::read_metadata(&bytes).expect("parse");
        let info = parsed.info("features").expect("features");
        assert_eq!(info.shape, vec![2, 2]);
        assert_eq!(parsed.info("labels").expect("labels").dtype, safetensors::Dtype::I64);
        assert_eq!(parsed.metadata().as_ref().and_then(|m| m.get("keys")).map(String::as_str), Some("a,b"));
    }
}
