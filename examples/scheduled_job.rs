//! A scheduled job run at most once per interval across the fleet (ShedLock's use): every
//! instance ticks, `run_exclusive` lets one of them run each interval of the shard's clock.
//! Two instances (two routers here, two processes in production) tick four times a second on a
//! one-second schedule for three seconds; each interval runs once. Then a hold with
//! `lock_at_least`, and one without keep-alive that only lasts as long as it is extended.
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example scheduled_job
//! ```

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let first = LockRouter::from_yaml_file(&config).await?;
    first.migrate().await?;
    let second = LockRouter::from_yaml_file(&config).await?;

    let every = Duration::from_secs(1);
    let runs: Arc<Mutex<BTreeMap<u64, &str>>> = Arc::default();
    let instance = |router: LockRouter, name: &'static str| {
        let runs = runs.clone();
        async move {
            let mut tick = tokio::time::interval(every / 4);
            for _ in 0..12 {
                tick.tick().await;
                router
                    .run_exclusive("job:nightly-report", every, AcquireOptions::new(), |run| {
                        let runs = runs.clone();
                        async move {
                            let again = runs.lock().unwrap().insert(run.interval(), name);
                            assert!(again.is_none(), "interval {} ran twice", run.interval());
                        }
                    })
                    .await?;
            }
            router.shutdown().await
        }
    };
    let (a, b) = tokio::join!(instance(first, "first"), instance(second, "second"));
    a?;
    b?;
    for (interval, by) in runs.lock().unwrap().iter() {
        println!("interval {interval}: run by the {by} instance");
    }

    let router = LockRouter::from_yaml_file(&config).await?;
    // Released at once, but nobody gets the key for two seconds after the grant.
    let guard = router
        .acquire(
            "job:invoice-batch",
            AcquireOptions::new().lock_at_least(Duration::from_secs(2)),
        )
        .await?;
    guard.release().await?;
    let again = router
        .try_acquire("job:invoice-batch", AcquireOptions::new())
        .await?;
    println!("taken again right after: {}", again.is_some());

    // No keep-alive: the lease ends at its ttl unless the holder extends it.
    let guard = router
        .acquire(
            "job:export",
            AcquireOptions::new().lock_at_most(Duration::from_secs(5)),
        )
        .await?;
    guard.extend(Duration::from_secs(10)).await?;
    println!(
        "export lease ends in {:?}",
        guard.held_until() - tokio::time::Instant::now()
    );
    guard.release().await?;
    router.shutdown().await?;
    Ok(())
}
