//! The lease keeper: per shard, one background task renews every lease this process holds
//! there with one statement per tick, and reports leases that can no longer be trusted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use shardlock_core::config::ShardConfig;
use shardlock_core::{
    Admission, BackendError, BackendErrorKind, Breaker, BreakerConfig, BreakerState, CallOutcome,
    LockKey, Transition,
};
use shardlock_mysql::{Attempt, GrantRequest, Shard};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use crate::queue::{KeyQueues, Turn, Want};

/// A lease row granted to this process, shared by the keeper and by the holds (guards) made
/// under it: the first, and those handed over in memory after it.
#[derive(Debug)]
pub(crate) struct LeaseState {
    pub(crate) id: u64,
    pub(crate) key: LockKey,
    pub(crate) owner: String,
    pub(crate) ttl: Duration,
    pub(crate) renew_every: Duration,
    /// What it was granted for (its ttl and the clock-drift bound), to place its local end.
    pub(crate) want: Want,
    /// Local, conservative end of the lease: measured from *before* the statement that granted
    /// or last renewed it was sent, allowing for the shard's time truncation and clock drift
    /// ([`Want::lease_end`]), so it is always before the shard's own expiry.
    deadline: Mutex<Instant>,
    lost: watch::Sender<bool>,
    /// The next fence to hand out in memory, and the last one reserved on the shard.
    next_fence: AtomicU64,
    fence_top: u64,
    /// In-memory hand-offs end this long after the shard grant.
    local_until: Instant,
    /// This process's turn on the key: held until the lease is released, so local waiters
    /// queue in memory instead of polling the shard.
    pub(crate) turn: Mutex<Option<Turn>>,
    /// Granted in process while the shard's breaker was open (`LockMode::LocalFallback`).
    pub(crate) local: bool,
    /// The topology epoch up to which this lease is known to be visible where the key lives:
    /// granted under it, or followed there by a row on the key's new shard (see
    /// [`crate::moves`]). Only ever rises.
    pub(crate) placed_epoch: AtomicU64,
    /// Rows of the same grant on other shards: where the key lived before a reload (taken by an
    /// acquire of a moved key) or where it lives after one (taken when the key moved while
    /// held). Renewed by their shards' keepers, released with this lease; losing one loses
    /// this lease.
    companions: Mutex<Companions>,
    /// For a companion row: the lease it belongs to (told when the companion is lost).
    parent: std::sync::OnceLock<Weak<LeaseState>>,
    /// Held while the lease follows its key after a reload (one follower at a time).
    pub(crate) following: tokio::sync::Mutex<()>,
}

/// The companion rows of a lease, and whether the lease already ended (a companion that
/// arrives after that is released at once).
#[derive(Debug, Default)]
struct Companions {
    rows: Vec<(Arc<ShardState>, Arc<LeaseState>)>,
    ended: bool,
}

/// What the shard granted: to which owner (grant `id`), its first fence and how many more
/// were reserved after it, and when the granting statement was sent.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) id: u64,
    pub(crate) owner: String,
    pub(crate) fence: u64,
    pub(crate) reserve: u32,
    pub(crate) sent: Instant,
}

impl LeaseState {
    /// The lease of `grant`; in-memory hand-offs may follow it for `local_for`.
    pub(crate) fn new(
        key: LockKey,
        grant: Grant,
        want: Want,
        local_for: Duration,
        turn: Option<Turn>,
    ) -> Self {
        Self {
            id: grant.id,
            key,
            owner: grant.owner,
            ttl: want.ttl,
            renew_every: want.renew_every,
            want,
            deadline: Mutex::new(want.lease_end(grant.sent)),
            lost: watch::channel(false).0,
            next_fence: AtomicU64::new(grant.fence + 1),
            fence_top: grant.fence + u64::from(grant.reserve),
            local_until: grant.sent + local_for,
            turn: Mutex::new(turn),
            local: false,
            placed_epoch: AtomicU64::new(0),
            companions: Mutex::default(),
            parent: std::sync::OnceLock::new(),
            following: tokio::sync::Mutex::new(()),
        }
    }

    /// This lease as a companion row of `parent`: its loss is the parent's.
    pub(crate) fn belonging_to(self, parent: &Arc<LeaseState>) -> Self {
        let _ = self.parent.set(Arc::downgrade(parent));
        self
    }

