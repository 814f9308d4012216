//! The other lock patterns across a reload that moves their keys: transaction and CAS locks
//! keep excluding, queued jobs are each done exactly once, state-machine rows are still found.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::Signal;
use shardlock::mysql_async::prelude::Queryable;
use shardlock::patterns::{StateMachine, TxLockGuard};
use shardlock::{AcquireOptions, Config, Error, LockRouter};
use shardlock_testkit::{report, Cluster, HeldRequest, Proxy, ProxyMode, Shard, Worker};
use tokio::signal::unix::SignalKind;

/// Four shards, configs listing the first three and all four (500 ms move window), and a
/// router over each, migrated.
async fn cluster() -> (Cluster, Config, Config) {
    cluster_with("").await
}

/// [`cluster`] with `per_shard` (YAML lines) in each shard's entry.
async fn cluster_with(per_shard: &str) -> (Cluster, Config, Config) {
    let cluster = Cluster::start(4).await.unwrap();
    let (three, four) = (
        config_of(&cluster, &[1; 3], per_shard),
        config_of(&cluster, &[1; 4], per_shard),
    );
    LockRouter::new(four.clone())
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    (cluster, three, four)
}

/// A config listing the first shards of `cluster`, one per weight in `weights`, each entry
/// with `per_shard` (YAML lines) added (500 ms move window).
fn config_of(cluster: &Cluster, weights: &[u32], per_shard: &str) -> Config {
    windowed(cluster, weights, per_shard, "500ms")
}

/// [`config_of`] with a move window of `window`.
fn windowed(cluster: &Cluster, weights: &[u32], per_shard: &str, window: &str) -> Config {
    let yaml = placement_yaml(cluster, weights, per_shard, window);
    Config::from_yaml_str(&format!("{yaml}cleaner:\n  heartbeat-interval: 100ms\n")).unwrap()
}

/// The shards and routing of [`windowed`], as YAML.
fn placement_yaml(cluster: &Cluster, weights: &[u32], per_shard: &str, window: &str) -> String {
    let mut yaml = String::from("shards:\n");
    for (s, weight) in cluster.shards().iter().zip(weights) {
        yaml.push_str(&format!(
            "  - name: {}\n    url: {}\n    weight: {weight}\n{per_shard}",
            s.name(),
            s.url()
        ));
    }
    yaml.push_str(&format!("routing:\n  move-window: {window}\n"));
    yaml
}

/// A key that lives on another shard under `four` than under `three`.
async fn moving_key(three: &Config, four: &Config, prefix: &str) -> String {
    key_that(three, four, prefix, true).await
}

/// A key that lives on another shard under `four` than under `three` if `moves`, else on the
/// same one.
async fn key_that(three: &Config, four: &Config, prefix: &str, moves: bool) -> String {
    let (a, b) = (
        LockRouter::new(three.clone()).await.unwrap(),
        LockRouter::new(four.clone()).await.unwrap(),
    );
    (0..)
        .map(|i| format!("{prefix}{i}"))
        .find(|k| (a.shard_for(k).unwrap() != b.shard_for(k).unwrap()) == moves)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_excludes_across_a_reload_and_follows_its_key() {
    let (_cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "tx:").await;
    let a = LockRouter::new(three.clone()).await.unwrap();
    let b = LockRouter::new(three).await.unwrap();
    let held = a
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();

    b.reload(four.clone()).await.unwrap();
    let refused = b.lock_in_transaction(&key, Duration::ZERO).await;
    assert!(
        matches!(refused, Err(Error::Timeout { .. })),
        "the reloaded process is kept out: {refused:?}"
    );
    a.reload(four).await.unwrap();
    common::moves_done(&a).await;
    common::moves_done(&b).await;
    assert!(held.is_held(), "the lock followed its key");
    let refused = b.lock_in_transaction(&key, Duration::ZERO).await;
    assert!(
        matches!(refused, Err(Error::Timeout { .. })),
        "still kept out after the move: {refused:?}"
    );
    held.commit().await.unwrap();
    let next = b
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();
    next.rollback().await.unwrap();
}

/// A transaction lock follows its moved key past a process that reloaded first and waits for the
/// key longer than the follow may take: that process waits for the key's row on its old shard
/// holding none on the new one. Before, it locked the shards in name order: with the new one
/// first, it held it while it waited for the old, the holder's follow waited for it in turn
/// until the follow gave up, and the holder lost its lock.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_follows_its_key_past_a_process_waiting_for_it() {
    let (cluster, _, four) = cluster().await;
    // A shard taken out: its keys move to shards whose names come first.
    let three = windowed(&cluster, &[1; 3], "", "4s");
    let key = moving_key(&four, &three, "tx:").await;
    let a = LockRouter::new(four.clone()).await.unwrap();
    let b = LockRouter::new(four).await.unwrap();
    let old = shard_of(&cluster, &a, &key);
    let held = a
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();
    b.reload(three.clone()).await.unwrap();
    assert!(b.shard_for(&key).unwrap().as_str() < old.name());
    let waiting = tokio::spawn({
        let (b, key) = (b.clone(), key.clone());
        async move { b.lock_in_transaction(&key, Duration::from_secs(60)).await }
    });
    common::until_a_row_lock_is_waited_for(old).await;
    a.reload(three).await.unwrap();
    let committed = held.commit().await;
    assert!(
        committed.is_ok(),
        "the holder lost its lock to a process waiting for it: {committed:?}"
    );
    let next = waiting.await.unwrap().unwrap();
    next.rollback().await.unwrap();
}

/// During a move a transaction lock also holds its key's row where the key lived, in a
/// transaction nothing runs on. If that transaction ends under it (its session killed, as an
/// idle-transaction timeout or an operator does, or its link cut), a process not reloaded yet
/// locks the key there: the lock is lost, and its `commit` commits nothing (it committed).
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_whose_row_on_the_old_shard_was_let_go_commits_nothing() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "tx:").await;
    // Not reloaded: it keeps the move in force, and locks the key where it lived.
    let behind = LockRouter::new(three.clone()).await.unwrap();
    let moved = LockRouter::new(three).await.unwrap();
    let old = shard_of(&cluster, &behind, &key);
    moved.reload(four).await.unwrap();
    let held = moved
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();

    // The one idle transaction holding row locks on the old shard is the lock's row there
    // (heartbeats may be writing meanwhile).
    common::kill_the_idle_locking_session(old).await;
    let theirs = behind
        .lock_in_transaction(&key, Duration::from_secs(10))
        .await
        .expect("the row let go on the old shard is free");

    let committed = held.commit().await;
    assert!(
        matches!(committed, Err(Error::LockLost { .. })),
        "a lock whose row on the old shard was let go, taken by another process, committed: {committed:?}"
    );
    theirs.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cas_lock_taken_before_a_reload_stays_taken_and_releasable_after_it() {
    let (_cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    let a = LockRouter::new(three.clone()).await.unwrap();
    let b = LockRouter::new(three).await.unwrap();
    let guard = a.cas_acquire(&key, "a").await.unwrap().expect("free");

    b.reload(four.clone()).await.unwrap();
    assert!(b.cas_acquire(&key, "b").await.unwrap().is_none());
    a.reload(four.clone()).await.unwrap();
    common::moves_done(&a).await;
    common::moves_done(&b).await;
    assert!(
        b.cas_acquire(&key, "b").await.unwrap().is_none(),
        "still taken once the move is over"
    );
    // A process that never saw the old topology finds it taken too.
    // (It joins once the others' heartbeats say their moves are over.)
    let newcomer = LockRouter::new(four).await.unwrap();
    let taken = loop {
        match newcomer.cas_acquire(&key, "c").await {
            Err(Error::Unavailable { .. }) => tokio::time::sleep(Duration::from_millis(50)).await,
            other => break other.unwrap(),
        }
    };
    assert!(taken.is_none());

    assert!(
        a.cas_release(guard).await.unwrap(),
        "released where it lives now"
    );
    let next = b.cas_acquire(&key, "b").await.unwrap().expect("free again");
    assert!(b.cas_release(next).await.unwrap());
}

/// A carry copies an owned CAS row onto the key's new shard only where the row there is free.
/// One still owned by another take (a release that freed the old shard and failed on the new
/// one) takes no copy: the row it was to copy must stay owned, and the move in force, until
/// that row is freed. (It was freed all the same: that lock was nowhere, and once the other
/// take's release was retried, a third process took the key while the lock's holder still
/// held it.)
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_lock_is_not_carried_away_onto_a_row_another_take_still_owns() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    // `early` reaches the key's new shard through a proxy.
    let new_shard = LockRouter::new(four.clone())
        .await
        .unwrap()
        .shard_for(&key)
        .unwrap();
    let proxy = Proxy::start(named(&cluster, &new_shard).port())
        .await
        .unwrap();
    let through_proxy = |mut c: Config| {
        for s in c.shards.iter_mut().filter(|s| s.name == new_shard) {
            s.url = proxy.url();
        }
        c
    };
    let early = LockRouter::new(through_proxy(three.clone())).await.unwrap();
    // Not reloaded yet: it keeps the move in force, and takes the key where it lived.
    let late = LockRouter::new(three).await.unwrap();
    let old_shard = late.shard_for(&key).unwrap();
    early.reload(through_proxy(four.clone())).await.unwrap();
    let early_take = early.cas_acquire(&key, "early").await.unwrap().unwrap();

    // Its release frees the old shard's row, and not the new one's.
    proxy.set(ProxyMode::Reset);
    assert!(early.cas_release(early_take.clone()).await.is_err());
    let late_take = late
        .cas_acquire(&key, "late")
        .await
        .unwrap()
        .expect("free on the old shard");

    // The fleet runs `four`: the carry finds the new shard's row owned by the early take.
    let kept = late.stats().moves_kept;
    late.reload(four.clone()).await.unwrap();
    let old = named(&cluster, &old_shard);
    let stored = shardlock::LockKey::new(&key).unwrap().stored().to_vec();
    let passed = common::eventually(Duration::from_secs(30), || {
        let stored = &stored;
        let failed = late.stats().moves_kept > kept;
        async move {
            let mut old = old.connect().await.unwrap();
            let carried: Option<Option<u64>> = old
                .exec_first(
                    "SELECT carried_version FROM shardlock_cas WHERE lock_key = ?",
                    (stored,),
                )
                .await
                .unwrap();
            failed || carried.flatten().is_some()
        }
    })
    .await;
    assert!(passed, "the carry never passed the key: {:?}", late.stats());

    // The early take's release, tried again, frees its row; the late take still holds the key.
    proxy.set(ProxyMode::Pass);
    let released = common::eventually(Duration::from_secs(30), || {
        let (early, take) = (&early, early_take.clone());
        async move { early.cas_release(take).await.is_ok() }
    })
    .await;
    assert!(released, "the early take's release never went through");
    let third = LockRouter::new(four).await.unwrap();
    third.wait_joined().await;
    let stolen = third.cas_acquire(&key, "third").await.unwrap();
    assert!(
        stolen.is_none(),
        "a third process took a CAS lock the late take still holds: {stolen:?}"
    );
    assert!(late.cas_release(late_take).await.unwrap());
}

/// Two keys that live on one shard under `three` and move under `four`, in key order (the
/// order a carry takes them in).
async fn two_moving_keys(three: &Config, four: &Config, prefix: &str) -> (String, String) {
    let (a, b) = (
        LockRouter::new(three.clone()).await.unwrap(),
        LockRouter::new(four.clone()).await.unwrap(),
    );
    let mut seen: HashMap<String, String> = HashMap::new();
    for key in (0..).map(|i| format!("{prefix}{i}")) {
        let old = a.shard_for(&key).unwrap().to_string();
        if old == b.shard_for(&key).unwrap() {
            continue;
        }
        if let Some(other) = seen.get(&old) {
            let mut pair = [other.clone(), key];
            pair.sort();
            let [first, second] = pair;
            return (first, second);
        }
        seen.insert(old, key);
    }
    unreachable!()
}

