//! Telemetry: `tracing` spans and events for every lock wait and hold, OpenTelemetry metrics,
//! and [`init`], the one call that serves those metrics to Prometheus.
//!
//! The library only *emits*: spans `shardlock.acquire` (namespace, shard, bucket, key or its
//! hash, attempts, wait_ms, outcome, mode) and `shardlock.hold` (grant to release); events for
//! renewals, lost leases, in-memory hand-offs, breaker transitions and cleaner deletions; and
//! metrics through the OpenTelemetry metrics API (meter `shardlock`). Nothing is exported until
//! the host installs a subscriber and a meter provider — [`init`] does the latter — **before**
//! it builds its routers (instruments bind to the meter provider in force then).
//!
//! Metrics (names as the Prometheus exporter writes them):
//!
//! | metric | kind | attributes |
//! | --- | --- | --- |
//! | `shardlock_acquire_duration_seconds` | histogram (its `_count`: acquires by outcome) | namespace, shard, outcome, mode |
//! | `shardlock_statement_duration_seconds` | histogram: one call to a shard | shard, outcome (ok, failure) |
//! | `shardlock_hold_duration_seconds` | histogram | shard, mode |
//! | `shardlock_renewal_statements_total`, `shardlock_renewal_failures_total` | counter | instance |
//! | `shardlock_leases_lost_total`, `shardlock_local_handoffs_total`, `shardlock_breaker_rejections_total` | counter | instance |
//! | `shardlock_breaker_state` | gauge: 0 closed, 1 half-open, 2 open | instance, shard |
//! | `shardlock_pool_connections` | gauge | instance, shard, state (max, size, available, waiting) |
//! | `shardlock_cleaner_deleted_total` | counter | shard, reason (released, abandoned) |
//! | `shardlock_hot_key_wait_seconds` | gauge: wait over the hot-key window | instance, key, rank |
//!
//! `outcome` is `granted`, `timeout`, `unavailable` or `error`; `mode` is `remote` or `local`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Weak};
use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter};
use opentelemetry::KeyValue;
use shardlock_core::config::TelemetryConfig;
use shardlock_core::{Error, HotKeys, LockKey, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::state::Inner;
use crate::sync::LockExt;

/// Waits shorter than this are not counted for hot keys: a key nobody waits a millisecond for
/// is not what an operator looks for, and skipping them keeps the summary off the fastest path.
const HOT_KEY_MIN_WAIT: Duration = Duration::from_millis(1);

/// Latency buckets, in seconds: 100 µs to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// Set once metrics are exported ([`init`] or [`metrics_exported_elsewhere`]); routers built
/// before that skip recording, which costs nothing then.
static METRICS_ON: AtomicBool = AtomicBool::new(false);

/// Tells shardlock that the host installed an OpenTelemetry meter provider of its own (instead
/// of calling [`init`]): routers built after this call record metrics and hot keys.
pub fn metrics_exported_elsewhere() {
    METRICS_ON.store(true, Ordering::Release);
}

/// A router's instruments and hot-key summary.
pub(crate) struct Telemetry {
    /// Whether metrics were exported when the router was built.
    on: bool,
    record_keys: bool,
    acquire: Histogram<f64>,
    statement: Histogram<f64>,
    hold: Histogram<f64>,
    cleaner_deleted: Counter<u64>,
    hot: Mutex<HotKeys>,
    hot_keys: usize,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("record_keys", &self.record_keys)
            .finish_non_exhaustive()
    }
}

impl Telemetry {
    pub(crate) fn new(config: &TelemetryConfig) -> Self {
        let meter = meter();
        Self {
            on: METRICS_ON.load(Ordering::Acquire),
            record_keys: config.record_keys,
            acquire: meter
                .f64_histogram("shardlock.acquire.duration")
                .with_unit("s")
                .with_description("Time from acquire call to its answer (granted or not)")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            statement: meter
                .f64_histogram("shardlock.statement.duration")
                .with_unit("s")
                .with_description(
                    "Round trip of one call to a shard (lease statements, retries included)",
                )
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            hold: meter
                .f64_histogram("shardlock.hold.duration")
                .with_unit("s")
                .with_description("Time from grant to release")
                .with_boundaries(LATENCY_BUCKETS.to_vec())
                .build(),
            cleaner_deleted: meter
                .u64_counter("shardlock.cleaner.deleted")
                .with_description("Rows deleted by the cleaner")
                .build(),
            hot: Mutex::new(HotKeys::new(
                (config.hot_keys as usize * 4).max(16),
                config.hot_key_window,
            )),
            hot_keys: config.hot_keys as usize,
        }
    }

