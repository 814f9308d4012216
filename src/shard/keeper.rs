//! The lease keeper: per shard, one background task renews every lease this process holds
//! there, one statement per tick for each `MAX_RENEW_BATCH` of them, reports leases that can
//! no longer be trusted, and re-acquires on the shard the keys held in process while it was
//! unavailable.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::clock::Moment;
use shardlock_core::{BackendError, BackendErrorKind, BreakerState};
use shardlock_mysql::{Attempt, GrantRequest, Renewal};
use tokio::sync::watch;

use super::ShardState;
use crate::shard::{LeaseState, NOT_RENEWED};
use crate::sync::LockExt;

/// How often the keeper tries to re-acquire on the shard the keys held locally.
const RECONCILE_EVERY: Duration = Duration::from_millis(50);

/// Reconcile passes in a row a local lease's key may be found held by a row whose holder
/// cannot be told (the look failed) before that counts as a conflict: the row may be another
/// process's, and the local holder must learn of it.
const UNDECIDED_LOOKS: u32 = 3;

impl ShardState {
    /// Re-acquires on the shard, under the same owner, the keys this process holds locally.
    /// A key another process holds there now is reported lost to its local holder (who keeps
    /// its turn, so no second holder appears in this process until it lets go).
    async fn reconcile(self: &Arc<Self>) {
        let locals: Vec<Arc<LeaseState>> = self.local.locked().values().cloned().collect();
        for lease in locals {
            // After shutdown, local leases are ended by it, not re-acquired. Nor while the
            // registry may count this process dead (its heartbeat lapsed, or another start
            // took its id over): the fleet may place the key elsewhere meanwhile, and the row
            // taken would be lost at once. Held in process until its heartbeat lands again.
            if self.breaker_state() == BreakerState::Open
                || self.shared.is_closed()
                || !self.shared.registry_live_at(Moment::now())
            {
                return;
            }
            // Released since the pass began: its key's turn may be another grant's by now.
            if !self.local.locked().contains_key(&lease.id) {
                continue;
            }
            // A lease without keep-alive takes its row for what is left of its end; one that
            // ended in process takes none.
            let Some(mut ttl) = lease.ttl_left() else {
                self.end_in_process(&lease);
                continue;
            };
            let request = |ttl: Duration| GrantRequest {
                key: lease.key.stored().to_vec(),
                owner: lease.owner.clone(),
                ttl_ms: u32::try_from(ttl.as_millis()).unwrap_or(u32::MAX),
                fence_floor: 0,
                reserve: 0,
                trace: None,
            };
            let mut req = request(ttl);
            lease.asking_row_for(ttl);
            let stats = &self.shared.stats;
            let mut sent = Moment::now();
            let mut attempt = self.acquire_alone(&req).await;
            // Whether a try whose reply was lost may still take the row, answered as held.
            let lost_try = |a: &Result<Attempt, _>| {
                matches!(
                    a,
                    Ok(Attempt::Held {
                        after_lost_try: true,
                        ..
                    })
                )
            };
            let mut may_land = lost_try(&attempt);
            let stale = match attempt {
                Ok(Attempt::Held { .. }) => self.give_back_stale_row(&req.key, lease.id).await,
                _ => Ok(false),
            };
            let worth_again = match stale {
                // Whose row it is could not be told: not a conflict, the key is tried again
                // next time (below, as a failed try that wrote nothing); but not for ever,
                // the row may be another holder's: a conflict after a few such passes.
                // (A look the breaker refused was not sent: it does not count.)
                Err(mut e)
                    if e.kind == BackendErrorKind::BreakerOpen
                        || lease.undecided_looks.fetch_add(1, Ordering::Relaxed)
                            < UNDECIDED_LOOKS =>
                {
                    e.maybe_applied = false;
                    attempt = Err(e);
                    false
                }
                Err(_) => false,
                Ok(again) => {
                    lease.undecided_looks.store(0, Ordering::Relaxed);
                    again
                }
            };
            if worth_again {
                let Some(left) = lease.ttl_left() else {
                    self.end_in_process(&lease);
                    // The lost try may still take the row: given back.
                    if may_land {
                        self.give_back(req.key, req.owner, lease.row_ttl());
                    }
                    continue;
                };
                (ttl, req) = (left, request(left));
                lease.asking_row_for(ttl);
                sent = Moment::now();
                attempt = self.acquire_alone(&req).await;
                may_land |= lost_try(&attempt);
            }
            match attempt {
                Ok(Attempt::Granted { after_lost_try, .. }) => {
                    // A try that may still take the row once it is free: this pass's, or one
                    // of an earlier pass whose reply was lost (its mark is cleared here, and
                    // the lease's release or the give-back below watches for it).
                    let lost_try = after_lost_try
                        || may_land
                        || lease.maybe_on_shard.swap(false, Ordering::SeqCst);
                    // Under the map's lock, so the holder either still finds it local or finds
                    // it moved to the renewed leases.
                    let moved = {
                        let mut local = self.local.locked();
                        // Shutdown takes the local leases under this lock: once it has, the
                        // row just taken is given back below instead.
                        let moved = !self.shared.is_closed() && local.remove(&lease.id).is_some();
                        // How much later the holder's `extend` moved its end while the
                        // statement was out (its row still ends at `ttl`).
                        let mut short = None;
                        if moved {
                            // Counted before the holder's `lost()` can see the new deadline.
                            stats.reconciled.fetch_add(1, Ordering::Relaxed);
                            lease.reconciled.store(true, Ordering::Release);
                            if lost_try {
                                lease.lost_try_may_land();
                            }
                            short = lease.set_deadline_from(sent, ttl);
                            self.insert(lease.clone());
                        }
                        moved.then_some(short)
                    };
                    if let Some(short) = moved {
                        tracing::info!(
                            shard = self.name(),
                            key = self.shared.telemetry.key_label(&lease.key),
                            "shardlock re-acquired a locally held key on its shard"
                        );
                        if let Some(short) = short {
                            self.extend_reconciled(&lease, sent + ttl + short).await;
                        }
                    } else if lost_try {
                        // Released meanwhile, and a try may take the row again.
                        self.watch_lost_try(req.key, req.owner, lease.row_ttl(), None);
                    } else {
                        // Released meanwhile: give the row back (until the shard answers).
                        self.give_back(req.key, req.owner, lease.row_ttl());
                    }
                }
                Ok(Attempt::Held { .. }) => {
                    if self.remove_local(lease.id) {
                        stats.reconcile_conflicts.fetch_add(1, Ordering::Relaxed);
                        lease.mark_lost(
                            "another process held the key on its shard when the shard came back",
                            &self.shared,
                        );
                    }
                    // A try may still take the row once it is free (this pass's, or one of an
                    // earlier pass whose reply was lost): given back.
                    let may_land = may_land || lease.maybe_on_shard.swap(false, Ordering::SeqCst);
                    if may_land {
                        self.give_back(req.key, req.owner, lease.row_ttl());
                    }
                }
                // Still failing, or the row locked by another transaction: this key next
                // time; the others are tried meanwhile (one locked row must not keep a key
                // another process took from being reported lost), until the breaker opens.
                // A write whose reply was lost may have taken the row (also one answered
                // `Locked`: its retry after the lost reply waited out the lock): a release
                // while the lease is still local gives it back (see `guard::end_hold`).
                outcome => {
                    let maybe_applied = may_land
                        || match &outcome {
                            Err(e) => e.maybe_applied,
                            _ => true,
                        };
                    if maybe_applied {
                        lease.maybe_on_shard.store(true, Ordering::SeqCst);
                        // Released while the call was out: its release did not see the mark.
                        // Whoever clears the mark gives the row back, once.
                        let released = !self.local.locked().contains_key(&lease.id);
                        if released && lease.maybe_on_shard.swap(false, Ordering::SeqCst) {
                            self.give_back(req.key, req.owner, lease.row_ttl());
                        }
                    }
                }
            }
        }
    }

