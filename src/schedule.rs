//! Scheduled jobs run at most once per interval across the fleet.
//!
//! Intervals are cut by the shard's clock, the one clock every process of a fleet shares for a
//! key: interval `n` of `every` is `[n × every, (n + 1) × every)` since the Unix epoch. A run
//! holds the key's lease, and the row stays taken until its interval ends even if the run
//! finishes (or its process dies) sooner, so nobody else starts in the same interval.

use std::future::Future;
use std::time::Duration;

use shardlock_core::{Error, LockKey, Result};

use crate::{AcquireOptions, LockGuard, LockMode, LockRouter};

/// One run of a scheduled job: which interval it is and the lease it holds.
#[derive(Debug)]
pub struct ScheduledRun {
    interval: u64,
    guard: LockGuard,
}

impl ScheduledRun {
    /// The interval this run belongs to, in whole intervals since the Unix epoch: the shard's
    /// clock at the grant, as its fence carries it (see [`LockRouter::run_exclusive`]).
    /// Strictly rising from one run of the key to the next, even across clock steps.
    pub fn interval(&self) -> u64 {
        self.interval
    }

    /// The run's fence, for writes guarded by [`crate::fenced_exec`].
    pub fn fence(&self) -> u64 {
        self.guard.fence()
    }

    /// The lease the run holds; it ends when the run returns (the row stays taken until
    /// the interval ends). Race long work against [`LockGuard::lost`].
    pub fn guard(&self) -> &LockGuard {
        &self.guard
    }
}

impl LockRouter {
    /// Runs `f` if no instance has run the job `key` in the current interval of `every`, and
    /// returns its output; `Ok(None)` when another run of this interval holds or held it.
    /// Call it on every tick of your schedule (on every instance, more often than `every` if
    /// ticks may be late): each interval runs once across the fleet while one instance ticks.
    ///
    /// Intervals are cut by the key's shard's clock as the grant's fence carries it (a fence
    /// starts at that clock in µs and only rises), so neither a lagging or early local clock
    /// or scheduler nor a shard clock stepping back runs an interval twice
    /// ([`ScheduledRun::interval`]). The lease is renewed while `f` runs: nobody else runs
    /// while it holds, and a run that outlasts its interval leaves the next interval to
    /// whoever ticks after it ends. `f` is not stopped when the lease is lost (a pause past
    /// its ttl, a shard cut off): race long work against [`LockGuard::lost`] (on
    /// [`ScheduledRun::guard`]), or the next interval's run may start while it still runs. If the process dies mid-run, the key stays taken until the
    /// interval ends or the lease's ttl runs out, whichever is later. Options without
    /// keep-alive (`lock_at_most`) bound the lease instead: a run that outlasts both its
    /// interval and that bound may overlap the next interval's run (race it against
    /// [`LockGuard::lost`]).
    ///
    /// Refused: `every` outside 100 ms..1 day; an in-process lock (the `local` failure
    /// policy while the shard is down) does not count as a run anywhere but here, so it
    /// returns [`Error::Unavailable`] instead of running `f`.
    ///
    /// Cancellation: dropping the future ends the run (the row stays taken until the
    /// interval ends); before `f` started, nothing ran, and the interval counts as run all the
    /// same once its lease was granted (its row kept taken as a finished run's is).
    pub async fn run_exclusive<F, Fut, T>(
        &self,
        key: &str,
        every: Duration,
        opts: AcquireOptions,
        f: F,
    ) -> Result<Option<T>>
    where
        F: FnOnce(ScheduledRun) -> Fut,
        Fut: Future<Output = T>,
    {
        shardlock_core::config::check_ttl(every).map_err(|reason| Error::InvalidArgument {
            name: "every",
            reason: reason.replace("a lease must last", "an interval must last"),
        })?;
        let key = LockKey::new(key)?;
        // The row outlasts a release by up to a whole interval; the end is set once the
        // grant's time on the shard is known.
        let opts = opts.lock_at_least(every);
        let Some(guard) = self.acquire_inner(key, &opts, Some(Duration::ZERO)).await? else {
            return Ok(None);
        };
        if guard.mode() != LockMode::Remote {
            let shard = guard.shard().to_owned();
            guard.refuse_local();
            return Err(crate::semaphore::local_refused(shard));
        }
        let interval = match hold_to_interval_end(&guard, every).await {
            Ok(interval) => interval,
            Err(e) => {
                // Nothing ran: the rows are let go in full rather than kept to the interval's
                // end, so that the next tick (here or elsewhere) may run it. Its fence puts
                // that run in this interval, or in a later one if a hold landed (answered or
                // not) and raised the key's fence to the interval's end.
                let hold = guard.hold();
                for (shard, row) in std::iter::once((hold.shard.clone(), hold.lease.clone()))
                    .chain(hold.lease.companion_rows())
                {
                    row.clear_at_least();
                    shard.shared.released_kept(&row.owner, shard.serial);
                }
                let _ = guard.release().await;
                return Err(e);
            }
        };
        let run = ScheduledRun {
            interval,
            guard: guard.reenter()?,
        };
        let out = f(run).await;
        if let Err(e) = guard.release().await {
            tracing::warn!(error = %shardlock_core::Report(&e), interval, "shardlock scheduled run ended without its release");
        }
        Ok(Some(out))
    }
}

/// The run's interval comes from its fence, not from the shard's clock: a fence is at least
/// the clock of the shard that granted it in µs, rises across clock steps, moves and node
/// failovers, and every row of the run raises its key's fence to the end of the interval, so
/// the next run's fence, and interval, is larger even if a clock stepped back. Every row is
/// also kept taken until that end (by its own shard's clock, from its own grant), now and
/// after its release. Returns the interval.
async fn hold_to_interval_end(guard: &LockGuard, every: Duration) -> Result<u64> {
    let every_ms = every.as_millis() as u64;
    let interval = guard.fence() / 1000 / every_ms;
    let end_ms = (interval + 1) * every_ms;
    let hold = guard.hold();
    let mut rows = vec![(hold.shard.clone(), hold.lease.clone())];
    rows.extend(hold.lease.companion_rows());
    for (shard, row) in &rows {
        let (key, owner) = (row.key.stored(), row.owner.as_str());
        let granted_ms = shard
            .call(|b| b.granted_at_ms(key, owner))
            .await
            .map_err(|e| e.into_error(shard.name()))?;
        let Some(granted_ms) = granted_ms else {
            row.mark_lost("taken over before its run began", &shard.shared);
            return Err(guard.lost_error());
        };
        let after_grant = Duration::from_millis(end_ms.saturating_sub(granted_ms).max(1));
        row.set_at_least(after_grant, shard);
        let held = shard
            .call_row(|b| b.hold_until(key, owner, after_grant, end_ms * 1000))
            .await
            .map_err(|e| e.into_error(shard.name()))?;
        if !held {
            row.mark_lost("taken over before its run began", &shard.shared);
            return Err(guard.lost_error());
        }
    }
    Ok(interval)
}
