//! The statements of the other lock patterns (`shardlock::patterns`): transaction locks,
//! version compare-and-set locks, state-machine claims and job claims. Their tables are made
//! by migration 4 (and 6); time is the shard's clock.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, Transaction, TxOpts};
use shardlock_core::{BackendError, Error};

use crate::error::classify;
use crate::pool::{settle, SessionConn};
use crate::shard::Shard;

// Transaction locks. Text protocol, the key as a hex literal (`{key}`, hex digits only: no
// injection possible): the connection is reset after the transaction, and prepared statements
// would not survive that.

/// The caller's wait (`{secs}`), for both statements below: the upsert of a row whose lock is
/// held waits for its holder too. Whole seconds, the server's unit; for this session only,
/// and only until the lock is taken ([`TX_LOCK`] sets the pool's again, for the caller's
/// own statements).
const TX_LOCK_WAIT: &str = "SET SESSION innodb_lock_wait_timeout = {secs}";

/// Whether the key has its row already: a plain read, which waits for no lock (the upsert
/// below would wait for the lock of a row someone holds, past a zero wait's `NOWAIT`).
const TX_ROW_SEEN: &str = "SELECT COUNT(*) FROM shardlock_txlock WHERE lock_key = {key}";

/// Makes sure the key has a row to lock, committed on its own before the transaction starts:
/// a locking read of a missing row would lock only a gap, which two transactions can hold at
/// once. An upsert that changes nothing, not `INSERT IGNORE` (which would also turn other
/// errors into warnings). Sent only for a row [`TX_ROW_SEEN`] did not find.
const TX_ROW: &str = "INSERT INTO shardlock_txlock (lock_key) VALUES ({key}) \
     ON DUPLICATE KEY UPDATE lock_key = lock_key";

/// Opens the transaction that holds the lock, autocommit off for the rest of the session
/// (the pool's reset turns it on again): if the caller's SQL ends that transaction — a
/// deadlock its statement loses rolls the whole transaction back, lock included; a DDL
/// statement or a `COMMIT` of its own commits it — what the caller runs after that opens a
/// transaction of its own, which ending the lock rolls back ([`TX_COMMIT`] finds no
/// savepoint), instead of committing statement by statement without the lock. (Not after a
/// `SET autocommit = 1` of its own, which commits and turns that back on.)
const TX_BEGIN: &str = "SET autocommit = 0; START TRANSACTION";

/// Takes the row's exclusive lock, held until the transaction ends or the connection dies, so
/// the caller's own statements in the transaction run under it. `{nowait}` is ` NOWAIT` for a
/// zero wait (MySQL 8.0, MariaDB 10.3+): a locked row is answered at once, with 3572 (MySQL)
/// or 1205 (MariaDB).
///
/// Then marks the transaction with a savepoint (named at random per lock, so that none of the
/// caller's can stand in for it), the one trace of it the server drops when the transaction
/// ends for any reason: [`TX_COMMIT`] finds it, or learns that the caller's SQL
/// ended the transaction early (a DDL statement commits implicitly, so does the caller's own
/// `COMMIT`) and that the statements after that ran without the lock. Then sets the
/// session's lock wait back to the pool's (`{after}`): the caller's own statements under the
/// lock wait as on any connection of the shard, not as long as the lock's wait said (a try
/// without waiting would leave them a second). Sent with the lock in one round trip; a failed
/// lock stops it before the savepoint.
const TX_LOCK: &str =
    "SELECT lock_key FROM shardlock_txlock WHERE lock_key = {key} FOR UPDATE{nowait}; \
     SAVEPOINT {savepoint}; SET SESSION innodb_lock_wait_timeout = {after}";

/// Ends the transaction of a lock whose locking read found no row (another transaction
/// deleted it meanwhile), autocommit on again: the row is created anew, committed on its own,
/// before the lock is taken again.
const TX_NO_ROW: &str = "ROLLBACK; SET autocommit = 1";

/// Ends a transaction lock keeping the caller's statements, if it is still the transaction
/// that took the lock (its savepoint is there); else the server answers 1305 (no such
/// savepoint) and commits nothing.
const TX_COMMIT: &str = "RELEASE SAVEPOINT {savepoint}; COMMIT";

/// Ends a transaction lock undoing the caller's statements, answering 1305 (and undoing
/// nothing) when the transaction that took the lock had already ended.
const TX_ROLLBACK_LOCK: &str = "ROLLBACK TO SAVEPOINT {savepoint}; ROLLBACK";

/// Goes back to a transaction lock's savepoint, keeping the transaction and its row lock:
/// answers 1305 when the transaction that took the lock ended.
const TX_BACK_TO_LOCK: &str = "ROLLBACK TO SAVEPOINT {savepoint}";

/// The server's answer to a savepoint that does not exist (MySQL and MariaDB).
const NO_SUCH_SAVEPOINT: u16 = 1305;

/// Ends a transaction lock undoing the caller's statements.
const TX_ROLLBACK: &str = "ROLLBACK";

