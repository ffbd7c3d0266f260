//! The whole pushdown request path in-process, against the real `fs` backend and real ONNX Runtime
//! sessions of the `tiny-cnn` fixture model: tensor cache (miss, hit, revalidated unchanged,
//! changed and gone), HEAD, Range, If-None-Match, alias buckets, `split=auto` per tenant, the
//! SSE-C cache bypass, engine panic recovery, idle eviction and one inference slot shared by several
//! engines. The numbers themselves are checked
//! against PIL + onnxruntime by `tests/python/test_pushdown.py`; here every path must give the same
//! bytes as the first computation.

use std::time::{Duration, Instant};

use bytes::Bytes;
use integration_tests::*;
use tensorgate::Server;
use tensorgate::config::{AliasConfig, Config, CredentialConfig};
use tensorgate::pushdown::engine::OrtArena;
use tensorgate::pushdown::spec::Dtype;
use tensorgate::pushdown::tensor::{Tensor, write_npy};
use tensorgate::s3::credentials::SecretKey;

const MODEL: &str = "tiny-cnn";
const BUCKET: &str = "data";

/// A gateway over a fresh directory with pushdown on the repository's models and the ONNX Runtime
/// of the project's `.venv` (scripts/setup.sh installs both).
async fn gateway(tweak: impl FnOnce(&mut Config)) -> (tempfile::TempDir, Server) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("data").join(BUCKET)).expect("bucket dir");
    let mut cfg = fs_config(&dir.path().join("data"));
    cfg.pushdown.models_dir = repo_root().join("models");
    cfg.pushdown.ort_library = Some(ort_library());
    tweak(&mut cfg);
    let server = Server::start(&cfg).await.expect("gateway");
    (dir, server)
}

/// A deterministic sample of the model's input shape, as `.npy`.
fn sample(seed: u32) -> Bytes {
    let data =
        (0..3 * 32 * 32u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 1000).map(|v| v as f32 / 1000.0).collect();
    Bytes::from(write_npy(&Tensor { shape: vec![3, 32, 32], data }, Dtype::F32))
}

fn put_file(dir: &tempfile::TempDir, key: &str, body: &[u8]) {
    std::fs::write(dir.path().join("data").join(BUCKET).join(key), body).expect("write object");
}

async fn get(server: &Server, path: &str, headers: &[(&str, &str)]) -> RawResponse {
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    raw(
        server.s3_addr,
        "GET",
        &host,
        path,
        headers,
        Bytes::new(),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("request")
}

fn pushdown_path(key: &str, split: &str) -> String {
    format!("/{BUCKET}/{key}?tensorgate-model={MODEL}&tensorgate-split={split}")
}

fn header<'a>(r: &'a RawResponse, name: &str) -> &'a str {
    r.headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default()
}

async fn admin_json(server: &Server, path: &str) -> serde_json::Value {
    let url = format!("http://{}{path}", server.admin_addr);
    let body = http_get(&url).await;
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: {e}: {body}"))
}

#[tokio::test]
async fn cached_outputs_are_served_revalidated_or_recomputed_as_the_source_says() {
    let (dir, server) = gateway(|_| {}).await;
    put_file(&dir, "a.npy", &sample(1));
    let path = pushdown_path("a.npy", "pool");

    let miss = get(&server, &path, &[]).await;
    assert_eq!(miss.status, 200, "{}", miss.text());
    assert_eq!(header(&miss, "x-tensorgate-cache"), "miss");
    assert_eq!(header(&miss, "x-tensorgate-split"), "pool");
    assert_eq!(header(&miss, "content-type"), "application/x-npy");
    assert!(header(&miss, "server-timing").contains("infer;dur="));
    // The default asks the store on every request (a conditional GET): unchanged → the cached bytes.
    let again = get(&server, &path, &[]).await;
    assert_eq!(header(&again, "x-tensorgate-cache"), "revalidated");
    assert_eq!(again.body, miss.body);
    assert_eq!(header(&again, "etag"), header(&miss, "etag"));

    // Changed behind the gateway's back: recomputed from the new bytes, under a new ETag.
    put_file(&dir, "a.npy", &sample(2));
    let changed = get(&server, &path, &[]).await;
    assert_eq!(header(&changed, "x-tensorgate-cache"), "miss");
    assert_ne!(changed.body, miss.body);
    assert_ne!(header(&changed, "etag"), header(&miss, "etag"));
    // Gone: the store's answer passes through, and the entry is dropped.
    std::fs::remove_file(dir.path().join("data").join(BUCKET).join("a.npy")).expect("rm");
    let gone = get(&server, &path, &[]).await;
    assert_eq!(gone.status, 404, "{}", gone.text());
    assert!(gone.text().contains("NoSuchKey"));

    let metrics = http_get(&format!("http://{}/metrics", server.admin_addr)).await;
    for outcome in ["unchanged", "changed", "gone"] {
        let line = format!("tensorgate_cache_revalidations_total{{outcome=\"{outcome}\"}} 1");
        assert!(metrics.contains(&line), "{line} in\n{metrics}");
    }
    server.shutdown().await;
}

