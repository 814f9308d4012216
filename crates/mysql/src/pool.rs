//! The per-shard connection pool: deadpool managing `mysql_async` connections.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::time::Duration;

use deadpool::managed::{self, Metrics, RecycleError, RecycleResult};
use futures_util::future::BoxFuture;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, OptsBuilder};

use crate::stranded::{Ending, Lister, ER_NO_SUCH_THREAD};

/// The server's `max_prepared_stmt_count` was reached. The limit is server-wide, so the
/// statement that hits it is not at fault: closing the connection that got the error gives
/// back its cached statements, and the runner retries once on another connection.
pub(crate) const PREPARED_STATEMENT_LIMIT: u16 = 1461;

/// A pooled connection and what the pool must know about its state.
#[derive(Debug)]
pub(crate) struct ShardConn {
    conn: Conn,
    /// Set while a statement is on the wire. Still set when the connection comes back means
    /// the future was dropped mid-statement: the session state is unknown, so it is discarded.
    in_flight: bool,
    /// Set when the session state was changed (a transaction, `GET_LOCK`, the caller's own
    /// SQL); the connection is reset before reuse.
    dirty: bool,
    /// Set after an error that leaves the connection unusable (a transport error), or that
    /// closing it cures (the server's prepared-statement limit, a read-only server): the
    /// connection is discarded.
    broken: bool,
    /// The manager's generation when it was opened (see [`ShardManager::retire_all`]).
    generation: u64,
    /// The Galera node it reached (its index in the shard's `nodes`; 0 on a plain shard).
    node: usize,
    /// Who its server session is, provably (see [`SessionId`]); `None` when that cannot be
    /// told (a Galera shard, a server that refused the session's lock, a proxy in between).
    session: Option<SessionId>,
}

/// A server session told apart from every other the server has had: its thread id, and a
/// user lock (`GET_LOCK`) named by a random token that the session holds from the moment it
/// is opened (and takes again after each reset). Thread ids start over when the server
/// restarts, so an id alone may name another process's session by then; the server answers
/// `IS_USED_LOCK` with this thread's id only while this very session lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionId {
    pub(crate) thread: u32,
    token: u64,
    /// The server the session is on (a hash of its `@@hostname` and `@@port`): only that
    /// server can say whether the session lives.
    pub(crate) server: u64,
}

/// What a new session's probe found (see [`SessionId::open`]).
enum Identity {
    /// The session, told apart from every other the server has had.
    Known(SessionId),
    /// Why it cannot be told apart.
    Unknown(String),
    /// A Galera node (`wsrep_on`), reached as a plain shard.
    GaleraNode,
}

impl SessionId {
    /// The identity of `conn`'s new session: takes its lock and reads which server and thread
    /// answer. Why there is none, when there cannot be: the server refused user locks; or the
    /// thread that answers is not the one the server greeted the connection with (a proxy
    /// such as ProxySQL in between). A Galera node is said apart: a shard reaches one only
    /// through `nodes:`. An error is the connection's: it failed.
    async fn open(conn: &mut Conn) -> mysql_async::Result<Identity> {
        use rand::Rng;
        // Whatever the greeting says the server is (ProxySQL greets as MySQL; Percona XtraDB
        // Cluster is MySQL with Galera): a server built without Galera has no such row.
        // Rows read by position, as whatever text they hold: a proxy that answers in another
        // shape is taken for a server without Galera, never a panic.
        let wsrep: Vec<mysql_async::Row> = match conn.query("SHOW VARIABLES LIKE 'wsrep_on'").await
        {
            Err(mysql_async::Error::Server(_)) => Vec::new(),
            answer => answer?,
        };
        let on = |row: &mysql_async::Row| {
            row.get_opt::<Option<String>, _>(1)
                .and_then(Result::ok)
                .flatten()
                .is_some_and(|v| v.eq_ignore_ascii_case("ON"))
        };
        if wsrep.iter().any(on) {
            return Ok(Identity::GaleraNode);
        }
        let token = rand::rng().random();
        let probe = format!(
            "SELECT GET_LOCK('{}', 0), CONNECTION_ID(), @@hostname, @@port",
            lock_name(token)
        );
        let row: mysql_async::Row = match conn.query_first(probe).await {
            Err(mysql_async::Error::Server(e)) => return Ok(Identity::Unknown(e.to_string())),
            answer => match answer? {
                Some(row) => row,
                None => return Ok(Identity::Unknown("no answer to the session probe".into())),
            },
        };
        let number = |i: usize| {
            row.get_opt::<Option<u64>, _>(i)
                .and_then(Result::ok)
                .flatten()
        };
        let (taken, thread, port) = (number(0), number(1), number(3));
        let host: Option<String> = row.get_opt(2).and_then(Result::ok).flatten();
        if taken != Some(1) {
            return Ok(Identity::Unknown(
                "the server did not grant a session lock".into(),
            ));
        }
        if thread != Some(u64::from(conn.id())) {
            return Ok(Identity::Unknown(format!(
                "the session is thread {thread:?}, the greeting said {}: a proxy in between",
                conn.id()
            )));
        }
        Ok(Identity::Known(Self {
            thread: conn.id(),
            token,
            server: server_of(host, port),
        }))
    }

    /// Whether this session is gone, asked on `conn`: if its server still has it, it is told
    /// to end (`KILL`) and the answer is `false` until a later look finds it gone; `false`
    /// too when `conn` reached another server (only the session's own can tell). Unlike the
    /// shard's list of stranded sessions (see [`crate::stranded`]), it never gives up on a
    /// session the server keeps: its caller decides how long to ask.
    pub(crate) async fn end_on(&self, conn: &mut Conn) -> mysql_async::Result<bool> {
        match self.lives_on(conn).await? {
            None => return Ok(false),
            Some(false) => return Ok(true),
            Some(true) => {}
        }
        match conn
            .query_drop(format!("KILL CONNECTION {}", self.thread))
            .await
        {
            // Gone since the look: seen so by the next one.
            Err(mysql_async::Error::Server(e)) if e.code == ER_NO_SUCH_THREAD => Ok(false),
            Err(e) => Err(e),
            Ok(()) => Ok(false),
        }
    }

