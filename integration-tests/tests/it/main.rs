//! End-to-end tests: one binary (faster linking), one module per area.

mod auth;
mod cluster;
mod edge;
mod faults;
mod fs_backend;
mod passthrough;
mod pushdown;
mod transparent;
