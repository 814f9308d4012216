//! Carrying the lock patterns' rows of moved keys from the shard they left to their new shard,
//! once a reload's move window is over: owned CAS rows and unfinished jobs. Each step is a
//! conditional statement, so a carry interrupted anywhere and run again (by this process or
//! another) neither loses nor duplicates anything.

use futures_util::future::BoxFuture;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Params, Transaction, TxOpts, Value};

use crate::lease::{padded_in_list, rows_source};
use crate::pool::settle;

/// An owned CAS row: key, owner, version.
pub type CasRow = (Vec<u8>, String, u64);

/// Owned CAS rows in key order after a key.
const OWNED_CAS_AFTER: &str = "SELECT lock_key, owner, version FROM shardlock_cas \
     WHERE lock_key > ? AND owner IS NOT NULL ORDER BY lock_key LIMIT ?";

pub(crate) async fn owned_cas_after(
    conn: &mut Conn,
    after: &[u8],
    limit: usize,
) -> mysql_async::Result<Vec<CasRow>> {
    let rows: Vec<(Vec<u8>, Vec<u8>, u64)> =
        conn.exec(OWNED_CAS_AFTER, (after, limit as u64)).await?;
    Ok(rows
        .into_iter()
        .map(|(k, o, v)| (k, String::from_utf8_lossy(&o).into_owned(), v))
        .collect())
}

/// Writes owned CAS rows where their keys now live: a free (or missing) row takes the carried
/// owner and version, and `token`, which names the copies (see [`carry_cas_row`]); an owned
/// one is left alone. Whether every row is now owned by its carried owner under `token`: a
/// row left alone that another take owns (its holder's release has not reached it yet) holds
/// no copy, and the row it was to copy must not be freed. A filled row's carried mark (see [`CAS_FREE_CARRIED`]) is cleared: the
/// version it names may come again, the version being the carried one now. The version is
/// assigned first, while `owner` still has its old value. (Placeholders are
/// cast: a derived table's column types are otherwise the server's guess.)
pub(crate) async fn adopt_cas(
    conn: &mut Conn,
    rows: &[CasRow],
    token: &str,
) -> mysql_async::Result<bool> {
    if rows.is_empty() {
        return Ok(true);
    }
    // In key order, as `raise_floors` writes: carries of the same keys from several
    // processes then lock rows in one order and cannot deadlock each other.
    let mut sorted: Vec<&CasRow> = rows.iter().collect();
    sorted.sort();
    let mut params: Vec<Value> = Vec::with_capacity(rows.len() * 4);
    for (key, owner, version) in sorted {
        params.extend([
            key.as_slice().into(),
            owner.as_str().into(),
            (*version).into(),
            token.into(),
        ]);
    }
    let sql = format!(
        "INSERT INTO shardlock_cas (lock_key, owner, version, token) \
         SELECT src.k, src.o, CAST(src.v AS UNSIGNED), src.t FROM {} \
         ON DUPLICATE KEY UPDATE \
         version = IF(shardlock_cas.owner IS NULL, CAST(src.v AS UNSIGNED), shardlock_cas.version), \
         carried_version = IF(shardlock_cas.owner IS NULL, NULL, shardlock_cas.carried_version), \
         token = IF(shardlock_cas.owner IS NULL, src.t, shardlock_cas.token), \
         owner = IF(shardlock_cas.owner IS NULL, src.o, shardlock_cas.owner)",
        rows_source(&["k", "o", "v", "t"], rows.len())
    );
    conn.exec_drop(sql, Params::Positional(params)).await?;
    // Read back: a copy's owner and token stay until its take releases them, and that
    // release waits for the carry's lock on the row copied from.
    let mut keys: Vec<&[u8]> = rows.iter().map(|(key, _, _)| key.as_slice()).collect();
    keys.sort();
    keys.dedup();
    let mut params: Vec<Value> = Vec::with_capacity(rows.len() * 3);
    for (key, owner, _) in rows {
        params.extend([key.as_slice().into(), owner.as_str().into(), token.into()]);
    }
    let sql = format!(
        "SELECT COUNT(*) FROM shardlock_cas WHERE (lock_key, owner, token) IN ({})",
        vec!["(?, ?, ?)"; rows.len()].join(", ")
    );
    let owned: Option<u64> = conn.exec_first(sql, Params::Positional(params)).await?;
    Ok(owned == Some(keys.len() as u64))
}

