//! Live topology changes: reloads that move keys never let two holders exist, fences keep
//! rising across the move, and a reload that changes only policies moves nothing.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, Config, ListOptions, LockRouter};
use shardlock_testkit::{report, Cluster, Competitor, Proxy, ProxyMode, Worker};

const KEYS: usize = 500;
const TASKS: usize = 32;
const ROUNDS: usize = 50;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";
const PATH_ENV: &str = "SHARDLOCK_TEST_CONFIG_PATH";
const WINDOW: &str = "move-window: 3s";
const LONG_WINDOW: &str = "move-window: 20s";
const POLICY: &str =
    "routing:\n  move-window: 3s\nnamespaces:\n  default:\n    ttl: 1s\n    wait: 30s\n";

/// Waits up to `limit` until one lease of `router` followed its moved key; panics with `what`
/// and the router's stats if none did.
async fn until_followed(router: &LockRouter, limit: Duration, what: &str) {
    let followed = common::eventually(limit, || async { router.stats().followed == 1 }).await;
    assert!(followed, "{what}: {:?}", router.stats());
}

/// The config listing the first `n` shards of the cluster.
fn config_for(cluster: &Cluster, n: usize) -> String {
    let mut yaml = String::from("shards:\n");
    for s in &cluster.shards()[..n] {
        yaml.push_str(&format!("  - name: {}\n    url: {}\n", s.name(), s.url()));
    }
    yaml.push_str(POLICY);
    yaml
}

/// Asserts that `started` grants `key` to nobody, naming `because` as the instance its fleet
/// check waits for.
async fn refused_for(started: &LockRouter, key: &str, because: &LockRouter) {
    match started.try_acquire(key, AcquireOptions::new()).await {
        Err(shardlock::Error::Unavailable { source, .. }) => {
            let why = shardlock::Report(&source).to_string();
            assert!(why.contains(because.instance_id()), "{why}");
        }
        other => panic!(
            "granted or refused otherwise: {:?}",
            other.map(|g| g.is_some())
        ),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_across_grow_and_shrink_never_hold_a_key_twice() {
    let cluster = Cluster::start(4).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("shardlock.yaml");
    // Leases of 3 s, renewed every second: a second's stall of a busy machine loses none (a
    // lost lease fails its round).
    let config_for = |cluster: &Cluster, n| config_for(cluster, n).replace("ttl: 1s", "ttl: 3s");
    std::fs::write(&path, config_for(&cluster, 4)).unwrap();
    // Tables on all four shards before the run starts with three.
    LockRouter::from_yaml_file(&path)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    std::fs::write(&path, config_for(&cluster, 3)).unwrap();

    let app_url = cluster.shard(0).url();
    let mut app = common::counters::create(&app_url, KEYS).await;

    let env = [
        (PATH_ENV, path.display().to_string()),
        (APP_ENV, app_url.clone()),
    ];
    let mut workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "counter", &env).unwrap())
        .collect();
    for w in &mut workers {
        w.expect("ready").await.unwrap();
    }
    let total = 2 * TASKS * ROUNDS;
    // Grow to four shards, shrink to three, twice, each step after a share of the writes.
    for (step, shards) in [4, 3, 4, 3].into_iter().enumerate() {
        let progress = total * (step + 1) / 5;
        let reached = common::eventually(Duration::from_secs(60), || {
            let url = app_url.clone();
            async move {
                let mut c = shardlock::mysql_async::Conn::from_url(url.as_str())
                    .await
                    .unwrap();
                let n: u64 = c
                    .query_first("SELECT COUNT(*) FROM writes")
                    .await
                    .unwrap()
                    .unwrap();
                n as usize >= progress
            }
        })
        .await;
        assert!(reached, "no progress to {progress} writes");
        std::fs::write(&path, config_for(&cluster, shards)).unwrap();
        for w in &workers {
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(w.pid()),
                nix::sys::signal::Signal::SIGHUP,
            )
            .unwrap();
        }
        for w in &mut workers {
            w.expect(&format!("epoch {}", step + 2)).await.unwrap();
        }
    }
    let mut moved = 0u64;
    for w in workers {
        let fields = w.finish_report("done ").await.unwrap();
        assert_eq!(
            fields[0], 5,
            "each worker went through four reloads: {fields:?}"
        );
        moved += fields[1];
    }
    eprintln!("{moved} grants of moved keys also took the key on its previous shard");
    assert!(moved > 0, "keys moved while they were in use");

    common::counters::check(&mut app, total).await;
}

async fn counter_worker() {
    let path = std::env::var(PATH_ENV).unwrap();
    let router = LockRouter::from_yaml_file(&path).await.unwrap();
    let _reloads = router.reload_on_sighup(&path).unwrap();
    // Says when each reload applied: the parent writes the next step's file only then (read
    // by a SIGHUP before, it would make the next one a reload of the config in force, which
    // changes nothing).
    let epochs = router.clone();
    tokio::spawn(async move {
        let mut seen = epochs.epoch();
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            if epochs.epoch() != seen {
                seen = epochs.epoch();
                report!("epoch {seen}");
            }
        }
    });
    let pool = Pool::new(std::env::var(APP_ENV).unwrap().as_str());
    report!("ready");
    common::counters::run(&router, &pool, TASKS, ROUNDS, KEYS, AcquireOptions::new()).await;
    // The last reload may still be on its way.
    let reloaded =
        common::eventually(Duration::from_secs(30), || async { router.epoch() == 5 }).await;
    assert!(reloaded, "epoch {}", router.epoch());
    report!("done {} {}", router.epoch(), router.stats().moved_grants);
    router.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_changes_only_a_ttl_moves_nothing() {
    let extra = format!(
        "{}namespaces:\n  default:\n    ttl: 5s\n",
        common::NO_HEARTBEAT
    );
    let (cluster, router, yaml) = common::start(3, &extra).await;
    let keys: Vec<String> = (0..1000).map(|i| format!("k:{i}")).collect();
    let before: Vec<String> = keys.iter().map(|k| router.shard_for(k).unwrap()).collect();
    let held = router.acquire("k:1", AcquireOptions::new()).await.unwrap();
    common::until_placement_recorded(&cluster).await;

    let changed = yaml.replace("ttl: 5s", "ttl: 7s");
    // The shards listed in another order too: the ring is the same.
    let mut reordered = Config::from_yaml_str(&changed).unwrap();
    reordered.shards.reverse();
    router.reload(reordered).await.unwrap();
    assert_eq!(router.epoch(), 2);
    assert_eq!(
        router.moves_in_progress(),
        0,
        "shards listed in another order moved keys"
    );
    router
        .reload(Config::from_yaml_str(&changed).unwrap())
        .await
        .unwrap();
    assert_eq!(router.epoch(), 3);
    // The same configuration again (a periodic SIGHUP): nothing changes, the epoch included.
    router
        .reload(Config::from_yaml_str(&changed).unwrap())
        .await
        .unwrap();
    assert_eq!(router.epoch(), 3, "a reload of the config in force is none");
    let after: Vec<String> = keys.iter().map(|k| router.shard_for(k).unwrap()).collect();
    assert_eq!(before, after, "no key moved");
    assert!(held.is_held(), "a lease held across the reload stays held");
    // Released before the count: its renewal would be counted.
    held.release().await.unwrap();

    let writes_before =
        common::inserts(&cluster).await + common::status_sum(&cluster, "Com_update").await;
    let g = router.acquire("k:2", AcquireOptions::new()).await.unwrap();
    let writes = common::inserts(&cluster).await + common::status_sum(&cluster, "Com_update").await
        - writes_before;
    assert_eq!(
        writes, 1,
        "one statement: nothing to check on another shard"
    );
    let (_, row) = router.inspect("k:2").await.unwrap();
    assert_eq!(row.unwrap().ttl_ms, 7000, "the new policy applies");
    assert_eq!(router.stats().moved_grants, 0);
    g.release().await.unwrap();

    // An invalid config is rejected with its field; the old one stays in force.
    let mut bad = Config::from_yaml_str(&changed).unwrap();
    bad.shards.clear();
    let err = router.reload(bad).await.unwrap_err();
    assert!(err.to_string().contains("shards"), "{err}");
    assert_eq!(router.epoch(), 3);
}

/// A reload may not change who the process is: its instance id (its owners and registry rows
/// bear the one it started with) nor its fleet (it would grant under the other fleet's
/// topology without having joined it). After `shutdown`, no reload is taken.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_changes_the_instance_is_refused_and_none_is_taken_after_shutdown() {
    let (cluster, router, yaml) = common::start(1, "instance:\n  id: one\n").await;
    for (changed, field) in [
        (yaml.replace("id: one", "id: two"), "instance.id"),
        (
            yaml.replace("id: one", "id: one\n  fleet: other"),
            "instance.fleet",
        ),
    ] {
        let err = router
            .reload(Config::from_yaml_str(&changed).unwrap())
            .await
            .unwrap_err();
        let shardlock::Error::Config(e) = &err else {
            panic!("{err}")
        };
        assert_eq!(e.field.as_deref(), Some(field), "{e}");
    }
    assert_eq!(router.epoch(), 1, "the refused reloads changed nothing");
    // No id and `auto` are the same: one drawn at the start.
    let drawn = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    drawn
        .reload(Config::from_yaml_str(&cluster.config_yaml("instance:\n  id: auto\n")).unwrap())
        .await
        .unwrap();

    router.shutdown().await.unwrap();
    let two = cluster.config_yaml("instance:\n  id: one\nrouting:\n  move-window: 1s\n");
    let err = router
        .reload(Config::from_yaml_str(&two).unwrap())
        .await
        .unwrap_err();
    assert!(matches!(err, shardlock::Error::Shutdown), "{err}");
}

crate::worker_entry! { "counter" => counter_worker() }

#[tokio::test(flavor = "multi_thread")]
async fn a_process_that_reloaded_and_one_that_did_not_exclude_each_other() {
    let cluster = Cluster::start(4).await.unwrap();
    let three = config_for(&cluster, 3);
    let four = Config::from_yaml_str(&config_for(&cluster, 4)).unwrap();
    LockRouter::new(four.clone())
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let stale = LockRouter::from_yaml_str(&three).await.unwrap();
    let fresh = LockRouter::from_yaml_str(&three).await.unwrap();
    fresh.reload(four).await.unwrap();
    let moved = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| stale.shard_for(k).unwrap() != fresh.shard_for(k).unwrap())
        .unwrap();
    let once = || AcquireOptions::new().wait(Duration::ZERO);

    // Held under the old topology: the reloaded process must not get it on the new shard.
    let old = stale.acquire(&moved, once()).await.unwrap();
    assert!(fresh.try_acquire(&moved, once()).await.unwrap().is_none());
    let old_fence = old.fence();
    old.release().await.unwrap();

    // Held by the reloaded process: it holds the old shard too, so the stale one is kept out.
    let new = fresh.acquire(&moved, once()).await.unwrap();
    assert_eq!(new.shard(), fresh.shard_for(&moved).unwrap());
    assert!(new.fence() > old_fence);
    assert!(stale.try_acquire(&moved, once()).await.unwrap().is_none());
    assert_eq!(fresh.stats().moved_grants, 1);
    let new_fence = new.fence();
    new.release().await.unwrap();
    // The process that did not reload still gets a fence above the reloaded one's.
    let again = stale.acquire(&moved, once()).await.unwrap();
    let again_fence = again.fence();
    assert!(again_fence > new_fence, "{again_fence} after {new_fence}");
    again.release().await.unwrap();
    let last = fresh.acquire(&moved, once()).await.unwrap();
    assert!(last.fence() > again_fence);
    last.release().await.unwrap();
}

async fn shard_status(router: &LockRouter, name: &str) -> shardlock::ShardStatus {
    router
        .status()
        .await
        .into_iter()
        .find(|s| s.name == name)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn shards_that_stay_keep_their_pools_and_a_leaving_shard_is_drained() {
    let cluster = Cluster::start(4).await.unwrap();
    // No heartbeat: a reload beats at once, and its connection would blur the pool counts.
    let quiet = |yaml: String| yaml + "cleaner:\n  registry: static\n";
    let four = Config::from_yaml_str(&quiet(config_for(&cluster, 4))).unwrap();
    let router = LockRouter::new(four).await.unwrap();
    router.migrate().await.unwrap();
    let on_s4 = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| router.shard_for(k).unwrap() == "s4")
        .unwrap();
    let held = router.acquire(&on_s4, AcquireOptions::new()).await.unwrap();
    assert!(shard_status(&router, "s1").await.pool.size > 0);
    // The sessions of s1's pool as its server lists them (the count alone moves with the
    // router's background statements, the placement record's among them).
    let sessions = || async {
        let mut c = cluster.shard(0).connect().await.unwrap();
        let ids: Vec<u64> = c
            .query(
                "SELECT ID FROM information_schema.PROCESSLIST \
                 WHERE DB = 'shardlock' AND ID <> CONNECTION_ID()",
            )
            .await
            .unwrap();
        ids.into_iter().collect::<std::collections::HashSet<u64>>()
    };
    let opened = sessions().await;

    let three = quiet(config_for(&cluster, 3)).replace("move-window: 3s", "move-window: 500ms");
    router
        .reload(Config::from_yaml_str(&three).unwrap())
        .await
        .unwrap();
    // The held lease follows its key (to one of the shards that stay) before the counts.
    until_followed(
        &router,
        Duration::from_secs(5),
        "the held lease never followed its key",
    )
    .await;
    let status = router.status().await;
    let now = sessions().await;
    // The pool's connections stay open, but for one its pool discarded meanwhile (a statement
    // given up mid-way, such as the reload's bounded record write on a busy machine).
    assert!(
        opened.difference(&now).count() <= 1,
        "s1 stayed: same pool, same connections ({opened:?} then {now:?})"
    );
    let s4 = status
        .iter()
        .find(|s| s.name == "s4")
        .expect("s4 is still listed");
    assert!(
        !s4.current && !s4.closed,
        "kept while a lease is held there"
    );

    // Past the window, s4's pool stays open while our lease there is held...
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(!shard_status(&router, "s4").await.closed);
    // ...and is closed once it is released.
    held.release().await.unwrap();
    let drained = common::eventually(Duration::from_secs(5), || async {
        shard_status(&router, "s4").await.closed
    })
    .await;
    assert!(drained, "the pool of a shard that left is closed");
}

