//! The guard of a held lock, and how a hold ends: handed over in memory, handed over by the
//! release statement, or released.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use shardlock_core::{Error, Result};
use shardlock_mysql::{GrantRequest, HandoffOutcome, ReleaseAnswer};
use tokio::time::Instant;

use crate::clock::Moment;
use crate::queue::{NextWaiter, Turn, Want};
use crate::shard::{Grant, LeaseState, REGISTRY_LAPSED, REGISTRY_TAKEN_OVER};
use crate::shard::{Settling, ShardState};
use crate::sync::LockExt;

/// Where a lock is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// A lease row on the key's shard: mutual exclusion across every process.
    Remote,
    /// An in-process lock while the shard is unavailable (only with the `local` failure
    /// policy): mutual exclusion inside this process only.
    LocalFallback,
}

/// The bit set in every fence of a [`LockMode::LocalFallback`] guard: shard fences never have
/// it, so the two spaces cannot be confused.
pub const LOCAL_FENCE_BIT: u64 = 1 << 63;

/// One grant to one task: its fence, and how many guards share it (explicit reentrancy).
#[derive(Debug)]
pub(crate) struct Hold {
    pub(crate) lease: Arc<LeaseState>,
    pub(crate) shard: Arc<ShardState>,
    pub(crate) fence: u64,
    guards: AtomicUsize,
    /// When it was granted, for the hold-time metric.
    granted: Instant,
    /// `shardlock.hold`, open from grant to release.
    span: tracing::Span,
    /// The hold span of the holder that handed this grant over, if it was handed over.
    after: Option<tracing::Span>,
}

impl Hold {
    /// A grant handed over by the holder of `after` (in memory or by the release statement):
    /// its span starts a trace of its own that follows from the previous hold.
    pub(crate) fn handed(
        lease: Arc<LeaseState>,
        shard: Arc<ShardState>,
        fence: u64,
        after: &tracing::Span,
    ) -> Arc<Self> {
        let span = tracing::info_span!(
            parent: None,
            "shardlock.hold",
            shardlock.shard = shard.name(),
            shardlock.fence = fence,
            shardlock.mode = "remote",
        );
        span.follows_from(after);
        Arc::new(Self {
            lease,
            shard,
            fence,
            guards: AtomicUsize::new(1),
            granted: Instant::now(),
            span,
            after: Some(after.clone()),
        })
    }

    pub(crate) fn new(lease: Arc<LeaseState>, shard: Arc<ShardState>, fence: u64) -> Arc<Self> {
        let span = tracing::info_span!(
            "shardlock.hold",
            shardlock.shard = shard.name(),
            shardlock.fence = fence,
            shardlock.mode = if lease.local { "local" } else { "remote" },
        );
        Arc::new(Self {
            lease,
            shard,
            fence,
            guards: AtomicUsize::new(1),
            granted: Instant::now(),
            span,
            after: None,
        })
    }

    /// Whether this lease (and every companion row of it) is surely still ours: and a lease
    /// on a shard no longer than the registry surely counts this process live (see
    /// `Shared::beaten`).
    fn is_live(&self) -> bool {
        let shared = &self.shard.shared;
        // The registry's time first: a heartbeat that lands after a lapse marks the leases lost
        // before it moves that time on, so a time read moved on comes with the mark.
        // An in-process lease does not depend on the registry, unless another start took this
        // process's id over: it is reconciled with its shard never then (see
        // `Shared::replaced`), a hand-off of one after that included.
        let replaced = shared.was_replaced();
        let registry_live =
            (self.lease.in_process_only() && !replaced) || shared.registry_live_at(Moment::now());
        if !self.lease.is_live() {
            // For good as well: a renewal whose answer comes after the lease's end (its task
            // starved) would move the end on, but whoever looked meanwhile was told it is over.
            self.lease.mark_lost(self.lease.not_live_because(), shared);
            return false;
        }
        if registry_live {
            return true;
        }
        // For good: a heartbeat landing later makes the process live again, not its leases.
        let why = match replaced {
            true => REGISTRY_TAKEN_OVER,
            false => REGISTRY_LAPSED,
        };
        self.lease.mark_lost(why, shared);
        false
    }