impl SessionConn {
    /// Locks `key`'s row of `shardlock_txlock` (created on first use) in a new transaction on
    /// this connection. The server waits up to `wait` rounded up to whole seconds (zero: not
    /// at all); the caller enforces the exact wait. A row still locked is answered with a lock
    /// wait timeout (1205) or, for a zero wait on MySQL, 3572. Once it is taken, the session
    /// waits for row locks as the pool's sessions do under `statement_timeout`.
    ///
    /// `waiting` is set when a statement that may wait for the row's lock is sent: until then,
    /// a call cut short was held up by the shard, not by the lock's holder.
    pub async fn lock_tx_row(
        &mut self,
        key: &[u8],
        wait: Duration,
        statement_timeout: Duration,
        waiting: &AtomicBool,
    ) -> Result<(), BackendError> {
        let hex: String = key.iter().map(|b| format!("{b:02x}")).collect();
        let key = format!("X'{hex}'");
        // At most the server's limit: a "wait for ever" waits that long.
        let secs = wait.as_secs_f64().ceil().clamp(1.0, 1_073_741_824.0) as u64;
        let nowait = if wait.is_zero() { " NOWAIT" } else { "" };
        self.savepoint = format!("shardlock_tx_lock_{:016x}", rand::random::<u64>());
        let lock = TX_LOCK
            .replace("{key}", &key)
            .replace("{nowait}", nowait)
            .replace("{savepoint}", &self.savepoint)
            .replace(
                "{after}",
                &crate::pool::lock_wait_timeout_secs(statement_timeout).to_string(),
            );
        let raw = self.raw();
        let run = async {
            loop {
                // Each pass waits for the row's lock only once it asks for it.
                waiting.store(false, Ordering::Relaxed);
                raw.query_drop(TX_LOCK_WAIT.replace("{secs}", &secs.to_string()))
                    .await?;
                let seen: Option<u64> = raw.query_first(TX_ROW_SEEN.replace("{key}", &key)).await?;
                if seen != Some(1) {
                    waiting.store(true, Ordering::Relaxed);
                    raw.query_drop(TX_ROW.replace("{key}", &key)).await?;
                }
                raw.query_drop(TX_BEGIN).await?;
                // `NOWAIT` waits for no lock.
                if !wait.is_zero() {
                    waiting.store(true, Ordering::Relaxed);
                }
                let locked: Vec<mysql_async::Row> = raw
                    .query_iter(lock.as_str())
                    .await?
                    .collect_and_drop()
                    .await?;
                if !locked.is_empty() {
                    return Ok(());
                }
                // The row was deleted while the lock waited for it (under READ COMMITTED a
                // locking read then answers no row, and locks nothing): create it again.
                raw.query_drop(TX_NO_ROW).await?;
            }
        };
        let locked = run.await;
        if locked.is_err() {
            // No lock's transaction to end: an answered failure locked nothing, and a
            // connection cut off mid-statement is listed as such when it is let go.
            self.savepoint.clear();
        }
        locked.map_err(classify)
    }

    /// Commits the transaction of [`SessionConn::lock_tx_row`], releasing the lock; `false`
    /// when that transaction had already ended (the caller's SQL committed it, implicitly or
    /// not): nothing is committed now, the session is rolled back, and what ran before may
    /// have been committed.
    pub async fn commit(&mut self) -> Result<bool, BackendError> {
        let locked = !self.savepoint.is_empty();
        // Let go before its answer, the session is ended only once gone: a `COMMIT` already
        // running completes even after a `KILL`.
        self.ending = crate::stranded::Ending::UntilGone;
        self.end_lock(TX_COMMIT).await.map_err(|mut e| {
            // Unanswered (a broken link, a lost reply): the lock's COMMIT may have run.
            e.maybe_applied |= locked && e.code.is_none();
            e
        })
    }

    /// Rolls back the transaction of [`SessionConn::lock_tx_row`] like
    /// [`SessionConn::rollback`]; `false` when that transaction had already ended (the caller's
    /// SQL committed it, implicitly or not), so that what ran before may be committed.
    pub async fn rollback_lock(&mut self) -> Result<bool, BackendError> {
        self.end_lock(TX_ROLLBACK_LOCK).await
    }

    /// Ends the lock's transaction with `sql`, which starts at its savepoint; `false` (and
    /// the session rolled back) when the savepoint, and so the transaction, was gone. The
    /// savepoint is kept until the transaction is known to have ended, so that a connection
    /// let go after an error is listed (see [`SessionConn`]).
    async fn end_lock(&mut self, sql: &str) -> Result<bool, BackendError> {
        if self.savepoint.is_empty() {
            // No lock was taken on this connection: there is no lock's transaction to end.
            self.rollback().await?;
            return Ok(false);
        }
        let sql = sql.replace("{savepoint}", &self.savepoint);
        let ended = match self.raw().query_drop(sql).await {
            Ok(()) => true,
            Err(mysql_async::Error::Server(e)) if e.code == NO_SUCH_SAVEPOINT => {
                self.rollback().await?;
                false
            }
            Err(e) => return Err(classify(e)),
        };
        self.savepoint.clear();
        Ok(ended)
    }

