//! A reply lost after the server acted: the grant it carried is given back, so the key is not
//! blocked for the lease's whole ttl.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Config, LockRouter};
use shardlock_testkit::{Cluster, HeldRequest, Proxy, ProxyMode};

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_whose_reply_was_lost_is_given_back() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, "", "").await;
    lose_the_grant(&router, &proxy, "k").await;
    // The server did grant it: the reply was lost on the way back.
    let (_, row) = other.inspect("k").await.unwrap();
    let row = row.expect("the acquire reached the server");
    assert!(row.is_held(), "{row:?}");

    // Once the link carries replies again the grant is given back, long before its minute.
    proxy.set(ProxyMode::Pass);
    let freed = freed_within(&other, "k", Duration::from_secs(10)).await;
    assert!(freed, "the key stayed blocked by a grant nobody knew of");
}

/// A grant whose reply was lost while the shard's breaker opened is given back once the shard
/// answers again, though nothing else of the process calls it: the give-back probes the
/// half-open breaker itself rather than wait for callers to close it, which would leave the
/// key held by nobody for the lease's whole ttl. While the shard still refuses connections,
/// such a probe's failure reopens the breaker, as a caller's would: give-backs do not keep
/// probing a dead shard every few milliseconds, whatever the cool-down.
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_lost_behind_an_opening_breaker_is_given_back_by_a_probe() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let breaker = "breaker:\n  consecutive-failures: 1\n  cooldown: 1s\n";
    let (router, proxy) = behind_proxy(&cluster, "", breaker).await;

    // The lost reply is the one failure that opens the breaker, before the give-back it
    // starts sends anything: the give-back cannot free the key while replies are lost.
    lose_the_grant(&router, &proxy, "k").await;
    assert_eq!(router.stats().breaker_opened, 1);
    // Refused from well before the cool-down ends: no give-back reaches the server meanwhile.
    proxy.set(ProxyMode::Reset);
    let (_, row) = other.inspect("k").await.unwrap();
    let row = row.expect("the acquire reached the server");
    assert!(row.is_held(), "{row:?}");
    let reopened = common::eventually(Duration::from_secs(10), || async {
        router.stats().breaker_opened >= 2
    })
    .await;
    assert!(
        reopened,
        "a give-back's refused probe left the breaker half-open"
    );
    proxy.set(ProxyMode::Pass);

    let freed = freed_within(&other, "k", Duration::from_secs(10)).await;
    assert!(
        freed,
        "the grant was not given back behind the breaker: {:?}",
        router.status().await
    );
}

/// A give-back admitted as a half-open breaker's probe that waits behind another transaction's
/// lock on its row until the statement times out decides nothing: the lock says nothing of
/// the shard's health, and a breaker reopened by it (its cool-down doubled each time) would
/// refuse the process's callers for as long as the lock is held. Once the lock is gone the key
/// is given back.
#[tokio::test(flavor = "multi_thread")]
async fn a_give_back_behind_a_locked_row_never_reopens_the_breaker() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let shard = cluster.shard(0);
    // A lock wait of 4.5 s under a 5 s statement timeout: a wait retried inside the call
    // times out.
    let (router, proxy) = behind_proxy(
        &cluster,
        "    statement-timeout: 5s\n",
        "breaker:\n  consecutive-failures: 1\n  cooldown: 3s\n",
    )
    .await;

    // Set up before the grant is lost: between the lost reply and the link's healing only
    // the row's lock is taken (one statement on an open connection), well within the 3 s
    // cool-down, so that no give-back probes the breaker while replies are still lost (its
    // failed connection would reopen it, as it should).
    let mut competitor = shardlock_testkit::Competitor::begin(shard, false)
        .await
        .unwrap();
    let begun = shard.lock_waits_begun().await.unwrap();
    lose_the_grant(&router, &proxy, "k").await;
    assert_eq!(router.stats().breaker_opened, 1);
    competitor.lock(b"k").await.unwrap();
    proxy.set(ProxyMode::Pass);
    // The give-back's first call waits twice (once more after the lock wait's error) and
    // times out; a third wait is its next call's.
    while shard.lock_waits_begun().await.unwrap() < begun + 3 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    competitor.end().await.unwrap();

    let freed = freed_within(&other, "k", Duration::from_secs(15)).await;
    assert!(freed, "the key was not given back once the lock was gone");
    assert_eq!(
        router.stats().breaker_opened,
        1,
        "a give-back waiting on a locked row reopened the breaker"
    );
}

/// A release whose reply is lost after the server freed the row is retried; the retry finds
/// the row free and answers released, not "lost"; so does one whose retry finds the key
/// already taken by another owner, which the lost try had freed it for (the lease could not
/// have ended yet). A lease force-released behind its holder's back still answers
/// `LockLost`, although its row is just as free, also when its release's reply is lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_release_whose_reply_was_lost_answers_released() {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    // The release statement prepared on the one connection: the reply lost is the one to
    // the release itself.
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let guard = router.acquire("r", AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::LoseOneReply);
    guard.release().await.unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "a reply was lost");
    let (_, row) = direct.inspect("r").await.unwrap();
    assert!(!row.expect("the row").is_held());

    let guard = router.acquire("t", AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::LoseOneReplyThenBlackhole);
    let release = tokio::spawn(guard.release());
    // The release's reply is lost; its retry waits on the cut link while another owner takes
    // the key the release freed.
    proxy.wait_for(ProxyMode::Blackhole).await;
    let taker = direct
        .try_acquire("t", AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap()
        .expect("the release freed the key before its reply was lost");
    proxy.set(ProxyMode::Pass);
    release.await.unwrap().expect("released, not lost");
    taker.release().await.unwrap();
    assert_eq!(router.stats().lost, 0);

    let guard = router.acquire("f", AcquireOptions::new()).await.unwrap();
    direct
        .force_release("f")
        .await
        .unwrap()
        .expect("force-released");
    let err = guard.release().await.unwrap_err();
    assert!(matches!(err, shardlock::Error::LockLost { .. }), "{err}");
    assert_eq!(router.stats().lost, 1);

    // Force-released, then the release's reply lost: its retry finds the row freed, but by
    // force (no owner at all), not by its first try (which leaves its tombstone).
    let guard = router.acquire("g", AcquireOptions::new()).await.unwrap();
    direct
        .force_release("g")
        .await
        .unwrap()
        .expect("force-released");
    proxy.set(ProxyMode::LoseOneReply);
    let answer = guard.release().await;
    assert_eq!(proxy.mode(), ProxyMode::Pass, "a reply was lost");
    let err = answer.expect_err("a lease revoked before its release was answered as released");
    assert!(matches!(err, shardlock::Error::LockLost { .. }), "{err}");
    assert_eq!(router.stats().lost, 2);
}

/// A force-release whose reply is lost after the server freed the key is sent again and
/// finds no such holder any more: it still tells the operator whose lease it ended, at which
/// fence, rather than that nobody held the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_force_release_whose_reply_was_lost_still_names_the_holder_it_evicted() {
    let (cluster, holder, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (operator, proxy) = behind_proxy(&cluster, "", "").await;
    let guard = holder
        .acquire("evict", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    // The one request carrying the holder's owner: the release itself (the look before it
    // names the key only).
    let owner: &'static [u8] = Box::leak(guard.owner().as_bytes().into());
    proxy.set(ProxyMode::LoseReplyTo(owner));
    let evicted = operator.force_release("evict").await.unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "no reply was lost");
    let evicted = evicted.expect("the force-release said nobody held the key");
    assert_eq!(evicted.owner, guard.owner());
    assert!(evicted.was_live && evicted.fence > guard.fence());
    let err = guard.release().await.unwrap_err();
    assert!(matches!(err, shardlock::Error::LockLost { .. }), "{err}");
}