/// A carry that scanned an owned CAS row, and reaches it only after its holder released it and
/// took it again under the same owner name (on the old shard and, the move being in force, on
/// the new one, where that first take has the version the scan read), carries the row as it
/// is now and leaves the holder's take on the new shard alone: not freed, not written over.
#[tokio::test(flavor = "multi_thread")]
async fn a_carry_that_scanned_a_cas_row_before_its_holder_took_it_again_leaves_the_new_take_alone()
{
    // The carry waits on a row lock while the holder acts: statements may wait that long.
    let (cluster, three, four) = cluster_with("    statement-timeout: 30s\n").await;
    let (first, second) = two_moving_keys(&three, &four, "cas:").await;
    let a = LockRouter::new(three).await.unwrap();
    let old = shard_of(&cluster, &a, &second);
    let carried = a.cas_acquire(&first, "a").await.unwrap().expect("free");
    let held = a.cas_acquire(&second, "o").await.unwrap().expect("free");
    // The carry, once past its scan, waits to write the first key's copy.
    let new = &cluster.shards()[3];
    let mut blocker = common::row_locked(new, "shardlock_cas", &first).await;
    a.reload(four).await.unwrap();
    assert_eq!(shard_of(&cluster, &a, &second).name(), new.name());
    common::until_a_row_lock_is_waited_for(new).await;

    assert!(a.cas_release(held.clone()).await.unwrap());
    let again = a.cas_acquire(&second, "o").await.unwrap().expect("free");
    assert_eq!(
        again.version, held.version,
        "the new shard's first take has the version the carry read on the old one"
    );
    blocker.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&a).await;

    let other = a.cas_acquire(&second, "b").await.unwrap();
    assert!(
        other.is_none(),
        "the carry freed the holder's take: {other:?}"
    );
    assert!(
        a.cas_acquire(&first, "b").await.unwrap().is_none(),
        "the first key was carried"
    );
    assert_eq!(
        common::cas_owner(old, &second).await,
        None,
        "the take on the old shard was carried"
    );
    assert!(
        a.cas_release(again).await.unwrap(),
        "the holder releases its take where the key lives"
    );
    assert!(a.cas_release(carried).await.unwrap());
}

/// A reload undone while its move is in force: the newer move waits for the older one, whose
/// carry is held up on the placement in between, and the older one does not copy a CAS lock
/// away from the shard its key lives on again to that placement, where nobody looks once the
/// newer move ends.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_lock_stays_home_when_a_reload_is_undone_during_its_move() {
    // The carries wait on row locks while the test sets the order: statements may wait.
    let (cluster, three, four) = cluster_with("    statement-timeout: 30s\n").await;
    let key = moving_key(&three, &four, "cas:").await;
    let a = LockRouter::new(three.clone()).await.unwrap();
    let held = a.cas_acquire(&key, "o").await.unwrap().expect("free");
    let leased = a.acquire(&key, Default::default()).await.unwrap();
    leased.release().await.unwrap();
    // A lease row and a job of the key's on the shard in between, locked before the moves
    // begin: the older move's carry waits to write the key's fence floor there, before it gets
    // to CAS rows; the newer one waits for it, then for the job to move it back.
    let new = &cluster.shards()[3];
    let mut floors_held = common::row_locked(new, "shardlock_lease", &key).await;

    a.reload(four).await.unwrap();
    assert_eq!(shard_of(&cluster, &a, &key).name(), new.name());
    let job = a.enqueue_job(&key, b"j", Duration::ZERO, 0).await.unwrap();
    let mut job_held = new.connect().await.unwrap();
    job_held.query_drop("START TRANSACTION").await.unwrap();
    job_held
        .exec_drop(
            "SELECT 1 FROM shardlock_job WHERE id = ? FOR UPDATE",
            (job,),
        )
        .await
        .unwrap();
    let kept = a.stats().moves_kept;
    a.reload(three).await.unwrap();
    let ordered = common::eventually(Duration::from_secs(30), || async {
        new.lock_waits_now().await.unwrap() >= 1 && a.stats().moves_kept > kept
    })
    .await;
    assert!(
        ordered,
        "the older carry waits on the shard in between, and the newer move for it"
    );

    floors_held.query_drop("ROLLBACK").await.unwrap();
    let older_done = common::eventually(Duration::from_secs(30), || async {
        a.moves_in_progress() == 1
    })
    .await;
    assert!(older_done, "the older move ended");
    job_held.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&a).await;

    let other = a.cas_acquire(&key, "x").await.unwrap();
    assert!(
        other.is_none(),
        "another owner took a held CAS lock: {other:?}"
    );
    assert!(a.cas_release(held).await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn jobs_enqueued_before_a_reload_are_each_done_exactly_once_after_it() {
    const JOBS: usize = 1000;
    let (cluster, three, four) = cluster().await;
    let queue = moving_key(&three, &four, "queue:").await;
    let routers = [
        LockRouter::new(three.clone()).await.unwrap(),
        LockRouter::new(three).await.unwrap(),
    ];
    for i in 0..JOBS {
        routers[i % 2]
            .enqueue_job(&queue, format!("job-{i}").as_bytes(), Duration::ZERO, 3)
            .await
            .unwrap();
    }
    for r in &routers {
        r.reload(four.clone()).await.unwrap();
    }
    let done = Arc::new(std::sync::Mutex::new(HashMap::<String, usize>::new()));
    let record = |payload: Vec<u8>| {
        *done
            .lock()
            .unwrap()
            .entry(String::from_utf8(payload).unwrap())
            .or_default() += 1;
    };
    // Claimed on the old shard while the move is in progress, and still running once its
    // window is over: the move waits for them.
    // (On a loaded machine the window may end among these claims: a claim that meets jobs
    // in the one statement between being marked moving and arriving on the new shard finds
    // nothing, and is tried again.)
    let mut running = Vec::new();
    let give_up = tokio::time::Instant::now() + Duration::from_secs(20);
    while running.len() < 50 {
        match routers[0]
            .claim_job(&queue, "early", Duration::from_secs(30))
            .await
            .unwrap()
        {
            Some(job) => running.push(job),
            None => assert!(tokio::time::Instant::now() < give_up, "jobs are due"),
        }
    }
    // Once a carry pass has moved the others (after the window), the move stays in force.
    let passed = common::eventually(Duration::from_secs(30), || async {
        carried(&cluster).await == JOBS - 50
    })
    .await;
    assert!(passed, "no carry pass moved the jobs nobody runs");
    assert_eq!(
        routers[0].moves_in_progress(),
        1,
        "running jobs keep the move in force"
    );
    for job in running {
        assert!(routers[0].complete_job(&job).await.unwrap(), "{job:?}");
        record(job.payload);
    }
    for r in &routers {
        common::moves_done(r).await;
    }
    assert_eq!(
        carried(&cluster).await,
        JOBS - 50,
        "the rest were carried to the new shard, once"
    );
    let mut workers = Vec::new();
    for (n, router) in routers.iter().enumerate() {
        for t in 0..8 {
            let (router, queue, done) = (router.clone(), queue.clone(), done.clone());
            workers.push(tokio::spawn(async move {
                let worker = format!("w{n}.{t}");
                let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
                while done.lock().unwrap().len() < JOBS && tokio::time::Instant::now() < deadline {
                    match router
                        .claim_job(&queue, &worker, Duration::from_secs(30))
                        .await
                        .unwrap()
                    {
                        Some(job) => {
                            assert!(router.complete_job(&job).await.unwrap(), "{job:?}");
                            let payload = String::from_utf8(job.payload).unwrap();
                            *done.lock().unwrap().entry(payload).or_default() += 1;
                        }
                        None => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            }));
        }
    }
    for w in workers {
        w.await.unwrap();
    }
    let done = done.lock().unwrap().clone();
    assert_eq!(done.len(), JOBS, "every job was done");
    let twice: Vec<_> = done.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "done more than once: {twice:?}");
    // Nothing left to do anywhere.
    for s in cluster.shards() {
        let mut c = s.connect().await.unwrap();
        let left: Option<u64> = c
            .query_first("SELECT COUNT(*) FROM shardlock_job WHERE status NOT IN ('done', 'moved')")
            .await
            .unwrap();
        assert_eq!(left, Some(0), "unfinished jobs on {}", s.name());
    }
}

/// How many jobs a move's carry enqueued, on every shard of `cluster`.
async fn carried(cluster: &Cluster) -> usize {
    let mut carried = 0;
    for s in cluster.shards() {
        let mut c = s.connect().await.unwrap();
        let n: Option<u64> = c
            .query_first("SELECT COUNT(*) FROM shardlock_job WHERE origin NOT LIKE 'enqueue:%'")
            .await
            .unwrap();
        carried += n.unwrap_or(0) as usize;
    }
    carried
}

/// A job of a moved queue claimed on the shard its queue leaves, whose claim runs out there
/// with no retries left, fails there, as the next claim of its queue would fail it: once the
/// move is over, no claim of its queue comes to that shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_whose_last_claim_runs_out_on_the_shard_its_queue_left_fails_there() {
    let (cluster, three, four) = cluster().await;
    let queue = moving_key(&three, &four, "queue:").await;
    let router = LockRouter::new(three).await.unwrap();
    let old = shard_of(&cluster, &router, &queue);
    let id = router
        .enqueue_job(&queue, b"last try", Duration::ZERO, 0)
        .await
        .unwrap();
    let job = router
        .claim_job(&queue, "w", Duration::from_secs(2))
        .await
        .unwrap()
        .expect("due");
    router.reload(four).await.unwrap();
    // The move waits for the running claim, and ends once it ran out.
    common::moves_done(&router).await;
    assert_eq!(
        job_status(old, id).await.as_deref(),
        Some("failed"),
        "a claim run out with no retries left on the shard its queue left"
    );
    assert!(!router.complete_job(&job).await.unwrap());
}

/// While a reload's move is in progress, a queue's jobs are claimed on its new shard though the
/// shard it left is down: a shard that was not reached, where no claim can have landed, is
/// passed over. Before, its error answered every claim for as long as it was down (the move
/// stays in force meanwhile).
#[tokio::test(flavor = "multi_thread")]
async fn a_moved_queue_is_claimed_where_it_is_while_the_shard_it_left_is_down() {
    let (cluster, three, _) = cluster().await;
    let four = windowed(&cluster, &[1; 4], "", "60s");
    let queue = moving_key(&three, &four, "queue:").await;
    let router = LockRouter::new(three).await.unwrap();
    let old = shard_of(&cluster, &router, &queue);
    router.reload(four).await.unwrap();
    assert!(router.moves_in_progress() > 0);
    old.kill().unwrap();
    let id = router
        .enqueue_job(&queue, b"where it is", Duration::ZERO, 0)
        .await
        .unwrap();
    // A claim that used a connection pooled to the old shard before it died may have reached
    // it (its error says so); once the old shard is known unreachable, claims pass it over.
    let started = std::time::Instant::now();
    let job = loop {
        match router.claim_job(&queue, "w", Duration::from_secs(30)).await {
            Ok(Some(job)) => break job,
            Err(Error::Unavailable { .. }) if started.elapsed() < Duration::from_secs(30) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            other => panic!("the job on the queue's new shard was not claimed: {other:?}"),
        }
    };
    assert_eq!(job.id, id);
    assert!(router.complete_job(&job).await.unwrap());
    // Nothing left where it can be reached: the unreached shard's error is the answer.
    let empty = router.claim_job(&queue, "w", Duration::from_secs(30)).await;
    assert!(matches!(empty, Err(Error::Unavailable { .. })), "{empty:?}");
    old.restart().await.unwrap();
}

/// The status of job `id` on `shard`.
async fn job_status(shard: &Shard, id: u64) -> Option<String> {
    shard
        .connect()
        .await
        .unwrap()
        .exec_first("SELECT status FROM shardlock_job WHERE id = ?", (id,))
        .await
        .unwrap()
}

/// A job marked moving whose copy had not reached its queue's new shard when a reload undid
/// the move (the new shard kept the copy waiting until it gave up) is not left moving, which
/// no claim takes: it goes on to where its move began for, comes back with its queue, and
/// runs once.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_whose_move_a_reload_undid_half_way_still_runs_once() {
    // The copy gives up after a statement timeout.
    let (cluster, three, four) = cluster_with("    statement-timeout: 2s\n").await;
    let queue = moving_key(&three, &four, "queue:").await;
    let router = LockRouter::new(three.clone()).await.unwrap();
    let home = shard_of(&cluster, &router, &queue);
    let id = router
        .enqueue_job(&queue, b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    // Keys that move go to the shard `four` adds.
    let new = &cluster.shards()[3];
    let mut copies_held = copies_held(new).await;

    router.reload(four).await.unwrap();
    // The carry tries to copy the job, and waits for its row.
    common::until_a_row_lock_is_waited_for(new).await;
    assert_eq!(job_status(home, id).await.as_deref(), Some("moving"));
    router.reload(three).await.unwrap();
    // The copy under way gives up before the new shard takes copies again.
    let gave_up = common::eventually(Duration::from_secs(30), || async {
        new.lock_waits_now().await.unwrap() == 0
    })
    .await;
    assert!(gave_up, "the copy under way never gave up");
    copies_held.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&router).await;

    runs_once(&router, &queue, &cluster).await;
}

