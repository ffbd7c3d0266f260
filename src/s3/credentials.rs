//! Client credentials: access key → secret, with secrets that never print and compare in
//! constant time.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use arc_swap::ArcSwapOption;
use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

/// A secret access key. `Debug` and `Display` print a placeholder; memory is wiped on drop.
/// Clones share the last SigV4 signing key derived from it ([`Self::signing_key`]).
#[derive(Clone)]
pub struct SecretKey(Zeroizing<String>, Arc<ArcSwapOption<Derived>>);

/// A SigV4 signing key and the scope it was derived for (wiped on drop, like the secret).
struct Derived {
    date: String,
    region: String,
    service: String,
    key: Zeroizing<[u8; 32]>,
}

impl SecretKey {
    #[must_use]
    pub fn new(s: String) -> Self {
        Self(Zeroizing::new(s), Arc::default())
    }

    /// The secret, for key derivation only.
    #[must_use]
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }

    /// The SigV4 signing key for `date` (`YYYYMMDD`), `region` and `service`: derived (four
    /// HMACs) when the scope differs from the last one asked for, else the kept one. A scope
    /// changes once a day per region, so verifying and signing requests derive about once a day.
    #[must_use]
    pub(crate) fn signing_key(&self, date: &str, region: &str, service: &str) -> [u8; 32] {
        if let Some(d) = &*self.1.load()
            && d.date == date
            && d.region == region
            && d.service == service
        {
            return *d.key;
        }
        let key = crate::s3::sigv4::signing_key(self.0.as_bytes(), date, region, service);
        self.1.store(Some(Arc::new(Derived {
            date: date.to_owned(),
            region: region.to_owned(),
            service: service.to_owned(),
            key: Zeroizing::new(key),
        })));
        key
    }
}

impl PartialEq for SecretKey {
    fn eq(&self, other: &Self) -> bool {
        self.0.as_bytes().ct_eq(other.0.as_bytes()).into()
    }
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[REDACTED]")
    }
}

impl fmt::Display for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[REDACTED]")
    }
}

/// The client credentials in force, replaced whole by a configuration reload (`crate::reload`).
pub(crate) type LiveCredentials = std::sync::Arc<arc_swap::ArcSwap<CredentialStore>>;

/// The set of client credentials the gateway accepts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CredentialStore {
    keys: HashMap<String, SecretKey>,
}

impl CredentialStore {
    pub fn insert(&mut self, access_key: String, secret: SecretKey) {
        self.keys.insert(access_key, secret);
    }

    #[must_use]
    pub(crate) fn get(&self, access_key: &str) -> Option<&SecretKey> {
        self.keys.get(access_key)
    }

    #[must_use]
    pub(crate) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signing_keys_are_derived_for_each_scope_and_shared_by_clones() {
        let derived = |d, r| crate::s3::sigv4::signing_key(b"secret", d, r, "s3");
        let secret = SecretKey::new("secret".into());
        assert_eq!(secret.signing_key("20261207", "us-east-1", "s3"), derived("20261207", "us-east-1"));
        let clone = secret.clone();
        assert!(clone.1.load().as_ref().is_some_and(|d| d.date == "20261207"), "a clone shares the kept key");
        assert_eq!(clone.signing_key("20261208", "us-east-1", "s3"), derived("20261208", "us-east-1"));
        assert_eq!(secret.signing_key("20261208", "eu-west-1", "s3"), derived("20261208", "eu-west-1"));
        assert_eq!(secret.signing_key("20261208", "us-east-1", "s3"), derived("20261208", "us-east-1"));
        assert_ne!(derived("20261207", "us-east-1"), derived("20261208", "us-east-1"));
    }

    #[test]
    fn secrets_never_print() {
        let s = SecretKey::new("super-secret".into());
        assert_eq!(format!("{s:?} {s}"), "[REDACTED] [REDACTED]");
        let mut store = CredentialStore::default();
        store.insert("AK".into(), s.clone());
        assert!(!format!("{store:?}").contains("super-secret"));
        assert_eq!(store.get("AK"), Some(&s));
        assert_ne!(store.get("AK"), Some(&SecretKey::new("other".into())));
    }
}
