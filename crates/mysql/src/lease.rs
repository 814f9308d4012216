//! The lease statements. Each is one round trip; time is the shard's clock.

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Params, Value};

/// Shard clock in microseconds since the epoch: where a new row's fence starts.
///
/// A macro, not a `const`, because statements are assembled with `concat!`, which takes only
/// literals; `#[macro_export]` is what lets the cleaner's statements use it too (hidden from
/// the docs, it is not API).
#[macro_export]
#[doc(hidden)]
macro_rules! now_us {
    () => {
        "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)"
    };
}

/// What a release writes over the owner: the owner with its first byte made `:`. No owner
/// starts with `:` (it starts with the instance id, which is never empty and never contains
/// one), so the tombstone equals no owner and every owner-checked statement misses the row as
/// it would a `NULL` owner. It keeps the owner's length, and with it the record's size, so the
/// server updates the row in place; a `NULL` would shrink the record, which InnoDB does by
/// deleting and inserting it again within its page (measured: 7–8% of the whole lock cycle at
/// 16 tasks). Every release writes it, hand-offs and releases kept for a while
/// (`RELEASE_AT_LEAST`) included, so that a release retried after a lost reply can tell its
/// own from a force-release's: rows freed by a force-release or by earlier versions have a
/// `NULL` owner. `released!` tells both.
#[macro_export]
#[doc(hidden)]
macro_rules! tombstone {
    () => {
        "CONCAT(':', SUBSTRING(owner, 2))"
    };
}

/// Whether the owner column `$owner` says the row was released: `NULL`, or a `tombstone!`.
#[macro_export]
#[doc(hidden)]
macro_rules! released {
    ($owner:literal) => {
        concat!("(", $owner, " IS NULL OR LEFT(", $owner, ", 1) = ':')")
    };
}

/// Whether a row carries a live lease: an owner that is not a `tombstone!`, and an end still
/// ahead of the shard's clock. The owner test matters when the clock steps back behind a
/// release's time: the row's `expires_at` is then ahead again, but it stays released.
#[macro_export]
#[doc(hidden)]
macro_rules! live {
    () => {
        "(owner IS NOT NULL AND LEFT(owner, 1) <> ':' AND expires_at > NOW(3))"
    };
}

/// [`live!`] in an `ON DUPLICATE KEY UPDATE` whose source has columns of its own: the row as
/// found.
macro_rules! live_row {
    () => {
        "(shardlock_lease.owner IS NOT NULL AND LEFT(shardlock_lease.owner, 1) <> ':' \
         AND shardlock_lease.expires_at > NOW(3))"
    };
}

/// The first byte of a `tombstone!`.
const TOMBSTONE_MARK: u8 = b':';

/// Whether an owner column as read names a holder: `false` when the row was released (`NULL`,
/// or a `tombstone!`).
pub(crate) fn names_holder(owner: &Option<Vec<u8>>) -> bool {
    matches!(owner, Some(o) if o.first() != Some(&TOMBSTONE_MARK))
}

/// An owner column as read: `None` when the row was released (see [`names_holder`]).
pub(crate) fn holding_owner(owner: Option<Vec<u8>>) -> Option<Vec<u8>> {
    if names_holder(&owner) {
        owner
    } else {
        None
    }
}

/// One above the shard's fence floor (`shardlock_meta`: raised when keys move here, and to the
/// fence of every row the cleaner deletes): every new fence is at least this. A subquery, for
/// the statements that only need the floor as a bound: the hand-off (its key's row, granted
/// here, is already above it) and the clock read of a move. Acquires read it through
/// [`floor_row`], locked.
#[macro_export]
#[doc(hidden)]
macro_rules! fence_floor {
    () => {
        "(COALESCE((SELECT CAST(value AS UNSIGNED) FROM shardlock_meta WHERE name = 'fence-floor'), 0) + 1)"
    };
}

/// The fence floor's row joined into an acquire (`FROM ... JOIN` it, or `FROM` it alone), so
/// that the statement reads it once, as `meta.value`, for both the insert and the update
/// branch: read as a subquery in each, it was the costliest part of an acquire on the server
/// (a second table opened and locked per reference).
///
/// The `SELECT` ends with [`floor_lock`]: the row stays share-locked until the acquire commits,
/// so a raise of the floor waits for acquires in flight, and every acquire after it reads the
/// raised floor. Without it that holds only at `REPEATABLE READ`: at `READ COMMITTED` (a common
/// server default, which shardlock leaves alone because callers' own transactions run on its
/// sessions) `INSERT ... SELECT` reads its source without locks.
///
/// Every migrated shard has the row (migration 5). Without it the `SELECT` yields nothing and
/// nothing is written: [`floor_row_missing`] turns that reply into an error instead of an
/// answer.
#[macro_export]
#[doc(hidden)]
macro_rules! floor_row {
    () => {
        "shardlock_meta AS meta"
    };
}

/// [`floor_row`]'s condition.
#[macro_export]
#[doc(hidden)]
macro_rules! floor_row_is {
    () => {
        "meta.name = 'fence-floor'"
    };
}

/// The end of the `SELECT` that reads [`floor_row`]: its share lock, at every isolation level
/// (MySQL 8 also spells it `FOR SHARE`, which MariaDB does not take).
#[macro_export]
#[doc(hidden)]
macro_rules! floor_lock {
    () => {
        "LOCK IN SHARE MODE"
    };
}

/// One above the fence floor read through [`floor_row`].
#[macro_export]
#[doc(hidden)]
macro_rules! joined_floor {
    () => {
        "(CAST(meta.value AS UNSIGNED) + 1)"
    };
}

/// What a grant asks of the shard: the row `key` for `owner` for `ttl`, with a first fence of
/// at least `fence_floor` (and above every earlier fence of the key and the shard's fence
/// floor), and `reserve` more fences set aside after it.
///
/// The reserved fences are for grants this process makes in memory (local hand-offs) without
/// another round trip: the row stores the top of the range, so whoever is granted the key next
/// through the shard gets a fence above all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantRequest {
    /// The stored key.
    pub key: Vec<u8>,
    /// The new owner, unique per grant.
    pub owner: String,
    /// Lease length in ms.
    pub ttl_ms: u32,
    /// The first fence is at least this (a key's fence on the shard it lived on before a
    /// move: the same lease's, so it may be equal).
    pub fence_floor: u64,
    /// Fences reserved after the first one.
    pub reserve: u32,
    /// The new holder's trace context (W3C traceparent), stored with the lease so that a
    /// waiter elsewhere can link to it; `None` when the holder is not traced.
    pub trace: Option<String>,
}