/// The same, undone by restarting the whole fleet onto the config before the reload: the
/// start replays one placement of the two from the fleet's record, and the shard that marked
/// the job moving, its queue's home again, is no shard its move leaves. The job still runs,
/// once.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_whose_move_a_restart_undid_half_way_still_runs_once() {
    let (cluster, three, four) = cluster_with("    statement-timeout: 2s\n").await;
    let queue = moving_key(&three, &four, "queue:").await;
    let router = LockRouter::new(four.clone()).await.unwrap();
    let home = shard_of(&cluster, &router, &queue);
    let id = router
        .enqueue_job(&queue, b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    // The queue goes to one of the shards `three` lists: copies wait on all of them.
    let old = &cluster.shards()[..3];
    let mut held = Vec::new();
    for shard in old {
        held.push(copies_held(shard).await);
    }
    let waits = || async {
        let mut n = 0;
        for shard in old {
            n += shard.lock_waits_now().await.unwrap();
        }
        n
    };

    router.reload(three).await.unwrap();
    let copying =
        common::eventually(Duration::from_secs(30), || async { waits().await >= 1 }).await;
    assert!(copying, "the carry never tried to copy the job");
    assert_eq!(job_status(home, id).await.as_deref(), Some("moving"));
    router.shutdown().await.unwrap();
    let gave_up =
        common::eventually(Duration::from_secs(30), || async { waits().await == 0 }).await;
    assert!(gave_up, "the copy under way never gave up");
    for mut conn in held {
        conn.query_drop("ROLLBACK").await.unwrap();
    }

    let restarted = LockRouter::new(four).await.unwrap();
    common::moves_done(&restarted).await;
    runs_once(&restarted, &queue, &cluster).await;
}

/// Asserts that the one job of `queue`, its payload `once`, is claimed through `router` once,
/// and that nothing is left unfinished.
async fn runs_once(router: &LockRouter, queue: &str, cluster: &Cluster) {
    let job = (router.claim_job(queue, "w", Duration::from_secs(30)).await)
        .unwrap()
        .unwrap_or_else(|| panic!("the job is claimed by nobody"));
    assert_eq!(job.payload, b"once");
    assert!(router.complete_job(&job).await.unwrap());
    let again = router
        .claim_job(queue, "w", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(again.is_none(), "the job ran twice: {again:?}");
    nothing_left(cluster).await;
}

/// A job marked moving towards a shard whose server changed since (a failover to a promoted
/// replica behind its URL: same database, same shard id, another server) still goes there and
/// runs once: it was matched by the whole identity, found nowhere, and the move waited for it
/// for ever.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_moving_towards_a_shard_that_failed_over_since_still_runs_once() {
    let (cluster, three, four) = cluster().await;
    let queue = moving_key(&three, &four, "queue:").await;
    let placed = LockRouter::new(four.clone()).await.unwrap();
    let dest = shard_of(&cluster, &placed, &queue);
    placed.shutdown().await.unwrap();
    let router = LockRouter::new(three).await.unwrap();
    let home = shard_of(&cluster, &router, &queue);
    let id = router
        .enqueue_job(&queue, b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    let shard_id: Option<String> = (dest.connect().await.unwrap())
        .query_first("SELECT value FROM shardlock_meta WHERE name = 'shard-id'")
        .await
        .unwrap();
    (home.connect().await.unwrap())
        .exec_drop(
            "UPDATE shardlock_job SET status = 'moving', moved_to = ? WHERE id = ?",
            (
                format!("{} replaced-host:3306#9/shardlock", shard_id.unwrap()),
                id,
            ),
        )
        .await
        .unwrap();
    router.reload(four).await.unwrap();
    common::moves_done(&router).await;
    runs_once(&router, &queue, &cluster).await;
}

/// A job carried by two processes at once, one that read its shard's server before a failover
/// behind its URL and one after (`server_id` changed: the same database, another server),
/// is enqueued where it goes once: each keyed it by the server it had read, and it ran twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_carried_by_processes_on_either_side_of_a_failover_runs_once() {
    let (cluster, three, four) = cluster_with("    statement-timeout: 10s\n").await;
    let queue = moving_key(&three, &four, "queue:").await;
    // A fleet that has granted records its placement, and a process that starts reads which
    // server each shard is.
    let first = LockRouter::new(three.clone()).await.unwrap();
    let warm = first.acquire("warm", AcquireOptions::new()).await.unwrap();
    warm.release().await.unwrap();
    common::until_placement_recorded_on(&cluster.shards()[..3]).await;
    first.shutdown().await.unwrap();
    let a = LockRouter::new(three.clone()).await.unwrap();
    let home = shard_of(&cluster, &a, &queue);
    a.enqueue_job(&queue, b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    // The failover: another server id, and every session ended (a session keeps the server
    // id it started with).
    let mut conn = home.connect().await.unwrap();
    conn.query_drop("SET GLOBAL server_id = 4242")
        .await
        .unwrap();
    let sessions: Vec<u64> = conn
        .query(
            "SELECT id FROM information_schema.processlist \
             WHERE id <> CONNECTION_ID() AND command <> 'Daemon'",
        )
        .await
        .unwrap();
    for id in sessions {
        let _ = conn.query_drop(format!("KILL CONNECTION {id}")).await;
    }
    let b = LockRouter::new(three).await.unwrap();
    // Keys that move go to the shard `four` adds: both copies wait there.
    let dest = &cluster.shards()[3];
    let mut held = copies_held(dest).await;

    a.reload(four.clone()).await.unwrap();
    b.reload(four).await.unwrap();
    // One waits for the copies' row lock, the other behind it for the table's auto-increment
    // lock, which no row-lock count shows.
    let both = common::eventually(Duration::from_secs(30), || async {
        let copies: Option<u64> = (dest.connect().await.unwrap())
            .query_first(
                "SELECT COUNT(*) FROM information_schema.processlist \
                 WHERE info LIKE 'INSERT INTO shardlock_job%'",
            )
            .await
            .unwrap();
        copies >= Some(2)
    })
    .await;
    assert!(both, "the two processes never both tried to copy the job");
    held.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&a).await;
    common::moves_done(&b).await;
    runs_once(&a, &queue, &cluster).await;
}

/// A job claimed between a carry's read of it and its marking (the claim reached the shard
/// its queue leaves while that shard was still in force) holds the move up until its claim
/// ends: the move ended without it, and once the claim ran out (its worker gone) no claim of
/// its queue came to that shard again.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_claimed_while_its_carry_marks_it_holds_the_move_up() {
    // A lock wait of 9 s: the carry's marking waits out the claim below however busy the
    // machine (timed out, it was tried again after the claim, and tested nothing).
    let (cluster, three, four) = cluster_with("    statement-timeout: 10s\n").await;
    let queue = moving_key(&three, &four, "queue:").await;
    let router = LockRouter::new(three).await.unwrap();
    let home = shard_of(&cluster, &router, &queue);
    let id = router
        .enqueue_job(&queue, b"once", Duration::ZERO, 3)
        .await
        .unwrap();
    // The worker's claim waits for the carry's read and goes in before its marking.
    let mut worker = home.connect().await.unwrap();
    worker.query_drop("START TRANSACTION").await.unwrap();
    worker
        .exec_drop(
            "SELECT id FROM shardlock_job WHERE id = ? FOR UPDATE",
            (id,),
        )
        .await
        .unwrap();

    router.reload(four).await.unwrap();
    // The carry tries to mark the job, and waits for its row.
    common::until_a_row_lock_is_waited_for(home).await;
    worker
        .exec_drop(
            "UPDATE shardlock_job SET status = 'claimed', locked_by = 'gone', \
             locked_at = NOW(3), lease_until = NOW(3) + INTERVAL 2 SECOND WHERE id = ?",
            (id,),
        )
        .await
        .unwrap();
    worker.query_drop("COMMIT").await.unwrap();
    common::moves_done(&router).await;
    runs_once(&router, &queue, &cluster).await;
}

/// A job whose enqueue was held up across the reload that moved its queue lands on the shard
/// the queue left after the move's carry scanned it, and is carried before the call answers:
/// once the move is over, no claim of its queue comes to that shard, and it sat there, ready,
/// for good.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_enqueued_across_the_reload_that_moves_its_queue_still_runs() {
    let (cluster, three, four) = cluster_with("    statement-timeout: 30s\n").await;
    let queue = moving_key(&three, &four, "queue:").await;
    let router = LockRouter::new(three).await.unwrap();
    let old = shard_of(&cluster, &router, &queue);
    // Inserts there wait behind a transaction that locked the end of the job table.
    let mut blocker = old.connect().await.unwrap();
    blocker.query_drop("START TRANSACTION").await.unwrap();
    blocker
        .query_drop("SELECT id FROM shardlock_job FOR UPDATE")
        .await
        .unwrap();
    let enqueue = tokio::spawn({
        let (router, queue) = (router.clone(), queue.clone());
        async move { router.enqueue_job(&queue, b"once", Duration::ZERO, 3).await }
    });
    common::until_a_row_lock_is_waited_for(old).await;
    router.reload(four).await.unwrap();
    common::moves_done(&router).await;
    blocker.query_drop("ROLLBACK").await.unwrap();
    enqueue.await.unwrap().unwrap();
    runs_once(&router, &queue, &cluster).await;
}

/// A job left moving towards a shard no config of this process lists (its move undone half
/// way, that shard since dropped) does not hold up the moves of the shard it sits on.
#[tokio::test(flavor = "multi_thread")]
async fn a_job_left_moving_towards_a_shard_nobody_knows_holds_up_no_move() {
    let (cluster, three, four) = cluster().await;
    let queue = key_that(&three, &four, "queue:", false).await;
    let router = LockRouter::new(three).await.unwrap();
    let home = shard_of(&cluster, &router, &queue);
    let id = router
        .enqueue_job(&queue, b"stuck", Duration::ZERO, 3)
        .await
        .unwrap();
    (home.connect().await.unwrap())
        .exec_drop(
            "UPDATE shardlock_job SET status = 'moving', moved_to = 'gone' WHERE id = ?",
            (id,),
        )
        .await
        .unwrap();
    router.reload(four).await.unwrap();
    common::moves_done(&router).await;
    assert_eq!(job_status(home, id).await.as_deref(), Some("moving"));
}

/// A transaction on `shard` in which every copy of a job into its queue table waits: the
/// range of the origin index is locked (gap locks: repeatable read).
async fn copies_held(shard: &Shard) -> shardlock::mysql_async::Conn {
    let mut conn = shard.connect().await.unwrap();
    for statement in [
        "SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        "START TRANSACTION",
        "SELECT 1 FROM shardlock_job WHERE origin >= '' FOR UPDATE",
    ] {
        conn.query_drop(statement).await.unwrap();
    }
    conn
}

