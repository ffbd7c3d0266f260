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
//!
//! A pool may *lend* ([`FairSlots::lending`]): a sample that finds every slot held, some by later
//! places of its own tenant, takes one beyond the pool instead of waiting for them, and slots
//! given back on other tenants' turns repay the loan (tenants keep taking turns). The engines' places ahead of inference lend (ADR 0021): a
//! client's shard 0 whose source came back a few milliseconds after shard 1's would otherwise
//! wait until shard 1's decoded samples had run. Only a tenant's own later samples make it lend,
//! so no tenant gains over another, and the loans are bounded.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::queue::Place;

/// The slot pool.
#[derive(Debug)]
pub(crate) struct FairSlots {
    inner: Mutex<Inner>,
    /// Most slots out on loan at once (0: the pool never lends).
    lend: usize,
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
    /// Where the held slots stand, per tenant (a count per place), in a pool that lends.
    held: HashMap<String, BTreeMap<Place, usize>>,
    /// Slots out on loan: the next ones given back repay them instead of passing on.
    lent: usize,
}

impl Inner {
    fn hold(&mut self, at: Option<&(String, Place)>) {
        if let Some((tenant, place)) = at {
            *self.held.entry(tenant.clone()).or_default().entry(*place).or_default() += 1;
        }
    }

    fn unhold(&mut self, at: Option<&(String, Place)>) {
        let Some((tenant, place)) = at else { return };
        let Some(places) = self.held.get_mut(tenant) else { return };
        if let Some(n) = places.get_mut(place) {
            *n -= 1;
            if *n == 0 {
                places.remove(place);
            }
        }
        if places.is_empty() {
            self.held.remove(tenant);
        }
    }

    /// The tenant whose turn is next: the first after the one served last that has waiters.
    fn next_turn(&self) -> Option<String> {
        let after = self.last.as_ref().map(|t| self.waiting.range::<String, _>((Bound::Excluded(t), Bound::Unbounded)));
        after.into_iter().flatten().chain(&self.waiting).next().map(|(tenant, _)| tenant.clone())
    }

    /// Whether `tenant`'s oldest waiter could borrow: its tenant holds slots at later places.
    fn could_borrow(&self, tenant: &str) -> bool {
        let head = self.waiting.get(tenant).and_then(|q| q.first_key_value()).map(|((a, s, _), _)| (*a, *s));
        head.is_some_and(|place| self.holds_later(tenant, place))
    }

    /// Whether `tenant` holds a slot at a place after `place`.
    fn holds_later(&self, tenant: &str, place: Place) -> bool {
        self.held.get(tenant).is_some_and(|p| p.range((Bound::Excluded(place), Bound::Unbounded)).next().is_some())
    }
}

/// A held slot; dropping it hands the slot to the next waiter.
#[derive(Debug)]
pub(crate) struct Slot {
    slots: Arc<FairSlots>,
    armed: bool,
    /// Whose and where, in a pool that lends.
    at: Option<(String, Place)>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.armed {
            self.armed = false;
            self.slots.release(self.at.take().as_ref());
        }
    }
}

impl FairSlots {
    /// A pool of `slots` (at least one).
    #[must_use]
    pub(crate) fn new(slots: usize) -> Arc<Self> {
        Self::lending(slots, 0)
    }

