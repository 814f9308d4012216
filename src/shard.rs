//! The shard handle: a shard's pool behind its circuit breaker, and the leases this process
//! holds there. Every statement that decides a grant goes through [`ShardState::call`] (or one
//! of its named variants), so the breaker sees it; the keeper task that renews the leases is
//! started and supervised from here (see [`keeper`]).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardlock_core::config::ShardConfig;
use shardlock_core::{
    Admission, BackendError, BackendErrorKind, Breaker, BreakerConfig, BreakerState, CallOutcome,
    ProbeTicket, Ticket, Transition,
};
use shardlock_mysql::{Attempt, CasGiveBack, GrantRequest, ReleaseAnswer, Shard};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::clock::Moment;
use crate::queue::Want;
use crate::sync::LockExt;
pub(crate) use lanes::is_not_sent;
use lanes::{no_answer, LeaveLane};

mod keeper;
mod lanes;
mod lease;
mod shared;

pub(crate) use keeper::spawn_keeper;
pub(crate) use lease::{Grant, LeaseState, NOT_RENEWED, SHUT_DOWN, UNHEARD_ROW};
pub(crate) use shared::{Shared, REGISTRY_LAPSED, REGISTRY_SWITCHED, REGISTRY_TAKEN_OVER};

/// Breaker transitions kept per shard for `breaker_transitions`.
const TRANSITIONS_KEPT: usize = 64;

/// What a caller is told of a lease statement whose row stayed locked by another transaction
/// for the server's whole lock wait (1205, which callers never see): a timeout, nothing done.
pub(crate) fn lock_wait_told(e: BackendError) -> BackendError {
    if e.kind != BackendErrorKind::LockWaitTimeout {
        return e;
    }
    let mut timeout = BackendError::new(
        BackendErrorKind::Timeout,
        None,
        "its row stayed locked by another transaction for the server's whole lock wait; this \
         try did nothing",
    );
    // An earlier try whose reply was lost may have acted.
    timeout.maybe_applied = e.maybe_applied;
    timeout
}

/// `e`, a shard's failure that came after `done` (said in its message), its cause as its
/// source: a call that did part of its work before a statement failed says what stands.
/// A backend error so said counts as `maybe_applied`: what was done was.
pub(crate) fn done_before(e: shardlock_core::Error, done: String) -> shardlock_core::Error {
    use shardlock_core::Error;
    let said = |source: BackendError| BackendError {
        source: Box::new(DoneBefore {
            done,
            source: source.source,
        }),
        maybe_applied: true,
        ..source
    };
    match e {
        Error::Unavailable { shard, source } => Error::Unavailable {
            shard,
            source: said(source),
        },
        Error::Backend { shard, source } => Error::Backend {
            shard,
            source: said(source),
        },
        other => other,
    }
}

/// What a call did before a shard failed (see [`done_before`]): the failure's cause follows
/// as its source.
#[derive(Debug)]
struct DoneBefore {
    done: String,
    source: Box<dyn std::error::Error + Send + Sync + 'static>,
}

impl std::fmt::Display for DoneBefore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "after {}, this shard failed", self.done)
    }
}

impl std::error::Error for DoneBefore {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.source)
    }
}

/// Where a CAS take given back may have been carried, asked once its first shard answered
/// and again after each round (see [`ShardState::give_back_cas`]): the topology epoch it was
/// read under, and the shards.
pub(crate) type CasFollow =
    Box<dyn Fn() -> futures_util::future::BoxFuture<'static, (u64, Vec<Arc<ShardState>>)> + Send>;

/// A shard and the leases this process holds on it.
#[derive(Debug)]
pub(crate) struct ShardState {
    /// The backend: reached only through the breaker ([`ShardState::call`] and its variants),
    /// or through [`ShardState::unguarded`], whose name says it skips the breaker.
    backend: Shard,
    /// The settings it was built from: a reload reuses the shard only if they are unchanged.
    pub(crate) config: ShardConfig,
    /// Unique among the shard states of this process (a reload may build another state under
    /// the same name, for another server).
    pub(crate) serial: u64,
    leases: Mutex<HashMap<u64, Arc<LeaseState>>>,
    wake: Arc<Notify>,
    /// The shortest renewal period of the leases held here, in ms (`u64::MAX` when none), so
    /// that the keeper is only woken when a new lease needs an earlier tick.
    shortest_ms: AtomicU64,
    pub(crate) shared: Arc<Shared>,
    breaker: Mutex<Breaker>,
    /// The last transitions of the breaker, oldest first.
    transitions: Mutex<std::collections::VecDeque<Transition>>,
    /// Leases granted in process while the breaker was open, not yet re-acquired on the shard.
    local: Mutex<HashMap<u64, Arc<LeaseState>>>,
    /// The shard's name as a metric attribute value (cheap to clone).
    pub(crate) label: opentelemetry::StringValue,
    /// Hold-time histograms bound to this shard (remote, local), while metrics are on.
    pub(crate) holds: Option<[opentelemetry::metrics::BoundHistogram<f64>; 2]>,
    /// Acquire histograms bound to this shard, per namespace.
    pub(crate) acquires: crate::telemetry::BoundAcquires,
    /// The server and schema behind the shard, once read (see [`Shard::identity`]): two shard
    /// states with the same identity are the same database.
    pub(crate) identity: std::sync::OnceLock<String>,
    /// The identity as the latest heartbeat read it (see [`ShardState::server_identity`]).
    seen_identity: Mutex<Option<String>>,
    /// When this process's latest heartbeat that this shard took was sent.
    beat_landed: Mutex<Option<Moment>>,
    /// A heartbeat found a silence of this process's row here and left it in the row: the
    /// next one moves the row on without judging (see [`ShardState::silence_to_judge`]).
    silence_seen: AtomicBool,
    /// A node clock skew a reload raised for this shard's database, in µs, above its config's
    /// (which this state keeps): its leases allow for it (see [`ShardState::raise_skew`]).
    skew_floor_us: AtomicU64,
    /// Acquires waiting to be sent (see [`lanes`]).
    acquire_lane: lanes::Lane<(GrantRequest, bool), Attempt>,
    /// Releases waiting to be sent: (key, owner).
    release_lane: lanes::Lane<(Vec<u8>, String), ReleaseAnswer>,
    /// Set while a reconciliation pass runs (beside the keeper loop).
    reconciling: std::sync::atomic::AtomicBool,
    /// Keys an acquire found locked by another transaction past the server's lock wait, and
    /// until when their acquires are sent apart from the batches (see `lanes.rs`).
    locked_keys: Mutex<std::collections::HashMap<Vec<u8>, std::time::Instant>>,
    /// Whether `locked_keys` may hold a key: most batches never look at it.
    any_locked: std::sync::atomic::AtomicBool,
    /// Acquires of those keys sent apart at once, at most (each waits out a lock wait on a
    /// connection of its own): an eighth of the pool, at least one. Past that they go in the
    /// batches, as any key: none waits for a turn to be sent apart.
    apart: Arc<tokio::sync::Semaphore>,
    /// Until when releases are sent alone, after a batch of them was undone by a row locked
    /// by another transaction (the batch's update may wait on rows it does not change).
    releases_alone_until: Mutex<Option<std::time::Instant>>,
    /// Give-backs retrying in the background (see [`ShardState::give_back`]), and transaction
    /// locks whose `COMMIT` may still land here waiting for their session to end: a shard that
    /// left the topology keeps its pool until they end.
    settling: std::sync::atomic::AtomicUsize,
    /// Set while this state is not in the topology in force: it left in a reload (for another
    /// state of the same database, one rebuilt with changed settings, say). Its leases are
    /// then handed over neither in memory nor through it, so a hot key's chain of hand-offs
    /// moves to the state in force (its pool, breaker and credentials) at its next release.
    left: AtomicBool,
    /// The keeper panics at its next tick (tests of its supervision).
    #[cfg(feature = "fault-injection")]
    pub(crate) panic_next_tick: std::sync::atomic::AtomicBool,
    /// The reconcile's next look at whose row a key's is fails (tests of that failure).
    #[cfg(feature = "fault-injection")]
    pub(crate) fail_next_look: std::sync::atomic::AtomicBool,
}

