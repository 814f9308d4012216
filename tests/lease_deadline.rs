//! A holder learns it lost its lease before anyone else can be granted the key, even when the
//! shard's clock runs faster than the holder's (within the configured `clock-drift`).

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;

use shardlock::{AcquireOptions, Config, LockGuard, LockRouter};
use shardlock_testkit::{Cluster, Proxy, ProxyMode};

/// Asserts that `guard` (of `key`) says it lost its lease no later than `other` is granted
/// the key: the lease's end, where `is_held()` turned false, came before the grant's answer
/// (the instant a task woken by `lost()` runs depends on the machine's load), and `lost()`
/// completes.
async fn lost_before_granted(guard: LockGuard, other: &LockRouter, key: &str) {
    let watcher = tokio::spawn(async move {
        guard.lost().await;
        assert!(!guard.is_held(), "lost() completed for a lease still held");
        guard.held_until()
    });
    let granted_at = common::first_grant(other, key).await;
    let ended_at = tokio::time::timeout(Duration::from_secs(60), watcher)
        .await
        .expect("lost() never completed")
        .unwrap();
    assert!(
        ended_at <= granted_at,
        "another process was granted the key {:?} before the holder's lease ended",
        ended_at - granted_at
    );
}

/// One shard whose clock runs 5% fast, and a router over it, migrated.
async fn fast_clock_shard() -> (Cluster, LockRouter) {
    let cluster = Cluster::start_with_clocks(1, &[(0, "+0 x1.05")])
        .await
        .unwrap();
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    other.migrate().await.unwrap();
    (cluster, other)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_is_lost_locally_before_a_fast_shard_clock_frees_it() {
    // The shard's clock runs 5% fast; the holder allows for 6%.
    let (cluster, other) = fast_clock_shard().await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let holder = LockRouter::from_yaml_str(&format!(
        "instance:\n  clock-drift: 0.06\nshards:\n  - name: s1\n    url: {}\n",
        proxy.url()
    ))
    .await
    .unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    // Cut off: no renewal reaches the shard, so the lease ends by the shard's clock.
    proxy.set(ProxyMode::Blackhole);
    lost_before_granted(guard, &other, "k").await;
    proxy.set(ProxyMode::Pass);
}

/// A reload that raises `instance.clock-drift` (the shard's clock found running faster than
/// allowed) applies to the leases held then: their local end comes earlier at once, even for
/// a lease that is never renewed, so the holder still knows it lost the key before the shard
/// gives it to anyone else. Lowered again, it applies to later grants.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_raises_the_clock_drift_ends_the_leases_held_earlier() {
    // The shard's clock runs 5% fast; the holder allows for 1%, then, reloaded, for 8%.
    let (cluster, other) = fast_clock_shard().await;
    let drift = |d: &str| format!("instance:\n  clock-drift: {d}\n{}", cluster.config_yaml(""));
    let holder = LockRouter::from_yaml_str(&drift("0.01")).await.unwrap();
    // Never renewed: it ends by the shard's clock at its ttl.
    let once = AcquireOptions::new()
        .ttl(Duration::from_secs(4))
        .keep_alive(false);
    let guard = holder.acquire("k", once.clone()).await.unwrap();
    let before = guard.held_until();
    holder
        .reload(Config::from_yaml_str(&drift("0.08")).unwrap())
        .await
        .unwrap();
    assert!(
        guard.held_until() < before,
        "the raised drift left the held lease's end where it was"
    );
    lost_before_granted(guard, &other, "k").await;

    // Lowered again, it applies to later grants: 1%, and 1 ms, off the ttl.
    holder
        .reload(Config::from_yaml_str(&drift("0.01")).unwrap())
        .await
        .unwrap();
    let before = tokio::time::Instant::now();
    let later = holder.acquire("later", once).await.unwrap();
    assert!(
        later.held_until() >= before + Duration::from_millis(3_950),
        "a grant after the drift was lowered ends {:?} after it was asked for",
        later.held_until() - before
    );
    later.release().await.unwrap();
}

