//! Shared setup for the integration tests: real MariaDB shards started by the testkit.
#![allow(dead_code, unreachable_pub)]

pub mod counters;
pub mod faults;
pub mod history;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Conn;
use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Cluster, Shard};

/// Environment variable carrying the YAML config to worker processes.
pub const CONFIG_ENV: &str = "SHARDLOCK_TEST_CONFIG";

/// Config lines for a test that counts a shard's writes: the static registry, so that no
/// heartbeat writes in the background (one every `heartbeat-interval`, and every 250 ms while
/// a router joins, e.g. until `migrate` made the tables its first beat missed). The placement
/// record is written in the background too, once: see [`until_placement_recorded`].
pub const NO_HEARTBEAT: &str = "cleaner:\n  registry: static\n";

/// The owner of `key`'s CAS row on `shard` (`None`: free, or no row).
pub async fn cas_owner(shard: &Shard, key: &str) -> Option<String> {
    let mut c = shard.connect().await.unwrap();
    let owner: Option<Option<String>> = c
        .exec_first("SELECT owner FROM shardlock_cas WHERE lock_key = ?", (key,))
        .await
        .unwrap();
    owner.flatten()
}

/// `n` fresh shards and a migrated router over them; `extra` is appended to the YAML.
pub async fn start(n: usize, extra: &str) -> (Cluster, LockRouter, String) {
    let cluster = Cluster::start(n).await.expect("start shards");
    let yaml = cluster.config_yaml(extra);
    let router = LockRouter::from_yaml_str(&yaml).await.expect("router");
    router.migrate().await.expect("migrate");
    (cluster, router, yaml)
}

/// The router of a worker process, from the config its parent passed.
pub async fn worker_router() -> LockRouter {
    let yaml = std::env::var(CONFIG_ENV).expect("worker needs its config");
    LockRouter::from_yaml_str(&yaml)
        .await
        .expect("worker router")
}

/// Statements that write rows, from the server's own counters. Lock statements are all
/// writes; reads by the tests themselves are not counted.
pub async fn dml_statements(shard: &Shard) -> u64 {
    shard.row_writes().await.unwrap()
}

/// Inserts of either form (`INSERT ... VALUES`, `INSERT ... SELECT`: an acquire is the
/// second) over all shards.
pub async fn inserts(cluster: &Cluster) -> u64 {
    status_sum(cluster, "Com_insert").await + status_sum(cluster, "Com_insert_select").await
}

/// Waits until every shard of `cluster` holds the record of where the default fleet places
/// keys: a router writes it on its current shards soon after its first grant (and again when
/// its placements change). A test that counts a shard's writes waits for it first.
pub async fn until_placement_recorded(cluster: &Cluster) {
    until_placement_recorded_on(cluster.shards()).await;
}

/// Waits until `router` itself recorded its placement (its record write landed on every
/// shard); panics after 30 s.
pub async fn until_router_recorded(router: &LockRouter) {
    let recorded = eventually(Duration::from_secs(30), || async {
        router.stats().placements_recorded > 0
    })
    .await;
    assert!(recorded, "the router never recorded its placement");
}

/// [`until_placement_recorded`] on `shards` alone.
pub async fn until_placement_recorded_on(shards: &[Shard]) {
    let recorded = eventually(Duration::from_secs(30), || async {
        for shard in shards {
            let mut c = shard.connect().await.unwrap();
            let found: Option<u64> = c
                .query_first("SELECT seq FROM shardlock_placement WHERE fleet = 'default'")
                .await
                .unwrap();
            if found.is_none() {
                return false;
            }
        }
        true
    })
    .await;
    assert!(recorded, "the router recorded its placement on every shard");
}

/// Waits until `shard` holds a record of the default fleet naming one placement alone, whose
/// JSON contains `containing` (the end of a move, recorded).
pub async fn until_recorded_alone(shard: &Shard, containing: &str) -> bool {
    eventually(Duration::from_secs(60), || async {
        let mut c = shard.connect().await.unwrap();
        let alone: Option<bool> = c
            .exec_first(
                "SELECT JSON_LENGTH(placements) = 1 AND LOCATE(?, placements) > 0 \
                 FROM shardlock_placement WHERE fleet = 'default'",
                (containing,),
            )
            .await
            .unwrap();
        alone == Some(true)
    })
    .await
}

/// Asserts that `router` grants `key` to nobody for a reason that says each of `says`.
pub async fn refused_saying(router: &LockRouter, key: &str, says: &[&str]) {
    match router.try_acquire(key, AcquireOptions::new()).await {
        Err(shardlock::Error::Unavailable { source, .. }) => {
            let why = shardlock::Report(&source).to_string();
            assert!(says.iter().all(|s| why.contains(s)), "{why}");
        }
        other => panic!(
            "granted, or refused otherwise: {:?}",
            other.map(|g| g.is_some())
        ),
    }
}

