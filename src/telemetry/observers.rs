//! The observable instruments of a router: its counters, each shard's breaker and pool, and
//! its hot keys, read when metrics are collected rather than recorded as things happen.
//!
//! Telemetry sits below the router, so it cannot read a router itself: the router hands
//! [`register_observers`] a source that takes a [`RouterSnapshot`] of it. The meter provider
//! keeps the callbacks for the life of the process, so the source must not keep the router
//! alive: it holds it weakly and gives `None` once the router is gone, and the callbacks then
//! report nothing.

use std::time::Duration;

use opentelemetry::metrics::Meter;
use opentelemetry::KeyValue;
use shardlock_core::BreakerState;
use shardlock_mysql::PoolStatus;

use super::attr;
use crate::stats::LockStats;

/// A router as its observable instruments read it, taken at each callback.
#[derive(Debug, Clone)]
pub(crate) struct RouterSnapshot {
    /// The `instance` attribute of every observation.
    pub(crate) instance_id: String,
    /// The router's counters.
    pub(crate) stats: LockStats,
    /// Every shard of the topology, current and leaving.
    pub(crate) shards: Vec<ShardSnapshot>,
    /// The keys that made callers wait longest, most first, as the gauge reports them.
    pub(crate) hot_keys: Vec<(String, Duration)>,
}

/// One shard of a [`RouterSnapshot`].
#[derive(Debug, Clone)]
pub(crate) struct ShardSnapshot {
    /// The `shard` attribute.
    pub(crate) name: String,
    /// This process's breaker for the shard.
    pub(crate) breaker: BreakerState,
    /// The shard's connection pool.
    pub(crate) pool: PoolStatus,
    /// Acquires and releases waiting for the shard's next batch.
    pub(crate) batch_waiting: usize,
    /// Batches out to the shard now.
    pub(crate) batches_in_flight: usize,
}