/// A release that failed (the shard cut off: the statement and its retry both refused) is
/// given back once the shard answers again, though its caller has its error and is gone: the
/// key is free then, not only at the end of its minute-long lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_release_is_given_back_once_the_shard_answers() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let long = AcquireOptions::new().ttl(Duration::from_secs(60));
    let guard = router.acquire("cut", long).await.unwrap();
    proxy.set(ProxyMode::Reset);
    guard
        .release()
        .await
        .expect_err("released through a cut link");
    let (_, row) = other.inspect("cut").await.unwrap();
    assert!(
        row.expect("the lease's row").is_held(),
        "the release reached the shard"
    );

    proxy.set(ProxyMode::Pass);
    let freed = freed_within(&other, "cut", Duration::from_secs(10)).await;
    assert!(freed, "the key stayed held after its holder released it");
}

/// A lease released while its key's move to a new shard is under way, after a try there whose
/// reply was lost, gives that try's row back once the new shard answers again, though the
/// shard was cut off when the lease ended: the key is free then, not only at the end of its
/// minute-long lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_move_given_up_after_a_lost_reply_gives_its_row_back_once_the_shard_answers() {
    let (cluster, other, _) = common::start(2, "cleaner:\n  registry: static\n").await;
    let proxy = Proxy::start(cluster.shard(1).port()).await.unwrap();
    // s1 alone, then s1 and s2 (through the proxy), with a move window long enough that the
    // move is still under way when the lease ends.
    let yaml = |s2: &str| {
        format!(
            "shards:\n  - name: s1\n    url: {}\n{s2}routing:\n  move-window: 30s\n\
             breaker:\n  consecutive-failures: 1\n  cooldown: 1s\ncleaner:\n  registry: static\n",
            cluster.shard(0).url()
        )
    };
    let router = LockRouter::from_yaml_str(&yaml("")).await.unwrap();
    let key = common::key_on(&other, "moving", "s2");
    let long = AcquireOptions::new().ttl(Duration::from_secs(60));
    let held = router.acquire(&key, long).await.unwrap();

    // The move's first try on s2 (the one request carrying the lease's owner) is granted with
    // its reply lost, which opens the breaker; then the link is cut.
    let owner: &'static [u8] = Box::leak(held.owner().as_bytes().into());
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(owner));
    let two = format!("  - name: s2\n    url: {}\n", proxy.url());
    let two = shardlock::Config::from_yaml_str(&yaml(&two)).unwrap();
    router.reload(two).await.unwrap();
    proxy.wait_for(ProxyMode::Blackhole).await;
    proxy.set(ProxyMode::Reset);
    let (shard, row) = other.inspect(&key).await.unwrap();
    assert_eq!(shard, "s2");
    assert!(row.expect("the try reached s2").is_held(), "{key}");

    // The lease ends while s2 refuses connections: the move gives up its try's row then.
    held.release().await.unwrap();
    let reopened = common::eventually(Duration::from_secs(10), || async {
        router.stats().breaker_opened >= 2
    })
    .await;
    assert!(
        reopened,
        "nothing probed s2 after the move gave up: {:?}",
        router.stats()
    );
    proxy.set(ProxyMode::Pass);
    let freed = freed_within(&other, &key, Duration::from_secs(10)).await;
    assert!(
        freed,
        "the move's row stayed held after its lease ended: {:?}",
        router.status().await
    );
}

/// An acquire whose connection broke while its statement was still on its way to the shard
/// (held in a partition's retransmissions, say) is retried on another connection and granted.
/// The broken connection's session (one reset since it opened) is ended first, so that the
/// statement, reaching the shard after the lease was released, grants nothing: the key is not
/// left held by nobody for the lease's ttl.
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_that_reaches_the_shard_after_its_retry_grants_nothing() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    // The pool's one connection lent for a transaction and reset since: its session took its
    // lock again.
    let tx = router
        .lock_in_transaction("tx", Duration::from_secs(5))
        .await
        .unwrap();
    tx.commit().await.unwrap();
    proxy.set(ProxyMode::StrandTo(b"stranded-key"));
    let long = AcquireOptions::new().ttl(Duration::from_secs(60));
    let guard = router.acquire("stranded-key", long).await.unwrap();
    assert_eq!(
        proxy.mode(),
        ProxyMode::Pass,
        "the acquire was not held back"
    );
    guard.release().await.unwrap();

    arrives_too_late(&proxy, &other, "stranded-key").await;
}

/// A try that times out with its statement still on the way (held in a partition's
/// retransmissions, say) is dropped mid-statement, its connection not broken: its session is
/// listed all the same and ended before the shard's next statement, so the statement,
/// arriving after the key was granted to another owner and released, grants nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_statement_whose_try_timed_out_grants_nothing_when_it_arrives() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let shard = format!("    statement-timeout: 1s\n{POOL_OF_ONE}");
    let (router, proxy) = behind_proxy(&cluster, &shard, "").await;
    proxy.set(ProxyMode::HoldTo(b"held-key"));
    let long = AcquireOptions::new().ttl(Duration::from_secs(60));
    let timed_out = router.acquire("held-key", long.clone()).await;
    assert!(
        matches!(&timed_out, Err(shardlock::Error::Unavailable { source, .. }) if source.maybe_applied),
        "the held acquire did not time out: {timed_out:?}"
    );
    assert_eq!(
        proxy.mode(),
        ProxyMode::Pass,
        "the acquire was not held back"
    );
    let guard = router.acquire("held-key", long).await.unwrap();
    guard.release().await.unwrap();

    arrives_too_late(&proxy, &other, "held-key").await;
}

/// A transaction lock given up with its lock statement still on the way (held in a
/// partition's retransmissions, say) leaves no row locked. Arriving late, the statement locks
/// the row in a transaction nobody holds, which the server would keep until it noticed the
/// connection gone: hours, on a network gone silent. The process's next statement on the
/// shard ends that session, whatever the statement is (a heartbeat, a lease's).
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_given_up_on_the_wire_is_ended_by_the_next_statement() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let _link = strand_a_transaction_lock(&router, &proxy, &cluster).await;

    the_next_statement_frees_the_row(&router, &other).await;
}

/// As above, when the next thing the process does on the shard is lock the same row: the
/// session it lends for that transaction first ends the stranded one, which would otherwise
/// make it wait out its whole wait. A transaction lock committed lists nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_given_up_on_the_wire_does_not_block_the_next_one() {
    let (cluster, _, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let _link = strand_a_transaction_lock(&router, &proxy, &cluster).await;

    let tx = router
        .lock_in_transaction("tx-key", Duration::from_secs(5))
        .await;
    assert!(
        tx.is_ok(),
        "the stranded session still held the row: {tx:?}"
    );
    tx.unwrap().commit().await.unwrap();
    assert_eq!(
        router.status().await[0].pool.stranded,
        0,
        "a committed transaction lock listed its session"
    );
}

/// A transaction lock's guard dropped while its link is cut: the connection's close never
/// reaches the server, whose session keeps the transaction, and the row, until it notices
/// (hours, on a silent network). The process's next statement on the shard ends it.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_dropped_while_cut_off_is_ended_by_the_next_statement() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let tx = router
        .lock_in_transaction("tx-key", Duration::from_secs(2))
        .await
        .unwrap();
    proxy.set(ProxyMode::HoldClose);
    drop(tx);
    let _link = proxy.held().await;
    assert!(
        a_tx_row_is_locked(&cluster).await,
        "the row was freed though its session never heard the close"
    );

    the_next_statement_frees_the_row(&router, &other).await;
}