/// A give-back's (or an ending transaction lock's) hold on its shard, counted in the shard's
/// `settling` while it lives.
pub(crate) struct Settling(pub(crate) Arc<ShardState>);

impl Settling {
    pub(crate) fn new(shard: &Arc<ShardState>) -> Self {
        shard
            .settling
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self(shard.clone())
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        self.0
            .settling
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The breaker's clock: Tokio's, so tests with paused time drive it.
fn breaker_now() -> std::time::Instant {
    Instant::now().into_std()
}

impl ShardState {
    /// How far the clocks of the servers that decide this shard's lease expiry may be apart:
    /// for a Galera shard twice `node-clock-skew` (each node is used only within it of this
    /// process's clock, so two nodes are at most twice apart), else nothing (one server).
    pub(crate) fn clock_skew(&self) -> Duration {
        if self.config.nodes.is_empty() {
            Duration::ZERO
        } else {
            self.config.node_clock_skew * 2
        }
    }

    /// [`ShardState::clock_skew`], or the larger one a reload raised since for this shard's
    /// database (see [`ShardState::raise_skew`]): what its leases allow for.
    pub(crate) fn leases_skew(&self) -> Duration {
        let floor = Duration::from_micros(self.skew_floor_us.load(Ordering::SeqCst));
        self.clock_skew().max(floor)
    }

    /// Whether a grant of `want` sent to this shard at `sent` may have ended on the shard by
    /// now: by the drift and node skew in force now, if a reload raised them since (the lease
    /// is placed by them).
    pub(crate) fn ran_out(&self, want: &Want, sent: Moment) -> bool {
        Moment::now()
            >= Want::end_by(
                sent,
                want.ttl,
                want.drift_ppm.max(self.shared.drift_ppm()),
                want.clock_skew.max(self.leases_skew()),
            )
    }

    /// A reload raised the node clock skew of this shard's database to `skew` (this state keeps
    /// its old config, and its leases): they allow for it from now on, and so does every lease
    /// registered here later (a grant in flight across the reload). Set before the leases are
    /// listed, as the registrations list theirs before they read it: one of the two sees the
    /// other.
    pub(crate) fn raise_skew(&self, skew: Duration) {
        let us = u64::try_from(skew.as_micros()).unwrap_or(u64::MAX);
        self.skew_floor_us.fetch_max(us, Ordering::SeqCst);
        for lease in self.held().into_iter().chain(self.locals()) {
            lease.allow_skew(skew);
        }
    }

    pub(crate) fn new(
        shard: Shard,
        config: ShardConfig,
        breaker: BreakerConfig,
        shared: Arc<Shared>,
    ) -> Arc<Self> {
        let label = opentelemetry::StringValue::from(Arc::<str>::from(shard.name()));
        let registry = shared.clone();
        let apart = (config.pool.max_size / 8).max(1);
        let state = Arc::new(Self {
            holds: shared.telemetry.bind_holds(&label),
            acquires: crate::telemetry::BoundAcquires::default(),
            config,
            leases: Mutex::default(),
            wake: Arc::default(),
            shortest_ms: AtomicU64::new(u64::MAX),
            shared,
            breaker: Mutex::new(Breaker::new(breaker)),
            transitions: Mutex::default(),
            local: Mutex::default(),
            label,
            backend: shard,
            identity: std::sync::OnceLock::new(),
            seen_identity: Mutex::default(),
            beat_landed: Mutex::default(),
            silence_seen: AtomicBool::new(false),
            skew_floor_us: AtomicU64::new(0),
            serial: {
                static SERIALS: AtomicU64 = AtomicU64::new(0);
                SERIALS.fetch_add(1, Ordering::Relaxed)
            },
            acquire_lane: lanes::Lane::default(),
            release_lane: lanes::Lane::default(),
            reconciling: std::sync::atomic::AtomicBool::new(false),
            locked_keys: Mutex::default(),
            any_locked: std::sync::atomic::AtomicBool::new(false),
            apart: Arc::new(tokio::sync::Semaphore::new(apart)),
            releases_alone_until: Mutex::default(),
            settling: Default::default(),
            left: AtomicBool::new(false),
            #[cfg(feature = "fault-injection")]
            panic_next_tick: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "fault-injection")]
            fail_next_look: std::sync::atomic::AtomicBool::new(false),
        });
        registry.register(&state);
        state
    }