/// Two routers over four shards with a short move window, a key that lives on s4, and the
/// three-shard config both reload to.
async fn two_routers_and_a_key_on_s4() -> (Cluster, LockRouter, LockRouter, String, Config) {
    let cluster = Cluster::start(4).await.unwrap();
    let short = |yaml: String| yaml.replace("move-window: 3s", "move-window: 500ms");
    let four = short(config_for(&cluster, 4));
    let three = Config::from_yaml_str(&short(config_for(&cluster, 3))).unwrap();
    let a = LockRouter::from_yaml_str(&four).await.unwrap();
    a.migrate().await.unwrap();
    let b = LockRouter::from_yaml_str(&four).await.unwrap();
    let key = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| a.shard_for(k).unwrap() == "s4")
        .unwrap();
    (cluster, a, b, key, three)
}

/// Past any move window: three times the 500 ms these tests configure. (Leases held across
/// it last 3 s, and are seen renewed after it: a busy machine's stall does not end them.)
const PAST_THE_WINDOW: Duration = Duration::from_millis(1500);

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_held_past_the_move_window_is_never_granted_twice() {
    let (_cluster, a, b, key, three) = two_routers_and_a_key_on_s4().await;
    let opts = || {
        AcquireOptions::new()
            .ttl(Duration::from_secs(3))
            .wait(Duration::ZERO)
    };
    let held = a.acquire(&key, opts()).await.unwrap();
    a.reload(three.clone()).await.unwrap();
    b.reload(three).await.unwrap();
    assert!(b.try_acquire(&key, opts()).await.unwrap().is_none());

    // The lease followed its key, and is held (and renewed) for longer than the window.
    until_followed(
        &a,
        Duration::from_secs(30),
        "the lease never followed its key",
    )
    .await;
    // Both moves over: b takes the key where it lives now alone.
    common::moves_done(&a).await;
    common::moves_done(&b).await;
    common::renewed(&held, "a lease renewed past the move window was lost").await;
    assert!(
        b.try_acquire(&key, opts()).await.unwrap().is_none(),
        "granted on {} while a holds it",
        b.shard_for(&key).unwrap()
    );

    let fence = held.fence();
    held.release().await.unwrap();
    let next = b.try_acquire(&key, opts()).await.unwrap().expect("free");
    assert_eq!(next.shard(), b.shard_for(&key).unwrap());
    assert!(next.fence() > fence, "{} after {fence}", next.fence());
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_move_stays_in_force_past_its_window_while_a_process_of_the_fleet_has_not_reloaded() {
    let (_cluster, a, b, key, three) = two_routers_and_a_key_on_s4().await;
    let opts = || {
        AcquireOptions::new()
            .ttl(Duration::from_secs(1))
            .wait(Duration::ZERO)
    };
    a.reload(three.clone()).await.unwrap();
    // b missed the reload, and holds nothing while a's window passes (a lease held across it
    // would keep the move in force by itself): the move is kept past its window.
    let kept = common::eventually(Duration::from_secs(30), || async {
        a.stats().moves_kept > 0 || a.moves_in_progress() == 0
    })
    .await;
    assert!(kept, "the move neither ended nor was kept");
    assert!(a.moves_in_progress() > 0, "b still runs the old topology");
    // b still places the key on s4.
    let held = b.acquire(&key, opts()).await.unwrap();
    assert_eq!(held.shard(), "s4");
    assert!(
        a.try_acquire(&key, opts()).await.unwrap().is_none(),
        "granted on {} while b holds it on s4",
        a.shard_for(&key).unwrap()
    );
    held.release().await.unwrap();

    // Once b reloads too, a's move ends (b's own runs its window from b's reload).
    b.reload(three).await.unwrap();
    let ended = common::eventually(Duration::from_secs(10), || async {
        a.moves_in_progress() == 0
    })
    .await;
    assert!(ended, "a's move ends once no process runs the old topology");
}

#[tokio::test(flavor = "multi_thread")]
async fn waiters_after_a_reload_are_not_handed_a_moved_lease_and_pollers_follow_the_key() {
    let (_cluster, a, b, key, three) = two_routers_and_a_key_on_s4().await;
    let opts = || {
        AcquireOptions::new()
            .ttl(Duration::from_secs(3))
            .wait(Duration::from_secs(20))
    };
    let held = a.acquire(&key, opts()).await.unwrap();
    // One waiter in a's process (in memory, behind the holder), one polling from b.
    let in_memory = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.acquire(&key, opts()).await.unwrap() }
    });
    let polling = tokio::spawn({
        let (b, key) = (b.clone(), key.clone());
        async move { b.acquire(&key, opts()).await.unwrap() }
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        a.stats().queued == 1 && b.stats().acquire_statements >= 1
    })
    .await;
    assert!(queued, "both waiters are waiting");
    let three_again = three.clone();
    a.reload(three.clone()).await.unwrap();
    b.reload(three).await.unwrap();
    common::moves_done(&a).await;
    common::moves_done(&b).await;
    let new_shard = a.shard_for(&key).unwrap();
    held.release().await.unwrap();

    // Whoever gets it next holds it where the key lives now, and the other cannot get it.
    let (mut in_memory, mut polling) = (in_memory, polling);
    let (first, second) = tokio::select! {
        g = &mut in_memory => (g.unwrap(), polling),
        g = &mut polling => (g.unwrap(), in_memory),
    };
    assert_eq!(first.shard(), new_shard, "granted where the key lives now");
    assert!(first.is_held());
    assert!(!second.is_finished());
    // A process that started on the new topology does not get it either (while the others'
    // move is in force it grants nothing at all).
    let fresh = LockRouter::new(three_again).await.unwrap();
    assert!(!matches!(
        fresh
            .try_acquire(&key, AcquireOptions::new().wait(Duration::ZERO))
            .await,
        Ok(Some(_))
    ));
    let fence = first.fence();
    first.release().await.unwrap();
    let last = second.await.unwrap();
    assert_eq!(last.shard(), new_shard);
    assert!(last.fence() > fence);
    last.release().await.unwrap();
}

/// A 500 ms move window, a cleaner with no grace, and a namespace `hot` whose grants reserve
/// a million fences each for in-memory hand-offs (a second of the clock floor).
const RUN_AHEAD: &str = "routing:\n  move-window: 500ms\ncleaner:\n  grace: 0s\nnamespaces:\n  \
     default:\n    ttl: 5s\n  hot:\n    ttl: 5s\n    handoff-max-count: 1000000\n";