/// A transaction lock's `COMMIT` whose answer is lost says that it may have committed, as it
/// did.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_commit_whose_answer_is_lost_may_have_applied() {
    let (cluster, _, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let mut admin = cluster.shard(0).connect().await.unwrap();
    admin
        .query_drop("CREATE TABLE paid (id INT PRIMARY KEY)")
        .await
        .unwrap();
    let mut tx = router
        .lock_in_transaction("tx-key", Duration::from_secs(2))
        .await
        .unwrap();
    tx.conn()
        .query_drop("INSERT INTO paid VALUES (1)")
        .await
        .unwrap();
    proxy.set(ProxyMode::LoseReplyTo(b"RELEASE SAVEPOINT"));
    let committed = tx.commit().await;
    assert_eq!(
        proxy.mode(),
        ProxyMode::Pass,
        "the COMMIT's answer was lost"
    );
    assert!(
        matches!(&committed, Err(shardlock::Error::Unavailable { source, .. }) if source.maybe_applied),
        "a lost COMMIT answer did not say it may have applied: {committed:?}"
    );
    let rows: Option<u64> = admin
        .query_first("SELECT COUNT(*) FROM paid")
        .await
        .unwrap();
    assert_eq!(rows, Some(1), "the COMMIT ran");
}

/// Gives up on a transaction lock of `tx-key` through `proxy` while its lock statement is
/// held back, then delivers the statement: its session, which nobody holds now, locks the row.
/// The session's link stays open while the result lives, as a partition's does until the
/// server notices.
async fn strand_a_transaction_lock(
    router: &LockRouter,
    proxy: &Proxy,
    cluster: &shardlock_testkit::Cluster,
) -> HeldRequest {
    proxy.set(ProxyMode::HoldTo(b"FOR UPDATE"));
    let given_up = router
        .lock_in_transaction("tx-key", Duration::from_secs(1))
        .await;
    assert!(
        matches!(given_up, Err(shardlock::Error::Timeout { .. })),
        "the held lock statement was not given up: {given_up:?}"
    );
    assert_eq!(proxy.mode(), ProxyMode::Pass, "the lock was not held back");
    let mut held = proxy.held().await;
    assert!(
        held.deliver().await,
        "the session was gone before its lock statement arrived"
    );
    assert!(
        a_tx_row_is_locked(cluster).await,
        "the late lock statement did not lock the row"
    );
    held
}

/// Whether a row of `shardlock_txlock` is locked on the one shard of `cluster`, by the
/// server's own answer to a locking read that waits for nothing.
async fn a_tx_row_is_locked(cluster: &shardlock_testkit::Cluster) -> bool {
    let mut conn = cluster.shard(0).connect().await.unwrap();
    conn.query_drop("START TRANSACTION").await.unwrap();
    let read = conn
        .query_drop("SELECT lock_key FROM shardlock_txlock FOR UPDATE NOWAIT")
        .await;
    match read {
        Ok(()) => false,
        // MariaDB answers a locked row's NOWAIT with 1205, MySQL with 3572.
        Err(shardlock::mysql_async::Error::Server(e)) if e.code == 1205 || e.code == 3572 => true,
        Err(e) => panic!("the locking read failed: {e}"),
    }
}

/// Takes and releases a lease through `router`, a statement on its shard; then `other` must
/// be able to lock `tx-key`'s row.
async fn the_next_statement_frees_the_row(router: &LockRouter, other: &LockRouter) {
    let lease = router
        .acquire("another-key", AcquireOptions::new())
        .await
        .unwrap();
    lease.release().await.unwrap();
    let tx = other
        .lock_in_transaction("tx-key", Duration::from_secs(2))
        .await;
    assert!(
        tx.is_ok(),
        "the row stayed locked after the next statement: {tx:?}"
    );
    tx.unwrap().commit().await.unwrap();
}

/// Delivers the acquire of `key` that `proxy` held back, now that its lease was released: its
/// session must have been ended, and `key` left free.
async fn arrives_too_late(proxy: &Proxy, other: &LockRouter, key: &str) {
    let ran = proxy.held().await.deliver().await;
    let (_, row) = other.inspect(key).await.unwrap();
    let row = row.expect("the lease's row");
    assert!(
        !row.is_held(),
        "the held-back acquire ran after the release: {row:?}"
    );
    assert!(
        !ran,
        "the session was still open when its statement arrived"
    );
}

