//! Guarding writes to your own tables with the fencing token.

use mysql_async::prelude::Queryable;
use mysql_async::{Params, Value};
use shardlock_core::{Error, Result};

/// Runs a fenced write: a statement that only applies when the row's stored fence is older
/// than `fence`, and fails with [`Error::FenceRejected`] when it matched no row.
///
/// `sql` uses named parameters (`:name`) and must mention `:fence`, which is bound to `fence`.
/// Keep a fence column in the protected row and write it together with the data:
///
/// ```sql
/// UPDATE account SET balance = :balance, fence = :fence WHERE id = :id AND fence < :fence
/// ```
///
/// A fence of a [`crate::LockMode::LocalFallback`] guard is refused with
/// [`Error::InvalidArgument`]: it was not issued by the shard.
///
/// A holder whose lease was lost (paused past its ttl, force-released) and who still tries to
/// write is rejected, because the next holder got a larger fence and wrote it first. The row
/// must exist (create it with `fence = 0`). Works on any connection or transaction, on any
/// server: the table is yours, not shardlock's.
///
/// ```no_run
/// # async fn demo(conn: &mut shardlock::mysql_async::Conn, guard: &shardlock::LockGuard) -> shardlock::Result<()> {
/// use shardlock::mysql_async::Value;
/// shardlock::fenced_exec(
///     conn,
///     "UPDATE account SET balance = :balance, fence = :fence WHERE id = :id AND fence < :fence",
///     [("balance", Value::from(90)), ("id", Value::from(7))],
///     guard.fence(),
/// )
/// .await?;
/// # Ok(()) }
/// ```
///
/// Cancellation: the write may have reached the server and applied (and committed, under
/// autocommit) with its answer unread. Run nothing more on `conn`: drop it (or its guard), which
/// closes it and rolls back an open transaction, and read the row to learn the outcome.
pub async fn fenced_exec<Q, N>(
    conn: &mut Q,
    sql: &str,
    params: impl IntoIterator<Item = (N, Value)>,
    fence: u64,
) -> Result<u64>
where
    Q: Queryable,
    N: Into<String>,
{
    if fence & crate::LOCAL_FENCE_BIT != 0 {
        return Err(Error::InvalidArgument {
            name: "fence",
            reason: "this fence belongs to a LocalFallback guard (granted in process while the \
                     shard was down); it only orders holds inside this process and cannot \
                     fence shared writes"
                .into(),
        });
    }
    if !sql.contains(":fence") {
        return Err(Error::InvalidArgument {
            name: "sql",
            reason: "a fenced write must compare and store `:fence`".into(),
        });
    }
    let mut named: std::collections::HashMap<Vec<u8>, Value> = params
        .into_iter()
        .map(|(n, v)| (n.into().into_bytes(), v))
        .collect();
    named.insert(b"fence".to_vec(), Value::from(fence));
    let backend = |e| Error::Backend {
        shard: "<caller's connection>".into(),
        source: shardlock_mysql::classify(e),
    };
    let result = conn
        .exec_iter(sql, Params::Named(named))
        .await
        .map_err(backend)?;
    let affected = result.affected_rows();
    result.drop_result().await.map_err(backend)?;
    match affected {
        0 => Err(Error::FenceRejected { fence }),
        n => Ok(n),
    }
}
