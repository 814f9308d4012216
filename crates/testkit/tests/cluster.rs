//! The testkit itself: shards start, answer, die when killed, freeze when paused, come back.

use std::time::{Duration, Instant};

use mysql_async::prelude::Queryable;
use shardlock_testkit::Cluster;

#[tokio::test(flavor = "multi_thread")]
async fn shards_start_fault_and_restart() {
    let started = Instant::now();
    let cluster = Cluster::start(3).await.expect("start 3 shards");
    eprintln!("3 shards ready in {:?}", started.elapsed());
    let ports: Vec<u16> = cluster.shards().iter().map(|s| s.port()).collect();
    assert_eq!(
        ports.iter().collect::<std::collections::HashSet<_>>().len(),
        3
    );

    let s1 = cluster.shard(0);
    let mut conn = s1.connect().await.unwrap();
    conn.query_drop("CREATE TABLE t (id INT PRIMARY KEY) ENGINE=InnoDB")
        .await
        .unwrap();
    conn.query_drop("INSERT INTO t VALUES (7)").await.unwrap();
    drop(conn);

    s1.kill().unwrap();
    assert!(
        s1.connect().await.is_err(),
        "a killed shard must refuse connections"
    );
    s1.restart().await.unwrap();
    let mut conn = s1.connect().await.unwrap();
    let v: Option<i32> = conn.query_first("SELECT id FROM t").await.unwrap();
    assert_eq!(v, Some(7), "committed data survives SIGKILL and restart");

    let s2 = cluster.shard(1);
    s2.pause().unwrap();
    let attempt = tokio::time::timeout(Duration::from_millis(500), s2.connect()).await;
    assert!(attempt.is_err(), "a paused shard must not answer");
    s2.resume().unwrap();
    assert!(s2.connect().await.is_ok());
}
