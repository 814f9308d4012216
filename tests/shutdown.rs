//! Shutdown gives every lease back, and no guard still says it holds a key once another
//! process can have it.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Competitor, Proxy, ProxyMode};

#[tokio::test(flavor = "multi_thread")]
async fn a_guard_is_lost_before_its_key_is_free_for_others_at_shutdown() {
    let (cluster, other, _) = common::start(1, "").await;
    // The shutting-down router reaches the shard through a proxy whose replies come late. A
    // connection the release opens there takes several delayed round trips (handshake,
    // settings): its pool waits for it longer than by default, or on a busy machine the
    // release fails for want of a connection before it is sent, which is not what this tests.
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    pool: {{ wait-timeout: 10s, create-timeout: 10s }}\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let guard = router.acquire("k", AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::Delay(Duration::from_millis(300)));

    let watcher = tokio::spawn(async move {
        guard.lost().await;
        (tokio::time::Instant::now(), guard.is_held())
    });
    let poller = tokio::spawn(async move { common::first_grant(&other, "k").await });
    router.shutdown().await.unwrap();
    let (lost_at, still_held) = watcher.await.unwrap();
    let granted_at = poller.await.unwrap();
    assert!(!still_held);
    assert_eq!(
        router.stats().lost,
        0,
        "a lease ended by its router's shutdown was counted lost (every deploy would read as \
         leases lost)"
    );
    assert!(
        lost_at <= granted_at,
        "another process held the key {:?} before this guard knew it had lost it",
        lost_at - granted_at
    );
}

/// A guard dropped on another runtime than its router's, one that never runs again (a
/// `block_on` that returned at once, then dropped): its release still runs, on the router's
/// runtime. Spawned on the runtime that dropped it, it would never run while the router's
/// keeper renewed the lease, keeping the key from everyone for as long as the router lives.
#[tokio::test(flavor = "multi_thread")]
async fn a_guard_dropped_on_a_runtime_that_ends_is_released() {
    let (cluster, router, _) = common::start(1, "").await;
    let other = common::worker_router_from(&cluster).await;
    let ttl = AcquireOptions::new().ttl(Duration::from_secs(2));
    // The pool's connections are opened here, on the router's runtime, where its keeper
    // renews: one opened on the other runtime would die with it, and the lease with it.
    router
        .acquire("warm", ttl.clone())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let dropping = router.clone();
    std::thread::spawn(move || {
        let router = dropping;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let guard = router.acquire("k", ttl).await.unwrap();
            drop(guard);
        });
    })
    .join()
    .unwrap();
    let freed = common::eventually(Duration::from_secs(30), || async {
        let once = AcquireOptions::new().wait(Duration::ZERO);
        other.try_acquire("k", once).await.unwrap().is_some()
    })
    .await;
    assert!(
        freed,
        "the key of a guard dropped on a runtime that ended stayed taken"
    );
}

/// A current-thread runtime, one shard, a router reaching it directly and one through a
/// proxy (one batch in flight per lane; `extra`, YAML lines, in its shard's entry; no
/// registry, whose heartbeats through a link the test slows would lapse on a busy machine).
fn behind_a_proxy(
    extra: &str,
) -> (
    tokio::runtime::Runtime,
    shardlock_testkit::Cluster,
    LockRouter,
    Proxy,
    LockRouter,
) {
    let main = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (cluster, direct, _) = main.block_on(common::start(1, ""));
    let proxy = main
        .block_on(Proxy::start(cluster.shard(0).port()))
        .unwrap();
    let router = main.block_on(async {
        LockRouter::from_yaml_str(&format!(
            "shards:\n  - name: s1\n    url: {}\n{extra}    pool:\n      \
             batches-in-flight: 1\n      create-timeout: 30s\ncleaner:\n  registry: static\n",
            proxy.url()
        ))
        .await
        .unwrap()
    });
    (main, cluster, direct, proxy, router)
}

