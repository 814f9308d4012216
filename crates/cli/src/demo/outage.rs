//! Act 2: a shard killed mid-sale and restarted, with the stock buyers (`fail-fast`) and the
//! recommendation-cache refills (`local`) that keep running through it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, LockRouter};

use super::buyers::{sold_out, spawn_buyers, WorkerReport};
use super::summary::summarize;
use super::{sku_key, DemoArgs, NAMESPACE};
use crate::{dev, AnyError, ConfigSource};

/// The namespace of the demo's recommendation-cache refills (`local` policy).
const RECS: &str = "recommendations";

/// Act 2: more stock, buyers and cache refills in this process, and the shard holding the
/// most SKUs killed a second in and restarted two seconds later.
pub(super) async fn act(
    source: &ConfigSource,
    shards: &[(String, Pool)],
    args: &DemoArgs,
) -> Result<(), AnyError> {
    let router = source.router().await?;
    let restock = args.stock;
    for (_, pool) in shards {
        pool.get_conn()
            .await?
            .exec_drop(
                "UPDATE demo_stock SET initial = initial + ?, stock = stock + ?",
                (restock, restock),
            )
            .await?;
    }
    let victim = busiest_shard(&router, args.skus)?;
    let victim_index = source
        .config
        .shards
        .iter()
        .position(|s| s.name == victim)
        .ok_or("victim shard not configured")?;
    println!(
        "\nAct 2: {restock} more units per SKU; {} buyers and 8 cache refillers in this process; \
         shard {victim} is killed 0.3 s in and restarted 2 s later.",
        args.buyers
    );
    let started = Instant::now();
    let opts = AcquireOptions::new().namespace(NAMESPACE);
    // Buyers pause 5 ms between purchases so that the sale outlasts the outage.
    let buyers = spawn_buyers(&router, shards, &opts, args, Duration::from_millis(5));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let refills: Vec<_> = (0..8)
        .map(|r| {
            let (router, stop) = (router.clone(), stop.clone());
            tokio::spawn(async move { refill_task(&router, &stop, r).await })
        })
        .collect();
    let timeline = {
        let (router, stop, victim) = (router.clone(), stop.clone(), victim.clone());
        tokio::spawn(async move {
            let mut seen = vec![(Duration::ZERO, router.breaker_state(&victim))];
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let state = router.breaker_state(&victim);
                if seen.last().map(|(_, s)| *s) != Some(state) {
                    seen.push((started.elapsed(), state));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            seen
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    dev::cluster().kill(victim_index)?;
    let killed_at = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    dev::cluster().up().await?;
    let restarted_at = started.elapsed();
    let mut reports = sold_out(buyers).await?;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut refilled = RefillReport::default();
    for r in refills {
        let r = r.await?;
        refilled.remote += r.remote;
        refilled.local += r.local;
    }
    let timeline = timeline.await?;
    let elapsed = started.elapsed();
    let stats = router.stats();
    if let Some(first) = reports.first_mut() {
        first.record(&stats);
    }
    summarize(&router, shards, args, &reports, elapsed).await?;
    let totals = WorkerReport::total(&reports);
    let (unavailable, failed) = (totals.unavailable, totals.failed_purchases);
    let slowest = totals.unavailable_us_max;
    println!(
        "Fault:  {victim} killed at {:.1} s, restarted at {:.1} s. Its breaker here: {}",
        killed_at.as_secs_f64(),
        restarted_at.as_secs_f64(),
        timeline
            .iter()
            .map(|(at, state)| format!(
                "{} at {:.2} s",
                state.map_or("-", shardlock::BreakerState::name),
                at.as_secs_f64()
            ))
            .collect::<Vec<_>>()
            .join(" -> ")
    );
    println!(
        "stock ({NAMESPACE}, fail-fast): {unavailable} acquires answered Unavailable (slowest \
         {:.1} ms) and were retried later; {failed} purchases in flight when the shard died were \
         rolled back; nothing oversold (above).",
        slowest as f64 / 1000.0
    );
    println!(
        "{RECS} (local): {} refills under shard leases, {} under in-process locks while \
         {victim} was down; {} re-acquired on the shard, {} conflicts.",
        refilled.remote, refilled.local, stats.reconciled, stats.reconcile_conflicts
    );
    router.shutdown().await?;
    Ok(())
}

/// The shard that holds the most SKUs.
fn busiest_shard(router: &LockRouter, skus: u32) -> Result<String, AnyError> {
    let mut count: HashMap<String, u32> = HashMap::new();
    for i in 0..skus {
        *count.entry(router.shard_for(&sku_key(i))?).or_default() += 1;
    }
    Ok(count
        .into_iter()
        .max_by_key(|(name, n)| (*n, std::cmp::Reverse(name.clone())))
        .map(|(name, _)| name)
        .ok_or("no SKUs")?)
}

#[derive(Debug, Default)]
struct RefillReport {
    remote: u64,
    local: u64,
}

/// Refills recommendation caches (`recs:<n>`) under the `local`-policy lock until stopped.
async fn refill_task(
    router: &LockRouter,
    stop: &std::sync::atomic::AtomicBool,
    r: u32,
) -> RefillReport {
    let mut report = RefillReport::default();
    let opts = AcquireOptions::new().namespace(RECS);
    let mut i = r;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        i = i.wrapping_add(7);
        match router
            .acquire(&format!("recs:{}", i % 32), opts.clone())
            .await
        {
            Ok(guard) => {
                if guard.mode() == shardlock::LockMode::LocalFallback {
                    report.local += 1;
                } else {
                    report.remote += 1;
                }
                tokio::time::sleep(Duration::from_millis(2)).await; // the refill
                let _ = guard.release().await;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    report
}
