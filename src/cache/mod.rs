//! The cross-epoch tensor cache: pushdown outputs kept in memory (moka, weighted by bytes) and
//! optionally on disk, so that reading a dataset again costs a lookup instead of a prefix run.
//!
//! Correctness rests on three rules (ARCHITECTURE.md, "Tensor cache"):
//! 1. The key holds everything that determines the output except the object's content
//!    ([`CacheKey`]); the content is named by the source ETag stored in the entry.
//! 2. Every write through the gateway bumps a generation counter covering the object (or its
//!    bucket, for multi-object deletes); an entry stamped with an older generation is never served
//!    without asking the backend whether the source ETag still holds.
//! 3. Otherwise an entry is served without asking only within `revalidate_after` of its last
//!    validation (default zero: every request sends one conditional GET, which costs a round trip
//!    but no object bytes). This bounds staleness after writes that bypass the gateway.
//!
//! [`TensorCache::get_or_compute`] applies them: callers never look up, validate or insert
//! themselves. Concurrent misses on one key compute once.

pub mod disk;
pub(crate) mod key;

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use moka::future::Cache;
use moka::policy::EvictionPolicy;
use serde::{Deserialize, Serialize};

pub use self::key::{CacheKey, Cached, ObjectId};
use crate::metrics::Metrics;

/// Generation counters per object, striped by hash: a write bumps its stripe, which forces every
/// entry of every object in the stripe to revalidate once. 4096 stripes keep false sharing of a
/// bump rare while costing 32 KiB.
const OBJECT_STRIPES: usize = 4096;
/// Generation counters per bucket (multi-object deletes, bucket deletion).
const BUCKET_STRIPES: usize = 256;
/// Bookkeeping bytes charged per memory entry on top of the tensor (key, headers, moka node).
const ENTRY_OVERHEAD: u64 = 512;

/// Keys of single-use outputs (augmented ones, ADR 0032) seen once, remembered so that a second
/// request of one is cached: 65,536 hashes (512 KiB) cover an epoch of a large shard dataset's
/// requests, or many epochs of single images' retries; when full the set starts over (a repeat
/// then goes uncached once more, never wrong).
const SEEN_ONCE: usize = 65_536;

/// How the memory tier chooses what to keep when full. Measured on epoch scans by
/// `cargo bench --bench cache_policy` (`docs/BENCHMARKS.md`, "Tensor cache"; ADR 0004): at 1.5x
/// and 3x the tier, `pin` reaches the ideal hit rate (capacity / dataset), TinyLFU 58-92% of it,
/// LRU half of it at best and nothing on a fixed order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Policy {
    /// No eviction: admit until full, then keep what is there (CoorDL's choice for epoch scans).
    /// Entries idle past `idle_expiry` leave, so a finished dataset makes room for the next.
    #[default]
    Pin,
    /// moka's TinyLFU: admits a new entry only if it is used more often than what it would evict.
    TinyLfu,
    /// Least recently used: the textbook policy, which thrashes on scans larger than the cache.
    Lru,
}

/// Cache settings.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    pub memory_bytes: u64,
    pub policy: Policy,
    pub revalidate_after: Duration,
    /// Memory entries not read for this long are dropped (any policy).
    pub idle_expiry: Duration,
    pub disk: Option<DiskConfig>,
}

/// The optional disk tier.
#[derive(Debug, Clone)]
pub struct DiskConfig {
    pub(crate) dir: PathBuf,
    pub(crate) max_bytes: u64,
}

/// When an entry was last known to match its source.
#[derive(Debug, Clone, Copy)]
struct Stamp {
    generation: u64,
    validated: Option<Instant>,
}

/// A cache entry: the output and its validation stamp.
#[derive(Debug)]
pub struct Entry {
    pub(crate) data: Arc<Cached>,
    stamp: Mutex<Stamp>,
}

impl Entry {
    fn new(data: Arc<Cached>, generation: u64, validated: Option<Instant>) -> Self {
        Self { data, stamp: Mutex::new(Stamp { generation, validated }) }
    }

