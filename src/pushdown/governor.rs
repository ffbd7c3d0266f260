//! Admission under a memory budget: HAPI's storage-side batch adaptation, across tenants.
//!
//! Memory is reserved at three levels ([`super::memory::MemoryModel`]): each engine reserves its
//! sessions and the activations of its largest batch when it starts (the batch cap shrinks to what
//! fits); each request reserves its outputs when it opens its [`Stream`] (so a started request can
//! always finish: requests that each held part of their outputs and waited for the rest would
//! deadlock); each sample reserves its decoded input while in flight.
//!
//! Every pushdown request opens a [`Stream`] with its tenant (access key), its per-sample memory
//! footprint in flight and an optional requested storage batch. The
//! allocator ([`allot`]) gives each open stream an *allotment*: how many of its samples may be in
//! flight (decoding, queued, running) at once. Allotments water-fill the budget left after the
//! engines' fixed memory: tenants share equally, a tenant's streams share its part equally, nobody
//! gets more than it asked for, and what a capped stream leaves goes to the others. A sample is
//! admitted only while its stream is under its allotment *and* the sum of reserved footprints stays
//! within the budget, so shrinking allotments never overshoot: newcomers wait for memory to be
//! released. A sample that waits longer than `max_wait` fails the request with `503 SlowDown`.
//!
//! Without adaptation (`pushdown.adaptation = false`, the comparison mode), a stream's allotment is
//! its requested batch (or all its samples) and the budget is not checked.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use super::error::PushdownError;
use crate::metrics::Metrics;

/// What the allocator knows about one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Demand {
    pub(crate) tenant: String,
    pub(crate) per_sample: u64,
    /// Most samples in flight it wants (its requested storage batch, at most its sample count).
    pub(crate) cap: usize,
}

/// Water-filling: splits `free` bytes equally between tenants, then between each tenant's streams,
/// never giving a stream more than `cap` samples, and handing what capped streams leave to the
/// others. Every stream whose one sample fits in `free` gets at least 1, so nobody starves (the
/// global check in [`Stream::admit`] keeps the sum within the budget meanwhile).
#[must_use]
pub(crate) fn allot(free: u64, demands: &[Demand]) -> Vec<usize> {
    let mut by_tenant: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, d) in demands.iter().enumerate() {
        by_tenant.entry(d.tenant.as_str()).or_default().push(i);
    }
    let bytes_wanted = |i: usize| demands[i].per_sample.saturating_mul(demands[i].cap as u64);
    let tenants: Vec<(u64, Vec<usize>)> =
        by_tenant.into_values().map(|ix| (ix.iter().map(|&i| bytes_wanted(i)).sum(), ix)).collect();
    let tenant_bytes = water_fill(free, &tenants.iter().map(|(w, _)| *w).collect::<Vec<_>>());
    let mut out = vec![0; demands.len()];
    for ((_, ix), budget) in tenants.iter().zip(tenant_bytes) {
        let shares = water_fill(budget, &ix.iter().map(|&i| bytes_wanted(i)).collect::<Vec<_>>());
        for (&i, bytes) in ix.iter().zip(shares) {
            let d = &demands[i];
            let n = usize::try_from(bytes / d.per_sample.max(1)).unwrap_or(usize::MAX).min(d.cap);
            out[i] = if n == 0 && d.per_sample <= free && d.cap > 0 { 1 } else { n };
        }
    }
    out
}

/// Max-min fair split of `total` among wants.
fn water_fill(total: u64, wants: &[u64]) -> Vec<u64> {
    let mut order: Vec<usize> = (0..wants.len()).collect();
    order.sort_by_key(|&i| wants[i]);
    let mut out = vec![0; wants.len()];
    let mut left = total;
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (wants.len() - k) as u64;
        out[i] = wants[i].min(fair);
        left -= out[i];
    }
    out
}

#[derive(Debug)]
struct Open {
    demand: Demand,
    allotment: usize,
    in_flight: usize,
}

#[derive(Debug, Default)]
struct State {
    /// Engines (sessions and their batches' activations).
    fixed: u64,
    /// Request-level holds: source objects and outputs until their responses are sent.
    held: u64,
    /// Samples in flight.
    reserved: u64,
    streams: HashMap<u64, Open>,
    next_id: u64,
    /// Source holds of requests that have not reserved their outputs yet, oldest first.
    pending: BTreeMap<u64, WaitingRequest>,
    /// What the last request to reserve its outputs needed (its outputs and one sample): the
    /// room a new source hold leaves free ([`Governor::hold_source`]).
    last_need: u64,
}

/// A request holding its source and not yet its outputs.
#[derive(Debug, Default)]
struct WaitingRequest {
    /// Its source's bytes.
    bytes: u64,
    /// What it waits to reserve (outputs and one sample), once it has asked.
    need: u64,
}

impl State {
    fn total(&self) -> u64 {
        self.fixed + self.held + self.reserved
    }