    /// Runs one call to the shard through its breaker: refused at once (kind
    /// [`BackendErrorKind::BreakerOpen`]) while the breaker is open, else run and its outcome
    /// recorded. Infrastructure failures and slow calls count against the shard; answers,
    /// a busy lock included, count for it. A half-open probe dropped before it completes gives
    /// its permit back.
    pub(crate) async fn call<'s, T, F>(
        &'s self,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        self.call_judged(|_| Timing::Counts, statement).await
    }

    /// [`ShardState::call`] whose duration is judged as `timing` says of its outcome.
    pub(crate) async fn call_judged<'s, T, F>(
        &'s self,
        timing: impl FnOnce(&Result<T, BackendError>) -> Timing,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        self.call_timed(statement(&self.backend), timing).await
    }

    /// [`ShardState::call`] for a lease statement that takes its row's lock (a release, an
    /// extend, a hand-off, a minimum hold, stored data): it may wait behind another
    /// transaction's lock on the row (a transaction lock on the key, a console session), which
    /// says nothing of the shard's health. A slow answer is judged by a statement that waits for no lock instead, as a
    /// grant's is, and the server's answer that the lock wait ran out (1205: nothing was done;
    /// not sent again) counts for the shard. That answer is a timeout to the caller, who
    /// never sees 1205 (a release's row is given back in the background).
    pub(crate) async fn call_row<'s, T, F>(
        &'s self,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        self.call_row_waited(statement)
            .await
            .map_err(lock_wait_told)
    }

    /// [`ShardState::call_row`] with the server's answer that the lock wait ran out left as it
    /// is (`LockWaitTimeout`), for a caller that acts on it before telling its callers.
    pub(crate) async fn call_row_waited<'s, T, F>(
        &'s self,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        let result = self.call_timed(statement(&self.backend), |result| match result {
            Ok(_) => Timing::Undecided,
            Err(e) if e.kind == BackendErrorKind::LockWaitTimeout => Timing::Ignored,
            Err(_) => Timing::Counts,
        });
        result.await
    }

    /// [`ShardState::call`] for callers outside the lease machinery (the other lock
    /// patterns): errors name the shard.
    pub(crate) async fn run<'s, T, F>(
        &'s self,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> shardlock_core::Result<T>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        self.call(statement)
            .await
            .map_err(|e| e.into_error(self.name()))
    }

    /// [`ShardState::call`] for calls that may wait for a row lock on purpose (transaction
    /// locks, job claims): their duration says nothing about the shard's health, so it never
    /// counts as a slow call.
    pub(crate) async fn call_waiting<'s, T, F>(
        &'s self,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        self.call_waiting_cut(false, statement).await
    }

    /// [`ShardState::call_waiting`] for a statement given less time than the shard's
    /// statement timeout when `cut`: its timeout then tells of the time it was given, not of
    /// the shard, and decides nothing (a renewal bounded by a lease about to end, after an
    /// outage, would otherwise reopen a breaker that had just let it through as a probe).
    pub(crate) async fn call_waiting_cut<'s, T, F>(
        &'s self,
        cut: bool,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        let Some(ticket) = self.admit().ticket() else {
            return Err(self.rejected());
        };
        self.run_admitted(ticket, statement(&self.backend), |_| Timing::Ignored, cut)
            .await
    }

    /// [`ShardState::call_waiting`] for a call that waits for a lock for as long as it is held
    /// elsewhere (a transaction lock's wait for its row): while the breaker is half-open it
    /// goes ahead without taking a probe's slot, uncounted (see
    /// `shardlock_core::Breaker::admit_waiting`), so that it holds up no call that would close
    /// the breaker.
    pub(crate) async fn call_lock_wait<'s, T, F>(
        &'s self,
        statement: impl FnOnce(&'s Shard) -> F,
    ) -> Result<T, BackendError>
    where
        F: std::future::Future<Output = Result<T, BackendError>> + 's,
    {
        let (admission, transition) = self.breaker.locked().admit_waiting(breaker_now());
        self.note(transition);
        let Some(ticket) = admission.ticket() else {
            return Err(self.rejected());
        };
        self.run_admitted(ticket, statement(&self.backend), |_| Timing::Ignored, false)
            .await
    }

    /// The backend without the breaker: the one way around it, for what an operator or the
    /// application asks directly — migrate, inspect, status counts, force-release, registry
    /// listings, a dropped router's deregistration, and the connection `shard_connection`
    /// hands out. An operator must see the shard as it is even while this process's breaker is
    /// open (that is when they look), and the outcome of their calls says nothing about whether
    /// grants should fail fast. Nothing that grants, renews or releases a lease goes this way.
    pub(crate) fn unguarded(&self) -> &Shard {
        &self.backend
    }

    /// The shard's name, as configured.
    pub(crate) fn name(&self) -> &str {
        self.backend.name()
    }

    /// How long one statement may take before the backend gives up on it.
    pub(crate) fn statement_timeout(&self) -> std::time::Duration {
        self.backend.statement_timeout()
    }

    /// The pool's size and use.
    pub(crate) fn pool_status(&self) -> shardlock_mysql::PoolStatus {
        self.backend.pool_status()
    }

    /// Whether the pool was closed (the shard left the topology and was drained).
    pub(crate) fn is_closed(&self) -> bool {
        self.backend.is_closed()
    }

    /// Closes the pool: connections are closed as they come back.
    pub(crate) fn close(&self) {
        self.backend.close()
    }

    /// One grant attempt, sent alone or in a batch with others of this shard (see
    /// [`lanes`]), through the breaker; its duration is judged by [`acquire_timing`].
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        req: &GrantRequest,
    ) -> Result<Attempt, BackendError> {
        let answer = self.send_acquire(req.clone(), false);
        answer.await.unwrap_or_else(|_| Err(no_answer()))
    }

    /// [`ShardState::acquire`] sent by the caller on a connection of its own, outside the
    /// lanes: for the keeper's re-acquires of local leases, whose row may be locked by another
    /// transaction for the server's whole lock wait. In a lane it would hold a runner that
    /// long, and every caller's acquire of the shard would queue behind it (a lane has one
    /// steady runner for a pool under 16). Judged by the breaker as the lane judges it.
    pub(crate) async fn acquire_alone(&self, req: &GrantRequest) -> Result<Attempt, BackendError> {
        let attempt = self
            .call_timed(self.backend.acquire(req), |r| {
                acquire_timing(r, |a| *a == Attempt::Locked)
            })
            .await;
        if !matches!(&attempt, Err(e) if e.kind == BackendErrorKind::BreakerOpen) {
            (self.shared.stats.acquire_statements).fetch_add(1, Ordering::Relaxed);
        }
        attempt
    }

    /// [`ShardState::acquire`] for a caller that may go away (an acquire's poll): the
    /// dispatcher, whose task always completes, gives the grant back if the caller is gone when
    /// it is answered, and gives the key back when the outcome is unknown — a statement that
    /// failed after it may have reached the server (its reply lost or late), any `Locked`
    /// answer, or a `Held` one after a try whose connection broke once it had sent. An answer
    /// sent but never taken is the caller's to give back (acquire/attempt.rs).
    pub(crate) fn attempt(self: &Arc<Self>, req: &GrantRequest) -> lanes::Answer<Attempt> {
        self.send_acquire(req.clone(), true)
    }

    fn send_acquire(self: &Arc<Self>, req: GrantRequest, orphan: bool) -> lanes::Answer<Attempt> {
        // Refused at once while the breaker is open (its cool-down not over): queued, the
        // request would wait for the lane's runners, busy with statements sent before the
        // breaker opened, only to be refused then. A cool-down that ends meanwhile makes the
        // request a candidate probe, which the runner's own admission decides.
        if self.breaker_state() == BreakerState::Open {
            let (answer, rx) = tokio::sync::oneshot::channel();
            let _ = answer.send(Err(self.rejected()));
            return rx;
        }
        let (answer, start) = self.acquire_lane.push((req, orphan), self.runners());
        if start {
            self.shared.spawn(self.acquire_runner().send_acquires());
        }
        answer
    }

    /// Releases `key` if `owner` still holds it, alone or in a batch with other releases of
    /// this shard (see [`lanes`]), through the breaker; `false` when it did not (the lease was
    /// lost).
    pub(crate) async fn release(
        self: &Arc<Self>,
        key: &[u8],
        owner: &str,
    ) -> Result<ReleaseAnswer, BackendError> {
        if self.release_lane.enter_alone(self.runners()) {
            // Sent by the caller: a release dropped midway leaves the row to its ttl, as it
            // would in a batch whose caller went away (the statement still runs there).
            let _leave = LeaveLane(self);
            // Boxed: every release's future would otherwise be as large as the statement's,
            // and most releases wait in the lane instead.
            return Box::pin(self.call_row(|b| b.release(key, owner))).await;
        }
        // Queued again once if the lane's last runner ended without sending it (the router's
        // runtime shut down, or the runner panicked): this push starts another.
        let mut again = true;
        loop {
            let lease = (key.to_vec(), owner.to_owned());
            let (answer, start) = self.release_lane.push(lease, self.runners());
            if start {
                self.shared.spawn(self.release_runner().send_releases());
            }
            match answer.await.unwrap_or_else(|_| Err(no_answer())) {
                Err(e) if again && lanes::is_not_sent(&e) => again = false,
                answer => return answer,
            }
        }
    }

    /// [`ShardState::release`], leaving the key taken until `at_least` after its grant when
    /// that is set (one statement of its own, not batched: such releases are rare).
    pub(crate) async fn release_after(
        self: &Arc<Self>,
        key: &[u8],
        owner: &str,
        at_least: Option<Duration>,
    ) -> Result<ReleaseAnswer, BackendError> {
        match at_least {
            None => self.release(key, owner).await,
            Some(_) => {
                // Boxed: rare, and the common release's future would be as large as this one.
                let answer = Box::pin(self.call_row(|b| b.release_after(key, owner, at_least)));
                let answer = answer.await;
                // Answered: the row shows its hold (a zero ttl), or is not this owner's.
                if answer.is_ok() {
                    self.shared.released_kept(owner, self.serial);
                }
                answer
            }
        }
    }

    /// Gives back, owner-checked, a row that a statement whose outcome is unknown (its reply lost
    /// or late) may have granted to `owner`: retried in the background until the shard answers,
    /// for up to `ttl` and the shard's clock skew (after that the row has ended by itself).
    /// Nobody else is kept waiting for the lease's whole ttl because one reply got lost.
    pub(crate) fn give_back(self: &Arc<Self>, key: Vec<u8>, owner: String, ttl: Duration) {
        self.release_in_background(key, owner, ttl, Ends::Released);
    }

    /// [`ShardState::give_back`] for a row that is surely `owner`'s or already gone, because
    /// its release failed and nothing that could grant it to `owner` again is still pending:
    /// any answer of the shard ends it.
    pub(crate) fn release_later(self: &Arc<Self>, key: Vec<u8>, owner: String, ttl: Duration) {
        self.release_in_background(key, owner, ttl, Ends::AnyAnswer);
    }

    /// Frees `owner`'s row of `key` whenever it appears, for as long as a row written now
    /// could last (`ttl` and the shard's clock skew): a try of a grant to `owner` whose reply
    /// was lost may still land where its session could not be ended (a Galera node, a proxy
    /// that keeps sessions of its own), and take the row again, also once a release freed it.
    /// Every answer is let pass; the owner must be held by no lease of this process (its row
    /// let go, or never taken). A row that must stay taken `at_least` after its grant is
    /// released as its holder's release is, keeping that hold.
    pub(crate) fn watch_lost_try(
        self: &Arc<Self>,
        key: Vec<u8>,
        owner: String,
        ttl: Duration,
        at_least: Option<Duration>,
    ) {
        self.release_in_background(key, owner, ttl, Ends::Never(at_least));
    }

    fn release_in_background(
        self: &Arc<Self>,
        key: Vec<u8>,
        owner: String,
        ttl: Duration,
        ends: Ends,
    ) {
        let giving_back = Settling::new(self);
        self.shared.spawn(async move {
            let shard = &giving_back.0;
            // As long as the row can last: on a Galera shard a node whose clock lags may keep
            // it up to the nodes' skew longer.
            let until = Instant::now() + ttl + shard.clock_skew();
            let mut backoff = shardlock_core::Backoff::new(
                std::time::Duration::from_millis(5),
                std::time::Duration::from_millis(500),
            );
            // Until the pool is closed (shutdown, or the shard left the topology): the row
            // then ends by expiry.
            while Instant::now() < until && !shard.is_closed() {
                // Not while the breaker is open, nor while all its half-open probes are out (a
                // refusal not counted as a caller's). While it is half-open the release may be
                // a probe: the give-back may be all this process sends the shard (its callers
                // gone, no lease to renew), and waiting for callers to close the breaker would
                // then keep the key held by nobody for its whole ttl. A timeout or a slow answer
                // decides nothing (`tentative`): it may wait behind the very statement it
                // undoes, or behind another transaction's lock on the row, neither of which
                // says the shard is sick; a refused connection or a lost server does.
                let Some(ticket) = shard.admit().ticket() else {
                    tokio::time::sleep(backoff.next_delay()).await;
                    continue;
                };
                // Alone, not in a batch: a batch release counts a free row as freed, and the
                // row may be free only because the statement being undone has not written it
                // yet; a single release waits behind that statement's lock.
                let released = match ends {
                    Ends::Never(Some(at_least)) => {
                        let release = shard.backend.release_after(&key, &owner, Some(at_least));
                        shard
                            .run_admitted(ticket, release, |_| Timing::Counts, true)
                            .await
                    }
                    _ => {
                        let release = shard.backend.release(&key, &owner);
                        shard
                            .run_admitted(ticket, release, |_| Timing::Counts, true)
                            .await
                    }
                };
                // Undoing a grant: a "not ours" may come before the statement being undone has
                // finished on the server (its client gave up; the server did not), so only a
                // release that freed the row ends it early.
                match (released, ends) {
                    (_, Ends::Never(_)) => {}
                    (Ok(ReleaseAnswer::Released), _) => return,
                    (Ok(_), Ends::AnyAnswer) => return,
                    _ => {}
                }
                tokio::time::sleep(backoff.next_delay()).await;
            }
        });
    }

    /// Undoes, by its call token, a CAS take whose outcome is unknown: retried in the
    /// background until the shard answers (CAS rows never expire), or its pool closes (a
    /// warning then names the key). On a plain shard the answer comes after the take, if it
    /// is still on its way: the shard's next statement ends such a session first (not on a
    /// Galera shard, where a take still on its way may land after the answer). Not counted as
    /// a give-back a leaving shard's drain waits for: it has no end of its own.
    ///
    /// A move's carry may have brought the take to where the key lives now (its copies bear
    /// the take's token), also while a copy of unknown outcome is kept beside a row found
    /// here: `then` names those shards once this one answered (the key's shards under the
    /// topology in force then, a reload since included), where it is given back too, undone,
    /// on each in turn; asked again once they answered, until no reload came during a round
    /// (one may have moved the key on, and a carry the take with it). `how` says how the row
    /// is freed here (see [`CasGiveBack`]).
    pub(crate) fn give_back_cas(
        self: &Arc<Self>,
        key: Vec<u8>,
        token: String,
        how: CasGiveBack,
        then: Option<CasFollow>,
    ) {
        let first = self.clone();
        self.shared.spawn(async move {
            // Closed (a shard that left in a reload): where the key went is still looked at.
            first.give_back_cas_until_answered(&key, &token, how).await;
            let Some(then) = then else { return };
            // Asked only now: a carry may have moved the take while the first shard was down.
            // Earlier placements first: a carry in flight from one of them to the key's shard
            // holds its row there, so the give-back there waits for its copy. Asked again
            // after each round in which a reload came: a carry held up on a shard of the round
            // (it holds the row there) may have moved the take on to where the reload puts the
            // key, a shard visited already among them (a reload undone).
            let mut round = None;
            loop {
                let (epoch, shards) = then().await;
                if round == Some(epoch) {
                    return;
                }
                for shard in shards {
                    // The first round skips the first shard: it just answered.
                    if round.is_some() || !shard.same_database(&first) {
                        let undone = CasGiveBack::Undone(None);
                        shard
                            .give_back_cas_until_answered(&key, &token, undone)
                            .await;
                    }
                }
                round = Some(epoch);
            }
        });
    }

    /// One give-back of a CAS take by its token, retried until this shard answers (or it left,
    /// or the router shut down: a warning names the key).
    async fn give_back_cas_until_answered(&self, key: &[u8], token: &str, how: CasGiveBack) {
        let mut backoff = shardlock_core::Backoff::new(
            std::time::Duration::from_millis(5),
            std::time::Duration::from_millis(500),
        );
        loop {
            if self.is_closed() {
                tracing::warn!(
                    shard = self.name(),
                    key = self.shared.telemetry.stored_key_label(key),
                    token,
                    "shardlock gave up giving back a CAS take whose outcome is unknown (the \
                     shard left or the router shut down): the row may stay owned; free it by \
                     its token"
                );
                return;
            }
            match self.call(|b| b.give_back_cas(key, token, how)).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(shard = self.name(), error = %shardlock_core::Report(&e), "shardlock CAS give-back failed; retrying");
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    }

    /// Marks this state as out of the topology in force (`true`), or in it again.
    pub(crate) fn set_left(&self, left: bool) {
        self.left.store(left, Ordering::Release);
    }

    /// Whether this state is out of the topology in force (see [`ShardState::set_left`]).
    pub(crate) fn has_left(&self) -> bool {
        self.left.load(Ordering::Acquire)
    }

    /// Whether give-backs are still retrying in the background, or transaction locks wait
    /// for their session here to end.
    pub(crate) fn settling(&self) -> bool {
        self.settling_count() > 0
    }

    /// How many calls [`ShardState::settling`] counts.
    pub(crate) fn settling_count(&self) -> u64 {
        self.settling.load(std::sync::atomic::Ordering::Relaxed) as u64
    }

    /// How many batches of each kind may be in flight (`pool.batches-in-flight`, and more
    /// while many requests wait: see [`lanes::Runners`]).
    fn runners(&self) -> lanes::Runners {
        let pool = &self.config.pool;
        lanes::Runners::new(pool.batches_in_flight(), pool.max_size)
    }

    /// Acquires and releases waiting for a runner of this shard now.
    pub(crate) fn lanes_waiting(&self) -> usize {
        self.acquire_lane.waiting() + self.release_lane.waiting()
    }

    /// Acquire and release batches out to this shard now (a lone request is a batch of one).
    pub(crate) fn batches_in_flight_now(&self) -> usize {
        self.acquire_lane.running() + self.release_lane.running()
    }

    /// Whether a call may go to the shard now (see [`Breaker::admit`]); a transition it makes
    /// is noted. An admitted call must be run with [`ShardState::run_admitted`].
    fn admit(&self) -> Admission {
        let (admission, transition) = self.breaker.locked().admit(breaker_now());
        self.note(transition);
        admission
    }

    async fn call_timed<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
        timing: impl FnOnce(&Result<T, BackendError>) -> Timing,
    ) -> Result<T, BackendError> {
        let Some(ticket) = self.admit().ticket() else {
            return Err(self.rejected());
        };
        self.run_admitted(ticket, call, timing, false).await
    }

    /// Runs a call [`ShardState::admit`] let through (with its `ticket`: a call, or a probe) and
    /// reports how it went to the breaker: a failure, or a success slower than the slow-call
    /// threshold as `timing` says its duration tells of the shard. A `tentative` call that
    /// timed out or was slow decides nothing (a probe's slot is given back unjudged): only a
    /// prompt answer or a failure that is not a timeout is recorded.
    async fn run_admitted<T>(
        &self,
        ticket: Ticket,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
        timing: impl FnOnce(&Result<T, BackendError>) -> Timing,
        tentative: bool,
    ) -> Result<T, BackendError> {
        let probe = match ticket {
            Ticket::Probe(probe) => Some(probe),
            Ticket::Call(_) => None,
        };
        let mut permit = ProbePermit {
            state: self,
            ticket: probe,
        };
        let started = Instant::now();
        let result = call.await;
        permit.ticket = None;
        let outcome = match &result {
            Err(e) if e.kind.is_infrastructure() => CallOutcome::Failure,
            _ => CallOutcome::Success,
        };
        self.shared.telemetry.statement(
            &self.label,
            outcome == CallOutcome::Failure,
            started.elapsed(),
        );
        // A Galera shard's commits all wait while its cluster evicts a dead member, whichever
        // node this process uses: a call is slow only beyond the longest that may take
        // (errors, a statement timeout among them, still count).
        let elapsed = started.elapsed();
        let timing = timing(&result);
        let took = if timing != Timing::Ignored && elapsed > self.backend.stall_allowance() {
            elapsed
        } else {
            Duration::ZERO
        };
        let slow_call = self.breaker.locked().config().slow_call;
        let slow = took >= slow_call && !took.is_zero();
        if timing == Timing::Undecided && slow && !tentative {
            // Judged by a statement that waits for no lock instead: slow too, the link or
            // the server is (at the cost of one statement per slow answer). Only through an
            // idle connection (a wait for the pool may be one behind row locks too), else
            // nothing is decided. Awaited to its end: one given up on the wire would leave a
            // session for the shard's next statement to end first. A probe dropped meanwhile
            // gives its slot back.
            if self.pool_status().available == 0 {
                if let Some(probe) = probe {
                    self.breaker.locked().abandon_probe(probe);
                }
                return result;
            }
            permit.ticket = probe;
            let started = Instant::now();
            let ping = self.backend.clock_us().await;
            permit.ticket = None;
            let elapsed = started.elapsed();
            let outcome = match &ping {
                Err(e) if e.kind.is_infrastructure() => CallOutcome::Failure,
                _ => CallOutcome::Success,
            };
            let took = if elapsed > self.backend.stall_allowance() {
                elapsed
            } else {
                Duration::ZERO
            };
            let transition = (self.breaker.locked()).record(breaker_now(), outcome, took, ticket);
            self.note(transition);
            return result;
        }
        let mut breaker = self.breaker.locked();
        let timed_out = matches!(&result, Err(e) if e.kind == BackendErrorKind::Timeout);
        let undecided = tentative && (timed_out || slow);
        let transition = match probe {
            Some(probe) if undecided => {
                breaker.abandon_probe(probe);
                None
            }
            None if undecided => None,
            _ => breaker.record(breaker_now(), outcome, took, ticket),
        };
        drop(breaker);
        self.note(transition);
        result
    }

    /// A call the open breaker refused, counted.
    pub(crate) fn rejected(&self) -> BackendError {
        self.shared
            .stats
            .breaker_rejections
            .fetch_add(1, Ordering::Relaxed);
        BackendError::new(
            BackendErrorKind::BreakerOpen,
            None,
            "its breaker is open after repeated failures; probes resume after the breaker \
             cool-down",
        )
    }

    /// The breaker's slow-call threshold.
    pub(crate) fn slow_call(&self) -> Duration {
        self.breaker.locked().config().slow_call
    }

    /// The breaker's state now.
    pub(crate) fn breaker_state(&self) -> BreakerState {
        self.breaker.locked().state(breaker_now())
    }

    /// The breaker's last transitions, oldest first.
    pub(crate) fn breaker_transitions(&self) -> Vec<Transition> {
        self.transitions.locked().iter().copied().collect()
    }

    /// New breaker thresholds (a reload that kept this shard).
    pub(crate) fn reconfigure_breaker(&self, config: BreakerConfig) {
        self.breaker.locked().reconfigure(config);
    }

    fn note(&self, transition: Option<Transition>) {
        let Some(t) = transition else { return };
        let stats = &self.shared.stats;
        match t.to {
            BreakerState::Open => {
                stats.breaker_opened.fetch_add(1, Ordering::Relaxed);
                if t.from == BreakerState::Closed {
                    tracing::warn!(
                        shard = self.backend.name(),
                        "shardlock breaker opened: the shard is failing"
                    );
                } else {
                    tracing::debug!(
                        shard = self.backend.name(),
                        "shardlock breaker probe failed; open again"
                    );
                }
            }
            BreakerState::Closed => {
                stats.breaker_closed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    shard = self.backend.name(),
                    "shardlock breaker closed: the shard is back"
                );
                self.wake.notify_one();
            }
            BreakerState::HalfOpen => {
                tracing::info!(
                    shard = self.backend.name(),
                    "shardlock breaker half-open: probing the shard"
                );
            }
        }
        let mut kept = self.transitions.locked();
        if kept.len() == TRANSITIONS_KEPT {
            kept.pop_front();
        }
        kept.push_back(t);
    }

    /// Registers a lease granted in process; the keeper re-acquires it on the shard once the
    /// breaker lets calls through again. One placed under an older topology than the one in
    /// force follows its key, as [`ShardState::insert`] has it.
    pub(crate) fn insert_local(self: &Arc<Self>, lease: Arc<LeaseState>) {
        self.local.locked().insert(lease.id, lease.clone());
        lease.allow_drift(self.shared.drift_ppm());
        lease.allow_skew(self.leases_skew());
        // Granted after a shutdown took its list of the holds to end (the acquire's statement
        // failed after it began): lost as those are, as in [`ShardState::insert`]. (Listed
        // before the check: one of the two sees the other.)
        if self.shared.is_closed() {
            self.remove_local(lease.id);
            lease.mark_lost(SHUT_DOWN, &self.shared);
            return;
        }
        self.wake.notify_one();
        if lease.placed_epoch.load(Ordering::Acquire) < self.shared.epoch() {
            self.shared.follow(self.clone(), lease);
        }
    }

    /// Moves the end of lease `id`, held locally here, to at least `by` from now: `None` when
    /// it is not held locally (re-acquired on the shard, or released), `Some(false)` when it
    /// ended in process. Under the local map's lock: a re-acquire moving it to the shard
    /// meanwhile sees the new end.
    pub(crate) fn extend_local(&self, id: u64, by: Duration) -> Option<bool> {
        let local = self.local.locked();
        local.get(&id).map(|lease| lease.extend_locally(by))
    }

    /// The leases held locally here, not yet re-acquired on the shard.
    pub(crate) fn locals(&self) -> Vec<Arc<LeaseState>> {
        self.local.locked().values().cloned().collect()
    }

    /// Forgets a local lease that was not re-acquired on the shard yet; `false` when it was
    /// (it is then an ordinary lease to release through the shard) or was lost.
    pub(crate) fn remove_local(&self, id: u64) -> bool {
        self.local.locked().remove(&id).is_some()
    }

    /// Waits out a reconcile moving a local lease to the shard's leases: it does so under the
    /// local map's lock, having seen the router still open there. Once the router is closed,
    /// every lease such a move makes is among [`ShardState::held`] after this.
    pub(crate) fn settle_reconcile(&self) {
        drop(self.local.locked());
    }

    /// Takes every local lease (shutdown).
    pub(crate) fn take_local(&self) -> Vec<Arc<LeaseState>> {
        self.local.locked().drain().map(|(_, l)| l).collect()
    }

    /// How many leases are held locally here, not yet re-acquired on the shard.
    pub(crate) fn local_count(&self) -> usize {
        self.local.locked().len()
    }

    /// Registers a lease held on this shard with its keeper. A lease placed under an older
    /// topology than the one in force is made to follow its key (a reload may have missed
    /// it: it checks the leases registered after it swapped the topology in, and this checks
    /// the epoch after registering, so one of the two sees the other).
    pub(crate) fn insert(self: &Arc<Self>, lease: Arc<LeaseState>) {
        lease.keep_taken(self);
        // A lease without keep-alive is not renewed: it only wakes the keeper to be reported
        // lost at its end.
        let every = if lease.want.keep_alive {
            lease.renew_every.as_millis() as u64
        } else {
            u64::MAX
        };
        let was_empty = {
            let mut leases = self.leases.locked();
            leases.insert(lease.id, lease.clone());
            leases.len() == 1
        };
        // Granted under a config allowing less drift than a reload since (see
        // `Shared::allow_drift`).
        lease.allow_drift(self.shared.drift_ppm());
        lease.allow_skew(self.leases_skew());
        // Granted after a shutdown took its list of the leases to end (an answer that came
        // late): lost and given back as those are, not left held by a guard that shutdown
        // never saw. (Listed before the check: one of the two sees the other.)
        if self.shared.is_closed() && !lease.is_companion() {
            lease.mark_lost(SHUT_DOWN, &self.shared);
            let turn = lease.turn.locked().take();
            let (shard, lease) = (self.clone(), lease.clone());
            if let Some(runtime) = self.shared.runtime() {
                runtime.spawn(crate::guard::release_through_shard(shard, lease, turn));
            }
            return;
        }
        // Or granted late in its ttl: the next tick is at most a renewal interval away (a
        // shorter interval than the shard's shortest wakes it above).
        if !lease.want.keep_alive
            || self.shortest_ms.fetch_min(every, Ordering::AcqRel) > every
            || was_empty
            || lease.ends_before_renewed(Moment::now() + lease.renew_every)
        {
            self.wake.notify_one();
        }
        if !lease.is_companion() && lease.placed_epoch.load(Ordering::Acquire) < self.shared.epoch()
        {
            self.shared.follow(self.clone(), lease);
        }
    }

    /// The shard's identity now: as the latest heartbeat read it (a failover behind the same
    /// URL, a shard id stored since the first read), else as first read.
    pub(crate) fn server_identity(&self) -> Option<String> {
        let seen = self.seen_identity.locked().clone();
        seen.or_else(|| self.identity.get().cloned())
    }

    /// A heartbeat sent at `at` reached this shard.
    pub(crate) fn beat_landed(&self, at: Moment) {
        *self.beat_landed.locked() = Some(at);
    }

    /// Takes what this process's heartbeats knew of its registry row on the database that a
    /// shard state of `replaced` (the current ones of the topology before a reload) reaches
    /// too, when this state is not one of them (it was rebuilt for changed settings): the
    /// latest heartbeat that landed there, and whether a silence seen there is still to be
    /// moved on. Without it, the first heartbeat of the rebuilt state would judge nothing
    /// and move on a silence the fleet saw (see [`ShardState::silence_to_judge`]).
    pub(crate) fn inherit_beats(&self, replaced: &[Arc<ShardState>]) {
        if replaced.iter().any(|r| std::ptr::eq(&**r, self)) {
            return;
        }
        let latest = (replaced.iter().filter(|r| r.same_database(self)))
            .max_by_key(|r| *r.beat_landed.locked());
        if let Some(old) = latest {
            *self.beat_landed.locked() = *old.beat_landed.locked();
            (self.silence_seen).store(old.silence_seen.load(Ordering::Acquire), Ordering::Release);
        }
    }

    /// How long this process's registry row here may have gone unbeaten by the shard's clock,
    /// as a heartbeat sent now finds it, for that to be no lapse: `lapse`, or longer if its own
    /// clock saw more since its latest heartbeat here was sent (allowing for its drift, for the
    /// time a heartbeat may take to reach the shard, its statement timeout, for a Galera
    /// shard's node skew and for the shard's millisecond clock). A longer silence means its
    /// clocks stood still while the shard's ran on (a frozen virtual machine, a restored
    /// checkpoint), and the others may have counted it dead: the heartbeat leaves it in the row
    /// (see [`shardlock_mysql::Beat::judge_silence`]), so that a lost reply does not hide it.
    /// `None` judges nothing: before a heartbeat of this process landed here, and once a
    /// silence was seen, so that the next heartbeat moves the row on.
    pub(crate) fn silence_to_judge(
        &self,
        lapse: Duration,
        config: &shardlock_core::Config,
    ) -> Option<Duration> {
        if self.silence_seen.load(Ordering::Acquire) {
            return None;
        }
        let landed = (*self.beat_landed.locked())?;
        let drift = f64::from(config.instance.clock_drift_ppm()) / 1e6;
        let since = (Moment::now().saturating_duration_since(landed)
            + self.config.statement_timeout)
            .mul_f64(1.0 + drift);
        Some(lapse.max(since) + config.node_clock_spread() + Duration::from_millis(1))
    }

    /// Whether a heartbeat answered at `answered` found that this process went silent here:
    /// its row kept a silence the heartbeat judged (see [`ShardState::silence_to_judge`]) that
    /// is also longer than its own clock saw by the answer (a host suspended while the
    /// heartbeat waited counts on that clock, and is no lapse), or it was no longer this
    /// start's row (`silent_for` is `None`: taken over and given up by another start, or
    /// forgotten) while its latest heartbeat here was within its lapse by its own clock.
    /// Nothing is known before a heartbeat of this process landed here. (A row no longer its
    /// own that the first try of a judging heartbeat made its own again, its reply lost, was
    /// written silent for longer than it judges: the try sent again finds that kept silence.)
    pub(crate) fn went_silent(
        &self,
        silent_for: Option<Duration>,
        kept_silent: bool,
        answered: Moment,
        lapse: Duration,
        config: &shardlock_core::Config,
    ) -> bool {
        // A kept silence is moved on by the next heartbeat, lapse or not.
        self.silence_seen.store(kept_silent, Ordering::Release);
        let Some(landed) = *self.beat_landed.locked() else {
            return false;
        };
        let drift = f64::from(config.instance.clock_drift_ppm()) / 1e6;
        let since = answered
            .saturating_duration_since(landed)
            .mul_f64(1.0 + drift);
        match silent_for {
            Some(silent) => {
                kept_silent
                    && silent
                        > lapse.max(since) + config.node_clock_spread() + Duration::from_millis(1)
            }
            None => since < lapse,
        }
    }

    /// Records the identity a heartbeat read.
    pub(crate) fn saw_identity(&self, identity: String) {
        *self.seen_identity.locked() = Some(identity);
    }

    /// Reads the shard's identity if it is not known yet; unknown (unreachable) leaves it so,
    /// and the shard then counts as another database than any other shard state.
    pub(crate) async fn resolve_identity(&self) {
        if self.identity.get().is_some() {
            return;
        }
        match self.backend.identity().await {
            Ok(id) => {
                let _ = self.identity.set(id);
            }
            Err(e) => {
                tracing::warn!(shard = self.backend.name(), error = %shardlock_core::Report(&e), "shardlock could not tell which database the shard reaches; its keys count as moved")
            }
        }
    }

    /// Whether `other` reaches its server as this shard does: the same addresses, credentials
    /// and TLS settings (a state rebuilt by a reload may differ in its weight, timeouts or pool
    /// alone, and still connect as this one).
    pub(crate) fn connects_like(&self, other: &ShardState) -> bool {
        let (a, b) = (&self.config, &other.config);
        a.url == b.url
            && a.nodes == b.nodes
            && a.user == b.user
            && a.password == b.password
            && a.password_file == b.password_file
            && a.tls == b.tls
    }

    /// Whether this shard and `other` are the same database: the same shard state, or the
    /// same server identity (see [`ShardState::identity`]).
    pub(crate) fn same_database(&self, other: &ShardState) -> bool {
        std::ptr::eq(self, other)
            || (self.backend.name() == other.name()
                && self.config.url == other.config.url
                && self.config.nodes == other.config.nodes)
            || matches!((self.identity.get(), other.identity.get()), (Some(a), Some(b)) if a == b)
    }

    /// Whether this shard and `other` are surely different databases: both identities are
    /// known and differ. (Unknown means "maybe the same": nothing is moved between them.)
    pub(crate) fn surely_other_database(&self, other: &ShardState) -> bool {
        !self.same_database(other)
            && self.identity.get().is_some()
            && other.identity.get().is_some()
    }

    pub(crate) fn remove(&self, id: u64) -> Option<Arc<LeaseState>> {
        self.leases.locked().remove(&id)
    }

    /// Whether a lease of this process, local or remote, holds `owner` here. Local first: a
    /// lease moves from the local map to the held one under the local map's lock, so it is
    /// seen in one or the other.
    pub(crate) fn holds_owner(&self, owner: &str) -> bool {
        self.local
            .lock()
            .unwrap()
            .values()
            .any(|l| l.owner == owner)
            || self.held().iter().any(|l| l.owner == owner)
    }

    pub(crate) fn held(&self) -> Vec<Arc<LeaseState>> {
        self.leases.locked().values().cloned().collect()
    }
}

