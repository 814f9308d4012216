//! Runtime errors of shardlock and the classification of backend failures.

use std::time::Duration;

use crate::config::ConfigError;

/// `Result` with shardlock's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything a lock operation can fail with.
///
/// Each message says what happened and what to do next. Deadlocks (MySQL 1213) and lock wait
/// timeouts (1205) never appear here: the library retries them itself. (A release, an extend
/// or a hand-off kept behind another transaction's lock on its row for the whole server lock
/// wait answers [`Error::Unavailable`], nothing done; a release's row is given back in the
/// background once the lock goes.)
///
/// `Display` says what this error is and nothing of its cause: the cause (a [`BackendError`],
/// and under it the MySQL error) is [`source`](std::error::Error::source), so that an error
/// reporter walking the chain prints each part once. [`Error::report`] prints the whole chain
/// on one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock was not granted within the caller's `wait`.
    #[error(
        "lock `{key_label}` was not granted within {waited:?}: another owner holds it; \
         retry later or pass a longer wait"
    )]
    Timeout {
        /// The key asked for as this error shows it: the key itself with
        /// `telemetry.record-keys`, else its stable hash ([`crate::LockKey::label_hash`]), so
        /// that key contents stay out of logged errors as they stay out of spans and metrics.
        key_label: String,
        /// How long the caller waited.
        waited: Duration,
    },
    /// The shard that owns the key cannot be reached; keys are never rerouted elsewhere.
    #[error(
        "shard `{shard}` is unavailable; the key is not moved to another shard, retry once \
         the shard is back"
    )]
    Unavailable {
        /// The shard's configured name.
        shard: String,
        /// What the backend reported.
        #[source]
        source: BackendError,
    },
    /// The lease is gone: it expired before it could be renewed, was taken over, or was
    /// force-released. Work done under it may not have been exclusive.
    #[error(
        "lease on `{key_label}` was lost (expired, taken over or force-released); abandon the \
         critical section and let fenced writes reject what it would still write"
    )]
    LockLost {
        /// The key whose lease was lost, shown as in [`Error::Timeout`]: itself with
        /// `telemetry.record-keys`, else its hash.
        key_label: String,
    },
    /// The key is empty or too long.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// Why it was rejected.
        reason: String,
    },
    /// A caller-supplied value (an option, not the YAML file) is out of range.
    #[error("invalid argument `{name}`: {reason}")]
    InvalidArgument {
        /// The option's name.
        name: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// The configuration is invalid; the error names the file, line, column and field.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The shard answered with an error that is not an outage (a schema problem, say).
    #[error("shard `{shard}` failed")]
    Backend {
        /// The shard's configured name.
        shard: String,
        /// What the backend reported, kept with its MySQL source.
        #[source]
        source: BackendError,
    },
    /// A fenced write found a fence at least as new as the caller's: a newer holder has
    /// written, so this holder's write was not applied.
    #[error(
        "fenced write rejected: fence {fence} is older than the one already stored; a newer \
         holder of the lock has written, so this write was not applied"
    )]
    FenceRejected {
        /// The caller's (stale) fence.
        fence: u64,
    },
    /// The router was shut down; no new locks are granted.
    #[error("the lock router has been shut down; create a new one")]
    Shutdown,
}

impl Error {
    /// This error and its causes on one line, `error: cause: its cause`: for a log line or a
    /// message where the chain is not walked.
    pub fn report(&self) -> Report<'_> {
        Report(self)
    }

    /// Whether the shard could not be reached (as opposed to a logical outcome). Only then
    /// may a caller reasonably degrade (serve stale data, queue the work): every other error
    /// is an answer, and retrying or degrading would not change it.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }
}