    /// Ends a local lease without keep-alive whose end passed before its shard came back: it
    /// is reported lost and no longer counted as held here (its release then finds no row, as
    /// after a conflict). A re-acquire whose reply was lost may have taken its row: given back.
    fn end_in_process(self: &Arc<Self>, lease: &LeaseState) {
        if !self.remove_local(lease.id) {
            return;
        }
        lease.mark_lost(NOT_RENEWED, &self.shared);
        if lease.maybe_on_shard.swap(false, Ordering::SeqCst) {
            let key = lease.key.stored().to_vec();
            self.give_back(key, lease.owner.clone(), lease.row_ttl());
        }
    }

    /// Extends the row of `lease`, just re-acquired on the shard, to `to`: the end its holder's
    /// `extend` promised while the re-acquire was out. If the shard does not answer, the lease
    /// ends where its row does (earlier than promised, never later than its row).
    async fn extend_reconciled(&self, lease: &LeaseState, to: Moment) {
        // Lost meanwhile: its row is not to be kept longer.
        if lease.is_lost() {
            return;
        }
        let sent = Moment::now();
        let by = to - sent;
        let key = lease.key.stored();
        match self.call_row(|b| b.extend(key, &lease.owner, by)).await {
            Ok(true) => lease.extend_from(sent, by),
            // Released meanwhile, or not ours any more.
            Ok(false) if lease.has_ended() => {}
            Ok(false) => {
                lease.mark_lost("ended or taken over before it was extended", &self.shared)
            }
            Err(e) => tracing::warn!(
                shard = self.name(),
                key = self.shared.telemetry.key_label(&lease.key),
                error = %e,
                "shardlock could not extend a lease re-acquired on its shard: it ends at its row's end, before the end its holder asked for"
            ),
        }
    }