/// Acquire in one statement, for a free row, a released row or an expired lease alike.
///
/// `owner` is unique per attempt, so after the first assignment `owner = ?` means "this
/// attempt won". The winner's first fence is handed back through `LAST_INSERT_ID(expr)`,
/// which the server reports in the OK packet (the stored fence is that plus the reserve). A
/// loser marks the row as wanted and gets, through the same channel, how long the holder has
/// had it, in ms, with the top bit set ([`HELD_MARK`]) so it cannot be taken for a fence;
/// waiters use it to poll a briefly held key soon. Assignments run left to right, so `owner`
/// must come first. A row held by a live lease is never taken; nothing is deleted, so there
/// is no insert/delete churn on hot rows. Times are `NOW(3)` of the shard, in UTC; the
/// statement is kept small because the server re-resolves every expression of a prepared
/// statement on each execution.
///
/// A row already this owner's (a try whose reply was lost, landing after the retry that
/// answered) keeps its end if that is later: the lease may have been extended since, and its
/// holder counts on that end (`GREATEST`). A row taken over has ended: its end is first
/// brought back to now at the latest (a released row's end is its release's time, which a
/// shard clock stepped back puts ahead), so that the new owner's end is its own ttl's.
///
/// The loser's branch is `fence + 0 * LAST_INSERT_ID(...)`: the fence stays, but the call is
/// still evaluated for its side effect. Its `GREATEST(..., 0)` matters: if the shard's clock
/// stepped back since the grant, the held time is negative, and 2^63 plus it would fall below
/// [`HELD_MARK`] and be read as a granted fence.
///
/// Parameters: key, owner, fence floor, reserve, ttl ms, ttl us, trace | owner, owner, fence
/// floor, reserve, owner, ttl ms, owner, ttl us, owner, owner, trace, owner.
const ACQUIRE: &str = concat!(
    "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at, holder_trace, wanted_at) ",
    "SELECT ?, ?, LAST_INSERT_ID(GREATEST(", now_us!(), ", ", joined_floor!(), ", ?)) + ?, ?, NOW(3) + INTERVAL ? MICROSECOND, NOW(3), ?, NULL ",
    "FROM ", floor_row!(), " WHERE ", floor_row_is!(), " ", floor_lock!(), " ",
    "ON DUPLICATE KEY UPDATE ",
    "expires_at = IF(", released!("owner"), ", LEAST(expires_at, NOW(3)), expires_at), ",
    "owner = IF(", released!("owner"), " OR expires_at <= NOW(3), ?, owner), ",
    "fence = IF(owner = ?, LAST_INSERT_ID(GREATEST(fence + 1, ", now_us!(), ", ", joined_floor!(), ", ?)) + ?, ",
    "fence + 0 * LAST_INSERT_ID(9223372036854775808 + LEAST(GREATEST(TIMESTAMPDIFF(MICROSECOND, acquired_at, NOW(3)) DIV 1000, 0), 1000000000))), ",
    "ttl_ms = IF(owner = ?, ?, ttl_ms), ",
    "expires_at = IF(owner = ?, GREATEST(expires_at, NOW(3) + INTERVAL ? MICROSECOND), expires_at), ",
    "acquired_at = IF(owner = ?, NOW(3), acquired_at), ",
    "holder_trace = IF(owner = ?, ?, holder_trace), ",
    "wanted_at = IF(owner = ?, NULL, NOW(3))"
);

/// The trace context of the live holder of a key, if it was traced.
const HOLDER_TRACE: &str = concat!(
    "SELECT holder_trace FROM shardlock_lease WHERE lock_key = ? AND ",
    live!()
);

/// Owner-checked release: only the row carrying our owner is touched, its owner turned into a
/// `tombstone!`. The row stays (with its fence) so the next grant's fence is larger; the
/// cleaner removes old released rows.
const RELEASE: &str = concat!(
    "UPDATE shardlock_lease SET owner = ",
    tombstone!(),
    ", expires_at = NOW(3), wanted_at = NULL WHERE lock_key = ? AND owner = ?"
);

/// Release that hands the lease straight to a waiting owner of this process, in one
/// statement, unless another process marked the row as wanted since the grant: then it is
/// released for everyone. The new grant's fence comes back through `LAST_INSERT_ID(expr)` as
/// in [`ACQUIRE`]; a plain release reports 0. Only a live row is handed over: a statement held
/// up until after the row ended (its holder lost it meanwhile) must not bring it back, on a
/// shard a reload's move may have left since, where nobody would look for it.
///
/// Parameters: new owner ×2, reserve, new owner, ttl ms, new owner, ttl us, new owner | key,
/// old owner.
const HANDOFF: &str = concat!(
    "UPDATE shardlock_lease SET ",
    "owner = IF(wanted_at IS NULL, ?, ",
    tombstone!(),
    "), ",
    "fence = IF(owner <=> ?, LAST_INSERT_ID(GREATEST(fence + 1, ",
    now_us!(),
    ", ",
    fence_floor!(),
    ")) + ?, fence + LAST_INSERT_ID(0)), ",
    "ttl_ms = IF(owner <=> ?, ?, ttl_ms), ",
    "expires_at = IF(owner <=> ?, NOW(3) + INTERVAL ? MICROSECOND, NOW(3)), ",
    "acquired_at = IF(owner <=> ?, NOW(3), acquired_at), ",
    "holder_trace = NULL, ",
    "wanted_at = NULL ",
    "WHERE lock_key = ? AND owner = ? AND expires_at > NOW(3)"
);

/// Raises the stored fence of a lease we hold to at least `?`: after a moved key was granted on
/// its new shard, its rows on the shards it lived on before must carry that fence too, so that
/// a process still placing the key there gets a larger one.
const RAISE_FENCE: &str =
    "UPDATE shardlock_lease SET fence = GREATEST(fence, ?) WHERE lock_key = ? AND owner = ?";

/// Whether `owner` holds `key`. Also `true` when the stored fence was already at least
/// `fence`: sessions count matched rows (`CLIENT_FOUND_ROWS`), so the answer is about the
/// owner, not about whether the value changed.
pub(crate) async fn raise_fence(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    fence: u64,
) -> mysql_async::Result<bool> {
    conn.exec_drop(RAISE_FENCE, (fence, key, owner)).await?;
    Ok(conn.affected_rows() == 1)
}

/// Raises the shard's fence floor (see [`fence_floor`]) to at least `?` (creating it if a
/// shard migrated before it existed lacks it).
const RAISE_SHARD_FLOOR: &str = "INSERT INTO shardlock_meta (name, value) \
     VALUES ('fence-floor', CAST(CAST(? AS UNSIGNED) AS CHAR)) ON DUPLICATE KEY UPDATE \
     value = CAST(GREATEST(CAST(value AS UNSIGNED), CAST(? AS UNSIGNED)) AS CHAR)";

/// Where the shard's next fence of a fresh key starts: its clock in microseconds, or its
/// fence floor if that is higher (its clock stepped back since it raised the floor).
const CLOCK_US: &str = concat!("SELECT GREATEST(", now_us!(), ", ", fence_floor!(), ")");

pub(crate) async fn raise_shard_floor(conn: &mut Conn, floor: u64) -> mysql_async::Result<()> {
    conn.exec_drop(RAISE_SHARD_FLOOR, (floor, floor)).await
}

/// [`raise_shard_floor`] waiting at most a second (the server's shortest wait) for the floor's
/// row lock; then the session's lock wait set back to `restore` seconds.
pub(crate) async fn raise_shard_floor_briefly(
    conn: &mut Conn,
    floor: u64,
    restore: u64,
) -> mysql_async::Result<()> {
    conn.query_drop("SET SESSION innodb_lock_wait_timeout = 1")
        .await?;
    let raised = conn.exec_drop(RAISE_SHARD_FLOOR, (floor, floor)).await;
    conn.query_drop(format!("SET SESSION innodb_lock_wait_timeout = {restore}"))
        .await?;
    raised
}

pub(crate) async fn clock_us(conn: &mut Conn) -> mysql_async::Result<u64> {
    Ok(conn.query_first(CLOCK_US).await?.unwrap_or(0))
}

