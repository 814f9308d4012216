//! One shard: its pool, its statement timeout, and the lease operations on it.

use std::sync::Arc;
use std::time::Duration;

use deadpool::Runtime;
use futures_util::future::BoxFuture;
use mysql_async::{Conn, Opts, OptsBuilder};
use rand::Rng;
use shardlock_core::config::ShardConfig;
use shardlock_core::{BackendError, BackendErrorKind, ConfigError};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tracing::Instrument;

use crate::batch::{self, BatchGrants};
use crate::carry::{self, CasRow, CopyCas, MovingJob, PendingJob};
use crate::cleaner::{self, Beat, Deleted, Heartbeat, InstanceRow, Scanned};
use crate::error::{classify, classify_pool};
use crate::lease::{
    self, Attempt, FenceRow, GrantRequest, HandoffOutcome, LeaseRow, ReleaseAnswer, Released,
    RenewOutcome,
};
use crate::migrate::{self, MigrateReport};
use crate::pool::{
    lock_wait_timeout_secs, session_setup, Lifetimes, SessionConn, SessionId, ShardConn,
    ShardManager, ShardPool, GALERA_SYNC_WAIT,
};
use crate::stranded::{Ending, Lister, MOST_STRANDED};

/// A shard: a named MySQL server (or schema) holding lease rows.
#[derive(Debug)]
pub struct Shard {
    name: String,
    pool: ShardPool,
    statement_timeout: Duration,
    /// Where the shard is, for the database client spans of its calls.
    server: Server,
    /// Sessions whose statement may still be on its way to the server (see
    /// [`crate::stranded`]).
    stranded: Lister,
    /// The pool's connections that sessions of the caller's own may use at once (see
    /// `caller_sessions`).
    sessions: Arc<Semaphore>,
    /// How long a caller's session waits for one of them.
    session_wait: Duration,
}

/// How many of a pool of `max_size` connections callers' sessions (transaction locks, the
/// caller's SQL) may hold at once: all but a quarter (at least one, from a pool of two). Such
/// a session is held as long as its caller likes, and a transaction lock's waits for its row
/// for as long as the lock is held elsewhere; had they taken every connection, the lease
/// statements, renewals and heartbeats of the process would wait for the pool until its
/// wait-timeout, and those timeouts, counted against the shard, would open its breaker on a
/// shard that answers (with `on-shard-failure: local`, in-process locks of keys that others
/// hold there).
pub(crate) fn caller_sessions(max_size: usize) -> usize {
    match max_size {
        0 | 1 => max_size,
        _ => max_size - (max_size / 4).max(1),
    }
}

/// A try's statement on the wire: its session is listed as stranded if the try is dropped
/// before the answer (a timeout, or a caller gone) or the answer is lost. Either way the pool
/// discards the connection (mid-statement, or broken), so no later try ends a session in use.
struct OnTheWire<'a> {
    shard: &'a Shard,
    session: Option<SessionId>,
}

impl OnTheWire<'_> {
    /// The try ended: `lost` when its outcome is unknown.
    fn answered(mut self, lost: bool) {
        let session = self.session.take();
        if let Some(session) = session.filter(|_| lost) {
            self.shard.stranded.strand(session, Ending::UntilGone);
        }
    }
}

impl Drop for OnTheWire<'_> {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            self.shard.stranded.strand(session, Ending::UntilGone);
        }
    }
}

/// An acquire's answer, `attempt`, marked with whether a try before the one that answered may
/// have reached the server (`lost_try`, its reply lost). Someone else's row then proves
/// nothing of that try: where its session cannot be ended before the retry (a Galera node; a
/// proxy that keeps sessions of its own; a session the shard stopped waiting for, see
/// [`crate::stranded`]), its statement may still be on its way, and take the key once the row
/// is free, for an owner its caller no longer counts as holding anything; a grant's row,
/// once released, may be taken again by it.
fn after(attempt: Attempt, lost: Lost) -> Attempt {
    match attempt {
        Attempt::Held { held_for_ms, .. } => Attempt::Held {
            held_for_ms,
            after_lost_try: lost.applied,
        },
        // Only a try that may still land can take the row again once it is released: one
        // whose session was ended before the retry cannot.
        Attempt::Granted { fence, .. } => Attempt::Granted {
            fence,
            after_lost_try: lost.in_flight,
        },
        attempt => attempt,
    }
}

/// What the tries of a call before the one that answered may have done.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Lost {
    /// One may have reached the server (its reply lost): what the answer found may be its
    /// doing, or (where its session could not be ended) it may still land.
    pub(crate) applied: bool,
    /// One may still reach the server after the answer: its session could not be ended before
    /// the next try (a Galera node, a proxy that keeps sessions of its own).
    pub(crate) in_flight: bool,
}

/// Whether a try's error leaves its outcome unknown, the statement sent: a broken connection
/// or a timeout. A server's error reply means the statement did nothing, and `Other` is a
/// reply read and refused here (an acquire that found no fence floor wrote nothing).
fn is_lost(err: &BackendError) -> bool {
    err.code.is_none() && err.kind != BackendErrorKind::Other
}

/// How a call's tries are made.
#[derive(Debug, Clone, Copy)]
struct Tries {
    /// A try whose connection broke after its statement was sent is made again (an idempotent
    /// statement); a connection that broke before is always tried again.
    retry_broken: bool,
    /// The server's lock wait timeout (1205) is the answer, not tried again: a statement on
    /// the rows of one owner (a release, an extend, a hand-off), which another transaction's
    /// lock on them holds up, would only wait behind the same lock into the client's timeout.
    answer_lock_waits: bool,
}

impl Tries {
    const IDEMPOTENT: Self = Self {
        retry_broken: true,
        answer_lock_waits: false,
    };
    const ONCE: Self = Self {
        retry_broken: false,
        answer_lock_waits: false,
    };
    const ROW_IDEMPOTENT: Self = Self {
        retry_broken: true,
        answer_lock_waits: true,
    };
    const ROW_ONCE: Self = Self {
        retry_broken: false,
        answer_lock_waits: true,
    };
}

/// A shard's server as OpenTelemetry's database attributes name it.
#[derive(Debug)]
struct Server {
    address: String,
    port: u16,
    database: String,
}

/// The pool's state, for `status` and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStatus {
    /// Most connections allowed.
    pub max_size: usize,
    /// Connections open now.
    pub size: usize,
    /// Idle connections ready for use.
    pub available: usize,
    /// Callers waiting for a connection.
    pub waiting: usize,
    /// Sessions whose statement may still reach the server, ended before the shard's next
    /// statement (see [`Shard`]): a connection broke, or timed out, with a statement on the
    /// wire, and no statement has looked them up since.
    pub stranded: usize,
}

/// The shard's password from `password` or `password-file`, if either is given. The file is
/// read here to report a missing one at once, and again for every new connection.
fn password(config: &ShardConfig, index: usize) -> Result<Option<String>, ConfigError> {
    if let Some(password) = &config.password {
        return Ok(Some(password.expose().to_owned()));
    }
    let Some(path) = &config.password_file else {
        return Ok(None);
    };
    crate::pool::read_password_file(path)
        .map(Some)
        .map_err(|e| ConfigError::field(format!("shards[{index}].password-file"), e.to_string()))
}

