//! Migrations: a version whose changes were made but not recorded (the process died between
//! its DDL, which commits on its own, and the version row) is run again without error.

mod common;

use shardlock::mysql_async::prelude::Queryable;

#[tokio::test(flavor = "multi_thread")]
async fn a_version_interrupted_after_its_ddl_runs_again() {
    let (cluster, router, _) = common::start(1, "").await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    // As if the process died right after migration 6's ALTERs committed.
    c.query_drop("DELETE FROM shardlock_schema_version WHERE version = 6")
        .await
        .unwrap();
    let report = router.migrate().await.unwrap();
    assert_eq!(report[0].1.applied, vec![6], "{report:?}");
    let again = router.migrate().await.unwrap();
    assert!(again[0].1.applied.is_empty(), "{again:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn every_version_runs_again_over_its_own_changes() {
    let (cluster, router, _) = common::start(1, "").await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    for &(version, name, _) in shardlock::MIGRATIONS {
        // As if the process died between this version's changes and its version row.
        c.exec_drop(
            "DELETE FROM shardlock_schema_version WHERE version = ?",
            (version,),
        )
        .await
        .unwrap();
        let report = router.migrate().await.unwrap();
        assert_eq!(report[0].1.applied, vec![version], "{name}: {report:?}");
    }
}
