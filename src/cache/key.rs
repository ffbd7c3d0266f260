//! What a cache entry is keyed by and what it holds, shared by both tiers.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

/// The object an output was computed from: bucket, key, and the forwarded query (a `versionId`,
/// `partNumber` or response override names different bytes).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectId {
    pub bucket: String,
    pub key: String,
    pub query: String,
}

/// Everything that determines an output besides the object's content: the object, and the
/// variant (model digest, split, format, dtype; the model digest covers the preprocessing, which
/// is part of the verified manifest).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CacheKey {
    pub object: ObjectId,
    pub variant: String,
}

/// A computed output and what its response needs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Cached {
    #[serde(skip)]
    pub body: Bytes,
    pub content_type: String,
    pub shape: Vec<usize>,
    pub split: String,
    pub dtype: String,
    /// The ETag of the source object the output was computed from.
    pub source_etag: String,
    pub source_last_modified: Option<String>,
    pub source_bytes: u64,
    /// What an augmented single image drew (`x-tensorgate-augmented`: `top,left,height,width,flip`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub augmented: Option<String>,
}