    fn stamp(&self) -> Stamp {
        *self.stamp.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Records that the backend confirmed the entry's source ETag under `generation`.
    fn validated(&self, generation: u64) {
        let mut s = self.stamp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if generation >= s.generation {
            *s = Stamp { generation, validated: Some(Instant::now()) };
        }
    }

    fn weight(&self) -> u32 {
        u32::try_from(self.data.body.len() as u64 + ENTRY_OVERHEAD).unwrap_or(u32::MAX)
    }
}

/// Where a hit came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    Memory,
    Disk,
}

impl Tier {
    #[must_use]
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Disk => "disk",
        }
    }
}

/// What a lookup found.
#[derive(Debug)]
enum Lookup {
    /// Servable as is.
    Fresh(Arc<Entry>, Tier),
    /// Present, but the backend must confirm the source ETag first.
    Stale(Arc<Entry>, Tier),
    Miss,
}

/// What the store answered to a pushdown's source read (the `fetch` of
/// [`TensorCache::get_or_compute`]).
#[derive(Debug)]
pub enum Fetched<S, R> {
    /// `304` to the `If-None-Match` of the cached source ETag that the fetch added itself: the
    /// cached output still holds. Carries the answer for when nothing is cached.
    NotModified(R),
    /// The source: its ETag, and what `compute` reads it from.
    Source { etag: String, source: S },
    /// Anything else (refused, not found, a `304` to the caller's own condition): passed to the
    /// caller as the store sent it.
    Answer(R),
}

/// How a read-through ended.
#[derive(Debug)]
pub enum ReadThrough<R, X> {
    /// Served from a tier; `revalidated` when the store confirmed the source on this request.
    Cached { entry: Arc<Entry>, tier: Tier, revalidated: bool },
    /// Computed on this request (and cached where the tier admits it), with what `compute` gave
    /// beside the output.
    Computed { data: Arc<Cached>, extra: X },
    /// The store's answer, passed through.
    Answer(R),
}

/// Counters per object stripe and per bucket stripe, by hash: what [`Generations`] and
/// [`Occupancy`] each keep.
#[derive(Debug)]
struct Stripes {
    objects: Box<[AtomicU64]>,
    buckets: Box<[AtomicU64]>,
    hasher: BuildHasherDefault<DefaultHasher>,
}

impl Stripes {
    fn new() -> Self {
        let counters = |n| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into_boxed_slice();
        Self {
            objects: counters(OBJECT_STRIPES),
            buckets: counters(BUCKET_STRIPES),
            hasher: BuildHasherDefault::default(),
        }
    }

    fn object_slot(&self, bucket: &str, key: &str) -> &AtomicU64 {
        &self.objects[(self.hasher.hash_one((bucket, key)) % OBJECT_STRIPES as u64) as usize]
    }

    fn bucket_slot(&self, bucket: &str) -> &AtomicU64 {
        &self.buckets[(self.hasher.hash_one(bucket) % BUCKET_STRIPES as u64) as usize]
    }
}

/// How many memory entries each object stripe and each bucket stripe holds: counted up before
/// an insert and down when the entry leaves (the eviction listener sees every departure:
/// replaced, invalidated, evicted, expired), so a count is never below the entries held. A write
/// to an object or bucket whose stripe holds none has nothing to free, and skips moka's
/// predicate invalidation: registering a predicate costs a random-number system call and a
/// concurrent map insert, and every registered predicate is tested against every entry, so on a
/// write-heavy node that never caches the written objects it was pure cost (ADR 0033).
#[derive(Debug)]
struct Occupancy(Stripes);

impl Occupancy {
    fn entered(&self, o: &ObjectId) {
        self.0.object_slot(&o.bucket, &o.key).fetch_add(1, Ordering::AcqRel);
        self.0.bucket_slot(&o.bucket).fetch_add(1, Ordering::AcqRel);
    }

    fn left(&self, o: &ObjectId) {
        // Saturating: a departure is never counted without its arrival, but a count must not wrap.
        let down = |c: &AtomicU64| {
            let _ = c.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        };
        down(self.0.object_slot(&o.bucket, &o.key));
        down(self.0.bucket_slot(&o.bucket));
    }

    fn object_may_hold(&self, bucket: &str, key: &str) -> bool {
        self.0.object_slot(bucket, key).load(Ordering::Acquire) > 0
    }

    fn bucket_may_hold(&self, bucket: &str) -> bool {
        self.0.bucket_slot(bucket).load(Ordering::Acquire) > 0
    }
}