/// The fences of a shard's rows, in key order after a key (the empty key: from the start),
/// with the owner of each live lease, and for a row kept past its release (`ttl_ms = 0`, see
/// `RELEASE_AT_LEAST`) how many µs it still has by the shard's clock.
const FENCES_AFTER: &str = concat!(
    "SELECT lock_key, fence, IF(",
    live!(),
    ", owner, NULL), IF(",
    live!(),
    " AND ttl_ms = 0, TIMESTAMPDIFF(MICROSECOND, NOW(3), expires_at), NULL) \
     FROM shardlock_lease WHERE lock_key > ? ORDER BY lock_key LIMIT ?"
);

/// A row's key and fence, and its owner while a lease holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceRow {
    /// The stored key.
    pub key: Vec<u8>,
    /// The highest fence reserved for the key on this shard.
    pub fence: u64,
    /// The owner of the live lease, if any.
    pub live_owner: Option<String>,
    /// For a row its holder released with a minimum hold (`lock_at_least`, a scheduled run's
    /// interval), which stays taken with no process renewing it: how long it still stays so.
    pub kept_for: Option<std::time::Duration>,
}

/// The live leases among some keys: `(key, owner)`.
const LIVE_HEAD: &str = concat!(
    "SELECT lock_key, owner FROM shardlock_lease WHERE ",
    live!(),
    " AND lock_key IN "
);

pub(crate) async fn live_owners(
    conn: &mut Conn,
    keys: &[Vec<u8>],
) -> mysql_async::Result<Vec<(Vec<u8>, String)>> {
    let (list, params) = padded_in_list(keys.iter().map(Vec::as_slice));
    let rows: Vec<(Vec<u8>, Vec<u8>)> = conn
        .exec(format!("{LIVE_HEAD}{list}"), Params::Positional(params))
        .await?;
    Ok(rows
        .into_iter()
        .map(|(k, o)| (k, String::from_utf8_lossy(&o).into_owned()))
        .collect())
}

/// Most rows read or floors written by one statement of a floor copy.
pub const FLOOR_BATCH: usize = 1000;

pub(crate) async fn fences_after(
    conn: &mut Conn,
    after: &[u8],
    limit: usize,
) -> mysql_async::Result<Vec<FenceRow>> {
    // Key, fence, live owner, µs a kept row has left.
    type Row = (Vec<u8>, u64, Option<Vec<u8>>, Option<i64>);
    let rows: Vec<Row> = conn.exec(FENCES_AFTER, (after, limit as u64)).await?;
    Ok(rows
        .into_iter()
        .map(|(key, fence, owner, kept_us)| FenceRow {
            key,
            fence,
            live_owner: owner.map(|o| String::from_utf8_lossy(&o).into_owned()),
            kept_for: kept_us.map(|us| std::time::Duration::from_micros(us.max(0).unsigned_abs())),
        })
        .collect())
}

/// Copies a row kept past its release (see [`FenceRow::kept_for`]) to the shard its key moved
/// to: the key's row here takes the copy's owner, stays taken for `µs` more by this shard's
/// clock and keeps at least the fence, unless a live lease holds it (the copy itself, sent
/// again; or, should a process that has not reloaded have taken the key, another's: then
/// nothing changes and the move waits for it as for any lease). Assignments run left to right, so `ttl_ms`,
/// `acquired_at` and `owner` come first, while the row is as found, and the rest test whether
/// the owner became the copy's (a copy's owner is its kept row's, marked as a copy: unique).
///
/// Parameters: key, owner, fence, µs.
const KEEP_MOVED: &str = concat!(
    "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at, wanted_at) ",
    "SELECT src.k, src.o, CAST(src.f AS UNSIGNED), 0, NOW(3) + INTERVAL src.l MICROSECOND, NOW(3), NULL ",
    "FROM (SELECT ? AS k, ? AS o, ? AS f, ? AS l) AS src ",
    "ON DUPLICATE KEY UPDATE ",
    "ttl_ms = IF(", live_row!(), ", shardlock_lease.ttl_ms, 0), ",
    "acquired_at = IF(", live_row!(), ", shardlock_lease.acquired_at, NOW(3)), ",
    "owner = IF(", live_row!(), ", shardlock_lease.owner, src.o), ",
    "fence = IF(shardlock_lease.owner = src.o, GREATEST(shardlock_lease.fence, CAST(src.f AS UNSIGNED)), shardlock_lease.fence), ",
    "expires_at = IF(shardlock_lease.owner = src.o, GREATEST(shardlock_lease.expires_at, NOW(3) + INTERVAL src.l MICROSECOND), shardlock_lease.expires_at), ",
    "wanted_at = IF(shardlock_lease.owner = src.o, NULL, shardlock_lease.wanted_at), ",
    "holder_trace = IF(shardlock_lease.owner = src.o, NULL, shardlock_lease.holder_trace)"
);

pub(crate) async fn keep_moved(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    fence: u64,
    kept_for: std::time::Duration,
) -> mysql_async::Result<()> {
    let us = u64::try_from(kept_for.as_micros()).unwrap_or(u64::MAX);
    conn.exec_drop(KEEP_MOVED, (key, owner, fence, us)).await
}

/// Raises the stored fence of each key to at least the given one: after a reload moved the
/// keys here, the fences they had on the shard they left become their floor here, so that the
/// next grant is above every earlier one whatever the two shards' clocks say. A key without a
/// row gets a released one carrying the floor. Keys are written in one global order, so
/// concurrent copies from several processes cannot deadlock each other.
pub(crate) async fn raise_floors(
    conn: &mut Conn,
    floors: &[(Vec<u8>, u64)],
) -> mysql_async::Result<()> {
    if floors.is_empty() {
        return Ok(());
    }
    let mut sorted: Vec<&(Vec<u8>, u64)> = floors.iter().collect();
    sorted.sort();
    let mut params: Vec<Value> = Vec::with_capacity(floors.len() * 2);
    for (key, fence) in sorted {
        params.push(key.as_slice().into());
        params.push((*fence).into());
    }
    let sql = format!(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         SELECT src.k, NULL, CAST(src.f AS UNSIGNED), 0, NOW(3), NOW(3) FROM {} \
         ON DUPLICATE KEY UPDATE fence = GREATEST(shardlock_lease.fence, CAST(src.f AS UNSIGNED))",
        rows_source(&["k", "f"], floors.len())
    );
    conn.exec_drop(sql, Params::Positional(params)).await
}

/// `(SELECT ? AS a, ? AS b UNION ALL SELECT ?, ? ...) AS src`: `rows` rows of placeholders
/// named `columns`, to insert many rows with `INSERT ... SELECT` and refer to them as `src.a`
/// in `ON DUPLICATE KEY UPDATE` (the portable form: `VALUES()` there is deprecated in MySQL 8
/// and its replacement row alias is not in MariaDB).
pub(crate) fn rows_source(columns: &[&str], rows: usize) -> String {
    let mut sql = String::from("(");
    for row in 0..rows {
        sql.push_str(if row == 0 {
            "SELECT "
        } else {
            " UNION ALL SELECT "
        });
        for (i, column) in columns.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            sql.push('?');
            if row == 0 {
                sql.push_str(" AS ");
                sql.push_str(column);
            }
        }
    }
    sql.push_str(") AS src");
    sql
}

/// What a hand-off did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandoffOutcome {
    /// The lease moved to the new owner, with this fence.
    Granted(u64),
    /// Another process wants the key: it was released instead.
    Released,
    /// The old owner no longer held it; nothing changed.
    NotOurs,
}

