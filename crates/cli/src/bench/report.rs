//! What a bench run reports: each round's measurement, the median of each side and their
//! ratio, written as JSON, as an SVG latency plot and as a table.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use super::{BenchArgs, Scenario};
use crate::AnyError;

/// One measured round.
#[derive(Debug, Default, Clone, Serialize)]
pub(super) struct Measurement {
    pub(super) name: String,
    pub(super) ops: u64,
    pub(super) seconds: f64,
    pub(super) ops_per_sec: f64,
    /// Statements that wrote rows (INSERT/UPDATE/DELETE), counted by the server, per op.
    pub(super) statements_per_op: f64,
    /// Errors 1213/1205 that reached the caller's code.
    pub(super) deadlock_errors_surfaced: u64,
    /// `Innodb_deadlocks` increase on the shard during the round.
    pub(super) innodb_deadlocks: u64,
    /// Other errors.
    pub(super) errors: u64,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) max_ms: f64,
    /// The latency distribution: (quantile, ms) at fixed quantiles, for the plot.
    pub(super) latency_quantiles: Vec<(f64, f64)>,
    /// CPU time the shard's server spent per op, in µs, when it runs on this machine: what
    /// the lock costs the database, which a busy service shares, whatever the machine's noise
    /// does to ops/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) server_cpu_us_per_op: Option<f64>,
    /// CPU time this process spent per op, in µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) own_cpu_us_per_op: Option<f64>,
    /// Share of this machine's CPU time that its host took during the round (a virtual
    /// machine's `steal`), where `/proc/stat` tells it: rounds the host slowed by different
    /// amounts are not comparable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) host_steal: Option<f64>,
    /// shardlock's distinct-key rounds: how its dispatcher grouped the keys (its own stats).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(super) batching: Option<Batching>,
}

/// Keys per statement the router sent in a round: 1.0 is no batching at all.
#[derive(Debug, Default, Clone, Copy, Serialize)]
pub(super) struct Batching {
    /// Keys per acquire write (a batch of many, or a single acquire).
    pub(super) keys_per_acquire: f64,
    /// Keys per release statement.
    pub(super) keys_per_release: f64,
    /// Acquire statements (writes and read-backs) per key.
    pub(super) acquire_statements_per_key: f64,
    /// Share of the keys that went alone, as a single acquire (nothing else queued when a
    /// runner took it)...
    pub(super) alone_acquires: f64,
    /// ... and as a single release.
    pub(super) alone_releases: f64,
}

/// The shard's server-wide counters at one moment (the harness reads them before and after
/// each round): what a round added is its reading after minus before. Kept here, beside
/// [`summarize`] that turns two of them into a [`Measurement`], so that the report depends on
/// no part of the harness.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Reading {
    /// Row-writing statements (INSERT, INSERT ... SELECT, UPDATE, DELETE).
    pub(super) statements: u64,
    /// `Innodb_deadlocks`.
    pub(super) deadlocks: u64,
    /// CPU time the shard's server process has used, when it runs on this machine.
    pub(super) server_cpu: Option<Duration>,
    /// CPU time this process has used (the routers, the baselines' pools, the bench itself).
    pub(super) own_cpu: Option<Duration>,
    /// This machine's CPU time so far, where `/proc/stat` tells it.
    pub(super) machine_cpu: Option<MachineCpu>,
}

/// All CPUs' time since boot, in ticks, and the part of it the host took (`steal`): the first
/// line of `/proc/stat`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct MachineCpu {
    pub(super) total: u64,
    pub(super) steal: u64,
}

impl MachineCpu {
    /// Reads the `cpu` line of a `/proc/stat` text: user, nice, system, idle, iowait, irq,
    /// softirq and steal make up the total (guest time is counted in user already). `None`
    /// for a text without that line or with fewer than those eight fields (a kernel before
    /// 2.6.11 has no steal).
    pub(super) fn parse(stat: &str) -> Option<Self> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(str::parse)
            .collect::<Result<_, _>>()
            .ok()?;
        (fields.len() == 8).then(|| MachineCpu {
            total: fields.iter().sum(),
            steal: fields[7],
        })
    }
}

/// The quantiles kept of every latency distribution.
const QUANTILES: &[f64] = &[
    0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 0.995, 0.999, 1.0,
];

