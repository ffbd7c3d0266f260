//! Harness for the end-to-end tests: a real store (SeaweedFS, Ceph RGW or OpenStack Swift, each
//! started by its script in `scripts/`), the real gateway started in-process on ephemeral ports,
//! the real `aws-sdk-s3` client, and a raw signer (the official `aws-sigv4` crate) for the
//! requests the SDK will not send.
//!
//! `TENSORGATE_IT_STORE` picks the store the store-facing tests run against: `seaweedfs` (the
//! default), `ceph-rgw` or `swift`. `scripts/test.sh` runs them once per store.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use aws_credential_types::Credentials;
use aws_sdk_s3::config::{BehaviorVersion, Region};
use aws_sigv4::http_request::{
    PayloadChecksumKind, PercentEncodingMode, SignableBody, SignableRequest, SignatureLocation, SigningSettings,
    UriPathNormalizationMode, sign,
};
use aws_sigv4::sign::v4;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tensorgate::config::{BackendKind, Config, CredentialConfig};
use tensorgate::s3::credentials::SecretKey;

pub const CLIENT_AK: &str = "it-access-key";
pub const CLIENT_SK: &str = "it-secret-key";
pub const SEAWEED_AK: &str = "seaweed-ak";
pub const SEAWEED_SK: &str = "seaweed-sk";
/// The shared SeaweedFS of the test run (the kill test starts its own on another port).
pub const SEAWEED_PORT: u16 = 18433;

/// The repository root.
#[must_use]
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_path_buf()
}