pub(crate) async fn handoff(
    conn: &mut Conn,
    old_owner: &str,
    to: &GrantRequest,
) -> mysql_async::Result<HandoffOutcome> {
    let ttl_us = u64::from(to.ttl_ms) * 1000;
    let new_owner = to.owner.as_str();
    let params: Vec<Value> = vec![
        new_owner.into(),
        new_owner.into(),
        to.reserve.into(),
        new_owner.into(),
        to.ttl_ms.into(),
        new_owner.into(),
        ttl_us.into(),
        new_owner.into(),
        to.key.as_slice().into(),
        old_owner.into(),
    ];
    conn.exec_drop(HANDOFF, Params::Positional(params)).await?;
    Ok(
        match (
            conn.affected_rows(),
            conn.last_insert_id().filter(|&f| f > 0),
        ) {
            (0, _) => HandoffOutcome::NotOurs,
            (_, Some(fence)) => HandoffOutcome::Granted(fence),
            (_, None) => HandoffOutcome::Released,
        },
    )
}

/// Renewal of many leases in one statement. Owners are unique per grant and each is written
/// to one key only, so `key IN (...) AND owner IN (...)` matches exactly our (key, owner)
/// pairs while letting the server use the primary key. Only live leases are extended: one that
/// already expired on the shard's clock stays lost even if nobody took it yet. A renewal never
/// brings a lease's end forward: one its holder extended ([`extend`]) keeps that end.
const RENEW_HEAD: &str = "UPDATE shardlock_lease \
     SET expires_at = GREATEST(expires_at, NOW(3) + INTERVAL ttl_ms * 1000 MICROSECOND) \
     WHERE expires_at > NOW(3) AND lock_key IN ";
const HELD_HEAD: &str =
    "SELECT lock_key FROM shardlock_lease WHERE expires_at > NOW(3) AND lock_key IN ";

/// What a read of a lease row returns ([`LeaseRow`], then the stored key): the data only while
/// the owner that stored it holds the row.
macro_rules! row_columns {
    () => {
        "SELECT owner, fence, ttl_ms, \
         CAST(TIMESTAMPDIFF(MICROSECOND, NOW(3), expires_at) DIV 1000 AS SIGNED), \
         CAST(TIMESTAMPDIFF(MICROSECOND, acquired_at, NOW(3)) DIV 1000 AS SIGNED), \
         CAST(GREATEST(TIMESTAMPDIFF(MICROSECOND, wanted_at, NOW(3)) DIV 1000, 0) AS SIGNED), \
         IF(data_owner = owner, data, NULL), lock_key \
         FROM shardlock_lease"
    };
}
/// Durations relative to the shard's clock, in milliseconds. A batch may mark a key wanted
/// up to a millisecond ahead of the clock (see `batch.rs`): "wanted for" counts from 0.
const INSPECT: &str = concat!(row_columns!(), " WHERE lock_key = ?");

/// Stores `?` with a live lease of its owner.
///
/// Parameters: data, key, owner.
const SET_DATA: &str = "UPDATE shardlock_lease SET data_owner = owner, data = ? \
     WHERE lock_key = ? AND owner = ? AND expires_at > NOW(3)";

/// Longest payload stored with a lease (the column's width).
pub const MAX_DATA_BYTES: usize = 1024;

/// Whether `owner` held `key` live and its data is now `data`.
pub(crate) async fn set_data(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    data: &[u8],
) -> mysql_async::Result<bool> {
    conn.exec_drop(SET_DATA, (data, key, owner)).await?;
    Ok(conn.affected_rows() == 1)
}

/// Which rows [`crate::Shard::list`] reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Stored keys starting with these bytes (all when empty).
    pub prefix: Vec<u8>,
    /// Only live leases.
    pub held_only: bool,
    /// At most this many rows, in key order.
    pub limit: usize,
}

/// The smallest byte string above every string that starts with `prefix`, if there is one
/// (not for a prefix of 0xFF bytes only).
fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xFF {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

/// Lease rows in key order, as a range of the primary key.
pub(crate) async fn list(
    conn: &mut Conn,
    filter: &ListFilter,
) -> mysql_async::Result<Vec<(Vec<u8>, LeaseRow)>> {
    let mut sql = String::from(concat!(row_columns!(), " WHERE lock_key >= ?"));
    let mut params: Vec<Value> = vec![filter.prefix.as_slice().into()];
    if let Some(end) = prefix_end(&filter.prefix).filter(|_| !filter.prefix.is_empty()) {
        sql.push_str(" AND lock_key < ?");
        params.push(end.into());
    }
    if filter.held_only {
        sql.push_str(concat!(" AND ", live!()));
    }
    sql.push_str(" ORDER BY lock_key LIMIT ?");
    params.push((filter.limit as u64).into());
    let rows: Vec<InspectRow> = conn.exec(sql, Params::Positional(params)).await?;
    Ok(rows
        .into_iter()
        .map(|row| {
            let key = row.7.clone();
            (key, lease_row(row))
        })
        .collect())
}

const COUNT_HELD: &str = concat!("SELECT COUNT(*) FROM shardlock_lease WHERE ", live!());

/// Most leases renewed by one statement (two parameters each, well under the 65,535 limit).
pub const MAX_RENEW_BATCH: usize = 4096;

/// Most bytes of keys and owners renewed by one statement: 4,096 leases of 255-byte keys
/// would make a statement (and its read-back) of 1.6 MB, past a `max_allowed_packet` lowered
/// to 1 MiB (the least a server is likely to run with), and every renewal of the shard would
/// fail. Leases of ordinary keys (a few dozen bytes) still fill [`MAX_RENEW_BATCH`].
pub const MAX_RENEW_BYTES: usize = 512 * 1024;

/// `items` in chunks of at most [`MAX_RENEW_BATCH`] and [`MAX_RENEW_BYTES`] (`bytes` of
/// each: its key and owner), in order; an item larger than the bytes alone is a chunk of its
/// own.
pub fn renew_chunks<T>(items: &[T], bytes: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut chunks = Vec::new();
    let (mut start, mut size) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        let item_bytes = bytes(item);
        if i > start && (i - start == MAX_RENEW_BATCH || size + item_bytes > MAX_RENEW_BYTES) {
            chunks.push(&items[start..i]);
            (start, size) = (i, 0);
        }
        size += item_bytes;
    }
    if start < items.len() {
        chunks.push(&items[start..]);
    }
    chunks
}

/// Marks "held for N ms" in what a losing acquire reports. Fences start at the shard's clock in
/// microseconds (under 2^51 today) and rise with it and with each grant's reserve, far from
/// 2^63: the top bit alone tells the two answers apart in one number.
pub const HELD_MARK: u64 = 1 << 63;

/// What an acquire attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// Granted.
    Granted {
        /// The first fence of the grant.
        fence: u64,
        /// Whether a try of this call before the one that answered may still reach the
        /// server: its reply was lost, and its session could not be ended before the retry
        /// (a Galera node; a proxy that keeps sessions of its own). It would take the key
        /// again for the same owner once the grant's row is released.
        after_lost_try: bool,
    },
    /// Someone else's live lease holds the key, granted this long ago (ms).
    Held {
        /// How long the current holder has held the key, by the shard's clock.
        held_for_ms: u64,
        /// Whether a try of this call before the one that answered may have reached the
        /// server (its reply lost). Where that try's session could not be ended first (on a
        /// Galera node; behind a proxy that keeps sessions of its own), its statement may
        /// still be on its way, and take the key for the asking owner once the row is free:
        /// the answer proves that no row of the owner's is there now, not that none will be.
        after_lost_try: bool,
    },
    /// Another transaction kept the key's row locked until the server gave up waiting for it
    /// (error 1205, `innodb_lock_wait_timeout`): nothing was written, nothing decided; ask
    /// again. The shard answered, so this says nothing against its health.
    Locked,
}

