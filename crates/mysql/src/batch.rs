//! Many acquires, or many releases, of one shard in one statement: group commit for locks.
//!
//! On a busy shard the server's cost per statement (parse, open, lock, commit) dominates what
//! a lock costs, not the rows it touches. When many tasks of one process lock different keys
//! of one shard at once, the facade's dispatcher hands their requests here together:
//!
//! - [`acquire_batch`]: one `INSERT ... SELECT ... ON DUPLICATE KEY UPDATE` writes every key's
//!   row with exactly the conditions of the single [`ACQUIRE`](crate::lease) statement (a
//!   free, released or expired row is granted; a live one is marked wanted), rows in key
//!   order; when the server reports that every row was new, its reply alone says each grant
//!   and fence, else one `SELECT` reads the batch's rows back. Owners are unique per attempt, so a
//!   row carrying the request's owner is this request's grant, and its first fence is the
//!   stored one minus the reserve. Two statements for any number of keys, no `RETURNING`
//!   (MySQL has none) and no user variables.
//! - [`release_batch`]: one owner-checked `UPDATE` for every key.
//!
//! Keys inside a statement are always written in one global order (the primary key's byte
//! order), so concurrent batches of several processes take their row locks in the same order;
//! a deadlock the server still reports (gap locks on fresh keys, say) undoes the whole
//! statement and is retried by the shard's runner, never surfaced.

use std::sync::atomic::{AtomicBool, Ordering};

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Params};

use crate::lease::{
    floor_row_missing, names_holder, padded_in_list, Attempt, GrantRequest, Released, HELD_MARK,
    LOCK_WAIT_TIMEOUT,
};
use crate::{floor_lock, floor_row, floor_row_is, joined_floor, now_us, released, tombstone};

/// Most keys in one batch: its JSON (about 150 KiB with 255-byte keys, as hex) stays far below
/// `max_allowed_packet`, and the read-back's key list far below the server's 65,535
/// placeholders.
pub const MAX_BATCH: usize = 256;

/// The write of a batch acquire: `INSERT INTO ... SELECT` from the batch's rows, passed as one
/// JSON array parameter and read through `JSON_TABLE` (`src`), in key order, with the single
/// acquire's conditions. Assignments run left to right, so `owner` comes first and the later
/// ones test whether it became `src.o`.
///
/// One table function rather than a `UNION ALL` of one `SELECT` per key: the server resolves
/// and optimizes a prepared statement's every `SELECT` again at each execution, so a union
/// costs per key about what a statement per key would; and one statement text means one
/// prepared statement per connection, whatever the batch sizes. Keys travel as hex (JSON
/// carries text, keys are bytes); hex keeps their order, so `ORDER BY` is the primary key's
/// byte order, the order in which every other multi-row statement here takes its row locks.
///
/// Two things let a batch of fresh keys skip its read-back (see [`all_inserted`]):
/// - `LAST_INSERT_ID(base)` hands the client the one value a fresh row's fence depends on
///   that the client does not know: the shard's clock and fence floor, `GREATEST(now, floor)`,
///   the same for every row of the statement (`NOW()` is fixed when a statement starts, and
///   the floor is one row read under the statement's lock). A fresh row's first fence is then
///   `max(base, src.f)`.
/// - Every duplicate row is changed, so the server counts it in the `Duplicates` it reports:
///   a grant changes the owner or raises the fence, and a held row's `wanted_at` moves even
///   when another batch marked it in the same millisecond (it then steps one millisecond
///   further). A row set to its own values would count in neither, and a batch of one fresh
///   key and one such held key would look like two fresh grants. So every branch of the
///   update below must change the row, whatever it finds; the test
///   `every_kind_of_row_is_read_back_even_when_the_clock_stands_still` pins that down.
const ACQUIRE_BATCH: &str = concat!(
    "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at, holder_trace, wanted_at) ",
    "SELECT UNHEX(src.k), src.o, GREATEST(LAST_INSERT_ID(GREATEST(", now_us!(), ", ", joined_floor!(), ")), src.f) + src.r, ",
    "src.t, NOW(3) + INTERVAL src.t * 1000 MICROSECOND, NOW(3), src.tr, NULL ",
    "FROM JSON_TABLE(?, '$[*]' COLUMNS (",
    "k VARCHAR(512) CHARACTER SET ascii PATH '$[0]', ",
    "o VARCHAR(191) CHARACTER SET utf8mb4 PATH '$[1]', ",
    "f BIGINT UNSIGNED PATH '$[2]', ",
    "r INT UNSIGNED PATH '$[3]', ",
    "t INT UNSIGNED PATH '$[4]', ",
    "tr VARCHAR(55) CHARACTER SET ascii PATH '$[5]'",
    ")) AS src JOIN ", floor_row!(), " ON ", floor_row_is!(), " ORDER BY src.k ", floor_lock!(), " ",
    "ON DUPLICATE KEY UPDATE ",
    "expires_at = IF(", released!("shardlock_lease.owner"), ", LEAST(shardlock_lease.expires_at, NOW(3)), shardlock_lease.expires_at), ",
    "owner = IF(", released!("shardlock_lease.owner"), " OR shardlock_lease.expires_at <= NOW(3), src.o, shardlock_lease.owner), ",
    "fence = IF(shardlock_lease.owner = src.o, GREATEST(shardlock_lease.fence + 1, ", now_us!(), ", ", joined_floor!(), ", src.f) + src.r, shardlock_lease.fence), ",
    "ttl_ms = IF(shardlock_lease.owner = src.o, src.t, shardlock_lease.ttl_ms), ",
    "expires_at = IF(shardlock_lease.owner = src.o, GREATEST(shardlock_lease.expires_at, NOW(3) + INTERVAL src.t * 1000 MICROSECOND), shardlock_lease.expires_at), ",
    "acquired_at = IF(shardlock_lease.owner = src.o, NOW(3), shardlock_lease.acquired_at), ",
    "holder_trace = IF(shardlock_lease.owner = src.o, src.tr, shardlock_lease.holder_trace), ",
    "wanted_at = IF(shardlock_lease.owner = src.o, NULL, ",
    "IF(shardlock_lease.wanted_at <=> NOW(3), NOW(3) + INTERVAL 1000 MICROSECOND, NOW(3)))"
);

