//! Passthrough benchmark client (the real `aws-sdk-s3`): throughput of PUT and GET at several
//! object sizes and GET latency percentiles, against one endpoint. `bench/passthrough.sh` runs it
//! against SeaweedFS directly and through the gateway in the same run and reports ratios.
//!
//! Usage: `s3bench ENDPOINT ACCESS_KEY SECRET_KEY LABEL [big FILE | latency | kinds]`; prints one JSON object
//! per line. With `CPU_PIDS=name:pid,...` in the environment, each throughput line also carries the
//! CPU seconds (user + system, from `/proc/PID/stat`) each named process spent on its PUT phase and
//! on its GET phase, so CPU per GB is known per object size and operation, not only per workload.
//! With `LATENCY_OUT=PATH`, the sequential latency row's per-request milliseconds, in the order the
//! requests started, are appended to PATH as one JSON line (`bench/report.py` pools them over
//! rounds; the order shows whether slow requests come in bursts).
//!
//! `kinds`: small requests one kind at a time (4 KiB PUT, GET, HEAD, ListObjectsV2 of 100 keys,
//! `mixed` (nine GETs in ten, a PUT in ten), DeleteObject, and with `PUSHDOWN=MODEL:SPLIT:JPEG_PATH` a pushdown GET of one image, after one
//! that fills the cache), `KINDS_COUNT` of each (default 2,000; a listing a quarter of that)
//! with `KINDS_CONCURRENCY` in flight (default 8); each line carries the microseconds of CPU per
//! request of every `CPU_PIDS` process, the requests per second and the p50 and p99, from the on-CPU nanoseconds of its threads
//! (`/proc/PID/task/*/schedstat`: ticks of 10 ms are too coarse for a phase of a second).
//! `KINDS_HOOK=CMD` runs `CMD before KIND` and `CMD after KIND` (through `sh -c`) around each
//! measured phase, for a tool that counts what the proxy did in it (`bench/request_instructions.sh`).
//! `KINDS=get,head` runs those kinds only (a PUT phase first when a GET, HEAD or DELETE needs its
//! objects).

use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_s3::primitives::ByteStream;
use integration_tests::{sdk_client, unique_bucket};
use tokio::sync::Semaphore;

async fn drain(mut body: ByteStream) -> u64 {
    let mut n = 0;
    while let Ok(Some(chunk)) = body.try_next().await {
        n += chunk.len() as u64;
    }
    n
}

/// Runs `count` operations with `concurrency` in flight; returns per-op latencies and the wall time.
async fn run<F, Fut>(count: usize, concurrency: usize, op: F) -> (Vec<Duration>, Duration)
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let sem = Arc::new(Semaphore::new(concurrency));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        let permit = sem.clone().acquire_owned().await.expect("semaphore");
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            op(i).await;
            drop(permit);
            t.elapsed()
        }));
    }
    let mut lat = Vec::with_capacity(count);
    for t in tasks {
        lat.push(t.await.expect("task"));
    }
    (lat, start.elapsed())
}

/// The processes whose CPU time each phase records (`CPU_PIDS=proxy:123,store:456`).
fn cpu_pids() -> Vec<(String, u32)> {
    std::env::var("CPU_PIDS")
        .unwrap_or_default()
        .split(',')
        .filter_map(|p| {
            let (name, pid) = p.split_once(':')?;
            Some((name.to_owned(), pid.parse().ok()?))
        })
        .collect()
}

/// utime + stime of `pid`, in clock ticks (fields 14 and 15 of `/proc/PID/stat`, after the
/// parenthesised command name).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // After `)`: state is field 3, so utime (14) and stime (15) are the 12th and 13th here.
    rest.split_whitespace().skip(11).take(2).filter_map(|v| v.parse::<u64>().ok()).sum()
}

/// Nanoseconds on a CPU of all of `pid`'s threads now alive (a thread that ends within a phase
/// takes its time with it: the proxies measured keep theirs).
fn cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    tasks
        .filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// Runs `phase` and returns what it returns with `,"<prefix>_<name>_cpu_s":S` for each process.