    /// Whether the transaction of [`SessionConn::lock_tx_row`] still holds its row, on a
    /// connection that ran nothing since: its savepoint is there (going back to it undoes
    /// nothing and keeps the row's lock). `false` when that transaction ended; an error when
    /// the session is gone or did not answer.
    pub async fn still_locked(&mut self) -> Result<bool, BackendError> {
        if self.savepoint.is_empty() {
            return Ok(false);
        }
        let sql = TX_BACK_TO_LOCK.replace("{savepoint}", &self.savepoint);
        match self.raw().query_drop(sql).await {
            Ok(()) => Ok(true),
            Err(mysql_async::Error::Server(e)) if e.code == NO_SUCH_SAVEPOINT => Ok(false),
            Err(e) => Err(classify(e)),
        }
    }

    /// Rolls back the transaction of [`SessionConn::lock_tx_row`], releasing the lock.
    pub async fn rollback(&mut self) -> Result<(), BackendError> {
        self.raw().query_drop(TX_ROLLBACK).await.map_err(classify)
    }
}

// Version compare-and-set locks.

/// Frees the CAS row of `key` if the take of call token `?` owns it: a release, and a take
/// whose outcome is unknown (its reply lost, its retry failed) undone, name the take by its
/// token, unique per call, so no other take is freed, whatever its owner name.
const CAS_GIVE_BACK: &str = "UPDATE shardlock_cas SET owner = NULL, token = NULL, \
     version = version + 1 WHERE lock_key = ? AND token = ? AND owner IS NOT NULL \
     AND (? IS NULL OR version = ?)";

/// Frees the CAS row of `key` that the take of call token `?` made on a shard its key lived on
/// before a reload, once the move's carry began there: the take holds the key where it lives
/// now, so the row is freed marked carried, as a carry frees a row it carried (`carried_version`,
/// version + 2, assigned first while `version` is still the old one). A carry of this row whose
/// outcome is unknown then keeps its copies, the take's own rows among them.
const CAS_PASS_ON: &str = "UPDATE shardlock_cas SET carried_version = version + 2, \
     owner = NULL, token = NULL, version = version + 2 \
     WHERE lock_key = ? AND token = ? AND owner IS NOT NULL";

/// Whether the CAS row of `key` is free at version `?`: what a release of the version before
/// leaves (a release's retry after a lost reply reads it; a later take or release moves the
/// version on, and the answer is then "not freed").
const CAS_FREED_AT: &str =
    "SELECT COUNT(*) FROM shardlock_cas WHERE lock_key = ? AND owner IS NULL AND version = ?";

/// Creates the key's row, free, on first use; an existing row is left as it is. An upsert that
/// changes nothing rather than `INSERT IGNORE`, which would also turn other errors into
/// warnings; ownership is decided by [`CAS_TAKE`] alone.
const CAS_ROW: &str = "INSERT INTO shardlock_cas (lock_key, owner, version) VALUES (?, NULL, 0) \
     ON DUPLICATE KEY UPDATE lock_key = lock_key";

/// A plain read, locking nothing: [`CAS_TAKE`] checks what was read again, so a race lost in
/// between shows as no row changed rather than as a wait. `token` tells a try whose reply was
/// lost that the grant is its own; it names the take that owns the row: every statement that
/// frees a row clears it, and an owner carried into a row brings the token of the take that
/// made it (or, lacking one, the carry's own): a release or give-back by a call's token
/// reaches that take's copies and never matches a later owner.
const CAS_READ: &str = "SELECT owner, version, token FROM shardlock_cas WHERE lock_key = ?";

/// Sets the owner only where the version is still the one read and nobody owns the row: a
/// carried row (see the carry module) arrives owned with a version of its own, so the version
/// alone does not prove the row is still free. Judged by affected rows.
const CAS_TAKE: &str = "UPDATE shardlock_cas SET owner = ?, token = ?, version = version + 1 \
     WHERE lock_key = ? AND version = ? AND owner IS NULL";

/// Takes the CAS row of `key` for `owner` (creating it free on first use): its new version,
/// or `None` when it is owned (or the race was lost). `token` is unique per call: a retry
/// after a lost reply finds its own grant.
pub(crate) async fn take_cas(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    token: &str,
) -> mysql_async::Result<Option<u64>> {
    conn.exec_drop(CAS_ROW, (key,)).await?;
    type Row = (Option<Vec<u8>>, u64, Option<Vec<u8>>);
    let row: Option<Row> = conn.exec_first(CAS_READ, (key,)).await?;
    let version = match row {
        Some((None, version, _)) => version,
        // Taken by this very call: a try whose reply was lost (the token is per call, so
        // another acquire under the same owner name is not mistaken for it).
        Some((Some(_), version, Some(t))) if t == token.as_bytes() => return Ok(Some(version)),
        _ => return Ok(None),
    };
    conn.exec_drop(CAS_TAKE, (owner, token, key, version))
        .await?;
    if conn.affected_rows() == 1 {
        return Ok(Some(version + 1));
    }
    // The race lost, maybe to this call's own try whose reply was lost, landing between the
    // read and the take: the row is then this call's, and answered as taken (else it stayed
    // owned for good, by a take nobody holds). Only that try can have written this token.
    let row: Option<Row> = conn.exec_first(CAS_READ, (key,)).await?;
    Ok(match row {
        Some((Some(_), version, Some(t))) if t == token.as_bytes() => Some(version),
        _ => None,
    })
}

