//! The `local` failure policy: while a shard's breaker is open, keys of that shard are granted
//! in process (`LockMode::LocalFallback`); when it is back they are re-acquired there before
//! any remote grant of them in this process, and a key found held by another process then is
//! reported lost. Never two holders of a key inside one process.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::faults::{Rig, POOL, WAIT};
use shardlock::{AcquireOptions, BreakerState, Error, LockMode, LockRouter, LOCAL_FENCE_BIT};
use shardlock_testkit::{Cluster, Competitor, Proxy, ProxyMode};

/// Counts of one phase of the 64-task run.
#[derive(Default)]
struct Tally {
    remote: AtomicU64,
    local: AtomicU64,
    overlaps: AtomicU64,
    unavailable: AtomicU64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_tasks_never_overlap_before_during_and_after_a_shard_dies() {
    let rig = Rig::start("local", None, POOL).await;
    let keys = rig.keys("k", 8, false);
    let holders: Arc<Vec<AtomicBool>> =
        Arc::new(keys.iter().map(|_| AtomicBool::new(false)).collect());
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let tasks: Vec<_> = (0..64)
        .map(|t| {
            let (router, keys, holders, tally, stop) = (
                rig.router.clone(),
                keys.clone(),
                holders.clone(),
                tally.clone(),
                stop.clone(),
            );
            tokio::spawn(async move {
                let mut i = t;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let k = i % keys.len();
                    match router
                        .acquire(&keys[k], AcquireOptions::new().wait(WAIT))
                        .await
                    {
                        Ok(guard) => {
                            if holders[k].swap(true, Ordering::AcqRel) {
                                tally.overlaps.fetch_add(1, Ordering::Relaxed);
                            }
                            let mode = match guard.mode() {
                                LockMode::LocalFallback => {
                                    assert_ne!(guard.fence() & LOCAL_FENCE_BIT, 0);
                                    &tally.local
                                }
                                _ => {
                                    assert_eq!(guard.fence() & LOCAL_FENCE_BIT, 0);
                                    &tally.remote
                                }
                            };
                            mode.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_micros(200)).await;
                            holders[k].store(false, Ordering::Release);
                            let _ = guard.release().await; // may find the shard gone
                        }
                        Err(Error::Unavailable { .. }) => {
                            tally.unavailable.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        Err(Error::Timeout { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
            })
        })
        .collect();

    let count = |c: &AtomicU64| c.load(Ordering::Relaxed);
    reach("remote grants before the fault", 500, &tally.remote).await;
    let remote_before = count(&tally.remote);

    rig.cluster.shard(0).kill().unwrap();
    reach("local grants", 500, &tally.local).await;
    assert_ne!(rig.router.breaker_state("s1"), Some(BreakerState::Closed));

    rig.cluster.shard(0).restart().await.unwrap();
    let router = rig.router.clone();
    assert!(
        common::eventually(Duration::from_secs(20), || {
            let closed = router.breaker_state("s1") == Some(BreakerState::Closed);
            async move { closed }
        })
        .await,
        "the breaker never closed"
    );
    let remote_after_recovery = count(&tally.remote);
    reach(
        "remote grants after recovery",
        remote_after_recovery + 500,
        &tally.remote,
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    let stats = rig.router.stats();
    eprintln!(
        "remote before {remote_before}, local {}, remote in all {}, unavailable {}, \
         reconciled {}, conflicts {}",
        count(&tally.local),
        count(&tally.remote),
        count(&tally.unavailable),
        stats.reconciled,
        stats.reconcile_conflicts
    );
    assert_eq!(
        count(&tally.overlaps),
        0,
        "two holders of a key in one process"
    );
    assert_eq!(stats.local_grants, count(&tally.local));
    assert_eq!(stats.reconcile_conflicts, 0, "nobody else held these keys");
    assert!(
        rig.router
            .status()
            .await
            .iter()
            .all(|s| s.local_fallback_leases == 0),
        "local leases left behind"
    );
}

/// Waits until `counter` reaches `n` (20 s at most).
async fn reach(what: &str, n: u64, counter: &AtomicU64) {
    let reached = common::eventually(Duration::from_secs(20), || {
        let v = counter.load(Ordering::Relaxed);
        async move { v >= n }
    })
    .await;
    assert!(reached, "{what} never reached {n}");
}

/// A second instance that reaches `s1` directly while the first is cut off by the proxy.
async fn direct_router(rig: &Rig) -> LockRouter {
    let yaml =
        common::faults::config_yaml(&rig.cluster, &rig.cluster.shard(0).url(), POOL, "fail-fast");
    LockRouter::from_yaml_str(&yaml).await.unwrap()
}

/// A rig whose router is cut off from `s1`, and a key of `s1` it holds in process.
async fn held_locally() -> (Rig, String, shardlock::LockGuard) {
    held_locally_for(AcquireOptions::new()).await
}

/// [`held_locally`], acquired with `options`.
async fn held_locally_for(options: AcquireOptions) -> (Rig, String, shardlock::LockGuard) {
    let rig = Rig::start("local", None, POOL).await;
    let key = rig.keys("k", 1, false).remove(0);
    cut_off(&rig, "other").await;
    let guard = rig.router.acquire(&key, options).await.unwrap();
    assert_eq!(guard.mode(), LockMode::LocalFallback);
    (rig, key, guard)
}

/// `key`, acquired by the rig's router while it is cut off from `s1`: held in process.
async fn in_process(rig: &Rig, key: &str) -> shardlock::LockGuard {
    held_as(&rig.router, key, LockMode::LocalFallback).await
}

/// `key`, acquired by `router` with the namespace's options, held as `mode` says.
async fn held_as(router: &LockRouter, key: &str, mode: LockMode) -> shardlock::LockGuard {
    let guard = router.acquire(key, AcquireOptions::new()).await.unwrap();
    assert_eq!(guard.mode(), mode);
    guard
}

/// Reconnects the rig's router to `s1` and waits until its local hold is re-acquired there.
async fn reconciled(rig: &Rig) {
    rig.proxy.set(ProxyMode::Pass);
    let router = rig.router.clone();
    assert!(
        common::eventually(Duration::from_secs(10), || {
            let done = router.stats().reconciled == 1;
            async move { done }
        })
        .await,
        "the local hold was never re-acquired on the shard"
    );
}

/// A key held in process and re-acquired on its shard since is a lease with a row like any
/// other: `extend` moves that row's end (it answered `Ok` and moved nothing, and a lease
/// without keep-alive then ended at its ttl all the same).
#[tokio::test(flavor = "multi_thread")]
async fn extend_moves_the_end_of_a_local_hold_once_it_was_reconciled() {
    // Long enough to be reconciled before it ends, whatever probes the breaker needs first.
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(20))
        .keep_alive(false);
    let (rig, _, guard) = held_locally_for(once).await;
    reconciled(&rig).await;
    guard.extend(Duration::from_secs(60)).await.unwrap();
    assert!(
        guard.held_until() > tokio::time::Instant::now() + Duration::from_secs(30),
        "extended by a minute, the reconciled lease still ends {:?} from now",
        guard.held_until() - tokio::time::Instant::now()
    );
    guard.release().await.unwrap();
}

/// A key held in process, re-acquired on its shard and extended there, whose release fails
/// (the shard cut off again) is given back for as long as its extended row lasts. Before, a
/// hold granted in process was given back for its ttl only, as if it had no row: a shard away
/// for longer left the key taken by nobody until the extension ran out.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_release_of_an_extended_hold_reconciled_from_process_is_given_back_later() {
    let (rig, key, guard) =
        held_locally_for(AcquireOptions::new().ttl(Duration::from_secs(2))).await;
    reconciled(&rig).await;
    guard.extend(Duration::from_secs(300)).await.unwrap();
    rig.proxy.set(ProxyMode::Reset);
    let released = guard.release().await;
    assert!(
        released.is_err(),
        "released through a cut link: {released:?}"
    );
    // Away for longer than the lease's ttl (the give-back's window before).
    tokio::time::sleep(Duration::from_secs(5)).await;
    rig.proxy.set(ProxyMode::Pass);
    let other = direct_router(&rig).await;
    let taken = common::eventually(Duration::from_secs(30), || async {
        matches!(
            other.try_acquire(&key, AcquireOptions::new()).await,
            Ok(Some(_))
        )
    })
    .await;
    assert!(
        taken,
        "the extended row of a failed release was never given back"
    );
}

/// A key held in process and re-acquired on its shard since is lost, as any lease on a shard
/// is, when its process's heartbeat lapses (here: the fleet saw its registry row silent for a
/// minute, as after a freeze): the fleet may count the process dead and take the key where
/// its topology puts it. Still counted as held in process, it stayed held.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_hold_reconciled_on_its_shard_is_lost_when_its_process_lapses() {
    use shardlock::mysql_async::prelude::Queryable;
    let (rig, _, guard) =
        held_locally_for(AcquireOptions::new().ttl(Duration::from_secs(60))).await;
    reconciled(&rig).await;
    (rig.cluster.shard(0).connect().await.unwrap())
        .exec_drop(
            "UPDATE shardlock_instance SET heartbeat_at = heartbeat_at - INTERVAL 60 SECOND \
             WHERE instance_id = ?",
            (rig.router.instance_id(),),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), guard.lost())
        .await
        .expect("a local hold re-acquired on its shard outlived its process's lapse");
    assert!(rig.router.stats().heartbeat_lapses >= 1);
    assert!(!guard.is_held());
}

/// `lock_at_least(d)` keeps a key taken for `d` after its grant whatever its holder does, in
/// process too: a hold in process released at once let the next caller of this process take
/// the key straight away, and a once-per-interval job ran twice.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_hold_released_early_keeps_its_key_for_its_minimum() {
    let at_least = Duration::from_secs(5);
    let (rig, key, guard) = held_locally_for(AcquireOptions::new().lock_at_least(at_least)).await;
    guard.release().await.unwrap();
    let next = rig.router.try_acquire(&key, AcquireOptions::new()).await;
    let next = next.map(|g| g.map(|g| g.mode()));
    assert!(
        matches!(next, Ok(None)),
        "a key held in process for at least {at_least:?} was taken again once released: {next:?}"
    );
    // Then it is taken again.
    let after = (rig.router)
        .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(after.mode(), LockMode::LocalFallback);
    after.release().await.unwrap();
}

