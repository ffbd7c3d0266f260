//! CPU time of the calling thread: what preprocessing and profiling cost, free of contention.

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
