//! The scenarios run by child processes of this command (`--worker-buckets`,
//! `--worker-overlap`), so that grants cross processes as in production: `buckets` (one key
//! split into buckets) and `overlap` (many tasks of two processes on a shared set of keys).

use std::time::{Duration, Instant};

use rand::Rng;
use serde::Serialize;
use shardlock::{AcquireOptions, Error, LockRouter};

use super::harness::Round;
use super::report::{summarize, Measurement};
use super::BenchArgs;
use crate::{AnyError, ConfigSource};

/// Processes of the scenarios run here.
const PROCESSES: usize = 2;
/// Tasks per process of the `buckets` scenario.
const BUCKET_TASKS: u32 = 32;
/// Tasks per process of the `overlap` scenario.
pub(super) const OVERLAP_TASKS: u32 = 64;
/// Keys the `overlap` scenario's tasks share.
pub(super) const OVERLAP_KEYS: u32 = 1_000;

/// What a worker process does.
#[derive(Debug, Clone, Copy)]
pub(super) enum Work {
    /// `BUCKET_TASKS` tasks take random buckets of one key (of this many buckets).
    Buckets(u32),
    /// `OVERLAP_TASKS` tasks take random keys of this many.
    Overlap(u32),
}

impl Work {
    fn args(self) -> [String; 2] {
        match self {
            Work::Buckets(n) => ["--worker-buckets".into(), n.to_string()],
            Work::Overlap(n) => ["--worker-overlap".into(), n.to_string()],
        }
    }

    fn name(self) -> String {
        match self {
            Work::Buckets(n) => {
                format!("{n} bucket(s), {PROCESSES} processes x {BUCKET_TASKS} tasks")
            }
            Work::Overlap(n) => {
                format!("shardlock, {n} keys, {PROCESSES} processes x {OVERLAP_TASKS} tasks")
            }
        }
    }
}

/// Runs `work` in `PROCESSES` child processes for the round's duration, on keys of this
/// round, and measures their lock cycles (acquire, then release at once; in-memory hand-off
/// off, so the shard serves every grant).
pub(super) async fn across_processes(
    source: &ConfigSource,
    work: Work,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let name = work.name();
    let before = round.counters.read().await?;
    let started = Instant::now();
    let mut children = Vec::new();
    for _ in 0..PROCESSES {
        let child = tokio::process::Command::new(std::env::current_exe()?)
            .args(source.child_args())
            .arg("bench")
            .args(work.args())
            .args(["--worker-key", &format!("bench:w:{}", round.tag)])
            .args([
                "--duration",
                &format!("{}ms", round.args.duration.as_millis()),
            ])
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
            return Err(format!("a bench worker failed ({})", out.status).into());
        }
        let report: WorkerReport = serde_json::from_slice(&out.stdout)?;
        latencies.extend(report.latencies_us);
        m.errors += report.errors;
        m.deadlock_errors_surfaced += report.deadlocks_surfaced;
    }
    let after = round.counters.read().await?;
    summarize(&mut m, latencies, started.elapsed(), before, after);
    eprintln!("{}: {:.0} grants/s", m.name, m.ops_per_sec);
    Ok(m)
}

/// What a worker prints.
#[derive(Debug, Serialize, serde::Deserialize)]
struct WorkerReport {
    latencies_us: Vec<u32>,
    errors: u64,
    /// Errors carrying a deadlock (1213) or lock wait timeout (1205): shardlock retries
    /// those itself, so any here is a defect.
    deadlocks_surfaced: u64,
}

pub(super) async fn worker(
    source: &ConfigSource,
    args: &BenchArgs,
    work: Work,
) -> Result<(), AnyError> {
    let mut config = source.config.clone();
    config.shards.truncate(1);
    // The worker processes share keys: one fleet, theirs alone.
    config.instance.fleet = Some(format!("shardlock-bench:{}", args.worker_key));
    let mut ns = shardlock::config::NamespaceConfig::default();
    ns.buckets = match work {
        Work::Buckets(n) => n,
        Work::Overlap(_) => 1,
    };
    ns.handoff_max_count = 0;
    ns.wait = Duration::from_secs(60);
    config.namespaces.insert("bench-workers".into(), ns);
    let router = LockRouter::new(config).await?;
    let stop = Instant::now() + args.duration;
    let tasks = match work {
        Work::Buckets(_) => BUCKET_TASKS,
        Work::Overlap(_) => OVERLAP_TASKS,
    };
    let tasks: Vec<_> = (0..tasks)
        .map(|task| {
            let (router, key) = (router.clone(), args.worker_key.clone());
            tokio::spawn(async move {
                let mut report = WorkerReport {
                    latencies_us: Vec::new(),
                    errors: 0,
                    deadlocks_surfaced: 0,
                };
                let mut i = 0u64;
                while Instant::now() < stop {
                    let t = Instant::now();
                    let opts = AcquireOptions::new().namespace("bench-workers");
                    let guard = match work {
                        Work::Buckets(_) => {
                            let hint = format!("{}:{task}:{i}", std::process::id());
                            router.acquire_bucket(&key, &hint, opts).await
                        }
                        Work::Overlap(keys) => {
                            let n = rand::rng().random_range(0..keys);
                            router.acquire(&format!("{key}:{n}"), opts).await
                        }
                    };
                    match guard.map(|g| g.release()) {
                        Ok(release) => match release.await {
                            Ok(()) => report.latencies_us.push(t.elapsed().as_micros() as u32),
                            Err(e) => report.count(&e),
                        },
                        Err(e) => report.count(&e),
                    }
                    i += 1;
                }
                report
            })
        })
        .collect();
    let mut report = WorkerReport {
        latencies_us: Vec::new(),
        errors: 0,
        deadlocks_surfaced: 0,
    };
    for t in tasks {
        let r = t.await?;
        report.latencies_us.extend(r.latencies_us);
        report.errors += r.errors;
        report.deadlocks_surfaced += r.deadlocks_surfaced;
    }
    router.shutdown().await?;
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

impl WorkerReport {
    fn count(&mut self, e: &Error) {
        let code = match e {
            Error::Backend { source, .. } | Error::Unavailable { source, .. } => source.code,
            _ => None,
        };
        if matches!(code, Some(1213 | 1205)) {
            self.deadlocks_surfaced += 1;
        } else {
            self.errors += 1;
        }
    }
}
