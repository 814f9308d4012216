//! The lease cleaner and the instance registry, against real shards: leases of live instances
//! are kept, a killed instance's leases go once its heartbeat is stale, two cleaners never both
//! delete, a million released rows are cleaned in batches under load, and a force-release
//! evicts a live holder with a fence that rejects its later writes.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Conn, Value};
use shardlock::{AcquireOptions, Error, InstanceVerdict, LockRouter};
use shardlock_testkit::{report, Cluster, Proxy, ProxyMode, Worker};
use tokio::time::Instant;

/// A quick cleaner: grace 300 ms, heartbeats every 100 ms, dead after `timeout` of silence.
fn cleaner_yaml(timeout: &str) -> String {
    format!(
        "cleaner:\n  interval: 200ms\n  grace: 300ms\n  batch-size: 100\n  batch-pause: 1ms\n  \
         registry: heartbeat\n  heartbeat-interval: 100ms\n  heartbeat-timeout: {timeout}\n\
         namespaces:\n  default:\n    ttl: 300ms\n    wait: 2s\n"
    )
}

async fn router(yaml: &str) -> LockRouter {
    LockRouter::from_yaml_str(yaml).await.unwrap()
}

/// The shard of the cluster that holds `key`.
async fn shard_conn(cluster: &Cluster, router: &LockRouter, key: &str) -> Conn {
    let name = router.shard_for(key).unwrap();
    let shard = cluster.shards().iter().find(|s| s.name() == name).unwrap();
    shard.connect().await.unwrap()
}

async fn row_exists(cluster: &Cluster, router: &LockRouter, key: &str) -> bool {
    let mut c = shard_conn(cluster, router, key).await;
    let n: Option<u64> = c
        .exec_first(
            "SELECT COUNT(*) FROM shardlock_lease WHERE lock_key = ?",
            (key.as_bytes(),),
        )
        .await
        .unwrap();
    n == Some(1)
}

/// A lease row of `owner` on `key` that ended 10 s ago and was never released.
async fn plant_ended_lease(cluster: &Cluster, router: &LockRouter, key: &str, owner: &str) {
    let mut c = shard_conn(cluster, router, key).await;
    c.exec_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         VALUES (?, ?, 1, 1000, NOW(3) - INTERVAL 10 SECOND, NOW(3) - INTERVAL 11 SECOND)",
        (key.as_bytes(), owner),
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ended_lease_of_a_live_instance_is_kept_and_taken_over_by_acquire() {
    let (cluster, _router, yaml) = common::start(2, &cleaner_yaml("2s")).await;
    let holder = router(&yaml).await; // heartbeats from now on
    let cleaner = router(&yaml).await;
    let live_instance = holder.instance_id().to_owned();
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            let instances = cleaner.instances().await;
            instances.iter().all(|(_, rows)| {
                rows.as_ref()
                    .is_ok_and(|r| r.iter().any(|i| i.instance_id == live_instance))
            })
        })
        .await,
        "the holder never registered on every shard"
    );
    plant_ended_lease(
        &cluster,
        &cleaner,
        "stuck:live",
        &format!("{live_instance}:77"),
    )
    .await;
    plant_ended_lease(&cluster, &cleaner, "stuck:ghost", "ghost-instance:77").await;

    let report = cleaner.clean_once().await.unwrap();
    assert!(report.leader);
    let kept: u64 = report.shards.iter().map(|s| s.kept_live_holder).sum();
    let abandoned: u64 = report.shards.iter().map(|s| s.abandoned).sum();
    assert_eq!((kept, abandoned), (1, 1), "{report:?}");
    assert!(row_exists(&cluster, &cleaner, "stuck:live").await);
    assert!(!row_exists(&cluster, &cleaner, "stuck:ghost").await);

    // The row of the live instance is not deleted, but its lease ended: acquire takes it over,
    // with a larger fence.
    let guard = cleaner
        .acquire("stuck:live", AcquireOptions::new())
        .await
        .unwrap();
    assert!(guard.fence() > 1);
    guard.release().await.unwrap();
}

/// A row another session keeps locked (a console's open transaction) is passed over, not
/// waited for: the pass deletes the rest of its batch, goes on and reports the row in use; the
/// row goes in a later pass, once it is let go. (Waited for, every pass would stop at that
/// batch after the server's whole lock wait, and count the wait against the shard.)
#[tokio::test(flavor = "multi_thread")]
async fn a_row_locked_by_another_session_is_passed_over_not_waited_for() {
    let (cluster, _router, yaml) = common::start(1, &cleaner_yaml("2s")).await;
    let cleaner = router(&yaml).await;
    for key in ["ghost:a", "ghost:b", "ghost:c"] {
        plant_ended_lease(&cluster, &cleaner, key, "ghost-instance:77").await;
    }
    let mut console = shard_conn(&cluster, &cleaner, "ghost:b").await;
    console.query_drop("BEGIN").await.unwrap();
    console
        .query_drop("SELECT owner FROM shardlock_lease WHERE lock_key = 'ghost:b' FOR UPDATE")
        .await
        .unwrap();

    let report = cleaner.clean_once().await.unwrap();
    let shard = &report.shards[0];
    assert_eq!(shard.error, None, "the pass stopped at the locked row");
    assert_eq!(
        (shard.abandoned, shard.in_use),
        (2, 1),
        "the rows around the locked one: {report:?}"
    );
    assert!(!row_exists(&cluster, &cleaner, "ghost:a").await);
    assert!(row_exists(&cluster, &cleaner, "ghost:b").await);
    assert!(!row_exists(&cluster, &cleaner, "ghost:c").await);

    console.query_drop("ROLLBACK").await.unwrap();
    let report = cleaner.clean_once().await.unwrap();
    let shard = &report.shards[0];
    assert_eq!((shard.abandoned, shard.in_use), (1, 0), "{report:?}");
    assert!(!row_exists(&cluster, &cleaner, "ghost:b").await);
}