    /// Whether this session lives, asked on `conn`; `None` when `conn` reached another server
    /// (only the session's own can tell).
    pub(crate) async fn lives_on(&self, conn: &mut Conn) -> mysql_async::Result<Option<bool>> {
        let probe = format!(
            "SELECT IS_USED_LOCK('{}'), @@hostname, @@port",
            self.lock_name()
        );
        let Some((holder, host, port)) = conn
            .query_first::<(Option<u64>, Option<String>, Option<u64>), _>(probe)
            .await?
        else {
            return Ok(None);
        };
        if server_of(host, port) != self.server {
            return Ok(None);
        }
        Ok(Some(holder == Some(u64::from(self.thread))))
    }

    /// A session of thread `thread` on server 0, for unit tests of the list.
    #[cfg(test)]
    pub(crate) fn of_thread(thread: u32) -> Self {
        Self {
            thread,
            token: u64::from(thread),
            server: 0,
        }
    }

    /// Takes the session's lock again on `conn`, after a reset freed it: whether the server
    /// granted it.
    async fn take_again(&self, conn: &mut Conn) -> mysql_async::Result<bool> {
        let taken: Option<Option<i64>> = conn
            .query_first(format!("SELECT GET_LOCK('{}', 0)", self.lock_name()))
            .await?;
        Ok(taken.flatten() == Some(1))
    }

    /// The name of the session's lock.
    pub(crate) fn lock_name(&self) -> String {
        lock_name(self.token)
    }
}

/// The server a session is on, from its `@@hostname` and `@@port` (see [`SessionId`]).
fn server_of(host: Option<String>, port: Option<u64>) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (host, port).hash(&mut hasher);
    hasher.finish()
}

/// The name of a session's lock (see [`SessionId`]).
fn lock_name(token: u64) -> String {
    format!("shardlock-session:{token:016x}")
}

/// Ends `tx` as `result` says: committed when it is `Ok`, else rolled back at once (best
/// effort; a connection that cannot is broken, and discarded). A server error inside a
/// transaction leaves it open, and mysql_async rolls a dropped transaction back only before
/// its connection's next command: back in the pool, a connection may stay idle for long, and
/// the rows its transaction locked (a job's, the cleaner's, a CAS row) would stay locked,
/// holding up every session that wants them.
pub(crate) async fn settle<T>(
    tx: mysql_async::Transaction<'_>,
    result: mysql_async::Result<T>,
) -> mysql_async::Result<T> {
    match result {
        Ok(done) => {
            tx.commit().await?;
            Ok(done)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

impl ShardConn {
    /// The Galera node this connection reached (0 on a plain shard).
    pub(crate) fn node(&self) -> usize {
        self.node
    }

    /// Whether an error left it unusable: it is discarded when it comes back.
    pub(crate) fn is_broken(&self) -> bool {
        self.broken
    }

    /// Who its server session is (see [`SessionId`]).
    pub(crate) fn session(&self) -> Option<SessionId> {
        self.session
    }

    /// Runs `f` on the connection, tracking whether it completed and whether it broke.
    pub(crate) async fn run<'a, T>(
        &'a mut self,
        f: impl FnOnce(&'a mut Conn) -> BoxFuture<'a, mysql_async::Result<T>>,
    ) -> mysql_async::Result<T> {
        self.in_flight = true;
        let result = f(&mut self.conn).await;
        self.in_flight = false;
        if let Err(e) = &result {
            // A connection at the server's prepared-statement limit is closed, which frees
            // the statements it cached there; one to a read-only server (a demoted primary,
            // still answering under the old address) too. A reply refused here (a shard
            // without a fence floor) was read in full: the connection stays.
            self.broken |= (e.is_fatal() && !crate::lease::is_refused_here(e))
                || matches!(e, mysql_async::Error::Server(s)
                    if s.code == PREPARED_STATEMENT_LIMIT || is_read_only(s.code));
        }
        result
    }

    /// The raw connection for the caller's own SQL; it will be reset before anyone reuses it.
    ///
    /// Unlike [`ShardConn::run`] it cannot mark a statement in flight, since it does not see
    /// the caller's statements end. A caller whose future may be dropped mid-statement must
    /// discard the connection itself ([`SessionConn::discard`]); otherwise the pool resets a
    /// session whose state it cannot know.
    pub(crate) fn raw(&mut self) -> &mut Conn {
        self.dirty = true;
        &mut self.conn
    }
}

/// A connection of a shard's pool lent to one caller for a session of its own: a transaction
/// lock's, or the caller's own SQL. Dropped, it goes back to the pool, which resets it before
/// anyone reuses it; [`SessionConn::discard`] closes it instead.
///
/// Let go with a statement cut off (its future dropped) or its link broken, its server
/// session may live on, still to run that statement or holding the transaction it was in (a
/// transaction lock's row) with nobody to end it: the session is then listed as stranded,
/// ended before the shard's next statement, and the connection is discarded.
#[derive(Debug)]
pub struct SessionConn {
    /// `None` once let go.
    conn: Option<managed::Object<ShardManager>>,
    /// The savepoint that marks a transaction lock's transaction: random per lock, so that no
    /// savepoint of the caller's SQL can stand in for it.
    pub(crate) savepoint: String,
    /// How its session is ended if it is let go stranded: until gone once a transaction lock's
    /// `COMMIT` was sent (one already running would complete after a `KILL`).
    pub(crate) ending: Ending,
    stranded: Lister,
    /// Its place among the connections callers' sessions may use (see
    /// [`crate::shard::caller_sessions`]), given back when it is dropped.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl SessionConn {
    pub(crate) fn new(
        conn: managed::Object<ShardManager>,
        stranded: Lister,
        slot: tokio::sync::OwnedSemaphorePermit,
    ) -> Self {
        Self {
            conn: Some(conn),
            savepoint: String::new(),
            ending: Ending::Killed,
            stranded,
            _slot: slot,
        }
    }

    /// Who its server session is, to end it with [`crate::Shard::end_session`] once the
    /// connection is let go; `None` when it cannot be told apart from others (see
    /// [`SessionId`]).
    pub fn session(&self) -> Option<SessionId> {
        self.conn.as_ref().and_then(|c| c.session)
    }

    /// Whether a statement was cut off on it, or its link broke: the driver counts the
    /// connection as disconnected until a statement is answered. The statement may still run
    /// on the server.
    pub fn cut_off(&self) -> bool {
        self.conn.as_ref().is_some_and(|c| c.conn.is_disconnected())
    }

    /// The raw connection for the caller's own SQL.
    pub fn raw(&mut self) -> &mut Conn {
        self.conn.as_mut().expect("open until let go").raw()
    }

    /// Closes the connection instead of pooling it: the server then rolls back whatever it
    /// was running, and nothing of its session reaches the next user.
    pub fn discard(mut self) {
        if let Some(conn) = self.let_go() {
            drop(managed::Object::take(conn));
        }
    }

    /// Takes the connection out, for the pool (or `None`, closed). Lists its session when the
    /// server may keep it going with nobody to end it: a statement was cut off on it or its
    /// link broke (the driver counts the connection as disconnected until a statement is
    /// answered), or a transaction lock's transaction is still open (a guard dropped, perhaps
    /// while its link is cut, so that the server never hears the connection close). Such a
    /// connection is closed at once: pooled, it would keep its row locked while idle, and no
    /// one else's statements may run in a session listed to be ended.
    fn let_go(&mut self) -> Option<managed::Object<ShardManager>> {
        let conn = self.conn.take()?;
        if !conn.conn.is_disconnected() && self.savepoint.is_empty() {
            return Some(conn);
        }
        if let Some(session) = conn.session {
            self.stranded.strand(session, self.ending);
        }
        drop(managed::Object::take(conn));
        None
    }
}

impl Drop for SessionConn {
    fn drop(&mut self) {
        drop(self.let_go());
    }
}

/// The password in `path`: its text without one trailing newline (files written with `echo`
/// end with one that is not part of the password). The error names the file.
pub(crate) fn read_password_file(path: &Path) -> std::io::Result<String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        std::io::Error::new(e.kind(), format!("cannot read {}: {e}", path.display()))
    })?;
    let password = text.strip_suffix('\n').unwrap_or(&text);
    Ok(password.strip_suffix('\r').unwrap_or(password).to_owned())
}

