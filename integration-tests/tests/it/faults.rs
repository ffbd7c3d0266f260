//! Faults: backend down, body limits, load shedding, graceful shutdown.

use std::time::Duration;

use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use integration_tests::*;
use tensorgate::Server;

/// Port of the SeaweedFS this module kills (not the shared one).
const DOOMED_PORT: u16 = 18533;

#[tokio::test]
async fn backend_killed_mid_test_gives_503_xml() {
    let endpoint = seaweedfs(DOOMED_PORT).expect("seaweedfs");
    let server = Server::start(&s3_config(&endpoint)).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    let b = unique_bucket("doomed");
    c.create_bucket().bucket(&b).send().await.expect("create");
    c.put_object().bucket(&b).key("k").body(ByteStream::from_static(b"x")).send().await.expect("put");
    stop_seaweedfs(DOOMED_PORT);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let r = signed_get(server.s3_addr, &host, &format!("/{b}/k")).await.expect("get");
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("<Code>ServiceUnavailable</Code>"), "{}", r.text());
    assert!(r.headers.contains_key("retry-after"));
    let retries = || async {
        let m = raw(server.admin_addr, "GET", "admin", "/metrics", &[], Bytes::new(), Auth::None)
            .await
            .expect("metrics")
            .text();
        m.lines()
            .find_map(|l| l.strip_prefix("tensorgate_backend_retries_total "))
            .and_then(|v| v.trim().parse::<u64>().ok())
            .expect("retry counter")
    };
    let after_get = retries().await;
    assert!(after_get > 0, "an idempotent GET is retried");
    // A PUT is not retried (its streamed body cannot be replayed).
    let r = raw(
        server.s3_addr,
        "PUT",
        &host,
        &format!("/{b}/k2"),
        &[],
        Bytes::from_static(b"data"),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("put");
    assert_eq!(r.status, 503, "{}", r.text());
    assert_eq!(retries().await, after_get);
    server.shutdown().await;
}

/// A backend that accepts connections but never answers: the client gets `503` after the response
/// timeout and the retry budget, not a hung request.
#[tokio::test]
async fn backend_timeout_gives_503() {
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = silent.local_addr().expect("addr");
    let hold = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = silent.accept().await {
            conns.push(c);
        }
    });
    let mut cfg = s3_config(&format!("http://{addr}"));
    cfg.backend.response_timeout_secs = 1;
    cfg.backend.retry_budget_secs = 2;
    let server = Server::start(&cfg).await.expect("gateway");
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let r = signed_get(server.s3_addr, &host, "/b/k").await.expect("get");
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("did not answer in time"), "{}", r.text()); // the response timeout's answer
    hold.abort();
    server.shutdown().await;
}