/// The read-back of a batch acquire: each key's owner, stored fence and how long its holder
/// has had it (ms, shard clock).
const READ_HEAD: &str = "SELECT lock_key, owner, fence, \
     CAST(LEAST(GREATEST(TIMESTAMPDIFF(MICROSECOND, acquired_at, NOW(3)) DIV 1000, 0), 1000000000) AS UNSIGNED) \
     FROM shardlock_lease WHERE lock_key IN ";

/// A row as the read-back sees it: key, owner, stored fence, held for (ms).
type ReadRow = (Vec<u8>, Option<Vec<u8>>, u64, u64);

/// What a batch acquire found, and what it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchGrants {
    /// Each request's outcome, in the requests' order.
    pub attempts: Vec<Attempt>,
    /// Statements sent: 1 when the write's reply said every key was granted, else 2.
    pub statements: u64,
    /// Whether a try before the one that answered may have reached the server (its reply
    /// lost): see [`Attempt::Held`]'s `after_lost_try`. The answers may then follow a write
    /// that landed, or that is still on its way.
    pub after_lost_try: bool,
}

/// Tries to grant every request, in one statement when every key is fresh, else two: what
/// each found, in the requests' order
/// ([`Attempt::Granted`] with its first fence, [`Attempt::Held`], or for every request
/// [`Attempt::Locked`] when a row stayed locked by another transaction for the server's whole
/// lock wait: the write was undone, nothing was decided). Of this try alone: the caller
/// marks what a try before it may have done (`after_lost_try`).
///
/// Keys must be distinct (one process polls a key at a time) and at most [`MAX_BATCH`].
/// `wrote` is set once the write has committed rows: a failure of the read-back after it
/// leaves grants behind, whatever its error says.
pub(crate) async fn acquire_batch(
    conn: &mut Conn,
    reqs: &[&GrantRequest],
    wrote: &AtomicBool,
) -> mysql_async::Result<BatchGrants> {
    debug_assert!(!reqs.is_empty() && reqs.len() <= MAX_BATCH);
    let mut sorted: Vec<&GrantRequest> = reqs.to_vec();
    sorted.sort_by(|a, b| a.key.cmp(&b.key));
    let rows: Vec<serde_json::Value> = sorted
        .iter()
        .map(|req| {
            serde_json::json!([
                hex(&req.key),
                req.owner,
                req.fence_floor,
                req.reserve,
                req.ttl_ms,
                req.trace
            ])
        })
        .collect();
    let batch = serde_json::Value::Array(rows).to_string();
    // As for the single acquire, 1205 is an answer: the statement was undone as a whole.
    match conn.exec_drop(ACQUIRE_BATCH, (batch,)).await {
        Err(mysql_async::Error::Server(e)) if e.code == LOCK_WAIT_TIMEOUT => {
            return Ok(BatchGrants {
                attempts: vec![Attempt::Locked; reqs.len()],
                statements: 1,
                after_lost_try: false,
            })
        }
        result => result?,
    }
    floor_row_missing(conn)?;
    wrote.store(true, Ordering::Relaxed);
    if let Some(base) = all_inserted(conn, reqs.len()) {
        return Ok(BatchGrants {
            attempts: reqs
                .iter()
                .map(|req| Attempt::Granted {
                    fence: base.max(req.fence_floor),
                    after_lost_try: false,
                })
                .collect(),
            statements: 1,
            after_lost_try: false,
        });
    }
    let (list, keys) = padded_in_list(sorted.iter().map(|r| r.key.as_slice()));
    let rows: Vec<ReadRow> = conn
        .exec(format!("{READ_HEAD}{list}"), Params::Positional(keys))
        .await?;
    let attempts = reqs
        .iter()
        .map(|req| {
            let row = rows.iter().find(|(key, ..)| *key == req.key);
            match row {
                Some((_, Some(owner), fence, _)) if owner.as_slice() == req.owner.as_bytes() => {
                    Attempt::Granted {
                        fence: fence.saturating_sub(u64::from(req.reserve)),
                        after_lost_try: false,
                    }
                }
                Some((_, _, _, held_for_ms)) => Attempt::Held {
                    held_for_ms: *held_for_ms,
                    after_lost_try: false,
                },
                // Written a moment ago, gone now: never a grant this call cannot prove.
                None => Attempt::Held {
                    held_for_ms: 0,
                    after_lost_try: false,
                },
            }
        })
        .collect();
    Ok(BatchGrants {
        attempts,
        statements: 2,
        after_lost_try: false,
    })
}

/// When the batch write inserted a new row for every one of its `n` keys: the base of their
/// fences (see [`ACQUIRE_BATCH`]). The server says so in its reply: `n` rows affected, no
/// duplicates and no warnings (a value `JSON_TABLE` had to cut would be stored other than
/// sent); a reply it cannot read that way means a read-back.
fn all_inserted(conn: &Conn, n: usize) -> Option<u64> {
    let info = conn.info();
    let mut words = info.split_whitespace();
    let mut count = |label: &str| -> Option<usize> {
        (words.next()? == label).then_some(())?;
        words.next()?.parse().ok()
    };
    let counts = (
        count("Records:")?,
        count("Duplicates:")?,
        count("Warnings:")?,
    );
    let base = conn
        .last_insert_id()
        .filter(|&base| base > 0 && base < HELD_MARK)?;
    (counts == (n, 0, 0) && conn.affected_rows() == n as u64).then_some(base)
}