/// Migrates the shards of `yaml` with a router that grants nothing (so it records no
/// placement), then shuts it down.
pub async fn migrate_only(yaml: &str) {
    let setup = LockRouter::from_yaml_str(yaml).await.unwrap();
    setup.migrate().await.unwrap();
    setup.shutdown().await.unwrap();
}

/// `n` lock cycles on `router`: keys `{prefix}:0` to `{prefix}:{n-1}`, each acquired with
/// `opts` and released at once.
pub async fn lock_cycles(router: &LockRouter, prefix: &str, n: usize, opts: AcquireOptions) {
    for i in 0..n {
        let guard = router
            .acquire(&format!("{prefix}:{i}"), opts.clone())
            .await
            .unwrap();
        guard.release().await.unwrap();
    }
}

/// The backend of one shard `s1` at `url`, as a router builds it, with a 20 s statement
/// timeout: for a test's own statements on a shard (someone else's row, say).
pub fn backend_at(url: &str) -> shardlock_mysql::Shard {
    let yaml = format!("shards:\n  - name: s1\n    url: {url}\n    statement-timeout: 20s\n");
    let config = shardlock::Config::from_yaml_str(&yaml).unwrap();
    shardlock_mysql::Shard::new(&config.shards[0], 0).unwrap()
}

/// A grant of `key` to `owner` for a minute, with `reserve` fences set aside, as the backend
/// takes it.
pub fn grant_request(key: &[u8], owner: &str, reserve: u32) -> shardlock_mysql::GrantRequest {
    shardlock_mysql::GrantRequest {
        key: key.to_vec(),
        owner: owner.to_owned(),
        ttl_ms: 60_000,
        fence_floor: 0,
        reserve,
        trace: None,
    }
}

/// A transaction that holds `key`'s row of `table` on `shard` locked until it is dropped or
/// rolled back (the row made first if it is not there).
pub async fn row_locked(shard: &Shard, table: &str, key: &str) -> Conn {
    let mut conn = shard.connect().await.unwrap();
    conn.exec_drop(
        format!("INSERT IGNORE INTO {table} (lock_key) VALUES (?)"),
        (key,),
    )
    .await
    .unwrap();
    conn.query_drop("START TRANSACTION").await.unwrap();
    conn.exec_drop(
        format!("SELECT 1 FROM {table} WHERE lock_key = ? FOR UPDATE"),
        (key,),
    )
    .await
    .unwrap();
    conn
}

/// Kills the session of the one idle transaction on `shard` that holds row locks (a
/// transaction lock's, heartbeats and other statements aside).
pub async fn kill_the_idle_locking_session(shard: &Shard) {
    let mut admin = shard.connect().await.unwrap();
    let sessions: Vec<u64> = admin
        .query(
            "SELECT trx_mysql_thread_id FROM information_schema.INNODB_TRX \
             WHERE trx_query IS NULL AND trx_rows_locked > 0",
        )
        .await
        .unwrap();
    assert_eq!(sessions.len(), 1, "open transactions on {}", shard.name());
    admin
        .query_drop(format!("KILL {}", sessions[0]))
        .await
        .unwrap();
}

/// Sum of a global status counter over all shards.
pub async fn status_sum(cluster: &Cluster, name: &str) -> u64 {
    let mut sum = 0;
    for s in cluster.shards() {
        sum += s.global_status(name).await.unwrap();
    }
    sum
}

/// Number of live lease rows on every shard together: not released, not ended (by UTC: this
/// session keeps the server's time zone, while leases are written in UTC).
pub async fn live_leases(cluster: &Cluster) -> u64 {
    let mut total = 0;
    for s in cluster.shards() {
        let mut c = s.connect().await.unwrap();
        let n: Option<u64> = c
            .query_first(concat!(
                "SELECT COUNT(*) FROM shardlock_lease WHERE NOT ",
                shardlock_mysql::released!("owner"),
                " AND expires_at > UTC_TIMESTAMP(3)"
            ))
            .await
            .unwrap();
        total += n.unwrap_or(0);
    }
    total
}

