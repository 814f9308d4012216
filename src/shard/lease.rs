//! A lease this process holds: the row a grant wrote, its local deadline (always before the
//! shard can hand the key to anyone else), its renewal period, the moved key's companion rows,
//! and the "lost" signal its guards listen to. Shared by the shard's keeper, which renews it,
//! and by the guards made under it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use crate::clock::Moment;
use shardlock_core::LockKey;
use tokio::sync::watch;

use super::ShardState;
use super::Shared;
use crate::queue::{Turn, Want};
use crate::sync::LockExt;

/// A local lease has no end of its own: it lasts until released, or lost on reconciliation.
const LOCAL_HORIZON: Duration = Duration::from_secs(100 * 365 * 86_400);

/// An in-process lease without keep-alive with less than this left when its shard returns
/// is let end in process rather than re-acquired there.
const MIN_TTL_LEFT: Duration = Duration::from_millis(1);

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
    deadline: Mutex<Deadline>,
    /// Told when [`LeaseState::valid_until`] may have moved earlier (a local lease placed on
    /// its shard, a companion row adopted), so that a `lost()` sleeping toward the old end
    /// looks again.
    end_moved: tokio::sync::Notify,
    lost: watch::Sender<bool>,
    /// Its row was locked by another transaction at its last renewal (not extended), or that
    /// renewal timed out: the next one takes the rows free of other locks at once, without
    /// waiting for any, apart from the other leases (see the keeper's tick; a renewal apart
    /// that times out makes the next one plain again).
    pub(crate) renew_apart: std::sync::atomic::AtomicBool,
    /// Set once the keeper has sent (or tried to send) a renewal of this lease: until then, a
    /// lease granted late in its ttl is renewed at once rather than at the shard's next tick
    /// (see [`LeaseState::ends_before_renewed`]).
    renewal_tried: std::sync::atomic::AtomicBool,
    /// Set by the first release of this lease sent to its shard (see
    /// `guard::release_through_shard`): a second one, a shutdown's beside the guard's drop,
    /// is not sent.
    pub(crate) release_claimed: std::sync::atomic::AtomicBool,
    /// The row stays taken this many µs after its grant even if released earlier (0: no such
    /// bound). From [`Want::at_least`]; a scheduled run sets it to the end of its interval.
    at_least_us: AtomicU64,
    /// The next fence to hand out in memory, and the last one reserved on the shard.
    next_fence: AtomicU64,
    fence_top: u64,
    /// In-memory hand-offs end this long after the shard grant.
    local_until: Moment,
    /// This process's turn on the key: held until the lease is released, so local waiters
    /// queue in memory instead of polling the shard.
    pub(crate) turn: Mutex<Option<Turn>>,
    /// Granted in process while the shard's breaker was open (`LockMode::LocalFallback`).
    pub(crate) local: bool,
    /// Set once a local lease was re-acquired on its shard: a row like any other's from then
    /// on, lost with the others when the registry may count this process dead.
    pub(crate) reconciled: std::sync::atomic::AtomicBool,
    /// Set when re-acquiring this local lease on its shard may have written its row unheard
    /// (the reply was lost): released while still local, it gives that row back.
    pub(crate) maybe_on_shard: std::sync::atomic::AtomicBool,
    /// Reconcile passes in a row that found this local lease's key held and could not tell
    /// whose row it was (see `keeper.rs`).
    pub(crate) undecided_looks: std::sync::atomic::AtomicU32,
    /// Set while a try before the one that granted this lease may still land (see
    /// [`LeaseState::give_back_lost_try`]).
    pub(crate) lost_try_may_land: std::sync::atomic::AtomicBool,
    /// The longest row a re-acquire of this local lease asked for, in ms (an `extend` in
    /// process may have made it longer than its ttl): a give-back of a row that re-acquire may
    /// have written unheard is retried that long.
    asked_row_ms: AtomicU64,
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
    /// While a try of the follow may have taken the key on its new shard unheard: when that
    /// row may run out, unrenewed. The lease ends then unless the try is answered (see
    /// `moves::take_on`): the fleet's move may end on that row.
    unheard_row_until: Mutex<Option<Moment>>,
}

/// The companion rows of a lease, and whether the lease already ended (a companion that
/// arrives after that is released at once).
#[derive(Debug, Default)]
struct Companions {
    rows: Vec<(Arc<ShardState>, Arc<LeaseState>)>,
    ended: bool,
}