/// The row as a carry of it reads it, locking it until the carry commits or rolls back: its
/// holder's release (which goes to the old shard first) and other processes' carries of the
/// row wait, so what the carry decides from it holds until the row is freed.
const CAS_HOLD: &str =
    "SELECT owner, version, token FROM shardlock_cas WHERE lock_key = ? FOR UPDATE";

/// Frees a carried row, raising the version by 2 (a holder's release raises it by 1), and
/// marks it carried at that version: a mark that takes, releases and give-backs leave alone,
/// so a later look tells a carry's free from a release however the row changed since.
const CAS_FREE_CARRIED: &str = "UPDATE shardlock_cas SET owner = NULL, token = NULL, \
     version = version + 2, carried_version = ? \
     WHERE lock_key = ? AND owner = ? AND version = ?";

/// The row as [`carry_kept`] reads it, locked like [`CAS_HOLD`].
const CAS_CARRIED: &str =
    "SELECT owner, version, carried_version FROM shardlock_cas WHERE lock_key = ? FOR UPDATE";

/// Carries the CAS row of `key` if it is owned: holds it locked here, writes it (its owner and
/// version as they are now, not as a scan saw them) where its key now lives with `copy`, on
/// other shards, and frees it here in the same transaction; whether it was carried (`copy`
/// answers `false` for a key that does not move: nothing is written). `copy` is given the row's token, the call token of the take that made it (or of
/// the carry that brought it here): copies bear it, so that a give-back of that take by its
/// token, which finds the row freed here, frees them where they are.
///
/// The lock is what makes the carry safe to run from several processes at once: a carry that
/// scanned the row before another one freed it (and its holder then released the copy) finds
/// it free rather than writing the released lock back. A try that fails after `copy` leaves
/// copies that may or may not be counted on; the caller settles them with [`carry_kept`].
pub(crate) async fn carry_cas_row(
    conn: &mut Conn,
    key: &[u8],
    copy: &CopyCas<'_>,
) -> mysql_async::Result<bool> {
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    let carried = carry_in(&mut tx, key, copy).await;
    // Nothing is written unless the row is carried: committing the rest only lets it go.
    settle(tx, carried).await
}

/// [`carry_cas_row`]'s statements, in its transaction.
async fn carry_in(
    tx: &mut Transaction<'_>,
    key: &[u8],
    copy: &CopyCas<'_>,
) -> mysql_async::Result<bool> {
    type Held = (Option<Vec<u8>>, u64, Option<Vec<u8>>);
    let now: Option<Held> = tx.exec_first(CAS_HOLD, (key,)).await?;
    let Some((Some(owner), version, token)) = now else {
        return Ok(false);
    };
    let row: CasRow = (
        key.to_vec(),
        String::from_utf8_lossy(&owner).into_owned(),
        version,
    );
    let token = token.map(|t| String::from_utf8_lossy(&t).into_owned());
    match copy(row, token).await {
        Ok(true) => {}
        Ok(false) => return Ok(false),
        Err(e) => return Err(mysql_async::Error::Other(Box::new(e))),
    }
    tx.exec_drop(CAS_FREE_CARRIED, (version + 2, key, owner, version))
        .await?;
    Ok(true)
}