/// Generation counters (rule 2 of the module docs).
#[derive(Debug)]
struct Generations(Stripes);

impl Generations {
    /// The sum of the object's and its bucket's counters: both only grow, so any bump changes it.
    fn current(&self, object: &ObjectId) -> u64 {
        self.0.object_slot(&object.bucket, &object.key).load(Ordering::Acquire)
            + self.0.bucket_slot(&object.bucket).load(Ordering::Acquire)
    }
}

/// The tensor cache. See the module docs.
#[derive(Debug)]
pub struct TensorCache {
    memory: Cache<CacheKey, Arc<Entry>>,
    memory_bytes: u64,
    policy: Policy,
    revalidate_after: Duration,
    generations: Generations,
    /// Which stripes hold memory entries (writes elsewhere have nothing to free).
    occupancy: Arc<Occupancy>,
    disk: Option<disk::DiskTier>,
    flights: Mutex<HashMap<CacheKey, Arc<tokio::sync::Mutex<()>>>>,
    /// Hashes of single-use keys requested once ([`Self::repeated`]).
    seen_once: Mutex<std::collections::HashSet<u64>>,
    metrics: Metrics,
}

/// Held while one request computes a key; others wanting the key wait, then find it cached.
#[derive(Debug)]
pub(crate) struct Flight<'a> {
    cache: &'a TensorCache,
    key: CacheKey,
    lock: Option<tokio::sync::OwnedMutexGuard<()>>,
}

impl Drop for Flight<'_> {
    fn drop(&mut self) {
        let mut flights = self.cache.flights.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(guard) = self.lock.take() {
            let mutex = tokio::sync::OwnedMutexGuard::mutex(&guard).clone();
            drop(guard);
            // The table's reference and ours: nobody else waits, so the slot can go.
            if Arc::strong_count(&mutex) == 2 {
                flights.remove(&self.key);
            }
        }
    }
}

/// What the store said of a cached entry's source when asked again
/// (`tensorgate_cache_revalidations_total{outcome}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Revalidation {
    /// The source's ETag is the entry's: the entry is served.
    Unchanged,
    /// The source changed: the entry goes and the output is computed again.
    Changed,
    /// The store refused this caller the source (transparent mode asks it per caller): the
    /// caller gets the store's answer and the entry stays.
    Refused,
    /// The source is gone (or answered otherwise): the entry goes.
    Gone,
}

impl Revalidation {
    fn label(self) -> &'static str {
        match self {
            Self::Unchanged => "unchanged",
            Self::Changed => "changed",
            Self::Refused => "refused",
            Self::Gone => "gone",
        }
    }
}

impl TensorCache {
    /// Builds the tiers; the disk tier's surviving entries are indexed (not yet read).
    ///
    /// # Errors
    /// The disk directory cannot be created or listed.
    pub fn new(cfg: &CacheConfig, metrics: Metrics) -> std::io::Result<Self> {
        let evictions = metrics.cache_evictions.clone();
        let occupancy = Arc::new(Occupancy(Stripes::new()));
        let held = occupancy.clone();
        let memory = Cache::builder()
            .max_capacity(cfg.memory_bytes)
            .time_to_idle(cfg.idle_expiry)
            .weigher(|_k: &CacheKey, v: &Arc<Entry>| v.weight())
            .eviction_policy(match cfg.policy {
                Policy::TinyLfu | Policy::Pin => EvictionPolicy::tiny_lfu(),
                Policy::Lru => EvictionPolicy::lru(),
            })
            .eviction_listener(move |k: Arc<CacheKey>, _v, cause| {
                held.left(&k.object);
                if cause.was_evicted() {
                    evictions.get_or_create(&crate::metrics::TierLabel { tier: "memory" }).inc();
                }
            })
            .support_invalidation_closures()
            .build();
        let disk = cfg.disk.as_ref().map(|d| disk::DiskTier::open(&d.dir, d.max_bytes, metrics.clone())).transpose()?;
        Ok(Self {
            memory,
            memory_bytes: cfg.memory_bytes,
            policy: cfg.policy,
            revalidate_after: cfg.revalidate_after,
            generations: Generations(Stripes::new()),
            occupancy,
            disk,
            flights: Mutex::new(HashMap::new()),
            seen_once: Mutex::new(std::collections::HashSet::new()),
            metrics,
        })
    }