/// `lock_at_most(d)` bounds a hold whatever its holder does, in process too: a key held in
/// process without keep-alive ends at its ttl from the grant (it had no end at all while its
/// shard was away), and its shard, once back, does not take it again for this process.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_hold_without_keep_alive_ends_at_its_ttl() {
    let at_most = Duration::from_millis(1500);
    let (rig, key, guard) = held_locally_for(AcquireOptions::new().lock_at_most(at_most)).await;
    let granted = tokio::time::Instant::now();
    assert!(
        guard.held_until() <= granted + at_most,
        "a local hold of at most {at_most:?} ends {:?} after it was granted",
        guard.held_until() - granted
    );
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("a local hold without keep-alive was never reported lost");
    assert!(!guard.is_held());
    // Ended, it stays so: `extend` does not bring it back.
    assert!(matches!(
        guard.extend(Duration::from_secs(60)).await,
        Err(Error::LockLost { .. })
    ));
    assert!(!guard.is_held());

    // Back on the shard, the ended hold is no longer counted as held in process, and takes no
    // row there.
    let other = direct_router(&rig).await;
    rig.proxy.set(ProxyMode::Pass);
    let router = rig.router.clone();
    let ended = common::eventually(Duration::from_secs(20), || {
        let router = router.clone();
        async move { router.status().await[0].local_fallback_leases == 0 }
    })
    .await;
    assert!(
        ended,
        "the ended local hold is still counted once its shard is back"
    );
    let next = other
        .try_acquire(&key, AcquireOptions::new())
        .await
        .unwrap()
        .expect("a local hold that ended took its row when its shard came back");
    assert_eq!(rig.router.stats().reconciled, 0);
    next.release().await.unwrap();
    drop(guard);
}

