//! The edge's bounds against a running gateway (fs backend: nothing here depends on the store):
//! heads that never finish, downloads nobody reads, bodies that stop coming, and admission that
//! counts a request until its response is sent.

use std::time::{Duration, Instant};

use aws_sdk_s3::primitives::ByteStream;
use integration_tests::*;
use tensorgate::Server;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn host(server: &Server) -> String {
    format!("127.0.0.1:{}", server.s3_addr.port())
}

async fn metric(server: &Server, name: &str) -> f64 {
    let text = http_get(&format!("http://{}/metrics", server.admin_addr)).await;
    metric_sum(&text, name)
}

#[tokio::test]
async fn heads_that_never_finish_are_closed_after_the_header_timeout_while_clients_are_served() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fs_config(&dir.path().join("data"));
    cfg.edge.header_timeout_secs = 2;
    let server = Server::start(&cfg).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    c.create_bucket().bucket("bkt").send().await.expect("create");

    // 2,000 connections that each send half a request head and then nothing.
    let mut silent = Vec::new();
    for _ in 0..2000 {
        let mut s = TcpStream::connect(server.s3_addr).await.expect("connect");
        s.write_all(b"GET /bkt/x HTTP/1.1\r\nHost: 127.0.0.1\r\nx-amz-date: 2").await.expect("half a head");
        silent.push(s);
    }
    // A normal client is served while they are open.
    for served in 0..20 {
        let key = format!("k{served}");
        c.put_object().bucket("bkt").key(&key).body(ByteStream::from_static(b"x")).send().await.expect("put");
        let got = c.get_object().bucket("bkt").key(&key).send().await.expect("get");
        assert_eq!(got.body.collect().await.expect("body").into_bytes().as_ref(), b"x");
    }
    // Every silent connection is then closed by the gateway, for the header timeout (its metric);
    // the 60 s bound on each read only keeps a broken gateway from hanging the test.
    let closed = futures_util::future::join_all(silent.into_iter().map(|mut s| async move {
        let mut buf = [0u8; 256];
        matches!(tokio::time::timeout(Duration::from_secs(60), s.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
    }))
    .await;
    assert_eq!(closed.iter().filter(|c| **c).count(), 2000);
    assert!(metric(&server, "tensorgate_connections_closed_total{reason=\"header_timeout\"}").await >= 2000.0);
    server.shutdown().await;
}

#[tokio::test]
async fn an_idle_kept_alive_connection_is_closed_after_the_header_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fs_config(&dir.path().join("data"));
    cfg.edge.header_timeout_secs = 1;
    let server = Server::start(&cfg).await.expect("gateway");
    let mut s = TcpStream::connect(server.s3_addr).await.expect("connect");
    let head = signed_head("GET", &host(&server), "/", &[]).expect("head");
    s.write_all(head.as_bytes()).await.expect("request");
    let mut first = [0u8; 12];
    s.read_exact(&mut first).await.expect("status line");
    assert_eq!(&first, b"HTTP/1.1 200");
    // Kept alive, then idle: closed by the gateway once the timer for the next head runs out.
    let idle = Instant::now();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut rest)).await.expect("closed").expect("read");
    // Not before the timer ran out (a lower bound: a loaded machine only makes it later), and for it.
    assert!(idle.elapsed() >= Duration::from_millis(900), "closed after {:?}", idle.elapsed());
    assert_eq!(metric(&server, "tensorgate_connections_closed_total{reason=\"header_timeout\"}").await, 1.0);
    server.shutdown().await;
}

#[tokio::test]
async fn a_head_larger_than_the_limit_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Server::start(&fs_config(&dir.path().join("data"))).await.expect("gateway");
    let mut s = TcpStream::connect(server.s3_addr).await.expect("connect");
    let big = "a".repeat(tensorgate::edge::MAX_HEADER_BYTES + 1);
    // The client may see the refusal before it has written everything.
    let _ = s.write_all(format!("GET / HTTP/1.1\r\nHost: x\r\nx-filler: {big}\r\n\r\n").as_bytes()).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut answer)).await.expect("answered");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431"), "{answer}");
    server.shutdown().await;
}