/// The driver's options for reaching `config`'s shard as shardlock does: its URL, the user and
/// password given beside it (a password file read now) and its TLS — for a connection or pool
/// of the application's own next to the shard's locks (`index`: the shard's place in `shards`,
/// for errors).
///
/// With TLS mode `preferred` the options ask for TLS, and a server that offers none refuses
/// them with `DriverError::NoClientSslFlagFromServer`: shardlock's own pools then connect again
/// without TLS; a caller of these options does the same (`OptsBuilder::ssl_opts(None)`). With
/// `verify-ca` the options check the URL's host name too (as `verify-identity` does): shardlock's
/// pools first read a name off the server's certificate, once its chain is checked.
pub fn connect_opts(config: &ShardConfig, index: usize) -> Result<Opts, ConfigError> {
    let opts = Opts::from_url(&config.url).map_err(|e| {
        ConfigError::field(
            format!("shards[{index}].url"),
            format!("cannot parse the URL: {e}"),
        )
    })?;
    let mut opts = OptsBuilder::from_opts(opts);
    if let Some(user) = &config.user {
        opts = opts.user(Some(user));
    }
    if let Some(password) = password(config, index)? {
        opts = opts.pass(Some(password));
    }
    Ok(crate::tls::apply(opts, &config.tls, index)?.into())
}