/// A reload that raises `instance.clock-drift` shortens the lapse (how long after its latest
/// heartbeat that landed a process stops counting itself live) for the heartbeats already
/// sent too: cut off from its shard since its last heartbeat, the process counts its leases
/// lost by the shorter lapse. By the old one they were held up to half a second after the
/// registry may have counted the process dead.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_raises_the_clock_drift_shortens_the_lapse_of_heartbeats_sent() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    // Lapses (the lesser of (timeout + interval) / 2 and timeout / (1 + drift) − interval /
    // 2): 20.5 s with a drift of 1%, 14.5 s with 50%; the reload comes between them, with
    // three seconds to spare on either side (a reload held up on a busy machine).
    let yaml = |drift: &str| {
        format!(
            "instance:\n  clock-drift: {drift}\nshards:\n  - name: s1\n    url: {}\n    \
             statement-timeout: 500ms\ncleaner:\n  heartbeat-interval: 11s\n  \
             heartbeat-timeout: 30s\n",
            proxy.url()
        )
    };
    let holder = LockRouter::from_yaml_str(&yaml("0.01")).await.unwrap();
    holder.migrate().await.unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    // A heartbeat lands (as migrate's does), then none.
    holder.migrate().await.unwrap();
    // Refused at once, the heartbeats after it hold up no reload.
    proxy.set(ProxyMode::Reset);
    let cut = tokio::time::Instant::now();
    tokio::time::sleep_until(cut + Duration::from_millis(17_500)).await;
    assert!(
        guard.is_held(),
        "lost by the old lapse before the reload: the test shows nothing"
    );
    holder
        .reload(Config::from_yaml_str(&yaml("0.5")).unwrap())
        .await
        .unwrap();
    assert!(
        cut.elapsed() < Duration::from_millis(20_500),
        "the reload ended past the old lapse: the test shows nothing"
    );
    assert!(
        !guard.is_held(),
        "a lease was held {:?} after its process's last heartbeat, past the lapse of the \
         drift in force",
        cut.elapsed()
    );
    proxy.set(ProxyMode::Pass);
}

/// A grant whose answer came after a reload raised `instance.clock-drift` is judged late by
/// the drift in force, by which its lease is placed: it was judged by the drift of its asking,
/// and its caller handed a guard already lost, instead of the key counted busy and polled again.
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_answered_after_a_reload_raised_the_drift_is_judged_by_it() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = |drift: &str| {
        format!(
            "instance:\n  clock-drift: {drift}\nshards:\n  - name: s1\n    url: {}\n    \
             statement-timeout: 60s\ncleaner:\n  registry: static\n",
            proxy.url()
        )
    };
    let holder = LockRouter::from_yaml_str(&yaml("0.01")).await.unwrap();
    holder.migrate().await.unwrap();
    // A 20 s lease ends 19.8 s after its asking by a drift of 1%, 10 s by 50%. Its statement
    // waits on the link until the reload is in force and 12 s have passed since it was sent.
    proxy.set(ProxyMode::PauseTo(b"drifting-key"));
    let acquiring = tokio::spawn({
        let holder = holder.clone();
        let opts = AcquireOptions::new()
            .ttl(Duration::from_secs(20))
            .wait(Duration::from_secs(60));
        async move { holder.acquire("drifting-key", opts).await }
    });
    tokio::time::timeout(Duration::from_secs(60), proxy.wait_for(ProxyMode::Paused))
        .await
        .expect("the acquire's statement never reached the link");
    let asked = tokio::time::Instant::now();
    holder
        .reload(Config::from_yaml_str(&yaml("0.5")).unwrap())
        .await
        .unwrap();
    tokio::time::sleep_until(asked + Duration::from_secs(12)).await;
    proxy.set(ProxyMode::Pass);
    let guard = acquiring.await.unwrap().unwrap();
    assert!(
        guard.is_held(),
        "a grant answered 12s after its asking, past its lease's end by the drift in force, \
         was handed over already lost"
    );
    guard.release().await.unwrap();
}

/// A process whose clocks stood still while its shards' ran on (a frozen virtual machine, a
/// process restored from a checkpoint: its heartbeats stopped, and its own clocks saw no time
/// pass) finds at its next heartbeat that its registry row went unbeaten for longer than its
/// lapse by the shard's clock: the others may have counted it dead, ended moves it never made
/// and granted its keys elsewhere. Its leases are lost and it grants nothing until it has
/// joined again. (The freeze is pretended: the row is aged as the fleet sees a frozen
/// process's.) Its clocks saw nothing, and it held its keys on and granted.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_whose_clocks_stood_still_finds_its_silence_by_the_shards_clock() {
    let (cluster, holder, _) = common::start(1, "").await;
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    age_a_minute(&cluster, &holder).await;
    lost_to_its_silence(&holder, &guard).await;
}

