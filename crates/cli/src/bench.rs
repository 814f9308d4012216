//! `shardlock bench`: lock throughput against baselines measured in the same run on the same
//! shard, plus counts that do not depend on machine noise (statements per lock cycle, InnoDB
//! deadlocks provoked).
//!
//! Runs are interleaved (shardlock, baseline, shardlock, baseline, ...) and each side reports
//! its median round, so that drift on a shared machine (background purge, other load) hits
//! both sides alike.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{
    Conn, Error as MyError, Opts, OptsBuilder, Pool, PoolConstraints, PoolOpts,
};
use shardlock::{AcquireOptions, Backoff, LockRouter};

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
    /// Acquire latency of keys on the healthy shards while the last shard is down (its URL
    /// points at a closed port; 4 tasks keep calling its keys, answered by its breaker),
    /// against the same load with every shard up. Compare p50/p99.
    ShardDown,
    /// The uncontended cycle (16 tasks, distinct keys) with metrics on (an OpenTelemetry meter
    /// provider feeding the Prometheus exporter; spans as `SHARDLOCK_LOG` enables them)
    /// against a router built before any provider was installed, in the same run.
    Telemetry,
    /// The same on one hot key, 64 tasks, handed over in memory: the worst case, where a
    /// grant costs a couple of microseconds and the metrics' own cost shows most.
    TelemetryHotKey,
    /// Acquire latency of distinct keys (`--tasks`) while the cleaner deletes released rows
    /// of the same shard in batches (400,000 rows planted per second of the round, batches of
    /// 1,000, 10 ms apart), against the same load with nothing to clean. Compare p50/p99.
    Cleaner,
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
    /// Concurrent tasks in the uncontended scenario.
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
    /// Internal: the key of a `buckets` worker.
    #[arg(long, hide = true, default_value = "bench:buckets")]
    worker_key: String,
}

/// Processes and tasks per process of the `buckets` scenario.
const BUCKET_PROCESSES: usize = 2;
const BUCKET_TASKS: u32 = 32;

/// One measured round.
#[derive(Debug, Default, Clone, Serialize)]
struct Measurement {
    name: String,
    ops: u64,
    seconds: f64,
    ops_per_sec: f64,
    /// Statements that wrote rows (INSERT/UPDATE/DELETE), counted by the server, per op.
    statements_per_op: f64,
    /// Errors 1213/1205 that reached the caller's code.
    deadlock_errors_surfaced: u64,
    /// `Innodb_deadlocks` increase on the shard during the round.
    innodb_deadlocks: u64,
    /// Other errors.
    errors: u64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    /// The latency distribution: (quantile, ms) at fixed quantiles, for the plot.
    latency_quantiles: Vec<(f64, f64)>,
}

/// The quantiles kept of every latency distribution.
const QUANTILES: &[f64] = &[
    0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0,
];

#[derive(Debug, Serialize)]
struct Comparison {
    scenario: Scenario,
    /// The median round of each side.
    shardlock: Measurement,
    baseline: Measurement,
    /// shardlock's median ops/s divided by the baseline's.
    ratio: f64,
    /// Every round's ops/s, in the order run.
    shardlock_rounds: Vec<f64>,
    baseline_rounds: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    shard: String,
    round_secs: f64,
    rounds: u32,
    tasks: u32,
    hot_tasks: u32,
    comparisons: Vec<Comparison>,
}