    /// How a key appears in spans and metrics: itself, or its stable hash.
    pub(crate) fn key_label(&self, key: &LockKey) -> String {
        if self.record_keys {
            key.to_string()
        } else {
            key.label_hash()
        }
    }

    /// Records one acquire call. The common case — granted through the shard — goes through
    /// a histogram bound to its attributes once per shard and namespace (`bound`), which
    /// spares the per-call attribute lookup.
    pub(crate) fn acquired(
        &self,
        key: &LockKey,
        attrs: AcquireAttrs,
        took: Duration,
        waited_for_key: bool,
        bound: Option<&BoundAcquires>,
    ) {
        if !self.on {
            return;
        }
        let granted_remote = attrs.outcome == "granted" && attrs.mode == "remote";
        match bound {
            Some(bound) if granted_remote => bound.record(self, &attrs, took),
            _ => {
                let kv = attrs.key_values();
                // Its `_count` series are the acquires by outcome: no separate counter.
                self.acquire.record(took.as_secs_f64(), &kv);
            }
        }
        if waited_for_key && took >= HOT_KEY_MIN_WAIT {
            // Keyed by the key itself; turned into its label only when reported. Under
            // contention a record is skipped rather than waited for: a hot key is recorded
            // often enough anyway.
            if let Ok(mut hot) = self.hot.try_lock() {
                hot.record(
                    Instant::now().into_std(),
                    key.as_str(),
                    took.as_micros() as u64,
                );
            }
        }
    }

    /// Records one call to a shard that was sent.
    pub(crate) fn statement(
        &self,
        shard: &opentelemetry::StringValue,
        failed: bool,
        took: Duration,
    ) {
        if !self.on {
            return;
        }
        self.statement.record(
            took.as_secs_f64(),
            &[
                KeyValue::new("shard", shard.clone()),
                KeyValue::new("outcome", if failed { "failure" } else { "ok" }),
            ],
        );
    }

    /// Hold-time histograms bound to `shard` and each mode (remote, local); `None` while
    /// metrics are off.
    pub(crate) fn bind_holds(
        &self,
        shard: &opentelemetry::StringValue,
    ) -> Option<[opentelemetry::metrics::BoundHistogram<f64>; 2]> {
        self.on.then(|| {
            ["remote", "local"].map(|mode| {
                self.hold.bind(&[
                    KeyValue::new("shard", shard.clone()),
                    KeyValue::new("mode", mode),
                ])
            })
        })
    }

    /// Records cleaner deletions.
    pub(crate) fn cleaned(&self, shard: &str, released: u64, abandoned: u64) {
        for (reason, n) in [("released", released), ("abandoned", abandoned)] {
            if n > 0 {
                self.cleaner_deleted.add(
                    n,
                    &[
                        KeyValue::new("shard", shard.to_owned()),
                        KeyValue::new("reason", reason),
                    ],
                );
            }
        }
    }

    /// The keys that made callers wait longest over the hot-key window: (label, total wait).
    pub(crate) fn hot_keys(&self, n: usize) -> Vec<(String, Duration)> {
        let top = self.hot.locked().top(Instant::now().into_std(), n);
        top.into_iter()
            .map(|(key, us)| {
                let label = match LockKey::new(&key) {
                    Ok(k) if !self.record_keys => k.label_hash(),
                    _ => key,
                };
                (label, Duration::from_micros(us))
            })
            .collect()
    }
}

/// The attributes of one acquire's metrics.
#[derive(Debug)]
pub(crate) struct AcquireAttrs {
    pub(crate) namespace: opentelemetry::StringValue,
    pub(crate) shard: opentelemetry::StringValue,
    pub(crate) outcome: &'static str,
    pub(crate) mode: &'static str,
}

