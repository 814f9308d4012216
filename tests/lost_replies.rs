//! A reply lost after the server acted: the grant it carried is given back, so the key is not
//! blocked for the lease's whole ttl.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Proxy, ProxyMode};

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_whose_reply_was_lost_is_given_back() {
    let (cluster, other, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\ncleaner:\n  registry: static\n",
        proxy.url()
    ))
    .await
    .unwrap();
    // Warm the pool, so that the lost statement travels on an open connection.
    let g = router.acquire("warm", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();

    proxy.set(ProxyMode::LoseReplies);
    let long = AcquireOptions::new()
        .ttl(Duration::from_secs(60))
        .wait(Duration::ZERO);
    let err = router.try_acquire("k", long).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    // The server did grant it: the reply was lost on the way back.
    let (_, row) = other.inspect("k").await.unwrap();
    let row = row.expect("the acquire reached the server");
    assert!(row.is_held(), "{row:?}");

    // Once the link carries replies again the grant is given back, long before its minute.
    proxy.set(ProxyMode::Pass);
    let freed = common::eventually(Duration::from_secs(10), || async {
        other
            .try_acquire("k", AcquireOptions::new().wait(Duration::ZERO))
            .await
            .unwrap()
            .is_some()
    })
    .await;
    assert!(freed, "the key stayed blocked by a grant nobody knew of");
}