    /// Whether a new source of `bytes` may be held: beside everything reserved it leaves room for
    /// one request's outputs and one sample: at least `floor` (one sample's need on its engine),
    /// what the last request to open needed, or more if a request holding its source waits for
    /// more. Opened requests need that room too (their samples are admitted one by one), so it
    /// is kept beside them as well. A room larger than what the budget has beside the engines
    /// and this source admits the source only while nothing else is held.
    fn source_fits(&self, budget: u64, bytes: u64, floor: u64) -> bool {
        let waiting = self.pending.values().map(|p| p.need).max().unwrap_or(0);
        let room = floor.max(self.last_need).max(waiting).min(budget.saturating_sub(self.fixed + bytes));
        self.total() + bytes + room <= budget
    }

    /// Whether the request holding source `id`, waiting for `need` bytes, should give its source
    /// back: it is not the oldest request holding a source, and even once every opened request
    /// has finished and every younger one has given way, the oldest's need (this one's while the
    /// oldest has not asked) would not fit beside the engines and the sources up to this one.
    /// So only as many of the youngest give way as the oldest needs.
    fn should_yield(&self, id: u64, need: u64, budget: u64) -> bool {
        let Some((&oldest, first)) = self.pending.first_key_value() else { return false };
        let oldest_need = if first.need > 0 { first.need } else { need };
        let up_to_this: u64 = self.pending.range(..=id).map(|(_, p)| p.bytes).sum();
        oldest != id && self.fixed + up_to_this + oldest_need > budget
    }
}

/// What a request-level hold is for ([`Governor::hold_for`]).
#[derive(Debug, Clone, Copy)]
enum Purpose {
    /// Fits or waits (an engine's start).
    Plain,
    /// A request's source: it leaves room for one request's outputs, at least `floor`
    /// ([`State::source_fits`]).
    Source { floor: u64 },
    /// A request's outputs, admitted with room for `headroom` more (one sample); `source` is the
    /// request's pending source hold, if any.
    Outputs { headroom: u64, source: Option<u64> },
}

/// Governor settings.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GovernorConfig {
    pub(crate) budget: u64,
    pub(crate) adaptive: bool,
    pub(crate) max_wait: Duration,
}

/// The process-wide memory governor (one per pushdown service).
#[derive(Debug)]
pub(crate) struct Governor {
    cfg: GovernorConfig,
    state: Mutex<State>,
    changed: Notify,
    metrics: Metrics,
    reclaim: OnceLock<Reclaim>,
}

/// Makes room when engines' reservations are what a request or a new engine does not fit beside:
/// stops the engines that no request holds now and says how many (each gives its reservation
/// back once its workers have exited, which wakes the waiters). Set by the pushdown service
/// ([`Governor::set_reclaim`]); without it, such a request is refused (`BudgetBusy`).
pub(crate) struct Reclaim(pub Box<dyn Fn() -> usize + Send + Sync>);

impl std::fmt::Debug for Reclaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Reclaim")
    }
}

/// How long a new engine's first worker waits for the engines it had stopped to give their
/// reservations back (they are idle: their workers exit as soon as their queues close, in
/// milliseconds), and how often it looks.
const RECLAIM_WAIT: Duration = Duration::from_secs(2);
const RECLAIM_POLL: Duration = Duration::from_millis(5);

/// One request's admission state; closing it (drop) returns its share to the others.
#[derive(Debug)]
pub(crate) struct Stream {
    governor: Arc<Governor>,
    id: u64,
    per_sample: u64,
    /// The request's own outputs and source (they stay while the request waits).
    held: u64,
}

/// One admitted sample's reservation, released on drop.
#[derive(Debug)]
pub(crate) struct SampleHold {
    governor: Arc<Governor>,
    stream: u64,
    bytes: u64,
}

/// What a request asks of the governor when it opens its stream ([`Governor::open`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StreamAsk {
    /// Bytes one of its samples holds from its admission to the end of its inference.
    pub(crate) per_sample: u64,
    /// Bytes its outputs (and what its body copies) hold until the response is sent.
    pub(crate) held: u64,
    /// The client's storage batch (`batch=`): an upper bound the governor may lower.
    pub(crate) requested: Option<usize>,
    /// Samples it may have in flight at once (its samples, bounded by the engine's queue).
    pub(crate) samples: usize,
}

impl Governor {
    #[must_use]
    pub(crate) fn new(cfg: GovernorConfig, metrics: Metrics) -> Self {
        metrics.memory_budget.set(i64::try_from(cfg.budget).unwrap_or(i64::MAX));
        Self { cfg, state: Mutex::new(State::default()), changed: Notify::new(), metrics, reclaim: OnceLock::new() }
    }

    /// Sets how room is made ([`Reclaim`]); once.
    pub(crate) fn set_reclaim(&self, reclaim: Reclaim) {
        let _ = self.reclaim.set(reclaim);
    }

    /// Stops the engines no request holds (never with the state locked: a stopping engine's
    /// reservation is returned under it); how many.
    fn make_room(&self) -> usize {
        self.reclaim.get().map_or(0, |r| (r.0)())
    }

