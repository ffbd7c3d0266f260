//! The split planner: a pipelined cost model of a training epoch (docs/planner.md, ADR 0025).
//! Pure: the gateway supplies the storage-side terms (its own measurements), the client the
//! network and compute-side terms (its profile); [`plan`] returns the predicted epoch time of
//! every candidate split, and of no pushdown at all, and the argmin (no pushdown unless a split is
//! at least [`PUSHDOWN_MARGIN`] faster).
//!
//! The unit of work is a request of `U` samples (a shard), which passes three stages at split `s`:
//! - `Storage(s) = U * storage(s) * load / parallelism`: the storage node decodes and runs the
//!   prefix;
//! - `Link(s) = U * bytes(s) / bandwidth`: the features cross the network;
//! - `Compute(s) = U * (compute(s) + bytes(s) * decode) + train * U / B`: the compute tier
//!   deserialises them, finishes the frozen layers from `s` and trains the head on `U / B`
//!   batches of `B`.
//!
//! The loader keeps requests in flight ahead of the one it consumes, so the storage node computes
//! request k+1 while request k crosses the link and request k-1 trains: the slowest stage sets the
//! pace, the other two are paid once, filling and draining the pipeline. With `R = D / U` requests:
//! `T(s) = Storage + Link + Compute + (R - 1) * max(Storage, Link, Compute)`.
//!
//! The candidate `none` is the baseline: raw objects cross the network and the compute tier
//! decodes them and runs every frozen layer (`Storage = 0`, no deserialisation term). HAPI
//! compares the chosen split with a measured baseline; here the baseline is one more candidate.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The split value that asks the gateway to choose (`split=auto`).
pub(crate) const AUTO: &str = "auto";
/// The candidate that means "no pushdown".
pub(crate) const NO_PUSHDOWN: &str = "none";
/// A split is chosen over no pushdown only when its predicted epoch is at least this much shorter.
/// Pushdown spends the storage node's CPU, which every tenant shares, and where both tiers are
/// CPU-bound the model's predictions were off by up to about 20% (docs/REPRODUCTION.md): a
/// predicted gain of a few percent is noise, and the fallback then costs nothing. In the
/// reproduction's full run, 5% to 15% all turned its three misses (ResNet-18 at 1000 Mbit/s) right.
pub(crate) const PUSHDOWN_MARGIN: f64 = 0.10;
/// Seconds per byte the compute tier spends deserialising features when the profile does not say
/// (numpy reading an in-memory `.npy`/safetensors buffer: about 2 GB/s).
pub(crate) const DEFAULT_DECODE_SECS_PER_BYTE: f64 = 5e-10;

/// What the compute tier measured (or states).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClientProfile {
    /// Training batch size `B`.
    pub(crate) batch_size: usize,
    /// Samples per epoch `D`.
    pub(crate) samples: usize,
    /// Samples one request carries `U` (a shard's), the unit the tiers pipeline; default `B`, and
    /// at most `D`.
    #[serde(default)]
    pub(crate) samples_per_request: Option<usize>,
    /// Bytes per second one request receives (measured on pushdown GETs).
    pub(crate) bandwidth_bytes_per_sec: f64,
    /// Seconds to train the unfrozen layers on one batch (forward and backward).
    pub(crate) train_secs_per_batch: f64,
    /// Seconds per sample to run the frozen layers from each split to the freeze split on the
    /// compute tier; `none`: decoding a raw object and running all frozen layers. A split missing
    /// here is not a candidate.
    pub(crate) compute_secs_per_sample: BTreeMap<String, f64>,
    /// Mean bytes of a raw object per sample (the baseline's transfer).
    pub(crate) raw_bytes_per_sample: f64,
    /// Deserialisation cost; default [`DEFAULT_DECODE_SECS_PER_BYTE`].
    #[serde(default)]
    pub(crate) decode_secs_per_byte: Option<f64>,
    /// Compute-tier memory per split (bytes, for a batch of `B`); with `memory_limit`, splits
    /// above it are excluded (HAPI excludes splits that would not fit the GPU).
    #[serde(default)]
    pub(crate) memory_bytes: BTreeMap<String, u64>,
    #[serde(default)]
    pub(crate) memory_limit: Option<u64>,
    /// A text model's mean attended tokens per sample (the client's texts): the storage node
    /// measures its costs at that length where its batches are cut to their longest text
    /// (pooled outputs); default the model's length.
    #[serde(default)]
    pub(crate) tokens_per_sample: Option<f64>,
}

