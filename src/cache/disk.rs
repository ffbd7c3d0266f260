//! The disk tier: one file per output, so a dataset larger than memory still skips recomputation.
//!
//! File layout: `TGC1`, a little-endian `u32` header length, the JSON header ([`Header`]: the key,
//! the response fields, the body length and its CRC-32), then the body. Files are written to a
//! temporary name and renamed, so a crash leaves either a whole entry or a stray temporary file
//! (removed at start). At start only headers are read (the index); a body's CRC is checked on every
//! read, and an entry that fails any check is deleted and treated as a miss. Entries that survive a
//! restart carry no validation, so their first use asks the backend to confirm the source ETag.
//!
//! Admission is first come, first kept (no eviction): on the epoch scans this tier exists for,
//! keeping the first part of the dataset resident beats replacing it (see `docs/BENCHMARKS.md`).
//! Entries leave when their object is written through the gateway or found changed.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::key::{CacheKey, Cached, ObjectId};
use crate::metrics::{Metrics, TierLabel};

const MAGIC: &[u8; 4] = b"TGC1";
const SUFFIX: &str = "tgc";
/// Largest header accepted when indexing; a larger one means the file is not ours or is damaged.
const MAX_HEADER_BYTES: u32 = 1 << 20;

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    key: CacheKey,
    meta: Cached,
    body_len: u64,
    body_crc32: u32,
}

#[derive(Debug, Clone)]
struct Slot {
    path: PathBuf,
    bytes: u64,
    /// The generation the entry was validated under in this process; `None` after a restart.
    generation: Option<u64>,
}

/// Keys are ordered by (bucket, key, ...) so all entries of an object or bucket are one range.
type Index = BTreeMap<CacheKey, Slot>;

#[derive(Debug)]
pub(crate) struct DiskTier {
    dir: PathBuf,
    max_bytes: u64,
    used: Arc<AtomicU64>,
    index: Arc<Mutex<Index>>,
    metrics: Metrics,
}

fn file_name(key: &CacheKey) -> String {
    let id = serde_json::to_vec(key).unwrap_or_default();
    format!("{}.{SUFFIX}", crate::s3::sigv4::sha256_hex(&id))
}