/// Starts (or finds running) a SeaweedFS on `port`; returns its endpoint.
///
/// # Errors
/// When the script fails (e.g. `scripts/setup.sh` was not run).
pub fn seaweedfs(port: u16) -> anyhow::Result<String> {
    let out = Command::new("bash")
        .arg(repo_root().join("scripts/seaweedfs.sh"))
        .arg("start")
        .env("SEAWEED_PORT", port.to_string())
        .output()
        .context("running scripts/seaweedfs.sh")?;
    if !out.status.success() {
        bail!("seaweedfs.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?.trim().to_owned())
}

/// A store the gateway forwards to, as the tests see it.
#[derive(Debug, Clone)]
pub struct Store {
    pub kind: StoreKind,
    pub endpoint: String,
    pub access_key: &'static str,
    pub secret_key: &'static str,
}

/// The stores the suite runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    SeaweedFs,
    CephRgw,
    Swift,
}

impl StoreKind {
    /// The store named by `TENSORGATE_IT_STORE` (default SeaweedFS).
    ///
    /// # Panics
    /// On an unknown name.
    #[must_use]
    pub fn from_env() -> Self {
        match std::env::var("TENSORGATE_IT_STORE").as_deref() {
            Err(_) | Ok("" | "seaweedfs") => Self::SeaweedFs,
            Ok("ceph-rgw") => Self::CephRgw,
            Ok("swift") => Self::Swift,
            Ok(other) => panic!("TENSORGATE_IT_STORE={other}: expected seaweedfs, ceph-rgw or swift"),
        }
    }

    /// Whether the store implements object tagging (Swift 2.30's s3api does not).
    #[must_use]
    pub fn has_tagging(self) -> bool {
        self != Self::Swift
    }

    /// Whether the store enforces ACLs on anonymous requests (Swift 2.30's s3api refuses every
    /// anonymous request; SeaweedFS has no anonymous ACLs by default).
    #[must_use]
    pub fn has_public_acls(self) -> bool {
        self == Self::CephRgw
    }
}

/// Credentials of the stores' scripts (their defaults).
pub const RGW_AK: &str = "rgw-ak";
pub const RGW_SK: &str = "rgw-sk";
pub const SWIFT_AK: &str = "test:tester";
pub const SWIFT_SK: &str = "testing";
pub const RGW_PORT: u16 = 19533;
pub const SWIFT_PORT: u16 = 19633;

/// Starts (or finds running) the store this run tests against.
///
/// # Errors
/// When its script fails.
pub fn store() -> anyhow::Result<Store> {
    let kind = StoreKind::from_env();
    let (script, port_var, port, access_key, secret_key) = match kind {
        StoreKind::SeaweedFs => ("seaweedfs.sh", "SEAWEED_PORT", SEAWEED_PORT, SEAWEED_AK, SEAWEED_SK),
        StoreKind::CephRgw => ("ceph-rgw.sh", "RGW_PORT", RGW_PORT, RGW_AK, RGW_SK),
        StoreKind::Swift => ("swift.sh", "SWIFT_PORT", SWIFT_PORT, SWIFT_AK, SWIFT_SK),
    };
    let out = Command::new("bash")
        .arg(repo_root().join("scripts").join(script))
        .arg("start")
        .env(port_var, port.to_string())
        .output()
        .with_context(|| format!("running scripts/{script}"))?;
    if !out.status.success() {
        bail!("{script} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let endpoint = String::from_utf8(out.stdout)?.lines().last().unwrap_or_default().trim().to_owned();
    Ok(Store { kind, endpoint, access_key, secret_key })
}

/// A gateway configuration on ephemeral ports with one client credential, in front of `store`.
#[must_use]
pub fn store_config(store: &Store) -> Config {
    let mut c = s3_config(&store.endpoint);
    c.backend.access_key = Some(store.access_key.to_owned());
    c.backend.secret_key = Some(SecretKey::new(store.secret_key.to_owned()));
    c.backend.trailing_checksums = store.kind == StoreKind::SeaweedFs;
    c
}

/// A gateway in transparent identity mode in front of `store`: no client key, no store key.
#[must_use]
pub fn transparent_config(store: &Store) -> Config {
    let mut c = s3_config(&store.endpoint);
    c.backend.access_key = None;
    c.backend.secret_key = None;
    c.credentials.clear();
    c.backend.identity = tensorgate::config::IdentityMode::Transparent;
    c
}

/// The store's address as a socket address (its endpoint is `http://127.0.0.1:PORT`).
///
/// # Panics
/// On an endpoint that is not `http://IP:PORT`.
#[must_use]
pub fn store_addr(store: &Store) -> SocketAddr {
    store.endpoint.trim_start_matches("http://").parse().expect("store endpoint is http://IP:PORT")
}

/// An SDK client that talks to the store directly, with the store's own key (to check what
/// the store holds, bypassing the gateway).
#[must_use]
pub fn direct_client(store: &Store) -> aws_sdk_s3::Client {
    sdk_client(&store.endpoint, store.access_key, store.secret_key)
}

/// Stops the SeaweedFS on `port`.
pub fn stop_seaweedfs(port: u16) {
    let _ = Command::new("bash")
        .arg(repo_root().join("scripts/seaweedfs.sh"))
        .arg("stop")
        .env("SEAWEED_PORT", port.to_string())
        .status();
}

/// A gateway configuration on ephemeral ports with one client credential, in front of `endpoint`.
#[must_use]
pub fn s3_config(endpoint: &str) -> Config {
    let mut c = base_config();
    c.backend.kind = BackendKind::S3;
    c.backend.endpoint = Some(endpoint.to_owned());
    c.backend.access_key = Some(SEAWEED_AK.to_owned());
    c.backend.secret_key = Some(SecretKey::new(SEAWEED_SK.to_owned()));
    c
}

/// A gateway configuration serving `root` with the fs backend.
#[must_use]
pub fn fs_config(root: &Path) -> Config {
    let mut c = base_config();
    c.backend.kind = BackendKind::Fs;
    c.backend.root = root.to_path_buf();
    c
}

fn base_config() -> Config {
    let mut c = Config {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        admin_listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..Config::default()
    };
    c.domains = vec!["s3.test".to_owned()];
    c.credentials = vec![CredentialConfig {
        access_key: CLIENT_AK.into(),
        secret_key: Some(SecretKey::new(CLIENT_SK.into())),
        ..CredentialConfig::default()
    }];
    c.shutdown_grace_secs = 5;
    c.backend.retry_budget_secs = 2;
    c.backend.response_timeout_secs = 5;
    c
}

/// An `aws-sdk-s3` client for `endpoint` with the given credentials (path style).
#[must_use]
pub fn sdk_client(endpoint: &str, ak: &str, sk: &str) -> aws_sdk_s3::Client {
    let conf = aws_sdk_s3::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .endpoint_url(endpoint)
        .force_path_style(true)
        .credentials_provider(Credentials::new(ak, sk, None, None, "it"))
        .build();
    aws_sdk_s3::Client::from_conf(conf)
}

/// The gateway's URL.
#[must_use]
pub fn url(addr: SocketAddr) -> String {
    format!("http://{addr}")
}

/// A bucket name unique within the test run (nextest runs each test in its own process, so the
/// process id is part of it).
#[must_use]
pub fn unique_bucket(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let t = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or_default();
    format!("{prefix}-{}-{}-{}", std::process::id(), t % 100_000_000, N.fetch_add(1, Ordering::Relaxed))
}

/// A response from [`raw`].
#[derive(Debug)]
pub struct RawResponse {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl RawResponse {
    #[must_use]
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How [`raw`] authenticates.
#[derive(Debug, Clone, Copy)]
pub enum Auth<'a> {
    None,
    /// Header signature with `(access key, secret)` and the given `x-amz-content-sha256` value.
    Header(&'a str, &'a str, &'a str),
    /// A presigned URL valid for the duration, signed at the given time.
    Presign(&'a str, &'a str, Duration, SystemTime),
}

/// Sends one hand-built request to `addr` with `Host: host`, signed as `auth` says.
///
/// # Errors
/// Transport failures.
pub async fn raw(
    addr: SocketAddr,
    method: &str,
    host: &str,
    path_and_query: &str,
    headers: &[(&str, &str)],
    body: Bytes,
    auth: Auth<'_>,
) -> anyhow::Result<RawResponse> {
    let uri = format!("http://{host}{path_and_query}");
    let mut req = http::Request::builder().method(method).uri(&uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut req = req.header("host", host).body(Full::new(body))?;
    match auth {
        Auth::None => {}
        Auth::Header(ak, sk, content_sha) => {
            req.headers_mut().insert("x-amz-content-sha256", content_sha.parse()?);
            sign_request(&mut req, ak, sk, None, SystemTime::now(), content_sha)?;
        }
        Auth::Presign(ak, sk, expires, at) => sign_request(&mut req, ak, sk, Some(expires), at, "UNSIGNED-PAYLOAD")?,
    }
    // Send to the gateway's address whatever the Host header says (virtual-host tests).
    *req.uri_mut() =
        format!("http://{addr}{}", req.uri().path_and_query().map(|p| p.as_str()).unwrap_or("/")).parse()?;
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(RawResponse { status, headers, body })
}

/// A GET signed with the test client's key (header SigV4, `UNSIGNED-PAYLOAD`).
///
/// # Errors
/// Transport failures.
pub async fn signed_get(addr: SocketAddr, host: &str, path_and_query: &str) -> anyhow::Result<RawResponse> {
    raw(addr, "GET", host, path_and_query, &[], Bytes::new(), Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"))
        .await
}

/// The status of a HEAD signed with the test client's key (does the object exist?).
///
/// # Errors
/// Transport failures.
pub async fn signed_head_status(addr: SocketAddr, host: &str, path: &str) -> anyhow::Result<u16> {
    let r = raw(addr, "HEAD", host, path, &[], Bytes::new(), Auth::Header(CLIENT_AK, CLIENT_SK, "UNSIGNED-PAYLOAD"));
    Ok(r.await?.status)
}

fn sign_request(
    req: &mut http::Request<Full<Bytes>>,
    ak: &str,
    sk: &str,
    presign: Option<Duration>,
    at: SystemTime,
    content_sha: &str,
) -> anyhow::Result<()> {
    let identity = Credentials::new(ak, sk, None, None, "raw").into();
    let mut settings = SigningSettings::default();
    settings.percent_encoding_mode = PercentEncodingMode::Single;
    settings.uri_path_normalization_mode = UriPathNormalizationMode::Disabled;
    if let Some(exp) = presign {
        settings.signature_location = SignatureLocation::QueryParams;
        settings.expires_in = Some(exp);
    } else {
        settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    }
    let params = v4::SigningParams::builder()
        .identity(&identity)
        .region("us-east-1")
        .name("s3")
        .time(at)
        .settings(settings)
        .build()?
        .into();
    let uri = req.uri().to_string();
    let hdrs: Vec<(String, String)> =
        req.headers().iter().map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned())).collect();
    let signable = SignableRequest::new(
        req.method().as_str(),
        &uri,
        hdrs.iter().map(|(k, v)| (k.as_str(), v.as_str())),
        SignableBody::Precomputed(content_sha.to_owned()),
    )?;
    let (instructions, _) = sign(signable, &params)?.into_parts();
    instructions.apply_to_request_http1x(req);
    Ok(())
}

/// Signs a `STREAMING-AWS4-HMAC-SHA256-PAYLOAD` body the way SDKs do: returns the headers to send
/// (with the seed signature, made by `aws-sigv4`) and the encoded body. The chunk signatures use
/// `tensorgate::s3::sigv4`'s pure functions, which unit tests check against AWS's published
/// chunk-signing example.
///
/// # Errors
/// Signing failures.
pub fn signed_chunked_upload(
    host: &str,
    path: &str,
    ak: &str,
    sk: &str,
    data: &[u8],
    chunk: usize,
    tamper: bool,
) -> anyhow::Result<(Vec<(String, String)>, Bytes)> {
    use tensorgate::s3::sigv4::{chunk_string_to_sign, scope, sha256_hex, signature, signing_key};
    let now = SystemTime::now();
    let mut req = http::Request::builder()
        .method("PUT")
        .uri(format!("http://{host}{path}"))
        .header("host", host)
        .header("content-encoding", "aws-chunked")
        .header("x-amz-decoded-content-length", data.len().to_string())
        .header("x-amz-content-sha256", "STREAMING-AWS4-HMAC-SHA256-PAYLOAD")
        .body(Full::new(Bytes::new()))?;
    sign_request(&mut req, ak, sk, None, now, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD")?;
    let auth = req.headers()["authorization"].to_str()?.to_owned();
    let seed = auth.rsplit("Signature=").next().unwrap_or_default().to_owned();
    let amz_date = req.headers()["x-amz-date"].to_str()?.to_owned();
    let date = &amz_date[..8];
    let key = signing_key(sk.as_bytes(), date, "us-east-1", "s3");
    let scope = scope(date, "us-east-1", "s3");
    let mut prev = seed;
    let mut body = Vec::new();
    let mut pieces: Vec<&[u8]> = data.chunks(chunk).collect();
    pieces.push(&[]);
    for (i, piece) in pieces.iter().enumerate() {
        let sig = signature(&key, &chunk_string_to_sign(&amz_date, &scope, &prev, &sha256_hex(piece)));
        body.extend_from_slice(format!("{:x};chunk-signature={sig}\r\n", piece.len()).as_bytes());
        let mut p = piece.to_vec();
        if tamper && i == 0 && !p.is_empty() {
            p[0] ^= 1;
        }
        body.extend_from_slice(&p);
        body.extend_from_slice(b"\r\n");
        prev = sig;
    }
    let headers = req
        .headers()
        .iter()
        .filter(|(k, _)| *k != "host")
        .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or_default().to_owned()))
        .collect();
    Ok((headers, Bytes::from(body)))
}

/// A TLS-terminating TCP relay in front of `upstream` (`host:port`), with a fresh self-signed
/// certificate for `localhost`. Returns the relay's port and the certificate's PEM (the CA to trust).
///
/// # Errors
/// Certificate generation or bind failures.
pub async fn tls_relay(upstream: String) -> anyhow::Result<(u16, String)> {
    use std::sync::Arc;

    let cert = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()])?;
    let pem = cert.cert.pem();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await else { return };
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
            });
        }
    });
    Ok((port, pem))
}

