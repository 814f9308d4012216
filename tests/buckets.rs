//! Bucketed sub-locks: a SKU's stock split into 16 bucket rows, sold by two processes × 32
//! buyers while whole-key restocks take every bucket. Never oversold, restocks interleave
//! safely, and nothing deadlocks.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Pool, TxOpts, Value};
use shardlock::{AcquireOptions, LockGuard, LockRouter};
use shardlock_testkit::{report, Cluster, Worker};

const BUCKETS: u32 = 16;
const INITIAL: i64 = 20;
const BUYERS: usize = 32;
const ATTEMPTS: usize = 12;
const RESTOCKS: i64 = 4;
const RESTOCK_EACH: i64 = 5;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";
const NAMESPACES: &str =
    "namespaces:\n  stock:\n    buckets: 16\n    bucket-spill: true\n    wait: 30s\n";

fn stock() -> AcquireOptions {
    AcquireOptions::new().namespace("stock")
}

const FENCED_UPDATE: &str =
    "UPDATE stock SET qty = :qty, fence = :fence WHERE bucket = :bucket AND fence < :fence";

#[tokio::test(flavor = "multi_thread")]
async fn bucketed_stock_is_never_oversold_and_restocks_interleave() {
    let (cluster, router, yaml) = common::start(3, NAMESPACES).await;
    let app_url = cluster.shard(0).url();
    let mut app = common::app_conn(
        &app_url,
        &[
            "CREATE TABLE stock (bucket INT PRIMARY KEY, qty BIGINT NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
            "CREATE TABLE orders (id BIGINT AUTO_INCREMENT PRIMARY KEY, bucket INT NOT NULL, fence BIGINT UNSIGNED NOT NULL)",
        ],
    )
    .await;
    app.exec_batch(
        "INSERT INTO stock VALUES (?, ?, 0)",
        (0..BUCKETS).map(|b| (b, INITIAL)),
    )
    .await
    .unwrap();

    let env = [(common::CONFIG_ENV, yaml), (APP_ENV, app_url.clone())];
    let mut workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "buyer", &env).unwrap())
        .collect();
    for w in &mut workers {
        w.expect("ready").await.unwrap();
    }
    let orders_now = |app_url: String| async move {
        let mut c = shardlock::mysql_async::Conn::from_url(app_url.as_str())
            .await
            .unwrap();
        let n: Option<u64> = c.query_first("SELECT COUNT(*) FROM orders").await.unwrap();
        n.unwrap_or(0)
    };
    // Restocks start once buyers are buying.
    let buying = common::eventually(Duration::from_secs(60), || async {
        orders_now(app_url.clone()).await > 0
    })
    .await;
    assert!(buying, "the buyers started");

    // Whole-key restocks while the buyers run: every bucket at once, in bucket order.
    let pool = Pool::new(app_url.as_str());
    let mut orders_at_restock = Vec::new();
    for _ in 0..RESTOCKS {
        let all = router.acquire_all_buckets("sku:1", stock()).await.unwrap();
        assert_eq!(
            all.iter().map(|g| g.bucket().unwrap()).collect::<Vec<_>>(),
            (0..BUCKETS).collect::<Vec<_>>()
        );
        let mut conn = pool.get_conn().await.unwrap();
        let mut tx = conn.start_transaction(TxOpts::default()).await.unwrap();
        for g in &all {
            let qty: i64 = tx
                .exec_first("SELECT qty FROM stock WHERE bucket = ?", (g.bucket(),))
                .await
                .unwrap()
                .unwrap();
            let params = [
                ("qty", Value::from(qty + RESTOCK_EACH)),
                ("bucket", Value::from(g.bucket())),
            ];
            shardlock::fenced_exec(&mut tx, FENCED_UPDATE, params, g.fence())
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        for g in all {
            g.release().await.unwrap();
        }
        orders_at_restock.push(orders_now(app_url.clone()).await);
        tokio::task::yield_now().await;
    }
    assert!(
        orders_at_restock.first() < orders_at_restock.last(),
        "buyers bought between the first and the last restock: {orders_at_restock:?}"
    );

    let mut bought = 0;
    for w in workers {
        bought += w.finish_report("bought ").await.unwrap()[0] as i64;
    }
    let rows: Vec<(u32, i64)> = app
        .query("SELECT bucket, qty FROM stock ORDER BY bucket")
        .await
        .unwrap();
    let orders: Vec<(u32, u64)> = app
        .query("SELECT bucket, fence FROM orders ORDER BY id")
        .await
        .unwrap();
    assert!(rows.iter().all(|(_, qty)| *qty >= 0), "oversold: {rows:?}");
    let left: i64 = rows.iter().map(|(_, q)| q).sum();
    let supplied = INITIAL * BUCKETS as i64 + RESTOCKS * RESTOCK_EACH * BUCKETS as i64;
    assert_eq!(orders.len() as i64, bought);
    assert_eq!(
        bought + left,
        supplied,
        "every unit is either sold once or still in stock"
    );
    for bucket in 0..BUCKETS {
        let fences: Vec<u64> = orders
            .iter()
            .filter(|(b, _)| *b == bucket)
            .map(|(_, f)| *f)
            .collect();
        assert!(
            fences.windows(2).all(|w| w[0] < w[1]),
            "bucket {bucket}: {fences:?}"
        );
    }
    eprintln!(
        "{bought} units sold, {left} left, {} restocked",
        supplied - INITIAL * BUCKETS as i64
    );
}

