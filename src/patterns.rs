//! The other MySQL lock patterns teams use, routed by key over the same shards, through the
//! same breakers and with the same errors as lease locks:
//!
//! - [`LockRouter::lock_in_transaction`]: `SELECT ... FOR UPDATE` on a row of
//!   `shardlock_txlock` inside a transaction on a dedicated connection; your own SQL runs in that
//!   transaction ([`TxLockGuard::conn`]); commit, rollback or a dead connection releases it.
//! - [`LockRouter::cas_acquire`] / [`LockRouter::cas_release`]: compare-and-set on a version.
//! - [`LockRouter::transition`]: a state-machine claim on a row of *your* table, one
//!   conditional `UPDATE` judged by affected rows ([`StateMachine`]).
//! - [`LockRouter::claim_job`] and friends: claim the next due job of a queue in
//!   `shardlock_job`, with a lease after which a crashed worker's job is claimed again.

use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, TxOpts};
use shardlock_core::{BackendError, BackendErrorKind, Error, LockKey, Result};
use shardlock_mysql::{classify, ShardManager};

use crate::keeper::ShardState;
use crate::LockRouter;

/// A row lock held inside an open transaction on a dedicated connection. Run your SQL on
/// [`TxLockGuard::conn`]; [`TxLockGuard::commit`] or [`TxLockGuard::rollback`] ends the
/// transaction and the lock together. Dropping the guard rolls back (the connection is reset
/// before reuse); if this process dies, the server rolls back when it notices the connection
/// is gone.
pub struct TxLockGuard {
    /// `None` once committed or rolled back.
    conn: Option<deadpool::managed::Object<ShardManager>>,
    key: String,
    shard: String,
}

impl std::fmt::Debug for TxLockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxLockGuard")
            .field("key", &self.key)
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl TxLockGuard {
    /// The connection whose open transaction holds the lock: your statements here commit or
    /// roll back with it.
    pub fn conn(&mut self) -> &mut Conn {
        self.conn
            .as_mut()
            .expect("open until commit or rollback")
            .raw()
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The shard holding the row.
    pub fn shard(&self) -> &str {
        &self.shard
    }

    /// Commits your statements and releases the lock.
    pub async fn commit(mut self) -> Result<()> {
        self.end("COMMIT").await
    }

    /// Rolls back your statements and releases the lock.
    pub async fn rollback(mut self) -> Result<()> {
        self.end("ROLLBACK").await
    }

    async fn end(&mut self, how: &str) -> Result<()> {
        let mut conn = self.conn.take().expect("ended once");
        conn.raw()
            .query_drop(how)
            .await
            .map_err(|e| classify(e).into_error(&self.shard))
    }
}

impl Drop for TxLockGuard {
    /// Rolls back in the background; without a runtime, the connection is closed, which
    /// rolls back on the server.
    fn drop(&mut self) {
        let Some(conn) = self.conn.take() else { return };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn(async move {
                let mut conn = conn;
                if conn.raw().query_drop("ROLLBACK").await.is_err() {
                    drop(deadpool::managed::Object::take(conn));
                }
            })),
            Err(_) => drop(deadpool::managed::Object::take(conn)),
        }
    }
}

/// A version compare-and-set lock held by [`LockRouter::cas_acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasGuard {
    /// The key.
    pub key: String,
    /// The owner written in the row.
    pub owner: String,
    /// The row's version after the acquire (it rises with every acquire and release).
    pub version: u64,
}

/// A state machine over a row of the caller's table: which column identifies the row, which
/// holds its state, and which transitions are allowed. Names are checked when declared (they
/// are the only parts of the statement that are not bound parameters).
#[derive(Debug, Clone)]
pub struct StateMachine {
    table: String,
    id_column: String,
    state_column: String,
    transitions: Vec<(String, String)>,
}

impl StateMachine {
    /// A machine on `table` (rows found by `id_column`, state in `state_column`).
    pub fn new(table: &str, id_column: &str, state_column: &str) -> Result<Self> {
        for (what, name) in [
            ("table", table),
            ("id column", id_column),
            ("state column", state_column),
        ] {
            let ok = !name.is_empty()
                && name.len() <= 64
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !ok {
                return Err(Error::InvalidArgument {
                    name: "state machine",
                    reason: format!("{what} `{name}` must be 1-64 of [A-Za-z0-9_]"),
                });
            }
        }
        Ok(Self {
            table: table.to_owned(),
            id_column: id_column.to_owned(),
            state_column: state_column.to_owned(),
            transitions: Vec::new(),
        })
    }

    /// Allows `from` → `to`.
    pub fn allow(mut self, from: &str, to: &str) -> Self {
        self.transitions.push((from.to_owned(), to.to_owned()));
        self
    }
}