/// A delete that fails half way (the server refuses one row of the batch) is rolled back at
/// once: the rows it locked are not left locked on an idle pooled connection, holding up the
/// acquires of their keys.
#[tokio::test(flavor = "multi_thread")]
async fn a_delete_that_fails_half_way_leaves_no_row_locked() {
    let (cluster, _router, yaml) = common::start(1, &cleaner_yaml("2s")).await;
    let cleaner = router(&yaml).await;
    for key in ["ghost:a", "ghost:b"] {
        plant_ended_lease(&cluster, &cleaner, key, "ghost-instance:77").await;
    }
    let mut admin = shard_conn(&cluster, &cleaner, "ghost:a").await;
    admin
        .query_drop(
            "CREATE TRIGGER refuse_b BEFORE DELETE ON shardlock_lease FOR EACH ROW \
             BEGIN IF OLD.lock_key = 'ghost:b' THEN \
             SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused'; END IF; END",
        )
        .await
        .unwrap();
    let report = cleaner.clean_once().await.unwrap();
    assert!(
        report.shards[0].error.is_some(),
        "the refused delete went through: {report:?}"
    );
    let free = admin
        .query_drop(
            "SELECT owner FROM shardlock_lease WHERE lock_key IN ('ghost:a', 'ghost:b') \
             FOR UPDATE NOWAIT",
        )
        .await;
    assert!(
        free.is_ok(),
        "the rows of the failed delete stayed locked: {free:?}"
    );
}

/// A process restarted under its fixed instance id (a StatefulSet's pod) runs under a new start
/// nonce: the ended leases of the start before it are deleted, though the id is live again,
/// while its own are kept. (The registry's row of an id passes to a new start only once the
/// one before counted as dead, whose leases were lost then.)
#[tokio::test(flavor = "multi_thread")]
async fn ended_leases_of_an_earlier_start_under_a_live_id_are_deleted() {
    let (cluster, _migrated, _) = common::start(1, "").await;
    let live =
        router(&cluster.config_yaml(&format!("instance:\n  id: w1\n{}", cleaner_yaml("2s")))).await;
    let own = live.acquire("own", AcquireOptions::new()).await.unwrap();
    let nonce = own.owner().split(':').nth(1).unwrap().to_owned();
    own.release().await.unwrap();
    assert!(
        common::eventually(Duration::from_secs(5), || async {
            let instances = live.instances().await;
            instances.iter().all(|(_, rows)| {
                rows.as_ref()
                    .is_ok_and(|r| r.iter().any(|i| i.instance_id == "w1"))
            })
        })
        .await,
        "the live start never registered"
    );
    only_the_earlier_starts_lease_goes(&cluster, &live, &nonce).await;
}

/// The same with a registry that knows ids, not starts (`static`, listing `w1` as live): the
/// cleaner's own start is the one start its id has now. Before, such a registry kept the
/// ended leases of every earlier start under a listed id for ever.
#[tokio::test(flavor = "multi_thread")]
async fn ended_leases_of_an_earlier_start_under_a_listed_id_are_deleted() {
    let (cluster, _migrated, _) = common::start(1, "").await;
    let yaml = cleaner_yaml("2s").replace(
        "registry: heartbeat",
        "registry: static\n  live-instances: [w1]",
    );
    let live = router(&cluster.config_yaml(&format!("instance:\n  id: w1\n{yaml}"))).await;
    let own = live.acquire("own", AcquireOptions::new()).await.unwrap();
    let nonce = own.owner().split(':').nth(1).unwrap().to_owned();
    own.release().await.unwrap();
    only_the_earlier_starts_lease_goes(&cluster, &live, &nonce).await;
}

/// A cleaner that lost its leadership (force-released, as an operator does) leads again at its
/// next pass when nobody else does. Before, the lost leadership's release still held the key's
/// turn in process when the pass tried to lead without waiting: the pass reported
/// `leader: false`, and nothing was cleaned until the pass after.
#[tokio::test(flavor = "multi_thread")]
async fn a_cleaner_that_lost_its_leadership_leads_again_at_its_next_pass() {
    let (_cluster, _migrated, yaml) = common::start(1, &cleaner_yaml("2s")).await;
    let cleaner = router(&yaml).await;
    assert!(cleaner.clean_once().await.unwrap().leader);
    let operator = router(&yaml).await;
    let freed = operator
        .force_release(shardlock::CLEANER_LOCK_KEY)
        .await
        .unwrap();
    assert!(freed.is_some());
    let lost = common::eventually(Duration::from_secs(30), || async {
        cleaner.stats().lost > 0
    })
    .await;
    assert!(lost, "the cleaner never learnt it lost its leadership");
    let report = cleaner.clean_once().await.unwrap();
    assert!(report.leader, "{report:?}");
}

