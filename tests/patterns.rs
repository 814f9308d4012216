//! The other lock patterns against real shards: a transaction lock whose holder process is
//! SIGKILLed mid-transaction, a state-machine claim with 64 concurrent claimers, 10,000 jobs
//! claimed by 2 processes × 16 workers with a worker killed mid-job, and a version CAS lock
//! under 64 contenders.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::patterns::{Job, StateMachine};
use shardlock::{Error, LockRouter};
use shardlock_testkit::{report, Cluster, Worker};
use tokio::time::Instant;

/// Runs `sql` on every shard.
async fn on_every_shard(cluster: &Cluster, sql: &str) {
    for s in cluster.shards() {
        s.connect().await.unwrap().query_drop(sql).await.unwrap();
    }
}

/// Rows of `table` over all shards.
async fn count_rows(cluster: &Cluster, sql: &str) -> u64 {
    let mut n = 0;
    for s in cluster.shards() {
        let c: Option<u64> = s.connect().await.unwrap().query_first(sql).await.unwrap();
        n += c.unwrap_or(0);
    }
    n
}

/// The lock's wait is the lock's alone: the caller's statements under it wait for row locks as
/// the shard's sessions do (a try without waiting left them one second, a long wait as long).
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_locks_wait_is_not_left_to_the_callers_statements() {
    let (_cluster, _router, yaml) = common::start(1, "").await;
    let yaml = yaml.replacen("    url:", "    statement-timeout: 10s\n    url:", 1);
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    for wait in [Duration::ZERO, Duration::from_secs(30)] {
        let mut held = router.lock_in_transaction("acct:wait", wait).await.unwrap();
        let secs: Option<u64> = held
            .conn()
            .query_first("SELECT @@SESSION.innodb_lock_wait_timeout")
            .await
            .unwrap();
        assert_eq!(
            secs,
            Some(9),
            "a lock taken with a wait of {wait:?} left the caller's statements this lock wait"
        );
        held.rollback().await.unwrap();
    }
}

/// A try without waiting on a row someone holds is answered by the server (`NOWAIT`) without
/// waiting for the row's lock. Before, making sure the row existed waited for its lock (an
/// upsert locks the row it finds) until the client cut the try short, leaving its session on
/// the server for the next statement to end.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_tried_without_waiting_is_refused_by_the_server() {
    let (cluster, router, _) = common::start(1, "").await;
    let held = router
        .lock_in_transaction("acct:nowait", Duration::ZERO)
        .await
        .unwrap();
    let waits = || common::status_sum(&cluster, "Innodb_row_lock_waits");
    let before = waits().await;
    for _ in 0..3 {
        let refused = router
            .lock_in_transaction("acct:nowait", Duration::ZERO)
            .await;
        assert!(matches!(refused, Err(Error::Timeout { .. })), "{refused:?}");
    }
    assert_eq!(
        waits().await - before,
        0,
        "tries without waiting waited for the row's lock"
    );
    held.rollback().await.unwrap();
}

/// A try without waiting on a key whose row another transaction is creating (its insert not
/// committed yet) waits for that row's lock in making sure the row exists: a busy key, answered
/// `Timeout`, that counts against no shard. Before, that wait was judged as a slow statement
/// and opened a breaker that opens on one.
#[tokio::test(flavor = "multi_thread")]
async fn a_try_without_waiting_behind_a_row_being_created_counts_against_no_shard() {
    let cluster = Cluster::start(1).await.unwrap();
    common::migrate_only(&cluster.config_yaml("")).await;
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 10s\n\
         breaker:\n  consecutive-failures: 1\n  slow-call: 300ms\ncleaner:\n  registry: static\n",
        cluster.shard(0).url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let key = shardlock::LockKey::new("acct:new").unwrap();
    let mut creating = cluster.shard(0).connect().await.unwrap();
    creating.query_drop("START TRANSACTION").await.unwrap();
    creating
        .exec_drop(
            "INSERT INTO shardlock_txlock (lock_key) VALUES (?)",
            (key.stored(),),
        )
        .await
        .unwrap();
    let tried = router
        .lock_in_transaction("acct:new", Duration::ZERO)
        .await
        .map(|_| ());
    creating.query_drop("ROLLBACK").await.unwrap();
    assert!(
        router.breaker_transitions("s1").is_empty(),
        "a try held up by a row being created counted against its shard ({tried:?}): {:?}",
        router.breaker_transitions("s1")
    );
    assert!(matches!(tried, Err(Error::Timeout { .. })), "{tried:?}");
    router
        .lock_in_transaction("acct:new", Duration::ZERO)
        .await
        .unwrap()
        .rollback()
        .await
        .unwrap();
}

/// A transaction lock whose own session ends (killed here; timed out idle, or its server
/// restarted) was rolled back, and another process may hold the key: `lost()` says so. It
/// waited on, and `is_held()` said the lock held, while another holder worked under the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_whose_session_was_killed_is_reported_lost() {
    let (cluster, router, _) = common::start(1, "").await;
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    let held = router
        .lock_in_transaction("tx:killed", Duration::from_secs(5))
        .await
        .unwrap();
    common::kill_the_idle_locking_session(cluster.shard(0)).await;
    let theirs = other
        .lock_in_transaction("tx:killed", Duration::from_secs(10))
        .await
        .expect("the killed session's row is free");
    let noticed = tokio::time::timeout(Duration::from_secs(30), held.lost()).await;
    assert!(
        noticed.is_ok(),
        "lost() went on waiting while another process held the key"
    );
    assert!(!held.is_held());
    theirs.commit().await.unwrap();
    assert!(
        held.commit().await.is_err(),
        "a lock whose session ended committed"
    );
}

