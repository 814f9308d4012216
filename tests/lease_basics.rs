//! Lease semantics on real shards: grant, contention, owner-checked release, fences, one round
//! trip per acquire and per release, byte-exact keys, reentrancy.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Error, LockRouter};
use shardlock_testkit::{Proxy, ProxyMode};

fn once() -> AcquireOptions {
    AcquireOptions::new().wait(Duration::ZERO)
}

/// A waiter of a namespace whose every grant goes through the shard (`handoff-max-count: 0`)
/// waiting behind a holder of another namespace on the same key is granted by the release
/// statement, not handed the holder's lease in memory (within the holder's `handoff-max-time`).
/// Before, only the holder's namespace was asked.
#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_whose_namespace_hands_off_nothing_in_memory_is_granted_by_the_shard() {
    let (_cluster, router, _) = common::start(
        1,
        "namespaces:\n  default:\n    ttl: 10s\n    handoff-max-time: 5s\n  strict:\n    \
         ttl: 10s\n    handoff-max-count: 0\n",
    )
    .await;
    let held = router.acquire("shared:1", once()).await.unwrap();
    let waiter = tokio::spawn({
        let router = router.clone();
        async move {
            let opts = AcquireOptions::new()
                .namespace("strict")
                .wait(Duration::from_secs(10));
            router.acquire("shared:1", opts).await
        }
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the waiter queued behind the holder");
    held.release().await.unwrap();
    let next = waiter.await.unwrap().unwrap();
    assert_eq!(
        router.stats().local_handoffs,
        0,
        "a waiter whose namespace wants every grant from the shard was handed one in memory"
    );
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn grant_contend_release_and_fences_rise() {
    let (cluster, router, yaml) = common::start(3, "").await;
    let other = shardlock::LockRouter::from_yaml_str(&yaml).await.unwrap();

    let g = router
        .acquire("order:1001", AcquireOptions::new())
        .await
        .unwrap();
    assert!(g.is_held());
    assert_eq!(g.shard(), router.shard_for("order:1001").unwrap());
    assert!(
        other
            .try_acquire("order:1001", once())
            .await
            .unwrap()
            .is_none(),
        "held elsewhere"
    );
    let err = other
        .acquire(
            "order:1001",
            AcquireOptions::new().wait(Duration::from_millis(200)),
        )
        .await
        .unwrap_err();
    // The error names the key as telemetry does: by its hash, unless keys are recorded.
    let hash = shardlock::LockKey::new("order:1001").unwrap().label_hash();
    match &err {
        Error::Timeout { key_label, .. } => assert_eq!(key_label, &hash),
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains(&hash), "{err}");
    assert!(!err.to_string().contains("order:1001"), "{err}");
    let recording =
        LockRouter::from_yaml_str(&cluster.config_yaml("telemetry:\n  record-keys: true\n"))
            .await
            .unwrap();
    let err = recording.acquire("order:1001", once()).await.unwrap_err();
    assert!(err.to_string().contains("`order:1001`"), "{err}");

    let (shard, row) = router.inspect("order:1001").await.unwrap();
    let row = row.unwrap();
    assert_eq!(shard, g.shard());
    assert_eq!(row.owner.as_deref(), Some(g.owner()));
    assert!(
        row.fence >= g.fence(),
        "the row stores the top of the fences reserved for this grant"
    );
    assert!(row.is_held());

    let first = g.fence();
    g.release().await.unwrap();
    let g2 = other
        .try_acquire("order:1001", once())
        .await
        .unwrap()
        .expect("free after release");
    assert!(g2.fence() > first, "fence {} after {first}", g2.fence());
    let third = router.acquire(
        "order:1001",
        AcquireOptions::new().wait(Duration::from_secs(5)),
    );
    let sent = router.stats().acquire_statements;
    let (third, released) = tokio::join!(third, async {
        // Released once the third caller found the key held: it waits, then gets it.
        let refused = common::eventually(Duration::from_secs(5), || async {
            router.stats().acquire_statements > sent
        })
        .await;
        assert!(refused, "the third caller never asked the shard");
        g2.release().await
    });
    released.unwrap();
    let third = third.unwrap();
    assert!(third.fence() > first);
    third.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn one_statement_per_acquire_and_per_release() {
    let (cluster, router, _) = common::start(1, common::NO_HEARTBEAT).await;
    let shard = cluster.shard(0);
    // Warm the pool and the statement cache.
    router
        .acquire("warm", once())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    common::until_placement_recorded(&cluster).await;
    let before = common::dml_statements(shard).await;
    let cycles = 50;
    for i in 0..cycles {
        let g = router.acquire(&format!("k{i}"), once()).await.unwrap();
        g.release().await.unwrap();
    }
    let after_cycles = common::dml_statements(shard).await;
    assert_eq!(
        after_cycles - before,
        2 * cycles,
        "two statements per lock cycle"
    );

    // A lease left behind by a crashed holder (expired on the shard's clock) is taken over in
    // one statement too.
    use shardlock::mysql_async::prelude::Queryable;
    let mut conn = shard.connect().await.unwrap();
    conn.query_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         VALUES ('stale', 'crashed:1', 5, 1000, '2020-01-01', '2020-01-01')",
    )
    .await
    .unwrap();
    let before = common::dml_statements(shard).await;
    let took = router.acquire("stale", once()).await.unwrap();
    assert_eq!(
        common::dml_statements(shard).await - before,
        1,
        "takeover is one statement"
    );
    assert!(took.fence() > 5);
    took.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_are_compared_byte_for_byte_and_stored_literally() {
    let (cluster, router, _) = common::start(1, "").await;
    let a = router.acquire("Order:1", once()).await.unwrap();
    let b = router
        .try_acquire("order:1", once())
        .await
        .unwrap()
        .expect("case differs: another lock");
    let nasty = "k'; DROP TABLE shardlock_lease; -- \\ \" %_ \u{0}";
    let c = router.acquire(nasty, once()).await.unwrap();
    let long = "L".repeat(1024);
    let d = router.acquire(&long, once()).await.unwrap();
    let long2 = format!("{}M", "L".repeat(1023));
    let e = router.acquire(&long2, once()).await.unwrap();
    assert!(router.try_acquire(&long, once()).await.unwrap().is_none());

    use shardlock::mysql_async::prelude::Queryable;
    let mut conn = cluster.shard(0).connect().await.unwrap();
    let keys: Vec<Vec<u8>> = conn
        .query("SELECT lock_key FROM shardlock_lease")
        .await
        .unwrap();
    assert!(
        keys.contains(&nasty.as_bytes().to_vec()),
        "stored literally"
    );
    assert!(keys.contains(&b"Order:1".to_vec()) && keys.contains(&b"order:1".to_vec()));
    assert_eq!(
        keys.iter()
            .filter(|k| k.len() == 33 && k[0] == 0xFF)
            .count(),
        2,
        "long keys as digests"
    );
    for g in [a, b, c, d, e] {
        g.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn reentrancy_is_explicit_and_counted() {
    let (_cluster, router, _) = common::start(1, "").await;
    let g = router.acquire("job:1", once()).await.unwrap();
    // Not implicit: a second acquire in the same process waits like anyone else.
    assert!(router.try_acquire("job:1", once()).await.unwrap().is_none());
    let inner = g.reenter().unwrap();
    assert_eq!((inner.fence(), g.holds()), (g.fence(), 2));
    inner.release().await.unwrap();
    assert!(
        router.try_acquire("job:1", once()).await.unwrap().is_none(),
        "outer hold remains"
    );
    g.release().await.unwrap();
    let last = router
        .try_acquire("job:1", once())
        .await
        .unwrap()
        .expect("free after the last hold");
    last.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_taken_over_lease_is_reported_lost_and_release_leaves_the_new_row() {
    let (cluster, router, _) = common::start(1, "").await;
    let ttl = AcquireOptions::new()
        .ttl(Duration::from_millis(600))
        .wait(Duration::ZERO);
    let g = router.acquire("pay:9", ttl).await.unwrap();
    // Another owner takes the row over behind our back (as after a force-release).
    use shardlock::mysql_async::prelude::Queryable;
    let mut conn = cluster.shard(0).connect().await.unwrap();
    conn.query_drop("UPDATE shardlock_lease SET owner = 'intruder:1', fence = fence + 1 WHERE lock_key = 'pay:9'")
        .await
        .unwrap();
    // The next renewal (every ttl/3) notices.
    tokio::time::timeout(Duration::from_secs(10), g.lost())
        .await
        .expect("lost() completes");
    assert!(!g.is_held());
    let err = g.release().await.unwrap_err();
    match &err {
        Error::LockLost { key_label } => {
            assert_eq!(
                key_label,
                &shardlock::LockKey::new("pay:9").unwrap().label_hash()
            )
        }
        other => panic!("{other}"),
    }
    let owner: Option<String> = conn
        .query_first("SELECT owner FROM shardlock_lease WHERE lock_key = 'pay:9'")
        .await
        .unwrap();
    assert_eq!(
        owner.as_deref(),
        Some("intruder:1"),
        "someone else's lease is left intact"
    );
    assert_eq!(router.stats().lost, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_local_waiter_is_handed_the_lease_by_the_release_statement() {
    // No in-memory hand-offs: the shard serves every grant.
    let extra = format!(
        "{}namespaces:\n  default:\n    handoff-max-count: 0\n",
        common::NO_HEARTBEAT
    );
    let (cluster, router, _) = common::start(1, &extra).await;
    let g = router.acquire("sku:7", once()).await.unwrap();
    common::until_placement_recorded(&cluster).await;
    let waiter = tokio::spawn({
        let router = router.clone();
        async move {
            router
                .acquire("sku:7", AcquireOptions::new().wait(Duration::from_secs(10)))
                .await
        }
    });
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            router.stats().queued == 1
        })
        .await
    );
    let before = common::dml_statements(cluster.shard(0)).await;
    let first = g.fence();
    g.release().await.unwrap();
    let next = waiter.await.unwrap().unwrap();
    assert_eq!(
        common::dml_statements(cluster.shard(0)).await - before,
        1,
        "release and grant in one statement"
    );
    assert_eq!(router.stats().handoffs, 1);
    assert!(next.fence() > first);
    let (_, row) = router.inspect("sku:7").await.unwrap();
    assert_eq!(
        row.unwrap().owner.as_deref(),
        Some(next.owner()),
        "the row names the new holder"
    );
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_key_wanted_by_another_process_is_released_to_it_not_handed_off() {
    // A long backoff cap: the local waiter yields that long after such a release. No
    // in-memory hand-offs: the release goes through the shard, where the mark is seen.
    let (_cluster, router, yaml) = common::start(
        1,
        "namespaces:\n  default:\n    backoff-cap: 3s\n    handoff-max-count: 0\n",
    )
    .await;
    let other = shardlock::LockRouter::from_yaml_str(&yaml).await.unwrap();
    let g = router.acquire("sku:8", once()).await.unwrap();
    let local = tokio::spawn({
        let router = router.clone();
        async move {
            router
                .acquire("sku:8", AcquireOptions::new().wait(Duration::from_secs(20)))
                .await
        }
    });
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            router.stats().queued == 1
        })
        .await
    );
    // The other process fails once, which marks the row as wanted.
    assert!(other.try_acquire("sku:8", once()).await.unwrap().is_none());
    g.release().await.unwrap();
    assert_eq!(
        router.stats().handoffs,
        0,
        "not handed off past a waiting process"
    );
    let theirs = other
        .try_acquire("sku:8", once())
        .await
        .unwrap()
        .expect("released for everyone");
    theirs.release().await.unwrap();
    local.await.unwrap().unwrap().release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn in_memory_hand_offs_take_fences_the_shard_reserved() {
    let extra = format!(
        "{}namespaces:\n  default:\n    handoff-max-count: 3\n    handoff-max-time: 5s\n",
        common::NO_HEARTBEAT
    );
    let (cluster, router, yaml) = common::start(1, &extra).await;
    let g = router.acquire("sku:9", once()).await.unwrap();
    common::until_placement_recorded(&cluster).await;
    let waiters: Vec<_> = (0..5)
        .map(|_| {
            let router = router.clone();
            tokio::spawn(async move {
                let g = router
                    .acquire("sku:9", AcquireOptions::new().wait(Duration::from_secs(10)))
                    .await?;
                let fence = g.fence();
                g.release().await?;
                Ok::<_, shardlock::Error>(fence)
            })
        })
        .collect();
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            router.stats().queued == 5
        })
        .await
    );
    let before = common::dml_statements(cluster.shard(0)).await;
    let first = g.fence();
    g.release().await.unwrap();
    let mut fences = vec![first];
    for w in waiters {
        fences.push(w.await.unwrap().unwrap());
    }
    let statements = common::dml_statements(cluster.shard(0)).await - before;
    let stats = router.stats();
    // Three grants in memory (the reserve), then one through the shard, whose reserve covers
    // the last waiter; then the final release.
    assert_eq!((stats.local_handoffs, stats.handoffs), (4, 1), "{stats:?}");
    assert_eq!(statements, 2, "one hand-off statement and one release");
    // Waiters are served in queue order, which is not the order they were spawned in.
    let mut in_grant_order = fences.clone();
    in_grant_order.sort_unstable();
    in_grant_order.dedup();
    assert_eq!(
        in_grant_order.len(),
        fences.len(),
        "every grant has its own fence: {fences:?}"
    );
    assert_eq!(
        in_grant_order[0], first,
        "later grants have larger fences: {fences:?}"
    );
    // Whoever gets the key next through the shard is above every fence handed out here.
    let other = shardlock::LockRouter::from_yaml_str(&yaml).await.unwrap();
    let next = other.acquire("sku:9", once()).await.unwrap();
    assert!(
        next.fence() > *fences.last().unwrap(),
        "{} after {fences:?}",
        next.fence()
    );
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_are_pinned_whatever_the_servers_defaults() {
    let (cluster, _setup, yaml) = common::start(1, "").await;
    // Defaults that would break the lease statements if a session inherited them.
    let mut admin = cluster.shard(0).connect().await.unwrap();
    admin
        .query_drop("SET GLOBAL sql_mode = 'SIMULTANEOUS_ASSIGNMENT', GLOBAL autocommit = 0")
        .await
        .unwrap();
    let a = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let b = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let once = || AcquireOptions::new().wait(Duration::ZERO);
    let mut last = 0;
    for _ in 0..3 {
        let g = a.acquire("k", once()).await.unwrap();
        assert!(g.fence() > last);
        assert!(
            b.try_acquire("k", once()).await.unwrap().is_none(),
            "b sees it held"
        );
        last = g.fence();
        g.release().await.unwrap();
        let g = b.acquire("k", once()).await.unwrap();
        assert!(g.fence() > last);
        last = g.fence();
        g.release().await.unwrap();
    }
    admin
        .query_drop("SET GLOBAL sql_mode = DEFAULT, GLOBAL autocommit = 1")
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_handed_the_lock_gets_the_ttl_it_asked_for() {
    let (_cluster, router, _) = common::start(1, "").await;
    let held = router
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(1)))
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let router = router.clone();
        async move {
            router
                .acquire(
                    "k",
                    AcquireOptions::new()
                        .ttl(Duration::from_secs(5))
                        .wait(Duration::from_secs(10)),
                )
                .await
                .unwrap()
        }
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued);
    held.release().await.unwrap();
    let next = waiter.await.unwrap();
    let (_, row) = router.inspect("k").await.unwrap();
    assert_eq!(
        row.unwrap().ttl_ms,
        5000,
        "the row carries the waiter's ttl"
    );
    next.release().await.unwrap();
}

