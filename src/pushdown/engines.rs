//! The engine table: one cell per (model, split), started once however many requests ask at the
//! same moment (single flight), on a blocking thread (cutting the prefix is CPU work; no lock is
//! held while it runs), replaced when its workers died (or, [`RETRY_FAILED_AFTER`] after it
//! failed to start, on the next request), evicted once idle, or at once when no request holds it
//! and its memory is needed (the governor's reclaim).
//!
//! Eviction drops the table's handle only when nobody else holds one (no request in flight on
//! it): the engine's queue then closes, its workers exit with their sessions, and its memory
//! reservation returns to the governor ([`super::governor::EngineHold`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::OnceCell;

use super::engine::Engine;
use super::error::PushdownError;
use crate::metrics::{Metrics, ReasonLabel};

/// An engine's (model, split), with the model's version: a model replaced under the same name
/// starts engines of its own while requests of the old one finish on theirs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct EngineKey {
    pub(crate) model: String,
    pub(crate) version: String,
    pub(crate) split: String,
}

/// How long an engine that failed to start (its prefix unusable, or too large for what the budget
/// had left) keeps answering with that error before a request may start it again: long enough that
/// a broken model cannot make every request pay for a session and a probe, short enough that an
/// engine refused for memory gets another chance once idle engines were evicted.
const RETRY_FAILED_AFTER: Duration = Duration::from_secs(30);

#[derive(Debug)]
struct Cell {
    engine: OnceCell<Arc<Engine>>,
    /// Milliseconds since the table's epoch at the last lookup.
    last_used: AtomicU64,
    created: Instant,
}

impl Cell {
    fn new() -> Self {
        Self { engine: OnceCell::new(), last_used: AtomicU64::new(0), created: Instant::now() }
    }

    /// Whether this cell's engine should be replaced by a new one.
    fn replaceable(&self) -> bool {
        self.engine.get().is_some_and(|e| !e.is_alive() || (e.failed() && self.created.elapsed() >= RETRY_FAILED_AFTER))
    }

    /// Whether its engine started and then lost its workers: a failure of a running engine, not
    /// a start that was refused (an unusable prefix, or no room in the budget).
    fn died(&self) -> bool {
        self.engine.get().is_some_and(|e| !e.failed() && !e.is_alive())
    }
}

/// The supervised engines of one pushdown service.
#[derive(Debug)]
pub(crate) struct EngineTable {
    cells: Mutex<HashMap<EngineKey, Arc<Cell>>>,
    /// Engines unused this long are evicted.
    idle: Duration,
    epoch: Instant,
    /// `tensorgate_pushdown_engine_evictions_total`, by reason.
    evictions: Family<ReasonLabel, Counter>,
    /// `tensorgate_pushdown_engine_failures_total`, by reason (here `dead`).
    failures: Family<ReasonLabel, Counter>,
}