/// Where a session cannot be ended before the retry (behind a proxy that keeps sessions of its
/// own, as here; on a Galera node), an acquire whose first try was cut off on the wire and
/// whose retry found someone else's row says so (`Held` after a lost try): the first try may
/// still reach the server and take the key once the row is free (shown below, for an owner
/// its caller would count as holding nothing), so the answer proves no row of the owner's to
/// come. Alone and in a batch.
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_whose_cut_off_try_may_still_land_says_so_when_it_finds_the_key_held() {
    let (cluster, _router, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    proxy.renumber_sessions();
    let direct = common::backend_at(&cluster.shard(0).url());
    let behind = common::backend_at(&proxy.url());
    let request = |key: &str, owner: &str| common::grant_request(key.as_bytes(), owner, 0);
    // The owner's name is in the statement's parameters, alone or in a batch's document.
    let cases: [(&str, &'static str, bool); 2] = [
        ("cut-off:alone", "cut-off-owner-1", false),
        ("cut-off:batched", "cut-off-owner-2", true),
    ];
    for (key, owner, batched) in cases {
        let held = direct.acquire(&request(key, "someone")).await.unwrap();
        assert!(
            matches!(held, shardlock_mysql::Attempt::Granted { .. }),
            "{held:?}"
        );
        proxy.set(ProxyMode::StrandTo(owner.as_bytes()));
        let answer = if batched {
            let free = format!("{key}:free");
            let reqs = [request(key, owner), request(&free, owner)];
            let grants = behind.acquire_batch(&reqs).await.unwrap();
            assert!(
                grants.after_lost_try,
                "the batch did not say a try was lost"
            );
            grants.attempts[0]
        } else {
            behind.acquire(&request(key, owner)).await.unwrap()
        };
        assert_eq!(
            proxy.mode(),
            ProxyMode::Pass,
            "the acquire was not held back"
        );
        assert!(
            matches!(
                answer,
                shardlock_mysql::Attempt::Held {
                    after_lost_try: true,
                    ..
                }
            ),
            "an acquire whose cut-off try may still land answered as if none could (batched: \
             {batched}): {answer:?}"
        );

        // Why: the cut-off try, arriving once the row is free, takes the key.
        direct.release(key.as_bytes(), "someone").await.unwrap();
        assert!(
            proxy.held().await.deliver().await,
            "the cut-off try did not run"
        );
        let row = direct
            .inspect(key.as_bytes())
            .await
            .unwrap()
            .expect("the key's row");
        assert!(
            row.is_held() && row.owner.as_deref() == Some(owner),
            "the cut-off try did not take the key once it was free: {row:?}"
        );
    }
}

/// The same cut-off try, where the retry was granted: once the lease is released, the try
/// arriving late takes the free row again for an owner nobody holds. Its row is given back
/// whenever it appears (for as long as it could last), so the key is not kept from everyone
/// for the try's whole ttl.
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_try_that_lands_after_its_grant_was_released_is_given_back() {
    let long = AcquireOptions::new().ttl(Duration::from_secs(600));
    let (_cluster, other, _router) = a_try_landing_after_its_release(long).await;
    let freed = freed_within(&other, "k", Duration::from_secs(30)).await;
    assert!(
        freed,
        "a cut-off try that landed after its grant was released kept the key from everyone"
    );
}

/// The same, for a lease that keeps its key taken a while after its grant (`lock_at_least`,
/// a scheduled run's interval): the row the late try took is released as its holder's
/// release was, and stays taken until the hold ends rather than being freed.
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_try_landing_on_a_row_kept_for_a_minimum_hold_leaves_the_hold() {
    let kept = AcquireOptions::new()
        .ttl(Duration::from_secs(600))
        .lock_at_least(Duration::from_secs(600));
    let (_cluster, other, _router) = a_try_landing_after_its_release(kept).await;
    // Kept again (a zero ttl, its end the hold's) once the late try's row was released.
    let kept_again = common::eventually(Duration::from_secs(30), || async {
        let (_, row) = other.inspect("k").await.unwrap();
        row.is_some_and(|r| r.is_held() && r.ttl_ms == 0)
    })
    .await;
    let (_, row) = other.inspect("k").await.unwrap();
    assert!(
        kept_again,
        "the row a cut-off try took was not kept for the lease's minimum hold: {row:?}"
    );
}

/// On a plain shard the cut-off try's session is ended before the retry runs: it cannot land
/// later, and nothing watches for it once the lease is released (a watch would send a
/// release every half second for the lease's ttl).
#[tokio::test(flavor = "multi_thread")]
async fn a_cut_off_try_whose_session_was_ended_is_not_watched_for() {
    let (cluster, _other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = held_back_router_on(&cluster, false).await;
    let long = AcquireOptions::new().ttl(Duration::from_secs(600));
    let guard = cut_off_first_try(&router, &proxy, long).await;
    guard.release().await.unwrap();
    // Give-backs and watches in progress keep the shard settling.
    let settled = common::eventually(Duration::from_secs(30), || async {
        router.stats().settling == 0
    })
    .await;
    assert!(
        settled,
        "a lost try whose session was ended is watched for after its lease's release"
    );
}

/// A router behind a proxy that keeps sessions of its own (the shard's thread ids are not
/// the sessions', so a session cut off cannot be ended), instance id `held-back`.
async fn held_back_router(cluster: &Cluster) -> (LockRouter, Proxy) {
    held_back_router_on(cluster, true).await
}

/// [`held_back_router`], its proxy keeping sessions of its own if `renumber`.
async fn held_back_router_on(cluster: &Cluster, renumber: bool) -> (LockRouter, Proxy) {
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    if renumber {
        proxy.renumber_sessions();
    }
    let router = router_behind(&proxy, "", "instance:\n  id: held-back\n").await;
    (router, proxy)
}

/// Acquires `k` with `opts` while the first try is cut off on the wire (its statement held
/// back, still on its way): the retry, on another connection, is granted.
async fn cut_off_first_try(
    router: &LockRouter,
    proxy: &Proxy,
    opts: AcquireOptions,
) -> shardlock::LockGuard {
    proxy.set(ProxyMode::StrandTo(b"held-back:"));
    let guard = router.acquire("k", opts).await.unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "no try was held back");
    guard
}

/// One shard, a router on it, and the held-back router (kept: its give-backs run while it
/// lives) after it acquired `k` with `opts` while its first try was cut off on the wire,
/// released it, and the cut-off try then reached the server: it took `k` again for its owner
/// (a released row is anyone's, a kept one its owner's), which the give-back may undo at once.
async fn a_try_landing_after_its_release(
    opts: AcquireOptions,
) -> (Cluster, LockRouter, (LockRouter, Proxy)) {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = held_back_router(&cluster).await;
    let guard = cut_off_first_try(&router, &proxy, opts).await;
    guard.release().await.unwrap();
    assert!(
        proxy.held().await.deliver().await,
        "the cut-off try did not run"
    );
    (cluster, other, (router, proxy))
}

/// After a restart the shard's thread ids start over: the id of a session stranded before it
/// may be another client's by the time the next statement would end it. That session is left
/// alone (only a session still holding its own lock is ended), whatever it is running.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_given_a_stranded_thread_id_after_a_restart_is_left_alone() {
    let (cluster, _, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let shard = cluster.shard(0);
    // Thread ids well above those the restarted server hands out first.
    for _ in 0..20 {
        drop(shard.connect().await.unwrap());
    }
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    proxy.set(ProxyMode::StrandToThenBlackhole(b"stranded-key"));
    let long = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Duration::ZERO);
    let acquire = tokio::spawn({
        let router = router.clone();
        async move { router.try_acquire("stranded-key", long).await }
    });
    let stranded = proxy.held().await.thread();
    let listed = |router: LockRouter| async move { router.status().await[0].pool.stranded };
    assert_eq!(
        listed(router.clone()).await,
        1,
        "the session was not listed"
    );
    shard.restart().await.unwrap();
    // One session per connection: no switch to the Unix socket, which takes a second id.
    let tcp_only = format!("{}?prefer_socket=false", shard.url());
    let mut innocent = None;
    while innocent.is_none() {
        let conn = shardlock::mysql_async::Conn::from_url(tcp_only.as_str())
            .await
            .unwrap();
        assert!(conn.id() <= stranded, "no session got thread {stranded}");
        innocent = Some(conn).filter(|c| c.id() == stranded);
    }
    let mut innocent = innocent.unwrap();
    innocent.query_drop("BEGIN").await.unwrap();

    proxy.set(ProxyMode::Pass);
    let _ = acquire.await.unwrap();
    let after = router
        .acquire("after", AcquireOptions::new())
        .await
        .unwrap();
    after.release().await.unwrap();
    assert_eq!(
        listed(router.clone()).await,
        0,
        "the session was not looked up"
    );
    let alive = innocent
        .query_first::<u32, _>("SELECT CONNECTION_ID()")
        .await;
    assert!(
        matches!(alive, Ok(Some(id)) if id == stranded),
        "the session given thread {stranded} after the restart was ended: {alive:?}"
    );
}

/// A CAS take whose first try was cut off on the wire (behind a proxy that keeps sessions of
/// its own, so the try cannot be ended first) and landed while the retry was between its read
/// of the free row and its take: the retry's take changes nothing, and the row is the call's
/// own. Answered "owned by another", the take's row stayed owned for good (CAS rows never
/// expire) by a take nobody held.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_whose_cut_off_try_lands_during_its_retry_is_answered_as_taken() {
    let (cluster, _router, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    proxy.renumber_sessions();
    let behind = std::sync::Arc::new(common::backend_at(&proxy.url()));
    // The retry may send its take before the proxy is set to hold it (`StrandTo` passes
    // everything once it held the first): then another key is tried.
    for attempt in 0..5 {
        let key = format!("cut-off:{attempt}");
        // The owner's name is sent in the take's statement alone.
        proxy.set(ProxyMode::StrandTo(b"cut-off-cas-owner"));
        let mut take = tokio::spawn({
            let (behind, key) = (behind.clone(), key.clone());
            async move {
                let token = format!("cut-off-token-{attempt}");
                behind
                    .take_cas(key.as_bytes(), "cut-off-cas-owner", &token)
                    .await
            }
        });
        let mut first = proxy.held().await;
        // The retry read the row free and sends its take: held up while the first try lands.
        proxy.set(ProxyMode::PauseTo(b"cut-off-cas-owner"));
        tokio::select! {
            _ = proxy.wait_for(ProxyMode::Paused) => {}
            _ = &mut take => continue,
        }
        assert!(first.deliver().await, "the cut-off try did not run");
        assert_eq!(
            common::cas_owner(cluster.shard(0), &key).await.as_deref(),
            Some("cut-off-cas-owner"),
            "the cut-off try took the row"
        );
        proxy.set(ProxyMode::Pass);
        let answer = take.await.unwrap();
        assert!(
            matches!(answer, Ok(Some(_))),
            "a take whose own cut-off try took the row answered {answer:?}"
        );
        return;
    }
    panic!("the retry's take was never held up before it ran");
}

/// A shard's pool of one connection: a statement prepared once is prepared on the connection
/// the next call uses.
const POOL_OF_ONE: &str = "    pool:\n      max-size: 1\n";

/// A shard reached directly and through a proxy (1 s statements, a pool of one), the CAS take
/// and release statements prepared on the proxied connection.
async fn cas_behind_proxy() -> (Cluster, LockRouter, LockRouter, Proxy) {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let shard = format!("    statement-timeout: 1s\n{POOL_OF_ONE}");
    let (router, proxy) = behind_proxy(&cluster, &shard, "").await;
    let warm = router.cas_acquire("warm", "w").await.unwrap().unwrap();
    assert!(router.cas_release(warm).await.unwrap());
    (cluster, direct, router, proxy)
}

/// A CAS take whose reply was lost and whose retry failed (the link down) may have taken the
/// row: it is given back by the call's token once the shard answers, not left owned for good
/// with no guard to release it (CAS rows never expire).
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_whose_outcome_stayed_unknown_is_given_back_once_the_shard_answers() {
    let (cluster, direct, router, proxy) = cas_behind_proxy().await;
    // The owner's name is sent in the take's statement alone.
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(b"lost-take-owner"));
    let taken = router.cas_acquire("c", "lost-take-owner").await;
    assert!(taken.is_err(), "answered without a reply: {taken:?}");
    assert_eq!(
        common::cas_owner(cluster.shard(0), "c").await.as_deref(),
        Some("lost-take-owner"),
        "the take whose reply was lost was made"
    );
    proxy.set(ProxyMode::Pass);
    assert!(
        taken_again(&direct, "c").await,
        "the row stayed owned by a take nobody holds"
    );
}