#[tokio::test]
async fn trusted_entries_are_hits_and_head_range_and_if_none_match_are_answered_from_them() {
    let (dir, server) = gateway(|c| c.pushdown.cache.revalidate_after_ms = 600_000).await;
    put_file(&dir, "b.npy", &sample(3));
    let path = pushdown_path("b.npy", "block1");
    let full = get(&server, &path, &[]).await;
    assert_eq!(full.status, 200, "{}", full.text());
    let hit = get(&server, &path, &[]).await;
    assert_eq!(header(&hit, "x-tensorgate-cache"), "hit");
    assert_eq!(header(&hit, "x-tensorgate-cache-tier"), "memory");
    assert_eq!(hit.body, full.body);

    let part = get(&server, &path, &[("range", "bytes=10-29")]).await;
    assert_eq!(part.status, 206);
    assert_eq!(part.body, full.body.slice(10..30));
    assert_eq!(header(&part, "content-range"), format!("bytes 10-29/{}", full.body.len()));
    let tail = get(&server, &path, &[("range", "bytes=-5")]).await;
    assert_eq!(tail.body, full.body.slice(full.body.len() - 5..));
    let bad = get(&server, &path, &[("range", format!("bytes={}-", full.body.len()).as_str())]).await;
    assert_eq!(bad.status, 416, "{}", bad.text());

    let etag = header(&full, "etag").to_owned();
    let not_modified = get(&server, &path, &[("if-none-match", etag.as_str())]).await;
    assert_eq!(not_modified.status, 304);
    assert!(not_modified.body.is_empty());
    let other = get(&server, &path, &[("if-none-match", "\"something-else\"")]).await;
    assert_eq!(other.status, 200);

    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let head = raw(
        server.s3_addr,
        "HEAD",
        &host,
        &path,
        &[],
        Bytes::new(),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("head");
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    assert_eq!(header(&head, "content-length"), full.body.len().to_string());
    assert_eq!(header(&head, "x-tensorgate-shape"), header(&full, "x-tensorgate-shape"));
    server.shutdown().await;
}

#[tokio::test]
async fn sse_c_reads_are_never_served_from_the_cache() {
    let (dir, server) = gateway(|c| c.pushdown.cache.revalidate_after_ms = 600_000).await;
    put_file(&dir, "c.npy", &sample(4));
    let path = pushdown_path("c.npy", "pool");
    let sse = [
        ("x-amz-server-side-encryption-customer-algorithm", "AES256"),
        ("x-amz-server-side-encryption-customer-key", "MDEyMzQ1Njc4OTAxMjM0NTY3ODkwMTIzNDU2Nzg5MDE="),
        ("x-amz-server-side-encryption-customer-key-md5", "d4fvyMaK9R9ZNeYz2mGxNw=="),
    ];
    let first = get(&server, &path, &sse).await;
    let second = get(&server, &path, &sse).await;
    // The fs backend serves SSE-C reads as plain ones; the gateway must still ask it every time.
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(second.status, 200, "{}", second.text());
    assert_eq!(header(&first, "x-tensorgate-cache"), "miss");
    assert_eq!(header(&second, "x-tensorgate-cache"), "miss");
    assert_eq!(first.body, second.body);
    let plain = get(&server, &path, &[]).await;
    assert_eq!(header(&plain, "x-tensorgate-cache"), "miss", "the SSE-C reads cached nothing");
    server.shutdown().await;
}

#[tokio::test]
async fn alias_buckets_read_as_pushdowns_list_the_target_and_refuse_writes() {
    let (dir, server) = gateway(|c| {
        c.pushdown.aliases.push(AliasConfig {
            bucket: "data-pool".into(),
            target: BUCKET.into(),
            model: MODEL.into(),
            split: "pool".into(),
            format: None,
            dtype: None,
            column: None,
        });
    })
    .await;
    put_file(&dir, "d.npy", &sample(5));
    let direct = get(&server, &pushdown_path("d.npy", "pool"), &[]).await;
    let aliased = get(&server, "/data-pool/d.npy", &[]).await;
    assert_eq!(aliased.status, 200, "{}", aliased.text());
    assert_eq!(aliased.body, direct.body);
    let listed = get(&server, "/data-pool?list-type=2", &[]).await;
    assert_eq!(listed.status, 200, "{}", listed.text());
    assert!(listed.text().contains("<Key>d.npy</Key>"), "{}", listed.text());
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let put = raw(
        server.s3_addr,
        "PUT",
        &host,
        "/data-pool/e.npy",
        &[],
        sample(6),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("put");
    assert_eq!(put.status, 405, "{}", put.text());
    assert!(!dir.path().join("data").join(BUCKET).join("e.npy").exists());
    let both = get(&server, &format!("/data-pool/d.npy?tensorgate-model={MODEL}&tensorgate-split=stem"), &[]).await;
    assert_eq!(both.status, 400, "an alias already names its model: {}", both.text());
    server.shutdown().await;
}

#[tokio::test]
async fn split_auto_follows_each_tenants_own_plan() {
    let (dir, server) = gateway(|c| {
        c.credentials.push(CredentialConfig {
            access_key: "other-tenant".into(),
            secret_key: Some(SecretKey::new("other-secret".into())),
            ..CredentialConfig::default()
        });
    })
    .await;
    put_file(&dir, "f.npy", &sample(7));
    let auto = pushdown_path("f.npy", "auto");
    // No plan yet: the manifest's freeze split.
    assert_eq!(header(&get(&server, &auto, &[]).await, "x-tensorgate-split"), "block2");
    // Another tenant plans for a network so fast that nothing is pushed down.
    let fast = fast_network();
    let pd = server.gateway.pushdown().expect("pushdown").clone();
    let (plan, _) = pd.plan(MODEL, &fast, Some("other-tenant"), Dtype::F32).await.expect("plan");
    assert_eq!(plan.chosen, "none");
    let mine = get(&server, &auto, &[]).await;
    assert_eq!(header(&mine, "x-tensorgate-split"), "block2", "another tenant's plan is not mine");
    // My own plan is followed: no pushdown, the object's bytes.
    pd.plan(MODEL, &fast, Some(CLIENT_AK), Dtype::F32).await.expect("my plan");
    let raw_bytes = get(&server, &auto, &[]).await;
    assert_eq!(raw_bytes.status, 200);
    assert_eq!(raw_bytes.body, sample(7));
    server.shutdown().await;
}

/// A client profile on a network so fast that the planner pushes nothing down.
fn fast_network() -> tensorgate::planner::ClientProfile {
    serde_json::from_value(serde_json::json!({
        "batch_size": 8, "samples": 800, "train_secs_per_batch": 0.001, "raw_bytes_per_sample": 1e6,
        "bandwidth_bytes_per_sec": 1e12,
        "compute_secs_per_sample": {"none": 1e-9, "stem": 1e-9, "block1": 1e-9, "block2": 1e-9},
    }))
    .expect("profile")
}

#[tokio::test]
async fn the_plans_table_and_its_tenant_names_are_bounded() {
    use tensorgate::pushdown::PushdownError;
    use tensorgate::pushdown::planning::{MAX_PLANS, MAX_TENANT_BYTES};
    let (_dir, server) = gateway(|_| {}).await;
    let pd = server.gateway.pushdown().expect("pushdown").clone();
    let fast = fast_network();
    for t in 0..MAX_PLANS {
        pd.plan(MODEL, &fast, Some(&format!("tenant-{t}")), Dtype::F32).await.expect("room for it");
    }
    let full = pd.plan(MODEL, &fast, Some("one-more"), Dtype::F32).await;
    assert!(matches!(full, Err(PushdownError::TooManyPlans { .. })), "{full:?}");
    pd.plan(MODEL, &fast, Some("tenant-0"), Dtype::F32).await.expect("a tenant with a plan re-plans");
    let long = pd.plan(MODEL, &fast, Some(&"k".repeat(MAX_TENANT_BYTES + 1)), Dtype::F32).await;
    assert!(matches!(long, Err(PushdownError::InvalidArgument { .. })), "{long:?}");
    let text = http_get(&format!("http://{}/metrics", server.admin_addr)).await;
    let labels = text.lines().filter(|l| l.starts_with("tensorgate_pushdown_plans_total{")).count();
    assert_eq!(labels, MAX_PLANS, "one metric label per kept plan's tenant");
    server.shutdown().await;
}

/// Threads of this process whose name starts with `prefix` (inference workers are named
/// `infer-<model>-<split>-<n>`; Linux truncates names to 15 bytes).
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("tasks")
        .flatten()
        .filter(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with(prefix)))
        .count()
}