/// Errors of a server that refuses writes: `--read-only` (1290), a read-only transaction
/// (1792), `super_read_only` or a Galera node that is not synced (1836).
pub(crate) fn is_read_only(code: u16) -> bool {
    shardlock_core::BackendErrorKind::from_mysql_code(code)
        == shardlock_core::BackendErrorKind::ReadOnly
}

/// How long a pooled connection may live and idle (see `PoolConfig`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lifetimes {
    /// Idle longer than this: pinged before reuse.
    pub(crate) idle_check: Duration,
    /// Idle longer than this: closed.
    pub(crate) idle_timeout: Duration,
    /// Older than this: closed.
    pub(crate) max_lifetime: Duration,
}

/// deadpool's manager for one shard.
pub(crate) struct ShardManager {
    opts: Opts,
    /// Set once a connection's session could not be told apart (see [`SessionId::open`]):
    /// warned about once.
    unguarded_warned: std::sync::atomic::AtomicBool,
    /// Why the shard is refused, once a connection found a Galera node reached without
    /// `nodes:` (see [`SessionId::open`]): every later connection is refused at once.
    galera_refused: std::sync::OnceLock<String>,
    lifetimes: Lifetimes,
    /// Read again for every new connection, so a rotated secret takes effect without a reload.
    password_file: Option<PathBuf>,
    /// Connections opened before the latest [`ShardManager::retire_all`] are closed when they
    /// come back.
    generation: AtomicU64,
    /// TLS `preferred`: a server that offers no TLS is connected to in plaintext.
    plaintext_fallback: bool,
    /// What the last connection opened found at the other end (a [`ServerKind`]).
    kind: AtomicU8,
    /// TLS `verify-ca`: the CA file the server's certificate is read against, for the name
    /// each connection then checks ([`crate::tls::certificate_name`]), and that name, read
    /// again after a connection fails.
    verify_ca: Option<PathBuf>,
    certificate_name: std::sync::Mutex<Vec<Option<String>>>,
    /// A Galera shard's nodes (empty: the URL's one server).
    nodes: Nodes,
}

/// The causality wait of a Galera shard's sessions (`wsrep_sync_wait`): reads (1), updates
/// and deletes (2), inserts (4). A node applies the cluster's writes a moment after they
/// commit; until then a statement run there decides on an older row. Certification undoes a
/// stale write that touches a row written since, but not a decision that writes nothing or
/// another row: a renewal that matches no row yet and whose read-back then finds the lease
/// live would answer "held" without extending it, and a fresh grant would read a fence floor
/// older than one raised through another node. Waiting costs a round through the cluster per
/// statement (`shardlock bench --scenario galera` measures it).
pub(crate) const GALERA_SYNC_WAIT: u8 = 7;

/// The nodes of a Galera shard, in preference order: a new connection goes to the first one
/// that is in the cluster's primary component and not passed over after failing.
#[derive(Debug, Default)]
pub(crate) struct Nodes {
    addresses: Vec<(String, u16)>,
    /// How long one node may take to let us in before the next is tried.
    connect_timeout: Duration,
    /// How far a node's clock may be from ours.
    clock_skew: Duration,
    /// The node the newest connection went to.
    current: std::sync::atomic::AtomicUsize,
    /// Per node: passed over until then, after it failed, and how many times in a row it did.
    down_until: std::sync::Mutex<Vec<(Option<std::time::Instant>, u32)>>,
    /// When a connection to a less preferred node was last given up to try a preferred one
    /// again (see [`Nodes::time_to_return`]).
    return_tried: std::sync::Mutex<Option<std::time::Instant>>,
    /// The shard's `statement-timeout`, checked once against the cluster's eviction time.
    statement_timeout: Duration,
    eviction_checked: std::sync::atomic::AtomicBool,
    /// The longest the cluster may take to evict a dead node, ms, as its options say (0: not
    /// read yet).
    eviction_ms: AtomicU64,
}

/// Galera's defaults for `evs.inactive_timeout` (a silent member is dead after this, whatever
/// the others think) and `evs.inactive_check_period`, assumed until the cluster's are read.
const DEFAULT_INACTIVE: (Duration, Duration) =
    (Duration::from_secs(15), Duration::from_millis(500));
/// What a new view takes once a member is declared dead, about.
const VIEW_CHANGE: Duration = Duration::from_secs(1);