pub(crate) async fn run(
    source: &ConfigSource,
    args: BenchArgs,
    as_json: bool,
) -> Result<(), AnyError> {
    if let Some(buckets) = args.worker_buckets {
        return bucket_worker(source, &args, buckets).await;
    }
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
    let pool = baseline_pool(&shard.url, shard.pool.max_size)?;
    prepare_baseline_tables(&pool).await?;
    let counters = Counters { pool: pool.clone() };
    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();

    let mut comparisons = Vec::new();
    let mut with_telemetry = None;
    for &scenario in &args.scenario {
        let telemetry_scenario =
            matches!(scenario, Scenario::Telemetry | Scenario::TelemetryHotKey);
        if telemetry_scenario && with_telemetry.is_none() {
            // Instruments bind to the provider in force when a router is built: `router`
            // keeps no-op ones, the new router gets live ones.
            let guard = shardlock::telemetry::init(&source.config.telemetry).await?;
            let on = LockRouter::new(router.config().as_ref().clone()).await?;
            with_telemetry = Some((guard, on));
        }
        let redis = match scenario {
            Scenario::HotKeyRedis => match redis_connection(&args.redis).await {
                Ok(conn) => Some(conn),
                Err(e) => {
                    eprintln!(
                        "skipping hot-key-redis: Redis at {} does not answer ({e})",
                        args.redis
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
        let (mut ours, mut base) = (Vec::new(), Vec::new());
        for round in 0..args.rounds {
            let tag = format!("{run_id}:{round}");
            match scenario {
                Scenario::Uncontended => {
                    ours.push(uncontended_shardlock(&router, &tag, &args, &counters).await?);
                    base.push(uncontended_raw(&pool, &tag, &args, &counters).await?);
                }
                Scenario::HotKey => {
                    ours.push(hot_key_shardlock(&router, &tag, &args, &counters).await?);
                    base.push(hot_key_naive(&pool, &tag, &args, &counters).await?);
                }
                Scenario::Buckets => {
                    ours.push(buckets_across_processes(source, 16, &tag, &args, &counters).await?);
                    base.push(buckets_across_processes(source, 1, &tag, &args, &counters).await?);
                }
                Scenario::Reload => {
                    let (during, steady) = throughput_across_reload(source, &tag, &args).await?;
                    ours.push(during);
                    base.push(steady);
                }
                Scenario::ShardDown => {
                    base.push(with_a_shard_down(source, false, &tag, &args, &counters).await?);
                    ours.push(with_a_shard_down(source, true, &tag, &args, &counters).await?);
                }
                Scenario::Telemetry => {
                    let (_, on) = with_telemetry.as_ref().expect("set up above");
                    let mut m =
                        uncontended_shardlock(on, &format!("{tag}:on"), &args, &counters).await?;
                    m.name = "distinct keys, metrics on".into();
                    ours.push(m);
                    let mut m =
                        uncontended_shardlock(&router, &format!("{tag}:off"), &args, &counters)
                            .await?;
                    m.name = "distinct keys, metrics off".into();
                    base.push(m);
                }
                Scenario::TelemetryHotKey => {
                    let (_, on) = with_telemetry.as_ref().expect("set up above");
                    let mut m = hot_key_shardlock(on, &tag, &args, &counters).await?;
                    m.name = "one hot key, metrics on".into();
                    ours.push(m);
                    let mut m = hot_key_shardlock(&router, &tag, &args, &counters).await?;
                    m.name = "one hot key, metrics off".into();
                    base.push(m);
                }
                Scenario::Cleaner => {
                    base.push(while_cleaning(source, false, &tag, &args, &counters).await?);
                    ours.push(while_cleaning(source, true, &tag, &args, &counters).await?);
                }
                Scenario::HotKeyRedis => {
                    let redis = redis.clone().expect("connected above");
                    ours.push(hot_key_shardlock(&router, &tag, &args, &counters).await?);
                    base.push(hot_key_redis(redis, &tag, &args, &counters).await?);
                }
            }
        }
        let rounds = |ms: &[Measurement]| ms.iter().map(|m| m.ops_per_sec).collect::<Vec<_>>();
        let (ours_rounds, base_rounds) = (rounds(&ours), rounds(&base));
        let (ours, base) = (median(ours), median(base));
        let ratio = ours.ops_per_sec / base.ops_per_sec.max(f64::MIN_POSITIVE);
        comparisons.push(Comparison {
            scenario,
            shardlock: ours,
            baseline: base,
            ratio,
            shardlock_rounds: ours_rounds,
            baseline_rounds: base_rounds,
        });
    }
    router.shutdown().await?;
    if let Some((_, on)) = &with_telemetry {
        on.shutdown().await?;
    }

    let report = Report {
        shard: shard.name.clone(),
        round_secs: args.duration.as_secs_f64(),
        rounds: args.rounds,
        tasks: args.tasks,
        hot_tasks: args.hot_tasks,
        comparisons,
    };
    std::fs::create_dir_all(&args.out)?;
    let json = serde_json::to_string_pretty(&report)?;
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let file = args.out.join(format!("bench-{stamp}.json"));
    std::fs::write(&file, &json)?;
    std::fs::write(args.out.join("latest.json"), &json)?;
    let picture = args.out.join(format!("bench-{stamp}.svg"));
    let plotted: Vec<crate::plot::Panel<'_>> = report
        .comparisons
        .iter()
        .map(|c| crate::plot::Panel {
            title: format!("{:?}", c.scenario),
            series: vec![
                (
                    c.shardlock.name.as_str(),
                    c.shardlock.latency_quantiles.as_slice(),
                ),
                (
                    c.baseline.name.as_str(),
                    c.baseline.latency_quantiles.as_slice(),
                ),
            ],
        })
        .collect();
    crate::plot::latency_svg(&plotted, &picture)?;
    std::fs::copy(&picture, args.out.join("latest.svg"))?;
    if as_json {
        println!("{json}");
    } else {
        print_report(&report);
        println!(
            "\nreport: {} (latency plot: {})",
            file.display(),
            picture.display()
        );
    }
    Ok(())
}

/// `args.tasks` tasks acquiring and releasing keys of every shard but the last, while 4 tasks
/// keep calling keys of the last one; with `down`, that shard's URL points at a closed port.
async fn with_a_shard_down(
    source: &ConfigSource,
    down: bool,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let mut config = bench_config(source, "shard-down");
    if config.shards.len() < 2 {
        return Err("the shard-down scenario needs at least 2 shards".into());
    }
    let victim = config.shards.last_mut().expect("at least 2 shards");
    let victim_name = victim.name.clone();
    if down {
        victim.url = "mysql://root@127.0.0.1:1/shardlock".into(); // nothing listens on port 1
    }
    let router = LockRouter::new(config).await?;
    if !down {
        router.migrate().await?;
    }
    let keys = |healthy: bool, n: usize| -> Result<Vec<String>, AnyError> {
        let mut keys = Vec::with_capacity(n);
        for i in 0.. {
            let key = format!("bench:down:{tag}:{i}");
            if (router.shard_for(&key)? != victim_name) == healthy {
                keys.push(key);
                if keys.len() == n {
                    break;
                }
            }
        }
        Ok(keys)
    };
    let (healthy, dead) = (
        Arc::new(keys(true, args.tasks as usize * 8)?),
        keys(false, 4)?,
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = dead
        .into_iter()
        .map(|key| {
            let (router, stop) = (router.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(Some(g)) = router.try_acquire(&key, AcquireOptions::new()).await {
                        drop(g.release().await);
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
        })
        .collect();
    let name = if down {
        "shardlock, healthy keys, one shard down"
    } else {
        "shardlock, healthy keys, all shards up"
    };
    let op_router = router.clone();
    let m = measure(name, args.duration, args.tasks, counters, move |task, i| {
        let router = op_router.clone();
        let key = healthy[task as usize * 8 + (i % 8) as usize].clone();
        async move {
            let guard = router
                .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(5)))
                .await?;
            guard.release().await?;
            Ok(())
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for c in callers {
        c.await?;
    }
    let _ = router.shutdown().await;
    m
}

/// `args.tasks` tasks acquiring and releasing distinct keys of the first shard; with
/// `cleaning`, the cleaner deletes released rows planted before the round, all through it.
async fn while_cleaning(
    source: &ConfigSource,
    cleaning: bool,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let mut config = bench_config(source, "cleaner");
    config.shards.truncate(1);
    config.cleaner.batch_size = 1000;
    config.cleaner.batch_pause = Duration::from_millis(10);
    config.cleaner.grace = Duration::from_secs(1);
    let url = config.shards[0].url.clone();
    let router = LockRouter::new(config).await?;
    let prefix = format!("bench:garbage:{tag}:");
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cleaner = if cleaning {
        let rows = (args.duration.as_secs_f64() * 400_000.0) as u64;
        plant_released_rows(&url, &prefix, rows).await?;
        let (router, stop) = (router.clone(), stop.clone());
        Some(tokio::spawn(async move {
            let mut deleted = 0;
            while !stop.load(Ordering::Relaxed) && deleted < rows {
                match router.clean_once().await {
                    Ok(report) => deleted += report.shards.iter().map(|s| s.released).sum::<u64>(),
                    Err(e) => {
                        eprintln!("bench cleaner: {e}");
                        break;
                    }
                }
            }
            (deleted, rows)
        }))
    } else {
        None
    };
    let name = if cleaning {
        "shardlock, while the cleaner deletes"
    } else {
        "shardlock, nothing to clean"
    };
    let op_router = router.clone();
    let tag = tag.to_owned();
    let m = measure(name, args.duration, args.tasks, counters, move |task, i| {
        let router = op_router.clone();
        let key = format!("bench:clean:{tag}:{task}:{}", i % 16);
        async move {
            router
                .acquire(&key, AcquireOptions::new())
                .await?
                .release()
                .await?;
            Ok(())
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    if let Some(cleaner) = cleaner {
        let through = !cleaner.is_finished();
        let (deleted, rows) = cleaner.await?;
        if !through {
            eprintln!(
                "the cleaner deleted its {rows} rows before the round ended: the round measured \
                 less than cleaning ({deleted} deleted)"
            );
        }
        // What the round left is not measured.
        let mut c = Conn::from_url(url.as_str()).await?;
        c.exec_drop(
            "DELETE FROM shardlock_lease WHERE lock_key LIKE CONCAT(?, '%')",
            (prefix.as_bytes(),),
        )
        .await?;
    }
    let _ = router.shutdown().await;
    m
}

/// Plants `rows` released rows under `prefix`, ended an hour ago, with fences far below the
/// shard's clock: rows the cleaner deletes. Portable SQL (no sequence engine).
async fn plant_released_rows(url: &str, prefix: &str, rows: u64) -> Result<(), AnyError> {
    let mut c = Conn::from_url(url).await?;
    let digits = "(SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
                  UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
                  UNION ALL SELECT 8 UNION ALL SELECT 9)";
    // In chunks of 100,000 rows: five digits per statement.
    for chunk in 0..rows.div_ceil(100_000) {
        let first = chunk * 100_000;
        c.exec_drop(
            format!(
                "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
                 SELECT CONCAT(?, LPAD(n, 8, '0')), NULL, n + 1, 1000, \
                 UTC_TIMESTAMP(3) - INTERVAL 1 HOUR, UTC_TIMESTAMP(3) - INTERVAL 1 HOUR \
                 FROM (SELECT ? + a.d + 10 * b.d + 100 * c.d + 1000 * e.d + 10000 * f.d AS n \
                       FROM {digits} a, {digits} b, {digits} c, {digits} e, {digits} f) s \
                 WHERE n < ?"
            ),
            (prefix.as_bytes(), first, rows),
        )
        .await?;
    }
    Ok(())
}

/// The config of one of the benchmark's routers: its own fleet (see `instance.fleet`), since
/// the benchmark runs routers of different topologies side by side on keys no one else uses.
fn bench_config(source: &ConfigSource, role: &str) -> shardlock::Config {
    let mut config = source.config.clone();
    config.instance.fleet = Some(format!(
        "shardlock-bench:{role}:{}:{}",
        std::process::id(),
        BENCH_ROUTERS.fetch_add(1, Ordering::Relaxed)
    ));
    config
}

/// Routers made by [`bench_config`] so far.
static BENCH_ROUTERS: AtomicU64 = AtomicU64::new(0);

/// The round with the median ops/s.
fn median(mut rounds: Vec<Measurement>) -> Measurement {
    rounds.sort_by(|a, b| a.ops_per_sec.total_cmp(&b.ops_per_sec));
    rounds.swap_remove(rounds.len() / 2)
}

async fn uncontended_shardlock(
    router: &LockRouter,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let (router, tag) = (router.clone(), tag.to_owned());
    measure(
        "shardlock acquire+release, distinct keys",
        args.duration,
        args.tasks,
        counters,
        move |task, i| {
            let (router, key) = (router.clone(), format!("bench:u:{tag}:{task}:{i}"));
            async move {
                let guard = router
                    .try_acquire(&key, AcquireOptions::new())
                    .await?
                    .ok_or("a distinct key was busy")?;
                guard.release().await?;
                Ok(())
            }
        },
    )
    .await
}

async fn uncontended_raw(
    pool: &Pool,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let (pool, tag) = (pool.clone(), tag.to_owned());
    measure("raw INSERT + owner-checked DELETE", args.duration, args.tasks, counters, move |task, i| {
        let (pool, key) = (pool.clone(), format!("bench:r:{tag}:{task}:{i}"));
        async move {
            let mut c = pool.get_conn().await?;
            c.exec_drop(
                "INSERT INTO bench_raw_lock (lock_key, owner, expires_at) VALUES (?, ?, NOW(3) + INTERVAL 10 SECOND)",
                (&key, "bench-owner"),
            )
            .await?;
            c.exec_drop("DELETE FROM bench_raw_lock WHERE lock_key = ? AND owner = ?", (&key, "bench-owner")).await?;
            Ok(())
        }
    })
    .await
}

async fn hot_key_shardlock(
    router: &LockRouter,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let (router, key) = (router.clone(), format!("bench:hot:{tag}"));
    measure(
        "shardlock, one hot key",
        args.duration,
        args.hot_tasks,
        counters,
        move |_, _| {
            let (router, key) = (router.clone(), key.clone());
            async move {
                let guard = router
                    .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(60)))
                    .await?;
                guard.release().await?;
                Ok(())
            }
        },
    )
    .await
}

/// The lock every team writes first: INSERT; on a duplicate, take over if expired; DELETE by
/// owner on release; exponential backoff with jitter between tries (shardlock's default
/// steps). Deadlocks and lock wait timeouts reach this code; it counts them and tries again.
async fn hot_key_naive(
    pool: &Pool,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let (pool, key) = (pool.clone(), format!("bench:naive:{tag}"));
    measure("naive hand-rolled lock, one hot key", args.duration, args.hot_tasks, counters, move |task, i| {
        let (pool, key, owner) = (pool.clone(), key.clone(), format!("{task}:{i}"));
        async move {
            let mut backoff = default_backoff();
            let mut c = pool.get_conn().await?;
            loop {
                let inserted = c
                    .exec_drop(
                        "INSERT INTO bench_naive_lock (lock_key, owner, expires_at) VALUES (?, ?, NOW(3) + INTERVAL 10 SECOND)",
                        (&key, &owner),
                    )
                    .await;
                let won = match inserted {
                    Ok(()) => true,
                    Err(MyError::Server(e)) if e.code == 1062 => {
                        c.exec_drop(
                            "UPDATE bench_naive_lock SET owner = ?, expires_at = NOW(3) + INTERVAL 10 SECOND \
                             WHERE lock_key = ? AND expires_at < NOW(3)",
                            (&owner, &key),
                        )
                        .await
                        .map_err(surface)?;
                        c.affected_rows() == 1
                    }
                    Err(e) => return Err(surface(e)),
                };
                if won {
                    break;
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
            c.exec_drop("DELETE FROM bench_naive_lock WHERE lock_key = ? AND owner = ?", (&key, &owner))
                .await
                .map_err(surface)?;
            Ok(())
        }
    })
    .await
}

/// The `buckets` scenario: `BUCKET_PROCESSES` child processes, each with `BUCKET_TASKS`
/// tasks taking random buckets of one key (in-memory hand-off off) and releasing at once.
async fn buckets_across_processes(
    source: &ConfigSource,
    buckets: u32,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let name = format!("{buckets} bucket(s), {BUCKET_PROCESSES} processes x {BUCKET_TASKS} tasks");
    let (statements_before, deadlocks_before) = counters.read().await?;
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..BUCKET_PROCESSES {
        let child = tokio::process::Command::new(std::env::current_exe()?)
            .args(source.child_args())
            .args([
                "bench",
                "--worker-buckets",
                &buckets.to_string(),
                "--worker-key",
                &format!("bench:b:{tag}"),
            ])
            .args(["--duration", &format!("{}ms", args.duration.as_millis())])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        children.push(child);
    }
    let mut latencies: Vec<u32> = Vec::new();
    let mut m = Measurement {
        name,
        ..Default::default()
    };
    for child in children {
        let out = child.wait_with_output().await?;
        if !out.status.success() {
            return Err(format!("a bucket worker failed ({})", out.status).into());
        }
        let report: WorkerReport = serde_json::from_slice(&out.stdout)?;
        latencies.extend(report.latencies_us);
        m.errors += report.errors;
    }
    let (statements_after, deadlocks_after) = counters.read().await?;
    m.innodb_deadlocks = deadlocks_after - deadlocks_before;
    summarize(
        &mut m,
        latencies,
        started.elapsed(),
        statements_after - statements_before,
    );
    eprintln!("{}: {:.0} grants/s", m.name, m.ops_per_sec);
    Ok(m)
}

/// The `reload` scenario: returns (the move window after the reload, the steady state before),
/// as grant rates; the worst 100 ms interval after the reload is reported in its name.
async fn throughput_across_reload(
    source: &ConfigSource,
    tag: &str,
    args: &BenchArgs,
) -> Result<(Measurement, Measurement), AnyError> {
    let mut config = bench_config(source, "reload");
    let run = args.duration * 3;
    config.routing.move_window = Some(run);
    let router = LockRouter::new(config.clone()).await?;
    router.migrate().await?;
    let mut moved = config.clone();
    moved.shards[0].weight *= 2;
    let started = Instant::now();
    let stop = started + run;
    let reload_at = started + run / 3;
    let grants = Arc::new(std::sync::Mutex::new(Vec::<Duration>::new()));
    let tasks: Vec<_> = (0..32u32)
        .map(|task| {
            let (router, grants, tag) = (router.clone(), grants.clone(), tag.to_owned());
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < stop {
                    let key = format!(
                        "bench:reload:{tag}:{}",
                        (u64::from(task) * 7919 + i * 104_729) % 500
                    );
                    if let Ok(g) = router.acquire(&key, AcquireOptions::new()).await {
                        drop(g.release().await);
                        grants.lock().unwrap().push(started.elapsed());
                    }
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep_until(reload_at.into()).await;
    router.reload(moved).await?;
    for t in tasks {
        t.await?;
    }
    let moved_grants = router.stats().moved_grants;
    router.shutdown().await?;
    let grants = grants.lock().unwrap().clone();
    let split = run / 3;
    let rate = |from: Duration, to: Duration| {
        grants.iter().filter(|g| **g >= from && **g < to).count() as f64 / (to - from).as_secs_f64()
    };
    // Skip the first 10% as warm-up; compare whole phases and the worst 100 ms after the reload.
    let steady = rate(run / 10, split);
    let during = rate(split, run);
    let worst = (0..((run - split).as_millis() / 100) as u32)
        .map(|i| {
            rate(
                split + Duration::from_millis(100) * i,
                split + Duration::from_millis(100) * (i + 1),
            )
        })
        .fold(f64::INFINITY, f64::min);
    let measurement = |name: String, ops_per_sec: f64, seconds: Duration| Measurement {
        name,
        ops: (ops_per_sec * seconds.as_secs_f64()) as u64,
        seconds: seconds.as_secs_f64(),
        ops_per_sec,
        ..Default::default()
    };
    let during = measurement(
        format!("after reload (worst 100 ms: {worst:.0}/s, {moved_grants} moved grants)"),
        during,
        run - split,
    );
    Ok((
        during,
        measurement("steady, before the reload".into(), steady, split - run / 10),
    ))
}

/// What a `buckets` worker prints.
#[derive(Debug, Serialize, serde::Deserialize)]
struct WorkerReport {
    latencies_us: Vec<u32>,
    errors: u64,
}

async fn bucket_worker(
    source: &ConfigSource,
    args: &BenchArgs,
    buckets: u32,
) -> Result<(), AnyError> {
    let mut config = source.config.clone();
    config.shards.truncate(1);
    // Both worker processes share keys: one fleet, theirs alone.
    config.instance.fleet = Some(format!("shardlock-bench:buckets:{buckets}"));
    let ns = shardlock::config::NamespaceConfig {
        buckets,
        handoff_max_count: 0,
        wait: Duration::from_secs(60),
        ..Default::default()
    };
    config.namespaces.insert("bench-buckets".into(), ns);
    let router = LockRouter::new(config).await?;
    let stop = Instant::now() + args.duration;
    let tasks: Vec<_> = (0..BUCKET_TASKS)
        .map(|task| {
            let (router, key) = (router.clone(), args.worker_key.clone());
            tokio::spawn(async move {
                let (mut latencies, mut errors) = (Vec::new(), 0u64);
                let mut i = 0u64;
                while Instant::now() < stop {
                    let t = Instant::now();
                    let hint = format!("{}:{task}:{i}", std::process::id());
                    let opts = AcquireOptions::new().namespace("bench-buckets");
                    match router.acquire_bucket(&key, &hint, opts).await {
                        Ok(g) => match g.release().await {
                            Ok(()) => latencies.push(t.elapsed().as_micros() as u32),
                            Err(_) => errors += 1,
                        },
                        Err(_) => errors += 1,
                    }
                    i += 1;
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut report = WorkerReport {
        latencies_us: Vec::new(),
        errors: 0,
    };
    for t in tasks {
        let (l, e) = t.await?;
        report.latencies_us.extend(l);
        report.errors += e;
    }
    router.shutdown().await?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The baselines back off like shardlock does by default.
fn default_backoff() -> Backoff {
    Backoff::new(
        shardlock::config::DEFAULT_BACKOFF_BASE,
        shardlock::config::DEFAULT_BACKOFF_CAP,
    )
}

async fn redis_connection(url: &str) -> Result<redis::aio::MultiplexedConnection, AnyError> {
    let client = redis::Client::open(url)?;
    let conn = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await??;
    Ok(conn)
}

/// The usual Redis lock: `SET key owner NX PX ttl`; on failure back off (shardlock's default
/// steps) and retry; release with a script that deletes the key only if it still holds our
/// owner. All tasks share one multiplexed connection, as a service would.
async fn hot_key_redis(
    conn: redis::aio::MultiplexedConnection,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let key = format!("shardlock-bench:hot:{tag}");
    let release = redis::Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end",
    );
    measure(
        "redis SET NX PX, one hot key",
        args.duration,
        args.hot_tasks,
        counters,
        move |task, i| {
            let (mut conn, key, release, owner) = (
                conn.clone(),
                key.clone(),
                release.clone(),
                format!("{task}:{i}"),
            );
            async move {
                let mut backoff = default_backoff();
                loop {
                    let set: Option<String> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&owner)
                        .arg("NX")
                        .arg("PX")
                        .arg(10_000)
                        .query_async(&mut conn)
                        .await?;
                    if set.is_some() {
                        break;
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                let _: i64 = release
                    .key(&key)
                    .arg(&owner)
                    .invoke_async(&mut conn)
                    .await?;
                Ok(())
            }
        },
    )
    .await
}

fn print_report(report: &Report) {
    println!(
        "\nshard {} · {} interleaved rounds of {:.0} s, median round shown",
        report.shard, report.rounds, report.round_secs
    );
    println!(
        "{:<40} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9}",
        "", "ops/s", "stmts/op", "p50 ms", "p99 ms", "dl errs", "InnoDB dl"
    );
    for c in &report.comparisons {
        for m in [&c.shardlock, &c.baseline] {
            println!(
                "{:<40} {:>9.0} {:>9.2} {:>8.2} {:>8.2} {:>8} {:>9}",
                m.name,
                m.ops_per_sec,
                m.statements_per_op,
                m.p50_ms,
                m.p99_ms,
                m.deadlock_errors_surfaced,
                m.innodb_deadlocks
            );
        }
        let target = match c.scenario {
            Scenario::ShardDown => Some("the all-up run (target p99 within 1.5x)"),
            Scenario::Cleaner => Some("the run with nothing to clean (target p99 within 2x)"),
            _ => None,
        };
        if let Some(target) = target {
            println!(
                "  -> {:?}: p50 {:.2}x, p99 {:.2}x {target}\n",
                c.scenario,
                c.shardlock.p50_ms / c.baseline.p50_ms.max(f64::MIN_POSITIVE),
                c.shardlock.p99_ms / c.baseline.p99_ms.max(f64::MIN_POSITIVE)
            );
            continue;
        }
        println!(
            "  -> {:?}: shardlock at {:.2}x the baseline\n",
            c.scenario, c.ratio
        );
    }
}

/// The baselines' pool: as many connections as the shard's shardlock pool, and (like
/// shardlock's pool) no session reset on every return, so prepared statements stay cached.
fn baseline_pool(url: &str, max: usize) -> Result<Pool, AnyError> {
    let constraints = PoolConstraints::new(1, max.max(1)).ok_or("pool size")?;
    let opts = OptsBuilder::from_opts(Opts::from_url(url)?)
        .pool_opts(
            PoolOpts::default()
                .with_constraints(constraints)
                .with_reset_connection(false),
        )
        .setup(vec!["SET time_zone = '+00:00'"]);
    Ok(Pool::new(opts))
}

async fn prepare_baseline_tables(pool: &Pool) -> Result<(), AnyError> {
    let mut c = pool.get_conn().await?;
    for table in ["bench_raw_lock", "bench_naive_lock"] {
        c.query_drop(format!("DROP TABLE IF EXISTS {table}"))
            .await?;
        c.query_drop(format!(
            "CREATE TABLE {table} (lock_key VARBINARY(255) PRIMARY KEY, \
             owner VARBINARY(191) NOT NULL, expires_at DATETIME(3) NOT NULL) ENGINE=InnoDB"
        ))
        .await?;
    }
    Ok(())
}

/// Marks deadlocks and lock wait timeouts so `measure` can count them.
fn surface(e: MyError) -> AnyError {
    match &e {
        MyError::Server(s) if s.code == 1213 || s.code == 1205 => Box::new(DeadlockSurfaced(e)),
        _ => e.into(),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("deadlock or lock wait timeout reached the caller: {0}")]
struct DeadlockSurfaced(MyError);

/// Server-side counters of the benchmark shard.
struct Counters {
    pool: Pool,
}

impl Counters {
    /// (row-writing statements, InnoDB deadlocks) so far.
    async fn read(&self) -> Result<(u64, u64), AnyError> {
        let mut c = self.pool.get_conn().await?;
        let row: Option<(u64, u64)> = c
            .query_first(
                "SELECT CAST(SUM(IF(VARIABLE_NAME IN ('COM_INSERT','COM_UPDATE','COM_DELETE'), VARIABLE_VALUE, 0)) AS UNSIGNED), \
                        CAST(SUM(IF(VARIABLE_NAME = 'INNODB_DEADLOCKS', VARIABLE_VALUE, 0)) AS UNSIGNED) \
                 FROM information_schema.GLOBAL_STATUS",
            )
            .await?;
        Ok(row.unwrap_or_default())
    }
}

/// Runs `op(task, i)` in `tasks` concurrent loops for `duration` and measures it.
async fn measure<F, Fut>(
    name: &str,
    duration: Duration,
    tasks: u32,
    counters: &Counters,
    op: F,
) -> Result<Measurement, AnyError>
where
    F: Fn(u32, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), AnyError>> + Send,
{
    let bar = ProgressBar::new(duration.as_millis() as u64).with_style(
        ProgressStyle::with_template("{prefix:<40} [{bar:30}] {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(name.to_owned());
    let (statements_before, deadlocks_before) = counters.read().await?;
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let stop = started + duration;
    let handles: Vec<_> = (0..tasks)
        .map(|task| {
            let (op, done) = (op.clone(), done.clone());
            tokio::spawn(async move {
                let (mut latencies, mut surfaced, mut errors) = (Vec::new(), 0u64, 0u64);
                let mut i = 0;
                while Instant::now() < stop {
                    let t = Instant::now();
                    match op(task, i).await {
                        Ok(()) => {
                            latencies.push(t.elapsed().as_micros() as u32);
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) if e.is::<DeadlockSurfaced>() => surfaced += 1,
                        Err(e) => {
                            errors += 1;
                            if errors == 1 {
                                eprintln!("bench error: {e}");
                            }
                        }
                    }
                    i += 1;
                }
                (latencies, surfaced, errors)
            })
        })
        .collect();
    while Instant::now() < stop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        bar.set_position(started.elapsed().as_millis() as u64);
        bar.set_message(format!("{} ops", done.load(Ordering::Relaxed)));
    }
    let mut latencies = Vec::new();
    let mut m = Measurement {
        name: name.to_owned(),
        ..Default::default()
    };
    for h in handles {
        let (l, surfaced, errors) = h.await?;
        latencies.extend(l);
        m.deadlock_errors_surfaced += surfaced;
        m.errors += errors;
    }
    let elapsed = started.elapsed();
    bar.finish_and_clear();
    let (statements_after, deadlocks_after) = counters.read().await?;
    m.innodb_deadlocks = deadlocks_after - deadlocks_before;
    summarize(
        &mut m,
        latencies,
        elapsed,
        statements_after - statements_before,
    );
    eprintln!("{name}: {:.0} ops/s", m.ops_per_sec);
    Ok(m)
}

/// Fills in rates, statements per op and latency percentiles.
fn summarize(m: &mut Measurement, mut latencies: Vec<u32>, elapsed: Duration, statements: u64) {
    latencies.sort_unstable();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0) as f64
            / 1000.0
    };
    m.ops = latencies.len() as u64;
    m.seconds = elapsed.as_secs_f64();
    m.ops_per_sec = m.ops as f64 / m.seconds;
    m.statements_per_op = statements as f64 / m.ops.max(1) as f64;
    m.p50_ms = pct(0.50);
    m.p99_ms = pct(0.99);
    m.max_ms = pct(1.0);
    if !latencies.is_empty() {
        m.latency_quantiles = QUANTILES.iter().map(|&q| (q, pct(q))).collect();
    }
}
