//! Transaction locks: `SELECT ... FOR UPDATE` on a row of `shardlock_txlock` inside a
//! transaction on a dedicated connection.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use mysql_async::Conn;
use shardlock_core::{BackendError, BackendErrorKind, BreakerState, Error, LockKey, Result};
use shardlock_mysql::{SessionConn, SessionId};
use tokio::sync::watch;

use super::Discard;
use crate::clock::{Moment, SUSPEND_NOTICED_WITHIN};
use crate::shard::{Settling, ShardState, Shared, Timing, REGISTRY_LAPSED};
use crate::state::{FollowsKey, Inner};
use crate::sync::LockExt;
use crate::LockRouter;

/// A row lock held inside an open transaction on a dedicated connection. Run your SQL on
/// [`TxLockGuard::conn`]; [`TxLockGuard::commit`] or [`TxLockGuard::rollback`] ends the
/// transaction and the lock together. Dropping the guard rolls back: the connection is closed,
/// and since the server may not hear that (a cut link), its session is also ended by this
/// process's next statement on the shard, on a plain shard (see the README's "What each lock
/// mode survives"); so is that of a connection whose link broke or whose statement was cut
/// off. If this process dies, the server rolls back when it notices the connection is gone.
///
/// Across a reload that moves the key, the lock follows it: the row is also locked on the
/// key's new shard (in a transaction of its own) within half the move window, and
/// [`TxLockGuard::commit`] waits for that. If it fails, the lock is lost:
/// [`TxLockGuard::is_held`] turns false, [`TxLockGuard::lost`] completes and
/// [`TxLockGuard::commit`] rolls back and answers [`Error::LockLost`].
#[must_use = "dropping the guard rolls the transaction back and releases the lock at once"]
pub struct TxLockGuard {
    /// `None` once committed or rolled back.
    conn: Option<SessionConn>,
    /// Who `conn`'s server session is, to wait for its end when a `COMMIT` may be on its way
    /// (see [`TxLockState::end_once_gone`]).
    session: Option<SessionId>,
    key: String,
    shard: String,
    /// The lock's shard's, which bounds a rollback.
    statement_timeout: Duration,
    state: Arc<TxLockState>,
    /// The router, for a follow that `commit` must wait for.
    router: Weak<Inner>,
}

/// What a reload needs to make a transaction lock follow its key: where the row is locked and
/// the transactions holding it elsewhere.
#[derive(Debug)]
pub(crate) struct TxLockState {
    key: LockKey,
    /// How the key appears in log lines: itself, or its hash (`telemetry.record-keys`).
    label: String,
    /// The topology epoch up to which the lock is known to hold where the key lives.
    placed_epoch: AtomicU64,
    /// The fingerprint of the topology of `placed_epoch`: advertised while the lock has not
    /// followed its key under a later one (see `Inner::advertised`).
    placed_in: std::sync::Mutex<String>,
    rows: std::sync::Mutex<TxRows>,
    lost: watch::Sender<bool>,
    /// One follower at a time.
    following: tokio::sync::Mutex<()>,
    /// The router's, for whether the registry still surely counts this process live.
    shared: Arc<Shared>,
    /// The router's heartbeat nudge: a lock that ends while it had not followed its key lets
    /// the process advertise the topology in force, at once rather than at the next beat.
    beat_now: Arc<tokio::sync::Notify>,
    /// [`Shared::registry_losses`] before the lock was sought: a lock has no lease row, so
    /// when the leases are lost to the registry (a lapse), it is too.
    registry_losses: u64,
    /// When [`TxLockGuard::lost`] last asked whether the lock's session lives (the next look
    /// is a [`SESSION_LOOK`] later, whichever call of `lost` makes it).
    session_looked: std::sync::Mutex<tokio::time::Instant>,
    /// Set while such a look is out.
    session_looking: AtomicBool,
}

/// The shards where a transaction lock's row is locked (the guard's own first), and the
/// connections of the other ones (each closed, so rolled back, when the lock ends).
#[derive(Debug, Default)]
struct TxRows {
    shards: Vec<Arc<ShardState>>,
    others: Vec<(Arc<ShardState>, Discard)>,
    ended: bool,
    /// The guard's `COMMIT` may be on its way (or land yet): the other rows stay, and the
    /// lock counts as placed where it was, until it is answered (or its session is gone).
    committing: bool,
}

impl TxLockState {
    /// Whether the lock is surely still held: not lost, and the registry surely counts this
    /// process live, as it has since the lock was sought. A process started onto another
    /// topology after the fleet counted this one dead (paused, or cut off from every shard)
    /// locks the key where its topology puts it, which this lock does not exclude; found so,
    /// the lock stays lost.
    fn is_live(&self) -> bool {
        if *self.lost.borrow() {
            return false;
        }
        let shared = &self.shared;
        if shared.is_closed() {
            self.mark_lost("its router shut down");
            return false;
        }
        // The registry's time first: a heartbeat that lands after a lapse counts the loss
        // before it moves that time on, so a time read moved on comes with the count.
        if shared.registry_live_at(Moment::now())
            && shared.registry_losses() == self.registry_losses
        {
            return true;
        }
        self.mark_lost(REGISTRY_LAPSED);
        false
    }

    fn mark_lost(&self, why: &'static str) {
        if !self.lost.send_replace(true) {
            tracing::warn!(key = self.label, why, "shardlock transaction lock lost");
        }
    }