/// A namespace with a `key-prefix` locks its keys in its own scope: the same key in two
/// scoped namespaces is two locks, and the lock is the prefixed key, as tools see it. The
/// prefix cannot change in a reload.
#[tokio::test(flavor = "multi_thread")]
async fn namespaces_with_key_prefixes_lock_their_own_keys() {
    let scopes =
        "namespaces:\n  billing:\n    key-prefix: billing/\n  stock:\n    key-prefix: stock/\n";
    let (cluster, router, _yaml) = common::start(2, scopes).await;
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(scopes))
        .await
        .unwrap();
    let billing = AcquireOptions::new().namespace("billing");
    let stock = AcquireOptions::new().namespace("stock");

    let b = router.acquire("order:1", billing.clone()).await.unwrap();
    let s = router.acquire("order:1", stock.clone()).await.unwrap();
    let plain = router
        .acquire("order:1", AcquireOptions::new())
        .await
        .unwrap();
    assert_eq!(b.key(), "order:1", "the key as the caller wrote it");
    assert_eq!(b.shard(), router.shard_for("billing/order:1").unwrap());
    let (_, row) = router.inspect("billing/order:1").await.unwrap();
    assert_eq!(row.unwrap().owner.as_deref(), Some(b.owner()));
    let (_, row) = router.inspect("stock/order:1").await.unwrap();
    assert_eq!(row.unwrap().owner.as_deref(), Some(s.owner()));
    // Errors, spans and metrics name the lock with its scope.
    let recording = LockRouter::from_yaml_str(
        &cluster.config_yaml(&format!("{scopes}telemetry:\n  record-keys: true\n")),
    )
    .await
    .unwrap();
    let err = recording
        .acquire("order:1", billing.clone().wait(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("`billing/order:1`"), "{err}");
    // Within a scope it is one lock for every process.
    assert!(other
        .try_acquire("order:1", billing.clone().wait(Duration::ZERO))
        .await
        .unwrap()
        .is_none());
    b.release().await.unwrap();
    let again = other
        .try_acquire("order:1", billing.clone().wait(Duration::ZERO))
        .await
        .unwrap()
        .expect("free once released");
    again.release().await.unwrap();
    s.release().await.unwrap();
    plain.release().await.unwrap();

    let moved = cluster.config_yaml(
        "namespaces:\n  billing:\n    key-prefix: payments/\n  stock:\n    key-prefix: stock/\n",
    );
    let err = router
        .reload(shardlock::Config::from_yaml_str(&moved).unwrap())
        .await
        .unwrap_err();
    match &err {
        Error::Config(e) => assert_eq!(
            e.field.as_deref(),
            Some("namespaces.billing.key-prefix"),
            "{e}"
        ),
        other => panic!("{other}"),
    }
    // Nor can a scoped namespace leave (it could come back with another prefix later).
    let gone = cluster.config_yaml("namespaces:\n  stock:\n    key-prefix: stock/\n");
    let err = router
        .reload(shardlock::Config::from_yaml_str(&gone).unwrap())
        .await
        .unwrap_err();
    match &err {
        Error::Config(e) => assert_eq!(e.field.as_deref(), Some("namespaces.billing"), "{e}"),
        other => panic!("{other}"),
    }
}