#[tokio::test]
async fn a_worker_panic_is_answered_with_an_error_and_the_engine_recovers() {
    let (dir, server) = gateway(|c| c.pushdown.workers = 1).await;
    for (i, key) in ["g1.npy", "g2.npy", "g3.npy"].iter().enumerate() {
        put_file(&dir, key, &sample(10 + i as u32));
    }
    let first = get(&server, &pushdown_path("g1.npy", "stem"), &[]).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let pd = server.gateway.pushdown().expect("pushdown").clone();
    let failures = || async {
        let text = http_get(&format!("http://{}/metrics", server.admin_addr)).await;
        metric_sum(&text, "tensorgate_pushdown_engine_failures_total{reason=\"run_panicked\"}")
    };
    assert_eq!(failures().await, 0.0, "exported at zero before any failure");
    assert!(pd.inject_worker_panic(MODEL, "stem"));
    let failed = get(&server, &pushdown_path("g2.npy", "stem"), &[]).await;
    assert_eq!(failed.status, 500, "{}", failed.text());
    assert!(failed.text().contains("<Code>InternalError</Code>"), "{}", failed.text());
    assert_eq!(failures().await, 1.0, "the panicked run is counted");
    let next = get(&server, &pushdown_path("g2.npy", "stem"), &[]).await;
    assert_eq!(next.status, 200, "the engine runs again: {}", next.text());
    let third = get(&server, &pushdown_path("g3.npy", "stem"), &[]).await;
    assert_eq!(third.status, 200);
    // Shutdown returns only once the inference threads hold nothing of ONNX Runtime: a process
    // that exits while one still drops its session inside it aborts (seen in CI as "pure virtual
    // method called").
    assert!(pd.inference_threads() > 0);
    assert!(server.shutdown().await);
    assert_eq!(pd.inference_threads(), 0);
}

