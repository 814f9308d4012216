//! Listing leases across shards and data stored with a lease, on real shards: prefixes,
//! namespaces' scopes, held-only, limits, buckets and digested keys as they read; data shown
//! while its grant holds the key and never to a later grant.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, Error, ListOptions, LockRouter};

const SCOPES: &str =
    "namespaces:\n  billing:\n    key-prefix: billing/\n  stock:\n    buckets: 4\n";

#[tokio::test(flavor = "multi_thread")]
async fn leases_are_listed_across_shards_with_their_data() {
    let (cluster, router, _yaml) = common::start(3, SCOPES).await;
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(SCOPES))
        .await
        .unwrap();
    let billing = AcquireOptions::new().namespace("billing");

    let mut held = Vec::new();
    for i in 0..12 {
        held.push(
            router
                .acquire(&format!("order:{i:02}"), AcquireOptions::new())
                .await
                .unwrap(),
        );
    }
    let scoped = router.acquire("order:01", billing.clone()).await.unwrap();
    scoped.set_data(b"invoice 7731").await.unwrap();
    let bucket = router
        .acquire_bucket("sku:9", "user:1", AcquireOptions::new().namespace("stock"))
        .await
        .unwrap();
    let long_key = "k".repeat(300);
    let long = router
        .acquire(&long_key, AcquireOptions::new())
        .await
        .unwrap();
    held.pop().unwrap().release().await.unwrap(); // order:11, released

    let all = router.list(ListOptions::new()).await.unwrap();
    assert!(all.failed.is_empty() && !all.truncated);
    let keys: Vec<&str> = all.leases.iter().map(|l| l.key.as_str()).collect();
    // In the order of the stored keys: digests (0xFF first) after every literal key.
    let mut sorted = keys.clone();
    sorted.sort_unstable_by_key(|k| (k.starts_with('#'), *k));
    assert_eq!(keys, sorted, "in key order");
    // Every shard's rows are there: 12 plain (one released), one scoped, a bucket, a digest.
    assert_eq!(all.leases.len(), 15, "{keys:?}");
    let shards: std::collections::BTreeSet<&str> =
        all.leases.iter().map(|l| l.shard.as_str()).collect();
    assert!(shards.len() > 1, "from several shards: {shards:?}");
    let row = |key: &str| all.leases.iter().find(|l| l.key == key).unwrap();
    assert_eq!(row("order:00").row.owner.as_deref(), Some(held[0].owner()));
    assert_eq!(row("order:00").shard, held[0].shard());
    assert!(!row("order:11").row.is_held());
    let b = row("sku:9");
    assert_eq!(b.bucket, bucket.bucket());
    let label = shardlock::LockKey::new(&long_key).unwrap().label_hash();
    assert_eq!(row(&label).row.owner.as_deref(), Some(long.owner()));
    assert_eq!(
        row("billing/order:01").row.data.as_deref(),
        Some(&b"invoice 7731"[..])
    );

    let held_only = router.list(ListOptions::new().held_only()).await.unwrap();
    assert_eq!(held_only.leases.len(), 14);
    let prefixed = router
        .list(ListOptions::new().prefix("order:0").held_only())
        .await
        .unwrap();
    assert_eq!(prefixed.leases.len(), 10, "order:00..order:09");
    let scope = router
        .list(ListOptions::new().namespace("billing"))
        .await
        .unwrap();
    let scope: Vec<&str> = scope.leases.iter().map(|l| l.key.as_str()).collect();
    assert_eq!(scope, ["billing/order:01"]);
    let first = router.list(ListOptions::new().limit(5)).await.unwrap();
    assert_eq!(first.leases.len(), 5);
    assert!(first.truncated);
    assert_eq!(
        first
            .leases
            .iter()
            .map(|l| l.key.as_str())
            .collect::<Vec<_>>(),
        keys[..5]
    );

    // Data is its grant's: inspect shows it, a later grant's row does not.
    let (_, row) = router.inspect("billing/order:01").await.unwrap();
    assert_eq!(row.unwrap().data.as_deref(), Some(&b"invoice 7731"[..]));
    scoped.release().await.unwrap();
    let next = other
        .try_acquire("order:01", billing.clone().wait(Duration::ZERO))
        .await
        .unwrap()
        .unwrap();
    let (_, row) = router.inspect("billing/order:01").await.unwrap();
    let row = row.unwrap();
    assert_eq!(row.owner.as_deref(), Some(next.owner()));
    assert_eq!(row.data, None, "an earlier holder's data");

    match next.set_data(&[0u8; 1025]).await {
        Err(Error::InvalidArgument { name: "data", .. }) => {}
        other => panic!("{other:?}"),
    }
    router
        .force_release("billing/order:01")
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(
        next.set_data(b"late").await,
        Err(Error::LockLost { .. })
    ));
    // Evicted: free for everyone else.
    assert!(router
        .try_acquire("order:01", billing.wait(Duration::ZERO))
        .await
        .unwrap()
        .is_some());
}
