//! Every metric, defined once (prefix `tensorgate_`), registered in a registry that is passed around,
//! never global. Label values are bounded sets: operation names and status classes, never keys.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::s3::route::S3Op;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpStatus {
    pub(crate) op: &'static str,
    pub(crate) status_class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpLabel {
    pub(crate) op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OpOutcome {
    pub(crate) op: &'static str,
    pub(crate) outcome: &'static str,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 0.25 ms .. ~8 s: covers a cached small GET through a slow multipart completion.
    Histogram::new(exponential_buckets(0.000_25, 2.0, 16))
}

/// What one upstream client (the store, or the cluster's other members) records: time to response
/// headers by operation and outcome, retries, and response body bytes.
#[derive(Clone, Debug)]
pub(crate) struct UpstreamMetrics {
    pub(crate) duration: HistogramFamily<OpOutcome>,
    /// `duration`'s series by operation and outcome, kept after first use (as `OpHandles`).
    durations: Arc<[[OnceLock<Histogram>; Outcome::ALL.len()]; S3Op::COUNT]>,
    pub(crate) retries: Counter,
    pub(crate) bytes_received: Counter,
}

/// How a request to an upstream ended, as its `outcome` label says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// An answer below 400.
    Ok,
    /// A 4xx answer.
    ClientError,
    /// A 5xx answer.
    ServerError,
    /// No answer (connection, timeout).
    Error,
}

impl Outcome {
    const ALL: [Self; 4] = [Self::Ok, Self::ClientError, Self::ServerError, Self::Error];

    /// The answer's outcome by its status.
    pub(crate) fn of(status: http::StatusCode) -> Self {
        if status.is_server_error() {
            Self::ServerError
        } else if status.is_client_error() {
            Self::ClientError
        } else {
            Self::Ok
        }
    }

    fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ClientError => "4xx",
            Self::ServerError => "5xx",
            Self::Error => "error",
        }
    }
}

impl UpstreamMetrics {
    /// Registers `{prefix}_request_duration_seconds`, `{prefix}_retries` and
    /// `{prefix}_response_body_bytes`.
    fn register(r: &mut Registry, prefix: &str, what: &str) -> Self {
        let duration: HistogramFamily<OpOutcome> = Family::new_with_constructor(latency_histogram);
        r.register(
            format!("{prefix}_request_duration_seconds"),
            format!("Time to response headers from {what}, by operation and outcome"),
            duration.clone(),
        );
        let retries = Counter::default();
        r.register(format!("{prefix}_retries"), format!("Requests to {what} retried"), retries.clone());
        let bytes_received = Counter::default();
        r.register(
            format!("{prefix}_response_body_bytes"),
            format!("Response body bytes received from {what}"),
            bytes_received.clone(),
        );
        let durations = Arc::new(std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())));
        Self { duration, durations, retries, bytes_received }
    }

    pub(crate) fn observe(&self, op: S3Op, outcome: Outcome, elapsed: Duration) {
        self.durations[op.index()][outcome as usize]
            .get_or_init(|| self.duration.get_or_create(&OpOutcome { op: op.name(), outcome: outcome.label() }).clone())
            .observe(elapsed.as_secs_f64());
    }
}

/// The `status_class` labels of `requests_total`, by the hundreds digit less one.
const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Each operation's series of `requests_total` (by status class) and `request_duration_seconds`,
/// taken from their families on first use and kept: a request then hashes no label set (the
/// families' lookups were a few percent of a proxied GET's instructions; ADR 0033). A series
/// appears in the exposition when first used, as before.
#[derive(Debug)]
struct OpHandles {
    requests: [[OnceLock<Counter>; STATUS_CLASSES.len()]; S3Op::COUNT],
    durations: [OnceLock<Histogram>; S3Op::COUNT],
}

impl Default for OpHandles {
    fn default() -> Self {
        Self {
            requests: std::array::from_fn(|_| std::array::from_fn(|_| OnceLock::new())),
            durations: std::array::from_fn(|_| OnceLock::new()),
        }
    }
}

