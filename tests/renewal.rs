//! Renewal is batched: 1,000 leases on three shards survive three ttls, and the shards' own
//! counters show one renewal statement per shard per tick. Leases about to end without
//! renewal do not cut the others' renewals short.

mod common;

use std::time::Duration;

use futures_util::future::join_all;
use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, BreakerState, LockRouter};
use shardlock_testkit::{Cluster, Proxy, ProxyMode};

const LEASES: usize = 1000;
/// Renewed every second: a second's stall of a busy machine loses no lease.
const TTL: Duration = Duration::from_secs(3);

#[tokio::test(flavor = "multi_thread")]
async fn a_thousand_leases_renewed_with_one_statement_per_shard_per_tick() {
    // No heartbeats: they are UPDATEs too, and the shards' counters would count them.
    let (cluster, router, _) = common::start(3, "cleaner:\n  registry: static\n").await;
    let opts = AcquireOptions::new().ttl(TTL).wait(Duration::ZERO);
    let guards: Vec<_> = join_all((0..LEASES).map(|i| {
        let (router, opts) = (router.clone(), opts.clone());
        async move { router.acquire(&format!("lease:{i}"), opts).await.unwrap() }
    }))
    .await;
    for s in ["s1", "s2", "s3"] {
        assert!(
            guards.iter().any(|g| g.shard() == s),
            "leases on every shard"
        );
    }

    let updates_before = common::status_sum(&cluster, "Com_update").await;
    let stats_before = router.stats();
    // Three ttls' worth of ticks: a tick every ttl/3 on each of the three shards. Counted,
    // not timed: a busy machine's late ticks make the wait longer, not the count wrong.
    let started = tokio::time::Instant::now();
    let ticked = common::eventually(Duration::from_secs(60), || async {
        router.stats().renew_ticks - stats_before.renew_ticks >= 3 * 9
    })
    .await;
    let took = started.elapsed();
    assert!(ticked, "renewals stopped: {:?}", router.stats());
    // Not more often than every ttl/3: nine ticks of a shard span eight periods (seven, for
    // shards whose ticks are not aligned).
    assert!(
        took >= TTL / 3 * 7,
        "27 renewal ticks in {took:?}, a tick every {:?} at most",
        TTL / 3
    );
    // Read between ticks: a tick is counted before its statement's answer is.
    let settled = |s: &shardlock::LockStats| {
        s.renew_statements - stats_before.renew_statements + s.renew_failures
            - stats_before.renew_failures
            == s.renew_ticks - stats_before.renew_ticks
    };
    let between = common::eventually(Duration::from_secs(10), || async {
        settled(&router.stats())
    })
    .await;
    let stats = router.stats();
    let updates = common::status_sum(&cluster, "Com_update").await - updates_before;
    assert!(
        between,
        "a renewal tick sent other than one statement: {stats:?}"
    );

    assert!(guards.iter().all(|g| g.is_held()), "no lease lost");
    assert_eq!(stats.lost, 0);
    let ticks = stats.renew_ticks - stats_before.renew_ticks;
    let statements = stats.renew_statements - stats_before.renew_statements;
    eprintln!("{ticks} renewal ticks, {statements} renewal statements, {updates} UPDATEs counted by the shards");
    let failures = stats.renew_failures - stats_before.renew_failures;
    assert_eq!(
        statements + failures,
        ticks,
        "one statement per shard per tick ({failures} failed)"
    );
    // The shards' counters agree, up to one statement per shard that was on its way at either
    // end of the window (the server counts it before the client does).
    assert!(
        updates.abs_diff(statements) <= 6,
        "the shards saw {updates} UPDATEs for {statements} renewal statements"
    );

    for g in guards {
        g.release().await.unwrap();
    }
    assert_eq!(common::live_leases(&cluster).await, 0);
}