fn lock(index: &Mutex<Index>) -> std::sync::MutexGuard<'_, Index> {
    index.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl DiskTier {
    /// Opens (creating) the directory and indexes the entries whose headers check out.
    ///
    /// # Errors
    /// The directory cannot be created or listed.
    pub(crate) fn open(dir: &Path, max_bytes: u64, metrics: Metrics) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let mut index = Index::new();
        let mut used = 0u64;
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().and_then(|e| e.to_str()) != Some(SUFFIX) {
                if path.extension().and_then(|e| e.to_str()) == Some("tmp") {
                    let _ = std::fs::remove_file(&path);
                }
                continue;
            }
            match read_header(&path) {
                Ok((header, bytes))
                    if used + bytes <= max_bytes && path.file_name() == Some(file_name(&header.key).as_ref()) =>
                {
                    used += bytes;
                    index.insert(header.key, Slot { path, bytes, generation: None });
                }
                _ => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        tracing::info!(dir = %dir.display(), entries = index.len(), bytes = used, "Disk cache indexed.");
        let tier = Self {
            dir: dir.to_owned(),
            max_bytes,
            used: Arc::new(AtomicU64::new(used)),
            index: Arc::new(Mutex::new(index)),
            metrics,
        };
        tier.report();
        Ok(tier)
    }

    fn report(&self) {
        let v = i64::try_from(self.used.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
        self.metrics.cache_resident_bytes.get_or_create(&TierLabel { tier: "disk" }).set(v);
    }

    /// Reads an entry (on a blocking thread), checking its integrity.
    pub(crate) async fn get(&self, key: &CacheKey) -> Option<(Arc<Cached>, Option<u64>)> {
        let slot = lock(&self.index).get(key).cloned()?;
        let path = slot.path.clone();
        let read = tokio::task::spawn_blocking(move || read_entry(&path)).await.ok();
        match read {
            Some(Ok((found, data))) if found == *key => Some((Arc::new(data), slot.generation)),
            other => {
                if let Some(Err(e)) = other {
                    tracing::warn!(path = %slot.path.display(), error = %e, "Disk cache entry failed its check; dropped.");
                }
                self.metrics.cache_corrupt.inc();
                self.remove(key);
                None
            }
        }
    }

    /// Writes an entry in the background if it fits (first come, first kept).
    pub(crate) fn put(&self, key: CacheKey, data: Arc<Cached>, generation: u64) {
        let bytes = data.body.len() as u64 + 4096;
        let reserved = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| (u + bytes <= self.max_bytes).then_some(u + bytes));
        if reserved.is_err() || lock(&self.index).contains_key(&key) {
            if reserved.is_ok() {
                self.used.fetch_sub(bytes, Ordering::AcqRel);
            }
            return;
        }
        let path = self.dir.join(file_name(&key));
        let (index, used, metrics) = (self.index.clone(), self.used.clone(), self.metrics.clone());
        tokio::task::spawn_blocking(move || {
            match write_entry(&path, &key, &data) {
                Ok(()) => {
                    if let Some(old) = lock(&index).insert(key, Slot { path, bytes, generation: Some(generation) }) {
                        used.fetch_sub(old.bytes, Ordering::AcqRel);
                    }
                }
                Err(e) => {
                    used.fetch_sub(bytes, Ordering::AcqRel);
                    tracing::warn!(path = %path.display(), error = %e, "Disk cache write failed.");
                }
            }
            let v = i64::try_from(used.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
            metrics.cache_resident_bytes.get_or_create(&TierLabel { tier: "disk" }).set(v);
        });
    }

    /// Deletes one entry.
    pub(crate) fn remove(&self, key: &CacheKey) {
        let slot = lock(&self.index).remove(key);
        if let Some(slot) = slot {
            self.discard(vec![slot]);
        }
    }

    /// Deletes every entry of an object (`Some(key)`) or of a whole bucket (`None`).
    pub(crate) fn remove_object(&self, bucket: &str, key: Option<&str>) {
        let slots: Vec<Slot> = {
            let mut index = lock(&self.index);
            let from = CacheKey {
                object: ObjectId {
                    bucket: bucket.to_owned(),
                    key: key.unwrap_or_default().to_owned(),
                    query: String::new(),
                },
                variant: String::new(),
            };
            let doomed: Vec<CacheKey> = index
                .range(from..)
                .map(|(k, _)| k)
                .take_while(|k| k.object.bucket == bucket && key.is_none_or(|o| k.object.key == o))
                .cloned()
                .collect();
            doomed.iter().filter_map(|k| index.remove(k)).collect()
        };
        if !slots.is_empty() {
            self.discard(slots);
        }
    }

    fn discard(&self, slots: Vec<Slot>) {
        let freed: u64 = slots.iter().map(|s| s.bytes).sum();
        self.used.fetch_sub(freed, Ordering::AcqRel);
        self.report();
        drop(tokio::task::spawn_blocking(move || {
            for s in slots {
                let _ = std::fs::remove_file(&s.path);
            }
        }));
    }
}

fn read_header(path: &Path) -> std::io::Result<(Header, u64)> {
    let mut f = std::fs::File::open(path)?;
    let file_len = f.metadata()?.len();
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix)?;
    let header_len = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
    if &prefix[..4] != MAGIC || header_len > MAX_HEADER_BYTES {
        return Err(std::io::Error::other("not a cache entry"));
    }
    let mut raw = vec![0u8; header_len as usize];
    f.read_exact(&mut raw)?;
    let header: Header = serde_json::from_slice(&raw).map_err(std::io::Error::other)?;
    if 8 + u64::from(header_len) + header.body_len != file_len {
        return Err(std::io::Error::other("truncated cache entry"));
    }
    Ok((header, file_len))
}

fn read_entry(path: &Path) -> std::io::Result<(CacheKey, Cached)> {
    parse_entry(&std::fs::read(path)?)
}

/// An entry file's key and output (with its body), every length and the body's CRC checked.
/// Pure: the disk tier's whole trust boundary for bytes it finds on disk (fuzzed).
///
/// # Errors
/// Anything that is not a whole, undamaged entry.
pub fn parse_entry(bytes: &[u8]) -> std::io::Result<(CacheKey, Cached)> {
    let bad = || std::io::Error::other("damaged cache entry");
    let header_len = bytes.get(4..8).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize).ok_or_else(bad)?;
    if bytes.get(..4) != Some(MAGIC.as_slice()) {
        return Err(bad());
    }
    let body_at = header_len.checked_add(8).ok_or_else(bad)?;
    let header: Header =
        serde_json::from_slice(bytes.get(8..body_at).ok_or_else(bad)?).map_err(std::io::Error::other)?;
    let body = &bytes[body_at..];
    if body.len() as u64 != header.body_len || crc32fast::hash(body) != header.body_crc32 {
        return Err(bad());
    }
    let mut data = header.meta;
    data.body = Bytes::copy_from_slice(body);
    Ok((header.key, data))
}

