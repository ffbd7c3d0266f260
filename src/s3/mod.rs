//! The S3 protocol: routing, SigV4, credentials, header names and XML error bodies. Pure: no IO.

pub(crate) mod authority;
pub mod checksum;
pub mod credentials;
pub mod form;
pub(crate) mod headers;
pub mod listing;
pub mod post_policy;
pub mod route;
pub(crate) mod sigv2;
pub mod sigv4;
pub(crate) mod xml;