/// Asserts that no job is left unfinished on any shard of `cluster` (a job left moving is
/// claimed by nobody).
async fn nothing_left(cluster: &Cluster) {
    for s in cluster.shards() {
        let left: Option<u64> = (s.connect().await.unwrap())
            .query_first("SELECT COUNT(*) FROM shardlock_job WHERE status NOT IN ('done', 'moved')")
            .await
            .unwrap();
        assert_eq!(left, Some(0), "unfinished jobs on {}", s.name());
    }
}

/// A `coupon` table on every shard of a cluster, a code that the second config moves, its row
/// `available` where the first config places it, a router on that config, and the second.
async fn coupon_on_a_moving_key() -> (Cluster, LockRouter, String, Config) {
    let (cluster, three, four) = cluster().await;
    let code = moving_key(&three, &four, "coupon:").await;
    for s in cluster.shards() {
        let mut c = s.connect().await.unwrap();
        c.query_drop(
            "CREATE TABLE coupon (code VARCHAR(64) PRIMARY KEY, state VARCHAR(16) NOT NULL)",
        )
        .await
        .unwrap();
    }
    let router = LockRouter::new(three).await.unwrap();
    insert_coupon(&router, &code).await;
    (cluster, router, code, four)
}

/// Inserts `code`'s row, `available`, where `router` places it.
async fn insert_coupon(router: &LockRouter, code: &str) {
    let mut conn = router.shard_connection(code).await.unwrap();
    conn.raw()
        .exec_drop("INSERT INTO coupon VALUES (?, 'available')", (code,))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn state_machine_claims_reach_rows_on_the_shard_a_key_left() {
    let (_cluster, router, code, four) = coupon_on_a_moving_key().await;
    // The application moves its rows with its keys, after the move; meanwhile they are found
    // where they are.
    router.reload(four).await.unwrap();
    let machine = StateMachine::new("coupon", "code", "state")
        .unwrap()
        .allow("available", "locked");
    assert!(router
        .transition(&machine, &code, "available", "locked")
        .await
        .unwrap());
    assert!(!router
        .transition(&machine, &code, "available", "locked")
        .await
        .unwrap());
}

/// While the application copies a moved key's row to its new shard (inserted there, not yet
/// deleted where it was), its state on the new shard answers: the copy left behind, still in
/// `from`, gives no second caller a second win.
#[tokio::test(flavor = "multi_thread")]
async fn a_state_machine_row_copied_to_its_new_shard_is_won_once() {
    let (_cluster, router, code, four) = coupon_on_a_moving_key().await;
    router.reload(four).await.unwrap();
    insert_coupon(&router, &code).await;
    let machine = StateMachine::new("coupon", "code", "state")
        .unwrap()
        .allow("available", "locked");
    let mut wins = 0;
    for _ in 0..2 {
        if router
            .transition(&machine, &code, "available", "locked")
            .await
            .unwrap()
        {
            wins += 1;
        }
    }
    assert_eq!(
        wins, 1,
        "a copy left on the shard the key left was won again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_that_fails_on_a_later_shard_leaves_no_row_locked() {
    let (cluster, mut three, mut four) = cluster().await;
    // Nothing in the background that would check the pooled connections out (and so reset
    // them) while the test looks: no heartbeats, and no move ending meanwhile.
    for config in [&mut three, &mut four] {
        config.cleaner.registry = shardlock::config::RegistryKind::Static;
        config.routing.move_window = Some(Duration::from_secs(120));
    }
    // A key that moves from s4 to a shard named before it: during the move it is locked there
    // first, then on s4.
    let key = moving_key(&three, &four, "tx:").await;
    let router = LockRouter::new(four.clone()).await.unwrap();
    assert_eq!(router.shard_for(&key).unwrap(), "s4");
    router.reload(three).await.unwrap();
    let home = router.shard_for(&key).unwrap();
    cluster.shard(3).kill().unwrap();
    assert!(router
        .lock_in_transaction(&key, Duration::from_secs(1))
        .await
        .is_err());

    // The row locked on the key's shard before s4 failed was rolled back with its connection,
    // not left locked on a connection back in the pool.
    let at = named(&cluster, &home);
    let mut c = at.connect().await.unwrap();
    c.query_drop("SET SESSION innodb_lock_wait_timeout = 2")
        .await
        .unwrap();
    let mut tx = c.start_transaction(Default::default()).await.unwrap();
    let rows: Result<Vec<Vec<u8>>, _> = tx
        .query("SELECT lock_key FROM shardlock_txlock FOR UPDATE")
        .await;
    assert!(rows.is_ok(), "a row is still locked: {rows:?}");
}

/// The shard of `cluster` that `router` places `key` on.
fn shard_of<'c>(cluster: &'c Cluster, router: &LockRouter, key: &str) -> &'c Shard {
    named(cluster, &router.shard_for(key).unwrap())
}

/// The shard of `cluster` named `name`.
fn named<'c>(cluster: &'c Cluster, name: &str) -> &'c Shard {
    cluster.shards().iter().find(|s| s.name() == name).unwrap()
}

/// A CAS release that found nothing looks again under a reload that came meanwhile only if
/// that reload placed the key elsewhere: one that left it in place (a policy change, a
/// config-sync job reloading again and again) does not send the release round again, or
/// reloads faster than a release runs would keep it going.
#[tokio::test(flavor = "multi_thread")]
async fn a_release_that_found_nothing_is_not_sent_again_after_a_reload_that_left_its_key_in_place()
{
    let (cluster, _, _) = common::start(2, "cleaner:\n  registry: static\n").await;
    // The release waits on the test's row lock as long as it takes (the default statement
    // timeout would end its wait, and the release would be sent again).
    let shards: String = (cluster.shards().iter())
        .map(|s| {
            format!(
                "  - name: {}\n    url: {}\n    statement-timeout: 30s\n",
                s.name(),
                s.url()
            )
        })
        .collect();
    let yaml = format!(
        "shards:\n{shards}cleaner:\n  registry: static\nnamespaces:\n  default:\n    ttl: 5s\n"
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let key = "cas:released-twice";
    let guard = router.cas_acquire(key, "me").await.unwrap().unwrap();
    assert!(router.cas_release(guard.clone()).await.unwrap());
    common::until_placement_recorded(&cluster).await;
    let shard = shard_of(&cluster, &router, key);

    // The release of the clone waits on the row while a reload changes only a policy.
    let mut blocker = common::row_locked(shard, "shardlock_cas", key).await;
    let updates = shard.global_status("Com_update").await.unwrap();
    let release = tokio::spawn({
        let router = router.clone();
        async move { router.cas_release(guard).await }
    });
    common::until_a_row_lock_is_waited_for(shard).await;
    let policy = Config::from_yaml_str(&yaml.replace("ttl: 5s", "ttl: 7s")).unwrap();
    router.reload(policy).await.unwrap();
    assert_eq!(router.epoch(), 2);
    blocker.query_drop("ROLLBACK").await.unwrap();

    let released = release.await.unwrap().unwrap();
    assert!(!released, "the guard was released already");
    let sent = shard.global_status("Com_update").await.unwrap() - updates;
    assert_eq!(
        sent, 1,
        "one release statement: the reload left the key where the release looked"
    );
}

/// A transaction lock whose row was locked under the topology before a reload, but only after
/// the fleet ended the key's move (the lock statement held up behind another transaction's
/// lock on the row), is rolled back and locked again where the key lives now, not handed out
/// while another process holds the key there.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_taken_on_the_old_shard_after_the_move_ended_is_taken_again() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "tx:").await;
    let a = LockRouter::new(four.clone()).await.unwrap();
    let b = LockRouter::new(four).await.unwrap();
    let old = shard_of(&cluster, &a, &key);
    let mut blocker = common::row_locked(old, "shardlock_txlock", &key).await;
    let mut locking = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.lock_in_transaction(&key, Duration::from_secs(60)).await }
    });
    common::until_a_row_lock_is_waited_for(old).await;

    a.reload(three.clone()).await.unwrap();
    b.reload(three).await.unwrap();
    common::moves_done(&b).await;
    let theirs = b.lock_in_transaction(&key, Duration::ZERO).await.unwrap();
    assert_ne!(theirs.shard(), old.name());

    // a's lock statement, sent under the old topology, now locks the row on the old shard.
    blocker.query_drop("ROLLBACK").await.unwrap();
    let taken_again = common::eventually(Duration::from_secs(30), || async {
        a.stats().stale_grants == 1
    });
    tokio::select! {
        got = &mut locking => panic!(
            "a was handed the lock while b holds it on {}: {:?}",
            theirs.shard(),
            got.unwrap().map(|g| g.shard().to_owned())
        ),
        taken_again = taken_again => assert!(taken_again, "{:?}", a.stats()),
    }
    theirs.commit().await.unwrap();
    let ours = locking.await.unwrap().unwrap();
    assert_eq!(ours.shard(), a.shard_for(&key).unwrap());
    ours.commit().await.unwrap();
}

/// A router over the four shards with a 6 s move window (long enough that a follow still
/// waits while a test looks), holding a transaction lock on a key the three-shard config
/// (returned) moves.
async fn a_transaction_lock_on_a_moving_key() -> (Cluster, Config, String, LockRouter, TxLockGuard)
{
    let (cluster, three, four) = cluster().await;
    let window = |mut c: Config| {
        c.routing.move_window = Some(Duration::from_secs(6));
        c
    };
    let (three, four) = (window(three), window(four));
    let key = moving_key(&three, &four, "tx:").await;
    let a = LockRouter::new(four).await.unwrap();
    let held = a
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();
    (cluster, three, key, a, held)
}

/// A transaction lock held when a reload moves its key commits only once its row is locked
/// where the key lives now: the processes that reloaded lock it only there once their move is
/// over. Held up there by another transaction past half the move window, the lock is lost,
/// and its commit rolls back.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_commits_only_once_it_followed_its_key() {
    let (cluster, three, key, a, held) = a_transaction_lock_on_a_moving_key().await;
    let new = shard_of(
        &cluster,
        &LockRouter::new(three.clone()).await.unwrap(),
        &key,
    );
    let mut blocker = common::row_locked(new, "shardlock_txlock", &key).await;

    a.reload(three).await.unwrap();
    let committed = held.commit().await;
    assert!(
        matches!(committed, Err(Error::LockLost { .. })),
        "committed before its row was locked where its key lives now: {committed:?}"
    );
    assert_eq!(a.stats().stale_grants, 0);
    blocker.query_drop("ROLLBACK").await.unwrap();
}

/// A CAS lock taken on the key's old shard under the topology before a reload, but only after
/// the fleet ended the key's move and carried its owned rows over (the take held up behind
/// another transaction's lock on the row), is given back: another process owns the key where
/// it lives now.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_lock_taken_on_the_old_shard_after_the_move_ended_is_given_back() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    let a = LockRouter::new(four.clone()).await.unwrap();
    let b = LockRouter::new(four).await.unwrap();
    let old = shard_of(&cluster, &a, &key);
    let mine = a.cas_acquire(&key, "a").await.unwrap().expect("free");
    assert!(a.cas_release(mine).await.unwrap());
    let mut blocker = common::row_locked(old, "shardlock_cas", &key).await;
    let taking = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.cas_acquire(&key, "a").await }
    });
    common::until_a_row_lock_is_waited_for(old).await;

    a.reload(three.clone()).await.unwrap();
    b.reload(three).await.unwrap();
    common::moves_done(&b).await;
    let theirs = b.cas_acquire(&key, "b").await.unwrap().expect("free");

    // a's take, sent under the old topology, now runs on the old shard.
    blocker.query_drop("ROLLBACK").await.unwrap();
    let got = taking.await.unwrap().unwrap();
    assert!(got.is_none(), "a took the key b owns: {got:?}");
    assert_eq!(a.stats().stale_grants, 1);
    assert!(b.cas_release(theirs).await.unwrap());
}