/// Ages `holder`'s registry row on the first shard by a minute, as the fleet sees a process
/// frozen that long.
async fn age_a_minute(cluster: &Cluster, holder: &LockRouter) {
    age_by(cluster, holder, Duration::from_secs(60)).await;
}

/// Ages `holder`'s registry row on the first shard by `by`.
async fn age_by(cluster: &Cluster, holder: &LockRouter, by: Duration) {
    (cluster.shard(0).connect().await.unwrap())
        .exec_drop(
            "UPDATE shardlock_instance SET heartbeat_at = heartbeat_at - INTERVAL ? SECOND \
             WHERE instance_id = ?",
            (by.as_secs(), holder.instance_id()),
        )
        .await
        .unwrap();
}

/// `guard` of `holder` is lost for its process's silence (the fleet counted it dead), and
/// `holder`, joined again, grants again.
async fn lost_to_its_silence(holder: &LockRouter, guard: &LockGuard) {
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("a lease of a process the fleet counted dead was never lost");
    assert!(!guard.is_held());
    assert!(holder.stats().heartbeat_lapses >= 1);
    let again = holder
        .acquire("other", AcquireOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    again.release().await.unwrap();
}

/// As above, with the reply to the heartbeat that finds the silence lost: the heartbeat is
/// sent again once its connection broke, after the first try acted. The silence found is
/// left in the row, as the fleet sees it, so the try sent again finds it too (and the
/// heartbeat after it moves the row on). Before, the first try moved the row on and the one
/// sent again found a row beaten a moment ago.
#[tokio::test(flavor = "multi_thread")]
async fn a_silence_found_by_a_heartbeat_whose_reply_was_lost_is_found_all_the_same() {
    let fleet = b"frozen-fleet-7";
    let (cluster, proxy, holder, guard) = holding_behind_a_proxy(fleet).await;
    reply_lost_to_the_heartbeat_after(&cluster, &proxy, &holder, fleet, age_a_minute).await;
    lost_to_its_silence(&holder, &guard).await;
}

/// As above, with the row no longer the process's own: while it stood still, another start
/// under its instance id took the row over and shut down (or a cleaner forgot the row). The
/// heartbeat that takes the row back has its reply lost, and the try sent again finds the row
/// its own: that row was written silent, as the fleet had seen it, so the try finds the
/// silence. Before, it found a row beaten a moment ago, and the process held and granted on.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_given_up_by_a_twin_and_taken_back_by_a_heartbeat_whose_reply_was_lost_is_seen() {
    let fleet = b"given-up-fleet-8";
    let (cluster, proxy, holder, guard) = holding_behind_a_proxy(fleet).await;
    reply_lost_to_the_heartbeat_after(&cluster, &proxy, &holder, fleet, given_up_by_a_twin).await;
    lost_to_its_silence(&holder, &guard).await;
}

/// Makes `holder`'s registry row on the first shard another start's, shut down.
async fn given_up_by_a_twin(cluster: &Cluster, holder: &LockRouter) {
    (cluster.shard(0).connect().await.unwrap())
        .exec_drop(
            "UPDATE shardlock_instance SET nonce = 'a-twin', deregistered_at = NOW(3) \
             WHERE instance_id = ?",
            (holder.instance_id(),),
        )
        .await
        .unwrap();
}

/// A router on one shard behind a proxy, in a fleet named `fleet` (a name no other request
/// carries), holding a lease of a minute on "k".
async fn holding_behind_a_proxy(fleet: &[u8]) -> (Cluster, Proxy, LockRouter, LockGuard) {
    let fleet = std::str::from_utf8(fleet).unwrap();
    let yaml = |proxy: &Proxy| {
        format!(
            "shards:\n  - name: s1\n    url: {}\ninstance:\n  fleet: {fleet}\n",
            proxy.url()
        )
    };
    held_behind_a_proxy(yaml, Duration::from_secs(60)).await
}