/// A CAS take whose caller went away while its statement was on its way (a timeout around
/// the call), and that then reached the shard and committed, is given back: the take runs to
/// its end without its caller. Dropped with the call, it kept the key owned for good with no
/// guard to release it.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_whose_caller_went_away_is_given_back() {
    let (cluster, direct, router, proxy) = cas_behind_proxy().await;
    // The owner's name is sent in the take's statement alone.
    proxy.set(ProxyMode::HoldTo(b"gone-take-owner"));
    let gone = tokio::time::timeout(
        Duration::from_millis(100),
        router.cas_acquire("c", "gone-take-owner"),
    )
    .await;
    assert!(
        gone.is_err(),
        "answered while its statement was held: {gone:?}"
    );
    let mut held = proxy.held().await;
    assert!(held.deliver().await, "the held take did not run");
    assert_eq!(
        common::cas_owner(cluster.shard(0), "c").await.as_deref(),
        Some("gone-take-owner"),
        "the held take was made"
    );
    assert!(
        taken_again(&direct, "c").await,
        "the row stayed owned by a take whose caller went away"
    );
    drop(held);

    // The take's statement held up on its way while its caller gives up, then answered: the
    // take, answered `Taken` with nobody to hand it to, is released.
    proxy.set(ProxyMode::PauseTo(b"paused-take-owner"));
    let gone = tokio::time::timeout(
        Duration::from_millis(100),
        router.cas_acquire("d", "paused-take-owner"),
    )
    .await;
    assert!(
        gone.is_err(),
        "answered while its statement was held up: {gone:?}"
    );
    proxy.wait_for(ProxyMode::Paused).await;
    proxy.set(ProxyMode::Pass);
    assert!(
        taken_again(&direct, "d").await,
        "the row stayed owned by a take answered after its caller went away"
    );
}

/// A CAS take whose outcome stayed unknown on its key's old shard during a move, and that
/// another process's carry brought to the key's new shard before the old shard answered
/// again, is given back there: the copy bears the take's call token.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_of_unknown_outcome_carried_by_a_move_is_given_back_where_it_went() {
    // The taker's move stays in force throughout; the carrier's ends soon after its reload.
    let (long, top) = (
        "routing:\n  move-window: 10m\ncleaner:\n  registry: static\n",
        "routing:\n  move-window: 300ms\ncleaner:\n  registry: static\n",
    );
    let (cluster, _, _) = common::start(2, top).await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let s1 = |url: &str| {
        format!("  - name: s1\n    url: {url}\n    statement-timeout: 1s\n{POOL_OF_ONE}")
    };
    let s2 = format!("  - name: s2\n    url: {}\n", cluster.shard(1).url());
    let (via_proxy, direct) = (s1(&proxy.url()), s1(&cluster.shard(0).url()));
    let a = LockRouter::from_yaml_str(&format!("shards:\n{via_proxy}{long}"))
        .await
        .unwrap();
    let b = LockRouter::from_yaml_str(&format!("shards:\n{direct}{top}"))
        .await
        .unwrap();
    let two =
        |s1: &str, top: &str| Config::from_yaml_str(&format!("shards:\n{s1}{s2}{top}")).unwrap();
    a.reload(two(&via_proxy, long)).await.unwrap();
    let on = |shard: &'static str| {
        let a = &a;
        (0..)
            .map(|i| format!("c{i}"))
            .find(move |k| a.shard_for(k).unwrap() == shard)
            .unwrap()
    };
    let (moved, stayed) = (on("s2"), on("s1"));
    let warm = a.cas_acquire(&stayed, "w").await.unwrap().unwrap();
    assert!(a.cas_release(warm).await.unwrap());

    proxy.set(ProxyMode::LoseReplyToThenBlackhole(b"lost-take-owner"));
    let taken = a.cas_acquire(&moved, "lost-take-owner").await;
    assert!(taken.is_err(), "answered without a reply: {taken:?}");
    b.reload(two(&direct, top)).await.unwrap();
    common::moves_done(&b).await;
    assert_eq!(
        cas_owners(&cluster, &moved).await,
        [None, Some("lost-take-owner".to_owned())],
        "the take whose reply was lost was made, and carried to s2"
    );

    proxy.set(ProxyMode::Pass);
    assert!(
        taken_again(&b, &moved).await,
        "the carried take stayed owned with nobody holding it"
    );
}

/// As above across two reloads: the take of unknown outcome was made under the second
/// topology on the key's first shard, and before that shard answers again the taker reloads
/// once more and another process's carry brings the take to the key's shard under the third
/// topology. The give-back follows it there: where the key lives when the first shard is found
/// empty, not where it lived at the take.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_of_unknown_outcome_is_given_back_where_a_later_reload_carried_it() {
    let (cluster, proxy, a, b, moved) = Chain::with_a_lost_take().await;
    a.reload(Chain::config(&cluster, Some(&proxy), 3, LONG))
        .await
        .unwrap();
    b.reload(Chain::config(&cluster, None, 3, TOP))
        .await
        .unwrap();
    common::moves_done(&b).await;
    assert_eq!(
        cas_owners(&cluster, &moved).await,
        [None, None, Some("lost-take-owner".to_owned())],
        "the take whose reply was lost was made on s1, and carried to s3"
    );

    proxy.set(ProxyMode::Pass);
    assert!(
        taken_again(&b, &moved).await,
        "the carried take stayed owned with nobody holding it"
    );
}

/// As above with the reload during the give-back itself. The take's first shard answered
/// found empty (a carry had brought the take to the key's next shard); the follow-up, under
/// the taker's topology then, waited there behind another carry, which held the row while it
/// brought the take on to the key's shard under a later topology; and the taker reloaded onto
/// that topology meanwhile. The follow-up asks again after a round in which a reload came.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_of_unknown_outcome_is_followed_through_a_reload_during_its_give_back() {
    let (cluster, proxy, a, b, moved) = Chain::with_a_lost_take().await;
    // The other process's first move carries the take from s1 to s2.
    b.reload(Chain::config(&cluster, None, 2, TOP))
        .await
        .unwrap();
    common::moves_done(&b).await;
    let owner = Some("lost-take-owner".to_owned());
    assert_eq!(cas_owners(&cluster, &moved).await, [None, owner, None]);

    // Its second move's carry waits on the take's row on s2, which the test holds.
    let s2 = &cluster.shards()[1];
    let mut blocker = common::row_locked(s2, "shardlock_cas", &moved).await;
    b.reload(Chain::config(&cluster, None, 3, TOP))
        .await
        .unwrap();
    common::until_a_row_lock_is_waited_for(s2).await;
    // The give-back answers on s1, found empty; its follow-up, under the taker's second
    // topology, waits on s2 behind the carry.
    proxy.set(ProxyMode::Pass);
    let behind = common::eventually(Duration::from_secs(30), || async {
        s2.lock_waits_now().await.unwrap() >= 2
    })
    .await;
    assert!(behind, "the give-back's follow-up never reached s2");
    a.reload(Chain::config(&cluster, Some(&proxy), 3, LONG))
        .await
        .unwrap();
    blocker.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&b).await;

    assert!(
        taken_again(&b, &moved).await,
        "the take the carry brought on to s3 stayed owned with nobody holding it"
    );
}