    /// Whether the lock's transactions on other shards (a key a reload moved) still hold their
    /// rows: nothing runs on their connections, so nothing tells when one ends (its session
    /// killed, an idle-transaction timeout, the link cut, the server restarted), and a process
    /// placed where that row is may lock the key meanwhile. Each is asked, within its shard's
    /// statement timeout, whether its transaction is still the one that took the row (its
    /// savepoint is there); one that is not, or does not answer, loses the lock.
    async fn others_still_locked(&self) -> bool {
        let others = std::mem::take(&mut self.rows.locked().others);
        let mut kept = Vec::with_capacity(others.len());
        let mut held = true;
        for (shard, mut conn) in others {
            let open = conn.0.as_mut().expect("open until the lock ends");
            let still = tokio::time::timeout(shard.statement_timeout(), open.still_locked()).await;
            if !matches!(still, Ok(Ok(true))) {
                tracing::warn!(key = self.label, shard = shard.name(), answer = ?still, "shardlock transaction lock lost its row on another shard");
                held = false;
            }
            kept.push((shard, conn));
        }
        // Back with any a follow added meanwhile (closed with them when the lock ends).
        self.rows.locked().others.extend(kept);
        if !held {
            self.mark_lost("its row on another shard was let go (its session ended)");
        }
        held
    }

    /// Ends the lock's transactions on other shards (closing their connections).
    fn end(&self) {
        let others = {
            let mut rows = self.rows.locked();
            rows.ended = true;
            rows.committing = false;
            std::mem::take(&mut rows.others)
        };
        drop(others);
        if self.placed_epoch.load(Ordering::Acquire) < self.shared.epoch() {
            self.beat_now.notify_one();
        }
    }

    /// Ends the lock whose `COMMIT` may still be on its way (its answer lost, or its call
    /// given up) on `session`: the transactions on other shards end only once the lock's own
    /// shard says that session is gone (told to end until it is: a `COMMIT` still in transit
    /// then finds no session, one already running completes first), or after
    /// [`COMMIT_GONE_WITHIN`] (waited out whole for a session that cannot be told apart: a
    /// Galera shard's, one behind a proxy). Ended at once, they would let a process placed by
    /// a reload lock the key before the `COMMIT` landed.
    ///
    /// Until then the lock stays `committing`: it still counts as not having followed its key
    /// (see [`FollowsKey::pending_since`]), so the fleet keeps a reload's move in force.
    fn end_once_gone(self: &Arc<Self>, session: Option<SessionId>) {
        let own = {
            let mut rows = self.rows.locked();
            rows.ended = true;
            // Its shard's pool stays open meanwhile, should the shard have left the topology
            // (counted before the lock counts as ended, which a drain waits for too).
            rows.shards.first().map(Settling::new)
        };
        // On the router's runtime, where it runs as long as the router's keepers do.
        let (Some(own), Some(runtime)) = (own, self.shared.runtime()) else {
            self.end();
            return;
        };
        let state = self.clone();
        runtime.spawn(async move {
            let Settling(own) = &own;
            let until = tokio::time::Instant::now() + COMMIT_GONE_WITHIN;
            let mut pause = Duration::from_millis(50);
            // Until the shard's pool closes: a shutdown waits for this before it deregisters.
            while tokio::time::Instant::now() < until && !own.is_closed() {
                // A session that cannot be asked after is waited out.
                if let Some(session) = session {
                    if let Ok(true) = own.call(|b| b.end_session(session)).await {
                        break;
                    }
                }
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(1));
            }
            state.end();
        });
    }
}

/// How often [`TxLockGuard::lost`] asks whether the lock's session lives.
const SESSION_LOOK: Duration = Duration::from_secs(1);

/// How long a `COMMIT` whose answer never came may still land: a segment sent into a silent
/// network is retransmitted for about a quarter of an hour at most (Linux's `tcp_retries2`
/// default), as the shard's list of stranded sessions counts too.
const COMMIT_GONE_WITHIN: Duration = Duration::from_secs(20 * 60);

impl std::fmt::Debug for TxLockGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TxLockGuard")
            .field("key", &self.key)
            .field("shard", &self.shard)
            .finish_non_exhaustive()
    }
}

impl TxLockGuard {
    /// The connection whose open transaction holds the lock: your statements here commit or
    /// roll back with it. They run as you send them, with no statement timeout of this
    /// library's: a shard that stops answering (paused, a silent partition) holds them up
    /// until the connection breaks; bound them yourself (`tokio::time::timeout`) and drop the
    /// guard, which rolls back.
    pub fn conn(&mut self) -> &mut Conn {
        self.conn
            .as_mut()
            .expect("open until commit or rollback")
            .raw()
    }

    /// The key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The shard holding the row (where the key lived when it was locked).
    pub fn shard(&self) -> &str {
        &self.shard
    }

    /// False once the lock is lost: its key moved in a reload and could not be locked on its
    /// new shard in time (true while it is being locked there); with the `heartbeat` registry
    /// also once this process's heartbeat lapsed (paused, or cut off from every shard, as for
    /// a lease, see [`crate::LockGuard::is_held`]): a process started meanwhile onto another
    /// topology may lock the key where that topology puts it. Such a lock stays lost, and
    /// [`TxLockGuard::commit`] rolls it back. Its rows on other shards (a key a reload moved)
    /// are held by transactions nothing runs on: one that ends under it (its session killed,
    /// an idle-transaction timeout) is found by [`TxLockGuard::commit`], not here; so is a
    /// transaction your own SQL ended (a deadlock it lost, a DDL statement), which ends the
    /// lock with it. The lock's own session ending (killed, timed out idle, its server
    /// restarted) is found by [`TxLockGuard::lost`] while it waits, within a second, and by
    /// your next statement on [`TxLockGuard::conn`], which fails: not here before then.
    pub fn is_held(&self) -> bool {
        self.state.is_live()
    }

