//! The `reload` scenario: grant rate before and during the move window a reload opens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use shardlock::{AcquireOptions, LockRouter};

use super::harness::{bench_config, Round};
use super::report::Measurement;
use crate::{AnyError, ConfigSource};

/// The `reload` scenario: returns (the move window after the reload, the steady state before),
/// as grant rates; the worst 100 ms interval after the reload is reported in its name.
pub(super) async fn throughput_across_reload(
    source: &ConfigSource,
    round: Round<'_>,
) -> Result<(Measurement, Measurement), AnyError> {
    let mut config = bench_config(source, "reload");
    let run = round.args.duration * 3;
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
            let (router, grants, tag) = (router.clone(), grants.clone(), round.tag.to_owned());
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
