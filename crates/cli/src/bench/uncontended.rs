//! The `uncontended` scenario: distinct keys, so every cost is the lock's own statements.

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, LockRouter, LockStats};

use super::harness::Round;
use super::report::{Batching, Measurement};
use crate::AnyError;

pub(super) async fn shardlock(
    router: &LockRouter,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let before = router.stats();
    let (caller, tag) = (router.clone(), round.tag.to_owned());
    let mut m = round
        .measure(
            "shardlock acquire+release, distinct keys",
            round.args.tasks,
            move |task, i| {
                let (router, key) = (caller.clone(), format!("bench:u:{tag}:{task}:{i}"));
                async move {
                    let guard = router
                        .try_acquire(&key, AcquireOptions::new())
                        .await?
                        .ok_or("a distinct key was busy")?;
                    guard.release().await?;
                    Ok(())
                }
            },
        )
        .await?;
    m.batching = Some(batching(&before, &router.stats()));
    Ok(m)
}

/// [`shardlock`], then [`sweep`].
pub(super) async fn shardlock_swept(
    router: &LockRouter,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let m = shardlock(router, round).await?;
    sweep(router, round).await?;
    Ok(m)
}

/// Deletes the released rows that [`shardlock`]'s round left on `router`'s shard, after the
/// round was measured. In production the cleaner keeps the table at the rows still in use;
/// the bench runs none, and without this every round's rows (tens of thousands of distinct
/// keys) would stay, making each later round's inserts, and each later run's, dearer than the
/// raw baseline's, whose owner deletes its row. What the deletes leave the server to purge is
/// waited out before the next round ([`super::harness::Counters::settle`]). The round's tag
/// names its scenario, so these keys are never taken again and need no fence floor.
pub(super) async fn sweep(router: &LockRouter, round: Round<'_>) -> Result<(), AnyError> {
    // Every key that starts `bench:u:<tag>:`, by primary key range (`;` follows `:`), on the
    // shard of such a key (the bench's router has one).
    let (from, to) = (
        format!("bench:u:{}:", round.tag),
        format!("bench:u:{};", round.tag),
    );
    let mut shard = router.shard_connection(&from).await?;
    loop {
        let c = shard.raw();
        c.exec_drop(
            "DELETE FROM shardlock_lease WHERE lock_key >= ? AND lock_key < ? \
             AND (owner IS NULL OR LEFT(owner, 1) = ':') LIMIT 10000",
            (&from, &to),
        )
        .await?;
        if c.affected_rows() == 0 {
            return Ok(());
        }
    }
}

/// How the router grouped the keys between two readings of its stats. Every key of this
/// scenario is granted at the first try: each is one acquire and one release.
fn batching(before: &LockStats, after: &LockStats) -> Batching {
    let keys = (after.grants - before.grants) as f64;
    let (batches, batched) = (
        (after.acquire_batches - before.acquire_batches) as f64,
        (after.batched_acquires - before.batched_acquires) as f64,
    );
    let (release_batches, batched_releases) = (
        (after.release_batches - before.release_batches) as f64,
        (after.batched_releases - before.batched_releases) as f64,
    );
    let per = |keys: f64, statements: f64| keys / statements.max(1.0);
    Batching {
        keys_per_acquire: per(keys, batches + keys - batched),
        keys_per_release: per(keys, release_batches + keys - batched_releases),
        acquire_statements_per_key: (after.acquire_statements - before.acquire_statements) as f64
            / keys.max(1.0),
        alone_acquires: (keys - batched) / keys.max(1.0),
        alone_releases: (keys - batched_releases) / keys.max(1.0),
    }
}

pub(super) async fn raw_sql(pool: &Pool, round: Round<'_>) -> Result<Measurement, AnyError> {
    let (pool, tag) = (pool.clone(), round.tag.to_owned());
    round.measure("raw INSERT + owner-checked DELETE", round.args.tasks, move |task, i| {
        let (pool, key) = (pool.clone(), format!("bench:r:{tag}:{task}:{i}"));
        async move {
            let mut c = pool.get_conn().await?;
            c.exec_drop(
                "INSERT INTO bench_raw_lock (lock_key, owner, expires_at) VALUES (?, ?, NOW(3) + INTERVAL 10 SECOND)",
                (&key, "bench-owner"),
            )
            .await?;
            c.exec_drop("DELETE FROM bench_raw_lock WHERE lock_key = ? AND owner = ?", (&key, "bench-owner")).await?;
            Ok(())
        }
    })
    .await
}

/// The shard's log flush setting while the `durable` scenario runs, and what it was before.
pub(super) struct Durable {
    before: u64,
}

impl Durable {
    /// Makes every commit flush the log (`innodb_flush_log_at_trx_commit = 1`).
    pub(super) async fn start(pool: &Pool) -> Result<Self, AnyError> {
        let mut c = pool.get_conn().await?;
        let before: Option<u64> = c
            .query_first("SELECT @@GLOBAL.innodb_flush_log_at_trx_commit")
            .await?;
        c.query_drop("SET GLOBAL innodb_flush_log_at_trx_commit = 1")
            .await?;
        Ok(Self {
            before: before.unwrap_or(1),
        })
    }

    /// Puts the setting back as it was.
    pub(super) async fn restore(self, pool: &Pool) -> Result<(), AnyError> {
        let mut c = pool.get_conn().await?;
        c.exec_drop(
            "SET GLOBAL innodb_flush_log_at_trx_commit = ?",
            (self.before,),
        )
        .await?;
        Ok(())
    }
}
