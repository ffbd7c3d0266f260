//! Near-data pushdown: a GET that names a model and a split returns the tensor the model's prefix
//! computes from the object instead of the object's bytes. This module declares the pieces and
//! re-exports what the rest of the crate uses; it holds no code of its own.
//!
//! In the order a request meets them: [`spec`] (what the request asks for), `service` (the
//! [`Pushdown`] service: registry, engines, governor, CPU slots), `job` ([`Pushdown::prepare`]
//! resolves a request into a [`Job`], which reads its source under the memory budget), `parse`
//! (the source as samples: images, `.npy`, WebDataset shards ([`shard`]), Parquet ([`table`]),
//! texts ([`text`])), [`preprocess`] and [`engine`] (inference threads with batching, supervised in
//! [`engines`], admitted by [`governor`] and [`fair`], running sessions of an `inference` trait), `encode` and [`tensor`] (`.npy`,
//! safetensors, tar or Parquet out). [`registry`] verifies model files (from `models_dir` and
//! the store's bucket, which `models_store` mirrors), [`prefix`] cuts a model at
//! a split, [`runtime`] loads ONNX Runtime and makes its sessions. The proxy's pushdown phase (`crate::proxy::pushdown`)
//! answers a job over HTTP through the tensor cache.

pub mod augment;
pub(crate) mod clock;
pub(crate) mod decode;
mod encode;
pub mod engine;
pub(crate) mod engines;
pub(crate) mod error;
pub(crate) mod fair;
pub(crate) mod governor;
pub(crate) mod import;
mod inference;
mod job;
pub mod manifest;
pub(crate) mod memory;
mod models_store;
pub(crate) mod order;
mod parse;
pub mod planning;
pub mod prefix;
pub mod preprocess;
pub(crate) mod queue;
pub(crate) mod registry;
pub(crate) mod runtime;
mod service;
pub mod shard;
pub mod spec;
pub(crate) mod stream;
pub mod table;
pub mod tensor;
pub mod text;

pub use self::error::PushdownError;
pub(crate) use self::job::Job;
pub(crate) use self::models_store::ModelsStoreConfig;
pub use self::service::DEFAULT_MAX_OBJECT_BYTES;
pub(crate) use self::service::{Output, Pushdown, PushdownConfig};

#[cfg(test)]
mod tests;