/// Closes a connection instead of pooling it, unless taken out first.
struct Discard(Option<deadpool::managed::Object<ShardManager>>);

impl Drop for Discard {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(deadpool::managed::Object::take(conn));
        }
    }
}

/// A job claimed by [`LockRouter::claim_job`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// The job's id (unique on its queue's shard).
    pub id: u64,
    /// The queue.
    pub queue: String,
    /// What [`LockRouter::enqueue_job`] stored.
    pub payload: Vec<u8>,
    /// Claims of it before this one that were not completed (lease ran out).
    pub retry_count: u32,
    /// The claim token written in the row (the worker's name and a claim number).
    pub claim: String,
}

impl LockRouter {
    /// The shard state of `key` in the topology in force.
    pub(crate) fn state_for(&self, key: &LockKey) -> std::sync::Arc<ShardState> {
        self.inner.topology.load().locate(key).clone()
    }

    /// Locks `key` with `SELECT ... FOR UPDATE` on its row of `shardlock_txlock` (created
    /// race-free on first use) in a new transaction on a dedicated connection of the key's
    /// shard, waiting up to `wait` (zero: `NOWAIT`; the server's lock wait timeout is whole
    /// seconds, so the wait is also enforced here). Errors: `Timeout` when the row stayed
    /// locked, `Unavailable` when the shard failed; deadlocks are retried.
    pub async fn lock_in_transaction(&self, key: &str, wait: Duration) -> Result<TxLockGuard> {
        let lock_key = LockKey::new(key)?;
        let shard = self.state_for(&lock_key);
        let name = shard.shard.name().to_owned();
        let started = tokio::time::Instant::now();
        let deadline = started + wait;
        loop {
            let attempt = async {
                // Until the lock is ours, a failed or abandoned attempt's connection is closed,
                // not pooled: a lock statement still waiting on the server must not end up
                // holding the row on an idle pooled connection.
                let mut conn = Discard(Some(shard.shard.connection().await?));
                let raw = conn.0.as_mut().expect("set above").raw();
                let run = async {
                    // Text protocol, the key as a hex literal (no injection possible): the
                    // connection is reset after the transaction, and prepared statements
                    // would not survive that.
                    let hex: String = lock_key
                        .stored()
                        .iter()
                        .map(|b| format!("{b:02x}"))
                        .collect();
                    raw.query_drop(format!(
                        "INSERT INTO shardlock_txlock (lock_key) VALUES (X'{hex}') \
                         ON DUPLICATE KEY UPDATE lock_key = lock_key"
                    ))
                    .await?;
                    let secs = wait.as_secs_f64().ceil().max(1.0) as u64;
                    raw.query_drop(format!("SET SESSION innodb_lock_wait_timeout = {secs}"))
                        .await?;
                    raw.query_drop("START TRANSACTION").await?;
                    let nowait = if wait.is_zero() { " NOWAIT" } else { "" };
                    raw.query_drop(format!(
                        "SELECT lock_key FROM shardlock_txlock WHERE lock_key = X'{hex}' FOR UPDATE{nowait}"
                    ))
                    .await
                };
                run.await.map_err(classify)?;
                Ok::<_, BackendError>(conn.0.take().expect("set above"))
            };
            let bounded = async {
                match tokio::time::timeout_at(deadline + Duration::from_millis(50), attempt).await {
                    Ok(r) => r,
                    Err(_) => Err(BackendError::new(
                        BackendErrorKind::LockWaitTimeout,
                        Some(1205),
                        "the row stayed locked for the whole wait",
                    )),
                }
            };
            match shard.call_waiting(bounded).await {
                Ok(conn) => {
                    return Ok(TxLockGuard {
                        conn: Some(conn),
                        key: key.to_owned(),
                        shard: name,
                    })
                }
                // NOWAIT answers 3572 (MySQL) or 1205 (MariaDB) when the row is locked.
                Err(e)
                    if e.kind == BackendErrorKind::LockWaitTimeout
                        || e.code == Some(3572)
                        || (e.kind == BackendErrorKind::Deadlock
                            && tokio::time::Instant::now() >= deadline) =>
                {
                    return Err(Error::Timeout {
                        key: key.to_owned(),
                        waited: started.elapsed(),
                    })
                }
                Err(e) if e.kind == BackendErrorKind::Deadlock => continue,
                Err(e) => return Err(e.into_error(&name)),
            }
        }
    }