/// Writes a carried row's copies, named by its token (when it has one), on the shards its key
/// now lives on (see [`crate::Shard::adopt_cas`]); `false` when the key does not move.
pub type CopyCas<'a> = dyn Fn(CasRow, Option<String>) -> BoxFuture<'a, Result<bool, shardlock_core::BackendError>>
    + Send
    + Sync
    + 'a;

/// After a carry whose copies of `row` were written but whose outcome is unknown: whether the
/// copies are to be kept. They are while the row is still owned as copied (a later carry
/// counts on them) or once a carry freed it at that state (marked carried at its version + 2,
/// or later: a later carry's mark hides an earlier one, and keeping is the side that never
/// frees a lock someone holds; or free at version + 2 with no mark, as versions before the
/// mark leave a carried row); not once its holder released it. Read with the row locked, so
/// that a carry's transaction still open is waited for.
pub(crate) async fn carry_kept(conn: &mut Conn, row: &CasRow) -> mysql_async::Result<bool> {
    let (key, owner, version) = (row.0.as_slice(), row.1.as_bytes(), row.2);
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    let now = tx.exec_first(CAS_CARRIED, (key,)).await;
    let now: Option<(Option<Vec<u8>>, u64, Option<u64>)> = settle(tx, now).await?;
    Ok(match now {
        Some((o, v, carried)) => {
            (o.as_deref() == Some(owner) && v == version)
                || carried.is_some_and(|at| at >= version + 2)
                || (o.is_none() && v == version + 2)
        }
        None => false,
    })
}

/// A job not finished yet, as the carry sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingJob {
    /// Its id on the shard it is on.
    pub id: u64,
    /// Its queue (the key that places it).
    pub queue: Vec<u8>,
    /// Claimed by a worker whose lease has not run out: it cannot move until it does.
    pub running: bool,
    /// Claimed by a worker whose lease ran out with no retries left: it fails where it is,
    /// as the next claim of its queue would fail it (none comes here once the move is over).
    pub exhausted: bool,
    /// Being moved (marked by a carry, to the shard it goes to): no claim takes it until its move is finished.
    pub moving: bool,
}

/// Jobs not finished, in id order after an id: ready, being moved, or claimed (running, or
/// abandoned, with retries left or not; `NOW(3)` is one value through a statement, so a claim
/// is one of the two).
const PENDING_JOBS_AFTER: &str = "SELECT id, queue, status = 'claimed' AND lease_until > NOW(3), \
     status = 'claimed' AND lease_until <= NOW(3) AND retry_count >= max_retries, \
     status = 'moving' FROM shardlock_job WHERE id > ? AND status IN ('ready', 'moving', 'claimed') \
     ORDER BY id LIMIT ?";

pub(crate) async fn pending_jobs_after(
    conn: &mut Conn,
    after: u64,
    limit: usize,
) -> mysql_async::Result<Vec<PendingJob>> {
    let rows: Vec<(u64, Vec<u8>, bool, bool, bool)> =
        conn.exec(PENDING_JOBS_AFTER, (after, limit as u64)).await?;
    Ok(rows
        .into_iter()
        .map(|(id, queue, running, exhausted, moving)| PendingJob {
            id,
            queue,
            running,
            exhausted,
            moving,
        })
        .collect())
}

/// Fails the jobs of `ids` still claimed with their lease run out and no retries left, as a
/// claim of their queue does (`FAIL_EXHAUSTED` in the patterns module). Returns how many it
/// failed: a job whose claim was renewed since it was read is not.
pub(crate) async fn fail_exhausted(conn: &mut Conn, ids: &[u64]) -> mysql_async::Result<usize> {
    let (list, params) = id_list(ids);
    conn.exec_drop(
        format!(
            "UPDATE shardlock_job SET status = 'failed', lease_until = NULL, locked_by = NULL \
             WHERE id IN {list} AND status = 'claimed' AND lease_until <= NOW(3) \
             AND retry_count >= max_retries"
        ),
        Params::Positional(params),
    )
    .await?;
    Ok(conn.affected_rows() as usize)
}