impl EngineTable {
    #[must_use]
    pub(crate) fn new(idle: Duration, metrics: &Metrics) -> Self {
        Self {
            cells: Mutex::default(),
            idle,
            epoch: Instant::now(),
            evictions: metrics.engine_evictions.clone(),
            failures: metrics.engine_failures.clone(),
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The cell for `key`: the existing one unless its engine died, then a fresh one.
    fn cell(&self, key: &EngineKey) -> Arc<Cell> {
        let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        let cell = match cells.get(key) {
            Some(c) if !c.replaceable() => c.clone(),
            found => {
                if let Some(old) = found {
                    tracing::warn!(model = %key.model, split = %key.split, "Engine failed or has no live worker; starting a new one.");
                    if old.died() {
                        self.failures.get_or_create(&ReasonLabel { reason: "dead" }).inc();
                    }
                }
                let c = Arc::new(Cell::new());
                cells.insert(key.clone(), c.clone());
                c
            }
        };
        cell.last_used.store(self.now_ms(), Ordering::Relaxed);
        cell
    }

    /// The running engine for `key`, started with `start` on a blocking thread if there is none,
    /// given what `prepare` gave (awaited only by the caller that starts it: the start's memory
    /// hold). Concurrent callers wait for the one start; a failed start is retried by the next
    /// caller.
    ///
    /// # Errors
    /// What `prepare` or `start` failed with.
    pub(crate) async fn get_or_start<P, R, F>(
        &self,
        key: &EngineKey,
        prepare: P,
        start: F,
    ) -> Result<Arc<Engine>, PushdownError>
    where
        P: Future<Output = Result<R, PushdownError>>,
        R: Send + 'static,
        F: FnOnce(R) -> Result<Engine, PushdownError> + Send + 'static,
    {
        let cell = self.cell(key);
        let engine = cell
            .engine
            .get_or_try_init(|| async {
                let prepared = prepare.await?;
                tokio::task::spawn_blocking(move || start(prepared))
                    .await
                    .map_err(|e| PushdownError::Internal(format!("engine start failed: {e}")))?
                    .map(Arc::new)
            })
            .await?;
        Ok(engine.clone())
    }

    /// The engine for `key` if it runs (no start, no touch).
    #[must_use]
    pub(crate) fn running(&self, key: &EngineKey) -> Option<Arc<Engine>> {
        self.cells.lock().unwrap_or_else(PoisonError::into_inner).get(key).and_then(|c| c.engine.get().cloned())
    }

    /// Every running engine.
    #[must_use]
    pub(crate) fn all(&self) -> Vec<(EngineKey, Arc<Engine>)> {
        let cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
        cells.iter().filter_map(|(k, c)| Some((k.clone(), c.engine.get()?.clone()))).collect()
    }

    /// Drops the engines unused for the idle time that no request holds; returns their keys.
    pub(crate) fn evict_idle(&self) -> Vec<EngineKey> {
        let idle = u64::try_from(self.idle.as_millis()).unwrap_or(u64::MAX);
        self.evict(Some(idle), "idle")
    }

    /// Drops every engine that no request holds now, however recently used (their memory is
    /// needed: `super::governor::Governor`'s reclaim); returns their keys.
    pub(crate) fn evict_unused(&self) -> Vec<EngineKey> {
        self.evict(None, "memory")
    }

    /// Drops the engines no request holds (and, with `idle_ms`, unused that long).
    fn evict(&self, idle_ms: Option<u64>, reason: &'static str) -> Vec<EngineKey> {
        let now = self.now_ms();
        let mut evicted = Vec::new();
        let mut dropped = Vec::new();
        {
            let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
            cells.retain(|key, cell| {
                let unused =
                    idle_ms.is_none_or(|idle| now.saturating_sub(cell.last_used.load(Ordering::Relaxed)) >= idle);
                // Only the table holds the engine (and the cell is not being started).
                let free = cell.engine.get().is_some_and(|e| Arc::strong_count(e) == 1) && Arc::strong_count(cell) == 1;
                if unused && free {
                    evicted.push(key.clone());
                    dropped.push(cell.clone());
                    false
                } else {
                    true
                }
            });
        }
        // The engines stop (queues close, workers exit) outside the lock.
        drop(dropped);
        for EngineKey { model, split, .. } in &evicted {
            tracing::info!(%model, %split, reason, "Engine evicted.");
        }
        self.evictions.get_or_create(&ReasonLabel { reason }).inc_by(evicted.len() as u64);
        evicted
    }

    /// Drops the engines of model versions `current` does not say are served (removed or
    /// replaced models): each stops when its last request is done, and its memory returns to the
    /// budget then. Returns their keys.
    pub(crate) fn retire(&self, current: impl Fn(&EngineKey) -> bool) -> Vec<EngineKey> {
        let mut retired = Vec::new();
        let dropped: Vec<Arc<Cell>> = {
            let mut cells = self.cells.lock().unwrap_or_else(PoisonError::into_inner);
            let keys: Vec<EngineKey> = cells.keys().filter(|k| !current(k)).cloned().collect();
            keys.into_iter().filter_map(|k| cells.remove(&k).inspect(|_| retired.push(k))).collect()
        };
        drop(dropped);
        for EngineKey { model, split, .. } in &retired {
            tracing::info!(%model, %split, "Engine retired: its model was removed or replaced.");
        }
        self.evictions.get_or_create(&ReasonLabel { reason: "retired" }).inc_by(retired.len() as u64);
        retired
    }

    /// Drops every engine (shutdown): each stops when its last request is done.
    pub(crate) fn clear(&self) {
        let cells = std::mem::take(&mut *self.cells.lock().unwrap_or_else(PoisonError::into_inner));
        drop(cells);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_start_gets_what_its_preparation_gave_and_a_failed_preparation_starts_nothing() {
        let table = EngineTable::new(Duration::from_secs(60), &Metrics::new());
        let key = EngineKey { model: "m".to_owned(), version: "v".to_owned(), split: "s".to_owned() };
        let err = table
            .get_or_start(&key, async { Ok(7u32) }, |n| Err(PushdownError::Model(format!("given {n}"))))
            .await
            .expect_err("the start fails");
        assert!(matches!(&err, PushdownError::Model(m) if m == "given 7"), "{err:?}");
        let err = table
            .get_or_start(&key, async { Err::<u32, _>(PushdownError::Overloaded) }, |_| -> Result<Engine, _> {
                panic!("a start whose preparation failed must not run")
            })
            .await
            .expect_err("the preparation fails");
        assert!(matches!(err, PushdownError::Overloaded), "{err:?}");
        assert!(table.all().is_empty());
    }
}