#[tokio::test]
async fn connections_over_the_limit_get_slow_down() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fs_config(&dir.path().join("data"));
    cfg.edge.max_connections = 8;
    let server = Server::start(&cfg).await.expect("gateway");
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(TcpStream::connect(server.s3_addr).await.expect("connect"));
    }
    // Let the gateway accept them all before the ninth arrives.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut ninth = TcpStream::connect(server.s3_addr).await.expect("connect");
    ninth.write_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.expect("write");
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), ninth.read_to_string(&mut answer)).await.expect("fast").expect("read");
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.contains("<Code>SlowDown</Code>") && answer.contains("Retry-After: 1"), "{answer}");
    drop(held);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let r = signed_get(server.s3_addr, &host(&server), "/").await.expect("list buckets");
    assert_eq!(r.status, 200, "{}", r.text());
    server.shutdown().await;
}

#[tokio::test]
async fn streaming_downloads_hold_their_admission_until_sent_and_stalled_ones_are_cut() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fs_config(&dir.path().join("data"));
    cfg.max_in_flight = 4;
    cfg.edge.stall_timeout_secs = 2;
    let server = Server::start(&cfg).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    c.create_bucket().bucket("big").send().await.expect("create");
    let object = vec![7u8; 64 * 1024 * 1024];
    c.put_object().bucket("big").key("o").body(ByteStream::from(object)).send().await.expect("put");

    // Four downloads whose heads arrived and whose bodies nobody reads.
    let head = signed_head("GET", &host(&server), "/big/o", &[]).expect("head");
    let mut slow = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(server.s3_addr).await.expect("connect");
        s.write_all(head.as_bytes()).await.expect("request");
        let mut first = [0u8; 12];
        s.read_exact(&mut first).await.expect("status line");
        assert_eq!(&first, b"HTTP/1.1 200");
        slow.push(s);
    }
    let fifth = signed_get(server.s3_addr, &host(&server), "/").await.expect("fifth");
    assert_eq!(fifth.status, 503, "{}", fifth.text());
    assert!(fifth.text().contains("SlowDown"));
    assert!(fifth.headers.contains_key("retry-after"));

    // Nobody reads: after the stall timeout the gateway cuts the downloads and frees their places.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = signed_get(server.s3_addr, &host(&server), "/").await.expect("after");
    assert_eq!(after.status, 200, "{}", after.text());
    assert!(metric(&server, "tensorgate_connections_closed_total{reason=\"stalled\"}").await >= 4.0);
    drop(slow);
    server.shutdown().await;
}

#[tokio::test]
async fn a_body_that_stops_coming_gets_request_timeout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fs_config(&dir.path().join("data"));
    cfg.edge.stall_timeout_secs = 1;
    let server = Server::start(&cfg).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    c.create_bucket().bucket("bkt").send().await.expect("create");
    let head = signed_head("PUT", &host(&server), "/bkt/partial", &[("content-length", "100000")]).expect("head");
    let mut s = TcpStream::connect(server.s3_addr).await.expect("connect");
    s.write_all(head.as_bytes()).await.expect("head");
    s.write_all(&[1u8; 1000]).await.expect("some of the body");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(60), s.read_to_end(&mut answer)).await.expect("answered");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("<Code>RequestTimeout</Code>"), "{answer}"); // the stall timeout's answer
    let missing = c.head_object().bucket("bkt").key("partial").send().await;
    assert!(missing.is_err(), "a cut upload stores nothing");
    server.shutdown().await;
}

/// A "store" that accepts connections, reads what comes and never answers.
async fn silent_store() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn a_silent_store_costs_a_request_its_deadline_and_a_full_backend_sheds_at_once() {
    let mut cfg = s3_config(&silent_store().await);
    cfg.edge.request_timeout_secs = 1;
    cfg.backend.response_timeout_secs = 60;
    cfg.backend.max_concurrency = 1;
    cfg.backend.permit_timeout_ms = 300;
    let server = Server::start(&cfg).await.expect("gateway");
    let h = host(&server);
    let (first, second) = tokio::join!(signed_get(server.s3_addr, &h, "/bkt/a"), async {
        // The first request holds the one backend slot while the store stays silent.
        tokio::time::sleep(Duration::from_millis(100)).await;
        signed_get(server.s3_addr, &h, "/bkt/b").await
    });
    let (first, second) = (first.expect("first"), second.expect("second"));
    assert_eq!(first.status, 503, "{}", first.text());
    assert!(first.text().contains("request_timeout_secs"), "{}", first.text());
    assert_eq!(second.status, 503, "{}", second.text());
    assert!(second.text().contains("<Code>SlowDown</Code>"), "{}", second.text());
    assert!(metric(&server, "tensorgate_request_timeouts_total").await >= 1.0);
    server.shutdown().await;
}