/// One split as the storage node measured it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub(crate) struct StorageSplit {
    pub(crate) split: String,
    /// Seconds per sample to decode and run the prefix (one inference thread).
    pub(crate) secs_per_sample: f64,
    /// Output bytes per sample.
    pub(crate) bytes_per_sample: f64,
    /// Output shape per sample (lets a client time its suffix without fetching features).
    #[serde(default)]
    pub(crate) shape: Vec<usize>,
    /// A text model's: the tokens per text its cost was measured at (the client's texts where
    /// the split's batches are cut to their longest text, else the model's length).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) text_length: Option<usize>,
}

/// The storage side: candidate splits in model order up to the freeze split, and its load.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StorageProfile {
    pub(crate) splits: Vec<StorageSplit>,
    /// Inference threads serving one request's samples in parallel.
    pub(crate) parallelism: f64,
    /// Slowdown from work already queued (1 = idle).
    pub(crate) load_factor: f64,
}

/// A candidate's prediction.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Candidate {
    pub(crate) split: String,
    /// Predicted epoch seconds; `None` when excluded.
    pub(crate) epoch_secs: Option<f64>,
    /// Seconds one request spends in each stage (the module's `Storage`, `Link`, `Compute`).
    pub(crate) storage_secs: f64,
    pub(crate) link_secs: f64,
    pub(crate) compute_secs: f64,
    pub(crate) bytes_per_sample: f64,
    /// Why the candidate was not considered.
    pub(crate) excluded: Option<String>,
}

/// The planner's answer.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Plan {
    /// The split to use, or [`NO_PUSHDOWN`].
    pub chosen: String,
    /// Samples per request `U` the stages were sized for.
    pub(crate) samples_per_request: usize,
    pub(crate) candidates: Vec<Candidate>,
}

impl Plan {
    /// The candidate for `split`, if it is one.
    #[cfg(test)]
    pub(crate) fn candidate(&self, split: &str) -> Option<&Candidate> {
        self.candidates.iter().find(|c| c.split == split)
    }
}

/// Why no plan could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum PlanError {
    #[error("invalid profile: {0}")]
    Invalid(String),
    #[error("no candidate split can be evaluated (profile every split, or the baseline)")]
    NothingToChoose,
}

/// Seconds one request of `unit` samples spends in each stage, and the epoch they pipeline into.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Stages {
    storage: f64,
    link: f64,
    compute: f64,
}

impl Stages {
    /// `requests` requests through the pipeline: every stage once, then the slowest per request.
    fn epoch_secs(self, requests: f64) -> f64 {
        let slowest = self.storage.max(self.link).max(self.compute);
        self.storage + self.link + self.compute + (requests - 1.0).max(0.0) * slowest
    }
}

