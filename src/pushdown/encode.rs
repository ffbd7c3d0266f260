//! Outputs as bytes: a WebDataset shard of features beside the source's other members, and the
//! batch of one request's samples stacked.

use bytes::Bytes;

use super::error::PushdownError;
use super::spec::Dtype;
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

/// A shard's outputs as a WebDataset shard (`format=tar`): each sample's features as `.npy`, its
/// other members after it. Returns the body and the shape the features would have stacked.
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
