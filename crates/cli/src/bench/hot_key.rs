//! The `hot-key` and `hot-key-redis` scenarios: many tasks of one process on one key, against
//! the hand-rolled SQL lock and the usual Redis lock.

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::{Error as MyError, Pool};
use shardlock::{AcquireOptions, LockRouter};

use super::harness::{default_backoff, surface, Round};
use super::report::Measurement;
use crate::AnyError;

pub(super) async fn shardlock(
    router: &LockRouter,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let key = format!("bench:hot:{}", round.tag);
    round
        .measure_cycles(
            "shardlock, one hot key",
            round.args.hot_tasks,
            router,
            AcquireOptions::new().wait(Duration::from_secs(60)),
            move |_, _| key.clone(),
        )
        .await
}

/// The lock every team writes first: INSERT; on a duplicate, take over if expired; DELETE by
/// owner on release; exponential backoff with jitter between tries (shardlock's default
/// steps). Deadlocks and lock wait timeouts reach this code; it counts them and tries again.
pub(super) async fn naive(pool: &Pool, round: Round<'_>) -> Result<Measurement, AnyError> {
    let key = format!("bench:naive:{}", round.tag);
    let name = "naive hand-rolled lock, one hot key";
    naive_on(pool, round, name, round.args.hot_tasks, move |_, _| {
        key.clone()
    })
    .await
}

/// [`naive`] with `tasks` tasks, the `i`th cycle of task `task` on `key(task, i)`.
pub(super) async fn naive_on<K>(
    pool: &Pool,
    round: Round<'_>,
    name: &str,
    tasks: u32,
    key: K,
) -> Result<Measurement, AnyError>
where
    K: Fn(u32, u64) -> String + Clone + Send + 'static,
{
    let pool = pool.clone();
    round.measure(name, tasks, move |task, i| {
        let (pool, key, owner) = (pool.clone(), key(task, i), format!("{task}:{i}"));
        async move {
            let mut backoff = default_backoff();
            let mut c = pool.get_conn().await?;
            loop {
                let inserted = c
                    .exec_drop(
                        "INSERT INTO bench_naive_lock (lock_key, owner, expires_at) VALUES (?, ?, NOW(3) + INTERVAL 10 SECOND)",
                        (&key, &owner),
                    )
                    .await;
                let won = match inserted {
                    Ok(()) => true,
                    Err(MyError::Server(e)) if e.code == 1062 => {
                        c.exec_drop(
                            "UPDATE bench_naive_lock SET owner = ?, expires_at = NOW(3) + INTERVAL 10 SECOND \
                             WHERE lock_key = ? AND expires_at < NOW(3)",
                            (&owner, &key),
                        )
                        .await
                        .map_err(surface)?;
                        c.affected_rows() == 1
                    }
                    Err(e) => return Err(surface(e)),
                };
                if won {
                    break;
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
            c.exec_drop("DELETE FROM bench_naive_lock WHERE lock_key = ? AND owner = ?", (&key, &owner))
                .await
                .map_err(surface)?;
            Ok(())
        }
    })
    .await
}

pub(super) async fn redis_connection(
    url: &str,
) -> Result<redis::aio::MultiplexedConnection, AnyError> {
    let client = redis::Client::open(url)?;
    let conn = tokio::time::timeout(
        Duration::from_secs(2),
        client.get_multiplexed_async_connection(),
    )
    .await??;
    Ok(conn)
}

/// The usual Redis lock: `SET key owner NX PX ttl`; on failure back off (shardlock's default
/// steps) and retry; release with a script that deletes the key only if it still holds our
/// owner. All tasks share one multiplexed connection, as a service would.
pub(super) async fn redis_set_nx(
    conn: redis::aio::MultiplexedConnection,
    round: Round<'_>,
) -> Result<Measurement, AnyError> {
    let key = format!("shardlock-bench:hot:{}", round.tag);
    let release = redis::Script::new(
        "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end",
    );
    round
        .measure(
            "redis SET NX PX, one hot key",
            round.args.hot_tasks,
            move |task, i| {
                let (mut conn, key, release, owner) = (
                    conn.clone(),
                    key.clone(),
                    release.clone(),
                    format!("{task}:{i}"),
                );
                async move {
                    let mut backoff = default_backoff();
                    loop {
                        let set: Option<String> = redis::cmd("SET")
                            .arg(&key)
                            .arg(&owner)
                            .arg("NX")
                            .arg("PX")
                            .arg(10_000)
                            .query_async(&mut conn)
                            .await?;
                        if set.is_some() {
                            break;
                        }
                        tokio::time::sleep(backoff.next_delay()).await;
                    }
                    let _: i64 = release
                        .key(&key)
                        .arg(&owner)
                        .invoke_async(&mut conn)
                        .await?;
                    Ok(())
                }
            },
        )
        .await
}