/// A router made from `yaml` (given the proxy in front of the one shard), migrated, holding a
/// lease on "k" for `ttl`.
async fn held_behind_a_proxy(
    yaml: impl FnOnce(&Proxy) -> String,
    ttl: Duration,
) -> (Cluster, Proxy, LockRouter, LockGuard) {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let holder = LockRouter::from_yaml_str(&yaml(&proxy)).await.unwrap();
    holder.migrate().await.unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(ttl))
        .await
        .unwrap();
    (cluster, proxy, holder, guard)
}

/// Right after a heartbeat of `holder` landed (none is on its way), `change` is made to its
/// registry row and the reply to the next heartbeat is lost: the first request that carries
/// the fleet's name (every heartbeat does, and so do the placement record's statements, done
/// once the router has recorded).
async fn reply_lost_to_the_heartbeat_after<'a, F: std::future::Future<Output = ()>>(
    cluster: &'a Cluster,
    proxy: &Proxy,
    holder: &'a LockRouter,
    fleet: &'static [u8],
    change: impl FnOnce(&'a Cluster, &'a LockRouter) -> F,
) {
    common::until_router_recorded(holder).await;
    just_beaten(cluster, holder).await;
    change(cluster, holder).await;
    proxy.set(ProxyMode::LoseReplyTo(fleet));
    assert_eq!(
        holder.stats().heartbeat_lapses,
        0,
        "a lapse before the reply was lost"
    );
    tokio::time::timeout(Duration::from_secs(30), proxy.wait_for(ProxyMode::Pass))
        .await
        .expect("no heartbeat's reply was lost");
}

/// Waits until a heartbeat of `holder` has just landed on the first shard: none is on its way.
async fn just_beaten(cluster: &Cluster, holder: &LockRouter) {
    let landed = common::eventually(Duration::from_secs(60), || {
        let id = holder.instance_id();
        async move {
            let age: Option<i64> = (cluster.shard(0).connect().await.unwrap())
                .exec_first(
                    "SELECT TIMESTAMPDIFF(MICROSECOND, heartbeat_at, NOW(3)) DIV 1000 \
                     FROM shardlock_instance WHERE instance_id = ?",
                    (id,),
                )
                .await
                .unwrap();
            age.is_some_and(|ms| ms < 250)
        }
    })
    .await;
    assert!(landed, "no heartbeat landed");
}

/// As above, with a reload between the freeze and the heartbeat that finds it: the reload
/// changed the shard's settings (not which database it reaches), so the shard's state was
/// rebuilt, and the rebuilt state's first heartbeat judges as the old one's would have.
/// Before, it judged nothing (it knew of no heartbeat landed there) and moved the silence on.
#[tokio::test(flavor = "multi_thread")]
async fn a_silence_is_found_by_the_first_heartbeat_of_a_shard_a_reload_rebuilt() {
    let cluster = Cluster::start(1).await.unwrap();
    // Heartbeats far apart: none comes between the aging and the reload.
    let config = |timeout: &str| {
        Config::from_yaml_str(&cluster.config_yaml(&format!(
            "    statement-timeout: {timeout}\ncleaner:\n  heartbeat-interval: 15s\n  \
             heartbeat-timeout: 60s\n"
        )))
        .unwrap()
    };
    let holder = LockRouter::new(config("5s")).await.unwrap();
    holder.migrate().await.unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    common::until_router_recorded(&holder).await;
    just_beaten(&cluster, &holder).await;
    age_a_minute(&cluster, &holder).await;
    assert_eq!(
        holder.stats().heartbeat_lapses,
        0,
        "a lapse before the reload"
    );
    holder.reload(config("6s")).await.unwrap();
    lost_to_its_silence(&holder, &guard).await;
}

