//! Configuration reloaded while serving: on SIGHUP or `POST /v1/config/reload` the gateway reads
//! its configuration again, exactly as at start (the file, `TENSORGATE__*` variables, then the
//! flags it started with), checks it whole, and applies what may change without a restart.
//!
//! - Applied: client credentials (`[[credentials]]`: added, rotated, revoked; a revoked key is
//!   refused from its next request on, on kept-alive connections and for cached outputs too,
//!   because every request is authenticated against the store in force), `domains`,
//!   `allow_anonymous`, `max_body_bytes`, `max_in_flight`, alias buckets
//!   (`[[pushdown.aliases]]`), what alias endpoints stand for (`[[pushdown.alias_endpoints]]`, not
//!   their addresses) and `log.filter`.
//! - Refused by name, nothing changed: keys that need a restart ([`fixed_changes`]: the listen
//!   addresses (alias endpoints' too), `region`, `admin_open_reads`, `shutdown_grace_secs`, `upgrade_socket`, `[edge]`, `[backend]`,
//!   `[pushdown]` other than its aliases, `[cluster]`, `log.format`, and a client's own store
//!   key).
//! - A file that does not load or check changes nothing either.
//!
//! Every outcome is counted (`tensorgate_config_reloads_total{outcome}`) and logged; the admin
//! call answers it.

use std::sync::{Arc, Mutex, PoisonError};

use crate::config::{Config, ConfigError, Overrides};
use crate::metrics::{Metrics, OutcomeLabel};
use crate::proxy::LiveFront;
use crate::proxy::admit::Admission;
use crate::s3::credentials::LiveCredentials;

/// Why a reload changed nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReloadError {
    #[error("this gateway was started from a configuration value, not from a file and flags: nothing to read again")]
    NoSource,
    #[error("the configuration does not load or check, nothing changed: {0}")]
    Invalid(#[from] ConfigError),
    #[error("the configuration changes {} (restart to change them), nothing changed", .0.join(", "))]
    Fixed(Vec<&'static str>),
}

impl ReloadError {
    fn outcome(&self) -> &'static str {
        match self {
            Self::NoSource | Self::Invalid(_) => "invalid",
            Self::Fixed(_) => "fixed",
        }
    }
}

/// Reads the configuration again and applies it ([`Reloader::reload`]).
#[derive(Debug)]
pub(crate) struct Reloader {
    /// How the configuration was read at start; `None` for a gateway started from a value.
    source: Option<Overrides>,
    /// The configuration in force.
    running: Mutex<Config>,
    credentials: LiveCredentials,
    front: LiveFront,
    admission: Arc<Admission>,
    metrics: Metrics,
    /// The cluster hop secret read at start: it signs this member's hops, which a reload does
    /// not change, so a new one is refused (its file's contents can change without the file's name).
    cluster_secret: Option<crate::s3::credentials::SecretKey>,
}

impl Reloader {
    pub(crate) fn new(
        source: Option<Overrides>,
        (running, cluster_secret): (Config, Option<crate::s3::credentials::SecretKey>),
        (credentials, front): (LiveCredentials, LiveFront),
        admission: Arc<Admission>,
        metrics: Metrics,
    ) -> Self {
        Self { source, running: Mutex::new(running), credentials, front, admission, metrics, cluster_secret }
    }

    /// Reads, checks and applies the configuration; returns the keys that changed. Blocking
    /// (reads files, builds the credential store): call it on a blocking thread. Reloads run one
    /// at a time.
    ///
    /// # Errors
    /// Why nothing changed.
    pub(crate) fn reload(&self) -> Result<Vec<&'static str>, ReloadError> {
        let result = self.apply();
        let outcome = match &result {
            Ok(changed) => {
                tracing::info!(changed = ?changed, "Configuration reloaded.");
                "applied"
            }
            Err(e) => {
                tracing::warn!(error = %e, "Configuration not reloaded.");
                e.outcome()
            }
        };
        self.metrics.config_reloads.get_or_create(&OutcomeLabel { outcome }).inc();
        result
    }

    fn apply(&self) -> Result<Vec<&'static str>, ReloadError> {
        let source = self.source.as_ref().ok_or(ReloadError::NoSource)?;
        let mut running = self.running.lock().unwrap_or_else(PoisonError::into_inner);
        let new = Config::load(source)?;
        let built = new.runtime()?;
        crate::telemetry::check_filter(&new.log.filter)
            .map_err(|message| ConfigError::Invalid { key: "log.filter", message })?;
        let mut fixed = fixed_changes(&running, &new);
        if built.cluster_secret != self.cluster_secret && !fixed.contains(&"cluster") {
            fixed.push("cluster.secret_key (its contents)");
        }
        if !fixed.is_empty() {
            return Err(ReloadError::Fixed(fixed));
        }
        // First the one step that can fail, so that a failure changes nothing.
        if new.log.filter != running.log.filter {
            crate::telemetry::set_filter(&new.log.filter)
                .map_err(|message| ConfigError::Invalid { key: "log.filter", message })?;
        }
        let mut changed = reloadable_changes(&running, &new);
        if **self.credentials.load() != built.credentials {
            // A secret read from a file changes without the configuration changing.
            changed.insert(0, "credentials");
            changed.dedup();
        }
        self.credentials.store(Arc::new(built.credentials));
        self.front.store(Arc::new(built.front));
        self.admission.set_limit(new.max_in_flight);
        *running = new;
        Ok(changed)
    }
}

