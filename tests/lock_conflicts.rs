//! Another transaction on a shard competes for lease rows (an operator's console, a batch job):
//! the lease statements wait behind it; a lock wait timeout (1205) makes a waiter ask again
//! within its own wait, a deadlock in which a lease statement is the victim (1213) is retried
//! inside the call, and neither reaches the caller, counts against the shard or costs a lease.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, LockGuard, LockMode, LockRouter};
use shardlock_testkit::{Cluster, Competitor};

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_behind_another_transactions_row_lock_keeps_waiting() {
    // The default statement timeout (2 s) leaves the server a lock wait of 1 s. A breaker
    // that opens on two slow calls in a row: lock waits must not count as slow.
    let (cluster, router, _) = common::start(
        1,
        "namespaces:\n  default:\n    wait: 30s\n\
         breaker:\n  consecutive-failures: 2\n  min-calls: 2\n  failure-rate: 0.5\n  slow-call: 200ms\n",
    )
    .await;
    let shard = cluster.shard(0);
    let competitor = common::locked_row(&router, shard, "k").await;

    let sent = router.stats().acquire_statements;
    let waiter = {
        let router = router.clone();
        tokio::spawn(async move { router.acquire("k", AcquireOptions::new()).await })
    };
    // The waiter's statement waits behind the competitor until the server gives up on it
    // (1205), and it asks again: a third statement sent means two were answered that way.
    while router.stats().acquire_statements < sent + 3 {
        if waiter.is_finished() {
            panic!(
                "the waiter gave up behind the locked row: {:?}",
                waiter.await.unwrap().map(|g| g.fence())
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Counted as it is sent: its wait on the server may begin a moment later.
    let waits = common::eventually(Duration::from_secs(30), || async {
        shard.lock_waits_now().await.unwrap() > 0
    })
    .await;
    assert!(
        waits,
        "the third statement never waited behind the locked row"
    );
    competitor.end().await.unwrap();
    let guard = waiter
        .await
        .unwrap()
        .expect("a lock wait timeout reached the caller");
    assert_eq!(guard.mode(), LockMode::Remote);
    assert!(
        router.breaker_transitions("s1").is_empty(),
        "lock waits counted against the shard: {:?}",
        router.breaker_transitions("s1")
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_renewal_chosen_as_a_deadlock_victim_is_retried_and_the_leases_stay_held() {
    let (cluster, router, _) = common::start(1, "namespaces:\n  default:\n    ttl: 3s\n").await;
    let shard = cluster.shard(0);
    let a = router.acquire("a", AcquireOptions::new()).await.unwrap();
    let b = router.acquire("b", AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(shard, true).await.unwrap();
    let mut keys = [
        competitor.key_of(a.owner()).await.unwrap().unwrap(),
        competitor.key_of(b.owner()).await.unwrap().unwrap(),
    ];
    // The renewal locks its rows in key order: the competitor takes the last one first.
    keys.sort();
    let deadlocks = shard.global_status("Innodb_deadlocks").await.unwrap();
    competitor.lock(&keys[1]).await.unwrap();
    // The next renewal locks the first row and waits for the last...
    while shard.lock_waits_now().await.unwrap() == 0 {
        assert!(a.is_held() && b.is_held());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ... and the competitor asking for the first closes the cycle. Having written more, it
    // is not the victim: the renewal is rolled back, and sent again.
    competitor
        .lock(&keys[0])
        .await
        .expect("the server rolled back the competitor, not the renewal");
    assert_eq!(
        shard.global_status("Innodb_deadlocks").await.unwrap(),
        deadlocks + 1
    );
    while shard.lock_waits_now().await.unwrap() == 0 {
        assert!(a.is_held() && b.is_held());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (until_a, until_b) = (a.held_until(), b.held_until());
    competitor.end().await.unwrap();
    // The retried renewal extends both leases.
    while a.held_until() <= until_a || b.held_until() <= until_b {
        assert!(
            a.is_held() && b.is_held(),
            "a lease was lost to the deadlock"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        router.stats().renew_failures,
        0,
        "the deadlock reached the keeper"
    );
    a.release().await.unwrap();
    b.release().await.unwrap();
}

/// Another transaction holds one lease's row locked for longer than the lease lasts (an
/// operator's console): that lease is lost at its end, its renewal blocked, but the leases
/// renewed with it in one statement are renewed all along, and the waits count against no
/// shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_locked_by_another_transaction_costs_only_its_own_lease() {
    // A breaker that opens on one call slower than the server's lock wait (1 s) comes near:
    // a renewal's lock wait must not count.
    let (cluster, router, _) = common::start(
        1,
        "namespaces:\n  default:\n    ttl: 3s\n\
         breaker:\n  consecutive-failures: 1\n  slow-call: 800ms\n",
    )
    .await;
    let shard = cluster.shard(0);
    // Taken before the locked one: unrenewed, they would end before it.
    let a = router.acquire("a", AcquireOptions::new()).await.unwrap();
    let c = router.acquire("c", AcquireOptions::new()).await.unwrap();
    let b = router.acquire("b", AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(shard, false).await.unwrap();
    let key = competitor.key_of(b.owner()).await.unwrap().unwrap();
    competitor.lock(&key).await.unwrap();

    b.lost().await;
    assert!(
        a.is_held() && c.is_held(),
        "a lease renewed with the locked one was lost with it"
    );
    assert!(
        router.breaker_transitions("s1").is_empty(),
        "renewals blocked by a row lock counted against the shard: {:?}",
        router.breaker_transitions("s1")
    );
    competitor.end().await.unwrap();
    a.release().await.unwrap();
    c.release().await.unwrap();
}

/// Once a lease's row is found locked, its renewals wait for no lock: a shorter lease of the
/// same process is renewed beside it all along. (A renewal that waited out the server's lock
/// wait, 1 s, at every tick held up the renewal of every other lease, and one shorter than
/// that was lost.)
#[tokio::test(flavor = "multi_thread")]
async fn a_locked_row_holds_up_no_renewal_of_a_shorter_lease() {
    let (cluster, router, _) = common::start(
        1,
        "namespaces:\n  default:\n    ttl: 10s\n  fast:\n    ttl: 1s\n",
    )
    .await;
    let shard = cluster.shard(0);
    let slow = router.acquire("slow", AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(shard, false).await.unwrap();
    let key = competitor.key_of(slow.owner()).await.unwrap().unwrap();
    competitor.lock(&key).await.unwrap();
    let found = common::eventually(Duration::from_secs(30), || async {
        router.stats().renewals_blocked >= 1
    })
    .await;
    assert!(found, "the locked row's renewal was never found blocked");

    let fast = router
        .acquire("fast", AcquireOptions::new().namespace("fast"))
        .await
        .unwrap();
    for _ in 0..5 {
        common::renewed(&fast, "a lease renewed beside a locked row was lost").await;
    }
    assert!(
        slow.is_held(),
        "the locked row's lease ended before its end"
    );
    competitor.end().await.unwrap();
    fast.release().await.unwrap();
    slow.release().await.unwrap();
}

/// A row locked for a while, the server's lock wait (1 s) longer than the renewal's own
/// timeout: the renewal times out, not told apart from a slow shard, and the next renews
/// apart, finding the row locked without waiting; the lease is renewed once the lock is gone,
/// and the breaker stays closed (every renewal timing out behind the lock opened it).
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_whose_row_was_locked_for_a_while_is_renewed_once_the_lock_ends() {
    let (_cluster, router, guard, competitor) =
        locked_lease("500ms", "namespaces:\n  default:\n    ttl: 6s\n").await;
    let found = common::eventually(Duration::from_secs(30), || async {
        router.stats().renewals_blocked >= 2
    })
    .await;
    assert!(found, "the renewals never found the row locked");
    assert!(
        router.breaker_transitions("s1").is_empty(),
        "renewals behind a locked row opened the breaker: {:?}",
        router.breaker_transitions("s1")
    );

    competitor.end().await.unwrap();
    common::renewed(&guard, "the lease was lost after its row's lock ended").await;
    guard.release().await.unwrap();
}

/// A renewal that waited behind another transaction's row lock, which then ended, was slow
/// only because of that lock: it counts against no shard (it counted as a slow call, and a
/// batch job taking lease rows for a second at each tick opened the breaker).
#[tokio::test(flavor = "multi_thread")]
async fn a_renewal_slowed_by_a_lock_that_then_ended_counts_against_no_shard() {
    // A lock wait of 9 s, and 8 s left of the lease at its first renewal, so the renewal
    // outwaits the lock with room to spare on a busy machine; a breaker that opens on one
    // call slower than 800 ms.
    let (cluster, router, guard, competitor) = locked_lease(
        "10s",
        "namespaces:\n  default:\n    ttl: 12s\n\
         breaker:\n  consecutive-failures: 1\n  slow-call: 800ms\n",
    )
    .await;
    let shard = cluster.shard(0);
    // A renewal waits behind the locked row.
    common::until_a_row_lock_is_waited_for(shard).await;
    // The lock lasts beyond the slow-call threshold while the renewal waits.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    competitor.end().await.unwrap();

    common::renewed(&guard, "the lease was lost behind a lock that ended").await;
    assert!(
        router.breaker_transitions("s1").is_empty(),
        "a renewal slowed by a row lock counted against the shard: {:?}",
        router.breaker_transitions("s1")
    );
    guard.release().await.unwrap();
}

/// While a lease's row stays locked, its renewal is tried again at a quarter period, alone:
/// the leases renewed beside it at the last full tick are not renewed again until the next
/// one (every lease of the shard was renewed four times as often while a lock lasted).
#[tokio::test(flavor = "multi_thread")]
async fn the_retry_of_a_locked_leases_renewal_renews_no_other_lease() {
    // A period of 6.7 s: the retry comes 1.7 s after the tick that found the row locked.
    let (_cluster, router, guard, competitor) =
        locked_lease("2s", "namespaces:\n  default:\n    ttl: 20s\n").await;
    let free = router.acquire("free", AcquireOptions::new()).await.unwrap();
    let found = common::eventually(Duration::from_secs(60), || async {
        router.stats().renewals_blocked >= 1
    })
    .await;
    assert!(found, "the renewals never found the row locked");
    let until = free.held_until();
    let retried = common::eventually(Duration::from_secs(30), || async {
        router.stats().renewals_blocked >= 2
    })
    .await;
    assert!(retried, "the locked lease's renewal was never tried again");
    assert_eq!(
        free.held_until(),
        until,
        "the retry of a locked lease's renewal renewed a lease free of any lock"
    );
    competitor.end().await.unwrap();
    common::renewed(&guard, "the lease was lost after its row's lock ended").await;
    common::renewed(&free, "the lease free of any lock was lost").await;
    free.release().await.unwrap();
    guard.release().await.unwrap();
}

/// One shard, a router over it with `statement_timeout` and `rest` (YAML after its shards),
/// the lease of key `k` it holds, and another transaction holding that lease's row locked.
async fn locked_lease(
    statement_timeout: &str,
    rest: &str,
) -> (Cluster, LockRouter, LockGuard, Competitor) {
    let (cluster, _direct, _) = common::start(1, "").await;
    let shard = cluster.shard(0);
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: {statement_timeout}\n{rest}",
        shard.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let guard = router.acquire("k", AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(shard, false).await.unwrap();
    let key = competitor.key_of(guard.owner()).await.unwrap().unwrap();
    competitor.lock(&key).await.unwrap();
    (cluster, router, guard, competitor)
}

/// An acquire that waited behind another transaction's lock on its key's row (an operator's
/// console, a transaction lock), then was granted, was slow because the key was busy, not
/// because the shard was: it counted as a slow call, and a breaker that opens on one such
/// call opened on a healthy shard.
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_slowed_by_a_row_lock_counts_against_no_shard() {
    // A lock wait of 9 s; a breaker that opens on one call slower than 2 s, with no
    // registry's heartbeats beside the acquire (a slow one on a busy machine would open it).
    let (cluster, _direct, _) = common::start(1, "").await;
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 10s\n\
         breaker:\n  consecutive-failures: 1\n  slow-call: 2s\ncleaner:\n  registry: static\n",
        cluster.shard(0).url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let competitor = common::locked_row(&router, cluster.shard(0), "busy").await;
    let acquiring = tokio::spawn({
        let router = router.clone();
        let opts = AcquireOptions::new().wait(Duration::from_secs(30));
        async move { router.acquire("busy", opts).await }
    });
    // The acquire waits for the row.
    common::until_a_row_lock_is_waited_for(cluster.shard(0)).await;
    // Past the slow-call threshold, within the server's lock wait (9 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    competitor.end().await.unwrap();
    let granted = acquiring.await.unwrap().unwrap();
    assert!(
        router.breaker_transitions("s1").is_empty(),
        "an acquire slowed by a row lock counted against its shard: {:?}",
        router.breaker_transitions("s1")
    );
    granted.release().await.unwrap();
}

/// A release or an extend kept waiting behind another transaction's lock on its row is slow
/// because the row is busy, not because the shard is: answered late, or told by the server
/// that its lock wait ran out (1205), it counts against no shard, and the row is freed once
/// the lock goes. Before, a slow release counted as a slow call, and one whose lock wait ran
/// out was sent again into the client's timeout: either opened a breaker that opens on one
/// such call.
#[tokio::test(flavor = "multi_thread")]
async fn a_release_or_extend_held_up_by_a_row_lock_counts_against_no_shard() {
    // A lock wait of 9 s and then of 1 s; a breaker that opens on one failure or one call
    // slower than 2 s, with no registry's heartbeats beside the release.
    let cluster = Cluster::start(1).await.unwrap();
    common::migrate_only(&cluster.config_yaml("")).await;
    for (statement_timeout, extend) in [("10s", false), ("2s", false), ("10s", true), ("2s", true)]
    {
        let yaml = format!(
            "shards:\n  - name: s1\n    url: {}\n    statement-timeout: {statement_timeout}\n\
             breaker:\n  consecutive-failures: 1\n  slow-call: 2s\ncleaner:\n  registry: static\n",
            cluster.shard(0).url()
        );
        let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
        let held = router.acquire("busy", AcquireOptions::new()).await.unwrap();
        let mut competitor = Competitor::begin(cluster.shard(0), false).await.unwrap();
        let key = competitor.key_of(held.owner()).await.unwrap().unwrap();
        competitor.lock(&key).await.unwrap();
        // An extend takes its row's lock as a release does.
        let statement = tokio::spawn(async move {
            if extend {
                (held.extend(Duration::from_secs(60)).await, Some(held))
            } else {
                (held.release().await, None)
            }
        });
        common::until_a_row_lock_is_waited_for(cluster.shard(0)).await;
        let (answer, still_held) = if statement_timeout == "10s" {
            // Past the slow-call threshold, within the server's lock wait (9 s).
            tokio::time::sleep(Duration::from_secs(3)).await;
            competitor.end().await.unwrap();
            statement.await.unwrap()
        } else {
            // The server's lock wait (1 s) runs out first; a release's row is given back once
            // the lock goes.
            let answer = statement.await.unwrap();
            competitor.end().await.unwrap();
            answer
        };
        let what = if extend { "an extend" } else { "a release" };
        // Answered once the lock went, or told it did nothing (never 1205).
        if statement_timeout == "10s" {
            assert!(answer.is_ok(), "{what}: {answer:?}");
        } else {
            assert!(
                matches!(answer, Err(shardlock::Error::Unavailable { .. })),
                "{what}: {answer:?}"
            );
        }
        assert!(
            router.breaker_transitions("s1").is_empty(),
            "{what} held up by a row lock counted against its shard ({answer:?}): {:?}",
            router.breaker_transitions("s1")
        );
        if let Some(guard) = still_held {
            guard.release().await.unwrap();
        }
        let freed = common::eventually(Duration::from_secs(30), || async {
            let other = router.try_acquire("busy", AcquireOptions::new()).await;
            match other {
                Ok(Some(guard)) => guard.release().await.is_ok(),
                _ => false,
            }
        })
        .await;
        assert!(freed, "the row stayed taken after {what} ({answer:?})");
        router.shutdown().await.unwrap();
    }
}

/// A bucketed acquire that spills to other buckets tries them within its wait: with every
/// bucket's row behind another transaction's lock (each try answered only after the server's
/// lock wait), it stops spilling when its wait is over, and answers that it timed out. Before,
/// it tried all sixteen, a lock wait each, long past its wait.
#[tokio::test(flavor = "multi_thread")]
async fn a_spilling_bucket_acquire_tries_no_bucket_past_its_wait() {
    let (cluster, router, _) = common::start(
        1,
        "namespaces:\n  stock:\n    buckets: 16\n    bucket-spill: true\n",
    )
    .await;
    let stock = || AcquireOptions::new().namespace("stock");
    let every = router.acquire_all_buckets("sku", stock()).await.unwrap();
    let mut competitor = Competitor::begin(cluster.shard(0), false).await.unwrap();
    for bucket in every {
        let row = competitor.key_of(bucket.owner()).await.unwrap().unwrap();
        bucket.release().await.unwrap();
        competitor.lock(&row).await.unwrap();
    }
    // No write of the placement record among the acquires counted.
    common::until_placement_recorded(&cluster).await;
    let before = common::inserts(&cluster).await;
    let spilled = router
        .acquire_bucket("sku", "hint", stock().wait(Duration::from_millis(300)))
        .await;
    let tries = common::inserts(&cluster).await - before;
    competitor.end().await.unwrap();
    assert!(
        matches!(spilled, Err(shardlock::Error::Timeout { .. })),
        "{spilled:?}"
    );
    // The hint's own bucket, once: its answer comes after the wait.
    assert_eq!(tries, 1, "acquires sent for a 300 ms wait");
}

/// A slow acquire is judged by a statement that waits for no lock: on a slow link that one is
/// slow too, and the breaker opens, whatever else the process sends (an acquire answered
/// slowly decided nothing, and with no release or heartbeat to judge, a slow shard never
/// opened its breaker).
#[tokio::test(flavor = "multi_thread")]
async fn a_slow_acquire_on_a_slow_link_opens_the_breaker() {
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    let proxy = shardlock_testkit::Proxy::start(cluster.shard(0).port())
        .await
        .unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 20s\nbreaker:\n  \
         consecutive-failures: 1\n  slow-call: 300ms\ncleaner:\n  registry: static\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    // Two pooled connections made before the link slows, and the placement record written:
    // one for the acquire, one idle for the statement that judges it (with none idle, or one
    // busy with the record's write, nothing is judged).
    let tx = router
        .lock_in_transaction("warm-tx", Duration::from_secs(10))
        .await
        .unwrap();
    let warm = router.acquire("warm", AcquireOptions::new()).await.unwrap();
    warm.release().await.unwrap();
    tx.rollback().await.unwrap();
    common::until_placement_recorded(&cluster).await;
    // Each way: a round trip of 400 ms at least.
    proxy.set(shardlock_testkit::ProxyMode::Delay(Duration::from_millis(
        200,
    )));
    let granted = router.try_acquire("slow", AcquireOptions::new()).await;
    let granted = granted.map(|g| g.map(|g| g.mode()));
    assert!(matches!(granted, Ok(Some(LockMode::Remote))), "{granted:?}");
    assert_eq!(
        router.breaker_state("s1"),
        Some(shardlock::BreakerState::Open),
        "a slow acquire on a slow link left the breaker closed"
    );
    proxy.set(shardlock_testkit::ProxyMode::Pass);
}

/// A key whose row another transaction keeps locked holds up no acquire of other keys: once
/// found locked, its polls are sent apart from the batches. In a batch, each of its polls
/// waited out the server's lock wait (10 s here) with every key beside it, and callers of
/// free keys timed out.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_whose_row_stays_locked_holds_up_no_batch_of_other_keys() {
    // A lock wait (10 s) twice the other callers' wait, and one batch at a time.
    let (cluster, router, yaml) = common::start(1, "").await;
    let yaml = yaml.replacen(
        "    url:",
        "    statement-timeout: 11s\n    pool:\n      max-size: 8\n      batches-in-flight: 1\n    url:",
        1,
    );
    let router = {
        drop(router);
        LockRouter::from_yaml_str(&yaml).await.unwrap()
    };
    let shard = cluster.shard(0);
    let competitor = common::locked_row(&router, shard, "locked").await;

    let sent = router.stats().acquire_statements;
    let waiter = {
        let router = router.clone();
        let wait = AcquireOptions::new().wait(Duration::from_secs(600));
        tokio::spawn(async move { router.acquire("locked", wait).await })
    };
    // Its first poll was answered "locked" (after the server's lock wait), and it polls on.
    let found = common::eventually(Duration::from_secs(120), || async {
        router.stats().acquire_statements >= sent + 2
    })
    .await;
    assert!(found, "the locked key's first poll was never answered");

    let timeouts_before = router.stats().timeouts;
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let router = router.clone();
            tokio::spawn(async move {
                let wait = AcquireOptions::new().wait(Duration::from_secs(5));
                for i in 0..3 {
                    // (After the locked key: its lock takes the gap before it too.)
                    let key = format!("z-free:{t}:{i}");
                    match router.acquire(&key, wait.clone()).await {
                        Ok(guard) => guard.release().await.unwrap(),
                        Err(e) => return Err(format!("{key}: {e}")),
                    }
                }
                Ok(())
            })
        })
        .collect();
    let mut failed = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            failed.push(e);
        }
    }
    assert!(
        failed.is_empty(),
        "acquires of free keys waited behind a locked row: {failed:?} ({} timeouts)",
        router.stats().timeouts - timeouts_before
    );
    competitor.end().await.unwrap();
    waiter.await.unwrap().unwrap().release().await.unwrap();
}
