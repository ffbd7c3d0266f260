//! Client credentials: access key → secret, with secrets that never print and compare in
//! constant time.

use std::collections::HashMap;
use std::fmt;

use subtle::ConstantTimeEq;
use zeroize::Zeroizing;

/// A secret access key. `Debug` and `Display` print a placeholder; memory is wiped on drop.
#[derive(Clone)]
pub struct SecretKey(Zeroizing<String>);

impl SecretKey {
    #[must_use]
    pub fn new(s: String) -> Self {
        Self(Zeroizing::new(s))
    }

    /// The secret, for key derivation only.
    #[must_use]
    pub(crate) fn expose(&self) -> &str {
        &self.0
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