/// Runs a conditional write of one row; whether it changed that row.
async fn changed_one(
    conn: &mut Conn,
    sql: &str,
    params: impl Into<mysql_async::Params> + Send,
) -> mysql_async::Result<bool> {
    conn.exec_drop(sql, params).await?;
    Ok(conn.affected_rows() == 1)
}

/// How [`Shard::give_back_cas`] frees the row of a take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CasGiveBack {
    /// The take is undone (or released): only at this version, when given (a carry's copy
    /// of a known version).
    Undone(Option<u64>),
    /// The take holds its key where the key lives now, and this row is on a shard the key
    /// lived on before, whose move's carry began: freed marked carried, as a carry frees a row
    /// it carried (version + 2, `carried_version`), so that a carry of the row whose outcome is
    /// unknown keeps its copies.
    PassedOn,
}

/// Frees the CAS row of `key` if the take of `token` owns it, as `how` says; whether it did.
pub(crate) async fn give_back_cas(
    conn: &mut Conn,
    key: &[u8],
    token: &str,
    how: CasGiveBack,
) -> mysql_async::Result<bool> {
    match how {
        CasGiveBack::Undone(version) => {
            changed_one(conn, CAS_GIVE_BACK, (key, token, version, version)).await
        }
        CasGiveBack::PassedOn => changed_one(conn, CAS_PASS_ON, (key, token)).await,
    }
}

/// Whether the CAS row of `key` is free at `version` (see [`CAS_FREED_AT`]).
pub(crate) async fn cas_freed_at(
    conn: &mut Conn,
    key: &[u8],
    version: u64,
) -> mysql_async::Result<bool> {
    let n: Option<u64> = conn.exec_first(CAS_FREED_AT, (key, version)).await?;
    Ok(n == Some(1))
}

// State-machine claims.

/// One conditional `UPDATE` judged by affected rows: the old state in the `WHERE` makes the
/// server the arbiter, so of concurrent claimers exactly one matches the row. The table and
/// column names (`{table}`, `{id}`, `{state}`) cannot be bound, so they are checked when the
/// table is declared ([`StateTable::new`]) and quoted (a name such as `1` or `rank` is then
/// the column, not a number or a keyword); the values are bound. The row must not be in `to`
/// already by the column's collation: where `from` and `to` compare equal there (`locked` and
/// `LOCKED` in a case-insensitive column, `used` and `used ` with trailing spaces), the row
/// would still match `from` after the winner's update, and with found rows counted every
/// later caller would win too; such a transition never wins. (`RTRIM`: a `CHAR` column under
/// a NO PAD collation stores `used ` as `used`, which then differs from `to` as written.)
const TRANSITION: &str =
    "UPDATE `{table}` SET `{state}` = ? WHERE `{id}` = ? AND `{state}` = ? AND `{state}` <> ? \
     AND `{state}` <> RTRIM(?)";

/// Whether the row is in the table at all, in whatever state.
const STATE_ROW: &str = "SELECT 1 FROM `{table}` WHERE `{id}` = ? LIMIT 1";

/// A table of the caller's whose rows carry a state, and the transition statement on it.
#[derive(Debug, Clone)]
pub struct StateTable {
    table: String,
    transition: String,
    exists: String,
}

impl StateTable {
    /// Rows of `table` found by `id_column`, their state in `state_column`; each name 1-64 of
    /// `[A-Za-z0-9_]` (they are the only parts of the statement that are not bound
    /// parameters), else [`Error::InvalidArgument`].
    pub fn new(table: &str, id_column: &str, state_column: &str) -> Result<Self, Error> {
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
            transition: TRANSITION
                .replace("{table}", table)
                .replace("{state}", state_column)
                .replace("{id}", id_column),
            exists: STATE_ROW
                .replace("{table}", table)
                .replace("{id}", id_column),
        })
    }

    /// The table's name.
    pub fn name(&self) -> &str {
        &self.table
    }
}

/// Moves row `id` of `table` from `from` to `to`; whether this call did.
pub(crate) async fn transition(
    conn: &mut Conn,
    table: &StateTable,
    id: &str,
    from: &str,
    to: &str,
) -> mysql_async::Result<bool> {
    changed_one(conn, table.transition.as_str(), (to, id, from, to, to)).await
}

/// Whether row `id` of `table` is there, in any state.
pub(crate) async fn state_row_exists(
    conn: &mut Conn,
    table: &StateTable,
    id: &str,
) -> mysql_async::Result<bool> {
    let found: Option<u8> = conn.exec_first(table.exists.as_str(), (id,)).await?;
    Ok(found.is_some())
}