    /// Gives back the row of `key` if this router wrote it for a grant older than the local
    /// lease `local_id` under an owner no lease of it holds any more: a lease lost while the
    /// shard was unreachable leaves its row until the shard's clock ends it, and reconciling
    /// the key's local holder must not count that as another process's. (A grant of the key
    /// made since the local lease, whose row may be written before its lease is registered,
    /// has a higher number and is never touched.) `true` when the acquire is worth trying
    /// again: such a row was released, or the row is free by now (the lost lease's own
    /// give-back, retried in the background, freed it first); `false` when the row is another
    /// holder's; an error when that could not be told (the look or the release failed).
    async fn give_back_stale_row(
        self: &Arc<Self>,
        key: &[u8],
        local_id: u64,
    ) -> Result<bool, BackendError> {
        #[cfg(feature = "fault-injection")]
        if self.fail_next_look.swap(false, Ordering::AcqRel) {
            return Err(BackendError::timeout("injected: the look was not answered"));
        }
        let row = self.call(|b| b.inspect(key)).await?;
        let Some(row) = row.filter(|r| r.owner.is_some() && r.expires_in_ms > 0) else {
            return Ok(true);
        };
        // A release that keeps the key taken until a minimum hold ends (`lock_at_least`, a
        // schedule's interval) leaves its row with a zero ttl: taken on purpose, not stale.
        // One whose release failed keeps its ttl, and this router remembers its owner as kept
        // until the hold ends (`Shared::keep_taken`): a lost lease's row looks the same.
        if row.ttl_ms == 0 {
            return Ok(false);
        }
        let owner = row.owner.expect("filtered above");
        if !(self.shared).is_stale_own(&owner, local_id, self.leases_skew()) {
            return Ok(false);
        }
        tracing::info!(
            shard = self.name(),
            owner,
            "shardlock gave back a row of a lease it had lost"
        );
        // Whatever it answers but a failure, the row is not that lease's any more.
        self.release(key, &owner).await.map(|_| true)
    }

