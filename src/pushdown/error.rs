//! Why a pushdown request failed: one type for the service and its parts.

/// Why a pushdown request failed. Mapped to S3 codes in `crate::error`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum PushdownError {
    #[error("invalid pushdown field {field}: {message}")]
    InvalidArgument { field: String, message: String },
    #[error("unknown model {name:?}; available: {known}")]
    UnknownModel { name: String, known: String },
    #[error("model {model} has no split {split:?}; splits: {known}")]
    UnknownSplit { model: String, split: String, known: String },
    #[error("pushdown is unavailable: {0}")]
    Unavailable(String),
    #[error("too many pushdown samples queued; retry later")]
    Overloaded,
    /// Would not fit even in an empty budget (`400`): the request (or the engine) is too large.
    #[error("needs {needed} bytes, more than pushdown.memory_budget can ever hold ({budget} bytes)")]
    ExceedsBudget { needed: u64, budget: u64 },
    /// Would fit, but running engines hold the rest of the budget (`503`): idle engines are
    /// evicted after `pushdown.engine_idle_secs`, so a retry can succeed.
    #[error("needs {needed} bytes of pushdown.memory_budget, {free} are free beside the running engines; retry later")]
    BudgetBusy { needed: u64, free: u64 },
    /// The plans table is full (`planning::MAX_PLANS`): a new (tenant, model) cannot be planned.
    #[error("the gateway holds its most plans ({max}); a new tenant or model cannot be planned now")]
    TooManyPlans { max: usize },
    /// Transparent identity mode: a caller's signed HEAD or Range reads only part of the source,
    /// and the gateway holds no key to read the rest, so an output not yet cached cannot be made.
    #[error(
        "in transparent identity mode without a gateway key (backend.access_key) a pushdown output is first computed from the caller's own GET of the whole object: send a GET without Range once (HEAD and Range are then answered from the cache)"
    )]
    WholeReadFirst,
    #[error("cannot use the object as model input: {0}")]
    BadInput(String),
    #[error("unsupported pushdown input: {0}")]
    Unsupported(String),
    #[error("the object is larger than pushdown.max_object_bytes ({limit} bytes)")]
    ObjectTooLarge { limit: u64 },
    /// The source's body did not arrive within `pushdown.source_timeout_secs`.
    #[error("the storage backend did not send the object within {secs} s; retry later")]
    SourceTimeout { secs: u64 },
    /// The source's body broke off.
    #[error("reading the object from the storage backend failed: {0}")]
    SourceRead(String),
    #[error("the model cannot run this split: {0}")]
    Model(String),
    #[error("internal pushdown error: {0}")]
    Internal(String),
    /// Nobody waits for the rest of a streamed output (ADR 0031): a `HEAD` answered from its
    /// layout, or a client gone when no admission place was left to finish it into the cache.
    /// Ends the job; never an answer (the response went before it).
    #[error("nobody waits for the rest of the output")]
    Unwanted,
}

/// Runs a third-party parser of untrusted bytes, turning its panics into `400 BadInput` (`what`:
/// the message's prefix, e.g. "cannot decode image"): a parser bug must cost that one request,
/// never the process or a `500`. libjpeg reports fatal errors by unwinding (the `mozjpeg`
/// contract); the parquet crate panics on some damaged files (`super::table`).
///
/// # Errors
/// What `f` returns, or `BadInput` if it panicked.
pub(crate) fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, PushdownError>) -> Result<T, PushdownError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("damaged data");
        Err(PushdownError::BadInput(format!("{what}: {msg}")))
    })
}