/// A CAS take that reaches its key's old shard only after the move's carry passed the key
/// there (held up behind another transaction's lock on the row) is given back on that shard:
/// the move ends without carrying it, and a row left owned there would hold the key for good
/// once a later reload places the key there again.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_take_landing_on_the_old_shard_after_the_carry_passed_its_key_is_given_back_there() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    let a = LockRouter::new(three).await.unwrap();
    let old = shard_of(&cluster, &a, &key);
    a.reload(four).await.unwrap();
    let mut blocker = common::row_locked(old, "shardlock_cas", &key).await;
    let taking = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.cas_acquire(&key, "a").await }
    });
    common::until_a_row_lock_is_waited_for(old).await;
    common::moves_done(&a).await;

    blocker.query_drop("ROLLBACK").await.unwrap();
    let guard = taking.await.unwrap().unwrap().expect("free");
    assert_eq!(
        common::cas_owner(old, &key).await,
        None,
        "the take was left owned on the old shard"
    );
    assert!(a.cas_release(guard).await.unwrap());
}

/// Configs listing three shards of `cluster`, then four, then four weighted `last` (move
/// window `window`), and a key whose shards under the three satisfy `placed`.
async fn three_topologies(
    cluster: &Cluster,
    last: &[u32],
    window: &str,
    placed: impl Fn([&str; 3]) -> bool,
) -> ([Config; 3], String) {
    topologies(cluster, [&[1, 1, 1], &[1, 1, 1, 1], last], window, placed).await
}

/// Configs listing the shards of `cluster` with each of `weights` (move window `window`), and
/// a key whose shards under the three satisfy `placed`.
async fn topologies(
    cluster: &Cluster,
    weights: [&[u32]; 3],
    window: &str,
    placed: impl Fn([&str; 3]) -> bool,
) -> ([Config; 3], String) {
    let configs = weights.map(|w| windowed(cluster, w, "", window));
    let mut routers = Vec::new();
    for config in &configs {
        routers.push(LockRouter::new(config.clone()).await.unwrap());
    }
    let key = (0..)
        .map(|i| format!("cas:{i}"))
        .find(|k| {
            let at = routers.iter().map(|r| r.shard_for(k).unwrap());
            let at: Vec<String> = at.collect();
            placed([&at[0], &at[1], &at[2]])
        })
        .unwrap();
    (configs, key)
}

/// Asserts that `router` takes `key` by CAS: the lock was not left owned by nobody.
async fn assert_taken_again(router: &LockRouter, key: &str) {
    let next = router.cas_acquire(key, "n").await.unwrap();
    assert!(
        next.is_some(),
        "the lock stayed owned with nobody holding it"
    );
}

/// Three shards apart.
fn all_apart([a, b, c]: [&str; 3]) -> bool {
    a != b && b != c && a != c
}

/// Three topologies, a key on one shard under the first two and on another under the third.
/// A process reloads through all three while another stops at the second and holds the key
/// there, where its topology takes it alone. The first move must not end while that process
/// runs the second topology: its carry would copy the row to the third shard and free it here,
/// and a second take under the second topology would be granted.
#[tokio::test(flavor = "multi_thread")]
async fn a_move_stays_in_force_while_a_process_runs_a_later_topology_than_its_own_placement() {
    let (cluster, _, _) = cluster().await;
    let ([t0, t1, t2], key) = three_topologies(&cluster, &[1, 1, 1, 8], "500ms", |[a, b, c]| {
        a == b && b != c
    })
    .await;
    let a = LockRouter::new(t0.clone()).await.unwrap();
    let b = LockRouter::new(t0).await.unwrap();
    a.reload(t1.clone()).await.unwrap();
    b.reload(t1).await.unwrap();
    let held = b.cas_acquire(&key, "b").await.unwrap().expect("free");
    a.reload(t2).await.unwrap();
    // Registry reads that kept a's moves in force, past both windows.
    let kept = common::eventually(Duration::from_secs(30), || async {
        a.stats().moves_kept >= 10
    })
    .await;
    assert!(kept, "a's moves were never kept in force by b");
    assert_eq!(
        a.moves_in_progress(),
        2,
        "the first move ended while a process ran the topology after it"
    );
    let other = b.cas_acquire(&key, "other").await.unwrap();
    assert!(
        other.is_none(),
        "a second take under the topology in between was granted: {other:?}"
    );
    let newer = a.cas_acquire(&key, "a").await.unwrap();
    assert!(newer.is_none(), "a took a held CAS lock: {newer:?}");
    assert!(b.cas_release(held).await.unwrap());
    let next = a.cas_acquire(&key, "a").await.unwrap().expect("free");
    let refused = b.cas_acquire(&key, "b").await.unwrap();
    assert!(refused.is_none(), "b took a held CAS lock: {refused:?}");
    assert!(a.cas_release(next).await.unwrap());
}

/// A clone of a CAS guard released already, released again after the key was taken anew
/// under the same owner name during a move, frees nothing: not the new take's row on the old
/// shard either, where a process still running the old topology takes the key alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_released_cas_guard_released_again_during_a_move_leaves_a_new_take_alone() {
    let (_cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    let old = LockRouter::new(three.clone()).await.unwrap();
    let new = LockRouter::new(three).await.unwrap();
    new.reload(four).await.unwrap();
    let first = new.cas_acquire(&key, "svc").await.unwrap().expect("free");
    assert!(new.cas_release(first.clone()).await.unwrap());
    let second = new
        .cas_acquire(&key, "svc")
        .await
        .unwrap()
        .expect("free again");
    assert_eq!(new.moves_in_progress(), 1, "the move is in force");

    let again = new.cas_release(first).await.unwrap();
    let other = old.cas_acquire(&key, "x").await.unwrap();
    assert!(
        other.is_none(),
        "a process on the old topology took a held CAS lock: {other:?}"
    );
    assert!(!again, "a guard released already released something again");
    assert!(new.cas_release(second).await.unwrap());
}

/// Two reloads in a row: a CAS take made under the second topology while the first's move was
/// in force has rows on both earlier shards, with versions of their own. The first move's
/// carry (its window closed first) copies its row onto the third topology's shard, where the
/// key lives now, with the first shard's version; the second's carry then finds the copy
/// there. The holder's release frees it all the same: it names the take, not a version.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_lock_taken_between_two_reloads_is_released_where_the_first_carry_put_it() {
    let (cluster, _, _) = cluster().await;
    let ([t0, t1, t2], key) = three_topologies(&cluster, &[1, 1, 8, 1], "500ms", all_apart).await;
    // A process on the first topology: it keeps the first move in force, and takes and
    // releases the key twice, so its row there is ahead of the one on the second shard.
    let first = LockRouter::new(t0.clone()).await.unwrap();
    for _ in 0..2 {
        let guard = first.cas_acquire(&key, "p").await.unwrap().expect("free");
        assert!(first.cas_release(guard).await.unwrap());
    }
    let holder = LockRouter::new(t0).await.unwrap();
    holder.reload(t1).await.unwrap();
    let held = holder.cas_acquire(&key, "h").await.unwrap().expect("free");
    holder.reload(t2).await.unwrap();
    first.shutdown().await.unwrap();
    common::moves_done(&holder).await;

    assert!(
        holder.cas_release(held).await.unwrap(),
        "the holder could not release its lock where the first carry put it"
    );
    assert_taken_again(&holder, &key).await;
}

/// Two reloads in a row, a CAS lock held on its key's first shard. The first move's carry
/// writes the lock's copy onto the second topology's shard, where it is held up (another
/// transaction holds the row there) while the process reloads again. The second move, whose
/// window ends meanwhile, waits for the first: its scan of the second shard (before the first,
/// in shard order) would pass before the copy lands, the first carry would then free the row,
/// and once both moves were over the lock would be only where nobody looks.
#[tokio::test(flavor = "multi_thread")]
async fn a_later_move_waits_for_an_earlier_carry_still_writing_onto_its_shards() {
    let (cluster, _, _) = cluster().await;
    // The key leaves the last shard, then goes to one before it in the shards' order.
    let weights: [&[u32]; 3] = [&[1, 1, 1, 8], &[1, 1, 1, 1], &[1, 1, 8, 1]];
    let (mut configs, key) = topologies(&cluster, weights, "500ms", |[a, b, c]| {
        all_apart([a, b, c]) && b < a
    })
    .await;
    // The held-up copy waits for the row for as long as its statement may take.
    for shard in configs.iter_mut().flat_map(|c| c.shards.iter_mut()) {
        shard.statement_timeout = Duration::from_secs(30);
    }
    let [t0, t1, t2] = configs;
    let router = LockRouter::new(t0).await.unwrap();
    let first = shard_of(&cluster, &router, &key);
    let held = router.cas_acquire(&key, "h").await.unwrap().expect("free");
    let probe = LockRouter::new(t1.clone()).await.unwrap();
    let second = shard_of(&cluster, &probe, &key);
    probe.shutdown().await.unwrap();
    let mut blocker = common::row_locked(second, "shardlock_cas", &key).await;
    router.reload(t1).await.unwrap();
    common::until_a_row_lock_is_waited_for(second).await;
    let kept = router.stats().moves_kept;
    router.reload(t2).await.unwrap();
    // The second move's window is over: its carry either waits for the first, or scans the
    // shards in order and waits for the lock's row on the first shard.
    let looked = common::eventually(Duration::from_secs(20), || async {
        router.stats().moves_kept > kept || first.lock_waits_now().await.unwrap() > 0
    })
    .await;
    assert!(looked, "the second move was never looked at");
    blocker.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&router).await;

    let other = router.cas_acquire(&key, "x").await.unwrap();
    assert!(
        other.is_none(),
        "a second take of a held CAS lock was granted once both moves were over: {other:?}"
    );
    assert!(router.cas_release(held).await.unwrap());
    assert_taken_again(&router, &key).await;
}

/// Two config changes rolled out as one reload by one process and as two by another: a key
/// on three shards under the three topologies. The first move's carry (the second's window is
/// still open) writes its copy only where the key lives now, which the whole fleet runs: a
/// copy on the middle topology's shard would be left where the holder, which skipped that
/// topology, never releases, and the second move's carry would then bring it back onto the
/// key's shard, owned for good by a lock released long before.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_lock_released_by_a_process_that_skipped_a_topology_leaves_no_copy_behind() {
    let (cluster, _, _) = cluster().await;
    let ([t0, t1, t2], key) = three_topologies(&cluster, &[1, 1, 8, 1], "3s", all_apart).await;
    // A process on the first topology keeps the first move in force.
    let first = LockRouter::new(t0.clone()).await.unwrap();
    let stepwise = LockRouter::new(t0.clone()).await.unwrap();
    let holder = LockRouter::new(t0).await.unwrap();
    stepwise.reload(t1).await.unwrap();
    // The first move's window is over once a registry read kept it in force.
    let kept = common::eventually(Duration::from_secs(30), || async {
        stepwise.stats().moves_kept >= 1
    })
    .await;
    assert!(kept, "the first move was never kept in force");
    stepwise.reload(t2.clone()).await.unwrap();
    holder.reload(t2).await.unwrap();
    let held = holder.cas_acquire(&key, "h").await.unwrap().expect("free");
    first.shutdown().await.unwrap();
    let first_done = common::eventually(Duration::from_secs(30), || async {
        stepwise.moves_in_progress() <= 1
    })
    .await;
    assert!(first_done, "the first move never ended");
    assert!(holder.cas_release(held).await.unwrap());
    common::moves_done(&stepwise).await;
    common::moves_done(&holder).await;

    let next = stepwise.cas_acquire(&key, "n").await.unwrap();
    assert!(
        next.is_some(),
        "a copy of the released lock was left owned where the key lives"
    );
}

