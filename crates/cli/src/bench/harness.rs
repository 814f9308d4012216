//! What every scenario runs on: the measured loop ([`Round::measure`]), the shard's counters,
//! the baselines' pool and tables, and the config of a bench router.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use shardlock::config::ShardConfig;
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Error as MyError, OptsBuilder, Pool, PoolConstraints, PoolOpts};
use shardlock::{AcquireOptions, Backoff, LockRouter};
use shardlock_testkit::ROW_WRITES;

use super::report::{summarize, MachineCpu, Measurement, Reading};
use super::BenchArgs;
use crate::{AnyError, ConfigSource};

/// The config of one of the benchmark's routers: its own fleet (see `instance.fleet`), since
/// the benchmark runs routers of different topologies side by side on keys no one else uses,
/// and its own instance id (a configured one is refused to a second router of this process).
pub(super) fn bench_config(source: &ConfigSource, role: &str) -> shardlock::Config {
    let mut config = source.config.clone();
    config.instance.id = None;
    config.instance.fleet = Some(format!(
        "shardlock-bench:{role}:{}:{}",
        std::process::id(),
        BENCH_ROUTERS.fetch_add(1, Ordering::Relaxed)
    ));
    config
}

/// Routers made by [`bench_config`] so far.
static BENCH_ROUTERS: AtomicU64 = AtomicU64::new(0);

/// The baselines back off like shardlock does by default.
pub(super) fn default_backoff() -> Backoff {
    Backoff::new(
        shardlock::config::DEFAULT_BACKOFF_BASE,
        shardlock::config::DEFAULT_BACKOFF_CAP,
    )
}

/// The baselines' pool: a connection for each of the uncontended scenario's `tasks` (the raw
/// cycle at 64 tasks is the raw cycle at 64 connections, as a team would run it), and never
/// fewer than the shard's shardlock pool; like shardlock's pool, no session reset on every
/// return, so prepared statements stay cached. Reaches the shard as shardlock does
/// (credentials beside the URL, TLS).
pub(super) fn baseline_pool(shard: &ShardConfig, tasks: u32) -> Result<Pool, AnyError> {
    let max = shard.pool.max_size.max(tasks as usize);
    let constraints = PoolConstraints::new(1, max.max(1)).ok_or("pool size")?;
    let opts = OptsBuilder::from_opts(shardlock::connect_opts(shard, 0)?)
        .pool_opts(
            PoolOpts::default()
                .with_constraints(constraints)
                .with_reset_connection(false),
        )
        .setup(vec!["SET time_zone = '+00:00'"]);
    Ok(Pool::new(opts))
}

pub(super) async fn prepare_baseline_tables(pool: &Pool) -> Result<(), AnyError> {
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

/// Marks deadlocks and lock wait timeouts so [`Round::measure`] can count them.
pub(super) fn surface(e: MyError) -> AnyError {
    match &e {
        MyError::Server(s) if s.code == 1213 || s.code == 1205 => Box::new(DeadlockSurfaced(e)),
        _ => e.into(),
    }
}

#[derive(Debug, thiserror::Error)]
#[error("deadlock or lock wait timeout reached the caller: {0}")]
struct DeadlockSurfaced(MyError);

/// Server-side counters of the benchmark shard.
pub(super) struct Counters {
    pool: Pool,
    /// The shard's server process, when it runs on this machine: its CPU time is read with
    /// every [`Reading`].
    server: Option<u32>,
}

impl Counters {
    /// The counters of the shard `pool` reaches, and its server process if it runs here.
    pub(super) async fn new(pool: Pool) -> Result<Self, AnyError> {
        let server = local_server(&pool).await?;
        Ok(Counters { pool, server })
    }

    /// Waits, up to 30 s, until the server has purged what earlier rounds deleted and
    /// changed (InnoDB's history list is short again), so that no round pays for the purge of
    /// the one before it: the raw baseline's deleted rows, the rows swept after a shardlock
    /// round. MariaDB reports the list's length as a status variable; where it does not,
    /// nothing is waited for.
    pub(super) async fn settle(&self) -> Result<(), AnyError> {
        let mut c = self.pool.get_conn().await?;
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let length: Option<u64> = c
                .query_first(
                    "SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS \
                     WHERE VARIABLE_NAME = 'INNODB_HISTORY_LIST_LENGTH'",
                )
                .await?;
            match length {
                Some(n) if n > 1_000 && Instant::now() < until => {
                    tokio::time::sleep(Duration::from_millis(20)).await
                }
                _ => return Ok(()),
            }
        }
    }

    /// The server's counts so far, as a [`Reading`].
    ///
    /// Server-wide, not per session: the routers' own background statements (renewals,
    /// heartbeats) and any other client of the server count too. `information_schema
    /// .GLOBAL_STATUS` and `Innodb_deadlocks` are MariaDB's (MySQL 8 moved the first to
    /// `performance_schema.global_status` and has no such status variable), as is the dev
    /// shard this bench runs on by default.
    pub(super) async fn read(&self) -> Result<Reading, AnyError> {
        let mut c = self.pool.get_conn().await?;
        let writes = vec!["?"; ROW_WRITES.len()].join(",");
        let row: Option<(u64, u64)> = c
            .exec_first(
                format!(
                    "SELECT CAST(SUM(IF(VARIABLE_NAME IN ({writes}), VARIABLE_VALUE, 0)) AS UNSIGNED), \
                            CAST(SUM(IF(VARIABLE_NAME = 'INNODB_DEADLOCKS', VARIABLE_VALUE, 0)) AS UNSIGNED) \
                     FROM information_schema.GLOBAL_STATUS"
                ),
                ROW_WRITES.to_vec(),
            )
            .await?;
        let (statements, deadlocks) = row.unwrap_or_default();
        Ok(Reading {
            statements,
            deadlocks,
            server_cpu: self
                .server
                .and_then(|pid| cpu_time(&format!("/proc/{pid}/stat"), false)),
            // With the bench workers this process ran and waited for (the overlap scenario's
            // two shardlock processes).
            own_cpu: cpu_time("/proc/self/stat", true),
            machine_cpu: std::fs::read_to_string("/proc/stat")
                .ok()
                .and_then(|stat| MachineCpu::parse(&stat)),
        })
    }
}

