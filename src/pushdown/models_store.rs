//! Models kept in a bucket of the store (`[pushdown.models_store]`): the source every member of a
//! cluster shares (ADR 0028). A model is `<prefix><name>/manifest.toml` and the files it names,
//! written with any S3 client; the store's own rights on that bucket decide who may add, replace
//! or remove one. A sync lists the prefix and mirrors each model whose listing changed into a
//! local directory, which the registry then reads as it reads `models_dir`, so a model from the
//! store passes the same checks (size, sha256, ONNX graph, split tensors) before it is served.
//!
//! Bounded before anything is paid: the keys listed, the files per model, and each file's size,
//! from the listing (and again from the download's length, byte by byte). A download is fetched
//! `If-Match` the listed ETag, so a model rewritten during a sync is taken whole at the next one,
//! never half old and half new. A store that cannot be listed changes nothing: the models mirrored
//! last stay served.
//!
//! [`plan`] (listing in, actions out) is pure; [`ModelsStore`] does the requests and file moves.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::BodyExt;
use serde::Deserialize;

use crate::backend::ForwardPayload;
use crate::backend::s3::{http_client, sign_request};
use crate::body::Body;
use crate::s3::credentials::SecretKey;
use crate::s3::sigv4::{uri_encode, uri_encode_path};

/// Where the models live in the store, and how to reach it.
#[derive(Debug, Clone)]
pub(crate) struct ModelsStoreConfig {
    /// The backend's endpoint and region.
    pub(crate) endpoint: http::Uri,
    pub(crate) region: String,
    pub(crate) bucket: String,
    /// Keys under it are `<prefix><model>/<file>`.
    pub(crate) prefix: String,
    /// The key that reads the bucket (reading is all it needs).
    pub(crate) key: (String, SecretKey),
    /// Where models are mirrored; the registry reads it beside `models_dir`.
    pub(crate) mirror_dir: PathBuf,
    pub(crate) connect_timeout: Duration,
    /// Time to response headers.
    pub(crate) response_timeout: Duration,
    pub(crate) ca_file: Option<PathBuf>,
}

/// Most keys one sync lists (ten pages of 1,000): a model is a few files, so this is hundreds of
/// models; past it the sync fails and changes nothing.
const MAX_LISTED_KEYS: usize = 10_000;

/// Most files of one model: its ONNX file, manifest and tokenizer, and external weight files.
const MAX_FILES_PER_MODEL: usize = 64;

/// Largest listing page read: 1,000 entries with 1 KiB keys are about 1.3 MB of XML.
const MAX_LISTING_PAGE_BYTES: usize = 8 * 1024 * 1024;

/// Longest a download may go without a byte, or a listing page take, before this sync gives up
/// (the mirrored copy stays; the next sync tries again).
const DOWNLOAD_STALL: Duration = Duration::from_secs(30);

/// Under the mirror: downloads in progress, and the listings the mirrored models were fetched at.
const PARTIAL: &str = ".partial";
const LISTINGS: &str = ".listings";

/// One object of the listing.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(super) struct Listed {
    #[serde(rename = "Key")]
    key: String,
    #[serde(rename = "Size")]
    size: u64,
    #[serde(rename = "ETag", default)]
    etag: String,
}

/// A model's files as listed: (file name, size, ETag), sorted by name. A mirror fetched at the
/// same listing is the same model.
type Files = Vec<(String, u64, String)>;

/// What one sync does, from the listing and what is mirrored.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Plan {
    /// Models new or changed in the bucket, with the files to fetch.
    fetch: BTreeMap<String, Files>,
    /// Mirrored models no longer in the bucket (or no longer acceptable there).
    remove: Vec<String>,
    /// (model or key, why) for what the bucket holds but cannot be served.
    refused: Vec<(String, String)>,
}

/// A model's or file's name as the bucket may spell it: a plain name, not hidden, of letters,
/// digits and `._-+` (so it is a file name here too, and never a mirror's own entry).
fn plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 255
        && !s.starts_with('.')
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
}