/// Under `registry: static` nothing says which topology the others run: a move's carry waits
/// until every move's window is over, when by the contract every process has applied every
/// reload. Two reloads in a row, the first move's window shorter: until the second's is over,
/// a process may still legally run the topology in between, taking the key only where that
/// topology and its own earlier moves put it, so the first move must not end (and carry a
/// lock onto the last topology's shard alone) before then.
#[tokio::test(flavor = "multi_thread")]
async fn under_a_static_registry_a_move_ends_only_once_every_later_window_is_over() {
    let (cluster, _, _) = cluster().await;
    // The first window long enough that the second reload, two awaits later, always comes
    // within it, even on a busy machine.
    let (mut configs, _) = three_topologies(&cluster, &[1, 1, 8, 1], "5s", all_apart).await;
    for config in &mut configs {
        config.cleaner.registry = shardlock::config::RegistryKind::Static;
    }
    configs[2].routing.move_window = Some(Duration::from_secs(12));
    let [t0, t1, t2] = configs;
    let router = LockRouter::new(t0).await.unwrap();
    router.reload(t1).await.unwrap();
    router.reload(t2).await.unwrap();
    let first_done = common::eventually(Duration::from_secs(60), || async {
        router.moves_in_progress() <= 1
    })
    .await;
    assert!(first_done, "the first move never ended");
    assert!(
        router.stats().moves_kept >= 1,
        "the first move ended while the second's window was open"
    );
}

/// Heartbeats every 100 ms; dead after 2 s without one.
const BEATS: &str = "cleaner:\n  heartbeat-interval: 100ms\n  heartbeat-timeout: 2s\n";

/// The config a worker reloads onto, and the key it takes.
const RELOAD_ENV: &str = "SHARDLOCK_TEST_RELOAD";
const KEY_ENV: &str = "SHARDLOCK_TEST_KEY";

/// A CAS holder frozen past its heartbeat timeout while the rest of the fleet reloaded: the
/// fleet counts it dead, ends the move without it and carries its lock to the key's new shard.
/// Resumed, still on the old topology, its release finds nothing where it places the key: it
/// says so as an error, not `false` (the lock is still owned where the fleet put it), and
/// releases it once reloaded.
#[tokio::test(flavor = "multi_thread")]
async fn a_cas_holder_that_lapsed_through_a_move_releases_where_the_fleet_carried_its_lock() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    let yaml =
        |weights: &[u32]| format!("{}{BEATS}", placement_yaml(&cluster, weights, "", "500ms"));
    let (old, new) = (yaml(&[1; 3]), yaml(&[1; 4]));
    let mut holder = Worker::spawn(
        "worker",
        "lapsed-cas-holder",
        &[
            (
                common::CONFIG_ENV,
                format!("instance:\n  id: holder\n{old}"),
            ),
            (RELOAD_ENV, format!("instance:\n  id: holder\n{new}")),
            (KEY_ENV, key.clone()),
        ],
    )
    .unwrap();
    holder.expect("taken").await.unwrap();
    let router = LockRouter::from_yaml_str(&old).await.unwrap();
    router
        .reload(Config::from_yaml_str(&new).unwrap())
        .await
        .unwrap();
    holder.pause().unwrap();
    // Counted dead, the holder keeps the move in force no more.
    common::moves_done(&router).await;
    let carried = router.cas_acquire(&key, "x").await.unwrap();
    assert!(carried.is_none(), "the lock was not carried: {carried:?}");

    holder.resume().unwrap();
    holder.signal(Signal::SIGUSR1).unwrap();
    let minute = Duration::from_secs(60);
    let said = tokio::time::timeout(minute, holder.expect("")).await;
    let said = said.expect("the holder said nothing").unwrap();
    assert!(
        said.starts_with("refused") && said.contains("was not joined to its fleet"),
        "a lapsed holder's release that found nothing said: {said}"
    );
    let said = tokio::time::timeout(minute, holder.expect("")).await;
    let said = said.expect("the holder said nothing").unwrap();
    assert_eq!(said, "released true", "once reloaded");
    assert_taken_again(&router, &key).await;
}

/// Takes the key of [`KEY_ENV`] by CAS; told to go on (SIGUSR1, after its pause), releases it
/// once its heartbeat lapsed and says how that went; then reloads onto the config of
/// [`RELOAD_ENV`] and, once joined to its fleet, releases it again.
async fn lapsed_cas_holder_worker() {
    let mut go = tokio::signal::unix::signal(SignalKind::user_defined1()).unwrap();
    let router = common::worker_router().await;
    let key = std::env::var(KEY_ENV).unwrap();
    let guard = router.cas_acquire(&key, "h").await.unwrap().expect("free");
    report!("taken");
    go.recv().await;
    while router.stats().heartbeat_lapses == 0 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!router.is_joined(), "lapsed, then on another topology");
    match router.cas_release(guard.clone()).await {
        Ok(freed) => report!("released {freed}"),
        Err(e) => report!("refused {}", shardlock::Report(&e)),
    }
    let reload = Config::from_yaml_str(&std::env::var(RELOAD_ENV).unwrap()).unwrap();
    router.reload(reload).await.unwrap();
    // As the refusal advises.
    router.wait_joined().await;
    assert!(router.is_joined());
    match router.cas_release(guard).await {
        Ok(freed) => report!("released {freed}"),
        Err(e) => report!("refused {}", shardlock::Report(&e)),
    }
}

/// A holder paused past its heartbeat timeout counts as dead. A process started meanwhile onto
/// another topology (a restart onto a changed config, the old fleet taken for gone) finds no
/// live instance of the old one and takes the key where its topology puts it, which the
/// holder's lease on the key's old shard does not exclude. That lease's ttl has not run out,
/// yet it is lost by the time its holder runs again: a lease lasts no longer than the registry
/// surely counts its holder live.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_held_through_a_lapse_is_lost_when_a_restart_onto_another_topology_took_its_key() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "lease:").await;
    let yaml =
        |weights: &[u32]| format!("{}{BEATS}", placement_yaml(&cluster, weights, "", "500ms"));
    let mut holder = Worker::spawn(
        "worker",
        "lapsed-lease-holder",
        &[(common::CONFIG_ENV, yaml(&[1; 3])), (KEY_ENV, key.clone())],
    )
    .unwrap();
    holder.expect("held").await.unwrap();
    holder.pause().unwrap();
    // Its fleet as one that ran a version before migration 13: no placement record, so the
    // restart takes the key only where its own topology puts it (with the record it would move
    // from the holder's shards and wait there for its row to end), and the holder's own lapse
    // must make it give the lease up.
    for shard in cluster.shards() {
        let mut c = shard.connect().await.unwrap();
        c.query_drop("DELETE FROM shardlock_placement")
            .await
            .unwrap();
    }
    // Started onto four shards, it joins its fleet once the holder's heartbeat timed out.
    let restarted = LockRouter::from_yaml_str(&yaml(&[1; 4])).await.unwrap();
    let minute = Duration::from_secs(60);
    let joined = tokio::time::timeout(minute, restarted.wait_joined()).await;
    joined.expect("the restarted process never joined its fleet");
    let taken = restarted.try_acquire(&key, AcquireOptions::new()).await;
    assert!(
        taken.unwrap().is_some(),
        "the key is free where the new topology puts it"
    );

    holder.resume().unwrap();
    holder.signal(Signal::SIGUSR1).unwrap();
    let said = tokio::time::timeout(minute, holder.expect("")).await;
    let said = said.expect("the holder said nothing").unwrap();
    assert_eq!(
        said, "held false",
        "the paused holder took its lease for held while another process held the key"
    );
}

/// A process paused while its fleet moved on (a start onto another placement that recorded
/// its move, then stopped) finds the newer record when it rejoins, and moves from there
/// before it grants: a row kept past its release where the fleet placed the key since is
/// seen, not granted over where this process's own topology puts the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_paused_while_its_fleet_moved_on_moves_from_the_newer_record_before_it_grants() {
    let (cluster, _, _) = cluster().await;
    let yaml =
        |weights: &[u32]| format!("{}{BEATS}", placement_yaml(&cluster, weights, "", "500ms"));
    let (before, after) = (yaml(&[1; 4]), yaml(&[1, 1, 1, 8]));
    let key = moving_key(
        &Config::from_yaml_str(&before).unwrap(),
        &Config::from_yaml_str(&after).unwrap(),
        "kept:",
    )
    .await;
    let mut paused = Worker::spawn(
        "worker",
        "paused-granter",
        &[(common::CONFIG_ENV, before.clone()), (KEY_ENV, key.clone())],
    )
    .unwrap();
    paused.expect("granted").await.unwrap();
    common::until_placement_recorded(&cluster).await;
    paused.pause().unwrap();

    // Its fleet moves on without it: a start onto another placement joins once the paused
    // process's heartbeat timed out, moves from the recorded one, keeps a row of `key` for an
    // hour where the key lives now, and stops.
    let minute = Duration::from_secs(60);
    let moved_on = LockRouter::from_yaml_str(&after).await.unwrap();
    let joined = tokio::time::timeout(minute, moved_on.wait_joined()).await;
    joined.expect("the start never joined its fleet");
    let over = common::eventually(minute, || async { moved_on.moves_in_progress() == 0 }).await;
    assert!(over, "the start's move from the recorded placement ended");
    let hour = Duration::from_secs(3600);
    let g = moved_on
        .acquire(&key, AcquireOptions::new().lock_at_least(hour))
        .await
        .unwrap();
    g.release().await.unwrap();
    let recorded = common::until_recorded_alone(cluster.shard(0), "\"weight\":8").await;
    assert!(
        recorded,
        "the fleet recorded the placement it moved to alone"
    );
    moved_on.shutdown().await.unwrap();

    paused.resume().unwrap();
    paused.signal(Signal::SIGUSR1).unwrap();
    let said = tokio::time::timeout(minute, paused.expect("taken")).await;
    let said = said.expect("the resumed process said nothing").unwrap();
    assert_eq!(
        said, "false",
        "the resumed process granted a key whose row its fleet kept where the key lived"
    );
}

/// Grants a key once (its fleet records where it places keys); told to go on (SIGUSR1,
/// after its pause), waits to join its fleet again and says whether it took the key of
/// [`KEY_ENV`].
async fn paused_granter_worker() {
    let mut go = tokio::signal::unix::signal(SignalKind::user_defined1()).unwrap();
    let router = common::worker_router().await;
    let g = router
        .acquire("first", AcquireOptions::new())
        .await
        .unwrap();
    g.release().await.unwrap();
    report!("granted");
    go.recv().await;
    let joined = tokio::time::timeout(Duration::from_secs(60), router.wait_joined()).await;
    let key = std::env::var(KEY_ENV).unwrap();
    match router.try_acquire(&key, AcquireOptions::new()).await {
        Ok(taken) => report!("taken {}", taken.is_some()),
        Err(e) => report!(
            "taken: refused ({}, joined: {})",
            shardlock::Report(&e),
            joined.is_ok()
        ),
    }
}

/// Holds the key of [`KEY_ENV`] under a lease of a minute; told to go on (SIGUSR1, after its
/// pause), says whether it still holds it.
async fn lapsed_lease_holder_worker() {
    let mut go = tokio::signal::unix::signal(SignalKind::user_defined1()).unwrap();
    let router = common::worker_router().await;
    let key = std::env::var(KEY_ENV).unwrap();
    let ttl = AcquireOptions::new().ttl(Duration::from_secs(60));
    let guard = router.acquire(&key, ttl).await.unwrap();
    report!("held");
    go.recv().await;
    report!("held {}", guard.is_held());
}

crate::worker_entry! {
    "lapsed-cas-holder" => lapsed_cas_holder_worker(),
    "lapsed-lease-holder" => lapsed_lease_holder_worker(),
    "paused-granter" => paused_granter_worker(),
}

/// `router`'s own registry row on s1.
async fn own_row(router: &LockRouter) -> Option<shardlock::InstanceRow> {
    let shards = router.instances().await;
    let (_, rows) = shards.into_iter().find(|(name, _)| name == "s1")?;
    rows.ok()?
        .into_iter()
        .find(|r| r.instance_id == router.instance_id())
}