/// Registers the observable instruments of a router. Each callback takes its own snapshot
/// from `source`, which gives `None` once the router is gone; the callbacks then report
/// nothing.
///
/// A snapshot holds more than any one callback reads. Taking all of it for each of the eight
/// costs atomic loads and a few short locks (the key queues, each shard's breaker, the hot-key
/// summary, where an acquire that finds it taken skips its record) once per collection (a
/// scrape, or the OTLP reader's 10 s tick): not worth a second kind of source.
pub(crate) fn register_observers<F>(meter: &Meter, source: F)
where
    F: Fn() -> Option<RouterSnapshot> + Clone + Send + Sync + 'static,
{
    type Read = fn(&LockStats) -> u64;
    let counters: [(&'static str, &'static str, Read); 12] = [
        (
            "shardlock.acquire.statements",
            "Acquire statements sent (one alone; per batch its write, and a read-back unless every key was new)",
            |s| s.acquire_statements,
        ),
        (
            "shardlock.acquire.batches",
            "Batches of several acquires sent together to a shard",
            |s| s.acquire_batches,
        ),
        (
            "shardlock.acquire.batched",
            "Acquires sent in batches (batched / batches: the mean batch size)",
            |s| s.batched_acquires,
        ),
        (
            "shardlock.release.batches",
            "Batches of several releases sent together to a shard, one statement each",
            |s| s.release_batches,
        ),
        (
            "shardlock.release.batched",
            "Releases sent in batches (batched / batches: the mean batch size)",
            |s| s.batched_releases,
        ),
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
        (
            "shardlock.renewal.blocked",
            "Lease renewals not made because another transaction held the row locked",
            |s| s.renewals_blocked,
        ),
        ("shardlock.leases.lost", "Leases reported lost", |s| s.lost),
        (
            "shardlock.local_handoffs",
            "Grants handed over in memory",
            |s| s.local_handoffs,
        ),
        (
            "shardlock.heartbeat.lapses",
            "Times the heartbeat lapsed: the process counted as maybe dead and joined its fleet again",
            |s| s.heartbeat_lapses,
        ),
        (
            "shardlock.breaker.rejections",
            "Calls not sent because a breaker was open",
            |s| s.breaker_rejections,
        ),
    ];
    for (name, description, read) in counters {
        let source = source.clone();
        meter
            .u64_observable_counter(name)
            .with_description(description)
            .with_callback(move |observer| {
                if let Some(router) = source() {
                    let instance = KeyValue::new(attr::INSTANCE, router.instance_id);
                    observer.observe(read(&router.stats), &[instance]);
                }
            })
            .build();
    }
    per_shard_by_state(
        meter,
        source.clone(),
        "shardlock.breaker.state",
        "Breaker per shard: 1 for the state it is in (closed, half_open, open), 0 for the others",
        |shard| {
            [
                ("closed", BreakerState::Closed),
                ("half_open", BreakerState::HalfOpen),
                ("open", BreakerState::Open),
            ]
            .map(|(name, state)| (Some(name), usize::from(shard.breaker == state)))
            .to_vec()
        },
    );
    type ReadPool = fn(&PoolStatus) -> usize;
    let pool: [(&'static str, &'static str, ReadPool); 5] = [
        (
            "shardlock.pool.connections.max",
            "Most connections the shard's pool opens",
            |p| p.max_size,
        ),
        (
            "shardlock.pool.connections.open",
            "Connections open to the shard now, in use or idle",
            |p| p.size,
        ),
        (
            "shardlock.pool.connections.idle",
            "Open connections to the shard not in use",
            |p| p.available,
        ),
        (
            "shardlock.pool.requests.pending",
            "Callers waiting for a connection to the shard",
            |p| p.waiting,
        ),
        (
            "shardlock.pool.sessions.stranded",
            "Sessions whose statement may still reach the shard, to end before its next statement",
            |p| p.stranded,
        ),
    ];
    for (name, description, read) in pool {
        per_shard_by_state(meter, source.clone(), name, description, move |shard| {
            vec![(None, read(&shard.pool))]
        });
    }
    per_shard_by_state(
        meter,
        source.clone(),
        "shardlock.batches",
        "The dispatcher per shard, by state: in_flight (batches out now), waiting (requests queued for the next)",
        |shard| {
            vec![
                (Some("in_flight"), shard.batches_in_flight),
                (Some("waiting"), shard.batch_waiting),
            ]
        },
    );
    let hot_keys = source;
    meter
        .f64_observable_gauge("shardlock.hot_key.wait")
        .with_unit("s")
        .with_description("Wait time per hot key over the hot-key window, top keys only")
        .with_callback(move |observer| {
            let Some(router) = hot_keys() else {
                return;
            };
            for (key, waited) in router.hot_keys {
                observer.observe(
                    waited.as_secs_f64(),
                    &[
                        KeyValue::new(attr::INSTANCE, router.instance_id.clone()),
                        KeyValue::new(attr::KEY, key),
                    ],
                );
            }
        })
        .build();
}