/// A key held in process without keep-alive is re-acquired on its returning shard for what is
/// left of its ttl, not a whole ttl from then: its row ends when the hold does.
#[tokio::test(flavor = "multi_thread")]
async fn a_local_hold_without_keep_alive_takes_its_row_for_what_is_left() {
    let at_most = Duration::from_secs(20);
    let (rig, key, guard) = held_locally_for(AcquireOptions::new().lock_at_most(at_most)).await;
    let granted = tokio::time::Instant::now();
    // The hold ages while its shard is away.
    tokio::time::sleep(Duration::from_secs(4)).await;
    reconciled(&rig).await;
    // Measured before the read: the row's time left shrinks while it is read.
    let left = (granted + at_most).saturating_duration_since(tokio::time::Instant::now());
    let (_, row) = rig.router.inspect(&key).await.unwrap();
    let row = row.expect("the reconcile took the row");
    // The shard's clock may read a little ahead of the end measured here.
    let slack = 500;
    assert!(
        row.expires_in_ms <= left.as_millis() as i64 + slack,
        "the row of a hold with {left:?} left ends in {} ms",
        row.expires_in_ms
    );
    assert!(guard.is_held());
    guard.release().await.unwrap();
}

/// `extend` moves the end of a key held in process (it answered `Ok` and moved nothing), and
/// one answered while its re-acquire on the returning shard is out moves the row's end too:
/// here that re-acquire waits behind another transaction's lock on the row.
#[tokio::test(flavor = "multi_thread")]
async fn extend_while_held_in_process_moves_the_end_the_shard_keeps() {
    let rig = Rig::start("local", None, POOL).await;
    // A server lock wait of 3 s, inside the statement timeout: the re-acquire waits that long
    // behind the lock (while `extend` is called, and the lock then ended).
    let yaml = rig
        .yaml
        .replacen("statement-timeout: 1s", "statement-timeout: 4s", 1);
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let key = rig.keys("k", 1, false).remove(0);
    // The key's row exists on the shard (released), so a transaction can lock it.
    let once = router.acquire(&key, AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(rig.cluster.shard(0), false)
        .await
        .unwrap();
    let stored = competitor.key_of(once.owner()).await.unwrap().unwrap();
    once.release().await.unwrap();

    cut_off_from(&router, &rig.proxy, "other").await;
    let at_most = Duration::from_secs(3);
    let guard = router
        .acquire(&key, AcquireOptions::new().lock_at_most(at_most))
        .await
        .unwrap();
    assert_eq!(guard.mode(), LockMode::LocalFallback);
    competitor.lock(&stored).await.unwrap();
    rig.proxy.set(ProxyMode::Pass);
    common::until_a_row_lock_is_waited_for(rig.cluster.shard(0)).await;

    let extended = tokio::time::Instant::now();
    let by = Duration::from_secs(60);
    guard.extend(by).await.unwrap();
    assert!(
        guard.held_until() >= extended + by,
        "extended by a minute in process, the hold still ends {:?} from now",
        guard.held_until() - tokio::time::Instant::now()
    );
    competitor.end().await.unwrap();
    let held_long = common::eventually(Duration::from_secs(20), || {
        let (done, until) = (router.stats().reconciled == 1, guard.held_until());
        async move { done && until > tokio::time::Instant::now() + Duration::from_secs(30) }
    })
    .await;
    assert!(
        held_long,
        "re-acquired on its shard, the hold extended by a minute ends {:?} from now",
        guard.held_until() - tokio::time::Instant::now()
    );
    let (_, row) = router.inspect(&key).await.unwrap();
    let row = row.expect("the reconcile took the row");
    assert!(
        row.expires_in_ms > 30_000,
        "the row of a hold extended by a minute ends in {} ms",
        row.expires_in_ms
    );
    guard.release().await.unwrap();
}

/// Cuts the rig's router off from `s1` until its breaker opens.
async fn cut_off(rig: &Rig, key: &str) {
    cut_off_from(&rig.router, &rig.proxy, key).await;
}

/// Cuts `router` off from `s1`, behind `proxy`, until its breaker opens.
async fn cut_off_from(router: &LockRouter, proxy: &Proxy, key: &str) {
    proxy.set(ProxyMode::Reset);
    while router.breaker_state("s1") != Some(BreakerState::Open) {
        let _ = router.try_acquire(key, AcquireOptions::new()).await;
    }
}

/// Cut off from its only shard for most of the heartbeat timeout, a process may count as
/// dead elsewhere, so it takes nothing from the shard until it has joined its fleet again;
/// the in-process locks of the `local` policy go on meanwhile, and shard grants come back.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_cut_off_from_every_shard_for_long_still_grants_in_process() {
    let cluster = Cluster::start(1).await.expect("start shards");
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = common::faults::config_yaml(&cluster, &proxy.url(), POOL, "local")
        + "cleaner:\n  heartbeat-interval: 100ms\n  heartbeat-timeout: 2s\ninstance:\n  id: cut\n";
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let registered = common::eventually(Duration::from_secs(10), || async {
        router.instances().await.iter().all(|(_, rows)| {
            rows.as_ref()
                .is_ok_and(|rows| rows.iter().any(|i| i.instance_id == "cut"))
        })
    })
    .await;
    assert!(registered, "its heartbeat reached the shard");
    let remote = router
        .acquire("before", AcquireOptions::new())
        .await
        .unwrap();
    assert_eq!(remote.mode(), LockMode::Remote);
    remote.release().await.unwrap();

    cut_off_from(&router, &proxy, "cut").await;
    // The heartbeat lapses: the last that reached the shard is over 1.05 s old.
    let lapsed = common::eventually(Duration::from_secs(60), || {
        let lapses = router.stats().heartbeat_lapses;
        async move { lapses == 1 }
    })
    .await;
    assert!(lapsed, "the heartbeat lapsed");
    let local = router
        .acquire("during", AcquireOptions::new())
        .await
        .unwrap();
    assert_eq!(local.mode(), LockMode::LocalFallback);
    local.release().await.unwrap();

    proxy.set(ProxyMode::Pass);
    let back = common::eventually(Duration::from_secs(30), || async {
        let once = AcquireOptions::new().wait(Duration::ZERO);
        match router.try_acquire("after", once).await {
            Ok(Some(guard)) => {
                let remote = guard.mode() == LockMode::Remote;
                guard.release().await.unwrap();
                remote
            }
            _ => false,
        }
    })
    .await;
    assert!(
        back,
        "shard grants resume once the process has joined its fleet again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_locally_held_key_is_taken_on_the_shard_when_it_returns() {
    let (rig, key, guard) = held_locally().await;
    let key = &key;
    let other = direct_router(&rig).await;
    // While the proxy cuts this instance off, the shard knows nothing of the local hold.
    assert!(rig.router.status().await[0].local_fallback_leases == 1);

    reconciled(&rig).await;
    // Now the shard keeps other processes out, and this process's waiters behind the holder.
    assert!(other
        .try_acquire(key, AcquireOptions::new())
        .await
        .unwrap()
        .is_none());
    assert!(rig
        .router
        .try_acquire(key, AcquireOptions::new())
        .await
        .unwrap()
        .is_none());
    assert!(guard.is_held());
    guard.release().await.unwrap();
    let next = held_as(&other, key, LockMode::Remote).await;
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_conflict_found_on_recovery_is_reported_to_the_local_holder() {
    let (rig, key, local) = held_locally().await;
    let key = &key;
    // Another process, which reaches the shard, takes the same key meanwhile: the trade-off
    // of the local policy.
    let other = direct_router(&rig).await;
    let remote = other.acquire(key, AcquireOptions::new()).await.unwrap();

    rig.proxy.set(ProxyMode::Pass);
    tokio::time::timeout(Duration::from_secs(10), local.lost())
        .await
        .expect("the local holder was not told");
    assert!(!local.is_held());
    assert_eq!(rig.router.stats().reconcile_conflicts, 1);
    // Its turn stays with it until it lets go: this process's next acquire waits behind it,
    // then behind the remote holder.
    assert!(rig
        .router
        .try_acquire(key, AcquireOptions::new())
        .await
        .unwrap()
        .is_none());
    assert!(matches!(local.release().await, Err(Error::LockLost { .. })));
    assert!(remote.is_held());
    let remote_fence = remote.fence();
    remote.release().await.unwrap();
    let again = held_as(&rig.router, key, LockMode::Remote).await;
    assert!(again.fence() > remote_fence);
}

/// A key held in process when a reload moves it to another shard ends, visibly, while its old
/// shard is still out of reach: the keeper would re-acquire it only on the shard it left,
/// where the processes placed by the reload no longer look for it.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_held_in_process_that_a_reload_moves_is_lost_to_its_holder() {
    let (rig, _key, local) = held_locally().await;
    let without_s1 = format!(
        "shards:\n{}",
        &rig.yaml[rig.yaml.find("  - name: s2").unwrap()..]
    );
    let config = shardlock::Config::from_yaml_str(&without_s1).unwrap();
    rig.router.reload(config).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), local.lost())
        .await
        .expect("the holder of a key moved away in process was not told");
    assert!(!local.is_held());
    // Its release says so, though the shard it was held for is still out of reach.
    let released = local.release().await;
    assert!(
        matches!(released, Err(Error::LockLost { .. })),
        "the release of a key moved away in process answered {released:?}"
    );
}

