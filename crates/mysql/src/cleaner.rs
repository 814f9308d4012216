//! The statements of the cleaner, the heartbeat instance registry and fenced force-release.

use mysql_async::prelude::Queryable;
use mysql_async::{Conn, IsolationLevel, Params, Transaction, TxOpts, Value};

use crate::lease::{holding_owner, padded_in_list};
use crate::pool::settle;
use crate::{now_us, released};

/// `NOW(3)` less the longer of `?` µs (the reader's own `cleaner.heartbeat-timeout`) and the
/// timeout the row's instance beat with: a row whose `heartbeat_at` is older is silent past
/// both, and counts as dead by either process's rule. An instance whose timeout is longer than
/// the reader's stops granting (its heartbeat lapses, by its own clock) before its own
/// timeout, so it never grants while a reader with a shorter timeout counts it dead. A macro,
/// for `concat!` (see `now_us!`).
macro_rules! silent_past_timeout {
    () => {
        "NOW(3) - INTERVAL GREATEST(?, COALESCE(heartbeat_timeout_ms, 0) * 1000) MICROSECOND"
    };
}

/// A heartbeat of the process with start nonce `?`: the row is written only while it is this
/// process's (same nonce) or, if the heartbeat takes rows (`?`, see [`Beat::take`]), nobody's
/// that is live (deregistered, or silent past the longer of the writer's timeout, `?` µs, and
/// the row's own), so that another start
/// under the same id, which took the row over while this process counted as dead, keeps it
/// (see [`Heartbeat::TakenBy`]). A deregistered instance that beats again is alive again.
/// `started_at` is reset when another start takes the row (the assignments run left to right:
/// it compares the old nonce), and so is `heartbeat_timeout_ms`, which within one start only
/// grows: a heartbeat of the configuration before a reload that lengthened the timeout, late
/// on the wire (or retried), never leaves the shorter one in the row after the router saw
/// the longer one reach every shard (see `Gate` in the router). Times are the shard's `NOW(3)`, and [`ALIVE_HEAD`] compares them with the
/// same clock, so liveness never depends on two machines' clocks agreeing. The first
/// assignment reports, through `LAST_INSERT_ID`, how long a row of this start (nonce `?`) had
/// gone unbeaten by the shard's clock, in µs, times 2, plus 1 if that is longer than `?` µs
/// ([`Beat::judge_silence`]), plus 3 (a row that was not this start's: 1, or 2 when it is
/// left silent, below); it sets `host` to `?` either way. Such a silence is left in the row
/// (`heartbeat_at` is not moved) for the process to see, also when this reply is lost and the
/// statement is sent again: only a heartbeat that does not judge (once the process has acted
/// on it) moves it on. A row that was not this start's, taken by a heartbeat that judges, is
/// written silent for `?` µs (0 when it does not judge): longer than it judges, so that a
/// try sent again after a lost reply finds that silence in what is now its own row.
const HEARTBEAT: &str = concat!(
    "UPDATE shardlock_instance SET host = IF(LAST_INSERT_ID(IF(nonce <=> ?, ",
    "GREATEST(0, TIMESTAMPDIFF(MICROSECOND, heartbeat_at, NOW(3))) * 2 ",
    "+ (TIMESTAMPDIFF(MICROSECOND, heartbeat_at, NOW(3)) > ?) + 3, 1 + (? > 0))) = 0, host, ?), ",
    "pid = ?, ",
    "started_at = IF(nonce <=> ?, started_at, NOW(3)), ",
    "heartbeat_timeout_ms = IF(nonce <=> ?, GREATEST(COALESCE(heartbeat_timeout_ms, 0), ?), ?), ",
    "heartbeat_at = IF(nonce <=> ?, IF(TIMESTAMPDIFF(MICROSECOND, heartbeat_at, NOW(3)) > ?, ",
    "heartbeat_at, NOW(3)), NOW(3) - INTERVAL ? MICROSECOND), ",
    "nonce = ?, ",
    "deregistered_at = NULL, topology = ?, moving = ?, fleet = ?, servers = ? ",
    "WHERE instance_id = ? AND (nonce <=> ? OR (? AND (deregistered_at IS NOT NULL ",
    "OR heartbeat_at <= ",
    silent_past_timeout!(),
    ")))"
);

/// The longest silence a heartbeat writes into a row it takes (see [`HEARTBEAT`]): a year.
/// A process judges a longer one only once its own clock saw that long since its heartbeat
/// there, and it has lapsed by that clock already.
const MAX_SILENCE_US: i64 = 365 * 24 * 3600 * 1_000_000;

/// The first heartbeat of an instance id on the shard (`started_at` = now), silent for `?` µs
/// as [`HEARTBEAT`] writes a row it takes; an existing row is left as it is. Then
/// [`BEAT_LAST`] says whose the row is.
const REGISTER: &str = "INSERT INTO shardlock_instance \
     (instance_id, host, pid, nonce, started_at, heartbeat_at, deregistered_at, topology, \
     moving, fleet, heartbeat_timeout_ms, servers) \
     VALUES (?, ?, ?, ?, NOW(3), NOW(3) - INTERVAL ? MICROSECOND, NULL, ?, ?, ?, ?, ?) \
     ON DUPLICATE KEY UPDATE instance_id = instance_id";

