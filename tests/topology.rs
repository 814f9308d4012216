//! Live topology changes: reloads that move keys never let two holders exist, fences keep
//! rising across the move, and a reload that changes only policies moves nothing.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, Config, LockRouter};
use shardlock_testkit::{report, Cluster, Worker};

const KEYS: usize = 500;
const TASKS: usize = 32;
const ROUNDS: usize = 50;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";
const PATH_ENV: &str = "SHARDLOCK_TEST_CONFIG_PATH";
const POLICY: &str =
    "routing:\n  move-window: 3s\nnamespaces:\n  default:\n    ttl: 1s\n    wait: 30s\n";

/// The config listing the first `n` shards of the cluster.
fn config_for(cluster: &Cluster, n: usize) -> String {
    let mut yaml = String::from("shards:\n");
    for s in &cluster.shards()[..n] {
        yaml.push_str(&format!("  - name: {}\n    url: {}\n", s.name(), s.url()));
    }
    yaml.push_str(POLICY);
    yaml
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_across_grow_and_shrink_never_hold_a_key_twice() {
    let cluster = Cluster::start(4).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("shardlock.yaml");
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
    let (cluster, router, yaml) = common::start(3, "namespaces:\n  default:\n    ttl: 5s\n").await;
    let keys: Vec<String> = (0..1000).map(|i| format!("k:{i}")).collect();
    let before: Vec<String> = keys.iter().map(|k| router.shard_for(k).unwrap()).collect();
    let held = router.acquire("k:1", AcquireOptions::new()).await.unwrap();

    let changed = yaml.replace("ttl: 5s", "ttl: 7s");
    router
        .reload(Config::from_yaml_str(&changed).unwrap())
        .await
        .unwrap();
    assert_eq!(router.epoch(), 2);
    let after: Vec<String> = keys.iter().map(|k| router.shard_for(k).unwrap()).collect();
    assert_eq!(before, after, "no key moved");
    assert!(held.is_held(), "a lease held across the reload stays held");

    let writes_before = common::status_sum(&cluster, "Com_insert").await
        + common::status_sum(&cluster, "Com_update").await;
    let g = router.acquire("k:2", AcquireOptions::new()).await.unwrap();
    let writes = common::status_sum(&cluster, "Com_insert").await
        + common::status_sum(&cluster, "Com_update").await
        - writes_before;
    assert_eq!(
        writes, 1,
        "one statement: nothing to check on another shard"
    );
    let (_, row) = router.inspect("k:2").await.unwrap();
    assert_eq!(row.unwrap().ttl_ms, 7000, "the new policy applies");
    assert_eq!(router.stats().moved_grants, 0);
    g.release().await.unwrap();
    held.release().await.unwrap();

    // An invalid config is rejected with its field; the old one stays in force.
    let mut bad = Config::from_yaml_str(&changed).unwrap();
    bad.shards.clear();
    let err = router.reload(bad).await.unwrap_err();
    assert!(err.to_string().contains("shards"), "{err}");
    assert_eq!(router.epoch(), 2);
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
    let four = Config::from_yaml_str(&config_for(&cluster, 4)).unwrap();
    let router = LockRouter::new(four).await.unwrap();
    router.migrate().await.unwrap();
    let on_s4 = (0..)
        .map(|i| format!("k:{i}"))
        .find(|k| router.shard_for(k).unwrap() == "s4")
        .unwrap();
    let held = router.acquire(&on_s4, AcquireOptions::new()).await.unwrap();
    let opened = shard_status(&router, "s1").await.pool.size;
    assert!(opened > 0);

    let three = config_for(&cluster, 3).replace("move-window: 3s", "move-window: 500ms");
    router
        .reload(Config::from_yaml_str(&three).unwrap())
        .await
        .unwrap();
    let status = router.status().await;
    let s1 = status.iter().find(|s| s.name == "s1").unwrap();
    assert_eq!(
        s1.pool.size, opened,
        "s1 stayed: same pool, same connections"
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
