//! Authentication at the gateway: wrong and unknown keys, presigned URLs, expiry, anonymous access.

use std::time::{Duration, SystemTime};

use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use integration_tests::*;
use tensorgate::Server;

async fn setup() -> (Server, aws_sdk_s3::Client, String) {
    let store = store().expect("store");
    let server = Server::start(&store_config(&store)).await.expect("gateway");
    let client = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    let bucket = unique_bucket("auth");
    client.create_bucket().bucket(&bucket).send().await.expect("create bucket");
    client
        .put_object()
        .bucket(&bucket)
        .key("k")
        .body(ByteStream::from_static(b"secret data"))
        .send()
        .await
        .expect("put");
    (server, client, bucket)
}

#[tokio::test]
async fn wrong_secret_and_unknown_key_are_refused() {
    let (server, _c, b) = setup().await;
    let wrong = sdk_client(&url(server.s3_addr), CLIENT_AK, "not-the-secret");
    let e = wrong.get_object().bucket(&b).key("k").send().await.expect_err("wrong secret");
    assert_eq!(e.raw_response().map(|r| r.status().as_u16()), Some(403));
    assert_eq!(aws_sdk_s3::error::ProvideErrorMetadata::code(&e), Some("SignatureDoesNotMatch"));
    let unknown = sdk_client(&url(server.s3_addr), "nobody", "x");
    let e = unknown.list_buckets().send().await.expect_err("unknown key");
    assert_eq!(aws_sdk_s3::error::ProvideErrorMetadata::code(&e), Some("InvalidAccessKeyId"));
    // The backend's own credentials are not client credentials.
    let store = store().expect("store");
    let backend_key = sdk_client(&url(server.s3_addr), store.access_key, store.secret_key);
    assert!(backend_key.list_buckets().send().await.is_err());
    server.shutdown().await;
}

#[tokio::test]
async fn presigned_urls_work_until_they_expire() {
    let (server, c, b) = setup().await;
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    // Presigned by the official SDK.
    let presigned = c
        .get_object()
        .bucket(&b)
        .key("k")
        .presigned(aws_sdk_s3::presigning::PresigningConfig::expires_in(Duration::from_secs(60)).expect("config"))
        .await
        .expect("presign");
    let path = presigned.uri().split_once(&host).expect("gateway URL").1.to_owned();
    let ok = raw(server.s3_addr, "GET", &host, &path, &[], Bytes::new(), Auth::None).await.expect("get");
    assert_eq!(ok.status, 200, "{}", ok.text());
    assert_eq!(ok.body.as_ref(), b"secret data");

    let tampered = path.replace("/k?", "/other?");
    let bad = raw(server.s3_addr, "GET", &host, &tampered, &[], Bytes::new(), Auth::None).await.expect("get");
    assert_eq!(bad.status, 403);

    let old = SystemTime::now() - Duration::from_secs(3600);
    let expired = raw(
        server.s3_addr,
        "GET",
        &host,
        &format!("/{b}/k"),
        &[],
        Bytes::new(),
        Auth::Presign(CLIENT_AK, CLIENT_SK, Duration::from_secs(60), old),
    )
    .await
    .expect("get");
    assert_eq!(expired.status, 403);
    assert!(
        expired.text().contains("<Code>AccessDenied</Code>") && expired.text().contains("expired"),
        "{}",
        expired.text()
    );
    server.shutdown().await;
}