    /// A pool of `slots` (at least one) that lends up to `lend` more to a tenant's samples that
    /// find its later samples holding slots (module docs).
    #[must_use]
    pub(crate) fn lending(slots: usize, lend: usize) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner {
                free: slots.max(1),
                waiting: BTreeMap::new(),
                asked: 0,
                last: None,
                held: HashMap::new(),
                lent: 0,
            }),
            lend,
        })
    }

    /// A slot handed out now to `tenant` at `place`, held on the books of a pool that lends.
    fn slot(self: &Arc<Self>, g: &mut Inner, tenant: &str, place: Place) -> Slot {
        let at = (self.lend > 0).then(|| (tenant.to_owned(), place));
        g.hold(at.as_ref());
        Slot { slots: self.clone(), armed: true, at }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for a slot for the sample at `place` of `tenant`. Cancel-safe: a waiter dropped
    /// before its turn leaves the queue when the turn comes, and a slot handed to a waiter that is
    /// gone passes on.
    pub(crate) async fn acquire(self: &Arc<Self>, tenant: &str, place: Place) -> Slot {
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
    pub(crate) fn acquire_blocking(self: &Arc<Self>, tenant: &str, place: Place) -> Slot {
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
            return Ok(self.slot(&mut g, tenant, (arrival, sample)));
        }
        if g.lent < self.lend && g.holds_later(tenant, (arrival, sample)) {
            g.lent += 1;
            return Ok(self.slot(&mut g, tenant, (arrival, sample)));
        }
        let (tx, rx) = oneshot::channel();
        g.asked += 1;
        let key = (arrival, sample, g.asked);
        let queue = g.waiting.entry(tenant.to_owned()).or_default();
        // Waiters dropped before their turn (a client gone) leave now, not when the turn comes:
        // a queue holds only live waiters, which the engine's queue bound counts.
        queue.retain(|_, tx| !tx.is_closed());
        queue.insert(key, tx);
        Err(rx)
    }

    /// Slots free now.
    #[must_use]
    #[cfg(test)]
    pub(crate) fn free(&self) -> usize {
        self.lock().free
    }

    /// Passes a released slot to the next tenant's oldest waiter, or returns it to the pool. In a
    /// pool with slots on loan, when the tenant whose turn it is could not borrow (its later
    /// samples hold no places) the slot repays a loan instead and that tenant keeps its turn: the
    /// turns stay round robin, so a tenant waits for at most the loans out (bounded by the pool's
    /// `lend`) beyond its turn, however many samples another tenant has that could borrow.
    fn release(self: &Arc<Self>, at: Option<&(String, Place)>) {
        let mut g = self.lock();
        g.unhold(at);
        let mut slot = Slot { slots: self.clone(), armed: true, at: None };
        loop {
            let turn = g.next_turn();
            let repay = g.lent > 0 && turn.as_deref().is_none_or(|t| !g.could_borrow(t));
            let Some(tenant) = turn.filter(|_| !repay) else {
                slot.armed = false;
                if repay {
                    g.lent -= 1;
                } else {
                    g.free += 1;
                }
                return;
            };
            let queue = g.waiting.get_mut(&tenant).expect("tenant has waiters");
            let ((arrival, sample, _), tx) = queue.pop_first().expect("queues are never empty");
            if queue.is_empty() {
                g.waiting.remove(&tenant);
            }
            slot.at = (self.lend > 0).then(|| (tenant.clone(), (arrival, sample)));
            g.hold(slot.at.as_ref());
            g.last = Some(tenant);
            match tx.send(slot) {
                Ok(()) => return,
                Err(back) => {
                    // That waiter is gone: next one.
                    slot = back;
                    g.unhold(slot.at.as_ref());
                }
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

    #[tokio::test]
    async fn a_lending_pool_lends_only_against_the_tenants_own_later_samples() {
        let slots = FairSlots::lending(2, 1);
        let later = [slots.acquire("a", (5, 0)).await, slots.acquire("a", (5, 1)).await];
        // Tenant b, and a's even later samples, wait as in any pool.
        for (tenant, place) in [("b", (1, 0)), ("a", (6, 0))] {
            assert!(slots.take_or_queue(tenant, place).is_err(), "{tenant} {place:?}");
        }
        // a's earlier request borrows, once: the loan is bounded.
        let early = slots.take_or_queue("a", (4, 0)).expect("lent");
        assert!(slots.take_or_queue("a", (4, 1)).is_err());
        assert_eq!(slots.lock().lent, 1);
        // The first slot given back repays the loan instead of passing on; the second finds the
        // waiters above gone (their receivers were dropped) and returns to the pool.
        drop(later);
        let g = slots.lock();
        assert_eq!((g.lent, g.free), (0, 1));
        drop(g);
        drop(early);
        assert!(slots.lock().held.is_empty(), "{:?}", slots.lock().held);
    }

    /// A tenant's earlier request keeps getting the places its later request's samples give
    /// back, ahead of them, while loans are out; the loans are repaid once no earlier sample waits.
    #[tokio::test]
    async fn places_given_back_go_to_earlier_samples_before_loans_are_repaid() {
        let slots = FairSlots::lending(1, 1);
        let later = slots.acquire("a", (5, 0)).await;
        let _later_waits = slots.take_or_queue("a", (5, 1)).expect_err("queued");
        let first = slots.take_or_queue("a", (4, 0)).expect("lent");
        let mut second = slots.take_or_queue("a", (4, 1)).expect_err("queued: the loan is out");
        drop(first);
        let second = second.try_recv().expect("passed on, not repaid");
        assert_eq!(slots.lock().lent, 1);
        drop((second, later));
        let g = slots.lock();
        assert_eq!((g.lent, g.free), (0, 0), "repaid, then passed to the later request's waiter");
    }

    /// While loans are out, tenants still take turns: a tenant whose earlier samples could borrow
    /// gets a place given back on its own turn only, and on another tenant's turn the place
    /// repays a loan, that tenant keeping its turn, so it waits for at most the loans out.
    #[tokio::test]
    async fn loans_do_not_take_other_tenants_turns() {
        let slots = FairSlots::lending(1, 1);
        let later = slots.acquire("a", (5, 0)).await;
        let first = slots.take_or_queue("a", (4, 0)).expect("lent");
        let mut a_rest: Vec<_> =
            (1..4).map(|s| slots.take_or_queue("a", (4, s)).expect_err("queued: the loan is out")).collect();
        let mut b = slots.take_or_queue("b", (6, 0)).expect_err("queued");
        drop(first);
        let second = a_rest[0].try_recv().expect("a's turn: its earlier sample");
        drop(second);
        // b's turn: b cannot borrow, so the place repays the loan and b keeps its turn...
        assert!(b.try_recv().is_err());
        assert_eq!(slots.lock().lent, 0);
        drop(later);
        // ...and takes the next place, ahead of a's two other samples that could have borrowed.
        let _b = b.try_recv().expect("b's turn");
        assert!(a_rest[1].try_recv().is_err() && a_rest[2].try_recv().is_err());
    }

    /// A waiter that gave up leaves the queue when the next one of its tenant queues.
    #[tokio::test]
    async fn waiters_that_gave_up_leave_the_queue() {
        let slots = FairSlots::new(1);
        let _held = slots.acquire("a", (0, 0)).await;
        for s in 0..10 {
            drop(slots.take_or_queue("a", (1, s)).expect_err("queued"));
        }
        let _live = slots.take_or_queue("a", (2, 0)).expect_err("queued");
        assert_eq!(slots.lock().waiting["a"].len(), 1);
    }

    /// Whatever order samples ask, give up waiting and give slots back in, the books balance:
    /// slots out (held or handed to a waiter) plus free ones are the pool plus the loans, the
    /// loans stay within their bound, and everything comes back at the end.
    #[test]
    fn the_books_balance_under_any_order_of_asks_and_returns() {
        use rand::{Rng, SeedableRng};
        use tokio::sync::oneshot::error::TryRecvError;
        for seed in 0..200 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let (pool, lend) = (rng.random_range(1..4), rng.random_range(0..4));
            let slots = FairSlots::lending(pool, lend);
            let (mut out, mut waiting) = (Vec::new(), Vec::new());
            for _ in 0..300 {
                match rng.random_range(0..4) {
                    0 | 1 => {
                        let tenant = ["a", "b"][rng.random_range(0..2)];
                        let place = (rng.random_range(0..6), rng.random_range(0..3));
                        match slots.take_or_queue(tenant, place) {
                            Ok(slot) => out.push(slot),
                            Err(rx) => waiting.push(rx),
                        }
                    }
                    2 if !out.is_empty() => drop(out.swap_remove(rng.random_range(0..out.len()))),
                    3 if !waiting.is_empty() => drop(waiting.swap_remove(rng.random_range(0..waiting.len()))),
                    _ => {}
                }
                waiting.retain_mut(|rx: &mut oneshot::Receiver<Slot>| match rx.try_recv() {
                    Ok(slot) => {
                        out.push(slot);
                        false
                    }
                    Err(TryRecvError::Empty) => true,
                    Err(TryRecvError::Closed) => false,
                });
                let g = slots.lock();
                assert_eq!(out.len() + g.free, pool + g.lent, "seed {seed}");
                assert!(g.lent <= lend, "seed {seed}");
                let booked: usize = g.held.values().flat_map(BTreeMap::values).sum();
                assert_eq!(booked, if lend > 0 { out.len() } else { 0 }, "seed {seed}");
            }
            drop(waiting);
            drop(out);
            let g = slots.lock();
            assert_eq!((g.free, g.lent, g.held.len()), (pool, 0, 0), "seed {seed}");
        }
    }

    #[tokio::test]
    async fn a_pool_that_does_not_lend_never_does() {
        let slots = FairSlots::new(1);
        let _later = slots.acquire("a", (5, 0)).await;
        assert!(slots.take_or_queue("a", (4, 0)).is_err());
        assert!(slots.lock().held.is_empty());
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