/// A release that hands the lease to a waiter through the shard, held up on its way past the
/// lease's end (a slow link), finds the row ended under its owner: released as any release
/// would be, and answered released, not lost (nobody else held the key meanwhile).
#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_held_up_past_the_leases_end_is_answered_released() {
    let (cluster, _, _) = common::start(1, "").await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    // Every hand-off through the shard; no renewal to keep the row alive.
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 10s\n\
         cleaner:\n  registry: static\nnamespaces:\n  default:\n    handoff-max-count: 0\n",
        proxy.url()
    ))
    .await
    .unwrap();
    let short = AcquireOptions::new()
        .ttl(Duration::from_secs(1))
        .keep_alive(false);
    let held = router.acquire("handed", short.clone()).await.unwrap();
    let waiter = tokio::spawn({
        let router = router.clone();
        async move {
            let wait = short.wait(Duration::from_secs(60));
            router.acquire("handed", wait).await
        }
    });
    let queued = common::eventually(Duration::from_secs(30), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the waiter never queued behind the holder");
    proxy.set(ProxyMode::Delay(Duration::from_millis(1500)));
    let released = held.release().await;
    assert!(
        released.is_ok(),
        "a hand-off held up past the lease's end answered {released:?}"
    );
    proxy.set(ProxyMode::Pass);
    waiter.await.unwrap().unwrap().release().await.unwrap();
}

