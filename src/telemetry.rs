//! Logging: `tracing` with an env-style filter, plain or JSON lines. Secrets never reach it: the
//! credential types redact themselves and the request log carries access keys, never secrets.
//! The filter can be replaced while serving ([`set_filter`], a configuration reload).

use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Registry, fmt, reload};

use crate::config::LogFormat;

/// The installed subscriber's filter, once [`init`] installed it.
static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Installs the global subscriber (a no-op if one is already installed, as in tests).
pub(crate) fn init(format: LogFormat, filter: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let (filter, handle) = reload::Layer::new(filter);
    let lines = fmt::layer()
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let installed = match format {
        LogFormat::Plain => tracing_subscriber::registry().with(filter).with(lines).try_init(),
        LogFormat::Json => tracing_subscriber::registry().with(filter).with(lines.json()).try_init(),
    };
    if installed.is_ok() {
        let _ = FILTER.set(handle);
    }
}

/// Whether `filter` is a filter directive `tracing` accepts.
///
/// # Errors
/// Why it is not.
pub(crate) fn check_filter(filter: &str) -> Result<(), String> {
    EnvFilter::try_new(filter).map(|_| ()).map_err(|e| e.to_string())
}

/// Replaces the log filter (nothing to do where [`init`] did not install the subscriber).
///
/// # Errors
/// An invalid directive.
pub(crate) fn set_filter(filter: &str) -> Result<(), String> {
    let new = EnvFilter::try_new(filter).map_err(|e| e.to_string())?;
    match FILTER.get() {
        Some(handle) => handle.reload(new).map_err(|e| e.to_string()),
        None => Ok(()),
    }
}