/// A config listing the shards of `cluster` named in `names`, each with `per_shard` lines,
/// then `tail`.
fn shards_named(cluster: &Cluster, names: &[&str], per_shard: &str, tail: &str) -> Config {
    let mut yaml = String::from("shards:\n");
    for s in cluster
        .shards()
        .iter()
        .filter(|s| names.contains(&s.name()))
    {
        yaml.push_str(&format!(
            "  - name: {}\n    url: {}\n{per_shard}",
            s.name(),
            s.url()
        ));
    }
    Config::from_yaml_str(&(yaml + tail)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn fences_rise_across_a_move_whatever_the_clocks_and_the_run_ahead() {
    // s4's clock is a minute ahead of the others': its fences are clock-floored a minute
    // "later" than the shard its keys move to.
    let cluster = Cluster::start_with_clocks(4, &[(3, "+60s")]).await.unwrap();
    let listing = |names: &[&str]| shards_named(&cluster, names, "", RUN_AHEAD);
    let cluster = &cluster;
    let clock = |i: usize| async move {
        let mut c = cluster.shard(i).connect().await.unwrap();
        let us: Option<u64> = c
            .query_first("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)")
            .await
            .unwrap();
        us.unwrap()
    };
    let skew = clock(3).await.saturating_sub(clock(0).await);
    assert!(skew > 50_000_000, "s4 runs a minute ahead: {skew} us");
    let before = listing(&["s1", "s2", "s4"]);
    let after = listing(&["s1", "s2", "s3"]);
    LockRouter::new(listing(&["s1", "s2", "s3", "s4"]))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let router = LockRouter::new(before).await.unwrap();
    let probe = LockRouter::new(after.clone()).await.unwrap();
    let moved = |from: &str| {
        (0..)
            .map(|i| format!("k:{i}"))
            .find(|k| router.shard_for(k).unwrap() == from && probe.shard_for(k).unwrap() != from)
            .unwrap()
    };
    // A key on the fast-clock shard, and one whose fences ran ahead of its shard's clock: each
    // grant reserves a million fences (a second of the clock floor) for in-memory hand-offs.
    let (ahead, ran_ahead) = (moved("s4"), moved("s1"));
    let mut highest = std::collections::HashMap::new();
    // And a key of the fast-clock shard whose row the cleaner deleted before the move: no row
    // to carry, only the shard's clock floored its fences.
    let deleted = (0..)
        .map(|i| format!("gone:{i}"))
        .find(|k| router.shard_for(k).unwrap() == "s4" && probe.shard_for(k).unwrap() != "s4")
        .unwrap();
    let g = router
        .acquire(&deleted, AcquireOptions::new())
        .await
        .unwrap();
    highest.insert(deleted.clone(), g.fence());
    g.release().await.unwrap();
    let cleaned = common::eventually(Duration::from_secs(30), || async {
        common::clean_pass(&router).await;
        router.inspect(&deleted).await.unwrap().1.is_none()
    })
    .await;
    assert!(cleaned, "the cleaner deleted the released row");
    let g = router.acquire(&ahead, AcquireOptions::new()).await.unwrap();
    highest.insert(ahead.clone(), g.fence());
    g.release().await.unwrap();
    for _ in 0..20 {
        let g = router
            .acquire(&ran_ahead, AcquireOptions::new().namespace("hot"))
            .await
            .unwrap();
        highest.insert(ran_ahead.clone(), g.fence() + 1_000_000);
        g.release().await.unwrap();
    }

    router.reload(after.clone()).await.unwrap();
    tokio::time::sleep(PAST_THE_WINDOW).await;
    // Past the window, whether or not the fences were carried over yet.
    for key in [&ahead, &ran_ahead] {
        let g = router.acquire(key, AcquireOptions::new()).await.unwrap();
        assert!(
            g.fence() > highest[key],
            "{key}: {} after {}",
            g.fence(),
            highest[key]
        );
        highest.insert(key.clone(), g.fence());
        g.release().await.unwrap();
    }
    let carried = common::eventually(Duration::from_secs(30), || async {
        router.moves_in_progress() == 0
    })
    .await;
    assert!(
        carried,
        "the fences of moved keys were carried to their new shards"
    );
    assert!(router.stats().fences_carried >= 2, "{:?}", router.stats());

    // A process that never saw the old topology knows only the new shards: the carried
    // fences are its floor.
    let newcomer = LockRouter::new(after).await.unwrap();
    for key in [&ahead, &ran_ahead, &deleted] {
        let g = newcomer.acquire(key, AcquireOptions::new()).await.unwrap();
        assert!(
            g.fence() > highest[key],
            "{key}: {} after {}",
            g.fence(),
            highest[key]
        );
        g.release().await.unwrap();
    }
}

/// A fleet stopped and started again onto a changed config (a rolling deploy whose processes
/// stop rather than reload, a restart after an outage) has no process left to reload: the
/// start moves from the placement the fleet last ran, recorded on its shards, as a reload
/// does. A moved key's fence keeps rising (s1's clock runs an hour ahead of s2's, where the
/// key moves), during the move and after it, and a row kept past its release stays taken.
#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_restarted_onto_a_changed_config_moves_from_the_placement_it_last_ran() {
    let cluster = Cluster::start_with_clocks(2, &[(0, "+3600s")])
        .await
        .unwrap();
    let beats = "cleaner:\n  heartbeat-interval: 100ms\n";
    // A long window: the move is still under way when the test looks at it.
    let (one, two) = (
        config_for(&cluster, 1).replace(WINDOW, LONG_WINDOW) + beats,
        config_for(&cluster, 2).replace(WINDOW, LONG_WINDOW) + beats,
    );
    // Migrates both shards; it grants nothing, so it records no placement.
    let setup = LockRouter::from_yaml_str(&two).await.unwrap();
    setup.migrate().await.unwrap();
    let moved = |prefix: &str| {
        (0..)
            .map(|i| format!("{prefix}:{i}"))
            .find(|k| setup.shard_for(k).unwrap() == "s2")
            .unwrap()
    };
    let (key, kept) = (moved("k"), moved("kept"));
    setup.shutdown().await.unwrap();

    let old = LockRouter::from_yaml_str(&one).await.unwrap();
    let g = old.acquire(&key, AcquireOptions::new()).await.unwrap();
    let fence = g.fence();
    g.release().await.unwrap();
    let hour = Duration::from_secs(3600);
    let g = old
        .acquire(&kept, AcquireOptions::new().lock_at_least(hour))
        .await
        .unwrap();
    g.release().await.unwrap();
    common::until_placement_recorded_on(&cluster.shards()[..1]).await;
    old.shutdown().await.unwrap();

    // The whole fleet is gone; a process starts with the grown config.
    let mut s2 = cluster.shard(1).connect().await.unwrap();
    let new = LockRouter::from_yaml_str(&two).await.unwrap();
    // Recorded before the start is handed out (a fleet stopped right after finds the move).
    let names: Option<u64> = s2
        .query_first(
            "SELECT JSON_LENGTH(placements) FROM shardlock_placement WHERE fleet = 'default'",
        )
        .await
        .unwrap();
    assert_eq!(
        names,
        Some(2),
        "the start recorded its move before it granted"
    );
    assert_eq!(new.shard_for(&key).unwrap(), "s2");
    let g = new.acquire(&key, AcquireOptions::new()).await.unwrap();
    assert!(
        g.fence() > fence,
        "during the move: {} after {fence}",
        g.fence()
    );
    let fence = g.fence();
    g.release().await.unwrap();
    let taken = new.try_acquire(&kept, AcquireOptions::new()).await.unwrap();
    assert!(
        taken.is_none(),
        "a row kept past its release was granted during the move"
    );
    assert_eq!(
        new.moves_in_progress(),
        1,
        "the start moves from s1's placement"
    );
    // The kept row is renewed and followed by nobody: the move copies it to s2 and ends
    // without waiting the hour.
    let over = common::eventually(Duration::from_secs(60), || async {
        new.moves_in_progress() == 0
    })
    .await;
    assert!(
        over,
        "the move from the recorded placement ended: {:?}",
        new.stats()
    );
    let taken = new.try_acquire(&kept, AcquireOptions::new()).await.unwrap();
    assert!(
        taken.is_none(),
        "a row kept past its release was granted once its move ended"
    );

    // Recorded once the move is over: the new placement alone.
    let recorded = common::until_recorded_alone(cluster.shard(0), "\"name\":\"s2\"").await;
    assert!(recorded, "the fleet recorded its new placement alone");
    // A process that knows only the new shards: what the move carried is where keys live.
    let newcomer = LockRouter::from_yaml_str(&two).await.unwrap();
    let g = newcomer.acquire(&key, AcquireOptions::new()).await.unwrap();
    assert!(
        g.fence() > fence,
        "after the move: {} after {fence}",
        g.fence()
    );
    g.release().await.unwrap();
    assert_eq!(
        newcomer.moves_in_progress(),
        0,
        "the fleet recorded its new placement once its move was over"
    );
    let taken = newcomer
        .try_acquire(&kept, AcquireOptions::new())
        .await
        .unwrap();
    assert!(
        taken.is_none(),
        "a row kept past its release was granted on its new shard"
    );
    // An operator who evicts the kept row's holder by its name (read off s1) evicts its copy
    // on s2 too.
    let holder = owner_on(&cluster, 0, &kept).await;
    let evicted = newcomer
        .force_release_owner_everywhere(&kept, &holder)
        .await
        .unwrap();
    assert_eq!(
        evicted.len(),
        2,
        "evicted by the holder's name: {evicted:?}"
    );
    let taken = newcomer
        .try_acquire(&kept, AcquireOptions::new())
        .await
        .unwrap();
    assert!(taken.is_some(), "the kept row's copy outlived its eviction");
}

/// What the copy of a kept row writes on its key's new shard: it takes a missing, released or
/// expired row for what the kept row has left, with the higher of the two fences, and leaves a
/// live lease as it is, another owner's (a process that has not reloaded took the key there)
/// or the copy's own (sent again), whose end it only moves later.
#[tokio::test(flavor = "multi_thread")]
async fn a_kept_row_copied_to_its_new_shard_takes_only_a_row_no_lease_holds() {
    let cluster = Cluster::start(1).await.unwrap();
    common::migrate_only(&config_for(&cluster, 1)).await;
    let shard = common::backend_at(&cluster.shard(0).url());
    let granted = |attempt| match attempt {
        shardlock_mysql::Attempt::Granted { fence, .. } => fence,
        other => panic!("not granted: {other:?}"),
    };
    let held = granted(
        shard
            .acquire(&common::grant_request(b"held", "someone", 0))
            .await
            .unwrap(),
    );
    let released = granted(
        shard
            .acquire(&common::grant_request(b"released", "earlier", 0))
            .await
            .unwrap(),
    );
    shard.release(b"released", "earlier").await.unwrap();
    let expired = granted(
        shard
            .acquire(&common::grant_request(b"expired", "gone", 0))
            .await
            .unwrap(),
    );
    let mut conn = cluster.shard(0).connect().await.unwrap();
    conn.query_drop(
        "UPDATE shardlock_lease SET expires_at = NOW(3) - INTERVAL 1 SECOND \
         WHERE lock_key = 'expired'",
    )
    .await
    .unwrap();
    let hour = Duration::from_secs(3600);
    // The copy of a kept row, sent again (a retry, another process's carry): still the copy's.
    shard
        .keep_moved(b"own", "kept", 7, Duration::from_secs(1))
        .await
        .unwrap();
    for (key, fence) in [
        (&b"missing"[..], 7),
        (b"held", 7),
        (b"released", released + 5),
        (b"expired", 7),
        (b"own", 7),
    ] {
        shard.keep_moved(key, "kept", fence, hour).await.unwrap();
    }
    let rows: Vec<(String, String, u64, u32, bool)> = conn
        .query(
            "SELECT CAST(lock_key AS CHAR), owner, fence, ttl_ms, \
             expires_at > NOW(3) + INTERVAL 50 MINUTE FROM shardlock_lease ORDER BY lock_key",
        )
        .await
        .unwrap();
    let row = |key: &str, owner: &str, fence: u64, ttl_ms: u32, kept: bool| {
        (key.to_owned(), owner.to_owned(), fence, ttl_ms, kept)
    };
    assert_eq!(
        rows,
        vec![
            row("expired", "kept", expired, 0, true),
            row("held", "someone", held, 60_000, false),
            row("missing", "kept", 7, 0, true),
            row("own", "kept", 7, 0, true),
            row("released", "kept", released + 5, 0, true),
        ],
        "rows after the copy of a kept row (key, owner, fence, ttl_ms, kept for the hour)"
    );
}

/// A scheduled run's row stays taken to its interval's end after the run, renewed and followed
/// by nobody. A reload that moves its key copies that row to the key's new shard, so the move
/// ends without waiting for the interval (an hour here, a day for a nightly job), a process
/// started meanwhile is not refused for it, and the interval runs no second time, for the
/// reloaded process or the newcomer, nor once the run's own owner sends a stray release there
/// (a give-back of a follow, still retrying). The shards' clocks are a minute into an hour,
/// so the interval has most of it left.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_moves_a_finished_scheduled_run_without_waiting_for_its_interval() {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let ahead = format!("+{}s", 3600 - now % 3600 + 60);
    let cluster = Cluster::start_with_clocks(2, &[(0, &ahead), (1, &ahead)])
        .await
        .unwrap();
    let beats = "cleaner:\n  heartbeat-interval: 100ms\n";
    let (one, two) = (
        config_for(&cluster, 1) + beats,
        config_for(&cluster, 2) + beats,
    );
    common::migrate_only(&two).await;
    let placed = LockRouter::from_yaml_str(&two).await.unwrap();
    let job = common::key_on(&placed, "job", "s2");
    placed.shutdown().await.unwrap();

    let router = LockRouter::from_yaml_str(&one).await.unwrap();
    assert!(tick(&router, &job).await, "the interval's first tick ran");
    reloaded_without_a_second_run(&router, &two, &job, "moved").await;
    // A statement of the run's owner (its kept row on s1 names it) does not free the copy.
    let run_owner = owner_on(&cluster, 0, &job).await;
    common::backend_at(&cluster.shard(1).url())
        .release(job.as_bytes(), &run_owner)
        .await
        .unwrap();

    let newcomer = LockRouter::from_yaml_str(&two).await.unwrap();
    let other = newcomer
        .try_acquire("other", AcquireOptions::new())
        .await
        .unwrap();
    assert!(other.is_some(), "a process started after the move granted");
    assert!(
        !tick(&newcomer, &job).await,
        "a newcomer ran the interval again"
    );
    newcomer.shutdown().await.unwrap();

    // Moved back: the move from s2 finds the kept row on s1 as it was left, and ends.
    reloaded_without_a_second_run(&router, &one, &job, "moved back").await;
}

/// One tick of the hourly job `job`: whether it ran.
async fn tick(router: &LockRouter, job: &str) -> bool {
    let hour = Duration::from_secs(3600);
    (router.run_exclusive(job, hour, AcquireOptions::new(), |_| async {}))
        .await
        .unwrap()
        .is_some()
}

/// Reloads `router` onto `yaml`, which moves `job` (`how`); the move must end although the
/// job's interval has not, and the job must not run again.
async fn reloaded_without_a_second_run(router: &LockRouter, yaml: &str, job: &str, how: &str) {
    router
        .reload(Config::from_yaml_str(yaml).unwrap())
        .await
        .unwrap();
    let over = common::eventually(Duration::from_secs(60), || async {
        router.moves_in_progress() == 0
    })
    .await;
    assert!(
        over,
        "a move ({how}) waited for the interval of a finished scheduled run: {:?}",
        router.stats()
    );
    assert!(
        !tick(router, job).await,
        "the interval ran again after its key {how}"
    );
}

/// The owner of `key`'s row on shard `i`, read there.
async fn owner_on(cluster: &Cluster, i: usize, key: &str) -> String {
    (cluster.shard(i).connect().await.unwrap())
        .exec_first(
            "SELECT owner FROM shardlock_lease WHERE lock_key = ?",
            (key.as_bytes(),),
        )
        .await
        .unwrap()
        .unwrap()
}

/// Configs of s1 alone and of s2 alone (heartbeats every 100 ms), both shards migrated by a
/// router that grants nothing.
async fn s1_then_s2(cluster: &Cluster) -> (String, String) {
    let tail = format!("{POLICY}cleaner:\n  heartbeat-interval: 100ms\n");
    let only = |i: usize| {
        let s = cluster.shard(i);
        format!(
            "shards:\n  - name: {}\n    url: {}\n{tail}",
            s.name(),
            s.url()
        )
    };
    common::migrate_only(&config_for(cluster, 2)).await;
    (only(0), only(1))
}