/// The head of a request signed with the test client's key (`UNSIGNED-PAYLOAD`), as the bytes a
/// client writes before its body: for tests that send the body by hand (slowly, or not at all).
///
/// # Errors
/// Signing failures.
pub fn signed_head(method: &str, host: &str, path: &str, headers: &[(&str, &str)]) -> anyhow::Result<String> {
    let mut req = http::Request::builder().method(method).uri(format!("http://{host}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let mut req = req.header("host", host).header("x-amz-content-sha256", "UNSIGNED-PAYLOAD").body(Full::default())?;
    sign_request(&mut req, CLIENT_AK, CLIENT_SK, None, SystemTime::now(), "UNSIGNED-PAYLOAD")?;
    let mut out = format!("{method} {path} HTTP/1.1\r\n");
    for (k, v) in req.headers() {
        out.push_str(&format!("{k}: {}\r\n", v.to_str()?));
    }
    out.push_str("\r\n");
    Ok(out)
}

/// The ONNX Runtime library of the project's `.venv` (the `onnxruntime` wheel `scripts/setup.sh`
/// installs), for the in-process pushdown tests.
///
/// # Panics
/// When it is not installed.
#[must_use]
pub fn ort_library() -> PathBuf {
    let lib = repo_root().join(".venv/lib");
    std::fs::read_dir(&lib)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|py| std::fs::read_dir(py.path().join("site-packages/onnxruntime/capi")).ok())
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libonnxruntime.so")))
        .unwrap_or_else(|| panic!("no onnxruntime wheel under {}: run scripts/setup.sh", lib.display()))
}

/// The sum of every sample of the metric family `name` (all its label sets) in a Prometheus
/// text exposition; a `name` with `{...` sums one label set.
#[must_use]
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines().filter(|l| l.starts_with(name)).filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).sum()
}

/// The body of a plain GET (the admin API).
///
/// # Panics
/// On transport failures.
pub async fn http_get(url: &str) -> String {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let resp = client.get(url.parse().expect("url")).await.expect("GET");
    String::from_utf8_lossy(&resp.into_body().collect().await.expect("body").to_bytes()).into_owned()
}