/// A key held in process when a reload points its shard at another address of the same
/// database (the way past a dead proxy) is lost to its holder: its keeper went on trying the
/// old address, under a breaker nothing showed any more, and the lease stayed held for good
/// while other processes took the key through the new address.
#[tokio::test(flavor = "multi_thread")]
async fn a_key_held_in_process_whose_shard_a_reload_rebuilds_is_lost_to_its_holder() {
    let rig = Rig::start("local", None, POOL).await;
    let key = rig.keys("k", 1, false).remove(0);
    // A reload while s1 answers (its statement timeout raised), which reads which database
    // each shard is: the next one then tells that the new address reaches the same one.
    let known = rig
        .yaml
        .replacen("statement-timeout: 1s", "statement-timeout: 2s", 1);
    let config = shardlock::Config::from_yaml_str(&known).unwrap();
    rig.router.reload(config).await.unwrap();
    cut_off(&rig, "other").await;
    let local = in_process(&rig, &key).await;
    let direct = known.replace(&rig.proxy.url(), &rig.cluster.shard(0).url());
    assert_ne!(direct, known, "s1 is reached through the proxy");
    let config = shardlock::Config::from_yaml_str(&direct).unwrap();
    rig.router.reload(config).await.unwrap();
    assert_eq!(
        rig.router.moves_in_progress(),
        0,
        "the same database: nothing moved"
    );
    tokio::time::timeout(Duration::from_secs(30), local.lost())
        .await
        .expect("the holder of a key whose shard was rebuilt in process was not told");
    assert!(!local.is_held());
    let other = direct_router(&rig).await;
    let theirs = other
        .try_acquire(&key, AcquireOptions::new())
        .await
        .unwrap()
        .expect("the key is free on its shard");
    theirs.release().await.unwrap();
}