/// How long a node that failed is passed over before it is tried again; doubled for each
/// failure in a row, up to [`NODE_BACKOFF_CAP`], and a quarter more or less at random so that
/// processes do not all come back at once. A node that has not failed for
/// [`NODE_FAILURES_FORGOTTEN`] starts again from the shortest backoff.
const NODE_BACKOFF: Duration = Duration::from_secs(2);
const NODE_BACKOFF_CAP: Duration = Duration::from_secs(30);
const NODE_FAILURES_FORGOTTEN: Duration = Duration::from_secs(60);

impl Nodes {
    /// `addresses` (`host:port`, port 3306 when left out), each tried for at most
    /// `connect_timeout`, each used only while its clock is within `clock_skew` of ours.
    pub(crate) fn new(
        addresses: &[String],
        connect_timeout: Duration,
        clock_skew: Duration,
        statement_timeout: Duration,
    ) -> Self {
        let addresses: Vec<(String, u16)> = addresses
            .iter()
            .map(|a| match a.rsplit_once(':') {
                Some((host, port)) => (
                    host.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_owned(),
                    port.parse().unwrap_or(3306),
                ),
                None => (a.clone(), 3306),
            })
            .collect();
        let n = addresses.len();
        Self {
            addresses,
            connect_timeout,
            clock_skew,
            current: Default::default(),
            down_until: std::sync::Mutex::new(vec![(None, 0); n]),
            return_tried: Default::default(),
            statement_timeout,
            eviction_checked: Default::default(),
            eviction_ms: AtomicU64::new(0),
        }
    }

    /// The order to try the nodes in now: those not passed over, in preference order, then
    /// those that are (a node that failed may be back; with every node down, each is tried).
    fn order(&self) -> Vec<usize> {
        let now = std::time::Instant::now();
        let down = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        let (up, passed): (Vec<usize>, Vec<usize>) =
            (0..self.addresses.len()).partition(|&i| down[i].0.is_none_or(|until| until <= now));
        up.into_iter().chain(passed).collect()
    }

    /// Node `i` failed: passed over for its next backoff. Failures while it is passed over
    /// already (every statement in flight when it froze) count as one.
    fn failed(&self, i: usize) {
        use rand::Rng;
        let now = std::time::Instant::now();
        let mut down = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        let (until, times) = &mut down[i];
        if until.is_some_and(|until| until > now) {
            return;
        }
        if until.is_none_or(|until| now > until + NODE_FAILURES_FORGOTTEN) {
            *times = 0;
        }
        *times = times.saturating_add(1);
        let backoff = NODE_BACKOFF
            .saturating_mul(1 << (*times - 1).min(8))
            .min(NODE_BACKOFF_CAP)
            .mul_f64(rand::rng().random_range(0.75..1.25));
        *until = Some(now + backoff);
    }

    /// Node `i` let a connection in and may serve: no longer passed over. Its failures are
    /// remembered a while, so that a node that keeps failing soon after it is reached is
    /// passed over longer each time.
    fn reached(&self, i: usize) {
        let mut down = self.down_until.lock().unwrap_or_else(|e| e.into_inner());
        if down[i]
            .0
            .is_some_and(|until| until > std::time::Instant::now())
        {
            down[i].0 = Some(std::time::Instant::now());
        }
    }

    /// Whether a connection to `node` should be given up now so that a new one tries a node
    /// preferred over it, which is no longer passed over: the way every process's connections
    /// return to the preferred node once it is back. At most once per [`NODE_BACKOFF`], so a
    /// node still dead costs one failed connection attempt per backoff, not one per call.
    fn time_to_return(&self, node: usize) -> bool {
        let now = std::time::Instant::now();
        let preferred_up = self.down_until.lock().unwrap_or_else(|e| e.into_inner())[..node]
            .iter()
            .any(|(until, _)| until.is_none_or(|until| until <= now));
        if !preferred_up {
            return false;
        }
        let mut tried = self.return_tried.lock().unwrap_or_else(|e| e.into_inner());
        if tried.is_some_and(|at| at.elapsed() < NODE_BACKOFF) {
            return false;
        }
        *tried = Some(std::time::Instant::now());
        true
    }
}

/// Whether the clock of the server `conn` reached is within `skew` of ours, the round trip's
/// uncertainty given to it. The nodes of a Galera shard each decide lease expiry by their own
/// clock; every process uses a node only within `skew` of its own clock, so that (with the
/// processes' clocks synchronised too) the nodes that answer one after another are close.
async fn clock_within(conn: &mut Conn, skew: Duration) -> Result<(), String> {
    let micros = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as i128)
    };
    // Without the session's causality wait: the reading must be taken when it is answered.
    conn.query_drop("SET SESSION wsrep_sync_wait = 0")
        .await
        .map_err(|e| e.to_string())?;
    let before = std::time::SystemTime::now();
    let theirs: Option<i64> = conn
        .query_first("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)")
        .await
        .map_err(|e| e.to_string())?;
    let after = std::time::SystemTime::now();
    conn.query_drop(format!("SET SESSION wsrep_sync_wait = {GALERA_SYNC_WAIT}"))
        .await
        .map_err(|e| e.to_string())?;
    let theirs = i128::from(theirs.ok_or("no clock reading")?);
    let (before, after) = (micros(before), micros(after));
    // The reading was taken somewhere in the round trip: the offset could be as large as the
    // distance from its farther end, and that is what must be within the bound.
    let off = (theirs - before).abs().max((theirs - after).abs());
    if off > skew.as_micros() as i128 {
        return Err(format!(
            "its clock is {} ms {} this host's; node-clock-skew allows {} ms",
            off / 1000,
            if theirs < before {
                "behind"
            } else {
                "ahead of"
            },
            skew.as_millis()
        ));
    }
    Ok(())
}

