//! Logging: `tracing` with an env-style filter, plain or JSON lines. Secrets never reach it: the
//! credential types redact themselves and the request log carries access keys, never secrets.

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber (a no-op if one is already installed, as in tests).
pub(crate) fn init(format: LogFormat, filter: &str) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let _ = match format {
        LogFormat::Plain => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}
