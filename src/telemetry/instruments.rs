//! What the lock paths record as they run: a router's instruments (acquire, statement and hold
//! histograms, cleaner deletions) and its hot-key summary.
//!
//! These sit on the acquire path, so they are built to cost little there: a router built
//! while no metrics are exported skips recording altogether, the common outcome (granted on
//! the shard) goes through histograms bound once per shard and namespace instead of looking
//! its attributes up per call, and the hot-key summary is skipped rather than waited for when
//! another task holds it.

use std::sync::Mutex;
use std::time::Duration;

use opentelemetry::metrics::{Counter, Histogram, Meter};
use opentelemetry::KeyValue;
use shardlock_core::config::TelemetryConfig;
use shardlock_core::{HotKeys, LockKey};
use tokio::time::Instant;

use super::attr;
use crate::sync::LockExt;

/// Waits shorter than this are not counted for hot keys: a key nobody waits a millisecond for
/// is not what an operator looks for, and skipping them keeps the summary off the fastest path.
const HOT_KEY_MIN_WAIT: Duration = Duration::from_millis(1);

/// Latency buckets, in seconds: 100 µs to 30 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0,
];

/// A router's instruments and hot-key summary.
pub(crate) struct Telemetry {
    /// Whether metrics are exported: the host gave the router a meter provider, or said it
    /// installed a global one before the router was built.
    on: bool,
    /// Where the instruments (and the router's observable ones) come from.
    meter: Meter,
    /// Whether keys appear as themselves in spans and metrics (else as a stable hash).
    record_keys: bool,
    /// The settings it was made with: a reload does not change them.
    started_with: TelemetryConfig,
    acquire: Histogram<f64>,
    statement: Histogram<f64>,
    hold: Histogram<f64>,
    cleaner_deleted: Counter<u64>,
    hot: Mutex<HotKeys>,
    /// How many keys the hot-key gauge reports (`telemetry.hot-keys`).
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
    /// The telemetry settings this router started with (a reload keeps them).
    pub(crate) fn started_with(&self) -> &TelemetryConfig {
        &self.started_with
    }

    /// Instruments from `meter` (the host's provider's), or from the global provider.
    pub(crate) fn new(config: &TelemetryConfig, meter: Option<Meter>) -> Self {
        let on = meter.is_some() || super::metrics_on();
        let meter = meter.unwrap_or_else(super::global_meter);
        Self {
            on,
            record_keys: config.record_keys,
            started_with: config.clone(),
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
            meter,
        }
    }

    /// The meter the router's observable instruments come from too.
    pub(crate) fn meter(&self) -> &Meter {
        &self.meter
    }

    /// How a key appears in spans and metrics: itself, or its stable hash.
    pub(crate) fn key_label(&self, key: &LockKey) -> String {
        if self.record_keys {
            key.to_string()
        } else {
            key.label_hash()
        }
    }

    /// How a key stored as `stored` (a row's primary key) appears: itself (as text), or its
    /// stable hash, as [`Telemetry::key_label`] shows the key.
    pub(crate) fn stored_key_label(&self, stored: &[u8]) -> String {
        if self.record_keys {
            String::from_utf8_lossy(stored).into_owned()
        } else {
            LockKey::stored_label_hash(stored)
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
                    key.scoped_str(),
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
                KeyValue::new(attr::SHARD, shard.clone()),
                KeyValue::new(attr::OUTCOME, if failed { "failure" } else { "ok" }),
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
                    KeyValue::new(attr::SHARD, shard.clone()),
                    KeyValue::new(attr::MODE, mode),
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
                        KeyValue::new(attr::SHARD, shard.to_owned()),
                        KeyValue::new(attr::REASON, reason),
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
                // Recorded by the lock's name (its scope's prefix and key, buckets together):
                // labelled as that plain lock is, whatever its length.
                let label = if self.record_keys {
                    key
                } else {
                    LockKey::name_label_hash(&key)
                };
                (label, Duration::from_micros(us))
            })
            .collect()
    }

    /// The hot keys the gauge reports: as many as `telemetry.hot-keys` asks for.
    pub(crate) fn reported_hot_keys(&self) -> Vec<(String, Duration)> {
        self.hot_keys(self.hot_keys)
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
            KeyValue::new(attr::NAMESPACE, self.namespace.clone()),
            KeyValue::new(attr::SHARD, self.shard.clone()),
            KeyValue::new(attr::OUTCOME, self.outcome),
            KeyValue::new(attr::MODE, self.mode),
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