    /// Completes when the lock is lost (see [`TxLockGuard::is_held`]); never for a lock that
    /// stays held. While it waits, it also asks the lock's shard every second whether the
    /// lock's own session still lives: a session killed, timed out idle
    /// (`idle_transaction_timeout`) or ended by the server's restart was rolled back, and
    /// another process may hold the key since. Found so, the lock is lost (and
    /// [`TxLockGuard::is_held`] says so from then on). A shard that does not answer says
    /// nothing (the session may live on: a cut link); nor does a session that cannot be told
    /// apart from others (a Galera shard's, one behind a proxy such as ProxySQL). Cancel-safe.
    pub async fn lost(&self) {
        let state = &self.state;
        let mut lost = state.lost.subscribe();
        let mut losses = state.shared.watch_registry_losses();
        // Polled beside the other looks, not in turn with them: a probe held up (a cut link,
        // for the statement timeout) must not hold back the lapse's.
        let looks = self.look_at_session();
        tokio::pin!(looks);
        loop {
            // The lapse is watched too, looked at again as heartbeats move it on, and the
            // losses to the registry (a lapse found, a switch to the heartbeat registry).
            let until = state.shared.registry_live_until();
            let look = until.map_or_else(
                || tokio::time::Instant::now() + SUSPEND_NOTICED_WITHIN,
                Moment::checked_timer,
            );
            tokio::select! {
                _ = lost.wait_for(|lost| *lost) => return,
                _ = losses.changed() => {}
                () = tokio::time::sleep_until(look) => {}
                // Marks the lock lost (the first branch) once the session is gone.
                () = &mut looks => {}
            }
            if !state.is_live() {
                return;
            }
        }
    }

    /// Asks the lock's shard, every [`SESSION_LOOK`] after the last answer (whichever call
    /// of `lost` is waiting then), whether the lock's own session lives, and marks the lock
    /// lost once it says the session is gone (see [`TxLockGuard::lost`]); never completes.
    /// Each look runs on the router's runtime and marks the lock itself, so a `lost` dropped
    /// meanwhile neither cuts its statement off (which would cost the shard its connection)
    /// nor loses its answer; one at a time, through no breaker (its answer says nothing of the
    /// shard's health), and not while every connection of the pool is in use (the lock's own
    /// among them): it would only wait for one. A session that cannot be told apart is not
    /// asked after.
    async fn look_at_session(&self) {
        let own = self.state.rows.locked().shards.first().cloned();
        let (Some(session), Some(own)) = (self.session, own) else {
            return std::future::pending().await;
        };
        loop {
            let next = *self.state.session_looked.locked() + SESSION_LOOK;
            tokio::time::sleep_until(next).await;
            {
                let mut looked = self.state.session_looked.locked();
                // Another call of `lost` looked meanwhile, or its look is still out.
                if *looked + SESSION_LOOK > tokio::time::Instant::now()
                    || self.state.session_looking.swap(true, Ordering::AcqRel)
                {
                    continue;
                }
                *looked = tokio::time::Instant::now();
            }
            let pool = own.pool_status();
            if pool.available == 0 && pool.size >= pool.max_size {
                self.state.session_looking.store(false, Ordering::Release);
                continue;
            }
            let (own, state) = (own.clone(), self.state.clone());
            let spawned = self.state.shared.spawn(async move {
                if let Ok(Some(false)) = own.unguarded().session_lives(session).await {
                    state.mark_lost(
                        "its session ended (killed, timed out idle, or its server restarted)",
                    );
                }
                // The next look a second after this one's answer, however long it took.
                *state.session_looked.locked() = tokio::time::Instant::now();
                state.session_looking.store(false, Ordering::Release);
            });
            if spawned.is_none() {
                self.state.session_looking.store(false, Ordering::Release);
            }
        }
    }