/// A lease released with a minimum hold keeps its owner until the hold ends; once it has
/// ended, the cleaner deletes it as the released row it is, though its holder lives on. It
/// was kept "for a live holder" for as long as the holder's process ran.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_kept_past_its_release_goes_once_its_hold_ended_though_its_holder_lives() {
    let (cluster, _migrated, yaml) = common::start(1, &cleaner_yaml("2s")).await;
    let holder = router(&yaml).await; // heartbeats from now on: alive
    let guard = holder
        .acquire(
            "kept:1",
            AcquireOptions::new().lock_at_least(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    guard.release().await.unwrap();
    let cleaner = router(&yaml).await;
    let gone = common::eventually(Duration::from_secs(20), || async {
        cleaner.clean_once().await.unwrap();
        !row_exists(&cluster, &cleaner, "kept:1").await
    })
    .await;
    let last = cleaner.clean_once().await.unwrap();
    assert!(
        gone,
        "a released row kept for a minimum hold stayed: {last:?}"
    );
    holder.shutdown().await.unwrap();
    cleaner.shutdown().await.unwrap();
}

/// A registry of one's own, as a test scripts it.
#[derive(Debug)]
enum Scripted {
    /// Never answers.
    Hung,
    /// Fails every question.
    Failing,
    /// Says when it is asked, then never answers.
    HungOnceAsked(Arc<tokio::sync::Notify>),
}

impl shardlock::InstanceRegistry for Scripted {
    fn dead<'a>(
        &'a self,
        _shard: &'a str,
        _instances: &'a [String],
    ) -> futures_util::future::BoxFuture<'a, shardlock::Result<Vec<String>>> {
        match self {
            Scripted::Failing => Box::pin(async {
                Err(Error::InvalidArgument {
                    name: "registry",
                    reason: "the registry's service is down".into(),
                })
            }),
            Scripted::HungOnceAsked(asked) => {
                asked.notify_one();
                Box::pin(std::future::pending())
            }
            Scripted::Hung => Box::pin(std::future::pending()),
        }
    }
}

/// A registry of your own that hangs is given up on as a shard that does not answer would be
/// (its statement timeout): the pass reports it and deletes nothing there, and ends, so the
/// cleaner lock it holds does not stop cleaning for the whole fleet. Before, the pass waited
/// for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_pass_asking_a_registry_that_hangs_ends_and_deletes_nothing() {
    let (cluster, _migrated, _) = common::start(1, "").await;
    let yaml = cluster.config_yaml(&cleaner_yaml("2s")).replacen(
        "    url:",
        "    statement-timeout: 1s\n    url:",
        1,
    );
    let cleaner = router(&yaml).await;
    cleaner.set_registry(Arc::new(Scripted::Hung));
    plant_ended_lease(&cluster, &cleaner, "stuck:hung", "gone:0000000000000000:1").await;
    let pass = tokio::time::timeout(Duration::from_secs(60), cleaner.clean_once()).await;
    let report = pass
        .expect("a pass waited for ever on its registry")
        .unwrap();
    let error = report.shards[0].error.clone().unwrap_or_default();
    assert!(error.contains("did not answer"), "{report:?}");
    assert!(row_exists(&cluster, &cleaner, "stuck:hung").await);
}

/// A registry that cannot judge the owners of one batch's ended leases keeps those, and the
/// pass goes on through the shard: released rows after them in key order are deleted. Before,
/// the error ended the shard's pass at the first ended lease, pass after pass.
#[tokio::test(flavor = "multi_thread")]
async fn a_registry_error_keeps_its_batchs_ended_leases_and_the_pass_goes_on() {
    let (cluster, _migrated, _) = common::start(1, "").await;
    let cleaner = router(&cluster.config_yaml(&cleaner_yaml("2s"))).await;
    cleaner.set_registry(Arc::new(Scripted::Failing));
    // First in key order, then more released rows than one batch (100) takes.
    plant_ended_lease(&cluster, &cleaner, "0:ended", "gone:0000000000000000:1").await;
    let mut c = shard_conn(&cluster, &cleaner, "0:ended").await;
    for i in 0..150 {
        c.exec_drop(
            "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, \
             acquired_at) VALUES (?, NULL, 1, 1000, NOW(3) - INTERVAL 10 SECOND, \
             NOW(3) - INTERVAL 11 SECOND)",
            (format!("z:{i:03}").into_bytes(),),
        )
        .await
        .unwrap();
    }
    let report = cleaner.clean_once().await.unwrap();
    let shard = &report.shards[0];
    assert_eq!(
        (shard.released, shard.unjudged),
        (150, 1),
        "the pass stopped at the registry's error: {report:?}"
    );
    assert!(shard
        .error
        .as_deref()
        .unwrap_or_default()
        .contains("service is down"));
    assert!(row_exists(&cluster, &cleaner, "0:ended").await);
    cleaner.shutdown().await.unwrap();
}

/// The stop of a running cleaner ends a pass under way (a pass over millions of rows may
/// outlast a service manager's stop timeout, whose kill leaves the cleaner lock held until
/// its ttl), and gives the cleaner lock back. Before, the stop waited for the pass to end.
#[tokio::test(flavor = "multi_thread")]
async fn a_stop_ends_the_pass_under_way_and_gives_the_cleaner_lock_back() {
    let (cluster, _migrated, _) = common::start(1, "").await;
    // The registry is waited for up to the statement timeout: longer than the test waits.
    let yaml = cluster.config_yaml(&cleaner_yaml("2s")).replacen(
        "    url:",
        "    statement-timeout: 120s\n    url:",
        1,
    );
    let cleaner = router(&yaml).await;
    let asked = Arc::new(tokio::sync::Notify::new());
    cleaner.set_registry(Arc::new(Scripted::HungOnceAsked(asked.clone())));
    plant_ended_lease(&cluster, &cleaner, "stuck:stop", "gone:0000000000000000:1").await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = cleaner.clone();
    let run = tokio::spawn(async move {
        running
            .run_cleaner(
                async {
                    let _ = stopped.await;
                },
                |_| {},
            )
            .await
    });
    asked.notified().await;
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the stop waited for the pass under way")
        .unwrap();
    let other = router(&yaml).await;
    let report = other.clean_once().await.unwrap();
    assert!(report.leader, "the cleaner lock was kept: {report:?}");
    other.shutdown().await.unwrap();
    cleaner.shutdown().await.unwrap();
}