async fn buyer() {
    let router = common::worker_router().await;
    let pool = Pool::new(std::env::var(APP_ENV).unwrap().as_str());
    report!("ready");
    let tasks: Vec<_> = (0..BUYERS)
        .map(|n| {
            let (router, pool) = (router.clone(), pool.clone());
            tokio::spawn(async move {
                let mut bought = 0i64;
                for i in 0..ATTEMPTS {
                    let hint = format!("{}:{n}:{i}", std::process::id());
                    let g = router
                        .acquire_bucket("sku:1", &hint, stock())
                        .await
                        .expect("acquire a bucket");
                    let bucket = g.bucket().expect("a bucket");
                    let mut conn = pool.get_conn().await.unwrap();
                    let mut tx = conn.start_transaction(TxOpts::default()).await.unwrap();
                    let qty: i64 = tx
                        .exec_first("SELECT qty FROM stock WHERE bucket = ?", (bucket,))
                        .await
                        .unwrap()
                        .unwrap();
                    if qty > 0 {
                        tokio::task::yield_now().await;
                        let params = [
                            ("qty", Value::from(qty - 1)),
                            ("bucket", Value::from(bucket)),
                        ];
                        shardlock::fenced_exec(&mut tx, FENCED_UPDATE, params, g.fence())
                            .await
                            .expect("fenced write");
                        tx.exec_drop(
                            "INSERT INTO orders (bucket, fence) VALUES (?, ?)",
                            (bucket, g.fence()),
                        )
                        .await
                        .unwrap();
                        bought += 1;
                    }
                    tx.commit().await.unwrap();
                    drop(conn);
                    g.release().await.unwrap();
                }
                bought
            })
        })
        .collect();
    let mut bought = 0;
    for t in tasks {
        bought += t.await.unwrap();
    }
    report!("bought {bought}");
    router.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn buckets_land_on_shards_independently_and_spill_when_busy() {
    let (_cluster, router, _) = common::start(3, NAMESPACES).await;
    let all = router.acquire_all_buckets("sku:2", stock()).await.unwrap();
    let shards: std::collections::HashSet<&str> = all.iter().map(|g| g.shard()).collect();
    assert_eq!(shards.len(), 3, "16 buckets spread over the 3 shards");
    // With every bucket held, a bucket acquire (spilling or not) waits and times out.
    let err = router
        .acquire_bucket("sku:2", "user:1", stock().wait(Duration::from_millis(100)))
        .await
        .unwrap_err();
    assert!(matches!(err, shardlock::Error::Timeout { .. }), "{err}");
    // Free one bucket: a spilling acquire finds it whatever the hint.
    let mut all = all;
    let freed = all.remove(7);
    freed.release().await.unwrap();
    let g = router
        .acquire_bucket("sku:2", "user:1", stock().wait(Duration::ZERO))
        .await
        .unwrap();
    assert_eq!(g.bucket(), Some(7));
    assert_eq!(g.key(), "sku:2");
}

/// A spilling bucket acquire passes over the buckets whose shard is down (its breaker open)
/// and waits for the hint's own bucket, on a shard that is up: one shard down does not fail
/// every acquire of the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_spilling_acquire_passes_over_buckets_whose_shard_is_down() {
    let rig = common::faults::Rig::start("fail-fast", None, common::faults::POOL).await;
    // Gone from the fleet: its topology, without the namespace, would keep the others out.
    rig.router.shutdown().await.unwrap();
    let stock_ns = "  stock:\n    buckets: 16\n    bucket-spill: true\n";
    let router = shardlock::LockRouter::from_yaml_str(&format!("{}{stock_ns}", rig.yaml))
        .await
        .unwrap();
    let direct = common::faults::config_yaml(
        &rig.cluster,
        &rig.cluster.shard(0).url(),
        common::faults::POOL,
        "fail-fast",
    );
    let other = shardlock::LockRouter::from_yaml_str(&format!("{direct}{stock_ns}"))
        .await
        .unwrap();
    // Another process holds every bucket on the shards that stay up, the hint's own among them.
    let mut held = other.acquire_all_buckets("sku:9", stock()).await.unwrap();
    let on_s1: Vec<u32> = held
        .iter()
        .filter(|g| g.shard() == "s1")
        .filter_map(|g| g.bucket())
        .collect();
    assert!(!on_s1.is_empty(), "no bucket on s1");
    held.retain(|g| g.shard() != "s1");
    let home = held[0].bucket().unwrap();
    let hint = (0..)
        .map(|i| format!("user:{i}"))
        .find(|h| shardlock_core::bucket_for(h.as_bytes(), BUCKETS) == home)
        .unwrap();
    let s1_key = rig.keys("k", 1, false).remove(0);
    rig.proxy.set(shardlock_testkit::ProxyMode::Reset);
    while router.breaker_state("s1") != Some(shardlock::BreakerState::Open) {
        let _ = router.try_acquire(&s1_key, AcquireOptions::new()).await;
    }
    let err = router
        .acquire_bucket("sku:9", &hint, stock().wait(Duration::from_millis(300)))
        .await
        .unwrap_err();
    assert!(
        matches!(err, shardlock::Error::Timeout { .. }),
        "a bucket on the shard that is down failed the acquire: {err}"
    );
}