    /// Commits your statements and releases the lock. A lost lock is rolled back instead and
    /// answers [`Error::LockLost`]: nothing of the transaction is kept. The lock is checked as
    /// the commit begins, its rows on other shards too (each asked, within its shard's
    /// statement timeout, whether its transaction still holds the row): a pause of this process between that check and the `COMMIT`
    /// reaching the server (or a `COMMIT` held up in a partition) past the heartbeat's lapse
    /// still commits, and a process started onto another topology meanwhile may have locked
    /// the key where that topology puts it (see [`TxLockGuard::is_held`]); there is no fence
    /// to close that window, as there is for a lease.
    ///
    /// If your SQL ended the transaction that took the lock — a deadlock one of your
    /// statements lost (1213) rolls the whole transaction back, a DDL statement (`CREATE
    /// TABLE`, `ALTER`, ...) commits implicitly, and so does a `COMMIT` of your own — the lock
    /// ended with it, and another process may have taken it since: `commit` then commits
    /// nothing more, rolls back what ran after the end (the session runs with autocommit off,
    /// so none of it was committed), and answers [`Error::LockLost`]. What a DDL statement or
    /// your `COMMIT` committed stays committed (it ran under the lock), and so does the DDL
    /// statement itself. After a deadlock, take the lock again and run the whole transaction
    /// again, not the statement alone. Run DDL before taking the lock. Never run `SET
    /// autocommit = 1` on the lock's connection: it commits the transaction (ending the lock),
    /// and every statement after it then commits on its own, outside the lock, where `commit`
    /// cannot roll it back (it still answers [`Error::LockLost`]).
    ///
    /// Cancellation: the connection is closed, not pooled, and the lock is released either way; a
    /// `COMMIT` that reached the server may still have committed, else the server rolls back. Read
    /// your rows to learn which. So does an [`Error::Unavailable`] whose source says
    /// `maybe_applied`: the `COMMIT` was sent and its answer lost. Either way a `COMMIT` on its
    /// way may land later; the rows the lock holds on other shards (a key a reload moved) stay
    /// locked, and the lock counts as placed where it was, until the lock's shard says its
    /// session is gone: it is told to end until it is, so that a `COMMIT` still in transit
    /// finds no session (one already running completes first); at most 20 minutes (the
    /// longest a segment is retransmitted), and not past the router's shutdown. A session
    /// that cannot be told apart from others (a Galera shard's, one behind a proxy such as
    /// ProxySQL) cannot be asked after: its 20 minutes are waited out. A `COMMIT` unanswered
    /// for 20 minutes is given up so, and waited for 20 minutes more at most. The session is
    /// told apart by a user lock it holds (`GET_LOCK`): do not run `RELEASE_ALL_LOCKS()` on the
    /// lock's connection, or its session reads as gone while it lives (and
    /// [`TxLockGuard::lost`] reports the lock lost).
    pub async fn commit(mut self) -> Result<()> {
        // A reload may have moved the key: nothing commits under the lock before it is held
        // where the key lives now. The processes that reloaded lock it only there once their
        // move is over, and transaction locks leave no row for that end to find.
        follow_now(self.router.clone(), self.state.clone()).await;
        // From here until the `COMMIT` is answered, a reload's follow that fails marks the
        // lock lost but keeps its rows on other shards: rolled back while the `COMMIT` is on
        // its way (a slow link), they would let a process placed by that reload lock the key
        // before this transaction commits. (Set before the check: a follow that failed before
        // it rolled them back, and the lock is lost.)
        self.state.rows.locked().committing = true;
        // The other shards first (each a round trip), then this process's own standing, as
        // near the `COMMIT` as can be.
        if !self.state.others_still_locked().await || !self.is_held() {
            self.end(false).await?;
            return Err(Error::LockLost {
                key_label: self.state.label.clone(),
            });
        }
        self.end(true).await
    }

    /// Rolls back your statements and releases the lock; [`Error::LockLost`] when your SQL had
    /// ended the lock's transaction already (see [`TxLockGuard::commit`]): what it committed
    /// then stays committed.
    ///
    /// [`Error::Unavailable`] when the shard did not answer within its statement timeout (a
    /// paused server, or a rollback of a large transaction that takes longer): the connection
    /// is closed, so the server rolls back once it finds that (or completes the rollback it
    /// began), and the key stays locked until then.
    ///
    /// Cancellation: the connection is closed, not pooled, so the server rolls back anyway and the
    /// lock is released.
    pub async fn rollback(mut self) -> Result<()> {
        self.end(false).await
    }

    /// Cancellation: if this is dropped before the server answered, the connection is closed
    /// (the server then rolls back); it is pooled again only after a complete answer.
    async fn end(&mut self, commit: bool) -> Result<()> {
        let mut conn = Discard(self.conn.take());
        let open = conn.0.as_mut().expect("ended once");
        let ended = if commit {
            // Bounded: a `COMMIT` unanswered that long (a link gone half-open) counts as lost,
            // so the lock ends (see `end_once_gone`) instead of holding its placement for ever.
            tokio::time::timeout(COMMIT_GONE_WITHIN, open.commit())
                .await
                .unwrap_or_else(|_| {
                    let mut e = BackendError::timeout("the COMMIT was not answered");
                    e.maybe_applied = true;
                    Err(e)
                })
        } else {
            // Bounded: on a shard that does not answer (paused), the closed connection leaves
            // the rollback to the server, which rolls back once it finds the connection gone.
            tokio::time::timeout(self.statement_timeout, open.rollback_lock())
                .await
                .unwrap_or_else(|_| {
                    Err(BackendError::timeout(
                        "the ROLLBACK was not answered within the statement timeout: the \
                         connection is closed, and the server rolls back once it finds that",
                    ))
                })
        };
        // The `COMMIT` was sent and its answer lost: it may land yet.
        let unknown = commit && matches!(&ended, Err(e) if e.maybe_applied);
        let result = match ended {
            Ok(true) => Ok(()),
            // Your SQL ended the transaction that held the lock (a deadlock, a DDL statement's
            // implicit commit): what ran after that ran without the lock, and was rolled back.
            Ok(false) => {
                self.state
                    .mark_lost("the caller's SQL ended the lock's transaction");
                Err(Error::LockLost {
                    key_label: self.state.label.clone(),
                })
            }
            Err(e) => Err(e.into_error(&self.shard)),
        };
        if result.is_ok() || matches!(result, Err(Error::LockLost { .. })) {
            drop(conn.0.take()); // a clean connection back to the pool
        }
        // Else closed: its session is ended by the shard's next statement (listed as
        // stranded), and waited for by `end_once_gone`.
        drop(conn);
        match unknown {
            true => self.state.end_once_gone(self.session),
            false => self.state.end(),
        }
        result
    }
}