/// A router used from two runtimes: a release called on one of them, whose caller gives up
/// and whose runtime then ends, goes on on the router's runtime (its statement parked by a
/// partition), and a release of the same shard queued behind it (one batch in flight per
/// lane) is sent once the link heals. Run on the caller's runtime, that release would have
/// ended with it, and the one queued behind it waited for a runner to start it.
#[test]
fn a_release_whose_callers_runtime_ended_goes_on_and_the_next_is_sent() {
    let (main, _cluster, direct, proxy, router) = behind_a_proxy("");
    let (a, b) = main.block_on(async {
        let a = router.acquire("a", AcquireOptions::new()).await.unwrap();
        let b = router.acquire("b", AcquireOptions::new()).await.unwrap();
        (a, b)
    });
    // No reply comes back from now on: a's release stays in flight.
    proxy.set(ProxyMode::Blackhole);
    let before = router.stats().releases;
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // a's release, polled once on `other` (which hands its work to the router's runtime),
    // then given up, and `other` dropped.
    other.block_on(async {
        let mut release = std::pin::pin!(a.release());
        assert!(futures_util::poll!(release.as_mut()).is_pending());
    });
    drop(other);
    // The runtime has one thread: a release counted has run up to its statement's reply.
    let released = |n: u64| router.stats().releases == before + n;
    // Handed out of the runtime unawaited: it is awaited below.
    #[allow(clippy::async_yields_async)]
    let queued = main.block_on(async {
        let sent = tokio::time::timeout(Duration::from_secs(30), async {
            while !released(1) {
                tokio::task::yield_now().await;
            }
        });
        sent.await
            .expect("a release given up on a runtime that ended never reached its statement");
        let queued = tokio::spawn(b.release());
        while !released(2) {
            tokio::task::yield_now().await;
        }
        queued
    });
    proxy.set(ProxyMode::Pass);
    let answer =
        main.block_on(async { tokio::time::timeout(Duration::from_secs(30), queued).await });
    let answer = answer
        .expect("the queued release was never answered")
        .unwrap();
    assert!(answer.is_ok(), "{answer:?}");
    for key in ["a", "b"] {
        let freed = main.block_on(common::eventually(Duration::from_secs(30), || async {
            let (_, row) = direct.inspect(key).await.unwrap();
            !row.expect("its row").is_held()
        }));
        assert!(freed, "{key} stayed held after its release");
    }
}

