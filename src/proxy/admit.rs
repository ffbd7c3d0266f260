//! The admit phase: whether the gateway takes a request at all, decided before any work is done
//! for it. Draining refuses everything (`503 ServiceUnavailable`); beyond `max_in_flight` requests
//! the next one is shed (`503 SlowDown` with `Retry-After`). The permit of an admitted request
//! rides its response body, so a streaming download counts until its last byte is sent or the
//! client goes away.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::GatewayError;
use crate::metrics::Metrics;

/// Admission state shared by all requests.
#[derive(Debug)]
pub(crate) struct Admission {
    permits: Arc<Semaphore>,
    draining: AtomicBool,
}

/// An admitted request's place; dropping it admits another.
#[derive(Debug)]
pub(crate) struct Admitted(#[allow(dead_code, reason = "held for its drop")] OwnedSemaphorePermit);

impl Admission {
    #[must_use]
    pub(crate) fn new(max_in_flight: usize) -> Self {
        Self { permits: Arc::new(Semaphore::new(max_in_flight)), draining: AtomicBool::new(false) }
    }

    /// From now on every request is refused.
    pub(crate) fn begin_shutdown(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    #[must_use]
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Takes a place, or says why not.
    ///
    /// # Errors
    /// `ShuttingDown` while draining, `Overloaded` when `max_in_flight` requests hold places.
    pub(crate) fn admit(&self, metrics: &Metrics) -> Result<Admitted, GatewayError> {
        if self.is_draining() {
            return Err(GatewayError::ShuttingDown);
        }
        match self.permits.clone().try_acquire_owned() {
            Ok(p) => Ok(Admitted(p)),
            Err(_) => {
                metrics.load_shed.inc();
                Err(GatewayError::Overloaded)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_returned_on_drop_and_draining_refuses() {
        let (a, m) = (Admission::new(2), Metrics::new());
        let one = a.admit(&m).expect("first");
        let _two = a.admit(&m).expect("second");
        assert!(matches!(a.admit(&m), Err(GatewayError::Overloaded)));
        assert_eq!(m.load_shed.get(), 1);
        drop(one);
        let _three = a.admit(&m).expect("a place was freed");
        a.begin_shutdown();
        assert!(matches!(a.admit(&m), Err(GatewayError::ShuttingDown)));
    }
}