/// Who beat last under an instance id.
const BEAT_LAST: &str = "SELECT nonce, host, pid FROM shardlock_instance WHERE instance_id = ?";

/// Who beats live under an instance id (as [`HEARTBEAT`] judges a row it may not take):
/// registered, not deregistered, heard from within the longer of `?` µs and its own timeout.
const LIVE_START: &str = concat!(
    "SELECT nonce, host, pid FROM shardlock_instance WHERE instance_id = ? \
     AND deregistered_at IS NULL AND heartbeat_at > ",
    silent_past_timeout!()
);

/// Owner-checked like a release: a process whose id another start has taken over since (see
/// [`HEARTBEAT`]) leaves that one's row live.
const DEREGISTER: &str = "UPDATE shardlock_instance SET deregistered_at = NOW(3) \
     WHERE instance_id = ? AND nonce = ?";

/// The living among some instances, with the start nonce each beats with: registered, not
/// deregistered, heard from within the longer of `?` µs and the timeout they beat with.
const ALIVE_HEAD: &str = concat!(
    "SELECT instance_id, nonce FROM shardlock_instance WHERE deregistered_at IS NULL AND heartbeat_at > ",
    silent_past_timeout!(),
    " AND instance_id IN "
);

const INSTANCES: &str = "SELECT instance_id, host, pid, \
     DATE_FORMAT(started_at, '%Y-%m-%dT%H:%i:%s.%fZ'), \
     CAST(TIMESTAMPDIFF(MICROSECOND, heartbeat_at, NOW(3)) DIV 1000 AS SIGNED), \
     deregistered_at IS NOT NULL, topology, moving <> 0, fleet, heartbeat_timeout_ms, servers, \
     nonce FROM shardlock_instance ORDER BY instance_id";

/// The rows after `?` in key order, at most `?` of them, each told whether the cleaner may
/// remove it: its lease ended longer than the grace (`?` µs) ago — a released row, or a lease
/// that was never released — and the shard clock has passed its fence by the margin (`?` µs),
/// so that the next grant of the key, whose fence is floored at the clock, is still above
/// every fence of the row. Only those rows come back, and the window's last, with how many
/// rows it held, so that the scan goes on after it, and with the bound of the window's fences
/// (the clock less the margin, `?` µs again: `NOW` is the statement's start throughout).
///
/// The window bounds the rows one statement examines: filtered in the same statement, a long
/// run of rows that do not qualify (live leases, rows within their grace) was read whole
/// before the first that did, past the statement timeout on a big enough shard, and every
/// pass stopped at the same key. A consistent read: it locks nothing.
const CANDIDATES: &str = concat!(
    "SELECT lock_key, owner, fence, kept, qualifies, examined, ",
    now_us!(),
    " - ? FROM (",
    "SELECT lock_key, owner, fence, ttl_ms = 0 AS kept, ",
    "expires_at < NOW(3) - INTERVAL ? MICROSECOND AND fence < ",
    now_us!(),
    " - ? AS qualifies, ",
    "LEAD(lock_key) OVER (ORDER BY lock_key) IS NULL AS last, COUNT(*) OVER () AS examined ",
    "FROM (SELECT lock_key, owner, fence, ttl_ms, expires_at FROM shardlock_lease ",
    "WHERE lock_key > ? ORDER BY lock_key LIMIT ?) AS scanned) AS judged ",
    "WHERE qualifies OR last ORDER BY lock_key"
);

/// The delete re-checks every condition of [`CANDIDATES`] on the row it deletes, so a key
/// granted again since the scan is left alone. Primary-key lookups only: acquires of other
/// keys are not blocked.
const DELETE_TAIL: &str = concat!(
    " AND expires_at < NOW(3) - INTERVAL ? MICROSECOND AND fence < ",
    now_us!(),
    " - ?"
);

/// Frees a held key and takes its fence past every fence of the evicted holder (hand-off
/// reserves included); the new top comes back through `LAST_INSERT_ID`.
const FORCE_RELEASE: &str = concat!(
    "UPDATE shardlock_lease SET owner = NULL, expires_at = NOW(3), wanted_at = NULL, ",
    "fence = LAST_INSERT_ID(GREATEST(fence + 1, ",
    now_us!(),
    ")) WHERE lock_key = ? AND owner = ?"
);

/// One window of the cleaner's scan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Scanned {
    /// The rows of the window the cleaner may remove, in key order.
    pub candidates: Vec<Candidate>,
    /// Rows the window examined: at most the limit asked for.
    pub examined: u64,
    /// The window's last key when it was full: the scan goes on after it. `None` once the
    /// window reached the end of the table.
    pub next: Option<Vec<u8>>,
    /// Above every candidate's fence: the shard's clock at the scan, less the margin.
    pub horizon: u64,
}

