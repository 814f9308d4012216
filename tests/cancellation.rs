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

/// An acquire made from a runtime that stops being driven once the caller gives up (a sync
/// bridge's `block_on` with a timeout, its runtime kept for later) leaves nothing behind
/// either: the statement it sent runs to its answer on the router's runtime, where the grant
/// is given back, and the shard's lane is free for the next caller. On the caller's runtime
/// the answer was never read: the key stayed held by nobody for its ttl, and with one batch
/// in flight every later acquire on the shard waited behind the stalled one.
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_abandoned_on_a_runtime_no_longer_driven_leaves_nothing_behind() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let proxy = shardlock_testkit::Proxy::start(cluster.shard(0).port())
        .await
        .unwrap();
    let router = shardlock::LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n    pool:\n      max-size: 4\n      \
         batches-in-flight: 1\ncleaner:\n  registry: static\n",
        proxy.url()
    ))
    .await
    .unwrap();
    let warm = router.acquire("warm", AcquireOptions::new()).await.unwrap();
    warm.release().await.unwrap();

    // The caller's runtime: driven only inside `block_on`, and kept until the test ends.
    proxy.set(shardlock_testkit::ProxyMode::PauseTo(b"abandoned-key"));
    let (give_up, given_up) = tokio::sync::oneshot::channel::<()>();
    let (end, ended) = std::sync::mpsc::channel::<()>();
    let caller = {
        let router = router.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let long = AcquireOptions::new().ttl(Duration::from_secs(600));
                tokio::select! {
                    _ = router.acquire("abandoned-key", long) => panic!("answered while paused"),
                    _ = given_up => {}
                }
            });
            // Not driven from here on, not dropped either.
            let _ = ended.recv();
            drop(runtime);
        })
    };
    // The acquire's statement is on its way; its caller gives up, then the shard answers.
    proxy.wait_for(shardlock_testkit::ProxyMode::Paused).await;
    give_up.send(()).unwrap();
    proxy.set(shardlock_testkit::ProxyMode::Pass);

    let next = router
        .acquire(
            "next-key",
            AcquireOptions::new().wait(Duration::from_secs(20)),
        )
        .await;
    assert!(
        next.is_ok(),
        "an acquire waited behind one abandoned on a runtime no longer driven: {next:?}"
    );
    next.unwrap().release().await.unwrap();
    // Given back long before its ten minutes. (A try answered slower than the breaker's
    // slow-call on a busy machine says the shard is unavailable: tried again.)
    let freed = common::eventually(Duration::from_secs(60), || async {
        (other.try_acquire("abandoned-key", AcquireOptions::new().wait(Duration::ZERO)))
            .await
            .is_ok_and(|granted| granted.is_some())
    })
    .await;
    assert!(freed, "the abandoned grant stayed held by nobody");
    end.send(()).unwrap();
    caller.join().unwrap();
}