/// The server gave up waiting for a row lock.
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// An error when the acquire just sent wrote nothing because the shard lacks its fence floor
/// row (see [`floor_row`]): no row was affected, where the session's `CLIENT_FOUND_ROWS`
/// counts every row the statement met, even one it left as it was. Read as an answer, the
/// empty write would look like a held key to every caller, forever.
pub(crate) fn floor_row_missing(conn: &Conn) -> mysql_async::Result<()> {
    if conn.affected_rows() == 0 {
        return Err(mysql_async::Error::Other(Box::new(NoFenceFloor)));
    }
    Ok(())
}

/// An acquire's reply read and refused here: the shard has no fence floor row. The statement
/// ran to its end, so its connection is as good as before (see [`is_refused_here`]).
#[derive(Debug)]
struct NoFenceFloor;

impl std::fmt::Display for NoFenceFloor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(
            "the shard has no fence floor (row 'fence-floor' of shardlock_meta): \
             run `shardlock migrate` on it",
        )
    }
}

impl std::error::Error for NoFenceFloor {}

/// Whether `e` is a reply this crate read in full and refused ([`NoFenceFloor`]): an
/// `Error::Other`, which `is_fatal` calls fatal to the connection, though it is not.
pub(crate) fn is_refused_here(e: &mysql_async::Error) -> bool {
    matches!(e, mysql_async::Error::Other(e) if e.is::<NoFenceFloor>())
}

pub(crate) async fn acquire(conn: &mut Conn, req: &GrantRequest) -> mysql_async::Result<Attempt> {
    let ttl_us = u64::from(req.ttl_ms) * 1000;
    let owner = req.owner.as_str();
    let params: Vec<Value> = vec![
        req.key.as_slice().into(),
        owner.into(),
        req.fence_floor.into(),
        req.reserve.into(),
        req.ttl_ms.into(),
        ttl_us.into(),
        req.trace.as_deref().into(),
        owner.into(),
        owner.into(),
        req.fence_floor.into(),
        req.reserve.into(),
        owner.into(),
        req.ttl_ms.into(),
        owner.into(),
        ttl_us.into(),
        owner.into(),
        owner.into(),
        req.trace.as_deref().into(),
        owner.into(),
    ];
    // 1205 is an answer here, not an error: as an error the shard's runner would retry it at
    // once, spending the statement timeout behind the same row lock, where the caller's poll
    // loop waits with its own backoff and deadline instead.
    match conn.exec_drop(ACQUIRE, Params::Positional(params)).await {
        Err(mysql_async::Error::Server(e)) if e.code == LOCK_WAIT_TIMEOUT => {
            return Ok(Attempt::Locked)
        }
        result => result?,
    }
    floor_row_missing(conn)?;
    Ok(match conn.last_insert_id().unwrap_or(0) {
        reported if reported >= HELD_MARK => Attempt::Held {
            held_for_ms: reported - HELD_MARK,
            after_lost_try: false,
        },
        // No value came back: read as held, never as a grant this call cannot prove.
        0 => Attempt::Held {
            held_for_ms: 0,
            after_lost_try: false,
        },
        fence => Attempt::Granted {
            fence,
            after_lost_try: false,
        },
    })
}

/// Moves the end of a live lease to at least `?` µs from now, owner-checked; never earlier.
///
/// Parameters: µs, key, owner.
const EXTEND: &str = "UPDATE shardlock_lease \
     SET expires_at = GREATEST(expires_at, NOW(3) + INTERVAL ? MICROSECOND) \
     WHERE lock_key = ? AND owner = ? AND expires_at > NOW(3)";

/// Whether `owner`'s lease of `key` was live and now lasts at least `by` from the shard's now.
pub(crate) async fn extend(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    by: std::time::Duration,
) -> mysql_async::Result<bool> {
    let us = u64::try_from(by.as_micros()).unwrap_or(u64::MAX);
    conn.exec_drop(EXTEND, (us, key, owner)).await?;
    Ok(conn.affected_rows() == 1)
}

/// The shard's clock when `owner`'s grant of `key` was made, in ms since the epoch; `None` if
/// `owner` does not hold it.
const GRANTED_AT: &str = "SELECT CAST(UNIX_TIMESTAMP(acquired_at) * 1000 AS UNSIGNED) \
     FROM shardlock_lease WHERE lock_key = ? AND owner = ?";

pub(crate) async fn granted_at_ms(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
) -> mysql_async::Result<Option<u64>> {
    conn.exec_first(GRANTED_AT, (key, owner)).await
}

/// Moves the end of a live lease to at least `?` µs after its grant and its stored fence to
/// at least `?`, owner-checked; neither ever goes down.
///
/// Parameters: fence, µs, key, owner.
const HOLD_UNTIL: &str = "UPDATE shardlock_lease \
     SET fence = GREATEST(fence, ?), \
     expires_at = GREATEST(expires_at, acquired_at + INTERVAL ? MICROSECOND) \
     WHERE lock_key = ? AND owner = ? AND expires_at > NOW(3)";

/// Whether `owner`'s lease of `key` was live and now lasts at least `after_grant` past its
/// grant, with every later grant's fence above `fence`.
pub(crate) async fn hold_until(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    after_grant: std::time::Duration,
    fence: u64,
) -> mysql_async::Result<bool> {
    let us = u64::try_from(after_grant.as_micros()).unwrap_or(u64::MAX);
    conn.exec_drop(HOLD_UNTIL, (fence, us, key, owner)).await?;
    Ok(conn.affected_rows() == 1)
}

/// Release of a live lease that must stay taken until `?` µs after its grant: before then the
/// row keeps its owner and ends then, with a ttl of 0 so that a renewal still on its way
/// cannot move that end; after, or if the lease already ended, a plain release. Assignments
/// run left to right: `owner` is decided on the row as it was, the rest on that decision.
///
/// Parameters: µs, µs, key, owner.
const RELEASE_AT_LEAST: &str = concat!(
    "UPDATE shardlock_lease SET \
     owner = IF(expires_at > NOW(3) AND acquired_at + INTERVAL ? MICROSECOND > NOW(3), owner, ",
    tombstone!(),
    "), \
     ttl_ms = IF(LEFT(owner, 1) = ':', ttl_ms, 0), \
     expires_at = IF(LEFT(owner, 1) = ':', NOW(3), acquired_at + INTERVAL ? MICROSECOND), \
     wanted_at = NULL \
     WHERE lock_key = ? AND owner = ?"
);

/// Who holds a key, if anyone: read after a release that matched no row.
const OWNER: &str = "SELECT owner FROM shardlock_lease WHERE lock_key = ?";

