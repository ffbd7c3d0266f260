//! tensorgate: a drop-in S3 gateway that verifies and re-signs every S3 request on its way to a
//! backend store, the base on which near-data pushdown of neural-network prefixes is built.
//!
//! Module map: see `ARCHITECTURE.md`.

pub(crate) mod admin;
pub mod backend;
pub(crate) mod body;
pub mod cache;
pub mod cli;
pub mod cluster;
pub mod config;
pub(crate) mod demo;
pub mod edge;
pub(crate) mod error;
pub mod metrics;
pub mod planner;
pub mod proxy;
pub mod pushdown;
pub(crate) mod reload;
pub mod s3;
pub mod server;
pub mod telemetry;
pub(crate) mod upgrade;

pub use config::Config;
pub use server::{Server, run};
