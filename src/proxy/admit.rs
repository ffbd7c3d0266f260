//! The admit phase: whether the gateway takes a request at all, decided before any work is done
//! for it. Draining refuses everything (`503 ServiceUnavailable`); beyond `max_in_flight` requests
//! the next one is shed (`503 SlowDown` with `Retry-After`). The permit of an admitted request
//! rides its response body, so a streaming download counts until its last byte is sent or the
//! client goes away.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::error::GatewayError;
use crate::metrics::Metrics;

/// Admission state shared by all requests.
#[derive(Debug)]
pub(crate) struct Admission {
    in_flight: Arc<AtomicUsize>,
    /// `max_in_flight`, changed by a configuration reload (`crate::reload`): requests already
    /// admitted keep their places; new ones are admitted while fewer than this hold places.
    limit: AtomicUsize,
    draining: AtomicBool,
    /// Handing over to a new process (`crate::upgrade`): requests are still served, each answer
    /// closing its connection, so clients reconnect to the new process.
    closing: AtomicBool,
}

/// An admitted request's place; dropping it admits another.
#[derive(Debug)]
pub(crate) struct Admitted(Arc<AtomicUsize>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    #[must_use]
    pub(crate) fn new(max_in_flight: usize) -> Self {
        Self {
            in_flight: Arc::default(),
            limit: AtomicUsize::new(max_in_flight),
            draining: AtomicBool::new(false),
            closing: AtomicBool::new(false),
        }
    }

    /// From now on every request is refused.
    pub(crate) fn begin_shutdown(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    #[must_use]
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// From now on every answer closes its connection (a new process serves the sockets).
    pub(crate) fn begin_handover(&self) {
        self.closing.store(true, Ordering::SeqCst);
    }

    #[must_use]
    pub(crate) fn is_closing(&self) -> bool {
        self.closing.load(Ordering::SeqCst)
    }

    /// A new `max_in_flight`.
    pub(crate) fn set_limit(&self, max_in_flight: usize) {
        self.limit.store(max_in_flight, Ordering::Release);
    }

    /// Takes a place, or says why not.
    ///
    /// # Errors
    /// `ShuttingDown` while draining, `Overloaded` when `max_in_flight` requests hold places.
    pub(crate) fn admit(&self, metrics: &Metrics) -> Result<Admitted, GatewayError> {
        if self.is_draining() {
            return Err(GatewayError::ShuttingDown);
        }
        let place = Admitted(self.in_flight.clone());
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= self.limit.load(Ordering::Acquire) {
            drop(place);
            metrics.load_shed.inc();
            return Err(GatewayError::Overloaded);
        }
        Ok(place)
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

    #[test]
    fn a_new_limit_applies_to_the_next_request() {
        let (a, m) = (Admission::new(1), Metrics::new());
        let one = a.admit(&m).expect("first");
        assert!(matches!(a.admit(&m), Err(GatewayError::Overloaded)));
        a.set_limit(3);
        let (_two, _three) = (a.admit(&m).expect("second"), a.admit(&m).expect("third"));
        a.set_limit(1);
        drop(one);
        // Three were admitted under the old limit; under the new one, none more until one is left.
        assert!(matches!(a.admit(&m), Err(GatewayError::Overloaded)));
    }
}
