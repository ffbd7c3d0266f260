//! Retry policy for idempotent, body-less backend requests: capped exponential backoff with full
//! jitter (<https://aws.amazon.com/blogs/architecture/exponential-backoff-and-jitter/>), bounded by
//! an attempt count and a total time budget.

use std::time::{Duration, Instant};

use rand::Rng;

/// Retry settings.
#[derive(Debug, Clone)]
pub(crate) struct RetryPolicy {
    /// Attempts after the first one.
    pub(crate) max_retries: u32,
    /// First backoff; doubles each retry.
    pub(crate) base: Duration,
    /// Largest single backoff.
    pub(crate) cap: Duration,
    /// No retry starts after this much time since the first attempt. Keeps a client waiting at most
    /// about this long on a dead backend before it gets its `503`.
    pub(crate) budget: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_retries: 3,
            base: Duration::from_millis(50),
            cap: Duration::from_secs(2),
            budget: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// The backoff before retry number `retry` (1-based), or `None` when retries are exhausted.
    #[must_use]
    pub(crate) fn backoff(&self, retry: u32, started: Instant) -> Option<Duration> {
        if retry > self.max_retries {
            return None;
        }
        let exp = self.base.saturating_mul(1u32 << retry.min(16)).min(self.cap);
        let wait = Duration::from_secs_f64(rand::rng().random_range(0.0..=exp.as_secs_f64()));
        (started.elapsed() + wait < self.budget).then_some(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_by_count_and_budget() {
        let p = RetryPolicy::default();
        let now = Instant::now();
        for r in 1..=3 {
            assert!(p.backoff(r, now).expect("within limits") <= p.cap);
        }
        assert!(p.backoff(4, now).is_none());
        let tight = RetryPolicy { budget: Duration::ZERO, ..RetryPolicy::default() };
        assert!(tight.backoff(1, now).is_none());
    }
}
