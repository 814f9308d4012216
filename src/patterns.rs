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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, TxOpts};
use shardlock_core::{BackendError, BackendErrorKind, Error, LockKey, Result};
use shardlock_mysql::{classify, ShardManager};

use tokio::sync::watch;

use crate::keeper::ShardState;
use crate::topology::Topology;
use crate::LockRouter;

/// A row lock held inside an open transaction on a dedicated connection. Run your SQL on
/// [`TxLockGuard::conn`]; [`TxLockGuard::commit`] or [`TxLockGuard::rollback`] ends the
/// transaction and the lock together. Dropping the guard rolls back (the connection is reset
/// before reuse); if this process dies, the server rolls back when it notices the connection
/// is gone.
///
/// Across a reload that moves the key, the lock follows it: the row is also locked on the
/// key's new shard (in a transaction of its own) within half the move window. If that fails,
/// the lock is lost: [`TxLockGuard::is_held`] turns false, [`TxLockGuard::lost`] completes
/// and [`TxLockGuard::commit`] rolls back and answers [`Error::LockLost`].
pub struct TxLockGuard {
    /// `None` once committed or rolled back.
    conn: Option<deadpool::managed::Object<ShardManager>>,
    key: String,
    shard: String,
    state: Arc<TxLockState>,
}

/// What a reload needs to make a transaction lock follow its key: where the row is locked and
/// the transactions holding it elsewhere.
#[derive(Debug)]
pub(crate) struct TxLockState {
    key: LockKey,
    /// The topology epoch up to which the lock is known to hold where the key lives.
    placed_epoch: AtomicU64,
    rows: std::sync::Mutex<TxRows>,
    lost: watch::Sender<bool>,
    /// One follower at a time.
    following: tokio::sync::Mutex<()>,
}

/// The shards where a transaction lock's row is locked (the guard's own first), and the
/// connections of the other ones (each closed, so rolled back, when the lock ends).
#[derive(Debug, Default)]
struct TxRows {
    shards: Vec<Arc<ShardState>>,
    others: Vec<Discard>,
    ended: bool,
}

impl TxLockState {
    fn mark_lost(&self, why: &'static str) {
        if !self.lost.send_replace(true) {
            tracing::warn!(key = %self.key, why, "shardlock transaction lock lost");
        }
    }

    /// Ends the lock's transactions on other shards (closing their connections).
    fn end(&self) {
        let others = {
            let mut rows = self.rows.lock().unwrap();
            rows.ended = true;
            std::mem::take(&mut rows.others)
        };
        drop(others);
    }
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

    /// The shard holding the row (where the key lived when it was locked).
    pub fn shard(&self) -> &str {
        &self.shard
    }

    /// False once the lock is lost: its key moved in a reload and could not be locked on its
    /// new shard in time.
    pub fn is_held(&self) -> bool {
        !*self.state.lost.borrow()
    }

    /// Completes when the lock is lost (see [`TxLockGuard::is_held`]); never for a lock that
    /// stays held. Cancel-safe.
    pub async fn lost(&self) {
        let mut lost = self.state.lost.subscribe();
        let _ = lost.wait_for(|lost| *lost).await;
    }

    /// Commits your statements and releases the lock. A lost lock is rolled back instead and
    /// answers [`Error::LockLost`]: nothing of the transaction is kept.
    pub async fn commit(mut self) -> Result<()> {
        if !self.is_held() {
            self.end("ROLLBACK").await?;
            return Err(Error::LockLost {
                key: self.key.clone(),
            });
        }
        self.end("COMMIT").await
    }

    /// Rolls back your statements and releases the lock.
    pub async fn rollback(mut self) -> Result<()> {
        self.end("ROLLBACK").await
    }