impl Drop for TxLockGuard {
    /// Closes the connection, which rolls back on the server: a statement of yours that was
    /// interrupted may still be running on it, so it never goes back to the pool. That
    /// statement may be a `COMMIT` (yours through [`TxLockGuard::conn`], a DDL statement's
    /// implicit one), which may land yet, as may that of a `commit` given up before its
    /// answer: the lock then ends as after a `COMMIT` whose answer was lost (see
    /// `end_once_gone`). Ended at once, it let go of its rows on other shards and of the
    /// placement it holds in force while that `COMMIT` could still land, and a process placed
    /// by a reload could lock the key meanwhile (helper 245 F2). A guard dropped with no
    /// statement cut off ends at once.
    fn drop(&mut self) {
        let cut_off = self.conn.as_ref().is_some_and(SessionConn::cut_off);
        let (ended, committing) = {
            let mut rows = self.state.rows.locked();
            rows.committing |= cut_off && !rows.ended;
            (rows.ended, rows.committing)
        };
        drop(Discard(self.conn.take()));
        match (ended, committing) {
            (true, _) => {}
            (false, true) => self.state.end_once_gone(self.session),
            (false, false) => self.state.end(),
        }
    }
}

impl LockRouter {
    /// Locks `key` with `SELECT ... FOR UPDATE` on its row of `shardlock_txlock` (created
    /// race-free on first use) in a new transaction on a dedicated connection of the key's
    /// shard, waiting up to `wait` (zero: `NOWAIT`, answered within the shard's statement
    /// timeout; the server's lock wait timeout is whole seconds, so a wait is also enforced
    /// here). Errors: `Timeout` when the row stayed locked, `Unavailable` when the shard failed
    /// or did not answer within the wait (a wait cut short counts neither for nor against its
    /// breaker); deadlocks are retried. The connection is one of those that transaction locks
    /// and `shard_connection` sessions may use (all but a quarter of `pool.max-size`): when
    /// this process's others hold them all, it waits for one within the wait (a `NOWAIT`
    /// try, within the pool's wait-timeout; the tries on other shards during a move, not at
    /// all), then answers `Backend` with an error that says so (the shard did nothing). During a move, the rows on the other shards are tried
    /// without waiting, each within the statement timeout, which a shard that does not answer
    /// may add to the wait.
    ///
    /// While a reload's move is in progress, a key that moved is locked on the shards it lived
    /// on before as well (each in a transaction of its own, released with the lock), so a
    /// process that has not reloaded yet is kept out; a lock held when its key moves follows
    /// it (see [`TxLockGuard`]).
    ///
    /// Your statements on [`TxLockGuard::conn`] wait for other transactions' row locks as the
    /// shard's pooled sessions do (the server's lock wait set from its `statement-timeout`),
    /// not as long as `wait`.
    ///
    /// Cancellation: an attempt in flight and rows already locked (on the key's shard or, during
    /// a move, on previous shards) have their connections closed, which rolls them back.
    pub async fn lock_in_transaction(&self, key: &str, wait: Duration) -> Result<TxLockGuard> {
        let lock_key = LockKey::new(key)?;
        if self.inner.shared.is_closed() {
            return Err(Error::Shutdown);
        }
        let losses = self.inner.shared.registry_losses();
        let lapses = self.joined(&lock_key)?;
        let deadline = crate::state::instant_after(wait);
        loop {
            // A try without waiting (`NOWAIT`) gets its own bound on every pass.
            let (left, until) = match wait.is_zero() {
                true => (Duration::ZERO, crate::state::instant_after(Duration::ZERO)),
                false => (
                    deadline.saturating_duration_since(tokio::time::Instant::now()),
                    deadline,
                ),
            };
            if let Some(guard) = self
                .lock_under_topology(key, &lock_key, left, until, (lapses, losses))
                .await?
            {
                return Ok(guard);
            }
        }
    }