#[tokio::test]
async fn idle_engines_are_evicted_and_their_memory_and_threads_returned() {
    let (dir, server) = gateway(|c| c.pushdown.engine_idle_secs = 1).await;
    put_file(&dir, "h.npy", &sample(20));
    let before = admin_json(&server, "/v1/memory").await;
    assert_eq!(before["reserved_bytes"], 0, "{before}");
    let r = get(&server, &pushdown_path("h.npy", "block2"), &[]).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let during = admin_json(&server, "/v1/memory").await;
    assert_eq!(during["engines"].as_array().map(Vec::len), Some(1), "{during}");
    let starts = |reason: &'static str| {
        let admin = server.admin_addr;
        async move {
            let text = http_get(&format!("http://{admin}/metrics")).await;
            metric_sum(&text, &format!("tensorgate_pushdown_engine_starts_total{{reason=\"{reason}\"}}"))
        }
    };
    assert_eq!((starts("measured").await, starts("remembered").await), (1.0, 0.0));
    assert!(during["reserved_bytes"].as_u64() > Some(0), "{during}");
    assert!(threads_named("infer-tiny-cnn") > 0);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = admin_json(&server, "/v1/memory").await;
        if now["engines"].as_array().is_some_and(Vec::is_empty)
            && now["reserved_bytes"] == 0
            && threads_named("infer-tiny-cnn") == 0
        {
            break;
        }
        assert!(Instant::now() < deadline, "engine not evicted: {now}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A new request (a new object: no cached output) starts the engine again.
    put_file(&dir, "h2.npy", &sample(21));
    let again = get(&server, &pushdown_path("h2.npy", "block2"), &[]).await;
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(header(&again, "x-tensorgate-cache"), "miss");
    // Without measuring again: the first engine's memory model, reserved the same.
    assert_eq!((starts("measured").await, starts("remembered").await), (1.0, 1.0));
    let restarted = admin_json(&server, "/v1/memory").await;
    assert_eq!(restarted["engines"][0]["memory"], during["engines"][0]["memory"], "{restarted}");
    assert_eq!(restarted["engines"][0]["reserved_bytes"], during["engines"][0]["reserved_bytes"], "{restarted}");
    server.shutdown().await;
}