/// A router used from two runtimes: an acquire called on one of them, its row written and its
/// reply held up on the way back, when that runtime ends. The lane's runner runs on the
/// router's runtime, so the acquire of another caller queued behind it is answered, and the
/// abandoned grant is given back. (When runners ran on their caller's runtime, the other
/// caller was told the router had shut down, and the row stayed taken until its ttl.)
#[test]
fn an_acquire_queued_behind_one_whose_callers_runtime_ended_is_answered() {
    let (main, _cluster, direct, proxy, router) = behind_a_proxy("    statement-timeout: 30s\n");
    let other = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let ttl = AcquireOptions::new().ttl(Duration::from_secs(60));
    // A pooled connection, made here without delay.
    main.block_on(async {
        let warm = router.acquire("warm", ttl.clone()).await.unwrap();
        warm.release().await.unwrap();
    });
    // Every chunk takes 2 s each way: `x`, called on `other`, starts the lane's runner (on
    // the router's runtime, `main`), which sends `k`, queued meanwhile from `main`, after it.
    proxy.set(ProxyMode::Delay(Duration::from_secs(2)));
    let _x = other.spawn({
        let (router, ttl) = (router.clone(), ttl.clone());
        async move { router.acquire("x", ttl).await }
    });
    let written = |key: &'static str| {
        let direct = &direct;
        async move {
            loop {
                let (_, row) = direct.inspect(key).await.unwrap();
                if row.is_some_and(|r| r.is_held()) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    // Handed out of the runtime unawaited: it is awaited once `other` is gone.
    #[allow(clippy::async_yields_async)]
    let k = main.block_on(async {
        written("x").await;
        let k = tokio::spawn({
            let router = router.clone();
            async move { router.acquire("k", ttl.wait(Duration::from_secs(60))).await }
        });
        // Written: its reply is on its way back.
        written("k").await;
        k
    });
    other.shutdown_background();
    proxy.set(ProxyMode::Pass);
    let answer = main.block_on(async { tokio::time::timeout(Duration::from_secs(60), k).await });
    let guard = answer
        .expect("the acquire was never answered")
        .unwrap()
        .expect("an acquire queued behind one whose caller's runtime ended failed");
    main.block_on(guard.release()).unwrap();
    // The abandoned acquire's grant was given back.
    let freed = main.block_on(common::eventually(Duration::from_secs(30), || async {
        let (_, row) = direct.inspect("x").await.unwrap();
        !row.is_some_and(|r| r.is_held())
    }));
    assert!(
        freed,
        "the grant of an acquire whose caller's runtime ended stayed held"
    );
}

/// A heartbeat writes the instance's row as live again. One still on its way when the router
/// deregisters would make a process that is gone count as live for `heartbeat-timeout`, to
/// cleaners and to routers starting with another topology (which then grant nothing):
/// shutdown deregisters only once no heartbeat is on its way. The heartbeat is held on its
/// way by a transaction holding the instance's row.
#[tokio::test(flavor = "multi_thread")]
async fn shutdown_deregisters_only_after_the_last_heartbeat() {
    use mysql_async::prelude::Queryable;
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    let server = cluster.shard(0);
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 20s\n\
         cleaner:\n  heartbeat-interval: 50ms\n  heartbeat-timeout: 5s\n",
        server.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let id = router.instance_id().to_owned();
    let mut holder = server.connect().await.unwrap();
    holder.query_drop("BEGIN").await.unwrap();
    holder
        .exec_drop(
            "SELECT instance_id FROM shardlock_instance WHERE instance_id = ? FOR UPDATE",
            (&id,),
        )
        .await
        .unwrap();
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            server.lock_waits_now().await.unwrap() >= 1
        })
        .await,
        "no heartbeat waited for the instance's row"
    );
    let shutdown = tokio::spawn(async move { router.shutdown().await });
    // Without leases to give back, a shutdown that did not wait would send its deregistration
    // at once, and it would wait for the row behind the heartbeat.
    let watched = tokio::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(1) {
        let waits = server.lock_waits_now().await.unwrap();
        assert!(
            waits <= 1,
            "the deregistration was sent while a heartbeat was on its way"
        );
        assert!(
            !shutdown.is_finished(),
            "shutdown returned while a heartbeat was on its way"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    holder.query_drop("ROLLBACK").await.unwrap();
    shutdown.await.unwrap().unwrap();
    let deregistered: Option<bool> = holder
        .exec_first(
            "SELECT deregistered_at IS NOT NULL FROM shardlock_instance WHERE instance_id = ?",
            (&id,),
        )
        .await
        .unwrap();
    assert_eq!(deregistered, Some(true));
}

/// A grant answered after shutdown took its list of the leases to end (its statement waited
/// behind another transaction's row lock meanwhile) hands out no guard that says it holds the
/// key: shutdown never saw that lease, and ends nothing later.
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_answered_after_shutdown_began_says_it_is_lost() {
    let (cluster, _other, _) = common::start(1, "").await;
    let shard = cluster.shard(0);
    // The server's lock wait (9 s) outlasts the shutdown below.
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 10s\n",
        shard.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let once = router.acquire("k", AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(shard, false).await.unwrap();
    let key = competitor.key_of(once.owner()).await.unwrap().unwrap();
    once.release().await.unwrap();
    competitor.lock(&key).await.unwrap();
    let acquiring = tokio::spawn({
        let router = router.clone();
        async move { router.acquire("k", AcquireOptions::new()).await }
    });
    // The acquire waits behind the locked row.
    common::until_a_row_lock_is_waited_for(shard).await;

    router.shutdown().await.unwrap();
    competitor.end().await.unwrap();
    if let Ok(guard) = acquiring.await.unwrap() {
        assert!(
            !guard.is_held(),
            "a grant answered after shutdown began says it holds the key"
        );
    }
}

/// A key granted in process by an acquire that was waiting on its shard while the router shut
/// down (its statement timed out after shutdown had ended every hold it knew of, and the
/// breaker opened) is lost at once, as shutdown ends every hold: its guard stayed held, and
/// its `lost()` never completed.
#[tokio::test(flavor = "multi_thread")]
async fn a_hold_in_process_granted_across_a_shutdown_is_lost() {
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 1s\nbreaker:\n  \
         consecutive-failures: 1\n  slow-call: 10s\ncleaner:\n  registry: static\n\
         namespaces:\n  default:\n    on-shard-failure: local\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    proxy.set(ProxyMode::HoldTo(b"held-key"));
    let acquiring = tokio::spawn({
        let router = router.clone();
        let opts = AcquireOptions::new().wait(Duration::from_secs(30));
        async move { router.acquire("held-key", opts).await }
    });
    let _held = proxy.held().await;
    router.shutdown().await.unwrap();
    match acquiring.await.unwrap() {
        Ok(guard) => {
            assert_eq!(guard.mode(), shardlock::LockMode::LocalFallback);
            tokio::time::timeout(Duration::from_secs(10), guard.lost())
                .await
                .expect("a hold in process granted across a shutdown was never reported lost");
            assert!(!guard.is_held());
        }
        Err(e) => assert!(matches!(e, shardlock::Error::Shutdown), "{e}"),
    }
}

/// A transaction lock alive at shutdown (its guard kept by a request still running) is lost:
/// its `commit` rolls back, and the instance deregisters as usual; none is taken after. One
/// whose `COMMIT` is on its way and stays unanswered keeps its instance in the registry until
/// its heartbeat times out: deregistered, it no longer kept a move of its key in force, and the
/// fleet ended the move and locked the key where it lives now while that `COMMIT` could still
/// land.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_alive_at_shutdown_is_lost_and_one_committing_keeps_its_instance() {
    use mysql_async::prelude::Queryable;
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    // A shutdown waits up to half the heartbeat timeout for a `COMMIT` to settle.
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\ncleaner:\n  heartbeat-interval: 1s\n  \
         heartbeat-timeout: 4s\n",
        proxy.url()
    );
    let deregistered = |id: String| {
        let shard = cluster.shard(0);
        async move {
            let row: Option<bool> = (shard.connect().await.unwrap())
                .exec_first(
                    "SELECT deregistered_at IS NOT NULL FROM shardlock_instance \
                     WHERE instance_id = ?",
                    (id,),
                )
                .await
                .unwrap();
            row
        }
    };

    // Kept, not committing.
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let tx = router
        .lock_in_transaction("tx", Duration::from_secs(10))
        .await
        .unwrap();
    router.shutdown().await.unwrap();
    assert!(
        !tx.is_held(),
        "a transaction lock held across its router's shutdown"
    );
    let committed = tx.commit().await;
    assert!(
        matches!(committed, Err(shardlock::Error::LockLost { .. })),
        "a transaction lock committed after its router's shutdown: {committed:?}"
    );
    assert_eq!(
        deregistered(router.instance_id().to_owned()).await,
        Some(true),
        "an instance whose transaction lock could not commit any more stayed registered"
    );
    let after = router.lock_in_transaction("tx", Duration::ZERO).await;
    assert!(
        matches!(after, Err(shardlock::Error::Shutdown)),
        "a transaction lock taken after shutdown: {after:?}"
    );

    // Its `COMMIT` on its way, held on the link.
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let tx = router
        .lock_in_transaction("tx", Duration::from_secs(10))
        .await
        .unwrap();
    proxy.set(ProxyMode::HoldTo(b"RELEASE SAVEPOINT"));
    let committing = tokio::spawn(tx.commit());
    let _held = proxy.held().await;
    router.shutdown().await.unwrap();
    assert_eq!(
        deregistered(router.instance_id().to_owned()).await,
        Some(false),
        "an instance was deregistered at shutdown while a COMMIT of it was on its way"
    );
    committing.abort();
}