/// As above, found by the last heartbeat of a reload's move on a shard that stays current (a
/// reload that adds a shard): the move does not end, and the process lapses at once. Before,
/// that heartbeat only failed the move, and the process held and granted on until its next
/// heartbeat (here a minute later, after the test's wait).
#[tokio::test(flavor = "multi_thread")]
async fn a_silence_found_by_the_last_heartbeat_of_a_move_is_a_lapse_at_once() {
    let cluster = Cluster::start(2).await.unwrap();
    let yaml = |n: usize| {
        let mut yaml = String::from("shards:\n");
        for s in &cluster.shards()[..n] {
            yaml.push_str(&format!("  - name: {}\n    url: {}\n", s.name(), s.url()));
        }
        yaml + "routing:\n  move-window: 10s\ncleaner:\n  heartbeat-interval: 60s\n  \
                heartbeat-timeout: 120s\n"
    };
    common::migrate_only(&yaml(2)).await;
    let holder = LockRouter::from_yaml_str(&yaml(1)).await.unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    common::until_router_recorded(&holder).await;
    holder
        .reload(Config::from_yaml_str(&yaml(2)).unwrap())
        .await
        .unwrap();
    // The reload's heartbeat advertises the move; then the freeze, before the window ends.
    let advertised = common::eventually(Duration::from_secs(30), || {
        let (cluster, id) = (&cluster, holder.instance_id());
        async move {
            let moving: Option<bool> = (cluster.shard(0).connect().await.unwrap())
                .exec_first(
                    "SELECT moving <> 0 FROM shardlock_instance WHERE instance_id = ?",
                    (id,),
                )
                .await
                .unwrap();
            moving == Some(true)
        }
    })
    .await;
    assert!(advertised, "the reload's heartbeat never landed");
    age_by(&cluster, &holder, Duration::from_secs(600)).await;
    assert_eq!(
        holder.stats().heartbeat_lapses,
        0,
        "a lapse before the freeze"
    );
    assert_eq!(
        holder.moves_in_progress(),
        1,
        "the move ended before the freeze"
    );
    lost_to_its_silence(&holder, &guard).await;
}

/// A shard out of reach for longer than the lapse, while the others took every heartbeat,
/// finds this process's row there silent that long once it is back: that is no lapse (the
/// process knew its heartbeats missed that shard), and the leases on the other shards stay
/// held.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_left_silent_by_a_shard_out_of_reach_is_no_lapse() {
    let cluster = Cluster::start(2).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    // A lapse of 4.25 s: (interval + timeout) / 2. (Shorter, one slow round of heartbeats
    // on a busy machine was a lapse of its own.)
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 500ms\n  - name: s2\n    \
         url: {}\ncleaner:\n  heartbeat-interval: 500ms\n  heartbeat-timeout: 8s\n",
        proxy.url(),
        cluster.shard(1).url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let key = common::key_on(&router, "held", "s2");
    let guard = router
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    proxy.set(ProxyMode::Reset);
    let failures = router.stats().heartbeat_failures;
    // Out of reach for well over the lapse: twelve heartbeats (6 s) miss it.
    let missed = common::eventually(Duration::from_secs(60), || async {
        router.stats().heartbeat_failures >= failures + 12
    })
    .await;
    assert!(missed, "the heartbeats never missed the shard");
    proxy.set(ProxyMode::Pass);
    // The row's age by the shard's clock, in ms.
    let age = || async {
        let age: Option<i64> = (cluster.shard(0).connect().await.unwrap())
            .exec_first(
                "SELECT TIMESTAMPDIFF(MICROSECOND, heartbeat_at, NOW(3)) DIV 1000 \
                 FROM shardlock_instance WHERE instance_id = ?",
                (router.instance_id(),),
            )
            .await
            .unwrap();
        age.unwrap_or(i64::MAX)
    };
    // A heartbeat lands, then the next one: the first one's answer was dealt with by then.
    let limit = Duration::from_secs(30);
    let fresh = common::eventually(limit, || async { age().await < 250 }).await
        && common::eventually(limit, || async { age().await >= 250 }).await
        && common::eventually(limit, || async { age().await < 250 }).await;
    assert!(fresh, "no heartbeats reached the shard once it was back");
    assert_eq!(
        router.stats().heartbeat_lapses,
        0,
        "a row left silent by a shard out of reach was taken for a lapse"
    );
    assert!(guard.is_held());
    guard.release().await.unwrap();
}