    /// [`LockRouter::lock_in_transaction`] under the topology in force; `None` when a reload
    /// replaced it while the rows were being locked (they are rolled back: lock again).
    async fn lock_under_topology(
        &self,
        key: &str,
        lock_key: &LockKey,
        wait: Duration,
        deadline: tokio::time::Instant,
        (lapses, losses): (u64, u64),
    ) -> Result<Option<TxLockGuard>> {
        let lock_key = lock_key.clone();
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(&lock_key).clone();
        let previous = topology.previous_locations(&lock_key);
        if let Some(galera) = previous
            .iter()
            .chain([&shard])
            .find(|s| !s.config.nodes.is_empty())
        {
            // A row lock taken by SELECT ... FOR UPDATE holds on one node only, and
            // processes may write through different nodes for a while (a failover, a node
            // left after a timeout): two holders.
            return Err(Error::InvalidArgument {
                name: "lock_in_transaction",
                reason: format!(
                    "shard `{}` is a Galera cluster, where a transaction lock's row lock holds on \
                     one node only; use a lease lock (acquire) for this key",
                    galera.name()
                ),
            });
        }
        // Every row at once, or none: a row is waited for only while this call holds no
        // other; the rest are then tried without waiting, and all let go to wait for one of
        // them that was busy. A lock that follows its moved key holds its old row while it
        // waits for the new one, whatever the shards' order: a call that waited for a row
        // while holding another could wait for that lock while it waited for this call (a
        // deadlock across servers that no server can see), which lost the lock when its
        // follow gave up. The current shard first.
        let order: Vec<&Arc<ShardState>> = [&shard].into_iter().chain(&previous).collect();
        let mut first = 0;
        let (others, conn) = 'rows: loop {
            let mut others = Vec::with_capacity(previous.len());
            let mut conn = None;
            for i in (first..order.len()).chain(0..first) {
                let at = order[i];
                let locked = if i == first {
                    let left = match wait.is_zero() {
                        true => Duration::ZERO,
                        false => deadline.saturating_duration_since(tokio::time::Instant::now()),
                    };
                    lock_row(at, &lock_key, left, deadline, false).await?
                } else {
                    // Busy (the server's answer to `NOWAIT`): waited for next, alone, while
                    // the wait lasts. The try is bounded by the shard's statement timeout.
                    match lock_row(at, &lock_key, Duration::ZERO, deadline, true).await {
                        Err(Error::Timeout { .. }) if tokio::time::Instant::now() < deadline => {
                            first = i;
                            continue 'rows;
                        }
                        locked => locked?,
                    }
                };
                // Closed, not pooled, if a later shard fails, the rows are let go or the
                // caller goes away: a pooled connection would keep the row locked until its
                // next checkout.
                if i == 0 {
                    conn = Some(Discard(Some(locked)));
                } else {
                    others.push((at.clone(), Discard(Some(locked))));
                }
            }
            break (others, conn);
        };
        // Dropped on a lapse: their connections close, which rolls the rows back.
        self.still_joined(&lock_key, lapses)?;
        if self.inner.shared.registry_losses() != losses {
            // Lost to the registry meanwhile (a switch to the heartbeat registry, which is no
            // lapse): it would be handed out lost.
            return Err(self.not_granting(&lock_key, crate::router::LAPSED.to_owned()));
        }
        // Locked under a placement a reload replaced (see `placed_elsewhere_since`): rolled
        // back as the connections close, and locked again under the new placement.
        if self.placed_elsewhere_since(&topology, &lock_key) {
            return Ok(None);
        }
        let conn = conn
            .and_then(|mut c| c.0.take())
            .expect("the current shard is in the order");
        let mut shards = vec![shard.clone()];
        shards.extend(previous);
        let state = Arc::new(TxLockState {
            label: shard.shared.telemetry.key_label(&lock_key),
            key: lock_key,
            placed_epoch: AtomicU64::new(topology.epoch),
            placed_in: std::sync::Mutex::new(topology.fingerprint.clone()),
            rows: std::sync::Mutex::new(TxRows {
                shards,
                others,
                ended: false,
                committing: false,
            }),
            lost: watch::channel(false).0,
            following: tokio::sync::Mutex::new(()),
            shared: self.inner.shared.clone(),
            beat_now: self.inner.beat_now.clone(),
            registry_losses: losses,
            session_looked: std::sync::Mutex::new(tokio::time::Instant::now()),
            session_looking: AtomicBool::new(false),
        });
        // Registered, then the epoch checked: a reload swaps the topology, then looks at the
        // registered locks, so one of the two sees the other.
        {
            let mut locks = self.inner.tx_locks.locked();
            locks.retain(|l| l.strong_count() > 0);
            locks.push(Arc::downgrade(&state) as Weak<dyn FollowsKey>);
        }
        if self.inner.shared.epoch() > topology.epoch {
            follow(Arc::downgrade(&self.inner), state.clone());
        }
        Ok(Some(TxLockGuard {
            session: conn.session(),
            conn: Some(conn),
            key: key.to_owned(),
            shard: shard.name().to_owned(),
            statement_timeout: shard.statement_timeout(),
            state,
            router: Arc::downgrade(&self.inner),
        }))
    }
}

/// How long past its wait a transaction lock's attempt that waits is given before it is cut
/// short.
const CUT_AFTER: Duration = Duration::from_millis(50);

