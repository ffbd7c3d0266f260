//! Scale-out: the members of a tensorgate cluster (one gateway per storage node), their health, and
//! which member owns an object's pushdowns.
//!
//! - **Ownership** is rendezvous (highest-random-weight) hashing over the object: every member
//!   scores `(member id, bucket, key)` and the highest score owns it, so all splits and all epochs
//!   of an object meet the same tensor cache, and a member joining or leaving moves only the
//!   objects it gains or loses (about 1/N). The score is the first 8 bytes of
//!   `SHA-256(id 0x00 bucket 0x00 key)` read big-endian; ties go to the smaller id. The Python
//!   client computes the same order (`tensorgate.cluster`), so it can send each request to its
//!   owner and walk the order when one fails. Pure: [`rank`], [`score`].
//! - **Membership** is a static list or a DNS name that resolves to every member (a Kubernetes
//!   headless Service), re-resolved every `refresh_secs`; each member's health is its `/readyz`,
//!   probed at the same period with a short timeout. This node counts as ready while it serves.
//!   Published at `GET /v1/cluster` on the admin port. The store's own clustering stays the
//!   distributed engine: nothing here is consensus, and a result never depends on which member
//!   computed it.

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::s3::credentials::SecretKey;

/// Seconds between membership refreshes (DNS and `/readyz` probes): a failed node stops getting
/// routed work within this long, and a probe round costs one small request per member.
pub const DEFAULT_CLUSTER_REFRESH_SECS: u64 = 5;
/// A member that does not answer `/readyz` within this is unreachable for the round: well above a
/// LAN round trip, short enough that one dead member does not hold a round up.
pub(crate) const DEFAULT_CLUSTER_PROBE_TIMEOUT_MS: u64 = 1000;
/// The admin port DNS-discovered members listen on (the default `admin_listen` port).
pub(crate) const DEFAULT_CLUSTER_DNS_ADMIN_PORT: u16 = 9001;

/// The cluster this gateway is a member of (`[cluster]`; see `crate::cluster`).
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    /// This member's id: one of `members`' ids, or its `ip:port` among the DNS members
    /// (`TENSORGATE_CLUSTER_NODE_ID`, e.g. from the pod's IP).
    pub node_id: String,
    /// Static members (ids, S3 and admin URLs).
    #[serde(default)]
    pub members: Vec<Member>,
    /// A `host:port` that resolves to every member's S3 listener (a headless Service).
    #[serde(default)]
    pub dns: Option<String>,
    #[serde(default = "default_dns_admin_port")]
    pub dns_admin_port: u16,
    #[serde(default = "default_refresh_secs")]
    pub refresh_secs: u64,
    #[serde(default = "default_probe_timeout_ms")]
    pub probe_timeout_ms: u64,
    /// The credential members sign gateway-to-gateway hops with (every member accepts it, and
    /// only it may name the tenant a hop acts for). Without a secret, members do not forward.
    #[serde(default = "default_cluster_access_key")]
    pub access_key: String,
    #[serde(default)]
    pub secret_key: Option<SecretKey>,
    #[serde(default)]
    pub secret_key_file: Option<PathBuf>,
}

fn default_cluster_access_key() -> String {
    "tensorgate-cluster".into()
}

fn default_dns_admin_port() -> u16 {
    DEFAULT_CLUSTER_DNS_ADMIN_PORT
}
fn default_refresh_secs() -> u64 {
    DEFAULT_CLUSTER_REFRESH_SECS
}
fn default_probe_timeout_ms() -> u64 {
    DEFAULT_CLUSTER_PROBE_TIMEOUT_MS
}

/// The hashing in use, as `/v1/cluster` names it (clients check it before routing).
pub const HASHING: &str = "hrw-sha256-v1";

/// One member: its id and where its S3 and admin listeners are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Member {
    pub id: String,
    pub s3: String,
    pub admin: String,
}

/// A member's rendezvous score for an object.
#[must_use]
pub(crate) fn score(member: &str, bucket: &str, key: &str) -> u64 {
    let mut h = Sha256::new();
    h.update(member.as_bytes());
    h.update([0]);
    h.update(bucket.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let d = h.finalize();
    u64::from_be_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// The members in ownership order for an object: the owner first, then where to go when it is
/// down.
#[must_use]
pub fn rank<'a, T: AsRef<str>>(ids: &'a [T], bucket: &str, key: &str) -> Vec<&'a T> {
    let mut scored: Vec<(u64, &T)> = ids.iter().map(|m| (score(m.as_ref(), bucket, key), m)).collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.as_ref().cmp(b.1.as_ref())));
    scored.into_iter().map(|(_, m)| m).collect()
}

