//! The guard of a held lock.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use shardlock_core::{Error, Result};
use shardlock_mysql::HandoffOutcome;
use tokio::time::Instant;

use crate::keeper::{Grant, LeaseState, ShardState};
use crate::queue::Turn;

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
    pub(crate) lease: Arc<LeaseState>,
    pub(crate) shard: Arc<ShardState>,
    pub(crate) done: bool,
}

impl LockGuard {
    /// The fencing token of this grant: larger than that of every earlier grant of the key.
    pub fn fence(&self) -> u64 {
        self.lease.fence
    }

    /// The key, as given to `acquire`.
    pub fn key(&self) -> &str {
        self.lease.key.as_str()
    }

    /// The name of the shard that holds the lease.
    pub fn shard(&self) -> &str {
        self.shard.shard.name()
    }

    /// Where the lock is held.
    pub fn mode(&self) -> LockMode {
        LockMode::Remote
    }

    /// The owner written in the lease row: `<instance id>:<grant seq>`.
    pub fn owner(&self) -> &str {
        &self.lease.owner
    }

    /// False once the lease is known lost or its local deadline passed without renewal.
    pub fn is_held(&self) -> bool {
        !self.lease.is_lost() && Instant::now() < self.lease.deadline()
    }

    /// Completes when the lease is lost: renewal failed until the lease ended, or the key was
    /// taken over or force-released. Never completes for a lease that stays held.
    /// Cancel-safe.
    pub async fn lost(&self) {
        let mut rx = self.lease.subscribe_lost();
        let _ = rx.wait_for(|lost| *lost).await;
    }

    /// Re-enters the lock: returns another guard of the same lease (same fence). The lease is
    /// released when the last guard is released or dropped. Reentrancy is only ever explicit.
    pub fn reenter(&self) -> Result<LockGuard> {
        if self.lease.is_lost() {
            return Err(Error::LockLost {
                key: self.key().to_owned(),
            });
        }
        self.lease.holds.fetch_add(1, Ordering::AcqRel);
        Ok(LockGuard {
            lease: self.lease.clone(),
            shard: self.shard.clone(),
            done: false,
        })
    }

    /// How many guards share this lease.
    pub fn holds(&self) -> usize {
        self.lease.holds.load(Ordering::Acquire)
    }

    /// Releases the lock (owner-checked: only our own lease row is touched). With reentrant
    /// guards still alive, this only gives up this guard's hold.
    ///
    /// Returns [`Error::LockLost`] if the lease was no longer ours (someone else's lease is
    /// left intact), and a backend error if the shard could not be reached (the lease is no
    /// longer renewed then, so it ends by expiry).
    ///
    /// Cancellation: the release runs in its own task and completes even if this future is
    /// dropped.
    pub async fn release(mut self) -> Result<()> {
        self.done = true;
        if self.lease.holds.fetch_sub(1, Ordering::AcqRel) > 1 {
            return Ok(());
        }
        let task = tokio::spawn(release_lease(self.shard.clone(), self.lease.clone()));
        task.await.map_err(|_| Error::Shutdown)?
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        if self.done || self.lease.holds.fetch_sub(1, Ordering::AcqRel) > 1 {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(release_lease(self.shard.clone(), self.lease.clone()));
            }
            // No runtime to release on: stop renewing; the lease ends by expiry.
            Err(_) => drop(self.shard.remove(self.lease.id)),
        }
    }
}

/// Ends a lease: stops renewing it, then, if a task of this process waits for the key, hands
/// the lease to it in one statement (a new grant with a larger fence); otherwise marks the row
/// released (deleting nothing, so the fence survives) and lets the next local waiter poll.
pub(crate) async fn release_lease(shard: Arc<ShardState>, lease: Arc<LeaseState>) -> Result<()> {
    shard.remove(lease.id);
    let stats = &shard.shared.stats;
    stats.releases.fetch_add(1, Ordering::Relaxed);
    let turn = lease.turn.lock().unwrap().take();
    let lost = || {
        lease.mark_lost("already taken over when released", &shard.shared.stats);
        Error::LockLost {
            key: lease.key.as_str().to_owned(),
        }
    };
    // No hand-offs once the router shuts down: waiters then find it closed.
    let next = turn
        .as_ref()
        .filter(|_| !shard.shared.is_closed())
        .and_then(Turn::next_waiter);
    if let Some(next) = next {
        let turn = turn.expect("a waiter was found through the turn");
        let (id, owner) = shard.shared.next_owner();
        let sent = Instant::now();
        let outcome = shard
            .shard
            .handoff(lease.key.stored(), &lease.owner, &owner, next.want.ttl)
            .await;
        return match outcome {
            Ok(HandoffOutcome::Granted(fence)) => {
                stats.grants.fetch_add(1, Ordering::Relaxed);
                stats.handoffs.fetch_add(1, Ordering::Relaxed);
                let want = next.want;
                let grant = Grant {
                    id,
                    owner,
                    fence,
                    sent,
                };
                let state = LeaseState::new(lease.key.clone(), grant, want, turn);
                let state = Arc::new(state);
                shard.insert(state.clone());
                next.grant(LockGuard {
                    lease: state,
                    shard: shard.clone(),
                    done: false,
                });
                Ok(())
            }
            Ok(HandoffOutcome::Released) => {
                // Another process asked for the key: let it in before our next poll.
                next.turn(turn, true);
                Ok(())
            }
            Ok(HandoffOutcome::NotOurs) => {
                next.turn(turn, false);
                Err(lost())
            }
            Err(e) => {
                next.turn(turn, false);
                Err(e.into_error(shard.shard.name()))
            }
        };
    }
    let result = shard.shard.release(lease.key.stored(), &lease.owner).await;
    drop(turn);
    match result {
        Ok(true) => Ok(()),
        Ok(false) => Err(lost()),
        Err(e) => Err(e.into_error(shard.shard.name())),
    }
}