    /// Whether the lease ended (released): companions are refused from then on.
    pub(crate) fn has_ended(&self) -> bool {
        self.companions.lock().unwrap().ended
    }

    /// The lease as placed under topology `epoch`.
    pub(crate) fn placed_at(self, epoch: u64) -> Self {
        self.placed_epoch.store(epoch, Ordering::Release);
        self
    }

    /// Whether this is a companion row of another lease.
    pub(crate) fn is_companion(&self) -> bool {
        self.parent.get().is_some()
    }

    /// The highest fence this grant reserved on its shard.
    pub(crate) fn fence_top(&self) -> u64 {
        self.fence_top
    }

    /// Adds `companion` (a row of this grant on `shard`) to this lease. `false` when the lease
    /// already ended or was lost: the caller must release the companion.
    pub(crate) fn adopt(
        self: &Arc<Self>,
        shard: Arc<ShardState>,
        companion: Arc<LeaseState>,
    ) -> bool {
        debug_assert!(companion.is_companion());
        let mut companions = self.companions.lock().unwrap();
        if companions.ended || self.is_lost() {
            return false;
        }
        if companion.is_lost() {
            drop(companions);
            self.mark_lost(
                "a row of the lease on another shard was lost",
                &shard.shared.stats,
            );
            return false;
        }
        companions.rows.push((shard, companion));
        true
    }

    /// Whether the lease has rows on other shards.
    pub(crate) fn has_companions(&self) -> bool {
        !self.companions.lock().unwrap().rows.is_empty()
    }

    /// The shards this lease has companion rows on.
    pub(crate) fn companion_shards(&self) -> Vec<Arc<ShardState>> {
        let companions = self.companions.lock().unwrap();
        companions.rows.iter().map(|(s, _)| s.clone()).collect()
    }

    /// Ends the lease's companions: returns them to release; later ones are refused.
    pub(crate) fn end_companions(&self) -> Vec<(Arc<ShardState>, Arc<LeaseState>)> {
        let mut companions = self.companions.lock().unwrap();
        companions.ended = true;
        std::mem::take(&mut companions.rows)
    }

    /// An in-process lease, granted while the shard's breaker is open: no row, no renewal,
    /// no hand-offs, until the keeper re-acquires it on the shard.
    pub(crate) fn local(key: LockKey, grant: Grant, want: Want, turn: Turn) -> Self {
        Self {
            deadline: Mutex::new(grant.sent + LOCAL_HORIZON),
            fence_top: 0,
            local: true,
            ..Self::new(key, grant, want, Duration::ZERO, Some(turn))
        }
    }

    /// Whether the lease is surely still ours on its shard, and on its companions' shards.
    pub(crate) fn is_live(&self) -> bool {
        let now = Instant::now();
        !self.is_lost()
            && now < self.deadline()
            && self
                .companions
                .lock()
                .unwrap()
                .rows
                .iter()
                .all(|(_, c)| !c.is_lost() && now < c.deadline())
    }

    /// A fence for an in-memory hand-off, if this lease may still make one: it is live, its
    /// reserved fences are not used up, and its time for local hand-offs has not run out.
    pub(crate) fn local_fence(&self) -> Option<u64> {
        if Instant::now() >= self.local_until || !self.is_live() {
            return None;
        }
        // Holds of one lease follow each other, so nobody else takes fences meanwhile.
        let fence = self.next_fence.load(Ordering::Acquire);
        (fence <= self.fence_top).then(|| {
            self.next_fence.store(fence + 1, Ordering::Release);
            fence
        })
    }

    pub(crate) fn deadline(&self) -> Instant {
        *self.deadline.lock().unwrap()
    }

    /// The earliest local deadline of this lease and its companion rows.
    pub(crate) fn valid_until(&self) -> Instant {
        let own = self.deadline();
        let companions = self.companions.lock().unwrap();
        companions
            .rows
            .iter()
            .map(|(_, c)| c.deadline())
            .fold(own, Instant::min)
    }

    pub(crate) fn set_deadline(&self, to: Instant) {
        *self.deadline.lock().unwrap() = to;
    }

    fn extend(&self, to: Instant) {
        let mut d = self.deadline.lock().unwrap();
        if to > *d {
            *d = to;
        }
    }