/// A job being moved: everything needed to enqueue it again where it goes.
#[derive(Debug, Clone, PartialEq)]
pub struct MovingJob {
    /// Its id on the shard it leaves.
    pub id: u64,
    /// Its queue.
    pub queue: Vec<u8>,
    /// Its payload.
    pub payload: Vec<u8>,
    /// When it is due (the old shard's clock, UTC).
    pub due_at: mysql_async::Value,
    /// Claims of it so far that were not completed.
    pub retry_count: u32,
    /// Its retry limit.
    pub max_retries: u32,
    /// The identity of the shard it goes to (fixed when its move started).
    pub moved_to: String,
    /// What names this move of it wherever it lands (its origin there, unique): read off
    /// its row, the same for every process that carries it.
    pub carry_key: String,
}

/// The key a job's move is enqueued under where it goes, read from the row it leaves: the
/// shard id, the job's id and its own origin (the request id of its enqueue, or the key of
/// the move that brought it; a job from before migration 6 has none, and its contents stand
/// in). Every process reads the same key off the same row, before or after a failover of its
/// shard behind its URL, so a move carried by two processes enqueues the job once; the
/// job's own origin keeps two jobs that share an id apart (a promoted replica that had not
/// received the last jobs reuses their ids), and a move back onto a shard the job once left
/// is a new key.
const CARRY_KEY: &str = "CONCAT('carry:', SHA2(CONCAT_WS('#', \
     (SELECT value FROM shardlock_meta WHERE name = 'shard-id'), id, \
     IFNULL(origin, CONCAT(queue, '#', due_at, '#', SHA2(payload, 256)))), 256))";

/// Marks `ids` as being moved to the shard `to` (those still ready, or claimed and abandoned
/// with retries left: their retry count goes up, as a new claim would do) and returns every
/// job of `ids` being moved, each with the shard it goes to: set by whoever marked it first.
/// Claimers never take a job being moved.
pub(crate) async fn start_moving(
    conn: &mut Conn,
    ids: &[u64],
    to: &str,
) -> mysql_async::Result<Vec<MovingJob>> {
    // `retry_count` is assigned before `status`, since it reads the old status: single-table
    // UPDATEs assign left to right (MariaDB too, as long as the session's sql_mode leaves out
    // SIMULTANEOUS_ASSIGNMENT, which it does).
    let (list, params) = id_list(ids);
    let mut marking = vec![Value::from(to)];
    marking.extend(params.iter().cloned());
    conn.exec_drop(
        format!(
            "UPDATE shardlock_job SET \
             retry_count = retry_count + IF(status = 'claimed', 1, 0), \
             status = 'moving', moved_to = ?, locked_by = NULL, locked_at = NULL, \
             lease_until = NULL \
             WHERE id IN {list} AND (status = 'ready' OR (status = 'claimed' \
             AND lease_until <= NOW(3) AND retry_count < max_retries))"
        ),
        Params::Positional(marking),
    )
    .await?;
    moves_begun(conn, ids).await
}

/// The jobs of `ids` being moved, each with the shard it goes to: a move begun is finished
/// there, whatever placement is in force by then (a job marked moving and then left, its
/// carrier stopped or a reload undone meanwhile, is claimed by nobody until it is).
pub(crate) async fn moves_begun(
    conn: &mut Conn,
    ids: &[u64],
) -> mysql_async::Result<Vec<MovingJob>> {
    let (list, params) = id_list(ids);
    type Row = (
        u64,
        Vec<u8>,
        Vec<u8>,
        mysql_async::Value,
        u32,
        u32,
        Vec<u8>,
        String,
    );
    let rows: Vec<Row> = conn
        .exec(
            format!(
                "SELECT id, queue, payload, due_at, retry_count, max_retries, moved_to, \
                 {CARRY_KEY} FROM shardlock_job WHERE id IN {list} AND status = 'moving'"
            ),
            Params::Positional(params),
        )
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(id, queue, payload, due_at, retry_count, max_retries, moved_to, carry_key)| {
                MovingJob {
                    id,
                    queue,
                    payload,
                    due_at,
                    retry_count,
                    max_retries,
                    moved_to: String::from_utf8_lossy(&moved_to).into_owned(),
                    carry_key,
                }
            },
        )
        .collect())
}

