//! Transparent identity mode (ADR 0013) against a real store (`TENSORGATE_IT_STORE`): the store's
//! own user signs, the gateway holds no key, and every request gets the store's own answer. Each
//! upload framing is sent through the gateway and straight to the store, signed for each, and the
//! two answers (and what the store then holds) must agree.

use aws_sdk_s3::primitives::ByteStream;
use aws_sdk_s3::types::{ChecksumAlgorithm, CompletedMultipartUpload, CompletedPart, Delete, ObjectIdentifier};
use bytes::Bytes;
use integration_tests::*;
use tensorgate::Server;

const TRAILER_BODY: &str = "d\r\nhello trailer\r\n0\r\nx-amz-checksum-crc32:WzGbuw==\r\n\r\n";

/// One upload, as a function of (host, path) it is signed for: (headers, body, auth mode).
type Upload = Box<dyn Fn(&str, &str, &Store) -> (Vec<(String, String)>, Bytes, Option<String>)>;

fn uploads() -> Vec<(&'static str, Upload)> {
    let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let d2 = data.clone();
    let plain = Bytes::from_static(b"plain body");
    let trailer_headers = || {
        vec![
            ("content-encoding".to_owned(), "aws-chunked".to_owned()),
            ("x-amz-decoded-content-length".to_owned(), "13".to_owned()),
            ("x-amz-trailer".to_owned(), "x-amz-checksum-crc32".to_owned()),
        ]
    };
    vec![
        ("unsigned-payload", Box::new(move |_, _, _| (vec![], plain.clone(), Some("UNSIGNED-PAYLOAD".into())))),
        (
            "signed-sha256",
            Box::new(|_, _, _| {
                let body = Bytes::from_static(b"signed body");
                (vec![], body.clone(), Some(tensorgate::s3::sigv4::sha256_hex(&body)))
            }),
        ),
        (
            "wrong-sha256",
            Box::new(|_, _, _| {
                (vec![], Bytes::from_static(b"tampered"), Some(tensorgate::s3::sigv4::sha256_hex(b"original")))
            }),
        ),
        (
            "signed-chunks",
            Box::new(move |host, path, s| {
                signed_chunked_upload(host, path, s.access_key, s.secret_key, &data, 64 * 1024, false)
                    .map(|(h, b)| (h, b, None))
                    .expect("encode")
            }),
        ),
        (
            "tampered-chunks",
            Box::new(move |host, path, s| {
                signed_chunked_upload(host, path, s.access_key, s.secret_key, &d2, 64 * 1024, true)
                    .map(|(h, b)| (h, b, None))
                    .expect("encode")
            }),
        ),
        (
            "unsigned-trailer",
            Box::new(move |_, _, _| {
                (
                    trailer_headers(),
                    Bytes::from_static(TRAILER_BODY.as_bytes()),
                    Some("STREAMING-UNSIGNED-PAYLOAD-TRAILER".into()),
                )
            }),
        ),
    ]
}

async fn put(addr: std::net::SocketAddr, path: &str, store: &Store, upload: &Upload) -> RawResponse {
    let host = addr.to_string();
    let (headers, body, sha) = upload(&host, path, store);
    let hv: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let auth = match &sha {
        Some(sha) => Auth::Header(store.access_key, store.secret_key, sha),
        None => Auth::None,
    };
    raw(addr, "PUT", &host, path, &hv, body, auth).await.expect("put")
}

