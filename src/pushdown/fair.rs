//! Slots for the storage node's CPU work, handed out fairly: tenants take turns (round robin by
//! access key), and a tenant's samples are served by [`Place`]: the order its requests arrived,
//! each request's in its own order. Two pools use them: image preprocessing
//! (`pushdown.preprocess_threads`) and inference runs across all engines
//! (`pushdown.inference_runs`).
//!
//! Without a bound, every admitted sample of every request decodes at once on the blocking pool,
//! and on a node with few cores they all finish together: a client's first shard is ready no
//! sooner than its last, and the network idles until then. With one slot per core, a client's
//! shards finish one after the other, so shard i crosses the network while shard i+1 computes
//! (HAPI's cross-iteration overlap, on the storage side), and one tenant's backlog cannot delay
//! another's samples by more than a turn.
//!
//! Within a tenant the order is the requests' arrival, not the order their samples asked: a
//! client that asks for shards 0-3 at once reads them in that order, but their sources come back
//! from the store in any order, and a shard whose source came back first would be computed first
//! while the client waits for shard 0 (and then for the others all at once).
//!
//! The same holds across engines: each (model, split) has its own inference threads, so a
//! client's shard 0 at one split and shards 1-3 at another (the Python loader's first shard, sent
//! before its plan) would share the cores and shard 0 would finish late. Inference runs take a
//! slot of their own pool, by their batch's earliest place, so the oldest request runs first
//! whichever engine serves it.

use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::queue::Place;

/// The slot pool.
#[derive(Debug)]
pub struct FairSlots {
    inner: Mutex<Inner>,
}

/// Where a waiter stands in its tenant's queue: its [`Place`], then the order it asked in (which
/// keeps keys unique).
type Key = (u64, u64, u64);

#[derive(Debug)]
struct Inner {
    free: usize,
    /// Waiters by tenant, each queue by place; a tenant with no waiters has no entry.
    waiting: BTreeMap<String, BTreeMap<Key, oneshot::Sender<Slot>>>,
    /// Waiters queued so far (the last part of a key).
    asked: u64,
    /// The tenant served last: the next turn goes to the one after it.
    last: Option<String>,
}

/// A held slot; dropping it hands the slot to the next waiter.
#[derive(Debug)]
pub struct Slot {
    slots: Arc<FairSlots>,
    armed: bool,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.armed {
            self.armed = false;
            self.slots.release();
        }
    }
}