/// The first time a node of the shard is reached: reads the longest the cluster may take to
/// evict a dead node (its `evs.inactive_timeout`, see [`ShardManager::eviction_time`]), and
/// warns when `statement-timeout` is not above the usual eviction time
/// (`evs.suspect_timeout`, see [`eviction_outlasts`]).
async fn check_eviction_time(conn: &mut Conn, nodes: &Nodes) {
    if nodes.eviction_checked.swap(true, Ordering::Relaxed) {
        return;
    }
    let options: Option<String> = conn
        .query_first("SELECT @@wsrep_provider_options")
        .await
        .ok()
        .flatten();
    let Some(options) = options else { return };
    let inactive = evs_option(&options, "evs.inactive_timeout").unwrap_or(DEFAULT_INACTIVE.0);
    let check = evs_option(&options, "evs.inactive_check_period").unwrap_or(DEFAULT_INACTIVE.1);
    nodes.eviction_ms.store(
        (inactive + check + VIEW_CHANGE).as_millis().max(1) as u64,
        Ordering::Relaxed,
    );
    if let Some(why) = eviction_outlasts(nodes.statement_timeout, &options) {
        tracing::warn!(
            "shardlock Galera shard: {why}; while the survivors evict a dead node, statements \
             sent to them time out, fail their callers and leave healthy nodes; raise \
             statement-timeout (and pool.wait-timeout) above it"
        );
    }
}

/// Why `statement_timeout` is too short for a cluster with `provider_options`
/// (`wsrep_provider_options`): its dead-node eviction takes `evs.suspect_timeout` and about
/// a second more for the new view. `None` when it is long enough, or the option is not there.
pub(crate) fn eviction_outlasts(
    statement_timeout: Duration,
    provider_options: &str,
) -> Option<String> {
    let suspect = evs_option(provider_options, "evs.suspect_timeout")?;
    let eviction = suspect + VIEW_CHANGE;
    (statement_timeout <= eviction).then(|| {
        format!(
            "statement-timeout {statement_timeout:?} is not above the cluster's eviction time, \
             evs.suspect_timeout {suspect:?} plus about a second"
        )
    })
}

/// The duration option `name` in `provider_options` (`wsrep_provider_options`).
fn evs_option(provider_options: &str, name: &str) -> Option<Duration> {
    provider_options.split(';').find_map(|option| {
        let (n, value) = option.split_once('=')?;
        (n.trim() == name)
            .then(|| iso_duration(value.trim()))
            .flatten()
    })
}

/// A duration as Galera writes it (ISO 8601 time part: `PT5S`, `PT1.5S`, `PT1M30S`, `PT1H`).
fn iso_duration(text: &str) -> Option<Duration> {
    let mut rest = text.strip_prefix("PT")?;
    let mut total = 0.0f64;
    while !rest.is_empty() {
        let end = rest.find(|c: char| c.is_ascii_alphabetic())?;
        let value: f64 = rest[..end].parse().ok()?;
        total += value
            * match &rest[end..=end] {
                "H" => 3600.0,
                "M" => 60.0,
                "S" => 1.0,
                _ => return None,
            };
        rest = &rest[end + 1..];
    }
    Duration::try_from_secs_f64(total).ok()
}

/// The error of a connection to a Galera node reached without `nodes:`, for `why`.
fn galera_refused(why: &str) -> mysql_async::Error {
    mysql_async::Error::Other(Box::new(std::io::Error::other(why.to_owned())))
}

/// Whether the Galera node `conn` reached may serve: ready, and in the primary component (a
/// node cut off from the majority answers, but must grant nothing).
async fn galera_node_ready(conn: &mut Conn) -> Result<(), String> {
    let status: Vec<(String, String)> = conn
        .query(
            "SHOW GLOBAL STATUS WHERE Variable_name IN \
             ('wsrep_ready', 'wsrep_cluster_status', 'wsrep_local_state_comment')",
        )
        .await
        .map_err(|e| e.to_string())?;

    let value = |name: &str| {
        status
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    };
    let synced = value("wsrep_local_state_comment");
    match (value("wsrep_ready"), value("wsrep_cluster_status")) {
        // Synced, not donor or joining: a node still catching up could answer a renewal from
        // a row older than the cluster's.
        (Some(ready), Some(state))
            if ready.eq_ignore_ascii_case("ON")
                && state.eq_ignore_ascii_case("Primary")
                && synced.is_some_and(|s| s.eq_ignore_ascii_case("Synced")) =>
        {
            Ok(())
        }
        (None, _) | (_, None) => Err("it is not a Galera node (no wsrep status)".into()),
        (ready, state) => Err(format!(
            "it is not a synced member of the cluster's primary component (wsrep_ready {}, \
             wsrep_cluster_status {}, wsrep_local_state_comment {})",
            ready.unwrap_or("?"),
            state.unwrap_or("?"),
            synced.unwrap_or("?")
        )),
    }
}

/// The server a shard's connections reach, as OpenTelemetry's `db.system.name` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ServerKind {
    /// No connection made yet.
    Unknown = 0,
    Mysql = 1,
    Mariadb = 2,
}

impl ServerKind {
    /// The kind of server `conn` reached. MariaDB's versions start at 10 (mysql_async reads
    /// `10.11.6` out of its `5.5.5-10.11.6-MariaDB` greeting); MySQL's are 5.x, 8.x and 9.x.
    fn of(conn: &Conn) -> Self {
        if conn.server_version().0 >= 10 {
            Self::Mariadb
        } else {
            Self::Mysql
        }
    }

    /// `db.system.name`: `other_sql` before any connection told which.
    pub(crate) fn system_name(self) -> &'static str {
        match self {
            Self::Unknown => "other_sql",
            Self::Mysql => "mysql",
            Self::Mariadb => "mariadb",
        }
    }
}

/// Without the connection options: they hold the password.
impl std::fmt::Debug for ShardManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardManager")
            .field("lifetimes", &self.lifetimes)
            .finish_non_exhaustive()
    }
}

/// One shard's pool.
pub(crate) type ShardPool = managed::Pool<ShardManager>;

impl ShardManager {
    /// A manager connecting with `opts` (and the password in `password_file`, read for each
    /// new connection), reusing connections as `lifetimes` allow.
    pub(crate) fn new(opts: Opts, lifetimes: Lifetimes, password_file: Option<PathBuf>) -> Self {
        Self {
            opts,
            unguarded_warned: Default::default(),
            galera_refused: Default::default(),
            lifetimes,
            password_file,
            generation: AtomicU64::new(0),
            plaintext_fallback: false,
            kind: AtomicU8::new(ServerKind::Unknown as u8),
            verify_ca: None,
            certificate_name: std::sync::Mutex::new(vec![None]),
            nodes: Nodes::default(),
        }
    }

