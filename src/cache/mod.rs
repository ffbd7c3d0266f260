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
//! Concurrent misses on one key compute once ([`TensorCache::flight`]).

pub mod disk;

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher, Hash};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use moka::future::Cache;
use moka::policy::EvictionPolicy;
use serde::{Deserialize, Serialize};

use crate::metrics::Metrics;

/// Generation counters per object, striped by hash: a write bumps its stripe, which forces every
/// entry of every object in the stripe to revalidate once. 4096 stripes keep false sharing of a
/// bump rare while costing 32 KiB.
const OBJECT_STRIPES: usize = 4096;
/// Generation counters per bucket (multi-object deletes, bucket deletion).
const BUCKET_STRIPES: usize = 256;
/// Bookkeeping bytes charged per memory entry on top of the tensor (key, headers, moka node).
const ENTRY_OVERHEAD: u64 = 512;

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
    pub dir: PathBuf,
    pub max_bytes: u64,
}

/// The object an output was computed from: bucket, key, and the forwarded query (a `versionId`,
/// `partNumber` or response override names different bytes).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectId {
    pub bucket: String,
    pub key: String,
    pub query: String,
}

/// Everything that determines an output besides the object's content: the object, and the
/// variant (model digest, split, format, dtype; the model digest covers the preprocessing, which
/// is part of the verified manifest).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CacheKey {
    pub object: ObjectId,
    pub variant: String,
}

/// A computed output and what its response needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cached {
    #[serde(skip)]
    pub body: Bytes,
    pub content_type: String,
    pub shape: Vec<usize>,
    pub split: String,
    pub dtype: String,
    /// The ETag of the source object the output was computed from.
    pub source_etag: String,
    pub source_last_modified: Option<String>,
    pub source_bytes: u64,
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
    pub data: Arc<Cached>,
    stamp: Mutex<Stamp>,
}

impl Entry {
    fn new(data: Arc<Cached>, generation: u64, validated: Option<Instant>) -> Self {
        Self { data, stamp: Mutex::new(Stamp { generation, validated }) }
    }

    fn stamp(&self) -> Stamp {
        *self.stamp.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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
    pub fn name(self) -> &'static str {
        match self {
            Self::Memory => "memory",
            Self::Disk => "disk",
        }
    }
}

/// What a lookup found.
#[derive(Debug)]
pub enum Lookup {
    /// Servable as is.
    Fresh(Arc<Entry>, Tier),
    /// Present, but the backend must confirm the source ETag first.
    Stale(Arc<Entry>, Tier),
    Miss,
}

/// Generation counters (rule 2 of the module docs).
#[derive(Debug)]
struct Generations {
    objects: Box<[AtomicU64]>,
    buckets: Box<[AtomicU64]>,
    hasher: BuildHasherDefault<DefaultHasher>,
}

impl Generations {
    fn new() -> Self {
        let counters = |n| (0..n).map(|_| AtomicU64::new(0)).collect::<Vec<_>>().into_boxed_slice();
        Self {
            objects: counters(OBJECT_STRIPES),
            buckets: counters(BUCKET_STRIPES),
            hasher: BuildHasherDefault::default(),
        }
    }

    fn object_slot(&self, bucket: &str, key: &str) -> &AtomicU64 {
        let h = self.hasher.hash_one((bucket, key));
        &self.objects[(h % OBJECT_STRIPES as u64) as usize]
    }

    fn bucket_slot(&self, bucket: &str) -> &AtomicU64 {
        let h = self.hasher.hash_one(bucket);
        &self.buckets[(h % BUCKET_STRIPES as u64) as usize]
    }