/// What to fetch, remove and refuse, given the bucket's listing under `prefix`, the listings the
/// mirrored models were fetched at, and the largest file allowed. Pure.
pub(super) fn plan(listed: &[Listed], prefix: &str, mirrored: &BTreeMap<String, Files>, max_bytes: u64) -> Plan {
    let mut models: BTreeMap<String, Result<Files, String>> = BTreeMap::new();
    let mut out = Plan::default();
    for item in listed {
        let Some(rel) = item.key.strip_prefix(prefix) else { continue };
        // A key beside the models (a README), or a folder marker: not part of any model.
        let Some((name, file)) = rel.split_once('/') else { continue };
        if file.is_empty() {
            continue;
        }
        if !plain_name(name) {
            out.refused
                .push((item.key.clone(), "is not under a plain model name ([A-Za-z0-9._+-], not hidden)".into()));
            continue;
        }
        let entry = models.entry(name.to_owned()).or_insert_with(|| Ok(Vec::new()));
        let Ok(files) = entry else { continue };
        if !plain_name(file) {
            *entry = Err(format!("{} is not a plain file name directly under the model", item.key));
        } else if item.size > max_bytes {
            *entry = Err(format!(
                "{} is {} bytes, more than pushdown.max_model_bytes ({max_bytes}); not fetched",
                item.key, item.size
            ));
        } else if files.len() == MAX_FILES_PER_MODEL {
            *entry = Err(format!("more than {MAX_FILES_PER_MODEL} files (MAX_FILES_PER_MODEL)"));
        } else {
            files.push((file.to_owned(), item.size, item.etag.clone()));
        }
    }
    let mut present = Vec::new();
    for (name, files) in models {
        match files {
            // Not a model (yet): its manifest is written last, or it is being removed.
            Ok(files) if !files.iter().any(|f| f.0 == super::registry::MANIFEST) => {}
            Ok(mut files) => {
                files.sort();
                if mirrored.get(&name) != Some(&files) {
                    out.fetch.insert(name.clone(), files);
                }
                present.push(name);
            }
            Err(why) => out.refused.push((format!("{prefix}{name}"), why)),
        }
    }
    out.remove = mirrored.keys().filter(|n| !present.contains(n)).cloned().collect();
    out
}

/// `ListObjectsV2`'s answer, the fields a sync reads.
#[derive(Debug, Deserialize)]
struct ListPage {
    #[serde(rename = "Contents", default)]
    contents: Vec<Listed>,
    #[serde(rename = "IsTruncated", default)]
    is_truncated: bool,
    #[serde(rename = "NextContinuationToken")]
    next_continuation_token: Option<String>,
}

type Client = hyper_util::client::legacy::Client<
    hyper_rustls::HttpsConnector<hyper_util::client::legacy::connect::HttpConnector>,
    Body,
>;

/// The bucket, read with its own key, and the local mirror of its models.
#[derive(Debug)]
pub(crate) struct ModelsStore {
    cfg: ModelsStoreConfig,
    client: Client,
    /// The listing each mirrored model was fetched at (also kept under [`LISTINGS`], so a restart
    /// or an upgraded binary fetches nothing unchanged). One sync at a time holds it.
    mirrored: tokio::sync::Mutex<BTreeMap<String, Files>>,
}

