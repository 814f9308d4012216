//! Acquire futures aborted at random points leave no lease and no connection behind.

mod common;

use std::time::Duration;

use futures_util::future::join_all;
use rand::Rng;
use shardlock::AcquireOptions;

const KEYS: usize = 8;
const TASKS: usize = 16;
const ROUNDS: usize = 40;

#[tokio::test(flavor = "multi_thread")]
async fn aborted_acquires_leak_nothing() {
    let (cluster, router, _) = common::start(1, "").await;
    let runs = (0..TASKS * ROUNDS).map(|i| {
        let router = router.clone();
        async move {
            // Sixteen concurrent callers, each making forty attempts one after another.
            tokio::time::sleep(Duration::from_millis(5 * (i / TASKS) as u64)).await;
            let key = format!("k{}", i % KEYS);
            // Abort somewhere between "before the statement is sent" and "after it answered".
            let cut = Duration::from_micros(rand::rng().random_range(0..6000));
            // A long lease, so that expiry cannot hide a leak within this test.
            let opts = AcquireOptions::new()
                .wait(Duration::from_millis(50))
                .ttl(Duration::from_secs(120));
            match tokio::time::timeout(cut, router.acquire(&key, opts)).await {
                Ok(Ok(guard)) => {
                    // Sometimes also cut the release short, or just drop the guard.
                    match rand::rng().random_range(0..3) {
                        0 => drop(guard),
                        1 => drop(
                            tokio::time::timeout(Duration::from_micros(200), guard.release()).await,
                        ),
                        _ => guard.release().await.unwrap(),
                    }
                    1
                }
                _ => 0,
            }
        }
    });
    let granted: usize = join_all(runs).await.into_iter().sum();
    eprintln!(
        "{granted} of {} acquires completed before being cut",
        TASKS * ROUNDS
    );
    // Both ends of the cut happened (a machine too slow for any acquire to finish within
    // 6 ms, or fast enough that none was cut, would test nothing).
    assert!(
        granted > 0 && granted < TASKS * ROUNDS && router.stats().acquire_statements > 0,
        "{granted} of {} acquires completed: {:?}",
        TASKS * ROUNDS,
        router.stats()
    );

    // Background releases (of cut attempts and dropped guards) finish on their own.
    let settled = common::eventually(Duration::from_secs(5), || async {
        common::live_leases(&cluster).await == 0
    })
    .await;
    assert!(
        settled,
        "{} leases leaked",
        common::live_leases(&cluster).await
    );
    // Every connection comes back to the pool (the heartbeat borrows one now and then).
    let returned = common::eventually(Duration::from_secs(5), || async {
        let pool = router.status().await.remove(0).pool;
        pool.waiting == 0 && pool.size == pool.available
    })
    .await;
    let pool = router.status().await.remove(0).pool;
    assert!(returned, "every connection is back in the pool: {pool:?}");
    // And every key is free for a fresh caller in this process (no stuck in-memory turn).
    for i in 0..KEYS {
        let g = router
            .try_acquire(&format!("k{i}"), AcquireOptions::new())
            .await
            .unwrap();
        g.expect("free").release().await.unwrap();
    }
}

/// Waiters that give up at random moments while the lock is handed over in memory: a hand-off
/// to a waiter that left a moment ago must pass on, never wedge the key.
#[tokio::test(flavor = "multi_thread")]
async fn waiters_giving_up_during_in_memory_hand_offs_never_wedge_the_key() {
    let (cluster, router, _) = common::start(1, "").await;
    let run = (0..64).map(|_| {
        let router = router.clone();
        async move {
            let mut granted = 0;
            for _ in 0..300 {
                let wait = Duration::from_micros(rand::rng().random_range(0..400));
                if let Ok(g) = router
                    .acquire("hot", AcquireOptions::new().wait(wait))
                    .await
                {
                    granted += 1;
                    tokio::task::yield_now().await;
                    drop(g);
                }
            }
            granted
        }
    });
    let outcome = tokio::time::timeout(Duration::from_secs(60), join_all(run)).await;
    let granted: usize = outcome.expect("the key never wedges").into_iter().sum();
    eprintln!(
        "{granted} grants, {} in memory",
        router.stats().local_handoffs
    );
    let g = router
        .acquire("hot", AcquireOptions::new().wait(Duration::from_secs(5)))
        .await
        .unwrap();
    g.release().await.unwrap();
    let settled = common::eventually(Duration::from_secs(5), || async {
        common::live_leases(&cluster).await == 0
    })
    .await;
    assert!(settled, "no lease left behind");
}