/// The gateway's metrics. Cloning is cheap (all handles are `Arc`s inside).
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Arc<Registry>,
    pub(crate) requests: Family<OpStatus, Counter>,
    pub(crate) request_duration: HistogramFamily<OpLabel>,
    op_handles: Arc<OpHandles>,
    pub(crate) request_bytes: Counter,
    pub(crate) response_bytes: Counter,
    pub(crate) in_flight: Gauge,
    pub(crate) load_shed: Counter,
    /// Configuration reloads (SIGHUP or the admin API), by outcome: `applied`, `invalid`, `fixed`.
    pub(crate) config_reloads: Family<OutcomeLabel, Counter>,
    pub(crate) connections_open: Gauge,
    pub(crate) connections_refused: Counter,
    pub(crate) connections_closed: Family<ReasonLabel, Counter>,
    pub(crate) request_timeouts: Counter,
    /// The store client's requests.
    pub(crate) backend: UpstreamMetrics,
    /// Gateway-to-gateway hops (`src/proxy/owner.rs`), kept apart from the store's numbers.
    pub(crate) cluster_hops: UpstreamMetrics,
    pub(crate) pushdown_requests: Family<ModelSplit, Counter>,
    pub(crate) pushdown_source_bytes: Family<ModelSplit, Counter>,
    pub(crate) pushdown_output_bytes: Family<ModelSplit, Counter>,
    pub(crate) pushdown_samples: Family<ModelSplit, Counter>,
    pub(crate) pushdown_batch_size: HistogramFamily<ModelSplit>,
    pub(crate) pushdown_queue_depth: Family<ModelSplit, Gauge>,
    pub(crate) pushdown_stage_duration: HistogramFamily<ModelSplitStage>,
    /// Token positions a text prefix ran: `attended`, or `padding` up to its batch's run length.
    pub(crate) pushdown_tokens: Family<ModelSplitTokens, Counter>,
    pub(crate) cache_hits: Family<TierLabel, Counter>,
    pub(crate) cache_misses: Counter,
    pub(crate) cache_revalidations: Family<OutcomeLabel, Counter>,
    pub(crate) cache_evictions: Family<TierLabel, Counter>,
    pub(crate) cache_resident_bytes: Family<TierLabel, Gauge>,
    pub(crate) cache_served_bytes: Family<TierLabel, Counter>,
    pub(crate) cache_corrupt: Counter,
    pub(crate) memory_budget: Gauge,
    pub(crate) memory_reserved: Gauge,
    pub(crate) peak_resident: Gauge,
    pub(crate) storage_batch_requested: Histogram,
    pub(crate) storage_batch_chosen: Histogram,
    pub(crate) admission_deferrals: Counter,
    pub(crate) admission_timeouts: Counter,
    /// Requests that gave their source back so that an older one could reserve its outputs.
    pub(crate) admission_yields: Counter,
    pub(crate) admission_wait: Histogram,
    /// Engines stopped, by reason: `idle` (`pushdown.engine_idle_secs`) or `memory` (no request
    /// held them when another engine or a request needed their reservation).
    pub(crate) engine_evictions: Family<ReasonLabel, Counter>,
    /// Models served now.
    pub(crate) models: Gauge,
    /// Models added, replaced, removed or refused by the rescans of `models_dir`.
    pub(crate) model_changes: Family<ChangeLabel, Counter>,
    /// Engines started, by how their first session was readied: `measured` (memory probes and
    /// the prefix check run) or `remembered` (an earlier engine of the same model version, split
    /// and settings in this process had measured and checked them).
    pub(crate) engine_starts: Family<ReasonLabel, Counter>,
    /// Engine failures, by what failed: `run_panicked` (an inference run panicked; its batch got
    /// an error and the worker rebuilt its session) or `dead` (a request found the engine without
    /// a live worker, and a new one was started).
    pub(crate) engine_failures: Family<ReasonLabel, Counter>,
    /// Cluster members as this node last probed them, by `state` (`ready`, `unready`,
    /// `unreachable`); set when `/metrics` is scraped.
    pub(crate) cluster_members: Family<StateLabel, Gauge>,
    pub(crate) tenant_samples: Family<TenantLabel, Counter>,
    pub(crate) plans: Family<TenantLabel, Counter>,
    pub(crate) cluster_forwarded: Family<PeerLabel, Counter>,
    pub(crate) cluster_fallbacks: Family<PeerLabel, Counter>,
}