    /// Until when the lease is surely ours (see [`Hold::is_live`]): also until the registry
    /// surely counts this process live, unlike [`LockGuard::held_until`].
    fn valid_until(&self) -> Moment {
        let own = self.lease.valid_until();
        match self.shard.shared.registry_live_until() {
            // (An in-process lease is ended by a replacement too: see `Shared::replaced`.)
            Some(live) if !self.lease.in_process_only() || self.shard.shared.was_replaced() => {
                own.min(live)
            }
            _ => own,
        }
    }
}

/// A held lock. Release it with [`LockGuard::release`]; dropping it releases in the
/// background.
///
/// While the guard lives, the lease is renewed in the background. If that fails for longer
/// than the lease, or someone takes the key over (the lease expired on the shard, or it was
/// force-released), [`LockGuard::lost`] completes and [`LockGuard::is_held`] turns false:
/// stop the critical section. Writes guarded by [`crate::fenced_exec`] are rejected after a
/// newer holder wrote.
#[derive(Debug)]
#[must_use = "dropping the guard releases the lock at once"]
pub struct LockGuard {
    hold: Arc<Hold>,
    done: bool,
}

impl LockGuard {
    pub(crate) fn new(hold: Arc<Hold>) -> Self {
        Self { hold, done: false }
    }

    /// The fencing token of this grant: larger than that of every earlier grant of the key
    /// from a shard.
    ///
    /// A [`LockMode::LocalFallback`] guard's fence has the top bit set ([`LOCAL_FENCE_BIT`]):
    /// it only orders holds inside this process, and [`crate::fenced_exec`] refuses it. It is
    /// not comparable with a shard's fences: the next grant from the shard has a lower one.
    pub fn fence(&self) -> u64 {
        self.hold.fence
    }

    /// The key, as given to `acquire`.
    pub fn key(&self) -> &str {
        self.hold.lease.key.as_str()
    }

    /// The bucket, for a lock taken with [`crate::LockRouter::acquire_bucket`] or
    /// [`crate::LockRouter::acquire_all_buckets`].
    pub fn bucket(&self) -> Option<u32> {
        self.hold.lease.key.bucket_number()
    }

    /// The name of the shard that holds the lease.
    pub fn shard(&self) -> &str {
        self.hold.shard.name()
    }

    /// Where the lock was granted. A [`LockMode::LocalFallback`] guard stays so for its life:
    /// it excludes only holders in this process, even after the keeper re-acquired its key on
    /// the shard (that row keeps out the processes that place the key on that shard, not one
    /// started onto another topology while this process counted as dead).
    pub fn mode(&self) -> LockMode {
        if self.hold.lease.local {
            LockMode::LocalFallback
        } else {
            LockMode::Remote
        }
    }

    /// The owner written in the lease row: `<instance id>:<start nonce>:<grant seq>`, unique
    /// per grant across processes. Grants handed over in
    /// memory share the row, and so the owner, of the grant they follow.
    pub fn owner(&self) -> &str {
        &self.hold.lease.owner
    }

    /// False once the lease is known lost or its local deadline passed without renewal; with
    /// the `heartbeat` registry also once this process's heartbeat lapsed (paused, or cut off
    /// from every shard, past halfway from `heartbeat-interval` to `heartbeat-timeout`): the
    /// others may count it dead, and a process started onto another topology meanwhile may
    /// hold the key where that topology puts it. Such a lease stays lost.
    pub fn is_held(&self) -> bool {
        self.hold.is_live()
    }

