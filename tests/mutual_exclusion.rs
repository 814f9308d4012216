//! Mutual exclusion across OS processes: read-modify-write counters guarded by shardlock on
//! three shards, two processes × 32 tasks over 200 keys. Counts must be exact and every
//! write's fence must rise per key in commit order.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use rand::Rng;
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{TxOpts, Value};
use shardlock::AcquireOptions;
use shardlock_testkit::{report, worker_main, Worker};

const KEYS: usize = 200;
const TASKS: usize = 32;
const ROUNDS: usize = 60;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_never_overlap_and_fences_rise_in_commit_order() {
    let (cluster, _router, yaml) = common::start(3, "").await;
    // The application's own tables live on s1 (any MySQL would do).
    let app_url = cluster.shard(0).url();
    let mut app = common::app_conn(
        &app_url,
        &[
            "CREATE TABLE counters (k VARCHAR(32) PRIMARY KEY, value BIGINT NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
            "CREATE TABLE writes (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(32) NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
        ],
    )
    .await;
    app.exec_batch(
        "INSERT INTO counters VALUES (?, 0, 0)",
        (0..KEYS).map(|i| (format!("c:{i}"),)),
    )
    .await
    .unwrap();

    let env = [
        (common::CONFIG_ENV, yaml.clone()),
        (APP_ENV, app_url.clone()),
    ];
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "counter", &env).unwrap())
        .collect();
    let mut done = 0;
    for w in workers {
        let (status, lines) = w.finish().await.unwrap();
        assert!(status.success(), "worker failed: {lines:?}");
        let n: usize = lines
            .iter()
            .find_map(|l| l.strip_prefix("done "))
            .expect("done line")
            .parse()
            .unwrap();
        done += n;
    }
    assert_eq!(done, 2 * TASKS * ROUNDS);

    let total: i64 = app
        .query_first("SELECT SUM(value) FROM counters")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        total as usize,
        2 * TASKS * ROUNDS,
        "a lost update means two holders overlapped"
    );
    let per_key: Vec<(String, i64)> = app.query("SELECT k, value FROM counters").await.unwrap();
    let writes: Vec<(String, u64)> = app
        .query("SELECT k, fence FROM writes ORDER BY id")
        .await
        .unwrap();
    let mut last: HashMap<&str, u64> = HashMap::new();
    let mut count: HashMap<&str, i64> = HashMap::new();
    for (k, fence) in &writes {
        let prev = last.insert(k, *fence).unwrap_or(0);
        assert!(*fence > prev, "fence of {k} went from {prev} to {fence}");
        *count.entry(k).or_default() += 1;
    }
    for (k, value) in &per_key {
        assert_eq!(count.get(k.as_str()).copied().unwrap_or(0), *value, "{k}");
    }
    assert_eq!(
        common::live_leases(&cluster).await,
        0,
        "every lease was released"
    );
}

/// Each of the 32 tasks does ROUNDS read-modify-write rounds under the key's lock.
async fn counter_worker() {
    let router = common::worker_router().await;
    let app_url = std::env::var(APP_ENV).unwrap();
    let pool = shardlock::mysql_async::Pool::new(app_url.as_str());
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (router, pool) = (router.clone(), pool.clone());
            tokio::spawn(async move {
                for _ in 0..ROUNDS {
                    let key = format!("c:{}", rand::rng().random_range(0..KEYS));
                    let guard = router
                        .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(30)))
                        .await
                        .expect("acquire");
                    let mut conn = pool.get_conn().await.unwrap();
                    let mut tx = conn.start_transaction(TxOpts::default()).await.unwrap();
                    let value: i64 = tx.exec_first("SELECT value FROM counters WHERE k = ?", (&key,)).await.unwrap().unwrap();
                    tokio::task::yield_now().await; // widen the race window a lock must close
                    shardlock::fenced_exec(
                        &mut tx,
                        "UPDATE counters SET value = :value, fence = :fence WHERE k = :k AND fence < :fence",
                        [("value", Value::from(value + 1)), ("k", Value::from(&key))],
                        guard.fence(),
                    )
                    .await
                    .expect("fenced write");
                    tx.exec_drop("INSERT INTO writes (k, fence) VALUES (?, ?)", (&key, guard.fence())).await.unwrap();
                    tx.commit().await.unwrap();
                    guard.release().await.expect("release");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    report!("done {}", TASKS * ROUNDS);
    router.shutdown().await.unwrap();
}

#[test]
#[ignore = "entry point of the worker processes spawned by the tests in this file"]
fn worker() {
    let Some(role) = worker_main() else { return };
    let rt = tokio::runtime::Runtime::new().unwrap();
    match role.as_str() {
        "counter" => rt.block_on(counter_worker()),
        other => panic!("unknown role {other}"),
    }
}