async fn read(addr: std::net::SocketAddr, path: &str, store: &Store) -> RawResponse {
    let host = addr.to_string();
    raw(
        addr,
        "GET",
        &host,
        path,
        &[],
        Bytes::new(),
        Auth::Header(store.access_key, store.secret_key, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("get")
}

fn code(r: &RawResponse) -> Option<String> {
    let t = r.text();
    Some(t.split("<Code>").nth(1)?.split("</Code>").next()?.to_owned())
}

#[tokio::test]
async fn every_upload_framing_gets_the_stores_own_answer() {
    let store = store().expect("store");
    let server = Server::start(&transparent_config(&store)).await.expect("gateway");
    let direct = store_addr(&store);
    let bucket = unique_bucket("tp");
    direct_client(&store).create_bucket().bucket(&bucket).send().await.expect("bucket");
    for (name, upload) in uploads() {
        let via = put(server.s3_addr, &format!("/{bucket}/gw-{name}"), &store, &upload).await;
        let got_via = read(direct, &format!("/{bucket}/gw-{name}"), &store).await;
        if name == "wrong-sha256" {
            // Checked by the gateway without the secret: refused and not stored on every store,
            // also where the store itself would store it (SeaweedFS does not check the hash).
            assert_eq!((via.status, code(&via).as_deref()), (400, Some("XAmzContentSHA256Mismatch")), "{}", via.text());
            assert_eq!(got_via.status, 404, "a body that fails its signed hash must not be stored");
            continue;
        }
        let bare = put(direct, &format!("/{bucket}/direct-{name}"), &store, &upload).await;
        assert_eq!((via.status, code(&via)), (bare.status, code(&bare)), "{name}: {} / {}", via.text(), bare.text());
        let got_bare = read(direct, &format!("/{bucket}/direct-{name}"), &store).await;
        assert_eq!(got_via.status, got_bare.status, "{name}: stored through the gateway iff stored directly");
        if got_via.status == 200 {
            assert_eq!(got_via.body, got_bare.body, "{name}: the same bytes stored");
        }
    }
    server.shutdown().await;
}

#[tokio::test]
async fn a_store_that_checks_payload_hashes_itself_answers_every_upload_alone() {
    // `backend.checks_payload_hash`: the gateway hashes nothing, so every framing, a body that
    // fails its signed hash included, gets exactly the store's answer and the store's outcome
    // (RGW and Swift refuse it; SeaweedFS stores it, which is why the setting is off by default).
    let store = store().expect("store");
    let mut cfg = transparent_config(&store);
    cfg.backend.checks_payload_hash = true;
    let server = Server::start(&cfg).await.expect("gateway");
    let direct = store_addr(&store);
    let bucket = unique_bucket("tph");
    direct_client(&store).create_bucket().bucket(&bucket).send().await.expect("bucket");
    for (name, upload) in uploads() {
        let via = put(server.s3_addr, &format!("/{bucket}/gw-{name}"), &store, &upload).await;
        let bare = put(direct, &format!("/{bucket}/direct-{name}"), &store, &upload).await;
        assert_eq!((via.status, code(&via)), (bare.status, code(&bare)), "{name}: {} / {}", via.text(), bare.text());
        let got_via = read(direct, &format!("/{bucket}/gw-{name}"), &store).await;
        let got_bare = read(direct, &format!("/{bucket}/direct-{name}"), &store).await;
        assert_eq!(got_via.status, got_bare.status, "{name}: stored through the gateway iff stored directly");
        if got_via.status == 200 {
            assert_eq!(got_via.body, got_bare.body, "{name}: the same bytes stored");
        }
    }
    server.shutdown().await;
}

#[tokio::test]
async fn the_sdk_with_the_stores_own_key_works_through_the_gateway() {
    let store = store().expect("store");
    let server = Server::start(&transparent_config(&store)).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), store.access_key, store.secret_key);
    let b = unique_bucket("tps");
    c.create_bucket().bucket(&b).send().await.expect("create bucket");
    c.put_object()
        .bucket(&b)
        .key("dir/ü nicode+key.txt")
        .body(ByteStream::from_static(b"hello"))
        .metadata("purpose", "it")
        .send()
        .await
        .expect("put");
    let got = c.get_object().bucket(&b).key("dir/ü nicode+key.txt").send().await.expect("get");
    assert_eq!(got.metadata().and_then(|m| m.get("purpose")).map(String::as_str), Some("it"));
    assert_eq!(got.body.collect().await.expect("body").into_bytes().as_ref(), b"hello");
    let listed = c.list_objects_v2().bucket(&b).prefix("dir/").send().await.expect("list");
    assert_eq!(listed.key_count(), Some(1));
    c.copy_object()
        .bucket(&b)
        .key("copy")
        .copy_source(format!("{b}/dir/%C3%BC%20nicode%2Bkey.txt"))
        .send()
        .await
        .expect("copy");

    let part = vec![7u8; 5 * 1024 * 1024];
    let up = c.create_multipart_upload().bucket(&b).key("mp").send().await.expect("create mpu");
    let id = up.upload_id().expect("upload id").to_owned();
    let mut done = CompletedMultipartUpload::builder();
    for n in 1..=2 {
        let p = c
            .upload_part()
            .bucket(&b)
            .key("mp")
            .upload_id(&id)
            .part_number(n)
            .body(ByteStream::from(part.clone()))
            .send()
            .await
            .expect("part");
        done = done.parts(CompletedPart::builder().part_number(n).e_tag(p.e_tag().expect("etag")).build());
    }
    c.complete_multipart_upload()
        .bucket(&b)
        .key("mp")
        .upload_id(&id)
        .multipart_upload(done.build())
        .send()
        .await
        .expect("complete");
    let head = c.head_object().bucket(&b).key("mp").send().await.expect("head");
    assert_eq!(head.content_length(), Some(10 * 1024 * 1024));

    // An SDK checksum upload: what the store answers directly, it answers through the gateway.
    let with_ck = |c: &aws_sdk_s3::Client, key: &'static str| {
        c.put_object()
            .bucket(&b)
            .key(key)
            .checksum_algorithm(ChecksumAlgorithm::Crc32)
            .body(ByteStream::from_static(b"checksummed"))
            .send()
    };
    let (via, bare) = (with_ck(&c, "ck-gw").await, with_ck(&direct_client(&store), "ck-direct").await);
    assert_eq!(via.is_ok(), bare.is_ok(), "{via:?} / {bare:?}");

    let deleted = c
        .delete_objects()
        .bucket(&b)
        .delete(
            Delete::builder()
                .objects(ObjectIdentifier::builder().key("copy").build().expect("id"))
                .build()
                .expect("delete"),
        )
        .send()
        .await;
    // Swift's s3api needs Content-MD5 (added by the gateway, beside the signature).
    assert_eq!(deleted.expect("delete objects").deleted().len(), 1);

    let presigned = c
        .get_object()
        .bucket(&b)
        .key("mp")
        .presigned(
            aws_sdk_s3::presigning::PresigningConfig::expires_in(std::time::Duration::from_secs(60)).expect("cfg"),
        )
        .await
        .expect("presign");
    let uri: http::Uri = presigned.uri().parse().expect("uri");
    let got = raw(
        server.s3_addr,
        "GET",
        &server.s3_addr.to_string(),
        uri.path_and_query().expect("pq").as_str(),
        &[],
        Bytes::new(),
        Auth::None,
    )
    .await
    .expect("presigned get");
    assert_eq!(got.status, 200);
    assert_eq!(got.body.len(), 10 * 1024 * 1024);

    let wrong = sdk_client(&url(server.s3_addr), store.access_key, "not-the-secret");
    let err = wrong.list_buckets().send().await.expect_err("refused");
    assert_eq!(err.raw_response().map(|r| r.status().as_u16()), Some(403));
    server.shutdown().await;
}