    /// After `refused` because engines stand in the way of a request: how long it may still wait
    /// for memory. The first time, the engines no request holds are stopped and their
    /// reservations awaited for up to [`RECLAIM_WAIT`] (`reclaimed` remembers when); a refusal
    /// past that, or with nothing to stop, stands.
    fn wait_after_refusal(
        &self,
        refused: PushdownError,
        reclaimed: &mut Option<tokio::time::Instant>,
    ) -> Result<tokio::time::Instant, PushdownError> {
        let since = match *reclaimed {
            Some(at) => at,
            None if matches!(refused, PushdownError::BudgetBusy { .. }) && self.make_room() > 0 => {
                *reclaimed.insert(tokio::time::Instant::now())
            }
            None => return Err(refused),
        };
        let until = since + RECLAIM_WAIT;
        if tokio::time::Instant::now() < until { Ok(until) } else { Err(refused) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[must_use]
    pub(crate) fn config(&self) -> GovernorConfig {
        self.cfg
    }

    /// Tenants with a pushdown request open now (the storage node's CPU is shared between them).
    #[must_use]
    pub(crate) fn active_tenants(&self) -> std::collections::BTreeSet<String> {
        self.lock().streams.values().map(|o| o.demand.tenant.clone()).collect()
    }

    /// Bytes reserved now: engines' fixed memory plus admitted samples.
    #[must_use]
    pub(crate) fn reserved(&self) -> u64 {
        self.lock().total()
    }

    /// Why `needed` bytes do not fit beside the engines' reservations (`free` is what those
    /// leave): never, whatever is evicted (`ExceedsBudget`, the request's fault), or not now
    /// (`BudgetBusy`: engines idle out, so a retry can pass).
    fn refusal(&self, needed: u64, free: u64) -> PushdownError {
        if needed > self.cfg.budget {
            PushdownError::ExceedsBudget { needed, budget: self.cfg.budget }
        } else {
            PushdownError::BudgetBusy { needed, free }
        }
    }

    /// Reserves an engine's memory for its lifetime: `workers` sessions of `model`, each with
    /// activations for batches of up to the returned size (at most `max_batch`; without
    /// adaptation, `max_batch` with no activations counted). With adaptation a batch size is
    /// chosen only if one batch of its samples (queued and held bytes) still fits beside it: an
    /// engine that took the whole budget could not admit its own requests. When not even batches
    /// of one fit, the engines no request holds are stopped and their reservations awaited
    /// (blocking: this runs on the engine's first worker thread, never on a tokio worker).
    ///
    /// # Errors
    /// With adaptation, when not even batches of one fit in what the budget has left after that
    /// ([`Self::refusal`] says whether they ever could).
    pub(crate) fn reserve_engine(
        self: &Arc<Self>,
        model: &super::memory::MemoryModel,
        workers: usize,
        max_batch: usize,
    ) -> Result<(usize, EngineHold), PushdownError> {
        if !self.cfg.adaptive {
            let bytes = model.engine_bytes(workers, 0);
            let mut s = self.lock();
            s.fixed += bytes;
            self.reallot(&mut s);
            return Ok((max_batch, EngineHold { governor: self.clone(), bytes }));
        }
        let per_sample = model.queued_bytes_per_sample + model.held_bytes_per_sample;
        let needs = |b: usize| model.engine_bytes(workers, b) + per_sample * b as u64;
        let mut waiting_since = None;
        loop {
            let refused = {
                let mut s = self.lock();
                let free = self.cfg.budget.saturating_sub(s.total());
                match (1..=max_batch.max(1)).rev().find(|&b| needs(b) <= free) {
                    Some(batch) => {
                        let bytes = model.engine_bytes(workers, batch);
                        s.fixed += bytes;
                        self.reallot(&mut s);
                        return Ok((batch, EngineHold { governor: self.clone(), bytes }));
                    }
                    None => self.refusal(needs(1), free),
                }
            };
            match waiting_since {
                None if matches!(refused, PushdownError::BudgetBusy { .. }) && self.make_room() > 0 => {
                    waiting_since = Some(Instant::now());
                }
                Some(t) if t.elapsed() < RECLAIM_WAIT => std::thread::sleep(RECLAIM_POLL),
                _ => return Err(refused),
            }
        }
    }

    /// Reserves `bytes` outside any stream (an engine's start), waiting as [`Stream::admit`] does.
    ///
    /// # Errors
    /// `Overloaded` after waiting longer than `max_wait`; at once `ExceedsBudget` if `bytes` is
    /// more than the budget can ever hold, `BudgetBusy` if engines hold what it would need.
    pub(crate) async fn hold(self: &Arc<Self>, bytes: u64) -> Result<Held, PushdownError> {
        self.hold_for(bytes, Purpose::Plain).await
    }

    /// Refuses at once what the budget could never hold (`ExceedsBudget`), before anything is
    /// started or read for it.
    ///
    /// # Errors
    /// `ExceedsBudget` when `bytes` is more than the whole budget (with adaptation).
    pub(crate) fn could_ever_hold(&self, bytes: u64) -> Result<(), PushdownError> {
        if self.cfg.adaptive && bytes > self.cfg.budget {
            return Err(PushdownError::ExceedsBudget { needed: bytes, budget: self.cfg.budget });
        }
        Ok(())
    }

    /// Reserves a request's source object, as [`Self::hold`] does, while room for one request's
    /// outputs and one sample (at least `floor`) stays free beside it
    /// ([`State::source_fits`]). The request is *pending* until it opens its stream
    /// ([`Self::open`]) with this hold: a request that holds its source waits for its outputs,
    /// and sources admitted without that room could take the whole budget while each waits for
    /// the rest (hold and wait: a 64-request burst once deadlocked so, ADR 0015).
    ///
    /// # Errors
    /// As [`Self::hold`].
    pub(crate) async fn hold_source(self: &Arc<Self>, bytes: u64, floor: u64) -> Result<Held, PushdownError> {
        self.hold_for(bytes, Purpose::Source { floor }).await
    }

    async fn hold_for(self: &Arc<Self>, bytes: u64, purpose: Purpose) -> Result<Held, PushdownError> {
        let deadline = tokio::time::Instant::now() + self.cfg.max_wait;
        let mut reclaimed = None;
        let (headroom, source) = match purpose {
            Purpose::Outputs { headroom, source } => (headroom, source),
            Purpose::Plain | Purpose::Source { .. } => (0, None),
        };
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let refused = {
                let mut s = self.lock();
                let fits = match purpose {
                    Purpose::Source { floor } => s.source_fits(self.cfg.budget, bytes, floor),
                    _ => s.total() + bytes + headroom <= self.cfg.budget,
                };
                if !self.cfg.adaptive || fits {
                    s.held += bytes;
                    let pending = match purpose {
                        Purpose::Source { .. } => {
                            let id = s.next_id;
                            s.next_id += 1;
                            s.pending.insert(id, WaitingRequest { bytes, need: 0 });
                            Some(id)
                        }
                        Purpose::Outputs { .. } => {
                            s.last_need = bytes + headroom;
                            source.and_then(|id| s.pending.remove(&id));
                            None
                        }
                        Purpose::Plain => None,
                    };
                    self.reallot(&mut s);
                    return Ok(Held { governor: self.clone(), bytes, pending });
                }
                if let Some(p) = source.and_then(|id| s.pending.get_mut(&id)) {
                    p.need = bytes + headroom;
                }
                if source.is_some_and(|id| s.should_yield(id, bytes + headroom, self.cfg.budget)) {
                    // Sources stand in the way of the oldest waiting request: this one gives its
                    // source back (503 SlowDown, retried by clients), so the oldest can go on.
                    self.metrics.admission_yields.inc();
                    return Err(PushdownError::Overloaded);
                }
                // The request's own source stays whatever happens; engines are what may give way.
                let own = source.and_then(|id| s.pending.get(&id)).map_or(0, |p| p.bytes);
                (self.cfg.adaptive && s.fixed + own + bytes + headroom > self.cfg.budget)
                    .then(|| self.refusal(own + bytes + headroom, self.cfg.budget.saturating_sub(s.fixed)))
            };
            // Engines stand in the way: the ones no request holds make room, and their
            // reservations come back while this waits.
            let until = match refused {
                Some(e) => self.wait_after_refusal(e, &mut reclaimed)?.min(deadline),
                None => deadline,
            };
            if tokio::time::timeout_at(until, notified).await.is_err() {
                if until < deadline {
                    continue; // the reclaim's wait is over: the next look decides
                }
                self.metrics.admission_timeouts.inc();
                return Err(PushdownError::Overloaded);
            }
        }
    }

    /// Opens a stream for a request of `ask.samples` samples, first reserving `ask.held` bytes
    /// (its outputs) for as long as the returned [`Held`] lives, waiting as [`Self::hold`] does;
    /// `source` is the request's source hold ([`Self::hold_source`]), pending until then.
    ///
    /// # Errors
    /// As [`Self::hold`]; `Overloaded` at once when only other pending requests' sources stand in
    /// the way and an older one waits too ([`State::should_yield`]).
    pub(crate) async fn open(
        self: &Arc<Self>,
        tenant: &str,
        ask: StreamAsk,
        source: Option<&Held>,
    ) -> Result<(Stream, Held), PushdownError> {
        let StreamAsk { per_sample, held, requested, samples } = ask;
        // Room for the outputs and for one sample in flight, so an opened request can progress.
        let purpose = Purpose::Outputs { headroom: per_sample, source: source.and_then(|h| h.pending) };
        let outputs = self.hold_for(held, purpose).await?;
        let cap = requested.unwrap_or(samples).min(samples).max(1);
        if let Some(r) = requested {
            self.metrics.storage_batch_requested.observe(r as f64);
        }
        let mut s = self.lock();
        let id = s.next_id;
        s.next_id += 1;
        let demand = Demand { tenant: tenant.to_owned(), per_sample, cap };
        s.streams.insert(id, Open { demand, allotment: 0, in_flight: 0 });
        self.reallot(&mut s);
        let chosen = s.streams.get(&id).map_or(0, |o| o.allotment);
        self.metrics.storage_batch_chosen.observe(chosen as f64);
        drop(s);
        // What the request keeps while its samples wait: its outputs and its source.
        let held = held + source.map_or(0, |h| h.bytes);
        Ok((Stream { governor: self.clone(), id, per_sample, held }, outputs))
    }

    fn reallot(&self, s: &mut State) {
        let ids: Vec<u64> = s.streams.keys().copied().collect();
        if self.cfg.adaptive {
            let demands: Vec<Demand> = ids.iter().map(|id| s.streams[id].demand.clone()).collect();
            let free = self.cfg.budget.saturating_sub(s.fixed + s.held);
            for (id, a) in ids.iter().zip(allot(free, &demands)) {
                if let Some(o) = s.streams.get_mut(id) {
                    o.allotment = a;
                }
            }
        } else {
            for o in s.streams.values_mut() {
                o.allotment = o.demand.cap;
            }
        }
        self.metrics.memory_reserved.set(i64::try_from(s.total()).unwrap_or(i64::MAX));
        self.changed.notify_waiters();
    }
}

impl Stream {
    /// The stream's current allotment (its storage batch).
    #[must_use]
    pub(crate) fn allotment(&self) -> usize {
        self.governor.lock().streams.get(&self.id).map_or(0, |o| o.allotment)
    }