/// The owner-checked release of many keys. Owners are unique per grant and each is written to
/// one key only, so `lock_key IN (...) AND owner IN (...)` matches exactly the (key, owner)
/// pairs while the server uses the primary key.
const RELEASE_HEAD: &str = concat!(
    "UPDATE shardlock_lease SET owner = ",
    tombstone!(),
    ", expires_at = NOW(3), wanted_at = NULL, ",
    // The statement's time (ms), through `LAST_INSERT_ID`, when it frees a row.
    "fence = fence + 0 * LAST_INSERT_ID(",
    released_ms!(),
    ") WHERE lock_key IN "
);

/// The shard's time in milliseconds, as [`OWNERS_HEAD`] reads a grant's.
macro_rules! released_ms {
    () => {
        "CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS UNSIGNED)"
    };
}
use released_ms;

/// After a batch release that did not release every key: who holds each key now, and since
/// when (ms, the shard's time).
const OWNERS_HEAD: &str = "SELECT lock_key, owner, CAST(UNIX_TIMESTAMP(acquired_at) * 1000 \
     AS UNSIGNED) FROM shardlock_lease WHERE lock_key IN ";

/// A row of [`OWNERS_HEAD`].
type OwnerRow = (Vec<u8>, Option<Vec<u8>>, Option<u64>);

/// Releases every (key, owner) still held, in one statement; what each found, in the given
/// order.
///
/// When every key was released (the statement matched one row per key) the answers are exact.
/// Otherwise some lease had been lost before (it expired and was taken, force-released, or
/// deleted by the cleaner): one more read tells what each row shows now. A row showing the
/// owner's own tombstone was freed by that owner ([`Released::Freed`]). A row the statement
/// freed may show another state by the time it is read, though (taken by a waiter at once, and
/// perhaps released again), so the statement cannot always say which rows are its own: when
/// every row it freed shows its own tombstone, a key another owner holds now counts as
/// [`Released::Taken`], and another owner's tombstone (the key was taken and released since)
/// as [`Released::Free`]; a row with no owner (`NULL`) was freed by a force-release (every
/// release leaves a tombstone) and is [`Released::Revoked`] whatever else; otherwise
/// a key another owner holds counts as [`Released::TakenSince`] (the caller tells by whether
/// its lease could have ended), and a free row as freed only when every row that does not show
/// its own tombstone must be one the statement freed (else as [`Released::Free`]: a lease lost
/// before, a force-release say, is never answered as released). A key another owner was
/// granted in an earlier millisecond (by the shard's clock) than the statement's is
/// [`Released::Taken`] whatever else: it was held before the statement (or granted by a
/// statement that began before this one and waited behind another row's lock, whose time is
/// its start: the lease is then answered as lost though it was released, the side a release
/// errs on).
pub(crate) async fn release_batch(
    conn: &mut Conn,
    leases: &[(&[u8], &str)],
) -> mysql_async::Result<Vec<Released>> {
    debug_assert!(!leases.is_empty() && leases.len() <= MAX_BATCH);
    let mut sorted: Vec<&(&[u8], &str)> = leases.iter().collect();
    sorted.sort();
    let (keys_sql, mut params) = padded_in_list(sorted.iter().map(|(k, _)| *k));
    let (owners_sql, owners) = padded_in_list(sorted.iter().map(|(_, o)| o.as_bytes()));
    params.extend(owners);
    conn.exec_drop(
        format!("{RELEASE_HEAD}{keys_sql} AND owner IN {owners_sql}"),
        Params::Positional(params),
    )
    .await?;
    let matched = conn.affected_rows() as usize;
    if matched == leases.len() {
        return Ok(vec![Released::Freed; leases.len()]);
    }
    let released_ms = (matched > 0).then(|| conn.last_insert_id()).flatten();
    let (list, keys) = padded_in_list(sorted.iter().map(|(k, _)| *k));
    let rows: Vec<OwnerRow> = conn
        .exec(format!("{OWNERS_HEAD}{list}"), Params::Positional(keys))
        .await?;
    Ok(released_rows(leases, matched, released_ms, &rows))
}