#[tokio::test]
async fn every_arena_mode_gives_the_same_bytes() {
    // `pushdown.ort_arena` changes where run buffers live, never what is computed.
    let (dir_off, off) = gateway(|c| c.pushdown.cache.enabled = false).await;
    let mut others = Vec::new();
    for mode in [OrtArena::PerRun, OrtArena::Kept] {
        others.push(
            gateway(move |c| {
                c.pushdown.cache.enabled = false;
                c.pushdown.ort_arena = mode;
            })
            .await,
        );
    }
    for seed in 0..4 {
        let key = format!("arena-{seed}.npy");
        put_file(&dir_off, &key, &sample(seed));
        for (dir, _) in &others {
            put_file(dir, &key, &sample(seed));
        }
        for split in ["block1", "pool"] {
            // Twice each: the second run reuses (kept) or regrows (per run) the arena of the first.
            for _ in 0..2 {
                let a = get(&off, &pushdown_path(&key, split), &[]).await;
                assert_eq!(a.status, 200, "{}", a.text());
                for (mode, (_, server)) in [OrtArena::PerRun, OrtArena::Kept].iter().zip(&others) {
                    let b = get(server, &pushdown_path(&key, split), &[]).await;
                    assert_eq!(b.status, 200, "{mode:?}: {}", b.text());
                    assert_eq!(a.body, b.body, "{key} at {split}: {mode:?} changed the output");
                }
            }
        }
    }
}

#[tokio::test]
async fn one_inference_slot_serves_concurrent_requests_on_several_engines_in_full() {
    // Every engine's batches wait for the node's one inference slot (`pushdown.inference_runs`),
    // taken on the inference threads: concurrent requests on two splits with two workers each
    // must all be answered, with the bytes an unlimited node computes.
    let (dir_free, free) = gateway(|c| {
        c.pushdown.cache.enabled = false;
        c.pushdown.inference_runs = 64;
    })
    .await;
    let (dir_one, one) = gateway(|c| {
        c.pushdown.cache.enabled = false;
        c.pushdown.workers = 2;
        c.pushdown.inference_runs = 1;
    })
    .await;
    let keys: Vec<String> = (0..6).map(|seed| format!("slot-{seed}.npy")).collect();
    for (seed, key) in (0..).zip(&keys) {
        put_file(&dir_free, key, &sample(seed));
        put_file(&dir_one, key, &sample(seed));
    }
    let asks: Vec<(String, &str)> =
        keys.iter().flat_map(|k| ["block1", "pool"].map(|split| (pushdown_path(k, split), split))).collect();
    let concurrent = futures_util::future::join_all(asks.iter().map(|(path, _)| get(&one, path, &[])));
    let answers = tokio::time::timeout(Duration::from_secs(120), concurrent)
        .await
        .expect("every request answered (no run waits forever for the slot)");
    for ((path, split), b) in asks.iter().zip(answers) {
        assert_eq!(b.status, 200, "{path}: {}", b.text());
        assert_eq!(header(&b, "x-tensorgate-split"), *split);
        let a = get(&free, path, &[]).await;
        assert_eq!(a.body, b.body, "{path}: one slot changed the output");
    }
}