    /// Until when the lease is surely this process's: its local deadline, moved on by every
    /// renewal, after which [`LockGuard::is_held`] is false unless it was renewed. Past once
    /// the lease ended; a lease lost early (taken over, force-released, its process's
    /// heartbeat lapsed) may end before it, so check [`LockGuard::is_held`] too. A
    /// [`LockMode::LocalFallback`] guard with keep-alive has no end of its own while its key is
    /// held in process (a far-off instant); one without ends at its ttl from the grant (by
    /// this process's clock), as [`crate::AcquireOptions::lock_at_most`] says. An instant
    /// of the runtime's clock, which stands still while the host is suspended: the lease's end
    /// comes earlier by any suspend from now on (and [`LockGuard::is_held`] counts it).
    pub fn held_until(&self) -> tokio::time::Instant {
        self.hold.lease.valid_until().timer()
    }

    /// Completes when the lease is lost: renewal failed until the lease ended (then at its
    /// local deadline, when [`LockGuard::is_held`] turns false), the key was taken over or
    /// force-released, or this process's heartbeat lapsed (see [`LockGuard::is_held`]). Never
    /// completes for a lease that stays held. Cancel-safe. A lost guard still holds its key's
    /// turn in this process until it is dropped or released (no two guards of one key live at
    /// once in a process, whatever their state): other tasks of this process wait for that,
    /// other processes do not.
    pub async fn lost(&self) {
        let lease = &self.hold.lease;
        // A companion row's loss (a moved key) is reported through the lease it belongs to.
        let mut lost = lease.subscribe_lost();
        loop {
            // The keeper reports a lease lost at its deadline, but not while it waits on a
            // renewal statement (up to a statement timeout): a lease granted meanwhile, with a
            // shorter ttl than that, ends first. Its deadline is watched here too, and looked
            // at again if it moves earlier meanwhile, and at least every
            // `SUSPEND_NOTICED_WITHIN` (a suspend of the host ends leases early by the
            // runtime's clock).
            let moved = lease.end_moved();
            let until = self.hold.valid_until().checked_timer();
            tokio::select! {
                _ = lost.wait_for(|lost| *lost) => return,
                _ = moved => {}
                _ = tokio::time::sleep_until(until) => {
                    if !self.is_held() {
                        let why = match lease.is_live() {
                            true => REGISTRY_LAPSED,
                            false => lease.not_live_because(),
                        };
                        lease.mark_lost(why, &self.hold.shard.shared);
                        return;
                    }
                }
            }
        }
    }

    /// Moves the end of the lease to at least `by` from now (by the shard's clock), on every
    /// row of it; never earlier. For a lease without keep-alive
    /// ([`crate::AcquireOptions::keep_alive`]) this is the only way it lasts longer than its
    /// ttl; a renewed lease keeps being renewed by its own ttl after that end.
    /// [`LockGuard::held_until`] moves with it (not past the end of a row that its key's move
    /// to a new shard may have taken unheard, by which the lease ends unless that is
    /// answered). A [`LockMode::LocalFallback`] guard's key held
    /// in process has no row: without keep-alive, only its end in process moves (`Ok` at
    /// once), and the row its shard gives it once back lasts that long; with keep-alive it has
    /// no end in process to move, and that row gets its ttl, renewed as usual. Once
    /// re-acquired on its shard, its row's end moves as any other's.
    ///
    /// Returns [`Error::LockLost`] if the lease already ended or was taken over (the guard then
    /// reports it lost), and a backend error if a shard could not be reached (the lease's end
    /// may or may not have moved; [`LockGuard::held_until`] stays where it was).
    pub async fn extend(&self, by: std::time::Duration) -> Result<()> {
        shardlock_core::config::check_ttl(by).map_err(|reason| Error::InvalidArgument {
            name: "extend",
            reason,
        })?;
        let lease = &self.hold.lease;
        if !self.is_held() {
            return Err(self.lost_error());
        }
        // Held in process, not re-acquired on its shard yet: only its end in process moves
        // (the re-acquire takes the row up to it), unless it ended. Re-acquired, it is a lease
        // with a row like any other.
        if lease.local {
            match self.hold.shard.extend_local(lease.id, by) {
                Some(true) => return Ok(()),
                Some(false) => return Err(self.lost_error()),
                None => {}
            }
        }
        let sent = Moment::now();
        let mut rows = vec![(self.hold.shard.clone(), lease.clone())];
        rows.extend(lease.companion_rows());
        for (shard, row) in &rows {
            match shard
                .call_row(|b| b.extend(row.key.stored(), &row.owner, by))
                .await
            {
                Ok(true) => {}
                Ok(false) => {
                    row.mark_lost("ended or taken over before it was extended", &shard.shared);
                    return Err(self.lost_error());
                }
                Err(e) => return Err(e.into_error(shard.name())),
            }
        }
        for (_, row) in &rows {
            row.extend_from(sent, by);
        }
        // Reported lost meanwhile (its local end passed before the answer came): the row may
        // still be ours, but the guard no longer says so.
        if lease.is_lost() {
            return Err(self.lost_error());
        }
        Ok(())
    }

