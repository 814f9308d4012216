//! The `cleaner` scenario: latency of a shard's locks while the cleaner deletes on it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Conn;
use shardlock::{AcquireOptions, LockRouter};

use super::harness::{bench_config, Round};
use super::report::Measurement;
use crate::{AnyError, ConfigSource};

/// `args.tasks` tasks acquiring and releasing distinct keys of the first shard; with
/// `cleaning`, the cleaner deletes released rows planted before the round, all through it.
pub(super) async fn while_cleaning(
    source: &ConfigSource,
    cleaning: bool,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let mut config = bench_config(source, "cleaner");
    config.shards.truncate(1);
    config.cleaner.batch_size = 1000;
    config.cleaner.batch_pause = Duration::from_millis(10);
    config.cleaner.grace = Duration::from_secs(1);
    let shard = shardlock::connect_opts(&config.shards[0], 0)?;
    let router = LockRouter::new(config).await?;
    let prefix = format!("bench:garbage:{}:", round.tag);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let cleaner = if cleaning {
        let rows = (round.args.duration.as_secs_f64() * 400_000.0) as u64;
        plant_released_rows(shard.clone(), &prefix, rows).await?;
        let (router, stop) = (router.clone(), stop.clone());
        Some(tokio::spawn(async move {
            let mut deleted = 0;
            while !stop.load(Ordering::Relaxed) && deleted < rows {
                match router.clean_once().await {
                    Ok(report) => deleted += report.shards.iter().map(|s| s.released).sum::<u64>(),
                    // The cleaner lock's shard busy for a moment (its breaker open): try again.
                    Err(e) if e.is_unavailable() => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => {
                        eprintln!("bench cleaner: {}", e.report());
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
    let tag = round.tag.to_owned();
    let m = round
        .measure_cycles(
            name,
            round.args.tasks,
            &router,
            AcquireOptions::new(),
            move |task, i| format!("bench:clean:{tag}:{task}:{}", i % 16),
        )
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
        let mut c = Conn::new(shard).await?;
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
async fn plant_released_rows(
    shard: shardlock::mysql_async::Opts,
    prefix: &str,
    rows: u64,
) -> Result<(), AnyError> {
    let mut c = Conn::new(shard).await?;
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