    /// Cancellation: if this is dropped before the server answered, the connection is closed
    /// (the server then rolls back); it is pooled again only after a complete answer.
    async fn end(&mut self, how: &str) -> Result<()> {
        let mut conn = Discard(self.conn.take());
        let result = conn
            .0
            .as_mut()
            .expect("ended once")
            .raw()
            .query_drop(how)
            .await
            .map_err(|e| classify(e).into_error(&self.shard));
        self.state.end();
        if result.is_ok() {
            drop(conn.0.take()); // a clean connection back to the pool
        }
        result
    }
}

impl Drop for TxLockGuard {
    /// Closes the connection, which rolls back on the server: a statement of yours that was
    /// interrupted may still be running on it, so it never goes back to the pool.
    fn drop(&mut self) {
        self.state.end();
        drop(Discard(self.conn.take()));
    }
}

/// A connection to a key's shard for your own SQL (setting up a state machine's table next to
/// it, say), from [`LockRouter::shard_connection`]. Closed when dropped, never pooled again: a
/// statement of yours interrupted on it must not reach the next user.
#[derive(Debug)]
pub struct ShardConnection(Discard);

impl ShardConnection {
    /// The connection.
    pub fn raw(&mut self) -> &mut Conn {
        self.0 .0.as_mut().expect("open until dropped").raw()
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
#[derive(Debug)]
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
    /// The shard it was claimed on (its queue may move in a reload before it is finished).
    home: JobHome,
}

/// The shard a job was claimed on; equal for any two jobs (only the public fields count).
#[derive(Clone)]
struct JobHome(Weak<ShardState>);

impl PartialEq for JobHome {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for JobHome {}

impl std::fmt::Debug for JobHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.upgrade() {
            Some(s) => f.write_str(s.shard.name()),
            None => f.write_str("(gone)"),
        }
    }
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
    ///
    /// While a reload's move is in progress, a key that moved is locked on the shards it lived
    /// on before as well (each in a transaction of its own, released with the lock), so a
    /// process that has not reloaded yet is kept out; a lock held when its key moves follows
    /// it (see [`TxLockGuard`]).
    pub async fn lock_in_transaction(&self, key: &str, wait: Duration) -> Result<TxLockGuard> {
        let lock_key = LockKey::new(key)?;
        self.check_joined(&lock_key)?;
        let deadline = crate::router::instant_after(wait);
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(&lock_key).clone();
        let previous = topology.previous_locations(&lock_key);
        // Every shard in one global order (by name), the current one included, so that two
        // processes at different epochs cannot each hold one row and wait for the other's
        // (a deadlock across servers that no server can see).
        let mut order: Vec<&Arc<ShardState>> = previous.iter().chain([&shard]).collect();
        order.sort_by(|a, b| a.shard.name().cmp(b.shard.name()));
        let mut others = Vec::with_capacity(previous.len());
        let mut conn = None;
        for at in order {
            let locked = lock_row(at, &lock_key, wait, deadline).await?;
            if Arc::ptr_eq(at, &shard) {
                conn = Some(locked);
            } else {
                others.push(Discard(Some(locked)));
            }
        }
        let conn = conn.expect("the current shard is in the order");
        let mut shards = vec![shard.clone()];
        shards.extend(previous);
        let state = Arc::new(TxLockState {
            key: lock_key,
            placed_epoch: AtomicU64::new(topology.epoch),
            rows: std::sync::Mutex::new(TxRows {
                shards,
                others,
                ended: false,
            }),
            lost: watch::channel(false).0,
            following: tokio::sync::Mutex::new(()),
        });
        // Registered, then the epoch checked: a reload swaps the topology, then looks at the
        // registered locks, so one of the two sees the other.
        {
            let mut locks = self.inner.tx_locks.lock().unwrap();
            locks.retain(|l| l.strong_count() > 0);
            locks.push(Arc::downgrade(&state));
        }
        if self.inner.shared.epoch() > topology.epoch {
            follow_tx_lock(Arc::downgrade(&self.inner), state.clone());
        }
        Ok(TxLockGuard {
            conn: Some(conn),
            key: key.to_owned(),
            shard: shard.shard.name().to_owned(),
            state,
        })
    }