    /// The sum of the object's and its bucket's counters: both only grow, so any bump changes it.
    fn current(&self, object: &ObjectId) -> u64 {
        self.object_slot(&object.bucket, &object.key).load(Ordering::Acquire)
            + self.bucket_slot(&object.bucket).load(Ordering::Acquire)
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
    disk: Option<disk::DiskTier>,
    flights: Mutex<HashMap<CacheKey, Arc<tokio::sync::Mutex<()>>>>,
    metrics: Metrics,
}

/// Held while one request computes a key; others wanting the key wait, then find it cached.
#[derive(Debug)]
pub struct Flight<'a> {
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

impl TensorCache {
    /// Builds the tiers; the disk tier's surviving entries are indexed (not yet read).
    ///
    /// # Errors
    /// The disk directory cannot be created or listed.
    pub fn new(cfg: &CacheConfig, metrics: Metrics) -> std::io::Result<Self> {
        let evictions = metrics.cache_evictions.clone();
        let memory = Cache::builder()
            .max_capacity(cfg.memory_bytes)
            .time_to_idle(cfg.idle_expiry)
            .weigher(|_k: &CacheKey, v: &Arc<Entry>| v.weight())
            .eviction_policy(match cfg.policy {
                Policy::TinyLfu | Policy::Pin => EvictionPolicy::tiny_lfu(),
                Policy::Lru => EvictionPolicy::lru(),
            })
            .eviction_listener(move |_k, _v, cause| {
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
            generations: Generations::new(),
            disk,
            flights: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// The generation an entry computed from a fetch starting now must carry.
    #[must_use]
    pub fn generation(&self, object: &ObjectId) -> u64 {
        self.generations.current(object)
    }

    /// Finds an entry in memory, then on disk (a disk hit is promoted to memory).
    pub async fn lookup(&self, key: &CacheKey) -> Lookup {
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

    /// Records that the backend confirmed the entry's source ETag under `generation`.
    pub fn validated(&self, entry: &Entry, generation: u64) {
        let mut s = entry.stamp.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if generation >= s.generation {
            *s = Stamp { generation, validated: Some(Instant::now()) };
        }
    }

    /// Stores a freshly computed output, validated under `generation` (taken before the fetch).
    pub async fn insert(&self, key: CacheKey, data: Arc<Cached>, generation: u64) -> Arc<Entry> {
        let entry = Arc::new(Entry::new(data, generation, Some(Instant::now())));
        self.admit(key.clone(), entry.clone()).await;
        if let Some(disk) = &self.disk {
            disk.put(key, entry.data.clone(), generation);
        }
        entry
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
        self.memory.insert(key, entry).await;
        self.metrics
            .cache_resident_bytes
            .get_or_create(&crate::metrics::TierLabel { tier: "memory" })
            .set(i64::try_from(self.memory.weighted_size()).unwrap_or(i64::MAX));
    }

    /// Drops an entry whose source changed or vanished.
    pub async fn remove(&self, key: &CacheKey) {
        self.memory.invalidate(key).await;
        if let Some(disk) = &self.disk {
            disk.remove(key);
        }
    }

    /// A write through the gateway changed (or may have changed) `bucket/key`.
    pub fn object_written(&self, bucket: &str, key: &str) {
        self.generations.object_slot(bucket, key).fetch_add(1, Ordering::AcqRel);
        let (b, k) = (bucket.to_owned(), key.to_owned());
        // Frees the memory now; correctness already holds through the generation.
        let _ = self.memory.invalidate_entries_if(move |ck, _| ck.object.bucket == b && ck.object.key == k);
        if let Some(disk) = &self.disk {
            disk.remove_object(bucket, Some(key));
        }
    }

    /// A write changed an unknown set of objects in `bucket` (multi-object delete, bucket delete).
    pub fn bucket_written(&self, bucket: &str) {
        self.generations.bucket_slot(bucket).fetch_add(1, Ordering::AcqRel);
        let b = bucket.to_owned();
        let _ = self.memory.invalidate_entries_if(move |ck, _| ck.object.bucket == b);
        if let Some(disk) = &self.disk {
            disk.remove_object(bucket, None);
        }
    }

    /// Waits until no other request is computing `key`, then holds it. After this returns, look
    /// the key up again: the request that held it may have cached the output.
    pub async fn flight(&self, key: &CacheKey) -> Flight<'_> {
        let mutex = {
            let mut flights = self.flights.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            flights.entry(key.clone()).or_default().clone()
        };
        let lock = mutex.lock_owned().await;
        Flight { cache: self, key: key.clone(), lock: Some(lock) }
    }

    /// Counts a request answered from a tier.
    pub fn record_hit(&self, tier: Tier, bytes: usize) {
        let label = crate::metrics::TierLabel { tier: tier.name() };
        self.metrics.cache_hits.get_or_create(&label).inc();
        self.metrics.cache_served_bytes.get_or_create(&label).inc_by(bytes as u64);
    }

    /// Counts a conditional GET's outcome: `unchanged`, `changed` or `gone`.
    pub fn record_revalidation(&self, outcome: &'static str) {
        self.metrics.cache_revalidations.get_or_create(&crate::metrics::OutcomeLabel { outcome }).inc();
    }

    pub fn record_miss(&self) {
        self.metrics.cache_misses.inc();
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
    pub fn memory_resident(&self) -> u64 {
        self.memory.weighted_size()
    }
}

#[cfg(test)]
mod tests {
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
        }
    }

    fn cache(policy: Policy, memory_bytes: u64, revalidate_after: Duration) -> TensorCache {
        TensorCache::new(
            &CacheConfig { memory_bytes, policy, revalidate_after, idle_expiry: Duration::from_secs(3600), disk: None },
            Metrics::new(),
        )
        .expect("cache")
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
            Lookup::Stale(e, _) => c.validated(&e, c.generation(&k.object)),
            Lookup::Miss => {} // invalidation already ran
            Lookup::Fresh(..) => panic!("served after a write without revalidation"),
        }
        c.bucket_written("b");
        assert!(!matches!(c.lookup(&k).await, Lookup::Fresh(..)));
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

    #[tokio::test]
    async fn concurrent_flights_on_one_key_run_one_at_a_time() {
        let c = Arc::new(cache(Policy::TinyLfu, 1 << 20, Duration::from_secs(60)));
        let running = Arc::new(AtomicU64::new(0));
        let computed = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let (c, running, computed) = (c.clone(), running.clone(), computed.clone());
                tokio::spawn(async move {
                    let k = key("f");
                    let _f = c.flight(&k).await;
                    if matches!(c.lookup(&k).await, Lookup::Fresh(..)) {
                        return;
                    }
                    assert_eq!(running.fetch_add(1, Ordering::SeqCst), 0, "two computations at once");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    c.insert(k.clone(), Arc::new(data(64)), 0).await;
                    computed.fetch_add(1, Ordering::SeqCst);
                    running.fetch_sub(1, Ordering::SeqCst);
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("task");
        }
        assert_eq!(computed.load(Ordering::SeqCst), 1);
        assert!(c.flights.lock().expect("lock").is_empty(), "flight slots leak");
    }
}