/// A lease's local end, and what placed it there: the statement (when it was sent, for which
/// ttl) and the clock drift it allows for. A reload that raises `instance.clock-drift` places
/// it again, earlier, by the drift allowed then (see [`LeaseState::allow_drift`]).
#[derive(Debug)]
struct Deadline {
    at: Moment,
    /// `None` for an in-process lease (no end of its own).
    placed_by: Option<(Moment, Duration)>,
    drift_ppm: u32,
    /// How far ahead of the granting node another node's clock may run (see
    /// [`LeaseState::allow_skew`]).
    clock_skew: Duration,
}

impl Deadline {
    /// The local end of a statement sent at `sent` that set the row's end `ttl` later.
    fn end_of(&self, sent: Moment, ttl: Duration) -> Moment {
        Want::end_by(sent, ttl, self.drift_ppm, self.clock_skew)
    }
}

/// What the shard granted: to which owner (grant `id`), its first fence and how many more
/// were reserved after it, and when the granting statement was sent.
#[derive(Debug)]
pub(crate) struct Grant {
    pub(crate) id: u64,
    pub(crate) owner: String,
    pub(crate) fence: u64,
    pub(crate) reserve: u32,
    pub(crate) sent: Moment,
    /// Whether a try before the one that granted may still land (its reply was lost where
    /// its session could not be ended first): see [`LeaseState::give_back_lost_try`].
    pub(crate) lost_try: bool,
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
            deadline: Mutex::new(Deadline {
                at: want.lease_end(grant.sent),
                placed_by: Some((grant.sent, want.ttl)),
                drift_ppm: want.drift_ppm,
                clock_skew: want.clock_skew,
            }),
            end_moved: tokio::sync::Notify::new(),
            lost: watch::channel(false).0,
            release_claimed: Default::default(),
            renew_apart: Default::default(),
            renewal_tried: Default::default(),
            maybe_on_shard: Default::default(),
            undecided_looks: Default::default(),
            lost_try_may_land: std::sync::atomic::AtomicBool::new(grant.lost_try),
            asked_row_ms: AtomicU64::new(0),
            at_least_us: AtomicU64::new(
                want.at_least
                    .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX)),
            ),
            next_fence: AtomicU64::new(grant.fence + 1),
            fence_top: grant.fence + u64::from(grant.reserve),
            local_until: grant.sent + local_for,
            turn: Mutex::new(turn),
            local: false,
            reconciled: std::sync::atomic::AtomicBool::new(false),
            placed_epoch: AtomicU64::new(0),
            companions: Mutex::default(),
            parent: std::sync::OnceLock::new(),
            following: tokio::sync::Mutex::new(()),
            unheard_row_until: Mutex::new(None),
        }
    }

    /// This lease as a companion row of `parent`: its loss is the parent's.
    pub(crate) fn belonging_to(self, parent: &Arc<LeaseState>) -> Self {
        let _ = self.parent.set(Arc::downgrade(parent));
        self
    }

    /// Whether the lease ended (released): companions are refused from then on.
    pub(crate) fn has_ended(&self) -> bool {
        self.companions.locked().ended
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

    /// Whether this is a companion row of a lease that was lost.
    pub(crate) fn parent_is_lost(&self) -> bool {
        self.parent
            .get()
            .and_then(Weak::upgrade)
            .is_some_and(|p| p.is_lost())
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
        let mut companions = self.companions.locked();
        if companions.ended || self.is_lost() {
            return false;
        }
        if companion.is_lost() {
            drop(companions);
            self.mark_lost(
                "a row of the lease on another shard was lost",
                &shard.shared,
            );
            return false;
        }
        companions.rows.push((shard, companion));
        self.end_moved.notify_waiters();
        true
    }

    /// Whether the lease has rows on other shards.
    pub(crate) fn has_companions(&self) -> bool {
        !self.companions.locked().rows.is_empty()
    }

    /// The companion rows of this lease, with their shards.
    pub(crate) fn companion_rows(&self) -> Vec<(Arc<ShardState>, Arc<LeaseState>)> {
        self.companions.locked().rows.clone()
    }

    /// The shards this lease has companion rows on.
    pub(crate) fn companion_shards(&self) -> Vec<Arc<ShardState>> {
        let companions = self.companions.locked();
        companions.rows.iter().map(|(s, _)| s.clone()).collect()
    }

    /// Refuses companions from now on; `true` if the lease has some (adopted before this).
    pub(crate) fn refuse_companions(&self) -> bool {
        let mut companions = self.companions.locked();
        companions.ended = true;
        !companions.rows.is_empty()
    }

    /// Ends the lease's companions: returns them to release; later ones are refused.
    pub(crate) fn end_companions(&self) -> Vec<(Arc<ShardState>, Arc<LeaseState>)> {
        let mut companions = self.companions.locked();
        companions.ended = true;
        std::mem::take(&mut companions.rows)
    }

    /// An in-process lease, granted while the shard's breaker is open: no row, no renewal,
    /// no hand-offs, until the keeper re-acquires it on the shard. One with keep-alive has no
    /// end meanwhile; one without ends at its ttl from the grant, by this process's clock (the
    /// only one it answers to), unless extended.
    pub(crate) fn local(key: LockKey, grant: Grant, want: Want, turn: Turn) -> Self {
        let lasts = if want.keep_alive {
            LOCAL_HORIZON
        } else {
            want.ttl
        };
        Self {
            deadline: Mutex::new(Deadline {
                at: grant.sent + lasts,
                placed_by: None,
                drift_ppm: want.drift_ppm,
                clock_skew: want.clock_skew,
            }),
            fence_top: 0,
            local: true,
            ..Self::new(key, grant, want, Duration::ZERO, Some(turn))
        }
    }

    /// Whether the lease is held in process only: granted so, and not re-acquired on its
    /// shard since. Such a lease does not depend on the registry.
    pub(crate) fn in_process_only(&self) -> bool {
        self.local && !self.reconciled.load(Ordering::Acquire)
    }

    /// Whether the lease is surely still ours on its shard, and on its companions' shards.
    pub(crate) fn is_live(&self) -> bool {
        let now = Moment::now();
        !self.is_lost()
            && now < self.deadline()
            && self
                .unheard_row_until
                .locked()
                .is_none_or(|until| now < until)
            && self
                .companions
                .locked()
                .rows
                .iter()
                .all(|(_, c)| !c.is_lost() && now < c.deadline())
    }

    /// A fence for an in-memory hand-off, if this lease may still make one: it is live, its
    /// reserved fences are not used up, and its time for local hand-offs has not run out.
    pub(crate) fn local_fence(&self) -> Option<u64> {
        if Moment::now() >= self.local_until || !self.is_live() {
            return None;
        }
        // Holds of one lease follow each other, so nobody else takes fences meanwhile.
        let fence = self.next_fence.load(Ordering::Acquire);
        (fence <= self.fence_top).then(|| {
            self.next_fence.store(fence + 1, Ordering::Release);
            fence
        })
    }

    /// How long after its grant the row stays taken, if it must outlast a release.
    pub(crate) fn at_least(&self) -> Option<Duration> {
        match self.at_least_us.load(Ordering::Acquire) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }

    /// Sets the minimum hold after the grant (a scheduled run's, to its interval's end; a
    /// moved key's companion row, the lease's), and records it as [`LeaseState::keep_taken`]
    /// does: it may end later than the one the grant asked for.
    pub(crate) fn set_at_least(&self, at_least: Duration, shard: &ShardState) {
        let us = u64::try_from(at_least.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        self.at_least_us.store(us, Ordering::Release);
        self.keep_taken(shard);
    }

    /// Drops the minimum hold: the row is let go in full at its release.
    pub(crate) fn clear_at_least(&self) {
        self.at_least_us.store(0, Ordering::Release);
    }

    /// Records the row's minimum hold, if it has one, as running from now at the latest, so
    /// that this router's reconcile of its key leaves the row taken even once the lease ended
    /// (see [`Shared::keep_taken`]). Called as the lease is registered after its grant on
    /// `shard`.
    pub(crate) fn keep_taken(&self, shard: &ShardState) {
        if let Some(at_least) = self.at_least() {
            let (drift_ppm, clock_skew) = {
                let d = self.deadline.locked();
                (d.drift_ppm, d.clock_skew)
            };
            let hold = super::shared::KeptHold {
                shard: shard.serial,
                from: Moment::now(),
                at_least,
                drift_ppm,
                clock_skew,
            };
            shard.shared.keep_taken(&self.owner, hold);
        }
    }

    pub(crate) fn deadline(&self) -> Moment {
        self.deadline.locked().at
    }

    /// Why the lease is not live (see [`LeaseState::is_live`]): not renewed in time, or a row a
    /// follow's try may have taken unheard may have run out.
    pub(crate) fn not_live_because(&self) -> &'static str {
        let unheard = *self.unheard_row_until.locked();
        match unheard {
            Some(until) if Moment::now() >= until && until < self.deadline() => UNHEARD_ROW,
            _ => NOT_RENEWED,
        }
    }

    /// Ends the lease by `until` at the latest (`None`: no more), while a row a follow's try
    /// may have taken unheard may run out then (see [`LeaseState::unheard_row_until`]).
    pub(crate) fn end_by_unheard_row(&self, until: Option<Moment>) {
        *self.unheard_row_until.locked() = until;
        if until.is_some() {
            self.end_moved.notify_waiters();
        }
    }

    /// The earliest local deadline of this lease and its companion rows.
    pub(crate) fn valid_until(&self) -> Moment {
        let own = self.deadline();
        let own = self
            .unheard_row_until
            .locked()
            .map_or(own, |until| own.min(until));
        let companions = self.companions.locked();
        companions
            .rows
            .iter()
            .map(|(_, c)| c.deadline())
            .fold(own, Moment::min)
    }

    /// The row's ttl to re-acquire this in-process lease with, sent now: its own ttl, or for
    /// one without keep-alive what is left of its end (`None` once that has passed: the
    /// lease ended in process, and takes no row).
    pub(crate) fn ttl_left(&self) -> Option<Duration> {
        if self.want.keep_alive {
            return Some(self.ttl);
        }
        let left = self.deadline() - Moment::now();
        (left >= MIN_TTL_LEFT).then_some(left)
    }

    /// Moves an in-process lease's end to at least `by` from now (`extend` while it holds no
    /// row); `false` when it already ended or was lost (never revived). The keeper's re-acquire
    /// places it again, and extends the row if it ends earlier.
    pub(crate) fn extend_locally(&self, by: Duration) -> bool {
        let mut d = self.deadline.locked();
        let now = Moment::now();
        if d.at <= now || self.is_lost() {
            return false;
        }
        d.at = d.at.max(now + by);
        true
    }

    /// Notes that a re-acquire of this in-process lease asks for a row of `ttl`.
    pub(crate) fn asking_row_for(&self, ttl: Duration) {
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX);
        self.asked_row_ms.fetch_max(ms, Ordering::AcqRel);
    }

    /// Marks that a try before the one that granted the lease's row may still land (see
    /// [`LeaseState::give_back_lost_try`]).
    pub(crate) fn lost_try_may_land(&self) {
        self.lost_try_may_land.store(true, Ordering::Release);
    }

    /// Once the lease's row was released (or handed to another owner): if a try before the one
    /// that granted it may still land (a Galera node, a proxy that keeps sessions of its own),
    /// it would take the free row again for this owner, whom nobody holds, and keep the key
    /// from everyone for a ttl. Its row is given back, owner-checked, whenever it appears, for
    /// as long as it could last (a minimum hold kept: [`ShardState::watch_lost_try`]). Once
    /// per lease.
    pub(crate) fn give_back_lost_try(&self, shard: &Arc<ShardState>) {
        if self.lost_try_may_land.swap(false, Ordering::AcqRel) {
            let key = self.key.stored().to_vec();
            shard.watch_lost_try(key, self.owner.clone(), self.row_ttl(), self.at_least());
        }
    }

    /// How long a row of this lease may last from when it was last written: its ttl, or the
    /// longest a re-acquire asked for (a give-back of it is retried that long).
    pub(crate) fn row_ttl(&self) -> Duration {
        let asked = Duration::from_millis(self.asked_row_ms.load(Ordering::Acquire));
        self.ttl.max(asked)
    }

    /// How long a row of this lease may still last from now: its ttl, the longest a
    /// re-acquire asked for (`row_ttl`), or what is left of its deadline (an extended lease),
    /// whichever is longest. The deadline of a lease held in process only is no row's.
    pub(crate) fn row_may_last(&self) -> Duration {
        let left = match self.in_process_only() {
            true => Duration::ZERO,
            false => self.deadline().saturating_duration_since(Moment::now()),
        };
        self.row_ttl().max(left)
    }

    /// Places the local end of an in-process lease re-acquired on its shard by a statement
    /// sent at `sent` for `ttl`. Returns how much later the end it had in process lies (an
    /// `extend` answered while the statement was out), which the row must still be extended
    /// by.
    pub(crate) fn set_deadline_from(&self, sent: Moment, ttl: Duration) -> Option<Duration> {
        let short = {
            let mut d = self.deadline.locked();
            let row_end = sent + ttl;
            let short = (!self.want.keep_alive && d.at > row_end).then(|| d.at - row_end);
            d.at = d.end_of(sent, ttl);
            d.placed_by = Some((sent, ttl));
            short
        };
        self.end_moved.notify_waiters();
        short
    }

    /// Allows for a shard clock that runs up to `drift_ppm` faster than ours, if that is more
    /// than the lease allowed for (never less): a reload raised `instance.clock-drift`. Its
    /// local end comes earlier at once, as each later one does; else the shard could free the
    /// row before its holder's end, a lease without keep-alive never renewed at all.
    pub(crate) fn allow_drift(&self, drift_ppm: u32) {
        self.allow_more(|d| {
            let more = drift_ppm > d.drift_ppm;
            d.drift_ppm = d.drift_ppm.max(drift_ppm);
            more
        });
    }

    /// Raises what the lease's end allows for, as `raise` does (answering whether it raised
    /// anything): the end is placed again from the statement that placed it, and comes no
    /// later than it was.
    fn allow_more(&self, raise: impl FnOnce(&mut Deadline) -> bool) {
        {
            let mut d = self.deadline.locked();
            if !raise(&mut d) {
                return;
            }
            if let Some((sent, ttl)) = d.placed_by {
                d.at = d.at.min(d.end_of(sent, ttl));
            }
        }
        self.end_moved.notify_waiters();
    }

    /// The node clock skew the lease's end allows for (see [`LeaseState::allow_skew`]).
    pub(crate) fn clock_skew(&self) -> Duration {
        self.deadline.locked().clock_skew
    }

    /// Allows for a Galera shard's other nodes' clocks running up to `clock_skew` ahead of the
    /// one that granted, if that is more than the lease allowed for (never less): a reload
    /// raised the shard's `node-clock-skew`, and its pool now takes nodes whose clocks run that
    /// far ahead, which may free the row that much sooner. As [`LeaseState::allow_drift`].
    pub(crate) fn allow_skew(&self, clock_skew: Duration) {
        self.allow_more(|d| {
            let more = clock_skew > d.clock_skew;
            d.clock_skew = d.clock_skew.max(clock_skew);
            more
        });
    }

    /// Completes once [`LeaseState::valid_until`] may have moved earlier than it was when this
    /// was called.
    pub(crate) fn end_moved(&self) -> tokio::sync::futures::Notified<'_> {
        self.end_moved.notified()
    }

    /// Moves the local end later, by a statement sent at `sent` that renewed (or extended) the
    /// row for `ttl`, if that ends later than the end in force.
    pub(crate) fn extend_from(&self, sent: Moment, ttl: Duration) {
        let mut d = self.deadline.locked();
        // Under the lock: by the drift and skew in force once it is placed (see
        // `allow_drift`).
        let to = d.end_of(sent, ttl);
        if to > d.at {
            d.at = to;
            d.placed_by = Some((sent, ttl));
        }
    }

    /// Whether the keeper must renew this lease before a tick at `tick`: it is kept alive, no
    /// renewal of it was tried yet, and it would have little time left then. A grant answered
    /// late in its ttl (after a lock wait of most of it, or on a slow link) is registered with
    /// less time left than a lease renewed on time ever has; at the shard's next tick, up to a
    /// renewal interval away, it may have ended without a renewal ever sent. A lease granted
    /// on time has its local lifetime (its ttl less the clock drift and skew it allows for)
    /// less a renewal interval left at the next tick, or more: little is less than half that,
    /// and than half a renewal interval.
    pub(crate) fn ends_before_renewed(&self, tick: Moment) -> bool {
        if !self.want.keep_alive || self.renewal_tried.load(Ordering::Acquire) {
            return false;
        }
        let d = self.deadline.locked();
        let lifetime = match d.placed_by {
            Some((sent, ttl)) => d.end_of(sent, ttl).saturating_duration_since(sent),
            None => self.ttl,
        };
        let little = self
            .renew_every
            .min(lifetime.saturating_sub(self.renew_every))
            / 2;
        d.at < tick + little
    }

    /// Notes that the keeper sends a renewal of this lease, whatever its outcome: one that
    /// failed is retried as any lease ending before the next full tick is (see the keeper's
    /// `tick`), not by bringing a tick forward again (against an open breaker, which refuses
    /// at once, that would spin).
    pub(crate) fn renewal_sent(&self) {
        // Loaded first: a full tick passes every lease of its shard, nearly all tried before.
        if !self.renewal_tried.load(Ordering::Relaxed) {
            self.renewal_tried.store(true, Ordering::Release);
        }
    }

    pub(crate) fn is_lost(&self) -> bool {
        *self.lost.borrow()
    }

    pub(crate) fn subscribe_lost(&self) -> watch::Receiver<bool> {
        self.lost.subscribe()
    }

    /// Marks the lease lost (once) and says why. A companion row's loss is its lease's: that
    /// is what gets counted and reported. An end by the router's own shutdown is not counted
    /// (every deploy would look like leases lost) while the lease was still live: one whose
    /// end came first (renewals stopped while the shutdown waited) was lost, and is counted.
    pub(crate) fn mark_lost(&self, why: &'static str, shared: &Shared) {
        let stats = &shared.stats;
        let parent = self.parent.get().and_then(Weak::upgrade);
        let counted = why != SHUT_DOWN || !self.is_live();
        // Counted before the holder is woken, so whoever sees `lost()` complete also sees
        // the count.
        let first = self.lost.send_if_modified(|lost| {
            if *lost {
                return false;
            }
            *lost = true;
            if parent.is_none() && counted {
                stats.lost.fetch_add(1, Ordering::Relaxed);
            }
            true
        });
        match parent {
            Some(parent) => parent.mark_lost(why, shared),
            // Ended by the router's own shutdown: expected, not worth a warning.
            None if first && why == SHUT_DOWN => {
                let key = shared.telemetry.key_label(&self.key);
                tracing::debug!(key, owner = %self.owner, why, "shardlock lease ended")
            }
            None if first => {
                let key = shared.telemetry.key_label(&self.key);
                tracing::warn!(key, owner = %self.owner, why, "shardlock lease lost")
            }
            None => {}
        }
    }
}