/// A reload that turns a namespace's `local` policy off stops the in-process grants of acquires
/// already under way (helper 243): one waiting in memory behind an in-process holder, its turn
/// come after the reload, was granted in process by the policy its call began with, while
/// another process could hold the key on its shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_turns_local_off_stops_in_process_grants_under_way() {
    let (rig, key, local) = held_locally().await;
    let waiter = {
        let (router, key) = (rig.router.clone(), key.clone());
        let opts = AcquireOptions::new().wait(Duration::from_secs(60));
        tokio::spawn(async move { router.acquire(&key, opts).await })
    };
    let queued = common::eventually(Duration::from_secs(30), || async {
        rig.router.stats().queued == 1
    })
    .await;
    assert!(
        queued,
        "the second acquire never waited behind the in-process holder"
    );
    let fail_fast = rig
        .yaml
        .replace("on-shard-failure: local", "on-shard-failure: fail-fast");
    assert_ne!(fail_fast, rig.yaml);
    let config = shardlock::Config::from_yaml_str(&fail_fast).unwrap();
    rig.router.reload(config).await.unwrap();
    let _ = local.release().await;
    let after = waiter.await.unwrap();
    assert!(
        matches!(after, Err(Error::Unavailable { .. })),
        "an acquire under way when a reload turned `local` off was answered {:?}",
        after.map(|g| g.mode())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn shutdown_ends_local_holds_too() {
    let (rig, _, guard) = held_locally().await;
    assert!(guard.is_held());
    let _ = rig.router.shutdown().await; // s1 is cut off: its pool may report the reset
    tokio::time::timeout(Duration::from_secs(1), guard.lost())
        .await
        .expect("a local hold outlived its router");
    assert!(!guard.is_held());
}

/// A lease lost while its shard was cut off leaves its row there until the shard's clock ends
/// it — here an hour on, as on a shard whose clock runs slow or was stepped back. When the
/// shard returns, reconciling the key's next (local) holder gives that row back, since no one
/// in this process holds its owner any more, instead of reporting a conflict with itself.
#[tokio::test(flavor = "multi_thread")]
async fn reconciling_takes_over_a_row_this_process_lost_instead_of_conflicting_with_it() {
    reconcile_past_a_row_this_process_lost(false).await;
}

/// The same when the reconcile's first look at whose row it found fails (a statement timed
/// out, a probe refused by the half-open breaker): the key is tried again at the next pass.
/// Before, a look that failed read as another process's row, and the local holder was told
/// it lost the key to another process.
#[tokio::test(flavor = "multi_thread")]
async fn a_reconcile_that_cannot_tell_whose_row_it_found_tries_again_instead_of_conflicting() {
    reconcile_past_a_row_this_process_lost(true).await;
}

/// A lease of this process lost while its shard was cut off leaves its row an hour on; its
/// key's next holder (local) is reconciled once the shard is back, after a failed look at whose
/// row it is with `look_fails`.
async fn reconcile_past_a_row_this_process_lost(look_fails: bool) {
    let rig = Rig::start("local", None, POOL).await;
    let key = rig.keys("k", 1, false).remove(0);
    let key = &key;
    let first = held_as(&rig.router, key, LockMode::Remote).await;
    let first_fence = first.fence();
    cut_off(&rig, "other").await;
    let mut direct = rig.cluster.shard(0).connect().await.unwrap();
    use shardlock::mysql_async::prelude::Queryable;
    direct
        .exec_drop(
            "UPDATE shardlock_lease SET expires_at = NOW(3) + INTERVAL 1 HOUR WHERE owner = ?",
            (first.owner(),),
        )
        .await
        .unwrap();
    assert_eq!(direct.affected_rows(), 1);
    tokio::time::timeout(Duration::from_secs(10), first.lost())
        .await
        .expect("the cut-off lease was not reported lost at its deadline");
    // Its release finds the shard unreachable, and the row stays: once its retries in the
    // background gave up too (else one could free the row when the shard is back, before the
    // reconcile finds it).
    assert!(first.release().await.is_err());
    assert!(
        rig.router.stats().settling > 0,
        "no release retried in the background"
    );
    let given_up = common::eventually(Duration::from_secs(30), || async {
        rig.router.stats().settling == 0
    })
    .await;
    assert!(given_up, "the release went on retrying in the background");
    let local = held_as(&rig.router, key, LockMode::LocalFallback).await;

    if look_fails {
        // The first look at whose row it is fails: that says nothing of who holds it.
        assert!(rig.router.inject_reconcile_look_failure("s1"));
    }
    rig.proxy.set(ProxyMode::Pass);
    let router = rig.router.clone();
    assert!(
        common::eventually(Duration::from_secs(10), || {
            let s = router.stats();
            async move { s.reconciled + s.reconcile_conflicts > 0 }
        })
        .await,
        "the local hold was never reconciled"
    );
    let stats = rig.router.stats();
    assert_eq!(
        (stats.reconciled, stats.reconcile_conflicts),
        (1, 0),
        "this process's own lost row counted as another holder"
    );
    assert!(local.is_held());
    // The shard now keeps other processes out on the local holder's behalf.
    let other = direct_router(&rig).await;
    assert!(other
        .try_acquire(key, AcquireOptions::new())
        .await
        .unwrap()
        .is_none());
    local.release().await.unwrap();
    let next = other.acquire(key, AcquireOptions::new()).await.unwrap();
    assert!(next.fence() > first_fence);
    next.release().await.unwrap();
}

/// A key whose row another transaction keeps locked holds up the re-acquiring of that key
/// alone: the shard's other locally held keys are re-acquired meanwhile, and one another
/// process took is reported lost to its local holder, whichever order they are tried in.
#[tokio::test(flavor = "multi_thread")]
async fn a_locked_row_holds_up_the_reconcile_of_its_key_alone() {
    let rig = Rig::start("local", None, POOL).await;
    // A server lock wait of 1 s, inside the statement timeout: a locked row is answered so.
    let yaml = rig
        .yaml
        .replacen("statement-timeout: 1s", "statement-timeout: 2s", 1);
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let keys = rig.keys("k", 8, false);
    // Every key's row exists on the shard (released), so a transaction can lock it.
    let mut stored = Vec::new();
    for key in &keys {
        let once = router.acquire(key, AcquireOptions::new()).await.unwrap();
        let mut reader = Competitor::begin(rig.cluster.shard(0), false)
            .await
            .unwrap();
        stored.push(reader.key_of(once.owner()).await.unwrap().unwrap());
        reader.end().await.unwrap();
        once.release().await.unwrap();
    }
    let mut competitor = Competitor::begin(rig.cluster.shard(0), false)
        .await
        .unwrap();
    cut_off_from(&router, &rig.proxy, "other").await;
    let mut locals = Vec::new();
    for key in &keys {
        let local = held_as(&router, key, LockMode::LocalFallback).await;
        locals.push(local);
    }
    // All rows locked but the last key's, which another process takes.
    for row in &stored[..keys.len() - 1] {
        competitor.lock(row).await.unwrap();
    }
    let other = direct_router(&rig).await;
    let remote = other
        .acquire(&keys[keys.len() - 1], AcquireOptions::new())
        .await
        .unwrap();
    rig.proxy.set(ProxyMode::Pass);
    let last = locals.last().unwrap();
    tokio::time::timeout(Duration::from_secs(60), last.lost())
        .await
        .expect("the local holder of a key another process took was not told");
    assert!(remote.is_held());
    competitor.end().await.unwrap();
    remote.release().await.unwrap();
}

/// Re-acquiring a local lease on its returning shard can wait behind another transaction for
/// seconds (here the server's lock wait of 4 s under a 5 s statement timeout, beyond the 2 s
/// ttl of a remote lease on the same shard). Meanwhile the keeper keeps renewing that remote
/// lease and callers' acquires of the shard go ahead: reconciliation runs beside them, and
/// tries again later, never surfacing the wait.
#[tokio::test(flavor = "multi_thread")]
async fn remote_leases_are_renewed_while_reconciliation_waits_behind_a_lock() {
    let rig = Rig::start("local", None, POOL).await;
    let yaml = rig
        .yaml
        .replacen("statement-timeout: 1s", "statement-timeout: 5s", 1);
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let keys = rig.keys("k", 3, false);
    let (local_key, remote_key) = (&keys[0], &keys[1]);
    // The local key's row exists on the shard (released), so a transaction can lock it.
    let once = router
        .acquire(local_key, AcquireOptions::new())
        .await
        .unwrap();
    let mut competitor = Competitor::begin(rig.cluster.shard(0), false)
        .await
        .unwrap();
    let stored = competitor.key_of(once.owner()).await.unwrap().unwrap();
    once.release().await.unwrap();

    rig.proxy.set(ProxyMode::Reset);
    while router.breaker_state("s1") != Some(BreakerState::Open) {
        let _ = router.try_acquire("other", AcquireOptions::new()).await;
    }
    let local = router
        .acquire(local_key, AcquireOptions::new())
        .await
        .unwrap();
    assert_eq!(local.mode(), LockMode::LocalFallback);
    competitor.lock(&stored).await.unwrap();
    rig.proxy.set(ProxyMode::Pass);

    // A remote lease on the same shard, once its breaker lets grants through again.
    let remote = loop {
        let guard = router
            .acquire(remote_key, AcquireOptions::new())
            .await
            .unwrap();
        if guard.mode() == LockMode::Remote {
            break guard;
        }
        guard.release().await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let shard = rig.cluster.shard(0);
    // Reconciliation's acquire of the local key waits behind the competitor, in a wait that
    // begins after the remote lease was granted: one that began before may be about to end
    // (the remote acquire itself may have queued behind it), and reconciliation's next try
    // comes a moment after, while no wait runs.
    let begun = shard.lock_waits_begun().await.unwrap();
    while shard.lock_waits_begun().await.unwrap() == begun
        || shard.lock_waits_now().await.unwrap() == 0
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ... and the remote lease is renewed before that wait ends.
    let before = remote.held_until();
    while remote.held_until() <= before {
        assert!(
            remote.is_held(),
            "the remote lease ended unrenewed while reconciliation waited"
        );
        assert_eq!(
            shard.lock_waits_now().await.unwrap(),
            1,
            "the remote lease was not renewed while reconciliation waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(remote.is_held());
    // Nor does a caller's acquire of the shard wait behind it: reconciliation sends its
    // statements on connections of its own, not through the lane callers' acquires queue in.
    let third = router
        .acquire(&keys[2], AcquireOptions::new())
        .await
        .expect("an acquire queued behind reconciliation's wait");
    assert_eq!(third.mode(), LockMode::Remote);
    third.release().await.unwrap();
    let reconciled = router.stats().reconciled;
    assert_eq!(reconciled, 0, "reconciled through a locked row");

    // Once the competitor lets go, the local lease is taken on the shard after all.
    competitor.end().await.unwrap();
    let r = router.clone();
    assert!(
        common::eventually(Duration::from_secs(20), || {
            let done = r.stats().reconciled == 1;
            async move { done }
        })
        .await,
        "the local lease was never reconciled"
    );
    assert!(local.is_held() && remote.is_held());
    local.release().await.unwrap();
    remote.release().await.unwrap();
}

/// A lease held in process, whose `lost()` is awaited from before its shard returns:
/// reconciliation places it on the shard, where it has a deadline again. If the keeper cannot
/// renew it by then (it waits on another lease's row), `lost()` reports it at that deadline,
/// not once the keeper is free again (it does not sleep on toward the in-process lease's
/// endless one).
#[tokio::test(flavor = "multi_thread")]
async fn a_reconciled_lease_is_reported_lost_at_its_new_deadline_while_the_keeper_waits() {
    let rig = Rig::start("local", None, POOL).await;
    // Statements wait on locked rows here for seconds: neither a failure nor a slow call.
    let yaml = rig
        .yaml
        .replacen("statement-timeout: 1s", "statement-timeout: 30s", 1)
        .replacen("slow-call: 200ms", "slow-call: 30s", 1);
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let keys = rig.keys("k", 2, false);
    let (local_key, remote_key) = (&keys[0], &keys[1]);
    let shard = rig.cluster.shard(0);
    // The local key's row exists on the shard (released), so a transaction can lock it.
    let once = router
        .acquire(local_key, AcquireOptions::new())
        .await
        .unwrap();
    let mut holds_local_row = Competitor::begin(shard, false).await.unwrap();
    let local_row = holds_local_row.key_of(once.owner()).await.unwrap().unwrap();
    once.release().await.unwrap();
    // A remote lease, renewed every 5 s, whose renewal will wait on its row.
    let remote = router
        .acquire(
            remote_key,
            AcquireOptions::new().ttl(Duration::from_secs(15)),
        )
        .await
        .unwrap();
    let mut holds_remote_row = Competitor::begin(shard, false).await.unwrap();
    let remote_row = holds_remote_row
        .key_of(remote.owner())
        .await
        .unwrap()
        .unwrap();

    rig.proxy.set(ProxyMode::Reset);
    while router.breaker_state("s1") != Some(BreakerState::Open) {
        let _ = router.try_acquire("other", AcquireOptions::new()).await;
    }
    let local = router
        .acquire(local_key, AcquireOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    assert_eq!(local.mode(), LockMode::LocalFallback);
    let mut lost = Box::pin(local.lost());
    assert!(futures_util::poll!(lost.as_mut()).is_pending());
    holds_local_row.lock(&local_row).await.unwrap();
    holds_remote_row.lock(&remote_row).await.unwrap();
    rig.proxy.set(ProxyMode::Pass);
    // Reconciliation's acquire of the local key and the keeper's renewal of the remote lease
    // both wait on their rows.
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            shard.lock_waits_now().await.unwrap() >= 2
        })
        .await,
        "reconciliation and renewal never both waited"
    );
    let before = router.stats();

    // Reconciliation goes through; the keeper still waits.
    holds_local_row.end().await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), lost)
        .await
        .expect("the reconciled lease was never reported lost");
    let after = router.stats();
    assert_eq!(after.reconciled, before.reconciled + 1);
    assert_eq!(
        (after.renew_ticks, after.renew_failures),
        (before.renew_ticks, before.renew_failures),
        "the reconciled lease was reported lost only once the keeper's renewal had ended"
    );
    assert!(!local.is_held());
    assert!(matches!(local.release().await, Err(Error::LockLost { .. })));

    // Once its row is let go, the remote lease's renewal goes through.
    holds_remote_row.end().await.unwrap();
    common::renewed(&remote, "the remote lease was lost").await;
    remote.release().await.unwrap();
}