/// What a release found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// The statement freed the owner's row.
    Freed,
    /// Nobody holds the key: its row was freed (or deleted) before, and shows no sign of
    /// whom by (another owner's tombstone, no row). By an earlier try of the same release whose
    /// reply was lost (the row then taken and released since, or swept), or by someone else
    /// (a force-release, the cleaner): only the caller can tell, by whether its lease could
    /// have ended.
    Free,
    /// Nobody holds the key and its row has no owner: a force-release freed it (a release
    /// leaves its tombstone), not this release's earlier try.
    Revoked,
    /// Another owner holds the key.
    Taken,
    /// Another owner holds the key, perhaps since the statement freed it for them: a batch
    /// release that freed rows it cannot tell apart (see `batch::release_batch`).
    TakenSince,
}

/// What an owner-checked release answers its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReleaseAnswer {
    /// The owner's row is free: this call freed it, or its first try did (its reply was lost
    /// and the retry found the row showing the owner's own tombstone).
    Released,
    /// Another owner holds the row (or none does, and nothing shows who freed it: another
    /// owner's tombstone, no row) after a release that may have freed it: a first try whose
    /// reply was lost, or a batch release that freed rows it cannot tell apart. That release
    /// freed it and someone took it since, or the lease had ended before. The server cannot
    /// tell these apart; the caller can, by whether its lease could have ended by now (a
    /// lease that cannot have expired yet was freed by that release, or revoked behind its
    /// back, which a free row after a lost reply cannot tell either).
    TakenAfterLostReply,
    /// Not the owner's: another owner holds it, or it was freed otherwise (force-released,
    /// deleted by the cleaner).
    NotHeld,
}

impl ReleaseAnswer {
    /// Whether the row was surely freed by this release.
    pub fn is_released(self) -> bool {
        self == Self::Released
    }
}

/// Releases `key` if `owner` holds it, leaving it taken until `at_least` after the grant
/// when that is set; when `owner` did not hold it, one more read tells whether anyone does.
pub(crate) async fn release(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
    at_least: Option<std::time::Duration>,
) -> mysql_async::Result<Released> {
    match at_least {
        None => conn.exec_drop(RELEASE, (key, owner)).await?,
        Some(at_least) => {
            let us = u64::try_from(at_least.as_micros()).unwrap_or(u64::MAX);
            conn.exec_drop(RELEASE_AT_LEAST, (us, us, key, owner))
                .await?
        }
    }
    if conn.affected_rows() == 1 {
        return Ok(Released::Freed);
    }
    let now: Option<Option<Vec<u8>>> = conn.exec_first(OWNER, (key,)).await?;
    Ok(match now {
        // This release's own tombstone: an earlier try of it freed the row.
        Some(Some(o)) if is_own_tombstone(&o, owner) => Released::Freed,
        Some(o) if names_holder(&o) => Released::Taken,
        // A row with no owner at all: a force-release (every release and hand-off leaves its
        // releaser's tombstone).
        Some(None) => Released::Revoked,
        _ => Released::Free,
    })
}

/// Whether the owner column `o` is `of`'s tombstone: the row `of` held, released by it.
pub(crate) fn is_own_tombstone(o: &[u8], of: &str) -> bool {
    o.len() == of.len() && o.first() == Some(&TOMBSTONE_MARK) && o[1..] == of.as_bytes()[1..]
}

/// What a renewal found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenewOutcome {
    /// For each lease passed in, what became of it.
    pub held: Vec<Renewal>,
    /// Statements it took: 1, 2 when some lease was not found and had to be told apart, 2 or
    /// 3 when renewed apart from rows another transaction held locked, and one more when
    /// that was found by a first statement's lock wait.
    pub statements: u32,
}

/// What a renewal did to one lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Renewal {
    /// Still ours, extended.
    Extended,
    /// Not ours any more, or ended: taken over, force-released or expired.
    Gone,
    /// Still ours, not extended: another transaction holds its row locked (a console session,
    /// a batch job). Tried again at a later renewal; lost at its end if the lock outlasts it.
    Blocked,
}

/// Builds `(?, ?, ...)` with `n` rounded up to a power of two, so that the statement cache
/// sees a handful of shapes rather than one per batch size. Padding repeats the last element,
/// which changes nothing in an `IN` list.
pub(crate) fn padded_in_list<'a>(
    items: impl ExactSizeIterator<Item = &'a [u8]> + Clone,
) -> (String, Vec<Value>) {
    let n = items.len().max(1).next_power_of_two();
    let mut values: Vec<Value> = items.clone().map(Value::from).collect();
    let last = values.last().cloned().unwrap_or(Value::NULL);
    values.resize(n, last);
    let mut list = String::with_capacity(n * 3 + 2);
    list.push('(');
    for i in 0..n {
        list.push_str(if i == 0 { "?" } else { ",?" });
    }
    list.push(')');
    (list, values)
}

/// Extends the leases, by key and owner, that are still ours and live. `apart`: some row of
/// theirs was locked by another transaction at their last renewal: the rows free of other
/// locks are renewed at once ([`renew_unlocked`]) instead of waiting behind a lock that may
/// still be there.
pub(crate) async fn renew(
    conn: &mut Conn,
    leases: &[(&[u8], &str)],
    apart: bool,
) -> mysql_async::Result<RenewOutcome> {
    debug_assert!(!leases.is_empty() && leases.len() <= MAX_RENEW_BATCH);
    let (keys_sql, mut params) = padded_in_list(leases.iter().map(|(k, _)| *k));
    let (owners_sql, owners) = padded_in_list(leases.iter().map(|(_, o)| o.as_bytes()));
    params.extend(owners);
    let tail = format!("{keys_sql} AND owner IN {owners_sql}");
    if apart {
        return renew_unlocked(conn, leases, &tail, params).await;
    }
    // 1205: another transaction holds one of these rows locked (the statement did nothing,
    // and would wait behind that lock again): the rows free of other locks are renewed alone.
    match conn
        .exec_drop(
            format!("{RENEW_HEAD}{tail}"),
            Params::Positional(params.clone()),
        )
        .await
    {
        Err(mysql_async::Error::Server(e)) if e.code == LOCK_WAIT_TIMEOUT => {
            let mut outcome = renew_unlocked(conn, leases, &tail, params).await?;
            outcome.statements += 1;
            return Ok(outcome);
        }
        result => result?,
    }
    if conn.affected_rows() as usize == leases.len() {
        return Ok(RenewOutcome {
            held: vec![Renewal::Extended; leases.len()],
            statements: 1,
        });
    }
    // Some lease was not extended: find out which ones are still ours.
    let still: Vec<Vec<u8>> = conn
        .exec(format!("{HELD_HEAD}{tail}"), Params::Positional(params))
        .await?;
    let held = leases
        .iter()
        .map(|(k, _)| match still.iter().any(|s| s.as_slice() == *k) {
            true => Renewal::Extended,
            false => Renewal::Gone,
        })
        .collect();
    Ok(RenewOutcome {
        held,
        statements: 2,
    })
}