    /// Whether this is a Galera shard (several nodes).
    pub(crate) fn has_nodes(&self) -> bool {
        !self.nodes.addresses.is_empty()
    }

    /// Node `node` stopped answering: passed over for a while and, if it is the node in use,
    /// every connection open now is closed as it comes back. A connection to an older node
    /// timing out says nothing of the node in use.
    pub(crate) fn leave_node(&self, node: usize) {
        if node < self.nodes.addresses.len() {
            self.nodes.failed(node);
        }
        self.node_failed(node);
    }

    /// A connection to node `node` broke: if it is the node in use, every connection open
    /// now is closed as it comes back (they all reach the same server).
    pub(crate) fn node_failed(&self, node: usize) {
        if self.nodes.current.load(Ordering::Relaxed) == node {
            self.retire_all();
        }
    }

    /// The longest this Galera shard's commits may stall while its cluster evicts a dead
    /// member: `evs.inactive_timeout` (the hard limit; usually the member is evicted sooner,
    /// after `evs.suspect_timeout`), a check period and a view change, by Galera's defaults
    /// until the cluster's own are read; zero on a plain shard.
    pub(crate) fn eviction_time(&self) -> Duration {
        if !self.has_nodes() {
            return Duration::ZERO;
        }
        match self.nodes.eviction_ms.load(Ordering::Relaxed) {
            0 => DEFAULT_INACTIVE.0 + DEFAULT_INACTIVE.1 + VIEW_CHANGE,
            ms => Duration::from_millis(ms),
        }
    }

    /// A Galera shard reached through `nodes`.
    pub(crate) fn nodes(mut self, nodes: Nodes) -> Self {
        let n = nodes.addresses.len().max(1);
        self.certificate_name = std::sync::Mutex::new(vec![None; n]);
        self.nodes = nodes;
        self
    }

    /// Connects in plaintext to a server that offers no TLS, although the options ask for it
    /// (TLS mode `preferred`).
    pub(crate) fn plaintext_fallback(mut self, on: bool) -> Self {
        self.plaintext_fallback = on;
        self
    }

    /// TLS `verify-ca` against the CA in `ca_file`.
    pub(crate) fn verify_ca(mut self, ca_file: Option<PathBuf>) -> Self {
        self.verify_ca = ca_file;
        self
    }

    /// Closes every connection open now as it comes back (idle ones are the caller's to drop
    /// from the pool): the server they reach refuses writes, and any of them in use at this
    /// moment, a transaction lock's or a read's, would otherwise go back into the pool.
    pub(crate) fn retire_all(&self) {
        self.generation.fetch_add(1, Ordering::Relaxed);
    }

    /// The kind of server the last connection opened reached.
    pub(crate) fn server_kind(&self) -> ServerKind {
        match self.kind.load(Ordering::Relaxed) {
            1 => ServerKind::Mysql,
            2 => ServerKind::Mariadb,
            _ => ServerKind::Unknown,
        }
    }
}

impl ShardManager {
    /// `opts` checking the certificate for a name it holds, under `verify-ca`: the name read
    /// off the server's certificate by the first connection (and again after one fails).
    #[cfg(feature = "tls")]
    async fn certificate_name(
        &self,
        opts: Opts,
        endpoint: usize,
    ) -> Result<Opts, mysql_async::Error> {
        let (Some(ca_file), Some(ssl)) = (&self.verify_ca, opts.ssl_opts()) else {
            return Ok(opts);
        };
        let known = self
            .certificate_name
            .lock()
            .unwrap_or_else(|e| e.into_inner())[endpoint]
            .clone();
        let name = match known {
            Some(name) => name,
            None => {
                let name =
                    crate::tls::certificate_name(opts.ip_or_hostname(), opts.tcp_port(), ca_file)
                        .await?;
                self.certificate_name
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())[endpoint] = Some(name.clone());
                name
            }
        };
        let ssl = ssl.clone().with_danger_tls_hostname_override(Some(name));
        Ok(OptsBuilder::from_opts(opts).ssl_opts(Some(ssl)).into())
    }

    #[cfg(not(feature = "tls"))]
    async fn certificate_name(
        &self,
        opts: Opts,
        _endpoint: usize,
    ) -> Result<Opts, mysql_async::Error> {
        Ok(opts)
    }

    /// A connection failed: a `verify-ca` server may have a new certificate, read it again.
    fn forget_certificate_name(&self, endpoint: usize) {
        self.certificate_name
            .lock()
            .unwrap_or_else(|e| e.into_inner())[endpoint] = None;
    }

    /// A connection with `opts` to the server at `endpoint` (`opts` names it already).
    async fn connect(&self, opts: Opts, endpoint: usize) -> Result<Conn, mysql_async::Error> {
        let opts = self.certificate_name(opts, endpoint).await?;
        match Conn::new(opts.clone()).await {
            Err(mysql_async::Error::Driver(
                mysql_async::DriverError::NoClientSslFlagFromServer,
            )) if self.plaintext_fallback => {
                Conn::new(OptsBuilder::from_opts(opts).ssl_opts(None)).await
            }
            answer => answer.inspect_err(|_| self.forget_certificate_name(endpoint)),
        }
    }

    /// A connection to the first Galera node that lets us in and may serve; connections to
    /// another node than the last one are retired, so that every process's connections meet
    /// on the preferred node again once it is back.
    async fn connect_node(&self, opts: Opts) -> Result<(Conn, usize), mysql_async::Error> {
        let nodes = &self.nodes;
        let mut why = Vec::new();
        for i in nodes.order() {
            let (host, port) = &nodes.addresses[i];
            let node_opts: Opts = OptsBuilder::from_opts(opts.clone())
                .ip_or_hostname(host.clone())
                .tcp_port(*port)
                .into();
            let attempt = async {
                let mut conn = self
                    .connect(node_opts, i)
                    .await
                    .map_err(|e| e.to_string())?;
                galera_node_ready(&mut conn).await?;
                clock_within(&mut conn, nodes.clock_skew).await?;
                check_eviction_time(&mut conn, nodes).await;
                Ok::<_, String>(conn)
            };
            match tokio::time::timeout(nodes.connect_timeout, attempt).await {
                Ok(Ok(conn)) => {
                    nodes.reached(i);
                    if nodes.current.swap(i, Ordering::Relaxed) != i {
                        self.retire_all();
                    }
                    return Ok((conn, i));
                }
                Ok(Err(e)) => why.push(format!("node {host}:{port}: {e}")),
                Err(_) => why.push(format!(
                    "node {host}:{port}: no answer within {:?}",
                    nodes.connect_timeout
                )),
            }
            nodes.failed(i);
        }
        Err(mysql_async::Error::Io(
            std::io::Error::other(format!("no node can serve: {}", why.join("; "))).into(),
        ))
    }
}