    /// Takes `key` by compare-and-set: reads the row's version and, if nobody owns it, sets
    /// `owner` where the version is still the one read. `None` when someone else owns it (or
    /// won the race). Two statements; the row is created on first use. A retry after a lost
    /// reply learns that its first try won (a token per call is written with the owner); a
    /// key already held under the same owner name by another call is not given twice.
    ///
    /// While a reload's move is in progress, a key that moved is taken on the shards it lived
    /// on before as well (and given back there if it cannot be taken everywhere); once the
    /// move is over, rows still owned on the old shards are carried to the new one, so a lock
    /// taken before a reload stays taken, and releasable, after it.
    pub async fn cas_acquire(&self, key: &str, owner: &str) -> Result<Option<CasGuard>> {
        let lock_key = LockKey::new(key)?;
        self.check_joined(&lock_key)?;
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(&lock_key).clone();
        let mut taken: Vec<Arc<ShardState>> = Vec::new();
        let mut version = Ok(None);
        let token = self.inner.shared.next_owner().1;
        for at in topology
            .previous_locations(&lock_key)
            .into_iter()
            .chain([shard])
        {
            version = cas_take(&at, lock_key.stored(), owner, &token).await;
            if !matches!(version, Ok(Some(_))) {
                break;
            }
            taken.push(at);
        }
        let version = match version {
            Ok(Some(version)) => version,
            // Someone owns it somewhere, or a shard failed: give back what was taken (a row
            // that cannot be given back now stays owned until its owner releases it).
            failed => {
                for at in taken {
                    let _ = cas_free(&at, lock_key.stored(), owner, None).await;
                }
                return failed.map(|_| None);
            }
        };
        Ok(Some(CasGuard {
            key: key.to_owned(),
            owner: owner.to_owned(),
            version,
        }))
    }

    /// Releases a CAS lock: only if the row still has the guard's owner and version. `false`
    /// when it did not (someone force-changed it). While a reload's move is in progress, the
    /// owner's rows on the key's previous shards are released too (the guard's version is the
    /// current shard's).
    pub async fn cas_release(&self, guard: CasGuard) -> Result<bool> {
        let lock_key = LockKey::new(&guard.key)?;
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(&lock_key).clone();
        // Every shard is tried; the first failure is reported after (release again to retry).
        let mut released = false;
        let mut failure = None;
        for old in topology.previous_locations(&lock_key) {
            match cas_free(&old, lock_key.stored(), &guard.owner, None).await {
                Ok(freed) => released |= freed,
                Err(e) => drop(failure.get_or_insert(e)),
            }
        }
        match cas_free(&shard, lock_key.stored(), &guard.owner, Some(guard.version)).await {
            Ok(freed) => released |= freed,
            Err(e) => drop(failure.get_or_insert(e)),
        }
        failure.map_or(Ok(released), Err)
    }