// Job claims.

/// `origin` holds a request id made per call and is unique: a retry after a lost reply hits
/// the duplicate key and reports, through `LAST_INSERT_ID(id)`, the id the first try inserted
/// instead of enqueuing the job twice (the portable form; `RETURNING` is MariaDB's only). Due
/// on the shard's clock; microseconds keep short delays exact.
const ENQUEUE_JOB: &str = "INSERT INTO shardlock_job \
     (queue, payload, status, due_at, retry_count, max_retries, origin) \
     VALUES (?, ?, 'ready', NOW(3) + INTERVAL ? MICROSECOND, 0, ?, ?) \
     ON DUPLICATE KEY UPDATE id = LAST_INSERT_ID(id)";

/// Only while the claim still holds: `locked_by` is the claim token (unique per claim) and the
/// lease has not run out on the shard's clock, so a worker whose job may have been claimed
/// again cannot finish the new claim.
const FINISH_JOB: &str = "UPDATE shardlock_job SET status = ?, lease_until = NULL \
     WHERE id = ? AND status = 'claimed' AND locked_by = ? AND lease_until > NOW(3)";

/// Whether job `id` was ended with status `?` under claim `?`: what [`FINISH_JOB`] leaves (the
/// claim token is unique per claim, and a new claim replaces it).
const FINISHED_BY: &str =
    "SELECT COUNT(*) FROM shardlock_job WHERE id = ? AND status = ? AND locked_by = ?";

/// Abandoned claims with no retries left are failed for good, not left claimed for ever, and
/// by no claim: [`FINISHED_BY`] must not read this as the abandoned claim's own failing. Under
/// READ COMMITTED only the rows that match are locked, and claimers never lock those; `LIMIT`
/// bounds the work one claim does.
const FAIL_EXHAUSTED: &str = "UPDATE shardlock_job SET status = 'failed', lease_until = NULL, \
     locked_by = NULL WHERE queue = ? AND status = 'claimed' AND lease_until <= NOW(3) \
     AND retry_count >= max_retries LIMIT 100";

/// A crashed worker's job first. `FOR UPDATE SKIP LOCKED` (MySQL 8.0, MariaDB 10.6) locks
/// just the row chosen and passes over rows other claimers are taking, so claimers never wait
/// on each other; the retry count read is the one the claim writes.
const CLAIM_ABANDONED: &str = "SELECT id, payload, retry_count + 1 FROM shardlock_job \
     WHERE queue = ? AND status = 'claimed' AND lease_until <= NOW(3) \
     AND retry_count < max_retries LIMIT 1 FOR UPDATE SKIP LOCKED";

/// Else the ready job due first, as [`CLAIM_ABANDONED`] locks it; the `(queue, status,
/// due_at)` index gives the order.
const CLAIM_READY: &str = "SELECT id, payload, retry_count FROM shardlock_job \
     WHERE queue = ? AND status = 'ready' AND due_at <= NOW(3) \
     ORDER BY due_at LIMIT 1 FOR UPDATE SKIP LOCKED";

/// The claim itself, by primary key on the row locked above, in the same transaction: the
/// job's id is known in the same step. The lease runs on the shard's clock.
const MARK_CLAIMED: &str = "UPDATE shardlock_job SET status = 'claimed', locked_by = ?, \
     locked_at = NOW(3), lease_until = NOW(3) + INTERVAL ? MICROSECOND, retry_count = ? \
     WHERE id = ?";

/// After a try whose reply was lost: the claim token is unique per claim, so the job that try
/// claimed, if it did, is found instead of a second one claimed. Locked: while it is, a row
/// still claimed under the token was claimed by nobody since, even if its lease ran out
/// meanwhile (every other claim writes its own token, and a job moved or failed for good has
/// none). Waiting for a lock on it, not skipping it: other claims' scans lock the rows they
/// pass for a moment (READ COMMITTED checks the lease after locking), and a row skipped then
/// would be claimed by nobody, while this claims another job. (After the wait the row is read
/// again: one another claim took since is not found.)
const CLAIMED_BY: &str = "SELECT id, payload, retry_count FROM shardlock_job \
     WHERE queue = ? AND status = 'claimed' AND locked_by = ? LIMIT 1 FOR UPDATE";

/// The claim [`CLAIMED_BY`] found, for its whole lease from now: its caller learns of it only
/// now, and its lease may have run out meanwhile.
const RENEW_CLAIM: &str = "UPDATE shardlock_job \
     SET lease_until = NOW(3) + INTERVAL ? MICROSECOND \
     WHERE id = ? AND status = 'claimed' AND locked_by = ?";

/// A claim's lease moved to at least `?` µs from now (never earlier), while the claim holds:
/// its token is in the row and its lease has not run out on the shard's clock. Sent again after
/// a lost reply, it answers the same (the claim still holds, its end moved as far) unless the
/// lease ran out meanwhile.
const EXTEND_CLAIM: &str = "UPDATE shardlock_job \
     SET lease_until = GREATEST(lease_until, NOW(3) + INTERVAL ? MICROSECOND) \
     WHERE id = ? AND status = 'claimed' AND locked_by = ? AND lease_until > NOW(3)";

