//! Versioned migrations, applied in order, recorded in `shardlock_schema_version`.

use mysql_async::prelude::Queryable;
use mysql_async::Conn;

/// The migrations, in order: `(version, name, SQL)`. The SQL lives in `migrations/`.
pub const MIGRATIONS: &[(u32, &str, &str)] = &[
    (
        1,
        "lease_table",
        include_str!("../migrations/0001_lease_table.sql"),
    ),
    (
        2,
        "instance_registry",
        include_str!("../migrations/0002_instance_registry.sql"),
    ),
    (
        3,
        "holder_trace",
        include_str!("../migrations/0003_holder_trace.sql"),
    ),
    (
        4,
        "lock_patterns",
        include_str!("../migrations/0004_lock_patterns.sql"),
    ),
    (
        5,
        "shard_identity",
        include_str!("../migrations/0005_shard_identity.sql"),
    ),
    (
        6,
        "carry_and_retry",
        include_str!("../migrations/0006_carry_and_retry.sql"),
    ),
    (
        7,
        "instance_topology",
        include_str!("../migrations/0007_instance_topology.sql"),
    ),
    (
        8,
        "lease_data",
        include_str!("../migrations/0008_lease_data.sql"),
    ),
    (
        9,
        "instance_nonce",
        include_str!("../migrations/0009_instance_nonce.sql"),
    ),
    (
        10,
        "instance_timeout",
        include_str!("../migrations/0010_instance_timeout.sql"),
    ),
    (
        11,
        "cas_carried",
        include_str!("../migrations/0011_cas_carried.sql"),
    ),
    (
        12,
        "instance_servers",
        include_str!("../migrations/0012_instance_servers.sql"),
    ),
    (
        13,
        "fleet_placement",
        include_str!("../migrations/0013_fleet_placement.sql"),
    ),
];

const VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS shardlock_schema_version (\
     version INT UNSIGNED NOT NULL PRIMARY KEY, \
     name VARCHAR(200) NOT NULL, \
     applied_at TIMESTAMP(3) NOT NULL DEFAULT CURRENT_TIMESTAMP(3)) ENGINE=InnoDB";

/// Errors that mean a DDL statement's change is already there: table exists (1050),
/// duplicate column (1060), duplicate key name (1061).
const ALREADY_DONE: &[u16] = &[1050, 1060, 1061];

/// What `migrate` did on one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrateReport {
    /// Versions applied by this call.
    pub applied: Vec<u32>,
    /// The schema version now: above this shardlock's last migration when a newer one
    /// migrated the shard.
    pub version: u32,
}

/// Applies missing migrations. Every step is idempotent (a change already there is recognised
/// and skipped, a version already recorded is not recorded again), so running it twice, or
/// from two processes at once, is harmless. On a single server, concurrent callers also
/// serialize on a named server lock, so that they do not wait on each other's DDL one
/// statement at a time. On a Galera shard (`cluster`) that lock would hold on one node only
/// (and some Galera builds refuse it), so none is taken: DDL runs in total order across the
/// cluster and idempotence does the rest. A server that refuses the lock is migrated without
/// it too.
pub(crate) async fn migrate(conn: &mut Conn, cluster: bool) -> mysql_async::Result<MigrateReport> {
    if cluster {
        return apply_again_on_conflict(conn).await;
    }
    let got: Option<i64> = match conn
        .query_first("SELECT GET_LOCK('shardlock.migrate', 30)")
        .await
    {
        Ok(got) => got,
        // Refused (some Galera builds do), not merely slow or killed while another process
        // holds it: those are errors.
        Err(mysql_async::Error::Server(e)) if !LOCK_WAIT_ENDED.contains(&e.code) => {
            tracing::debug!(
                code = e.code,
                "migrating without GET_LOCK, which the server refused: {}",
                e.message
            );
            return apply_again_on_conflict(conn).await;
        }
        Err(e) => return Err(e),
    };
    if got != Some(1) {
        return Err(mysql_async::Error::Other(
            "another process held the migration lock for 30 s".into(),
        ));
    }
    // Again on a conflict too: a Galera cluster reached through one address (no `nodes`)
    // takes the lock on whichever node that address leads to.
    let result = apply_again_on_conflict(conn).await;
    // A failed release is not reported over the migration's own result: the connection was
    // taken raw, so the pool resets it before reuse, and the reset frees the lock anyway.
    let _ = conn
        .query_drop("DO RELEASE_LOCK('shardlock.migrate')")
        .await;
    result
}

/// [`apply`], run again from the start when a statement lost a certification conflict (1213)
/// to the same step run by another process through another node, or was aborted for that
/// node's DDL (1317: on Galera, a statement holding a metadata lock that a replicated DDL
/// needs is interrupted): it is done, or will be found done.
async fn apply_again_on_conflict(conn: &mut Conn) -> mysql_async::Result<MigrateReport> {
    // One report across the runs: a version applied before a conflict is still this call's.
    let mut report = MigrateReport::default();
    let mut tries = 0;
    loop {
        match apply(conn, &mut report).await {
            Err(mysql_async::Error::Server(e)) if CONFLICT.contains(&e.code) && tries < 10 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(10 * tries)).await;
            }
            result => return result.map(|()| report),
        }
    }
}