    /// Makes the keeper panic at once (tests of its supervision).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn inject_keeper_panic(&self) {
        self.panic_next_tick.store(true, Ordering::Release);
        self.wake.notify_one();
    }

    /// When the keeper must act next: the renewal tick, or the earliest local deadline (a
    /// lease whose renewals keep failing is reported lost exactly then, not later).
    fn plan(&self, next_tick: &mut Option<Moment>) -> Option<Moment> {
        let now = Moment::now();
        let reconcile = (self.local_count() > 0).then(|| now + RECONCILE_EVERY);
        let leases = self.leases.locked();
        let earliest = leases.values().map(|l| l.deadline()).min();
        // Leases without keep-alive are not renewed, only reported lost at their end.
        let period = leases
            .values()
            .filter(|l| l.want.keep_alive)
            .map(|l| l.renew_every)
            .min();
        let tick = period.map(|period| {
            let tick = match *next_tick {
                Some(t) if t <= now + period => t,
                _ => now + period,
            };
            // A lease granted late in its ttl is renewed at once (see
            // `LeaseState::ends_before_renewed`).
            let tick = match leases.values().any(|l| l.ends_before_renewed(tick)) {
                true => now,
                false => tick,
            };
            *next_tick = Some(tick);
            tick
        });
        [reconcile, tick, earliest].into_iter().flatten().min()
    }

    /// Sends the renewal statements of `chunks` (see [`renewal_chunks`]) one after another,
    /// each bounded by its soonest end and at most `full`. Stops at a failure, but not at a
    /// chunk cut short by its own leases' end: the chunks after it end later.
    async fn renew_chunks(
        &self,
        chunks: Vec<(Moment, Vec<&Arc<LeaseState>>, bool)>,
        full: Duration,
    ) -> Renewed {
        let mut statements = 0;
        let mut failed = None;
        let mut cut_short = false;
        // Leases whose rows another transaction holds locked: tried again, apart, soon (alone,
        // until the next full tick).
        let mut blocked: u64 = 0;
        for (earliest, chunk, apart) in chunks {
            // Bounded by the soonest local deadline of the chunk (deadlines only move later
            // meanwhile): a renewal that answers after a lease ended is worthless. Past it, the
            // next tick reports that end at once (and the chunks after it, ending later, are
            // still sent now).
            let sent = Moment::now();
            if earliest <= sent {
                cut_short = true;
                continue;
            }
            let timeout = full.min(earliest - sent);
            let pairs: Vec<(&[u8], &str)> = chunk
                .iter()
                .map(|l| (l.key.stored(), l.owner.as_str()))
                .collect();
            // A renewal may wait behind another transaction's row lock, which then ends, or
            // find rows locked: its duration says nothing of the shard's health (an error
            // still counts, and a timeout when it had the whole statement timeout). Acquires
            // and heartbeats tell a slow shard.
            let renewal =
                self.call_waiting_cut(timeout < full, |b| b.renew(&pairs, timeout, apart));
            match renewal.await {
                Ok(outcome) => {
                    statements += u64::from(outcome.statements);
                    for (lease, renewal) in chunk.iter().zip(outcome.held) {
                        match renewal {
                            // A lease reported lost meanwhile stays so: it is dropped above.
                            Renewal::Extended => {
                                lease.renew_apart.store(false, Ordering::Release);
                                lease.extend_from(sent, lease.ttl);
                            }
                            Renewal::Blocked => {
                                lease.renew_apart.store(true, Ordering::Release);
                                blocked += 1;
                            }
                            // Still registered, so not released meanwhile: someone else has it.
                            Renewal::Gone if self.remove(lease.id).is_some() => lease.mark_lost(
                                "taken over, force-released or expired on the shard",
                                &self.shared,
                            ),
                            Renewal::Gone => {}
                        }
                    }
                }
                Err(e) => {
                    // A timeout takes the other path at the next try. Plain: the time left
                    // before the chunk's soonest end may have been shorter than the server's
                    // lock wait, so a row another transaction locks was not told apart from a
                    // slow shard; apart, the rows free of locks are renewed without waiting.
                    // Apart: two or three statements may not fit in the time a slow link
                    // leaves; plain, one does (and meets the lock again if it is still there).
                    let timed_out = e.kind == BackendErrorKind::Timeout;
                    if timed_out {
                        for lease in &chunk {
                            lease.renew_apart.store(!apart, Ordering::Release);
                        }
                    }
                    failed = Some(e);
                    // Cut short by its own leases' end, not the shard's fault: the chunks
                    // after it, ending later, get the time they leave.
                    if timed_out && timeout < full {
                        continue;
                    }
                    break;
                }
            }
        }
        Renewed {
            statements,
            failed,
            cut_short,
            blocked,
        }
    }

    /// Re-acquires local leases if there are any, reports expired leases, and renews the rest
    /// if the tick is due. A tick less than a period (the shortest renewal interval in force)
    /// after the last full one, `last_full` (a retry of leases whose rows another transaction
    /// held locked, see `LeaseState::renew_apart`), renews those alone: the others were
    /// renewed then, and are due again a period after it.
    async fn tick(
        self: &Arc<Self>,
        next_tick: &mut Option<Moment>,
        last_full: &mut Option<Moment>,
    ) {
        #[cfg(feature = "fault-injection")]
        if self.panic_next_tick.swap(false, Ordering::AcqRel) {
            panic!(
                "shardlock fault injection: the keeper of {} panics",
                self.name()
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
        let now = Moment::now();
        let mut leases = self.held();
        leases.retain(|l| {
            // Or already reported lost (by its holder's `lost()` at its deadline, just before
            // a renewal's late answer extended it), or a companion row of a lease that was:
            // nobody is told it is held any more.
            if l.deadline() <= now || l.is_lost() || l.parent_is_lost() {
                self.remove(l.id);
                l.mark_lost(NOT_RENEWED, &self.shared);
                false
            } else {
                true
            }
        });
        // Leases without keep-alive end at their deadline (above) unless extended. A renewal
        // is not cut short for them: their holders' `lost()` watches their deadlines, and a
        // bound from a lease about to end would time out every renewal on a slow link.
        leases.retain(|l| l.want.keep_alive);
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
        let started = Moment::now();
        // Less than a period after the last full tick (one that went through: a full tick that
        // failed or was cut short is not one): only the leases renewed apart are due. (Against
        // the shortest period in force now: a lease registered since with a shorter one makes
        // the next tick full sooner.)
        let full_due = last_full.map(|t| t + period);
        let early = full_due.is_some_and(|due| started < due);
        // One statement per chunk, each with its own statement timeout: on a slow shard a
        // tick of many chunks may take longer than one statement may, and each chunk that
        // answered extends its leases whatever the later ones do. The chunk whose lease ends
        // soonest goes first, so a tick cut short (or tried again) serves the soonest ends
        // first. (Chunks are not cut in deadline order: leases granted together would then
        // meet, chunk after chunk, the releases of the same keys sent together, row lock
        // against row lock.)
        // Leases renewed apart (see `LeaseState::renew_apart`) go last, in statements of their
        // own: the soonest end among them, coming on while a lock stays, would cut short the
        // timeout of every lease renewed with them.
        // Leases about to end are renewed in statements of their own, sent beside the others'
        // rather than before them (see `about_to_end`). A tick before the next full one (the
        // others renewed by the last) renews those renewed apart and every lease ending within
        // half a statement timeout, split or not: one whose renewal failed at the last tick
        // (a half-open breaker's refusal, a broken connection) would end before the next; and
        // so every lease that would end before the next full tick (only those whose renewal
        // failed, and those granted late in their ttl, do), and the leases `plan` brought it
        // forward for.
        let full = self.statement_timeout();
        let soon = about_to_end(&leases, started, full);
        let (apart, mut leases): (Vec<_>, Vec<_>) = leases
            .into_iter()
            .partition(|l| l.renew_apart.load(Ordering::Acquire));
        if early {
            // (`started + period` is no earlier than the tick `plan` weighed them against, so
            // each lease it brought the tick forward for is sent now, and not weighed again.)
            let next_full = full_due.unwrap_or(started);
            leases.retain(|l| {
                let end = l.deadline();
                end < started + full / 2
                    || end < next_full
                    || l.ends_before_renewed(started + period)
            });
        }
        for lease in leases.iter().chain(&apart) {
            lease.renewal_sent();
        }
        let ending = |l: &&Arc<LeaseState>| soon.is_some_and(|soon| l.deadline() < soon);
        let (leases_ending, leases_later): (Vec<_>, Vec<_>) = leases.iter().partition(ending);
        let (apart_ending, apart_later): (Vec<_>, Vec<_>) = apart.iter().partition(ending);
        let [soon, later] =
            [(leases_ending, apart_ending), (leases_later, apart_later)].map(|(plain, apart)| {
                let mut chunks = renewal_chunks(&plain, false);
                chunks.extend(renewal_chunks(&apart, true));
                chunks
            });
        // The others first: they take the warm connection and a half-open breaker's probe,
        // which statements about to time out would only waste.
        let (later, soon) = tokio::join!(
            self.renew_chunks(later, full),
            self.renew_chunks(soon, full)
        );
        // Full when the leases not about to end were all renewed: those about to end that
        // failed are tried again soon, alone.
        let renewed_full = !early && later.failed.is_none() && !later.cut_short;
        let Renewed {
            statements,
            failed,
            cut_short,
            blocked,
        } = later.and(soon);
        // Counted when done, together with the statements, so a snapshot never sees a tick
        // whose statement is still on its way; a tick cut short before its first chunk sent
        // nothing and is not one.
        let stats = &self.shared.stats;
        if statements > 0 || failed.is_some() {
            stats.renew_ticks.fetch_add(1, Ordering::Relaxed);
            stats.renew_micros.fetch_add(
                u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
        stats
            .renew_statements
            .fetch_add(statements, Ordering::Relaxed);
        stats.renewals_blocked.fetch_add(blocked, Ordering::Relaxed);
        if blocked > 0 {
            tracing::warn!(
                shard = self.name(),
                leases = blocked,
                "shardlock could not renew leases whose rows another transaction holds locked \
                 (a console session, a batch job); retrying, and they are lost at their end if \
                 the lock outlasts it"
            );
        }
        let full_due = match renewed_full {
            true => {
                *last_full = Some(started);
                Some(started + period)
            }
            false => full_due,
        };
        // Soon, and no later than the next full tick if that is still to come.
        let retry = || {
            let now = Moment::now();
            let soon = now + (period / 4).max(Duration::from_millis(20));
            Some(match full_due {
                Some(due) if due > now => soon.min(due),
                _ => soon,
            })
        };
        match failed {
            None if cut_short => *next_tick = Some(Moment::now()),
            // As after a failure: one retry before a blocked lease's end is too few for a lock
            // that ends in its last third.
            None if blocked > 0 => *next_tick = retry(),
            None if early => *next_tick = full_due,
            None => {
                *next_tick = Some(started + period);
                tracing::trace!(
                    shard = self.name(),
                    leases = leases.len(),
                    "shardlock renewed leases"
                );
            }
            Some(e) => {
                stats.renew_failures.fetch_add(1, Ordering::Relaxed);
                if e.kind == BackendErrorKind::BreakerOpen {
                    tracing::debug!(
                        shard = self.name(),
                        leases = leases.len(),
                        "shardlock renewal skipped: the shard's breaker is open"
                    );
                } else {
                    tracing::warn!(shard = self.name(), error = %shardlock_core::Report(&e), leases = leases.len(), "shardlock renewal failed; retrying");
                }
                // Retry soon; leases are reported lost only when their deadline passes.
                *next_tick = retry();
            }
        }
    }
}

/// The end before which leases are about to end at a tick starting `now`, if some are: those
/// ending within half a statement timeout (`full`) when that is less than half the time left
/// to the soonest end of the others. A statement is bounded by its soonest end, and on a link
/// slower than that (leases granted late, short ttls) it times out, its connection is given up
/// and its session ended; the renewal of every other lease, bounded by the same end or sent
/// after it, timed out too, tick after tick while such leases kept coming, until each was
/// lost. Leases whose ends are about as near share their statements (one namespace's, granted
/// in the same period), and so do all when none ends within half a statement timeout.
fn about_to_end(leases: &[Arc<LeaseState>], now: Moment, full: Duration) -> Option<Moment> {
    let near = now + full / 2;
    let soonest = leases.iter().map(|l| l.deadline()).min()?;
    let others = leases
        .iter()
        .map(|l| l.deadline())
        .filter(|end| *end >= near)
        .min()?;
    (soonest.saturating_duration_since(now) < others.saturating_duration_since(now) / 2)
        .then_some(near)
}

/// The statements of a stream of a tick: `leases` in chunks (see [`shardlock_mysql::renew_chunks`]),
/// each with the soonest local end among its leases (which bounds its statement), soonest first.
fn renewal_chunks<'a>(
    leases: &[&'a Arc<LeaseState>],
    apart: bool,
) -> Vec<(Moment, Vec<&'a Arc<LeaseState>>, bool)> {
    let bytes = |l: &&Arc<LeaseState>| l.key.stored().len() + l.owner.len();
    let mut chunks: Vec<_> = shardlock_mysql::renew_chunks(leases, bytes)
        .into_iter()
        .map(|chunk| {
            let end = chunk.iter().map(|l| l.deadline()).min();
            (end.expect("chunks are not empty"), chunk.to_vec(), apart)
        })
        .collect();
    chunks.sort_by_key(|(end, _, _)| *end);
    chunks
}

/// What a tick's renewal statements did (see [`ShardState::renew_chunks`]).
struct Renewed {
    statements: u64,
    /// The failure that stopped them, if one did.
    failed: Option<BackendError>,
    /// Whether a chunk's soonest end came before it could be sent.
    cut_short: bool,
    /// Leases whose rows another transaction held locked.
    blocked: u64,
}

impl Renewed {
    /// Both streams of a tick together (the failure of the first, if both failed).
    fn and(self, other: Renewed) -> Renewed {
        Renewed {
            statements: self.statements + other.statements,
            failed: self.failed.or(other.failed),
            cut_short: self.cut_short || other.cut_short,
            blocked: self.blocked + other.blocked,
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
                    tracing::error!(shard = state.name(), "shardlock lease keeper panicked; its leases are reported lost and a new keeper starts");
                    for lease in state.held() {
                        state.remove(lease.id);
                        lease.mark_lost("the lease keeper of its shard failed", &state.shared);
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
        let (mut next_tick, mut last_full) = (None, None);
        loop {
            let wake_at = match weak.upgrade() {
                Some(state) => state.plan(&mut next_tick),
                None => return,
            };
            // Looked at again within `SUSPEND_NOTICED_WITHIN`: the leases that ended while the
            // host was suspended are reported lost soon after it wakes.
            let sleep = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at.checked_timer()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = closed.wait_for(|c| *c) => return,
                _ = wake.notified() => continue,
                _ = sleep => {}
            }
            match weak.upgrade() {
                Some(state) => state.tick(&mut next_tick, &mut last_full).await,
                None => return,
            }
        }
    }
}
