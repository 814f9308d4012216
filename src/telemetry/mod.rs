//! Telemetry: `tracing` spans and events for every lock wait and hold, OpenTelemetry metrics,
//! and (feature `exporters`) `init`, the one call that serves those metrics to Prometheus.
//!
//! The library only *emits*: spans `shardlock.acquire` (`shardlock.namespace`, `.shard`,
//! `.bucket`, `.key` or its hash, `.attempts`, `.wait_ms`, `.outcome`, `.mode`) and
//! `shardlock.hold` (grant to release; `.shard`, `.fence`, `.mode`); a database
//! client span per call to a shard (named `{operation} {database}`, with OpenTelemetry's
//! `db.system.name`, `db.namespace`, `db.operation.name`, `server.address`, `server.port`,
//! and `error.type` with an error status when it fails; `shardlock.shard`); events for
//! renewals, lost leases, in-memory hand-offs, breaker transitions and cleaner deletions; and
//! metrics through the OpenTelemetry metrics API (meter `shardlock`). It installs nothing
//! global. Metrics go to the meter provider a router is built with
//! (`LockRouter::builder(config).meter_provider(&provider)`); a router built without one uses
//! the global provider if the host installed it and said so ([`metrics_exported_elsewhere`])
//! **before** building the router (instruments bind when the router is built). Spans go to the
//! host's `tracing` subscriber; with a `tracing-opentelemetry` layer they become OpenTelemetry
//! spans (opentelemetry 0.33 / tracing-opentelemetry 0.34: another major version of either
//! sees no span context, so lease rows carry no trace context and waiters get no links).
//!
//! Metrics (names and labels as the Prometheus exporter writes them; every attribute is
//! shardlock's own, under `shardlock.`, so none collides with the `instance` and `job` labels
//! Prometheus sets at scrape time):
//!
//! | metric | kind | labels |
//! | --- | --- | --- |
//! | `shardlock_acquire_duration_seconds` | histogram (its `_count`: acquires by outcome) | namespace, shard, outcome, mode |
//! | `shardlock_statement_duration_seconds` | histogram: one call to a shard | shard, outcome (ok, failure) |
//! | `shardlock_hold_duration_seconds` | histogram | shard, mode |
//! | `shardlock_renewal_statements_total`, `shardlock_renewal_failures_total` | counter | instance |
//! | `shardlock_leases_lost_total`, `shardlock_local_handoffs_total`, `shardlock_breaker_rejections_total`, `shardlock_heartbeat_lapses_total` | counter | instance |
//! | `shardlock_acquire_statements_total`, `shardlock_acquire_batches_total`, `shardlock_acquire_batched_total`, `shardlock_release_batches_total`, `shardlock_release_batched_total` | counter | instance |
//! | `shardlock_batches` | gauge: the dispatcher | instance, shard, state (in_flight, waiting) |
//! | `shardlock_breaker_state` | gauge: 1 for the state the breaker is in, 0 for the others | instance, shard, state (closed, half_open, open) |
//! | `shardlock_pool_connections_max`, `_open`, `_idle`, `shardlock_pool_requests_pending`, `shardlock_pool_sessions_stranded` | gauge | instance, shard |
//! | `shardlock_cleaner_deleted_total` | counter | shard, reason (released, abandoned) |
//! | `shardlock_hot_key_wait_seconds` | gauge: wait over the hot-key window, top keys | instance, key |
//!
//! Each label is written `shardlock_<name>` (`shardlock_shard`, `shardlock_instance`, ...).
//! `outcome` is `granted`, `timeout`, `unavailable` or `error`; `mode` is `remote` or `local`.

// Inside the facade this module is the bottom layer: it uses only `crate::sync`, `crate::stats`
// and other crates, so that the shard handle, the acquire path, the cleaner and the router can
// all record into it without a cycle. What it must read from a router (counters, breakers, pools,
// hot keys) the router hands it as a snapshot source (`observers`). Its parts:
//
// - `instruments`: what the lock paths record as they run, built to cost little there;
// - `trace_context`: a holder's trace context stored with its lease and linked by waiters;
// - `observers`: the gauges and counters read from a router when metrics are collected;
// - `export`: `init` and `TelemetryGuard`, the host's side, with `endpoint`, the Prometheus
//   HTTP endpoint.

use std::sync::atomic::{AtomicBool, Ordering};

/// Metric attribute keys, all shardlock's own and so under `shardlock.` (the Prometheus
/// exporter writes `shardlock_shard`, ...). None is `instance`, which Prometheus sets itself
/// at scrape time.
pub(crate) mod attr {
    pub(crate) const INSTANCE: &str = "shardlock.instance";
    pub(crate) const NAMESPACE: &str = "shardlock.namespace";
    pub(crate) const SHARD: &str = "shardlock.shard";
    pub(crate) const OUTCOME: &str = "shardlock.outcome";
    pub(crate) const MODE: &str = "shardlock.mode";
    pub(crate) const REASON: &str = "shardlock.reason";
    pub(crate) const STATE: &str = "shardlock.state";
    pub(crate) const KEY: &str = "shardlock.key";
}

use opentelemetry::metrics::Meter;

#[cfg(feature = "exporters")]
mod endpoint;
#[cfg(feature = "exporters")]
mod export;
mod instruments;
mod observers;
mod trace_context;

#[cfg(feature = "exporters")]
pub use export::{init, TelemetryGuard};
pub(crate) use instruments::{AcquireAttrs, BoundAcquires, Telemetry};
pub(crate) use observers::{register_observers, RouterSnapshot, ShardSnapshot};
pub(crate) use trace_context::{current_traceparent, link_current_to, tracing_current};

/// Set once the host said it installed a global meter provider ([`metrics_exported_elsewhere`]);
/// routers built before that, and without a provider of their own, skip recording, which costs
/// nothing then.
static METRICS_ON: AtomicBool = AtomicBool::new(false);

/// Tells shardlock that the host installed a global OpenTelemetry meter provider: routers
/// built after this call without a provider of their own record metrics and hot keys through
/// it.
pub fn metrics_exported_elsewhere() {
    METRICS_ON.store(true, Ordering::Release);
}

/// Whether metrics are exported now (read once per router, when it is built).
fn metrics_on() -> bool {
    METRICS_ON.load(Ordering::Acquire)
}

/// The meter of a router built without a meter provider of its own: the host's global
/// provider, or a no-op one.
fn global_meter() -> Meter {
    opentelemetry::global::meter("shardlock")
}