    pub(crate) fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    pub(crate) fn subscribe_lost(&self) -> watch::Receiver<bool> {
        self.lost.subscribe()
    }

    /// Marks the lease lost (once) and says why. A companion row's loss is its lease's: that
    /// is what gets counted and reported.
    pub(crate) fn mark_lost(&self, why: &'static str, stats: &Stats) {
        let parent = self.parent.get().and_then(Weak::upgrade);
        // Counted before the holder is woken, so whoever sees `lost()` complete also sees
        // the count.
        let first = self.lost.send_if_modified(|lost| {
            if *lost {
                return false;
            }
            *lost = true;
            if parent.is_none() {
                stats.lost.fetch_add(1, Ordering::Relaxed);
            }
            true
        });
        match parent {
            Some(parent) => parent.mark_lost(why, stats),
            // Ended by the router's own shutdown: expected, not worth a warning.
            None if first && why == SHUT_DOWN => {
                tracing::debug!(key = %self.key, owner = %self.owner, why, "shardlock lease ended")
            }
            None if first => {
                tracing::warn!(key = %self.key, owner = %self.owner, why, "shardlock lease lost")
            }
            None => {}
        }
    }
}

/// Why leases end at `shutdown()`.
pub(crate) const SHUT_DOWN: &str = "router shut down";

/// What every shard of a router shares: who we are, grant numbers, counters, key queues.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) instance_id: String,
    /// Random per router start (64 bits, hex): two processes configured with one instance id
    /// still never write the same owner.
    nonce: String,
    grant_seq: AtomicU64,
    pub(crate) stats: Stats,
    pub(crate) queues: Arc<KeyQueues>,
    /// Turns true at shutdown: no new grants, no hand-offs; keepers stop.
    pub(crate) closed: watch::Sender<bool>,
    /// Metrics instruments and the hot-key summary.
    pub(crate) telemetry: crate::telemetry::Telemetry,
    /// The epoch of the topology in force, set by a reload right after it swapped the topology
    /// in: a lease placed under an older one may have to follow its key (see [`crate::moves`]).
    pub(crate) epoch: AtomicU64,
    /// The router, for the tasks that make moved leases follow their keys.
    pub(crate) router: std::sync::OnceLock<Weak<crate::router::Inner>>,
    /// Every shard state made for this router that is still alive: the topology's, and those
    /// a reload left that still hold leases (draining).
    shard_states: Mutex<Vec<Weak<ShardState>>>,
}

impl Shared {
    pub(crate) fn new(instance_id: String, telemetry: crate::telemetry::Telemetry) -> Self {
        Self {
            telemetry,
            instance_id,
            nonce: format!("{:016x}", rand::random::<u64>()),
            grant_seq: AtomicU64::new(0),
            stats: Stats::default(),
            queues: Arc::default(),
            closed: watch::channel(false).0,
            epoch: AtomicU64::new(1),
            router: std::sync::OnceLock::new(),
            shard_states: Mutex::default(),
        }
    }

    /// Every live shard state of this router, in or out of the topology.
    pub(crate) fn shard_states(&self) -> Vec<Arc<ShardState>> {
        let mut states = self.shard_states.lock().unwrap();
        states.retain(|s| s.strong_count() > 0);
        states.iter().filter_map(Weak::upgrade).collect()
    }

    /// The epoch of the topology in force.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    pub(crate) fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    /// A new grant number and the owner string written for it:
    /// `<instance id>:<start nonce>:<grant seq>`.
    pub(crate) fn next_owner(&self) -> (u64, String) {
        let id = self.next_id();
        (id, format!("{}:{}:{id}", self.instance_id, self.nonce))
    }