/// [`renew`] of the leases whose rows no other transaction holds locked: those rows are read
/// with `SKIP LOCKED` (their locks let go as the read ends: autocommit, no transaction left
/// open on the connection whatever fails), then extended, so the renewal waits for no lock
/// but one taken in between; the others are [`Renewal::Blocked`] while still ours.
async fn renew_unlocked(
    conn: &mut Conn,
    leases: &[(&[u8], &str)],
    tail: &str,
    params: Vec<Value>,
) -> mysql_async::Result<RenewOutcome> {
    let free: Vec<Vec<u8>> = conn
        .exec(
            format!(
                "SELECT lock_key FROM shardlock_lease WHERE lock_key IN {tail} \
                 FOR UPDATE SKIP LOCKED"
            ),
            Params::Positional(params.clone()),
        )
        .await?;
    let mut statements = 2;
    let is_free = |k: &[u8]| free.iter().any(|f| f.as_slice() == k);
    let unlocked: Vec<(&[u8], &str)> = (leases.iter())
        .filter(|(k, _)| is_free(k))
        .copied()
        .collect();
    if !unlocked.is_empty() {
        let (keys_sql, mut unlocked_params) = padded_in_list(unlocked.iter().map(|(k, _)| *k));
        let (owners_sql, owners) = padded_in_list(unlocked.iter().map(|(_, o)| o.as_bytes()));
        unlocked_params.extend(owners);
        conn.exec_drop(
            format!("{RENEW_HEAD}{keys_sql} AND owner IN {owners_sql}"),
            Params::Positional(unlocked_params),
        )
        .await?;
        statements += 1;
    }
    // A plain read: it waits for no row lock.
    let still: Vec<Vec<u8>> = conn
        .exec(format!("{HELD_HEAD}{tail}"), Params::Positional(params))
        .await?;
    let held = leases
        .iter()
        .map(
            |(k, _)| match (still.iter().any(|s| s.as_slice() == *k), is_free(k)) {
                (false, _) => Renewal::Gone,
                (true, true) => Renewal::Extended,
                (true, false) => Renewal::Blocked,
            },
        )
        .collect();
    Ok(RenewOutcome { held, statements })
}

/// A lease row as stored, with times relative to the shard's clock when it was read.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LeaseRow {
    /// The holder, or `None` when released.
    pub owner: Option<String>,
    /// The highest fence reserved by the latest grant (its first fence plus the fences set
    /// aside for in-memory hand-offs); the next grant through the shard gets a larger one.
    pub fence: u64,
    /// Lease length of the latest grant, ms.
    pub ttl_ms: u32,
    /// Milliseconds until the lease ends unless renewed (negative: ended that long ago).
    pub expires_in_ms: i64,
    /// Milliseconds since the latest grant.
    pub held_for_ms: i64,
    /// Milliseconds since someone else last failed to take the key, if ever since the grant.
    pub wanted_ms_ago: Option<i64>,
    /// What the holder stored with its lease ([`crate::MAX_DATA_BYTES`] at most), if anything.
    pub data: Option<Vec<u8>>,
}

impl LeaseRow {
    /// Whether a live lease holds the key.
    pub fn is_held(&self) -> bool {
        self.owner.is_some() && self.expires_in_ms > 0
    }
}

type InspectRow = (
    Option<Vec<u8>>,
    u64,
    u32,
    i64,
    i64,
    Option<i64>,
    Option<Vec<u8>>,
    Vec<u8>,
);

fn lease_row(
    (owner, fence, ttl_ms, expires_in_ms, held_for_ms, wanted_ms_ago, data, _key): InspectRow,
) -> LeaseRow {
    LeaseRow {
        owner: holding_owner(owner).map(|o| String::from_utf8_lossy(&o).into_owned()),
        fence,
        ttl_ms,
        expires_in_ms,
        held_for_ms,
        wanted_ms_ago,
        data,
    }
}

pub(crate) async fn inspect(conn: &mut Conn, key: &[u8]) -> mysql_async::Result<Option<LeaseRow>> {
    let row: Option<InspectRow> = conn.exec_first(INSPECT, (key,)).await?;
    Ok(row.map(lease_row))
}

pub(crate) async fn holder_trace(
    conn: &mut Conn,
    key: &[u8],
) -> mysql_async::Result<Option<String>> {
    let row: Option<Option<String>> = conn.exec_first(HOLDER_TRACE, (key,)).await?;
    Ok(row.flatten())
}

/// The server behind a connection: host name, port and server id as the server reports them
/// (so a proxy or another URL to the same server gives the same answer), and its schema.
const SERVER: &str = "SELECT CONCAT(@@hostname, ':', @@port, '#', @@server_id, '/', DATABASE())";
/// Whether the server is a Galera node (no row on a server without Galera, MySQL's included).
const WSREP_ON: &str = "SHOW VARIABLES LIKE 'wsrep_on'";
/// A Galera node's state: whether it is ready and in the primary component, and the cluster's
/// state UUID (the same on every node, kept across restarts in `grastate.dat`).
const GALERA_STATE: &str = "SHOW STATUS WHERE Variable_name IN \
     ('wsrep_ready', 'wsrep_cluster_status', 'wsrep_cluster_state_uuid')";
const SHARD_ID: &str = "SELECT value FROM shardlock_meta WHERE name = 'shard-id'";

/// Error number of a missing table (`shardlock_meta` before migration 5).
const NO_SUCH_TABLE: u16 = 1146;

/// A shard not yet migrated to version 5 has no `shardlock_meta`: it is then identified by its
/// server alone rather than failing, so two URLs to one such database are still recognised.
///
/// On a Galera node the server is the cluster (its state UUID) and the schema: every node names
/// itself, and the shard is one database whichever node answers.
pub(crate) async fn identity(conn: &mut Conn) -> mysql_async::Result<String> {
    let wsrep: Option<(String, String)> = conn.query_first(WSREP_ON).await?;
    let server: Option<String> = match wsrep {
        Some((_, on)) if on.eq_ignore_ascii_case("ON") => {
            let state: Vec<(String, String)> = conn.query(GALERA_STATE).await?;
            let value = |name: &str| {
                state
                    .iter()
                    .find(|(n, _)| n.eq_ignore_ascii_case(name))
                    .map(|(_, v)| v.as_str())
            };
            let uuid = value("wsrep_cluster_state_uuid").unwrap_or_default();
            // Before its first primary view a node reports no UUID, or zeros: it cannot tell
            // which cluster it is (and an identity is kept once read).
            let joined = value("wsrep_ready") == Some("ON")
                && value("wsrep_cluster_status") == Some("Primary")
                && uuid.bytes().any(|b| b != b'0' && b != b'-');
            if !joined {
                return Err(mysql_async::Error::Other(
                    "a Galera node outside the cluster's primary component cannot tell which \
                     cluster it is"
                        .into(),
                ));
            }
            let schema: Option<Option<String>> = conn.query_first("SELECT DATABASE()").await?;
            Some(format!(
                "galera:{uuid}/{}",
                schema.flatten().unwrap_or_default()
            ))
        }
        _ => conn.query_first(SERVER).await?,
    };
    let id: Option<String> = match conn.query_first(SHARD_ID).await {
        Ok(id) => id,
        Err(mysql_async::Error::Server(e)) if e.code == NO_SUCH_TABLE => None,
        Err(e) => return Err(e),
    };
    Ok(format!(
        "{} {}",
        id.unwrap_or_default(),
        server.unwrap_or_default()
    ))
}