/// A row the cleaner may remove.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The stored key.
    pub key: Vec<u8>,
    /// The holder of a lease that ended without release; `None` for a released row.
    pub owner: Option<String>,
    /// Its fence when it was read (the shard's fence floor is raised to it before it is
    /// deleted, so that no later grant of the key goes below it, whatever the clock does).
    pub fence: u64,
    /// A row its holder released but kept taken until a minimum hold ended (`ttl_ms = 0`: a
    /// release with `lock_at_least`, or a move's copy of such a row): released, though it
    /// keeps its owner, whose process may live on.
    pub kept: bool,
}

/// One instance in the registry table.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstanceRow {
    /// The instance id (the first part of its owners).
    pub instance_id: String,
    /// Host name it reported.
    pub host: String,
    /// Process id it reported.
    pub pid: u32,
    /// When it first registered, shard clock (UTC, RFC 3339).
    pub started_at: String,
    /// Milliseconds since its latest heartbeat, by the shard's clock.
    pub heartbeat_ms_ago: i64,
    /// Whether it deregistered (shut down cleanly).
    pub deregistered: bool,
    /// The fingerprint of the topology it runs (`None` from versions before migration 7).
    pub topology: Option<String>,
    /// Whether a reload's move was in force in it at its latest heartbeat.
    pub moving: bool,
    /// The fleet it belongs to (`instance.fleet`; `None` from versions before migration 7).
    pub fleet: Option<String>,
    /// The `cleaner.heartbeat-timeout` it beat with (`None` from versions before migration
    /// 10): readers count it live for the longer of theirs and this.
    pub heartbeat_timeout: Option<std::time::Duration>,
    /// A digest of which database each shard name of its topology reaches (`None` from
    /// versions before migration 12; see [`Beat::servers`]).
    pub servers: Option<String>,
    /// The start nonce it beats with, random per process start: two starts under one id
    /// (a process restarted, a copied config) differ in it.
    pub nonce: Option<String>,
}

/// What the heartbeat registry says of an instance (see [`InstanceRow::verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InstanceVerdict {
    /// It heartbeats within the timeout: its leases are kept.
    Running,
    /// Silent longer than the timeout: dead, its ended leases are the cleaner's.
    Dead,
    /// It deregistered when it shut down.
    ShutDown,
}

impl InstanceVerdict {
    /// `running`, `dead` or `shut down`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Dead => "dead",
            Self::ShutDown => "shut down",
        }
    }
}

impl InstanceRow {
    /// The registry's verdict by a reader with `heartbeat_timeout`, by the rule the cleaner
    /// applies (alive: not deregistered and heard from within the longer of that and the
    /// instance's own timeout, shard clock).
    pub fn verdict(&self, heartbeat_timeout: std::time::Duration) -> InstanceVerdict {
        if self.deregistered {
            InstanceVerdict::ShutDown
        } else if u128::try_from(self.heartbeat_ms_ago).unwrap_or(0)
            < self.live_for(heartbeat_timeout).as_millis()
        {
            InstanceVerdict::Running
        } else {
            InstanceVerdict::Dead
        }
    }

    /// How long after its latest heartbeat a reader with `heartbeat_timeout` counts it live:
    /// the longer of that and its own timeout.
    pub fn live_for(&self, heartbeat_timeout: std::time::Duration) -> std::time::Duration {
        self.heartbeat_timeout
            .map_or(heartbeat_timeout, |own| own.max(heartbeat_timeout))
    }
}

/// Registry rows of instances not heard from for longer than `?` µs (dead or shut down that
/// long ago): they decide nothing any more, and a host restarting services under new ids
/// would otherwise add a row each time.
/// (Nor for less than the timeout the row's instance beat with.)
const FORGET: &str = concat!(
    "DELETE FROM shardlock_instance WHERE heartbeat_at < ",
    silent_past_timeout!()
);

pub(crate) async fn forget_instances(conn: &mut Conn, silent_us: u64) -> mysql_async::Result<u64> {
    conn.exec_drop(FORGET, (silent_us,)).await?;
    Ok(conn.affected_rows())
}

/// What an instance says of itself with each heartbeat.
#[derive(Debug, Clone, Copy)]
pub struct Beat<'a> {
    /// Its instance id.
    pub instance: &'a str,
    /// Its host name.
    pub host: &'a str,
    /// Its process id.
    pub pid: u32,
    /// The fingerprint of the topology it runs.
    pub topology: &'a str,
    /// Whether a reload's move is in force in it.
    pub moving: bool,
    /// Its fleet.
    pub fleet: &'a str,
    /// A digest of which database each shard name of its topology reaches: processes with
    /// the same fingerprint but another digest reach some shard name at another database.
    pub servers: &'a str,
    /// Its start nonce: the row is its own while it holds it.
    pub nonce: &'a str,
    /// `cleaner.heartbeat-timeout`: a row another start has not beaten for this long, nor for
    /// the timeout the row says, may be taken over. Written into the row.
    pub timeout: std::time::Duration,
    /// A silence of this start's row longer than this is reported as kept
    /// ([`Heartbeat::Beaten`]'s `kept_silent`) and left in the row; `None` judges nothing and
    /// moves the row on whatever its silence.
    pub judge_silence: Option<std::time::Duration>,
    /// Whether it may take the row when it is not its own start's but nobody's that is live
    /// (another start's, deregistered or silent past its timeout), or register one where there
    /// is none; else it only keeps its own ([`Heartbeat::Withheld`]). A process joining its
    /// fleet again that could not look on every shard for a live start of its id takes none:
    /// the start that took its id over while it counted as dead may be cut off from this shard
    /// and live on the one it could not read.
    pub take: bool,
}