/// Plants ended leases under `live`'s id `w1`: of an earlier start, of its own start (`nonce`),
/// and in the format before start nonces; one pass of `live`'s cleaner deletes the first only.
async fn only_the_earlier_starts_lease_goes(cluster: &Cluster, live: &LockRouter, nonce: &str) {
    let other_nonce = if nonce == "0000000000000000" {
        "1111111111111111"
    } else {
        "0000000000000000"
    };
    plant_ended_lease(
        cluster,
        live,
        "stuck:earlier",
        &format!("w1:{other_nonce}:7"),
    )
    .await;
    plant_ended_lease(cluster, live, "stuck:own", &format!("w1:{nonce}:999")).await;
    plant_ended_lease(cluster, live, "stuck:old-format", "w1:77").await;

    let report = live.clean_once().await.unwrap();
    let kept: u64 = report.shards.iter().map(|s| s.kept_live_holder).sum();
    let abandoned: u64 = report.shards.iter().map(|s| s.abandoned).sum();
    assert_eq!((kept, abandoned), (2, 1), "{report:?}");
    assert!(!row_exists(cluster, live, "stuck:earlier").await);
    assert!(row_exists(cluster, live, "stuck:own").await);
    assert!(row_exists(cluster, live, "stuck:old-format").await);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_instance_leases_go_once_its_heartbeat_is_stale() {
    let (cluster, _router, yaml) = common::start(2, &cleaner_yaml("3s")).await;
    let mut worker =
        Worker::spawn("worker", "holder", &[(common::CONFIG_ENV, yaml.clone())]).unwrap();
    let ready = worker.expect("ready ").await.unwrap();
    let instance = ready.trim_start_matches("ready ").trim().to_owned();
    worker.kill().await.unwrap();
    let killed = Instant::now();

    let cleaner = router(&yaml).await;
    // The killed instance's heartbeat is kept fresh here until a pass has seen its leases
    // ended and kept them (the time between their end and its heartbeat going stale is short
    // for a busy machine); then it goes stale.
    let mut shards = Vec::new();
    for shard in cluster.shards() {
        shards.push(shard.connect().await.unwrap());
    }
    let mut kept_while_alive = 0;
    let mut abandoned = 0;
    while abandoned < HELD_KEYS as u64 {
        if kept_while_alive < HELD_KEYS as u64 {
            for conn in &mut shards {
                conn.exec_drop(
                    "UPDATE shardlock_instance SET heartbeat_at = NOW(3) WHERE instance_id = ?",
                    (&instance,),
                )
                .await
                .unwrap();
            }
        }
        assert!(
            killed.elapsed() < Duration::from_secs(60),
            "the killed instance's leases were never deleted ({abandoned} of {HELD_KEYS})"
        );
        let report = cleaner.clean_once().await.unwrap();
        let kept: u64 = report.shards.iter().map(|s| s.kept_live_holder).sum();
        let deleted: u64 = report.shards.iter().map(|s| s.abandoned).sum();
        // Deleted only where the registry says the instance is dead: its heartbeat there is
        // older than the timeout.
        let registry = cleaner.instances().await;
        for cleaned in report.shards.iter().filter(|s| s.abandoned > 0) {
            let (_, rows) = registry
                .iter()
                .find(|(name, _)| *name == cleaned.shard)
                .unwrap();
            let beat = rows
                .as_ref()
                .unwrap()
                .iter()
                .find(|i| i.instance_id == instance);
            assert!(
                beat.is_some_and(|i| i.heartbeat_ms_ago >= 3000),
                "deleted on {} while the heartbeat was fresh: {beat:?}",
                cleaned.shard
            );
        }
        kept_while_alive = kept_while_alive.max(kept);
        abandoned += deleted;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(abandoned, HELD_KEYS as u64);
    assert_eq!(
        kept_while_alive, HELD_KEYS as u64,
        "before the heartbeat went stale, a pass saw the ended leases and kept them"
    );
    for i in 0..HELD_KEYS {
        assert!(!row_exists(&cluster, &cleaner, &format!("held:{i}")).await);
    }
}

const HELD_KEYS: usize = 6;

/// Holds `HELD_KEYS` keys, says which instance it is, and waits to be killed.
async fn holder_worker() {
    let router = common::worker_router().await;
    let mut guards = Vec::new();
    for i in 0..HELD_KEYS {
        guards.push(
            router
                .acquire(&format!("held:{i}"), AcquireOptions::new())
                .await
                .unwrap(),
        );
    }
    report!("ready {}", router.instance_id());
    std::future::pending::<()>().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_cleaners_never_both_delete() {
    // The cleaner lock (a lease of the default namespace) and the routers' heartbeats outlast
    // any stall of a busy machine: the leader keeps the lock through every pass. (Released
    // rows are deleted after the grace whatever the heartbeat timeout.)
    let yaml = cleaner_yaml("30s").replace("ttl: 300ms", "ttl: 30s");
    let (cluster, router_a, yaml) = common::start(2, &yaml).await;
    common::lock_cycles(&router_a, "gone", 300, AcquireOptions::new()).await;
    let (one, two) = (router(&yaml).await, router(&yaml).await);
    let mut deleted = [0u64; 2];
    let mut leader_passes = [0u32; 2];
    let mut passes = 0;
    while deleted.iter().sum::<u64>() < 300 {
        // Every row is past its grace after two passes (each 200 ms or more apart).
        passes += 1;
        assert!(passes <= 50, "{deleted:?} after {passes} passes");
        let (a, b) = tokio::join!(one.clean_once(), two.clean_once());
        let (a, b) = (a.unwrap(), b.unwrap());
        assert!(!(a.leader && b.leader), "two cleaners in one pass");
        for (i, report) in [a, b].into_iter().enumerate() {
            if report.leader {
                leader_passes[i] += 1;
            } else {
                assert_eq!(report.deleted(), 0);
            }
            deleted[i] += report.deleted();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // One of them cleaned every pass; the other stood by every pass.
    assert!(
        deleted.contains(&0) && deleted.contains(&300),
        "{deleted:?}, leader passes {leader_passes:?}"
    );
    assert!(leader_passes.contains(&0), "{leader_passes:?}");
    let _ = cluster;
}

/// A pass raises the shard's fence floor once, however many batches it deletes. A raise waits
/// for an exclusive lock on the floor's row, which every acquire reads under a shared lock for
/// its whole statement, a wait for its own row included: a raise waiting behind such an
/// acquire held up every acquire of the shard, and a pass raised the floor once per batch (then
/// once per batch whose fences were above what it had raised it to), so the stall came again
/// batch after batch.
#[tokio::test(flavor = "multi_thread")]
async fn a_pass_raises_the_fence_floor_once() {
    let extra = "cleaner:\n  registry: static\n  batch-size: 100\n  grace: 1s\n";
    let (cluster, router, _) = common::start(1, extra).await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    // Five batches of released rows, each with fences above the last's.
    c.query_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         SELECT CONCAT('garbage:', LPAD(seq, 3, '0')), NULL, seq, 1000, \
         NOW(3) - INTERVAL 1 HOUR, NOW(3) - INTERVAL 1 HOUR FROM seq_1_to_500",
    )
    .await
    .unwrap();
    // Every statement the shard runs, in a table.
    c.query_drop("SET GLOBAL log_output = 'TABLE'")
        .await
        .unwrap();
    c.query_drop("SET GLOBAL general_log = 1").await.unwrap();
    common::clean_pass(&router).await;
    c.query_drop("SET GLOBAL general_log = 0").await.unwrap();
    let left: Option<u64> = c
        .query_first("SELECT COUNT(*) FROM shardlock_lease WHERE lock_key LIKE 'garbage:%'")
        .await
        .unwrap();
    assert_eq!(left, Some(0), "the pass left released rows");
    let raises: Option<u64> = c
        .query_first(
            "SELECT COUNT(*) FROM mysql.general_log WHERE command_type = 'Execute' \
             AND argument LIKE 'INSERT INTO shardlock_meta%fence-floor%'",
        )
        .await
        .unwrap();
    assert_eq!(
        raises,
        Some(1),
        "the pass raised the fence floor more than once"
    );
}

/// A pass waits a second at most for the shard's fence floor: a raise waits for an exclusive
/// lock on the floor's row, which an acquire holds shared for its whole statement, its wait
/// behind another transaction's lock on its own row included, and while the raise waited every
/// other acquire of the shard waited behind it, for up to the server's whole lock wait (here
/// 4 s, for a statement timeout of 5 s). Given up, the rest of the shard is left to the next
/// pass.
#[tokio::test(flavor = "multi_thread")]
async fn a_pass_gives_up_on_a_fence_floor_held_by_an_acquire_behind_a_locked_row() {
    let cluster = Cluster::start(1).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 5s\n\
         cleaner:\n  registry: static\n  grace: 1s\n",
        cluster.shard(0).url()
    );
    let router = router(&yaml).await;
    router.migrate().await.unwrap();
    let mut c = cluster.shard(0).connect().await.unwrap();
    c.query_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         SELECT CONCAT('garbage:', seq), NULL, seq, 1000, \
         NOW(3) - INTERVAL 1 HOUR, NOW(3) - INTERVAL 1 HOUR FROM seq_1_to_10",
    )
    .await
    .unwrap();
    let shard = cluster.shard(0);
    let console = common::locked_row(&router, shard, "k").await;
    let waiter = {
        let router = router.clone();
        let opts = AcquireOptions::new().wait(Duration::from_secs(60));
        tokio::spawn(async move { router.acquire("k", opts).await })
    };
    let waiting = common::eventually(Duration::from_secs(30), || async {
        shard.lock_waits_now().await.unwrap() > 0
    })
    .await;
    assert!(waiting, "the acquire never waited behind the locked row");
    // Held until the pass is done: the acquire waits behind it, 4 s at a time, and asks again.
    let report = router.clean_once().await.unwrap();
    console.end().await.unwrap();
    let error = report.shards[0].error.clone().unwrap_or_default();
    assert!(
        error.contains("fence floor") && report.shards[0].released == 0,
        "a pass waited for the fence floor behind an acquire that waited for a locked row: \
         {report:?}"
    );
    let held = waiter
        .await
        .unwrap()
        .expect("granted once the row was let go");
    held.release().await.unwrap();
    let report = router.clean_once().await.unwrap();
    assert_eq!(report.shards[0].released, 10, "{report:?}");
}

/// A long run of rows the cleaner may not remove (live leases) before rows it may: each of its
/// scans examines at most a batch of rows, whatever they hold. Filtered in the same statement,
/// the run was read whole before the first row that qualified, past the statement timeout on a
/// big enough shard, and every pass stopped at the same key.
#[tokio::test(flavor = "multi_thread")]
async fn a_pass_examines_at_most_a_batch_of_rows_per_scan() {
    let extra = "cleaner:\n  registry: static\n  batch-size: 50\n  batch-pause: 1ms\n  grace: 1s\n";
    let (cluster, _router, yaml) = common::start(1, extra).await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    // 5,000 live leases, then 120 released rows, in key order.
    c.query_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         SELECT CONCAT('live:', LPAD(seq, 4, '0')), CONCAT('elsewhere:n:', seq), seq, 3600000, \
         NOW(3) + INTERVAL 1 HOUR, NOW(3) FROM seq_1_to_5000",
    )
    .await
    .unwrap();
    c.query_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         SELECT CONCAT('released:', LPAD(seq, 3, '0')), NULL, seq, 1000, \
         NOW(3) - INTERVAL 1 HOUR, NOW(3) - INTERVAL 1 HOUR FROM seq_1_to_120",
    )
    .await
    .unwrap();
    // Every statement of sessions opened from now on, with the rows it examined, in a table.
    for set in [
        "SET GLOBAL log_output = 'TABLE'",
        "SET GLOBAL long_query_time = 0",
        "SET GLOBAL slow_query_log = 1",
    ] {
        c.query_drop(set).await.unwrap();
    }
    let cleaner = router(&yaml).await;
    common::clean_pass(&cleaner).await;
    c.query_drop("SET GLOBAL slow_query_log = 0").await.unwrap();
    let left: Option<u64> = c
        .query_first("SELECT COUNT(*) FROM shardlock_lease WHERE lock_key LIKE 'released:%'")
        .await
        .unwrap();
    assert_eq!(
        left,
        Some(0),
        "the pass left released rows behind live ones"
    );
    let (scans, most): (u64, Option<u64>) = c
        .query_first(
            "SELECT COUNT(*), MAX(rows_examined) FROM mysql.slow_log \
             WHERE sql_text LIKE 'SELECT lock_key, owner, fence, %shardlock_lease WHERE lock_key > %'",
        )
        .await
        .unwrap()
        .unwrap();
    // The window's rows are read again by the statement's own steps (the window functions):
    // a few times 50, far below the 5,000 of the run.
    let most = most.expect("no scan was logged");
    assert!(
        most <= 10 * 50,
        "a scan examined {most} rows, with a batch size of 50"
    );
    // 5,120 rows in windows of 50, the last one short (the end).
    assert_eq!(scans, 5120_u64.div_ceil(50), "scans of the pass");
}