/// Why leases end at `shutdown()`.
pub(crate) const SHUT_DOWN: &str = "router shut down";

/// Why a lease ends at its local deadline.
pub(crate) const NOT_RENEWED: &str = "not renewed before its lease ended";

/// Why a lease whose key moved ends when a row its follow may have taken unheard may run out.
pub(crate) const UNHEARD_ROW: &str = "its key moved in a reload and a try on the new shard whose \
                                      outcome is unknown may have taken the key there and run out";

#[cfg(test)]
mod tests {
    use super::*;

    /// A reload that raises a Galera shard's `node-clock-skew` moves the local end of a lease
    /// held there earlier by as much at once, and its renewals after end that much earlier too
    /// (they kept the skew of the grant, and the lease outlived its row on a node whose clock
    /// runs that far ahead).
    #[tokio::test]
    async fn a_raised_node_clock_skew_moves_a_held_leases_end_earlier() {
        let ttl = Duration::from_secs(10);
        let want = Want {
            ttl,
            renew_every: ttl / 3,
            handoff_max_count: 0,
            handoff_max_time: Duration::ZERO,
            drift_ppm: 0,
            clock_skew: Duration::from_millis(500),
            keep_alive: true,
            at_least: None,
            handoffs: false,
        };
        let sent = Moment::now();
        let grant = Grant {
            id: 1,
            owner: "o".to_owned(),
            fence: 1,
            reserve: 0,
            sent,
            lost_try: false,
        };
        let lease = LeaseState::new(
            LockKey::new("k").unwrap(),
            grant,
            want,
            Duration::ZERO,
            None,
        );
        // 10 s less 1 ms, less the skew.
        let by = |skew_ms: u64| ttl - Duration::from_millis(1 + skew_ms);
        assert_eq!(lease.deadline(), sent + by(500));
        lease.allow_skew(Duration::from_secs(2));
        assert_eq!(
            lease.deadline(),
            sent + by(2000),
            "the raised skew left the end"
        );
        lease.allow_skew(Duration::from_secs(1));
        assert_eq!(
            lease.deadline(),
            sent + by(2000),
            "a lowered skew moved the end"
        );
        let renewed = sent + Duration::from_secs(3);
        lease.extend_from(renewed, ttl);
        assert_eq!(
            lease.deadline(),
            renewed + by(2000),
            "a renewal took the old skew"
        );
    }
}