    /// Whether `key` was asked for before: an output that is rarely wanted twice (an augmented
    /// one: every epoch draws anew, ADR 0032) is cached only from its second request (a retry, a
    /// second reader of the same seed), so that single-use outputs never crowd out the rest (or,
    /// under `pin`, fill the cache for good). The first request is noted and answered uncached.
    pub(crate) fn repeated(&self, key: &CacheKey) -> bool {
        let hash = BuildHasherDefault::<DefaultHasher>::default().hash_one(key);
        let mut seen = self.seen_once.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if seen.contains(&hash) {
            return true;
        }
        if seen.len() >= SEEN_ONCE {
            seen.clear();
        }
        seen.insert(hash);
        false
    }

    /// The generation an entry computed from a fetch starting now must carry.
    #[must_use]
    fn generation(&self, object: &ObjectId) -> u64 {
        self.generations.current(object)
    }

    /// Finds an entry in memory, then on disk (a disk hit is promoted to memory).
    async fn lookup(&self, key: &CacheKey) -> Lookup {
        let (entry, tier) = if let Some(e) = self.memory.get(key).await {
            (e, Tier::Memory)
        } else if let Some(disk) = &self.disk
            && let Some((data, generation)) = disk.get(key).await
        {
            // Never served unasked: a disk entry may predate a restart or an out-of-band write.
            let entry = Arc::new(Entry::new(data, generation.unwrap_or(0), None));
            self.admit(key.clone(), entry.clone()).await;
            (entry, Tier::Disk)
        } else {
            return Lookup::Miss;
        };
        let stamp = entry.stamp();
        let fresh = stamp.generation == self.generations.current(&key.object)
            && stamp.validated.is_some_and(|t| t.elapsed() <= self.revalidate_after);
        if fresh { Lookup::Fresh(entry, tier) } else { Lookup::Stale(entry, tier) }
    }

    /// Stores a freshly computed output, validated under `generation` (taken before the fetch).
    async fn insert(&self, key: CacheKey, data: Arc<Cached>, generation: u64) {
        self.admit(key.clone(), Arc::new(Entry::new(data.clone(), generation, Some(Instant::now())))).await;
        if let Some(disk) = &self.disk {
            disk.put(key, data, generation);
        }
    }

    async fn admit(&self, key: CacheKey, entry: Arc<Entry>) {
        if u64::from(entry.weight()) > self.memory_bytes {
            return;
        }
        if self.policy == Policy::Pin
            && !self.memory.contains_key(&key)
            && self.memory.weighted_size() + u64::from(entry.weight()) > self.memory_bytes
        {
            return;
        }
        self.occupancy.entered(&key.object);
        self.memory.insert(key, entry).await;
        self.metrics
            .cache_resident_bytes
            .get_or_create(&crate::metrics::TierLabel { tier: "memory" })
            .set(i64::try_from(self.memory.weighted_size()).unwrap_or(i64::MAX));
    }

    /// Drops an entry whose source changed or vanished.
    async fn remove(&self, key: &CacheKey) {
        self.memory.invalidate(key).await;
        if let Some(disk) = &self.disk {
            disk.remove(key);
        }
    }

    /// A write through the gateway changed (or may have changed) `bucket/key`.
    pub(crate) fn object_written(&self, bucket: &str, key: &str) {
        self.generations.0.object_slot(bucket, key).fetch_add(1, Ordering::AcqRel);
        // Frees the memory now; correctness already holds through the generation.
        if self.occupancy.object_may_hold(bucket, key) {
            let (b, k) = (bucket.to_owned(), key.to_owned());
            let _ = self.memory.invalidate_entries_if(move |ck, _| ck.object.bucket == b && ck.object.key == k);
        }
        if let Some(disk) = &self.disk {
            disk.remove_object(bucket, Some(key));
        }
    }

    /// A write changed an unknown set of objects in `bucket` (multi-object delete, bucket delete).
    pub(crate) fn bucket_written(&self, bucket: &str) {
        self.generations.0.bucket_slot(bucket).fetch_add(1, Ordering::AcqRel);
        if self.occupancy.bucket_may_hold(bucket) {
            let b = bucket.to_owned();
            let _ = self.memory.invalidate_entries_if(move |ck, _| ck.object.bucket == b);
        }
        if let Some(disk) = &self.disk {
            disk.remove_object(bucket, None);
        }
    }