/// A release that hands the lease to a waiter through the shard, answered only after the
/// waiter's lease may have ended there (a slow link), gives the waiter nothing: it got a
/// guard lost from the start, `Ok` yet never held, where a try answered that late counts the
/// key as busy. The waiter polls and gets a lease it holds.
#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_answered_past_the_waiters_lease_gives_it_no_guard() {
    let (cluster, _, _) = common::start(1, "").await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 30s\n\
         cleaner:\n  registry: static\nnamespaces:\n  default:\n    handoff-max-count: 0\n",
        proxy.url()
    ))
    .await
    .unwrap();
    // The holder's row outlasts the held-up statement; the waiter's lease (3 s) does not
    // outlast its answer (2 s each way).
    let holder = AcquireOptions::new()
        .ttl(Duration::from_secs(30))
        .keep_alive(false);
    let held = router.acquire("handed", holder).await.unwrap();
    let waiter = tokio::spawn({
        let router = router.clone();
        async move {
            let wait = AcquireOptions::new()
                .ttl(Duration::from_secs(3))
                .wait(Duration::from_secs(120));
            router.acquire("handed", wait).await
        }
    });
    let queued = common::eventually(Duration::from_secs(30), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the waiter never queued behind the holder");
    proxy.set(ProxyMode::Delay(Duration::from_secs(2)));
    held.release().await.unwrap();
    proxy.set(ProxyMode::Pass);
    let guard = waiter.await.unwrap().unwrap();
    assert!(
        guard.is_held(),
        "the waiter was handed a lease that had ended before it got it"
    );
    guard.release().await.unwrap();
}