/// Re-acquiring a local hold on its returning shard may write the row and lose the reply. The
/// holder that then releases while its lease is still local gives that row back, instead of
/// leaving the key taken, by nobody, for the lease's whole ttl.
#[tokio::test(flavor = "multi_thread")]
async fn a_reacquire_whose_reply_was_lost_is_given_back_when_the_local_holder_releases() {
    let rig = Rig::start("local", None, POOL).await;
    let mut keys = rig.keys("k", 2, false);
    let (key, probe) = (keys.remove(0), keys.remove(0));
    cut_off(&rig, &probe).await;
    let guard = rig
        .router
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(guard.mode(), LockMode::LocalFallback);
    let other = direct_router(&rig).await;

    // The re-acquire's statement names the holder's owner: its reply is lost, and then the
    // link is cut, so that its retry on another connection gets no answer either and the
    // breaker opens again.
    let owner: &'static [u8] = Box::leak(guard.owner().as_bytes().to_vec().into_boxed_slice());
    let opened = rig.router.stats().breaker_opened;
    rig.proxy.set(ProxyMode::LoseReplyToThenBlackhole(owner));
    rig.proxy.wait_for(ProxyMode::Blackhole).await;
    let failed = common::eventually(Duration::from_secs(20), || async {
        rig.router.stats().breaker_opened > opened
    })
    .await;
    assert!(failed, "the re-acquire never failed");
    let (_, row) = other.inspect(&key).await.unwrap();
    let row = row.expect("the re-acquire wrote the row");
    assert_eq!(row.owner.as_deref(), Some(guard.owner()));
    assert_eq!(rig.router.stats().reconciled, 0, "{:?}", rig.router.stats());
    guard.release().await.unwrap();

    // Once the shard is back for this process (its probes pass), the row is given back: well
    // before the 60 s ttl.
    rig.proxy.set(ProxyMode::Pass);
    let freed = common::eventually(Duration::from_secs(20), || async {
        if let Ok(Some(g)) = rig.router.try_acquire(&probe, AcquireOptions::new()).await {
            let _ = g.release().await;
        }
        match other.try_acquire(&key, AcquireOptions::new()).await {
            Ok(Some(g)) => g.release().await.is_ok(),
            _ => false,
        }
    })
    .await;
    assert!(freed, "the row the re-acquire wrote was left to its ttl");
}

