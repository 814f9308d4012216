//! What every shard handle of one router shares: who this process is (instance id and start
//! nonce, which make every owner unique), grant numbers, counters, the shutdown signal, and
//! the hook through which a lease placed under an older topology is made to follow its key.
//! Below the router, so that shard handles and keepers need nothing above them.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::watch;

use super::{LeaseState, ShardState};
use crate::clock::Moment;
use crate::stats::Stats;
use crate::sync::LockExt;

/// Why a lease ends when its process switches to the heartbeat registry.
pub(crate) const REGISTRY_SWITCHED: &str = "this process switched to the heartbeat registry \
     while it held the lease: no registry knew of it, so a process started meanwhile onto \
     another topology may hold the key where its topology puts it";

/// Why a lease ends when its process's heartbeat lapsed.
pub(crate) const REGISTRY_LAPSED: &str = "this process's heartbeat lapsed while it held the \
     lock (paused, or cut off from every shard): the registry may have counted it dead";

/// Why a lease ends when another start took its process's instance id over.
pub(crate) const REGISTRY_TAKEN_OVER: &str = "another start took this process's instance id \
     over while the registry counted this one dead: the key may be another's already";

/// What every shard of a router shares: who we are, grant numbers, counters, key queues.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) instance_id: String,
    /// Random per router start (64 bits, hex): two processes configured with one instance id
    /// still never write the same owner.
    nonce: String,
    grant_seq: AtomicU64,
    pub(crate) stats: Stats,
    /// Turns true at shutdown: no new grants, no hand-offs; keepers stop.
    pub(crate) closed: watch::Sender<bool>,
    /// Metrics instruments and the hot-key summary.
    pub(crate) telemetry: crate::telemetry::Telemetry,
    /// The epoch of the topology in force, set by a reload right after it swapped the topology
    /// in: a lease placed under an older one may have to follow its key (see [`crate::moves`]).
    pub(crate) epoch: AtomicU64,
    /// The clock drift (`instance.clock-drift`, in ppm) of the config in force: every lease
    /// registered allows for it at least (see [`Shared::allow_drift`]).
    drift_ppm: AtomicU32,
    /// Makes a lease follow its key to where the topology in force places it (set by the
    /// router: the moves it runs sit above the shard handles).
    follow: std::sync::OnceLock<Follow>,
    /// Every shard state made for this router that is still alive: the topology's, and those
    /// a reload left that still hold leases (draining).
    shard_states: Mutex<Vec<Weak<ShardState>>>,
    /// When the newest heartbeat that reached a shard was sent, and the lapse in force: the
    /// registry surely counts this process live until their sum (see [`Shared::beaten`]).
    /// `None`: no limit (the `static` registry, or no heartbeat yet).
    registry_live: Mutex<Option<(Moment, Duration)>>,
    /// When this process found its instance id taken over by another start: no lease or
    /// lock of it is live from then on, whatever heartbeat lands later.
    replaced_at: Mutex<Option<Moment>>,
    /// Times every lease on a shard was marked lost because the registry may have counted this
    /// process dead (see [`Shared::lose_shard_leases`]): a lock without a lease row (a
    /// transaction lock) taken before any of them holds no longer either.
    registry_losses: watch::Sender<u64>,
    /// Owners of rows this router keeps taken on purpose after their grant (`lock_at_least`,
    /// a scheduled run's interval), each with a local moment past that end: such a row is no
    /// stale row of a lost lease, also once its release failed (see [`Shared::is_stale_own`]).
    kept: Mutex<Kept>,
    /// The runtime the router was built on, where its keepers run: a guard dropped on another
    /// one (a `block_on` that returns at once, a runtime shutting down) releases here, where
    /// its release runs for as long as the keeper renewing the lease would.
    runtime: Option<tokio::runtime::Handle>,
}

/// See [`Shared::keep_taken`].
#[derive(Debug, Default)]
struct Kept {
    holds: std::collections::HashMap<String, Vec<KeptHold>>,
    /// Ended entries are dropped once the map has grown to this size.
    prune_at: usize,
}

