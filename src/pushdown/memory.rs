//! The memory model of a (model, split): fixed bytes (weights, session, run workspace) plus bytes
//! per sample, measured once when its engine starts, by probe runs at two batch sizes.
//!
//! How it is measured (Linux): sessions run with ONNX Runtime's CPU arena and memory patterns off
//! (or, with `pushdown.ort_arena = "per-run"`, give the arena back at the end of every run), so
//! every run allocates what it needs and frees it afterwards, and the process's resident peak
//! (`VmHWM`, reset through `/proc/self/clear_refs`) during a run is the run's true footprint.
//! 1. resident bytes before and after creating the session and one warm-up run: the session's
//!    fixed bytes (weights, pre-packed kernels);
//! 2. peak minus resident before the run, at batch [`PROBE_BATCHES`]`.0` and `.1`: the slope is
//!    the activation bytes per sample, the intercept the run's fixed workspace.
//!
//! With `pushdown.ort_arena = "kept"`, a session keeps what its runs allocated (ONNX Runtime's CPU
//! arena, memory patterns off), so a probe's peak says nothing about what stays. The first session
//! instead runs every batch size from 1 to `max_batch` once, ascending, and the model is fitted
//! over what each run left resident ([`MemoryModel::from_retention`]): an upper bound on the
//! arena at every batch size. Ascending matters: the arena grows only when a run does not fit in
//! what it holds, and runs in any order after the sweep left it where the sweep did (measured for
//! the bundled models in ADR 0011).
//!
//! Probes of different engines are serialized (the peak is process-wide); concurrent requests of
//! other engines can still add to a probe's peak, which only makes the model more conservative.
//! Host-side copies around the run (the queued sample, the batch buffer, the per-sample outputs
//! and the encoded response) and the prefix's ONNX bytes the engine keeps are added analytically
//! ([`MemoryModel`] says which is reserved when). The error of the model against measured peaks
//! is reported in `docs/BENCHMARKS.md`.

use serde::Serialize;

/// glibc tunables the binary runs with (`main.rs` restarts itself once to apply them, unless the
/// environment already sets a threshold: the operator's settings are then taken as they are).
/// - `mmap_threshold`: blocks of 128 KiB and more are mapped and unmapped, so freed inference
///   buffers leave the resident set at once. glibc's default raises this threshold after each
///   large free (up to 32 MiB) and keeps such blocks in its heaps; in a 64-client burst that held
///   250-300 MiB more than was in use. Its cost, 12-53% of pushdown throughput in page faults, and
///   why a larger threshold is not the fix: ADR 0009.
/// - `hugetlb=1`: mapped blocks of 2 MiB and more (a run's larger tensors) are advised
///   (`MADV_HUGEPAGE`) to be backed by transparent huge pages where the kernel's setting is
///   `madvise` or `always`, so they fault in 2 MiB at a time instead of 4 KiB: most of that
///   page-fault cost goes, and the measured memory model does not change (ADR 0012).
/// - `tcache_count=64`: each thread keeps up to 64 freed blocks per small size class (up to
///   1 KiB) instead of 7, so a request's few dozen small allocations are served from the thread's
///   cache rather than glibc's bins: about 4% of a proxied GET's instructions (ADR 0033). It
///   holds at most about 2 MiB per thread (64 blocks in each of 64 classes).
pub(crate) const MALLOC_TUNABLE: &str =
    "glibc.malloc.mmap_threshold=131072:glibc.malloc.hugetlb=1:glibc.malloc.tcache_count=64";

/// Batch sizes of the two probe runs.
pub(crate) const PROBE_BATCHES: (usize, usize) = (1, 8);

