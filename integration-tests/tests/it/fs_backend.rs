//! The embedded `fs` backend: a working S3 endpoint over a local directory, with no way out of it.

use aws_sdk_s3::primitives::ByteStream;
use bytes::Bytes;
use integration_tests::*;
use tensorgate::Server;

#[tokio::test]
async fn fs_backend_serves_s3_and_refuses_traversal() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("data");
    let server = Server::start(&fs_config(&root)).await.expect("gateway");
    let c = sdk_client(&url(server.s3_addr), CLIENT_AK, CLIENT_SK);
    c.create_bucket().bucket("local").send().await.expect("create");
    c.create_bucket().bucket("other").send().await.expect("create other");
    c.put_object().bucket("local").key("a/b.txt").body(ByteStream::from_static(b"on disk")).send().await.expect("put");
    let got = c.get_object().bucket("local").key("a/b.txt").send().await.expect("get");
    assert_eq!(got.body.collect().await.expect("body").into_bytes().as_ref(), b"on disk");
    assert_eq!(std::fs::read(root.join("local/a/b.txt")).expect("file on disk"), b"on disk");
    let listed = c.list_objects_v2().bucket("local").send().await.expect("list");
    assert_eq!(listed.contents().len(), 1);
    // Complete entries, as CRT-based clients (Mountpoint) require: the ETag is the object's.
    let head = c.head_object().bucket("local").key("a/b.txt").send().await.expect("head");
    assert_eq!(listed.contents()[0].e_tag(), head.e_tag());
    assert!(listed.contents()[0].e_tag().is_some());
    assert_eq!(listed.contents()[0].storage_class().map(|s| s.as_str()), Some("STANDARD"));
    let v1 = c.list_objects().bucket("local").send().await.expect("list v1");
    assert_eq!(v1.contents()[0].e_tag(), head.e_tag());
    let missing = c.get_object().bucket("local").key("nope").send().await.expect_err("missing");
    assert!(missing.into_service_error().is_no_such_key());
    // A common prefix is no object (s3s-fs alone answers 500 for the directory behind it).
    let prefix = c.get_object().bucket("local").key("a").send().await.expect_err("a prefix");
    assert!(prefix.into_service_error().is_no_such_key());
    let head = c.head_object().bucket("local").key("a").send().await.expect_err("a prefix");
    assert_eq!(head.raw_response().map(|r| r.status().as_u16()), Some(404));

    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    for evil in ["/local/..%2Fother%2Fx", "/local/a%2F..%2F..%2Fescape", "/local/%2Fetc%2Fpasswd"] {
        let r = raw(
            server.s3_addr,
            "PUT",
            &host,
            evil,
            &[],
            Bytes::from_static(b"evil"),
            Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
        )
        .await
        .expect("put");
        assert_eq!(r.status, 400, "{evil}: {}", r.text());
        assert!(r.text().contains("InvalidArgument"), "{}", r.text());
    }
    assert!(!root.join("other/x").exists());
    // A copy reads its source like a GET: a source outside its bucket is refused too.
    std::fs::write(dir.path().join("outside.txt"), b"not yours").expect("write outside");
    for evil in ["local/..%2F..%2Foutside.txt", "/local/a/../../outside.txt", "local/%2E%2E/x"] {
        let r = raw(
            server.s3_addr,
            "PUT",
            &host,
            "/local/stolen",
            &[("x-amz-copy-source", evil)],
            Bytes::new(),
            Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
        )
        .await
        .expect("copy");
        assert_eq!(r.status, 400, "{evil}: {}", r.text());
    }
    assert!(!root.join("local/stolen").exists());
    assert!(!dir.path().join("escape").exists());
    c.delete_object().bucket("local").key("a/b.txt").send().await.expect("delete");
    server.shutdown().await;
}