/// How a claimed job ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobEnd {
    /// Done.
    Done,
    /// Failed for good.
    Failed,
    /// Given back unfinished: ready for the next claim at once, its retry count as it was.
    Released,
}

impl JobEnd {
    /// The job's status once it ended so.
    fn status(self) -> &'static str {
        match self {
            JobEnd::Done => "done",
            JobEnd::Failed => "failed",
            JobEnd::Released => "ready",
        }
    }
}

/// A job claimed on a shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedJob {
    /// Its id on the shard.
    pub id: u64,
    /// What was enqueued.
    pub payload: Vec<u8>,
    /// Claims of it before this one that were not completed.
    pub retry_count: u32,
}

/// Enqueues a job (see [`ENQUEUE_JOB`]); its id.
pub(crate) async fn enqueue_job(
    conn: &mut Conn,
    queue: &str,
    payload: &[u8],
    delay: Duration,
    max_retries: u32,
    request: &str,
) -> mysql_async::Result<u64> {
    let delay_us = delay.as_micros() as u64;
    conn.exec_drop(
        ENQUEUE_JOB,
        (queue, payload, delay_us, max_retries, request),
    )
    .await?;
    Ok(conn.last_insert_id().unwrap_or(0))
}

/// Ends job `id` claimed under `claim`, if the claim still holds; whether it did.
pub(crate) async fn finish_job(
    conn: &mut Conn,
    id: u64,
    claim: &str,
    end: JobEnd,
) -> mysql_async::Result<bool> {
    let status = end.status();
    changed_one(conn, FINISH_JOB, (status, id, claim)).await
}

/// Moves the lease of job `id`'s claim `claim` to at least `lease` from now, if the claim still
/// holds; whether it did (see [`EXTEND_CLAIM`]).
pub(crate) async fn extend_claim(
    conn: &mut Conn,
    id: u64,
    claim: &str,
    lease: Duration,
) -> mysql_async::Result<bool> {
    let lease_us = lease.as_micros() as u64;
    changed_one(conn, EXTEND_CLAIM, (lease_us, id, claim)).await
}

/// Whether job `id` was ended as `end` under `claim` (see [`FINISHED_BY`]).
pub(crate) async fn finished_by(
    conn: &mut Conn,
    id: u64,
    claim: &str,
    end: JobEnd,
) -> mysql_async::Result<bool> {
    let status = end.status();
    let n: Option<u64> = conn.exec_first(FINISHED_BY, (id, status, claim)).await?;
    Ok(n == Some(1))
}

/// Claims the next due job of `queue` under `claim` for `lease`; after a try whose reply was
/// lost (`look_first`), first the job that try may have claimed.
pub(crate) async fn claim_job(
    conn: &mut Conn,
    queue: &str,
    claim: &str,
    lease: Duration,
    look_first: bool,
) -> mysql_async::Result<Option<ClaimedJob>> {
    let lease_us = lease.as_micros() as u64;
    // READ COMMITTED: under the default REPEATABLE READ, the scans below would keep next-key
    // locks on every row and gap of the queue they pass in the `(queue, status, due_at)`
    // index, holding up enqueues, finishes and other claims of the queue until this claim
    // commits; here only the rows actually matched stay locked.
    let mut opts = TxOpts::default();
    opts.with_isolation_level(IsolationLevel::ReadCommitted);
    let mut tx = conn.start_transaction(opts).await?;
    // Committed either way: with no job due, it keeps the jobs failed for good.
    let claimed = claim_in(&mut tx, queue, claim, lease_us, look_first).await;
    settle(tx, claimed).await
}

/// [`claim_job`]'s statements, in its transaction.
async fn claim_in(
    tx: &mut Transaction<'_>,
    queue: &str,
    claim: &str,
    lease_us: u64,
    look_first: bool,
) -> mysql_async::Result<Option<ClaimedJob>> {
    if look_first {
        let mine: Option<(u64, Vec<u8>, u32)> = tx.exec_first(CLAIMED_BY, (queue, claim)).await?;
        if let Some(mine) = mine {
            tx.exec_drop(RENEW_CLAIM, (lease_us, mine.0, claim)).await?;
            return Ok(Some(claimed(mine)));
        }
    }
    tx.exec_drop(FAIL_EXHAUSTED, (queue,)).await?;
    let mut row: Option<(u64, Vec<u8>, u32)> = tx.exec_first(CLAIM_ABANDONED, (queue,)).await?;
    if row.is_none() {
        row = tx.exec_first(CLAIM_READY, (queue,)).await?;
    }
    let Some((id, payload, retry_count)) = row else {
        return Ok(None);
    };
    tx.exec_drop(MARK_CLAIMED, (claim, lease_us, retry_count, id))
        .await?;
    Ok(Some(claimed((id, payload, retry_count))))
}