/// The taker's moves stay in force throughout; the carrier's end soon after its reloads.
const LONG: &str = "routing:\n  move-window: 10m\ncleaner:\n  registry: static\n";
const TOP: &str = "routing:\n  move-window: 300ms\ncleaner:\n  registry: static\n";

/// Three shards and two routers over them. The taker `a` reaches s1 through `proxy` and has
/// reloaded from s1 alone onto s1 and s2 ([`LONG`] windows); the carrier `b` reaches s1
/// directly and runs s1 alone ([`TOP`]). `moved` lives on s2 under two shards and on s3 under
/// three.
struct Chain {
    cluster: shardlock_testkit::Cluster,
    proxy: Proxy,
    a: LockRouter,
    b: LockRouter,
    moved: String,
}

impl Chain {
    async fn start() -> Self {
        let (cluster, _, _) = common::start(3, TOP).await;
        let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
        let config = |proxy, n, top| Self::config(&cluster, proxy, n, top);
        let a = LockRouter::new(config(Some(&proxy), 1, LONG))
            .await
            .unwrap();
        let b = LockRouter::new(config(None, 1, TOP)).await.unwrap();
        a.reload(config(Some(&proxy), 2, LONG)).await.unwrap();
        let last = LockRouter::new(config(None, 3, TOP)).await.unwrap();
        let moved = (0..)
            .map(|i| format!("c{i}"))
            .find(|k| a.shard_for(k).unwrap() == "s2" && last.shard_for(k).unwrap() == "s3")
            .unwrap();
        last.shutdown().await.unwrap();
        // The taker's one connection to s1, made before the link loses replies.
        let stayed = (0..)
            .map(|i| format!("w{i}"))
            .find(|k| a.shard_for(k).unwrap() == "s1")
            .unwrap();
        let warm = a.cas_acquire(&stayed, "w").await.unwrap().unwrap();
        assert!(a.cas_release(warm).await.unwrap());
        Self {
            cluster,
            proxy,
            a,
            b,
            moved,
        }
    }

    /// [`Chain::start`], then a CAS take of `moved` by `a`, made on s1 (where the key lived
    /// under one shard), whose reply is lost and whose retry fails: the link to s1 loses
    /// replies from then on. The chain's parts.
    async fn with_a_lost_take() -> (
        shardlock_testkit::Cluster,
        Proxy,
        LockRouter,
        LockRouter,
        String,
    ) {
        let chain = Self::start().await;
        (chain.proxy).set(ProxyMode::LoseReplyToThenBlackhole(b"lost-take-owner"));
        let taken = chain.a.cas_acquire(&chain.moved, "lost-take-owner").await;
        assert!(taken.is_err(), "answered without a reply: {taken:?}");
        let Self {
            cluster,
            proxy,
            a,
            b,
            moved,
        } = chain;
        (cluster, proxy, a, b, moved)
    }

    /// The first `n` shards of `cluster` with `top`, s1 reached through `proxy` if given
    /// (statement timeout 1 s, one connection). Statements on the others wait up to 30 s
    /// (behind a test's row lock).
    fn config(
        cluster: &shardlock_testkit::Cluster,
        proxy: Option<&Proxy>,
        n: usize,
        top: &str,
    ) -> Config {
        let url = proxy.map_or_else(|| cluster.shard(0).url(), Proxy::url);
        let mut yaml = format!(
            "shards:\n  - name: s1\n    url: {url}\n    statement-timeout: 1s\n{POOL_OF_ONE}"
        );
        for i in 1..n {
            let url = cluster.shard(i).url();
            let name = format!("s{}", i + 1);
            yaml.push_str(&format!(
                "  - name: {name}\n    url: {url}\n    statement-timeout: 30s\n"
            ));
        }
        Config::from_yaml_str(&format!("{yaml}{top}")).unwrap()
    }
}

/// Whether `router` takes `key` by CAS (and releases it) within 30 s: the give-back of a
/// take nobody holds freed it.
async fn taken_again(router: &LockRouter, key: &str) -> bool {
    common::eventually(Duration::from_secs(30), || async {
        match router.cas_acquire(key, "other").await.unwrap() {
            Some(g) => router.cas_release(g).await.unwrap(),
            None => false,
        }
    })
    .await
}

/// The owner of `key`'s CAS row on each shard of `cluster`, in order.
async fn cas_owners(cluster: &shardlock_testkit::Cluster, key: &str) -> Vec<Option<String>> {
    let mut owners = Vec::new();
    for shard in cluster.shards() {
        owners.push(common::cas_owner(shard, key).await);
    }
    owners
}

/// A router reaching the one shard of `cluster` through a proxy, and the proxy. `shard` and
/// `top` are YAML lines added to the shard's entry and to the top level. A lease taken and
/// released first warms the pool, so that the next statement travels on an open connection
/// on which the lock statements are prepared.
async fn behind_proxy(
    cluster: &shardlock_testkit::Cluster,
    shard: &str,
    top: &str,
) -> (LockRouter, Proxy) {
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let router = router_behind(&proxy, shard, top).await;
    // Every idle connection then takes a lock cycle, so that each has the lock statements
    // prepared: a try whose prepare's reply is lost never runs its statement, and the tests
    // lose the reply of a statement that ran.
    for _ in 0..4 {
        let warm = router.acquire("warm", AcquireOptions::new()).await.unwrap();
        warm.release().await.unwrap();
    }
    (router, proxy)
}

/// A router reaching the one shard behind `proxy` (`shard` and `top` as for [`behind_proxy`]),
/// after a lease taken and released, and its placement recorded (after its first grant)
/// before a test breaks the link: the record takes a connection of its own.
async fn router_behind(proxy: &Proxy, shard: &str, top: &str) -> LockRouter {
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n{shard}{top}cleaner:\n  registry: static\n",
        proxy.url()
    ))
    .await
    .unwrap();
    let warm = router.acquire("warm", AcquireOptions::new()).await.unwrap();
    warm.release().await.unwrap();
    common::until_router_recorded(&router).await;
    router
}

/// Takes `key` for a minute through `proxy` while it loses every reply: the caller is told
/// the shard is unavailable, though the server granted it.
async fn lose_the_grant(router: &LockRouter, proxy: &Proxy, key: &str) {
    proxy.set(ProxyMode::LoseReplies);
    let long = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Duration::ZERO);
    let err = router.try_acquire(key, long).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
}