impl ModelsStore {
    /// Opens the mirror (creating it, private to this user) and the client.
    ///
    /// # Errors
    /// A mirror that cannot be created, or no usable TLS configuration.
    pub(crate) fn new(cfg: ModelsStoreConfig) -> Result<Self, String> {
        for dir in [cfg.mirror_dir.clone(), cfg.mirror_dir.join(LISTINGS)] {
            create_private_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let client = http_client(cfg.connect_timeout, cfg.ca_file.as_deref()).map_err(|e| e.to_string())?;
        let mirrored = recover(&cfg.mirror_dir);
        Ok(Self { cfg, client, mirrored: tokio::sync::Mutex::new(mirrored) })
    }

    /// The directory the registry reads.
    #[must_use]
    pub(crate) fn mirror_dir(&self) -> &Path {
        &self.cfg.mirror_dir
    }

    /// `s3://bucket/prefix`, for logs and `/v1/models`.
    #[must_use]
    pub(crate) fn url(&self) -> String {
        format!("s3://{}/{}", self.cfg.bucket, self.cfg.prefix)
    }

    /// Brings the mirror to what the bucket holds; returns what the bucket holds but cannot be
    /// served (as (where, why), for the registry's refusals).
    ///
    /// # Errors
    /// The bucket could not be listed: nothing changed.
    pub(crate) async fn sync(&self, max_bytes: u64) -> Result<Vec<(PathBuf, String)>, String> {
        let mut mirrored = self.mirrored.lock().await;
        let listed = self.list().await?;
        let plan = plan(&listed, &self.cfg.prefix, &mirrored, max_bytes);
        let mut refused: Vec<(PathBuf, String)> = plan
            .refused
            .into_iter()
            .map(|(what, why)| (PathBuf::from(format!("s3://{}/{what}", self.cfg.bucket)), why))
            .collect();
        for name in plan.remove {
            self.unmirror(&name).await;
            mirrored.remove(&name);
        }
        for (name, files) in plan.fetch {
            match self.fetch(&name, &files).await {
                Ok(()) => {
                    mirrored.insert(name, files);
                }
                Err(why) => {
                    tracing::warn!(model = %name, error = %why, "Model not fetched from the store.");
                    refused.push((PathBuf::from(format!("s3://{}/{}{name}", self.cfg.bucket, self.cfg.prefix)), why));
                }
            }
        }
        Ok(refused)
    }

    /// Every key under the prefix, at most [`MAX_LISTED_KEYS`].
    async fn list(&self) -> Result<Vec<Listed>, String> {
        let mut listed = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut query = format!("list-type=2&prefix={}", uri_encode(&self.cfg.prefix));
            if let Some(t) = &token {
                query.push_str(&format!("&continuation-token={}", uri_encode(t)));
            }
            let resp = self.send(&format!("/{}", uri_encode(&self.cfg.bucket)), Some(&query), None).await?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), MAX_LISTING_PAGE_BYTES).collect();
            let body = tokio::time::timeout(DOWNLOAD_STALL, body)
                .await
                .map_err(|_| {
                    format!("listing the bucket: no answer for {} s (DOWNLOAD_STALL)", DOWNLOAD_STALL.as_secs())
                })?
                .map_err(|e| format!("listing the bucket: {e}"))?
                .to_bytes();
            if status != StatusCode::OK {
                return Err(format!(
                    "listing the bucket: {status} {}",
                    String::from_utf8_lossy(&body[..body.len().min(200)])
                ));
            }
            let page: ListPage =
                quick_xml::de::from_reader(&body[..]).map_err(|e| format!("listing the bucket: {e}"))?;
            listed.extend(page.contents);
            if listed.len() > MAX_LISTED_KEYS {
                return Err(format!("the models prefix holds more than {MAX_LISTED_KEYS} keys (MAX_LISTED_KEYS)"));
            }
            match page.next_continuation_token {
                Some(t) if page.is_truncated => token = Some(t),
                _ => return Ok(listed),
            }
        }
    }

    /// Downloads every file of `name` into a fresh directory and puts it in place of the mirrored
    /// one (the registry reads it after this sync).
    async fn fetch(&self, name: &str, files: &Files) -> Result<(), String> {
        let partial = self.cfg.mirror_dir.join(PARTIAL).join(name);
        let _ = tokio::fs::remove_dir_all(&partial).await;
        tokio::fs::create_dir(&partial).await.map_err(|e| format!("cannot create {}: {e}", partial.display()))?;
        let fetched = async {
            for (file, size, etag) in files {
                self.download(&format!("{}{name}/{file}", self.cfg.prefix), *size, etag, &partial.join(file)).await?;
            }
            Ok::<_, String>(())
        }
        .await;
        if let Err(why) = fetched {
            let _ = tokio::fs::remove_dir_all(&partial).await;
            return Err(why);
        }
        let listing = serde_json::to_vec(files).map_err(|e| e.to_string())?;
        let dest = self.cfg.mirror_dir.join(name);
        let old = self.cfg.mirror_dir.join(PARTIAL).join(format!("{name}.old"));
        let _ = tokio::fs::remove_dir_all(&old).await;
        if tokio::fs::try_exists(&dest).await.unwrap_or(false) {
            tokio::fs::rename(&dest, &old).await.map_err(|e| format!("cannot replace {}: {e}", dest.display()))?;
        }
        tokio::fs::rename(&partial, &dest).await.map_err(|e| format!("cannot place {}: {e}", dest.display()))?;
        let _ = tokio::fs::remove_dir_all(&old).await;
        tokio::fs::write(self.cfg.mirror_dir.join(LISTINGS).join(name), listing)
            .await
            .map_err(|e| format!("cannot record the listing of {name}: {e}"))?;
        Ok(())
    }

    /// One object to `to`: `If-Match` its listed ETag, exactly `size` bytes.
    async fn download(&self, key: &str, size: u64, etag: &str, to: &Path) -> Result<(), String> {
        use tokio::io::AsyncWriteExt;
        let path = format!("/{}/{}", uri_encode(&self.cfg.bucket), uri_encode_path(key));
        let resp = self.send(&path, None, Some(etag).filter(|e| !e.is_empty())).await?;
        match resp.status() {
            StatusCode::OK => {}
            StatusCode::PRECONDITION_FAILED => return Err(format!("{key} changed while it was fetched")),
            s => return Err(format!("GET {key}: {s}")),
        }
        let length =
            resp.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        if length.is_some_and(|l| l != size) {
            return Err(format!("{key} is {} bytes, its listing said {size}", length.unwrap_or_default()));
        }
        let mut out = tokio::fs::File::create(to).await.map_err(|e| format!("cannot create {}: {e}", to.display()))?;
        let mut body = resp.into_body();
        let mut got = 0u64;
        loop {
            let frame = tokio::time::timeout(DOWNLOAD_STALL, body.frame())
                .await
                .map_err(|_| format!("{key}: no byte for {} s (DOWNLOAD_STALL)", DOWNLOAD_STALL.as_secs()))?;
            let Some(frame) = frame else { break };
            let frame = frame.map_err(|e| format!("reading {key}: {e}"))?;
            let Ok(data) = frame.into_data() else { continue };
            got += data.len() as u64;
            if got > size {
                return Err(format!("{key} is longer than its listed {size} bytes"));
            }
            out.write_all(&data).await.map_err(|e| format!("writing {}: {e}", to.display()))?;
        }
        if got != size {
            return Err(format!("{key} ended after {got} of {size} bytes"));
        }
        out.sync_all().await.map_err(|e| format!("writing {}: {e}", to.display()))
    }

    async fn unmirror(&self, name: &str) {
        let _ = tokio::fs::remove_file(self.cfg.mirror_dir.join(LISTINGS).join(name)).await;
        if let Err(e) = tokio::fs::remove_dir_all(self.cfg.mirror_dir.join(name)).await {
            tracing::warn!(model = %name, error = %e, "Cannot remove a mirrored model.");
        }
    }

    /// A signed GET of `path` (already encoded), with `If-Match` when given.
    async fn send(
        &self,
        path: &str,
        query: Option<&str>,
        if_match: Option<&str>,
    ) -> Result<http::Response<hyper::body::Incoming>, String> {
        let base = self.cfg.endpoint.to_string();
        let url = match query {
            Some(q) => format!("{}{path}?{q}", base.trim_end_matches('/')),
            None => format!("{}{path}", base.trim_end_matches('/')),
        };
        let mut req = Request::get(&url).body(Body::from(Bytes::new())).map_err(|e| e.to_string())?;
        let host = req.uri().authority().map(|a| a.as_str().to_owned()).unwrap_or_default();
        req.headers_mut().insert(http::header::HOST, HeaderValue::from_str(&host).map_err(|e| e.to_string())?);
        if let Some(etag) = if_match {
            req.headers_mut().insert(http::header::IF_MATCH, HeaderValue::from_str(etag).map_err(|e| e.to_string())?);
        }
        sign_request(&mut req, &ForwardPayload::Empty, &self.cfg.key, &self.cfg.region).map_err(|e| e.to_string())?;
        match tokio::time::timeout(self.cfg.response_timeout, self.client.request(req)).await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(format!("the store is unreachable: {e}")),
            Err(_) => Err(format!("the store did not answer within {} s", self.cfg.response_timeout.as_secs())),
        }
    }
}

