//! The `buckets` scenario: one key split into buckets, taken by child processes of this
//! command (`--worker-buckets`), so that the grants cross processes as in production.

use std::time::{Duration, Instant};

use serde::Serialize;
use shardlock::{AcquireOptions, LockRouter};

use super::harness::Round;
use super::report::{summarize, Measurement};
use super::BenchArgs;
use crate::{AnyError, ConfigSource};

/// Processes and tasks per process of the `buckets` scenario.
const BUCKET_PROCESSES: usize = 2;
const BUCKET_TASKS: u32 = 32;

/// The `buckets` scenario: `BUCKET_PROCESSES` child processes, each with `BUCKET_TASKS`
/// tasks taking random buckets of one key (in-memory hand-off off) and releasing at once.
pub(super) async fn across_processes(
    source: &ConfigSource,
    buckets: u32,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let name = format!("{buckets} bucket(s), {BUCKET_PROCESSES} processes x {BUCKET_TASKS} tasks");
    let before = round.counters.read().await?;
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
                &format!("bench:b:{}", round.tag),
            ])
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
            return Err(format!("a bucket worker failed ({})", out.status).into());
        }
        let report: WorkerReport = serde_json::from_slice(&out.stdout)?;
        latencies.extend(report.latencies_us);
        m.errors += report.errors;
    }
    let after = round.counters.read().await?;
    summarize(&mut m, latencies, started.elapsed(), before, after);
    eprintln!("{}: {:.0} grants/s", m.name, m.ops_per_sec);
    Ok(m)
}

/// What a `buckets` worker prints.
#[derive(Debug, Serialize, serde::Deserialize)]
struct WorkerReport {
    latencies_us: Vec<u32>,
    errors: u64,
}

pub(super) async fn worker(
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