pub(crate) async fn count_held(conn: &mut Conn) -> mysql_async::Result<u64> {
    Ok(conn.query_first(COUNT_HELD).await?.unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewal_chunks_stay_under_the_lease_count_and_the_bytes() {
        let sizes = |chunks: Vec<&[usize]>| chunks.iter().map(|c| c.len()).collect::<Vec<_>>();
        // Ordinary keys: only the count cuts.
        let short = vec![80; 10_000];
        assert_eq!(sizes(renew_chunks(&short, |b| *b)), [4096, 4096, 1808]);
        // Keys of 255 bytes and long owners: the bytes cut, every chunk under them.
        let long = vec![400; 4096];
        let chunks = renew_chunks(&long, |b| *b);
        assert!(chunks
            .iter()
            .all(|c| c.iter().sum::<usize>() <= MAX_RENEW_BYTES));
        assert_eq!(sizes(chunks), [1310, 1310, 1310, 166]);
        // Nothing lost, nothing twice, in order.
        let mixed: Vec<usize> = (0..9_000).map(|i| 1 + (i * 37) % 700).collect();
        let chunks = renew_chunks(&mixed, |b| *b);
        assert_eq!(chunks.concat(), mixed);
        assert!(chunks
            .iter()
            .all(|c| !c.is_empty() && c.len() <= MAX_RENEW_BATCH));
        assert!(renew_chunks(&[] as &[usize], |b| *b).is_empty());
        // One item past the bytes alone is a chunk of its own.
        assert_eq!(
            sizes(renew_chunks(&[10, MAX_RENEW_BYTES + 1, 10], |b| *b)),
            [1, 1, 1]
        );
    }

    /// A hand-off statement that runs after the releasing holder's row ended (held up behind
    /// a row lock, a slow shard) hands nothing over: the row stays ended.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_lease_that_ended_on_the_shard_is_not_handed_over() {
        let (_cluster, shard) = crate::testing::migrated_shard().await;
        let grant = |owner: &str, ttl_ms| GrantRequest {
            key: b"k".to_vec(),
            owner: owner.to_owned(),
            ttl_ms,
            fence_floor: 0,
            reserve: 0,
            trace: None,
        };
        let granted = shard.acquire(&grant("a", 1)).await.unwrap();
        assert!(matches!(granted, Attempt::Granted { .. }), "{granted:?}");
        // Past its 1 ms by the shard's clock.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let handed = shard.handoff("a", &grant("b", 60_000)).await.unwrap();
        assert_eq!(handed, HandoffOutcome::NotOurs);

        // A live lease is handed over.
        let granted = shard.acquire(&grant("c", 60_000)).await.unwrap();
        assert!(matches!(granted, Attempt::Granted { .. }), "{granted:?}");
        let handed = shard.handoff("c", &grant("d", 60_000)).await.unwrap();
        assert!(matches!(handed, HandoffOutcome::Granted(_)), "{handed:?}");
    }

    /// A grant that lands again for the owner that holds the row (a try whose reply was lost,
    /// after the retry that answered) never shortens the lease: it may have been extended,
    /// and its holder counts on that end. Alone or in a batch.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_grant_landing_again_never_shortens_its_owners_lease() {
        let (_cluster, shard) = crate::testing::migrated_shard().await;
        let grant = |key: &str| GrantRequest {
            key: key.as_bytes().to_vec(),
            owner: format!("owner-of-{key}"),
            ttl_ms: 60_000,
            fence_floor: 0,
            reserve: 0,
            trace: None,
        };
        let hour = std::time::Duration::from_secs(3600);
        for (key, batched) in [("alone", false), ("batched", true)] {
            let req = grant(key);
            let granted = shard.acquire(&req).await.unwrap();
            assert!(matches!(granted, Attempt::Granted { .. }), "{granted:?}");
            assert!(shard
                .extend(req.key.as_slice(), &req.owner, hour)
                .await
                .unwrap());
            // The first try, landing late.
            let again = match batched {
                false => shard.acquire(&req).await.unwrap(),
                true => {
                    let other = grant("other-key");
                    let mut answers = shard.acquire_batch(&[req.clone(), other]).await.unwrap();
                    answers.attempts.remove(0)
                }
            };
            assert!(matches!(again, Attempt::Granted { .. }), "{again:?}");
            let mut conn = shard.connection().await.unwrap();
            let left_s: Option<i64> = conn
                .raw()
                .exec_first(
                    "SELECT TIMESTAMPDIFF(SECOND, NOW(3), expires_at) FROM shardlock_lease \
                     WHERE lock_key = ?",
                    (req.key.as_slice(),),
                )
                .await
                .unwrap();
            let left_s = left_s.expect("the row");
            assert!(
                left_s > 3000,
                "a grant landing again ({key}) cut an extended lease to {left_s} s"
            );
        }
    }

    /// A released row whose end lies ahead (released before the shard's clock stepped back)
    /// is taken over with the new owner's own ttl, not that end: should the new holder die, its
    /// key would otherwise stay taken for as long as the step. Alone or in a batch.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_row_taken_over_ends_at_its_new_owners_ttl_whatever_its_released_end() {
        let (_cluster, shard) = crate::testing::migrated_shard().await;
        let grant = |key: &str, owner: &str| GrantRequest {
            key: key.as_bytes().to_vec(),
            owner: owner.to_owned(),
            ttl_ms: 60_000,
            fence_floor: 0,
            reserve: 0,
            trace: None,
        };
        for (key, batched) in [("alone", false), ("batched", true)] {
            let first = grant(key, "first");
            let granted = shard.acquire(&first).await.unwrap();
            assert!(matches!(granted, Attempt::Granted { .. }), "{granted:?}");
            shard.release(&first.key, &first.owner).await.unwrap();
            let mut conn = shard.connection().await.unwrap();
            // As a shard clock stepped back an hour after the release leaves it.
            conn.raw()
                .exec_drop(
                    "UPDATE shardlock_lease SET expires_at = NOW(3) + INTERVAL 1 HOUR \
                     WHERE lock_key = ?",
                    (key.as_bytes(),),
                )
                .await
                .unwrap();
            let next = grant(key, &format!("next-{key}"));
            let taken = match batched {
                false => shard.acquire(&next).await.unwrap(),
                true => {
                    let other = grant(&format!("other-{key}"), "other");
                    let mut answers = shard.acquire_batch(&[next.clone(), other]).await.unwrap();
                    answers.attempts.remove(0)
                }
            };
            assert!(matches!(taken, Attempt::Granted { .. }), "{taken:?}");
            let left_s: Option<i64> = conn
                .raw()
                .exec_first(
                    "SELECT TIMESTAMPDIFF(SECOND, NOW(3), expires_at) FROM shardlock_lease \
                     WHERE lock_key = ?",
                    (key.as_bytes(),),
                )
                .await
                .unwrap();
            let left_s = left_s.expect("the row");
            assert!(
                left_s <= 60,
                "a row taken over ({key}) ends in {left_s} s, past its new owner's 60 s ttl"
            );
        }
    }

    #[test]
    fn in_lists_are_padded_to_powers_of_two() {
        let keys: Vec<&[u8]> = vec![b"a", b"b", b"c"];
        let (sql, values) = padded_in_list(keys.iter().copied());
        assert_eq!(sql, "(?,?,?,?)");
        assert_eq!(values.len(), 4);
        assert_eq!(values[3], Value::from(&b"c"[..]));
    }

    #[test]
    fn row_sources_name_their_columns_once() {
        assert_eq!(
            rows_source(&["k", "f"], 2),
            "(SELECT ? AS k, ? AS f UNION ALL SELECT ?, ?) AS src"
        );
    }

    #[test]
    fn acquire_binds_as_many_parameters_as_it_has_placeholders() {
        assert_eq!(ACQUIRE.matches('?').count(), 19);
        assert_eq!(HANDOFF.matches('?').count(), 10);
    }
}