/// A fleet that moved every key from s1 to s2 by a reload, then stopped, restarted with the
/// config it ran before the move (a rollback): the record on s1 says the fleet moved to s2, so
/// the start, which does not reach s2, grants nothing rather than forget what the keys have
/// there. (Records are written on the shards a move leaves too, not only on current ones.)
#[tokio::test(flavor = "multi_thread")]
async fn a_rollback_onto_a_placement_the_fleet_moved_away_from_grants_nothing() {
    let cluster = Cluster::start(2).await.unwrap();
    let (before, after) = s1_then_s2(&cluster).await;

    let router = LockRouter::from_yaml_str(&before).await.unwrap();
    let g = router.acquire("k:1", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    router
        .reload(Config::from_yaml_str(&after).unwrap())
        .await
        .unwrap();
    let g = router.acquire("k:1", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    let over = common::eventually(Duration::from_secs(30), || async {
        router.moves_in_progress() == 0
    })
    .await;
    assert!(over, "the move ended");
    common::until_placement_recorded(&cluster).await;
    router.shutdown().await.unwrap();
    rolled_back_is_refused(&before).await;
}

/// A router on `before` that granted a lease (`k:1`) and then recorded its placement on
/// `cluster`'s first shard.
async fn granted_and_recorded_on_s1(cluster: &Cluster, before: &str) -> LockRouter {
    let router = LockRouter::from_yaml_str(before).await.unwrap();
    let g = router.acquire("k:1", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    common::until_placement_recorded_on(&cluster.shards()[..1]).await;
    router
}

/// A start onto `before`, the config its fleet ran before a move (a rollback), grants
/// nothing: the record says where the fleet went, which this config does not reach.
async fn rolled_back_is_refused(before: &str) {
    let rolled_back = LockRouter::from_yaml_str(before).await.unwrap();
    common::refused_saying(&rolled_back, "k:1", &["this config does not reach"]).await;
}

/// A reload records its fleet's new placement before it returns, so before anything is placed
/// by it: a whole fleet stopped right after (a job enqueued where its queue moved) and
/// rolled back finds that it moved, and refuses (as
/// `a_rollback_onto_a_placement_the_fleet_moved_away_from_grants_nothing` shows), instead of
/// granting without the job.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_records_where_keys_go_before_it_places_any_there() {
    let cluster = Cluster::start(2).await.unwrap();
    let (before, after) = s1_then_s2(&cluster).await;
    let router = granted_and_recorded_on_s1(&cluster, &before).await;
    let mut s1 = cluster.shard(0).connect().await.unwrap();

    router
        .reload(Config::from_yaml_str(&after).unwrap())
        .await
        .unwrap();
    // Read before anything else: the heartbeat the reload wakes records too, later.
    let names = names_the_move_to_s2(&mut s1).await;
    assert_eq!(
        names,
        Some(true),
        "the record names the move to s2 once the reload returned"
    );
    router.shutdown().await.unwrap();
}

/// A reload whose write of its fleet's record waits (the record's row on a shard locked by
/// another transaction, as a slow shard would hold it) holds back no heartbeat: the process
/// does not lapse, and its leases stay held. A caller that gives up on such a reload leaves
/// it to complete.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_whose_record_write_waits_holds_back_no_heartbeat() {
    let cluster = Cluster::start(2).await.unwrap();
    // The record's write waits up to a second.
    let weighted = |weight: u32| {
        let (s1, s2) = (cluster.shard(0), cluster.shard(1));
        format!(
            "shards:\n  - name: s1\n    url: {}\n  - name: s2\n    url: {}\n    weight: {weight}\n\
             {POLICY}cleaner:\n  heartbeat-interval: 100ms\n",
            s1.url(),
            s2.url()
        )
    };
    let router = LockRouter::from_yaml_str(&weighted(1)).await.unwrap();
    router.migrate().await.unwrap();
    let held = router
        .acquire("held", AcquireOptions::new().ttl(Duration::from_secs(60)))
        .await
        .unwrap();
    common::until_placement_recorded(&cluster).await;

    let mut blocker = placement_record_locked(&cluster).await;
    let waits = cluster.shard(0).lock_waits_begun().await.unwrap();
    let reloading = tokio::spawn({
        let (router, config) = (router.clone(), Config::from_yaml_str(&weighted(3)).unwrap());
        async move { router.reload(config).await }
    });
    // A heartbeat sent once the record write waits.
    until_waits_begin(&cluster, waits).await;
    let since = std::time::Instant::now();
    let beat = common::eventually(Duration::from_secs(30), || async {
        !reloading.is_finished() && beaten_since(&router, since).await
    })
    .await;
    assert!(
        beat,
        "no heartbeat landed while the reload's record write waited"
    );
    reloading.await.unwrap().unwrap();
    assert!(
        held.is_held(),
        "a lease was lost to the reload's record write"
    );

    // A caller that gives up on a reload while its record write waits: the reload completes
    // all the same (half of it, the record naming a placement no process ran, would stay).
    // The reload's record written first (the heartbeats retry it, and their writes would
    // wait on the row too).
    let recorded = router.stats().placements_recorded;
    blocker.query_drop("ROLLBACK").await.unwrap();
    let caught_up = common::eventually(Duration::from_secs(30), || async {
        router.stats().placements_recorded > recorded
    })
    .await;
    assert!(caught_up, "the reload's record was never written");
    let mut blocker = placement_record_locked(&cluster).await;
    let epoch = router.epoch();
    let waits = cluster.shard(0).lock_waits_begun().await.unwrap();
    let reload = router.reload(Config::from_yaml_str(&weighted(5)).unwrap());
    // Given up once its record write waits.
    let given_up = tokio::select! {
        done = reload => Some(done),
        () = until_waits_begin(&cluster, waits) => None,
    };
    assert!(
        given_up.is_none(),
        "the reload did not wait for its record write: {given_up:?}"
    );
    blocker.query_drop("ROLLBACK").await.unwrap();
    let completed =
        common::eventually(Duration::from_secs(30), || async { router.epoch() > epoch }).await;
    assert!(
        completed,
        "a reload whose caller gave up was left half done"
    );
    held.release().await.unwrap();
    router.shutdown().await.unwrap();
}

/// Two processes of a fleet reloading onto the same topology at the same moment race for its
/// record, and one loses a shard's write to the other. The record names their placement all
/// the same, so neither warns that it places keys before its fleet's record names where (a
/// whole fleet reloading at once warned at every reload).
#[tokio::test(flavor = "multi_thread")]
async fn a_fleet_reloading_at_once_onto_one_topology_does_not_warn_of_its_record() {
    let warnings = capture_warnings();
    let cluster = Cluster::start(2).await.unwrap();
    let weighted = |weight: u32| slow_record_config(&cluster, weight);
    // One after the other (so neither write of the record loses): none lands after the
    // reloads begin.
    let a = recorded_router(&weighted(1)).await;
    let b = recorded_router(&weighted(1)).await;
    let (a, b) = (&a, &b);
    let seq_on_s2 = || async {
        let mut s2 = cluster.shard(1).connect().await.unwrap();
        let seq: Option<u64> = s2
            .query_first("SELECT seq FROM shardlock_placement WHERE fleet = 'default'")
            .await
            .unwrap();
        seq
    };
    let before = seq_on_s2().await;

    // b's write of the new record waits on s1, behind another transaction; on s2 it lands.
    let mut blocker = placement_record_locked(&cluster).await;
    let reload = |router: &LockRouter| {
        let (router, config) = (router.clone(), Config::from_yaml_str(&weighted(3)).unwrap());
        tokio::spawn(async move { router.reload(config).await })
    };
    let b_reload = reload(b);
    common::until_a_row_lock_is_waited_for(cluster.shard(0)).await;
    let landed = common::eventually(Duration::from_secs(30), || async {
        seq_on_s2().await != before
    })
    .await;
    assert!(landed, "b's record never landed on s2");
    // a reads the record (b's on s2, the old one on s1) and writes it too: on s1 behind b.
    let a_reload = reload(a);
    let both_wait = common::eventually(Duration::from_secs(30), || async {
        cluster.shard(0).lock_waits_now().await.unwrap() >= 2
    })
    .await;
    assert!(both_wait, "a's write of the record never waited on s1");
    // Each expects the record a read on s1: the first write lands, the second finds it
    // changed and loses s1.
    blocker.query_drop("ROLLBACK").await.unwrap();
    a_reload.await.unwrap().unwrap();
    b_reload.await.unwrap().unwrap();

    let logged = String::from_utf8(warnings.lock().unwrap().clone()).unwrap();
    assert!(
        !logged.contains(RECORD_NOT_NAMED),
        "a process of a fleet reloading at once warned of its record: {logged}"
    );
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// The warning stays where it is due: a reload whose record write loses a shard to other
/// placements (written there while the write waits) warns, the record naming elsewhere.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_whose_record_write_lost_to_other_placements_warns() {
    let warnings = capture_warnings();
    let cluster = Cluster::start(2).await.unwrap();
    let router = recorded_router(&slow_record_config(&cluster, 1)).await;
    let mut blocker = placement_record_locked(&cluster).await;
    let reloading = tokio::spawn({
        let config = Config::from_yaml_str(&slow_record_config(&cluster, 3)).unwrap();
        let router = router.clone();
        async move { router.reload(config).await }
    });
    common::until_a_row_lock_is_waited_for(cluster.shard(0)).await;
    blocker
        .query_drop(
            "UPDATE shardlock_placement SET seq = seq + 1000, placements = '[]' \
             WHERE fleet = 'default'",
        )
        .await
        .unwrap();
    blocker.query_drop("COMMIT").await.unwrap();
    reloading.await.unwrap().unwrap();

    let logged = String::from_utf8(warnings.lock().unwrap().clone()).unwrap();
    assert!(
        logged.contains(RECORD_NOT_NAMED),
        "a reload whose record lost a shard to other placements did not warn: {logged:?}"
    );
    router.shutdown().await.unwrap();
}

/// What a reload warns when its fleet's record does not name its placements.
const RECORD_NOT_NAMED: &str = "places keys before its fleet's placement record names where";

/// Two shards of `cluster`, s2 weighted `weight`, giving a write of the placement record 30 s
/// behind a row lock (the statement timeout), and a reload as long to record ahead (half the
/// heartbeat interval).
fn slow_record_config(cluster: &Cluster, weight: u32) -> String {
    let (s1, s2) = (cluster.shard(0), cluster.shard(1));
    format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 30s\n  - name: s2\n    \
         url: {}\n    weight: {weight}\n    statement-timeout: 30s\n\
         {POLICY}cleaner:\n  heartbeat-interval: 60s\n  heartbeat-timeout: 180s\n",
        s1.url(),
        s2.url()
    )
}