    pub(crate) fn lost_error(&self) -> Error {
        Error::LockLost {
            key_label: self
                .hold
                .shard
                .shared
                .telemetry
                .key_label(&self.hold.lease.key),
        }
    }

    /// Re-enters the lock: returns another guard of the same grant (same fence). The lock is
    /// released when the last of them is released or dropped. Reentrancy is only ever
    /// explicit.
    pub fn reenter(&self) -> Result<LockGuard> {
        if self.hold.lease.is_lost() {
            return Err(self.lost_error());
        }
        self.hold.guards.fetch_add(1, Ordering::AcqRel);
        Ok(LockGuard::new(self.hold.clone()))
    }

    /// The grant behind this guard.
    pub(crate) fn hold(&self) -> &Hold {
        &self.hold
    }

    /// The hold span of the holder that handed this grant over, if it was.
    pub(crate) fn handed_from(&self) -> Option<&tracing::Span> {
        self.hold.after.as_ref()
    }

    /// How many guards share this grant.
    pub fn holds(&self) -> usize {
        self.hold.guards.load(Ordering::Acquire)
    }

    /// Releases the lock. With reentrant guards still alive, this only gives up this guard's
    /// hold. If a task of this process waits for the key, it is handed the lock (in memory
    /// while the lease allows, else by the release statement itself); otherwise the lease row
    /// is released, owner-checked: only our own row is touched.
    ///
    /// Returns [`Error::LockLost`] if the lease was no longer ours (someone else holds the key
    /// now; their lease is left intact) or was already known lost ([`LockGuard::lost`] had
    /// completed), and a backend error if the shard could not be reached: the lease is no
    /// longer renewed then, and its row is given back in the background once the shard answers
    /// again (or ends by expiry, whichever comes first).
    ///
    /// Cancellation: the release runs in its own task and completes even if this future is
    /// dropped.
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
        if self.hold.guards.fetch_sub(1, Ordering::AcqRel) > 1 {
            return Ok(());
        }
        match end_hold(&self.hold) {
            None => Ok(()),
            // On the router's runtime: a release given up by its caller goes on.
            Some(shard_work) => match self.hold.shard.shared.spawn(shard_work) {
                Some(work) => work.await.map_err(|_| Error::Shutdown)?,
                // No runtime to release on: stop renewing; the lease ends by expiry.
                None => {
                    drop(self.hold.shard.remove(self.hold.lease.id));
                    Err(Error::Shutdown)
                }
            },
        }
    }

    /// Drops an in-process grant that its caller refuses (a pattern that counts only leases
    /// on the shards, or a process replaced under its id): nothing ran under it, so it keeps
    /// its key for no minimum hold (which kept the key's turn in this process for that long,
    /// a scheduled run's whole interval, refusing every later try here).
    pub(crate) fn refuse_local(self) {
        debug_assert_eq!(self.mode(), LockMode::LocalFallback);
        self.hold.lease.clear_at_least();
        drop(self);
    }

    /// Gives back a grant its caller never saw (sought across a heartbeat lapse): released
    /// through its shard, handed to no waiter in memory (it may have been placed where the
    /// fleet no longer places its key); the waiters poll the shard. In full: a minimum hold
    /// (`lock_at_least`, a scheduled run's interval) is for a holder that ran.
    pub(crate) async fn give_back_unseen(self) {
        if let Some(release) = self.give_back_unseen_later() {
            let _ = release.await;
        }
    }

    /// [`LockGuard::give_back_unseen`], run on the router's runtime: its task, if one is to
    /// be waited for.
    pub(crate) fn give_back_unseen_later(mut self) -> Option<tokio::task::JoinHandle<Result<()>>> {
        self.done = true;
        if self.hold.guards.fetch_sub(1, Ordering::AcqRel) > 1 {
            return None;
        }
        let (shard, lease) = (self.hold.shard.clone(), self.hold.lease.clone());
        for (at, row) in
            std::iter::once((shard.clone(), lease.clone())).chain(lease.companion_rows())
        {
            row.clear_at_least();
            shard.shared.released_kept(&row.owner, at.serial);
        }
        let (turn, id) = (lease.turn.locked().take(), lease.id);
        let release = (shard.shared).spawn(release_through_shard(shard.clone(), lease, turn));
        if release.is_none() {
            // No runtime to release on: stop renewing; the lease ends by expiry.
            drop(shard.remove(id));
        }
        release
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done || self.hold.guards.fetch_sub(1, Ordering::AcqRel) > 1 {
            return;
        }
        if let Some(shard_work) = end_hold(&self.hold) {
            // On the router's runtime: a task spawned on the caller's may never run (a
            // `block_on` returning at once), and the lease would be renewed for ever.
            match self.hold.shard.shared.runtime() {
                Some(runtime) => drop(runtime.spawn(shard_work)),
                // No runtime to release on: stop renewing; the lease ends by expiry.
                None => drop(self.hold.shard.remove(self.hold.lease.id)),
            }
        }
    }
}