/// Polls `check` every 20 ms until it is true or `limit` passes; returns whether it became true.
pub async fn eventually<F, Fut>(limit: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One cleaner pass of `router`, in a loop that waits for its effect: a pass that could not
/// try for the cleaner lock (its shard's breaker open for a moment after a fault) fails, and
/// the loop's next round tries again; any other failure panics.
#[allow(dead_code)]
pub async fn clean_pass(router: &LockRouter) {
    match router.clean_once().await {
        Err(e) if !e.is_unavailable() => panic!("a cleaner pass failed: {e}"),
        _ => {}
    }
}

/// Waits until `guard`'s lease is renewed (its end moves on); panics, saying `lost`, if the
/// lease is lost first.
pub async fn renewed(guard: &shardlock::LockGuard, lost: &str) {
    let until = guard.held_until();
    tokio::select! {
        _ = async {
            while guard.held_until() <= until {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        } => {}
        _ = guard.lost() => panic!("{lost}"),
    }
}

/// Tries `key` on `router` until it is granted (the shard frees it), releases it, and returns
/// when the grant's answer came: no later than the instant another process held it.
pub async fn first_grant(router: &LockRouter, key: &str) -> tokio::time::Instant {
    loop {
        let once = shardlock::AcquireOptions::new().wait(Duration::ZERO);
        if let Some(g) = router.try_acquire(key, once).await.unwrap() {
            let at = tokio::time::Instant::now();
            g.release().await.unwrap();
            return at;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A second router (another "instance") over the same cluster.
pub async fn worker_router_from(cluster: &Cluster) -> LockRouter {
    LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap()
}

/// A connection to `url` (the application's own database) after running `setup` on it.
pub async fn app_conn(url: &str, setup: &[&str]) -> Conn {
    let mut app = Conn::from_url(url).await.unwrap();
    for statement in setup {
        app.query_drop(*statement)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    app
}

/// The `#[test]` entry point of worker processes: runs the async function named by the role.
#[macro_export]
macro_rules! worker_entry {
    ($($role:literal => $run:expr),* $(,)?) => {
        #[test]
        #[ignore = "entry point of the worker processes spawned by the tests in this file"]
        fn worker() {
            let Some(role) = shardlock_testkit::worker_main() else { return };
            // Warnings (a lease lost, and why) on the worker's stderr, which the test shows
            // when it fails.
            let _ = tracing_subscriber::fmt()
                .with_env_filter("shardlock=warn")
                .with_writer(std::io::stderr)
                .try_init();
            let rt = tokio::runtime::Runtime::new().unwrap();
            match role.as_str() {
                $($role => rt.block_on($run),)*
                other => panic!("unknown role {other}"),
            }
        }
    };
}

/// Starts `n` transaction locks of `key` through `router` (each rolled back once it has the
/// row), and waits until `waiting` statements on `shard` wait for a row lock; their tasks.
#[allow(dead_code)]
pub async fn tx_lock_waiters(
    router: &LockRouter,
    key: &str,
    n: usize,
    shard: &Shard,
    waiting: u64,
) -> Vec<tokio::task::JoinHandle<shardlock::Result<()>>> {
    let waiters = (0..n)
        .map(|_| {
            let (router, key) = (router.clone(), key.to_owned());
            tokio::spawn(async move {
                let tx = router
                    .lock_in_transaction(&key, Duration::from_secs(60))
                    .await?;
                tx.rollback().await
            })
        })
        .collect();
    let waited = eventually(Duration::from_secs(30), || async {
        shard.lock_waits_now().await.unwrap() >= waiting
    })
    .await;
    assert!(waited, "the transaction locks never waited for their row");
    waiters
}

/// Waits until a statement on `shard` waits for a row lock (another transaction holds the
/// row); panics after 30 s, with what the server's sessions were doing. Read from the server's
/// live counter: `information_schema.INNODB_TRX` is a snapshot that the server renews only
/// after 100 ms without readers, so polled faster it can show a wait that began later never.
pub async fn until_a_row_lock_is_waited_for(shard: &Shard) {
    let started = std::time::Instant::now();
    while shard.lock_waits_now().await.unwrap() == 0 {
        if started.elapsed() > Duration::from_secs(30) {
            let mut conn = shard.connect().await.unwrap();
            let sessions: Vec<String> = conn
                .query(
                    "SELECT CONCAT_WS(' | ', ID, COMMAND, TIME, STATE, LEFT(INFO, 120)) \
                     FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID()",
                )
                .await
                .unwrap();
            panic!(
                "no statement waited for a row lock on {}: sessions {sessions:?}",
                shard.name()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `router`'s moves are over (windows passed, rows carried); panics after 30 s.
pub async fn moves_done(router: &shardlock::LockRouter) {
    let done = eventually(Duration::from_secs(30), || async {
        router.moves_in_progress() == 0
    })
    .await;
    assert!(done, "the move never ended");
}

/// The first key `{prefix}:{n}` that `router` places on `shard`.
pub fn key_on(router: &LockRouter, prefix: &str, shard: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}:{i}"))
        .find(|k| router.shard_for(k).unwrap() == shard)
        .unwrap()
}

/// The `shards:` YAML of one shard `s1` reached through `proxy`, with a 1 s statement timeout
/// (a call into a cut-off link gives up soon).
pub fn s1_through(proxy: &shardlock_testkit::Proxy) -> String {
    format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 1s\n",
        proxy.url()
    )
}

/// `key`'s row (made by a grant and its release) locked by another transaction.
#[allow(dead_code)]
pub async fn locked_row(
    router: &LockRouter,
    shard: &Shard,
    key: &str,
) -> shardlock_testkit::Competitor {
    let once = router.acquire(key, AcquireOptions::new()).await.unwrap();
    let mut competitor = shardlock_testkit::Competitor::begin(shard, false)
        .await
        .unwrap();
    let row = competitor.key_of(once.owner()).await.unwrap().unwrap();
    once.release().await.unwrap();
    competitor.lock(&row).await.unwrap();
    competitor
}