impl managed::Manager for ShardManager {
    type Type = ShardConn;
    type Error = mysql_async::Error;

    async fn create(&self) -> Result<ShardConn, mysql_async::Error> {
        if let Some(why) = self.galera_refused.get() {
            return Err(galera_refused(why));
        }
        let generation = self.generation.load(Ordering::Relaxed);
        let opts = match &self.password_file {
            Some(path) => {
                let password =
                    read_password_file(path).map_err(|e| mysql_async::Error::Other(Box::new(e)))?;
                OptsBuilder::from_opts(self.opts.clone())
                    .pass(Some(password))
                    .into()
            }
            None => self.opts.clone(),
        };
        // Connecting (and resetting, below) is boxed: both are rare, and inline their futures
        // (the driver's reset, which re-runs the session setup, is kilobytes) would make every
        // pool checkout — so every statement's future, and every future above it — that
        // large, copied whole on each move. (The driver's ping is boxed already.)
        let (mut conn, node) = if self.nodes.addresses.is_empty() {
            (Box::pin(self.connect(opts, 0)).await?, 0)
        } else {
            Box::pin(self.connect_node(opts)).await?
        };
        self.kind
            .store(ServerKind::of(&conn) as u8, Ordering::Relaxed);
        // Only a plain shard's sessions are told apart: a Galera shard's retry may run on
        // another node, from which a session of this one cannot be ended.
        let mut session = None;
        if self.nodes.addresses.is_empty() {
            match Box::pin(SessionId::open(&mut conn)).await? {
                Identity::Known(id) => session = Some(id),
                Identity::Unknown(why) if !self.unguarded_warned.swap(true, Ordering::Relaxed) => {
                    let (host, port) = (self.opts.ip_or_hostname(), self.opts.tcp_port());
                    tracing::warn!(server = %format!("{host}:{port}"), %why, "shardlock cannot tell this shard's sessions apart: a statement whose connection breaks while it is still on its way may run after its retry");
                }
                Identity::Unknown(_) => {}
                // Its safeguards come with `nodes:` (the causal wait on every statement, the
                // node checks and clock allowance, transaction locks refused): without them
                // a row lock holds on one node only, and a node behind answers for the
                // cluster. Refused, saying how to list it, and from then on without
                // connecting. Not a connection failure: the shard is misconfigured, not down,
                // so no breaker opens and no namespace falls back to in-process locks.
                Identity::GaleraNode => {
                    let (host, port) = (self.opts.ip_or_hostname(), self.opts.tcp_port());
                    let why = format!(
                        "{host}:{port} is a Galera node (wsrep_on), reached without `nodes:`: \
                         list the cluster's nodes under the shard's `nodes:` (one entry, such \
                         as a virtual IP, will do) so that every statement waits for the \
                         cluster, node clocks are allowed for and transaction locks are refused"
                    );
                    let why = self.galera_refused.get_or_init(|| why);
                    return Err(galera_refused(why));
                }
            }
        }
        Ok(ShardConn {
            conn,
            in_flight: false,
            dirty: false,
            broken: false,
            generation,
            node,
            session,
        })
    }

    async fn recycle(
        &self,
        c: &mut ShardConn,
        metrics: &Metrics,
    ) -> RecycleResult<mysql_async::Error> {
        if c.in_flight || c.broken || c.generation < self.generation.load(Ordering::Relaxed) {
            return Err(RecycleError::message(
                "cancelled mid-statement, broken or retired; discarded",
            ));
        }
        if self.has_nodes() && self.nodes.time_to_return(c.node) {
            // Every idle connection reaches the same node: all are given up, so that the
            // next call opens a new one, which tries the preferred node first (and comes
            // back here if it is still down).
            self.retire_all();
            return Err(RecycleError::message(
                "a preferred Galera node may be back; discarded to try it",
            ));
        }
        if metrics.age() > self.lifetimes.max_lifetime
            || metrics.last_used() > self.lifetimes.idle_timeout
        {
            return Err(RecycleError::message(
                "past pool.max-lifetime or pool.idle-timeout; discarded",
            ));
        }
        if c.dirty && self.has_nodes() {
            // On a Galera node a reset session may keep `wsrep_sync_wait` set yet no longer
            // wait (MariaDB's change_user clears the flag the wait depends on): its reads
            // could answer from a node behind the cluster. A fresh connection waits.
            return Err(RecycleError::message(
                "a Galera node's session is not reset; discarded",
            ));
        }
        if c.dirty {
            // COM_RESET_CONNECTION: ends transactions, frees GET_LOCK locks and temporary
            // tables, then mysql_async re-runs our setup statements.
            if !Box::pin(c.conn.reset()).await? {
                return Err(RecycleError::message(
                    "server cannot reset sessions; discarded",
                ));
            }
            // The reset freed the session's own lock too. A session that cannot take it again
            // could not be looked up if it were stranded: discarded.
            if let Some(id) = c.session {
                if !Box::pin(id.take_again(&mut c.conn)).await? {
                    return Err(RecycleError::message(
                        "session lock not taken again after a reset; discarded",
                    ));
                }
            }
            c.dirty = false;
        } else if metrics.last_used() > self.lifetimes.idle_check {
            // Only after a while idle: a ping on every checkout would double the round trips
            // of a busy pool, whose connections the server has no reason to have dropped.
            c.conn.ping().await?;
        }
        Ok(())
    }
}