fn write_entry(path: &Path, key: &CacheKey, data: &Cached) -> std::io::Result<()> {
    let header = Header {
        key: key.clone(),
        meta: data.clone(),
        body_len: data.body.len() as u64,
        body_crc32: crc32fast::hash(&data.body),
    };
    let raw = serde_json::to_vec(&header).map_err(std::io::Error::other)?;
    let header_len = u32::try_from(raw.len()).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("tmp");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(MAGIC)?;
        f.write_all(&header_len.to_le_bytes())?;
        f.write_all(&raw)?;
        f.write_all(&data.body)?;
        f.into_inner().map_err(std::io::IntoInnerError::into_error)?.sync_data()?;
    }
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::ObjectId;

    fn key(k: &str) -> CacheKey {
        CacheKey { object: ObjectId { bucket: "b".into(), key: k.into(), query: String::new() }, variant: "v".into() }
    }

    fn data() -> Arc<Cached> {
        Arc::new(Cached {
            body: Bytes::from_static(b"0123456789"),
            content_type: "application/x-npy".into(),
            shape: vec![10],
            split: "s".into(),
            dtype: "f32".into(),
            source_etag: "\"e\"".into(),
            source_last_modified: Some("Sun, 29 Nov 2026 20:00:00 GMT".into()),
            source_bytes: 99,
            augmented: None,
        })
    }

    async fn written(tier: &DiskTier, k: &CacheKey) {
        for _ in 0..200 {
            if lock(&tier.index).contains_key(k) {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        panic!("entry never written");
    }

    #[tokio::test]
    async fn entries_survive_a_restart_unvalidated_and_damage_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = DiskTier::open(dir.path(), 1 << 20, Metrics::new()).expect("open");
        let (a, b) = (key("a"), key("b"));
        tier.put(a.clone(), data(), 3);
        tier.put(b.clone(), data(), 3);
        written(&tier, &a).await;
        written(&tier, &b).await;
        let (got, generation) = tier.get(&a).await.expect("hit");
        assert_eq!((got.body.as_ref(), got.source_bytes, generation), (&b"0123456789"[..], 99, Some(3)));

        // Flip one body byte of b's file; truncate nothing.
        let path = dir.path().join(file_name(&b));
        let mut raw = std::fs::read(&path).expect("read");
        let last = raw.len() - 1;
        raw[last] ^= 1;
        std::fs::write(&path, raw).expect("write");
        std::fs::write(dir.path().join("junk.tgc"), b"not ours").expect("junk");
        drop(tier);

        let tier = DiskTier::open(dir.path(), 1 << 20, Metrics::new()).expect("reopen");
        assert!(!dir.path().join("junk.tgc").exists(), "foreign file kept");
        let (_, generation) = tier.get(&a).await.expect("a survives");
        assert_eq!(generation, None, "a restarted entry must revalidate");
        assert!(tier.get(&b).await.is_none(), "damaged body served");
        // Deletion runs on a blocking thread.
        for _ in 0..200 {
            if !path.exists() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert!(!path.exists(), "damaged entry left on disk");
    }

    #[tokio::test]
    async fn full_tier_keeps_what_it_has_and_invalidation_frees() {
        let dir = tempfile::tempdir().expect("tempdir");
        let tier = DiskTier::open(dir.path(), 2 * (10 + 4096), Metrics::new()).expect("open");
        for k in ["a", "b", "c"] {
            tier.put(key(k), data(), 0);
        }
        written(&tier, &key("a")).await;
        written(&tier, &key("b")).await;
        assert!(tier.get(&key("c")).await.is_none());
        tier.remove_object("b", Some("a"));
        assert!(tier.get(&key("a")).await.is_none());
        tier.put(key("c"), data(), 0);
        written(&tier, &key("c")).await;
        tier.remove_object("b", None);
        assert_eq!(tier.used.load(Ordering::SeqCst), 0);
    }
}