    /// Takes `key` by compare-and-set: reads the row's version and, if nobody owns it, sets
    /// `owner` where the version is still the one read. `None` when someone else owns it (or
    /// won the race). Two statements; the row is created on first use.
    pub async fn cas_acquire(&self, key: &str, owner: &str) -> Result<Option<CasGuard>> {
        let lock_key = LockKey::new(key)?;
        let shard = self.state_for(&lock_key);
        let stored = lock_key.stored().to_vec();
        let owner_s = owner.to_owned();
        let got = shard
            .run(|c| {
                let (stored, owner) = (stored.clone(), owner_s.clone());
                Box::pin(async move {
                    c.exec_drop(
                        "INSERT INTO shardlock_cas (lock_key, owner, version) VALUES (?, NULL, 0) \
                         ON DUPLICATE KEY UPDATE lock_key = lock_key",
                        (&stored,),
                    )
                    .await?;
                    let row: Option<(Option<Vec<u8>>, u64)> = c
                        .exec_first(
                            "SELECT owner, version FROM shardlock_cas WHERE lock_key = ?",
                            (&stored,),
                        )
                        .await?;
                    let Some((None, version)) = row else {
                        return Ok(None);
                    };
                    c.exec_drop(
                        "UPDATE shardlock_cas SET owner = ?, version = version + 1 \
                         WHERE lock_key = ? AND version = ? AND owner IS NULL",
                        (&owner, &stored, version),
                    )
                    .await?;
                    Ok((c.affected_rows() == 1).then_some(version + 1))
                })
            })
            .await?;
        Ok(got.map(|version| CasGuard {
            key: key.to_owned(),
            owner: owner.to_owned(),
            version,
        }))
    }

    /// Releases a CAS lock: only if the row still has the guard's owner and version. `false`
    /// when it did not (someone force-changed it).
    pub async fn cas_release(&self, guard: CasGuard) -> Result<bool> {
        let lock_key = LockKey::new(&guard.key)?;
        let shard = self.state_for(&lock_key);
        let stored = lock_key.stored().to_vec();
        shard
            .run(|c| {
                let (stored, owner) = (stored.clone(), guard.owner.clone());
                Box::pin(async move {
                    c.exec_drop(
                        "UPDATE shardlock_cas SET owner = NULL, version = version + 1 \
                         WHERE lock_key = ? AND owner = ? AND version = ?",
                        (&stored, &owner, guard.version),
                    )
                    .await?;
                    Ok(c.affected_rows() == 1)
                })
            })
            .await
    }