/// What each of `leases` found, from how many rows the release `matched` (at `released_ms`,
/// the shard's time, when it freed any) and what the rows show now (`rows`, by key), as
/// [`release_batch`] tells it. A row another owner was granted in an earlier millisecond than
/// the statement's was held before it: not one the statement freed.
fn released_rows(
    leases: &[(&[u8], &str)],
    matched: usize,
    released_ms: Option<u64>,
    rows: &[OwnerRow],
) -> Vec<Released> {
    let held_before =
        |granted: Option<u64>| matches!((granted, released_ms), (Some(g), Some(r)) if g < r);
    // What each key's row shows, a holder granted before the statement left out of the rows
    // it may have freed: answered `Taken`.
    let mut before = vec![false; leases.len()];
    let now: Vec<Option<&Option<Vec<u8>>>> = leases
        .iter()
        .zip(&mut before)
        .map(|((key, _), before)| {
            let row = rows.iter().find(|(k, ..)| k.as_slice() == *key)?;
            *before = names_holder(&row.1) && held_before(row.2);
            Some(&row.1)
        })
        .collect();
    let own = |owner: &Option<Vec<u8>>, of: &str| {
        owner
            .as_deref()
            .is_some_and(|o| crate::lease::is_own_tombstone(o, of))
    };
    let ours = leases
        .iter()
        .zip(&now)
        .filter(|((_, of), row)| row.is_some_and(|o| own(o, of)))
        .count();
    // Rows this statement freed that show something else by now (none, or fewer, when some
    // own tombstone is an earlier release's).
    let changed = matched.saturating_sub(ours);
    // Every row showing something else is one of those: a free row among them is this
    // statement's doing (freed, taken and released since).
    // (A holder read as granted before is counted here all the same: a grant statement that
    // began before this one and waited (behind another row's lock) takes its time from its
    // start, and may hold a row this one freed. Misread so, it makes a release answer "lost",
    // never a free row another's release left answer "released".)
    let others = now
        .iter()
        .zip(leases)
        .filter(|(row, (_, of))| row.is_some_and(|o| !own(o, of)))
        .count();
    let all_freed_here = changed >= others;
    leases
        .iter()
        .zip(now)
        .zip(before)
        .map(|(((_, of), row), before)| match row {
            Some(o) if own(o, of) => Released::Freed,
            _ if before => Released::Taken,
            // Another owner's: it held the row before, unless this statement freed it and the
            // row was taken since.
            Some(o) if names_holder(o) && changed == 0 => Released::Taken,
            Some(o) if names_holder(o) => Released::TakenSince,
            // No owner at all: freed by force (every release leaves a tombstone), whoever held
            // it then.
            Some(None) => Released::Revoked,
            // Another owner's tombstone: not this statement's doing when every row it freed
            // shows its own tombstone.
            Some(_) if changed == 0 || !all_freed_here => Released::Free,
            Some(_) => Released::Freed,
            None => Released::Free,
        })
        .collect()
}