/// The mirror as a stopped process left it: the listings of the models it holds whole. Downloads
/// in progress, listings without their model and models without their listing (a stop between
/// placing a model and recording it) are removed, so nothing is served that a sync would not
/// know to remove.
fn recover(mirror: &Path) -> BTreeMap<String, Files> {
    let _ = std::fs::remove_dir_all(mirror.join(PARTIAL));
    let _ = std::fs::create_dir(mirror.join(PARTIAL));
    let mut mirrored = BTreeMap::new();
    for entry in std::fs::read_dir(mirror.join(LISTINGS)).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let listing = std::fs::read(entry.path()).ok().and_then(|b| serde_json::from_slice::<Files>(&b).ok());
        match listing {
            Some(files) if plain_name(&name) && mirror.join(&name).is_dir() => {
                mirrored.insert(name, files);
            }
            _ => {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    for entry in std::fs::read_dir(mirror).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if plain_name(&name) && !mirrored.contains_key(&name) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    mirrored
}

/// `dir` and its parents, the last one readable by this user only (models are code the gateway
/// runs: nobody else may put one there).
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    if !dir.exists() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let meta = std::fs::metadata(dir)?;
    if meta.permissions().mode() & 0o022 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed(key: &str, size: u64, etag: &str) -> Listed {
        Listed { key: key.to_owned(), size, etag: etag.to_owned() }
    }

    fn files(items: &[(&str, u64, &str)]) -> Files {
        items.iter().map(|(f, s, e)| ((*f).to_owned(), *s, (*e).to_owned())).collect()
    }

    #[test]
    fn a_sync_fetches_what_changed_and_removes_what_went() {
        let bucket = [
            listed("m/README.md", 10, "r"),
            listed("m/a/manifest.toml", 100, "a1"),
            listed("m/a/model.onnx", 2000, "a2"),
            listed("m/b/model.onnx", 2000, "b2"),
            listed("m/c/manifest.toml", 100, "c1"),
            listed("m/c/", 0, "d"),
            listed("other/x/manifest.toml", 1, "x"),
        ];
        let mut mirrored = BTreeMap::new();
        mirrored.insert("a".to_owned(), files(&[("manifest.toml", 100, "a1"), ("model.onnx", 2000, "a2")]));
        mirrored.insert("gone".to_owned(), files(&[("manifest.toml", 1, "g")]));
        mirrored.insert("b".to_owned(), files(&[("manifest.toml", 1, "b1"), ("model.onnx", 2000, "b2")]));
        let p = plan(&bucket, "m/", &mirrored, 1 << 20);
        // `a` is as mirrored; `c` is new; `b` lost its manifest (being removed) and `gone` is gone.
        assert_eq!(p.fetch.keys().collect::<Vec<_>>(), ["c"]);
        assert_eq!(p.fetch["c"], files(&[("manifest.toml", 100, "c1")]));
        assert_eq!(p.remove, ["b", "gone"]);
        assert!(p.refused.is_empty(), "{:?}", p.refused);
        // A changed ETag is a new version to fetch.
        let changed = [listed("m/a/manifest.toml", 100, "a1"), listed("m/a/model.onnx", 2000, "a3")];
        assert_eq!(plan(&changed, "m/", &mirrored, 1 << 20).fetch.keys().collect::<Vec<_>>(), ["a"]);
    }

    #[test]
    fn hostile_listings_are_refused_before_a_byte_is_fetched() {
        let bucket = [
            listed("huge/manifest.toml", 100, "1"),
            listed("huge/model.onnx", 10 << 30, "2"),
            listed("nested/manifest.toml", 100, "1"),
            listed("nested/sub/model.onnx", 10, "2"),
            listed(".hidden/manifest.toml", 1, "1"),
            listed("dots/..", 1, "1"),
        ];
        let mut mirrored = BTreeMap::new();
        mirrored.insert("huge".to_owned(), files(&[("manifest.toml", 100, "1"), ("model.onnx", 10, "0")]));
        let p = plan(&bucket, "", &mirrored, 2 << 30);
        assert!(p.fetch.is_empty(), "{:?}", p.fetch);
        // A model that became unacceptable stops being served.
        assert_eq!(p.remove, ["huge"]);
        let why = |w: &str| p.refused.iter().find(|(k, _)| k == w).map(|(_, y)| y.as_str()).unwrap_or_default();
        assert!(why("huge").contains("more than pushdown.max_model_bytes"), "{:?}", p.refused);
        assert!(why("nested").contains("not a plain file name"), "{:?}", p.refused);
        assert!(why(".hidden/manifest.toml").contains("plain model name"), "{:?}", p.refused);
        assert!(why("dots").contains("not a plain file name"), "{:?}", p.refused);
        let many: Vec<Listed> = (0..=MAX_FILES_PER_MODEL).map(|i| listed(&format!("many/f{i}"), 1, "e")).collect();
        let p = plan(&many, "", &BTreeMap::new(), 10);
        assert!(p.refused[0].1.contains("MAX_FILES_PER_MODEL"), "{:?}", p.refused);
    }

    #[test]
    fn a_restart_keeps_the_models_mirrored_whole_and_drops_the_rest() {
        let root = tempfile::tempdir().expect("temp dir");
        let m = root.path();
        for dir in ["whole", "unrecorded", ".partial/half", ".listings"] {
            std::fs::create_dir_all(m.join(dir)).expect("dir");
        }
        let whole = files(&[("manifest.toml", 1, "e")]);
        std::fs::write(m.join(".listings/whole"), serde_json::to_vec(&whole).expect("json")).expect("write");
        std::fs::write(m.join(".listings/gone"), b"[]").expect("write");
        let mirrored = recover(m);
        assert_eq!(mirrored.into_iter().collect::<Vec<_>>(), [("whole".to_owned(), whole)]);
        assert!(!m.join("unrecorded").exists() && !m.join(".partial/half").exists());
        assert!(!m.join(".listings/gone").exists() && m.join("whole").exists());
    }

    /// A store on loopback that answers each request (by its request line) with `answer`'s
    /// status and body, closing the connection after each.
    async fn hostile_store(answer: fn(&str) -> (u16, Vec<u8>)) -> (ModelsStore, tempfile::TempDir) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&head).lines().next().unwrap_or_default().to_owned();
                    let (status, body) = answer(&line);
                    let resp =
                        format!("HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
                    let _ = conn.write_all(resp.as_bytes()).await;
                    let _ = conn.write_all(&body).await;
                });
            }
        });
        let mirror = tempfile::tempdir().expect("temp dir");
        let store = ModelsStore::new(ModelsStoreConfig {
            endpoint: format!("http://{addr}").parse().expect("uri"),
            region: "us-east-1".into(),
            bucket: "models".into(),
            prefix: String::new(),
            key: ("k".into(), SecretKey::new("s".into())),
            mirror_dir: mirror.path().join("mirror"),
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
            ca_file: None,
        })
        .expect("store");
        (store, mirror)
    }

    fn page(entries: usize, more: bool) -> Vec<u8> {
        let contents: String = (0..entries)
            .map(|i| format!("<Contents><Key>m{i}/manifest.toml</Key><ETag>\"e\"</ETag><Size>5</Size></Contents>"))
            .collect();
        format!(
            "<ListBucketResult><IsTruncated>{more}</IsTruncated><NextContinuationToken>t</NextContinuationToken>{contents}</ListBucketResult>"
        )
        .into_bytes()
    }

    #[tokio::test]
    async fn a_hostile_store_is_refused_within_the_bounds() {
        // A listing that never ends stops at MAX_LISTED_KEYS, and changes nothing.
        let (endless, _dir) = hostile_store(|_| (200, page(1000, true))).await;
        let e = endless.sync(1 << 20).await.expect_err("endless listing");
        assert!(e.contains("MAX_LISTED_KEYS"), "{e}");
        assert!(endless.mirrored.lock().await.is_empty());
        // A page over MAX_LISTING_PAGE_BYTES is not read whole.
        let (huge, _dir) = hostile_store(|_| (200, vec![b' '; MAX_LISTING_PAGE_BYTES + 1])).await;
        let e = huge.sync(1 << 20).await.expect_err("huge page");
        assert!(e.contains("listing the bucket"), "{e}");
        // A file longer than its listing said is refused, and nothing of it is mirrored.
        let (liar, _dir) = hostile_store(|line| {
            if line.contains("list-type=2") { (200, page(1, false)) } else { (200, b"ten bytes!".to_vec()) }
        })
        .await;
        let refused = liar.sync(1 << 20).await.expect("listed");
        assert!(refused.iter().any(|(_, why)| why.contains("its listing said 5")), "{refused:?}");
        assert!(!liar.mirror_dir().join("m0").exists() && liar.mirrored.lock().await.is_empty());
    }

    #[test]
    fn a_listing_page_parses() {
        let xml = br#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>models</Name><Prefix></Prefix>
<KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>true</IsTruncated>
<NextContinuationToken>tok+/=</NextContinuationToken>
<Contents><Key>a/manifest.toml</Key><LastModified>2026-12-06T00:00:00.000Z</LastModified>
<ETag>&quot;abc&quot;</ETag><Size>12</Size><StorageClass>STANDARD</StorageClass></Contents>
<Contents><Key>a/model.onnx</Key><ETag>"def-2"</ETag><Size>3000000000</Size></Contents>
</ListBucketResult>"#;
        let page: ListPage = quick_xml::de::from_reader(&xml[..]).expect("parses");
        assert!(page.is_truncated);
        assert_eq!(page.next_continuation_token.as_deref(), Some("tok+/="));
        assert_eq!(
            page.contents,
            [listed("a/manifest.toml", 12, "\"abc\""), listed("a/model.onnx", 3_000_000_000, "\"def-2\"")]
        );
        let empty: ListPage =
            quick_xml::de::from_reader(&b"<ListBucketResult><IsTruncated>false</IsTruncated></ListBucketResult>"[..])
                .expect("parses");
        assert!(empty.contents.is_empty() && !empty.is_truncated);
    }
}
