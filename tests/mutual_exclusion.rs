//! Mutual exclusion across OS processes: read-modify-write counters guarded by shardlock on
//! three shards, two processes × 32 tasks over 200 keys. Counts must be exact and every
//! write's fence must rise per key in commit order.

mod common;

use std::time::Duration;

use shardlock_testkit::Worker;

const KEYS: usize = 200;
const TASKS: usize = 32;
const ROUNDS: usize = 60;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_never_overlap_and_fences_rise_in_commit_order() {
    let (cluster, _router, yaml) = common::start(3, "").await;
    // The application's own tables live on s1 (any MySQL would do).
    let app_url = cluster.shard(0).url();
    let mut app = common::counters::create(&app_url, KEYS).await;

    let env = [
        (common::CONFIG_ENV, yaml.clone()),
        (APP_ENV, app_url.clone()),
    ];
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "counter", &env).unwrap())
        .collect();
    let mut done = 0;
    for w in workers {
        let n = w.finish_report("done ").await.unwrap()[0] as usize;
        done += n;
    }
    assert_eq!(done, 2 * TASKS * ROUNDS);

    common::counters::check(&mut app, 2 * TASKS * ROUNDS).await;
    assert_eq!(
        common::live_leases(&cluster).await,
        0,
        "every lease was released"
    );
}

/// Each of the 32 tasks does ROUNDS read-modify-write rounds under the key's lock.
async fn counter_worker() {
    common::counters::worker(APP_ENV, TASKS, ROUNDS, KEYS, Duration::from_secs(30))
        .await
        .unwrap();
}

crate::worker_entry! { "counter" => counter_worker() }