/// The `local` policy grants in process only while the breaker is open. Half-open, its probe
/// under way, the shard is likely back, and another process may hold the key there: a caller
/// the breaker turns away then waits within its wait (or hears `Unavailable`), never a
/// `LocalFallback` guard.
#[tokio::test(flavor = "multi_thread")]
async fn a_half_open_breaker_grants_nothing_in_process() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    // No heartbeat, no lease: the test's own acquires are the only calls, so its probe is the
    // one the breaker lets through; a probe held up behind a row lock is not a slow call. Two
    // acquire batches in flight: the next acquire is sent beside the probe (with one, it would
    // queue behind it).
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 30s\n    \
         pool: {{ max-size: 16, batches-in-flight: 2 }}\n\
         breaker:\n  consecutive-failures: 3\n  cooldown: 300ms\n  max-cooldown: 1s\n  \
         slow-call: 60s\n  probes: 1\ncleaner:\n  registry: static\n\
         namespaces:\n  default:\n    ttl: 30s\n    wait: 500ms\n    on-shard-failure: local\n",
        proxy.url()
    );
    let other = LockRouter::from_yaml_str(&cluster.config_yaml("cleaner:\n  registry: static\n"))
        .await
        .unwrap();
    other.migrate().await.unwrap();
    let remote = other.acquire("k", AcquireOptions::new()).await.unwrap();

    // Cut off from its start: every call fails as it connects, so none may have reached the
    // server and none is given back in the background (such a give-back could be the probe).
    proxy.set(ProxyMode::Reset);
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    cut_off_from(&router, &proxy, "other").await;
    proxy.set(ProxyMode::Pass);
    let half_open = common::eventually(Duration::from_secs(30), || async {
        router.breaker_state("s1") == Some(BreakerState::HalfOpen)
    })
    .await;
    assert!(half_open, "the breaker never cooled down");
    // The probe: an acquire held up behind a row lock of the lease table.
    let blocker = common::row_locked(cluster.shard(0), "shardlock_lease", "probe").await;
    let probe = tokio::spawn({
        let router = router.clone();
        async move {
            let opts = AcquireOptions::new().wait(Duration::from_secs(60));
            router.acquire("probe", opts).await
        }
    });
    common::until_a_row_lock_is_waited_for(cluster.shard(0)).await;
    assert_eq!(router.breaker_state("s1"), Some(BreakerState::HalfOpen));

    let tried = router
        .try_acquire("k", AcquireOptions::new().wait(Duration::ZERO))
        .await;
    match tried {
        Err(Error::Unavailable { .. }) => {}
        Ok(Some(guard)) => panic!(
            "granted {:?} while the breaker was half-open and another process held the key",
            guard.mode()
        ),
        other => panic!("{other:?}"),
    }

    drop(blocker);
    let probe = probe.await.unwrap().unwrap();
    assert_eq!(probe.mode(), LockMode::Remote);
    assert_eq!(router.breaker_state("s1"), Some(BreakerState::Closed));
    probe.release().await.unwrap();
    remote.release().await.unwrap();
}