    /// Waits until one more sample fits, then reserves its footprint plus `extra` bytes (an image
    /// sample's decode scratch).
    ///
    /// # Errors
    /// `Overloaded` (503 SlowDown) after waiting longer than `max_wait`; `ExceedsBudget` when one
    /// sample beside the request's outputs is more than the budget can ever hold, `BudgetBusy`
    /// when it does not fit beside the engines.
    pub(crate) async fn admit(&self, extra: u64) -> Result<SampleHold, PushdownError> {
        let g = &self.governor;
        let bytes = self.per_sample + extra;
        let started = Instant::now();
        let mut deadline = tokio::time::Instant::now() + g.cfg.max_wait;
        let mut deferred = false;
        let mut reclaimed = None;
        loop {
            let behind_own;
            let notified = g.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = g.lock();
                let budget_ok = !g.cfg.adaptive || s.total() + bytes <= g.cfg.budget;
                let own = s.streams.get(&self.id);
                let fits = own.is_some_and(|o| o.in_flight < o.allotment);
                // Behind the request's own samples in flight with its whole storage batch allotted
                // (not cut for memory): a queue of the request's making, whose samples end within
                // their own bounds, not a wait for memory, which is what `max_wait` bounds. A
                // shard of 1,000 texts at 40 ms each waits 40 s for its last slot.
                behind_own = own.is_some_and(|o| !fits && o.in_flight > 0 && o.allotment >= o.demand.cap);
                if behind_own {
                    deadline = tokio::time::Instant::now() + g.cfg.max_wait;
                }
                if fits && budget_ok {
                    s.reserved += bytes;
                    if let Some(o) = s.streams.get_mut(&self.id) {
                        o.in_flight += 1;
                    }
                    g.metrics.memory_reserved.set(i64::try_from(s.total()).unwrap_or(i64::MAX));
                    if deferred {
                        g.metrics.admission_wait.observe(started.elapsed().as_secs_f64());
                    }
                    return Ok(SampleHold { governor: g.clone(), stream: self.id, bytes });
                }
            }
            let refused = {
                let s = g.lock();
                // Even with every other request gone, this sample would not fit beside our outputs.
                (g.cfg.adaptive && s.fixed + self.held + bytes > g.cfg.budget)
                    .then(|| g.refusal(self.held + bytes, g.cfg.budget.saturating_sub(s.fixed)))
            };
            // As in `Governor::hold_with_headroom`.
            let until = match refused {
                Some(e) => g.wait_after_refusal(e, &mut reclaimed)?.min(deadline),
                None => deadline,
            };
            if !deferred {
                deferred = true;
                g.metrics.admission_deferrals.inc();
            }
            if tokio::time::timeout_at(until, notified).await.is_err() {
                if until < deadline || behind_own {
                    continue; // the reclaim's wait is over, or the request's own queue: look again
                }
                g.metrics.admission_timeouts.inc();
                return Err(PushdownError::Overloaded);
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        let g = &self.governor;
        let mut s = g.lock();
        s.streams.remove(&self.id);
        g.reallot(&mut s);
    }
}

/// A request-level reservation (a source object, a request's outputs), released on drop.
#[derive(Debug)]
pub(crate) struct Held {
    governor: Arc<Governor>,
    bytes: u64,
    /// A source hold whose request has not opened its stream yet ([`Governor::hold_source`]).
    pending: Option<u64>,
}

/// An engine's fixed memory, returned to the budget when the engine has stopped (evicted, or
/// every worker gone).
#[derive(Debug)]
pub(crate) struct EngineHold {
    governor: Arc<Governor>,
    bytes: u64,
}

impl Drop for EngineHold {
    fn drop(&mut self) {
        let g = &self.governor;
        let mut s = g.lock();
        s.fixed = s.fixed.saturating_sub(self.bytes);
        g.reallot(&mut s);
    }
}

impl Held {
    /// Gives back what this hold reserved beyond `bytes` (a source held at its bound while it was
    /// read, now that its size is known).
    pub(crate) fn shrink_to(&mut self, bytes: u64) {
        if bytes >= self.bytes {
            return;
        }
        let g = &self.governor;
        let mut s = g.lock();
        s.held = s.held.saturating_sub(self.bytes - bytes);
        if let Some(p) = self.pending.and_then(|id| s.pending.get_mut(&id)) {
            p.bytes = bytes;
        }
        self.bytes = bytes;
        g.reallot(&mut s);
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let g = &self.governor;
        let mut s = g.lock();
        s.held = s.held.saturating_sub(self.bytes);
        if let Some(id) = self.pending {
            s.pending.remove(&id);
        }
        g.reallot(&mut s);
    }
}

impl Drop for SampleHold {
    fn drop(&mut self) {
        let g = &self.governor;
        let mut s = g.lock();
        s.reserved = s.reserved.saturating_sub(self.bytes);
        if let Some(o) = s.streams.get_mut(&self.stream) {
            o.in_flight = o.in_flight.saturating_sub(1);
        }
        g.metrics.memory_reserved.set(i64::try_from(s.total()).unwrap_or(i64::MAX));
        drop(s);
        g.changed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    fn ask(per_sample: u64, held: u64, requested: Option<usize>, samples: usize) -> StreamAsk {
        StreamAsk { per_sample, held, requested, samples }
    }

    fn d(tenant: &str, per_sample: u64, cap: usize) -> Demand {
        Demand { tenant: tenant.into(), per_sample, cap }
    }

    #[test]
    fn allotments_are_fair_capped_and_fill_the_budget() {
        // One tenant alone: as much as fits, never more than asked.
        assert_eq!(allot(1000, &[d("a", 10, 500)]), vec![100]);
        assert_eq!(allot(1000, &[d("a", 10, 30)]), vec![30]);
        // Two tenants share equally; a capped one leaves the rest to the other.
        assert_eq!(allot(1000, &[d("a", 10, 500), d("b", 10, 500)]), vec![50, 50]);
        assert_eq!(allot(1000, &[d("a", 10, 20), d("b", 10, 500)]), vec![20, 80]);
        // Fairness is per tenant, not per request: a's three requests share a's half.
        let a = allot(1200, &[d("a", 10, 500), d("a", 10, 500), d("a", 10, 500), d("b", 10, 500)]);
        assert_eq!(a, vec![20, 20, 20, 60]);
        // Nobody starves while one sample fits; a sample larger than everything gets nothing.
        assert_eq!(allot(25, &[d("a", 10, 5), d("b", 10, 5), d("c", 10, 5)]), vec![1, 1, 1]);
        assert_eq!(allot(5, &[d("a", 10, 5)]), vec![0]);
        // Within the budget whenever the minimum of one does not kick in.
        let demands: Vec<Demand> = (0..7).map(|i| d(&format!("t{}", i % 3), 7 + i, 50)).collect();
        let got = allot(3000, &demands);
        let used: u64 = got.iter().zip(&demands).map(|(&n, d)| n as u64 * d.per_sample).sum();
        assert!(used <= 3000 && used > 2800, "{got:?} uses {used}");
    }

    fn governor(budget: u64, adaptive: bool, wait_ms: u64) -> Arc<Governor> {
        Arc::new(Governor::new(
            GovernorConfig { budget, adaptive, max_wait: Duration::from_millis(wait_ms) },
            Metrics::new(),
        ))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reservations_never_exceed_the_budget_and_everyone_finishes() {
        let g = governor(1000, true, 10_000);
        let engine = crate::pushdown::memory::MemoryModel::from_probes(300, [0, 0], 0, 0);
        let (batch, engine_hold) = g.reserve_engine(&engine, 1, 4).expect("engine fits");
        assert_eq!(batch, 4);
        let peak = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|t| {
                let (g, peak) = (g.clone(), peak.clone());
                tokio::spawn(async move {
                    let (stream, _outputs) =
                        g.open(&format!("tenant{}", t % 3), ask(50, 40, Some(64), 40), None).await.expect("opened");
                    let mut work = Vec::new();
                    for _ in 0..40 {
                        let slot = stream.admit(0).await.expect("admitted");
                        peak.fetch_max(g.reserved(), Ordering::SeqCst);
                        work.push(tokio::spawn(async move {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                            drop(slot);
                        }));
                    }
                    for w in work {
                        w.await.expect("sample");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("tenant finished");
        }
        assert!(peak.load(Ordering::SeqCst) <= 1000, "peak {}", peak.load(Ordering::SeqCst));
        assert_eq!(g.reserved(), 300, "everything but the engine released");
        drop(engine_hold);
        assert_eq!(g.reserved(), 0, "a stopped engine's memory is back");
    }

    /// `n` requests of a source of 60 and outputs of 100 plus one sample of 20, beside an engine
    /// of 300 in a budget of 1000; with `together`, none asks for its outputs before all hold
    /// their sources. How many finished, how many gave way, the peak reserved, the metric.
    async fn burst(n: usize, floor: u64, together: bool) -> (usize, usize, u64, u64) {
        let g = governor(1000, true, 60_000);
        let engine = crate::pushdown::memory::MemoryModel::from_probes(300, [0, 0], 0, 0);
        let (_, _engine) = g.reserve_engine(&engine, 1, 1).expect("engine fits");
        let peak = Arc::new(AtomicU64::new(0));
        let all_held = Arc::new(tokio::sync::Barrier::new(if together { n } else { 1 }));
        let tasks: Vec<_> = (0..n)
            .map(|t| {
                let (g, peak, all_held) = (g.clone(), peak.clone(), all_held.clone());
                tokio::spawn(async move {
                    let source = g.hold_source(60, floor).await?;
                    all_held.wait().await;
                    let (stream, outputs) = g.open(&format!("t{t}"), ask(20, 100, None, 1), Some(&source)).await?;
                    let slot = stream.admit(0).await?;
                    peak.fetch_max(g.reserved(), Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    drop((slot, stream, outputs, source));
                    Ok::<_, PushdownError>(())
                })
            })
            .collect();
        let (mut done, mut yielded) = (0, 0);
        for t in tasks {
            match t.await.expect("joined") {
                Ok(()) => done += 1,
                Err(PushdownError::Overloaded) => yielded += 1,
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(g.reserved(), 300, "everything but the engine released");
        (done, yielded, peak.load(Ordering::SeqCst), g.metrics.admission_yields.get())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn sources_leave_room_for_a_request_s_outputs_so_a_burst_cannot_hold_and_wait() {
        // The floor (one request's need) keeps room for the outputs: at most 9 sources are held
        // at once, and all 16 finish.
        let (done, yielded, peak, yields) = burst(16, 120, false).await;
        assert_eq!((done, yielded, yields), (16, 0, 0));
        assert!(peak <= 1000, "peak {peak}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn when_sources_took_the_room_anyway_the_youngest_give_way_to_the_oldest() {
        // No floor (the need is learned from the first open): 11 sources take 960 of 1000 and
        // each then needs 120. Without giving way, all would wait until max_wait (a minute).
        // With it, the two youngest give their sources back (300 + 9 x 60 + 120 fits), and the
        // other nine finish one after another.
        let (done, yielded, peak, yields) = burst(11, 0, true).await;
        assert_eq!((done, yielded, yields), (9, 2, 2));
        assert!(peak <= 1000, "peak {peak}");
    }

    #[tokio::test]
    async fn what_engines_crowd_out_is_busy_and_what_never_fits_is_too_large() {
        let g = governor(1000, true, 50);
        let engine = |fixed| crate::pushdown::memory::MemoryModel::from_probes(fixed, [0, 0], 0, 0);
        let (_, _first) = g.reserve_engine(&engine(700), 1, 1).expect("fits");
        // Another engine of 400 would fit an empty budget: not now (503), once the first idles out.
        assert!(matches!(
            g.reserve_engine(&engine(400), 1, 1),
            Err(PushdownError::BudgetBusy { needed: 400, free: 300 })
        ));
        assert!(matches!(
            g.reserve_engine(&engine(1001), 1, 1),
            Err(PushdownError::ExceedsBudget { budget: 1000, .. })
        ));
        // The same for requests: 400 bytes of outputs fit the budget, not beside the engine.
        assert!(matches!(g.hold(400).await, Err(PushdownError::BudgetBusy { .. })));
        assert!(matches!(g.open("a", ask(10, 400, None, 1), None).await, Err(PushdownError::BudgetBusy { .. })));
        assert!(matches!(g.open("a", ask(10, 995, None, 1), None).await, Err(PushdownError::ExceedsBudget { .. })));
        drop(_first);
        let (_, _second) = g.reserve_engine(&engine(400), 1, 1).expect("the first engine's memory is back");
    }

    #[tokio::test]
    async fn engines_no_request_holds_make_room_for_a_new_engine_and_for_requests() {
        // The reclaim stops what the table holds and no request does: here, the parked holds.
        let g = governor(1000, true, 2000);
        let parked: Arc<Mutex<Vec<EngineHold>>> = Arc::default();
        let table = parked.clone();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = calls.clone();
        g.set_reclaim(Reclaim(Box::new(move || {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let stopped = std::mem::take(&mut *table.lock().unwrap());
            let n = stopped.len();
            // An engine's workers exit a moment later, off the caller's thread.
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                drop(stopped);
            });
            n
        })));
        let engine = |fixed| crate::pushdown::memory::MemoryModel::from_probes(fixed, [0, 0], 0, 0);
        let (_, idle) = g.reserve_engine(&engine(700), 1, 1).expect("fits");
        parked.lock().unwrap().push(idle);
        // A second engine of 400 does not fit beside it; the idle one is stopped, its 700 come back.
        let (_, second) = g.reserve_engine(&engine(400), 1, 1).expect("room was made");
        assert_eq!((g.reserved(), calls.load(std::sync::atomic::Ordering::SeqCst)), (400, 1));
        // A request's outputs likewise: 700 do not fit beside the second engine until it is stopped.
        parked.lock().unwrap().push(second);
        let held = g.hold(700).await.expect("room was made");
        assert_eq!((g.reserved(), calls.load(std::sync::atomic::Ordering::SeqCst)), (700, 2));
        drop(held);
        // And a request whose outputs fit beside the engine but not beside its own source too.
        let (_, third) = g.reserve_engine(&engine(700), 1, 1).expect("fits");
        parked.lock().unwrap().push(third);
        let source = g.hold_source(200, 0).await.expect("fits beside the engine");
        let (_s, _out) = g.open("a", ask(0, 150, None, 1), Some(&source)).await.expect("room was made");
        assert_eq!((g.reserved(), calls.load(std::sync::atomic::Ordering::SeqCst)), (350, 3));
        drop((_s, _out, source));
        // An engine a request holds is not stopped: refused at once, as before.
        let (_, _busy) = g.reserve_engine(&engine(700), 1, 1).expect("fits");
        assert!(matches!(g.hold(400).await, Err(PushdownError::BudgetBusy { .. })));
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn a_reclaim_that_frees_too_little_ends_in_a_refusal_not_a_wait_to_the_bound() {
        // The reclaim says it stopped an engine, but nothing comes back (too little, or late):
        // after RECLAIM_WAIT the refusal stands, long before max_wait (a minute here) would end it
        // as `Overloaded`.
        let g = governor(1000, true, 60_000);
        g.set_reclaim(Reclaim(Box::new(|| 1)));
        let engine = |fixed| crate::pushdown::memory::MemoryModel::from_probes(fixed, [0, 0], 0, 0);
        let (_, _busy) = g.reserve_engine(&engine(700), 1, 1).expect("fits");
        assert!(matches!(g.hold(400).await, Err(PushdownError::BudgetBusy { .. })));
        let (mut stream, _outputs) = g.open("a", ask(10, 100, None, 1), None).await.expect("fits");
        stream.per_sample = 250;
        assert!(matches!(stream.admit(0).await, Err(PushdownError::BudgetBusy { .. })));
        assert!(matches!(g.reserve_engine(&engine(400), 1, 1), Err(PushdownError::BudgetBusy { .. })));
    }

    #[test]
    fn an_engine_leaves_room_for_one_batch_of_its_own_samples() {
        let g = governor(1000, true, 50);
        // 200 fixed (session and workspace) + 50 per sample of activations; each sample queues
        // 2 x 10 and holds 3 x 10 bytes.
        let model = crate::pushdown::memory::MemoryModel::from_probes(100, [150, 500], 10, 10);
        assert_eq!((model.fixed_bytes, model.activation_bytes_per_sample), (200, 50));
        assert_eq!((model.queued_bytes_per_sample, model.held_bytes_per_sample), (20, 30));
        let (batch, _hold) = g.reserve_engine(&model, 1, 64).expect("fits");
        // 200 + 50 b + 50 b <= 1000: b = 8 (without the samples' room, 16 would have been taken).
        assert_eq!((batch, g.reserved()), (8, 200 + 50 * 8));
    }

    #[tokio::test]
    async fn waiting_behind_the_requests_own_samples_is_not_bounded_by_max_wait() {
        let g = governor(1000, true, 20);
        let (a, _out) = g.open("a", ask(10, 0, Some(1), 3), None).await.expect("a");
        let first = a.admit(0).await.expect("first");
        let second = tokio::spawn({
            let a = Arc::new(a);
            async move { a.admit(0).await.map(drop) }
        });
        // Five times max_wait behind its own first sample: still waiting, not refused.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!second.is_finished());
        drop(first);
        second.await.expect("task").expect("admitted once the first ended");
    }

    #[tokio::test]
    async fn waiting_past_the_bound_is_overloaded_and_no_adaptation_ignores_the_budget() {
        let g = governor(100, true, 50);
        let (a, _a_out) = g.open("a", ask(60, 0, None, 10), None).await.expect("a");
        let _held = a.admit(0).await.expect("first fits");
        // b cannot even open: one of its samples does not fit beside a's.
        assert!(matches!(g.open("b", ask(60, 0, None, 10), None).await, Err(PushdownError::Overloaded)));
        let (b, _b_out) = g.open("b", ask(30, 0, None, 10), None).await.expect("b's samples are smaller");
        let _b1 = b.admit(0).await.expect("30 of the 40 free bytes");
        assert!(matches!(b.admit(0).await, Err(PushdownError::Overloaded)), "10 left");
        drop(_b1);
        assert!(matches!(g.hold(50).await, Err(PushdownError::Overloaded)), "only 40 bytes are free");
        assert!(matches!(a.admit(0).await, Err(PushdownError::Overloaded)), "a's allotment is 1 beside b");
        assert!(matches!(g.hold(101).await, Err(PushdownError::ExceedsBudget { .. })), "never fits");
        let small = g.hold(40).await.expect("fits exactly");
        drop(small);
        let big = crate::pushdown::memory::MemoryModel::from_probes(1000, [0, 0], 0, 0);
        assert!(g.reserve_engine(&big, 1, 1).is_err(), "an engine larger than the budget is refused");
        assert!(matches!(g.open("c", ask(10, 95, None, 1), None).await, Err(PushdownError::ExceedsBudget { .. })));

        let fixed = governor(100, false, 50);
        let (s, _out) = fixed.open("a", ask(60, 1000, Some(4), 10), None).await.expect("not enforced");
        let slots: Vec<SampleHold> =
            futures_util::future::try_join_all((0..4).map(|_| s.admit(0))).await.expect("all four");
        assert_eq!((slots.len(), fixed.reserved()), (4, 1240), "the comparison mode overshoots by design");
    }

    #[tokio::test]
    async fn a_hold_shrunk_to_what_arrived_frees_the_rest_for_waiters() {
        let g = governor(100, true, 5_000);
        let mut bound = g.hold(90).await.expect("a source held at its bound");
        let g2 = g.clone();
        let waiter = tokio::spawn(async move { g2.hold(50).await.map(|h| (h, g2.reserved())) });
        tokio::task::yield_now().await;
        bound.shrink_to(20);
        let (_other, reserved) = waiter.await.expect("joined").expect("the freed bytes admit the waiter");
        assert_eq!(reserved, 70);
        bound.shrink_to(40); // never grows
        assert_eq!(g.reserved(), 70);
        drop(bound);
        assert_eq!(g.reserved(), 50);
    }
}
