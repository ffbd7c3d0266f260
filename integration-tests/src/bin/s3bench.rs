//! Passthrough benchmark client (the real `aws-sdk-s3`): throughput of PUT and GET at several
//! object sizes and GET latency percentiles, against one endpoint. `bench/passthrough.sh` runs it
//! against SeaweedFS directly and through the gateway in the same run and reports ratios.
//!
//! Usage: `s3bench ENDPOINT ACCESS_KEY SECRET_KEY LABEL [big FILE | latency]`; prints one JSON object
//! per line. With `CPU_PIDS=name:pid,...` in the environment, each throughput line also carries the
//! CPU seconds (user + system, from `/proc/PID/stat`) each named process spent on its PUT phase and
//! on its GET phase, so CPU per GB is known per object size and operation, not only per workload.
//! With `LATENCY_OUT=PATH`, the sequential latency row's per-request milliseconds, in the order the
//! requests started, are appended to PATH as one JSON line (`bench/report.py` pools them over
//! rounds; the order shows whether slow requests come in bursts).

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