/// The runtime's clock stands still while the host is suspended; the shard's does not, so a
/// lease may have ended on its shard, and the key gone to someone else, before its holder's
/// process runs again. The holder counts the suspend (the lease clock) the moment it runs: its
/// guard says the lease is no longer held, `lost()` completes without waiting for a renewal to
/// fail, and the router, whose heartbeat may have counted as dead meanwhile, grants again only
/// once it has joined its fleet anew. (The suspend is pretended: the lease clock moves on by a
/// minute while the runtime's clock and the shard's do not; it is process-wide, and the test
/// runner, nextest, runs each test in a process of its own.)
#[tokio::test(flavor = "multi_thread")]
async fn a_suspend_of_the_host_ends_its_leases_by_the_time_it_wakes() {
    let (cluster, holder, _) = common::start(1, "").await;
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(3)))
        .await
        .unwrap();
    let fence = guard.fence();
    assert!(guard.is_held());
    assert_eq!(holder.stats().heartbeat_lapses, 0);

    LockRouter::pretend_host_suspended(Duration::from_secs(60));
    assert!(
        !guard.is_held(),
        "a lease of 3 s still held after the host slept a minute"
    );
    assert!(guard.held_until() <= tokio::time::Instant::now());
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("the lease that ended in the suspend was not reported lost");

    // The heartbeat is a minute old by the lease clock: the router lapsed, and joins again
    // before its next grant.
    let again = holder
        .acquire("k2", AcquireOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(holder.stats().heartbeat_lapses, 1);
    again.release().await.unwrap();

    // The lost lease is no longer renewed: the shard frees it by its own clock, and the next
    // holder's fence is higher.
    let other = common::worker_router_from(&cluster).await;
    common::first_grant(&other, "k").await;
    let next = other.acquire("k", AcquireOptions::new()).await.unwrap();
    assert!(next.fence() > fence);
    assert!(!guard.is_held());
    next.release().await.unwrap();
}

/// A reload that lengthens the heartbeat's interval and timeout: the next heartbeat comes later
/// than the old lapse allowed, and a lease held meanwhile stays held, its process counted live
/// for the new timeout once every shard holds it.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_slows_the_heartbeat_keeps_leases_held_between_its_beats() {
    let beats = |interval: &str, timeout: &str| {
        format!("cleaner:\n  heartbeat-interval: {interval}\n  heartbeat-timeout: {timeout}\n")
    };
    let (_cluster, router, yaml) = common::start(1, &beats("100ms", "3s")).await;
    let guard = router
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    let slower = yaml.replace(&beats("100ms", "3s"), &beats("5s", "50s"));
    let slower = shardlock::Config::from_yaml_str(&slower).unwrap();
    router.reload(slower).await.unwrap();

    // The shard holds the new timeout, and the heartbeat it took is older than the old lapse
    // (about 1.5 s): the next one comes five seconds after it. (The old settings leave a
    // heartbeat 1.4 s of delay on a busy machine before the lease would lapse.)
    let past_the_old_lapse = common::eventually(Duration::from_secs(30), || async {
        let shards = router.instances().await;
        let rows = shards.into_iter().flat_map(|(_, rows)| rows.ok()).flatten();
        rows.filter(|r| r.instance_id == router.instance_id())
            .any(|r| {
                r.heartbeat_timeout == Some(Duration::from_secs(50)) && r.heartbeat_ms_ago > 1700
            })
    })
    .await;
    assert!(
        past_the_old_lapse,
        "the slower heartbeat never reached the shard"
    );
    assert!(
        guard.is_held(),
        "the lease was lost between the slower heartbeats"
    );
    guard.release().await.unwrap();
}