/// Rows planted for the batch test.
const GARBAGE: u64 = 1_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_million_released_rows_are_cleaned_in_batches_under_load() {
    // Batches of a thousand deletes beside 32 busy tasks are slow on a loaded machine: this
    // test is about the batches, not the breaker, so slow calls do not open it.
    let extra = "cleaner:\n  batch-size: 1000\n  batch-pause: 10ms\n  grace: 1s\n\
                 breaker:\n  slow-call: 10s\n";
    let (cluster, router, _yaml) = common::start(1, extra).await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    let planted = Instant::now();
    c.query_drop(format!(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         SELECT CONCAT('garbage:', LPAD(seq, 7, '0')), NULL, seq, 1000, \
         NOW(3) - INTERVAL 1 HOUR, NOW(3) - INTERVAL 1 HOUR FROM seq_1_to_{GARBAGE}"
    ))
    .await
    .unwrap();
    eprintln!("planted {GARBAGE} released rows in {:?}", planted.elapsed());

    // 32 tasks acquire and release other keys of the same shard throughout. (Their latency
    // while the cleaner runs is measured by `shardlock bench --scenario cleaner`.)
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..32)
        .map(|t| {
            let (router, stop) = (router.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let key = format!("live:{t}:{}", i % 16);
                    i += 1;
                    let guard = router.acquire(&key, AcquireOptions::new()).await.unwrap();
                    guard.release().await.unwrap();
                }
                i
            })
        })
        .collect();
    let started = Instant::now();
    let mut deleted = 0;
    let mut batches = 0;
    let mut passes = 0;
    while deleted < GARBAGE {
        let report = router.clean_once().await.unwrap();
        assert!(report.leader);
        assert!(report.shards[0].error.is_none(), "{report:?}");
        // Every pass makes progress (so the loop ends), in batches of at most batch-size.
        assert!(
            report.shards[0].released > 0,
            "a pass deleted nothing: {report:?}"
        );
        deleted += report.shards[0].released;
        batches += report.shards[0].batches;
        passes += 1;
    }
    assert!(
        batches <= GARBAGE / 1000 + passes,
        "{batches} batches of at most 1000 rows for {GARBAGE} rows in {passes} passes"
    );
    let cleaned_in = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    let mut acquires = 0;
    for t in tasks {
        acquires += t.await.unwrap();
    }
    let left: Option<u64> = c
        .query_first("SELECT COUNT(*) FROM shardlock_lease WHERE lock_key LIKE 'garbage:%'")
        .await
        .unwrap();
    assert_eq!(left, Some(0), "garbage left behind");
    assert_eq!(deleted, GARBAGE);
    eprintln!(
        "cleaned {GARBAGE} rows in {cleaned_in:?} ({batches} batches, {passes} passes) beside \
         {acquires} acquires"
    );
}