    /// Whether `owner` was written by this router (its instance id and start nonce) for a
    /// grant numbered below `before`, and no lease of this router, local or remote, holds
    /// that owner now.
    pub(crate) fn is_stale_own(&self, owner: &str, before: u64) -> bool {
        let older = owner
            .strip_prefix(self.instance_id.as_str())
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|rest| rest.strip_prefix(self.nonce.as_str()))
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|seq| seq.parse::<u64>().ok())
            .is_some_and(|seq| seq < before);
        // Local first: a lease moves from the local map to the held one under the local map's
        // lock, so it is seen in one or the other.
        older
            && !self.shard_states().iter().any(|s| {
                s.local.lock().unwrap().values().any(|l| l.owner == owner)
                    || s.held().iter().any(|l| l.owner == owner)
            })
    }

    /// A new grant number (unique in this router; also names a lease row in its shard's
    /// keeper).
    pub(crate) fn next_id(&self) -> u64 {
        self.grant_seq.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// Counters of this router, since it started.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) grants: AtomicU64,
    pub(crate) handoffs: AtomicU64,
    pub(crate) local_handoffs: AtomicU64,
    pub(crate) moved_grants: AtomicU64,
    pub(crate) acquire_statements: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) releases: AtomicU64,
    pub(crate) lost: AtomicU64,
    pub(crate) renew_ticks: AtomicU64,
    pub(crate) renew_statements: AtomicU64,
    pub(crate) renew_failures: AtomicU64,
    pub(crate) heartbeat_failures: AtomicU64,
    pub(crate) breaker_rejections: AtomicU64,
    pub(crate) local_grants: AtomicU64,
    pub(crate) reconciled: AtomicU64,
    pub(crate) reconcile_conflicts: AtomicU64,
    pub(crate) breaker_opened: AtomicU64,
    pub(crate) breaker_closed: AtomicU64,
    pub(crate) followed: AtomicU64,
    pub(crate) fences_carried: AtomicU64,
}

/// A local lease has no end of its own: it lasts until released, or lost on reconciliation.
const LOCAL_HORIZON: Duration = Duration::from_secs(100 * 365 * 86_400);
/// How often the keeper tries to re-acquire on the shard the keys held locally.
const RECONCILE_EVERY: Duration = Duration::from_millis(50);
/// Breaker transitions kept per shard for `breaker_transitions`.
const TRANSITIONS_KEPT: usize = 64;

/// A shard and the leases this process holds on it.
#[derive(Debug)]
pub(crate) struct ShardState {
    pub(crate) shard: Shard,
    /// The settings it was built from: a reload reuses the shard only if they are unchanged.
    pub(crate) config: ShardConfig,
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
    /// Set while a reconciliation pass runs (beside the keeper loop).
    reconciling: std::sync::atomic::AtomicBool,
    /// The keeper panics at its next tick (tests of its supervision).
    #[cfg(feature = "fault-injection")]
    pub(crate) panic_next_tick: std::sync::atomic::AtomicBool,
}

/// The breaker's clock: Tokio's, so tests with paused time drive it.
fn breaker_now() -> std::time::Instant {
    Instant::now().into_std()
}

