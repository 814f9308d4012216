//! One grant attempt: the statement that may take a key, run so that it always completes.
//!
//! An acquire's caller may give up at any moment (its wait ends, its future is dropped) while
//! the statement is on the wire. A grant that lands after that must not stay behind as a lease
//! nobody holds, and a statement whose reply was lost may have granted all the same. So the
//! statement runs in a task of its own, and whoever sees a winning answer last gives it back:
//! the task, or the caller's end ([`PendingAttempt`]) when it drops with an answer untaken.

use std::sync::Arc;
use std::time::Duration;

use shardlock_core::{BackendError, BackendErrorKind, Error, LockKey, Result};
use shardlock_mysql::{Attempt, GrantRequest};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::clock::Moment;
use crate::queue::Want;
use crate::router::LockRouter;
use crate::shard::{Grant, ShardState};

/// What one grant attempt came to.
#[derive(Debug)]
pub(super) enum Tried {
    /// The key is this process's on that shard.
    Granted(Grant),
    /// Not granted: someone has held the key for this long (ms, by the shard's clock; 0 when
    /// its row was locked by another transaction), or `None` when that is unknown (no answer
    /// in time, an answer too late to use, a failure the policy waits out).
    Busy(Option<u64>),
}

impl LockRouter {
    /// One acquire attempt of `key` on `shard` for `owner` and `want`, with a first fence above
    /// `floor`.
    pub(super) async fn try_grant(
        &self,
        shard: &Arc<ShardState>,
        key: &LockKey,
        owner: &str,
        want: Want,
        floor: u64,
        deadline: Instant,
    ) -> Result<Tried> {
        let id = self.inner.shared.next_id();
        let req = GrantRequest {
            key: key.stored().to_vec(),
            owner: owner.to_owned(),
            ttl_ms: want.ttl_ms(),
            fence_floor: floor,
            reserve: want.handoff_max_count,
            trace: crate::telemetry::current_traceparent(),
        };
        let sent = Moment::now();
        Ok(match attempt(shard, &req, deadline).await? {
            None => Tried::Busy(None),
            // Granted, but the answer came so late that the lease may already have ended on
            // the shard: no use to anyone. Given back; the key counts as busy.
            // (Watched for as long as it could last, if a try before it may still land and
            // take the row again.)
            Some(Attempt::Granted { after_lost_try, .. }) if shard.ran_out(&want, sent) => {
                match after_lost_try {
                    true => shard.watch_lost_try(req.key, req.owner, want.ttl, None),
                    false => shard.release_later(req.key, req.owner, want.ttl),
                }
                Tried::Busy(None)
            }
            Some(Attempt::Granted {
                fence,
                after_lost_try,
            }) => Tried::Granted(Grant {
                id,
                owner: req.owner,
                fence,
                reserve: req.reserve,
                sent,
                lost_try: after_lost_try,
            }),
            // (A try of it before, whose reply was lost, may still land: its lane gives it back.)
            Some(Attempt::Held { held_for_ms, .. }) => Tried::Busy(Some(held_for_ms)),
            // The row was locked by another transaction: busy, poll again soon.
            Some(Attempt::Locked) => Tried::Busy(Some(0)),
        })
    }
}

/// One acquire statement, run in its own task so that it always completes. If the caller
/// goes away meanwhile, whoever sees a winning result last releases it: the task (when the
/// caller was gone before the answer) or [`PendingAttempt`]'s drop (when the answer was
/// already sent but not yet taken).
///
/// The caller waits until `deadline` at most (or the statement timeout, for a deadline
/// already past: a single try), so no acquire outlives its wait. `None` when the answer
/// did not come by then within the slow-call threshold (the key is then treated as busy);
/// an attempt outstanding longer than that is a shard failing to answer: `Unavailable`.
async fn attempt(
    shard: &Arc<ShardState>,
    req: &GrantRequest,
    deadline: Instant,
) -> Result<Option<Attempt>> {
    // Sent by the shard's dispatcher in a task of its own, which also gives the grant back if
    // nobody is there to take it, or if its outcome is unknown (see `ShardState::attempt`).
    let rx = shard.attempt(req);
    let mut pending = PendingAttempt {
        rx,
        shard: shard.clone(),
        key: req.key.clone(),
        owner: req.owner.clone(),
        ttl: Duration::from_millis(req.ttl_ms.into()),
        taken: false,
    };
    let sent = Instant::now();
    let until = if deadline > sent {
        deadline
    } else {
        sent + shard.statement_timeout() + Duration::from_millis(50)
    };
    let Ok(result) = tokio::time::timeout_at(until, &mut pending.rx).await else {
        // `pending` drops here: a grant that still arrives is released.
        let slow = shard.slow_call();
        if sent.elapsed() < slow {
            return Ok(None);
        }
        return Err(BackendError::new(
            BackendErrorKind::Timeout,
            None,
            format!("no answer to an acquire within {slow:?} (breaker.slow-call)"),
        )
        .into_error(shard.name()));
    };
    pending.taken = true;
    let Ok(result) = result else {
        // The lane's runner ended with this statement on its way, unanswered (the router's
        // runtime shut down, or it panicked): it may have taken the row. Given back,
        // owner-checked, until the shard answers; the next poll, with another owner, starts
        // another runner.
        let ttl = Duration::from_millis(req.ttl_ms.into());
        shard.give_back(req.key.clone(), req.owner.clone(), ttl);
        return match shard.shared.is_closed() {
            true => Err(Error::Shutdown),
            false => Ok(None),
        };
    };
    match result {
        // The lane's last runner ended (its runtime shut down) before sending it: no answer
        // this poll; the next one queues it again, and starts a runner on this runtime.
        Err(e) if crate::shard::is_not_sent(&e) => Ok(None),
        // Deadlocks (and lock waits) are retried within the statement's time; one still there
        // after it: the key counts as busy, polled again within the caller's wait, never
        // surfaced. (A batch's try that may have written the row is given back by its lane.)
        Err(e) if e.kind.is_retryable() => Ok(None),
        result => result.map(Some).map_err(|e| e.into_error(shard.name())),
    }
}

/// The caller's end of an attempt in flight (see [`attempt`]).
struct PendingAttempt {
    rx: oneshot::Receiver<std::result::Result<Attempt, shardlock_core::BackendError>>,
    shard: Arc<ShardState>,
    key: Vec<u8>,
    owner: String,
    /// The ttl asked for: how long a grant left behind would block the key.
    ttl: Duration,
    taken: bool,
}

impl Drop for PendingAttempt {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        // After close() the task can no longer send; a grant sent before is ours to undo,
        // retried until the shard answers (nothing else can grant it to this owner again).
        self.rx.close();
        if let Ok(Ok(Attempt::Granted { after_lost_try, .. })) = self.rx.try_recv() {
            let (key, owner) = (
                std::mem::take(&mut self.key),
                std::mem::take(&mut self.owner),
            );
            // Watched for as long as it could last, if a try before may still land and take
            // it again.
            match after_lost_try {
                true => self.shard.watch_lost_try(key, owner, self.ttl, None),
                false => self.shard.release_later(key, owner, self.ttl),
            }
        }
    }
}