/// What `router`'s own registry row on s1 advertises: its topology's fingerprint, and whether
/// a move was in force at its latest heartbeat.
async fn advertised(router: &LockRouter) -> Option<(String, bool)> {
    let row = own_row(router).await?;
    Some((row.topology?, row.moving))
}

/// The fingerprint `router` advertised in the first of its heartbeats that s1 saw after
/// `since`.
async fn advertised_after(router: &LockRouter, since: std::time::Instant) -> String {
    loop {
        // Read before the row: a heartbeat younger than this was sent after `since` (5 ms for
        // the shard's clock's millisecond truncation).
        let waited = i64::try_from(since.elapsed().as_millis()).unwrap();
        if let Some(row) = own_row(router).await {
            if row.heartbeat_ms_ago + 5 < waited {
                return row.topology.unwrap();
            }
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "no heartbeat after the reload"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A process that reloads while it holds a transaction lock on a moved key advertises the
/// topology it reloaded from until the lock holds where the key lives now. The lock leaves no
/// row for the others' move to wait on: seeing the process as not reloaded, they keep the move
/// in force, locking the key where it lived too, and do not lock it on its new shard alone
/// beside it. After a second reload meanwhile, still the topology the lock holds under.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_advertises_its_old_topology_until_its_transaction_locks_followed() {
    let (cluster, three, key, a, held) = a_transaction_lock_on_a_moving_key().await;
    let (before, moving) = advertised(&a).await.expect("registered on s1");
    assert!(!moving);
    let new = shard_of(
        &cluster,
        &LockRouter::new(three.clone()).await.unwrap(),
        &key,
    );
    let mut blocker = common::row_locked(new, "shardlock_txlock", &key).await;

    a.reload(three.clone()).await.unwrap();
    // A heartbeat sent since the reload returned, so after the swap.
    let reloaded = std::time::Instant::now();
    let during = advertised_after(&a, reloaded).await;
    assert!(held.is_held(), "still following");
    assert_eq!(
        during, before,
        "advertised the new topology before its lock followed"
    );
    // Nor the servers it reaches now (a reload that only points a shard at another server
    // keeps the fingerprint): none, which matches no other process.
    let servers = own_row(&a).await.and_then(|row| row.servers);
    assert_eq!(
        servers.as_deref(),
        Some("unknown"),
        "advertised the servers it reaches now before its lock followed"
    );

    // Reloaded again meanwhile: still the topology the lock holds under, not the one between.
    let mut two = three.clone();
    two.shards.truncate(2);
    a.reload(two).await.unwrap();
    let reloaded = std::time::Instant::now();
    let after_the_second = advertised_after(&a, reloaded).await;
    assert!(held.is_held(), "still following");
    assert_eq!(
        after_the_second, before,
        "advertised the topology in between"
    );

    // Once it followed, the new one.
    blocker.query_drop("ROLLBACK").await.unwrap();
    let followed = common::eventually(Duration::from_secs(30), || async {
        advertised(&a).await.is_some_and(|(f, _)| f != before)
    })
    .await;
    assert!(followed, "the new topology was never advertised");
    // (Read again after a reload: a shard's identity is read within a heartbeat or so.)
    let told = common::eventually(Duration::from_secs(30), || async {
        let servers = own_row(&a).await.and_then(|row| row.servers);
        servers.is_some_and(|s| s != "unknown")
    })
    .await;
    assert!(told, "its servers were never advertised");
    held.commit().await.unwrap();
}

/// A transaction lock whose follow fails part way — its row locked on the key's shard after
/// one reload, then held up on its shard after a second — rolls back the rows the follow took
/// at once, not when its guard ends: they would keep the key from the processes that lock it
/// there.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_that_fails_rolls_back_the_rows_it_took() {
    let (cluster, three, four) = cluster().await;
    let followed = followed_once(
        &cluster,
        [three, four],
        Duration::from_secs(6),
        Link::Direct,
    )
    .await;
    let Followed {
        a,
        held,
        key,
        p1,
        p2,
        two,
        ..
    } = followed;
    let shard = |name: &str| named(&cluster, name);

    // Reloaded again, with the key's row on p2 held by another transaction past the follow's
    // time: lost.
    let mut blocker = common::row_locked(shard(&p2), "shardlock_txlock", &key).await;
    a.reload(two).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), held.lost())
        .await
        .expect("the follow to p2 was held up past its time");

    // The row the first follow took on p1 is free while the guard lives.
    let locked = txlock_row_locked(shard(&p1), &key, 10).await;
    assert!(
        locked.is_ok(),
        "the row on {p1} is still locked by a lost lock: {locked:?}"
    );
    assert!(matches!(held.commit().await, Err(Error::LockLost { .. })));
    blocker.query_drop("ROLLBACK").await.unwrap();
}

/// A transaction lock whose `COMMIT` is on its way (held up on the link to its shard) when a
/// reload moves its key again, with the follow kept from the new shard past its time, keeps
/// the row it holds on the shard its key lived on in between until the `COMMIT` is answered:
/// rolled back at the follow's failure, it would let a process placed by the reload lock the
/// key there, and then the held-up `COMMIT` would still commit the holder's statements.
#[tokio::test(flavor = "multi_thread")]
async fn a_follow_that_fails_during_a_commit_keeps_the_rows_until_it_is_answered() {
    let (cluster, three, four) = cluster().await;
    let followed =
        followed_once(&cluster, [three, four], Duration::from_secs(2), Link::Proxy).await;
    let Followed {
        a,
        held,
        key,
        p1,
        p2,
        two,
        proxy,
    } = followed;
    let proxy = proxy.expect("proxied");
    let shard = |name: &str| named(&cluster, name);

    let (placed, _) = advertised(&a).await.expect("registered on s1");
    // The COMMIT is held on its way to the lock's own shard.
    proxy.set(ProxyMode::HoldTo(b"RELEASE SAVEPOINT"));
    let committing = tokio::spawn(held.commit());
    let mut commit = proxy.held().await;
    // Reloaded meanwhile, with the key's row on p2 held by another transaction past the
    // follow's time (half the 2 s window).
    let mut blocker = common::row_locked(shard(&p2), "shardlock_txlock", &key).await;
    a.reload(two).await.unwrap();
    let locked = txlock_row_locked(shard(&p1), &key, 3).await;
    assert!(
        locked.is_err(),
        "the row on {p1} was let go while the lock's COMMIT was on its way"
    );
    // Nor does the process advertise the new topology, the follow failed: the fleet keeps the
    // move in force (locking the key where it lived too) while the COMMIT may land.
    let since = std::time::Instant::now();
    assert_eq!(
        advertised_after(&a, since).await,
        placed,
        "advertised the topology its lock never followed to while its COMMIT was on its way"
    );
    blocker.query_drop("ROLLBACK").await.unwrap();
    // Nor does the process itself end the move, past its window: its own next lock of the key
    // would be taken on p2 alone while the COMMIT can still land.
    let kept = a.stats().moves_kept;
    let passed = common::eventually(Duration::from_secs(30), || {
        let (moves, passes) = (a.moves_in_progress(), a.stats().moves_kept - kept);
        async move { moves == 0 || passes >= 5 }
    })
    .await;
    assert!(passed, "the move neither ended nor was kept");
    let again = a.lock_in_transaction(&key, Duration::ZERO).await;
    assert!(
        matches!(again, Err(Error::Timeout { .. })),
        "the key was locked again by its holder's own process while its COMMIT was on its way: {again:?}"
    );
    assert!(commit.deliver().await, "the COMMIT was not run");
    drop(commit);
    // The client never heard the answer: the commit may have been applied.
    let committed = committing.await.unwrap();
    assert!(
        matches!(committed, Err(Error::Unavailable { .. })),
        "{committed:?}"
    );
    let locked = txlock_row_locked(shard(&p1), &key, 10).await;
    assert!(locked.is_ok(), "the row on {p1} stayed locked: {locked:?}");
}

/// A transaction lock whose `commit` is given up while its `COMMIT` is on its way (held up on
/// the link to its shard) keeps its row on the shard its key lived on in between until a
/// statement of the process reached its own shard again, which first ends the lock's session
/// there: let go at once, that row would let a process placed by a reload lock the key while
/// the `COMMIT` could still land.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_given_up_on_its_way_keeps_the_rows_until_its_session_is_ended() {
    let (cluster, three, four) = cluster().await;
    let followed =
        followed_once(&cluster, [three, four], Duration::from_secs(2), Link::Proxy).await;
    // Nothing of this process reaches the lock's shard meanwhile.
    let GivenUp {
        a: _a,
        key,
        p1,
        proxy,
        mut commit,
    } = commit_given_up(followed, ProxyMode::Blackhole).await;
    let p1 = named(&cluster, &p1);
    kept_until_the_session_is_ended(p1, &key, &proxy, &mut commit, "the given-up COMMIT").await;
}

/// Asserts that the row on `p1` of a lock whose `COMMIT` (`what`) is held on its way through
/// `proxy`, blackholed, stays locked; and once the link is back, that the row is let go only
/// after the lock's session was ended there (the `COMMIT` then never runs).
async fn kept_until_the_session_is_ended(
    p1: &Shard,
    key: &str,
    proxy: &Proxy,
    commit: &mut HeldRequest,
    what: &str,
) {
    let locked = txlock_row_locked(p1, key, 2).await;
    assert!(
        locked.is_err(),
        "the row on {} was let go while {what} could still land",
        p1.name()
    );
    proxy.set(ProxyMode::Pass);
    let freed = common::eventually(Duration::from_secs(60), || async {
        txlock_row_locked(p1, key, 1).await.is_ok()
    })
    .await;
    assert!(freed, "the row on {} stayed locked", p1.name());
    assert!(
        !commit.deliver().await,
        "{what} ran after the row was let go"
    );
}

/// A transaction lock dropped while a `COMMIT` of the caller's own, sent through the lock's
/// connection, is on its way (held up on the link to its shard) keeps its row on the shard its
/// key lived on in between until a statement of the process reached its own shard again, as
/// for its own `commit` given up (helper 245 F2): ended at once by the drop, that row let a
/// process placed by a reload lock the key while the caller's `COMMIT` could still land.
#[tokio::test(flavor = "multi_thread")]
async fn a_lock_dropped_while_its_callers_commit_is_on_its_way_keeps_the_rows_until_its_session_is_ended(
) {
    let (cluster, three, four) = cluster().await;
    let followed =
        followed_once(&cluster, [three, four], Duration::from_secs(2), Link::Proxy).await;
    let Followed {
        a: _a,
        mut held,
        key,
        p1,
        proxy,
        ..
    } = followed;
    let proxy = proxy.expect("proxied");
    proxy.set(ProxyMode::HoldTo(b"COMMIT"));
    let committing = tokio::spawn(async move {
        let _ = held.conn().query_drop("COMMIT").await;
        held
    });
    let mut commit = proxy.held().await;
    // Nothing of this process reaches the lock's shard meanwhile; the caller gives up, and
    // the guard is dropped with its call.
    proxy.set(ProxyMode::Blackhole);
    committing.abort();
    assert!(committing.await.unwrap_err().is_cancelled());
    let p1 = named(&cluster, &p1);
    kept_until_the_session_is_ended(p1, &key, &proxy, &mut commit, "the caller's COMMIT").await;
}