/// Force-release looks for the key on every shard of its config, but a shard where the key
/// does not live that is down holds nothing up: the key is still freed where it is held (an
/// incident, when force-release is used, is when a shard is down).
#[tokio::test(flavor = "multi_thread")]
async fn force_release_passes_over_a_dead_shard_where_the_key_does_not_live() {
    let (cluster, holder, yaml) = common::start(2, "").await;
    let key = (0..)
        .map(|i| format!("stuck:{i}"))
        .find(|k| holder.shard_for(k).unwrap() == "s1")
        .unwrap();
    let stuck = holder.acquire(&key, AcquireOptions::new()).await.unwrap();
    cluster.shard(1).kill().unwrap();
    let operator = router(&yaml).await;
    let held = operator.holders(&key).await.unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    let released = operator.force_release_everywhere(&key).await.unwrap();
    assert_eq!(released.len(), 1, "{released:?}");
    assert_eq!(released[0].owner, stuck.owner());
    tokio::time::timeout(Duration::from_secs(10), stuck.lost())
        .await
        .expect("the evicted holder never saw lost()");
}

/// A force-release whose key's own shard does not answer still frees the key where else it is
/// held (a process of another topology), and its error says whom it evicted there: an
/// operator who saw only "unavailable" would take it that nothing happened.
#[tokio::test(flavor = "multi_thread")]
async fn a_force_release_that_fails_on_the_keys_shard_says_what_it_released_elsewhere() {
    let cluster = Cluster::start(2).await.unwrap();
    let proxy = Proxy::start(cluster.shard(1).port()).await.unwrap();
    // A process whose topology has s1 alone holds a key there that the operator's places on s2.
    let alone = format!(
        "shards:\n  - name: s1\n    url: {}\n",
        cluster.shard(0).url()
    );
    let other = LockRouter::from_yaml_str(&alone).await.unwrap();
    other.migrate().await.unwrap();
    let operator = LockRouter::from_yaml_str(
        &cluster
            .config_yaml("")
            .replace(&cluster.shard(1).url(), &proxy.url()),
    )
    .await
    .unwrap();
    operator.migrate().await.unwrap();
    let key = (0..)
        .map(|i| format!("stuck:{i}"))
        .find(|k| operator.shard_for(k).unwrap() == "s2")
        .unwrap();
    let stuck = other.acquire(&key, AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::Reset);

    let err = operator.force_release_everywhere(&key).await.unwrap_err();
    let said = shardlock::Report(&err).to_string();
    assert!(
        err.is_unavailable()
            && said.contains("force-released on shard s1")
            && said.contains(stuck.owner()),
        "a force-release that failed on the key's shard did not say what it released: {said}"
    );
    tokio::time::timeout(Duration::from_secs(10), stuck.lost())
        .await
        .expect("the evicted holder never saw lost()");
}