/// Locks `key`'s row of `shardlock_txlock` on `shard` in a new transaction on a dedicated
/// connection, waiting up to `wait` (enforced until `deadline`); see
/// [`LockRouter::lock_in_transaction`].
///
/// The session is one of those callers may use on the shard (see
/// `shardlock_mysql::Shard::session_slot`), waited for outside the shard's breaker (it tells
/// nothing of the shard): until `deadline`, or the pool's wait-timeout for a try without
/// waiting; not at all while the call `holds` rows on other shards (a row is waited for only
/// while the call holds no other), where it answers busy while the wait lasts and the cap's
/// error after. With none free and the shard's breaker open: `Unavailable` at once.
async fn lock_row(
    shard: &Arc<ShardState>,
    lock_key: &LockKey,
    wait: Duration,
    deadline: tokio::time::Instant,
    holds: bool,
) -> Result<SessionConn> {
    let name = shard.name().to_owned();
    let started = tokio::time::Instant::now();
    loop {
        let within = match (holds, wait.is_zero()) {
            (true, _) => None,
            (false, true) => Some(shard.config.pool.wait_timeout),
            (false, false) => Some(deadline.saturating_duration_since(tokio::time::Instant::now())),
        };
        let slot = match shard.unguarded().session_slot(None).await {
            Ok(slot) => Ok(slot),
            // None free, on a shard whose breaker is open: refused at once, as the statement
            // would be, rather than after a wait for a place.
            Err(_) if shard.breaker_state() == BreakerState::Open => {
                return Err(Error::Unavailable {
                    shard: name,
                    source: shard.rejected(),
                })
            }
            Err(_) => shard.unguarded().session_slot(within).await,
        };
        let slot = match slot {
            Ok(slot) => slot,
            // Busy while the wait lasts: the caller waits for this shard's row next, alone.
            Err(_) if holds && tokio::time::Instant::now() < deadline => {
                return Err(Error::Timeout {
                    key_label: shard.shared.telemetry.key_label(lock_key),
                    waited: started.elapsed(),
                })
            }
            Err(source) => {
                return Err(Error::Backend {
                    shard: name,
                    source,
                })
            }
        };
        // Set once a statement that may wait for the row's lock is sent.
        let waiting = AtomicBool::new(false);
        let waiting = &waiting;
        let take = |backend| take_row(backend, lock_key, wait, waiting, slot);
        let attempt = if wait.is_zero() {
            // A try without waiting (`NOWAIT`) waits for no lock: its answer tells of the shard
            // as any statement's does, and is judged so, within the statement timeout (its
            // round trips may take longer than a cut would allow on a far link). Unless the
            // row was missing and its upsert waited behind another transaction creating it: a
            // busy key, answered so, whose time tells nothing of the shard.
            let limit = shard.statement_timeout();
            let bounded = |backend| async move {
                match tokio::time::timeout(limit, take(backend)).await {
                    Ok(answer) => answer,
                    Err(_) if waiting.load(Ordering::Relaxed) => Err(BackendError::new(
                        BackendErrorKind::LockWaitTimeout,
                        None,
                        "the row being created stayed locked by another transaction",
                    )),
                    Err(_) => Err(BackendError::new(
                        BackendErrorKind::Timeout,
                        None,
                        format!("no answer within {limit:?} (statement-timeout)"),
                    )),
                }
            };
            let timing = |_: &_| match waiting.load(Ordering::Relaxed) {
                true => Timing::Ignored,
                false => Timing::Counts,
            };
            shard.call_judged(timing, bounded).await
        } else {
            // Bounded by the wait, and no half-open breaker's probe (see
            // `ShardState::call_lock_wait`). Cut short, the call is dropped before the breaker judged it
            // (a probe gives its slot back): whether the row's holder or the shard held it
            // up, a wait tells nothing of the shard's health, and counted as an answer it
            // closed a breaker on a shard that never answered. The shard's own timeouts
            // within it (its pool's wait, a ping) count as ever.
            let attempt = shard.call_lock_wait(take);
            match tokio::time::timeout_at(deadline + CUT_AFTER, attempt).await {
                Ok(attempt) => attempt,
                // Cut short while waiting for the row's lock: its holder kept it.
                Err(_) if waiting.load(Ordering::Relaxed) => {
                    return Err(Error::Timeout {
                        key_label: shard.shared.telemetry.key_label(lock_key),
                        waited: started.elapsed(),
                    })
                }
                Err(_) => {
                    return Err(Error::Unavailable {
                        shard: name,
                        source: BackendError::new(
                            BackendErrorKind::Timeout,
                            None,
                            "the shard did not answer within the wait",
                        ),
                    })
                }
            }
        };
        match attempt {
            Ok(conn) => return Ok(conn),
            // NOWAIT answers 3572 (MySQL) or 1205 (MariaDB) when the row is locked.
            Err(e)
                if e.kind == BackendErrorKind::LockWaitTimeout
                    || e.code == Some(3572)
                    || (e.kind == BackendErrorKind::Deadlock
                        && tokio::time::Instant::now() >= deadline) =>
            {
                return Err(Error::Timeout {
                    key_label: shard.shared.telemetry.key_label(lock_key),
                    waited: started.elapsed(),
                })
            }
            Err(e) if e.kind == BackendErrorKind::Deadlock => continue,
            Err(e) => return Err(e.into_error(&name)),
        }
    }
}

/// The checkout and the lock statement of [`lock_row`]; `waiting` is set once a statement that
/// may wait for the row's lock is sent.
async fn take_row(
    backend: &shardlock_mysql::Shard,
    lock_key: &LockKey,
    wait: Duration,
    waiting: &AtomicBool,
    slot: tokio::sync::OwnedSemaphorePermit,
) -> std::result::Result<SessionConn, BackendError> {
    // Until the lock is ours, a failed or abandoned attempt's connection is closed, not
    // pooled: a lock statement still waiting on the server must not end up holding the row on
    // an idle pooled connection.
    let mut conn = Discard(Some(backend.connection_in(slot).await?));
    let open = conn.0.as_mut().expect("set above");
    let after = backend.statement_timeout();
    open.lock_tx_row(lock_key.stored(), wait, after, waiting)
        .await?;
    Ok(conn.0.take().expect("set above"))
}

impl FollowsKey for TxLockState {
    fn placed_epoch(&self) -> u64 {
        self.placed_epoch.load(Ordering::Acquire)
    }

    fn follow(self: Arc<Self>, inner: Weak<Inner>) {
        follow(inner, self);
    }