/// What a heartbeat found: a row is written only while it is its own start's, or nobody's
/// that is live (see [`Shard::heartbeat`](crate::Shard::heartbeat)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Heartbeat {
    /// The row is this process's now: it beat.
    Beaten {
        /// How long the row had gone unbeaten by the shard's clock, if it was this start's
        /// already (`None`: the row was new, deregistered, or another start's, silent past
        /// its timeout).
        silent_for: Option<std::time::Duration>,
        /// The silence was longer than [`Beat::judge_silence`]: the row was left unbeaten, as
        /// the rest of the fleet sees it, until a heartbeat that does not judge. With
        /// `silent_for` `None`: the row was not this start's (the fleet counted it dead:
        /// forgotten, or taken over by another start and given up) and the heartbeat judged,
        /// so it was written silent for longer than it judges, and stays so, as the fleet saw
        /// it, until a heartbeat that does not judge.
        kept_silent: bool,
    },
    /// The row is another start's that counts as dead (deregistered, or silent past its
    /// timeout), or there is none, and the heartbeat takes no row ([`Beat::take`]): left as
    /// it is.
    Withheld,
    /// Another start beats under this instance id, live: the row was left alone.
    TakenBy {
        /// Its host.
        host: String,
        /// Its process id.
        pid: u32,
    },
}

pub(crate) async fn heartbeat(conn: &mut Conn, beat: Beat<'_>) -> mysql_async::Result<Heartbeat> {
    let timeout_us = u64::try_from(beat.timeout.as_micros()).unwrap_or(u64::MAX);
    let timeout_ms = u64::try_from(beat.timeout.as_millis()).unwrap_or(u64::MAX);
    // Signed, as `TIMESTAMPDIFF` is: never is the largest.
    let judge_us = (beat.judge_silence).map_or(i64::MAX, |d| {
        i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
    });
    // A row not this start's that a judging heartbeat takes is written silent for longer than
    // it judges, and past the timeout as the fleet saw it.
    let left_silent_us = (beat.judge_silence).map_or(0, |_| {
        (judge_us.saturating_add(i64::try_from(timeout_us).unwrap_or(i64::MAX))).min(MAX_SILENCE_US)
    });
    let params: Vec<Value> = vec![
        beat.nonce.into(),
        judge_us.into(),
        left_silent_us.into(),
        beat.host.into(),
        beat.pid.into(),
        beat.nonce.into(),
        beat.nonce.into(),
        timeout_ms.into(),
        timeout_ms.into(),
        beat.nonce.into(),
        judge_us.into(),
        left_silent_us.into(),
        beat.nonce.into(),
        beat.topology.into(),
        beat.moving.into(),
        beat.fleet.into(),
        beat.servers.into(),
        beat.instance.into(),
        beat.nonce.into(),
        beat.take.into(),
        timeout_us.into(),
    ];
    conn.exec_drop(HEARTBEAT, params).await?;
    if conn.affected_rows() > 0 {
        let found = conn.last_insert_id().unwrap_or(1);
        let own = found.checked_sub(3);
        return Ok(Heartbeat::Beaten {
            silent_for: own.map(|v| std::time::Duration::from_micros(v / 2)),
            kept_silent: own.map_or(found == 2, |v| v % 2 == 1),
        });
    }
    if !beat.take {
        // Not its own, and left so: whether another start beats there live is read, as a
        // heartbeat that takes rows would have judged it.
        return Ok(match live_start(conn, (beat.instance, timeout_us)).await? {
            Some((nonce, host, pid)) if nonce.as_deref() != Some(beat.nonce.as_bytes()) => {
                Heartbeat::TakenBy { host, pid }
            }
            _ => Heartbeat::Withheld,
        });
    }
    let params: Vec<Value> = vec![
        beat.instance.into(),
        beat.host.into(),
        beat.pid.into(),
        beat.nonce.into(),
        left_silent_us.into(),
        beat.topology.into(),
        beat.moving.into(),
        beat.fleet.into(),
        timeout_ms.into(),
        beat.servers.into(),
    ];
    // Affected rows count the rows matched (see `Shard::new`): an existing row counts too,
    // so whose the row is now is read back.
    conn.exec_drop(REGISTER, params).await?;
    let last: Option<(Option<Vec<u8>>, String, u32)> =
        conn.exec_first(BEAT_LAST, (beat.instance,)).await?;
    Ok(match last {
        Some((nonce, host, pid)) if nonce.as_deref() != Some(beat.nonce.as_bytes()) => {
            Heartbeat::TakenBy { host, pid }
        }
        _ => Heartbeat::Beaten {
            silent_for: None,
            kept_silent: left_silent_us > 0,
        },
    })
}

