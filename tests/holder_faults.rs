//! A holder process that freezes or dies: its lease ends on the shard's clock, another
//! process takes over with a larger fence, and the old holder can do no harm.

mod common;

use std::time::{Duration, Instant};

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Conn, Value};
use shardlock::{AcquireOptions, Error};
use shardlock_testkit::{report, Worker};

const KEY: &str = "payment:42";
const TTL: Duration = Duration::from_millis(1500);
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";

async fn app_table(url: &str) -> Conn {
    common::app_conn(
        url,
        &[
            "CREATE TABLE ledger (id INT PRIMARY KEY, writer VARCHAR(32), fence BIGINT UNSIGNED NOT NULL)",
            "INSERT INTO ledger VALUES (1, 'nobody', 0)",
        ],
    )
    .await
}

const FENCED_WRITE: &str =
    "UPDATE ledger SET writer = :writer, fence = :fence WHERE id = 1 AND fence < :fence";

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_holder_loses_the_key_and_cannot_write_or_release_after_resuming() {
    let (cluster, router, yaml) = common::start(1, "").await;
    let app_url = cluster.shard(0).url();
    let mut app = app_table(&app_url).await;
    let env = [(common::CONFIG_ENV, yaml), (APP_ENV, app_url)];
    let mut holder = Worker::spawn("worker", "pausable-holder", &env).unwrap();
    let old_fence: u64 = holder.expect("acquired").await.unwrap().parse().unwrap();

    holder.pause().unwrap();
    let started = Instant::now();
    let guard = router
        .acquire(KEY, AcquireOptions::new().wait(Duration::from_secs(10)))
        .await
        .expect("the frozen holder's lease ends after its ttl");
    eprintln!("took over after {:?} (ttl {TTL:?})", started.elapsed());
    assert!(guard.fence() > old_fence);
    shardlock::fenced_exec(
        &mut app,
        FENCED_WRITE,
        [("writer", Value::from("new"))],
        guard.fence(),
    )
    .await
    .unwrap();

    holder.resume().unwrap();
    assert_eq!(holder.expect("lost").await.unwrap(), "");
    assert_eq!(holder.expect("release").await.unwrap(), "lock-lost");
    assert_eq!(holder.expect("write").await.unwrap(), "rejected");
    let (status, _) = holder.finish().await.unwrap();
    assert!(status.success());

    let (_, row) = router.inspect(KEY).await.unwrap();
    let row = row.unwrap();
    assert_eq!(
        row.owner.as_deref(),
        Some(guard.owner()),
        "the new holder's row is intact"
    );
    assert!(row.is_held());
    let writer: Option<String> = app
        .query_first("SELECT writer FROM ledger WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(writer.as_deref(), Some("new"));
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_holders_key_is_free_after_the_ttl() {
    let (_cluster, router, yaml) = common::start(1, "").await;
    let env = [(common::CONFIG_ENV, yaml), (APP_ENV, String::new())];
    let mut holder = Worker::spawn("worker", "holder", &env).unwrap();
    let old_fence: u64 = holder.expect("acquired").await.unwrap().parse().unwrap();
    holder.kill().await.unwrap();

    // The crash released nothing: nobody but the shard's clock may end a lease. (Read off the
    // row, not by a try: the lease may end by its ttl before a try on a busy machine.)
    let (_, row) = router.inspect(KEY).await.unwrap();
    let row = row.expect("the holder's row");
    assert!(
        row.owner.is_some() && row.fence >= old_fence,
        "the killed holder's row was released: {row:?}"
    );
    let started = Instant::now();
    let guard = router
        .acquire(KEY, AcquireOptions::new().wait(Duration::from_secs(10)))
        .await
        .unwrap();
    eprintln!(
        "acquired {:?} after the kill (ttl {TTL:?})",
        started.elapsed()
    );
    assert!(guard.fence() > old_fence);
    guard.release().await.unwrap();
}

/// Holds KEY and reports; after being frozen and resumed, reports what it observes.
async fn holder(pausable: bool) {
    let router = common::worker_router().await;
    let guard = router
        .acquire(KEY, AcquireOptions::new().ttl(TTL))
        .await
        .unwrap();
    report!("acquired {}", guard.fence());
    if !pausable {
        std::future::pending::<()>().await;
    }
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("lost() after resume");
    assert!(!guard.is_held());
    report!("lost");
    let fence = guard.fence();
    match guard.release().await {
        Err(Error::LockLost { .. }) => report!("release lock-lost"),
        other => report!("release {other:?}"),
    }
    let mut app = Conn::from_url(std::env::var(APP_ENV).unwrap())
        .await
        .unwrap();
    match shardlock::fenced_exec(
        &mut app,
        FENCED_WRITE,
        [("writer", Value::from("old"))],
        fence,
    )
    .await
    {
        Err(Error::FenceRejected { .. }) => report!("write rejected"),
        other => report!("write {other:?}"),
    }
}

crate::worker_entry! {
    "holder" => holder(false),
    "pausable-holder" => holder(true),
}

/// The task renewing a shard's leases panics: its leases are reported lost at once (no one
/// vouches for their renewal any more, and the shard ends them at their ttl), and a new keeper
/// takes over, so leases granted afterwards are renewed.
#[tokio::test(flavor = "multi_thread")]
async fn a_keeper_that_panics_reports_its_leases_lost_and_is_replaced() {
    let (_cluster, router, _) = common::start(1, "namespaces:\n  default:\n    ttl: 1s\n").await;
    let before = router
        .acquire("k:before", AcquireOptions::new())
        .await
        .unwrap();
    assert!(router.inject_keeper_panic("s1"));
    tokio::time::timeout(Duration::from_secs(10), before.lost())
        .await
        .expect("the panicked keeper's lease was not reported lost");
    assert!(!before.is_held());
    let before_fence = before.fence();
    // Its turn in this process ends when its holder lets go (the release gives back its row,
    // still carrying its owner).
    let _ = before.release().await;

    let after = router
        .acquire("k:after", AcquireOptions::new())
        .await
        .unwrap();
    // Renewed twice, and so held past several ttls.
    for _ in 0..2 {
        common::renewed(&after, "the lease after the panic was not renewed").await;
    }
    assert!(after.is_held());
    after.release().await.unwrap();
    // The lost lease's row was never renewed: it is free by the shard's clock now.
    let again = router
        .acquire("k:before", AcquireOptions::new())
        .await
        .unwrap();
    assert!(again.fence() > before_fence);
}

/// A lease granted while its shard's keeper waits on a renewal of other leases (a row of
/// theirs locked by another transaction, so the statement waits out its timeout) and whose ttl
/// is shorter than that wait: it cannot be renewed, and it is reported lost at its own
/// deadline, while the keeper still waits, not once the keeper is free again (a holder that
/// goes on until `lost()` would otherwise work on after the shard freed the key).
#[tokio::test(flavor = "multi_thread")]
async fn a_lease_granted_while_the_keeper_waits_is_reported_lost_at_its_own_deadline() {
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    // A long statement timeout: the renewal below waits up to its lease's end, ten seconds.
    let router = shardlock::LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: 30s\ncleaner:\n  registry: static\n",
        cluster.shard(0).url()
    ))
    .await
    .unwrap();
    router.migrate().await.unwrap();
    // Renewed every 5 s.
    let long = router
        .acquire("long", AcquireOptions::new().ttl(Duration::from_secs(15)))
        .await
        .unwrap();
    // The long lease's row locked by another transaction (that row only: new keys can still
    // be inserted).
    let shard = cluster.shard(0);
    let mut blocker = shardlock_testkit::Competitor::begin(shard, false)
        .await
        .unwrap();
    let row = blocker.key_of(long.owner()).await.unwrap().unwrap();
    blocker.lock(&row).await.unwrap();
    // A renewal statement begun after the rows were locked waits on them. (Read from the
    // server's counter, not by polling `information_schema.PROCESSLIST`, which crashed
    // MariaDB 10.11.19 here, freeing the query's temporary table.)
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            shard.lock_waits_now().await.unwrap() > 0
        })
        .await,
        "the keeper's renewal never came to wait on the locked row"
    );
    let before = router.stats();

    let short = router
        .acquire(
            "short",
            AcquireOptions::new()
                .ttl(Duration::from_millis(300))
                .wait(Duration::ZERO),
        )
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(60), short.lost())
        .await
        .expect("the short lease was never reported lost");
    // Reported while the keeper's tick was still waiting: no tick has ended since.
    let after = router.stats();
    assert_eq!(
        (after.renew_ticks, after.renew_failures),
        (before.renew_ticks, before.renew_failures),
        "the short lease was reported lost only once the keeper's renewal had ended"
    );
    assert!(!short.is_held());
    assert_eq!(after.lost, before.lost + 1);
    assert!(matches!(short.release().await, Err(Error::LockLost { .. })));

    // Once the row is let go, the waiting renewal goes through: the long lease stays.
    blocker.end().await.unwrap();
    common::renewed(&long, "the long lease was lost").await;
    long.release().await.unwrap();
}