#[tokio::test]
async fn anonymous_requests_need_operator_consent_and_the_stores_acls() {
    let (server, _c, b) = setup().await;
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let anon = raw(server.s3_addr, "GET", &host, &format!("/{b}/k"), &[], Bytes::new(), Auth::None).await.expect("get");
    assert_eq!(anon.status, 403);
    assert!(anon.text().contains("<Code>AccessDenied</Code>"));
    server.shutdown().await;

    // With anonymous access on, requests reach the store unsigned and the store decides: a private
    // bucket stays private (read, overwrite and delete are all refused, and nothing changed).
    let store = store().expect("store");
    let mut cfg = store_config(&store);
    cfg.allow_anonymous = true;
    let open = Server::start(&cfg).await.expect("gateway");
    let c = sdk_client(&url(open.s3_addr), CLIENT_AK, CLIENT_SK);
    let host = format!("127.0.0.1:{}", open.s3_addr.port());
    let key = format!("/{b}/k");
    // The store's own answer to the same anonymous request is the reference (403 on RGW and
    // SeaweedFS; Swift's s3api leaves unsigned requests to Swift proper, which answers 400).
    let direct: std::net::SocketAddr = store.endpoint.trim_start_matches("http://").parse().expect("store address");
    let direct_host = direct.to_string();
    for (method, body) in [("GET", &b""[..]), ("PUT", b"overwritten"), ("DELETE", b"")] {
        let body = Bytes::copy_from_slice(body);
        let via = raw(open.s3_addr, method, &host, &key, &[], body.clone(), Auth::None).await.expect("anonymous");
        let bare = raw(direct, method, &direct_host, &key, &[], body, Auth::None).await.expect("anonymous, direct");
        assert!(matches!(via.status, 400 | 403), "anonymous {method} of a private object: {}", via.text());
        assert_eq!(via.status, bare.status, "anonymous {method}: the store decides, as without the gateway");
    }
    // `Expect: 100-continue`: the first answer is the store's own (RGW and Swift refuse before
    // the body is sent; SeaweedFS invites it, then refuses), never an invitation from the gateway.
    async fn first_status(addr: std::net::SocketAddr, host: &str, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!("PUT {path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 10\r\nExpect: 100-continue\r\n\r\n");
        tcp.write_all(head.as_bytes()).await.expect("write");
        let mut first = vec![0u8; 64];
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), tcp.read(&mut first))
            .await
            .expect("an answer before the body")
            .expect("read");
        String::from_utf8_lossy(&first[..n]).split(' ').nth(1).unwrap_or_default().to_owned()
    }
    let via = first_status(open.s3_addr, &host, &key).await;
    assert_eq!(via, first_status(direct, &direct_host, &key).await, "Expect: 100-continue, as the store answers it");
    if store.kind != StoreKind::SeaweedFs {
        assert!(via.starts_with('4'), "refused before the body: {via}");
    }
    let kept = c.get_object().bucket(&b).key("k").send().await.expect("still there");
    assert_eq!(kept.body.collect().await.expect("body").into_bytes().as_ref(), b"secret data");
    if store.kind.has_public_acls() {
        // A public-read object is readable anonymously, as on the store itself.
        c.put_object()
            .bucket(&b)
            .key("public")
            .acl(aws_sdk_s3::types::ObjectCannedAcl::PublicRead)
            .body(ByteStream::from_static(b"for everyone"))
            .send()
            .await
            .expect("put public");
        let path = format!("/{b}/public");
        let got = raw(open.s3_addr, "GET", &host, &path, &[], Bytes::new(), Auth::None).await.expect("get");
        assert_eq!(got.status, 200, "{}", got.text());
        assert_eq!(got.body.as_ref(), b"for everyone");
        let put = raw(open.s3_addr, "PUT", &host, &path, &[], Bytes::from_static(b"vandal"), Auth::None).await;
        assert_eq!(put.expect("put").status, 403, "public-read is not public-write");
    }
    open.shutdown().await;
}

#[tokio::test]
async fn tampered_signed_payload_is_not_stored() {
    let (server, _c, b) = setup().await;
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let claimed = tensorgate::s3::sigv4::sha256_hex(b"the real body");
    let r = raw(
        server.s3_addr,
        "PUT",
        &host,
        &format!("/{b}/sha"),
        &[],
        "another body!".into(),
        Auth::Header(CLIENT_AK, CLIENT_SK, &claimed),
    )
    .await
    .expect("put");
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("XAmzContentSHA256Mismatch"), "{}", r.text());
    let absent = signed_head_status(server.s3_addr, &host, &format!("/{b}/sha")).await.expect("head");
    assert_eq!(absent, 404, "a body that does not match its signed hash must not be stored");
    let ok = raw(
        server.s3_addr,
        "PUT",
        &host,
        &format!("/{b}/sha"),
        &[],
        "the real body".into(),
        Auth::Header(CLIENT_AK, CLIENT_SK, &claimed),
    )
    .await
    .expect("put");
    assert_eq!(ok.status, 200, "{}", ok.text());

    // A large body (many frames reach the store before the hash is known) over an existing key:
    // the old content must survive.
    let big: Vec<u8> = (0..4 * 1024 * 1024u32).map(|i| (i % 253) as u8).collect();
    let mut tampered = big.clone();
    tampered[3 * 1024 * 1024] ^= 1;
    let claimed = tensorgate::s3::sigv4::sha256_hex(&big);
    let path = format!("/{b}/sha");
    let signed = Auth::Header(CLIENT_AK, CLIENT_SK, &claimed);
    let r = raw(server.s3_addr, "PUT", &host, &path, &[], tampered.into(), signed).await.expect("put");
    assert_eq!(r.status, 400, "{}", r.text());
    let kept = signed_get(server.s3_addr, &host, &path).await.expect("get");
    assert_eq!(kept.body.as_ref(), b"the real body", "a tampered overwrite must leave the object as it was");
    let r = raw(server.s3_addr, "PUT", &host, &path, &[], big.clone().into(), signed).await.expect("put");
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(signed_get(server.s3_addr, &host, &path).await.expect("get").body.as_ref(), big.as_slice());
    server.shutdown().await;
}