async fn with_cpu<T>(pids: &[(String, u32)], prefix: &str, phase: impl std::future::Future<Output = T>) -> (T, String) {
    let before: Vec<u64> = pids.iter().map(|(_, p)| cpu_ticks(*p)).collect();
    let out = phase.await;
    let mut json = String::new();
    for ((name, pid), b) in pids.iter().zip(before) {
        // Clock ticks are 1/100 s on Linux (USER_HZ), whatever the kernel's own tick rate.
        json.push_str(&format!(r#","{prefix}_{name}_cpu_s":{:.2}"#, cpu_ticks(*pid).saturating_sub(b) as f64 / 100.0));
    }
    (out, json)
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (endpoint, ak, sk, label) = (&args[1], &args[2], &args[3], &args[4]);
    let c = sdk_client(endpoint, ak, sk);
    let bucket = unique_bucket("bench");
    c.create_bucket().bucket(&bucket).send().await.expect("create bucket");

    if args.get(5).map(String::as_str) == Some("big") {
        // One large streamed PUT and GET (used for the gateway's peak-RSS measurement).
        let path = &args[6];
        let pids = cpu_pids();
        let t = Instant::now();
        let body = ByteStream::from_path(path).await.expect("file");
        let ((), put_cpu) = with_cpu(&pids, "put", async {
            c.put_object().bucket(&bucket).key("big").body(body).send().await.map(drop).expect("put big")
        })
        .await;
        let put = t.elapsed();
        let t = Instant::now();
        let (n, get_cpu) = with_cpu(&pids, "get", async {
            let got = c.get_object().bucket(&bucket).key("big").send().await.expect("get big");
            drain(got.body).await
        })
        .await;
        println!(
            r#"{{"label":"{label}","test":"big","bytes":{n},"put_s":{:.3},"get_s":{:.3}{put_cpu}{get_cpu}}}"#,
            put.as_secs_f64(),
            t.elapsed().as_secs_f64()
        );
        return;
    }

    if args.get(5).map(String::as_str) == Some("kinds") {
        kinds(&c, &bucket, label).await;
        return;
    }

    // `latency`: only the 4 KiB GET latencies (after putting the objects), for quick A/B runs.
    let latency_only = args.get(5).map(String::as_str) == Some("latency");
    let sizes: &[(usize, usize, usize)] = if latency_only {
        &[(4 * 1024, 1500, 16)]
    } else {
        &[(4 * 1024, 1500, 16), (1024 * 1024, 150, 8), (64 * 1024 * 1024, 6, 2)]
    };
    // `ONLY_SIZE=67108864`: that row alone (for profiling one row).
    let only: Option<usize> = std::env::var("ONLY_SIZE").ok().and_then(|v| v.parse().ok());
    let pids = cpu_pids();
    for &(size, count, conc) in sizes.iter().filter(|(size, ..)| only.is_none_or(|o| o == *size)) {
        let data = bytes::Bytes::from(vec![0x5au8; size]);
        let (c2, b2, d2) = (c.clone(), bucket.clone(), data.clone());
        let ((_, put_wall), put_cpu) = with_cpu(
            &pids,
            "put",
            run(count, conc, move |i| {
                let (c, b, d) = (c2.clone(), b2.clone(), d2.clone());
                async move {
                    c.put_object()
                        .bucket(b)
                        .key(format!("o{size}-{i}"))
                        .body(ByteStream::from(d))
                        .send()
                        .await
                        .expect("put");
                }
            }),
        )
        .await;
        let (c2, b2) = (c.clone(), bucket.clone());
        let ((_, get_wall), get_cpu) = with_cpu(
            &pids,
            "get",
            run(count, conc, move |i| {
                let (c, b) = (c2.clone(), b2.clone());
                async move {
                    let o = c.get_object().bucket(b).key(format!("o{size}-{i}")).send().await.expect("get");
                    assert_eq!(drain(o.body).await as usize, size);
                }
            }),
        )
        .await;
        let mb = (size * count) as f64 / 1e6;
        println!(
            r#"{{"label":"{label}","test":"throughput","size":{size},"count":{count},"concurrency":{conc},"put_mb_s":{:.2},"get_mb_s":{:.2},"put_ops_s":{:.1},"get_ops_s":{:.1}{put_cpu}{get_cpu}}}"#,
            mb / put_wall.as_secs_f64(),
            mb / get_wall.as_secs_f64(),
            count as f64 / put_wall.as_secs_f64(),
            count as f64 / get_wall.as_secs_f64()
        );
    }

    if only.is_some_and(|o| o != 4 * 1024) {
        return;
    }
    for (conc, count) in [(1usize, 1000usize), (32, 3000)] {
        let (c2, b2) = (c.clone(), bucket.clone());
        let (mut lat, _) = run(count, conc, move |i| {
            let (c, b) = (c2.clone(), b2.clone());
            async move {
                let o = c.get_object().bucket(b).key(format!("o4096-{}", i % 1500)).send().await.expect("get");
                drain(o.body).await;
            }
        })
        .await;
        if let Ok(path) = std::env::var("LATENCY_OUT")
            && conc == 1
        {
            use std::io::Write;
            let ms: Vec<String> = lat.iter().map(|d| format!("{:.3}", d.as_secs_f64() * 1e3)).collect();
            let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path).expect("LATENCY_OUT");
            writeln!(f, r#"{{"label":"{label}","concurrency":{conc},"ms":[{}]}}"#, ms.join(",")).expect("LATENCY_OUT");
        }
        lat.sort();
        println!(
            r#"{{"label":"{label}","test":"latency","size":4096,"concurrency":{conc},"count":{count},"p50_ms":{:.3},"p99_ms":{:.3}}}"#,
            pct(&lat, 0.5),
            pct(&lat, 0.99)
        );
    }
}

/// Runs `KINDS_HOOK` (if set) with `when` and `kind` as its arguments.
fn hook(when: &str, kind: &str) {
    if let Ok(cmd) = std::env::var("KINDS_HOOK") {
        let status = std::process::Command::new("sh").arg("-c").arg(format!("{cmd} {when} {kind}")).status();
        assert!(status.is_ok_and(|s| s.success()), "KINDS_HOOK {when} {kind} failed");
    }
}

/// The `kinds` mode (see the module's text).
async fn kinds(c: &aws_sdk_s3::Client, bucket: &str, label: &str) {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (count, conc) = (env("KINDS_COUNT", 2000), env("KINDS_CONCURRENCY", 8));
    let pids = cpu_pids();
    let data = bytes::Bytes::from(vec![0x5au8; 4096]);
    for i in 0..100 {
        let body = ByteStream::from(data.clone());
        c.put_object().bucket(bucket).key(format!("l/{i:03}")).body(body).send().await.expect("put listed");
    }
    let pushdown = std::env::var("PUSHDOWN").ok().map(|p| {
        let mut it = p.splitn(3, ':').map(str::to_owned);
        let (model, split, path) = (it.next(), it.next(), it.next());
        (model.expect("PUSHDOWN model"), split.expect("PUSHDOWN split"), path.expect("PUSHDOWN image"))
    });
    if let Some((_, _, path)) = &pushdown {
        let body = ByteStream::from(std::fs::read(path).expect("PUSHDOWN image"));
        c.put_object().bucket(bucket).key("image.jpg").body(body).send().await.expect("put image");
    }
    let only = std::env::var("KINDS").ok();
    let wanted = |k: &str| only.as_deref().is_none_or(|o| o.split(',').any(|w| w == k));
    let needs_objects = ["get", "head", "delete", "mixed"].iter().any(|k| wanted(k));
    let kinds: &[&str] = &["put", "get", "head", "list", "mixed", "delete", "pushdown"];
    for &kind in kinds.iter().filter(|k| wanted(k) || (**k == "put" && needs_objects)) {
        let n = if kind == "list" { count / 4 } else { count };
        let (c, b, d, p) = (c.clone(), bucket.to_owned(), data.clone(), pushdown.clone());
        let op = move |i: usize| {
            let (c, b, d, p) = (c.clone(), b.clone(), d.clone(), p.clone());
            async move {
                match kind {
                    // `mixed`: nine GETs in ten, and a PUT of a fresh key.
                    "put" | "mixed" if kind == "put" || i % 10 == 9 => {
                        let key = if kind == "put" { format!("k{i}") } else { format!("m{i}") };
                        drop(c.put_object().bucket(b).key(key).body(ByteStream::from(d)).send().await.expect("put"));
                    }
                    "get" | "mixed" => {
                        let o = c.get_object().bucket(b).key(format!("k{i}")).send().await.expect("get");
                        assert_eq!(drain(o.body).await, 4096);
                    }
                    "head" => drop(c.head_object().bucket(b).key(format!("k{i}")).send().await.expect("head")),
                    "list" => {
                        let l = c.list_objects_v2().bucket(b).prefix("l/").send().await.expect("list");
                        assert_eq!(l.key_count(), Some(100));
                    }
                    "delete" => drop(c.delete_object().bucket(b).key(format!("k{i}")).send().await.expect("delete")),
                    _ => {
                        let (model, split, _) = p.expect("PUSHDOWN");
                        let o = c
                            .get_object()
                            .bucket(b)
                            .key("image.jpg")
                            .customize()
                            .mutate_request(move |r| {
                                r.headers_mut().insert("x-tensorgate-model", model.clone());
                                r.headers_mut().insert("x-tensorgate-split", split.clone());
                            })
                            .send()
                            .await
                            .expect("pushdown get");
                        assert!(drain(o.body).await > 0);
                    }
                }
            }
        };
        if kind == "pushdown" {
            if pushdown.is_none() {
                continue;
            }
            op(0).await; // computes and fills the cache: the phase measures hits
        }
        hook("before", kind);
        let before: Vec<u64> = pids.iter().map(|(_, p)| cpu_ns(*p)).collect();
        let (mut lat, wall) = run(n, conc, op).await;
        hook("after", kind);
        lat.sort();
        let mut cpu = String::new();
        for ((name, pid), b) in pids.iter().zip(before) {
            cpu.push_str(&format!(r#","{name}_cpu_us":{:.2}"#, cpu_ns(*pid).saturating_sub(b) as f64 / 1e3 / n as f64));
        }
        println!(
            r#"{{"label":"{label}","test":"kind","kind":"{kind}","count":{n},"concurrency":{conc},"ops_s":{:.1},"p50_ms":{:.3},"p99_ms":{:.3}{cpu}}}"#,
            n as f64 / wall.as_secs_f64(),
            pct(&lat, 0.5),
            pct(&lat, 0.99)
        );
    }
}