/// What kind of backend failure happened; drives retries and (later) the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendErrorKind {
    /// InnoDB deadlock (1213): retried inside the library.
    Deadlock,
    /// InnoDB lock wait timeout (1205): retried inside the library.
    LockWaitTimeout,
    /// The connection could not be established or was lost mid-statement.
    Connection,
    /// The statement or the pool did not answer in time.
    Timeout,
    /// The server refused new connections (1040 and friends).
    TooManyConnections,
    /// The server is read-only (1290, 1792, 1836), or a Galera node that is not in its
    /// cluster's primary component (1047): it must not take writes; another server may.
    ReadOnly,
    /// The server is shutting down or killed the query (1053, 1927, 1317).
    ServerGone,
    /// The shard's breaker is open (or its half-open probes are all out): the call was not
    /// sent. Never recorded by the breaker itself.
    BreakerOpen,
    /// Anything else: SQL or schema errors that retrying will not fix.
    Other,
}

impl BackendErrorKind {
    /// The kind in words, as a backend error's message starts.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Deadlock => "deadlock",
            Self::LockWaitTimeout => "lock wait timeout",
            Self::Connection => "connection failed",
            Self::Timeout => "no answer in time",
            Self::TooManyConnections => "too many connections",
            Self::ReadOnly => "the server is read-only",
            Self::ServerGone => "the server is shutting down or killed the statement",
            Self::BreakerOpen => "breaker open: not sent",
            Self::Other => "error",
        }
    }

    /// Errors that the library retries by itself, at once, before reporting anything.
    ///
    /// Both are contention, not failure, and both leave nothing behind under autocommit: a
    /// deadlock victim's whole transaction is rolled back, and a lock wait timeout undoes the
    /// statement. In a multi-statement transaction 1205 undoes only the statement (unless the
    /// server runs with `innodb_rollback_on_timeout`), so the transaction's earlier work is
    /// still there and its owner must roll back before trying again.
    pub fn is_retryable(self) -> bool {
        matches!(self, Self::Deadlock | Self::LockWaitTimeout)
    }

    /// Errors that mean the shard itself is in trouble (they make a shard "unavailable").
    ///
    /// These are the failures the breaker counts: none of them is about the statement, so
    /// sending the same statement again soon would most likely fail the same way. `Other` is
    /// left out on purpose: a schema or SQL error is a bug to report, not an outage to wait
    /// out, and counting it would open the breaker on a healthy shard.
    pub fn is_infrastructure(self) -> bool {
        matches!(
            self,
            Self::Connection
                | Self::Timeout
                | Self::TooManyConnections
                | Self::ReadOnly
                | Self::ServerGone
                | Self::BreakerOpen
        )
    }

    /// The kind for a MySQL server error number.
    ///
    /// By number, never by message: messages change between versions and are translated
    /// (`lc_messages`); numbers are stable, and MySQL and MariaDB share the ones below except
    /// where a comment names one side. A number this table does not know is `Other`, which the
    /// breaker ignores, so an unknown outage code errs towards reporting the error over
    /// opening the breaker.
    pub fn from_mysql_code(code: u16) -> Self {
        match code {
            1213 => Self::Deadlock,
            1205 => Self::LockWaitTimeout,
            // 1040 the server's max_connections, 1203 the account's max_user_connections,
            // 1226 an account resource limit, 1461 the server's max_prepared_stmt_count: the
            // shard refuses work for want of a resource, whatever the statement.
            1040 | 1203 | 1226 | 1461 => Self::TooManyConnections,
            // 1290 usually `--read-only`/`super_read_only`, 1792 a read-only transaction, 1836
            // read-only mode: usually a failover left the URL on a replica, which no retry
            // of the same server fixes.
            // 1047 from a Galera node: "WSREP has not yet prepared node for application use"
            // (cut off from the primary component, or still joining), and 1180, a commit the
            // server could not complete (a Galera node that lost the primary component while
            // committing: nothing was committed); the shard's next node may serve.
            1290 | 1792 | 1836 | 1047 | 1180 => Self::ReadOnly,
            // 1053/1077 shutdown, 1152 and 1158-1161 the server aborted or lost the
            // connection, 1317 the query was killed, 1927 the connection was killed (MariaDB's
            // number), 4031 the server dropped an idle connection (MySQL 8.0.24+).
            1053 | 1077 | 1152 | 1158 | 1159 | 1160 | 1161 | 1317 | 1927 | 4031 => Self::ServerGone,
            // 3572 (MySQL's NOWAIT answer for a locked row) stays `Other`: it means "busy",
            // which the transaction lock recognises by number; as an outage it would open the
            // breaker whenever a row is contended.
            _ => Self::Other,
        }
    }
}