/// Statements run on every new (and every reset) connection: one statement that pins the
/// session whatever the server's defaults are. `time_zone`: shard time is read as
/// `UNIX_TIMESTAMP(NOW(n))`, in UTC without DST ambiguity. `autocommit`: every lease statement
/// commits on its own. `sql_mode`: the lease statements rely on left-to-right assignment in
/// `ON DUPLICATE KEY UPDATE`, which MariaDB's `SIMULTANEOUS_ASSIGNMENT` would change.
/// `innodb_lock_wait_timeout` (see [`lock_wait_timeout_secs`]): a statement queued behind
/// another transaction's row lock is answered (1205) before our own statement timeout.
/// `lc_messages`: a batch acquire reads the server's `Records: .. Duplicates: ..` reply text,
/// which a server set to another language translates.
pub(crate) fn session_setup(lock_wait_timeout_secs: u64) -> Vec<String> {
    vec![format!(
        "SET time_zone = '+00:00', autocommit = 1, \
         sql_mode = 'STRICT_TRANS_TABLES,NO_ENGINE_SUBSTITUTION', \
         innodb_lock_wait_timeout = {}, lc_messages = 'en_US'",
        lock_wait_timeout_secs.max(1)
    )]
}

/// The server's lock wait for a shard's sessions: whole seconds (the server's unit), at least
/// half a second below the statement timeout so that a statement stuck behind another
/// transaction's lock gets the server's answer (1205: nothing done, ask again) rather than
/// our timeout (outcome unknown, counted against the shard). At least 1 s: with a statement
/// timeout under 1.5 s the two race.
pub(crate) fn lock_wait_timeout_secs(statement_timeout: std::time::Duration) -> u64 {
    statement_timeout
        .saturating_sub(std::time::Duration::from_millis(500))
        .as_secs()
        .max(1)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn the_lock_wait_ends_before_the_statement_timeout() {
        for (statement_ms, wait_s) in [(1000, 1), (1900, 1), (2000, 1), (2500, 2), (5000, 4)] {
            assert_eq!(
                super::lock_wait_timeout_secs(Duration::from_millis(statement_ms)),
                wait_s,
                "{statement_ms} ms"
            );
        }
    }

    /// The eviction time is read off Galera's own option string; a statement timeout at or
    /// below `evs.suspect_timeout` plus a second is named, one above it is not.
    #[test]
    fn a_statement_timeout_shorter_than_the_clusters_eviction_is_named() {
        let options = "base_port = 4567; evs.inactive_timeout = PT15S; \
                       evs.suspect_timeout = PT5S; gcache.size = 128M";
        let why = super::eviction_outlasts(Duration::from_secs(2), options).unwrap();
        assert!(why.contains("5s"), "{why}");
        assert!(super::eviction_outlasts(Duration::from_secs(6), options).is_some());
        assert!(super::eviction_outlasts(Duration::from_secs(7), options).is_none());
        let tight = "evs.suspect_timeout = PT1.5S";
        assert!(super::eviction_outlasts(Duration::from_secs(2), tight).is_some());
        assert!(super::eviction_outlasts(Duration::from_secs(3), tight).is_none());
        for (text, secs) in [("PT1M30S", 90.0), ("PT0.5S", 0.5), ("PT1H", 3600.0)] {
            assert_eq!(
                super::iso_duration(text),
                Some(Duration::from_secs_f64(secs))
            );
        }
        assert_eq!(super::iso_duration("5s"), None);
        assert!(super::eviction_outlasts(Duration::from_secs(1), "gcache.size = 1G").is_none());
    }

    /// A node that fails is passed over for about 2 s, about twice as long for each failure
    /// in a row (failures while it is passed over count once, and reaching it does not make
    /// it forget); connections to a less preferred node are given up to try a preferred one
    /// only once that one is no longer passed over, and at most once per backoff.
    #[test]
    fn connections_return_to_a_preferred_node_once_its_backoff_ends() {
        use std::time::Instant;
        let nodes = super::Nodes::new(
            &["a:1".into(), "b:1".into(), "c:1".into()],
            Duration::from_secs(1),
            Duration::from_millis(250),
            Duration::from_secs(6),
        );
        let left = |i: usize| {
            nodes.down_until.lock().unwrap()[i]
                .0
                .unwrap()
                .saturating_duration_since(Instant::now())
        };
        let expire = |i: usize| nodes.down_until.lock().unwrap()[i].0 = Some(Instant::now());
        nodes.failed(0);
        let first = left(0);
        assert!(first > Duration::from_millis(1400) && first <= Duration::from_millis(2500));
        nodes.failed(0);
        assert_eq!(
            nodes.down_until.lock().unwrap()[0].1,
            1,
            "one failure while passed over"
        );
        assert_eq!(nodes.order(), vec![1, 2, 0]);
        // Passed over: connections to b stay.
        assert!(!nodes.time_to_return(1));
        // Its backoff over: connections to b are given up, then not until the next backoff.
        expire(0);
        assert!(nodes.time_to_return(1));
        assert!(!nodes.time_to_return(1));
        assert!(!nodes.time_to_return(2));
        // Connections to the most preferred node never are, nor to any when every node ahead
        // is passed over.
        *nodes.return_tried.lock().unwrap() = None;
        assert!(!nodes.time_to_return(0));
        nodes.failed(0);
        assert!(
            left(0) > Duration::from_secs(2),
            "the second failure in a row: twice as long"
        );
        nodes.failed(1);
        assert!(!nodes.time_to_return(2));
        // Reached again, node a is no longer passed over but remembers its failures.
        nodes.reached(0);
        assert_eq!(nodes.order()[0], 0);
        expire(0);
        nodes.failed(0);
        assert!(
            left(0) > Duration::from_secs(5),
            "the third: four times as long"
        );
    }
}

#[cfg(test)]
mod clock_tests {
    use std::time::Duration;

    /// A server whose clock is a second behind ours is refused at a 250 ms bound and
    /// accepted at 2 s; one on our clock is accepted.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_node_whose_clock_is_off_is_refused() {
        let cluster = shardlock_testkit::Cluster::start_with_clocks(2, &[(1, "-1s")])
            .await
            .unwrap();
        let mut ours = cluster.shard(0).connect().await.unwrap();
        super::clock_within(&mut ours, Duration::from_millis(250))
            .await
            .unwrap();
        let mut behind = cluster.shard(1).connect().await.unwrap();
        let refused = super::clock_within(&mut behind, Duration::from_millis(250))
            .await
            .unwrap_err();
        assert!(refused.contains("behind"), "{refused}");
        super::clock_within(&mut behind, Duration::from_secs(2))
            .await
            .unwrap();
    }
}