#[tokio::test(flavor = "multi_thread")]
async fn force_release_evicts_a_live_holder_with_a_fence_that_rejects_its_writes() {
    let (cluster, holder, yaml) = common::start(2, "namespaces:\n  default:\n    ttl: 1s\n").await;
    let mut app = common::app_conn(
        &cluster.shard(0).url(),
        &[
            "CREATE TABLE account (id INT PRIMARY KEY, balance INT NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
            "INSERT INTO account VALUES (1, 100, 0)",
        ],
    )
    .await;
    let write = |balance: i32, fence: u64| {
        (
            "UPDATE account SET balance = :balance, fence = :fence WHERE id = 1 AND fence < :fence",
            [("balance", Value::from(balance))],
            fence,
        )
    };
    let stuck = holder
        .acquire("account:1", AcquireOptions::new())
        .await
        .unwrap();
    let (sql, params, fence) = write(90, stuck.fence());
    shardlock::fenced_exec(&mut app, sql, params, fence)
        .await
        .unwrap();

    let operator = router(&yaml).await;
    // As `shardlock release --force` does once the operator confirmed the holder it showed.
    let released = operator
        .force_release_owner("account:1", stuck.owner())
        .await
        .unwrap()
        .unwrap();
    assert!(released.was_live);
    assert_eq!(released.owner, stuck.owner());
    assert!(released.fence > stuck.fence());
    tokio::time::timeout(Duration::from_secs(10), stuck.lost())
        .await
        .expect("the evicted holder never saw lost()");
    assert!(!stuck.is_held());

    let next = operator
        .acquire("account:1", AcquireOptions::new())
        .await
        .unwrap();
    assert!(next.fence() > released.fence);
    let (sql, params, fence) = write(80, next.fence());
    shardlock::fenced_exec(&mut app, sql, params, fence)
        .await
        .unwrap();
    let (sql, params, fence) = write(70, stuck.fence());
    assert!(matches!(
        shardlock::fenced_exec(&mut app, sql, params, fence).await,
        Err(Error::FenceRejected { .. })
    ));
    // The evicted holder confirmed again evicts nobody: not the holder that took the key since.
    assert!(operator
        .force_release_owner("account:1", stuck.owner())
        .await
        .unwrap()
        .is_none());
    let (_, row) = operator.inspect("account:1").await.unwrap();
    assert_eq!(row.and_then(|r| r.owner).as_deref(), Some(next.owner()));
    assert!(operator
        .force_release("nobody:holds:this")
        .await
        .unwrap()
        .is_none());
    next.release().await.unwrap();
    let balance: Option<i32> = app
        .query_first("SELECT balance FROM account")
        .await
        .unwrap();
    assert_eq!(balance, Some(80));
}

/// A pass that cannot try for the cleaner lock (its shard down, this process not joined to its
/// fleet) fails, saying why: a report that another instance cleans would tell a cron job, or
/// a daemon's log, that all is well while maybe none does.
#[tokio::test(flavor = "multi_thread")]
async fn a_pass_that_cannot_try_for_the_cleaner_lock_fails() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n",
        proxy.url()
    ))
    .await
    .unwrap();
    router.migrate().await.unwrap();
    proxy.set(ProxyMode::Reset);
    match router.clean_once().await {
        Err(e) => assert!(e.is_unavailable(), "{e}"),
        Ok(report) => panic!("a pass that could not try for the cleaner lock said: {report:?}"),
    }
}

