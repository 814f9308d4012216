//! The `uncontended` scenario: distinct keys, so every cost is the lock's own statements.

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, LockRouter};

use super::harness::{measure, Counters};
use super::report::Measurement;
use super::BenchArgs;
use crate::AnyError;

pub(super) async fn shardlock(
    router: &LockRouter,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let (router, tag) = (router.clone(), tag.to_owned());
    measure(
        "shardlock acquire+release, distinct keys",
        args.duration,
        args.tasks,
        counters,
        move |task, i| {
            let (router, key) = (router.clone(), format!("bench:u:{tag}:{task}:{i}"));
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
    .await
}

pub(super) async fn raw_sql(
    pool: &Pool,
    tag: &str,
    args: &BenchArgs,
    counters: &Counters,
) -> Result<Measurement, AnyError> {
    let (pool, tag) = (pool.clone(), tag.to_owned());
    measure("raw INSERT + owner-checked DELETE", args.duration, args.tasks, counters, move |task, i| {
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