/// The start that beats live under `instance`, if one does: its nonce, host and pid.
pub(crate) async fn live_start(
    conn: &mut Conn,
    (instance, timeout_us): (&str, u64),
) -> mysql_async::Result<Option<(Option<Vec<u8>>, String, u32)>> {
    conn.exec_first(LIVE_START, (instance, timeout_us)).await
}

pub(crate) async fn deregister(
    conn: &mut Conn,
    (instance, nonce): (&str, &str),
) -> mysql_async::Result<()> {
    conn.exec_drop(DEREGISTER, (instance, nonce)).await
}

pub(crate) async fn alive(
    conn: &mut Conn,
    instances: &[String],
    timeout_us: u64,
) -> mysql_async::Result<Vec<(String, Option<String>)>> {
    if instances.is_empty() {
        return Ok(Vec::new());
    }
    let (list, mut values) = padded_in_list(instances.iter().map(|i| i.as_bytes()));
    values.insert(0, timeout_us.into());
    let rows: Vec<(Vec<u8>, Option<String>)> = conn
        .exec(format!("{ALIVE_HEAD}{list}"), Params::Positional(values))
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, nonce)| (String::from_utf8_lossy(&id).into_owned(), nonce))
        .collect())
}

type InstanceTuple = (
    Vec<u8>,
    String,
    u32,
    String,
    i64,
    bool,
    Option<Vec<u8>>,
    bool,
    Option<Vec<u8>>,
    Option<u64>,
    Option<String>,
    Option<Vec<u8>>,
);

pub(crate) async fn instances(conn: &mut Conn) -> mysql_async::Result<Vec<InstanceRow>> {
    let rows: Vec<InstanceTuple> = conn.query(INSTANCES).await?;
    Ok(rows
        .into_iter()
        .map(
            |(
                id,
                host,
                pid,
                started_at,
                heartbeat_ms_ago,
                deregistered,
                topology,
                moving,
                fleet,
                timeout_ms,
                servers,
                nonce,
            )| {
                InstanceRow {
                    instance_id: String::from_utf8_lossy(&id).into_owned(),
                    host,
                    pid,
                    started_at,
                    heartbeat_ms_ago,
                    deregistered,
                    topology: topology.map(|t| String::from_utf8_lossy(&t).into_owned()),
                    moving,
                    fleet: fleet.map(|f| String::from_utf8_lossy(&f).into_owned()),
                    heartbeat_timeout: timeout_ms.map(std::time::Duration::from_millis),
                    servers,
                    nonce: nonce.map(|n| String::from_utf8_lossy(&n).into_owned()),
                }
            },
        )
        .collect())
}

/// A row of [`CANDIDATES`]: key, owner, fence, whether it was kept past its release, whether
/// it qualifies, the rows its window examined, and the window's horizon.
type CandidateRow = (Vec<u8>, Option<Vec<u8>>, u64, bool, bool, u64, u64);

pub(crate) async fn candidates(
    conn: &mut Conn,
    after: &[u8],
    grace_us: u64,
    margin_us: u64,
    limit: u32,
) -> mysql_async::Result<Scanned> {
    let rows: Vec<CandidateRow> = conn
        .exec(CANDIDATES, (margin_us, grace_us, margin_us, after, limit))
        .await?;
    let Some((last, .., examined, horizon)) = rows.last() else {
        return Ok(Scanned::default());
    };
    let (examined, horizon, next) = (*examined, *horizon, last.clone());
    let candidates = rows
        .into_iter()
        .filter(|&(.., qualifies, _, _)| qualifies)
        .map(|(key, owner, fence, kept, ..)| Candidate {
            key,
            owner: holding_owner(owner).map(|o| String::from_utf8_lossy(&o).into_owned()),
            fence,
            kept,
        })
        .collect();
    Ok(Scanned {
        candidates,
        examined,
        next: (examined >= u64::from(limit)).then_some(next),
        horizon,
    })
}

/// What one delete of the cleaner did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Deleted {
    /// Rows deleted.
    pub rows: u64,
    /// Rows that still qualified but were passed over because another session held their
    /// lock (a console's open transaction, a statement of another client on the row): left
    /// to a later pass rather than waited for.
    pub in_use: u64,
}