/// A transaction lock is held only once its locking read found the key's row. A shard under
/// READ COMMITTED answers a locking read that waited on a row another transaction deleted
/// (an operator's purge of `shardlock_txlock`, say) with no row and no lock: that lock was
/// handed out locking nothing, and the next caller created the row again and locked it too.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_whose_row_was_deleted_while_it_waited_is_not_handed_out_unlocked() {
    let args = ["--transaction-isolation=READ-COMMITTED".to_owned()];
    let cluster = Cluster::start_with_args(1, &args).await.unwrap();
    let yaml = cluster.config_yaml("");
    common::migrate_only(&yaml).await;
    let (a, b) = (
        LockRouter::from_yaml_str(&yaml).await.unwrap(),
        LockRouter::from_yaml_str(&yaml).await.unwrap(),
    );
    // The key's row exists.
    let wait = Duration::from_secs(60);
    a.lock_in_transaction("acct:purged", wait)
        .await
        .unwrap()
        .rollback()
        .await
        .unwrap();
    let server = cluster.shard(0);
    let mut purging = server.connect().await.unwrap();
    purging.query_drop("START TRANSACTION").await.unwrap();
    purging
        .query_drop("DELETE FROM shardlock_txlock")
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let a = a.clone();
        async move { a.lock_in_transaction("acct:purged", wait).await }
    });
    let waits = common::eventually(Duration::from_secs(30), || async {
        server.lock_waits_now().await.unwrap() >= 1
    })
    .await;
    assert!(waits, "the lock never waited for the purge");
    purging.query_drop("COMMIT").await.unwrap();
    let held = waiting.await.unwrap().unwrap();
    let second = b.lock_in_transaction("acct:purged", Duration::ZERO).await;
    assert!(
        matches!(second, Err(Error::Timeout { .. })),
        "a second transaction lock was handed out beside one whose row was purged: {:?}",
        second.map(|_| "held")
    );
    held.rollback().await.unwrap();
}