/// A (model, split)'s memory model, as the admin API reports it. Three kinds of bytes, reserved
/// by the governor at different times:
/// - per engine, for its lifetime: each worker's session and run workspace, plus activations for
///   its largest batch, plus the prefix's ONNX bytes once (`engine_bytes`);
/// - per sample in flight (admitted until its inference ends): the decoded input and its copy in
///   the batch buffer (`queued_bytes_per_sample`, plus the image's decode scratch);
/// - per request, from its start until its response is sent: every sample's output, its stacked
///   copy and the encoded response (`held_bytes_per_sample` x samples).
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub(crate) struct MemoryModel {
    /// Session (weights, pre-packed kernels) plus the run's batch-independent workspace.
    pub(crate) fixed_bytes: u64,
    /// Activation bytes per sample of a running batch (the probes' slope).
    pub(crate) activation_bytes_per_sample: u64,
    pub(crate) input_bytes_per_sample: u64,
    pub(crate) output_bytes_per_sample: u64,
    pub(crate) queued_bytes_per_sample: u64,
    pub(crate) held_bytes_per_sample: u64,
    /// Measured: session bytes and the two probe peaks above the pre-run resident size (with an
    /// arena: what stayed after the runs at batch 1 and at `max_batch`).
    pub(crate) session_bytes: u64,
    pub(crate) probe_peaks: [u64; 2],
    /// The cut prefix's ONNX bytes, which the engine keeps for its lifetime to build sessions
    /// (its workers', and replacements): once per engine, resident before any session exists,
    /// so no probe sees it.
    pub(crate) prefix_bytes: u64,
    /// One sample's output shape, as the first run gave it (what a Parquet output's outline is
    /// laid out from before any sample runs).
    pub(crate) output_shape: Vec<usize>,
    /// False when `/proc` could not be read: the model is then a conservative estimate.
    pub(crate) measured: bool,
    /// How it was measured: `peaks` (probe runs at two batch sizes, sessions without an arena),
    /// `retention` (a sweep over every batch size, sessions that keep an arena) or `estimate`.
    pub(crate) method: &'static str,
}

impl MemoryModel {
    /// Combines the probe measurements (all in bytes).
    #[must_use]
    pub(crate) fn from_probes(session_bytes: u64, peaks: [u64; 2], input: u64, output: u64) -> Self {
        let (b0, b1) = (PROBE_BATCHES.0 as u64, PROBE_BATCHES.1 as u64);
        let slope = peaks[1].saturating_sub(peaks[0]) / (b1 - b0);
        // A run holds at least its input and output per sample, whatever the allocator did.
        let activation = slope.max(input + output);
        let workspace = peaks[0].saturating_sub(activation * b0);
        Self::new(session_bytes + workspace, activation, input, output, (session_bytes, peaks, true), "peaks")
    }

    /// A model for sessions that keep their run buffers: `retained[b - 1]` is what the session
    /// held above its post-warm-up size after a run at batch `b` (runs ascending from 1). Fitted
    /// as an upper bound at every measured batch: the steepest growth from batch 1 is the slope
    /// (at least input + output per sample, as in [`Self::from_probes`]), so
    /// `fixed + slope * b >= session + retained[b - 1]` for every `b`.
    #[must_use]
    pub(crate) fn from_retention(session_bytes: u64, retained: &[u64], input: u64, output: u64) -> Self {
        let first = retained.first().copied().unwrap_or(0);
        let steepest = (2..=retained.len() as u64)
            .map(|b| retained[b as usize - 1].saturating_sub(first).div_ceil(b - 1))
            .max()
            .unwrap_or(0);
        let activation = steepest.max(input + output);
        let fixed = (session_bytes + first).saturating_sub(activation).max(session_bytes);
        let peaks = [first, retained.last().copied().unwrap_or(0)];
        Self::new(fixed, activation, input, output, (session_bytes, peaks, true), "retention")
    }

    /// Without `/proc`: weights twice over as fixed, and 16 x (input + output) per sample of a
    /// batch, a ceiling that held for every bundled model's measured activations.
    #[must_use]
    pub(crate) fn estimate(weights: u64, input: u64, output: u64) -> Self {
        Self::new(2 * weights, 16 * (input + output), input, output, (0, [0, 0], false), "estimate")
    }

    fn new(
        fixed: u64,
        activation: u64,
        input: u64,
        output: u64,
        probe: (u64, [u64; 2], bool),
        method: &'static str,
    ) -> Self {
        Self {
            fixed_bytes: fixed,
            activation_bytes_per_sample: activation,
            input_bytes_per_sample: input,
            output_bytes_per_sample: output,
            queued_bytes_per_sample: 2 * input,
            held_bytes_per_sample: 3 * output,
            session_bytes: probe.0,
            probe_peaks: probe.1,
            prefix_bytes: 0,
            output_shape: Vec::new(),
            measured: probe.2,
            method,
        }
    }