impl ShardState {
    pub(crate) fn new(
        shard: Shard,
        config: ShardConfig,
        breaker: BreakerConfig,
        shared: Arc<Shared>,
    ) -> Arc<Self> {
        let label = opentelemetry::StringValue::from(Arc::<str>::from(shard.name()));
        let registry = shared.clone();
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
            shard,
            identity: std::sync::OnceLock::new(),
            reconciling: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "fault-injection")]
            panic_next_tick: std::sync::atomic::AtomicBool::new(false),
        });
        registry
            .shard_states
            .lock()
            .unwrap()
            .push(Arc::downgrade(&state));
        state
    }

    /// Runs one call to the shard through its breaker: refused at once (kind
    /// [`BackendErrorKind::BreakerOpen`]) while the breaker is open, else run and its outcome
    /// recorded. Infrastructure failures and slow calls count against the shard; answers,
    /// a busy lock included, count for it. A half-open probe dropped before it completes gives
    /// its permit back.
    pub(crate) async fn call<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        self.call_timed(call, |_| true).await
    }

    /// [`ShardState::call`] for callers outside the lease machinery (the other lock
    /// patterns): errors name the shard.
    pub(crate) async fn run<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> shardlock_core::Result<T> {
        self.call(call)
            .await
            .map_err(|e| e.into_error(self.shard.name()))
    }

    /// [`ShardState::call`] for calls that may wait for a row lock on purpose (transaction
    /// locks, job claims): their duration says nothing about the shard's health, so it never
    /// counts as a slow call.
    pub(crate) async fn call_waiting<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
    ) -> Result<T, BackendError> {
        self.call_timed(call, |_| false).await
    }

    /// One grant attempt through the breaker ([`Shard::acquire`]). An answer that the key's
    /// row stayed locked by another transaction ([`Attempt::Locked`]) took the server's lock
    /// wait on purpose: it never counts as a slow call.
    pub(crate) async fn acquire(&self, req: &GrantRequest) -> Result<Attempt, BackendError> {
        self.call_timed(self.shard.acquire(req), |r| {
            !matches!(r, Ok(Attempt::Locked))
        })
        .await
    }

    async fn call_timed<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, BackendError>>,
        slow_counts: impl FnOnce(&Result<T, BackendError>) -> bool,
    ) -> Result<T, BackendError> {
        let (admission, transition) = self.breaker.lock().unwrap().admit(breaker_now());
        self.note(transition);
        let probe = match admission {
            Admission::Rejected => {
                self.shared
                    .stats
                    .breaker_rejections
                    .fetch_add(1, Ordering::Relaxed);
                return Err(BackendError::new(
                    BackendErrorKind::BreakerOpen,
                    None,
                    "its breaker is open after repeated failures; probes resume after the \
                     breaker cool-down",
                ));
            }
            Admission::Probe => true,
            Admission::Call => false,
        };
        let mut permit = ProbePermit {
            state: self,
            armed: probe,
        };
        let started = Instant::now();
        let result = call.await;
        permit.armed = false;
        let outcome = match &result {
            Err(e) if e.kind.is_infrastructure() => CallOutcome::Failure,
            _ => CallOutcome::Success,
        };
        self.shared.telemetry.statement(
            &self.label,
            outcome == CallOutcome::Failure,
            started.elapsed(),
        );
        let took = if slow_counts(&result) {
            started.elapsed()
        } else {
            Duration::ZERO
        };
        let transition = self
            .breaker
            .lock()
            .unwrap()
            .record(breaker_now(), outcome, took, probe);
        self.note(transition);
        result
    }

    /// The breaker's slow-call threshold.
    pub(crate) fn slow_call(&self) -> Duration {
        self.breaker.lock().unwrap().config().slow_call
    }

    /// The breaker's state now.
    pub(crate) fn breaker_state(&self) -> BreakerState {
        self.breaker.lock().unwrap().state(breaker_now())
    }

    /// The breaker's last transitions, oldest first.
    pub(crate) fn breaker_transitions(&self) -> Vec<Transition> {
        self.transitions.lock().unwrap().iter().copied().collect()
    }

    /// New breaker thresholds (a reload that kept this shard).
    pub(crate) fn reconfigure_breaker(&self, config: BreakerConfig) {
        self.breaker.lock().unwrap().reconfigure(config);
    }

    fn note(&self, transition: Option<Transition>) {
        let Some(t) = transition else { return };
        let stats = &self.shared.stats;
        match t.to {
            BreakerState::Open => {
                stats.breaker_opened.fetch_add(1, Ordering::Relaxed);
                if t.from == BreakerState::Closed {
                    tracing::warn!(
                        shard = self.shard.name(),
                        "shardlock breaker opened: the shard is failing"
                    );
                } else {
                    tracing::debug!(
                        shard = self.shard.name(),
                        "shardlock breaker probe failed; open again"
                    );
                }
            }
            BreakerState::Closed => {
                stats.breaker_closed.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    shard = self.shard.name(),
                    "shardlock breaker closed: the shard is back"
                );
                self.wake.notify_one();
            }
            BreakerState::HalfOpen => {
                tracing::info!(
                    shard = self.shard.name(),
                    "shardlock breaker half-open: probing the shard"
                );
            }
        }
        let mut kept = self.transitions.lock().unwrap();
        if kept.len() == TRANSITIONS_KEPT {
            kept.pop_front();
        }
        kept.push_back(t);
    }

    /// Registers a lease granted in process; the keeper re-acquires it on the shard once the
    /// breaker lets calls through again.
    pub(crate) fn insert_local(&self, lease: Arc<LeaseState>) {
        self.local.lock().unwrap().insert(lease.id, lease);
        self.wake.notify_one();
    }

    /// Forgets a local lease that was not re-acquired on the shard yet; `false` when it was
    /// (it is then an ordinary lease to release through the shard) or was lost.
    pub(crate) fn remove_local(&self, id: u64) -> bool {
        self.local.lock().unwrap().remove(&id).is_some()
    }

    /// Takes every local lease (shutdown).
    pub(crate) fn take_local(&self) -> Vec<Arc<LeaseState>> {
        self.local.lock().unwrap().drain().map(|(_, l)| l).collect()
    }

    /// How many leases are held locally here, not yet re-acquired on the shard.
    pub(crate) fn local_count(&self) -> usize {
        self.local.lock().unwrap().len()
    }

    /// Re-acquires on the shard, under the same owner, the keys this process holds locally.
    /// A key another process holds there now is reported lost to its local holder (who keeps
    /// its turn, so no second holder appears in this process until it lets go).
    async fn reconcile(self: &Arc<Self>) {
        let locals: Vec<Arc<LeaseState>> = self.local.lock().unwrap().values().cloned().collect();
        for lease in locals {
            // After shutdown, local leases are ended by it, not re-acquired.
            if self.breaker_state() == BreakerState::Open || self.shared.is_closed() {
                return;
            }
            // Released since the pass began: its key's turn may be another grant's by now.
            if !self.local.lock().unwrap().contains_key(&lease.id) {
                continue;
            }
            let req = GrantRequest {
                key: lease.key.stored().to_vec(),
                owner: lease.owner.clone(),
                ttl_ms: u32::try_from(lease.ttl.as_millis()).unwrap_or(u32::MAX),
                fence_floor: 0,
                reserve: 0,
                trace: None,
            };
            let stats = &self.shared.stats;
            let mut sent = Instant::now();
            let mut attempt = self.acquire(&req).await;
            if matches!(attempt, Ok(Attempt::Held { .. }))
                && self.give_back_stale_row(&req.key, lease.id).await
            {
                sent = Instant::now();
                attempt = self.acquire(&req).await;
            }
            match attempt {
                Ok(Attempt::Granted(_)) => {
                    // Under the map's lock, so the holder either still finds it local or finds
                    // it moved to the renewed leases.
                    let moved = {
                        let mut local = self.local.lock().unwrap();
                        // Shutdown takes the local leases under this lock: once it has, the
                        // row just taken is given back below instead.
                        let moved = !self.shared.is_closed() && local.remove(&lease.id).is_some();
                        if moved {
                            lease.set_deadline(lease.want.lease_end(sent));
                            self.insert(lease.clone());
                        }
                        moved
                    };
                    if moved {
                        stats.reconciled.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(shard = self.shard.name(), key = %lease.key, "shardlock re-acquired a locally held key on its shard");
                    } else {
                        // Released meanwhile: give the row back.
                        let _ = self.call(self.shard.release(&req.key, &req.owner)).await;
                    }
                }
                Ok(Attempt::Held { .. }) => {
                    if self.remove_local(lease.id) {
                        stats.reconcile_conflicts.fetch_add(1, Ordering::Relaxed);
                        lease.mark_lost(
                            "another process held the key on its shard when the shard came back",
                            stats,
                        );
                    }
                }
                // Still failing, or the row locked by another transaction: next time.
                Ok(Attempt::Locked) | Err(_) => return,
            }
        }
    }

    /// Gives back the row of `key` if this router wrote it for a grant older than the local
    /// lease `local_id` under an owner no lease of it holds any more: a lease lost while the
    /// shard was unreachable leaves its row until the shard's clock ends it, and reconciling
    /// the key's local holder must not count that as another process's. (A grant of the key
    /// made since the local lease, whose row may be written before its lease is registered,
    /// has a higher number and is never touched.) `true` when such a row was released.
    async fn give_back_stale_row(&self, key: &[u8], local_id: u64) -> bool {
        let Ok(Some(row)) = self.call(self.shard.inspect(key)).await else {
            return false;
        };
        let Some(owner) = row
            .owner
            .filter(|o| row.expires_in_ms > 0 && self.shared.is_stale_own(o, local_id))
        else {
            return false;
        };
        tracing::info!(
            shard = self.shard.name(),
            owner,
            "shardlock gave back a row of a lease it had lost"
        );
        matches!(self.call(self.shard.release(key, &owner)).await, Ok(true))
    }

    /// Makes the keeper panic at once (tests of its supervision).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn inject_keeper_panic(&self) {
        self.panic_next_tick.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// Registers a lease held on this shard with its keeper. A lease placed under an older
    /// topology than the one in force is made to follow its key (a reload may have missed
    /// it: it checks the leases registered after it swapped the topology in, and this checks
    /// the epoch after registering, so one of the two sees the other).
    pub(crate) fn insert(self: &Arc<Self>, lease: Arc<LeaseState>) {
        let every = lease.renew_every.as_millis() as u64;
        let was_empty = {
            let mut leases = self.leases.lock().unwrap();
            leases.insert(lease.id, lease.clone());
            leases.len() == 1
        };
        if self.shortest_ms.fetch_min(every, Ordering::AcqRel) > every || was_empty {
            self.wake.notify_one();
        }
        if !lease.is_companion() && lease.placed_epoch.load(Ordering::Acquire) < self.shared.epoch()
        {
            crate::moves::follow(self.clone(), lease);
        }
    }

    /// Reads the shard's identity if it is not known yet; unknown (unreachable) leaves it so,
    /// and the shard then counts as another database than any other shard state.
    pub(crate) async fn resolve_identity(&self) {
        if self.identity.get().is_some() {
            return;
        }
        match self.shard.identity().await {
            Ok(id) => {
                let _ = self.identity.set(id);
            }
            Err(e) => {
                tracing::warn!(shard = self.shard.name(), error = %e, "shardlock could not tell which database the shard reaches; its keys count as moved")
            }
        }
    }

    /// Whether this shard and `other` are the same database: the same shard state, or the
    /// same server identity (see [`ShardState::identity`]).
    pub(crate) fn same_database(&self, other: &ShardState) -> bool {
        std::ptr::eq(self, other)
            || (self.shard.name() == other.shard.name() && self.config.url == other.config.url)
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
        self.leases.lock().unwrap().remove(&id)
    }

    pub(crate) fn held(&self) -> Vec<Arc<LeaseState>> {
        self.leases.lock().unwrap().values().cloned().collect()
    }

    /// When the keeper must act next: the renewal tick, or the earliest local deadline (a
    /// lease whose renewals keep failing is reported lost exactly then, not later).
    fn plan(&self, next_tick: &mut Option<Instant>) -> Option<Instant> {
        let now = Instant::now();
        let reconcile = (self.local_count() > 0).then(|| now + RECONCILE_EVERY);
        let leases = self.leases.lock().unwrap();
        let Some(period) = leases.values().map(|l| l.renew_every).min() else {
            return reconcile;
        };
        let tick = match *next_tick {
            Some(t) if t <= now + period => t,
            _ => now + period,
        };
        *next_tick = Some(tick);
        let earliest = leases.values().map(|l| l.deadline()).min()?;
        Some(reconcile.map_or(tick, |r| r.min(tick)).min(earliest))
    }

    /// Re-acquires local leases if there are any, reports expired leases, and renews the rest
    /// if the tick is due.
    async fn tick(self: &Arc<Self>, next_tick: &mut Option<Instant>) {
        #[cfg(feature = "fault-injection")]
        if self.panic_next_tick.swap(false, Ordering::AcqRel) {
            panic!(
                "shardlock fault injection: the keeper of {} panics",
                self.shard.name()
            );
        }
        // Reconciliation runs beside the keeper, one pass at a time: its statements (each up
        // to the statement timeout) must never hold up renewing the remote leases, nor
        // reporting them lost at their deadline.
        if self.local_count() > 0 && !self.reconciling.swap(true, Ordering::AcqRel) {
            let state = self.clone();
            tokio::spawn(async move {
                // Cleared however the pass ends (a panic included), so the next tick retries.
                struct Done(Arc<ShardState>);
                impl Drop for Done {
                    fn drop(&mut self) {
                        self.0.reconciling.store(false, Ordering::Release);
                    }
                }
                let done = Done(state);
                done.0.reconcile().await;
            });
        }
        let now = Instant::now();
        let mut leases = self.held();
        leases.retain(|l| {
            if l.deadline() <= now {
                self.remove(l.id);
                l.mark_lost("not renewed before its lease ended", &self.shared.stats);
                false
            } else {
                true
            }
        });
        let Some(period) = leases.iter().map(|l| l.renew_every).min() else {
            *next_tick = None;
            self.shortest_ms.store(u64::MAX, Ordering::Release);
            return;
        };
        self.shortest_ms
            .store(period.as_millis() as u64, Ordering::Release);
        if next_tick.is_some_and(|t| t > now) {
            return;
        }
        // Bounded by the soonest local deadline: a renewal that answers after the lease ended
        // is worthless.
        let earliest = leases
            .iter()
            .map(|l| l.deadline())
            .min()
            .expect("non-empty");
        let timeout = self.shard.statement_timeout().min(earliest - now);
        let pairs: Vec<(&[u8], &str)> = leases
            .iter()
            .map(|l| (l.key.stored(), l.owner.as_str()))
            .collect();
        let sent = Instant::now();
        let renewed = self.call(self.shard.renew(&pairs, timeout)).await;
        // Counted when done, together with the statements, so a snapshot never sees a tick
        // whose statement is still on its way.
        self.shared
            .stats
            .renew_ticks
            .fetch_add(1, Ordering::Relaxed);
        match renewed {
            Ok(outcome) => {
                self.shared
                    .stats
                    .renew_statements
                    .fetch_add(outcome.statements as u64, Ordering::Relaxed);
                for (lease, held) in leases.iter().zip(outcome.held) {
                    if held {
                        lease.extend(lease.want.lease_end(sent));
                    } else if self.remove(lease.id).is_some() {
                        // Still registered, so not released meanwhile: someone else has it.
                        lease.mark_lost(
                            "taken over, force-released or expired on the shard",
                            &self.shared.stats,
                        );
                    }
                }
                *next_tick = Some(sent + period);
                tracing::trace!(
                    shard = self.shard.name(),
                    leases = leases.len(),
                    "shardlock renewed leases"
                );
            }
            Err(e) => {
                self.shared
                    .stats
                    .renew_failures
                    .fetch_add(1, Ordering::Relaxed);
                if e.kind == BackendErrorKind::BreakerOpen {
                    tracing::debug!(
                        shard = self.shard.name(),
                        leases = leases.len(),
                        "shardlock renewal skipped: the shard's breaker is open"
                    );
                } else {
                    tracing::warn!(shard = self.shard.name(), error = %e, leases = leases.len(), "shardlock renewal failed; retrying");
                }
                // Retry soon; leases are reported lost only when their deadline passes.
                *next_tick = Some(Instant::now() + (period / 4).max(Duration::from_millis(20)));
            }
        }
    }
}

