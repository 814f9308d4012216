//! `shardlock bench`: lock throughput against baselines measured in the same run on the same
//! shard, plus counts that do not depend on machine noise (statements per lock cycle, InnoDB
//! deadlocks provoked).
//!
//! Runs are interleaved (shardlock, baseline, shardlock, baseline, ...) and each side reports
//! its median round, so that drift on a shared machine (background purge, other load) hits
//! both sides alike.

mod cleaner;
mod galera;
mod harness;
mod hot_key;
mod reload;
mod report;
mod shard_down;
mod telemetry;
mod uncontended;
mod workers;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use rand::Rng;
use serde::Serialize;
use shardlock::LockRouter;

use self::harness::{baseline_pool, bench_config, prepare_baseline_tables, Counters, Round};
use self::report::{Comparison, Report};
use self::workers::Work;
use crate::{dev, AnyError, ConfigSource};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub(crate) enum Scenario {
    /// Distinct keys, acquire + release, against raw INSERT + owner-checked DELETE.
    Uncontended,
    /// One key, many tasks in one process, against the naive hand-rolled algorithm.
    HotKey,
    /// One key, many tasks in one process, against Redis `SET NX PX` + owner-checked delete.
    HotKeyRedis,
    /// One key split into 16 buckets against the same key as one bucket, 2 processes x 32
    /// tasks, in-memory hand-off off so the shard serves every grant.
    Buckets,
    /// 32 tasks on 500 keys over all shards; a reload that moves keys (first shard's weight
    /// doubled) happens a third into the round. Throughput in the move window against before.
    Reload,
    /// Acquire latency of keys on the healthy shards while the last shard is down (cut off
    /// once the router is up: a proxy in front of it resets every connection; 4 tasks keep
    /// calling its keys, answered by its breaker), against the same load with every shard up.
    /// Compare p50/p99.
    ShardDown,
    /// The uncontended cycle (16 tasks, distinct keys) with metrics on (an OpenTelemetry meter
    /// provider feeding the Prometheus exporter; spans as `SHARDLOCK_LOG` enables them)
    /// against a router built before any provider was installed, in the same run.
    Telemetry,
    /// The same on one hot key, 64 tasks, handed over in memory: the worst case, where a
    /// grant costs a couple of microseconds and the metrics' own cost shows most.
    TelemetryHotKey,
    /// The uncontended cycle with the shard made durable for the scenario (`SET GLOBAL
    /// innodb_flush_log_at_trx_commit = 1`: a log flush per commit, restored afterwards), where
    /// each statement's commit costs a flush and sending keys together saves the most.
    Durable,
    /// 2 processes x 64 tasks taking random keys of 1,000 shared ones (acquire, release at
    /// once; in-memory hand-off off, so the shard serves every grant and batches meet held
    /// rows), against the naive hand-rolled lock with 128 tasks on the same keys. Reports the
    /// deadlocks InnoDB saw and those that reached a caller (shardlock: none).
    Overlap,
    /// Acquire latency of distinct keys (`--tasks`) while the cleaner deletes released rows
    /// of the same shard in batches (400,000 rows planted per second of the round, batches of
    /// 1,000, 10 ms apart), against the same load with nothing to clean. Compare p50/p99.
    Cleaner,
    /// The uncontended cycle (`--tasks`) through a shard served by a three-node Galera
    /// cluster started on this machine (needs `galera-4`, `mariadb-backup`, `socat`), against
    /// the same cycle on the single-server shard: the price of synchronous replication.
    Galera,
}

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Scenarios to run (repeat the flag for several).
    #[arg(long, value_enum, default_values_t = [Scenario::Uncontended, Scenario::HotKey, Scenario::HotKeyRedis, Scenario::Buckets, Scenario::Reload, Scenario::ShardDown, Scenario::Telemetry, Scenario::TelemetryHotKey, Scenario::Cleaner])]
    scenario: Vec<Scenario>,
    /// The Redis server for the `hot-key-redis` baseline (skipped when it does not answer).
    #[arg(long, default_value = "redis://127.0.0.1:6379")]
    redis: String,
    /// How long each round runs.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// Interleaved rounds per side; each side reports its median round.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=20))]
    rounds: u32,
    /// Concurrent tasks in the uncontended scenario (and connections of the raw baseline).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    tasks: u32,
    /// Concurrent tasks on the hot key.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=1024))]
    hot_tasks: u32,
    /// Directory for the JSON report (`bench-<time>.json` and `latest.json`).
    #[arg(long, default_value = "target/shardlock-bench")]
    out: PathBuf,
    /// Switch in-memory hand-offs off (`handoff-max-count: 0`) for the single-process
    /// scenarios, so the shard serves every grant.
    #[arg(long)]
    no_local_handoff: bool,
    /// Internal: run as one process of the `buckets` scenario with this many buckets.
    #[arg(long, hide = true)]
    worker_buckets: Option<u32>,
    /// Internal: run as one process of the `overlap` scenario, on this many keys.
    #[arg(long, hide = true)]
    worker_overlap: Option<u32>,
    /// Internal: the key (or key prefix) of a worker.
    #[arg(long, hide = true, default_value = "bench:buckets")]
    worker_key: String,
}