/// A gauge per shard (and per state, where `read` names one), as `read` gives its values
/// from each shard's snapshot.
fn per_shard_by_state<F>(
    meter: &Meter,
    source: F,
    name: &'static str,
    description: &'static str,
    read: impl Fn(&ShardSnapshot) -> Vec<(Option<&'static str>, usize)> + Send + Sync + 'static,
) where
    F: Fn() -> Option<RouterSnapshot> + Send + Sync + 'static,
{
    meter
        .u64_observable_gauge(name)
        .with_description(description)
        .with_callback(move |observer| {
            let Some(router) = source() else {
                return;
            };
            for shard in &router.shards {
                for (state, n) in read(shard) {
                    let mut attrs = vec![
                        KeyValue::new(attr::INSTANCE, router.instance_id.clone()),
                        KeyValue::new(attr::SHARD, shard.name.clone()),
                    ];
                    attrs.extend(state.map(|s| KeyValue::new(attr::STATE, s)));
                    observer.observe(n as u64, &attrs);
                }
            }
        })
        .build();
}

#[cfg(all(test, feature = "exporters"))]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// A router of two shards, one breaker open, with one hot key.
    fn router() -> RouterSnapshot {
        let mut pool = PoolStatus::default();
        (pool.max_size, pool.size, pool.available, pool.waiting) = (8, 3, 2, 1);
        pool.stranded = 4;
        RouterSnapshot {
            instance_id: "observed-1".to_owned(),
            stats: LockStats {
                renew_statements: 7,
                lost: 2,
                acquire_batches: 3,
                batched_acquires: 20,
                batched_releases: 9,
                ..LockStats::default()
            },
            shards: vec![
                ShardSnapshot {
                    name: "s0".to_owned(),
                    breaker: BreakerState::Closed,
                    pool,
                    batch_waiting: 5,
                    batches_in_flight: 2,
                },
                ShardSnapshot {
                    name: "s1".to_owned(),
                    breaker: BreakerState::Open,
                    pool,
                    batch_waiting: 0,
                    batches_in_flight: 0,
                },
            ],
            hot_keys: vec![("k".to_owned(), Duration::from_millis(1500))],
        }
    }

    /// The value of the one sample of `metric` whose line has every label of `with`.
    fn sample(text: &str, metric: &str, with: &[&str]) -> Option<f64> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{metric}{{")))
            .find(|l| with.iter().all(|w| l.contains(w)))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
    }

    #[test]
    fn observers_report_a_live_router_and_nothing_once_it_is_gone() {
        let registry = prometheus::Registry::new();
        let exporter = opentelemetry_prometheus::exporter()
            .with_registry(registry.clone())
            .without_target_info()
            .build()
            .unwrap();
        let provider = opentelemetry_sdk::metrics::SdkMeterProvider::builder()
            .with_reader(exporter)
            .build();
        let live = Arc::new(router());
        let weak = Arc::downgrade(&live);
        let meter = opentelemetry::metrics::MeterProvider::meter(&provider, "shardlock");
        register_observers(&meter, move || weak.upgrade().map(|r| (*r).clone()));

        let text = super::super::endpoint::encode(&registry);
        let instance = r#"shardlock_instance="observed-1""#;
        let metric = |name, with: &[&str]| {
            sample(&text, name, &[&[instance], with].concat())
                .unwrap_or_else(|| panic!("no {name} {with:?} in\n{text}"))
        };
        assert_eq!(metric("shardlock_renewal_statements_total", &[]), 7.0);
        assert_eq!(metric("shardlock_leases_lost_total", &[]), 2.0);
        assert_eq!(metric("shardlock_local_handoffs_total", &[]), 0.0);
        assert_eq!(metric("shardlock_acquire_batches_total", &[]), 3.0);
        assert_eq!(metric("shardlock_acquire_batched_total", &[]), 20.0);
        assert_eq!(metric("shardlock_release_batched_total", &[]), 9.0);
        let (s0, s1) = (r#"shardlock_shard="s0""#, r#"shardlock_shard="s1""#);
        let in_flight = [s0, r#"shardlock_state="in_flight""#];
        assert_eq!(metric("shardlock_batches", &in_flight), 2.0);
        let queued = [s0, r#"shardlock_state="waiting""#];
        assert_eq!(metric("shardlock_batches", &queued), 5.0);
        // One series per breaker state, 1 for the state the breaker is in.
        for (shard, open) in [(s0, 0.0), (s1, 1.0)] {
            let state = |s: &str| {
                metric(
                    "shardlock_breaker_state",
                    &[shard, &format!(r#"shardlock_state="{s}""#)],
                )
            };
            assert_eq!(state("open"), open);
            assert_eq!(state("closed"), 1.0 - open);
            assert_eq!(state("half_open"), 0.0);
        }
        assert_eq!(metric("shardlock_pool_connections_max", &[s1]), 8.0);
        assert_eq!(metric("shardlock_pool_connections_open", &[s1]), 3.0);
        assert_eq!(metric("shardlock_pool_connections_idle", &[s1]), 2.0);
        assert_eq!(metric("shardlock_pool_requests_pending", &[s1]), 1.0);
        assert_eq!(metric("shardlock_pool_sessions_stranded", &[s1]), 4.0);
        let hot = [r#"shardlock_key="k""#];
        assert_eq!(metric("shardlock_hot_key_wait_seconds", &hot), 1.5);
        assert!(!text.contains("rank="), "{text}");

        drop(live);
        let text = super::super::endpoint::encode(&registry);
        assert!(
            !text.contains(instance),
            "a dropped router still reported:\n{text}"
        );
    }
}