/// A release or hand-off statement still to run.
type ShardWork = Pin<Box<dyn Future<Output = Result<()>> + Send>>;

/// Ends a hold. A waiting task of this process is handed the lock in memory when the lease
/// allows it (returns `None`: done); otherwise returns the shard work to run: the release
/// statement, which also hands the lease to the waiter unless another process asked for it.
fn end_hold(hold: &Hold) -> Option<ShardWork> {
    let (lease, shard) = (&hold.lease, &hold.shard);
    if let Some(holds) = &shard.holds {
        holds[usize::from(lease.local)].record(hold.granted.elapsed().as_secs_f64());
    }
    let _entered = hold.span.enter();
    if lease.local {
        // No hand-offs for an in-process lease: the next waiter takes its own turn (and goes
        // to the shard if it is back).
        let turn = lease.turn.locked().take();
        if shard.remove_local(lease.id) {
            shard.shared.stats.releases.fetch_add(1, Ordering::Relaxed);
            // A minimum hold (`lock_at_least`) keeps the key's turn, the one place an
            // in-process hold excludes anyone, until it has passed.
            let left = (lease.at_least())
                .and_then(|at_least| at_least.checked_sub(hold.granted.elapsed()));
            match (left, shard.shared.runtime()) {
                (Some(left), Some(runtime)) if !left.is_zero() => {
                    // Until shutdown at the latest: callers waiting for the key are then told.
                    let mut closed = shard.shared.closed.subscribe();
                    drop(runtime.spawn(async move {
                        tokio::select! {
                            () = tokio::time::sleep(left) => {}
                            _ = closed.wait_for(|closed| *closed) => {}
                        }
                        drop(turn);
                    }));
                }
                _ => drop(turn),
            }
            // A re-acquire whose reply was lost may have taken the row under this owner
            // (whoever clears the mark gives it back: this release, or the keeper).
            if lease.maybe_on_shard.swap(false, Ordering::SeqCst) {
                let key = lease.key.stored().to_vec();
                shard.give_back(key, lease.owner.clone(), lease.row_ttl());
            }
            return None;
        }
        // Re-acquired on the shard meanwhile (or found held there): release the row.
        return Some(Box::pin(release_through_shard(
            shard.clone(),
            lease.clone(),
            turn,
        )));
    }
    // A lease with rows on other shards (its key moved) or placed under an older topology (its
    // key may have moved) is not handed over: it is released everywhere and the waiters poll
    // where the key lives now.
    // A lease known lost is not handed over either: whoever holds the key now keeps it. Nor
    // one that must stay taken after its release (`lock_at_least`), nor one held through a
    // shard state a reload left (its pool is closed once nothing is held there).
    let placed = lease.placed_epoch.load(Ordering::Acquire);
    if lease.has_companions()
        || lease.at_least().is_some()
        || placed < shard.shared.epoch()
        || shard.has_left()
        || !lease.is_live()
    {
        let turn = lease.turn.locked().take();
        return Some(Box::pin(release_through_shard(
            shard.clone(),
            lease.clone(),
            turn,
        )));
    }
    let closed = shard.shared.is_closed();
    let mut turn_slot = lease.turn.locked();
    // No hand-offs once the router shuts down: waiters then find it closed.
    let next = turn_slot
        .as_ref()
        .filter(|_| !closed)
        .and_then(Turn::next_waiter);
    if let Some(next) = next {
        // In memory only when the waiter asked for this lease's own ttl; otherwise the
        // release statement grants it with the waiter's.
        // (Terms first: a fence of the range is used up only by a hand-off made.)
        let same_terms = lease.want.same_terms(&next.want);
        if let Some(fence) = same_terms.then(|| lease.local_fence()).flatten() {
            // Unlock first: if the waiter gave up meanwhile, the guard comes back and is
            // dropped right here, which ends its hold on this same lease.
            drop(turn_slot);
            shard.shared.stats.grants.fetch_add(1, Ordering::Relaxed);
            shard
                .shared
                .stats
                .local_handoffs
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(fence, "shardlock handed the lock over in memory");
            next.grant(LockGuard::new(Hold::handed(
                lease.clone(),
                shard.clone(),
                fence,
                &hold.span,
            )));
            return None;
        }
        let turn = turn_slot
            .take()
            .expect("a waiter was found through the turn");
        return Some(Box::pin(handoff_through_shard(
            shard.clone(),
            lease.clone(),
            (turn, next),
            hold.span.clone(),
            placed,
        )));
    }
    let turn = turn_slot.take();
    drop(turn_slot);
    Some(Box::pin(release_through_shard(
        shard.clone(),
        lease.clone(),
        turn,
    )))
}