/// Two buckets, no spill.
const PAIR: &str = "namespaces:\n  pair:\n    buckets: 2\n";

fn pair() -> AcquireOptions {
    AcquireOptions::new()
        .namespace("pair")
        .wait(Duration::from_secs(60))
}

/// A hint whose bucket is `bucket` of 2.
fn hint_of(bucket: u32) -> String {
    (0..)
        .map(|i| format!("user:{i}"))
        .find(|h| shardlock_core::bucket_for(h.as_bytes(), 2) == bucket)
        .unwrap()
}

/// A guard of `router` on bucket `bucket` of `key` (of the `pair` namespace).
async fn hold_bucket(router: &LockRouter, key: &str, bucket: u32) -> LockGuard {
    let guard = router
        .acquire_bucket(key, &hint_of(bucket), pair())
        .await
        .unwrap();
    assert_eq!(guard.bucket(), Some(bucket));
    guard
}

/// A shard and two routers of it (the `pair` namespace), the second holding bucket 1 of `key`.
async fn second_bucket_held(key: &str) -> (Cluster, LockRouter, LockRouter, LockGuard) {
    let (cluster, other, _) = common::start(1, PAIR).await;
    let router = LockRouter::from_yaml_str(&cluster.config_yaml(PAIR))
        .await
        .unwrap();
    let second = hold_bucket(&other, key, 1).await;
    (cluster, router, other, second)
}

/// A whole-key hold is handed out only with every bucket still its own: the first one may end
/// while the later ones are waited for (here its ttl runs out, as a pause past it would end
/// it), and another holder take it meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_whole_key_hold_whose_first_bucket_ended_while_it_waited_takes_it_again() {
    let (_cluster, router, other, second) = second_bucket_held("sku:w").await;
    let whole = {
        let router = router.clone();
        let opts = pair().lock_at_most(Duration::from_secs(1));
        tokio::spawn(async move { router.acquire_all_buckets("sku:w", opts).await })
    };
    // It took bucket 0 and waits for bucket 1; bucket 0 ends, and `other` takes it.
    let took_first = common::eventually(Duration::from_secs(60), || async {
        router.stats().grants > 0
    })
    .await;
    assert!(
        took_first,
        "the whole-key acquire never took its first bucket"
    );
    let first = hold_bucket(&other, "sku:w", 0).await;
    second.release().await.unwrap();
    let first_fence = first.fence();
    first.release().await.unwrap();
    let whole = whole.await.unwrap().unwrap();
    assert!(
        whole[0].fence() > first_fence,
        "a whole-key hold was handed out with bucket 0 (fence {}) that another took after it \
         ended (fence {first_fence})",
        whole[0].fence()
    );
}

