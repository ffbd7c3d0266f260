//! An engine's queue of samples waiting for inference: bounded, and served by *place* (the
//! request's arrival number, then the sample's position in it) instead of first come, first
//! served.
//!
//! A client that asks for shards 0-3 at once reads the answers in that order. Their samples reach
//! the queue in whatever order their sources came back from the store and were decoded, and a
//! first-come queue then finishes shard 2 before shard 1, while the client waits for shard 1 and
//! then gets the rest at once. Served by place, the oldest request's samples run first whenever
//! they are waiting ([`super::fair`] orders the decoding the same way).
//!
//! The inference threads block on it ([`Queue::next_batch`]): they are dedicated threads, never
//! tokio's, and the lock is held only to move items in or out.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

/// Where an item stands: its request's arrival number and its position in the request.
pub(crate) type Place = (u64, u64);

/// Why [`Queue::push`] gave the item back.
#[derive(Debug)]
pub(crate) enum Refused<T> {
    /// The queue holds its capacity.
    Full(T),
    /// The queue was closed: its engine is gone.
    Closed(T),
}

pub(crate) struct Queue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
    capacity: usize,
}

struct State<T> {
    /// By place; the last part counts pushes, which keeps keys unique and equal places in order.
    items: BTreeMap<(u64, u64, u64), T>,
    pushed: u64,
    closed: bool,
}

impl<T> std::fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("Queue")
            .field("queued", &s.items.len())
            .field("capacity", &self.capacity)
            .field("closed", &s.closed)
            .finish()
    }
}

impl<T> Queue<T> {
    /// A queue of at most `capacity` items (at least one).
    #[must_use]
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State { items: BTreeMap::new(), pushed: 0, closed: false }),
            ready: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // Nothing panics while the lock is held; if something did, the map itself is still sound.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `item` at `place`, or gives it back when the queue is full or closed.
    ///
    /// # Errors
    /// [`Refused`], with the item.
    pub(crate) fn push(&self, (arrival, position): Place, item: T) -> Result<(), Refused<T>> {
        let mut s = self.lock();
        if s.closed {
            return Err(Refused::Closed(item));
        }
        if s.items.len() >= self.capacity {
            return Err(Refused::Full(item));
        }
        s.pushed += 1;
        let key = (arrival, position, s.pushed);
        s.items.insert(key, item);
        drop(s);
        self.ready.notify_one();
        Ok(())
    }

    /// Waits for an item, then takes it and the items after it by place while the batch is
    /// smaller than every taken item's cap (`cap`; a cap below the batch taken so far ends it).
    /// `None` once the queue is closed and empty.
    pub(crate) fn next_batch(&self, cap: impl Fn(&T) -> usize) -> Option<Vec<T>> {
        let mut s = self.lock();
        loop {
            if let Some((_, first)) = s.items.pop_first() {
                let mut limit = cap(&first);
                let mut batch = vec![first];
                while batch.len() < limit {
                    let Some((_, item)) = s.items.pop_first() else { break };
                    limit = limit.min(cap(&item).max(batch.len() + 1));
                    batch.push(item);
                }
                return Some(batch);
            }
            if s.closed {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Refuses new items and, once what is queued has been taken, ends every
    /// [`Self::next_batch`].
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn items_come_out_by_place_not_by_push() {
        let q = Queue::new(16);
        for (place, name) in [((2, 0), "r2s0"), ((1, 1), "r1s1"), ((2, 1), "r2s1"), ((1, 0), "r1s0"), ((0, 5), "r0s5")]
        {
            q.push(place, name).unwrap();
        }
        assert_eq!(q.next_batch(|_| 2), Some(vec!["r0s5", "r1s0"]));
        assert_eq!(q.next_batch(|_| 8), Some(vec!["r1s1", "r2s0", "r2s1"]));
    }

    #[test]
    fn a_smaller_cap_ends_the_batch_and_equal_places_keep_their_order() {
        let q = Queue::new(16);
        for (cap, name) in [(4, "a"), (4, "b"), (2, "c"), (4, "d")] {
            q.push((0, 0), (cap, name)).unwrap();
        }
        // "c" asks for batches of at most 2, but the batch already holds 2: it joins, and ends it.
        assert_eq!(q.next_batch(|i| i.0), Some(vec![(4, "a"), (4, "b"), (2, "c")]));
        assert_eq!(q.next_batch(|i| i.0), Some(vec![(4, "d")]));
    }

    #[test]
    fn a_full_queue_gives_the_item_back() {
        let q = Queue::new(1);
        q.push((0, 0), 1).unwrap();
        assert!(matches!(q.push((0, 1), 2), Err(Refused::Full(2))));
        assert_eq!(q.next_batch(|_| 4), Some(vec![1]));
        q.push((0, 1), 2).unwrap();
    }

    #[test]
    fn closing_drains_what_is_queued_then_ends_the_waiters() {
        let q = Arc::new(Queue::new(4));
        q.push((0, 0), 1).unwrap();
        q.close();
        assert!(matches!(q.push((0, 1), 2), Err(Refused::Closed(2))));
        assert_eq!(q.next_batch(|_| 4), Some(vec![1]));
        assert_eq!(q.next_batch(|_| 4), None);

        let q = Arc::new(Queue::<u32>::new(4));
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || q.next_batch(|_| 4))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.close();
        assert_eq!(waiter.join().unwrap(), None, "a blocked waiter wakes up when the queue closes");
    }

    #[test]
    fn a_push_wakes_a_waiting_thread() {
        let q = Arc::new(Queue::new(4));
        let waiter = {
            let q = q.clone();
            std::thread::spawn(move || q.next_batch(|_| 4))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        q.push((0, 0), 7).unwrap();
        assert_eq!(waiter.join().unwrap(), Some(vec![7]));
    }
}
