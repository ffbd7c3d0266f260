//! Outputs as bytes: a shard's output laid out before its features are computed (as `.npy`,
//! safetensors, or a WebDataset shard of features beside the source's other members), and the
//! batch of one request's samples stacked.

use std::collections::HashMap;

use bytes::Bytes;

use super::error::PushdownError;
use super::spec::{Dtype, Format};
use super::tensor::Tensor;
use super::{shard, tensor};

/// Bytes a `format=tar` body holds beyond the encoded features: copies of the samples' other
/// members and the tar framing.
pub(super) fn tar_overhead(keys: &[String], others: &[Vec<(String, Bytes)>]) -> usize {
    let members = keys.len() + others.iter().map(Vec::len).sum::<usize>();
    let longest = keys
        .iter()
        .zip(others)
        .map(|(k, o)| k.len() + 1 + o.iter().map(|(e, _)| e.len()).chain([3]).max().unwrap_or(3))
        .max()
        .unwrap_or(0);
    let extra: usize = others.iter().flatten().map(|(_, b)| b.len()).sum();
    extra + shard::framing_bytes(members, longest)
}

/// A sample's members other than its input: the extension and the bytes, in archive order.
pub(super) type Members = Vec<(String, Bytes)>;

/// A shard's output laid out before any of its features is computed (ADR 0031): the bytes
/// before the first sample's, one piece per sample made from that sample's output alone, and
/// the bytes after the last; the output is exactly these in order, so its length follows from
/// the shard's parse and the split's output shape. `.npy` and safetensors pieces are the
/// samples' values in a stacked tensor; `format=tar` pieces are each sample's `.npy` member
/// and its other members ([`shard::write_sample`]).
#[derive(Debug)]
pub(crate) struct ShardLayout {
    pub(super) format: Format,
    dtype: Dtype,
    /// One sample's output shape (the split's).
    sample: Vec<usize>,
    keys: Vec<String>,
    others: Vec<Members>,
    pub(crate) head: Bytes,
    pub(crate) tail: Bytes,
    /// The whole output's length.
    pub(crate) len: u64,
}

impl ShardLayout {
    /// The layout of a shard's samples (`keys`, with their `labels` and `others` members) for
    /// `format` (not Parquet) in `dtype`, each sample's output of shape `sample`; `meta` is a
    /// safetensors output's metadata.
    pub(super) fn new(
        (format, dtype): (Format, Dtype),
        sample: &[usize],
        (keys, labels, others): (&[String], Option<&[i64]>, &[Members]),
        meta: HashMap<String, String>,
    ) -> Result<Self, PushdownError> {
        let n = keys.len();
        let values = sample.iter().product::<usize>() * dtype.size();
        let stacked: Vec<usize> = std::iter::once(n).chain(sample.iter().copied()).collect();
        let (head, tail, pieces) = match format {
            Format::Npy => (tensor::npy_header(&stacked, dtype), Vec::new(), n * values),
            Format::Safetensors => (tensor::safetensors_head(&stacked, labels, dtype, meta)?, Vec::new(), n * values),
            Format::Tar => {
                let npy = tensor::npy_header(sample, dtype).len() + values;
                let members = keys.iter().zip(others).map(|(k, o)| {
                    let rest = o.iter().map(|(e, d)| shard::member_bytes(k.len() + 1 + e.len(), d.len()));
                    shard::member_bytes(k.len() + 4, npy) + rest.sum::<usize>()
                });
                (Vec::new(), shard::END.to_vec(), members.sum())
            }
            Format::Parquet => return Err(PushdownError::Internal("a Parquet output is not a shard's".into())),
        };
        Ok(Self {
            format,
            dtype,
            sample: sample.to_vec(),
            keys: keys.to_vec(),
            others: others.to_vec(),
            len: (head.len() + pieces + tail.len()) as u64,
            head: Bytes::from(head),
            tail: Bytes::from(tail),
        })
    }

    /// The features' shape, stacked: the sample count, then one sample's shape.
    #[must_use]
    pub(crate) fn shape(&self) -> Vec<usize> {
        std::iter::once(self.keys.len()).chain(self.sample.iter().copied()).collect()
    }

    /// Sample `i`'s piece, from its output.
    ///
    /// # Errors
    /// An output not of the split's shape (the layout would not hold).
    pub(super) fn piece(&self, i: usize, out: &Tensor) -> Result<Vec<u8>, PushdownError> {
        if out.shape != self.sample || i >= self.keys.len() {
            return Err(PushdownError::Internal(format!(
                "sample {i}'s output has shape {:?}, not the split's {:?}",
                out.shape, self.sample
            )));
        }
        match self.format {
            Format::Tar => shard::write_sample(&self.keys[i], &tensor::write_npy(out, self.dtype), &self.others[i]),
            _ => Ok(tensor::encode_values(&out.data, self.dtype)),
        }
    }
}

