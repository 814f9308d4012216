//! A holder learns it lost its lease before anyone else can be granted the key, even when the
//! shard's clock runs faster than the holder's (within the configured `clock-drift`).

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Cluster, Proxy, ProxyMode};

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_is_lost_locally_before_a_fast_shard_clock_frees_it() {
    // The shard's clock runs 5% fast; the holder allows for 6%.
    let cluster = Cluster::start_with_clocks(1, &[(0, "+0 x1.05")])
        .await
        .unwrap();
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    other.migrate().await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let holder = LockRouter::from_yaml_str(&format!(
        "instance:\n  clock-drift: 0.06\nshards:\n  - name: s1\n    url: {}\n",
        proxy.url()
    ))
    .await
    .unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(2)))
        .await
        .unwrap();
    // Cut off: no renewal reaches the shard, so the lease ends by the shard's clock.
    proxy.set(ProxyMode::Blackhole);
    let watcher = tokio::spawn(async move {
        guard.lost().await;
        tokio::time::Instant::now()
    });
    let granted_at = common::first_grant(&other, "k").await;
    let lost_at = watcher.await.unwrap();
    assert!(
        lost_at <= granted_at,
        "another process was granted the key {:?} before the holder knew it lost it",
        lost_at - granted_at
    );
    proxy.set(ProxyMode::Pass);
}