/// The next hand-off through a shard waits until this is answered or dropped (see
/// [`crate::LockRouter::hold_next_handoff`]).
#[cfg(feature = "fault-injection")]
pub(crate) static HANDOFF_HELD: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>> =
    std::sync::Mutex::new(None);

/// The release statement that also grants the lease to `next`, with a fresh range of fences,
/// unless another process marked the row as wanted: then the key is released for everyone and
/// `next` gets the turn to poll after yielding.
async fn handoff_through_shard(
    shard: Arc<ShardState>,
    lease: Arc<LeaseState>,
    (turn, next): (Turn, NextWaiter),
    after: tracing::Span,
    placed: u64,
) -> Result<()> {
    #[cfg(feature = "fault-injection")]
    {
        let held = HANDOFF_HELD.locked().take();
        if let Some(held) = held {
            let _ = held.await;
        }
    }
    // No row of the lease is adopted on another shard from here on. If one was since the hold
    // ended under the topology of epoch `placed`, or a reload came since (its follow may be
    // under way), the key may have moved: handed over here, the waiter's lease would hold it
    // only where it lived, while the fleet takes it where it lives now. The rows are released
    // instead, and the waiter polls where the key lives.
    // A waiter in memory never polled, so its terms carry no clock skew: on a Galera shard the
    // new lease ends locally as early as the released one did. A ttl too short for that (one
    // passed with the waiter's call) is refused as its poll refuses it: the key is released and
    // the waiter polls, to be told so, rather than handed a lease lost before its renewal.
    let want = Want {
        clock_skew: lease.clock_skew().max(shard.leases_skew()),
        ..next.want
    };
    if lease.refuse_companions()
        || shard.shared.epoch() > placed
        || shard.has_left()
        || want.too_short_for(want.clock_skew)
    {
        let released = release_through_shard(shard, lease, None).await;
        next.turn(turn, false);
        return released;
    }
    // The shard's pool stays open until the statement has answered and the waiter's lease is
    // the keeper's (a shard a reload left is closed once nothing is held there).
    let _settling = Settling::new(&shard);
    shard.remove(lease.id);
    let shared = &shard.shared;
    shared.stats.releases.fetch_add(1, Ordering::Relaxed);
    let (id, owner) = shared.next_owner();
    let req = GrantRequest {
        key: lease.key.stored().to_vec(),
        owner,
        ttl_ms: want.ttl_ms(),
        fence_floor: 0,
        reserve: want.handoff_max_count,
        trace: None,
    };
    let sent = Moment::now();
    let answer = shard.call_row(|b| b.handoff(&lease.owner, &req)).await;
    // The releasing lease's row is let go from here on, whatever the answer (handed on,
    // released, or to be released below): a try that may still take it again is watched for.
    lease.give_back_lost_try(&shard);
    match answer {
        // Handed over, but answered so late that the waiter's lease may already have ended on
        // the shard (as a try answered that late is, `ShardState::ran_out`): a guard of it
        // would be lost from the start. Given back under its owner; the waiter polls.
        Ok(HandoffOutcome::Granted(_)) if shard.ran_out(&want, sent) => {
            shard.give_back(req.key, req.owner, want.ttl);
            next.turn(turn, false);
            Ok(())
        }
        Ok(HandoffOutcome::Granted(fence)) => {
            shared.stats.grants.fetch_add(1, Ordering::Relaxed);
            shared.stats.handoffs.fetch_add(1, Ordering::Relaxed);
            let grant = Grant {
                id,
                owner: req.owner,
                fence,
                reserve: req.reserve,
                sent,
                lost_try: false,
            };
            let state = Arc::new(
                LeaseState::new(
                    lease.key.clone(),
                    grant,
                    want,
                    want.handoff_max_time,
                    Some(turn),
                )
                // A reload since the check above makes it follow its key at once.
                .placed_at(placed),
            );
            shard.insert(state.clone());
            next.grant(LockGuard::new(Hold::handed(
                state,
                shard.clone(),
                fence,
                &after,
            )));
            Ok(())
        }
        Ok(HandoffOutcome::Released) => {
            // Another process asked for the key: let it in before our next poll.
            next.turn(turn, true);
            Ok(())
        }
        Ok(HandoffOutcome::NotOurs) => {
            // The row was not live under our owner as the statement ran: revoked, or ended
            // under our owner (the statement came after its end: a slow link, a row lock on
            // the way). Released like any other, which does nothing to another owner's row and
            // answers as a release does, before the waiter may poll for the row.
            let released = release_through_shard(shard, lease, None).await;
            next.turn(turn, false);
            released
        }
        Err(e) => {
            next.turn(turn, false);
            let key = lease.key.stored().to_vec();
            if e.maybe_applied {
                // Unknown whether the hand-off happened: neither owner may keep the row.
                shard.give_back(key.clone(), req.owner.clone(), lease.ttl.max(want.ttl));
                shard.give_back(key, lease.owner.clone(), lease.row_may_last());
            } else {
                // Not sent, or refused (a lock wait behind another transaction's lock on the
                // row): the row is still the releasing owner's, extended or not.
                shard.release_later(key, lease.owner.clone(), lease.row_may_last());
            }
            Err(e.into_error(shard.name()))
        }
    }
}

