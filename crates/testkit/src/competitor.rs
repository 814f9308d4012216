//! A transaction that competes with the library's statements for lease rows, as an operator's
//! console session, a batch job or a backup tool can: it holds row locks until it ends, so the
//! library's statements wait behind it (and, past `innodb_lock_wait_timeout`, get error 1205),
//! and it can close a lock cycle with one of them (error 1213, the library's statement chosen
//! as the victim because the competitor has written more).

use mysql_async::prelude::Queryable;
use mysql_async::Conn;

use crate::Shard;

/// Rows a heavy competitor writes before it locks anything: InnoDB rolls back the transaction
/// that has written less when it breaks a deadlock, so the library's statement is the victim.
const BALLAST_ROWS: u32 = 200;

/// An open transaction on a shard; rolled back by [`Competitor::end`] (or when dropped, as its
/// connection closes).
#[derive(Debug)]
pub struct Competitor {
    conn: Conn,
}

impl Competitor {
    /// Begins a transaction on `shard`. A `heavy` one first writes 200 rows of a
    /// scratch table, so that a deadlock it takes part in rolls back the other side.
    pub async fn begin(shard: &Shard, heavy: bool) -> mysql_async::Result<Self> {
        let mut conn = shard.connect().await?;
        conn.query_drop(
            "CREATE TABLE IF NOT EXISTS shardlock_test_ballast \
             (id INT PRIMARY KEY, n INT NOT NULL) ENGINE=InnoDB",
        )
        .await?;
        conn.query_drop("BEGIN").await?;
        if heavy {
            conn.query_drop(format!(
                "INSERT INTO shardlock_test_ballast (id, n) SELECT seq, 0 FROM seq_1_to_{BALLAST_ROWS} \
                 ON DUPLICATE KEY UPDATE n = n + 1"
            ))
            .await?;
        }
        Ok(Self { conn })
    }

    /// The stored key of the lease row that `owner` holds, read without locking.
    pub async fn key_of(&mut self, owner: &str) -> mysql_async::Result<Option<Vec<u8>>> {
        self.conn
            .exec_first(
                "SELECT lock_key FROM shardlock_lease WHERE owner = ?",
                (owner,),
            )
            .await
    }

    /// Stored keys of up to `n` lease rows picked at random, read without locking.
    pub async fn some_keys(&mut self, n: usize) -> mysql_async::Result<Vec<Vec<u8>>> {
        self.conn
            .exec(
                "SELECT lock_key FROM shardlock_lease ORDER BY RAND() LIMIT ?",
                (n as u64,),
            )
            .await
    }

    /// Locks the lease row of `key` (`SELECT … FOR UPDATE`), waiting for it as any
    /// transaction would; fails with 1213 if this transaction is chosen as a deadlock's victim.
    pub async fn lock(&mut self, key: &[u8]) -> mysql_async::Result<()> {
        self.conn
            .exec_drop(
                "SELECT lock_key FROM shardlock_lease WHERE lock_key = ? FOR UPDATE",
                (key,),
            )
            .await
    }

    /// Ends the transaction, undoing everything it wrote and freeing its locks.
    pub async fn end(mut self) -> mysql_async::Result<()> {
        self.conn.query_drop("ROLLBACK").await?;
        self.conn.disconnect().await
    }
}

impl Shard {
    /// Statements of this shard waiting for a row lock now (`Innodb_row_lock_current_waits`).
    pub async fn lock_waits_now(&self) -> mysql_async::Result<u64> {
        self.global_status("Innodb_row_lock_current_waits").await
    }

    /// Row lock waits this shard's server has begun since it started
    /// (`Innodb_row_lock_waits`): a wait that begins after a moment is one that raises it.
    pub async fn lock_waits_begun(&self) -> mysql_async::Result<u64> {
        self.global_status("Innodb_row_lock_waits").await
    }
}
