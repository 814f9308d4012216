//! One process holding many leases: what renewal costs at 1,000, 10,000 and 100,000 leases
//! over 3 shards — statements per shard per tick, a tick's duration, memory per held lease —
//! and whether any lease is lost while they are held for three ttls.
//!
//! Starts its own 3 throwaway MariaDB shards (as the tests do) and prints one row per count:
//!
//! ```sh
//! cargo run --release --example lease_scale            # 1k, 10k, 100k
//! cargo run --release --example lease_scale -- 5000    # other counts
//! ```

use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use shardlock::{AcquireOptions, LockRouter, LockStats};
use shardlock_testkit::Cluster;

/// The lease length: held for three of them, renewed every third of one.
const TTL: Duration = Duration::from_secs(3);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let counts: Vec<usize> = match std::env::args().skip(1).collect::<Vec<_>>() {
        args if args.is_empty() => vec![1_000, 10_000, 100_000],
        args => args
            .iter()
            .map(|a| a.parse())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("counts are whole numbers: {e}"))?,
    };
    let cluster = Cluster::start(3).await?;
    println!(
        "{:>8} {:>10} {:>12} {:>8} {:>16} {:>12} {:>6}",
        "leases", "acquire s", "bytes/lease", "ticks", "stmts/shard/tick", "tick ms", "lost"
    );
    for n in counts {
        let yaml = cluster.config_yaml(&format!(
            "namespaces:\n  default:\n    ttl: {}s\ncleaner:\n  registry: static\n",
            TTL.as_secs()
        ));
        let router = LockRouter::from_yaml_str(&yaml).await?;
        router.migrate().await?;
        let rss_before = rss_bytes();
        let started = Instant::now();
        let guards: Vec<_> = stream::iter(0..n)
            .map(|i| {
                let router = router.clone();
                async move {
                    router
                        .acquire(&format!("scale:{n}:{i}"), AcquireOptions::new())
                        .await
                }
            })
            .buffer_unordered(256)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        let acquired_in = started.elapsed();
        let per_lease = rss_bytes().saturating_sub(rss_before) / n as u64;
        let before = router.stats();
        tokio::time::sleep(TTL * 3).await;
        let after = router.stats();
        let held = guards.iter().filter(|g| g.is_held()).count();
        let ticks = after.renew_ticks - before.renew_ticks;
        println!(
            "{n:>8} {:>10.1} {per_lease:>12} {ticks:>8} {:>16.2} {:>12.1} {:>6}",
            acquired_in.as_secs_f64(),
            per_tick(&before, &after, |s| s.renew_statements),
            per_tick(&before, &after, |s| s.renew_micros) / 1000.0,
            n - held,
        );
        for g in guards {
            g.release().await?;
        }
        router.shutdown().await?;
    }
    Ok(())
}

/// The mean of a counter's growth per renewal tick between two snapshots.
fn per_tick(before: &LockStats, after: &LockStats, counter: fn(&LockStats) -> u64) -> f64 {
    let ticks = after.renew_ticks - before.renew_ticks;
    (counter(after) - counter(before)) as f64 / ticks.max(1) as f64
}

/// This process's resident memory.
fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}