/// An error and its chain of sources on one line, `error: cause: its cause`:
/// [`Error::report`], or `Report(&e)` for any error.
#[derive(Debug, Clone, Copy)]
pub struct Report<'a>(pub &'a (dyn std::error::Error + 'static));

impl Report<'_> {
    /// The error's `Display`, then each source's, each said once: a source whose text the part
    /// before it already contains is left out (some errors outside shardlock, an I/O error
    /// inside a driver's error for one, print their source in their own message too).
    pub fn parts(&self) -> Vec<String> {
        let mut parts = vec![self.0.to_string()];
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if !parts.last().is_some_and(|said| said.contains(&text)) {
                parts.push(text);
            }
            source = cause.source();
        }
        parts
    }
}

impl std::fmt::Display for Report<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.parts().join(": "))
    }
}

/// A backend failure: its kind, the MySQL error number when there is one, and the source.
#[derive(Debug, thiserror::Error)]
#[error("{}{}", kind.describe(), code.map(|c| format!(" (MySQL error {c})")).unwrap_or_default())]
pub struct BackendError {
    /// The classification.
    pub kind: BackendErrorKind,
    /// The MySQL server error number, if the server answered with one.
    pub code: Option<u16>,
    /// The underlying error (a `mysql_async::Error` for the MySQL backend; one `source()`
    /// further down when a force-release says what it did on other shards before this one
    /// failed).
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync + 'static>,
    /// Whether the statement may have reached the server before it failed (a timeout or a
    /// broken connection mid-statement), or an earlier statement of the same call did (a
    /// batch's write, before its key was sent again alone): its effect is then unknown. False
    /// when nothing of the call surely ever left (no connection, breaker open).
    pub maybe_applied: bool,
}

impl BackendError {
    /// A backend error of `kind` with the given source. `maybe_applied` starts false: only
    /// the shard's statement runner knows whether the statement left the process, and it
    /// sets the flag itself.
    pub fn new(
        kind: BackendErrorKind,
        code: Option<u16>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    ) -> Self {
        Self {
            kind,
            code,
            source: source.into(),
            maybe_applied: false,
        }
    }

    /// A statement or pool timeout.
    pub fn timeout(what: impl Into<String>) -> Self {
        Self::new(BackendErrorKind::Timeout, None, what.into())
    }

    /// Turns this into the caller-facing error for `shard`: [`Error::Unavailable`] for an
    /// infrastructure failure (retry once the shard is back), [`Error::Backend`] for anything
    /// else (retrying will not help). The backend error stays attached as the source either
    /// way, so its MySQL number reaches logs.
    pub fn into_error(self, shard: &str) -> Error {
        if self.kind.is_infrastructure() {
            Error::Unavailable {
                shard: shard.to_owned(),
                source: self,
            }
        } else {
            Error::Backend {
                shard: shard.to_owned(),
                source: self,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_mysql_codes_by_number() {
        assert!(BackendErrorKind::from_mysql_code(1213).is_retryable());
        assert!(BackendErrorKind::from_mysql_code(1205).is_retryable());
        assert!(BackendErrorKind::from_mysql_code(1290).is_infrastructure());
        assert!(BackendErrorKind::from_mysql_code(1040).is_infrastructure());
        assert!(BackendErrorKind::from_mysql_code(1461).is_infrastructure());
        let syntax = BackendErrorKind::from_mysql_code(1064);
        assert!(!syntax.is_retryable() && !syntax.is_infrastructure());
    }

    #[test]
    fn infrastructure_failures_become_unavailable() {
        let e = BackendError::timeout("statement").into_error("s1");
        assert!(matches!(e, Error::Unavailable { ref shard, .. } if shard == "s1"));
        let e = BackendError::new(BackendErrorKind::Other, Some(1146), "no table").into_error("s2");
        assert!(matches!(e, Error::Backend { .. }));
        assert!(e.to_string().contains("s2"));
    }
}