    /// The read-through: the module's three rules in one call. A fresh entry is served without
    /// asking unless `ask_store` (the store decides who may read: then every answer follows the
    /// store's yes to this caller on this request). Otherwise one request per key goes on (the
    /// others wait, then look again): `fetch` reads the source, given the cached source ETag to
    /// add as an `If-None-Match` where the request allows it; an unchanged source serves the
    /// entry, a changed one is computed by `compute` and replaces it, and any other answer is
    /// passed through. A refusal under `ask_store` says nothing of the object, so the entry stays
    /// for other callers; without it (the gateway's own read) it means the source is gone.
    ///
    /// # Errors
    /// What `fetch` or `compute` fail with; nothing is cached then.
    pub async fn get_or_compute<S, R, X, E>(
        &self,
        key: &CacheKey,
        ask_store: bool,
        fetch: impl AsyncFnOnce(Option<&str>) -> Result<Fetched<S, R>, E>,
        compute: impl AsyncFnOnce(S) -> Result<(Arc<Cached>, X), E>,
    ) -> Result<ReadThrough<R, X>, E> {
        if let Lookup::Fresh(entry, tier) = self.lookup(key).await
            && !ask_store
        {
            return Ok(self.hit(entry, tier, false));
        }
        // One request per key fetches and computes; the rest wait here and then hit.
        let _flight = self.flight(key).await;
        // Taken before the fetch: a write that lands while it runs makes the result stale.
        let generation = self.generation(&key.object);
        let cached = match self.lookup(key).await {
            Lookup::Fresh(entry, tier) if !ask_store => return Ok(self.hit(entry, tier, false)),
            Lookup::Fresh(entry, tier) | Lookup::Stale(entry, tier) => Some((entry, tier)),
            Lookup::Miss => None,
        };
        let fetched = fetch(cached.as_ref().map(|(e, _)| e.data.source_etag.as_str())).await?;
        if let Some((entry, tier)) = cached {
            let outcome = match &fetched {
                Fetched::NotModified(_) => Revalidation::Unchanged,
                Fetched::Source { etag, .. } if *etag == entry.data.source_etag => Revalidation::Unchanged,
                Fetched::Source { .. } => Revalidation::Changed,
                Fetched::Answer(_) if ask_store => Revalidation::Refused,
                Fetched::Answer(_) => Revalidation::Gone,
            };
            let label = crate::metrics::OutcomeLabel { outcome: outcome.label() };
            self.metrics.cache_revalidations.get_or_create(&label).inc();
            match outcome {
                Revalidation::Unchanged => {
                    entry.validated(generation);
                    return Ok(self.hit(entry, tier, true));
                }
                // The caller may not read the source; the entry stays for those who may.
                Revalidation::Refused => {}
                Revalidation::Changed | Revalidation::Gone => self.remove(key).await,
            }
        }
        let source = match fetched {
            Fetched::Source { source, .. } => source,
            Fetched::NotModified(r) | Fetched::Answer(r) => return Ok(ReadThrough::Answer(r)),
        };
        let (data, extra) = compute(source).await?;
        self.metrics.cache_misses.inc();
        self.insert(key.clone(), data.clone(), generation).await;
        Ok(ReadThrough::Computed { data, extra })
    }

    /// The read-through where nothing may be cached (no cache, or an object under a customer
    /// key): `fetch` without a condition, then `compute`.
    ///
    /// # Errors
    /// What `fetch` or `compute` fail with.
    pub(crate) async fn uncached<S, R, X, E>(
        fetch: impl AsyncFnOnce(Option<&str>) -> Result<Fetched<S, R>, E>,
        compute: impl AsyncFnOnce(S) -> Result<(Arc<Cached>, X), E>,
    ) -> Result<ReadThrough<R, X>, E> {
        match fetch(None).await? {
            Fetched::Source { source, .. } => {
                let (data, extra) = compute(source).await?;
                Ok(ReadThrough::Computed { data, extra })
            }
            Fetched::NotModified(r) | Fetched::Answer(r) => Ok(ReadThrough::Answer(r)),
        }
    }