/// A row kept taken `at_least` after `from` (a local moment no earlier than its grant), by a
/// shard clock that may run up to `drift_ppm` slower than ours and a node's clock up to
/// `clock_skew` behind: both as raised by a reload since, which [`Shared::allow_drift`] and
/// the shard's skew floor do.
#[derive(Debug, Clone)]
pub(crate) struct KeptHold {
    /// The serial of the shard state the row is on (a moved key's rows on two shards share
    /// their owner, and a reload that points a shard's name at another server keeps both
    /// under one name).
    pub(crate) shard: u64,
    pub(crate) from: Moment,
    pub(crate) at_least: Duration,
    pub(crate) drift_ppm: u32,
    pub(crate) clock_skew: Duration,
}

impl KeptHold {
    /// A local moment surely past the hold's end, for a node skew of at least `skew`.
    fn past(&self, skew: Duration) -> Moment {
        crate::queue::Want::kept_by(
            self.from,
            self.at_least,
            self.drift_ppm,
            self.clock_skew.max(skew),
        )
    }
}

impl Shared {
    /// This router's start nonce.
    pub(crate) fn nonce(&self) -> &str {
        &self.nonce
    }

    pub(crate) fn new(instance_id: String, telemetry: crate::telemetry::Telemetry) -> Self {
        Self {
            telemetry,
            instance_id,
            nonce: format!("{:016x}", rand::random::<u64>()),
            grant_seq: AtomicU64::new(0),
            stats: Stats::default(),
            closed: watch::channel(false).0,
            epoch: AtomicU64::new(1),
            drift_ppm: AtomicU32::new(0),
            follow: std::sync::OnceLock::new(),
            shard_states: Mutex::default(),
            registry_live: Mutex::default(),
            replaced_at: Mutex::default(),
            registry_losses: watch::channel(0).0,
            kept: Mutex::default(),
            runtime: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// The runtime to run `work` on that outlives no keeper of this router: the router's own,
    /// else the caller's; `None` outside any runtime.
    pub(crate) fn runtime(&self) -> Option<tokio::runtime::Handle> {
        self.runtime
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
    }

    /// Runs `task` on [`Shared::runtime`]: work that must go on once its caller went away (a
    /// lane's statements, a give-back, a lease following its key) would never run on the
    /// caller's runtime if that stopped being driven (a `block_on` that returned once its
    /// caller gave up, the runtime kept). `None`, the task dropped, outside any runtime.
    pub(crate) fn spawn<F>(&self, task: F) -> Option<tokio::task::JoinHandle<F::Output>>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.runtime().map(|runtime| runtime.spawn(task))
    }

    /// Whether the registry surely counts this process live at `at`: a lease on a shard is
    /// this process's no longer than that (see [`Shared::beaten`]).
    pub(crate) fn registry_live_at(&self, at: Moment) -> bool {
        self.registry_live_until().is_none_or(|until| at < until)
    }

    /// How many times every lease on a shard was lost to the registry (a lapse, a switch to
    /// the heartbeat registry): a lock taken when this answered `n` is held while it still
    /// does, and [`Shared::registry_live_at`] says so.
    pub(crate) fn registry_losses(&self) -> u64 {
        *self.registry_losses.borrow()
    }

    /// Changes with [`Shared::registry_losses`].
    pub(crate) fn watch_registry_losses(&self) -> watch::Receiver<u64> {
        self.registry_losses.subscribe()
    }

    /// See [`Shared::registry_live_at`].
    pub(crate) fn registry_live_until(&self) -> Option<Moment> {
        let beaten = self
            .registry_live
            .locked()
            .map(|(sent, lapse)| sent + lapse);
        match *self.replaced_at.locked() {
            Some(replaced) => Some(beaten.map_or(replaced, |until| until.min(replaced))),
            None => beaten,
        }
    }

    /// A heartbeat sent at `sent` reached a shard: the registry counts this process live until
    /// the newest such sending plus `lapse` (the lapse in force, see `Gate`: a shorter one
    /// counts at once). If the registry may have counted it dead before this heartbeat was
    /// sent (paused, or cut off from every shard, for longer than the lapse), every lease it
    /// holds on a shard is lost first, for good: another process may have started meanwhile
    /// onto another topology, found no live instance of this one, and granted the keys where
    /// its topology puts them, which this process's leases do not exclude. (A heartbeat held
    /// up after its sending is judged as it lands: [`Shared::lose_leases_if_lapsed`].)
    pub(crate) fn beaten(&self, sent: Moment, lapse: Duration) {
        self.lose_leases_if_lapsed(sent);
        let mut live = self.registry_live.locked();
        let newest = live.map_or(sent, |(before, _)| before.max(sent));
        *live = Some((newest, lapse));
    }

    /// The lapse in force is `lapse` from now on (a heartbeat with a longer one reached every
    /// shard).
    pub(crate) fn lapse_in_force(&self, lapse: Duration) {
        if let Some((_, held)) = self.registry_live.locked().as_mut() {
            *held = lapse;
        }
    }

    /// A reload shortened the lapse to `lapse` (a raised clock drift or node clock skew): the
    /// heartbeats already sent count by it from now on, for the registry may count this
    /// process dead that much sooner after them; leases it may already have are lost.
    pub(crate) fn shorten_lapse(&self, lapse: Duration) {
        if let Some((_, held)) = self.registry_live.locked().as_mut() {
            *held = (*held).min(lapse);
        }
        self.lose_leases_if_lapsed(Moment::now());
    }

    /// Marks every lease of this process on a shard lost if the registry may have counted it
    /// dead by `at` (see [`Shared::beaten`]).
    pub(crate) fn lose_leases_if_lapsed(&self, at: Moment) {
        if !self.registry_live_at(at) {
            self.lose_shard_leases(REGISTRY_LAPSED);
        }
    }

    /// Another start took this process's instance id over while the registry counted it dead:
    /// its leases and locks are lost, and so is every one it is granted or handed from now on
    /// (a hand-off or reconcile on its way), whatever its own clocks say (they may have stood
    /// still through what made it count as dead). Its in-process leases too: they would be
    /// re-acquired on their shard once it answers, and a conflict found then reported, but a
    /// replaced process reconciles nothing any more, so they would say held for ever while the
    /// new start holds their keys on the shard.
    pub(crate) fn replaced(&self) {
        self.replaced_at.locked().get_or_insert_with(Moment::now);
        // The in-process ones first: one that a reconcile moves to the shard's leases
        // meanwhile is then among those below.
        for shard in self.shard_states() {
            for lease in shard.locals() {
                lease.mark_lost(REGISTRY_TAKEN_OVER, self);
            }
        }
        self.lose_shard_leases(REGISTRY_TAKEN_OVER);
    }

    /// Whether another start took this process's instance id over (see [`Shared::replaced`]).
    pub(crate) fn was_replaced(&self) -> bool {
        self.replaced_at.locked().is_some()
    }

    /// Marks every lease of this process on a shard lost, for `why`, and every lock without
    /// a lease row taken before (see [`Shared::registry_losses`]).
    pub(crate) fn lose_shard_leases(&self, why: &'static str) {
        self.registry_losses.send_modify(|n| *n += 1);
        for shard in self.shard_states() {
            for lease in shard.held() {
                if !lease.in_process_only() {
                    lease.mark_lost(why, self);
                }
            }
        }
    }

    /// No registry judges this process any more (a reload onto `registry: static`); leases
    /// that lapsed before stay lost.
    pub(crate) fn registry_unlimited(&self) {
        self.lose_leases_if_lapsed(Moment::now());
        *self.registry_live.locked() = None;
    }

    /// Sets what [`Shared::follow`] does; the first call wins.
    pub(crate) fn set_follow(
        &self,
        follow: impl Fn(Arc<ShardState>, Arc<LeaseState>) + Send + Sync + 'static,
    ) {
        let _ = self.follow.set(Follow(Box::new(follow)));
    }

    /// Makes `lease`, held on `shard` and placed under an older topology than the one in force,
    /// follow its key (in the background; nothing before the router set the hook).
    pub(crate) fn follow(&self, shard: Arc<ShardState>, lease: Arc<LeaseState>) {
        if let Some(Follow(follow)) = self.follow.get() {
            follow(shard, lease);
        }
    }

    /// Adds a new shard state to those [`Shared::shard_states`] lists.
    pub(crate) fn register(&self, state: &Arc<ShardState>) {
        self.shard_states.locked().push(Arc::downgrade(state));
    }

    /// Every live shard state of this router, in or out of the topology.
    pub(crate) fn shard_states(&self) -> Vec<Arc<ShardState>> {
        // Also called from drops: a list poisoned by another panic is still a list.
        let mut states = self.shard_states.locked();
        states.retain(|s| s.strong_count() > 0);
        states.iter().filter_map(Weak::upgrade).collect()
    }

    /// Makes every lease of this router allow for a shard clock that runs up to `drift_ppm`
    /// faster than ours (a config's `instance.clock-drift`): if that is more than before, those
    /// held now too (see [`LeaseState::allow_drift`]; a lease registered meanwhile allows for
    /// it as it registers, after it is listed, so one of the two sees the other). Less applies
    /// to later grants only.
    pub(crate) fn allow_drift(&self, drift_ppm: u32) {
        let before = self.drift_ppm.swap(drift_ppm, Ordering::SeqCst);
        if drift_ppm <= before {
            return;
        }
        // A row kept taken runs by the slower clock too, its lease long gone or not.
        for hold in self.kept.locked().holds.values_mut().flatten() {
            hold.drift_ppm = hold.drift_ppm.max(drift_ppm);
        }
        for shard in self.shard_states() {
            for lease in shard.held().into_iter().chain(shard.locals()) {
                lease.allow_drift(drift_ppm);
            }
        }
    }

    /// The clock drift every lease of this router allows for (see [`Shared::allow_drift`]).
    pub(crate) fn drift_ppm(&self) -> u32 {
        self.drift_ppm.load(Ordering::SeqCst)
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
    /// grant numbered below `before`, no lease of this router, local or remote, holds that
    /// owner now, and its row is not kept taken any more by a shard whose nodes' clocks may
    /// be `clock_skew` apart.
    pub(crate) fn is_stale_own(&self, owner: &str, before: u64, clock_skew: Duration) -> bool {
        let older = owner
            .strip_prefix(self.instance_id.as_str())
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|rest| rest.strip_prefix(self.nonce.as_str()))
            .and_then(|rest| rest.strip_prefix(':'))
            .and_then(|seq| seq.parse::<u64>().ok())
            .is_some_and(|seq| seq < before);
        let now = Moment::now();
        let kept = (self.kept.locked().holds.get(owner))
            .is_some_and(|holds| holds.iter().any(|h| now < h.past(clock_skew)));
        older && !kept && !self.shard_states().iter().any(|s| s.holds_owner(owner))
    }

    /// Records that the row of `owner` stays taken for `hold` whatever becomes of its lease:
    /// its release may fail, and a later reconcile of the key must leave it taken until a
    /// local moment past the hold's end, by the clock drift and node skew allowed then.
    pub(crate) fn keep_taken(&self, owner: &str, hold: KeptHold) {
        // Ended holds are pruned by the largest skew of any shard: read first, when a prune is
        // due (the shard list's lock is not taken under this one's).
        let due = {
            let kept = self.kept.locked();
            kept.holds.len() >= kept.prune_at
        };
        let skew = due.then(|| {
            (self.shard_states().iter())
                .map(|s| s.leases_skew())
                .max()
                .unwrap_or_default()
        });
        let mut kept = self.kept.locked();
        if let Some(skew) = skew.filter(|_| kept.holds.len() >= kept.prune_at) {
            let now = Moment::now();
            kept.holds.retain(|_, holds| {
                holds.retain(|h| now < h.past(skew));
                !holds.is_empty()
            });
            kept.prune_at = (kept.holds.len() * 2).max(64);
        }
        let drift_ppm = hold.drift_ppm.max(self.drift_ppm());
        (kept.holds.entry(owner.to_owned()).or_default()).push(KeptHold { drift_ppm, ..hold });
    }

    /// Forgets `owner`'s minimum hold on `shard` once its release reached that shard: the row
    /// then shows it is kept (a zero ttl), and the map stays as small as the holds not
    /// released. Its row on another shard (a moved key's) is still kept until released there.
    pub(crate) fn released_kept(&self, owner: &str, shard: u64) {
        let mut kept = self.kept.locked();
        if let Some(holds) = kept.holds.get_mut(owner) {
            holds.retain(|h| h.shard != shard);
            if holds.is_empty() {
                kept.holds.remove(owner);
            }
        }
    }

    /// A new grant number (unique in this router; also names a lease row in its shard's
    /// keeper).
    pub(crate) fn next_id(&self) -> u64 {
        self.grant_seq.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// The hook behind [`Shared::follow`].
struct Follow(Box<dyn Fn(Arc<ShardState>, Arc<LeaseState>) + Send + Sync>);

impl std::fmt::Debug for Follow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Follow")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shared() -> Shared {
        let telemetry = crate::telemetry::Telemetry::new(&Default::default(), None);
        Shared::new("worker-1".to_owned(), telemetry)
    }

    /// A row kept taken 10 s from now on the shard state `shard`, recorded with no clock
    /// drift or node skew.
    fn ten_seconds_on(shard: u64) -> KeptHold {
        KeptHold {
            shard,
            from: Moment::now(),
            at_least: Duration::from_secs(10),
            drift_ppm: 0,
            clock_skew: Duration::ZERO,
        }
    }

    /// A reload that raises the clock drift allowed keeps a row kept taken for as long as the
    /// slower shard clock counts its hold, also once its lease is gone: a reconcile of its key
    /// must not give the row back before then.
    #[tokio::test(start_paused = true)]
    async fn a_kept_row_outlasts_a_clock_drift_raised_after_its_grant() {
        let shared = shared();
        let owner = format!("worker-1:{}:1", shared.nonce());
        shared.keep_taken(&owner, ten_seconds_on(1));
        // 10 %: the shard's clock counts 10 s in 11.1 s of ours.
        shared.allow_drift(100_000);
        tokio::time::advance(Duration::from_millis(10_500)).await;
        assert!(
            !shared.is_stale_own(&owner, 2, Duration::ZERO),
            "a row kept taken was given back before a shard clock 10% slower ended its hold"
        );
        tokio::time::advance(Duration::from_millis(700)).await;
        assert!(shared.is_stale_own(&owner, 2, Duration::ZERO));
    }

    /// A moved key's rows on two shards share their owner: the release of one leaves the
    /// other's hold, whose own release may have failed, in place.
    #[tokio::test(start_paused = true)]
    async fn a_release_on_one_shard_leaves_the_hold_of_the_same_owner_on_another() {
        let shared = shared();
        let owner = format!("worker-1:{}:1", shared.nonce());
        for shard in [1, 2] {
            shared.keep_taken(&owner, ten_seconds_on(shard));
        }
        shared.released_kept(&owner, 1);
        assert!(
            !shared.is_stale_own(&owner, 2, Duration::ZERO),
            "a release on one shard ended the hold of the same owner's row on another"
        );
        shared.released_kept(&owner, 2);
        assert!(shared.is_stale_own(&owner, 2, Duration::ZERO));
    }

    /// A hold recorded while a higher clock drift is allowed keeps it once a reload lowers it
    /// (a lease granted before the raise may have recorded less).
    #[tokio::test(start_paused = true)]
    async fn a_lowered_clock_drift_shortens_no_hold_recorded_before() {
        let shared = shared();
        shared.allow_drift(100_000);
        let owner = format!("worker-1:{}:1", shared.nonce());
        shared.keep_taken(&owner, ten_seconds_on(1));
        shared.allow_drift(0);
        tokio::time::advance(Duration::from_millis(10_500)).await;
        assert!(
            !shared.is_stale_own(&owner, 2, Duration::ZERO),
            "a row kept taken while 10% drift was allowed was given back once it was lowered"
        );
    }
}