impl AcquireAttrs {
    fn key_values(&self) -> [KeyValue; 4] {
        [
            KeyValue::new("namespace", self.namespace.clone()),
            KeyValue::new("shard", self.shard.clone()),
            KeyValue::new("outcome", self.outcome),
            KeyValue::new("mode", self.mode),
        ]
    }
}

/// Per shard: the acquire histogram bound to (namespace, this shard, granted, remote), one per
/// namespace seen, behind a copy-on-write map (reads take no lock).
#[derive(Default)]
pub(crate) struct BoundAcquires {
    by_namespace: arc_swap::ArcSwap<
        std::collections::HashMap<String, opentelemetry::metrics::BoundHistogram<f64>>,
    >,
}

impl std::fmt::Debug for BoundAcquires {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundAcquires").finish_non_exhaustive()
    }
}

impl BoundAcquires {
    fn record(&self, telemetry: &Telemetry, attrs: &AcquireAttrs, took: Duration) {
        let namespace = attrs.namespace.as_str();
        if let Some(bound) = self.by_namespace.load().get(namespace) {
            bound.record(took.as_secs_f64());
            return;
        }
        let bound = telemetry.acquire.bind(&attrs.key_values());
        bound.record(took.as_secs_f64());
        self.by_namespace.rcu(|map| {
            let mut map = (**map).clone();
            map.insert(namespace.to_owned(), bound.clone());
            map
        });
    }
}

/// The current span's OpenTelemetry context as a W3C traceparent, when it is recorded and has
/// a valid context (an OpenTelemetry layer is installed).
pub(crate) fn current_traceparent() -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let context = span.context();
    let sc = context.span().span_context().clone();
    sc.is_valid().then(|| {
        format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        )
    })
}

/// Whether the current span is recorded (so that a link is worth a statement).
pub(crate) fn tracing_current() -> bool {
    !tracing::Span::current().is_disabled()
}

/// Links the current span to the span of a W3C `traceparent` (the holder's, read from its
/// lease row).
pub(crate) fn link_current_to(traceparent: &str) {
    use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let mut parts = traceparent.split('-');
    let (Some("00"), Some(trace), Some(span), Some(flags)) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let (Ok(trace), Ok(span), Ok(flags)) = (
        TraceId::from_hex(trace),
        SpanId::from_hex(span),
        u8::from_str_radix(flags, 16),
    ) else {
        return;
    };
    let context = SpanContext::new(
        trace,
        span,
        TraceFlags::new(flags),
        true,
        TraceState::default(),
    );
    tracing::Span::current().add_link(context);
}

fn meter() -> Meter {
    opentelemetry::global::meter("shardlock")
}