    fn pending_since(&self, epoch: u64) -> Option<(u64, String)> {
        // The fingerprint first: `follow_now` writes the epoch first, so a follow between the
        // two reads pairs a newer epoch with the older fingerprint (advertising an older
        // placement is safe), never the reverse.
        let placed_in = self.placed_in.locked().clone();
        let placed = self.placed_epoch.load(Ordering::Acquire);
        let rows = self.rows.locked();
        // A lock whose `COMMIT` may still land counts as held, lost or not.
        let holds = rows.committing || (!*self.lost.borrow() && !rows.ended);
        (placed < epoch && holds).then_some((placed, placed_in))
    }

    fn holds_on(&self, shard: &ShardState) -> bool {
        let rows = self.rows.locked();
        !rows.ended && rows.shards.iter().any(|s| std::ptr::eq(&**s, shard))
    }

    fn commit_may_land(&self) -> bool {
        self.rows.locked().committing
    }
}

/// [`follow_now`] in the background.
fn follow(inner: Weak<Inner>, state: Arc<TxLockState>) {
    let Some(shared) = inner.upgrade().map(|i| i.shared.clone()) else {
        return;
    };
    shared.spawn(follow_now(inner, state));
}

/// Locks a transaction lock's row where its key lives now too (and where it lived before, for
/// earlier placements still in force), within half the move window of the reload; or marks the
/// lock lost. Nothing to do for a lock placed under the topology in force.
async fn follow_now(inner: Weak<Inner>, state: Arc<TxLockState>) {
    {
        let _one_at_a_time = state.following.lock().await;
        let Some(topology) = inner.upgrade().map(|i| i.topology.load_full()) else {
            return;
        };
        if state.placed_epoch.load(Ordering::Acquire) >= topology.epoch {
            return;
        }
        // Where the key lives now, and every earlier location still in force (after two
        // reloads in a row, the middle placement's processes still lock it there); those
        // already locked are kept. Each is waited for holding the others, in any order: a
        // call that locks the key waits for no row while it holds another.
        let mut targets: Vec<Arc<ShardState>> = topology.previous_locations(&state.key);
        targets.push(topology.locate(&state.key).clone());
        // A Galera shard first: the lock cannot follow there (below), and is lost before it
        // waits for any other row.
        targets.sort_by(|a, b| {
            let plain = |s: &ShardState| s.config.nodes.is_empty();
            (plain(a), a.name()).cmp(&(plain(b), b.name()))
        });
        let deadline = topology.reloaded_at + topology.config.move_window() / 2;
        let mut committing = false;
        for target in targets {
            let there = {
                let rows = state.rows.locked();
                // Ended with its `COMMIT` perhaps still to land (`end_once_gone`): it stays
                // placed where it was until that is settled.
                if rows.ended && rows.committing {
                    committing = true;
                    break;
                }
                rows.ended || rows.shards.iter().any(|s| s.same_database(&target))
            };
            if there {
                continue;
            }
            let wait = deadline.saturating_duration_since(Moment::now());
            // A row lock on a Galera shard holds on one node only (such locks are refused
            // there): the key moved where this lock cannot follow it.
            let galera = !target.config.nodes.is_empty();
            let locked = match galera {
                // (Its rows elsewhere held meanwhile, as its wait for the row is.)
                false => lock_row(&target, &state.key, wait, deadline.timer(), false).await,
                true => Err(Error::InvalidArgument {
                    name: "lock_in_transaction",
                    reason: format!(
                        "shard `{}` is a Galera cluster, where a transaction lock's row lock \
                         holds on one node only",
                        target.name()
                    ),
                }),
            };
            match locked {
                Ok(conn) => {
                    let mut rows = state.rows.locked();
                    if !rows.ended {
                        rows.shards.push(target.clone());
                        rows.others.push((target, Discard(Some(conn))));
                    } else if rows.committing {
                        committing = true;
                        break;
                    }
                }
                // An ended lock (committed, or rolled back) is not lost; one whose `COMMIT`
                // may still land stays placed where it was.
                Err(_) if state.rows.locked().ended => {
                    committing = state.rows.locked().committing;
                    break;
                }
                Err(e) => {
                    tracing::warn!(key = state.label, shard = target.name(), error = %shardlock_core::Report(&e), "shardlock could not lock a moved key's row on its new shard");
                    state.mark_lost(match galera {
                        false => "its key moved in a reload and its row could not be locked on the new shard in time",
                        true => "its key moved in a reload to a Galera shard, where a transaction lock holds on one node only",
                    });
                    // Lost: the rows it took elsewhere are rolled back now, not when its guard
                    // ends (they would keep the key's new location from the others); unless
                    // its `COMMIT` may be on its way (see `TxLockGuard::commit`).
                    let others = {
                        let mut rows = state.rows.locked();
                        committing = rows.committing;
                        match committing {
                            true => Vec::new(),
                            false => std::mem::take(&mut rows.others),
                        }
                    };
                    drop(others);
                    break;
                }
            }
        }
        // Not while a `COMMIT` that may land is pending on a failed follow: the lock still
        // holds where it was placed, and the fleet must keep the move in force until then.
        if committing {
            return;
        }
        let before = state
            .placed_epoch
            .fetch_max(topology.epoch, Ordering::AcqRel);
        if before < topology.epoch {
            *state.placed_in.locked() = topology.fingerprint.clone();
        }
    }
    // Followed (or lost): the topology it followed to may be advertised now.
    if let Some(inner) = inner.upgrade() {
        inner.beat_now.notify_one();
    }
}