impl FairSlots {
    /// A pool of `slots` (at least one).
    #[must_use]
    pub fn new(slots: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner { free: slots.max(1), waiting: BTreeMap::new(), asked: 0, last: None }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for the sample at `place` of `tenant`. Cancel-safe: a waiter dropped
    /// before its turn leaves the queue when the turn comes, and a slot handed to a waiter that is
    /// gone passes on.
    pub async fn acquire(self: &Arc<Self>, tenant: &str, place: Place) -> Slot {
        loop {
            let rx = match self.take_or_queue(tenant, place) {
                Ok(slot) => return slot,
                Err(rx) => rx,
            };
            // A sender is only dropped after sending, so this does not fail; if it did, ask again.
            if let Ok(slot) = rx.await {
                return slot;
            }
        }
    }

    /// [`Self::acquire`] for a thread outside the async runtime (an inference worker): parks
    /// the thread until its turn.
    pub fn acquire_blocking(self: &Arc<Self>, tenant: &str, place: Place) -> Slot {
        loop {
            let rx = match self.take_or_queue(tenant, place) {
                Ok(slot) => return slot,
                Err(rx) => rx,
            };
            if let Ok(slot) = rx.blocking_recv() {
                return slot;
            }
        }
    }

    /// A free slot, or a place in `tenant`'s queue at `place` and the receiver its turn comes on.
    fn take_or_queue(
        self: &Arc<Self>,
        tenant: &str,
        (arrival, sample): Place,
    ) -> Result<Slot, oneshot::Receiver<Slot>> {
        let mut g = self.lock();
        if g.free > 0 {
            g.free -= 1;
            return Ok(Slot { slots: self.clone(), armed: true });
        }
        let (tx, rx) = oneshot::channel();
        g.asked += 1;
        let key = (arrival, sample, g.asked);
        g.waiting.entry(tenant.to_owned()).or_default().insert(key, tx);
        Err(rx)
    }

    /// Slots free now.
    #[must_use]
    pub fn free(&self) -> usize {
        self.lock().free
    }

    /// Passes a released slot to the next tenant's oldest waiter, or returns it to the pool.
    fn release(self: &Arc<Self>) {
        let mut g = self.lock();
        let mut slot = Slot { slots: self.clone(), armed: true };
        loop {
            let after = g.last.clone();
            let next = after
                .as_ref()
                .and_then(|t| g.waiting.range::<String, _>((Bound::Excluded(t), Bound::Unbounded)).next())
                .or_else(|| g.waiting.iter().next())
                .map(|(t, _)| t.clone());
            let Some(tenant) = next else {
                slot.armed = false;
                g.free += 1;
                return;
            };
            let queue = g.waiting.get_mut(&tenant).expect("tenant has waiters");
            let (_, tx) = queue.pop_first().expect("queues are never empty");
            if queue.is_empty() {
                g.waiting.remove(&tenant);
            }
            g.last = Some(tenant);
            match tx.send(slot) {
                Ok(()) => return,
                Err(back) => slot = back, // that waiter is gone: next one
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the order in which queued waiters get the single slot; each asks as sample 0 of
    /// a request of its own, numbered in the order they ask.
    async fn order(slots: &Arc<FairSlots>, asks: &[(&str, u32)]) -> Vec<u32> {
        let places: Vec<_> = (0..).zip(asks).map(|(n, &(tenant, id))| (tenant, id, (n, 0))).collect();
        order_at(slots, &places).await
    }

    /// Records the order in which waiters, queued in the order given, get the single slot.
    async fn order_at(slots: &Arc<FairSlots>, asks: &[(&str, u32, Place)]) -> Vec<u32> {
        let first = slots.acquire("holder", (u64::MAX, 0)).await;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for &(tenant, id, place) in asks {
            let (slots, seen, tenant) = (slots.clone(), seen.clone(), tenant.to_owned());
            tasks.push(tokio::spawn(async move {
                let _slot = slots.acquire(&tenant, place).await;
                seen.lock().unwrap().push(id);
            }));
            tokio::task::yield_now().await; // queued in this order
        }
        drop(first);
        for t in tasks {
            t.await.unwrap();
        }
        Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
    }

    #[tokio::test]
    async fn one_tenant_is_served_in_arrival_order() {
        let slots = FairSlots::new(1);
        assert_eq!(order(&slots, &[("a", 1), ("a", 2), ("a", 3)]).await, vec![1, 2, 3]);
        assert_eq!(slots.free(), 1);
    }

    #[tokio::test]
    async fn a_tenants_requests_are_served_in_the_order_they_arrived() {
        let slots = FairSlots::new(1);
        // Request 1's samples asked first (its source came back first): request 0's still go
        // first, each request's in its own order, and the other tenant still takes turns.
        let asks = [("a", 11, (1, 0)), ("a", 12, (1, 1)), ("b", 20, (2, 0)), ("a", 1, (0, 0)), ("a", 2, (0, 1))];
        assert_eq!(order_at(&slots, &asks).await, vec![1, 20, 2, 11, 12]);
        assert_eq!(slots.free(), 1);
    }

    #[tokio::test]
    async fn tenants_take_turns() {
        let slots = FairSlots::new(1);
        // a queued three before b asked: b still gets the second turn.
        let got = order(&slots, &[("a", 1), ("a", 2), ("a", 3), ("b", 10), ("b", 11)]).await;
        assert_eq!(got, vec![1, 10, 2, 11, 3]);
        assert_eq!(slots.free(), 1);
    }

    #[tokio::test]
    async fn a_cancelled_waiter_does_not_keep_the_slot() {
        let slots = FairSlots::new(1);
        let held = slots.acquire("a", (0, 0)).await;
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("b", (1, 0)).await })
        };
        tokio::task::yield_now().await;
        waiter.abort();
        let _ = waiter.await;
        drop(held);
        assert_eq!(slots.free(), 1, "the slot went back to the pool");
        let _again = slots.acquire("c", (2, 0)).await;
        assert_eq!(slots.free(), 0);
    }

    /// Threads outside the runtime (inference workers) wait in the same order: a later request
    /// queued first still runs after an earlier one.
    #[test]
    fn blocking_waiters_are_served_by_place() {
        let slots = FairSlots::new(1);
        let held = slots.acquire_blocking("holder", (u64::MAX, 0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        // Queued latest request first; each waits before the next one queues.
        for (arrival, asked) in [(3u64, 0usize), (1, 1), (2, 2)] {
            let (slots2, seen) = (slots.clone(), seen.clone());
            threads.push(std::thread::spawn(move || {
                let _slot = slots2.acquire_blocking("a", (arrival, 0));
                seen.lock().unwrap().push(arrival);
            }));
            while slots.lock().waiting.get("a").map_or(0, BTreeMap::len) <= asked {
                std::thread::yield_now();
            }
        }
        drop(held);
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*seen.lock().unwrap(), vec![1, 2, 3]);
        assert_eq!(slots.free(), 1);
    }
}