/// A router on `yaml`, migrated, that granted a lease and then recorded its placement.
async fn recorded_router(yaml: &str) -> LockRouter {
    let router = LockRouter::from_yaml_str(yaml).await.unwrap();
    router.migrate().await.unwrap();
    let g = router.acquire("k:1", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    common::until_router_recorded(&router).await;
    router
}

/// Waits until a row lock wait begins on s1 past the `waits` already begun (30 s at most).
async fn until_waits_begin(cluster: &Cluster, waits: u64) {
    let begun = common::eventually(Duration::from_secs(30), || async {
        cluster.shard(0).lock_waits_begun().await.unwrap() > waits
    })
    .await;
    assert!(begun, "no row lock wait began on s1");
}

/// A transaction holding the placement record's rows on `cluster`'s first shard locked until
/// it rolls back: a write of the record there waits behind it.
async fn placement_record_locked(cluster: &Cluster) -> shardlock::mysql_async::Conn {
    let mut blocker = cluster.shard(0).connect().await.unwrap();
    blocker.query_drop("BEGIN").await.unwrap();
    blocker
        .query_drop("SELECT * FROM shardlock_placement FOR UPDATE")
        .await
        .unwrap();
    blocker
}

/// Every warning shardlock logs in this test's process from now on.
fn capture_warnings() -> std::sync::Arc<std::sync::Mutex<Vec<u8>>> {
    #[derive(Clone)]
    struct Logged(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
    impl std::io::Write for Logged {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logged = Logged(Default::default());
    let kept = logged.0.clone();
    tracing_subscriber::fmt()
        .with_env_filter("shardlock=warn")
        .with_ansi(false)
        .with_writer(move || logged.clone())
        .init();
    kept
}

/// A shard a reload's move leaves that was cut off when the reload recorded ahead gets the
/// record once it answers again, while the move is in force: a rollback start onto it then
/// finds where the fleet went.
#[tokio::test(flavor = "multi_thread")]
async fn a_shard_the_move_leaves_cut_off_at_the_reload_gets_the_record_once_back() {
    let cluster = Cluster::start(2).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let policy = POLICY.replace("move-window: 3s", "move-window: 60s");
    let tail = format!("{policy}cleaner:\n  heartbeat-interval: 100ms\n");
    let only = |url: String| format!("shards:\n  - name: s1\n    url: {url}\n{tail}");
    let (before, after) = (only(proxy.url()), only(cluster.shard(1).url()));
    let after = after.replace("name: s1", "name: s2");
    common::migrate_only(&config_for(&cluster, 2)).await;
    let router = granted_and_recorded_on_s1(&cluster, &before).await;

    proxy.set(ProxyMode::Blackhole);
    router
        .reload(Config::from_yaml_str(&after).unwrap())
        .await
        .unwrap();
    proxy.set(ProxyMode::Pass);
    let recorded = common::eventually(Duration::from_secs(30), || async {
        let mut c = cluster.shard(0).connect().await.unwrap();
        names_the_move_to_s2(&mut c).await == Some(true)
    })
    .await;
    assert!(
        recorded,
        "the shard the move leaves never got the record of the move"
    );
    router.shutdown().await.unwrap();
}

/// A move does not end while the shard it leaves lacks the record of the move (its write there
/// timed out behind a row lock, as behind a slow shard): no write goes there once the move is
/// over, and a whole fleet rolled back onto the placement it left read there the record from
/// before the move, and granted where it knew nothing of what the keys got since.
#[tokio::test(flavor = "multi_thread")]
async fn a_move_ends_only_once_the_shard_it_leaves_has_the_record_of_it() {
    let warnings = capture_warnings();
    let cluster = Cluster::start(2).await.unwrap();
    let (before, after) = s1_then_s2(&cluster).await;
    let router = granted_and_recorded_on_s1(&cluster, &before).await;

    let mut blocker = placement_record_locked(&cluster).await;
    router
        .reload(Config::from_yaml_str(&after).unwrap())
        .await
        .unwrap();
    let kept = "placement record does not name the placement moved to";
    let decided = common::eventually(Duration::from_secs(60), || async {
        router.moves_in_progress() == 0
            || String::from_utf8_lossy(&warnings.lock().unwrap()).contains(kept)
    })
    .await;
    assert!(decided, "the move neither ended nor was kept");
    assert_eq!(
        router.moves_in_progress(),
        1,
        "the move ended while the shard it leaves had the record from before it"
    );
    blocker.query_drop("ROLLBACK").await.unwrap();
    let recorded = common::eventually(Duration::from_secs(30), || async {
        let mut c = cluster.shard(0).connect().await.unwrap();
        names_the_move_to_s2(&mut c).await == Some(true)
    })
    .await;
    assert!(recorded, "the shard the move leaves never got the record");
    common::moves_done(&router).await;
    router.shutdown().await.unwrap();
    rolled_back_is_refused(&before).await;
}

/// Whether a heartbeat of `router` reached s1 after `since`.
async fn beaten_since(router: &LockRouter, since: std::time::Instant) -> bool {
    // Read before the row: a heartbeat younger than this was sent after `since` (5 ms for the
    // shard's clock's millisecond truncation).
    let waited = i64::try_from(since.elapsed().as_millis()).unwrap();
    let shards = router.instances().await;
    let Some((_, Ok(rows))) = shards.into_iter().find(|(name, _)| name == "s1") else {
        return false;
    };
    (rows.iter()).any(|r| r.instance_id == router.instance_id() && r.heartbeat_ms_ago + 5 < waited)
}

/// An operator's tool router (`shardlock status`, `inspect`, ...) started with another config
/// than its fleet last ran moves nothing (it would carry a live fleet's CAS locks and jobs
/// away) and grants nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_operator_tool_with_another_config_moves_and_grants_nothing() {
    let cluster = Cluster::start(2).await.unwrap();
    let (one, two) = (config_for(&cluster, 1), config_for(&cluster, 2));
    common::migrate_only(&two).await;
    let fleet = LockRouter::from_yaml_str(&one).await.unwrap();
    let g = fleet.acquire("k:1", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    common::until_placement_recorded_on(&cluster.shards()[..1]).await;

    // As the `shardlock` commands build it: under the static registry (it does not register).
    let tool = format!("{two}cleaner:\n  registry: static\n");
    let tool = LockRouter::builder(Config::from_yaml_str(&tool).unwrap())
        .operator_tool()
        .build()
        .await
        .unwrap();
    assert_eq!(tool.moves_in_progress(), 0, "a tool moved keys");
    let refused = tool.try_acquire("k:1", AcquireOptions::new()).await;
    assert!(
        matches!(refused, Err(shardlock::Error::InvalidArgument { .. })),
        "a tool granted, or refused otherwise: {:?}",
        refused.map(|g| g.is_some())
    );
    tool.shutdown().await.unwrap();
    fleet.shutdown().await.unwrap();
}

/// A start onto a config that no longer lists a shard its fleet last ran (dropped while the
/// fleet was down) cannot carry what the keys that left it had there: it grants nothing, and
/// says why, until the fleet's record is deleted by hand (or a process of the old config moves
/// the keys by a reload).
#[tokio::test(flavor = "multi_thread")]
async fn a_start_that_cannot_reach_a_shard_its_fleet_last_ran_grants_nothing_until_told() {
    let cluster = Cluster::start(2).await.unwrap();
    let beats = "cleaner:\n  heartbeat-interval: 100ms\n";
    let (one, two) = (
        config_for(&cluster, 1) + beats,
        config_for(&cluster, 2) + beats,
    );
    let old = LockRouter::from_yaml_str(&two).await.unwrap();
    old.migrate().await.unwrap();
    let g = old.acquire("k:1", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    common::until_placement_recorded(&cluster).await;
    old.shutdown().await.unwrap();

    let new = LockRouter::from_yaml_str(&one).await.unwrap();
    common::refused_saying(
        &new,
        "k:1",
        &["`s2` at database", "this config does not reach"],
    )
    .await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    c.query_drop("DELETE FROM shardlock_placement WHERE fleet = 'default'")
        .await
        .unwrap();
    let g = new
        .acquire("k:1", AcquireOptions::new().wait(Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(new.moves_in_progress(), 0, "nothing to move from");
    g.release().await.unwrap();
}

/// The cleaner may delete a row of the shard a key left while the move's carry is still
/// scanning that shard, once the shard's clock passed the row's fence (here: fences reserved
/// ahead of the clock for hand-offs). The carry floors the key's new shard (whose clock is a
/// minute behind) at the old one's clock and floor as they are after its scan, which the
/// cleaner raised to the deleted fence: the key's next fence is above it.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_cleaned_while_the_move_carries_fences_leaves_its_fence_as_the_floor() {
    let cluster = Cluster::start_with_clocks(4, &[(3, "+60s")]).await.unwrap();
    // Statements may wait on a row lock for long; none of it is a failing shard.
    let listing = |names: &[&str]| {
        let tail = format!("breaker:\n  slow-call: 60s\n{RUN_AHEAD}");
        shards_named(&cluster, names, "    statement-timeout: 60s\n", &tail)
    };
    let after = listing(&["s1", "s2", "s3"]);
    LockRouter::new(listing(&["s1", "s2", "s3", "s4"]))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let router = LockRouter::new(listing(&["s1", "s2", "s4"])).await.unwrap();
    let probe = LockRouter::new(after.clone()).await.unwrap();
    let on_s4 = |prefix: &str, n: usize| -> Vec<String> {
        (0..)
            .map(|i| format!("{prefix}{i:05}"))
            .filter(|k| router.shard_for(k).unwrap() == "s4")
            .take(n)
            .collect()
    };
    // The key, sorting after a full batch of the carry's scan of released rows on s4.
    let key = on_s4("z:", 1).remove(0);
    let planted = on_s4("a:", shardlock_mysql::FLOOR_BATCH);
    let mut s4 = cluster.shard(3).connect().await.unwrap();
    s4.exec_batch(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         VALUES (?, NULL, 1, 1000, NOW(3), NOW(3))",
        planted.iter().map(|k| (k.as_str(),)),
    )
    .await
    .unwrap();
    // Its fences run seconds ahead of s4's clock: each grant reserves a million for hand-offs.
    let mut highest = 0;
    for _ in 0..3 {
        let g = router
            .acquire(&key, AcquireOptions::new().namespace("hot"))
            .await
            .unwrap();
        highest = g.fence() + 1_000_000;
        g.release().await.unwrap();
    }
    // The carry's first batch is held up on the new shard of one of the planted keys.
    let held_up = &planted[0];
    let target = shard_named(&cluster, &probe.shard_for(held_up).unwrap());
    let mut blocker = target.connect().await.unwrap();
    blocker
        .exec_drop(
            "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
             VALUES (?, NULL, 1, 1000, NOW(3) + INTERVAL 1 HOUR, NOW(3))",
            (held_up.as_str(),),
        )
        .await
        .unwrap();
    blocker.query_drop("START TRANSACTION").await.unwrap();
    blocker
        .exec_drop(
            "SELECT 1 FROM shardlock_lease WHERE lock_key = ? FOR UPDATE",
            (held_up.as_str(),),
        )
        .await
        .unwrap();
    router.reload(after.clone()).await.unwrap();
    common::until_a_row_lock_is_waited_for(target).await;

    // Meanwhile s4's clock passes the key's fence and the cleaner deletes its row there.
    let cleaned = common::eventually(Duration::from_secs(30), || async {
        common::clean_pass(&router).await;
        let mut s4 = cluster.shard(3).connect().await.unwrap();
        let left: Option<u64> = s4
            .exec_first(
                "SELECT COUNT(*) FROM shardlock_lease WHERE lock_key = ?",
                (key.as_str(),),
            )
            .await
            .unwrap();
        left == Some(0)
    })
    .await;
    assert!(cleaned, "the cleaner deleted the key's row on s4");
    blocker.query_drop("ROLLBACK").await.unwrap();
    common::moves_done(&router).await;

    let g = router.acquire(&key, AcquireOptions::new()).await.unwrap();
    assert_ne!(g.shard(), "s4");
    assert!(
        g.fence() > highest,
        "the fence went back: {} after {highest}",
        g.fence()
    );
    g.release().await.unwrap();
}

/// A process's row in the registry of a shard it left in a reload is not taken for what it
/// runs now, whatever that shard's clock says: with the clock stepped back, the row looks
/// newer than the process's rows where it beats now. A process started with the old topology
/// still finds that the fleet runs another one, and grants nothing, rather than taking a key
/// on the shard it left while the process holds it where it lives now.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_on_a_shard_left_whose_clock_stepped_back_is_not_taken_for_the_fleets_topology() {
    let cluster = Cluster::start_with_clocks(3, &[(0, "+0")]).await.unwrap();
    let shards: Vec<(&str, String)> = cluster
        .shards()
        .iter()
        .map(|s| (s.name(), s.url()))
        .collect();
    let extra = "cleaner:\n  heartbeat-interval: 100ms\n";
    let old = listing(&shards[..2], extra);
    let new = listing(&shards[1..], extra);
    LockRouter::new(listing(&shards, extra))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let r = LockRouter::new(old.clone()).await.unwrap();
    let probe = LockRouter::new(new.clone()).await.unwrap();
    let key = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| r.shard_for(k).unwrap() == "s1" && probe.shard_for(k).unwrap() == "s3")
        .unwrap();
    probe.shutdown().await.unwrap();
    r.acquire("joined", AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    r.reload(new).await.unwrap();
    common::moves_done(&r).await;
    let held = r.acquire(&key, AcquireOptions::new()).await.unwrap();
    assert_eq!(held.shard(), "s3");

    cluster.shard(0).set_clock("-120s").unwrap();
    let s = LockRouter::new(old).await.unwrap();
    let theirs = s
        .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(3)))
        .await;
    assert!(
        matches!(&theirs, Err(e) if e.is_unavailable()),
        "a process of the old topology was answered {:?} while {} holds the key on s3",
        theirs.map(|g| (g.shard().to_owned(), g.fence())),
        r.instance_id()
    );
    held.release().await.unwrap();
}

/// A config listing `shards` as `(name, url)`, with a 500 ms move window and `extra` appended.
fn listing(shards: &[(&str, String)], extra: &str) -> Config {
    let mut yaml = String::from("shards:\n");
    for (name, url) in shards {
        yaml.push_str(&format!("  - name: {name}\n    url: {url}\n"));
    }
    yaml.push_str("routing:\n  move-window: 500ms\n");
    yaml.push_str(extra);
    Config::from_yaml_str(&yaml).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_url_that_reaches_another_server_is_a_move_and_one_that_reaches_the_same_is_not() {
    let cluster = Cluster::start(4).await.unwrap();
    let url = |i: usize| cluster.shard(i).url();
    let first = listing(&[("s1", url(0)), ("s2", url(1)), ("s3", url(2))], "");
    // The same server through a proxy: another URL, the same database.
    let proxy = shardlock_testkit::Proxy::start(cluster.shard(2).port())
        .await
        .unwrap();
    let same = listing(&[("s1", url(0)), ("s2", url(1)), ("s3", proxy.url())], "");
    // "s3" now names the fourth server: new hardware, a promoted replica.
    let other = listing(&[("s1", url(0)), ("s2", url(1)), ("s3", url(3))], "");
    LockRouter::new(listing(
        &[
            ("s1", url(0)),
            ("s2", url(1)),
            ("s3", url(2)),
            ("s4", url(3)),
        ],
        "",
    ))
    .await
    .unwrap()
    .migrate()
    .await
    .unwrap();
    let a = LockRouter::new(first.clone()).await.unwrap();
    let b = LockRouter::new(first).await.unwrap();
    let key = common::key_on(&a, "k", "s3");
    let opts = || {
        AcquireOptions::new()
            .ttl(Duration::from_secs(3))
            .wait(Duration::ZERO)
    };
    let held = a.acquire(&key, opts()).await.unwrap();

    a.reload(same.clone()).await.unwrap();
    b.reload(same).await.unwrap();
    assert_eq!(a.moves_in_progress(), 0, "the same database: nothing moved");
    tokio::time::sleep(PAST_THE_WINDOW).await;
    common::renewed(&held, "a lease renewed past the move window was lost").await;
    assert_eq!(a.stats().followed, 0);
    assert!(b.try_acquire(&key, opts()).await.unwrap().is_none());

    a.reload(other.clone()).await.unwrap();
    b.reload(other).await.unwrap();
    assert_eq!(
        a.moves_in_progress(),
        1,
        "another database: every key of s3 moved"
    );
    assert!(b.try_acquire(&key, opts()).await.unwrap().is_none());
    until_followed(
        &a,
        Duration::from_secs(30),
        "the lease never followed its key",
    )
    .await;
    common::moves_done(&a).await;
    common::moves_done(&b).await;
    common::renewed(&held, "a lease renewed past the move window was lost").await;
    assert!(
        b.try_acquire(&key, opts()).await.unwrap().is_none(),
        "granted on the new server while a holds the key on the old one"
    );
    let fence = held.fence();
    held.release().await.unwrap();
    let next = b.try_acquire(&key, opts()).await.unwrap().expect("free");
    assert!(next.fence() > fence);
    next.release().await.unwrap();
}

/// The fingerprint a process advertises leaves URLs out (one database has many), so a
/// process that reaches a shard's name at another server advertises the same topology. The
/// registry still tells: each heartbeat carries a digest of the servers its shard names reach
/// (migration 12). A process started with a config that points a shard elsewhere grants
/// nothing while such a process lives, and a reload that does so keeps its move in force until
/// the fleet follows.
#[tokio::test(flavor = "multi_thread")]
async fn a_shard_pointed_at_another_server_while_the_fleet_reaches_the_old_one_is_taken_on_both() {
    pointed_elsewhere_is_seen([0, 1, 3]).await;
}

/// The same when two shards' URLs are swapped: every process beats on every server.
#[tokio::test(flavor = "multi_thread")]
async fn two_shards_swapped_while_the_fleet_reaches_them_the_old_way_are_taken_on_both() {
    pointed_elsewhere_is_seen([0, 2, 1]).await;
}

/// The digest names each server as the server names itself, whatever URL reaches it, and a
/// process's digest does not change when it loses a shard: a member cut off from one shard
/// (its registry row there timed out) keeps nobody from starting, and a member that reaches a
/// shard through a proxy runs the same servers as one that reaches it directly.
#[tokio::test(flavor = "multi_thread")]
async fn a_member_cut_off_from_one_shard_or_reaching_it_through_a_proxy_blocks_no_start() {
    let cluster = Cluster::start(3).await.unwrap();
    let proxy = Proxy::start(cluster.shard(2).port()).await.unwrap();
    let url = |i: usize| cluster.shard(i).url();
    let beats = "cleaner:\n  heartbeat-interval: 100ms\n  heartbeat-timeout: 2s\n";
    let direct = listing(&[("s1", url(0)), ("s2", url(1)), ("s3", url(2))], beats);
    // A short statement timeout: its heartbeats on s1 and s2 go on landing while s3's fail.
    let mut proxied = String::from("shards:\n");
    for (name, url) in [("s1", url(0)), ("s2", url(1)), ("s3", proxy.url())] {
        proxied.push_str(&format!(
            "  - name: {name}\n    url: {url}\n    statement-timeout: 300ms\n"
        ));
    }
    let proxied =
        Config::from_yaml_str(&format!("{proxied}routing:\n  move-window: 500ms\n{beats}"))
            .unwrap();
    let setup = LockRouter::new(direct.clone()).await.unwrap();
    setup.migrate().await.unwrap();
    setup.shutdown().await.unwrap();
    let cut = LockRouter::new(proxied).await.unwrap();
    assert!(cut.is_joined());
    let id = cut.instance_id().to_owned();
    let joins = |config: Config| async move {
        let router = LockRouter::new(config).await.unwrap();
        let joined =
            common::eventually(Duration::from_secs(30), || async { router.is_joined() }).await;
        (router, joined)
    };
    let (started, joined) = joins(direct.clone()).await;
    assert!(
        joined,
        "a member reaching a shard through a proxy blocked a start"
    );
    started.shutdown().await.unwrap();

    proxy.set(ProxyMode::Blackhole);
    let rows_of = |router: &LockRouter, shard: usize| {
        let (router, id) = (router.clone(), id.clone());
        async move {
            let rows = router.instances().await.remove(shard).1.unwrap();
            rows.into_iter()
                .filter(|r| r.instance_id == id)
                .map(|r| r.heartbeat_ms_ago)
                .collect::<Vec<_>>()
        }
    };
    let reader = LockRouter::new(listing(&[("s3", url(2))], beats))
        .await
        .unwrap();
    let gone = common::eventually(Duration::from_secs(30), || async {
        rows_of(&reader, 0).await.iter().all(|ago| *ago > 2_000)
    })
    .await;
    assert!(gone, "the cut-off member's row on s3 did not time out");
    reader.shutdown().await.unwrap();

    let (started, joined) = joins(direct).await;
    assert!(
        joined,
        "a member cut off from one shard blocked a start of the same topology"
    );
    let live_on_s1 = rows_of(&started, 0).await;
    assert!(
        live_on_s1.iter().any(|ago| *ago < 2_000),
        "the cut-off member was not live elsewhere when the start was checked: {live_on_s1:?}"
    );
    started.shutdown().await.unwrap();
    proxy.set(ProxyMode::Pass);
    cut.shutdown().await.unwrap();
}

/// A fleet on `s1`..`s3` at the first three servers; `changed` names the servers (of four)
/// a changed config gives them, placing `s3`'s keys elsewhere.
async fn pointed_elsewhere_is_seen(changed: [usize; 3]) {
    let cluster = Cluster::start(4).await.unwrap();
    let url = |i: usize| cluster.shard(i).url();
    let beats = "cleaner:\n  heartbeat-interval: 100ms\n";
    let first = listing(&[("s1", url(0)), ("s2", url(1)), ("s3", url(2))], beats);
    let other = listing(
        &[
            ("s1", url(changed[0])),
            ("s2", url(changed[1])),
            ("s3", url(changed[2])),
        ],
        beats,
    );
    let all = [
        ("s1", url(0)),
        ("s2", url(1)),
        ("s3", url(2)),
        ("s4", url(3)),
    ];
    let setup = LockRouter::new(listing(&all, "")).await.unwrap();
    setup.migrate().await.unwrap();
    setup.shutdown().await.unwrap();
    let a = LockRouter::new(first.clone()).await.unwrap();
    let b = LockRouter::new(first).await.unwrap();
    let key = common::key_on(&a, "k", "s3");
    let held = b.acquire(&key, AcquireOptions::new()).await.unwrap();
    let opts = || AcquireOptions::new().wait(Duration::ZERO);

    // The fleet's placement record names the database `other` does not reach (where one does,
    // a start is refused for that first): deleted, as for a fleet that ran a version before
    // migration 13, to show the servers digest alone refuses it too.
    common::until_placement_recorded_on(&cluster.shards()[..3]).await;
    for shard in &cluster.shards()[..3] {
        let mut c = shard.connect().await.unwrap();
        c.query_drop("DELETE FROM shardlock_placement")
            .await
            .unwrap();
    }
    let started = LockRouter::new(other.clone()).await.unwrap();
    refused_for(&started, &key, &b).await;
    started.shutdown().await.unwrap();
    // Nothing held at the move's end: its carry then finds nothing left on the old server.
    held.release().await.unwrap();

    a.reload(other.clone()).await.unwrap();
    let decided = common::eventually(Duration::from_secs(30), || async {
        a.stats().moves_kept > 0 || a.moves_in_progress() == 0
    })
    .await;
    assert!(decided, "the move's carry never looked at the fleet");
    assert_eq!(
        a.moves_in_progress(),
        1,
        "the move ended while another process reaches s3 at the old server"
    );
    let held = b.acquire(&key, AcquireOptions::new()).await.unwrap();
    assert!(
        a.try_acquire(&key, opts()).await.unwrap().is_none(),
        "granted on the new server while another process holds the key on the old one"
    );

    b.reload(other).await.unwrap();
    let over = common::eventually(Duration::from_secs(30), || async {
        a.moves_in_progress() == 0 && b.moves_in_progress() == 0
    })
    .await;
    assert!(over, "the moves did not end once the fleet followed");
    assert!(held.is_held());
    assert!(a.try_acquire(&key, opts()).await.unwrap().is_none());
    held.release().await.unwrap();
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// A hand-off through the shard decided before a reload that moves its key, and run once the
/// lease followed the key (a row on its new shard), does not hand the key over on the old
/// shard alone, where the fleet stops looking once the move ends: the rows are released and
/// the waiter takes the key where it lives now.
#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_decided_before_a_reload_that_moved_its_key_takes_the_key_where_it_lives() {
    let cluster = Cluster::start(3).await.unwrap();
    let (two, three) = (config_for(&cluster, 2), config_for(&cluster, 3));
    let setup = LockRouter::from_yaml_str(&three).await.unwrap();
    setup.migrate().await.unwrap();
    let key = common::key_on(&setup, "k", "s3");
    setup.shutdown().await.unwrap();
    let router = LockRouter::from_yaml_str(&two).await.unwrap();
    let grown = Config::from_yaml_str(&three).unwrap();
    let held = router
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(5)))
        .await
        .unwrap();
    // Other terms than the holder's: handed over by the release statement, not in memory.
    let waiter = tokio::spawn({
        let (router, key) = (router.clone(), key.clone());
        async move {
            let opts = AcquireOptions::new()
                .ttl(Duration::from_secs(7))
                .wait(Duration::from_secs(30));
            router.acquire(&key, opts).await
        }
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the waiter did not queue");
    let handoff = LockRouter::hold_next_handoff();
    drop(held);
    router.reload(grown).await.unwrap();
    until_followed(
        &router,
        Duration::from_secs(10),
        "the ended lease did not follow its key",
    )
    .await;
    drop(handoff);

    let guard = waiter.await.unwrap().unwrap();
    let (shard, row) = router.inspect(&key).await.unwrap();
    assert_eq!(shard, "s3");
    assert_eq!(
        row.and_then(|r| r.owner).as_deref(),
        Some(guard.owner()),
        "the waiter holds the key on its old shard only"
    );
    guard.release().await.unwrap();
    router.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_database_back_under_another_name_within_the_window_is_taken_once() {
    let cluster = Cluster::start(4).await.unwrap();
    let url = |i: usize| cluster.shard(i).url();
    let four = listing(
        &[
            ("s1", url(0)),
            ("s2", url(1)),
            ("s3", url(2)),
            ("s4", url(3)),
        ],
        "",
    );
    let three = listing(&[("s1", url(0)), ("s2", url(1)), ("s3", url(2))], "");
    // s4's database back as "s5".
    let back = listing(
        &[
            ("s1", url(0)),
            ("s2", url(1)),
            ("s3", url(2)),
            ("s5", url(3)),
        ],
        "",
    );
    let router = LockRouter::new(four.clone()).await.unwrap();
    router.migrate().await.unwrap();
    let probe = LockRouter::new(back.clone()).await.unwrap();
    let key = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| router.shard_for(k).unwrap() == "s4" && probe.shard_for(k).unwrap() == "s5")
        .unwrap();
    router.reload(three).await.unwrap();
    router.reload(back).await.unwrap();
    assert!(router.moves_in_progress() > 0);
    // Its previous placements are s4 (the same database as s5) and another shard of three.
    let g = router
        .try_acquire(&key, AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap()
        .expect("nobody holds it: the database is taken once, not twice under two owners");
    assert_eq!(g.shard(), "s5");
    g.release().await.unwrap();

    // A namespace's bucket count cannot change in a reload.
    let err = router
        .reload(listing(
            &[
                ("s1", url(0)),
                ("s2", url(1)),
                ("s3", url(2)),
                ("s5", url(3)),
            ],
            "namespaces:\n  default:\n    buckets: 4\n",
        ))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("namespaces.default.buckets"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn force_release_frees_a_moved_key_where_a_process_that_did_not_reload_holds_it() {
    let (_cluster, a, b, key, three) = two_routers_and_a_key_on_s4().await;
    let held = a
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(1)))
        .await
        .unwrap();
    b.reload(three).await.unwrap();
    let released = b
        .force_release(&key)
        .await
        .unwrap()
        .expect("a holds it on s4");
    assert_eq!(released.shard, "s4");
    let noticed = tokio::time::timeout(Duration::from_secs(5), held.lost()).await;
    assert!(noticed.is_ok(), "the holder learns it lost the lock");
    let next = b
        .try_acquire(&key, AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap()
        .expect("free");
    assert!(next.fence() > held.fence());
    next.release().await.unwrap();
}

/// A process started with a new topology while its fleet still runs the old one (a rolling
/// restart onto a changed config) grants nothing until every live instance runs its topology
/// with no move in force: it cannot know where the others still place a moved key.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_started_with_another_topology_grants_nothing_until_its_fleet_agrees() {
    use shardlock::Error;
    let cluster = Cluster::start(3).await.unwrap();
    let beats = "cleaner:\n  heartbeat-interval: 100ms\n";
    let (two, three) = (
        config_for(&cluster, 2) + beats,
        config_for(&cluster, 3) + beats,
    );
    let setup = LockRouter::from_yaml_str(&three).await.unwrap();
    setup.migrate().await.unwrap();
    setup.shutdown().await.unwrap();
    let old = LockRouter::from_yaml_str(&two).await.unwrap();
    let new = LockRouter::from_yaml_str(&three).await.unwrap();
    // A key the grow moves to s3, held by the process on the old topology.
    let key = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| new.shard_for(k).unwrap() == "s3")
        .unwrap();
    assert_ne!(old.shard_for(&key).unwrap(), "s3");
    let held = old.acquire(&key, AcquireOptions::new()).await.unwrap();
    refused_for(&new, &key, &old).await;
    assert!(matches!(
        new.lock_in_transaction("any", Duration::ZERO).await,
        Err(Error::Unavailable { .. })
    ));
    // A service of another fleet (it never shares keys with these) runs its own topology.
    let other = LockRouter::from_yaml_str(&format!("instance:\n  fleet: other\n{three}"))
        .await
        .unwrap();
    let theirs = other
        .try_acquire("other-team:1", AcquireOptions::new())
        .await
        .unwrap()
        .expect("not held by anyone");
    theirs.release().await.unwrap();
    other.shutdown().await.unwrap();

    // The old process reloads to the new topology; its lease follows the key. Once its move
    // is over (and it has said so with a heartbeat), the new process joins.
    old.reload(Config::from_yaml_str(&three).unwrap())
        .await
        .unwrap();
    let joined = loop {
        match new.try_acquire(&key, AcquireOptions::new()).await {
            Err(Error::Unavailable { .. }) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other.unwrap(),
        }
    };
    assert!(joined.is_none(), "granted a key the old process holds");
    assert!(held.is_held());
    let fence = held.fence();
    held.release().await.unwrap();
    let next = new.acquire(&key, AcquireOptions::new()).await.unwrap();
    assert!(next.fence() > fence);
    next.release().await.unwrap();
}

/// A caller that gives up while its moved key's previous shard is raising its fence (the last
/// step of the acquire) leaves no lease behind: the grant on the key's new shard is given back
/// as the one on its previous shard is.
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_of_a_moved_key_given_up_half_way_leaves_no_lease() {
    let cluster = Cluster::start(2).await.unwrap();
    // The key's previous shard answers slowly, so the acquire can be dropped mid-step.
    let proxy = Proxy::start(cluster.shard(1).port()).await.unwrap();
    let policy = "routing:\n  move-window: 60s\nnamespaces:\n  default:\n    ttl: 60s\n";
    let s1 = format!("  - name: s1\n    url: {}\n", cluster.shard(0).url());
    let s2 = format!(
        "  - name: s2\n    url: {}\n    statement-timeout: 10s\n    \
         pool: {{ wait-timeout: 10s, create-timeout: 10s }}\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&format!("shards:\n{s1}{s2}{policy}"))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let mut on_s2 = (0..)
        .map(|i| format!("k:{i}"))
        .filter(|k| router.shard_for(k).unwrap() == "s2");
    let (key, warm) = (on_s2.next().unwrap(), on_s2.next().unwrap());
    let one = Config::from_yaml_str(&format!("shards:\n{s1}{policy}")).unwrap();
    router.reload(one).await.unwrap();
    assert_eq!(router.moves_in_progress(), 1);
    // A moved key taken and released first, so that s2's connections are open.
    router
        .acquire(&warm, AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    proxy.set(ProxyMode::Delay(Duration::from_millis(250)));

    // Taken on s2 (the previous shard), then on s1; dropped once s1's row shows, while s2 is
    // asked to raise its fence.
    let mut acquire = Box::pin(router.acquire(&key, AcquireOptions::new()));
    let held_on_s1 = async {
        loop {
            let (shard, row) = router.inspect(&key).await.unwrap();
            assert_eq!(shard, "s1");
            if row.is_some_and(|r| r.is_held()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::select! {
        guard = &mut acquire => panic!("the acquire ended before it was dropped: {guard:?}"),
        () = held_on_s1 => {}
    }
    drop(acquire);
    proxy.set(ProxyMode::Pass);

    // Well within the 60 s ttl: the row is given back, and the key is free for anyone.
    let freed = common::eventually(Duration::from_secs(10), || async {
        let (_, row) = router.inspect(&key).await.unwrap();
        !row.is_some_and(|r| r.is_held())
    })
    .await;
    assert!(freed, "the grant on s1 was left behind");
    let next = router
        .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    next.release().await.unwrap();
}

/// Two shards, s1 reached through a proxy that can hold a statement back, and a router over
/// both (statements and lock waits given a minute, none slow for the breaker), reloaded onto
/// s1 alone (a 60 s move window): a key named from `prefix` moves from s2 to s1, and is taken
/// on both while the move is in force.
async fn a_key_moving_behind_a_proxy(prefix: &str) -> (Cluster, Proxy, LockRouter, String) {
    let (cluster, proxy, router, key, one) = a_key_to_move_behind_a_proxy(prefix, "", false).await;
    router.reload(one).await.unwrap();
    assert_eq!(router.moves_in_progress(), 1);
    (cluster, proxy, router, key)
}

/// [`a_key_moving_behind_a_proxy`] before its reload, with the config it reloads onto;
/// `extra` (YAML) in both configs. `renumbered`: the proxy keeps sessions of its own (see
/// `Proxy::renumber_sessions`), so that a session cut off there cannot be ended.
async fn a_key_to_move_behind_a_proxy(
    prefix: &str,
    extra: &str,
    renumbered: bool,
) -> (Cluster, Proxy, LockRouter, String, Config) {
    let cluster = Cluster::start(2).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    if renumbered {
        proxy.renumber_sessions();
    }
    let policy = format!("routing:\n  move-window: 60s\nbreaker:\n  slow-call: 60s\n{extra}");
    let shard = |name: &str, url: String| {
        format!("  - name: {name}\n    url: {url}\n    statement-timeout: 60s\n")
    };
    let (s1, s2) = (
        shard("s1", proxy.url()),
        shard("s2", cluster.shard(1).url()),
    );
    let router = LockRouter::from_yaml_str(&format!("shards:\n{s1}{s2}{policy}"))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let key = (0..)
        .map(|i| format!("{prefix}:{i}"))
        .find(|k| router.shard_for(k).unwrap() == "s2")
        .unwrap();
    let one = Config::from_yaml_str(&format!("shards:\n{s1}{policy}")).unwrap();
    (cluster, proxy, router, key, one)
}

/// Sets `proxy` to hold back the first statement naming `key` (a grant of it on s1), and
/// acquires `key` with `opts` in a task of its own.
fn acquire_held_back_on_s1(
    proxy: &Proxy,
    router: &LockRouter,
    key: &str,
    opts: AcquireOptions,
) -> tokio::task::JoinHandle<shardlock::Result<shardlock::LockGuard>> {
    proxy.set(ProxyMode::PauseTo(Box::leak(
        key.to_owned().into_bytes().into_boxed_slice(),
    )));
    let (router, key) = (router.clone(), key.to_owned());
    tokio::spawn(async move { router.acquire(&key, opts).await })
}

/// Waits until `proxy` holds back the statement [`acquire_held_back_on_s1`] sent.
async fn held_back(proxy: &Proxy) {
    tokio::time::timeout(Duration::from_secs(60), proxy.wait_for(ProxyMode::Paused))
        .await
        .expect("the grant on s1 never reached the link");
}

/// A lease whose key moved may find the key's row on its new shard held a moment by another
/// process: one whose move started earlier or later takes the key's shards in another order,
/// and gives back what it took once it finds the lease's row. The lease takes the row once it
/// is free (within half the move window) and stays held: it was reported lost at the first
/// sight of that row (two processes across grow and shrink saw a release fail so).
#[tokio::test(flavor = "multi_thread")]
async fn a_moved_lease_whose_new_row_is_held_a_moment_takes_it_once_free() {
    let (cluster, proxy, router, key, one) =
        a_key_to_move_behind_a_proxy("held-a-moment", "", false).await;
    let held = router
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(10)))
        .await
        .unwrap();
    let mut s1 = cluster.shard(0).connect().await.unwrap();
    s1.exec_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         VALUES (?, 'another', 1, 60000, NOW(3) + INTERVAL 1 MINUTE, NOW(3))",
        (key.as_str(),),
    )
    .await
    .unwrap();
    // The lease's first try on s1 is held back until the link is set to hold back the next;
    // it then finds the row held.
    let naming: &'static [u8] = Box::leak(key.clone().into_bytes().into_boxed_slice());
    proxy.set(ProxyMode::PauseTo(naming));
    router.reload(one).await.unwrap();
    held_back(&proxy).await;
    proxy.set(ProxyMode::PauseTo(naming));
    let tried_again = common::eventually(Duration::from_secs(30), || async {
        proxy.mode() == ProxyMode::Paused || !held.is_held()
    })
    .await;
    assert!(
        held.is_held(),
        "a lease whose moved key's row on the new shard was held a moment was lost"
    );
    assert!(tried_again, "the lease never tried its new shard again");

    s1.exec_drop(
        "DELETE FROM shardlock_lease WHERE lock_key = ? AND owner = 'another'",
        (key.as_str(),),
    )
    .await
    .unwrap();
    assert_eq!(s1.affected_rows(), 1);
    proxy.set(ProxyMode::Pass);
    until_followed(
        &router,
        Duration::from_secs(30),
        "the lease never took its key's new row",
    )
    .await;
    assert!(held.is_held());
    held.release().await.unwrap();
}

/// A lease whose key moved takes the key on its new shard with its reply lost, and cannot
/// reach that shard since. The row it took there counts as the lease's (the fleet's move may
/// end on it), but nothing renews it: once it runs out, another process may take the key
/// there alone. The lease is lost by then; it stayed held while its tries failed, until half
/// the move window, and on after that if the next try found the key taken.
#[tokio::test(flavor = "multi_thread")]
async fn a_moved_lease_whose_row_taken_on_the_new_shard_with_its_reply_lost_runs_out_is_lost() {
    // No heartbeats: through the cut-off link they would lapse, and lose the lease anyway.
    let (cluster, proxy, router, key, one) =
        a_key_to_move_behind_a_proxy("reply-lost", common::NO_HEARTBEAT, false).await;
    let held = router
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(8)))
        .await
        .unwrap();
    let naming: &'static [u8] = Box::leak(key.clone().into_bytes().into_boxed_slice());
    proxy.set(ProxyMode::LoseReplyToThenBlackhole(naming));
    router.reload(one).await.unwrap();
    let taken = common::eventually(Duration::from_secs(30), || {
        let (s1, key, owner) = (cluster.shard(0), key.as_str(), held.owner());
        async move {
            let n: Option<u64> = s1
                .connect()
                .await
                .unwrap()
                .exec_first(
                    "SELECT COUNT(*) FROM shardlock_lease WHERE lock_key = ? AND owner = ?",
                    (key, owner),
                )
                .await
                .unwrap();
            n == Some(1)
        }
    })
    .await;
    assert!(taken, "the lease's try never took the key on s1");
    let seen = tokio::time::Instant::now();
    assert!(held.is_held(), "lost before the test could look");

    // Its row on s1 ends 8 s after the try was sent, before `seen`; half the move window is
    // 30 s. Renewed on s2 meanwhile, the lease never says it is held past that row's end.
    let lost = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            assert!(
                held.held_until() <= seen + Duration::from_secs(8),
                "a lease whose try on the new shard went unheard said it was held past the end \
                 of the row that try took"
            );
            tokio::select! {
                _ = held.lost() => return,
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
        }
    })
    .await;
    assert!(
        lost.is_ok(),
        "a lease whose row taken on the new shard with its reply lost ran out was still held"
    );
    proxy.set(ProxyMode::Pass);
    assert!(matches!(
        held.release().await,
        Err(shardlock::Error::LockLost { .. })
    ));
}

/// Where a session cut off on the wire cannot be ended (behind a proxy that keeps sessions of
/// its own, as here; on a Galera node), a lease following its moved key whose first try was
/// cut off, and whose retry found someone else's row, cannot know that the try will not land
/// once the row is free, in a row of its own nobody renews (the fleet's move may end on it).
/// It is lost once such a row may have run out, saying so, not held on while the row stays
/// taken: it took that answer for proof that no try of its would land.
#[tokio::test(flavor = "multi_thread")]
async fn a_moved_lease_whose_cut_off_try_may_still_land_is_lost_when_that_row_may_run_out() {
    let warnings = capture_warnings();
    let (cluster, proxy, router, key, one) =
        a_key_to_move_behind_a_proxy("cut-off", "", true).await;
    let held = router
        .acquire(&key, AcquireOptions::new().ttl(Duration::from_secs(8)))
        .await
        .unwrap();
    // Someone else's row on s1, the key's new shard, for a minute.
    let other = common::backend_at(&cluster.shard(0).url())
        .acquire(&common::grant_request(key.as_bytes(), "someone", 0))
        .await
        .unwrap();
    assert!(
        matches!(other, shardlock_mysql::Attempt::Granted { .. }),
        "{other:?}"
    );
    let naming: &'static [u8] = Box::leak(key.clone().into_bytes().into_boxed_slice());
    proxy.set(ProxyMode::StrandTo(naming));
    router.reload(one).await.unwrap();

    let lost = tokio::time::timeout(Duration::from_secs(60), held.lost()).await;
    assert!(lost.is_ok(), "the lease was never lost");
    assert_eq!(
        proxy.mode(),
        ProxyMode::Pass,
        "the follow's try was not cut off"
    );
    // Logged once the holder is woken: looked for until it is.
    let logged = || String::from_utf8(warnings.lock().unwrap().clone()).unwrap();
    let said = common::eventually(Duration::from_secs(10), || async {
        logged().contains("a try on the new shard whose outcome is unknown may have taken the key")
    })
    .await;
    assert!(
        said,
        "a lease whose cut-off try may still land was not lost for it: {}",
        logged()
    );
}

/// An acquire of a moved key whose row on the key's previous shard is taken or freed after
/// its grant there, while the key's new shard is asked (it ran out on a slow shard, or was
/// force-released), finds the key busy and polls again: it ended in `LockLost` for a lock it
/// never held, which ended an election campaign and a semaphore's acquire with wait left.
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_whose_moved_keys_earlier_row_was_freed_meanwhile_polls_again() {
    let (cluster, proxy, router, key) = a_key_moving_behind_a_proxy("freed-meanwhile").await;
    // Taken on s2 (the previous shard); its grant on s1 waits while s2's row is freed.
    let opts = AcquireOptions::new().wait(Duration::from_secs(30));
    let acquiring = acquire_held_back_on_s1(&proxy, &router, &key, opts);
    held_back(&proxy).await;
    let mut s2_conn = cluster.shard(1).connect().await.unwrap();
    s2_conn
        .exec_drop(
            "DELETE FROM shardlock_lease WHERE lock_key = ?",
            (key.as_str(),),
        )
        .await
        .unwrap();
    assert_eq!(s2_conn.affected_rows(), 1, "the grant on s2 left no row");
    proxy.set(ProxyMode::Pass);

    let guard = acquiring.await.unwrap().unwrap();
    assert!(guard.is_held());
    assert_eq!(guard.shard(), "s1");
    guard.release().await.unwrap();
}

/// An acquire of a moved key whose grant on the key's previous shard runs out while its new
/// shard is asked (a slow shard) finds the key busy and polls again: its grant answered in
/// time there, it was handed a guard already lost, its row on the previous shard ended (free
/// for anyone placing the key there).
#[tokio::test(flavor = "multi_thread")]
async fn an_acquire_whose_moved_keys_earlier_grant_ran_out_meanwhile_polls_again() {
    let (cluster, proxy, router, key) = a_key_moving_behind_a_proxy("ran-out-meanwhile").await;
    // The key's row on s2, locked by another transaction.
    let first = router.acquire(&key, AcquireOptions::new()).await.unwrap();
    let mut competitor = Competitor::begin(cluster.shard(1), false).await.unwrap();
    let stored = competitor.key_of(first.owner()).await.unwrap().unwrap();
    first.release().await.unwrap();
    competitor.lock(&stored).await.unwrap();

    // A 10 s lease, asked on s2 at t0: granted there once the lock ends 4 s later, its row
    // ends on s2 by t0 + 10 s. Its grant on s1, asked after that, is held back 7 s: answered
    // after t0 + 11 s, within its own 10 s.
    let opts = AcquireOptions::new()
        .ttl(Duration::from_secs(10))
        .wait(Duration::from_secs(60));
    let acquiring = acquire_held_back_on_s1(&proxy, &router, &key, opts);
    // The grant on s2 waits for its row.
    common::until_a_row_lock_is_waited_for(cluster.shard(1)).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    competitor.end().await.unwrap();
    held_back(&proxy).await;
    tokio::time::sleep(Duration::from_secs(7)).await;
    proxy.set(ProxyMode::Pass);

    let guard = acquiring.await.unwrap().unwrap();
    assert!(
        guard.is_held(),
        "an acquire whose grant on the previous shard ran out was handed a guard already lost"
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_shard_whose_move_is_over_is_left_alone_once_its_pool_closed() {
    let cluster = Cluster::start(2).await.unwrap();
    let short = |yaml: String| yaml.replace("move-window: 3s", "move-window: 500ms");
    let router = LockRouter::from_yaml_str(&short(config_for(&cluster, 2)))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let one = Config::from_yaml_str(&short(config_for(&cluster, 1))).unwrap();
    router.reload(one).await.unwrap();
    // No other process: the move ends, and the pool of the shard that left closes (the
    // server sees no connection but the one asking).
    let drained = common::eventually(Duration::from_secs(60), || async {
        let mut s2 = cluster.shard(1).connect().await.unwrap();
        let threads: Option<(String, u64)> = s2
            .query_first("SHOW GLOBAL STATUS LIKE 'Threads_connected'")
            .await
            .unwrap();
        router.moves_in_progress() == 0 && threads.is_some_and(|(_, n)| n == 1)
    })
    .await;
    assert!(drained, "the shard that left was drained");
    // Joining reads the registry where the fleet may still be (here `migrate`, which covers
    // the same shards): not on that shard any more.
    let report = router
        .migrate()
        .await
        .expect("the registry's shards answer");
    assert_eq!(report.len(), 1, "{report:?}");
    // Nor cleaned or listed: only `status` still shows it, closed.
    let cleaned = router.clean_once().await.unwrap();
    assert!(
        cleaned
            .shards
            .iter()
            .all(|s| s.error.is_none() && s.shard == "s1"),
        "{cleaned:?}"
    );
    let listed = router.list(ListOptions::default()).await.unwrap();
    assert!(listed.failed.is_empty(), "{listed:?}");
    let status = router.status().await;
    assert!(
        status.iter().any(|s| s.name == "s2" && s.closed),
        "{status:?}"
    );
}

/// The config listing the first `n` shards of the cluster, for statements that may wait on a
/// row lock for long: none of it is a failing shard.
fn patient_config(cluster: &Cluster, n: usize) -> String {
    let mut yaml = String::from("shards:\n");
    for s in &cluster.shards()[..n] {
        yaml.push_str(&format!(
            "  - name: {}\n    url: {}\n    statement-timeout: 60s\n",
            s.name(),
            s.url()
        ));
    }
    yaml + "routing:\n  move-window: 500ms\nbreaker:\n  slow-call: 60s\n\
            cleaner:\n  heartbeat-interval: 100ms\n\
            namespaces:\n  default:\n    ttl: 1s\n    wait: 60s\n"
}

/// Two routers over the four shards of `cluster` (tables migrated), a key whose shards under
/// four and three shards `choose` accepts, and a transaction holding the key's row locked on
/// its shard under four (the row made by a lease taken and released).
async fn a_key_whose_row_is_locked(
    cluster: &Cluster,
    choose: impl Fn(&str, &str) -> bool,
) -> (LockRouter, LockRouter, String, shardlock::mysql_async::Conn) {
    let a = LockRouter::from_yaml_str(&patient_config(cluster, 4))
        .await
        .unwrap();
    a.migrate().await.unwrap();
    let b = LockRouter::from_yaml_str(&patient_config(cluster, 4))
        .await
        .unwrap();
    let three = LockRouter::from_yaml_str(&patient_config(cluster, 3))
        .await
        .unwrap();
    let key = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| choose(&a.shard_for(k).unwrap(), &three.shard_for(k).unwrap()))
        .unwrap();
    drop(three);
    let first = a.acquire(&key, AcquireOptions::new()).await.unwrap();
    first.release().await.unwrap();
    let shard = shard_named(cluster, &a.shard_for(&key).unwrap());
    let mut blocker = shard.connect().await.unwrap();
    blocker.query_drop("START TRANSACTION").await.unwrap();
    blocker
        .exec_drop(
            "SELECT 1 FROM shardlock_lease WHERE lock_key = ? FOR UPDATE",
            (key.as_str(),),
        )
        .await
        .unwrap();
    (a, b, key, blocker)
}

fn shard_named<'c>(cluster: &'c Cluster, name: &str) -> &'c shardlock_testkit::Shard {
    cluster.shards().iter().find(|s| s.name() == name).unwrap()
}