impl Shard {
    /// Builds the shard's pool from its config (`index` is its position in `shards`, for
    /// error messages). Connects lazily: nothing is opened until first use.
    pub fn new(config: &ShardConfig, index: usize) -> Result<Self, ConfigError> {
        let opts = connect_opts(config, index)?;
        // `client_found_rows`: affected rows count the rows a statement matched, not those it
        // changed. Every "whether it did" answer relies on it: a renewal in the same
        // millisecond as the last one, or a fence raised to the value it had, changes nothing
        // yet must still say the owner holds the row.
        // `stmt_cache_size`: each cached statement is prepared on the server and counts
        // against its global `max_prepared_stmt_count` (16,382 by default); 128 per connection
        // keeps the fixed lease statements and the power-of-two IN-list shapes cached, but with
        // the default pool of 16, eight processes on one shard can reach the limit. A
        // connection that hits it (1461) is closed, freeing its statements, and the statement
        // is retried on another.
        let server = Server {
            address: opts.ip_or_hostname().to_owned(),
            port: opts.tcp_port(),
            database: opts.db_name().unwrap_or_default().to_owned(),
        };
        let mut setup = session_setup(lock_wait_timeout_secs(config.statement_timeout));
        if !config.nodes.is_empty() {
            // Every statement waits until the node has applied every write the cluster
            // committed before it (see `GALERA_SYNC_WAIT`).
            setup.push(format!(
                "SET SESSION wsrep_sync_wait = {GALERA_SYNC_WAIT}, wsrep_dirty_reads = OFF"
            ));
        }
        let opts = OptsBuilder::from_opts(opts)
            .client_found_rows(true)
            .tcp_nodelay(true)
            .stmt_cache_size(128)
            .setup(setup);
        let lifetimes = Lifetimes {
            idle_check: config.pool.idle_check,
            idle_timeout: config.pool.idle_timeout,
            max_lifetime: config.pool.max_lifetime,
        };
        let manager = ShardManager::new(opts.into(), lifetimes, config.password_file.clone())
            .plaintext_fallback(config.tls.mode == shardlock_core::config::TlsMode::Preferred)
            .verify_ca(
                (config.tls.mode == shardlock_core::config::TlsMode::VerifyCa)
                    .then(|| config.tls.ca_file.clone())
                    .flatten(),
            )
            .nodes(crate::pool::Nodes::new(
                &config.nodes,
                (config.pool.create_timeout / (config.nodes.len().max(1) as u32))
                    .max(Duration::from_millis(200)),
                config.node_clock_skew,
                config.statement_timeout,
            ));
        let pool = ShardPool::builder(manager)
            .max_size(config.pool.max_size)
            .wait_timeout(Some(config.pool.wait_timeout))
            .create_timeout(Some(config.pool.create_timeout))
            .recycle_timeout(Some(config.pool.recycle_timeout))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| ConfigError::field(format!("shards[{index}].pool"), e.to_string()))?;
        Ok(Self {
            name: config.name.clone(),
            pool,
            statement_timeout: config.statement_timeout,
            server,
            stranded: Lister::new(&config.name, MOST_STRANDED.max(2 * config.pool.max_size)),
            sessions: Arc::new(Semaphore::new(caller_sessions(config.pool.max_size))),
            session_wait: config.pool.wait_timeout,
        })
    }

    /// This shard, replacing `old` in a reload, with the sessions `old` has stranded: its pool
    /// closes, but a statement on its way to one of them may still reach the server, and `old`
    /// keeps serving calls that began before the reload.
    pub fn with_stranded_of(mut self, old: &Shard) -> Self {
        self.stranded.sessions = old.stranded.sessions.clone();
        self
    }

    /// Ends every listed session of `conn`'s server first (see [`crate::stranded`]); a
    /// session still there two statement timeouts after it was ended is let go.
    async fn end_stranded(&self, conn: &mut ShardConn) -> mysql_async::Result<()> {
        if !self.stranded.sessions.any() {
            return Ok(());
        }
        self.stranded
            .sessions
            .end(&self.name, conn, 2 * self.statement_timeout)
            .await
    }

    /// How long a call to this shard may be slowed for a reason that is not the shard's
    /// failing: on a Galera shard, the longest its cluster may take to evict a dead member
    /// (from its `evs.inactive_timeout`), during which every node's commits wait; zero on a
    /// plain shard.
    pub fn stall_allowance(&self) -> Duration {
        self.pool.manager().eviction_time()
    }

    /// The shard's configured name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The configured upper bound of one statement.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// Runs the statement function `f` on a pooled connection within the statement timeout,
    /// with `args` (what it borrows, lent to every try).
    ///
    /// Deadlocks and lock wait timeouts are retried until the time is up; so is a broken
    /// connection (a stale pooled one after a shard restart, say), once. `f` must therefore be
    /// idempotent in effect, as every lease statement is (a retried acquire by the same owner
    /// finds its own row).
    ///
    /// Cancellation: dropping the future mid-statement discards the connection (the pool sees
    /// it was in flight); whether the statement took effect on the server is then unknown.
    pub(crate) async fn run<A: Sync, T>(
        &self,
        operation: &'static str,
        args: A,
        f: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<T>>,
    ) -> Result<T, BackendError> {
        self.run_as(operation, args, f, Tries::IDEMPOTENT).await
    }

    /// [`Shard::run`] for a statement on the row of one owner (a release, an extend, a hold):
    /// the server's lock wait timeout (1205, another transaction holds the row) is the answer,
    /// not sent again (see [`Tries::answer_lock_waits`]).
    pub(crate) async fn run_row<A: Sync, T>(
        &self,
        operation: &'static str,
        args: A,
        f: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<T>>,
    ) -> Result<T, BackendError> {
        self.run_as(operation, args, f, Tries::ROW_IDEMPOTENT).await
    }

    /// [`Shard::run`] with its tries made as `tries` says, within the statement timeout.
    async fn run_as<A: Sync, T>(
        &self,
        operation: &'static str,
        args: A,
        f: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<T>>,
        tries: Tries,
    ) -> Result<T, BackendError> {
        self.with_conn(operation, self.statement_timeout, &args, f, tries)
            .await
            .map(|(v, _)| v)
    }

    /// [`Shard::run`] for a conditional write answered by whether it changed its row. When it
    /// did not and a try before the one that answered may have reached the server (its reply
    /// lost), the row may be as it is because of that try: `confirm` reads whether it is.
    pub(crate) async fn run_confirmed<A: Sync>(
        &self,
        operation: &'static str,
        args: A,
        write: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<bool>>,
        confirm: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<bool>>,
    ) -> Result<bool, BackendError> {
        let (changed, lost_try) = self
            .with_conn(
                operation,
                self.statement_timeout,
                &args,
                write,
                Tries::IDEMPOTENT,
            )
            .await?;
        if changed || !lost_try.applied {
            return Ok(changed);
        }
        self.run(operation, args, confirm).await
    }

    /// [`Shard::run`] for statements that are not idempotent: a connection that broke after
    /// the statement may have reached the server is not retried (the error says so,
    /// [`BackendError::maybe_applied`]); deadlocks and lock wait timeouts, which undo the
    /// statement, still are.
    pub(crate) async fn run_once<A: Sync, T>(
        &self,
        operation: &'static str,
        args: A,
        f: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<T>>,
    ) -> Result<T, BackendError> {
        self.run_as(operation, args, f, Tries::ONCE).await
    }

    /// A database client span for one call (`operation`, tries included), with
    /// OpenTelemetry's database attributes; its error attributes are filled in by
    /// [`Shard::failed`].
    fn client_span(&self, operation: &'static str) -> tracing::Span {
        let server = &self.server;
        tracing::info_span!(
            "shardlock.shard_call",
            otel.name = format!("{operation} {}", server.database),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            db.system.name = tracing::field::Empty,
            db.namespace = server.database.as_str(),
            db.operation.name = operation,
            server.address = server.address.as_str(),
            server.port = server.port,
            shardlock.shard = self.name.as_str(),
            error.type = tracing::field::Empty,
        )
    }

    /// Marks `span` failed with `err`: `error.type` is its MySQL error number, or its kind.
    fn failed(span: &tracing::Span, err: &BackendError) {
        span.record("otel.status_code", "error");
        match err.code {
            Some(code) => span.record("error.type", code),
            None => span.record("error.type", format!("{:?}", err.kind)),
        };
    }

    /// Runs `f` as a traced call (see [`Shard::run`]); the answer, and whether a try before
    /// the one that answered may have reached the server (its reply lost): what the answer
    /// found may then be that try's doing.
    async fn with_conn<A: Sync, T>(
        &self,
        operation: &'static str,
        timeout: Duration,
        args: &A,
        f: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<T>>,
        tries: Tries,
    ) -> Result<(T, Lost), BackendError> {
        let span = self.client_span(operation);
        let result = self
            .with_conn_tries(timeout, args, f, tries)
            .instrument(span.clone())
            .await;
        // Known once a connection was made (this call's, most of the time).
        span.record(
            "db.system.name",
            self.pool.manager().server_kind().system_name(),
        );
        if let Err(e) = &result {
            Self::failed(&span, e);
        }
        result
    }

    async fn with_conn_tries<A: Sync, T>(
        &self,
        timeout: Duration,
        args: &A,
        f: impl for<'c> Fn(&'c mut Conn, &'c A) -> BoxFuture<'c, mysql_async::Result<T>>,
        Tries {
            retry_broken,
            answer_lock_waits,
        }: Tries,
    ) -> Result<(T, Lost), BackendError> {
        let deadline = Instant::now() + timeout;
        let mut reconnected = false;
        // Set once a statement may have reached the server: a failure after that leaves its
        // effect unknown (`BackendError::maybe_applied`). Atomic rather than a `Cell` because
        // the future borrowing it must be `Send`, which a shared `&Cell` is not.
        let sent = std::sync::atomic::AtomicBool::new(false);
        // The Galera node of the connection the try runs on (0 on a plain shard), and when the
        // try sent its statement (µs after the call began).
        let node = std::sync::atomic::AtomicUsize::new(0);
        let began = Instant::now();
        let sent_at = std::sync::atomic::AtomicU64::new(0);
        // Whether the try's connection broke (its server dropped it), not merely failed.
        let broke = std::sync::atomic::AtomicBool::new(false);
        // Whether an earlier try may have applied: a later try's clean server error (a
        // deadlock, say) does not undo that.
        let mut applied_before = false;
        // Whether an earlier try may still apply: its session could not be listed to be ended
        // before the next try (see `crate::stranded`).
        let mut in_flight_before = false;
        // Whether this try's session can be ended should its statement be lost on the way.
        let endable = std::sync::atomic::AtomicBool::new(false);
        loop {
            // Each try from unsent: only a statement of this try may have reached the server
            // now (`applied_before` remembers earlier ones).
            sent.store(false, std::sync::atomic::Ordering::Relaxed);
            let attempt = tokio::time::timeout_at(deadline, async {
                let mut conn = self.pool.get().await.map_err(classify_pool)?;
                node.store(conn.node(), std::sync::atomic::Ordering::Relaxed);
                // Bounded by the try's deadline.
                self.end_stranded(&mut conn).await.map_err(classify)?;
                sent_at.store(
                    began.elapsed().as_micros() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                sent.store(true, std::sync::atomic::Ordering::Relaxed);
                let session = conn.session();
                endable.store(session.is_some(), std::sync::atomic::Ordering::Relaxed);
                let on_wire = OnTheWire {
                    shard: self,
                    session,
                };
                let answer = conn.run(|c| f(c, args)).await.map_err(classify);
                broke.store(
                    answer.is_err() && conn.is_broken(),
                    std::sync::atomic::Ordering::Relaxed,
                );
                // A connection still usable was answered: nothing of it is left on the way.
                on_wire.answered(answer.as_ref().is_err_and(is_lost) && conn.is_broken());
                answer
            })
            .await;
            let mut err = match attempt {
                Ok(Ok(v)) => {
                    let lost = Lost {
                        applied: applied_before,
                        in_flight: in_flight_before,
                    };
                    return Ok((v, lost));
                }
                Ok(Err(e)) => e,
                Err(_) => BackendError::timeout(format!(
                    "no answer within {timeout:?} (statement-timeout)"
                )),
            };
            // A server's error reply means the statement did nothing; a broken connection or a
            // timeout after sending leaves it unknown. `Other` is a reply read and refused here
            // (an acquire that found no fence floor wrote nothing), not a lost one.
            // 1180: a Galera node lost the primary component while committing; the survivors
            // may have applied the write, so its outcome is unknown too.
            let lost = is_lost(&err);
            let on_wire = sent.load(std::sync::atomic::Ordering::Relaxed);
            let this_try = on_wire && (lost || err.code == Some(1180));
            err.maybe_applied = applied_before || this_try;
            applied_before = err.maybe_applied;
            in_flight_before |= this_try && !endable.load(std::sync::atomic::Ordering::Relaxed);
            let node = node.load(std::sync::atomic::Ordering::Relaxed);
            let on_node = sent.load(std::sync::atomic::Ordering::Relaxed);
            let manager = self.pool.manager();
            if err.kind == BackendErrorKind::Timeout {
                // On a Galera shard, a node that stops answering a statement (frozen, cut
                // off) is left: new connections go to the next one, and no caller is handed
                // another connection to it to wait out its timeout on. A wait for a pooled
                // connection that timed out says nothing of any node, nor does a statement
                // sent with less than half the time left (the wait took the rest), nor one
                // given less than the statement timeout (a renewal bounded by a lease about
                // to end).
                let waited =
                    Duration::from_micros(sent_at.load(std::sync::atomic::Ordering::Relaxed));
                let full = timeout >= self.statement_timeout;
                if manager.has_nodes() && on_node && full && waited <= timeout / 2 {
                    manager.leave_node(node);
                    self.pool.retain(|c, _| c.node() != node);
                }
                return Err(err);
            }
            // The server refuses writes: a demoted primary, which a failover's new DNS answer
            // no longer names; or, on a Galera shard, the node of this connection is gone or
            // out of the primary component. Every idle connection was opened to it too;
            // closing them all sends the retry, and every later call, through a new
            // connection (to the next node), instead of handing each caller in turn a dead
            // one. (A connection that could not be made was to no node in particular.)
            if err.kind == BackendErrorKind::ReadOnly && !manager.has_nodes() {
                manager.retire_all();
                self.pool.retain(|_, _| false);
            } else if err.kind == BackendErrorKind::Connection
                && broke.load(std::sync::atomic::Ordering::Relaxed)
                && !manager.has_nodes()
            {
                // A connection the server dropped (a restart, a kill of the process's sessions,
                // a proxy that cut them) says the idle ones were likely dropped too: they are
                // closed, so that the retry runs on a new connection rather than on the next
                // dead one (each would cost the call its one retry).
                self.pool.retain(|_, _| false);
            } else if manager.has_nodes() && on_node {
                // A node that refuses (out of the primary component, read-only) is passed
                // over for a while too; a broken connection alone does not say the node is
                // gone (the next connection finds out).
                let refused = err.kind == BackendErrorKind::ReadOnly;
                if refused || err.kind == BackendErrorKind::Connection {
                    if refused {
                        manager.leave_node(node);
                    } else {
                        manager.node_failed(node);
                    }
                    self.pool.retain(|c, _| c.node() != node);
                }
            }
            // A broken connection (or one at the server's prepared-statement limit, or to a
            // read-only server, now closed) is retried once, on a new connection.
            let retry = err.kind.is_retryable()
                || ((err.kind == BackendErrorKind::Connection
                    || err.kind == BackendErrorKind::ReadOnly
                    || err.code == Some(crate::pool::PREPARED_STATEMENT_LIMIT))
                    && (retry_broken || !err.maybe_applied)
                    && !std::mem::replace(&mut reconnected, true));
            // A try with under 2 ms left could not finish: report this error, which says what
            // happened, rather than a timeout that leaves the outcome looking unknown. A
            // statement on one row that answers lock waits would only wait behind the same
            // lock again, into our timeout (outcome unknown), instead of this answer.
            let answered = answer_lock_waits && err.kind == BackendErrorKind::LockWaitTimeout;
            if !retry || answered || Instant::now() + Duration::from_millis(2) >= deadline {
                return Err(err);
            }
            // Deadlock victims that retry at the same instant deadlock again; a few ms of
            // jitter lets one of them go first. A broken connection is retried at once.
            if err.kind.is_retryable() {
                tracing::debug!(shard = %self.name, code = ?err.code, "retrying after a deadlock or lock wait timeout");
                let jitter = rand::rng().random_range(1..=4);
                tokio::time::sleep(Duration::from_millis(jitter)).await;
            }
        }
    }

    /// Tries to grant `req` in one statement: [`Attempt::Granted`] with the first fence (fences
    /// `first ..= first + req.reserve` are this grant's), [`Attempt::Held`] when a live
    /// lease of someone else holds the key, or [`Attempt::Locked`] when another transaction
    /// kept the key's row locked for longer than the server waits (the caller asks again, as
    /// for a held key, within its own wait).
    ///
    /// `Held` says whether a try before the one that answered may have reached the server
    /// (`after_lost_try`): that try may still land.
    pub async fn acquire(&self, req: &GrantRequest) -> Result<Attempt, BackendError> {
        Ok(self.acquire_telling_lost_try(req).await?.0)
    }

    /// [`Shard::acquire`], and whether a try of it before the one answered had its reply lost
    /// (it may have written, or still write: an [`Attempt::Locked`] may be the retry waiting
    /// behind that try's own lock).
    pub async fn acquire_telling_lost_try(
        &self,
        req: &GrantRequest,
    ) -> Result<(Attempt, bool), BackendError> {
        let timeout = self.statement_timeout;
        let (attempt, lost_try) = self
            .with_conn(
                "acquire",
                timeout,
                &req,
                |c, &req| Box::pin(lease::acquire(c, req)),
                Tries::IDEMPOTENT,
            )
            .await?;
        Ok((after(attempt, lost_try), lost_try.applied))
    }

    /// Tries to grant every request: one write for all keys with the single acquire's
    /// conditions, then, unless the server reported every row as new, one read-back (owners
    /// are unique per attempt, so a row carrying a request's owner is its grant). Keys
    /// distinct, at most [`crate::MAX_BATCH`].
    pub async fn acquire_batch(&self, reqs: &[GrantRequest]) -> Result<BatchGrants, BackendError> {
        let reqs: Vec<&GrantRequest> = reqs.iter().collect();
        let timeout = self.statement_timeout;
        // Set by any try whose write committed: a failure after it (the read-back's, or a
        // later try's that sent nothing) leaves that write's grants, unknown to the caller.
        let wrote = std::sync::atomic::AtomicBool::new(false);
        let (mut grants, lost_try) = self
            .with_conn(
                "acquire_batch",
                timeout,
                &(reqs, &wrote),
                |c, (reqs, wrote)| Box::pin(batch::acquire_batch(c, reqs, wrote)),
                Tries::IDEMPOTENT,
            )
            .await
            .map_err(|mut e| {
                e.maybe_applied |= wrote.load(std::sync::atomic::Ordering::Relaxed);
                e
            })?;
        for attempt in &mut grants.attempts {
            *attempt = after(*attempt, lost_try);
        }
        grants.after_lost_try = lost_try.applied;
        Ok(grants)
    }

    /// Releases every (key, owner) still held, in one statement; whether each was released
    /// (see [`Shard::release`]; a batch that frees a row which shows something else by the time
    /// it reads the rows back cannot tell which free rows it freed itself, and then counts
    /// each as released).
    pub async fn release_batch(
        &self,
        leases: &[(Vec<u8>, String)],
    ) -> Result<Vec<ReleaseAnswer>, BackendError> {
        let leases: Vec<(&[u8], &str)> = leases
            .iter()
            .map(|(k, o)| (k.as_slice(), o.as_str()))
            .collect();
        let (found, after_unknown) = self
            .with_conn(
                "release_batch",
                self.statement_timeout,
                &leases,
                |c, leases| Box::pin(batch::release_batch(c, leases)),
                Tries::ROW_IDEMPOTENT,
            )
            .await?;
        Ok(found
            .into_iter()
            .map(|f| released(f, after_unknown.applied))
            .collect())
    }

    /// Releases `key` if `owner` still holds it, or answers released when the row shows
    /// `owner`'s own tombstone (it released it before); [`ReleaseAnswer::NotHeld`] when it
    /// did not: another owner holds it, or it was freed otherwise (force-released, deleted by
    /// the cleaner).
    ///
    /// Retried once on a broken connection, like the other idempotent statements here: if the
    /// first try may have reached the server and the retry finds the row showing `owner`'s
    /// tombstone, that try freed it (only its reply was lost), and the answer is
    /// [`ReleaseAnswer::Released`]; a row freed by force (no owner) is
    /// [`ReleaseAnswer::NotHeld`]; another owner, or a free row that does not say who freed
    /// it, [`ReleaseAnswer::TakenAfterLostReply`].
    pub async fn release(&self, key: &[u8], owner: &str) -> Result<ReleaseAnswer, BackendError> {
        self.release_after(key, owner, None).await
    }

    /// [`Shard::release`], leaving the key taken (by `owner`, unrenewed) until `at_least`
    /// after the grant when that is set and has not passed yet.
    pub async fn release_after(
        &self,
        key: &[u8],
        owner: &str,
        at_least: Option<Duration>,
    ) -> Result<ReleaseAnswer, BackendError> {
        let (found, after_unknown) = self
            .with_conn(
                "release",
                self.statement_timeout,
                &(key, owner, at_least),
                |c, &(key, owner, at_least)| Box::pin(lease::release(c, key, owner, at_least)),
                Tries::ROW_IDEMPOTENT,
            )
            .await?;
        Ok(released(found, after_unknown.applied))
    }

    /// Moves the end of `owner`'s live lease of `key` to at least `by` from the shard's now;
    /// `false` when it is not a live lease of `owner` any more.
    pub async fn extend(
        &self,
        key: &[u8],
        owner: &str,
        by: Duration,
    ) -> Result<bool, BackendError> {
        self.run_row("extend", (key, owner, by), |c, &(key, owner, by)| {
            Box::pin(lease::extend(c, key, owner, by))
        })
        .await
    }

    /// Moves the end of `owner`'s live lease of `key` to at least `after_grant` past its grant
    /// and its stored fence to at least `fence` (every later grant's is above it); `false` when
    /// it is not a live lease of `owner` any more.
    pub async fn hold_until(
        &self,
        key: &[u8],
        owner: &str,
        after_grant: Duration,
        fence: u64,
    ) -> Result<bool, BackendError> {
        self.run_row(
            "hold_until",
            (key, owner, after_grant, fence),
            |c, &(key, owner, after_grant, fence)| {
                Box::pin(lease::hold_until(c, key, owner, after_grant, fence))
            },
        )
        .await
    }

    /// Stores `data` with `owner`'s live lease of `key`; `false` when it is not a live lease of
    /// `owner` any more.
    pub async fn set_data(
        &self,
        key: &[u8],
        owner: &str,
        data: &[u8],
    ) -> Result<bool, BackendError> {
        self.run_row("set_data", (key, owner, data), |c, &(key, owner, data)| {
            Box::pin(lease::set_data(c, key, owner, data))
        })
        .await
    }

    /// Lease rows matching `filter`, in key order, with their stored keys.
    pub async fn list(
        &self,
        filter: &lease::ListFilter,
    ) -> Result<Vec<(Vec<u8>, LeaseRow)>, BackendError> {
        self.run("list", filter, |c, &filter| {
            Box::pin(lease::list(c, filter))
        })
        .await
    }

    /// The shard's clock at `owner`'s grant of `key`, ms since the epoch; `None` when `owner`
    /// does not hold it.
    pub async fn granted_at_ms(
        &self,
        key: &[u8],
        owner: &str,
    ) -> Result<Option<u64>, BackendError> {
        self.run("granted_at", (key, owner), |c, &(key, owner)| {
            Box::pin(lease::granted_at_ms(c, key, owner))
        })
        .await
    }

    /// Raises the stored fence of `key`, held by `owner`, to at least `fence`; `false` when
    /// `owner` no longer holds it.
    pub async fn raise_fence(
        &self,
        key: &[u8],
        owner: &str,
        fence: u64,
    ) -> Result<bool, BackendError> {
        self.run_row(
            "raise_fence",
            (key, owner, fence),
            |c, &(key, owner, fence)| Box::pin(lease::raise_fence(c, key, owner, fence)),
        )
        .await
    }

    /// Up to `limit` rows' keys and fences (and live owners), in key order after `after`.
    pub async fn fences_after(
        &self,
        after: &[u8],
        limit: usize,
    ) -> Result<Vec<FenceRow>, BackendError> {
        self.run("fences_after", (after, limit), |c, &(after, limit)| {
            Box::pin(lease::fences_after(c, after, limit))
        })
        .await
    }

    /// Up to `limit` owned CAS rows in key order after `after` (carrying moved keys).
    pub async fn owned_cas_after(
        &self,
        after: &[u8],
        limit: usize,
    ) -> Result<Vec<CasRow>, BackendError> {
        self.run("owned_cas_after", (after, limit), |c, &(after, limit)| {
            Box::pin(carry::owned_cas_after(c, after, limit))
        })
        .await
    }

    /// Writes carried CAS rows here where the key's row is free, as copies named by `token`
    /// (see the carry module).
    pub async fn adopt_cas(&self, rows: &[CasRow], token: &str) -> Result<bool, BackendError> {
        self.run("adopt_cas", (rows, token), |c, &(rows, token)| {
            Box::pin(carry::adopt_cas(c, rows, token))
        })
        .await
    }

    /// Carries the CAS row of `key`, if it is owned, to where its key now lives: `copy` writes
    /// it there while the row is held locked here, then it is freed here (see the carry
    /// module); whether it was owned. Not retried once it may have reached the server: a
    /// failure after `copy` leaves it to [`Shard::cas_carry_kept`] to tell whether the copies
    /// are counted on.
    pub async fn carry_cas_row(
        &self,
        key: &[u8],
        copy: &CopyCas<'_>,
    ) -> Result<bool, BackendError> {
        self.run_once("carry_cas_row", (key, copy), |c, &(key, copy)| {
            Box::pin(carry::carry_cas_row(c, key, copy))
        })
        .await
    }

    /// After a carry whose copies of `row` were written but whose outcome is unknown: whether
    /// the copies are to be kept (the row is still owned as copied, or a carry freed it)
    /// rather than given back.
    pub async fn cas_carry_kept(&self, row: &CasRow) -> Result<bool, BackendError> {
        self.run("cas_carry_kept", row, |c, &row| {
            Box::pin(carry::carry_kept(c, row))
        })
        .await
    }

    /// Up to `limit` unfinished jobs in id order after `after` (carrying moved queues).
    pub async fn pending_jobs_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<PendingJob>, BackendError> {
        self.run(
            "pending_jobs_after",
            (after, limit),
            |c, &(after, limit)| Box::pin(carry::pending_jobs_after(c, after, limit)),
        )
        .await
    }

    /// Fails the claimed jobs of `ids` whose lease ran out with no retries left (carrying
    /// moved queues: no claim of their queue comes here once the move is over); how many.
    pub async fn fail_exhausted(&self, ids: &[u64]) -> Result<usize, BackendError> {
        self.run("fail_exhausted", ids, |c, &ids| {
            Box::pin(carry::fail_exhausted(c, ids))
        })
        .await
    }

    /// Marks jobs as being moved to the shard `to` and returns those that are being moved,
    /// with where each goes (see the carry module).
    pub async fn start_moving(
        &self,
        ids: &[u64],
        to: &str,
    ) -> Result<Vec<MovingJob>, BackendError> {
        self.run("start_moving", (ids, to), |c, &(ids, to)| {
            Box::pin(carry::start_moving(c, ids, to))
        })
        .await
    }

    /// The jobs of `ids` being moved, with where each goes (see the carry module).
    pub async fn moves_begun(&self, ids: &[u64]) -> Result<Vec<MovingJob>, BackendError> {
        self.run("moves_begun", ids, |c, &ids| {
            Box::pin(carry::moves_begun(c, ids))
        })
        .await
    }

    /// Enqueues moved jobs here, each once (by its move's carry key).
    pub async fn enqueue_moved(&self, jobs: &[MovingJob]) -> Result<(), BackendError> {
        self.run("enqueue_moved", jobs, |c, &jobs| {
            Box::pin(carry::enqueue_moved(c, jobs))
        })
        .await
    }

    /// Marks moved jobs as gone from here.
    pub async fn finish_moving(&self, ids: &[u64]) -> Result<(), BackendError> {
        self.run("finish_moving", ids, |c, &ids| {
            Box::pin(carry::finish_moving(c, ids))
        })
        .await
    }

    /// The shard's clock, in microseconds since the epoch.
    pub async fn clock_us(&self) -> Result<u64, BackendError> {
        self.run("clock_us", (), |c, _| Box::pin(lease::clock_us(c)))
            .await
    }

    /// Whether `session` (of a connection of this shard's, let go) is gone: told to end if
    /// its server still has it, `false` until a later call finds it gone, and while the
    /// shard reaches another server (only the session's own server can tell).
    pub async fn end_session(&self, session: SessionId) -> Result<bool, BackendError> {
        self.run("end_session", session, |c, session| {
            Box::pin(session.end_on(c))
        })
        .await
    }

    /// Whether `session` (of a connection of this shard's, in use elsewhere) lives; `None`
    /// while the shard reaches another server (only the session's own server can tell).
    pub async fn session_lives(&self, session: SessionId) -> Result<Option<bool>, BackendError> {
        self.run("session_lives", session, |c, session| {
            Box::pin(session.lives_on(c))
        })
        .await
    }

    /// Raises the shard's fence floor: every fence granted here from now on is above `floor`.
    pub async fn raise_shard_floor(&self, floor: u64) -> Result<(), BackendError> {
        self.run("raise_shard_floor", floor, |c, &floor| {
            Box::pin(lease::raise_shard_floor(c, floor))
        })
        .await
    }

    /// [`Shard::raise_shard_floor`] that waits at most a second for the floor's row lock, and
    /// is not sent again after that (`LockWaitTimeout`). Every acquire holds that lock shared
    /// for its whole statement, a wait behind another transaction's lock on its own row
    /// included, and while a raise waits, every other acquire of the shard waits behind it.
    pub async fn raise_shard_floor_briefly(&self, floor: u64) -> Result<(), BackendError> {
        let restore = lock_wait_timeout_secs(self.statement_timeout);
        self.run_row(
            "raise_shard_floor_briefly",
            (floor, restore),
            |c, &(floor, restore)| Box::pin(lease::raise_shard_floor_briefly(c, floor, restore)),
        )
        .await
    }

    /// The live leases among `keys` (at most [`crate::FLOOR_BATCH`]): `(key, owner)`.
    pub async fn live_owners(
        &self,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<(Vec<u8>, String)>, BackendError> {
        self.run("live_owners", keys, |c, keys| {
            Box::pin(lease::live_owners(c, keys))
        })
        .await
    }

    /// Copies a row kept past its release on the shard a key left to this one, the key's
    /// shard now (see `keep_moved` in the lease statements): taken by `owner` for `kept_for`
    /// more, with at least `fence`, unless a live lease holds it. Idempotent.
    pub async fn keep_moved(
        &self,
        key: &[u8],
        owner: &str,
        fence: u64,
        kept_for: Duration,
    ) -> Result<(), BackendError> {
        self.run(
            "keep_moved",
            (key, owner, fence, kept_for),
            |c, &(key, owner, fence, kept_for)| {
                Box::pin(lease::keep_moved(c, key, owner, fence, kept_for))
            },
        )
        .await
    }

    /// Raises each key's stored fence to at least the given floor (see `raise_floors` in
    /// the lease statements); idempotent.
    pub async fn raise_floors(&self, floors: &[(Vec<u8>, u64)]) -> Result<(), BackendError> {
        self.run("raise_floors", floors, |c, &floors| {
            Box::pin(lease::raise_floors(c, floors))
        })
        .await
    }

    /// Releases the key of `to` held by `old_owner`, granting it to `to` in the same statement
    /// unless another process asked for the key since it was granted. Not retried once it may
    /// have reached the server (a retry would find the row moved and report it lost).
    pub async fn handoff(
        &self,
        old_owner: &str,
        to: &GrantRequest,
    ) -> Result<HandoffOutcome, BackendError> {
        self.run_as(
            "handoff",
            (old_owner, to),
            |c, &(old_owner, to)| Box::pin(lease::handoff(c, old_owner, to)),
            Tries::ROW_ONCE,
        )
        .await
    }

    /// Extends every live lease in `leases` (key, owner) by its own ttl, in one statement per
    /// [`crate::MAX_RENEW_BATCH`] leases (fewer for long keys: see [`crate::renew_chunks`]), within
    /// `timeout` overall. `apart`: leases a row of which
    /// another transaction held locked at their last renewal, renewed without waiting for
    /// any lock (see [`crate::Renewal::Blocked`]).
    pub async fn renew(
        &self,
        leases: &[(&[u8], &str)],
        timeout: Duration,
        apart: bool,
    ) -> Result<RenewOutcome, BackendError> {
        let mut outcome = RenewOutcome {
            held: Vec::with_capacity(leases.len()),
            statements: 0,
        };
        // The caller's `timeout` bounds all chunks together: a renewal answered after a lease's
        // local end is worthless. (The lease keeper passes one chunk at a time, each with the
        // statement timeout or, if sooner, the time left before the soonest lease end.)
        let deadline = Instant::now() + timeout;
        let chunks = crate::renew_chunks(leases, |(key, owner)| key.len() + owner.len());
        for (i, chunk) in chunks.into_iter().enumerate() {
            // The first has the whole of it (a timeout given in full tells of the node).
            let left = match i {
                0 => timeout,
                _ => deadline.saturating_duration_since(Instant::now()),
            };
            let (part, _) = self
                .with_conn(
                    "renew",
                    left,
                    &(chunk, apart),
                    |c, &(chunk, apart)| Box::pin(lease::renew(c, chunk, apart)),
                    Tries::IDEMPOTENT,
                )
                .await?;
            outcome.held.extend(part.held);
            outcome.statements += part.statements;
        }
        Ok(outcome)
    }

    /// The lease row of `key`, if the key was ever granted here.
    pub async fn inspect(&self, key: &[u8]) -> Result<Option<LeaseRow>, BackendError> {
        self.run("inspect", key, |c, &key| Box::pin(lease::inspect(c, key)))
            .await
    }

    /// The trace context (W3C traceparent) of the live holder of `key`, if it was traced.
    pub async fn holder_trace(&self, key: &[u8]) -> Result<Option<String>, BackendError> {
        self.run("holder_trace", key, |c, &key| {
            Box::pin(lease::holder_trace(c, key))
        })
        .await
    }

    /// What identifies the database this shard reaches: the id its tables were created with
    /// (migration 5) and the server's host name, port, server id and schema. Two shards with
    /// the same identity are the same database, whatever their URLs. On a Galera node, the
    /// cluster (its state UUID) instead of the server: its nodes each name themselves, and the
    /// cluster's database is one whichever node answers, through `nodes:` or a `url:` alone.
    pub async fn identity(&self) -> Result<String, BackendError> {
        self.run("identity", (), |c, _| Box::pin(lease::identity(c)))
            .await
    }

    /// The placements `fleet` last recorded here (see [`Shard::record_placement`]): their
    /// sequence number and record; `None` if it recorded none.
    pub async fn fleet_placement(
        &self,
        fleet: &str,
    ) -> Result<Option<(u64, String)>, BackendError> {
        self.run("fleet_placement", fleet, |c, fleet| {
            Box::pin(cleaner::fleet_placement(c, fleet))
        })
        .await
    }

    /// Records `placements` (the router's record of the placements `fleet` runs) as number
    /// `seq`, if the shard's record is still the one numbered `read` (`None`: none yet);
    /// `false` if it is not (another process recorded meanwhile, or a try whose reply was
    /// lost did).
    pub async fn record_placement(
        &self,
        fleet: &str,
        read: Option<u64>,
        seq: u64,
        placements: &str,
    ) -> Result<bool, BackendError> {
        self.run(
            "record_placement",
            (fleet, read, seq, placements),
            |c, &args| Box::pin(cleaner::record_placement(c, args)),
        )
        .await
    }

    /// How many live leases the shard holds (all instances).
    pub async fn count_held(&self) -> Result<u64, BackendError> {
        self.run("count_held", (), |c, _| Box::pin(lease::count_held(c)))
            .await
    }

    /// Registers `instance` or renews its heartbeat, unless another live start beats under
    /// its id.
    pub async fn heartbeat(&self, beat: Beat<'_>) -> Result<Heartbeat, BackendError> {
        self.heartbeat_within(beat, self.statement_timeout).await
    }

    /// [`Shard::heartbeat`] within `within`, if that is shorter than the statement timeout.
    pub async fn heartbeat_within(
        &self,
        beat: Beat<'_>,
        within: Duration,
    ) -> Result<Heartbeat, BackendError> {
        self.with_conn(
            "heartbeat",
            within.min(self.statement_timeout),
            &beat,
            |c, &beat| Box::pin(cleaner::heartbeat(c, beat)),
            Tries::IDEMPOTENT,
        )
        .await
        .map(|(v, _)| v)
    }

    /// The start that beats under `instance` here, live by `timeout` or the longer timeout its
    /// row says, if one does: its nonce (`None` from versions before nonces), host and pid.
    /// Read only: see [`Shard::heartbeat`] for who may take the row.
    pub async fn live_start(
        &self,
        instance: &str,
        timeout: Duration,
    ) -> Result<Option<(Option<Vec<u8>>, String, u32)>, BackendError> {
        let timeout_us = u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX);
        self.run("live_start", (instance, timeout_us), |c, &args| {
            Box::pin(cleaner::live_start(c, args))
        })
        .await
    }

    /// Marks `instance` as shut down, if the start with `nonce` beat last under it.
    pub async fn deregister(&self, instance: &str, nonce: &str) -> Result<(), BackendError> {
        self.run("deregister", (instance, nonce), |c, &who| {
            Box::pin(cleaner::deregister(c, who))
        })
        .await
    }

    /// Deletes the registry rows of instances silent here for longer than `silent` (shard
    /// clock); how many.
    pub async fn forget_instances(&self, silent: Duration) -> Result<u64, BackendError> {
        let silent_us = u64::try_from(silent.as_micros()).unwrap_or(u64::MAX);
        self.run("forget_instances", silent_us, |c, &us| {
            Box::pin(cleaner::forget_instances(c, us))
        })
        .await
    }

    /// Those of `instances` that heartbeat here within `timeout` and did not deregister, with
    /// the start nonce each beats with (`None` from versions before nonces).
    pub async fn alive_instances(
        &self,
        instances: &[String],
        timeout: Duration,
    ) -> Result<Vec<(String, Option<String>)>, BackendError> {
        let timeout_us = timeout.as_micros() as u64;
        self.run(
            "alive_instances",
            (instances, timeout_us),
            |c, &(instances, timeout_us)| Box::pin(cleaner::alive(c, instances, timeout_us)),
        )
        .await
    }

    /// Every instance registered here.
    pub async fn instances(&self) -> Result<Vec<InstanceRow>, BackendError> {
        self.run("instances", (), |c, _| Box::pin(cleaner::instances(c)))
            .await
    }

    /// The rows the cleaner may remove among the `limit` rows after `after` (key order): ended
    /// longer than `grace` ago, fence passed by the shard clock by `margin`. At most `limit`
    /// rows are examined, whatever they are (see [`Scanned::next`]).
    pub async fn cleanup_candidates(
        &self,
        after: &[u8],
        grace: Duration,
        margin: Duration,
        limit: u32,
    ) -> Result<Scanned, BackendError> {
        let (grace_us, margin_us) = (grace.as_micros() as u64, margin.as_micros() as u64);
        self.run(
            "cleanup_candidates",
            (after, grace_us, margin_us, limit),
            |c, &(after, grace_us, margin_us, limit)| {
                Box::pin(cleaner::candidates(c, after, grace_us, margin_us, limit))
            },
        )
        .await
    }

    /// Deletes released rows among `keys` (`owners` = `None`), or the ended leases of `owners`
    /// among `keys`, each only if it still qualifies as in
    /// [`Shard::cleanup_candidates`] and its fence is at most `fence_at_most` (the floor the
    /// caller raised for them). Rows another session holds locked are passed over, not waited
    /// for (see [`Deleted::in_use`]).
    pub async fn delete_ended(
        &self,
        keys: &[Vec<u8>],
        owners: Option<&[String]>,
        grace: Duration,
        margin: Duration,
        fence_at_most: u64,
    ) -> Result<Deleted, BackendError> {
        let (grace_us, margin_us) = (grace.as_micros() as u64, margin.as_micros() as u64);
        self.run(
            "delete_ended",
            (keys, owners, grace_us, margin_us, fence_at_most),
            |c, &(keys, owners, grace_us, margin_us, fence_at_most)| {
                Box::pin(cleaner::delete(
                    c,
                    keys,
                    owners,
                    grace_us,
                    margin_us,
                    fence_at_most,
                ))
            },
        )
        .await
    }

    /// Frees `key` if `owner` holds it, raising its fence past all of the holder's; the new
    /// fence, or `None` when `owner` no longer held it. When the answer is `None` after a try
    /// whose reply was lost, a row freed by force as that try leaves it (no owner, its fence
    /// above `seen_fence`, the fence `owner`'s row was seen with: a release by the holder
    /// leaves the fence as it was) counts as that try's doing: the caller is told the key was
    /// freed, not that nobody held it.
    pub async fn force_release(
        &self,
        key: &[u8],
        owner: &str,
        seen_fence: u64,
    ) -> Result<Option<u64>, BackendError> {
        let (released, lost_try) = self
            .with_conn(
                "force_release",
                self.statement_timeout,
                &(key, owner),
                |c, &(key, owner)| Box::pin(cleaner::force_release(c, key, owner)),
                Tries::IDEMPOTENT,
            )
            .await?;
        if released.is_some() || !lost_try.applied {
            return Ok(released);
        }
        self.run(
            "force_release",
            (key, seen_fence),
            |c, &(key, seen_fence)| Box::pin(cleaner::freed_by_force(c, key, seen_fence)),
        )
        .await
    }

    /// Applies missing migrations.
    ///
    /// Only getting the connection is bounded by the statement timeout: DDL on a large table,
    /// and the wait for another process's migration lock (up to 30 s), may take longer. The
    /// connection is taken raw, which marks it dirty, so the pool resets it before reuse and
    /// the reset frees the `GET_LOCK` lock if releasing it failed. A future dropped mid-DDL
    /// also hands it back to be reset rather than discarded, since raw use is not tracked.
    pub async fn migrate(&self) -> Result<MigrateReport, BackendError> {
        let mut conn = tokio::time::timeout(self.statement_timeout, self.pool.get())
            .await
            .map_err(|_| BackendError::timeout("connecting to migrate"))?
            .map_err(classify_pool)?;
        // GET_LOCK state: reset before reuse.
        let conn: &mut ShardConn = &mut conn;
        let cluster = self.pool.manager().has_nodes();
        migrate::migrate(conn.raw(), cluster)
            .await
            .map_err(classify)
    }

    /// A pooled connection for a session of the caller's own (a transaction lock, the
    /// caller's SQL); it is reset before anyone reuses it. At most `caller_sessions` of the
    /// pool's connections are such sessions at once: waiting for one of them takes up to the
    /// pool's wait-timeout (see [`Shard::session_slot`]).
    ///
    /// Sessions of this shard listed as stranded are ended first: one may hold the very row
    /// the session is for (a transaction lock given up with its lock statement on the wire).
    pub async fn connection(&self) -> Result<SessionConn, BackendError> {
        let slot = self.session_slot(Some(self.session_wait)).await?;
        self.connection_in(slot).await
    }

    /// One of the connections callers' sessions may use (see [`Shard::connection`]), waited
    /// for up to `within` (`None`: not at all). The error, of kind `Other`, names the cap:
    /// the connections are held by this process's other sessions, not by the shard.
    pub async fn session_slot(
        &self,
        within: Option<Duration>,
    ) -> Result<OwnedSemaphorePermit, BackendError> {
        if let Ok(slot) = self.sessions.clone().try_acquire_owned() {
            return Ok(slot);
        }
        let acquire = self.sessions.clone().acquire_owned();
        match within {
            Some(within) => match tokio::time::timeout(within, acquire).await {
                Ok(slot) => Ok(slot.expect("the semaphore is never closed")),
                Err(_) => Err(self.no_session_slot(within)),
            },
            None => Err(self.no_session_slot(Duration::ZERO)),
        }
    }

    fn no_session_slot(&self, waited: Duration) -> BackendError {
        let max = self.pool.status().max_size;
        BackendError::new(
            BackendErrorKind::Other,
            None,
            format!(
                "no connection for a session of the caller's within {waited:?}: the {} of \
                 pool.max-size {max} that transaction locks and shard_connection sessions may \
                 use were all held by this process's others",
                caller_sessions(max)
            ),
        )
    }

    /// [`Shard::connection`] in a `slot` of [`Shard::session_slot`].
    pub async fn connection_in(
        &self,
        slot: OwnedSemaphorePermit,
    ) -> Result<SessionConn, BackendError> {
        let mut conn = self.pool.get().await.map_err(classify_pool)?;
        tokio::time::timeout(self.statement_timeout, self.end_stranded(&mut conn))
            .await
            .map_err(|_| {
                BackendError::timeout(format!(
                    "no answer within {:?} (statement-timeout)",
                    self.statement_timeout
                ))
            })?
            .map_err(classify)?;
        Ok(SessionConn::new(conn, self.stranded.clone(), slot))
    }

    /// The pool's state.
    pub fn pool_status(&self) -> PoolStatus {
        let s = self.pool.status();
        PoolStatus {
            max_size: s.max_size,
            size: s.size,
            available: s.available,
            waiting: s.waiting,
            stranded: self.stranded.sessions.count(),
        }
    }

    /// Closes the pool: idle connections are dropped, new `get`s fail.
    pub fn close(&self) {
        self.pool.close();
    }

    /// Whether [`Shard::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.pool.is_closed()
    }
}

/// What a release that found `found` answers: released for a row it freed; after a try that
/// may have freed it (`after_unknown`: its reply was lost), a row another owner holds or one
/// that tells nothing of who freed it is for the caller to judge (by whether its lease could
/// have ended); a row freed by force never was this release's.
fn released(found: Released, after_unknown: bool) -> ReleaseAnswer {
    match (found, after_unknown) {
        (Released::Freed, _) => ReleaseAnswer::Released,
        (Released::Free | Released::Taken, true) | (Released::TakenSince, _) => {
            ReleaseAnswer::TakenAfterLostReply
        }
        (Released::Free | Released::Taken, false) | (Released::Revoked, _) => {
            ReleaseAnswer::NotHeld
        }
    }
}

#[cfg(test)]
mod tests {
    use super::caller_sessions;

    #[test]
    fn callers_sessions_leave_a_quarter_of_the_pool_to_the_leases() {
        let lent: Vec<usize> = [1, 2, 3, 4, 7, 8, 16, 32].map(caller_sessions).into();
        assert_eq!(lent, [1, 1, 2, 3, 6, 6, 12, 24]);
    }
}
