//! Shutdown gives every lease back, and no guard still says it holds a key once another
//! process can have it.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Proxy, ProxyMode};

#[tokio::test(flavor = "multi_thread")]
async fn a_guard_is_lost_before_its_key_is_free_for_others_at_shutdown() {
    let (cluster, other, _) = common::start(1, "").await;
    // The shutting-down router reaches the shard through a proxy whose replies come late.
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let yaml = format!("shards:\n  - name: s1\n    url: {}\n", proxy.url());
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let guard = router.acquire("k", AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::Delay(Duration::from_millis(300)));

    let watcher = tokio::spawn(async move {
        guard.lost().await;
        (tokio::time::Instant::now(), guard.is_held())
    });
    let poller = tokio::spawn(async move { common::first_grant(&other, "k").await });
    router.shutdown().await.unwrap();
    let (lost_at, still_held) = watcher.await.unwrap();
    let granted_at = poller.await.unwrap();
    assert!(!still_held);
    assert!(
        lost_at <= granted_at,
        "another process held the key {:?} before this guard knew it had lost it",
        lost_at - granted_at
    );
}