    /// Moves row `id` of the machine's table (on the shard of key `id`, or while a reload's
    /// move is in progress on a shard it lived on before) from `from` to `to` in one
    /// conditional `UPDATE`; `true` when this call made the transition, `false` when
    /// the row was not in `from` (someone else moved it first, or it is done). Transitions the
    /// machine does not allow, and self-transitions, are refused before touching the shard.
    /// If the connection breaks after the statement may have reached the shard, the call is
    /// not retried (a retry could not tell its own transition from another's): the error
    /// says the outcome is unknown; read the row to learn it.
    pub async fn transition(
        &self,
        machine: &StateMachine,
        id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool> {
        if from == to {
            return Err(Error::InvalidArgument {
                name: "transition",
                reason: format!(
                    "{from} -> {to} changes nothing, so it cannot tell a winner from a loser"
                ),
            });
        }
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
        self.check_joined(&key)?;
        let topology = self.inner.topology.load_full();
        let mut shards = vec![topology.locate(&key).clone()];
        shards.extend(topology.previous_locations(&key));
        drop(topology);
        let sql = format!(
            "UPDATE {} SET {state} = ? WHERE {} = ? AND {state} = ?",
            machine.table,
            machine.id_column,
            state = machine.state_column
        );
        let (id, from, to) = (id.to_owned(), from.to_owned(), to.to_owned());
        // The row lives on the key's shard; while a move is in progress it may still be on
        // a shard the key lived on before (the application moves its rows with its keys).
        for shard in shards {
            // Not retried once it may have reached the server: a retry could not tell our own
            // transition from someone else's (the error then says the outcome is unknown).
            let moved = shard
                .run_once(|c| {
                    let (sql, id, from, to) = (sql.clone(), id.clone(), from.clone(), to.clone());
                    Box::pin(async move {
                        c.exec_drop(sql, (&to, &id, &from)).await?;
                        Ok(c.affected_rows() == 1)
                    })
                })
                .await?;
            if moved {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// A connection to the shard of `key`, for setting up a state machine's table next to it.
    /// It does not go through the shard's breaker (an operator's path), and it is closed when
    /// dropped.
    pub async fn shard_connection(&self, key: &str) -> Result<ShardConnection> {
        let key = LockKey::new(key)?;
        let shard = self.state_for(&key);
        let conn = shard
            .shard
            .connection()
            .await
            .map_err(|e| e.into_error(shard.shard.name()))?;
        Ok(ShardConnection(Discard(Some(conn))))
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
        self.check_joined(&key)?;
        let shard = self.state_for(&key);
        let (queue, payload) = (queue.to_owned(), payload.to_vec());
        // A request id in `origin` (unique): a retry after a lost reply finds the job the
        // first try enqueued and answers its id, instead of enqueuing it twice.
        let request = format!("enqueue:{}", self.inner.shared.next_owner().1);
        shard
            .run(|c| {
                let (queue, payload, request) = (queue.clone(), payload.clone(), request.clone());
                Box::pin(async move {
                    c.exec_drop(
                        "INSERT INTO shardlock_job \
                         (queue, payload, status, due_at, retry_count, max_retries, origin) \
                         VALUES (?, ?, 'ready', NOW(3) + INTERVAL ? MICROSECOND, 0, ?, ?) \
                         ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id)",
                        (
                            &queue,
                            &payload,
                            delay.as_micros() as u64,
                            max_retries,
                            &request,
                        ),
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
        self.check_joined(&key)?;
        let (_, claim_no) = self.inner.shared.next_owner();
        let claim = format!("{worker}@{claim_no}");
        // The queue's shard first, then (while a reload's move is in progress) the shards it
        // lived on before, whose jobs are carried over once the move is over.
        let topology = self.inner.topology.load_full();
        let mut shards = vec![topology.locate(&key).clone()];
        shards.extend(topology.previous_locations(&key));
        drop(topology);
        for shard in shards {
            if let Some((id, payload, retry_count)) = claim_on(&shard, queue, &claim, lease).await?
            {
                return Ok(Some(Job {
                    id,
                    queue: queue.to_owned(),
                    payload,
                    retry_count,
                    claim,
                    home: JobHome(Arc::downgrade(&shard)),
                }));
            }
        }
        Ok(None)
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
        // On the shard it was claimed on, even if its queue moved since.
        let shard = match job.home.0.upgrade() {
            Some(home) => home,
            None => self.state_for(&LockKey::new(&job.queue)?),
        };
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

/// Takes the CAS row of `stored` on `shard` for `owner`: its new version, or `None` when it
/// is owned (or the race was lost).
async fn cas_take(
    shard: &ShardState,
    stored: &[u8],
    owner: &str,
    token: &str,
) -> Result<Option<u64>> {
    let (stored, owner, token) = (stored.to_vec(), owner.to_owned(), token.to_owned());
    shard
        .run(|c| {
            let (stored, owner, token) = (stored.clone(), owner.clone(), token.clone());
            Box::pin(async move {
                c.exec_drop(
                    "INSERT INTO shardlock_cas (lock_key, owner, version) VALUES (?, NULL, 0) \
                     ON DUPLICATE KEY UPDATE lock_key = lock_key",
                    (&stored,),
                )
                .await?;
                type Row = (Option<Vec<u8>>, u64, Option<Vec<u8>>);
                let row: Option<Row> = c
                    .exec_first(
                        "SELECT owner, version, token FROM shardlock_cas WHERE lock_key = ?",
                        (&stored,),
                    )
                    .await?;
                let version = match row {
                    Some((None, version, _)) => version,
                    // Taken by this very call: a try whose reply was lost (the token is per
                    // call, so another acquire under the same owner name is not mistaken
                    // for it).
                    Some((Some(_), version, Some(t))) if t == token.as_bytes() => {
                        return Ok(Some(version));
                    }
                    _ => return Ok(None),
                };
                c.exec_drop(
                    "UPDATE shardlock_cas SET owner = ?, token = ?, version = version + 1 \
                     WHERE lock_key = ? AND version = ? AND owner IS NULL",
                    (&owner, &token, &stored, version),
                )
                .await?;
                Ok((c.affected_rows() == 1).then_some(version + 1))
            })
        })
        .await
}

/// Frees the CAS row of `stored` on `shard` if `owner` owns it (at `version`, when given).
async fn cas_free(
    shard: &ShardState,
    stored: &[u8],
    owner: &str,
    version: Option<u64>,
) -> Result<bool> {
    let (stored, owner) = (stored.to_vec(), owner.to_owned());
    shard
        .run(|c| {
            let (stored, owner) = (stored.clone(), owner.clone());
            Box::pin(async move {
                c.exec_drop(
                    "UPDATE shardlock_cas SET owner = NULL, version = version + 1 \
                     WHERE lock_key = ? AND owner = ? AND (? IS NULL OR version = ?)",
                    (&stored, &owner, version, version),
                )
                .await?;
                Ok(c.affected_rows() == 1)
            })
        })
        .await
}

/// Locks `key`'s row of `shardlock_txlock` on `shard` in a new transaction on a dedicated
/// connection, waiting up to `wait` (enforced until `deadline`); see
/// [`LockRouter::lock_in_transaction`].
async fn lock_row(
    shard: &Arc<ShardState>,
    lock_key: &LockKey,
    wait: Duration,
    deadline: tokio::time::Instant,
) -> Result<deadpool::managed::Object<ShardManager>> {
    let key = lock_key.as_str();
    let name = shard.shard.name().to_owned();
    let started = tokio::time::Instant::now();
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
                // The caller's wait, for both statements below (the upsert of a held row waits
                // for its holder too). Whole seconds, at most the server's limit (a "wait for
                // ever" waits that long).
                let secs = wait.as_secs_f64().ceil().clamp(1.0, 1_073_741_824.0) as u64;
                raw.query_drop(format!("SET SESSION innodb_lock_wait_timeout = {secs}"))
                    .await?;
                raw.query_drop(format!(
                    "INSERT INTO shardlock_txlock (lock_key) VALUES (X'{hex}') \
                         ON DUPLICATE KEY UPDATE lock_key = lock_key"
                ))
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
            Ok(conn) => return Ok(conn),
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

/// Every transaction lock registered with the router that was placed under an epoch older
/// than `topology`'s follows its key.
pub(crate) fn follow_tx_locks(inner: &Arc<crate::router::Inner>, topology: &Topology) {
    let locks: Vec<Arc<TxLockState>> = inner
        .tx_locks
        .lock()
        .unwrap()
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for state in locks {
        if state.placed_epoch.load(Ordering::Acquire) < topology.epoch {
            follow_tx_lock(Arc::downgrade(inner), state);
        }
    }
}

/// Locks a transaction lock's row on its key's new shard too, within half the move window of
/// the reload; or marks the lock lost.
fn follow_tx_lock(inner: Weak<crate::router::Inner>, state: Arc<TxLockState>) {
    tokio::spawn(async move {
        let _one_at_a_time = state.following.lock().await;
        let Some(topology) = inner.upgrade().map(|i| i.topology.load_full()) else {
            return;
        };
        if state.placed_epoch.load(Ordering::Acquire) >= topology.epoch {
            return;
        }
        let target = topology.locate(&state.key).clone();
        let there = {
            let rows = state.rows.lock().unwrap();
            rows.ended || rows.shards.iter().any(|s| s.same_database(&target))
        };
        if !there {
            let deadline = topology.reloaded_at + topology.config.move_window() / 2;
            let wait = deadline.saturating_duration_since(tokio::time::Instant::now());
            match lock_row(&target, &state.key, wait, deadline).await {
                Ok(conn) => {
                    let mut rows = state.rows.lock().unwrap();
                    if !rows.ended {
                        rows.shards.push(target);
                        rows.others.push(Discard(Some(conn)));
                    }
                }
                Err(e) => {
                    tracing::warn!(key = %state.key, shard = target.shard.name(), error = %e, "shardlock could not lock a moved key's row on its new shard");
                    state.mark_lost(
                        "its key moved in a reload and its row could not be locked on the new shard in time",
                    );
                }
            }
        }
        state
            .placed_epoch
            .fetch_max(topology.epoch, Ordering::AcqRel);
    });
}

/// [`LockRouter::claim_job`] on one shard: the claimed job's id, payload and retry count.
async fn claim_on(
    shard: &ShardState,
    queue: &str,
    claim: &str,
    lease: Duration,
) -> Result<Option<(u64, Vec<u8>, u32)>> {
    let mut tries = 0;
    // After a try that may have claimed a job (its reply lost), the next one first looks for
    // the job claimed under this claim token: a claim is never made twice.
    let mut look_first = false;
    loop {
        let attempt = shard
            .call_waiting(
                shard
                    .shard
                    .with_conn_once(shard.shard.statement_timeout(), |c| {
                        let (queue, claim) = (queue.to_owned(), claim.to_owned());
                        Box::pin(async move {
                            if look_first {
                                if let Some(mine) = claimed_by(c, &queue, &claim).await? {
                                    return Ok(Some(mine));
                                }
                            }
                            claim_in(c, &queue, &claim, lease).await
                        })
                    }),
            )
            .await;
        match attempt {
            Err(e) if (e.kind.is_retryable() || e.maybe_applied) && tries < 20 => {
                tries += 1;
                look_first |= e.maybe_applied;
                let jitter = rand::random::<u64>() % (2 * tries);
                tokio::time::sleep(Duration::from_millis(1 + jitter)).await;
            }
            other => return other.map_err(|e| e.into_error(shard.shard.name())),
        }
    }
}

/// The job of `queue` claimed under `claim`, if any (by an earlier try whose reply was lost).
async fn claimed_by(
    c: &mut Conn,
    queue: &str,
    claim: &str,
) -> mysql_async::Result<Option<(u64, Vec<u8>, u32)>> {
    c.exec_first(
        "SELECT id, payload, retry_count FROM shardlock_job \
         WHERE queue = ? AND status = 'claimed' AND locked_by = ? LIMIT 1",
        (queue, claim),
    )
    .await
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
    // Abandoned claims with no retries left are failed for good, not left claimed for ever.
    // (READ COMMITTED: only the rows that match are locked, and claimers never lock those.)
    tx.exec_drop(
        "UPDATE shardlock_job SET status = 'failed', lease_until = NULL \
         WHERE queue = ? AND status = 'claimed' AND lease_until <= NOW(3) \
         AND retry_count >= max_retries LIMIT 100",
        (queue,),
    )
    .await?;
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
        tx.commit().await?; // keeps the jobs failed above
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