/// How long one try of a DDL statement waits for its table's metadata lock (the server's
/// `lock_wait_timeout`, whose default is a day or a year). Every lock statement on the table
/// queues behind a DDL statement waiting for it, so the wait is kept short (a second, the
/// server's unit: below the default statement timeout, not below every one a config may set),
/// and tried again after a pause in which they run.
const DDL_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// Tries of a DDL statement whose table stays in use, and the pause between them.
const DDL_TRIES: u32 = 8;
const DDL_PAUSE: std::time::Duration = std::time::Duration::from_millis(500);

/// The server's lock wait timeout, metadata locks' included.
const LOCK_WAIT_TIMEOUT: u16 = 1205;

/// Runs one migration statement: a change already there is done; a table (or a row of a
/// migration's `INSERT`) another session keeps in use (an open transaction that read it, a
/// long query, a backup) is waited for [`DDL_TRIES`] times, each up to the lock wait, then
/// reported.
async fn run_ddl(conn: &mut Conn, statement: &str) -> mysql_async::Result<()> {
    let mut tries = 0;
    loop {
        match conn.query_drop(statement).await {
            Err(mysql_async::Error::Server(e)) if ALREADY_DONE.contains(&e.code) => return Ok(()),
            Err(mysql_async::Error::Server(e)) if e.code == LOCK_WAIT_TIMEOUT => {
                tries += 1;
                if tries == DDL_TRIES {
                    let head = statement.lines().next().unwrap_or_default();
                    return Err(mysql_async::Error::Other(
                        format!(
                            "another session kept what `{head}` needs (its table, or a row it \
                             writes) in use through {tries} waits (an open transaction that read \
                             or wrote it, a long query, a backup): the migration waits for it, \
                             and every lock statement on the table would queue behind the \
                             migration; find the session (SHOW PROCESSLIST, \
                             information_schema.innodb_trx) and run migrate again"
                        )
                        .into(),
                    ));
                }
                tokio::time::sleep(DDL_PAUSE).await;
            }
            other => return other,
        }
    }
}

/// A deadlock, or on Galera a certification conflict (1213); a statement interrupted for
/// another node's DDL (1317).
const CONFLICT: &[u16] = &[1213, 1317];

/// Errors of a `GET_LOCK` that ended without being refused: the statement's time limit (MySQL
/// 3024, MariaDB 1969) or a kill (1317).
const LOCK_WAIT_ENDED: &[u16] = &[3024, 1969, 1317];

/// Applies what `shardlock_schema_version` does not list yet, adding each version applied to
/// `report`.
async fn apply(conn: &mut Conn, report: &mut MigrateReport) -> mysql_async::Result<()> {
    // Reset with the connection when it goes back to the pool (it was taken raw).
    conn.query_drop(format!(
        "SET SESSION lock_wait_timeout = {}",
        DDL_LOCK_WAIT.as_secs()
    ))
    .await?;
    conn.query_drop(VERSION_TABLE).await?;
    let done: Vec<u32> = conn
        .query("SELECT version FROM shardlock_schema_version")
        .await?;
    for &(version, name, sql) in MIGRATIONS {
        if !done.contains(&version) {
            // DDL commits on its own, so a version interrupted half-way (a lost connection,
            // a killed process) is run again from its start: a change already made is
            // recognised by the server's answer and skipped.
            for statement in statements(sql) {
                run_ddl(conn, &statement).await?;
            }
            // IGNORE: a process migrating beside this one (without the lock) recorded it first.
            conn.exec_drop(
                "INSERT IGNORE INTO shardlock_schema_version (version, name) VALUES (?, ?)",
                (version, name),
            )
            .await?;
            report.applied.push(version);
        }
        report.version = version;
    }
    // Recorded by a newer shardlock: the schema is at that version, not at this one's last.
    report.version = done.iter().copied().fold(report.version, u32::max);
    // Every acquire reads the fence floor's row (a missing one is an error there): one
    // removed by hand is made again.
    conn.query_drop(ENSURE_FENCE_FLOOR).await
}

/// The fence floor's row, if it is missing (migration 5 makes it first, at 0). A floor removed
/// by hand is lost; made again at the shard's clock, it is at least above every fence the
/// cleaner deleted here (it deletes only rows the clock has passed), where 0 would not be.
const ENSURE_FENCE_FLOOR: &str = concat!(
    "INSERT IGNORE INTO shardlock_meta (name, value) VALUES ('fence-floor', CAST(",
    crate::now_us!(),
    " AS CHAR))"
);

/// Splits a migration file into statements: `;` at the end of a line ends one; `--` lines are
/// comments. Line-based rather than a SQL tokenizer, so a migration must not end a line
/// inside a string literal with `;`.
fn statements(sql: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in sql.lines() {
        let trimmed = line.trim();
        if trimmed.starts_with("--") || trimmed.is_empty() {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if trimmed.ends_with(';') {
            let stmt = current.trim().trim_end_matches(';').to_owned();
            out.push(stmt);
            current.clear();
        }
    }
    if !current.trim().is_empty() {
        out.push(current.trim().to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migration_files_split_into_statements() {
        let s = statements(MIGRATIONS[0].2);
        assert_eq!(s.len(), 1);
        assert!(s[0].starts_with("CREATE TABLE IF NOT EXISTS shardlock_lease"));
        assert!(s[0].contains("VARBINARY(255)"));
        let s = statements(MIGRATIONS[1].2);
        assert_eq!(s.len(), 1);
        assert!(s[0].starts_with("CREATE TABLE IF NOT EXISTS shardlock_instance"));
    }
}