pub(crate) async fn run(
    source: &ConfigSource,
    args: BenchArgs,
    as_json: bool,
) -> Result<(), AnyError> {
    if let Some(buckets) = args.worker_buckets {
        return workers::worker(source, &args, Work::Buckets(buckets)).await;
    }
    if let Some(keys) = args.worker_overlap {
        return workers::worker(source, &args, Work::Overlap(keys)).await;
    }
    // Before the first scenario: a directory that cannot be made failed only after every
    // scenario had run, naming no path.
    std::fs::create_dir_all(&args.out).map_err(|e| {
        crate::failure::fail(
            crate::failure::Exit::Failure,
            format!(
                "--out {}: cannot create the directory: {e}",
                args.out.display()
            ),
        )
    })?;
    if source.is_local_default() {
        dev::ensure_up().await?;
    }
    // Everything runs on the first shard, so that shardlock and the baselines share one server.
    let mut config = bench_config(source, "main");
    config.shards.truncate(1);
    if args.no_local_handoff {
        for ns in config.namespaces.values_mut() {
            ns.handoff_max_count = 0;
        }
    }
    let shard = config.shards[0].clone();
    let router = LockRouter::new(config).await?;
    router.migrate().await?;
    let pool = baseline_pool(&shard, args.tasks)?;
    prepare_baseline_tables(&pool).await?;
    let counters = Counters::new(pool.clone()).await?;
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();

    let mut comparisons = Vec::new();
    let mut metrics_on = None;
    for &scenario in &args.scenario {
        let telemetry_scenario =
            matches!(scenario, Scenario::Telemetry | Scenario::TelemetryHotKey);
        if telemetry_scenario && metrics_on.is_none() {
            metrics_on = Some(telemetry::MetricsOn::start(source, &router).await?);
        }
        let redis = match scenario {
            Scenario::HotKeyRedis => match hot_key::redis_connection(&args.redis).await {
                Ok(conn) => Some(conn),
                Err(e) => {
                    eprintln!(
                        "skipping hot-key-redis: Redis at {} does not answer ({e})",
                        without_password(&args.redis)
                    );
                    continue;
                }
            },
            Scenario::ShardDown if source.config.shards.len() < 2 => {
                eprintln!("skipping shard-down: it needs at least 2 shards");
                continue;
            }
            _ => None,
        };
        let durable = match scenario {
            Scenario::Durable => match uncontended::Durable::start(&pool).await {
                Ok(durable) => Some(durable),
                Err(e) => {
                    eprintln!("skipping durable: cannot set innodb_flush_log_at_trx_commit ({e})");
                    continue;
                }
            },
            _ => None,
        };
        let galera = match scenario {
            Scenario::Galera => match galera::GaleraShard::start(source).await {
                Ok(galera) => Some(galera),
                Err(e) => {
                    eprintln!("skipping galera: cannot start a local Galera cluster ({e})");
                    continue;
                }
            },
            _ => None,
        };
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            // Unique per run, scenario and round: no round meets keys another one took.
            let tag = format!("{run_id}:{scenario:?}:{round}");
            let round = Round {
                tag: &tag,
                args: &args,
                counters: &counters,
            };
            let (o, b) = match scenario {
                Scenario::Uncontended | Scenario::Durable => (
                    uncontended::shardlock_swept(&router, round).await?,
                    uncontended::raw_sql(&pool, round).await?,
                ),
                Scenario::HotKey => (
                    hot_key::shardlock(&router, round).await?,
                    hot_key::naive(&pool, round).await?,
                ),
                Scenario::HotKeyRedis => {
                    let redis = redis.clone().expect("connected above");
                    (
                        hot_key::shardlock(&router, round).await?,
                        hot_key::redis_set_nx(redis, round).await?,
                    )
                }
                Scenario::Buckets => (
                    workers::across_processes(source, Work::Buckets(16), round).await?,
                    workers::across_processes(source, Work::Buckets(1), round).await?,
                ),
                Scenario::Overlap => {
                    let (keys, tasks) = (workers::OVERLAP_KEYS, 2 * workers::OVERLAP_TASKS);
                    let prefix = format!("bench:naive:o:{}", round.tag);
                    let name = format!("naive hand-rolled lock, {keys} keys, {tasks} tasks");
                    (
                        workers::across_processes(source, Work::Overlap(keys), round).await?,
                        hot_key::naive_on(&pool, round, &name, tasks, move |_, _| {
                            format!("{prefix}:{}", rand::rng().random_range(0..keys))
                        })
                        .await?,
                    )
                }
                Scenario::Reload => reload::throughput_across_reload(source, round).await?,
                Scenario::ShardDown => {
                    // The all-up run first, then the one whose last shard dies once its router
                    // is up.
                    let base = shard_down::with_a_shard_down(source, false, round).await?;
                    (
                        shard_down::with_a_shard_down(source, true, round).await?,
                        base,
                    )
                }
                Scenario::Telemetry => {
                    let on = metrics_on.as_ref().expect("set up above");
                    on.uncontended(&router, round).await?
                }
                Scenario::TelemetryHotKey => {
                    let on = metrics_on.as_ref().expect("set up above");
                    on.hot_key(&router, round).await?
                }
                Scenario::Cleaner => {
                    let base = cleaner::while_cleaning(source, false, round).await?;
                    (cleaner::while_cleaning(source, true, round).await?, base)
                }
                Scenario::Galera => {
                    let galera = galera.as_ref().expect("started above");
                    (
                        galera.cycle(round).await?,
                        uncontended::shardlock_swept(&router, round).await?,
                    )
                }
            };
            ours.push(o);
            base.push(b);
        }
        if let Some(durable) = durable {
            durable.restore(&pool).await?;
        }
        if let Some(galera) = galera {
            galera.stop().await?;
        }
        comparisons.push(Comparison::of(scenario, ours, base));
    }
    router.shutdown().await?;
    if let Some(on) = &metrics_on {
        on.router.shutdown().await?;
    }

    let report = Report::new(shard.name.clone(), &args, comparisons);
    report.publish(&args.out, as_json)
}

/// `url` with the password of its `user:password@` part, and a `password` query parameter,
/// (if any) shown as `***`.
fn without_password(url: &str) -> String {
    let (url, query) = match url.split_once('?') {
        Some((url, query)) => (url, Some(query)),
        None => (url, None),
    };
    let url = match url.split_once("://") {
        Some((scheme, rest)) => match rest
            .rfind('@')
            .and_then(|at| Some((at, rest[..at].find(':')?)))
        {
            Some((at, colon)) => format!("{scheme}://{}:***{}", &rest[..colon], &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    };
    let Some(query) = query else { return url };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{url}?{}", query.join("&"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_redis_urls_password_is_not_shown() {
        use super::without_password as shown;
        assert_eq!(shown("redis://:s3cret@db:6379/0"), "redis://:***@db:6379/0");
        assert_eq!(shown("redis://app:p@ss@db:6379"), "redis://app:***@db:6379");
        assert_eq!(shown("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(
            shown("redis://db:6379/0?password=s3cret&protocol=resp3"),
            "redis://db:6379/0?password=***&protocol=resp3"
        );
    }
}
