//! Slots for the storage node's preprocessing CPU work, handed out fairly: tenants take turns
//! (round robin by access key), and a tenant's samples are served in the order they asked.
//!
//! Without a bound, every admitted sample of every request decodes at once on the blocking pool,
//! and on a node with few cores they all finish together: a client's first shard is ready no
//! sooner than its last, and the network idles until then. With one slot per core, a client's
//! shards finish one after the other, so shard i crosses the network while shard i+1 computes
//! (HAPI's cross-iteration overlap, on the storage side), and one tenant's backlog cannot delay
//! another's samples by more than a turn.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

/// The slot pool.
#[derive(Debug)]
pub struct FairSlots {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    free: usize,
    /// Waiters by tenant, each queue in arrival order; a tenant with no waiters has no entry.
    waiting: BTreeMap<String, VecDeque<oneshot::Sender<Slot>>>,
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
        Arc::new(Self { inner: Mutex::new(Inner { free: slots.max(1), waiting: BTreeMap::new(), last: None }) })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for `tenant`. Cancel-safe: a waiter dropped before its turn leaves the
    /// queue when the turn comes, and a slot handed to a waiter that is gone passes on.
    pub async fn acquire(self: &Arc<Self>, tenant: &str) -> Slot {
        loop {
            let rx = {
                let mut g = self.lock();
                if g.free > 0 {
                    g.free -= 1;
                    return Slot { slots: self.clone(), armed: true };
                }
                let (tx, rx) = oneshot::channel();
                g.waiting.entry(tenant.to_owned()).or_default().push_back(tx);
                rx
            };
            // A sender is only dropped after sending, so this does not fail; if it did, ask again.
            if let Ok(slot) = rx.await {
                return slot;
            }
        }
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
            let tx = queue.pop_front().expect("queues are never empty");
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

    /// Records the order in which queued waiters get the single slot.
    async fn order(slots: &Arc<FairSlots>, asks: &[(&str, u32)]) -> Vec<u32> {
        let first = slots.acquire("holder").await;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        for &(tenant, id) in asks {
            let (slots, seen, tenant) = (slots.clone(), seen.clone(), tenant.to_owned());
            tasks.push(tokio::spawn(async move {
                let _slot = slots.acquire(&tenant).await;
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
        let held = slots.acquire("a").await;
        let waiter = {
            let slots = slots.clone();
            tokio::spawn(async move { slots.acquire("b").await })
        };
        tokio::task::yield_now().await;
        waiter.abort();
        let _ = waiter.await;
        drop(held);
        assert_eq!(slots.free(), 1, "the slot went back to the pool");
        let _again = slots.acquire("c").await;
        assert_eq!(slots.free(), 0);
    }
}