/// The owner-checked release statement. Nothing is deleted, so the fence survives; the turn
/// passes to the next local waiter once the row is free.
pub(crate) async fn release_through_shard(
    shard: Arc<ShardState>,
    lease: Arc<LeaseState>,
    turn: Option<Turn>,
) -> Result<()> {
    // The pools stay open until the rows are released (a shard a reload left is closed once
    // nothing is held there): taken before the lease leaves its keeper.
    let _settling = Settling::new(&shard);
    shard.remove(lease.id);
    // Released once: a second release of the same lease (a shutdown's beside its guard's
    // drop) sends nothing. A lease the keeper found lost is still released here: its row may
    // be ours yet (a renewal that timed out after it committed).
    let again = lease.release_claimed.swap(true, Ordering::AcqRel);
    if !again {
        shard.shared.stats.releases.fetch_add(1, Ordering::Relaxed);
    }
    let companions = lease.end_companions();
    let _settling_there: Vec<_> = companions
        .iter()
        .map(|(other, _)| Settling::new(other))
        .collect();
    // Rows that must stay taken for a while after their grant (`lock_at_least`, a scheduled
    // run) stay so on every shard.
    let result = if again {
        Ok(ReleaseAnswer::Released)
    } else {
        shard
            .release_after(lease.key.stored(), &lease.owner, lease.at_least())
            .await
    };
    retry_if_failed(&shard, &lease, &result);
    lease.give_back_lost_try(&shard);
    // Read before the companions' releases, which may each take a statement timeout.
    let answered_at = Moment::now();
    // The key's rows on other shards (it moved); the turn passes on once all are free.
    for (other, row) in companions {
        other.remove(row.id);
        // Boxed: rare (a key a reload moved), and every release's future would be larger.
        let released = Box::pin(other.release_after(row.key.stored(), &row.owner, row.at_least()));
        let released = released.await;
        retry_if_failed(&other, &row, &released);
        row.give_back_lost_try(&other);
    }
    drop(turn);
    match result {
        // Freed by this release (or by its first try, whose reply was lost: the row shows its
        // tombstone); a lease the keeper already found lost stays lost.
        Ok(ReleaseAnswer::Released) if !lease.is_lost() => Ok(()),
        // Another owner holds the row after a release that may have freed it (a first try
        // whose reply was lost, a batch that freed rows it cannot tell apart). If the lease
        // cannot have ended on the shard by the time the row was read (its local end comes
        // before the shard's), that release freed the row for its new owner: released. (Or an operator had revoked the lease and someone took the key
        // since, which a free row after a lost reply cannot tell apart either.)
        Ok(ReleaseAnswer::TakenAfterLostReply)
            if !lease.is_lost() && answered_at < lease.deadline() =>
        {
            Ok(())
        }
        Ok(_) => Err(lost(&shard, &lease)),
        Err(e) => Err(e.into_error(shard.name())),
    }
}

/// Gives `lease`'s row back in the background when its release failed (the shard could not be
/// reached, or answered neither the statement nor its retry): the lease is no longer renewed,
/// but its row would stay taken until the shard's clock ends it, and every other process wait
/// that long for a key its holder let go. Retried until the shard answers, for as long as the
/// row can last. Not a row that must stay taken for a while after its grant (`at_least`): its
/// release only shortens it to that, which its own end does as well.
pub(crate) fn retry_if_failed(
    shard: &Arc<ShardState>,
    lease: &LeaseState,
    answer: &std::result::Result<ReleaseAnswer, shardlock_core::BackendError>,
) {
    if answer.is_ok() || lease.at_least().is_some() {
        return;
    }
    let (key, owner) = (lease.key.stored().to_vec(), lease.owner.clone());
    shard.release_later(key, owner, lease.row_may_last());
}

fn lost(shard: &ShardState, lease: &LeaseState) -> Error {
    lease.mark_lost("ended or taken over before it was released", &shard.shared);
    Error::LockLost {
        key_label: shard.shared.telemetry.key_label(&lease.key),
    }
}