/// The pid of the shard's server when it runs on this machine: the process whose pid is in
/// the server's `pid_file` and whose working directory is the server's `datadir` (so that a
/// remote server's pid file, read here, never names a local process). `None` otherwise, or
/// where there is no `/proc`.
async fn local_server(pool: &Pool) -> Result<Option<u32>, AnyError> {
    let mut c = pool.get_conn().await?;
    let files: Option<(String, String)> = c.query_first("SELECT @@pid_file, @@datadir").await?;
    let Some((pid_file, datadir)) = files else {
        return Ok(None);
    };
    let pid = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|text| text.trim().parse::<u32>().ok());
    Ok(pid.filter(|pid| {
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd"));
        let datadir = std::fs::canonicalize(datadir.trim_end_matches('/'));
        matches!((cwd, datadir), (Ok(cwd), Ok(dir)) if cwd == dir)
    }))
}

/// User plus system CPU time of the process whose `/proc/<pid>/stat` is at `path`, and with
/// `children`, of the children it waited for.
fn cpu_time(path: &str, children: bool) -> Option<Duration> {
    let stat = std::fs::read_to_string(path).ok()?;
    // The fields after the command name, which is in parentheses and may hold spaces: the
    // 14th to 17th of the line (utime, stime, cutime, cstime) are the 12th to 15th of these.
    let fields = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    let mut ticks = 0;
    for field in fields.take(if children { 4 } else { 2 }) {
        ticks += field.parse::<u64>().ok()?;
    }
    // In USER_HZ, which is 100 on every Linux architecture this runs on.
    Some(Duration::from_millis(ticks * 10))
}

/// One round of a scenario: what every scenario's measurement takes.
#[derive(Clone, Copy)]
pub(super) struct Round<'a> {
    /// Part of every key the round takes, unique per run, scenario and round, so that no
    /// round meets rows another one left.
    pub(super) tag: &'a str,
    pub(super) args: &'a BenchArgs,
    pub(super) counters: &'a Counters,
}

impl Round<'_> {
    /// Runs `op(task, i)` in `tasks` concurrent loops for `--duration` and measures it.
    pub(super) async fn measure<F, Fut>(
        self,
        name: &str,
        tasks: u32,
        op: F,
    ) -> Result<Measurement, AnyError>
    where
        F: Fn(u32, u64) -> Fut + Clone + Send + 'static,
        Fut: std::future::Future<Output = Result<(), AnyError>> + Send,
    {
        let (duration, counters) = (self.args.duration, self.counters);
        let bar = ProgressBar::new(duration.as_millis() as u64).with_style(
            ProgressStyle::with_template("{prefix:<40} [{bar:30}] {msg}")
                .expect("valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(name.to_owned());
        counters.settle().await?;
        let before = counters.read().await?;
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
                                    eprintln!("bench error: {}", shardlock::Report(e.as_ref()));
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
        summarize(&mut m, latencies, elapsed, before, counters.read().await?);
        eprintln!("{name}: {:.0} ops/s", m.ops_per_sec);
        Ok(m)
    }

    /// [`Round::measure`] of lock cycles on `router`: the `i`th cycle of task `task` acquires
    /// `key(task, i)`, waiting as `opts` says, and releases it at once.
    pub(super) async fn measure_cycles<K>(
        self,
        name: &str,
        tasks: u32,
        router: &LockRouter,
        opts: AcquireOptions,
        key: K,
    ) -> Result<Measurement, AnyError>
    where
        K: Fn(u32, u64) -> String + Clone + Send + 'static,
    {
        let router = router.clone();
        self.measure(name, tasks, move |task, i| {
            let (router, key, opts) = (router.clone(), key(task, i), opts.clone());
            async move {
                router.acquire(&key, opts).await?.release().await?;
                Ok(())
            }
        })
        .await
    }
}