/// A shard's outputs as a WebDataset shard (`format=tar`) once all are computed, each sample's
/// `.npy` of its own shape (a shard of `.npy` inputs, whose outputs' shapes are not known before):
/// each sample's features as `.npy`, its other members after it. Returns the body and the shape
/// the features would have stacked.
pub(super) fn write_tar(
    outputs: &[Tensor],
    keys: &[String],
    others: &[Vec<(String, Bytes)>],
    dtype: Dtype,
) -> Result<(Vec<u8>, Vec<usize>), PushdownError> {
    // An .npy header of a feature map is well under 128 bytes.
    let per = outputs.first().map_or(0, |t| t.data.len() * dtype.size() + 128);
    let capacity = per * outputs.len() + tar_overhead(keys, others);
    let rows =
        outputs.iter().zip(keys).zip(others).map(|((t, k), o)| (k.as_str(), tensor::write_npy(t, dtype), o.as_slice()));
    let body = shard::write(rows, capacity)?;
    let mut shape = vec![outputs.len()];
    shape.extend(outputs.first().map(|t| t.shape.clone()).unwrap_or_default());
    Ok((body, shape))
}

pub(super) fn stack(outputs: Vec<Tensor>, batched: bool) -> Tensor {
    let mut it = outputs.into_iter();
    let first = it.next().unwrap_or(Tensor { shape: vec![0], data: Vec::new() });
    if !batched {
        return first;
    }
    let mut shape = vec![1];
    shape.extend(&first.shape);
    let mut data = first.data;
    for t in it {
        shape[0] += 1;
        data.extend(t.data);
    }
    Tensor { shape, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The layout's bytes are the whole-output writers' bytes, and its length theirs, in every
    /// format a shard's output takes (long member names and other members included).
    #[test]
    fn a_layout_is_the_whole_output() {
        let long = format!("./{}/0003", "d".repeat(120));
        let keys = vec!["a/0001".to_owned(), long, "b".to_owned()];
        let cls = |v: &'static [u8]| ("cls".to_owned(), Bytes::from_static(v));
        let others = vec![vec![cls(b"3"), ("json".to_owned(), Bytes::from(vec![b'x'; 700]))], vec![cls(b"1")], vec![]];
        let labels = [3_i64, 1, 4];
        let outputs: Vec<Tensor> = (0..3)
            .map(|i| Tensor { shape: vec![2, 3], data: (0..6).map(|v| (v * 10 + i) as f32 / 7.0).collect() })
            .collect();
        let meta = || HashMap::from([("model".to_owned(), "m".to_owned())]);
        for (format, dtype) in [
            (Format::Npy, Dtype::F32),
            (Format::Npy, Dtype::F16),
            (Format::Safetensors, Dtype::F32),
            (Format::Safetensors, Dtype::Bf16),
            (Format::Tar, Dtype::F32),
            (Format::Tar, Dtype::F16),
        ] {
            let layout =
                ShardLayout::new((format, dtype), &[2, 3], (&keys, Some(&labels), &others), meta()).expect("layout");
            let mut laid = layout.head.to_vec();
            for (i, out) in outputs.iter().enumerate() {
                laid.extend(layout.piece(i, out).expect("piece"));
            }
            laid.extend_from_slice(&layout.tail);
            let stacked = stack(outputs.clone(), true);
            let whole = match format {
                Format::Npy => tensor::write_npy(&stacked, dtype),
                Format::Safetensors => {
                    tensor::write_safetensors(&[("features", &stacked)], Some(&labels), dtype, meta()).expect("st")
                }
                _ => {
                    let rows = outputs.iter().zip(&keys).zip(&others);
                    let rows = rows.map(|((t, k), o)| (k.as_str(), tensor::write_npy(t, dtype), o.as_slice()));
                    shard::write(rows, 0).expect("tar")
                }
            };
            assert_eq!(laid, whole, "{format:?} {dtype:?}");
            assert_eq!(layout.len, whole.len() as u64, "{format:?} {dtype:?}");
            assert_eq!(layout.shape(), stacked.shape);
        }
        let wrong = Tensor { shape: vec![6], data: vec![0.0; 6] };
        let layout = ShardLayout::new((Format::Npy, Dtype::F32), &[2, 3], (&keys, None, &others), meta()).expect("l");
        assert!(layout.piece(0, &wrong).is_err() && layout.piece(3, &outputs[0]).is_err());
    }
}