fn claimed((id, payload, retry_count): (u64, Vec<u8>, u32)) -> ClaimedJob {
    ClaimedJob {
        id,
        payload,
        retry_count,
    }
}

/// The patterns' operations on a shard, each on a pooled connection within the statement
/// timeout.
impl Shard {
    /// Takes the CAS row of `key` for `owner`, creating it on first use: its new version, or
    /// `None` when it is owned (or the race was lost). `token`, unique per call, lets a retry
    /// after a lost reply find that its first try won.
    pub async fn take_cas(
        &self,
        key: &[u8],
        owner: &str,
        token: &str,
    ) -> Result<Option<u64>, BackendError> {
        self.run(
            "take_cas",
            (key, owner, token),
            |c, &(key, owner, token)| Box::pin(take_cas(c, key, owner, token)),
        )
        .await
    }

    /// Releases the CAS row of `key` taken by the call of token `token` (or a carry's copy of
    /// that take); whether it did. The token, unique per call, names the take whatever
    /// happened since: a release of a guard released already (a clone, a retry) never frees a
    /// later take under the same owner name, and a copy carried in with another version is
    /// still found.
    ///
    /// A try whose reply was lost is retried; a retry that finds the row no longer the take's
    /// asks whether it is free at `version + 1`, which is what the lost try left of the take
    /// that wrote `version`.
    pub async fn release_cas(
        &self,
        key: &[u8],
        token: &str,
        version: u64,
    ) -> Result<bool, BackendError> {
        self.run_confirmed(
            "release_cas",
            (key, token, version),
            |c, &(key, token, _)| Box::pin(give_back_cas(c, key, token, CasGiveBack::Undone(None))),
            |c, &(key, _, version)| Box::pin(cas_freed_at(c, key, version + 1)),
        )
        .await
    }

    /// Frees the CAS row of `key` if the take of call token `token` owns it (a take whose
    /// outcome is unknown, a carry's copy of it, or a take's row left behind on a shard its
    /// key moved away from), as `how` says; whether it did.
    pub async fn give_back_cas(
        &self,
        key: &[u8],
        token: &str,
        how: CasGiveBack,
    ) -> Result<bool, BackendError> {
        self.run(
            "give_back_cas",
            (key, token, how),
            |c, &(key, token, how)| Box::pin(give_back_cas(c, key, token, how)),
        )
        .await
    }

    /// Moves row `id` of `table` from state `from` to `to`; whether this call did. Not
    /// retried once it may have reached the server: a retry could not tell its own transition
    /// from someone else's (the error then says the outcome is unknown).
    pub async fn transition(
        &self,
        table: &StateTable,
        id: &str,
        from: &str,
        to: &str,
    ) -> Result<bool, BackendError> {
        self.run_once(
            "transition",
            (table, id, from, to),
            |c, &(table, id, from, to)| Box::pin(transition(c, table, id, from, to)),
        )
        .await
    }

    /// Whether row `id` of `table` is on this shard, in any state.
    pub async fn state_row_exists(
        &self,
        table: &StateTable,
        id: &str,
    ) -> Result<bool, BackendError> {
        self.run("state_row_exists", (table, id), |c, &(table, id)| {
            Box::pin(state_row_exists(c, table, id))
        })
        .await
    }

    /// Adds a job to `queue`, due after `delay`, claimed at most `1 + max_retries` times;
    /// its id. `request`, unique per call, makes a retry after a lost reply answer the id of
    /// the job its first try enqueued.
    pub async fn enqueue_job(
        &self,
        queue: &str,
        payload: &[u8],
        delay: Duration,
        max_retries: u32,
        request: &str,
    ) -> Result<u64, BackendError> {
        self.run(
            "enqueue_job",
            (queue, payload, delay, max_retries, request),
            |c, &(queue, payload, delay, max_retries, request)| {
                Box::pin(enqueue_job(c, queue, payload, delay, max_retries, request))
            },
        )
        .await
    }

    /// Claims the next due job of `queue` under `claim` for `lease`, in one transaction that
    /// waits for no other claimer. After a try whose reply was lost, `look_first` finds the job
    /// that try claimed instead of claiming another. Not retried once it may have reached the
    /// server (the caller retries with `look_first`).
    pub async fn claim_job(
        &self,
        queue: &str,
        claim: &str,
        lease: Duration,
        look_first: bool,
    ) -> Result<Option<ClaimedJob>, BackendError> {
        self.run_once(
            "claim_job",
            (queue, claim, lease, look_first),
            |c, &(queue, claim, lease, look_first)| {
                Box::pin(claim_job(c, queue, claim, lease, look_first))
            },
        )
        .await
    }

    /// Moves the lease of job `id`, claimed under `claim`, to at least `lease` from now (by the
    /// shard's clock; never earlier), if the claim still holds; whether it did. A try whose
    /// reply was lost is sent again: it answers the same unless the lease ran out meanwhile.
    /// The server's lock wait timeout (a console session holding the row) is the answer.
    pub async fn extend_job(
        &self,
        id: u64,
        claim: &str,
        lease: Duration,
    ) -> Result<bool, BackendError> {
        self.run_row(
            "extend_job",
            (id, claim, lease),
            |c, &(id, claim, lease)| Box::pin(extend_claim(c, id, claim, lease)),
        )
        .await
    }