/// `bytes` as uppercase hex, the form `UNHEX` reads.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0F)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mysql_async::prelude::Queryable;
    use shardlock_core::Config;
    use shardlock_testkit::Cluster;

    use super::*;
    use crate::testing::migrated_shard;
    use crate::Shard;

    fn request(key: &str, owner: &str, fence_floor: u64) -> GrantRequest {
        GrantRequest {
            key: key.as_bytes().to_vec(),
            owner: owner.to_owned(),
            ttl_ms: 60_000,
            fence_floor,
            reserve: 2,
            trace: None,
        }
    }

    /// A batch release that freed more rows than show its tombstone cannot tell which: a row
    /// another owner holds now may be one it freed, taken since, and is answered so; with
    /// every freed row accounted for, it was held by that owner before.
    #[test]
    fn a_row_taken_after_a_batch_freed_rows_it_cannot_tell_apart_may_be_its_own() {
        let leases: [(&[u8], &str); 2] = [(b"k1", "a1"), (b"k2", "a2")];
        let row = |key: &[u8], owner: &str, granted: u64| {
            (key.to_vec(), Some(owner.as_bytes().to_vec()), Some(granted))
        };
        // k1 freed by the statement (at 100 ms) and taken by b since; k2 had been taken by c
        // before, in the same millisecond as the statement: not told apart.
        let taken_since = [row(b"k1", "b", 100), row(b"k2", "c", 100)];
        assert_eq!(
            released_rows(&leases, 1, Some(100), &taken_since),
            [Released::TakenSince, Released::TakenSince]
        );
        // k1 shows its own tombstone: k2's holder held it before the statement.
        let accounted = [row(b"k1", ":1", 50), row(b"k2", "c", 100)];
        assert_eq!(
            released_rows(&leases, 1, Some(100), &accounted),
            [Released::Freed, Released::Taken]
        );
        // k2 granted to c in an earlier millisecond than the statement's: c held it before,
        // and k1 is the row the statement freed, taken since.
        let granted_before = [row(b"k1", "b", 100), row(b"k2", "c", 99)];
        assert_eq!(
            released_rows(&leases, 1, Some(100), &granted_before),
            [Released::TakenSince, Released::Taken]
        );
        // k1 freed by the statement and granted to b by a statement that began before it (and
        // waited), k2 force-released before: k2 is not answered as released.
        let waited = [row(b"k1", "b", 90), (b"k2".to_vec(), None, Some(50))];
        assert_eq!(
            released_rows(&leases, 1, Some(100), &waited),
            [Released::Taken, Released::Revoked]
        );
    }

    /// A free row that the statement may not have freed is not answered as released unless
    /// every row that does not show the batch's tombstone must be one the statement freed;
    /// one a force-release left `NULL` never is (every release leaves a tombstone).
    #[test]
    fn a_free_row_is_answered_released_only_when_it_must_be_the_statements() {
        let leases: [(&[u8], &str); 2] = [(b"k1", "a1"), (b"k2", "a2")];
        let row = |key: &[u8], owner: Option<&str>| {
            (
                key.to_vec(),
                owner.map(|o| o.as_bytes().to_vec()),
                Some(100),
            )
        };
        // k1 force-released before (NULL); the statement freed k2, taken by b since: one row
        // freed, two rows showing something else.
        let forced = [row(b"k1", None), row(b"k2", Some("b"))];
        assert_eq!(
            released_rows(&leases, 1, Some(100), &forced),
            [Released::Revoked, Released::TakenSince]
        );
        // k1 freed, taken and released by another owner since (its tombstone); k2 taken
        // since: both rows the statement freed.
        let another = [row(b"k1", Some(":y")), row(b"k2", Some("b"))];
        assert_eq!(
            released_rows(&leases, 2, Some(100), &another),
            [Released::Freed, Released::TakenSince]
        );
        // Both freed by the statement, k1 taken and released since, k2 taken since.
        let both = [row(b"k1", Some(":x")), row(b"k2", Some("b"))];
        assert_eq!(
            released_rows(&leases, 2, Some(100), &both),
            [Released::Freed, Released::TakenSince]
        );
    }

    /// Connections the server has accepted so far.
    async fn connections(raw: &mut Conn) -> u64 {
        let row: Option<(String, u64)> = raw
            .query_first("SHOW GLOBAL STATUS LIKE 'Connections'")
            .await
            .unwrap();
        row.unwrap().1
    }

    /// The owner and fence stored for `key`.
    async fn stored(raw: &mut Conn, key: &str) -> (Option<Vec<u8>>, u64) {
        raw.exec_first(
            "SELECT owner, fence FROM shardlock_lease WHERE lock_key = ?",
            (key,),
        )
        .await
        .unwrap()
        .unwrap()
    }

    /// Every release leaves its releaser's tombstone: a hand-off that released the row for
    /// everyone (another process wanted it) and a release kept past its hold too, so that a
    /// release retried after a lost reply tells its own from a force-release's `NULL` (they
    /// left `NULL`, and such a retry answered a correct release `LockLost`).
    #[tokio::test(flavor = "multi_thread")]
    async fn every_release_leaves_its_releasers_tombstone() {
        let (cluster, shard) = migrated_shard().await;
        let mut raw = cluster.shard(0).connect().await.unwrap();
        for key in ["wanted", "kept"] {
            let grant = shard.acquire(&request(key, &format!("me:{key}"), 0)).await;
            assert!(matches!(grant.unwrap(), Attempt::Granted { .. }), "{key}");
        }
        raw.query_drop("UPDATE shardlock_lease SET wanted_at = NOW(3) WHERE lock_key = 'wanted'")
            .await
            .unwrap();
        shard
            .handoff("me:wanted", &request("wanted", "me:next", 0))
            .await
            .unwrap();
        assert_eq!(
            stored(&mut raw, "wanted").await.0.as_deref(),
            Some(&b":e:wanted"[..])
        );
        // Kept at least 1 µs after its grant: long past.
        let at_least = Some(std::time::Duration::from_micros(1));
        let answer = shard.release_after(b"kept", "me:kept", at_least).await;
        assert!(answer.unwrap().is_released());
        assert_eq!(
            stored(&mut raw, "kept").await.0.as_deref(),
            Some(&b":e:kept"[..])
        );
        let mut session = shard.connection().await.unwrap();
        for key in ["wanted", "kept"] {
            let owner = format!("me:{key}");
            let again = crate::lease::release(session.raw(), key.as_bytes(), &owner, at_least);
            assert_eq!(again.await.unwrap(), Released::Freed, "{key}");
        }
    }

    /// A release, alone or in a batch, turns the owner into a tombstone of the same length (so
    /// the server can update the row in place), and every reader takes the row as released,
    /// even when the shard's clock steps back behind the release (its `expires_at` is then in
    /// the future again): nothing reads it as held, the cleaner takes it for a released row,
    /// no owner-checked statement of the old owner matches it, and a single or batch acquire
    /// takes it.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_released_row_keeps_its_size_and_reads_as_released_everywhere() {
        let (cluster, shard) = migrated_shard().await;
        let mut raw = cluster.shard(0).connect().await.unwrap();
        let keys = ["alone", "batch:a", "batch:b", "cleaned"];
        for key in keys {
            let mut req = request(key, &format!("me:{key}"), 0);
            // Traced, so that a holder's trace left on a released row would show.
            req.trace = Some(format!("00-{:032x}-{:016x}-01", 1, 1));
            assert!(matches!(
                shard.acquire(&req).await.unwrap(),
                Attempt::Granted { .. }
            ));
            assert_eq!(shard.holder_trace(key.as_bytes()).await.unwrap(), req.trace);
        }
        let owner = |key: &str| format!("me:{key}");
        assert!(shard
            .release(b"alone", &owner("alone"))
            .await
            .unwrap()
            .is_released());
        let batch: Vec<(Vec<u8>, String)> = ["batch:a", "batch:b", "cleaned"]
            .iter()
            .map(|k| (k.as_bytes().to_vec(), owner(k)))
            .collect();
        let answers = shard.release_batch(&batch).await.unwrap();
        assert!(answers.iter().all(|a| a.is_released()), "{answers:?}");
        for key in keys {
            let (stored_owner, _) = stored(&mut raw, key).await;
            let stored_owner = stored_owner.expect("a tombstone, not NULL");
            assert_eq!(stored_owner.len(), owner(key).len(), "{key}: same length");
            assert_eq!(stored_owner[0], b':', "{key}");
            assert_eq!(&stored_owner[1..], &owner(key).as_bytes()[1..], "{key}");
        }
        // The cleaner's scan, before the clock steps back: released rows, without an owner.
        // (The row is first aged past the scan's conditions: ended a second ago, its fence a
        // second below the clock.)
        raw.query_drop(
            "UPDATE shardlock_lease SET expires_at = NOW(3) - INTERVAL 1 SECOND, \
             fence = fence - 1000000 WHERE lock_key = 'cleaned'",
        )
        .await
        .unwrap();
        let scanned = shard
            .cleanup_candidates(b"", Duration::ZERO, Duration::ZERO, 100)
            .await
            .unwrap();
        let cleaned = scanned
            .candidates
            .iter()
            .find(|c| c.key == b"cleaned")
            .unwrap();
        assert_eq!(cleaned.owner, None, "read as a released row");
        let deleted = shard
            .delete_ended(
                &[b"cleaned".to_vec()],
                None,
                Duration::ZERO,
                Duration::ZERO,
                u64::MAX,
            )
            .await
            .unwrap();
        assert_eq!(deleted.rows, 1, "deleted as a released row");
        // The shard's clock steps back an hour behind the releases.
        raw.query_drop("UPDATE shardlock_lease SET expires_at = NOW(3) + INTERVAL 1 HOUR")
            .await
            .unwrap();
        for key in ["alone", "batch:a", "batch:b"] {
            let row = shard.inspect(key.as_bytes()).await.unwrap().unwrap();
            assert_eq!(row.owner, None, "{key}: inspect");
            assert_eq!(shard.holder_trace(key.as_bytes()).await.unwrap(), None);
            let mine = owner(key);
            assert!(!shard
                .extend(key.as_bytes(), &mine, Duration::from_secs(9))
                .await
                .unwrap());
            assert!(!shard.set_data(key.as_bytes(), &mine, b"x").await.unwrap());
            let renewed = shard
                .renew(
                    &[(key.as_bytes(), mine.as_str())],
                    Duration::from_secs(5),
                    false,
                )
                .await
                .unwrap();
            assert_eq!(
                renewed.held,
                vec![crate::Renewal::Gone],
                "{key}: renewed by its old owner"
            );
        }
        assert_eq!(shard.count_held().await.unwrap(), 0);
        let live = shard
            .live_owners(vec![b"alone".to_vec(), b"batch:a".to_vec()])
            .await
            .unwrap();
        assert!(live.is_empty(), "{live:?}");
        let fences = shard.fences_after(b"", 100).await.unwrap();
        assert!(fences.iter().all(|f| f.live_owner.is_none()), "{fences:?}");
        let held_only = crate::lease::ListFilter {
            prefix: Vec::new(),
            held_only: true,
            limit: 100,
        };
        assert!(shard.list(&held_only).await.unwrap().is_empty());
        // A release of the old owner again finds its own tombstone: freed by it (what it
        // answers after a lost reply), alone and in a batch beside a lease it does free.
        let mut session = shard.connection().await.unwrap();
        let conn = session.raw();
        let again = crate::lease::release(conn, b"alone", &owner("alone"), None).await;
        assert_eq!(again.unwrap(), Released::Freed);
        let other = request("other", "me:other", 0);
        assert!(matches!(
            shard.acquire(&other).await.unwrap(),
            Attempt::Granted { .. }
        ));
        let pair: [(&[u8], &str); 2] = [(b"batch:a", "me:batch:a"), (b"other", "me:other")];
        let found = release_batch(conn, &pair).await.unwrap();
        assert_eq!(found, vec![Released::Freed, Released::Freed]);
        // A lease force-released before, beside one the batch frees: the lost one is told so.
        for key in ["forced:a", "forced:b"] {
            let req = request(key, &format!("me:{key}"), 0);
            assert!(matches!(
                shard.acquire(&req).await.unwrap(),
                Attempt::Granted { .. }
            ));
        }
        assert!(shard
            .force_release(b"forced:b", "me:forced:b", 0)
            .await
            .unwrap()
            .is_some());
        let pair: [(&[u8], &str); 2] = [(b"forced:a", "me:forced:a"), (b"forced:b", "me:forced:b")];
        let found = release_batch(conn, &pair).await.unwrap();
        assert_eq!(found, vec![Released::Freed, Released::Revoked]);
        // Force-released, then taken and released by another owner: its tombstone is not the
        // lost lease's, and the lease is told so as well.
        for key in ["forced:c", "forced:d"] {
            let req = request(key, &format!("me:{key}"), 0);
            assert!(matches!(
                shard.acquire(&req).await.unwrap(),
                Attempt::Granted { .. }
            ));
        }
        assert!(shard
            .force_release(b"forced:d", "me:forced:d", 0)
            .await
            .unwrap()
            .is_some());
        let since = request("forced:d", "you:forced:d", 0);
        assert!(matches!(
            shard.acquire(&since).await.unwrap(),
            Attempt::Granted { .. }
        ));
        assert!(shard
            .release(b"forced:d", "you:forced:d")
            .await
            .unwrap()
            .is_released());
        let pair: [(&[u8], &str); 2] = [(b"forced:c", "me:forced:c"), (b"forced:d", "me:forced:d")];
        let found = release_batch(conn, &pair).await.unwrap();
        assert_eq!(found, vec![Released::Freed, Released::Free]);
        // Both kinds of acquire take such a row.
        let single = request("alone", "you:1", 0);
        assert!(matches!(
            shard.acquire(&single).await.unwrap(),
            Attempt::Granted { .. }
        ));
        let reqs = [
            request("batch:a", "you:2", 0),
            request("batch:b", "you:3", 0),
        ];
        let grants = shard.acquire_batch(&reqs).await.unwrap();
        assert!(
            grants
                .attempts
                .iter()
                .all(|a| matches!(a, Attempt::Granted { .. })),
            "{grants:?}"
        );
        assert_eq!(shard.count_held().await.unwrap(), 3);
    }

    /// A batch answers from the write's reply alone only when every row was new, even on a
    /// shard whose clock stands still (here: the session's, fixed with `SET timestamp`): a
    /// batch of a fresh key and a key of each other kind is read back, and answered right.
    /// The held key is marked wanted by three batches in the very same millisecond: were its
    /// row left as it was, the server would count it neither as a duplicate nor apart from a
    /// new row, and the held key would be answered as granted.
    #[tokio::test(flavor = "multi_thread")]
    async fn every_kind_of_row_is_read_back_even_when_the_clock_stands_still() {
        let (cluster, shard) = migrated_shard().await;
        // The session the shard's own statements use, with the options they use.
        let mut session = shard.connection().await.unwrap();
        let conn = session.raw();
        conn.query_drop("SET timestamp = ROUND(UNIX_TIMESTAMP(NOW(6)), 3)")
            .await
            .unwrap();
        let mut raw = cluster.shard(0).connect().await.unwrap();
        // Rows of every kind, written by someone else.
        for key in ["held", "expired", "released"] {
            let first = acquire_batch(conn, &[&request(key, "other", 0)], &AtomicBool::new(false))
                .await
                .unwrap();
            let [Attempt::Granted { fence, .. }] = first.attempts[..] else {
                panic!("a fresh key: {first:?}");
            };
            assert_eq!(first.statements, 1, "a fresh key needs no read-back");
            assert_eq!(
                stored(&mut raw, key).await,
                (Some(b"other".to_vec()), fence + 2)
            );
        }
        raw.query_drop(
            "UPDATE shardlock_lease SET expires_at = NOW(3) - INTERVAL 1 SECOND \
             WHERE lock_key = 'expired'",
        )
        .await
        .unwrap();
        raw.query_drop("UPDATE shardlock_lease SET owner = NULL WHERE lock_key = 'released'")
            .await
            .unwrap();

        let cases = [
            ("held", "mine:0", false),
            ("held", "mine:1", false),
            ("held", "mine:2", false),
            ("expired", "mine:3", true),
            ("released", "mine:4", true),
            // The same request again, as after a lost reply: its own row.
            ("released", "mine:4", true),
        ];
        for (i, (key, owner, granted)) in cases.into_iter().enumerate() {
            let fresh_key = format!("fresh:{i}");
            let fresh = request(&fresh_key, owner, 0);
            let batch = acquire_batch(
                conn,
                &[&fresh, &request(key, owner, 0)],
                &AtomicBool::new(false),
            )
            .await
            .unwrap();
            assert_eq!(
                batch.statements, 2,
                "case {i}: a row that existed is read back"
            );
            match batch.attempts[1] {
                Attempt::Granted { fence, .. } if granted => {
                    let mine = Some(owner.as_bytes().to_vec());
                    assert_eq!(stored(&mut raw, key).await, (mine, fence + 2), "case {i}");
                }
                Attempt::Held { .. } if !granted => {}
                other => panic!("case {i}: {key} was answered {other:?}"),
            }
            let Attempt::Granted { fence, .. } = batch.attempts[0] else {
                panic!("case {i}: the fresh key was answered {batch:?}");
            };
            let mine = Some(owner.as_bytes().to_vec());
            assert_eq!(stored(&mut raw, &fresh_key).await, (mine, fence + 2));
        }
    }

    /// Fresh keys on a shard whose fence floor is above its clock (keys moved here, rows with
    /// high fences deleted by the cleaner), one also asking for a floor of its own above
    /// that: each first fence is answered from the reply alone, as the server stored it.
    #[tokio::test(flavor = "multi_thread")]
    async fn fresh_keys_answered_from_the_reply_carry_the_fences_stored() {
        let (cluster, shard) = migrated_shard().await;
        let floor = shard.clock_us().await.unwrap() + 1_000_000_000;
        shard.raise_shard_floor(floor).await.unwrap();
        let mut session = shard.connection().await.unwrap();
        let mut raw = cluster.shard(0).connect().await.unwrap();
        let reqs = [
            request("moved:0", "mine:0", floor + 5_000_000_000),
            request("moved:1", "mine:1", 0),
            request("moved:2", "mine:2", 0),
        ];
        let batch = acquire_batch(
            session.raw(),
            &reqs.iter().collect::<Vec<_>>(),
            &AtomicBool::new(false),
        )
        .await
        .unwrap();
        assert_eq!(batch.statements, 1, "every key was fresh");
        for (req, attempt) in reqs.iter().zip(&batch.attempts) {
            let Attempt::Granted { fence, .. } = attempt else {
                panic!("{attempt:?}");
            };
            assert!(*fence > floor, "{fence} after the shard's floor {floor}");
            assert!(
                *fence >= req.fence_floor,
                "{fence} below {}",
                req.fence_floor
            );
            let key = String::from_utf8(req.key.clone()).unwrap();
            let (_, stored_fence) = stored(&mut raw, &key).await;
            assert_eq!(stored_fence, fence + 2, "{key}");
        }
    }

    /// A shard whose fence floor row is gone (removed by hand) answers every acquire, alone
    /// or in a batch, with an error that says so, never with a held key; `migrate` makes the
    /// row again.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_missing_fence_floor_is_an_error_until_migrate() {
        let (cluster, shard) = migrated_shard().await;
        let mut raw = cluster.shard(0).connect().await.unwrap();
        raw.query_drop("DELETE FROM shardlock_meta WHERE name = 'fence-floor'")
            .await
            .unwrap();
        // The shard's pool holds a connection it has used.
        shard.clock_us().await.unwrap();
        let before = connections(&mut raw).await;
        let alone = shard.acquire(&request("alone", "mine:0", 0)).await;
        let err = alone.expect_err("no floor, no grant");
        let said = shardlock_core::Report(&err).to_string();
        assert!(said.contains("fence floor"), "{said}");
        assert!(!err.maybe_applied, "the reply said nothing was written");
        let reqs = [request("a", "mine:1", 0), request("b", "mine:2", 0)];
        let batch = shard.acquire_batch(&reqs).await;
        let err = batch.expect_err("no floor, no grant");
        let said = shardlock_core::Report(&err).to_string();
        assert!(said.contains("fence floor"), "{said}");
        assert!(!err.maybe_applied, "the reply said nothing was written");
        let rows: Option<u64> = raw
            .query_first("SELECT COUNT(*) FROM shardlock_lease")
            .await
            .unwrap();
        assert_eq!(rows, Some(0), "nothing was written");
        // The refusals were replies read in full: the shard's connection was kept, not
        // closed and opened again for each.
        assert_eq!(
            connections(&mut raw).await,
            before,
            "a connection was opened again"
        );

        let clock = shard.clock_us().await.unwrap();
        shard.migrate().await.unwrap();
        let floor: Option<u64> = raw
            .query_first(
                "SELECT CAST(value AS UNSIGNED) FROM shardlock_meta WHERE name = 'fence-floor'",
            )
            .await
            .unwrap();
        assert!(
            floor >= Some(clock),
            "made again at the clock: {floor:?} < {clock}"
        );
        let grant = shard.acquire(&request("alone", "mine:3", 0)).await.unwrap();
        assert!(matches!(grant, Attempt::Granted { .. }), "{grant:?}");
        let batch = shard.acquire_batch(&reqs).await.unwrap();
        assert!(
            batch
                .attempts
                .iter()
                .all(|a| matches!(a, Attempt::Granted { .. })),
            "{batch:?}"
        );
    }

    /// An acquire, alone or in a batch, share-locks the fence floor's row until it commits:
    /// a raise of the floor waits for it (here, until its lock wait ends), so no acquire
    /// that read the old floor commits after the raise. Also on a server whose default
    /// isolation is `READ COMMITTED`, where `INSERT ... SELECT` reads its source without
    /// locks unless the statement asks for them.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_raise_of_the_fence_floor_waits_for_acquires_in_flight() {
        let cluster = Cluster::start(1).await.unwrap();
        let mut admin = cluster.shard(0).connect().await.unwrap();
        admin
            .query_drop("SET GLOBAL TRANSACTION ISOLATION LEVEL READ COMMITTED")
            .await
            .unwrap();
        let config = Config::from_yaml_str(&cluster.config_yaml("")).unwrap();
        let shard = Shard::new(&config.shards[0], 0).unwrap();
        shard.migrate().await.unwrap();
        let mut raiser = cluster.shard(0).connect().await.unwrap();
        raiser
            .query_drop("SET SESSION innodb_lock_wait_timeout = 1")
            .await
            .unwrap();
        for batch in [false, true] {
            let mut session = shard.connection().await.unwrap();
            let conn = session.raw();
            conn.query_drop("BEGIN").await.unwrap();
            let req = request(&format!("in-flight:{batch}"), "mine", 0);
            if batch {
                let other = request(&format!("in-flight:{batch}:2"), "mine:2", 0);
                acquire_batch(conn, &[&req, &other], &AtomicBool::new(false))
                    .await
                    .unwrap();
            } else {
                crate::lease::acquire(conn, &req).await.unwrap();
            }
            let raised = crate::lease::raise_shard_floor(&mut raiser, 1).await;
            match raised {
                Err(mysql_async::Error::Server(e)) if e.code == LOCK_WAIT_TIMEOUT => {}
                other => panic!("batch {batch}: the raise did not wait: {other:?}"),
            }
            conn.query_drop("ROLLBACK").await.unwrap();
        }
        crate::lease::raise_shard_floor(&mut raiser, 1)
            .await
            .unwrap();
    }

    /// What a release answers, alone and in a batch: released for its own row, and for one it
    /// freed before (its tombstone says so); not released for a row another owner holds, nor
    /// for one deleted before (cleaned) or freed by force.
    #[tokio::test(flavor = "multi_thread")]
    async fn releases_answer_for_their_own_rows() {
        let (cluster, shard) = migrated_shard().await;
        let mut raw = cluster.shard(0).connect().await.unwrap();
        // `own` is held by its owner, `free` was released, `taken` is another owner's, `gone`
        // was deleted.
        let cluster = &cluster;
        let set_up = |run: &'static str| {
            let keys = ["own", "free", "taken", "gone"].map(|k| format!("{k}:{run}"));
            let shard = &shard;
            async move {
                let mut raw = cluster.shard(0).connect().await.unwrap();
                for key in &keys {
                    let grant = shard.acquire(&request(key, key, 0)).await.unwrap();
                    assert!(matches!(grant, Attempt::Granted { .. }), "{key}: {grant:?}");
                }
                assert!(shard
                    .release(keys[1].as_bytes(), &keys[1])
                    .await
                    .unwrap()
                    .is_released());
                raw.exec_drop(
                    "UPDATE shardlock_lease SET owner = 'other' WHERE lock_key = ?",
                    (&keys[2],),
                )
                .await
                .unwrap();
                raw.exec_drop(
                    "DELETE FROM shardlock_lease WHERE lock_key = ?",
                    (&keys[3],),
                )
                .await
                .unwrap();
                keys.map(|k| (k.clone().into_bytes(), k))
            }
        };
        let single = set_up("single").await;
        let mut answers = Vec::new();
        for (key, owner) in &single {
            answers.push(shard.release(key, owner).await.unwrap());
        }
        use crate::ReleaseAnswer::{NotHeld, Released};
        assert_eq!(answers, vec![Released, Released, NotHeld, NotHeld]);
        assert_eq!(
            stored(&mut raw, "taken:single").await.0.as_deref(),
            Some(&b"other"[..])
        );

        let [own, _, taken, gone] = set_up("batch").await;
        assert_eq!(
            shard.release_batch(&[own, taken, gone]).await.unwrap(),
            vec![Released, NotHeld, NotHeld]
        );
        assert_eq!(
            stored(&mut raw, "taken:batch").await.0.as_deref(),
            Some(&b"other"[..])
        );
        let [own, free, ..] = set_up("mixed").await;
        assert_eq!(
            shard.release_batch(&[own, free]).await.unwrap(),
            vec![Released, Released],
            "each row shows its own owner's tombstone"
        );
    }
}
