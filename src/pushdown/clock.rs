//! CPU time of the calling thread: what preprocessing and profiling cost, free of contention.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// This thread's CPU time in nanoseconds (Linux `/proc/thread-self/schedstat`); `None` elsewhere.
fn thread_cpu_nanos() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat").ok()?.split_whitespace().next()?.parse().ok()
}

/// Runs `f` and returns its result with the CPU time this thread spent on it: the cost free of
/// contention from other work on the core (wall time where there is no per-thread CPU clock).
pub(crate) fn cpu_timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let (started, cpu) = (Instant::now(), thread_cpu_nanos());
    let out = f();
    let spent = match (cpu, thread_cpu_nanos()) {
        (Some(a), Some(b)) => Duration::from_nanos(b.saturating_sub(a)),
        _ => started.elapsed(),
    };
    (out, spent)
}

/// CPU time spent on samples, and how many: a measured cost per sample (an engine's inference,
/// a node's image preprocessing), read by the split planner.
#[derive(Debug, Default)]
pub(crate) struct CpuTally {
    nanos: AtomicU64,
    samples: AtomicU64,
}

impl CpuTally {
    /// Counts `samples` that took `spent` of CPU time together.
    pub(crate) fn add(&self, spent: Duration, samples: u64) {
        self.nanos.fetch_add(u64::try_from(spent.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.samples.fetch_add(samples, Ordering::Relaxed);
    }

    /// Mean CPU seconds per sample, once at least `min_samples` were counted.
    pub(crate) fn secs_per_sample(&self, min_samples: u64) -> Option<f64> {
        let n = self.samples.load(Ordering::Relaxed);
        (n >= min_samples.max(1)).then(|| self.nanos.load(Ordering::Relaxed) as f64 / 1e9 / n as f64)
    }
}