/// An acquire's statement sent under the topology before a reload that runs only after the
/// fleet ended the key's move (held up here behind another transaction's lock on the key's
/// row; a paused process or a slow shard alike) grants on a shard nobody looks at for the key
/// any more, while the key may be held where it lives now. That grant is given back, not
/// handed out, and the acquire waits for the key where it lives now.
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_sent_before_a_reload_that_lands_after_the_move_ended_is_given_back() {
    let cluster = Cluster::start(4).await.unwrap();
    let (a, b, key, mut blocker) =
        a_key_whose_row_is_locked(&cluster, |four, _| four == "s4").await;

    let mut acquiring = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.acquire(&key, AcquireOptions::new()).await }
    });
    // a's statement waits for the row on s4.
    common::until_a_row_lock_is_waited_for(cluster.shard(3)).await;

    let three = Config::from_yaml_str(&patient_config(&cluster, 3)).unwrap();
    a.reload(three.clone()).await.unwrap();
    b.reload(three).await.unwrap();
    // Both advertise the new topology and the window passed: b's move is over, and b takes
    // the key where it lives now, on s1–s3 alone.
    let over = common::eventually(Duration::from_secs(30), || async {
        b.moves_in_progress() == 0
    })
    .await;
    assert!(over, "b's move never ended");
    let theirs = b
        .acquire(&key, AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap();
    assert_ne!(theirs.shard(), "s4");

    // a's statement, sent under the old topology, now runs and grants on s4.
    blocker.query_drop("ROLLBACK").await.unwrap();
    let given_back = common::eventually(Duration::from_secs(30), || async {
        a.stats().stale_grants == 1
    });
    tokio::select! {
        got = &mut acquiring => {
            let got = got.unwrap();
            panic!(
                "a was handed the key while b holds it on {}: {:?}",
                theirs.shard(),
                got.map(|g| (g.shard().to_owned(), g.is_held()))
            );
        }
        given_back = given_back => assert!(given_back, "{:?}", a.stats()),
    }

    // Once b lets go, a takes the key where it lives now, above b's fence.
    let fence = theirs.fence();
    theirs.release().await.unwrap();
    let ours = acquiring.await.unwrap().unwrap();
    assert_eq!(ours.shard(), a.shard_for(&key).unwrap());
    assert!(ours.fence() > fence);
    ours.release().await.unwrap();
}