/// Deletes released rows among `keys`, or, with `owners`, the leases of those owners among
/// `keys` (owners are unique per grant, so `key IN .. AND owner IN ..` matches exactly the
/// pairs), each only if it still qualifies.
///
/// Rows another session holds locked are passed over, not waited for: a row a console
/// session keeps locked would otherwise stop every pass at its batch, each one waiting the
/// server's whole lock wait, and those waits would count against the shard. So the rows that
/// qualify are locked first, skipping those held (`SKIP LOCKED`, MySQL 8.0 and MariaDB 10.6),
/// in a READ COMMITTED transaction (only the rows matched stay locked, no gaps), and only
/// those are deleted.
pub(crate) async fn delete(
    conn: &mut Conn,
    keys: &[Vec<u8>],
    owners: Option<&[String]>,
    grace_us: u64,
    margin_us: u64,
    fence_at_most: u64,
) -> mysql_async::Result<Deleted> {
    if keys.is_empty() {
        return Ok(Deleted::default());
    }
    let qualifying = |keys: &[Vec<u8>]| {
        let (key_list, mut values) = padded_in_list(keys.iter().map(Vec::as_slice));
        let mut sql = format!("lock_key IN {key_list}");
        match owners {
            None => sql.push_str(concat!(" AND ", released!("owner"))),
            Some(owners) => {
                let (owner_list, owner_values) =
                    padded_in_list(owners.iter().map(|o| o.as_bytes()));
                sql.push_str(&format!(" AND owner IN {owner_list}"));
                values.extend(owner_values);
            }
        }
        sql.push_str(DELETE_TAIL);
        // A row granted again since the scan has a higher fence than the floor raised for it.
        sql.push_str(" AND fence <= ?");
        values.push(Value::from(grace_us));
        values.push(Value::from(margin_us));
        values.push(Value::from(fence_at_most));
        (sql, Params::Positional(values))
    };
    let mut opts = TxOpts::default();
    opts.with_isolation_level(IsolationLevel::ReadCommitted);
    let mut tx = conn.start_transaction(opts).await?;
    let deleted = delete_in(&mut tx, keys, qualifying).await;
    settle(tx, deleted).await
}

/// [`delete`]'s statements, in its transaction; `qualifying` is the condition on rows of some
/// keys that may be deleted, with its parameters.
async fn delete_in(
    tx: &mut Transaction<'_>,
    keys: &[Vec<u8>],
    qualifying: impl Fn(&[Vec<u8>]) -> (String, Params),
) -> mysql_async::Result<Deleted> {
    let (rows, params) = qualifying(keys);
    let locked: Vec<Vec<u8>> = tx
        .exec(
            format!("SELECT lock_key FROM shardlock_lease WHERE {rows} FOR UPDATE SKIP LOCKED"),
            params,
        )
        .await?;
    let mut deleted = Deleted::default();
    if !locked.is_empty() {
        let (rows, params) = qualifying(&locked);
        tx.exec_drop(format!("DELETE FROM shardlock_lease WHERE {rows}"), params)
            .await?;
        deleted.rows = tx.affected_rows();
    }
    if locked.len() < keys.len() {
        // Those that qualify among the rest, read as last committed without waiting: held by
        // another session (the others no longer qualify, or are gone).
        let rest: Vec<Vec<u8>> = keys
            .iter()
            .filter(|k| !locked.contains(k))
            .cloned()
            .collect();
        let (rows, params) = qualifying(&rest);
        let held: Option<u64> = tx
            .exec_first(
                format!("SELECT COUNT(*) FROM shardlock_lease WHERE {rows}"),
                params,
            )
            .await?;
        deleted.in_use = held.unwrap_or(0);
    }
    Ok(deleted)
}

/// Frees `key` if `owner` still holds it; the new fence, or `None` if `owner` no longer did.
pub(crate) async fn force_release(
    conn: &mut Conn,
    key: &[u8],
    owner: &str,
) -> mysql_async::Result<Option<u64>> {
    conn.exec_drop(FORCE_RELEASE, (key, owner)).await?;
    Ok((conn.affected_rows() == 1)
        .then(|| conn.last_insert_id())
        .flatten())
}

/// The fence of `key`'s row if it was freed by force since its fence was `seen_fence` (no
/// owner, and a fence raised: a release leaves a tombstone, or keeps the fence).
pub(crate) async fn freed_by_force(
    conn: &mut Conn,
    key: &[u8],
    seen_fence: u64,
) -> mysql_async::Result<Option<u64>> {
    conn.exec_first(
        "SELECT fence FROM shardlock_lease WHERE lock_key = ? AND owner IS NULL AND fence > ?",
        (key, seen_fence),
    )
    .await
}

/// The placements `fleet` last recorded on a shard (migration 13): its sequence number and
/// the record (JSON, written and read by the router).
const FLEET_PLACEMENT: &str = "SELECT seq, placements FROM shardlock_placement WHERE fleet = ?";

/// Records `fleet`'s placements as number `seq` where the shard holds none yet.
const FIRST_PLACEMENT: &str =
    "INSERT IGNORE INTO shardlock_placement (fleet, seq, placements) VALUES (?, ?, ?)";

/// Records `fleet`'s placements as number `seq` over the record numbered as read.
const NEXT_PLACEMENT: &str =
    "UPDATE shardlock_placement SET seq = ?, placements = ? WHERE fleet = ? AND seq = ?";