/// Registers the observable instruments of a router: its counters, each shard's breaker and
/// pool, and its hot keys. They read the router through `inner` and report nothing once it is
/// gone.
pub(crate) fn register_observers(inner: Weak<Inner>) {
    let meter = meter();
    type Read = fn(&crate::LockStats) -> u64;
    let counters: [(&'static str, &'static str, Read); 5] = [
        (
            "shardlock.renewal.statements",
            "Renewal statements sent",
            |s| s.renew_statements,
        ),
        (
            "shardlock.renewal.failures",
            "Renewal attempts that failed",
            |s| s.renew_failures,
        ),
        ("shardlock.leases.lost", "Leases reported lost", |s| s.lost),
        (
            "shardlock.local_handoffs",
            "Grants handed over in memory",
            |s| s.local_handoffs,
        ),
        (
            "shardlock.breaker.rejections",
            "Calls not sent because a breaker was open",
            |s| s.breaker_rejections,
        ),
    ];
    for (name, description, read) in counters {
        let weak = inner.clone();
        meter
            .u64_observable_counter(name)
            .with_description(description)
            .with_callback(move |observer| {
                if let Some(router) = router_of(&weak) {
                    let instance = KeyValue::new("instance", router.instance_id().to_owned());
                    observer.observe(read(&router.stats()), &[instance]);
                }
            })
            .build();
    }
    let weak = inner.clone();
    meter
        .i64_observable_gauge("shardlock.breaker.state")
        .with_description("Breaker per shard: 0 closed, 1 half-open, 2 open")
        .with_callback(move |observer| {
            let Some(router) = router_of(&weak) else {
                return;
            };
            for status in router.shard_states() {
                let state = status.breaker_state().gauge();
                observer.observe(
                    state,
                    &[
                        KeyValue::new("instance", router.instance_id().to_owned()),
                        KeyValue::new("shard", status.name().to_owned()),
                    ],
                );
            }
        })
        .build();
    let weak = inner.clone();
    meter
        .u64_observable_gauge("shardlock.pool.connections")
        .with_description("Connection pool per shard, by state: max, size, available, waiting")
        .with_callback(move |observer| {
            let Some(router) = router_of(&weak) else {
                return;
            };
            for shard in router.shard_states() {
                let pool = shard.pool_status();
                for (state, n) in [
                    ("max", pool.max_size),
                    ("size", pool.size),
                    ("available", pool.available),
                    ("waiting", pool.waiting),
                ] {
                    observer.observe(
                        n as u64,
                        &[
                            KeyValue::new("instance", router.instance_id().to_owned()),
                            KeyValue::new("shard", shard.name().to_owned()),
                            KeyValue::new("state", state),
                        ],
                    );
                }
            }
        })
        .build();
    let weak = inner;
    meter
        .f64_observable_gauge("shardlock.hot_key.wait")
        .with_unit("s")
        .with_description("Wait time per hot key over the hot-key window, top keys only")
        .with_callback(move |observer| {
            let Some(router) = router_of(&weak) else {
                return;
            };
            let telemetry = &router.inner.shared.telemetry;
            for (rank, (key, waited)) in telemetry
                .hot_keys(telemetry.hot_keys)
                .into_iter()
                .enumerate()
            {
                observer.observe(
                    waited.as_secs_f64(),
                    &[
                        KeyValue::new("instance", router.instance_id().to_owned()),
                        KeyValue::new("key", key),
                        KeyValue::new("rank", (rank + 1) as i64),
                    ],
                );
            }
        })
        .build();
}

fn router_of(weak: &Weak<Inner>) -> Option<crate::LockRouter> {
    weak.upgrade().map(|inner| crate::LockRouter { inner })
}

/// What [`init`] set up; keep it for the life of the process. Dropping it stops the
/// Prometheus endpoint; [`TelemetryGuard::shutdown`] also flushes what OTLP still holds.
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: opentelemetry_sdk::metrics::SdkMeterProvider,
    tracer: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
    registry: prometheus::Registry,
    server: Option<(SocketAddr, tokio::task::JoinHandle<()>)>,
}

impl TelemetryGuard {
    /// Where the Prometheus endpoint listens (`/metrics`), if it was configured.
    pub fn prometheus_addr(&self) -> Option<SocketAddr> {
        self.server.as_ref().map(|(addr, _)| *addr)
    }

    /// The metrics in the Prometheus text format, as the endpoint serves them.
    pub fn prometheus_text(&self) -> String {
        encode(&self.registry)
    }

    /// The `tracing` layer that turns spans into OpenTelemetry spans exported over OTLP
    /// (`None` without `telemetry.otlp-endpoint`). Add it to the host's subscriber:
    ///
    /// ```no_run
    /// # async fn demo(config: shardlock::Config) -> shardlock::Result<()> {
    /// use tracing_subscriber::prelude::*;
    /// let telemetry = shardlock::telemetry::init(&config.telemetry).await?;
    /// tracing_subscriber::registry().with(telemetry.layer()).init();
    /// # Ok(()) }
    /// ```
    ///
    /// A waiter granted a lock handed over by its holder carries a span link to the holder's
    /// `shardlock.hold` span.
    pub fn layer<S>(
        &self,
    ) -> Option<tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::SdkTracer>>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        use opentelemetry::trace::TracerProvider as _;
        let tracer = self.tracer.as_ref()?.tracer("shardlock");
        Some(tracing_opentelemetry::layer().with_tracer(tracer))
    }

    /// Flushes what OTLP still holds and stops the providers.
    pub fn shutdown(self) {
        if let Some(tracer) = &self.tracer {
            let _ = tracer.force_flush();
            let _ = tracer.shutdown();
        }
        let _ = self.provider.force_flush();
        let _ = self.provider.shutdown();
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some((_, server)) = &self.server {
            server.abort();
        }
    }
}