/// A store that answers every request with `body` in chunked framing (no `Content-Length`), as a
/// store or a cluster peer may; yields its endpoint.
async fn chunked_store(body: Bytes) -> (String, tokio::task::JoinHandle<()>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let endpoint = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let mut out = b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nETag: \"chunked-1\"\r\n\
                    Last-Modified: Thu, 03 Dec 2026 12:00:00 GMT\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                    .to_vec();
                for part in body.chunks(1000) {
                    out.extend_from_slice(format!("{:x}\r\n", part.len()).as_bytes());
                    out.extend_from_slice(part);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"0\r\n\r\n");
                let _ = conn.write_all(&out).await;
            });
        }
    });
    (endpoint, task)
}

#[tokio::test]
async fn a_source_without_a_length_is_held_at_its_bound_while_read() {
    // The budget cannot hold a source at the default bound (64 MiB): refused with the budget's
    // error before any byte of it is read, and nothing stays reserved.
    let (endpoint, store) = chunked_store(sample(7)).await;
    let pushdown = |cfg: &mut Config, max_object_bytes: u64| {
        cfg.pushdown.models_dir = repo_root().join("models");
        cfg.pushdown.ort_library = Some(ort_library());
        cfg.pushdown.memory_budget = 48 * 1024 * 1024;
        cfg.pushdown.max_object_bytes = max_object_bytes;
    };
    let mut cfg = s3_config(&endpoint);
    pushdown(&mut cfg, tensorgate::pushdown::DEFAULT_MAX_OBJECT_BYTES);
    let server = Server::start(&cfg).await.expect("gateway");
    let r = get(&server, &pushdown_path("a.npy", "pool"), &[]).await;
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("EntityTooLarge"), "{}", r.text());
    assert_eq!(admin_json(&server, "/v1/memory").await["reserved_bytes"], 0);
    server.shutdown().await;

    // With a bound the budget holds, the same source is read, computed and answered as from a
    // store that sends its length, and the hold returns once the answer is sent.
    let mut cfg = s3_config(&endpoint);
    pushdown(&mut cfg, 1024 * 1024);
    let server = Server::start(&cfg).await.expect("gateway");
    let chunked = get(&server, &pushdown_path("a.npy", "pool"), &[]).await;
    assert_eq!(chunked.status, 200, "{}", chunked.text());
    let (dir, with_length) = gateway(|_| {}).await;
    put_file(&dir, "a.npy", &sample(7));
    let want = get(&with_length, &pushdown_path("a.npy", "pool"), &[]).await;
    assert_eq!(chunked.body, want.body);
    // The request's holds ride its response body, released just after its last byte: wait for
    // that state (bounded), then only the engine is reserved.
    let mut memory = serde_json::Value::Null;
    for _ in 0..200 {
        memory = admin_json(&server, "/v1/memory").await;
        let engines: u64 =
            memory["engines"].as_array().map_or(0, |e| e.iter().filter_map(|e| e["reserved_bytes"].as_u64()).sum());
        if memory["reserved_bytes"].as_u64() == Some(engines) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let engines: u64 =
        memory["engines"].as_array().map_or(0, |e| e.iter().filter_map(|e| e["reserved_bytes"].as_u64()).sum());
    assert!(engines > 0 && memory["reserved_bytes"].as_u64() == Some(engines), "{memory}");
    with_length.shutdown().await;
    server.shutdown().await;
    store.abort();
}