/// A `COMMIT` given up on its way on a session that cannot be told apart from others (behind
/// a proxy that keeps sessions of its own): nothing can end that session or say it is gone, so
/// the lock's row on the shard its key lived on in between stays locked until the `COMMIT`'s
/// time is out or the router shuts down, also while the shard answers and after the `COMMIT`
/// landed.
#[tokio::test(flavor = "multi_thread")]
async fn a_commit_given_up_on_a_session_that_cannot_be_told_apart_keeps_the_rows_until_the_end() {
    let (cluster, three, four) = cluster().await;
    let followed = followed_once(
        &cluster,
        [three, four],
        Duration::from_secs(2),
        Link::ProxyHidingSessions,
    )
    .await;
    // The shard answers meanwhile, and no one ends the session: the COMMIT may land any time.
    let GivenUp {
        a,
        key,
        p1,
        proxy: _proxy,
        mut commit,
    } = commit_given_up(followed, ProxyMode::Pass).await;
    let p1 = named(&cluster, &p1);
    let locked = txlock_row_locked(p1, &key, 3).await;
    assert!(
        locked.is_err(),
        "the row on {} was let go while a COMMIT on a session no one can end could still land",
        p1.name()
    );
    assert!(commit.deliver().await, "the COMMIT did not land");
    let locked = txlock_row_locked(p1, &key, 1).await;
    assert!(locked.is_err(), "the row on {} was let go", p1.name());
    a.shutdown().await.unwrap();
    let freed = common::eventually(Duration::from_secs(60), || async {
        txlock_row_locked(p1, &key, 1).await.is_ok()
    })
    .await;
    assert!(freed, "the row on {} outlived the router", p1.name());
}

/// What [`commit_given_up`] leaves: [`Followed`]'s router, key, shard `p1` and proxy, and
/// the lock's `COMMIT`, held on its way.
struct GivenUp {
    a: LockRouter,
    key: String,
    p1: String,
    proxy: Proxy,
    commit: HeldRequest,
}

/// Commits `followed`'s lock with its `COMMIT` held on its way to the lock's shard, the link
/// then in mode `then`, and gives the commit up.
async fn commit_given_up(followed: Followed, then: ProxyMode) -> GivenUp {
    let Followed {
        a,
        held,
        key,
        p1,
        proxy,
        ..
    } = followed;
    let proxy = proxy.expect("proxied");
    proxy.set(ProxyMode::HoldTo(b"RELEASE SAVEPOINT"));
    let committing = tokio::spawn(held.commit());
    let commit = proxy.held().await;
    proxy.set(then);
    committing.abort();
    assert!(committing.await.unwrap_err().is_cancelled());
    GivenUp {
        a,
        key,
        p1,
        proxy,
        commit,
    }
}

/// How router `a` of [`followed_once`] reaches the key's first shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    Direct,
    /// Through a proxy (under every config).
    Proxy,
    /// Through a proxy that hides which server session a connection has (see
    /// `Proxy::renumber_sessions`).
    ProxyHidingSessions,
}

/// What [`followed_once`] leaves: router `a` (over four shards, then three) holding a
/// transaction lock on `key` that followed it from its first shard to `p1`, the key's shard
/// `p2` under `two` (the first two shards), and the proxy in front of the key's first shard.
struct Followed {
    a: LockRouter,
    held: TxLockGuard,
    key: String,
    p1: String,
    p2: String,
    two: Config,
    proxy: Option<Proxy>,
}

/// [`Followed`], with move window `window`, the key's first shard reached over `link`.
async fn followed_once(
    cluster: &Cluster,
    [three, four]: [Config; 2],
    window: Duration,
    link: Link,
) -> Followed {
    let window = |mut c: Config| {
        c.routing.move_window = Some(window);
        c
    };
    let (mut three, mut four) = (window(three), window(four));
    let mut two = three.clone();
    two.shards.truncate(2);
    // A key on a different shard under each of four, three and two shards.
    let routers = [
        LockRouter::new(four.clone()).await.unwrap(),
        LockRouter::new(three.clone()).await.unwrap(),
        LockRouter::new(two.clone()).await.unwrap(),
    ];
    let (key, [p0, p1, p2]) = (0..)
        .map(|i| format!("follow:{i}"))
        .map(|k| {
            let placed = routers.each_ref().map(|r| r.shard_for(&k).unwrap());
            (k, placed)
        })
        .find(|(_, [p0, p1, p2])| p0 != p1 && p1 != p2 && p0 != p2)
        .unwrap();
    // Gone from the fleet: routers of other topologies would keep `a` from joining.
    for router in routers {
        router.shutdown().await.unwrap();
    }
    let proxy = match link {
        Link::Proxy | Link::ProxyHidingSessions => {
            let first = named(cluster, &p0);
            let proxy = Proxy::start(first.port()).await.unwrap();
            if link == Link::ProxyHidingSessions {
                proxy.renumber_sessions();
            }
            for config in [&mut four, &mut three, &mut two] {
                for s in config.shards.iter_mut().filter(|s| s.name == p0) {
                    s.url = proxy.url();
                    // Longer than the test holds a statement up.
                    s.statement_timeout = Duration::from_secs(60);
                }
            }
            Some(proxy)
        }
        Link::Direct => None,
    };
    let a = LockRouter::new(four).await.unwrap();
    let held = a
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();
    let (before, _) = advertised(&a).await.expect("registered on s1");

    // Reloaded once: it follows its key to p1.
    a.reload(three).await.unwrap();
    let followed = common::eventually(Duration::from_secs(30), || async {
        advertised(&a).await.is_some_and(|(f, _)| f != before)
    })
    .await;
    assert!(followed, "the first follow never ended");
    assert!(held.is_held());
    Followed {
        a,
        held,
        key,
        p1,
        p2,
        two,
        proxy,
    }
}

/// Locks `key`'s row of `shardlock_txlock` on `shard` in a transaction of its own, waiting up
/// to `secs` (the server's lock wait), and rolls back.
async fn txlock_row_locked(
    shard: &Shard,
    key: &str,
    secs: u32,
) -> Result<Option<u8>, shardlock::mysql_async::Error> {
    let mut c = shard.connect().await.unwrap();
    c.query_drop(format!("SET SESSION innodb_lock_wait_timeout = {secs}"))
        .await
        .unwrap();
    let mut tx = c.start_transaction(Default::default()).await.unwrap();
    let locked = tx
        .exec_first(
            "SELECT 1 FROM shardlock_txlock WHERE lock_key = ? FOR UPDATE",
            (key,),
        )
        .await;
    tx.rollback().await.unwrap();
    locked
}

/// A transaction lock has no lease row, so a process started onto another topology after its
/// holder's fleet counted as dead (the holder cut off from every shard past its heartbeat
/// timeout) locks the key where its own topology puts it. The holder learns its lock is lost
/// as its heartbeat lapses, and its `commit` rolls back, also once its heartbeat lands again.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_held_through_a_lapse_commits_nothing_once_a_start_onto_another_topology_locked_its_key(
) {
    transaction_lock_through_a_lapse(true).await;
}

/// The same, with nobody looking at the lock during the lapse: the heartbeat that lands after
/// it finds the lapse, and the lock stays lost though the registry counts its process live
/// again.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_that_lapsed_unwatched_commits_nothing() {
    transaction_lock_through_a_lapse(false).await;
}

/// See the two tests above; `watched`: the holder waits on `lost()` during the lapse.
async fn transaction_lock_through_a_lapse(watched: bool) {
    let cluster = Cluster::start(2).await.unwrap();
    let beats = "cleaner:\n  heartbeat-interval: 500ms\n  heartbeat-timeout: 2s\n";
    // The other topology: both shards, reached directly.
    let both = cluster.config_yaml(beats);
    let migrator =
        LockRouter::from_yaml_str(&cluster.config_yaml("cleaner:\n  registry: static\n"))
            .await
            .unwrap();
    migrator.migrate().await.unwrap();
    let key = common::key_on(&migrator, "k", "s2");
    migrator.shutdown().await.unwrap();
    let mut app = cluster.shard(0).connect().await.unwrap();
    app.query_drop("CREATE TABLE orders (k VARCHAR(64) PRIMARY KEY)")
        .await
        .unwrap();

    // The holder: s1 alone, through a proxy that will cut it off.
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let holder = LockRouter::from_yaml_str(&format!("{}{beats}", common::s1_through(&proxy)))
        .await
        .unwrap();
    let mut held = holder
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();
    held.conn()
        .exec_drop("INSERT INTO orders (k) VALUES (?)", (&key,))
        .await
        .unwrap();
    proxy.set(ProxyMode::Blackhole);
    if watched {
        tokio::time::timeout(Duration::from_secs(60), held.lost())
            .await
            .expect("the transaction lock outlived its process's heartbeat");
        assert!(!held.is_held());
    } else {
        let lapsed = common::eventually(Duration::from_secs(60), || async {
            holder.stats().heartbeat_lapses > 0
        })
        .await;
        assert!(lapsed, "the cut-off holder's heartbeat never lapsed");
    }

    // Once the holder counts as dead, a start onto the other topology locks the key on s2. Its
    // fleet as one that ran a version before migration 13: no placement record, so the start
    // takes the key only where its own topology puts it (with the record it would move from s1
    // and wait there for the holder's session), and the holder's own lapse must keep it from
    // committing.
    app.query_drop("DELETE FROM shardlock_placement")
        .await
        .unwrap();
    let other = LockRouter::from_yaml_str(&both).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), other.wait_joined())
        .await
        .expect("the start onto the other topology never joined once the holder counted dead");
    let theirs = other
        .lock_in_transaction(&key, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(theirs.shard(), "s2");
    theirs.commit().await.unwrap();

    // The holder's heartbeat lands again: its lock stays lost, and commits nothing.
    proxy.set(ProxyMode::Pass);
    // Its row on s1 was older than its timeout (the other start counted it dead): one this
    // fresh is a heartbeat that landed since.
    let landed = common::eventually(Duration::from_secs(30), || async {
        let shards = holder.instances().await;
        let rows = shards.into_iter().flat_map(|(_, rows)| rows.ok()).flatten();
        rows.filter(|r| r.instance_id == holder.instance_id())
            .any(|r| r.heartbeat_ms_ago < 400)
    })
    .await;
    assert!(landed, "the holder's heartbeat never reached s1 again");
    assert!(!held.is_held());
    let committed = held.commit().await;
    assert!(
        matches!(committed, Err(Error::LockLost { .. })),
        "the lapsed holder committed under a lock another process held: {committed:?}"
    );
    let rows: Vec<String> = app.query("SELECT k FROM orders").await.unwrap();
    assert!(
        rows.is_empty(),
        "the lapsed holder's write was kept: {rows:?}"
    );
}

/// A reload undone by one process while another still runs the topology in between, its own
/// move from the first one over: the undone move stays in force, and its carry does not empty
/// a shard of that topology of the CAS lock taken there. Before, a reload back to a topology
/// skipped the fleet check: the carry copied the lock away and the other process took it a
/// second time.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_undone_while_another_process_runs_the_one_in_between_carries_no_lock_from_it() {
    let (cluster, three, four) = cluster().await;
    let key = moving_key(&three, &four, "cas:").await;
    let a = LockRouter::new(four.clone()).await.unwrap();
    let b = LockRouter::new(four.clone()).await.unwrap();
    b.reload(three.clone()).await.unwrap();
    // a's move away from `four` lasts past the steps below (a window is no part of a
    // topology's fingerprint: a runs b's topology).
    a.reload(windowed(&cluster, &[1; 3], "", "20s"))
        .await
        .unwrap();
    let window_over = tokio::time::Instant::now() + Duration::from_secs(20);
    common::moves_done(&b).await;
    let first = b.cas_acquire(&key, "o1").await.unwrap().expect("free");
    a.reload(four).await.unwrap();
    assert!(
        a.moves_in_progress() == 2,
        "a's first move ended before it was undone"
    );

    // Once its window is over the undone move's carry decides: it carries (the move ends) or
    // it is kept in force, counted at each check with the newer move's.
    tokio::time::sleep_until(window_over).await;
    let kept = a.stats().moves_kept;
    let decided = common::eventually(Duration::from_secs(30), || async {
        a.moves_in_progress() < 2 || a.stats().moves_kept >= kept + 10
    })
    .await;
    assert!(decided, "the undone move neither ended nor was kept");
    let second = b.cas_acquire(&key, "o2").await.unwrap();
    assert!(
        second.is_none(),
        "a CAS lock held through the topology in between was granted again: {second:?} ({} \
         moves in force in the process that undid its reload)",
        a.moves_in_progress()
    );
    assert!(
        b.cas_release(first).await.unwrap(),
        "the holder releases its lock where it took it"
    );
}