/// The one-call setup for a host application: installs an OpenTelemetry meter provider whose
/// metrics are kept for Prometheus — served at `http://<prometheus-listen>/metrics` when the
/// config names an address — and, with `otlp-endpoint`, also pushed over OTLP, with a tracer
/// provider exporting spans there (add [`TelemetryGuard::layer`] to your `tracing`
/// subscriber). Call it once, inside a Tokio runtime, before building routers.
///
/// ```no_run
/// # async fn demo() -> shardlock::Result<()> {
/// let config = shardlock::Config::from_yaml_file("config/local.yaml")?;
/// let _telemetry = shardlock::telemetry::init(&config.telemetry).await?;
/// let router = shardlock::LockRouter::new(config).await?;
/// # Ok(()) }
/// ```
///
/// Cancellation: the meter (and OTLP tracer) providers are already installed globally when it
/// waits to bind the Prometheus listener; dropped then, they stay installed with no guard to
/// flush or stop them, and nothing listens. Call `init` again.
pub async fn init(config: &TelemetryConfig) -> Result<TelemetryGuard> {
    let registry = prometheus::Registry::new();
    let exporter = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .without_target_info()
        .build()
        .map_err(|e| Error::InvalidArgument {
            name: "telemetry",
            reason: format!("cannot set up the Prometheus exporter: {e}"),
        })?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(config.service_name.clone())
        .build();
    let otlp_error = |e: &dyn std::fmt::Display| Error::InvalidArgument {
        name: "telemetry.otlp-endpoint",
        reason: format!("cannot set up the OTLP exporter: {e}"),
    };
    let mut meters = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
        .with_resource(resource.clone())
        .with_reader(exporter);
    let mut tracer = None;
    if let Some(endpoint) = &config.otlp_endpoint {
        use opentelemetry_otlp::{Protocol, WithExportConfig};
        use opentelemetry_sdk::trace::Sampler;
        let endpoint = endpoint.trim_end_matches('/');
        let spans = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(format!("{endpoint}/v1/traces"))
            .build()
            .map_err(|e| otlp_error(&e))?;
        let metrics = opentelemetry_otlp::MetricExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpJson)
            .with_endpoint(format!("{endpoint}/v1/metrics"))
            .build()
            .map_err(|e| otlp_error(&e))?;
        meters = meters.with_reader(
            opentelemetry_sdk::metrics::PeriodicReader::builder(metrics)
                .with_interval(Duration::from_secs(10))
                .build(),
        );
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            config.trace_sample_ratio,
        )));
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_resource(resource)
            .with_sampler(sampler)
            .with_batch_exporter(spans)
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        tracer = Some(provider);
    }
    let provider = meters.build();
    opentelemetry::global::set_meter_provider(provider.clone());
    metrics_exported_elsewhere();
    let server = match &config.prometheus_listen {
        None => None,
        Some(addr) => {
            let listener =
                tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|e| Error::InvalidArgument {
                        name: "telemetry.prometheus-listen",
                        reason: format!("cannot listen on {addr}: {e}"),
                    })?;
            let addr = listener.local_addr().map_err(|e| Error::InvalidArgument {
                name: "telemetry.prometheus-listen",
                reason: e.to_string(),
            })?;
            Some((addr, tokio::spawn(serve(listener, registry.clone()))))
        }
    };
    Ok(TelemetryGuard {
        provider,
        tracer,
        registry,
        server,
    })
}

fn encode(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A minimal HTTP/1.1 server: `GET /metrics` answers the metrics, anything else 404.
async fn serve(listener: tokio::net::TcpListener, registry: prometheus::Registry) {
    loop {
        // A failed accept (out of file descriptors, a connection reset before it was
        // accepted) ends that connection, not the endpoint.
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "shardlock metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let mut request = vec![0u8; 4096];
            let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), stream.read(&mut request)).await
            else {
                return;
            };
            let line = String::from_utf8_lossy(&request[..n]);
            let response = if line.starts_with("GET /metrics") {
                let body = encode(&registry);
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    .to_owned()
            };
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}