crate::worker_entry! { "holder" => holder_worker() }

#[tokio::test(flavor = "multi_thread")]
async fn fences_rise_after_the_cleaner_deleted_a_row_even_if_the_clock_steps_back() {
    let cluster = Cluster::start_with_clocks(1, &[(0, "+0")]).await.unwrap();
    let router = LockRouter::from_yaml_str(&cluster.config_yaml("cleaner:\n  grace: 0s\n"))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let mut fences = std::collections::HashMap::new();
    for key in ["a", "b"] {
        let g = router.acquire(key, AcquireOptions::new()).await.unwrap();
        fences.insert(key, g.fence());
        g.release().await.unwrap();
    }
    // Released rows go once the shard's clock has passed their fence by a second.
    let cleaned = common::eventually(Duration::from_secs(30), || async {
        router.clean_once().await.unwrap();
        router.inspect("a").await.unwrap().1.is_none()
            && router.inspect("b").await.unwrap().1.is_none()
    })
    .await;
    assert!(cleaned, "the cleaner deleted both rows");
    // The next grant of a deleted key is above its old fence: by the clock...
    let g = router.acquire("a", AcquireOptions::new()).await.unwrap();
    assert!(
        g.fence() > fences["a"],
        "{} after {}",
        g.fence(),
        fences["a"]
    );
    g.release().await.unwrap();
    // ...and by the shard's fence floor once the clock stepped ten seconds back.
    cluster.shard(0).set_clock("-10s").unwrap();
    let g = router.acquire("b", AcquireOptions::new()).await.unwrap();
    assert!(
        g.fence() > fences["b"],
        "{} after {}",
        g.fence(),
        fences["b"]
    );
    g.release().await.unwrap();
}

/// Heartbeats that fail are counted (and warned about once a shard misses several in a row):
/// others' cleaners count an instance dead after `heartbeat-timeout` without one.
#[tokio::test(flavor = "multi_thread")]
async fn failed_heartbeats_are_counted() {
    let cluster = Cluster::start(1).await.unwrap();
    // s2 is a port nothing listens on.
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n  - name: s2\n    url: mysql://root@127.0.0.1:1/shardlock\n\
         cleaner:\n  heartbeat-interval: 50ms\n",
        cluster.shard(0).url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let r = router.clone();
    assert!(
        common::eventually(Duration::from_secs(20), || {
            let failed = r.stats().heartbeat_failures;
            async move { failed >= 3 }
        })
        .await,
        "heartbeats to the unreachable shard were not counted as failed"
    );
}

/// The registry's verdict on each instance is the one the cleaner acts on — a process killed
/// hours ago is `dead`, not `running` — and the cleaner deletes the rows of instances silent
/// longer than `cleaner.instance-retention`, keeping the recently dead and the live.
#[tokio::test(flavor = "multi_thread")]
async fn long_dead_instances_are_shown_dead_and_forgotten_after_the_retention() {
    let yaml = "cleaner:\n  registry: heartbeat\n  heartbeat-interval: 100ms\n  \
                heartbeat-timeout: 1s\n  instance-retention: 1h\n";
    let (cluster, router, _) = common::start(1, yaml).await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    for (id, silent_for, deregistered) in [
        ("killed-two-hours-ago", "2 HOUR", false),
        ("shut-down-two-hours-ago", "2 HOUR", true),
        ("killed-a-minute-ago", "1 MINUTE", false),
    ] {
        c.exec_drop(
            format!(
                "INSERT INTO shardlock_instance (instance_id, host, pid, started_at, heartbeat_at, \
                 deregistered_at) VALUES (?, 'host', 1, NOW(3) - INTERVAL 3 HOUR, \
                 NOW(3) - INTERVAL {silent_for}, IF(?, NOW(3) - INTERVAL {silent_for}, NULL))"
            ),
            (id, deregistered),
        )
        .await
        .unwrap();
    }
    let own = router.instance_id().to_owned();
    // The router's own heartbeat is in before the verdicts are read.
    assert!(
        common::eventually(Duration::from_secs(10), || async {
            verdicts(&router).await.contains_key(&own)
        })
        .await
    );
    let before = verdicts(&router).await;
    let verdict = |id: &str| before.get(id).copied();
    assert_eq!(verdict("killed-two-hours-ago"), Some(InstanceVerdict::Dead));
    assert_eq!(
        verdict("shut-down-two-hours-ago"),
        Some(InstanceVerdict::ShutDown)
    );
    assert_eq!(verdict("killed-a-minute-ago"), Some(InstanceVerdict::Dead));
    assert_eq!(verdict(&own), Some(InstanceVerdict::Running));

    let report = router.clean_once().await.unwrap();
    assert!(report.leader);
    assert_eq!(report.shards[0].instances_forgotten, 2, "{report:?}");
    let after = verdicts(&router).await;
    let mut left: Vec<&str> = after.keys().map(String::as_str).collect();
    left.sort_unstable();
    let mut expected = vec!["killed-a-minute-ago", own.as_str()];
    expected.sort_unstable();
    assert_eq!(left, expected);
}

/// Each registered instance's verdict by the router's heartbeat timeout.
async fn verdicts(router: &LockRouter) -> std::collections::HashMap<String, InstanceVerdict> {
    let timeout = router.config().cleaner.heartbeat_timeout;
    let mut out = std::collections::HashMap::new();
    for (_, rows) in router.instances().await {
        for row in rows.unwrap() {
            out.insert(row.instance_id.clone(), row.verdict(timeout));
        }
    }
    out
}