    /// Ends job `id`, claimed under `claim`, if the claim still holds (its lease has not run
    /// out); whether it did.
    pub async fn finish_job(
        &self,
        id: u64,
        claim: &str,
        end: JobEnd,
    ) -> Result<bool, BackendError> {
        self.run_confirmed(
            "finish_job",
            (id, claim, end),
            |c, &(id, claim, end)| Box::pin(finish_job(c, id, claim, end)),
            // By the lost try, if the job is ended as asked under this claim.
            |c, &(id, claim, end)| Box::pin(finished_by(c, id, claim, end)),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release names its take by the take's token: applied late (after the key was
    /// released and taken again under the same owner name), it frees nothing.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_late_cas_give_back_leaves_a_later_take_under_the_same_owner_alone() {
        let (_cluster, shard) = crate::testing::migrated_shard().await;
        let first = shard.take_cas(b"k", "a", "t1").await.unwrap().unwrap();
        assert!(shard.release_cas(b"k", "t1", first).await.unwrap());
        let second = shard.take_cas(b"k", "a", "t2").await.unwrap().unwrap();
        assert!(second > first);

        let late = shard.release_cas(b"k", "t1", first).await.unwrap();
        assert!(!late, "a give-back of the first take freed the second");
        let retaken = shard.take_cas(b"k", "b", "t3").await.unwrap();
        assert_eq!(retaken, None, "the second take is still owned");
        assert!(shard.release_cas(b"k", "t2", second).await.unwrap());

        // A give-back by a call's token frees only that call's take: not a row freed since
        // and then owned by a holder carried in from another shard.
        shard.take_cas(b"k", "a", "t4").await.unwrap().unwrap();
        assert!(shard
            .give_back_cas(b"k", "t4", CasGiveBack::Undone(None))
            .await
            .unwrap());
        let mut session = shard.connection().await.unwrap();
        let carried: crate::CasRow = (b"k".to_vec(), "h".to_owned(), 100);
        crate::carry::adopt_cas(session.raw(), &[carried], "carry")
            .await
            .unwrap();
        drop(session);
        assert!(
            !shard
                .give_back_cas(b"k", "t4", CasGiveBack::Undone(None))
                .await
                .unwrap(),
            "a late give-back freed a carried holder's row"
        );
        assert_eq!(shard.take_cas(b"k", "b", "t5").await.unwrap(), None);
    }

    /// A claim that ran out with no retries left, failed for good by the next claimer, does
    /// not read as failed by its own worker: a `fail_job` whose first try's reply was lost
    /// would otherwise answer `true` for a claim that no longer held.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_job_failed_for_running_out_is_not_read_as_failed_by_its_claim() {
        let (_cluster, shard) = crate::testing::migrated_shard().await;
        let id = shard
            .enqueue_job("q", b"p", Duration::ZERO, 0, "r1")
            .await
            .unwrap();
        let claim = shard
            .claim_job("q", "c1", Duration::from_millis(1), false)
            .await
            .unwrap()
            .expect("the job is ready");
        assert_eq!(claim.id, id);
        // Until the server's clock says the claim ran out.
        let mut conn = shard.connection().await.unwrap();
        loop {
            let out: Option<u64> = conn
                .raw()
                .exec_first(
                    "SELECT COUNT(*) FROM shardlock_job WHERE id = ? AND lease_until <= NOW(3)",
                    (id,),
                )
                .await
                .unwrap();
            if out == Some(1) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        drop(conn);
        let next = shard
            .claim_job("q", "c2", Duration::from_secs(60), false)
            .await
            .unwrap();
        assert!(next.is_none(), "no retries were left: {next:?}");
        let mut conn = shard.connection().await.unwrap();
        let status: Option<String> = conn
            .raw()
            .exec_first("SELECT status FROM shardlock_job WHERE id = ?", (id,))
            .await
            .unwrap();
        assert_eq!(status.as_deref(), Some("failed"));
        assert!(
            !finished_by(conn.raw(), id, "c1", JobEnd::Failed)
                .await
                .unwrap(),
            "a job failed for running out reads as failed by the claim that ran out"
        );
    }

    #[test]
    fn a_state_table_splices_only_checked_names() {
        let table = StateTable::new("coupon", "code", "state").unwrap();
        assert_eq!(
            table.transition,
            "UPDATE `coupon` SET `state` = ? WHERE `code` = ? AND `state` = ? AND `state` <> ? \
             AND `state` <> RTRIM(?)"
        );
        for bad in ["", "coupon; DROP TABLE x", "coupon`", &"c".repeat(65)] {
            assert!(StateTable::new(bad, "code", "state").is_err(), "{bad}");
            assert!(StateTable::new("coupon", bad, "state").is_err(), "{bad}");
            assert!(StateTable::new("coupon", "code", bad).is_err(), "{bad}");
        }
    }
}