    /// The model of an engine that keeps a prefix of `bytes` ([`Self::prefix_bytes`]).
    #[must_use]
    pub(crate) fn with_prefix(mut self, bytes: u64) -> Self {
        self.prefix_bytes = bytes;
        self
    }

    /// The model of an engine whose samples' outputs have `shape` ([`Self::output_shape`]).
    #[must_use]
    pub(crate) fn with_output_shape(mut self, shape: &[usize]) -> Self {
        self.output_shape = shape.to_vec();
        self
    }

    /// What an engine of `workers` sessions running batches of up to `batch` holds.
    #[must_use]
    pub(crate) fn engine_bytes(&self, workers: usize, batch: usize) -> u64 {
        (workers as u64).saturating_mul(self.fixed_bytes + self.activation_bytes_per_sample * batch as u64)
            + self.prefix_bytes
    }
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Resident bytes of this process now.
#[must_use]
pub(crate) fn resident_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|k| k * 1024)
}

/// Peak resident bytes since start or since the last [`reset_peak`].
#[must_use]
pub(crate) fn peak_resident_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|k| k * 1024)
}

/// Resets the peak to the current resident size. `false` if the kernel refused.
#[must_use]
pub(crate) fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_and_intercept_from_two_probes() {
        // 1 MB session; peaks 3 MB at batch 1 and 10 MB at batch 8: 1 MB per sample, 2 MB workspace.
        let m = MemoryModel::from_probes(1_000_000, [3_000_000, 10_000_000], 100_000, 50_000);
        assert_eq!(m.activation_bytes_per_sample, 1_000_000);
        assert_eq!(m.fixed_bytes, 3_000_000);
        assert_eq!((m.queued_bytes_per_sample, m.held_bytes_per_sample), (200_000, 150_000));
        assert_eq!(m.engine_bytes(2, 16), 2 * (3_000_000 + 16 * 1_000_000));
        // The prefix the engine keeps counts once, whatever its workers and batches.
        let m = m.with_prefix(45_000_000);
        assert_eq!(m.engine_bytes(2, 16), 2 * (3_000_000 + 16 * 1_000_000) + 45_000_000);
        assert_eq!(m.engine_bytes(1, 1), 3_000_000 + 1_000_000 + 45_000_000);
        // A noisy probe (peak 2 below peak 1) never yields less than input + output.
        let m = MemoryModel::from_probes(0, [5_000_000, 4_000_000], 100_000, 50_000);
        assert_eq!(m.activation_bytes_per_sample, 150_000);
    }

    #[test]
    fn retention_model_bounds_every_measured_batch() {
        // A step-shaped arena: nothing more up to batch 3, then a jump, then flat (region growth).
        let retained = [0, 0, 0, 9_000_000, 9_000_000, 9_000_000, 9_500_000, 9_500_000];
        let m = MemoryModel::from_retention(5_000_000, &retained, 100_000, 50_000);
        for (i, r) in retained.iter().enumerate() {
            let b = i as u64 + 1;
            assert!(m.fixed_bytes + m.activation_bytes_per_sample * b >= 5_000_000 + r, "batch {b}");
        }
        // The steepest growth is at batch 4: 9 MB over 3 samples.
        assert_eq!(m.activation_bytes_per_sample, 3_000_000);
        assert_eq!((m.method, m.probe_peaks), ("retention", [0, 9_500_000]));
        // Flat retention still reserves input + output per sample, and never less than the session.
        let m = MemoryModel::from_retention(1_000, &[4_000, 4_000], 100_000, 50_000);
        assert_eq!((m.activation_bytes_per_sample, m.fixed_bytes), (150_000, 1_000));
    }

    #[test]
    fn peak_tracks_an_allocation_and_resets() {
        let (Some(_), true) = (peak_resident_bytes(), reset_peak()) else {
            return; // not Linux, or /proc is read-only: nothing to measure (MemoryModel::estimate)
        };
        let before = peak_resident_bytes().expect("peak");
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        let during = peak_resident_bytes().expect("peak");
        drop(buf);
        assert!(during >= before + (60 << 20), "{before} -> {during}");
        assert!(reset_peak());
        assert!(peak_resident_bytes().expect("peak") < during);
    }
}
