//! Three gateways as one cluster, in-process, over one shared store (the fs backend on one
//! directory, as members of a real cluster share their store): membership and health at
//! `/v1/cluster`, pushdowns sent to any member computed by the object's rendezvous owner over the
//! authenticated hop with the same bytes whatever the route, a dead owner's objects computed by the
//! member asked, and a client that cannot name the tenant a hop acts for.

use std::time::{Duration, Instant};

use bytes::Bytes;
use integration_tests::*;
use tensorgate::Server;
use tensorgate::cluster::ClusterSettings;
use tensorgate::cluster::{Member, rank};
use tensorgate::pushdown::spec::Dtype;
use tensorgate::pushdown::tensor::{Tensor, write_npy};
use tensorgate::s3::credentials::SecretKey;

const MODEL: &str = "tiny-cnn";
const BUCKET: &str = "data";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port()
}

fn sample(seed: u32) -> Vec<u8> {
    let data =
        (0..3 * 32 * 32u32).map(|i| (i.wrapping_mul(2_654_435_761) ^ seed) % 1000).map(|v| v as f32 / 1000.0).collect();
    write_npy(&Tensor { shape: vec![3, 32, 32], data }, Dtype::F32)
}

/// Three members on fixed loopback ports over one directory.
async fn cluster(dir: &tempfile::TempDir) -> (Vec<Member>, Vec<Server>) {
    let members: Vec<Member> = (0..3)
        .map(|i| Member {
            id: format!("node-{i}"),
            s3: format!("http://127.0.0.1:{}", free_port()),
            admin: format!("http://127.0.0.1:{}", free_port()),
        })
        .collect();
    let mut servers = Vec::new();
    for m in &members {
        let mut cfg = fs_config(&dir.path().join("data"));
        cfg.listen = m.s3.trim_start_matches("http://").parse().expect("addr");
        cfg.admin_listen = m.admin.trim_start_matches("http://").parse().expect("addr");
        cfg.pushdown.models_dir = repo_root().join("models");
        cfg.pushdown.ort_library = Some(ort_library());
        cfg.cluster = Some(ClusterSettings {
            node_id: m.id.clone(),
            members: members.clone(),
            dns: None,
            dns_admin_port: 9001,
            refresh_secs: 1,
            probe_timeout_ms: 500,
            access_key: "it-cluster".into(),
            secret_key: Some(SecretKey::new("it-cluster-secret".into())),
            secret_key_file: None,
        });
        servers.push(Server::start(&cfg).await.expect("member"));
    }
    (members, servers)
}

async fn report(server: &Server) -> serde_json::Value {
    serde_json::from_str(&http_get(&format!("http://{}/v1/cluster", server.admin_addr)).await).expect("json")
}

async fn wait_states(server: &Server, want: &[&str]) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let r = report(server).await;
        let states: Vec<String> = r["members"]
            .as_array()
            .expect("members")
            .iter()
            .map(|m| m["state"].as_str().unwrap_or("").into())
            .collect();
        if states == want {
            return r;
        }
        assert!(Instant::now() < deadline, "members never reached {want:?}: {r}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn pushdown(server: &Server, key: &str, extra: &[(&str, &str)]) -> RawResponse {
    let host = format!("127.0.0.1:{}", server.s3_addr.port());
    let path = format!("/{BUCKET}/{key}?tensorgate-model={MODEL}&tensorgate-split=pool");
    raw(
        server.s3_addr,
        "GET",
        &host,
        &path,
        extra,
        Bytes::new(),
        Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"),
    )
    .await
    .expect("request")
}