/// A cluster member (a bounded set: the configured or resolved members).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PeerLabel {
    pub(crate) peer: String,
}

/// A tenant: the access key's configured name (a bounded set).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TenantLabel {
    pub(crate) tenant: String,
}

/// A cache tier: `memory` or `disk`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TierLabel {
    pub(crate) tier: &'static str,
}

/// Why a connection ended: `done`, `header_timeout`, `stalled` or `error`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ReasonLabel {
    pub(crate) reason: &'static str,
}

/// A cluster member's state (`crate::cluster::MemberState::state`: a bounded set).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct StateLabel {
    pub(crate) state: &'static str,
}

/// What a models rescan changed (`added`, `replaced`, `removed`, `refused`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ChangeLabel {
    pub(crate) change: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabel {
    pub(crate) outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ModelSplitStage {
    pub(crate) model: String,
    pub(crate) split: String,
    pub(crate) stage: &'static str,
}

/// Token positions of a text prefix's runs, by kind: `attended` or `padding`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ModelSplitTokens {
    pub(crate) model: String,
    pub(crate) split: String,
    pub(crate) kind: &'static str,
}

fn batch_histogram() -> Histogram {
    // 1, 2, 4, ... 128 samples per inference run.
    Histogram::new(exponential_buckets(1.0, 2.0, 8))
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct ModelSplit {
    pub(crate) model: String,
    pub(crate) split: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    #[must_use]
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("tensorgate");
        let requests = Family::<OpStatus, Counter>::default();
        r.register("requests", "S3 requests by operation and status class", requests.clone());
        let request_duration: HistogramFamily<OpLabel> = Family::new_with_constructor(latency_histogram);
        r.register("request_duration_seconds", "Time to response headers, by operation", request_duration.clone());
        let request_bytes = Counter::default();
        r.register("request_body_bytes", "Request body bytes received from clients", request_bytes.clone());
        let response_bytes = Counter::default();
        r.register("response_body_bytes", "Response body bytes sent to clients", response_bytes.clone());
        let in_flight = Gauge::default();
        r.register("in_flight_requests", "Requests whose response has not finished", in_flight.clone());
        let load_shed = Counter::default();
        r.register(
            "load_shed",
            "Requests refused with 503 SlowDown because too many were in flight",
            load_shed.clone(),
        );
        let config_reloads = Family::<OutcomeLabel, Counter>::default();
        r.register(
            "config_reloads",
            "Configuration reloads: applied, invalid (nothing changed), or fixed (a key that needs a restart changed; nothing changed)",
            config_reloads.clone(),
        );
        let connections_open = Gauge::default();
        r.register("connections_open", "Client connections being served", connections_open.clone());
        let connections_refused = Counter::default();
        r.register(
            "connections_refused",
            "Connections over edge.max_connections, answered 503 SlowDown and closed",
            connections_refused.clone(),
        );
        let connections_closed = Family::<ReasonLabel, Counter>::default();
        r.register(
            "connections_closed",
            "Client connections ended, by reason (done, header_timeout, stalled, error)",
            connections_closed.clone(),
        );
        let request_timeouts = Counter::default();
        r.register(
            "request_timeouts",
            "Requests answered 503 after edge.request_timeout_secs without a response",
            request_timeouts.clone(),
        );
        let backend = UpstreamMetrics::register(&mut r, "backend", "the backend");
        let cluster_hops = UpstreamMetrics::register(&mut r, "cluster_hop", "cluster owners (gateway-to-gateway hops)");
        let pushdown_requests = Family::<ModelSplit, Counter>::default();
        r.register("pushdown_requests", "Pushdown requests answered, by model and split", pushdown_requests.clone());
        let pushdown_source_bytes = Family::<ModelSplit, Counter>::default();
        r.register(
            "pushdown_source_bytes",
            "Object bytes read for pushdown (compare with output bytes: the data reduction)",
            pushdown_source_bytes.clone(),
        );
        let pushdown_output_bytes = Family::<ModelSplit, Counter>::default();
        r.register("pushdown_output_bytes", "Tensor bytes returned by pushdown", pushdown_output_bytes.clone());
        let pushdown_samples = Family::<ModelSplit, Counter>::default();
        r.register("pushdown_samples", "Samples run through a prefix", pushdown_samples.clone());
        let pushdown_batch_size: HistogramFamily<ModelSplit> = Family::new_with_constructor(batch_histogram);
        r.register(
            "pushdown_batch_size",
            "Samples per inference run (batched within and across requests)",
            pushdown_batch_size.clone(),
        );
        let pushdown_queue_depth = Family::<ModelSplit, Gauge>::default();
        r.register(
            "pushdown_queue_depth",
            "Samples queued or running per (model, split)",
            pushdown_queue_depth.clone(),
        );
        let pushdown_stage_duration: HistogramFamily<ModelSplitStage> = Family::new_with_constructor(latency_histogram);
        r.register(
            "pushdown_stage_duration_seconds",
            "Pushdown time by stage: fetch, decode, queue (per sample), infer, encode",
            pushdown_stage_duration.clone(),
        );
        let pushdown_tokens = Family::<ModelSplitTokens, Counter>::default();
        r.register(
            "pushdown_tokens",
            "Token positions run through a text prefix: attended, or padding (a batch runs at its longest text where the prefix allows, else at the model's length)",
            pushdown_tokens.clone(),
        );
        let cache_hits = Family::<TierLabel, Counter>::default();
        r.register("cache_hits", "Pushdown requests answered from the tensor cache, by tier", cache_hits.clone());
        let cache_misses = Counter::default();
        r.register("cache_misses", "Pushdown requests that ran the prefix", cache_misses.clone());
        let cache_revalidations = Family::<OutcomeLabel, Counter>::default();
        r.register(
            "cache_revalidations",
            "Conditional GETs confirming a cached output's source: unchanged, changed, gone, or refused (this caller, where the store decides per caller)",
            cache_revalidations.clone(),
        );
        let cache_evictions = Family::<TierLabel, Counter>::default();
        r.register("cache_evictions", "Entries evicted for space, by tier", cache_evictions.clone());
        let cache_resident_bytes = Family::<TierLabel, Gauge>::default();
        r.register("cache_resident_bytes", "Bytes held by the tensor cache, by tier", cache_resident_bytes.clone());
        let cache_served_bytes = Family::<TierLabel, Counter>::default();
        r.register(
            "cache_served_bytes",
            "Output bytes served from the tensor cache, by tier",
            cache_served_bytes.clone(),
        );
        let cache_corrupt = Counter::default();
        r.register(
            "cache_corrupt_entries",
            "Disk cache entries dropped for failing their check",
            cache_corrupt.clone(),
        );
        let memory_budget = Gauge::default();
        r.register("pushdown_memory_budget_bytes", "pushdown.memory_budget", memory_budget.clone());
        let memory_reserved = Gauge::default();
        r.register(
            "pushdown_memory_reserved_bytes",
            "Memory reserved by the governor: engines' fixed bytes plus admitted samples",
            memory_reserved.clone(),
        );
        let peak_resident = Gauge::default();
        r.register(
            "process_peak_resident_bytes",
            "Highest resident set size of the process seen",
            peak_resident.clone(),
        );
        let storage_batch_requested = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        r.register(
            "pushdown_storage_batch_requested",
            "Storage batch sizes requested by clients (x-tensorgate-batch)",
            storage_batch_requested.clone(),
        );
        let storage_batch_chosen = Histogram::new(exponential_buckets(1.0, 2.0, 14));
        r.register(
            "pushdown_storage_batch_chosen",
            "Samples in flight granted to a request when it opened (its allotment under the budget)",
            storage_batch_chosen.clone(),
        );
        let admission_deferrals = Counter::default();
        r.register("pushdown_admission_deferrals", "Samples that waited for memory", admission_deferrals.clone());
        let admission_timeouts = Counter::default();
        r.register(
            "pushdown_admission_timeouts",
            "Samples that waited past pushdown.max_wait_ms (the request got 503 SlowDown)",
            admission_timeouts.clone(),
        );
        let admission_yields = Counter::default();
        r.register(
            "pushdown_admission_yields",
            "Requests that gave their source back (503 SlowDown) because only other waiting requests' sources \
             stood in the way of their outputs, so that the oldest could go on",
            admission_yields.clone(),
        );
        let admission_wait = latency_histogram();
        r.register(
            "pushdown_admission_wait_seconds",
            "Time deferred samples waited for memory",
            admission_wait.clone(),
        );
        let engine_evictions = Family::<ReasonLabel, Counter>::default();
        r.register(
            "pushdown_engine_evictions",
            "Engines stopped: idle, unused when their memory was needed (memory), or of a model removed or replaced (retired)",
            engine_evictions.clone(),
        );
        let models = Gauge::default();
        r.register("pushdown_models", "Models served now", models.clone());
        let model_changes = Family::<ChangeLabel, Counter>::default();
        r.register(
            "pushdown_model_changes",
            "Models added, replaced, removed, or refused (failed their checks) while serving",
            model_changes.clone(),
        );
        let engine_starts = Family::<ReasonLabel, Counter>::default();
        r.register(
            "pushdown_engine_starts",
            "Engines started: their first session measured and checked (measured), or as an earlier engine of the same split had (remembered)",
            engine_starts.clone(),
        );
        let engine_failures = Family::<ReasonLabel, Counter>::default();
        // Both reasons exported from the start, at zero: an alert's `increase()` then sees the
        // first failure instead of a series appearing at 1.
        for reason in ["run_panicked", "dead"] {
            drop(engine_failures.get_or_create(&ReasonLabel { reason }));
        }
        r.register(
            "pushdown_engine_failures",
            "Engine failures: an inference run panicked and its session was rebuilt (run_panicked), or an engine without a live worker was replaced (dead)",
            engine_failures.clone(),
        );
        let cluster_members = Family::<StateLabel, Gauge>::default();
        r.register(
            "cluster_members",
            "Cluster members as this node last probed them, by state (ready, unready, unreachable)",
            cluster_members.clone(),
        );
        let tenant_samples = Family::<TenantLabel, Counter>::default();
        r.register("pushdown_tenant_samples", "Samples admitted, by tenant", tenant_samples.clone());
        let plans = Family::<TenantLabel, Counter>::default();
        r.register("pushdown_plans", "Split plans made (POST /v1/plan), by tenant", plans.clone());
        let cluster_forwarded = Family::<PeerLabel, Counter>::default();
        r.register("cluster_forwarded", "Pushdowns forwarded to their owner, by owner", cluster_forwarded.clone());
        let cluster_fallbacks = Family::<PeerLabel, Counter>::default();
        r.register(
            "cluster_fallbacks",
            "Pushdowns computed here because their owner did not answer, by owner",
            cluster_fallbacks.clone(),
        );
        Self {
            registry: Arc::new(r),
            memory_budget,
            memory_reserved,
            peak_resident,
            storage_batch_requested,
            storage_batch_chosen,
            admission_deferrals,
            admission_timeouts,
            admission_yields,
            admission_wait,
            engine_evictions,
            models,
            model_changes,
            engine_starts,
            engine_failures,
            cluster_members,
            tenant_samples,
            plans,
            cluster_forwarded,
            cluster_fallbacks,
            cache_hits,
            cache_misses,
            cache_revalidations,
            cache_evictions,
            cache_resident_bytes,
            cache_served_bytes,
            cache_corrupt,
            pushdown_samples,
            pushdown_batch_size,
            pushdown_queue_depth,
            pushdown_stage_duration,
            pushdown_tokens,
            pushdown_requests,
            pushdown_source_bytes,
            pushdown_output_bytes,
            requests,
            request_duration,
            op_handles: Arc::default(),
            request_bytes,
            response_bytes,
            in_flight,
            load_shed,
            config_reloads,
            connections_open,
            connections_refused,
            connections_closed,
            request_timeouts,
            backend,
            cluster_hops,
        }
    }

    pub(crate) fn observe_request(&self, op: S3Op, status: http::StatusCode, elapsed: Duration) {
        let class = match status.as_u16() {
            100..=199 => 0,
            200..=299 => 1,
            300..=399 => 2,
            400..=499 => 3,
            _ => 4,
        };
        let h = &self.op_handles;
        h.requests[op.index()][class]
            .get_or_init(|| {
                self.requests.get_or_create(&OpStatus { op: op.name(), status_class: STATUS_CLASSES[class] }).clone()
            })
            .inc();
        h.durations[op.index()]
            .get_or_init(|| self.request_duration.get_or_create(&OpLabel { op: op.name() }).clone())
            .observe(elapsed.as_secs_f64());
    }

    /// Records one answered pushdown request; `stages` are (fetch, decode, infer, encode).
    pub(crate) fn observe_pushdown(
        &self,
        model: &str,
        split: &str,
        source_bytes: usize,
        output_bytes: usize,
        stages: [Duration; 4],
    ) {
        let l = ModelSplit { model: model.to_owned(), split: split.to_owned() };
        self.pushdown_requests.get_or_create(&l).inc();
        self.pushdown_source_bytes.get_or_create(&l).inc_by(source_bytes as u64);
        self.pushdown_output_bytes.get_or_create(&l).inc_by(output_bytes as u64);
        for (stage, d) in ["fetch", "decode", "infer", "encode"].into_iter().zip(stages) {
            let k = ModelSplitStage { model: model.to_owned(), split: split.to_owned(), stage };
            self.pushdown_stage_duration.get_or_create(&k).observe(d.as_secs_f64());
        }
    }

    /// An RAII guard holding the in-flight gauge up until dropped.
    #[must_use]
    pub(crate) fn in_flight_guard(&self) -> InFlightGuard {
        self.in_flight.inc();
        InFlightGuard(self.in_flight.clone())
    }

    /// The Prometheus text exposition. Never inlined: `bench/request_instructions.sh` has
    /// callgrind dump its counts when this runs (a mark callgrind can see by name).
    #[must_use]
    #[inline(never)]
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("metrics encode");
        out
    }
}

/// Decrements the in-flight gauge on drop.
#[derive(Debug)]
pub(crate) struct InFlightGuard(Gauge);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_with_prefix_and_guard_balances() {
        let m = Metrics::new();
        m.observe_request(S3Op::GetObject, http::StatusCode::OK, Duration::from_millis(3));
        {
            let _g = m.in_flight_guard();
            assert_eq!(m.in_flight.get(), 1);
        }
        assert_eq!(m.in_flight.get(), 0);
        let text = m.render();
        assert!(text.contains(r#"tensorgate_requests_total{op="GetObject",status_class="2xx"} 1"#), "{text}");
        assert!(text.contains("tensorgate_request_duration_seconds_bucket"));
    }
}