/// An attempt cut short at the end of its wait by a shard that never answers is no answer of
/// the shard's: let through while half-open without a probe's slot, it decides nothing, and its
/// caller is told the shard is unavailable. A try without waiting, which waits for no lock, is
/// judged as any statement is: unanswered within the statement timeout, it opens the breaker
/// again. Before, every cut counted as the row's holder keeping it, so a try without waiting
/// closed the breaker on a cut-off shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_on_a_silent_shard_is_judged_only_by_the_shards_timeout() {
    use shardlock_testkit::{Proxy, ProxyMode};
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 2s\n\
         breaker:\n  consecutive-failures: 1\n  cooldown: 300ms\n  max-cooldown: 1s\n  \
         slow-call: 60s\n  probes: 1\ncleaner:\n  registry: static\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    router
        .lock_in_transaction("acct:silent", Duration::ZERO)
        .await
        .unwrap()
        .rollback()
        .await
        .unwrap();
    // Opened by calls that fail as they connect: none reached the server, so nothing is given
    // back in the background (a give-back could take the probe).
    proxy.set(ProxyMode::Reset);
    while router.breaker_state("s1") != Some(shardlock::BreakerState::Open) {
        let _ = router
            .try_acquire("other", shardlock::AcquireOptions::new())
            .await;
    }
    proxy.set(ProxyMode::Blackhole);
    let half_open = common::eventually(Duration::from_secs(30), || async {
        router.breaker_state("s1") == Some(shardlock::BreakerState::HalfOpen)
    })
    .await;
    assert!(half_open, "the breaker never cooled down");
    let transitions = router.breaker_transitions("s1").len();
    let refused = router.stats().breaker_rejections;
    // A wait cut short: no verdict, the probe's slot given back.
    let waited = router
        .lock_in_transaction("acct:silent", Duration::from_millis(300))
        .await
        .map(|_| ());
    let after_wait = router.breaker_state("s1");
    assert_eq!(
        router.stats().breaker_rejections,
        refused,
        "a wait was refused while half-open: {waited:?}"
    );
    // A try without waiting: the shard's statement timeout judges it, as any statement's.
    // (Let through as the probe once it is free: a call of the process's own in the
    // background, an acquire given up earlier, may hold it until its statement times out.)
    let started = std::time::Instant::now();
    let (tried, after_try) = loop {
        let tried = router
            .lock_in_transaction("acct:silent", Duration::ZERO)
            .await
            .map(|_| ());
        match tried {
            Err(Error::Unavailable { ref source, .. })
                if source.kind == shardlock::BackendErrorKind::BreakerOpen =>
            {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "a try without waiting was never let through as the probe"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            tried => break (tried, router.breaker_state("s1")),
        }
    };
    proxy.set(ProxyMode::Pass);
    let judged = &router.breaker_transitions("s1")[transitions..];
    assert_eq!(
        after_wait,
        Some(shardlock::BreakerState::HalfOpen),
        "a wait cut short on a silent shard was judged ({waited:?}): {judged:?}"
    );
    assert!(
        matches!(waited, Err(Error::Unavailable { .. })),
        "{waited:?}"
    );
    assert_eq!(
        after_try,
        Some(shardlock::BreakerState::Open),
        "a try without waiting on a silent shard was not judged a failure ({tried:?}): {judged:?}"
    );
    assert!(matches!(tried, Err(Error::Unavailable { .. })), "{tried:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn transaction_lock_survives_nothing_of_a_killed_holder_and_carries_the_callers_sql() {
    let (cluster, router, yaml) = common::start(2, "").await;
    on_every_shard(
        &cluster,
        "CREATE TABLE tx_log (id INT AUTO_INCREMENT PRIMARY KEY, what VARCHAR(32) NOT NULL)",
    )
    .await;
    let mut holder = Worker::spawn("worker", "tx-holder", &[(common::CONFIG_ENV, yaml)]).unwrap();
    holder.expect("locked").await.unwrap();

    // Held by the other process: no wait means no lock.
    let refused = router.lock_in_transaction("acct:1", Duration::ZERO).await;
    assert!(matches!(refused, Err(Error::Timeout { .. })), "{refused:?}");
    let waiter = {
        let router = router.clone();
        tokio::spawn(async move {
            let guard = router
                .lock_in_transaction("acct:1", Duration::from_secs(20))
                .await
                .unwrap();
            (Instant::now(), guard)
        })
    };
    // The waiter waits for the holder's row.
    let home = usize::from(router.shard_for("acct:1").unwrap() == "s2");
    common::until_a_row_lock_is_waited_for(cluster.shard(home)).await;
    assert!(!waiter.is_finished(), "the lock is still held");
    let killed = Instant::now();
    holder.kill().await.unwrap();
    // Granted within the waiter's own wait (20 s): the server ended the killed holder's
    // transaction, not a timeout.
    let (granted, mut guard) = waiter.await.unwrap();
    let after = granted - killed;
    eprintln!("granted {after:?} after the holder was killed");
    // The killed holder's uncommitted row went with its transaction.
    assert_eq!(
        count_rows(
            &cluster,
            "SELECT COUNT(*) FROM tx_log WHERE what = 'killed'"
        )
        .await,
        0
    );

    // The caller's SQL commits or rolls back with the lock.
    guard
        .conn()
        .query_drop("INSERT INTO tx_log (what) VALUES ('committed')")
        .await
        .unwrap();
    guard.commit().await.unwrap();
    let mut again = router
        .lock_in_transaction("acct:1", Duration::ZERO)
        .await
        .expect("free after commit");
    again
        .conn()
        .query_drop("INSERT INTO tx_log (what) VALUES ('rolled back')")
        .await
        .unwrap();
    again.rollback().await.unwrap();
    let dropped = router
        .lock_in_transaction("acct:1", Duration::ZERO)
        .await
        .expect("free after rollback");
    drop(dropped); // dropping rolls back and frees it too
    router
        .lock_in_transaction("acct:1", Duration::from_secs(2))
        .await
        .expect("free after drop")
        .commit()
        .await
        .unwrap();
    assert_eq!(
        count_rows(
            &cluster,
            "SELECT COUNT(*) FROM tx_log WHERE what = 'committed'"
        )
        .await,
        1
    );
    assert_eq!(
        count_rows(
            &cluster,
            "SELECT COUNT(*) FROM tx_log WHERE what = 'rolled back'"
        )
        .await,
        0
    );
}

async fn tx_holder() {
    let router = common::worker_router().await;
    let mut guard = router
        .lock_in_transaction("acct:1", Duration::from_secs(5))
        .await
        .unwrap();
    guard
        .conn()
        .query_drop("INSERT INTO tx_log (what) VALUES ('killed')")
        .await
        .unwrap();
    report!("locked");
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn state_machine_claim_has_one_winner_and_rollback_makes_it_claimable_again() {
    let (cluster, router, _) = common::start(2, "").await;
    on_every_shard(
        &cluster,
        "CREATE TABLE coupon (code VARCHAR(64) PRIMARY KEY, state VARCHAR(16) NOT NULL)",
    )
    .await;
    let code = "SPRING-7";
    router
        .shard_connection(code)
        .await
        .unwrap()
        .raw()
        .exec_drop("INSERT INTO coupon VALUES (?, 'available')", (code,))
        .await
        .unwrap();
    let machine = StateMachine::new("coupon", "code", "state")
        .unwrap()
        .allow("disabled", "available")
        .allow("available", "locked")
        .allow("locked", "used")
        .allow("locked", "available");
    let claim_from_to = |router: LockRouter, machine: StateMachine, from, to| async move {
        let wins = Arc::new(AtomicU64::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (router, machine, wins) = (router.clone(), machine.clone(), wins.clone());
                tokio::spawn(async move {
                    if router.transition(&machine, code, from, to).await.unwrap() {
                        wins.fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        wins.load(Ordering::Relaxed)
    };
    let claim = |router, machine| claim_from_to(router, machine, "available", "locked");
    assert_eq!(
        claim(router.clone(), machine.clone()).await,
        1,
        "exactly one claimer wins"
    );
    assert!(router
        .transition(&machine, code, "locked", "available")
        .await
        .unwrap());
    assert_eq!(
        claim(router.clone(), machine.clone()).await,
        1,
        "claimable again after rollback"
    );
    assert!(router
        .transition(&machine, code, "locked", "used")
        .await
        .unwrap());
    // Used is final: nothing leads out of it, and claiming finds nothing to move.
    assert!(matches!(
        router.transition(&machine, code, "used", "available").await,
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(claim(router.clone(), machine.clone()).await, 0);
    assert!(StateMachine::new("coupon; DROP TABLE x", "code", "state").is_err());
    // A transition to the same state changes nothing: it could not tell winner from loser.
    let same = StateMachine::new("coupon", "code", "state")
        .unwrap()
        .allow("used", "used");
    assert!(matches!(
        router.transition(&same, code, "used", "used").await,
        Err(Error::InvalidArgument { .. })
    ));
    // Nor does one whose states the column's collation takes for one (case-insensitive, as
    // the server's default is): the row would still be in `from` after the winner's update,
    // and every later caller would win too.
    let cased = StateMachine::new("coupon", "code", "state")
        .unwrap()
        .allow("used", "USED");
    let wins = claim_from_to(router.clone(), cased, "used", "USED").await;
    assert_eq!(
        wins, 0,
        "{wins} callers won a transition that changes nothing"
    );
}

/// A transaction lock's rollback on a shard that stopped answering (paused) returns within the
/// shard's statement timeout, with an error: the connection is closed, and the server rolls
/// back once it runs again. It waited until the shard came back.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_locks_rollback_on_a_paused_shard_answers_within_the_statement_timeout() {
    let (cluster, router, _) = common::start(1, "").await;
    let held = router
        .lock_in_transaction("acct:paused", Duration::ZERO)
        .await
        .unwrap();
    let server = cluster.shard(0);
    server.pause().unwrap();
    // Ten statement timeouts (2 s by default).
    let ended = tokio::time::timeout(Duration::from_secs(20), held.rollback()).await;
    server.resume().unwrap();
    match ended {
        Ok(Err(Error::Unavailable { .. })) => {}
        Ok(other) => panic!("a rollback on a paused shard answered {other:?}"),
        Err(_) => panic!("a rollback on a paused shard waited for the shard"),
    }
    // Rolled back once the shard runs again: the key is free.
    let again = common::eventually(Duration::from_secs(60), || async {
        router
            .lock_in_transaction("acct:paused", Duration::ZERO)
            .await
            .is_ok()
    })
    .await;
    assert!(again, "the key stayed locked after the shard came back");
}

/// A state machine's names are the caller's identifiers, not SQL: a column named `1` (an
/// identifier only when quoted) is compared as the column. Unquoted, `WHERE 1 = ?` held for
/// every row, and a transition of one row moved all of them.
#[tokio::test(flavor = "multi_thread")]
async fn a_transition_on_a_column_named_like_a_number_moves_its_row_alone() {
    let (cluster, router, _) = common::start(1, "").await;
    on_every_shard(
        &cluster,
        "CREATE TABLE ticket (`1` VARCHAR(64) PRIMARY KEY, `rank` VARCHAR(16) NOT NULL)",
    )
    .await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    c.query_drop("INSERT INTO ticket VALUES ('1', 'open'), ('2', 'open')")
        .await
        .unwrap();
    let machine = StateMachine::new("ticket", "1", "rank")
        .unwrap()
        .allow("open", "closed");
    let moved = router.transition(&machine, "1", "open", "closed").await;
    let states: Vec<(String, String)> = c
        .query("SELECT `1`, `rank` FROM ticket ORDER BY `1`")
        .await
        .unwrap();
    assert_eq!(
        states,
        [("1".into(), "closed".into()), ("2".into(), "open".into())],
        "a transition of row 1 ({moved:?}) moved others"
    );
    assert!(moved.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_job_whose_retries_ran_out_fails_instead_of_staying_claimed() {
    let (cluster, router, _) = common::start(1, "").await;
    router
        .enqueue_job("q", b"once", Duration::ZERO, 0)
        .await
        .unwrap();
    let job = router
        .claim_job("q", "w", Duration::from_millis(100))
        .await
        .unwrap()
        .expect("due");
    // The worker dies; its lease runs out and no retry is left.
    let ended = common::eventually(Duration::from_secs(10), || async {
        router
            .claim_job("q", "w", Duration::from_secs(1))
            .await
            .unwrap()
            .is_none()
            && count_rows(
                &cluster,
                "SELECT COUNT(*) FROM shardlock_job WHERE status = 'failed'",
            )
            .await
                == 1
    })
    .await;
    assert!(ended, "the job was failed for good");
    assert!(!router.complete_job(&job).await.unwrap());
}

/// A job given back unfinished is claimed again at once, not after its lease, and its give-back
/// counts as no retry: with none allowed, it still runs. A give-back of a claim that no longer
/// holds changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_given_back_is_claimed_again_at_once_and_not_counted_as_a_retry() {
    let (_cluster, router, _) = common::start(1, "").await;
    let id = router
        .enqueue_job("q", b"once", Duration::ZERO, 0)
        .await
        .unwrap();
    let hour = Duration::from_secs(3600);
    let first = router
        .claim_job("q", "w1", hour)
        .await
        .unwrap()
        .expect("due");
    assert!(router.release_job(&first).await.unwrap());
    let second = router.claim_job("q", "w2", hour).await.unwrap();
    let second = second.expect("a job given back was left to its hour-long lease");
    assert_eq!((second.id, second.retry_count), (id, 0));
    // The first claim's give-back, again: the job is w2's now.
    assert!(!router.release_job(&first).await.unwrap());
    assert!(!router.complete_job(&first).await.unwrap());
    assert!(router.complete_job(&second).await.unwrap());
    assert!(router.claim_job("q", "w3", hour).await.unwrap().is_none());
}

/// A shard whose one job of queue `q` is claimed by worker `w1` for `lease`, and the claim's
/// end as the shard wrote it.
async fn one_claimed_job(
    lease: Duration,
) -> (Cluster, LockRouter, Job, shardlock::mysql_async::Value) {
    let (cluster, router, _) = common::start(1, "").await;
    router
        .enqueue_job("q", b"long", Duration::ZERO, 3)
        .await
        .unwrap();
    let job = router
        .claim_job("q", "w1", lease)
        .await
        .unwrap()
        .expect("due");
    let claimed_until = (cluster.shard(0).connect().await.unwrap())
        .query_first("SELECT lease_until FROM shardlock_job")
        .await
        .unwrap()
        .unwrap();
    (cluster, router, job, claimed_until)
}

/// Waits until the clock of the cluster's first shard is `secs` seconds past `at` (a value
/// read from its rows).
async fn until_the_shards_clock_passes(
    cluster: &Cluster,
    at: shardlock::mysql_async::Value,
    secs: u32,
) {
    let past = common::eventually(Duration::from_secs(60), || {
        let url = cluster.shard(0).url();
        let at = at.clone();
        async move {
            let mut c = shardlock::mysql_async::Conn::from_url(url.as_str())
                .await
                .unwrap();
            let past: Option<u64> = c
                .exec_first("SELECT NOW(3) > ? + INTERVAL ? SECOND", (at, secs))
                .await
                .unwrap();
            past == Some(1)
        }
    })
    .await;
    assert!(
        past,
        "the shard's clock never passed {secs} s after the claim's first lease"
    );
}

/// A claim kept extended is claimed by no other worker past the lease it was claimed for, on
/// the shard's clock; an extend for less than what is left moves its end neither on the shard
/// nor here; a completed job is no longer held, by any clone of it, and cannot be extended.
#[tokio::test(flavor = "multi_thread")]
async fn an_extended_claim_outlasts_its_first_lease_and_ends_with_its_job() {
    let (cluster, router, job, claimed_until) = one_claimed_job(Duration::from_secs(1)).await;
    assert!(
        job.is_held(),
        "a job just claimed for a second was not held"
    );
    let first_end = job.held_until();
    let mut admin = cluster.shard(0).connect().await.unwrap();
    let hour = Duration::from_secs(3600);
    assert!(router.extend_job(&job, hour).await.unwrap());
    assert!(
        job.held_until() > first_end + Duration::from_secs(3000),
        "an extend by an hour did not move the claim's end"
    );

    // Past the lease it was claimed for, by the shard's clock: nobody else claims it.
    until_the_shards_clock_passes(&cluster, claimed_until, 0).await;
    let other = router.claim_job("q", "w2", hour).await.unwrap();
    assert_eq!(
        other, None,
        "a claim extended by an hour was taken after a second"
    );
    assert!(job.is_held());

    // An extend for less than is left keeps the end where it is.
    let end = job.held_until();
    assert!(router
        .extend_job(&job, Duration::from_secs(1))
        .await
        .unwrap());
    assert!(
        job.held_until() <= end,
        "a shorter extend moved the end here"
    );
    let kept: Option<u64> = admin
        .query_first("SELECT lease_until > NOW(3) + INTERVAL 3000 SECOND FROM shardlock_job")
        .await
        .unwrap();
    assert_eq!(kept, Some(1), "a shorter extend moved the claim's end back");

    let clone = job.clone();
    assert!(router.complete_job(&job).await.unwrap());
    assert!(!clone.is_held(), "a clone of a completed job still held it");
    let lost = tokio::time::timeout(Duration::ZERO, clone.lost()).await;
    assert!(lost.is_ok(), "lost() of a completed job did not complete");
    assert!(
        !router.extend_job(&clone, hour).await.unwrap(),
        "a completed job's claim was extended"
    );
}

/// A kept claim outlasts its lease several times over, by the shard's clock, claimed by no
/// other worker; once its keeper is dropped it runs out, `lost()` completes, and then another
/// worker claims the job.
#[tokio::test(flavor = "multi_thread")]
async fn a_kept_claim_is_extended_until_its_keeper_is_dropped() {
    let lease = Duration::from_secs(6);
    let (cluster, router, job, claimed_until) = one_claimed_job(lease).await;
    assert!(
        matches!(
            router.keep_job(&job, Duration::from_millis(2)),
            Err(Error::InvalidArgument { name: "lease", .. })
        ),
        "a lease too short to keep was accepted"
    );
    let keeper = router.keep_job(&job, lease).unwrap();
    // Half a lease past the one it was claimed for, by the shard's clock (extends come every
    // 2 s: a stall of 4 s would let the claim run out).
    until_the_shards_clock_passes(&cluster, claimed_until, 3).await;
    let other = router.claim_job("q", "w2", lease).await.unwrap();
    assert_eq!(other, None, "a kept claim was taken by another worker");
    assert!(job.is_held(), "a kept claim was not held");

    drop(keeper);
    tokio::time::timeout(Duration::from_secs(60), job.lost())
        .await
        .expect("a claim whose keeper was dropped never ran out");
    let again = common::eventually(Duration::from_secs(30), || async {
        router.claim_job("q", "w2", lease).await.unwrap().is_some()
    })
    .await;
    assert!(
        again,
        "the job was not claimed again once its claim ran out"
    );
    assert!(!router.complete_job(&job).await.unwrap());
}

/// A claim whose transaction fails half way (the server refuses its update) is rolled back at
/// once: the job's row is not left locked on an idle pooled connection, where every other
/// claimer would skip it.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_that_fails_half_way_leaves_the_jobs_row_unlocked() {
    let (cluster, router, yaml) = common::start(1, "").await;
    let other = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router
        .enqueue_job("q", b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    let mut admin = cluster.shard(0).connect().await.unwrap();
    admin
        .query_drop(
            "CREATE TRIGGER refuse_doomed BEFORE UPDATE ON shardlock_job FOR EACH ROW \
             BEGIN IF NEW.locked_by LIKE 'doomed@%' THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused'; END IF; END",
        )
        .await
        .unwrap();
    let refused = router
        .claim_job("q", "doomed", Duration::from_secs(30))
        .await;
    assert!(refused.is_err(), "the refused claim answered {refused:?}");
    let job = other
        .claim_job("q", "w2", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        job.is_some(),
        "the job's row stayed locked by the claim that failed"
    );
}

const JOBS: u64 = 10_000;
const QUEUE: &str = "emails";
const WORKERS: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_thousand_jobs_are_each_completed_once_and_a_killed_workers_job_is_reclaimed() {
    // Ten thousand enqueues and claims beside worker processes are slow on a loaded machine:
    // this test is about each job done once, not the breaker, so slow calls do not open it.
    let (cluster, router, yaml) = common::start(2, "breaker:\n  slow-call: 10s\n").await;
    on_every_shard(
        &cluster,
        "CREATE TABLE job_log (id BIGINT AUTO_INCREMENT PRIMARY KEY, job_id BIGINT UNSIGNED NOT NULL, \
         worker VARCHAR(191) NOT NULL, retry_count INT UNSIGNED NOT NULL)",
    )
    .await;
    // A worker that claims one job and is killed before completing it.
    let first = router
        .enqueue_job(QUEUE, b"the doomed one", Duration::ZERO, 3)
        .await
        .unwrap();
    let env = [(common::CONFIG_ENV, yaml.clone())];
    let mut doomed = Worker::spawn("worker", "job-doomed", &env).unwrap();
    let claimed = doomed.expect("claimed ").await.unwrap();
    assert_eq!(
        claimed.trim_start_matches("claimed ").trim(),
        first.to_string()
    );
    doomed.kill().await.unwrap();

    let enqueue: Vec<_> = (0..16)
        .map(|t| {
            let router = router.clone();
            tokio::spawn(async move {
                for i in (t..JOBS - 1).step_by(16) {
                    router
                        .enqueue_job(QUEUE, format!("job {i}").as_bytes(), Duration::ZERO, 3)
                        .await
                        .unwrap();
                }
            })
        })
        .collect();
    for t in enqueue {
        t.await.unwrap();
    }
    let started = Instant::now();
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "job-worker", &env).unwrap())
        .collect();
    let mut completed = 0;
    for w in workers {
        completed += w.finish_report("completed ").await.unwrap()[0];
    }
    eprintln!("{completed} jobs completed in {:?}", started.elapsed());
    assert_eq!(completed, JOBS, "every job completed by one of the workers");
    assert_eq!(
        count_rows(&cluster, "SELECT COUNT(*) FROM job_log").await,
        JOBS
    );
    assert_eq!(
        count_rows(&cluster, "SELECT COUNT(DISTINCT job_id) FROM job_log").await,
        JOBS,
        "no job twice"
    );
    assert_eq!(
        count_rows(
            &cluster,
            "SELECT COUNT(*) FROM shardlock_job WHERE status = 'done'"
        )
        .await,
        JOBS
    );
    let retried = count_rows(
        &cluster,
        &format!("SELECT COUNT(*) FROM job_log WHERE job_id = {first} AND retry_count = 1"),
    )
    .await;
    assert_eq!(
        retried, 1,
        "the killed worker's job was claimed again, retry count raised"
    );
}

/// Claims one job and waits to be killed.
async fn job_doomed() {
    let router = common::worker_router().await;
    let job = router
        .claim_job(QUEUE, "doomed", Duration::from_secs(1))
        .await
        .unwrap()
        .unwrap();
    report!("claimed {}", job.id);
    std::future::pending::<()>().await;
}

/// 16 workers claiming and completing jobs until nothing has been due for 3 s (the killed
/// worker's lease runs out meanwhile).
async fn job_worker() {
    let router = common::worker_router().await;
    let me = router.instance_id().to_owned();
    let tasks: Vec<_> = (0..WORKERS)
        .map(|w| {
            let (router, me) = (router.clone(), me.clone());
            tokio::spawn(async move {
                let worker = format!("{me}/{w}");
                let mut done = 0u64;
                let mut idle_since = None;
                loop {
                    let claimed = router
                        .claim_job(QUEUE, &worker, Duration::from_secs(5))
                        .await
                        .unwrap();
                    let Some(job) = claimed else {
                        let since = *idle_since.get_or_insert_with(Instant::now);
                        if since.elapsed() > Duration::from_secs(3) {
                            return done;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    };
                    idle_since = None;
                    let mut conn = router.shard_connection(QUEUE).await.unwrap();
                    conn.raw()
                        .exec_drop(
                            "INSERT INTO job_log (job_id, worker, retry_count) VALUES (?, ?, ?)",
                            (job.id, &worker, job.retry_count),
                        )
                        .await
                        .unwrap();
                    drop(conn);
                    assert!(router.complete_job(&job).await.unwrap(), "lease ran out");
                    done += 1;
                }
            })
        })
        .collect();
    let mut done = 0;
    for t in tasks {
        done += t.await.unwrap();
    }
    report!("completed {done}");
}

#[tokio::test(flavor = "multi_thread")]
async fn version_cas_lock_keeps_64_contenders_exact() {
    let (cluster, router, _) = common::start(1, "").await;
    let mut app = cluster.shard(0).connect().await.unwrap();
    app.query_drop("CREATE TABLE tally (id INT PRIMARY KEY, n INT NOT NULL)")
        .await
        .unwrap();
    app.query_drop("INSERT INTO tally VALUES (1, 0)")
        .await
        .unwrap();
    let url = cluster.shard(0).url();
    let pool = shardlock::mysql_async::Pool::new(url.as_str());
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let (router, pool) = (router.clone(), pool.clone());
            tokio::spawn(async move {
                for _ in 0..20 {
                    let guard = loop {
                        if let Some(g) = router
                            .cas_acquire("tally:1", &format!("t{t}"))
                            .await
                            .unwrap()
                        {
                            break g;
                        }
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    };
                    let mut c = pool.get_conn().await.unwrap();
                    let n: i64 = c
                        .query_first("SELECT n FROM tally WHERE id = 1")
                        .await
                        .unwrap()
                        .unwrap();
                    tokio::task::yield_now().await;
                    c.exec_drop("UPDATE tally SET n = ? WHERE id = 1", (n + 1,))
                        .await
                        .unwrap();
                    drop(c);
                    assert!(router.cas_release(guard).await.unwrap());
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let n: Option<i64> = app
        .query_first("SELECT n FROM tally WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(n, Some(64 * 20), "a lost update means two holders at once");
}

crate::worker_entry! {
    "tx-holder" => tx_holder(),
    "job-doomed" => job_doomed(),
    "job-worker" => job_worker(),
}

#[tokio::test(flavor = "multi_thread")]
async fn a_statement_interrupted_on_a_transaction_locks_connection_never_reaches_the_next_user() {
    // One connection per shard: whatever the pool hands out next is what the guard had.
    let (cluster, _setup, _) = common::start(1, "").await;
    let yaml = cluster
        .config_yaml("")
        .replace("    url:", "    pool:\n      max-size: 1\n    url:");
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let mut guard = router
        .lock_in_transaction("k", Duration::from_secs(5))
        .await
        .unwrap();
    // A statement of the caller's, given up on while the server still runs it.
    let slow = tokio::time::timeout(
        Duration::from_millis(200),
        guard.conn().query_drop("SELECT SLEEP(2)"),
    )
    .await;
    assert!(slow.is_err(), "the statement was still running");
    drop(guard);
    // The next user of the pool gets a clean connection, and the row is free again (the
    // abandoned transaction ended with its connection).
    let mut next = router
        .lock_in_transaction("k", Duration::from_secs(5))
        .await
        .unwrap();
    let two: Option<i64> = next.conn().query_first("SELECT 1 + 1").await.unwrap();
    assert_eq!(two, Some(2), "a reply meant for the previous user");
    next.commit().await.unwrap();
}

/// Caller SQL that ends the transaction holding a transaction lock — a DDL statement commits
/// implicitly, and so does a `COMMIT` of the caller's own — ends the lock with it: another
/// process may take the key at once, and `commit` (or `rollback`) answers `LockLost` instead
/// of reporting a locked section that was not. A transaction left intact ends as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_ended_by_the_callers_sql_is_reported_lost_at_commit() {
    let (cluster, router, _) = common::start(1, "").await;
    on_every_shard(
        &cluster,
        "CREATE TABLE tx_after_end (what VARCHAR(200) PRIMARY KEY)",
    )
    .await;
    let wait = Duration::from_secs(2);
    // Errors name the key by its hash (no `record-keys` here).
    let ended_label = shardlock::LockKey::new("tx:ended").unwrap().label_hash();
    for ending in [
        "CREATE TABLE IF NOT EXISTS tx_ddl_probe (n INT PRIMARY KEY)",
        "COMMIT",
        // A new transaction with a savepoint of the name an older version marked the lock's
        // with: it must not pass for the lock's.
        "COMMIT; BEGIN; SAVEPOINT shardlock_tx_lock",
    ] {
        let mut guard = router.lock_in_transaction("tx:ended", wait).await.unwrap();
        guard.conn().query_drop(ending).await.unwrap();
        // The lock ended with the transaction: another session takes it without waiting.
        let other = router
            .lock_in_transaction("tx:ended", Duration::ZERO)
            .await
            .unwrap_or_else(|e| panic!("after `{ending}` the key stayed locked: {e}"));
        // What the holder runs after the end is not committed, while the other holds the key
        // or after.
        guard
            .conn()
            .exec_drop("INSERT INTO tx_after_end VALUES (?)", (ending,))
            .await
            .unwrap();
        let after_end = "SELECT COUNT(*) FROM tx_after_end";
        assert_eq!(
            count_rows(&cluster, after_end).await,
            0,
            "after `{ending}`, a statement outside the lock was committed"
        );
        other.rollback().await.unwrap();
        match guard.commit().await {
            Err(Error::LockLost { key_label }) => assert_eq!(key_label, ended_label),
            other => panic!("after `{ending}`, commit answered {other:?}"),
        }
        assert_eq!(count_rows(&cluster, after_end).await, 0, "after `{ending}`");
        // A rollback learns it too: what ran before the end may be committed.
        let mut guard = router.lock_in_transaction("tx:ended", wait).await.unwrap();
        guard.conn().query_drop(ending).await.unwrap();
        match guard.rollback().await {
            Err(Error::LockLost { key_label }) => assert_eq!(key_label, ended_label),
            other => panic!("after `{ending}`, rollback answered {other:?}"),
        }
    }
    let mut guard = router.lock_in_transaction("tx:ended", wait).await.unwrap();
    guard.conn().query_drop("SELECT 1").await.unwrap();
    guard.commit().await.unwrap();
    let mut guard = router.lock_in_transaction("tx:ended", wait).await.unwrap();
    guard.conn().query_drop("SELECT 1").await.unwrap();
    guard.rollback().await.unwrap();
}

/// A deadlock that one of the holder's own statements loses rolls back the whole transaction,
/// the lock's row lock with it, and another process may take the key at once: what the holder
/// runs after that is not committed (the lock's session runs with autocommit off), while the
/// other holds the key or later, and `commit` answers `LockLost`.
#[tokio::test(flavor = "multi_thread")]
async fn a_deadlock_lost_by_the_holders_sql_commits_nothing_after_it() {
    let (cluster, router, _) = common::start(1, "").await;
    let shard = &cluster.shards()[0];
    shard
        .connect()
        .await
        .unwrap()
        .query_drop(
            "CREATE TABLE dl_rows (n INT PRIMARY KEY, v INT NOT NULL); \
             INSERT INTO dl_rows VALUES (1, 0), (2, 0); \
             CREATE TABLE dl_bulk (n INT PRIMARY KEY); \
             CREATE TABLE dl_after (n INT PRIMARY KEY)",
        )
        .await
        .unwrap();
    let mut holder = router
        .lock_in_transaction("tx:deadlock", Duration::from_secs(2))
        .await
        .unwrap();
    holder
        .conn()
        .query_drop("UPDATE dl_rows SET v = 1 WHERE n = 1")
        .await
        .unwrap();
    // Another transaction, the heavier one (InnoDB rolls back the lighter), locks row 2 and
    // then waits for the holder's row 1.
    let mut other = shard.connect().await.unwrap();
    other
        .query_drop(
            "START TRANSACTION; \
             INSERT INTO dl_bulk WITH RECURSIVE s (n) AS \
             (SELECT 1 UNION ALL SELECT n + 1 FROM s WHERE n < 1000) SELECT n FROM s; \
             UPDATE dl_rows SET v = 2 WHERE n = 2",
        )
        .await
        .unwrap();
    let waiting = tokio::spawn(async move {
        other
            .query_drop("UPDATE dl_rows SET v = 2 WHERE n = 1")
            .await
            .map(|()| other)
    });
    let mut watch = shard.connect().await.unwrap();
    let waits = "SELECT COUNT(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'";
    let deadline = Instant::now() + Duration::from_secs(60);
    while watch.query_first::<u64, _>(waits).await.unwrap() != Some(1) {
        assert!(
            Instant::now() < deadline,
            "the other transaction never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The holder's next statement closes the cycle and loses.
    match holder
        .conn()
        .query_drop("UPDATE dl_rows SET v = 1 WHERE n = 2")
        .await
    {
        Err(shardlock::mysql_async::Error::Server(e)) => assert_eq!(e.code, 1213, "{e}"),
        other => panic!("the holder's statement was not the deadlock's victim: {other:?}"),
    }
    let mut other = waiting.await.unwrap().unwrap();
    other.query_drop("COMMIT").await.unwrap();
    let taken = router
        .lock_in_transaction("tx:deadlock", Duration::ZERO)
        .await
        .expect("the deadlock ended the holder's lock");
    holder
        .conn()
        .query_drop("INSERT INTO dl_after VALUES (1)")
        .await
        .unwrap();
    let after = "SELECT COUNT(*) FROM dl_after";
    assert_eq!(
        count_rows(&cluster, after).await,
        0,
        "a statement run after the deadlock ended the lock was committed without it"
    );
    taken.rollback().await.unwrap();
    let committed = holder.commit().await;
    assert!(
        matches!(committed, Err(Error::LockLost { .. })),
        "{committed:?}"
    );
    assert_eq!(count_rows(&cluster, after).await, 0);
}

/// An owner, a worker name, a queue or a job's payload too long for its column is refused by
/// name before any statement, and one that fits is taken. Before, the server refused the write as data
/// too long, which read as the shard failing (a `Backend` error, counted against it).
#[tokio::test(flavor = "multi_thread")]
async fn an_owner_or_worker_name_too_long_for_its_column_is_refused_by_name() {
    let (_cluster, router, _) = common::start(1, "").await;
    let answer = router.cas_acquire("cas:long", &"o".repeat(192)).await;
    assert!(
        matches!(answer, Err(Error::InvalidArgument { name: "owner", .. })),
        "a 192-byte CAS owner was answered {answer:?}"
    );
    let guard = router
        .cas_acquire("cas:long", &"o".repeat(191))
        .await
        .unwrap()
        .expect("nobody holds the key");
    assert!(router.cas_release(guard).await.unwrap());

    for (queue, payload, name) in [
        ("q".repeat(256), vec![0u8; 4], "queue"),
        ("q:long".to_owned(), vec![0u8; 65_536], "payload"),
    ] {
        let answer = router
            .enqueue_job(&queue, &payload, Duration::ZERO, 0)
            .await;
        assert!(
            matches!(answer, Err(Error::InvalidArgument { name: n, .. }) if n == name),
            "a job with a {name} too long for its column was answered {answer:?}"
        );
    }
    let answer = router
        .claim_job(&"q".repeat(256), "w", Duration::from_secs(5))
        .await;
    assert!(
        matches!(answer, Err(Error::InvalidArgument { name: "queue", .. })),
        "a claim on a queue too long for its column was answered {answer:?}"
    );
    router
        .enqueue_job("q:long", b"once", Duration::ZERO, 0)
        .await
        .unwrap();
    let answer = router
        .claim_job("q:long", &"w".repeat(180), Duration::from_secs(5))
        .await;
    assert!(
        matches!(answer, Err(Error::InvalidArgument { name: "worker", .. })),
        "a claim by a 180-byte worker name was answered {answer:?}"
    );
    let job = router
        .claim_job("q:long", &"w".repeat(60), Duration::from_secs(5))
        .await
        .unwrap()
        .expect("the job is still due: the refused claim claimed nothing");
    assert!(router.complete_job(&job).await.unwrap());
}