pub(crate) async fn fleet_placement(
    conn: &mut Conn,
    fleet: &str,
) -> mysql_async::Result<Option<(u64, String)>> {
    conn.exec_first(FLEET_PLACEMENT, (fleet,)).await
}

pub(crate) async fn record_placement(
    conn: &mut Conn,
    (fleet, read, seq, placements): (&str, Option<u64>, u64, &str),
) -> mysql_async::Result<bool> {
    match read {
        None => {
            conn.exec_drop(FIRST_PLACEMENT, (fleet, seq, placements))
                .await?
        }
        Some(read) => {
            conn.exec_drop(NEXT_PLACEMENT, (seq, placements, fleet, read))
                .await?
        }
    }
    Ok(conn.affected_rows() == 1)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::Shard;

    /// A heartbeat of instance `id` from the start with `nonce`, set for `timeout`.
    fn beat<'a>(id: &'a str, nonce: &'a str, timeout: Duration) -> Beat<'a> {
        Beat {
            instance: id,
            host: "host",
            pid: 1,
            topology: "t",
            moving: false,
            fleet: "default",
            servers: "s",
            nonce,
            timeout,
            judge_silence: None,
            take: true,
        }
    }

    /// A heartbeat tells how long its start's own row had gone unbeaten by the shard's
    /// clock, and nothing of a row that was not its start's.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_heartbeat_tells_how_long_its_own_row_went_unbeaten() {
        let (cluster, shard) = crate::testing::migrated_shard().await;
        let timeout = Duration::from_secs(60);
        let age = |secs: u32| {
            let cluster = &cluster;
            async move {
                (cluster.shard(0).connect().await.unwrap())
                    .query_drop(format!(
                        "UPDATE shardlock_instance SET heartbeat_at = \
                         heartbeat_at - INTERVAL {secs} SECOND"
                    ))
                    .await
                    .unwrap();
            }
        };
        let silence = |beaten: Heartbeat| match beaten {
            Heartbeat::Beaten {
                silent_for,
                kept_silent: false,
            } => silent_for,
            other => panic!("{other:?}"),
        };
        let first = shard.heartbeat(beat("a", "n1", timeout)).await.unwrap();
        assert_eq!(silence(first), None, "a new row");
        age(31).await;
        let after = silence(shard.heartbeat(beat("a", "n1", timeout)).await.unwrap());
        assert!(
            after.is_some_and(|s| s >= Duration::from_secs(31) && s < Duration::from_secs(40)),
            "{after:?}"
        );
        let next = silence(shard.heartbeat(beat("a", "n1", timeout)).await.unwrap());
        assert!(next.is_some_and(|s| s < Duration::from_secs(5)), "{next:?}");
        // A silence longer than the heartbeat judges stays in the row, for a heartbeat sent
        // again after a lost reply to see too, until one that does not judge moves it on.
        age(31).await;
        let judging = Beat {
            judge_silence: Some(Duration::from_secs(20)),
            ..beat("a", "n1", timeout)
        };
        for _ in 0..2 {
            let kept = shard.heartbeat(judging).await.unwrap();
            assert!(
                matches!(kept, Heartbeat::Beaten { silent_for: Some(s), kept_silent: true }
                    if s >= Duration::from_secs(31)),
                "{kept:?}"
            );
        }
        let acted = silence(shard.heartbeat(beat("a", "n1", timeout)).await.unwrap());
        assert!(
            acted.is_some_and(|s| s >= Duration::from_secs(31)),
            "{acted:?}"
        );
        let judged = silence(shard.heartbeat(judging).await.unwrap());
        assert!(
            judged.is_some_and(|s| s < Duration::from_secs(5)),
            "{judged:?}"
        );
        // Silent past the timeout, taken over by another start: not its own row.
        age(61).await;
        let taken = silence(shard.heartbeat(beat("a", "n2", timeout)).await.unwrap());
        assert_eq!(taken, None);
        // A row that is not its start's, taken (given up by another start) or written anew
        // (forgotten) by a heartbeat that judges, is written silent, so that the try sent
        // again after a lost reply finds a kept silence in what is its own row by then.
        shard.deregister("a", "n2").await.unwrap();
        let forgotten = || async {
            (cluster.shard(0).connect().await.unwrap())
                .query_drop("DELETE FROM shardlock_instance")
                .await
                .unwrap();
        };
        for give_up in [None, Some(forgotten)] {
            if let Some(forget) = give_up {
                forget().await;
            }
            let retaken = shard.heartbeat(judging).await.unwrap();
            assert_eq!(
                retaken,
                Heartbeat::Beaten {
                    silent_for: None,
                    kept_silent: true
                }
            );
            let again = shard.heartbeat(judging).await.unwrap();
            assert!(
                matches!(again, Heartbeat::Beaten { silent_for: Some(s), kept_silent: true }
                    if s >= Duration::from_secs(20) + timeout),
                "{again:?}"
            );
            let rows = shard.instances().await.unwrap();
            assert_eq!(
                rows[0].verdict(timeout),
                InstanceVerdict::Dead,
                "as the fleet saw it"
            );
            let moved_on = silence(shard.heartbeat(beat("a", "n1", timeout)).await.unwrap());
            assert!(moved_on.is_some_and(|s| s > timeout), "{moved_on:?}");
        }
    }

    /// The timeout the registry row of `id` says.
    async fn row_timeout(shard: &Shard, id: &str) -> Option<Duration> {
        let rows = shard.instances().await.unwrap();
        rows.into_iter()
            .find(|r| r.instance_id == id)
            .and_then(|r| r.heartbeat_timeout)
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_row_is_judged_by_the_longest_timeout_its_start_beat_with() {
        let (_cluster, shard) = crate::testing::migrated_shard().await;
        let (long, short) = (Duration::from_secs(60), Duration::from_millis(1));

        let beaten = shard.heartbeat(beat("a", "n1", long)).await.unwrap();
        assert!(matches!(beaten, Heartbeat::Beaten { .. }));
        // A heartbeat from before a reload that lengthened the timeout, late on the wire.
        let late = shard.heartbeat(beat("a", "n1", short)).await.unwrap();
        assert!(matches!(late, Heartbeat::Beaten { .. }));
        assert_eq!(row_timeout(&shard, "a").await, Some(long), "only grows");

        // Silent for longer than a reader's timeout, not its own: live, and its id is kept.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let alive = shard.alive_instances(&["a".to_owned()], short).await;
        assert_eq!(
            alive.unwrap(),
            vec![("a".to_owned(), Some("n1".to_owned()))]
        );
        let rows = shard.instances().await.unwrap();
        assert_eq!(rows[0].verdict(short), InstanceVerdict::Running);
        let taken = shard.heartbeat(beat("a", "n2", short)).await.unwrap();
        assert!(matches!(taken, Heartbeat::TakenBy { .. }), "{taken:?}");

        // Once it deregistered, the next start's row says that start's own timeout.
        shard.deregister("a", "n1").await.unwrap();
        let next = shard.heartbeat(beat("a", "n2", short)).await.unwrap();
        assert!(matches!(
            next,
            Heartbeat::Beaten {
                silent_for: None,
                ..
            }
        ));
        assert_eq!(row_timeout(&shard, "a").await, Some(short));
    }

    /// A heartbeat that takes no row beats its start's own row only: another start's, dead
    /// (deregistered, or silent past its timeout), stays that start's, and no row is made
    /// where there is none; another start's that is live is told, as to any heartbeat.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_heartbeat_that_takes_no_row_beats_its_own_only() {
        let (cluster, shard) = crate::testing::migrated_shard().await;
        let timeout = Duration::from_secs(60);
        let own = |id, nonce| Beat {
            take: false,
            ..beat(id, nonce, timeout)
        };
        let nonce_of = |id: &'static str| {
            let shard = &shard;
            async move {
                let rows = shard.instances().await.unwrap();
                rows.into_iter()
                    .find(|r| r.instance_id == id)
                    .map(|r| r.nonce)
            }
        };
        // None: none made.
        let silence_an_hour = || async {
            (cluster.shard(0).connect().await.unwrap())
                .query_drop(
                    "UPDATE shardlock_instance SET heartbeat_at = heartbeat_at - INTERVAL 1 HOUR",
                )
                .await
                .unwrap();
        };
        let none = shard.heartbeat(own("a", "n1")).await.unwrap();
        assert_eq!(none, Heartbeat::Withheld);
        assert_eq!(nonce_of("a").await, None, "a row made where there was none");

        // Its own: beaten, silent or not.
        shard.heartbeat(beat("a", "n1", timeout)).await.unwrap();
        silence_an_hour().await;
        let beaten = shard.heartbeat(own("a", "n1")).await.unwrap();
        assert!(matches!(beaten, Heartbeat::Beaten { .. }), "{beaten:?}");

        // Another start's, live: told.
        let live = shard.heartbeat(own("a", "n2")).await.unwrap();
        assert!(matches!(live, Heartbeat::TakenBy { .. }), "{live:?}");

        // Another start's, silent past its timeout, then deregistered: left alone.
        silence_an_hour().await;
        let silent = shard.heartbeat(own("a", "n2")).await.unwrap();
        assert_eq!(silent, Heartbeat::Withheld);
        shard.deregister("a", "n1").await.unwrap();
        let deregistered = shard.heartbeat(own("a", "n2")).await.unwrap();
        assert_eq!(deregistered, Heartbeat::Withheld);
        assert_eq!(
            nonce_of("a").await,
            Some(Some("n1".to_owned())),
            "a heartbeat that takes no row took another start's"
        );
        // Taken by a heartbeat that takes rows.
        let taken = shard.heartbeat(beat("a", "n2", timeout)).await.unwrap();
        assert!(matches!(taken, Heartbeat::Beaten { .. }), "{taken:?}");
        assert_eq!(nonce_of("a").await, Some(Some("n2".to_owned())));
    }
}