/// The header of `/readyz` that names the models a member serves (a hash of their names and
/// versions): [`Cluster::report`] says whether the ready members agree.
pub(crate) const MODELS_HEADER: http::HeaderName = http::HeaderName::from_static("x-tensorgate-models");

/// Every [`MemberState::state`].
pub(crate) const MEMBER_STATES: [&str; 3] = ["ready", "unready", "unreachable"];

/// A member as this node last saw it.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MemberState {
    #[serde(flatten)]
    pub(crate) member: Member,
    /// `ready`, `unready` (its `/readyz` said no) or `unreachable`.
    pub(crate) state: &'static str,
    /// Seconds since the Unix epoch of the last probe (`None`: not probed yet).
    pub(crate) checked: Option<u64>,
    /// Why the last probe failed.
    pub(crate) error: Option<String>,
    /// The models it serves, as its `/readyz` said ([`MODELS_HEADER`]; `None`: no pushdown).
    pub(crate) models: Option<String>,
}

impl AsRef<str> for MemberState {
    fn as_ref(&self) -> &str {
        &self.member.id
    }
}

/// The cluster as this node sees it.
#[derive(Debug)]
pub(crate) struct Cluster {
    settings: ClusterSettings,
    members: RwLock<Vec<MemberState>>,
}

impl Cluster {
    /// A cluster of the configured static members (DNS members appear at the first refresh).
    #[must_use]
    pub(crate) fn new(settings: ClusterSettings) -> Arc<Self> {
        let members = settings.members.iter().cloned().map(|m| unprobed(m, &settings.node_id)).collect();
        Arc::new(Self { settings, members: RwLock::new(members) })
    }

    /// This node's id.
    #[must_use]
    pub(crate) fn node_id(&self) -> &str {
        &self.settings.node_id
    }

    /// The members now, sorted by id.
    #[must_use]
    pub(crate) fn members(&self) -> Vec<MemberState> {
        self.members.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The ready member that owns an object (this node included): the highest score, ties to the
    /// smaller id, as [`rank`] orders them. One pass under the read lock, one clone.
    #[must_use]
    pub(crate) fn owner(&self, bucket: &str, key: &str) -> Option<Member> {
        let members = self.members.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        members
            .iter()
            .filter(|m| m.state == "ready")
            .max_by(|a, b| {
                score(&a.member.id, bucket, key)
                    .cmp(&score(&b.member.id, bucket, key))
                    .then_with(|| b.member.id.cmp(&a.member.id))
            })
            .map(|m| m.member.clone())
    }

    /// What `GET /v1/cluster` answers: the members, and whether the ready ones serve the same
    /// models (`models_agree`: after a model is added to or removed from the models store, every
    /// member has it once this is true again).
    #[must_use]
    pub(crate) fn report(&self) -> serde_json::Value {
        let members = self.members();
        let mut served = members.iter().filter(|m| m.state == "ready").map(|m| &m.models);
        let first = served.next();
        serde_json::json!({
            "node": self.settings.node_id,
            "hashing": HASHING,
            "refresh_secs": self.settings.refresh_secs,
            "models_agree": served.all(|m| Some(m) == first),
            "members": members,
        })
    }

    /// Re-resolves the members (DNS) and probes each one's `/readyz` (this node is ready while it
    /// serves, with `own_models`). One round; [`Cluster::spawn_refresh`] repeats it.
    pub(crate) async fn refresh(&self, client: &probe::Prober, own_models: Option<String>) {
        let mut found = self.settings.members.clone();
        if let Some(name) = &self.settings.dns {
            match tokio::net::lookup_host(name.as_str()).await {
                Ok(addrs) => {
                    for a in addrs {
                        let admin = std::net::SocketAddr::new(a.ip(), self.settings.dns_admin_port);
                        found.push(Member {
                            id: a.to_string(),
                            s3: format!("http://{a}"),
                            admin: format!("http://{admin}"),
                        });
                    }
                }
                Err(e) => tracing::warn!(name = %name, error = %e, "cluster: members could not be resolved"),
            }
        }
        found.sort_by(|a, b| a.id.cmp(&b.id));
        found.dedup_by(|a, b| a.id == b.id);
        let timeout = Duration::from_millis(self.settings.probe_timeout_ms);
        let own_models = &own_models;
        let probes = found.into_iter().map(|m| async move {
            let now = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).ok();
            if m.id == self.settings.node_id {
                return MemberState {
                    member: m,
                    state: "ready",
                    checked: now,
                    error: None,
                    models: own_models.clone(),
                };
            }
            let (state, error, models) = match client.probe(&format!("{}/readyz", m.admin), timeout).await {
                Ok((200, models)) => ("ready", None, models),
                Ok((code, _)) => ("unready", Some(format!("/readyz answered {code}")), None),
                Err(e) => ("unreachable", Some(e), None),
            };
            MemberState { member: m, state, checked: now, error, models }
        });
        let states = futures_util::future::join_all(probes).await;
        *self.members.write().unwrap_or_else(std::sync::PoisonError::into_inner) = states;
    }