    /// Moves row `id` of the machine's table (on the shard of key `id`) from `from` to `to`
    /// in one conditional `UPDATE`; `true` when this call made the transition, `false` when
    /// the row was not in `from` (someone else moved it first, or it is done). Transitions the
    /// machine does not allow are refused before touching the shard.
    pub async fn transition(
        &self,
        machine: &StateMachine,
        id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool> {
        if !machine
            .transitions
            .iter()
            .any(|(f, t)| f == from && t == to)
        {
            return Err(Error::InvalidArgument {
                name: "transition",
                reason: format!("{from} -> {to} is not allowed on {}", machine.table),
            });
        }
        let key = LockKey::new(id)?;
        let shard = self.state_for(&key);
        let sql = format!(
            "UPDATE {} SET {state} = ? WHERE {} = ? AND {state} = ?",
            machine.table,
            machine.id_column,
            state = machine.state_column
        );
        let (id, from, to) = (id.to_owned(), from.to_owned(), to.to_owned());
        shard
            .run(|c| {
                let (sql, id, from, to) = (sql.clone(), id.clone(), from.clone(), to.clone());
                Box::pin(async move {
                    c.exec_drop(sql, (&to, &id, &from)).await?;
                    Ok(c.affected_rows() == 1)
                })
            })
            .await
    }

    /// The shard connection of a key, for setting up a state machine's table next to it.
    pub async fn shard_connection(
        &self,
        key: &str,
    ) -> Result<deadpool::managed::Object<ShardManager>> {
        let key = LockKey::new(key)?;
        let shard = self.state_for(&key);
        shard
            .shard
            .connection()
            .await
            .map_err(|e| e.into_error(shard.shard.name()))
    }

    /// Adds a job to `queue` (its jobs live on the shard of key `queue`), due after `delay`;
    /// a claim that is not completed within its lease is followed by up to `max_retries`
    /// more. Returns the job's id.
    pub async fn enqueue_job(
        &self,
        queue: &str,
        payload: &[u8],
        delay: Duration,
        max_retries: u32,
    ) -> Result<u64> {
        let key = LockKey::new(queue)?;
        let shard = self.state_for(&key);
        let (queue, payload) = (queue.to_owned(), payload.to_vec());
        shard
            .run(|c| {
                let (queue, payload) = (queue.clone(), payload.clone());
                Box::pin(async move {
                    c.exec_drop(
                        "INSERT INTO shardlock_job \
                         (queue, payload, status, due_at, retry_count, max_retries) \
                         VALUES (?, ?, 'ready', NOW(3) + INTERVAL ? MICROSECOND, 0, ?)",
                        (&queue, &payload, delay.as_micros() as u64, max_retries),
                    )
                    .await?;
                    Ok(c.last_insert_id().unwrap_or(0))
                })
            })
            .await
    }

    /// Claims the next due job of `queue` for `worker`, for `lease`: first a claimed job
    /// whose lease ran out (its retry count goes up) while retries are left, else the ready
    /// job due first. One READ COMMITTED transaction: `SELECT ... FOR UPDATE SKIP LOCKED`
    /// (MySQL 8, MariaDB 10.6+) locks just the chosen row, so claimers never wait on each
    /// other, then an `UPDATE` by primary key. `None` when nothing is due. Deadlocks are
    /// retried inside.
    pub async fn claim_job(
        &self,
        queue: &str,
        worker: &str,
        lease: Duration,
    ) -> Result<Option<Job>> {
        let key = LockKey::new(queue)?;
        let shard = self.state_for(&key);
        let name = shard.shard.name().to_owned();
        let (_, claim_no) = self.inner.shared.next_owner();
        let claim = format!("{worker}@{claim_no}");
        let mut tries = 0;
        let claimed = loop {
            let attempt = shard
                .call_waiting(shard.shard.with_conn(shard.shard.statement_timeout(), |c| {
                    let (queue, claim) = (queue.to_owned(), claim.clone());
                    Box::pin(async move { claim_in(c, &queue, &claim, lease).await })
                }))
                .await;
            match attempt {
                Err(e) if e.kind.is_retryable() && tries < 20 => {
                    tries += 1;
                    let jitter = rand::random::<u64>() % (2 * tries);
                    tokio::time::sleep(Duration::from_millis(1 + jitter)).await;
                }
                other => break other.map_err(|e| e.into_error(&name))?,
            }
        };
        Ok(claimed.map(|(id, payload, retry_count)| Job {
            id,
            queue: queue.to_owned(),
            payload,
            retry_count,
            claim: claim.clone(),
        }))
    }

    /// Marks `job` done, if its claim still holds (`false` when the lease ran out: the job
    /// may have been claimed again).
    pub async fn complete_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, "done").await
    }

    /// Marks `job` failed for good, if its claim still holds.
    pub async fn fail_job(&self, job: &Job) -> Result<bool> {
        self.finish_job(job, "failed").await
    }

    async fn finish_job(&self, job: &Job, status: &'static str) -> Result<bool> {
        let key = LockKey::new(&job.queue)?;
        let shard = self.state_for(&key);
        let (claim, id) = (job.claim.clone(), job.id);
        shard
            .run(|c| {
                let claim = claim.clone();
                Box::pin(async move {
                    c.exec_drop(
                        "UPDATE shardlock_job SET status = ?, lease_until = NULL \
                         WHERE id = ? AND status = 'claimed' AND locked_by = ? \
                         AND lease_until > NOW(3)",
                        (status, id, &claim),
                    )
                    .await?;
                    Ok(c.affected_rows() == 1)
                })
            })
            .await
    }
}

/// The claim transaction of [`LockRouter::claim_job`] on one connection.
async fn claim_in(
    c: &mut Conn,
    queue: &str,
    claim: &str,
    lease: Duration,
) -> mysql_async::Result<Option<(u64, Vec<u8>, u32)>> {
    let mut opts = TxOpts::default();
    opts.with_isolation_level(IsolationLevel::ReadCommitted);
    let mut tx = c.start_transaction(opts).await?;
    // An abandoned claim first (a crashed worker's job), else the ready job due first.
    let mut row: Option<(u64, Vec<u8>, u32)> = tx
        .exec_first(
            "SELECT id, payload, retry_count + 1 FROM shardlock_job \
             WHERE queue = ? AND status = 'claimed' AND lease_until <= NOW(3) \
             AND retry_count < max_retries LIMIT 1 FOR UPDATE SKIP LOCKED",
            (queue,),
        )
        .await?;
    if row.is_none() {
        row = tx
            .exec_first(
                "SELECT id, payload, retry_count FROM shardlock_job \
                 WHERE queue = ? AND status = 'ready' AND due_at <= NOW(3) \
                 ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED",
                (queue,),
            )
            .await?;
    }
    let Some((id, payload, retry_count)) = row else {
        tx.rollback().await?;
        return Ok(None);
    };
    tx.exec_drop(
        "UPDATE shardlock_job SET status = 'claimed', locked_by = ?, locked_at = NOW(3), \
         lease_until = NOW(3) + INTERVAL ? MICROSECOND, retry_count = ? WHERE id = ?",
        (claim, lease.as_micros() as u64, retry_count, id),
    )
    .await?;
    tx.commit().await?;
    Ok(Some((id, payload, retry_count)))
}