/// Whether `other` can take `key` within `limit`.
async fn freed_within(other: &LockRouter, key: &str, limit: Duration) -> bool {
    common::eventually(limit, || async {
        other
            .try_acquire(key, AcquireOptions::new().wait(Duration::ZERO))
            .await
            .unwrap()
            .is_some()
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn pattern_calls_learn_what_a_try_with_a_lost_reply_did() {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, POOL_OF_ONE, "").await;
    let mut admin = cluster.shard(0).connect().await.unwrap();
    let count = |sql: &'static str| {
        let url = cluster.shard(0).url();
        async move {
            let mut c = shardlock::mysql_async::Conn::from_url(url.as_str())
                .await
                .unwrap();
            let n: Option<u64> = c.query_first(sql).await.unwrap();
            n.unwrap_or(0)
        }
    };

    // A job of queue `q` enqueued and claimed.
    let claimed = |payload: &'static [u8]| {
        let router = router.clone();
        async move {
            router
                .enqueue_job("q", payload, Duration::ZERO, 3)
                .await
                .unwrap();
            (router.claim_job("q", "w", Duration::from_secs(30)).await)
                .unwrap()
                .expect("a job")
        }
    };

    // Enqueue (its statement prepared by a first call): the reply to the insert is lost; the
    // retry finds the job by its request id and answers its id.
    router
        .enqueue_job("warm", b"w", Duration::ZERO, 3)
        .await
        .unwrap();
    proxy.set(ProxyMode::LoseOneReply);
    let id = router
        .enqueue_job("q", b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "a reply was lost");
    let jobs: Vec<u64> = admin
        .query("SELECT id FROM shardlock_job WHERE queue = 'q'")
        .await
        .unwrap();
    assert_eq!(jobs, vec![id], "enqueued once, and its id answered");

    // Claim: the reply to its COMMIT is lost; the retry answers the job that try claimed and
    // claims no second one.
    router
        .enqueue_job("q", b"second", Duration::ZERO, 3)
        .await
        .unwrap();
    // (COM_QUERY, 0x03, then the text: not the isolation level's "READ COMMITTED".)
    proxy.set(ProxyMode::LoseReplyTo(b"\x03COMMIT"));
    let job = router
        .claim_job("q", "w", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("a job");
    assert_eq!(proxy.mode(), ProxyMode::Pass, "the COMMIT's reply was lost");
    assert_eq!(
        count("SELECT COUNT(*) FROM shardlock_job WHERE status = 'claimed'").await,
        1,
        "one claim"
    );
    assert!(router.complete_job(&job).await.unwrap());

    // Give back (its statement prepared by the completion above): the reply to its update is
    // lost and its retry cut off. The call fails, but the job is ready again (another worker
    // may claim it), so the claim no longer counts as this worker's.
    let job = claimed(b"given back").await;
    proxy.set(ProxyMode::LoseOneReplyThenBlackhole);
    let given = router.release_job(&job).await;
    proxy.set(ProxyMode::Pass);
    assert!(given.is_err(), "{given:?}");
    let status: Option<String> = admin
        .exec_first("SELECT status FROM shardlock_job WHERE id = ?", (job.id,))
        .await
        .unwrap();
    assert_eq!(
        status.as_deref(),
        Some("ready"),
        "the give-back reached the shard"
    );
    assert!(
        !job.is_held(),
        "a give-back that may have been done left the claim counted as held"
    );
    // The queue's jobs left (the one given back among them) done, as the cases below expect.
    while let Some(left) = router
        .claim_job("q", "w", Duration::from_secs(30))
        .await
        .unwrap()
    {
        assert!(router.complete_job(&left).await.unwrap());
    }

    // Complete: the reply to its update is lost; the retry finds the claim ended, by that
    // try, and answers that it completed the job.
    let job = claimed(b"third").await;
    proxy.set(ProxyMode::LoseOneReply);
    let completed = router.complete_job(&job).await.unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "a reply was lost");
    assert!(
        completed,
        "a completion whose reply was lost answered false"
    );

    // Extend: the reply to its update is lost; the retry finds the claim still this worker's
    // and answers that it extended it.
    let job = claimed(b"fourth").await;
    // (Once first, so that the connection has the statement prepared: the reply lost is then
    // that of the statement itself, which ran.)
    assert!(router
        .extend_job(&job, Duration::from_secs(60))
        .await
        .unwrap());
    let claimed_until = job.held_until();
    proxy.set(ProxyMode::LoseOneReply);
    let extended = router
        .extend_job(&job, Duration::from_secs(600))
        .await
        .unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "a reply was lost");
    assert!(extended, "an extend whose reply was lost answered false");
    assert!(
        job.held_until() > claimed_until + Duration::from_secs(500),
        "an extend whose reply was lost did not move the claim's end"
    );
    let moved: Option<u64> = admin
        .exec_first(
            "SELECT lease_until > NOW(3) + INTERVAL 500 SECOND FROM shardlock_job WHERE id = ?",
            (job.id,),
        )
        .await
        .unwrap();
    assert_eq!(moved, Some(1), "the extend did not move the claim's lease");
    assert!(router.complete_job(&job).await.unwrap());

    // CAS: whichever reply is lost, the lock ends up taken by its caller, once.
    let warm = router.cas_acquire("warm", "me").await.unwrap().unwrap();
    router.cas_release(warm).await.unwrap();
    proxy.set(ProxyMode::LoseOneReply);
    let guard = router.cas_acquire("c", "me").await.unwrap().expect("taken");
    assert!(direct.cas_acquire("c", "other").await.unwrap().is_none());
    assert!(router.cas_release(guard).await.unwrap());
    // And a release whose reply is lost answers that it released.
    let guard = router.cas_acquire("c", "me").await.unwrap().expect("taken");
    proxy.set(ProxyMode::LoseOneReply);
    let released = router.cas_release(guard).await.unwrap();
    assert_eq!(proxy.mode(), ProxyMode::Pass, "a reply was lost");
    assert!(released, "a release whose reply was lost answered false");
    assert!(direct.cas_acquire("c", "other").await.unwrap().is_some());

    // A state transition cannot tell its own earlier try from someone else's: it answers
    // that the outcome is unknown, never a false "lost".
    admin
        .query_drop("CREATE TABLE seat (id VARCHAR(16) PRIMARY KEY, state VARCHAR(16) NOT NULL)")
        .await
        .unwrap();
    admin
        .query_drop("INSERT INTO seat VALUES ('a0', 'free'), ('a1', 'free')")
        .await
        .unwrap();
    let machine = shardlock::patterns::StateMachine::new("seat", "id", "state")
        .unwrap()
        .allow("free", "taken");
    assert!(router
        .transition(&machine, "a0", "free", "taken")
        .await
        .unwrap());
    proxy.set(ProxyMode::LoseOneReply);
    let unknown = router.transition(&machine, "a1", "free", "taken").await;
    assert!(unknown.is_err(), "{unknown:?}");
    let state: Option<String> = admin
        .query_first("SELECT state FROM seat WHERE id = 'a1'")
        .await
        .unwrap();
    assert_eq!(state.as_deref(), Some("taken"), "the lost try did act");
}