/// Gives a half-open probe's permit back if its call was dropped before it completed.
struct ProbePermit<'a> {
    state: &'a ShardState,
    armed: bool,
}

impl Drop for ProbePermit<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.state.breaker.lock().unwrap().abandon_probe();
        }
    }
}

/// Starts the keeper of `state`. It holds only a `Weak` reference between ticks and stops when
/// the shard state is dropped or `closed` turns true.
pub(crate) fn spawn_keeper(state: &Arc<ShardState>, closed: watch::Receiver<bool>) {
    let weak: Weak<ShardState> = Arc::downgrade(state);
    // Supervised: a keeper that panics would leave every lease of its shard unrenewed and
    // unreported. Its leases are reported lost (their renewal can no longer be vouched for)
    // and a new keeper takes over.
    tokio::spawn(async move {
        loop {
            let keeper = tokio::spawn(keep(weak.clone(), closed.clone()));
            match keeper.await {
                Err(e) if e.is_panic() => {
                    let Some(state) = weak.upgrade() else { return };
                    tracing::error!(shard = state.shard.name(), "shardlock lease keeper panicked; its leases are reported lost and a new keeper starts");
                    for lease in state.held() {
                        state.remove(lease.id);
                        lease
                            .mark_lost("the lease keeper of its shard failed", &state.shared.stats);
                    }
                }
                _ => return,
            }
        }
    });
}

/// The keeper loop of one shard: renewal ticks, reconciliation, and lost-lease reports.
async fn keep(weak: Weak<ShardState>, mut closed: watch::Receiver<bool>) {
    let Some(wake) = weak.upgrade().map(|s| s.wake.clone()) else {
        return;
    };
    {
        let mut next_tick = None;
        loop {
            let wake_at = match weak.upgrade() {
                Some(state) => state.plan(&mut next_tick),
                None => return,
            };
            let sleep = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = closed.wait_for(|c| *c) => return,
                _ = wake.notified() => continue,
                _ = sleep => {}
            }
            match weak.upgrade() {
                Some(state) => state.tick(&mut next_tick).await,
                None => return,
            }
        }
    }
}