/// The keys `new` changes that a running gateway cannot: what its listeners, backend, engines,
/// cache, cluster and log format were built from.
pub(crate) fn fixed_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let without_aliases = |c: &Config| crate::config::PushdownSettings {
        aliases: Vec::new(),
        alias_endpoints: Vec::new(),
        ..c.pushdown.clone()
    };
    let endpoints = |c: &Config| c.pushdown.alias_endpoints.iter().map(|e| e.listen).collect::<Vec<_>>();
    let store_keys = |c: &Config| {
        let mut keys: Vec<_> = c
            .credentials
            .iter()
            .filter(|k| k.store_access_key.is_some())
            .map(|k| {
                (
                    k.access_key.clone(),
                    k.store_access_key.clone(),
                    k.store_secret_key.clone(),
                    k.store_secret_key_file.clone(),
                )
            })
            .collect();
        keys.sort_by(|a, b| a.0.cmp(&b.0));
        keys
    };
    [
        ("listen", old.listen != new.listen),
        ("admin_listen", old.admin_listen != new.admin_listen),
        ("admin_open_reads", old.admin_open_reads != new.admin_open_reads),
        ("region", old.region != new.region),
        ("shutdown_grace_secs", old.shutdown_grace_secs != new.shutdown_grace_secs),
        ("upgrade_socket", old.upgrade_socket != new.upgrade_socket),
        ("edge", old.edge != new.edge),
        ("backend", old.backend != new.backend),
        ("pushdown", without_aliases(old) != without_aliases(new)),
        ("pushdown.alias_endpoints.listen", endpoints(old) != endpoints(new)),
        ("cluster", old.cluster != new.cluster),
        ("log.format", old.log.format != new.log.format),
        ("credentials.store_access_key", store_keys(old) != store_keys(new)),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

/// The keys `new` changes that a reload applies.
pub(crate) fn reloadable_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    [
        ("credentials", old.credentials != new.credentials),
        ("domains", old.domains != new.domains),
        ("allow_anonymous", old.allow_anonymous != new.allow_anonymous),
        ("max_body_bytes", old.max_body_bytes != new.max_body_bytes),
        ("max_in_flight", old.max_in_flight != new.max_in_flight),
        ("pushdown.aliases", old.pushdown.aliases != new.pushdown.aliases),
        ("pushdown.alias_endpoints", old.pushdown.alias_endpoints != new.pushdown.alias_endpoints),
        ("log.filter", old.log.filter != new.log.filter),
    ]
    .into_iter()
    .filter_map(|(key, changed)| changed.then_some(key))
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_needs_a_restart_is_named_and_what_does_not_is_applied() {
        let mut old = Config::default();
        let mut new = old.clone();
        assert!(fixed_changes(&old, &new).is_empty());
        assert!(reloadable_changes(&old, &new).is_empty());
        new.max_in_flight = 7;
        new.log.filter = "debug".into();
        new.pushdown.aliases = vec![crate::config::AliasConfig {
            bucket: "feats".into(),
            target: "data".into(),
            model: "m".into(),
            split: "s".into(),
            format: None,
            dtype: None,
            column: None,
        }];
        let endpoint = |split: &str| crate::config::AliasEndpointConfig {
            listen: "127.0.0.1:9101".parse().expect("address"),
            model: "tiny-cnn".into(),
            split: split.into(),
            format: None,
            dtype: None,
            column: None,
        };
        old.pushdown.alias_endpoints = vec![endpoint("pool")];
        new.pushdown.alias_endpoints = vec![endpoint("block1")];
        assert!(fixed_changes(&old, &new).is_empty(), "aliases are not the rest of [pushdown]");
        assert_eq!(
            reloadable_changes(&old, &new),
            ["max_in_flight", "pushdown.aliases", "pushdown.alias_endpoints", "log.filter"]
        );
        // What an endpoint stands for is reloaded; where it listens is not.
        let mut moved = new.clone();
        moved.pushdown.alias_endpoints[0].listen = "127.0.0.1:9102".parse().expect("address");
        assert_eq!(fixed_changes(&new, &moved), ["pushdown.alias_endpoints.listen"]);
        new.listen = "127.0.0.1:1".parse().expect("address");
        new.pushdown.max_batch = 3;
        assert_eq!(fixed_changes(&old, &new), ["listen", "pushdown"]);
    }
}