/// A process switching to the heartbeat registry is in no registry until a heartbeat of it
/// lands: a process started onto another topology meanwhile finds none of it and takes its
/// keys where that topology puts them. So its leases end at the switch, and a heartbeat
/// landing later does not make them held again.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_held_across_a_switch_to_the_heartbeat_registry_ends_at_the_switch() {
    let cluster = Cluster::start(2).await.unwrap();
    // Another topology than the holder's: both shards, reached directly.
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    other.migrate().await.unwrap();
    let key = common::key_on(&other, "k", "s2");
    // The holder: s1 alone, through a proxy that will cut it off.
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let shards = common::s1_through(&proxy);
    let holder = LockRouter::from_yaml_str(&format!("{shards}cleaner:\n  registry: static\n"))
        .await
        .unwrap();
    let guard = holder
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(300)))
        .await
        .unwrap();
    proxy.set(ProxyMode::Blackhole);
    let heartbeat =
        format!("{shards}cleaner:\n  heartbeat-interval: 500ms\n  heartbeat-timeout: 2s\n");
    holder
        .reload(Config::from_yaml_str(&heartbeat).unwrap())
        .await
        .unwrap();
    assert!(
        !guard.is_held(),
        "the lease outlived the switch to a registry that knows nothing of its process"
    );
    let taken = other
        .try_acquire(&key, AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap()
        .expect("the other topology's start found no live holder and took the key on s2");
    assert_eq!(taken.shard(), "s2");
    assert!(!guard.is_held());
    taken.release().await.unwrap();

    // Once the other topology is gone and the holder's heartbeat lands, it joins its fleet;
    // the lease stays lost. (The other's grant may have had its heartbeat record the fleet's
    // placement, both shards: the holder, which cannot reach s2, would then rightly never
    // join. Its record is deleted, the documented override, whether it was written or not.)
    other.shutdown().await.unwrap();
    for shard in cluster.shards() {
        (shard.connect().await.unwrap())
            .query_drop("DELETE FROM shardlock_placement")
            .await
            .unwrap();
    }
    proxy.set(ProxyMode::Pass);
    tokio::time::timeout(Duration::from_secs(60), holder.wait_joined())
        .await
        .expect("the holder never joined once its heartbeat reached the shard");
    assert!(holder.is_joined());
    assert!(
        !guard.is_held(),
        "a heartbeat that landed after the switch made the lease held again"
    );
}

/// A router with the heartbeat registry (interval 500 ms, timeout 2 s: a lapse of 1.25 s)
/// holding a lease on its one shard, then cut off from it: no heartbeat of it lands any more.
async fn held_then_cut_off() -> (Cluster, Proxy, LockRouter, LockGuard, String) {
    let beats = "cleaner:\n  heartbeat-interval: 500ms\n  heartbeat-timeout: 2s\n";
    let yaml = |proxy: &Proxy| format!("{}{beats}", common::s1_through(proxy));
    let (cluster, proxy, router, guard) = held_behind_a_proxy(yaml, Duration::from_secs(300)).await;
    proxy.set(ProxyMode::Blackhole);
    let shards = common::s1_through(&proxy);
    (cluster, proxy, router, guard, shards)
}

/// A lease that lapsed with nobody looking (no `is_held`, no `lost`) is found lost by a reload
/// onto `registry: static`, which lifts the limit for the leases still held.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_that_lapsed_unwatched_stays_lost_after_a_reload_onto_the_static_registry() {
    let (_cluster, _proxy, router, guard, shards) = held_then_cut_off().await;
    // The heartbeat noticed the lapse (its gate closed), which looks at nothing of the lease.
    let lapsed = common::eventually(Duration::from_secs(60), || async {
        router.stats().heartbeat_lapses > 0
    })
    .await;
    assert!(lapsed, "the cut-off router's heartbeat never lapsed");
    let static_registry = format!("{shards}cleaner:\n  registry: static\n");
    router
        .reload(Config::from_yaml_str(&static_registry).unwrap())
        .await
        .unwrap();
    assert!(
        !guard.is_held(),
        "the reload onto the static registry made a lapsed lease held again"
    );
}

/// `wait_joined` of a router that has not joined its fleet (its heartbeat lapsed while cut
/// off) completes when the router shuts down, which leaves it not joined.
#[tokio::test(flavor = "multi_thread")]
async fn wait_joined_completes_at_shutdown() {
    let (_cluster, _proxy, router, guard, _) = held_then_cut_off().await;
    let lapsed =
        common::eventually(Duration::from_secs(60), || async { !router.is_joined() }).await;
    assert!(lapsed, "the cut-off router's heartbeat never lapsed");
    let waiting = tokio::spawn({
        let router = router.clone();
        async move { router.wait_joined().await }
    });
    drop(guard);
    let _ = router.shutdown().await;
    tokio::time::timeout(Duration::from_secs(60), waiting)
        .await
        .expect("wait_joined outlived the router's shutdown")
        .unwrap();
    assert!(!router.is_joined());
}