/// A renewal given less than the statement timeout (what was left before its lease's end)
/// that runs out tells of the time it had, not of the shard: it counted as a failure, and
/// after an outage the breaker that let such a renewal through as a probe opened again, and
/// again, until every lease of the shard was lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_renewal_cut_short_by_its_leases_end_does_not_open_the_breaker() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    pool: {{ wait-timeout: 30s, create-timeout: \
         30s }}\nbreaker:\n  slow-call: 10s\n  consecutive-failures: 1\ncleaner:\n  \
         registry: static\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let held = router
        .acquire("cut", AcquireOptions::new().ttl(Duration::from_secs(1)))
        .await
        .unwrap();
    // Each way: a renewal takes 800 ms at least, more than a 1 s lease has left at its tick.
    proxy.set(ProxyMode::Delay(Duration::from_millis(400)));
    held.lost().await;
    // Its renewal ran out at the lease's end, as the lease was reported lost.
    let ran_out = common::eventually(Duration::from_secs(30), || async {
        router.stats().renew_failures >= 1
    })
    .await;
    assert!(ran_out, "no renewal ran out");
    assert_eq!(
        router.breaker_state("s1"),
        Some(BreakerState::Closed),
        "a renewal cut short by its lease's end opened the breaker"
    );
    proxy.set(ProxyMode::Pass);
}

/// On a link slower than the time left to the next end of a lease without keep-alive (held
/// beside, one ending every 50 ms), the renewal of the others still gets the time its own
/// leases leave it: bounded by those ends, every renewal timed out until the renewed lease
/// was lost.
#[tokio::test(flavor = "multi_thread")]
async fn leases_ending_without_renewal_do_not_cut_the_renewal_of_others_short() {
    let (_cluster, proxy, router) = through_a_proxy("").await;
    let renewed = router
        .acquire("renewed", AcquireOptions::new().ttl(Duration::from_secs(3)))
        .await
        .unwrap();
    let ending = staircase(&router, 200, |i| {
        AcquireOptions::new().lock_at_most(Duration::from_millis(1000 + 50 * i))
    })
    .await;
    // Each way: a renewal takes 300 ms at least, and some lease ends within 50 ms of any tick.
    proxy.set(ProxyMode::Delay(Duration::from_millis(150)));
    let before = router.stats();
    let three_ticks = common::eventually(Duration::from_secs(60), || async {
        router.stats().renew_ticks >= before.renew_ticks + 3
    });
    tokio::select! {
        () = renewed.lost() => panic!("the renewed lease was lost: {:?}", router.stats()),
        done = three_ticks => assert!(done, "three renewal ticks did not come"),
    }
    let stats = router.stats();
    assert_eq!(
        stats.renew_failures, before.renew_failures,
        "renewals failed on a slow but working link"
    );
    assert!(renewed.is_held());
    drop(ending);
    proxy.set(ProxyMode::Pass);
    renewed.release().await.unwrap();
}

