//! Migrations: a version whose changes were made but not recorded (the process died between
//! its DDL, which commits on its own, and the version row) is run again without error; a
//! router whose shards are not migrated to its version grants nothing until they are.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Error, LockRouter};
use shardlock_testkit::Cluster;

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

/// A shard a newer shardlock migrated reports that newer version, not this one's last: it
/// said "up to date" at this version, hiding that the fleet runs mixed versions.
#[tokio::test(flavor = "multi_thread")]
async fn a_shard_migrated_by_a_newer_version_reports_its_version() {
    let (cluster, router, _) = common::start(1, "").await;
    let latest = shardlock::MIGRATIONS.last().unwrap().0;
    let mut c = cluster.shard(0).connect().await.unwrap();
    c.exec_drop(
        "INSERT INTO shardlock_schema_version (version, name) VALUES (?, 'from a newer release')",
        (latest + 1,),
    )
    .await
    .unwrap();
    let report = router.migrate().await.unwrap();
    assert_eq!(report[0].1.version, latest + 1, "{report:?}");
    assert!(report[0].1.applied.is_empty(), "{report:?}");
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

#[tokio::test(flavor = "multi_thread")]
async fn a_router_grants_only_once_its_heartbeat_reaches_a_migrated_registry_on_every_shard() {
    let cluster = Cluster::start(2).await.unwrap();
    // A namespace that falls back on in-process locks when its shard fails.
    let yaml = cluster.config_yaml("namespaces:\n  local:\n    on-shard-failure: local\n");
    let once = || AcquireOptions::new().wait(Duration::ZERO);
    // Made before the first migration (the usual first run): no registry to heartbeat in.
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let refused = router.try_acquire("k", once()).await.unwrap_err();
    let said = shardlock::Report(&refused).to_string();
    assert!(
        matches!(refused, Error::Unavailable { .. }) && said.contains("shardlock migrate"),
        "{said}"
    );
    // It heartbeats as `migrate` ends, and grants at once.
    router.migrate().await.unwrap();
    let held = router
        .try_acquire("k", once())
        .await
        .unwrap()
        .expect("free");
    held.release().await.unwrap();

    // A new version rolled out before its migration ran on one shard: the heartbeat cannot
    // record the new start there, which others would then not see; it grants nothing, on any
    // shard, until the shard is migrated.
    let mut s2 = cluster.shard(1).connect().await.unwrap();
    let timeout_migration = shardlock::MIGRATIONS
        .iter()
        .find(|(_, name, _)| *name == "instance_timeout")
        .unwrap()
        .0;
    s2.query_drop("ALTER TABLE shardlock_instance DROP COLUMN heartbeat_timeout_ms")
        .await
        .unwrap();
    s2.exec_drop(
        "DELETE FROM shardlock_schema_version WHERE version = ?",
        (timeout_migration,),
    )
    .await
    .unwrap();
    let early = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let key = common::key_on(&early, "k", "s1");
    // Nor in process, as after a shard failure: it never joined its fleet.
    for namespace in ["default", "local"] {
        let opts = once().namespace(namespace);
        let refused = early.try_acquire(&key, opts).await.unwrap_err();
        let said = shardlock::Report(&refused).to_string();
        assert!(
            said.contains("shard s2") && said.contains("shardlock migrate"),
            "{namespace}: {said}"
        );
    }
    let report = early.migrate().await.unwrap();
    assert_eq!(report[1].1.applied, vec![timeout_migration], "{report:?}");
    let held = early
        .try_acquire(&key, once())
        .await
        .unwrap()
        .expect("free");
    held.release().await.unwrap();
}

/// A migration whose table another session keeps in use (an open transaction that read it)
/// gives up after a few short waits and says so, rather than waiting the server's
/// `lock_wait_timeout` (a day on MariaDB, a year on MySQL) with every lock statement on the
/// table queued behind it; once the session ends, migrate applies it.
#[tokio::test(flavor = "multi_thread")]
async fn a_migration_whose_table_stays_in_use_gives_up_and_says_why() {
    let (cluster, router, _) = common::start(1, "").await;
    let mut c = cluster.shard(0).connect().await.unwrap();
    // As if the shard were at version 7: migration 8 adds two columns.
    c.query_drop(
        "ALTER TABLE shardlock_lease DROP COLUMN data_owner, DROP COLUMN data; \
         DELETE FROM shardlock_schema_version WHERE version = 8",
    )
    .await
    .unwrap();
    let mut reader = cluster.shard(0).connect().await.unwrap();
    reader
        .query_drop("START TRANSACTION; SELECT COUNT(*) FROM shardlock_lease")
        .await
        .unwrap();
    let migrated = tokio::time::timeout(Duration::from_secs(120), router.migrate())
        .await
        .expect("the migration waited on for the session's table");
    let err = migrated.expect_err("migrated while the table was in use");
    let said = shardlock::Report(&err).to_string();
    assert!(
        said.contains("ALTER TABLE shardlock_lease") && said.contains("in use"),
        "{said}"
    );
    reader.query_drop("COMMIT").await.unwrap();
    let report = router.migrate().await.unwrap();
    assert_eq!(report[0].1.applied, vec![8], "{report:?}");
}
