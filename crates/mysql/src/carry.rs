//! Carrying the lock patterns' rows of moved keys from the shard they left to their new shard,
//! once a reload's move window is over: owned CAS rows and unfinished jobs. Each step is a
//! conditional statement, so a carry interrupted anywhere and run again (by this process or
//! another) neither loses nor duplicates anything.

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Params, Value};

use crate::lease::{padded_in_list, rows_source};

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
/// owner and version, and no call token (the take that made it was on another shard); an
/// owned one is left alone. The version is assigned first, while
/// `owner` still has its old value. (Placeholders are cast: a derived table's column types are
/// otherwise the server's guess.)
pub(crate) async fn adopt_cas(conn: &mut Conn, rows: &[CasRow]) -> mysql_async::Result<()> {
    if rows.is_empty() {
        return Ok(());
    }
    // In key order, as `raise_floors` writes: carries of the same keys from several
    // processes then lock rows in one order and cannot deadlock each other.
    let mut sorted: Vec<&CasRow> = rows.iter().collect();
    sorted.sort();
    let mut params: Vec<Value> = Vec::with_capacity(rows.len() * 3);
    for (key, owner, version) in sorted {
        params.extend([
            key.as_slice().into(),
            owner.as_str().into(),
            (*version).into(),
        ]);
    }
    let sql = format!(
        "INSERT INTO shardlock_cas (lock_key, owner, version) \
         SELECT src.k, src.o, CAST(src.v AS UNSIGNED) FROM {} \
         ON DUPLICATE KEY UPDATE \
         version = IF(shardlock_cas.owner IS NULL, CAST(src.v AS UNSIGNED), shardlock_cas.version), \
         token = IF(shardlock_cas.owner IS NULL, NULL, shardlock_cas.token), \
         owner = IF(shardlock_cas.owner IS NULL, src.o, shardlock_cas.owner)",
        rows_source(&["k", "o", "v"], rows.len())
    );
    conn.exec_drop(sql, Params::Positional(params)).await
}

/// Frees a CAS row carried elsewhere if it is still owned by `owner` at `version`, raising
/// the version by 2 (a holder's release raises it by 1), so that after a lost reply a second
/// look tells who freed it. Whether this call (or its lost first try) freed it.
pub(crate) async fn free_carried_cas(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    version: u64,
) -> mysql_async::Result<bool> {
    conn.exec_drop(
        "UPDATE shardlock_cas SET owner = NULL, token = NULL, version = version + 2 \
         WHERE lock_key = ? AND owner = ? AND version = ?",
        (key, owner, version),
    )
    .await?;
    if conn.affected_rows() == 1 {
        return Ok(true);
    }
    let row: Option<(Option<Vec<u8>>, u64)> = conn
        .exec_first(
            "SELECT owner, version FROM shardlock_cas WHERE lock_key = ?",
            (key,),
        )
        .await?;
    Ok(matches!(row, Some((None, v)) if v == version + 2))
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
}

/// Jobs not finished, in id order after an id: ready, being moved, or claimed (running, or
/// abandoned with retries left).
const PENDING_JOBS_AFTER: &str = "SELECT id, queue, status = 'claimed' AND lease_until > NOW(3) \
     FROM shardlock_job WHERE id > ? AND (status IN ('ready', 'moving') \
     OR (status = 'claimed' AND (lease_until > NOW(3) OR retry_count < max_retries))) \
     ORDER BY id LIMIT ?";

pub(crate) async fn pending_jobs_after(
    conn: &mut Conn,
    after: u64,
    limit: usize,
) -> mysql_async::Result<Vec<PendingJob>> {
    let rows: Vec<(u64, Vec<u8>, bool)> =
        conn.exec(PENDING_JOBS_AFTER, (after, limit as u64)).await?;
    Ok(rows
        .into_iter()
        .map(|(id, queue, running)| PendingJob { id, queue, running })
        .collect())
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
}

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
    type Row = (u64, Vec<u8>, Vec<u8>, mysql_async::Value, u32, u32, Vec<u8>);
    let rows: Vec<Row> = conn
        .exec(
            format!(
                "SELECT id, queue, payload, due_at, retry_count, max_retries, moved_to \
                 FROM shardlock_job WHERE id IN {list} AND status = 'moving'"
            ),
            Params::Positional(params),
        )
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(id, queue, payload, due_at, retry_count, max_retries, moved_to)| MovingJob {
                id,
                queue,
                payload,
                due_at,
                retry_count,
                max_retries,
                moved_to: String::from_utf8_lossy(&moved_to).into_owned(),
            },
        )
        .collect())
}

/// Enqueues moved jobs, each at most once: `origin` (where it came from) is unique.
pub(crate) async fn enqueue_moved(
    conn: &mut Conn,
    origin: &str,
    jobs: &[MovingJob],
) -> mysql_async::Result<()> {
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
            format!("{origin}#{}", job.id).into(),
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