/// A try (no wait) whose statement, sent under the placement before a reload, granted only
/// after it on the shard the key left gives that grant back and tries once more where the key
/// lives now: a free key is not answered `None` (a `run_exclusive` would skip its run).
#[tokio::test(flavor = "multi_thread")]
async fn a_try_whose_grant_went_stale_in_a_reload_tries_again_where_the_key_lives() {
    let cluster = Cluster::start(4).await.unwrap();
    let (a, _b, key, mut blocker) =
        a_key_whose_row_is_locked(&cluster, |four, _| four == "s4").await;
    let trying = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.try_acquire(&key, AcquireOptions::new()).await }
    });
    common::until_a_row_lock_is_waited_for(cluster.shard(3)).await;

    a.reload(Config::from_yaml_str(&patient_config(&cluster, 3)).unwrap())
        .await
        .unwrap();
    blocker.query_drop("ROLLBACK").await.unwrap();
    let ours = trying
        .await
        .unwrap()
        .unwrap()
        .expect("the key is free where it lives now");
    assert_eq!(ours.shard(), a.shard_for(&key).unwrap());
    assert_eq!(a.stats().stale_grants, 1);
    ours.release().await.unwrap();
}

/// A grant whose statement ran across a reload that left its key where it was (and gave it no
/// earlier location the grant missed) is kept, not given back and taken again.
#[tokio::test(flavor = "multi_thread")]
async fn a_grant_across_a_reload_that_left_its_key_in_place_is_kept() {
    let cluster = Cluster::start(4).await.unwrap();
    let (a, _b, key, mut blocker) =
        a_key_whose_row_is_locked(&cluster, |four, three| four == three).await;
    let home = a.shard_for(&key).unwrap();
    let acquiring = tokio::spawn({
        let (a, key) = (a.clone(), key.clone());
        async move { a.acquire(&key, AcquireOptions::new()).await }
    });
    common::until_a_row_lock_is_waited_for(shard_named(&cluster, &home)).await;

    a.reload(Config::from_yaml_str(&patient_config(&cluster, 3)).unwrap())
        .await
        .unwrap();
    assert_eq!(a.shard_for(&key).unwrap(), home);
    blocker.query_drop("ROLLBACK").await.unwrap();
    let ours = acquiring.await.unwrap().unwrap();
    assert_eq!(ours.shard(), home);
    assert_eq!(a.stats().stale_grants, 0, "a grant in place was given back");
    ours.release().await.unwrap();
}