/// Enqueues moved jobs, each at most once: its origin here, its move's carry key, is unique.
pub(crate) async fn enqueue_moved(conn: &mut Conn, jobs: &[MovingJob]) -> mysql_async::Result<()> {
    if jobs.is_empty() {
        return Ok(());
    }
    let mut params: Vec<Value> = Vec::with_capacity(jobs.len() * 6);
    for job in jobs {
        params.extend([
            job.queue.as_slice().into(),
            job.payload.as_slice().into(),
            job.due_at.clone(),
            job.retry_count.into(),
            job.max_retries.into(),
            job.carry_key.as_str().into(),
        ]);
    }
    let sql = format!(
        "INSERT INTO shardlock_job (queue, payload, status, due_at, retry_count, max_retries, origin) \
         SELECT src.q, src.p, 'ready', src.d, CAST(src.r AS UNSIGNED), CAST(src.m AS UNSIGNED), \
         src.o FROM {} \
         ON DUPLICATE KEY UPDATE id = shardlock_job.id",
        rows_source(&["q", "p", "d", "r", "m", "o"], jobs.len())
    );
    conn.exec_drop(sql, Params::Positional(params)).await
}

/// Marks jobs moved (they live on another shard now).
pub(crate) async fn finish_moving(conn: &mut Conn, ids: &[u64]) -> mysql_async::Result<()> {
    let (list, params) = id_list(ids);
    conn.exec_drop(
        format!(
            "UPDATE shardlock_job SET status = 'moved' WHERE id IN {list} AND status = 'moving'"
        ),
        Params::Positional(params),
    )
    .await
}

/// `(?,?,...)` for `ids` with the padded, power-of-two shape of [`padded_in_list`], so the
/// statement cache sees few shapes, but the ids bound as integers (padded with the last one)
/// so that they compare with the BIGINT key as numbers.
fn id_list(ids: &[u64]) -> (String, Vec<Value>) {
    let bytes: Vec<[u8; 8]> = ids.iter().map(|id| id.to_le_bytes()).collect();
    let (list, _) = padded_in_list(bytes.iter().map(|b| b.as_slice()));
    let mut params: Vec<Value> = ids.iter().map(|&id| id.into()).collect();
    let last = params.last().cloned().unwrap_or(Value::NULL);
    params.resize(list.matches('?').count(), last);
    (list, params)
}

#[cfg(test)]
mod tests {
    use super::*;
    /// A carry of a row another carry freed already, whose holder then released the copy,
    /// writes nothing back: it carries the row as it is when it holds it, not as a scan saw
    /// it, and a free row is nothing to carry. A carry whose outcome went unheard tells a
    /// carry's free from its holder's release, however the row changed since.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_carry_is_told_from_a_release_and_a_second_carry_writes_nothing_back() {
        let (_cluster, shards) = crate::testing::migrated_shards(2).await;
        let [old, new] = <[_; 2]>::try_from(shards).unwrap();
        let version = old.take_cas(b"k", "o", "t1").await.unwrap().unwrap();
        let scanned = old.owned_cas_after(b"", 10).await.unwrap();
        assert_eq!(scanned, vec![(b"k".to_vec(), "o".to_owned(), version)]);

