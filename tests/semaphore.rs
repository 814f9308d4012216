//! Semaphores across processes on real shards: 3 processes × 32 tasks on a semaphore of 5
//! permits never have more than 5 holders at one instant, each slot has one holder at a time,
//! and every permit's fence rises per slot (a history of holds, checked afterwards).

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::history::{self, Recorder};
use shardlock::{AcquireOptions, Error};
use shardlock_testkit::Worker;

const NAME: &str = "sem:exports";
const PERMITS: u32 = 5;
const TASKS: usize = 32;
const ROUNDS: usize = 3;
const DIR_ENV: &str = "SHARDLOCK_TEST_HISTORY_DIR";

#[tokio::test(flavor = "multi_thread")]
async fn never_more_holders_than_permits() {
    let (_cluster, router, yaml) = common::start(3, "").await;
    let dir = tempfile::tempdir().unwrap();
    let env = [
        (common::CONFIG_ENV, yaml),
        (DIR_ENV, dir.path().display().to_string()),
    ];
    let workers: Vec<Worker> = (0..3)
        .map(|_| Worker::spawn("worker", "permits", &env).unwrap())
        .collect();
    for w in workers {
        assert_eq!(
            w.finish_report("done ").await.unwrap(),
            [(TASKS * ROUNDS) as u64]
        );
    }
    let holds = history::read(dir.path());
    assert_eq!(holds.len(), 3 * TASKS * ROUNDS);
    // One holder per slot at a time, fences rising per slot.
    history::check_no_two_holders(&holds);
    // At most PERMITS at any instant: ends sort before starts at the same instant.
    let mut events: Vec<(u64, i32)> = holds
        .iter()
        .flat_map(|h| [(h.start, 1), (h.end, -1)])
        .collect();
    events.sort_by_key(|&(t, delta)| (t, delta));
    let (mut now, mut most) = (0i32, 0i32);
    for (_, delta) in events {
        now += delta;
        most = most.max(now);
    }
    println!("at most {most} holders at once");
    assert!(
        most <= PERMITS as i32,
        "{most} holders of {PERMITS} permits"
    );

    // Bad permit counts are refused; all permits held means try_acquire answers None.
    for bad in [0, 1025] {
        assert!(matches!(
            router.semaphore(NAME, bad),
            Err(Error::InvalidArgument {
                name: "permits",
                ..
            })
        ));
    }
    let sem = router.semaphore("sem:small", 2).unwrap();
    let a = sem.acquire(AcquireOptions::new()).await.unwrap();
    let b = sem.acquire(AcquireOptions::new()).await.unwrap();
    assert_ne!(a.slot(), b.slot());
    assert!(sem
        .try_acquire(AcquireOptions::new())
        .await
        .unwrap()
        .is_none());
    let waited = sem
        .acquire(AcquireOptions::new().wait(Duration::from_millis(100)))
        .await
        .unwrap_err();
    assert!(matches!(waited, Error::Timeout { .. }), "{waited}");
    a.release().await.unwrap();
    let c = sem.acquire(AcquireOptions::new()).await.unwrap();
    assert!(c.fence() > 0);
    b.release().await.unwrap();
    c.release().await.unwrap();
}

/// Each task takes a permit ROUNDS times, holding it a few milliseconds; every hold is recorded
/// from the moment the permit came to the moment before its release (checked still held).
async fn permit_worker() {
    let router = common::worker_router().await;
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let recorder = std::sync::Arc::new(Recorder::create(&dir));
    let sem = router.semaphore(NAME, PERMITS).unwrap();
    let mut tasks = Vec::new();
    for _ in 0..TASKS {
        let (sem, recorder) = (sem.clone(), recorder.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let permit = sem
                    .acquire(AcquireOptions::new().wait(Duration::from_secs(120)))
                    .await
                    .unwrap();
                let start = history::now_ns();
                tokio::time::sleep(Duration::from_millis(3)).await;
                let end = history::now_ns();
                assert!(permit.guard().is_held(), "a permit lost mid-hold");
                recorder.hold(
                    &format!("sem/slot{}", permit.slot()),
                    true,
                    start,
                    end,
                    permit.fence(),
                );
                permit.release().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    shardlock_testkit::report!("done {}", TASKS * ROUNDS);
    router.shutdown().await.unwrap();
}

crate::worker_entry! { "permits" => permit_worker() }