/// A whole-key hold not taken in full keeps none of its buckets for a minimum hold: its caller
/// never held the key, so nothing ran that the hold should keep others from repeating.
#[tokio::test(flavor = "multi_thread")]
async fn a_whole_key_hold_not_taken_keeps_no_bucket_for_its_minimum_hold() {
    let (_cluster, router, other, second) = second_bucket_held("sku:m").await;
    let opts = pair()
        .lock_at_least(Duration::from_secs(600))
        .wait(Duration::from_millis(300));
    // Until a try took bucket 0 before it timed out on bucket 1 (a slow machine may not).
    for tries in 0.. {
        if router.stats().grants > 0 {
            break;
        }
        assert!(tries < 100, "no try took bucket 0 before its wait ran out");
        let err = (router.acquire_all_buckets("sku:m", opts.clone()).await).unwrap_err();
        assert!(matches!(err, shardlock::Error::Timeout { .. }), "{err}");
    }
    second.release().await.unwrap();
    let first = other.acquire_bucket("sku:m", &hint_of(0), pair()).await;
    assert!(
        first.is_ok(),
        "bucket 0 of a whole-key hold never handed out was kept for its minimum hold: {first:?}"
    );
}

crate::worker_entry! { "buyer" => buyer() }

/// A whole-key hold taken through a namespace that buckets keys into 4 excludes a bucket that
/// another namespace of the same scope counts past them (and one whose prefix the lock's name
/// begins with). Before, it took only its own 4: a caller of the 32-bucket namespace sold
/// from bucket 9 during a restock.
#[tokio::test(flavor = "multi_thread")]
async fn a_whole_key_hold_excludes_the_buckets_another_namespace_of_its_scope_counts() {
    let namespaces = "namespaces:\n  four:\n    buckets: 4\n  many:\n    buckets: 32\n  \
                      team:\n    buckets: 8\n    key-prefix: t/\n";
    let (_cluster, router, yaml) = common::start(1, namespaces).await;
    let other = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let whole = router
        .acquire_all_buckets("t/sku:1", AcquireOptions::new().namespace("four"))
        .await
        .unwrap();
    assert_eq!(
        whole.len(),
        32,
        "every bucket any namespace of its scope counts"
    );
    for (namespace, key, buckets) in [("many", "t/sku:1", 32), ("team", "sku:1", 8)] {
        let hint = (0..)
            .map(|i| format!("user:{i}"))
            .find(|h| shardlock_core::bucket_for(h.as_bytes(), buckets) >= 4)
            .unwrap();
        let opts = AcquireOptions::new()
            .namespace(namespace)
            .wait(Duration::ZERO);
        let beside = other.acquire_bucket(key, &hint, opts).await;
        assert!(
            matches!(beside, Err(shardlock::Error::Timeout { .. })),
            "a bucket of namespace {namespace} was granted beside a whole-key hold: {beside:?}"
        );
    }
    for guard in whole {
        guard.release().await.unwrap();
    }
}

/// A reload may not add a namespace that buckets keys past what the namespaces in force count
/// for them: a whole-key hold taken before it holds only those buckets. Within that count it
/// may, and the hold then excludes the new namespace's buckets.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_adds_no_namespace_bucketing_past_what_whole_key_holds_hold() {
    let four = "namespaces:\n  four:\n    buckets: 4\n";
    let (_cluster, router, yaml) = common::start(1, four).await;
    let whole = router
        .acquire_all_buckets("sku:1", AcquireOptions::new().namespace("four"))
        .await
        .unwrap();
    for (added, field) in [
        ("  many:\n    buckets: 32\n", "namespaces.many.buckets"),
        (
            "  team:\n    buckets: 8\n    key-prefix: t/\n",
            "namespaces.team.buckets",
        ),
    ] {
        let config = shardlock::Config::from_yaml_str(&format!("{yaml}{added}")).unwrap();
        match router.reload(config).await {
            Err(shardlock::Error::Config(e)) => assert_eq!(e.field.as_deref(), Some(field)),
            other => panic!("a namespace bucketing past a whole-key hold was added: {other:?}"),
        }
    }
    let config =
        shardlock::Config::from_yaml_str(&format!("{yaml}  two:\n    buckets: 2\n")).unwrap();
    router.reload(config).await.unwrap();
    let beside = router
        .acquire_bucket(
            "sku:1",
            "user:1",
            AcquireOptions::new().namespace("two").wait(Duration::ZERO),
        )
        .await;
    assert!(
        matches!(beside, Err(shardlock::Error::Timeout { .. })),
        "a bucket of the added namespace was granted beside a whole-key hold: {beside:?}"
    );
    for guard in whole {
        guard.release().await.unwrap();
    }
}