    /// Counts a request answered from a tier.
    fn hit<R, X>(&self, entry: Arc<Entry>, tier: Tier, revalidated: bool) -> ReadThrough<R, X> {
        let label = crate::metrics::TierLabel { tier: tier.name() };
        self.metrics.cache_hits.get_or_create(&label).inc();
        self.metrics.cache_served_bytes.get_or_create(&label).inc_by(entry.data.body.len() as u64);
        ReadThrough::Cached { entry, tier, revalidated }
    }

    /// Waits until no other request is computing `key`, then holds it. After this returns, look
    /// the key up again: the request that held it may have cached the output.
    async fn flight(&self, key: &CacheKey) -> Flight<'_> {
        let mutex = {
            let mut flights = self.flights.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            flights.entry(key.clone()).or_default().clone()
        };
        let lock = mutex.lock_owned().await;
        Flight { cache: self, key: key.clone(), lock: Some(lock) }
    }

    /// Waits for moka's pending maintenance (evictions, invalidation closures) and updates the
    /// memory tier's resident-bytes gauge; the admin port calls it on each scrape.
    pub async fn settle(&self) {
        self.memory.run_pending_tasks().await;
        let resident = i64::try_from(self.memory.weighted_size()).unwrap_or(i64::MAX);
        self.metrics.cache_resident_bytes.get_or_create(&crate::metrics::TierLabel { tier: "memory" }).set(resident);
    }

    /// Bytes held in memory (after [`Self::settle`], exact).
    #[must_use]
    #[cfg(test)]
    pub(crate) fn memory_resident(&self) -> u64 {
        self.memory.weighted_size()
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn key(k: &str) -> CacheKey {
        CacheKey {
            object: ObjectId { bucket: "b".into(), key: k.into(), query: String::new() },
            variant: "m|s|npy|f32".into(),
        }
    }

    fn data(n: usize) -> Cached {
        Cached {
            body: Bytes::from(vec![7u8; n]),
            content_type: "application/x-npy".into(),
            shape: vec![n / 4],
            split: "s".into(),
            dtype: "f32".into(),
            source_etag: "\"e\"".into(),
            source_last_modified: None,
            source_bytes: 10,
            augmented: None,
        }
    }

    fn cache(policy: Policy, memory_bytes: u64, revalidate_after: Duration) -> TensorCache {
        TensorCache::new(
            &CacheConfig { memory_bytes, policy, revalidate_after, idle_expiry: Duration::from_secs(3600), disk: None },
            Metrics::new(),
        )
        .expect("cache")
    }

    #[test]
    fn a_single_use_key_is_cached_from_its_second_request_on() {
        let c = cache(Policy::Pin, 1 << 20, Duration::ZERO);
        assert!(!c.repeated(&key("a")), "first: noted, not cached");
        assert!(c.repeated(&key("a")) && c.repeated(&key("a")), "then: through the cache");
        assert!(!c.repeated(&key("b")));
        for i in 0..SEEN_ONCE {
            c.repeated(&key(&format!("k{i}")));
        }
        assert!(c.seen_once.lock().expect("lock").len() <= SEEN_ONCE, "bounded");
    }

    #[tokio::test]
    async fn fresh_within_the_window_stale_after_a_write() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60));
        let k = key("x");
        assert!(matches!(c.lookup(&k).await, Lookup::Miss));
        let g = c.generation(&k.object);
        c.insert(k.clone(), Arc::new(data(64)), g).await;
        assert!(matches!(c.lookup(&k).await, Lookup::Fresh(_, Tier::Memory)));
        c.object_written("b", "x");
        match c.lookup(&k).await {
            Lookup::Stale(e, _) => e.validated(c.generation(&k.object)),
            Lookup::Miss => {} // invalidation already ran
            Lookup::Fresh(..) => panic!("served after a write without revalidation"),
        }
        c.bucket_written("b");
        assert!(!matches!(c.lookup(&k).await, Lookup::Fresh(..)));
    }

    #[tokio::test]
    async fn a_write_frees_entries_only_where_its_stripe_holds_some() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60));
        let k = key("held");
        c.object_written("b", "held");
        assert!(!c.occupancy.object_may_hold("b", "held") && !c.occupancy.bucket_may_hold("b"));
        let g = c.generation(&k.object);
        c.insert(k.clone(), Arc::new(data(64)), g).await;
        c.insert(k.clone(), Arc::new(data(64)), g).await; // the first entry leaves, replaced
        c.settle().await;
        assert!(c.occupancy.object_may_hold("b", "held") && c.occupancy.bucket_may_hold("b"));
        c.object_written("b", "held");
        for _ in 0..10 {
            c.settle().await;
        }
        assert_eq!(c.memory_resident(), 0, "the write freed the entry");
        assert!(
            !c.occupancy.object_may_hold("b", "held") && !c.occupancy.bucket_may_hold("b"),
            "every arrival and departure counted"
        );
        c.insert(k.clone(), Arc::new(data(64)), c.generation(&k.object)).await;
        c.bucket_written("b");
        for _ in 0..10 {
            c.settle().await;
        }
        assert_eq!(c.memory_resident(), 0, "a bucket-wide write frees it too");
        assert!(!c.occupancy.bucket_may_hold("b"));
    }

    #[tokio::test]
    async fn an_insert_racing_a_write_is_never_fresh() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60));
        let k = key("race");
        let before_fetch = c.generation(&k.object);
        c.object_written("b", "race"); // the write lands while the old bytes are being computed
        c.insert(k.clone(), Arc::new(data(64)), before_fetch).await;
        assert!(matches!(c.lookup(&k).await, Lookup::Stale(..)));
    }

    #[tokio::test]
    async fn zero_window_always_revalidates() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::ZERO);
        let k = key("z");
        let g = c.generation(&k.object);
        c.insert(k.clone(), Arc::new(data(64)), g).await;
        std::thread::sleep(Duration::from_millis(2));
        assert!(matches!(c.lookup(&k).await, Lookup::Stale(..)));
    }

    #[tokio::test]
    async fn pin_keeps_the_first_entries() {
        let c = cache(Policy::Pin, 10 * (1000 + ENTRY_OVERHEAD), Duration::from_secs(60));
        for i in 0..20 {
            let k = key(&i.to_string());
            c.insert(k.clone(), Arc::new(data(1000)), c.generation(&k.object)).await;
            c.settle().await;
        }
        assert!(matches!(c.lookup(&key("0")).await, Lookup::Fresh(..)));
        assert!(matches!(c.lookup(&key("19")).await, Lookup::Miss));
        assert!(c.memory_resident() <= 10 * (1000 + ENTRY_OVERHEAD));
    }

    /// A source the test's "store" answers with: its ETag, or a refusal.
    type Store = Result<&'static str, u16>;

    /// One read-through of `k` against a store answering `store`; returns how it ended and the
    /// condition the fetch was given.
    async fn read(c: &TensorCache, k: &CacheKey, ask: bool, store: Store) -> (ReadThrough<u16, ()>, Option<String>) {
        let mut asked = None;
        let r = c
            .get_or_compute(
                k,
                ask,
                async |cond: Option<&str>| {
                    asked = cond.map(str::to_owned);
                    Ok::<_, ()>(match store {
                        Ok(etag) if cond == Some(etag) => Fetched::NotModified(304),
                        Ok(etag) => Fetched::Source { etag: etag.to_owned(), source: etag },
                        Err(status) => Fetched::Answer(status),
                    })
                },
                async |etag: &str| Ok((Arc::new(Cached { source_etag: etag.to_owned(), ..data(64) }), ())),
            )
            .await
            .expect("read-through");
        (r, asked)
    }

    fn outcome(r: &ReadThrough<u16, ()>) -> &'static str {
        match r {
            ReadThrough::Cached { revalidated: false, .. } => "hit",
            ReadThrough::Cached { revalidated: true, .. } => "revalidated",
            ReadThrough::Computed { .. } => "computed",
            ReadThrough::Answer(_) => "answer",
        }
    }

    #[tokio::test]
    async fn read_through_serves_fresh_entries_unasked_only_when_the_gateway_decides() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60));
        let k = key("r");
        let (r, asked) = read(&c, &k, false, Ok("\"e1\"")).await;
        assert_eq!((outcome(&r), asked), ("computed", None));
        let (r, asked) = read(&c, &k, false, Ok("\"e1\"")).await;
        assert_eq!((outcome(&r), asked), ("hit", None), "fresh within the window: no fetch");
        // The store decides: even a fresh entry is served only after its yes on this request.
        let (r, asked) = read(&c, &k, true, Ok("\"e1\"")).await;
        assert_eq!((outcome(&r), asked.as_deref()), ("revalidated", Some("\"e1\"")));
    }

    #[tokio::test]
    async fn a_refusal_passes_through_and_keeps_the_entry_for_others() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::ZERO);
        let k = key("p");
        read(&c, &k, true, Ok("\"e1\"")).await;
        let (r, _) = read(&c, &k, true, Err(403)).await;
        assert!(matches!(r, ReadThrough::Answer(403)), "{}", outcome(&r));
        let (r, _) = read(&c, &k, true, Ok("\"e1\"")).await;
        assert_eq!(outcome(&r), "revalidated", "another caller still gets the entry");
        // The gateway's own read refused (or not found): the source is gone, the entry with it.
        let (r, _) = read(&c, &k, false, Err(404)).await;
        assert!(matches!(r, ReadThrough::Answer(404)));
        let (r, asked) = read(&c, &k, false, Ok("\"e1\"")).await;
        assert_eq!((outcome(&r), asked), ("computed", None));
    }

    #[tokio::test]
    async fn a_changed_source_is_computed_again_and_replaces_the_entry() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::ZERO);
        let k = key("c");
        read(&c, &k, false, Ok("\"e1\"")).await;
        let (r, asked) = read(&c, &k, false, Ok("\"e2\"")).await;
        assert_eq!((outcome(&r), asked.as_deref()), ("computed", Some("\"e1\"")));
        let (r, asked) = read(&c, &k, false, Ok("\"e2\"")).await;
        assert_eq!((outcome(&r), asked.as_deref()), ("revalidated", Some("\"e2\"")));
        // A 200 whose ETag is the cached one (a store that ignored the condition) also serves it.
        let (r, _) = c
            .get_or_compute(
                &k,
                true,
                async |_| Ok::<_, ()>(Fetched::<(), u16>::Source { etag: "\"e2\"".into(), source: () }),
                async |()| -> Result<(Arc<Cached>, ()), ()> { panic!("computed although unchanged") },
            )
            .await
            .map(|r| (outcome(&r), ()))
            .expect("read-through");
        assert_eq!(r, "revalidated");
        let m = c.metrics.cache_revalidations.get_or_create(&crate::metrics::OutcomeLabel { outcome: "changed" }).get();
        assert_eq!(m, 1);
    }

    #[tokio::test]
    async fn a_failed_computation_caches_nothing() {
        let c = cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60));
        let k = key("f");
        let failed = c
            .get_or_compute(
                &k,
                false,
                async |_| Ok::<_, &str>(Fetched::<(), u16>::Source { etag: "\"e\"".into(), source: () }),
                async |()| -> Result<(Arc<Cached>, ()), &str> { Err("bad input") },
            )
            .await;
        assert_eq!(failed.err(), Some("bad input"));
        assert!(matches!(c.lookup(&k).await, Lookup::Miss));
    }

    #[tokio::test]
    async fn concurrent_misses_on_one_key_compute_once() {
        let c = Arc::new(cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60)));
        let running = Arc::new(AtomicU64::new(0));
        let computed = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (c, running, computed) = (c.clone(), running.clone(), computed.clone());
                tokio::spawn(async move {
                    let r = c
                        .get_or_compute(
                            &key("f"),
                            false,
                            async |_| Ok::<_, ()>(Fetched::<(), ()>::Source { etag: "\"e\"".into(), source: () }),
                            async |()| {
                                assert_eq!(running.fetch_add(1, Ordering::SeqCst), 0, "two computations at once");
                                tokio::time::sleep(Duration::from_millis(5)).await;
                                computed.fetch_add(1, Ordering::SeqCst);
                                running.fetch_sub(1, Ordering::SeqCst);
                                Ok((Arc::new(data(64)), ()))
                            },
                        )
                        .await
                        .expect("read-through");
                    matches!(r, ReadThrough::Computed { .. })
                })
            })
            .collect();
        let mut computing = 0;
        for t in tasks {
            computing += usize::from(t.await.expect("task"));
        }
        assert_eq!((computed.load(Ordering::SeqCst), computing), (1, 1));
        assert!(c.flights.lock().expect("lock").is_empty(), "flight slots leak");
    }
}
