//! The S3 protocol: routing, SigV4, credentials, header names and XML error bodies. Pure: no IO.

pub mod authority;
pub mod checksum;
pub mod credentials;
pub mod form;
pub mod headers;
pub mod listing;
pub mod post_policy;
pub mod route;
pub mod sigv2;
pub mod sigv4;
pub mod xml;
