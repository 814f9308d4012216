//! The read-modify-write counter workload shared by the mutual-exclusion tests: without the
//! lock, two holders would read the same value and lose an update; every write records its
//! fence.

use std::collections::HashMap;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Conn, Pool, TxOpts, Value};
use shardlock::{AcquireOptions, LockRouter};

/// Creates `counters` (one row per key `c:0..keys`) and `writes` at `url`.
pub async fn create(url: &str, keys: usize) -> Conn {
    let mut app = super::app_conn(
        url,
        &[
            "CREATE TABLE counters (k VARCHAR(32) PRIMARY KEY, value BIGINT NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
            "CREATE TABLE writes (id BIGINT AUTO_INCREMENT PRIMARY KEY, k VARCHAR(32) NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
        ],
    )
    .await;
    app.exec_batch(
        "INSERT INTO counters VALUES (?, 0, 0)",
        (0..keys).map(|i| (format!("c:{i}"),)),
    )
    .await
    .unwrap();
    app
}

/// One round under the lock of `key`: read the counter, write it back plus one (fenced), and
/// log the write with its fence, in one transaction. Fails only if the lock could not be
/// taken; a release the shard could not answer is left to the lease's expiry.
pub async fn round(
    router: &LockRouter,
    pool: &Pool,
    key: &str,
    opts: AcquireOptions,
) -> shardlock::Result<()> {
    let guard = router.acquire(key, opts).await?;
    let wrote = fenced_increment(pool, key, guard.fence(), false).await;
    assert_eq!(wrote, Ok(true), "fenced write of {key}");
    match guard.release().await {
        Err(e) if !e.is_unavailable() => panic!("release: {e}"),
        _ => Ok(()),
    }
}

/// One increment of counter `key` under `fence` through `fenced_exec`, logged in `writes`, in
/// one transaction. `Ok(false)`: a newer holder had written (the fenced write was rejected).
/// With `lock_read`, the read locks the row, so that a frozen holder's open transaction is
/// waited for rather than overwritten; without it, two holders at once lose an update, which
/// `check` finds.
pub async fn fenced_increment(
    pool: &Pool,
    key: &str,
    fence: u64,
    lock_read: bool,
) -> Result<bool, String> {
    let err = |e: shardlock::mysql_async::Error| e.to_string();
    let mut conn = pool.get_conn().await.map_err(err)?;
    let mut tx = conn
        .start_transaction(TxOpts::default())
        .await
        .map_err(err)?;
    let read = if lock_read {
        "SELECT value FROM counters WHERE k = ? FOR UPDATE"
    } else {
        "SELECT value FROM counters WHERE k = ?"
    };
    let value: i64 = tx.exec_first(read, (key,)).await.map_err(err)?.unwrap_or(0);
    tokio::task::yield_now().await; // widen the race window a lock must close
    let wrote = shardlock::fenced_exec(
        &mut tx,
        "UPDATE counters SET value = :value, fence = :fence WHERE k = :k AND fence < :fence",
        [("value", Value::from(value + 1)), ("k", Value::from(key))],
        fence,
    )
    .await;
    if wrote.is_err() {
        let _ = tx.rollback().await;
        return Ok(false);
    }
    tx.exec_drop("INSERT INTO writes (k, fence) VALUES (?, ?)", (key, fence))
        .await
        .map_err(err)?;
    tx.commit().await.map_err(err)?;
    Ok(true)
}

/// Acquires that found their shard unavailable (their rounds were retried).
#[derive(Debug, Clone, Copy, Default)]
pub struct Unavailable {
    pub count: u64,
    /// When the last one was answered, in ms since the Unix epoch (0: never).
    pub last_ms: u64,
}

impl Unavailable {
    fn add(&mut self, other: Self) {
        self.count += other.count;
        self.last_ms = self.last_ms.max(other.last_ms);
    }
}

/// Now, in ms since the Unix epoch: comparable across the processes of one host.
pub fn epoch_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `tasks` tasks, each doing `rounds` rounds on random keys of `c:0..keys`; returns when all
/// are done, with the acquires that found their shard unavailable (those rounds are retried).
pub async fn run(
    router: &LockRouter,
    pool: &Pool,
    tasks: usize,
    rounds: usize,
    keys: usize,
    opts: AcquireOptions,
) -> Unavailable {
    use rand::Rng;
    let tasks: Vec<_> = (0..tasks)
        .map(|_| {
            let (router, pool, opts) = (router.clone(), pool.clone(), opts.clone());
            tokio::spawn(async move {
                let mut unavailable = Unavailable::default();
                for _ in 0..rounds {
                    let key = format!("c:{}", rand::rng().random_range(0..keys));
                    loop {
                        match round(&router, &pool, &key, opts.clone()).await {
                            Ok(()) => break,
                            Err(e) if e.is_unavailable() => {
                                unavailable.add(Unavailable {
                                    count: 1,
                                    last_ms: epoch_ms(),
                                });
                                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                            }
                            Err(e) => panic!("acquire {key}: {e}"),
                        }
                    }
                }
                unavailable
            })
        })
        .collect();
    let mut unavailable = Unavailable::default();
    for t in tasks {
        unavailable.add(t.await.unwrap());
    }
    unavailable
}

/// Counts are exact (`total` rounds in all) and fences rise per key in commit order.
pub async fn check(app: &mut Conn, total: usize) {
    let sum: i64 = app
        .query_first("SELECT SUM(value) FROM counters")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        sum as usize, total,
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
}

/// The body of a worker process of the counter tests: `tasks` tasks doing `rounds` rounds on
/// `c:0..keys` (acquires waiting up to `wait`) through the router its parent configured, with
/// the counters at the URL in `$app_env`. Reports `done <rounds> <acquires answered
/// Unavailable>` and gives back the router's shutdown.
pub async fn worker(
    app_env: &str,
    tasks: usize,
    rounds: usize,
    keys: usize,
    wait: std::time::Duration,
) -> shardlock::Result<()> {
    let router = super::worker_router().await;
    let app_url = std::env::var(app_env).unwrap();
    let pool = Pool::new(app_url.as_str());
    let unavailable = run(
        &router,
        &pool,
        tasks,
        rounds,
        keys,
        AcquireOptions::new().wait(wait),
    )
    .await;
    // Rounds, unavailable acquires, when the last was, calls an open breaker refused.
    shardlock_testkit::report!(
        "done {} {} {} {}",
        tasks * rounds,
        unavailable.count,
        unavailable.last_ms,
        router.stats().breaker_rejections
    );
    router.shutdown().await
}