/// Gives a half-open probe's permit back if its call was dropped before it completed.
struct ProbePermit<'a> {
    state: &'a ShardState,
    ticket: Option<ProbeTicket>,
}

impl Drop for ProbePermit<'_> {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket {
            // Never a panic in drop: the breaker's state is consistent after any panic.
            let mut breaker = self.state.breaker.locked();
            breaker.abandon_probe(ticket);
        }
    }
}

/// What a call's duration says of its shard, for the breaker's slow-call rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Timing {
    /// Slower than `slow-call`, it counts as a failure.
    Counts,
    /// Nothing: it may wait on purpose (a row lock, a lease's time left).
    Ignored,
    /// Slow, a statement that waits for no lock is sent and judged in its place; prompt, it
    /// counts as a success.
    Undecided,
}

/// How a grant attempt's duration is judged: an answer that the key's row stayed locked by
/// another transaction ([`Attempt::Locked`]) took the server's lock wait on purpose, and
/// counts for the shard; any other answer may have waited behind such a lock that then ended
/// (a transaction lock on the key, a console session): if slow, a statement that waits for no
/// lock is judged in its place, for a busy key is an answer, never a failure.
pub(crate) fn acquire_timing<T>(
    result: &Result<T, BackendError>,
    locked: impl Fn(&T) -> bool,
) -> Timing {
    match result {
        Ok(answer) if locked(answer) => Timing::Ignored,
        Ok(_) => Timing::Undecided,
        Err(_) => Timing::Counts,
    }
}

/// When a release in the background ([`ShardState::give_back`], [`ShardState::release_later`],
/// [`ShardState::watch_lost_try`]) stops before the row could have ended by itself.
#[derive(Debug, Clone, Copy)]
enum Ends {
    /// At a release that freed the row.
    Released,
    /// At any answer of the shard.
    AnyAnswer,
    /// Never: a try still on its way may take the row again later. Released keeping a minimum
    /// hold of that long after the grant, if any.
    Never(Option<Duration>),
}