    /// Refreshes every `refresh_secs` for as long as the cluster exists; `own_models` says what
    /// this member serves at each round.
    pub(crate) fn spawn_refresh(self: &Arc<Self>, own_models: impl Fn() -> Option<String> + Send + 'static) {
        let period = Duration::from_secs(self.settings.refresh_secs.max(1));
        let cluster = Arc::downgrade(self);
        tokio::spawn(async move {
            let client = probe::Prober::new();
            loop {
                let Some(c) = cluster.upgrade() else { break };
                c.refresh(&client, own_models()).await;
                drop(c);
                tokio::time::sleep(period).await;
            }
        });
    }
}

fn unprobed(member: Member, node: &str) -> MemberState {
    let state = if member.id == node { "ready" } else { "unreachable" };
    MemberState { member, state, checked: None, error: None, models: None }
}

/// The small HTTP client the probes need (plain HTTP inside the cluster network).
pub(crate) mod probe {
    use std::time::Duration;

    use http_body_util::Empty;
    use hyper_util::client::legacy::Client as Hyper;
    use hyper_util::client::legacy::connect::HttpConnector;
    use hyper_util::rt::TokioExecutor;

    /// A pooled HTTP/1 client.
    #[derive(Debug, Clone)]
    pub(crate) struct Prober(Hyper<HttpConnector, Empty<bytes::Bytes>>);

    impl Prober {
        #[must_use]
        pub(crate) fn new() -> Self {
            Self(Hyper::builder(TokioExecutor::new()).build_http())
        }

        /// The status of a GET of `url`, within `timeout`, and the models it says it serves
        /// ([`super::MODELS_HEADER`]).
        ///
        /// # Errors
        /// An unusable URL, a connection failure or the timeout, as text.
        pub(crate) async fn probe(&self, url: &str, timeout: Duration) -> Result<(u16, Option<String>), String> {
            let uri: http::Uri = url.parse().map_err(|e| format!("bad address {url}: {e}"))?;
            match tokio::time::timeout(timeout, self.0.get(uri)).await {
                Ok(Ok(resp)) => {
                    let models =
                        resp.headers().get(super::MODELS_HEADER).and_then(|v| v.to_str().ok()).map(str::to_owned);
                    Ok((resp.status().as_u16(), models))
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer in {} ms", timeout.as_millis())),
            }
        }
    }

    impl Default for Prober {
        fn default() -> Self {
            Self::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ownership_is_stable_and_moves_little_when_a_member_leaves() {
        let three = ["node-a", "node-b", "node-c"];
        let two = ["node-a", "node-c"];
        let keys: Vec<String> = (0..3000).map(|i| format!("train/{i:05}.tar")).collect();
        let mut counts = [0usize; 3];
        let mut moved = 0;
        for k in &keys {
            let owner = *rank(&three, "b", k)[0];
            counts[three.iter().position(|m| *m == owner).expect("member")] += 1;
            assert_eq!(owner, *rank(&three, "b", k)[0], "deterministic");
            let after = *rank(&two, "b", k)[0];
            if owner != "node-b" {
                assert_eq!(owner, after, "only node-b's objects move");
            } else {
                moved += 1;
                assert_eq!(after, *rank(&three, "b", k)[1], "they go to the next in order");
            }
        }
        assert!(counts.iter().all(|&c| (800..1200).contains(&c)), "balanced: {counts:?}");
        assert_eq!(moved, counts[1]);
    }

    #[test]
    fn the_score_is_the_documented_hash() {
        // SHA-256("node-a\0bucket\0key"), first 8 bytes big-endian: what the Python client computes.
        let d = Sha256::digest(b"node-a\0bucket\0key");
        assert_eq!(score("node-a", "bucket", "key"), u64::from_be_bytes(d[..8].try_into().expect("8")));
        assert_ne!(score("node-a", "bucket", "key"), score("node-a", "bucket2", "key"));
        assert_ne!(score("node-a", "b", "uck\0etkey"), score("node-a", "buck", "etkey"));
    }
}
