//! Hit rate of the tensor cache's memory-tier policies on epoch scans: a dataset of N equal-size
//! tensors read once per epoch, in a fresh random order each epoch (a shuffling data loader) and
//! in a fixed order, at 0.5x, 1.5x and 3x the tier's capacity. Epoch 1 only fills the cache, so
//! the rate is over epochs 2-5. Run: `cargo bench --bench cache_policy`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use tensorgate::cache::{CacheConfig, CacheKey, Cached, Fetched, ObjectId, Policy, ReadThrough, TensorCache};
use tensorgate::metrics::Metrics;

/// A ResNet-18 `layer4` output in f32: 512 x 7 x 7 x 4 bytes.
const TENSOR_BYTES: usize = 512 * 7 * 7 * 4;
/// Tensors the memory tier holds.
const CAPACITY: usize = 400;
const EPOCHS: usize = 5;

fn key(i: usize) -> CacheKey {
    CacheKey {
        object: ObjectId { bucket: "data".into(), key: format!("{i:06}.jpg"), query: String::new() },
        variant: "resnet18|layer4|npy|f32".into(),
    }
}

async fn run(policy: Policy, n: usize, shuffle: bool, body: &Bytes) -> f64 {
    let cfg = CacheConfig {
        // Capacity counts the per-entry charge (512 bytes) as the gateway does.
        memory_bytes: (CAPACITY * (TENSOR_BYTES + 512)) as u64,
        policy,
        revalidate_after: Duration::from_secs(3600),
        idle_expiry: Duration::from_secs(3600),
        disk: None,
    };
    let cache = TensorCache::new(&cfg, Metrics::new()).expect("cache");
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut hits, mut reads) = (0usize, 0usize);
    for epoch in 0..EPOCHS {
        if shuffle {
            order.shuffle(&mut rng);
        }
        for &i in &order {
            let k = key(i);
            // Through the gateway's own read-through: a miss "fetches" a source and computes.
            let read = cache
                .get_or_compute(
                    &k,
                    false,
                    async |_| Ok::<_, ()>(Fetched::<(), ()>::Source { etag: "\"e\"".into(), source: () }),
                    async |()| {
                        let data = Cached {
                            body: body.clone(),
                            content_type: "application/x-npy".into(),
                            shape: vec![512, 7, 7],
                            split: "layer4".into(),
                            dtype: "f32".into(),
                            source_etag: "\"e\"".into(),
                            source_last_modified: None,
                            source_bytes: 110_000,
                            augmented: None,
                        };
                        Ok((Arc::new(data), ()))
                    },
                )
                .await
                .expect("read-through");
            let hit = matches!(read, ReadThrough::Cached { .. });
            if epoch > 0 {
                reads += 1;
                hits += usize::from(hit);
            }
        }
        cache.settle().await;
    }
    hits as f64 / reads as f64
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    // Every entry shares one buffer: the weights are what matters, not the bytes.
    let body = Bytes::from(vec![0u8; TENSOR_BYTES]);
    println!("| order | dataset / memory tier | tinylfu | lru | pin | ideal (min(1, C/N)) |");
    println!("|---|---|---|---|---|---|");
    for shuffle in [true, false] {
        for ratio in [0.5, 1.5, 3.0] {
            let n = (CAPACITY as f64 * ratio) as usize;
            let mut row = format!("| {} | {ratio}x ({n} tensors) |", if shuffle { "shuffled" } else { "fixed" });
            for policy in [Policy::TinyLfu, Policy::Lru, Policy::Pin] {
                row.push_str(&format!(" {:.1}% |", 100.0 * run(policy, n, shuffle, &body).await));
            }
            row.push_str(&format!(" {:.1}% |", 100.0 * (CAPACITY as f64 / n as f64).min(1.0)));
            println!("{row}");
        }
    }
}