        let new_ref = &new;
        let copy = |row, token: Option<String>| {
            let copying: futures_util::future::BoxFuture<'_, _> = Box::pin(async move {
                new_ref
                    .adopt_cas(&[row], token.as_deref().unwrap_or("carry"))
                    .await
            });
            copying
        };
        assert!(old.carry_cas_row(b"k", &copy).await.unwrap(), "carried");
        // A carry that did not hear its commit's answer learns it was made, however the row
        // changed since (a take and give-back by a process the move is still in force for).
        let carried = scanned[0].clone();
        assert!(old.cas_carry_kept(&carried).await.unwrap());
        old.take_cas(b"k", "x", "t-x").await.unwrap().unwrap();
        assert!(old
            .give_back_cas(b"k", "t-x", crate::CasGiveBack::Undone(None))
            .await
            .unwrap());
        assert!(
            old.cas_carry_kept(&carried).await.unwrap(),
            "a carried row, taken and given back since, read as released: its copy, the lock, \
             would be given back"
        );
        assert!(new.release_cas(b"k", "t1", version).await.unwrap());

        // A second carry that scanned the row before the first freed it.
        let second = |_, _| -> futures_util::future::BoxFuture<'_, _> {
            Box::pin(async { panic!("a free row was copied") })
        };
        assert!(!old.carry_cas_row(&scanned[0].0, &second).await.unwrap());
        assert!(
            new.take_cas(b"k", "b", "t2").await.unwrap().is_some(),
            "the released lock was written back"
        );

        // The key carried back here later (as copies are written, with the version it had
        // there, 1) and released: the mark of the carry that took it away says nothing of it.
        let mut session = old.connection().await.unwrap();
        let back: CasRow = (b"k".to_vec(), "o2".to_owned(), 1);
        adopt_cas(session.raw(), std::slice::from_ref(&back), "t4")
            .await
            .unwrap();
        drop(session);
        assert!(old.release_cas(b"k", "t4", 1).await.unwrap());
        assert!(
            !old.cas_carry_kept(&back).await.unwrap(),
            "a released row read as carried by an earlier carry's mark"
        );

        // A row released by its holder, not carried: copies of it are nobody's.
        let version = old.take_cas(b"r", "o", "t3").await.unwrap().unwrap();
        assert!(old.release_cas(b"r", "t3", version).await.unwrap());
        let released = (b"r".to_vec(), "o".to_owned(), version);
        assert!(!old.cas_carry_kept(&released).await.unwrap());
    }

    /// A take's row on a shard its key moved away from, given back by the take once that
    /// move's carry began, is passed on, not undone: a carry of it whose outcome is unknown
    /// keeps its copies, the take's own row on the new shard among them (a copy that changed
    /// nothing there looks just like it).
    #[tokio::test(flavor = "multi_thread")]
    async fn a_take_passed_on_from_an_old_shard_keeps_a_carrys_copies() {
        let (_cluster, shards) = crate::testing::migrated_shards(2).await;
        let [old, new] = <[_; 2]>::try_from(shards).unwrap();
        // Taken on both shards of a move by one call: one token, here one version too.
        let version = old.take_cas(b"k", "h", "t1").await.unwrap().unwrap();
        assert_eq!(new.take_cas(b"k", "h", "t1").await.unwrap(), Some(version));
        // A carry's copy of the old row, which changes nothing on the new shard; the carry
        // then did not hear its commit's answer (it was not made).
        let copied: CasRow = (b"k".to_vec(), "h".to_owned(), version);
        let mut session = new.connection().await.unwrap();
        adopt_cas(session.raw(), std::slice::from_ref(&copied), "t1")
            .await
            .unwrap();
        drop(session);

        let passed = crate::CasGiveBack::PassedOn;
        assert!(old.give_back_cas(b"k", "t1", passed).await.unwrap());
        assert!(
            old.cas_carry_kept(&copied).await.unwrap(),
            "a take passed on read as released: the carry's settle would give back the take's \
             own row on the new shard"
        );
        assert_eq!(
            old.take_cas(b"k", "x", "t2").await.unwrap(),
            Some(version + 3),
            "the old row is free"
        );
    }
}