#[tokio::test]
async fn oversized_bodies_are_refused() {
    let endpoint = seaweedfs(SEAWEED_PORT).expect("seaweedfs");
    let mut cfg = s3_config(&endpoint);
    cfg.max_body_bytes = 1024;
    let server = Server::start(&cfg).await.expect("gateway");
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let b = unique_bucket("limit");
    let r = raw(
        server.s3_addr,
        "PUT",
        &host,
        &format!("/{b}"),
        &[],
        Bytes::new(),
        Auth::Header(CLIENT_AK, CLIENT_SK, tensorgate::s3::sigv4::EMPTY_SHA256),
    )
    .await
    .expect("create");
    assert_eq!(r.status, 200, "{}", r.text());
    let r = raw(
        server.s3_addr,
        "PUT",
        &host,
        &format!("/{b}/big"),
        &[],
        Bytes::from(vec![0u8; 4096]),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("put");
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("EntityTooLarge"));
    let r = raw(
        server.s3_addr,
        "PUT",
        &host,
        &format!("/{b}/small"),
        &[],
        Bytes::from(vec![0u8; 512]),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("put");
    assert_eq!(r.status, 200);
    server.shutdown().await;
}

#[tokio::test]
async fn health_readiness_and_metrics() {
    let endpoint = seaweedfs(SEAWEED_PORT).expect("seaweedfs");
    let server = Server::start(&s3_config(&endpoint)).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    c.list_buckets().send().await.expect("list");
    let get = |p: &'static str| raw(server.admin_addr, "GET", "admin", p, &[], Bytes::new(), Auth::None);
    assert_eq!(get("/healthz").await.expect("healthz").status, 200);
    assert_eq!(get("/readyz").await.expect("readyz").status, 200);
    let m = get("/metrics").await.expect("metrics").text();
    for needle in [
        r#"tensorgate_requests_total{op="ListBuckets",status_class="2xx"}"#,
        "tensorgate_backend_request_duration_seconds_bucket",
        "tensorgate_in_flight_requests",
        "tensorgate_response_body_bytes_total",
    ] {
        assert!(m.contains(needle), "{needle} missing from\n{m}");
    }
    assert!(!m.contains(CLIENT_SK) && !m.contains(SEAWEED_SK));
    server.gateway.begin_shutdown();
    assert_eq!(get("/readyz").await.expect("readyz").status, 503);
    server.shutdown().await;
}

/// A PUT whose body is still streaming holds its slot: with `max_in_flight = 1` the next request is
/// shed with `503 SlowDown`; shutdown then drains the first one to completion.
#[tokio::test]
async fn load_shedding_and_graceful_drain() {
    use http_body_util::StreamBody;
    use hyper::body::Frame;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let endpoint = seaweedfs(SEAWEED_PORT).expect("seaweedfs");
    let mut cfg = s3_config(&endpoint);
    cfg.max_in_flight = 1;
    cfg.allow_anonymous = false;
    let server = Server::start(&cfg).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    let b = unique_bucket("shed");
    c.create_bucket().bucket(&b).send().await.expect("create");

    // A slow upload, presigned so the body can stream from a channel.
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let presigned = c
        .put_object()
        .bucket(&b)
        .key("slow")
        .presigned(aws_sdk_s3::presigning::PresigningConfig::expires_in(Duration::from_secs(60)).expect("config"))
        .await
        .expect("presign");
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
    let mut rx = rx;
    let body = StreamBody::new(futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)));
    let req = http::Request::put(presigned.uri())
        .header("content-length", "8")
        .header("host", &host)
        .body(body)
        .expect("request");
    let client = Client::builder(TokioExecutor::new()).build_http();
    let slow = tokio::spawn(async move { client.request(req).await.map(|r| r.status().as_u16()) });
    tx.send(Ok(Frame::data(Bytes::from_static(b"1234")))).await.expect("send");
    tokio::time::sleep(Duration::from_millis(300)).await;

    let shed = signed_get(server.s3_addr, &host, "/").await.expect("list");
    assert_eq!(shed.status, 503, "{}", shed.text());
    assert!(shed.text().contains("SlowDown"));

    let addr = server.s3_addr;
    let shutdown = tokio::spawn(server.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    tx.send(Ok(Frame::data(Bytes::from_static(b"5678")))).await.expect("send");
    drop(tx);
    assert_eq!(slow.await.expect("join").expect("response"), 200, "the in-flight upload completes during drain");
    assert!(shutdown.await.expect("join"), "drained within the deadline");
    assert!(tokio::net::TcpStream::connect(addr).await.is_err(), "no longer accepting");
}

/// A client that goes away mid-download: the gateway drops the backend response (closing that
/// backend connection) and releases its in-flight slot and backend permit.
#[tokio::test]
async fn client_gone_mid_download_releases_the_request() {
    let endpoint = seaweedfs(SEAWEED_PORT).expect("seaweedfs");
    let server = Server::start(&s3_config(&endpoint)).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    let b = unique_bucket("gone");
    c.create_bucket().bucket(&b).send().await.expect("create");
    c.put_object().bucket(&b).key("big").body(ByteStream::from(vec![1u8; 32 * 1024 * 1024])).send().await.expect("put");
    let in_flight = || async {
        let m = raw(server.admin_addr, "GET", "admin", "/metrics", &[], Bytes::new(), Auth::None)
            .await
            .expect("metrics")
            .text();
        m.lines().find(|l| l.starts_with("tensorgate_in_flight_requests ")).map(str::to_owned).unwrap_or_default()
    };
    {
        let mut got = c.get_object().bucket(&b).key("big").send().await.expect("get");
        let first = got.body.try_next().await.expect("chunk").expect("some data");
        assert!(!first.is_empty());
        assert_eq!(in_flight().await, "tensorgate_in_flight_requests 1", "the download is in flight");
    } // dropped after one chunk
    let mut last = String::new();
    for _ in 0..50 {
        last = in_flight().await;
        if last == "tensorgate_in_flight_requests 0" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(last, "tensorgate_in_flight_requests 0");
    server.shutdown().await;
}