#[derive(Debug, Serialize)]
pub(super) struct Comparison {
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
pub(super) struct Report {
    shard: String,
    round_secs: f64,
    rounds: u32,
    tasks: u32,
    hot_tasks: u32,
    comparisons: Vec<Comparison>,
}

impl Comparison {
    /// Medians, so that one round disturbed by other load on the machine does not decide the
    /// ratio; every round's rate is kept beside them.
    pub(super) fn of(scenario: Scenario, ours: Vec<Measurement>, base: Vec<Measurement>) -> Self {
        let rounds = |ms: &[Measurement]| ms.iter().map(|m| m.ops_per_sec).collect::<Vec<_>>();
        let (ours_rounds, base_rounds) = (rounds(&ours), rounds(&base));
        let (ours, base) = (median(ours), median(base));
        let ratio = ours.ops_per_sec / base.ops_per_sec.max(f64::MIN_POSITIVE);
        Comparison {
            scenario,
            shardlock: ours,
            baseline: base,
            ratio,
            shardlock_rounds: ours_rounds,
            baseline_rounds: base_rounds,
        }
    }
}

/// The round with the median ops/s.
fn median(mut rounds: Vec<Measurement>) -> Measurement {
    rounds.sort_by(|a, b| a.ops_per_sec.total_cmp(&b.ops_per_sec));
    rounds.swap_remove(rounds.len() / 2)
}

impl Report {
    pub(super) fn new(shard: String, args: &BenchArgs, comparisons: Vec<Comparison>) -> Self {
        Report {
            shard,
            round_secs: args.duration.as_secs_f64(),
            rounds: args.rounds,
            tasks: args.tasks,
            hot_tasks: args.hot_tasks,
            comparisons,
        }
    }