/// A lease of a key over 255 bytes (its row holds a digest, not the key) keeps a move in force
/// until it ends, also once it followed its key: where the key lives now cannot be told from
/// its row, nor whether the owner's rows on other shards are where it followed or where it
/// lived under an earlier topology (a follow to a third shard still under way).
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_of_a_key_over_255_bytes_keeps_a_move_in_force_until_it_ends() {
    let cluster = Cluster::start(3).await.unwrap();
    let listing = |names: &[&str]| shards_named(&cluster, names, "", RUN_AHEAD);
    let (before, after) = (listing(&["s1", "s2"]), listing(&["s1", "s2", "s3"]));
    let setup = LockRouter::new(after.clone()).await.unwrap();
    setup.migrate().await.unwrap();
    let router = LockRouter::new(before).await.unwrap();
    let key = (0..)
        .map(|i| format!("{i}:{}", "k".repeat(300)))
        .find(|k| router.shard_for(k).unwrap() != setup.shard_for(k).unwrap())
        .unwrap();
    setup.shutdown().await.unwrap();
    let held = router.acquire(&key, AcquireOptions::new()).await.unwrap();

    router.reload(after).await.unwrap();
    let decided = common::eventually(Duration::from_secs(30), || async {
        router.stats().moves_kept > 0 || router.moves_in_progress() == 0
    })
    .await;
    assert!(decided, "the move's carry never ran");
    assert!(held.is_held());
    assert_eq!(
        router.moves_in_progress(),
        1,
        "the move ended while a lease of a key whose placement its row cannot tell was live"
    );
    held.release().await.unwrap();
    let over = common::eventually(Duration::from_secs(30), || async {
        router.moves_in_progress() == 0
    })
    .await;
    assert!(over, "the move did not end once the lease did");
}

/// Whether the fleet's placement record read through `conn` names two placements, one of them
/// with shard `s2` (a move to s2 in force); `None` without a record.
async fn names_the_move_to_s2(conn: &mut shardlock::mysql_async::Conn) -> Option<bool> {
    conn.query_first(
        "SELECT JSON_LENGTH(placements) = 2 AND placements LIKE '%\"name\":\"s2\"%' \
         FROM shardlock_placement WHERE fleet = 'default'",
    )
    .await
    .unwrap()
}

/// A reload undone while a held lease is still trying to follow its key to a shard that does
/// not answer: the lease stays held where it was, as the fleet places the key there again.
/// Its follow kept trying the shard the undone reload had added and reported the lease lost
/// at that move's end, though nobody else could take the key meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_following_its_key_to_a_silent_shard_stays_held_when_the_reload_is_undone() {
    let cluster = Cluster::start(4).await.unwrap();
    let proxy = Proxy::start(cluster.shard(3).port()).await.unwrap();
    // Both reloads wait for the silent shard (its identity, the placement record): the undone
    // move's follow must still be trying when the second one lands, on a busy machine too.
    let tail = "routing:\n  move-window: 12s\ncleaner:\n  registry: static\n";
    let three = {
        let mut yaml = String::from("shards:\n");
        for s in &cluster.shards()[..3] {
            yaml.push_str(&format!("  - name: {}\n    url: {}\n", s.name(), s.url()));
        }
        yaml
    };
    let with_s4 = |url: String| {
        format!("{three}  - name: s4\n    url: {url}\n    statement-timeout: 300ms\n{tail}")
    };
    let three = format!("{three}{tail}");
    let placing = LockRouter::from_yaml_str(&with_s4(cluster.shard(3).url()))
        .await
        .unwrap();
    placing.migrate().await.unwrap();
    let key = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| placing.shard_for(k).unwrap() == "s4")
        .unwrap();
    placing.shutdown().await.unwrap();

    let router = LockRouter::from_yaml_str(&three).await.unwrap();
    let other = LockRouter::from_yaml_str(&three).await.unwrap();
    let held = router.acquire(&key, AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::Blackhole);
    let reloaded = tokio::time::Instant::now();
    router
        .reload(Config::from_yaml_str(&with_s4(proxy.url())).unwrap())
        .await
        .unwrap();
    assert_eq!(router.shard_for(&key).unwrap(), "s4");
    router
        .reload(Config::from_yaml_str(&three).unwrap())
        .await
        .unwrap();
    // The undone move's follow gave up 6 s after its reload; wait for a loss until past that.
    let past = reloaded + Duration::from_secs(8);
    let lost = tokio::time::timeout_at(past, held.lost()).await;
    if lost.is_ok() || !held.is_held() {
        panic!(
            "a lease whose move was undone was lost: {:?}",
            held.release().await
        );
    }
    let second = other
        .try_acquire(&key, AcquireOptions::new())
        .await
        .unwrap();
    assert!(second.is_none(), "a second holder of {key}");
    held.release().await.unwrap();
    proxy.set(ProxyMode::Pass);
    other.shutdown().await.unwrap();
    router.shutdown().await.unwrap();
}

/// A reload refused for a shard it cannot build (its password file cannot be read) changes
/// nothing of the topology in force, its breakers' settings neither. Before, the shards it kept
/// took the new settings before the new shard failed: a breaker set to open after fifty
/// failures in a row opened after one.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_refused_for_a_shard_it_cannot_build_leaves_the_breakers_as_they_were() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!(
        "shards:\n  - name: s1\n    url: {}\nbreaker:\n  consecutive-failures: 50\n  \
         slow-call: 60s\ncleaner:\n  registry: static\n",
        proxy.url()
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    let refused = yaml
        .replace("consecutive-failures: 50", "consecutive-failures: 1")
        .replace(
            "breaker:",
            "  - name: s2\n    url: mysql://root@127.0.0.1:1/other\n    \
             password-file: /nonexistent/shardlock-password\nbreaker:",
        );
    let answer = router
        .reload(Config::from_yaml_str(&refused).unwrap())
        .await;
    assert!(
        answer.is_err(),
        "a shard without its password file was taken"
    );

    // A few failures of the shard's (one call's tries), far from fifty.
    proxy.set(ProxyMode::Reset);
    let failed = router.try_acquire("k", AcquireOptions::new()).await;
    assert!(
        failed.is_err(),
        "an acquire through a reset link: {failed:?}"
    );
    let after = router.breaker_state("s1");
    assert_eq!(
        after,
        Some(shardlock::BreakerState::Closed),
        "a few failures opened a breaker set to fifty: the refused reload's settings were applied"
    );
}
