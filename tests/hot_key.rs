//! One hot key, 64 tasks hammering it for 10 s from eight router instances: no deadlock or
//! lock wait timeout reaches a caller, and the server reports how many deadlocks it saw.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{report, Worker};

const TASKS: usize = 64;
const INSTANCES: usize = 8;
const RUN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread")]
async fn sixty_four_tasks_on_one_key_see_no_deadlocks() {
    let (cluster, _router, yaml) = common::start(1, "").await;
    let mut routers = Vec::new();
    for _ in 0..INSTANCES {
        routers.push(LockRouter::from_yaml_str(&yaml).await.unwrap());
    }
    let deadlocks_before = cluster
        .shard(0)
        .global_status("Innodb_deadlocks")
        .await
        .unwrap();
    let grants = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicU64::new(0));
    let stop = tokio::time::Instant::now() + RUN;
    let tasks: Vec<_> = (0..TASKS)
        .map(|i| {
            let router = routers[i % INSTANCES].clone();
            let (grants, inside) = (grants.clone(), inside.clone());
            tokio::spawn(async move {
                let mut errors = Vec::new();
                while tokio::time::Instant::now() < stop {
                    match router
                        .acquire(
                            "sku:hot",
                            AcquireOptions::new().wait(Duration::from_secs(30)),
                        )
                        .await
                    {
                        Ok(g) => {
                            assert_eq!(
                                inside.fetch_add(1, Ordering::SeqCst),
                                0,
                                "two holders at once"
                            );
                            // Held across an await: another task (of this router or another)
                            // granted meanwhile would find `inside` at 1.
                            tokio::task::yield_now().await;
                            grants.fetch_add(1, Ordering::Relaxed);
                            inside.fetch_sub(1, Ordering::SeqCst);
                            g.release().await.unwrap();
                        }
                        Err(e) => errors.push(e.to_string()),
                    }
                }
                errors
            })
        })
        .collect();
    let mut errors = Vec::new();
    for t in tasks {
        errors.extend(t.await.unwrap());
    }
    let deadlocks = cluster
        .shard(0)
        .global_status("Innodb_deadlocks")
        .await
        .unwrap()
        - deadlocks_before;
    let grants = grants.load(Ordering::Relaxed);
    eprintln!("{grants} grants in {RUN:?}; InnoDB deadlocks counted by the server: {deadlocks}");
    assert!(
        errors.is_empty(),
        "callers saw errors: {:?}",
        &errors[..errors.len().min(5)]
    );
    assert!(
        grants > TASKS as u64,
        "every task got the key at least once: {grants}"
    );
    assert_eq!(deadlocks, 0, "the lease statements provoke no deadlocks");
}

const SHARED_RUN: Duration = Duration::from_secs(5);
/// When the hot-key workers start, in `common::history::now_ns`'s nanoseconds.
const START_ENV: &str = "SHARDLOCK_TEST_HOT_START_NS";

/// Two processes × 32 tasks on one key, in-memory hand-off on: neither process starves. A
/// process keeps the key in memory for at most `handoff-max-time` and then yields it through
/// the shard when the other one asked, so each gets a fair share of the grants (a process
/// that kept handing the key to its own waiters would get nearly all). The longest stretch
/// without a grant is reported, not asserted: it measures the machine as much as the lock
/// (`shardlock bench --scenario hot-key` measures it).
#[tokio::test(flavor = "multi_thread")]
async fn two_processes_on_one_key_both_make_progress() {
    let (_cluster, _router, yaml) = common::start(1, "").await;
    // Both run from one moment (the machine's monotonic clock is every process's): a process
    // that started later would count the other's head start against its share.
    let start = common::history::now_ns() + 5_000_000_000;
    let env = [(common::CONFIG_ENV, yaml), (START_ENV, start.to_string())];
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "hot", &env).unwrap())
        .collect();
    let mut grants = Vec::new();
    for w in workers {
        let f = w.finish_report("done ").await.unwrap();
        let (granted, max_gap_ms, statements) = (f[0], f[1], f[2]);
        eprintln!("process: {granted} grants, longest stretch without one {max_gap_ms} ms, {statements} acquire statements");
        // Waiting costs the shard at most one statement per backoff step (at least 1 ms).
        assert!(
            statements <= SHARED_RUN.as_millis() as u64,
            "{statements} statements in {SHARED_RUN:?}"
        );
        grants.push(granted);
    }
    let total: u64 = grants.iter().sum();
    assert!(total > 100, "the key changed hands: {grants:?}");
    assert!(
        grants.iter().all(|&g| g * 10 >= total),
        "a process got less than a tenth of the grants: {grants:?}"
    );
}

async fn hot_worker() {
    let router = common::worker_router().await;
    let start: u64 = std::env::var(START_ENV).unwrap().parse().unwrap();
    let until_start = start.saturating_sub(common::history::now_ns());
    tokio::time::sleep(Duration::from_nanos(until_start)).await;
    let started = tokio::time::Instant::now();
    let stop = started + SHARED_RUN;
    let grants = Arc::new(std::sync::Mutex::new(Vec::new()));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (router, grants) = (router.clone(), grants.clone());
            tokio::spawn(async move {
                while tokio::time::Instant::now() < stop {
                    let g = router
                        .acquire(
                            "sku:shared",
                            AcquireOptions::new().wait(Duration::from_secs(30)),
                        )
                        .await
                        .unwrap();
                    grants.lock().unwrap().push(started.elapsed());
                    g.release().await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let mut at = grants.lock().unwrap().clone();
    at.sort();
    // The longest stretch without a grant, from the first grant to the end of the run.
    let end = at.last().copied().unwrap_or_default().max(SHARED_RUN);
    let mut gaps: Vec<Duration> = at.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.push(end.saturating_sub(*at.last().unwrap()));
    let max_gap = gaps.into_iter().max().unwrap_or_default();
    report!(
        "done {} {} {}",
        at.len(),
        max_gap.as_millis(),
        router.stats().acquire_statements
    );
    router.shutdown().await.unwrap();
}

crate::worker_entry! { "hot" => hot_worker() }