/// A row that a release keeps taken until its `lock_at_least` ends (a schedule's interval) is
/// no stale row of a lost lease: reconciling a key held in process meanwhile leaves it taken
/// and reports the conflict to the local holder.
#[tokio::test(flavor = "multi_thread")]
async fn reconciling_leaves_a_row_kept_for_its_minimum_hold_taken() {
    a_reconcile_leaves_a_row_kept_for_its_minimum_hold(false).await;
}

/// The same row when its release failed (the shard was cut off as the hold's work ended, as
/// a scheduled run's may be): it keeps its ttl and looks like a lost lease's row, yet it is
/// kept for its minimum hold, so a reconcile of the key held in process meanwhile leaves it.
#[tokio::test(flavor = "multi_thread")]
async fn reconciling_leaves_a_row_kept_for_its_minimum_hold_whose_release_failed() {
    a_reconcile_leaves_a_row_kept_for_its_minimum_hold(true).await;
}

/// A hold kept for two minutes after its grant, released before the router is cut off from its
/// shard (or after, `release_fails`); the key is then held in process, and the shard comes back.
async fn a_reconcile_leaves_a_row_kept_for_its_minimum_hold(release_fails: bool) {
    let rig = Rig::start("local", None, POOL).await;
    let key = rig.keys("k", 1, false).remove(0);
    let at_least = AcquireOptions::new().lock_at_least(Duration::from_secs(120));
    let finished = rig.router.acquire(&key, at_least).await.unwrap();
    let owner = finished.owner().to_owned();
    if release_fails {
        cut_off(&rig, "other").await;
        finished
            .release()
            .await
            .expect_err("the release reached a shard behind an open breaker");
    } else {
        finished.release().await.unwrap();
        cut_off(&rig, "other").await;
    }

    let local = in_process(&rig, &key).await;
    rig.proxy.set(ProxyMode::Pass);
    tokio::time::timeout(Duration::from_secs(30), local.lost())
        .await
        .expect("the reconcile gave back a row kept for its minimum hold as a lost lease's");
    assert_eq!(rig.router.stats().reconcile_conflicts, 1);
    let direct = direct_router(&rig).await;
    let (_, row) = direct.inspect(&key).await.unwrap();
    assert_eq!(
        row.and_then(|r| r.owner).as_deref(),
        Some(owner.as_str()),
        "the row kept for its minimum hold was given back"
    );
}

/// Transaction locks of a process waiting for a row that another process holds take no more
/// than their share of the shard's pool: the process's lease statements still get a
/// connection, so no wait of theirs for the pool counts against a shard that answers, its
/// breaker stays closed, and no key that another process holds there is granted in process.
#[tokio::test(flavor = "multi_thread")]
async fn transaction_locks_waiting_for_their_row_leave_connections_to_the_leases() {
    let pool =
        "{ max-size: 4, wait-timeout: 300ms, create-timeout: 400ms, recycle-timeout: 400ms }";
    let rig = Rig::start("local", None, pool).await;
    let keys = rig.keys("k", 2, false);
    let (leased, locked) = (keys[0].clone(), keys[1].clone());
    let other = direct_router(&rig).await;
    let held = other
        .acquire(&leased, AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    let tx = other
        .lock_in_transaction(&locked, Duration::from_secs(10))
        .await
        .unwrap();
    // Three of them wait for the row on the shard (the fourth for a connection of the three
    // that transaction locks may use).
    let waiters = common::tx_lock_waiters(&rig.router, &locked, 4, rig.cluster.shard(0), 3).await;

    let tried = rig
        .router
        .acquire(&leased, AcquireOptions::new().wait(Duration::from_secs(2)))
        .await;
    assert!(
        matches!(tried, Err(Error::Timeout { .. })),
        "a key held on a shard that answers was not busy: {:?}",
        tried.as_ref().map(|g| g.mode())
    );
    assert_eq!(rig.router.breaker_state("s1"), Some(BreakerState::Closed));
    assert_eq!(rig.router.stats().breaker_opened, 0);

    tx.rollback().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap().unwrap();
    }
    held.release().await.unwrap();
}