/// One shard, a router reaching it through a proxy (one connection, a 300 ms connect
/// timeout, a 1 s statement timeout), and one job queued on `q` with no retries allowed.
async fn one_job_behind_a_proxy() -> (Cluster, LockRouter, Proxy) {
    let (cluster, _direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let shard =
        "    statement-timeout: 1s\n    pool:\n      max-size: 1\n      create-timeout: 300ms\n";
    let (router, proxy) = behind_proxy(&cluster, shard, "").await;
    router
        .enqueue_job("q", b"once", Duration::ZERO, 0)
        .await
        .unwrap();
    (cluster, router, proxy)
}

/// Whether a claim's lease ran out on the cluster's first shard within 30 s, read at
/// `isolation` (READ UNCOMMITTED sees a claim not committed yet).
async fn a_claim_ran_out(cluster: &Cluster, isolation: &'static str) -> bool {
    common::eventually(Duration::from_secs(30), || {
        let url = cluster.shard(0).url();
        async move {
            let mut c = shardlock::mysql_async::Conn::from_url(url.as_str())
                .await
                .unwrap();
            c.query_drop(format!(
                "SET SESSION TRANSACTION ISOLATION LEVEL {isolation}"
            ))
            .await
            .unwrap();
            let n: Option<u64> = c
                .query_first(
                    "SELECT COUNT(*) FROM shardlock_job \
                     WHERE status = 'claimed' AND lease_until <= NOW(3)",
                )
                .await
                .unwrap();
            n == Some(1)
        }
    })
    .await
}

/// A claim answered only after its lease ran out on the shard (its COMMIT held up on the way)
/// is not held: its local end runs from before its try was sent, not from its answer, so its
/// worker is never told to go on with a job that another worker may claim meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_answered_after_its_lease_ran_out_is_not_held() {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = behind_proxy(&cluster, "    statement-timeout: 120s\n", "").await;
    router
        .enqueue_job("q", b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    // (COM_QUERY, 0x03, then the text: not the isolation level's "READ COMMITTED".)
    proxy.set(ProxyMode::PauseTo(b"\x03COMMIT"));
    let claiming = tokio::spawn({
        let router = router.clone();
        async move {
            router
                .claim_job("q", "w1", Duration::from_millis(300))
                .await
        }
    });
    tokio::time::timeout(Duration::from_secs(60), proxy.wait_for(ProxyMode::Paused))
        .await
        .expect("the claim's COMMIT never reached the link");
    // Its lease runs out on the shard, its transaction not committed yet (read as it stands).
    let ran_out = a_claim_ran_out(&cluster, "READ UNCOMMITTED").await;
    assert!(ran_out, "the held-up claim's lease never ran out");
    proxy.set(ProxyMode::Pass);
    let job = claiming.await.unwrap().unwrap().expect("the job");
    assert!(
        !job.is_held(),
        "a claim answered after its lease ran out on the shard was held for {:?}",
        job.held_until() - tokio::time::Instant::now()
    );
    let lost = tokio::time::timeout(Duration::ZERO, job.lost()).await;
    assert!(
        lost.is_ok(),
        "lost() of a claim that ran out did not complete"
    );

    let second = direct
        .claim_job("q", "w2", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the job, its first claim run out");
    assert_eq!((second.id, second.retry_count), (job.id, 1));
    assert!(second.is_held());
    assert!(
        !router
            .extend_job(&job, Duration::from_secs(30))
            .await
            .unwrap(),
        "a claim that ran out, the job claimed again since, was extended"
    );
    assert!(!router.complete_job(&job).await.unwrap());
    assert!(direct.complete_job(&second).await.unwrap());
}

/// A claim whose reply was lost, the link then down for several tries to reconnect: the call
/// keeps trying (its lost try claimed the job: given up, that claim would be nobody's until
/// its lease ran out, and with no retries allowed the job would then fail without having run),
/// and answers the job once the link is back.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_whose_reply_was_lost_keeps_trying_while_the_link_is_down() {
    let (_cluster, router, proxy) = one_job_behind_a_proxy().await;
    let opened = proxy.connections();
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(b"\x03COMMIT"));
    let claiming = tokio::spawn({
        let router = router.clone();
        async move { router.claim_job("q", "w", Duration::from_secs(30)).await }
    });
    // Four tries to reconnect into the blackhole (each gives up at the pool's create timeout),
    // or the call's end.
    let tried = common::eventually(Duration::from_secs(60), || async {
        proxy.connections() >= opened + 4 || claiming.is_finished()
    })
    .await;
    assert!(tried, "the call neither tried again nor returned");
    proxy.set(ProxyMode::Pass);
    let job = claiming
        .await
        .unwrap()
        .expect("a claim whose try claimed the job gave up while the link was down")
        .expect("the job its lost try claimed");
    assert_eq!(job.retry_count, 0, "the same claim, not a retry of the job");
    assert!(router.complete_job(&job).await.unwrap());
}

/// A claim whose caller went away after its `COMMIT` reached the shard (its reply lost, the
/// link then down): the job it claimed is given back once the shard answers, claimable at once
/// and not counted as a retry (helper 245 F1). Left to its lease, the claim was nobody's, and
/// then counted as a retry of the job: with none left, the job failed for good, never run.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_claimed_after_its_caller_went_away_is_given_back() {
    let (_cluster, router, proxy) = one_job_behind_a_proxy().await;
    let lease = Duration::from_secs(600);
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(b"\x03COMMIT"));
    let claiming = tokio::spawn({
        let router = router.clone();
        async move { router.claim_job("q", "w", lease).await }
    });
    let committed = common::eventually(Duration::from_secs(60), || async {
        proxy.mode() == ProxyMode::Blackhole
    })
    .await;
    assert!(committed, "the claim's COMMIT never reached the shard");
    claiming.abort();
    assert!(claiming.await.unwrap_err().is_cancelled());
    proxy.set(ProxyMode::Pass);
    let again = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Some(job) = router.claim_job("q", "w2", lease).await.unwrap() {
                return job;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .expect("a job claimed after its caller went away was left claimed by nobody");
    assert_eq!(again.retry_count, 0, "given back, not run out");
    assert!(router.complete_job(&again).await.unwrap());
}

/// A claim whose reply was lost, retried while another transaction holds the row of the job
/// it claimed locked for a moment (a claimer's scan passing over it): the retry waits for
/// that row and answers that job. (It skipped the row and claimed another: the first was then
/// claimed by nobody until its lease ran out, and with no retries allowed failed unrun.)
#[tokio::test(flavor = "multi_thread")]
async fn a_claims_retry_waits_for_its_jobs_row_rather_than_claim_another() {
    let (cluster, _direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let shard =
        "    statement-timeout: 5s\n    pool:\n      max-size: 1\n      create-timeout: 300ms\n";
    let (router, proxy) = behind_proxy(&cluster, shard, "").await;
    for payload in [b"one", b"two"] {
        router
            .enqueue_job("q", payload, Duration::ZERO, 0)
            .await
            .unwrap();
    }
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(b"\x03COMMIT"));
    let claiming = tokio::spawn({
        let router = router.clone();
        async move { router.claim_job("q", "w", Duration::from_secs(30)).await }
    });
    let mut admin = cluster.shard(0).connect().await.unwrap();
    let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
    let claimed: u64 = loop {
        let found = admin
            .query_first("SELECT id FROM shardlock_job WHERE status = 'claimed'")
            .await
            .unwrap();
        if let Some(id) = found {
            break id;
        }
        assert!(
            tokio::time::Instant::now() < give_up,
            "the lost try never claimed a job"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    for statement in [
        "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED",
        "START TRANSACTION",
    ] {
        admin.query_drop(statement).await.unwrap();
    }
    admin
        .exec_drop(
            "SELECT id FROM shardlock_job WHERE id = ? FOR UPDATE",
            (claimed,),
        )
        .await
        .unwrap();
    proxy.set(ProxyMode::Pass);
    let shard = cluster.shard(0);
    let waits = common::eventually(Duration::from_secs(30), || async {
        claiming.is_finished() || shard.lock_waits_now().await.unwrap() >= 1
    })
    .await;
    assert!(waits, "the retry neither waited nor returned");
    admin.query_drop("ROLLBACK").await.unwrap();
    let job = claiming
        .await
        .unwrap()
        .unwrap()
        .expect("the job its lost try claimed");
    assert_eq!(
        job.id, claimed,
        "the retry claimed another job than its lost try's"
    );
}

/// A claim whose reply was lost, retried only after its lease ran out (the link down
/// meanwhile): the retry never answers that claim as it stood, run out, while another worker
/// may claim the job again; it answers it renewed for its whole lease from then, as the same
/// claim (no retry of the job counted: with none allowed, it is not failed for good).
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_found_by_a_retry_after_its_lease_ran_out_is_answered_renewed() {
    let (cluster, router, proxy) = one_job_behind_a_proxy().await;
    let mut admin = cluster.shard(0).connect().await.unwrap();
    // (COM_QUERY, 0x03, then the text: not the isolation level's "READ COMMITTED".)
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(b"\x03COMMIT"));
    let claiming = tokio::spawn({
        let router = router.clone();
        async move { router.claim_job("q", "w", Duration::from_millis(300)).await }
    });
    let ran_out = a_claim_ran_out(&cluster, "READ COMMITTED").await;
    assert!(ran_out, "the claim whose reply was lost never ran out");
    admin.query_drop("SET @retried = NOW(3)").await.unwrap();
    proxy.set(ProxyMode::Pass);
    let job = claiming
        .await
        .unwrap()
        .unwrap()
        .expect("the job its lost try claimed");
    assert_eq!(job.retry_count, 0, "the same claim, not a retry of the job");
    let held: Option<u64> = admin
        .exec_first(
            "SELECT lease_until > @retried FROM shardlock_job WHERE id = ?",
            (job.id,),
        )
        .await
        .unwrap();
    assert_eq!(
        held,
        Some(1),
        "the retry answered a claim that had run out before it was sent"
    );
}