    /// Writes `bench-<time>.json` and `bench-<time>.svg` to `out`, copies them to `latest.*`
    /// so that scripts find the last run without knowing its time, and prints the JSON or the
    /// table.
    pub(super) fn publish(&self, out: &Path, as_json: bool) -> Result<(), AnyError> {
        std::fs::create_dir_all(out)?;
        let json = serde_json::to_string_pretty(self)?;
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_secs();
        let file = out.join(format!("bench-{stamp}.json"));
        std::fs::write(&file, &json)?;
        std::fs::write(out.join("latest.json"), &json)?;
        let picture = out.join(format!("bench-{stamp}.svg"));
        let plotted: Vec<crate::plot::Panel<'_>> = self
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
        std::fs::copy(&picture, out.join("latest.svg"))?;
        if as_json {
            println!("{json}");
        } else {
            print_report(self);
            println!(
                "\nreport: {} (latency plot: {})",
                file.display(),
                picture.display()
            );
        }
        Ok(())
    }
}

fn print_report(report: &Report) {
    println!(
        "\nshard {} · {} interleaved rounds of {:.0} s, median round shown",
        report.shard, report.rounds, report.round_secs
    );
    println!(
        "{:<40} {:>9} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>9}",
        "",
        "ops/s",
        "stmts/op",
        "p50 ms",
        "p99 ms",
        "dl errs",
        "InnoDB dl",
        "db µs/op",
        "app µs/op"
    );
    let cpu = |us: Option<f64>| us.map_or_else(|| "-".to_owned(), |us| format!("{us:.0}"));
    for c in &report.comparisons {
        for m in [&c.shardlock, &c.baseline] {
            println!(
                "{:<40} {:>9.0} {:>9.2} {:>8.2} {:>8.2} {:>8} {:>9} {:>9} {:>9}",
                m.name,
                m.ops_per_sec,
                m.statements_per_op,
                m.p50_ms,
                m.p99_ms,
                m.deadlock_errors_surfaced,
                m.innodb_deadlocks,
                cpu(m.server_cpu_us_per_op),
                cpu(m.own_cpu_us_per_op)
            );
        }
        if let Some(b) = c.shardlock.batching {
            println!(
                "  shardlock sent {:.1} keys per acquire write ({:.2} acquire statements per key), {:.1} per release; \
                 {:.0}% of acquires and {:.0}% of releases went alone",
                b.keys_per_acquire,
                b.acquire_statements_per_key,
                b.keys_per_release,
                b.alone_acquires * 100.0,
                b.alone_releases * 100.0
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
        if let (Some(ours), Some(base)) = (
            c.shardlock.server_cpu_us_per_op,
            c.baseline.server_cpu_us_per_op,
        ) {
            println!(
                "  the shard's server spent {ours:.0} µs of CPU per op for shardlock, {base:.0} µs \
                 for the baseline ({:.2}x)",
                ours / base.max(f64::MIN_POSITIVE)
            );
        }
        // Only where the host took any: on bare metal, or a host with time to spare, it is 0.
        let steal = c.shardlock.host_steal.zip(c.baseline.host_steal);
        if let Some((ours, base)) = steal.filter(|&(ours, base)| ours + base > 0.0) {
            println!(
                "  the host took {:.0}% of this machine's CPU time in shardlock's median round, \
                 {:.0}% in the baseline's",
                ours * 100.0,
                base * 100.0
            );
        }
        println!(
            "  -> {:?}: shardlock at {:.2}x the baseline\n",
            c.scenario, c.ratio
        );
    }
}

/// Fills in rates, statements per op, InnoDB deadlocks and latency percentiles.
pub(super) fn summarize(
    m: &mut Measurement,
    mut latencies: Vec<u32>,
    elapsed: Duration,
    before: Reading,
    after: Reading,
) {
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
    m.statements_per_op = (after.statements - before.statements) as f64 / m.ops.max(1) as f64;
    m.innodb_deadlocks = after.deadlocks - before.deadlocks;
    let per_op = |before: Option<Duration>, after: Option<Duration>| {
        let spent = after?.checked_sub(before?)?;
        (m.ops > 0).then(|| spent.as_secs_f64() * 1e6 / m.ops as f64)
    };
    m.server_cpu_us_per_op = per_op(before.server_cpu, after.server_cpu);
    m.own_cpu_us_per_op = per_op(before.own_cpu, after.own_cpu);
    m.host_steal = before
        .machine_cpu
        .zip(after.machine_cpu)
        .and_then(|(b, a)| {
            let total = a.total.checked_sub(b.total).filter(|&t| t > 0)?;
            Some(a.steal.checked_sub(b.steal)? as f64 / total as f64)
        });
    m.p50_ms = pct(0.50);
    m.p99_ms = pct(0.99);
    m.max_ms = pct(1.0);
    if !latencies.is_empty() {
        m.latency_quantiles = QUANTILES.iter().map(|&q| (q, pct(q))).collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_machines_cpu_line_gives_its_total_and_the_hosts_steal() {
        let stat = "cpu  100 5 50 800 10 1 2 32 7 0\ncpu0 50 2 25 400 5 0 1 16 3 0\nintr 1 2\n";
        assert_eq!(
            MachineCpu::parse(stat),
            Some(MachineCpu {
                total: 1000,
                steal: 32
            })
        );
        // Without steal (an old kernel), or without the line, nothing is claimed.
        assert_eq!(MachineCpu::parse("cpu  100 5 50 800 10 1 2\n"), None);
        assert_eq!(MachineCpu::parse("cpu0 1 2 3 4 5 6 7 8\n"), None);
        assert_eq!(MachineCpu::parse("cpu  1 2 x 4 5 6 7 8\n"), None);
    }

    #[test]
    fn a_rounds_steal_is_the_hosts_share_of_the_time_between_its_readings() {
        let reading = |total, steal| Reading {
            machine_cpu: Some(MachineCpu { total, steal }),
            ..Default::default()
        };
        let mut m = Measurement::default();
        summarize(
            &mut m,
            vec![1_000; 10],
            Duration::from_secs(1),
            reading(10_000, 100),
            reading(10_400, 200),
        );
        assert_eq!(m.host_steal, Some(0.25));
        // No time passed, or no reading: no share.
        let mut m = Measurement::default();
        summarize(
            &mut m,
            vec![],
            Duration::from_secs(1),
            reading(5, 1),
            reading(5, 1),
        );
        assert_eq!(m.host_steal, None);
        summarize(
            &mut m,
            vec![],
            Duration::from_secs(1),
            Reading::default(),
            reading(5, 1),
        );
        assert_eq!(m.host_steal, None);
    }
}