/// Evaluates every candidate and picks the fastest, or no pushdown when the fastest split is
/// predicted less than [`PUSHDOWN_MARGIN`] faster than it.
///
/// # Errors
/// A profile with non-positive batch size, samples, samples per request or bandwidth, or nothing
/// to evaluate.
pub(crate) fn plan(storage: &StorageProfile, client: &ClientProfile) -> Result<Plan, PlanError> {
    let unit = client.samples_per_request.unwrap_or(client.batch_size);
    if client.batch_size == 0 || client.samples == 0 || unit == 0 {
        return Err(PlanError::Invalid("batch_size, samples and samples_per_request must be positive".into()));
    }
    // An epoch smaller than a request is one request of the epoch's samples.
    let unit = unit.min(client.samples);
    if client.bandwidth_bytes_per_sec.is_nan() || client.bandwidth_bytes_per_sec <= 0.0 {
        return Err(PlanError::Invalid("bandwidth_bytes_per_sec must be positive".into()));
    }
    let u = unit as f64;
    let requests = client.samples as f64 / u;
    let batches_per_request = u / client.batch_size as f64;
    let bw = client.bandwidth_bytes_per_sec;
    let decode = client.decode_secs_per_byte.unwrap_or(DEFAULT_DECODE_SECS_PER_BYTE);
    let parallel = storage.parallelism.max(1.0);
    let load = storage.load_factor.max(1.0);
    let over_memory = |split: &str| match (client.memory_bytes.get(split), client.memory_limit) {
        (Some(&m), Some(limit)) if m > limit => Some(format!("needs {m} bytes on the compute tier, over {limit}")),
        _ => None,
    };
    let mut candidates = Vec::new();
    let baseline = (NO_PUSHDOWN, client.raw_bytes_per_sample, None);
    let splits = storage.splits.iter().map(|s| (s.split.as_str(), s.bytes_per_sample, Some(s.secs_per_sample)));
    for (split, bytes, storage_secs) in std::iter::once(baseline).chain(splits) {
        let compute = client.compute_secs_per_sample.get(split);
        // The baseline's raw objects are decoded by its `compute(none)`, not deserialised.
        let deserialise = if storage_secs.is_some() { bytes * decode } else { 0.0 };
        let stages = Stages {
            storage: u * storage_secs.unwrap_or(0.0) * load / parallel,
            link: u * bytes / bw,
            compute: u * (compute.copied().unwrap_or(0.0) + deserialise)
                + batches_per_request * client.train_secs_per_batch,
        };
        let excluded = match compute {
            None => Some("not profiled on the compute tier".to_owned()),
            Some(_) => over_memory(split),
        };
        candidates.push(Candidate {
            split: split.to_owned(),
            epoch_secs: excluded.is_none().then(|| stages.epoch_secs(requests)),
            storage_secs: stages.storage,
            link_secs: stages.link,
            compute_secs: stages.compute,
            bytes_per_sample: bytes,
            excluded,
        });
    }
    let (best_secs, best) = candidates
        .iter()
        .filter_map(|c| c.epoch_secs.map(|t| (t, &c.split)))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .ok_or(PlanError::NothingToChoose)?;
    let baseline = candidates.iter().find(|c| c.split == NO_PUSHDOWN).and_then(|c| c.epoch_secs);
    let chosen = match baseline {
        Some(none) if best_secs > (1.0 - PUSHDOWN_MARGIN) * none => NO_PUSHDOWN.to_owned(),
        _ => best.clone(),
    };
    Ok(Plan { chosen, samples_per_request: unit, candidates })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ResNet-like model: early splits are big, late ones small; the storage node is slower
    /// per sample at deeper splits.
    fn storage(secs_scale: f64) -> StorageProfile {
        storage_of(&[
            ("stem", 0.002 * secs_scale, 800_000.0),
            ("layer2", 0.005 * secs_scale, 400_000.0),
            ("layer4", 0.010 * secs_scale, 100_000.0),
            ("pool", 0.011 * secs_scale, 2_048.0),
        ])
    }

    /// An idle storage node with one inference thread and these (split, seconds per sample,
    /// bytes per sample).
    fn storage_of(splits: &[(&str, f64, f64)]) -> StorageProfile {
        StorageProfile {
            splits: splits
                .iter()
                .map(|&(s, secs, bytes)| StorageSplit {
                    split: s.into(),
                    secs_per_sample: secs,
                    bytes_per_sample: bytes,
                    shape: Vec::new(),
                    text_length: None,
                })
                .collect(),
            parallelism: 1.0,
            load_factor: 1.0,
        }
    }

    fn client(bandwidth: f64) -> ClientProfile {
        // The compute tier is fast (a GPU): finishing from any split costs little; the baseline
        // pays decoding.
        let compute = [("none", 0.004), ("stem", 0.0008), ("layer2", 0.0005), ("layer4", 0.0001), ("pool", 0.0)];
        ClientProfile {
            batch_size: 64,
            samples: 6400,
            samples_per_request: None,
            bandwidth_bytes_per_sec: bandwidth,
            train_secs_per_batch: 0.01,
            compute_secs_per_sample: compute.iter().map(|&(s, t)| (s.to_owned(), t)).collect(),
            raw_bytes_per_sample: 110_000.0,
            decode_secs_per_byte: None,
            memory_bytes: BTreeMap::new(),
            memory_limit: None,
            tokens_per_sample: None,
        }
    }

    #[test]
    fn slow_network_picks_the_deepest_small_split() {
        let p = plan(&storage(1.0), &client(1.25e6)).expect("plan"); // 10 Mbit/s
        assert_eq!(p.chosen, "pool");
        assert_eq!(p.candidates.len(), 5);
    }

    #[test]
    fn fast_network_and_slow_storage_pick_no_pushdown() {
        let p = plan(&storage(20.0), &client(1.25e9)).expect("plan"); // 10 Gbit/s, storage 20x slower
        assert_eq!(p.chosen, NO_PUSHDOWN);
        let t = |s: &str| p.candidate(s).and_then(|c| c.epoch_secs).expect("evaluated");
        assert!(t("none") < t("pool"));
    }

    #[test]
    fn a_split_must_beat_no_pushdown_by_the_margin() {
        // Find a bandwidth where the best split is predicted only slightly faster than `none`.
        let (st, mut c) = (storage(1.0), client(1.0));
        let t = |p: &Plan, s: &str| p.candidate(s).and_then(|x| x.epoch_secs).unwrap();
        let close = (1..400).map(|i| 1e6 * 1.05f64.powi(i)).find_map(|bw| {
            c.bandwidth_bytes_per_sec = bw;
            let p = plan(&st, &c).expect("plan");
            let best = p.candidates.iter().filter_map(|x| x.epoch_secs).fold(f64::INFINITY, f64::min);
            let gain = 1.0 - best / t(&p, NO_PUSHDOWN);
            (gain > 0.0 && gain < PUSHDOWN_MARGIN).then_some(p)
        });
        let p = close.expect("some bandwidth gives a small predicted gain");
        assert_eq!(p.chosen, NO_PUSHDOWN, "a gain under the margin is not worth the storage CPU");
        // A clear gain (slow network) still pushes down.
        assert_ne!(plan(&st, &client(1.25e6)).expect("plan").chosen, NO_PUSHDOWN);
    }

    #[test]
    fn the_formula_and_the_exclusions() {
        let mut c = client(1e8);
        c.compute_secs_per_sample.remove("stem");
        c.memory_bytes.insert("layer2".into(), 20_000_000_000);
        c.memory_limit = Some(16_000_000_000);
        let p = plan(&storage(1.0), &c).expect("plan");
        let get = |s: &str| p.candidate(s).expect("candidate").clone();
        assert!(get("stem").excluded.as_deref().is_some_and(|e| e.contains("not profiled")));
        assert!(get("layer2").excluded.as_deref().is_some_and(|e| e.contains("compute tier")));
        // layer4 by hand: U = B = 64 (the default), R = 100 requests.
        let l4 = get("layer4");
        let (storage_secs, link): (f64, f64) = (64.0 * 0.010, 64.0 * 100_000.0 / 1e8);
        let compute = 64.0 * (0.0001 + 100_000.0 * DEFAULT_DECODE_SECS_PER_BYTE) + 0.01;
        assert_eq!(p.samples_per_request, 64);
        assert!((l4.storage_secs - storage_secs).abs() < 1e-12 && (l4.link_secs - link).abs() < 1e-12);
        assert!((l4.compute_secs - compute).abs() < 1e-12);
        let want = storage_secs + link + compute + 99.0 * storage_secs.max(link).max(compute);
        assert!((l4.epoch_secs.expect("evaluated") - want).abs() < 1e-9);
        // The baseline's raw bytes are decoded by its compute term, never deserialised on top.
        let none = get("none");
        assert!((none.compute_secs - (64.0 * 0.004 + 0.01)).abs() < 1e-12 && none.storage_secs == 0.0);
        for bad in [
            ClientProfile { bandwidth_bytes_per_sec: 0.0, ..client(1.0) },
            ClientProfile { samples_per_request: Some(0), ..client(1.0) },
        ] {
            assert!(matches!(plan(&storage(1.0), &bad), Err(PlanError::Invalid(_))));
        }
    }

    #[test]
    fn a_bigger_request_pays_more_to_fill_the_pipeline() {
        // Per epoch the slowest stage costs the same (D samples at its pace); what grows with the
        // request is the other two stages' share, paid once while the pipeline fills and drains.
        let epoch = |unit| {
            let c = ClientProfile { samples_per_request: Some(unit), ..client(1e7) };
            let p = plan(&storage(1.0), &c).expect("plan");
            p.candidate("layer4").and_then(|x| x.epoch_secs).expect("evaluated")
        };
        assert!(epoch(64) < epoch(256) && epoch(256) < epoch(1024));
        // An epoch of 6400 samples in requests of more is one request of 6400.
        assert_eq!(epoch(6400), epoch(100_000));
        // Train time is charged per batch, however many batches a request holds.
        let c = ClientProfile { samples_per_request: Some(256), train_secs_per_batch: 1.0, ..client(1e7) };
        let p = plan(&storage(1.0), &c).expect("plan");
        let none = p.candidate(NO_PUSHDOWN).expect("baseline");
        assert!((none.compute_secs - (256.0 * 0.004 + 4.0)).abs() < 1e-12);
    }

    /// Two configurations of the reproduction (`bench/results/repro-full-f16-splits-5be1157.jsonl`,
    /// 4 shards of 64 samples, batch 64) whose recorded inputs led the sequential per-batch model
    /// to a choice 11% and 26% slower than the best measured first epoch: ResNet-18 at 25 Mbit/s
    /// (measured `layer3` 11.5 s, `layer4` 11.7, `none` 12.8) and ResNet-50-thin at 250 Mbit/s
    /// (`stage2` 5.3 s, `pool` 6.6, `none` 7.7). The storage node works on the next shard while
    /// this one crosses the link, which the pipelined model counts.
    #[test]
    fn the_reproductions_recorded_misses_of_the_sequential_model() {
        let profile = |bw: f64, raw: f64, decode: f64, compute: &[(&str, f64)]| ClientProfile {
            batch_size: 64,
            samples: 256,
            samples_per_request: Some(64),
            bandwidth_bytes_per_sec: bw,
            train_secs_per_batch: 0.0,
            compute_secs_per_sample: compute.iter().map(|&(s, t)| (s.to_owned(), t)).collect(),
            raw_bytes_per_sample: raw,
            decode_secs_per_byte: Some(decode),
            memory_bytes: BTreeMap::new(),
            memory_limit: None,
            tokens_per_sample: None,
        };
        let resnet18 = plan(
            &storage_of(&[
                ("layer2", 0.014498, 200_704.0),
                ("layer3", 0.020144, 100_352.0),
                ("layer4", 0.031753, 50_176.0),
            ]),
            &profile(
                2_793_271.0,
                103_143.0,
                1.4331e-8,
                &[("none", 0.041419), ("layer2", 0.015145), ("layer3", 0.009053), ("layer4", 0.0)],
            ),
        )
        .expect("plan");
        assert!(["layer3", "layer4"].contains(&resnet18.chosen.as_str()), "{resnet18:?}");
        let resnet50 = plan(
            &storage_of(&[
                ("stem", 0.005844, 401_408.0),
                ("stage0", 0.010032, 802_816.0),
                ("stage1", 0.012990, 401_408.0),
                ("stage2", 0.016592, 200_704.0),
                ("stage3", 0.025511, 100_352.0),
                ("pool", 0.021736, 2_048.0),
            ]),
            &profile(
                30_483_368.0,
                105_560.0,
                3.4544e-9,
                &[
                    ("none", 0.030471),
                    ("stem", 0.025084),
                    ("stage0", 0.017136),
                    ("stage1", 0.012454),
                    ("stage2", 0.004513),
                    ("stage3", 0.000032),
                    ("pool", 0.0),
                ],
            ),
        )
        .expect("plan");
        assert_eq!(resnet50.chosen, "stage2", "{resnet50:?}");
    }
}