/// A namespace removed by one reload cannot come back with other locks in a later one: a
/// lease taken in it before stays held (a leader's, a permit's), and under a new key prefix
/// (or bucket count) the same key would be another lock, granted beside it. Brought back as it
/// was, it is the same lock again.
#[tokio::test(flavor = "multi_thread")]
async fn a_namespace_removed_by_a_reload_comes_back_only_with_the_locks_it_had() {
    let (cluster, router, _) = common::start(1, "namespaces:\n  jobs: {}\n").await;
    let config = |namespaces: &str| {
        let yaml = cluster.config_yaml(&format!("namespaces:\n  default: {{}}\n{namespaces}"));
        shardlock::Config::from_yaml_str(&yaml).unwrap()
    };
    let jobs = AcquireOptions::new().namespace("jobs").wait(Duration::ZERO);
    let held = router.acquire("leader", jobs.clone()).await.unwrap();
    router.reload(config("")).await.unwrap();
    assert!(held.is_held(), "removing its namespace ended the lease");
    for (back, field) in [
        ("  jobs:\n    key-prefix: jobs/\n", "key-prefix"),
        ("  jobs:\n    buckets: 4\n", "buckets"),
    ] {
        match router.reload(config(back)).await {
            Err(Error::Config(e)) => {
                assert_eq!(e.field.as_deref(), Some("namespaces.jobs"), "{e}");
                assert!(e.to_string().contains(field), "{e}");
            }
            other => panic!("`jobs` came back with other locks ({field}): {other:?}"),
        }
    }
    router.reload(config("  jobs: {}\n")).await.unwrap();
    let second = router.try_acquire("leader", jobs).await.unwrap();
    assert!(second.is_none(), "a second holder of the key");
    held.release().await.unwrap();
}