/// Leases about to end at every tick (on a link slower than the time they have left, one
/// ending every 60 ms) do not cut short the renewal of a lease beside them that has time:
/// bounded by their ends, every renewal statement of the shard timed out, and the other lease
/// was lost at its own end.
#[tokio::test(flavor = "multi_thread")]
async fn leases_about_to_end_do_not_cut_the_renewal_of_others_short() {
    let (_cluster, proxy, router) = through_a_proxy("    statement-timeout: 5s\n").await;
    // Time enough for a renewal on a new connection through the slow link (the renewals cut
    // short give theirs up).
    let ttl = Duration::from_secs(6);
    let long = router
        .acquire("long", AcquireOptions::new().ttl(ttl))
        .await
        .unwrap();
    let ending = staircase(&router, 100, |i| {
        AcquireOptions::new().ttl(Duration::from_millis(600 + 60 * i))
    })
    .await;
    // Each way: a renewal takes 200 ms at least, and some lease ends within 60 ms of any tick
    // until the last of them ends (6.5 s after its grant), later than the long lease (granted
    // before them, for 6 s) would without renewal.
    proxy.set(ProxyMode::Delay(Duration::from_millis(100)));
    let until = long.held_until() + ttl;
    tokio::select! {
        () = async {
            while long.held_until() < until {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        } => {}
        () = long.lost() => panic!(
            "the long lease was lost beside leases about to end: {:?}",
            router.stats()
        ),
    }
    let lost = ending.iter().filter(|guard| !guard.is_held()).count();
    assert!(
        lost >= 10,
        "only {lost} leases ended unrenewed: the test means nothing: {:?}",
        router.stats()
    );
    drop(ending);
    proxy.set(ProxyMode::Pass);
    long.release().await.unwrap();
}

/// Leases of long keys are renewed in statements that a server with a `max_allowed_packet` of
/// 1 MiB takes: 4,096 of them (255-byte keys) made one renewal statement of 1.2 MB, which the
/// server refused, tick after tick, and every lease of the shard was lost at its end.
#[tokio::test(flavor = "multi_thread")]
async fn leases_of_long_keys_are_renewed_under_a_one_mebibyte_packet_limit() {
    let cluster = Cluster::start(1).await.unwrap();
    // Before the router connects: a session takes the global value when it starts.
    let mut conn = cluster.shard(0).connect().await.unwrap();
    conn.query_drop("SET GLOBAL max_allowed_packet = 1048576")
        .await
        .unwrap();
    drop(conn);
    let yaml = cluster.config_yaml("cleaner:\n  registry: static\n");
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let opts = AcquireOptions::new().ttl(TTL).wait(Duration::ZERO);
    let guards: Vec<_> = join_all((0..4096).map(|i| {
        let (router, opts) = (router.clone(), opts.clone());
        let key = format!("{i:04}{}", "k".repeat(251));
        async move { router.acquire(&key, opts).await.unwrap() }
    }))
    .await;
    let before = router.stats();
    let ticked = common::eventually(Duration::from_secs(60), || async {
        router.stats().renew_ticks >= before.renew_ticks + 3
    })
    .await;
    let stats = router.stats();
    assert!(ticked, "renewals stopped: {stats:?}");
    assert_eq!(
        stats.renew_failures, before.renew_failures,
        "renewals of long keys failed under a 1 MiB packet limit"
    );
    assert!(guards.iter().all(|g| g.is_held()), "leases were lost");
    join_all(guards.into_iter().map(|g| g.release())).await;
}

/// A grant answered late in its ttl, after a lock wait of most of it, has less time left than
/// a renewal interval: it is renewed at once, not at the shard's next tick, which may come
/// after its end (before, it was lost without a renewal ever sent).
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_granted_late_in_its_ttl_is_renewed_before_its_end() {
    // A server lock wait of 9 s; leases of 8 s, renewed every 8/3 s. No heartbeats, so the
    // only statements counted as renewals are the lease's.
    let (cluster, _direct, _) = common::start(1, "").await;
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 10s\n\
         cleaner:\n  registry: static\n",
        cluster.shard(0).url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let ttl = Duration::from_secs(8);
    let opts = AcquireOptions::new().ttl(ttl).wait(Duration::from_secs(30));
    let competitor = common::locked_row(&router, cluster.shard(0), "late").await;
    let acquiring = tokio::spawn({
        let router = router.clone();
        async move { router.acquire("late", opts).await }
    });
    // The acquire's statement waits for the row three quarters of the lease's ttl: the
    // lease is granted with less than a renewal interval left. The shard holds no other
    // lease, so its next tick is a whole interval away.
    common::until_a_row_lock_is_waited_for(cluster.shard(0)).await;
    tokio::time::sleep(ttl * 3 / 4).await;
    let renewals = router.stats().renew_statements;
    competitor.end().await.unwrap();
    let late = acquiring.await.unwrap().unwrap();
    let granted_until = late.held_until();
    let left = granted_until.saturating_duration_since(tokio::time::Instant::now());
    assert!(
        left < ttl / 3,
        "the premise: granted with {left:?} left, less than a renewal interval"
    );
    let renewed = common::eventually(Duration::from_secs(30), || async {
        router.stats().renew_statements > renewals
    });
    tokio::select! {
        renewed = renewed => assert!(renewed, "the late lease was never renewed"),
        _ = late.lost() => panic!("a lease granted late in its ttl was lost before its first renewal"),
    }
    assert!(
        late.is_held() && late.held_until() > granted_until,
        "a lease granted late in its ttl was lost before its first renewal"
    );
    late.release().await.unwrap();
}

/// A one-shard cluster reached through a proxy, `shard` added to the shard's config, and a
/// router on it (no heartbeats; slow calls only past 10 s).
async fn through_a_proxy(shard: &str) -> (Cluster, Proxy, LockRouter) {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n{shard}breaker:\n  slow-call: 10s\n\
         cleaner:\n  registry: static\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    (cluster, proxy, router)
}

/// `n` leases `ending:<i>` of `router`, the `i`th taken with `opts(i)`: ends a step apart.
async fn staircase(
    router: &LockRouter,
    n: u64,
    opts: impl Fn(u64) -> AcquireOptions,
) -> Vec<shardlock::LockGuard> {
    join_all((0..n).map(|i| {
        let (router, opts) = (router.clone(), opts(i));
        async move { router.acquire(&format!("ending:{i}"), opts).await.unwrap() }
    }))
    .await
}