fn computed_by(r: &RawResponse) -> String {
    r.headers.get("x-tensorgate-computed-by").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pushdowns_meet_their_owner_from_any_member_and_survive_a_dead_owner() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("data").join(BUCKET)).expect("bucket");
    let keys: Vec<String> = (0..12).map(|i| format!("s{i:02}.npy")).collect();
    for (i, k) in keys.iter().enumerate() {
        std::fs::write(dir.path().join("data").join(BUCKET).join(k), sample(i as u32)).expect("write");
    }
    let (members, mut servers) = cluster(&dir).await;
    let ids: Vec<&str> = members.iter().map(|m| m.id.as_str()).collect();
    for s in &servers {
        wait_states(s, &["ready", "ready", "ready"]).await;
    }
    let r = report(&servers[0]).await;
    assert_eq!((r["node"].as_str(), r["hashing"].as_str()), (Some("node-0"), Some(tensorgate::cluster::HASHING)));

    // Every object through member 0 and member 1: computed by its owner, equal bytes.
    let mut bodies = Vec::new();
    for k in &keys {
        let owner = *rank(&ids, BUCKET, k)[0];
        let a = pushdown(&servers[0], k, &[]).await;
        let b = pushdown(&servers[1], k, &[]).await;
        assert_eq!((a.status, b.status), (200, 200), "{}", a.text());
        assert_eq!((computed_by(&a), computed_by(&b)), (owner.to_owned(), owner.to_owned()), "{k}");
        assert_eq!(a.body, b.body, "{k}: the route changed the result");
        // The owner's own answer (a cache hit there) is the same again.
        let direct = pushdown(&servers[ids.iter().position(|i| *i == owner).expect("owner")], k, &[]).await;
        assert_eq!(direct.body, a.body);
        bodies.push((owner, a.body));
    }
    let not_mine = bodies.iter().filter(|(o, _)| *o != "node-0").count();
    assert!(not_mine > 0 && not_mine < keys.len(), "the 12 keys spread over the members");
    let m0 = http_get(&format!("http://{}/metrics", servers[0].admin_addr)).await;
    assert_eq!(metric_sum(&m0, "tensorgate_cluster_forwarded_total") as usize, not_mine, "{m0}");
    // Hops have their own upstream numbers; the store's (a local directory here: none) exclude them.
    assert_eq!(metric_sum(&m0, "tensorgate_cluster_hop_request_duration_seconds_count") as usize, not_mine, "{m0}");
    assert!(metric_sum(&m0, "tensorgate_cluster_hop_response_body_bytes_total") > 0.0, "{m0}");
    assert_eq!(metric_sum(&m0, "tensorgate_backend_request_duration_seconds_count"), 0.0, "{m0}");

    // A client cannot name the tenant a request acts for: only the cluster credential may.
    let spoofed = pushdown(&servers[0], "s00.npy", &[("tensorgate-peer-tenant", "mallory")]).await;
    assert_eq!(spoofed.status, 200);
    for s in &servers {
        let m = http_get(&format!("http://{}/metrics", s.admin_addr)).await;
        assert!(!m.contains("mallory"), "a client named a tenant");
    }

    // The hop credential signs pushdown reads only: a plain read or a write with it is refused.
    let host = format!("127.0.0.1:{}", servers[0].s3_addr.port());
    let peer = Auth::Header("it-cluster", "it-cluster-secret", "UNSIGNED-PAYLOAD");
    for (method, body) in [("GET", Bytes::new()), ("PUT", Bytes::from_static(b"x"))] {
        let r = raw(servers[0].s3_addr, method, &host, &format!("/{BUCKET}/s00.npy"), &[], body, peer)
            .await
            .expect("request");
        assert_eq!(r.status, 403, "{method}: {}", r.text());
    }

    // node-2 goes away: its objects are computed by the member asked (at once: the hop fails),
    // then by the next member in their order once the membership has noticed. Same bytes.
    let gone = servers.remove(2);
    assert!(gone.shutdown().await);
    for (k, (owner, body)) in keys.iter().zip(&bodies) {
        if *owner != "node-2" {
            continue;
        }
        let r = pushdown(&servers[0], k, &[]).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(&r.body, body, "{k}: recomputed elsewhere, the same bytes");
        assert_ne!(computed_by(&r), "node-2");
    }
    for s in &servers {
        wait_states(s, &["ready", "ready", "unreachable"]).await;
    }
    for (k, (owner, body)) in keys.iter().zip(&bodies) {
        if *owner != "node-2" {
            continue;
        }
        let next = *rank(&ids[..2], BUCKET, k)[0];
        let r = pushdown(&servers[1], k, &[]).await;
        assert_eq!((r.status, computed_by(&r)), (200, next.to_owned()), "{k}");
        assert_eq!(&r.body, body);
    }
    for s in servers {
        s.shutdown().await;
    }
}

#[test]
fn cluster_settings_are_checked() {
    let mut cfg = tensorgate::Config::default();
    let member =
        |id: &str| Member { id: id.into(), s3: "http://10.0.0.1:9000".into(), admin: "http://10.0.0.1:9001".into() };
    cfg.cluster = Some(ClusterSettings {
        node_id: "node-9".into(),
        members: vec![member("node-1")],
        dns: None,
        dns_admin_port: 9001,
        refresh_secs: 5,
        probe_timeout_ms: 1000,
        access_key: "c".into(),
        secret_key: None,
        secret_key_file: None,
    });
    assert!(cfg.validate().expect_err("not a member").to_string().contains("cluster.node_id"));
    let c = cfg.cluster.as_mut().expect("cluster");
    c.node_id = "node-1".into();
    c.members[0].s3 = "10.0.0.1:9000".into();
    assert!(cfg.validate().expect_err("not a URL").to_string().contains("cluster.members.s3"));
    cfg.cluster.as_mut().expect("cluster").members[0].s3 = "http://10.0.0.1:9000".into();
    cfg.validate().expect("valid");
    let toml = "[cluster]\nnode_id = \"a\"\nmembers = [{ id = \"a\", s3 = \"http://127.0.0.1:1\", admin = \"http://127.0.0.1:2\" }]\n";
    let parsed = tensorgate::Config::from_toml(toml).expect("parses");
    assert_eq!(parsed.cluster.expect("cluster").refresh_secs, tensorgate::cluster::DEFAULT_CLUSTER_REFRESH_SECS);
}
