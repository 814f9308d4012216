//! Version compare-and-set locks on rows of `shardlock_cas`.

use std::sync::Arc;

use shardlock_core::{LockKey, Result};
use shardlock_mysql::CasGiveBack;
use tracing::Instrument;

use crate::shard::{CasFollow, ShardState};
use crate::topology::Topology;
use crate::LockRouter;

/// A take undone, or released: by its token, at any version.
const UNDONE: CasGiveBack = CasGiveBack::Undone(None);

/// A version compare-and-set lock held by [`LockRouter::cas_acquire`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "a CAS lock has no lease: dropped without `cas_release`, it stays held"]
pub struct CasGuard {
    /// The key.
    pub key: String,
    /// The owner written in the row.
    pub owner: String,
    /// The row's version after the acquire. It rises with every acquire and release on the
    /// key's shard, but a reload that moves the key may carry it over a lower one, or start it
    /// again on the new shard: not a fencing token (a lease's fence is one).
    pub version: u64,
    /// The take's token, unique per call, written in the row's `token` column with the owner
    /// (and carried with it when a reload moves the key): the release frees only the rows of
    /// this take, never a later take under the same owner name.
    pub token: String,
}

/// A take of [`LockRouter::cas_acquire`] on its way to its caller: released in the
/// background if the caller went away before it got it.
struct UnseenTake {
    guard: Option<CasGuard>,
    router: LockRouter,
}

impl Drop for UnseenTake {
    fn drop(&mut self) {
        let Some(guard) = self.guard.take() else {
            return;
        };
        let router = self.router.clone();
        let Some(runtime) = router.inner.shared.runtime() else {
            tracing::warn!(
                key = guard.key,
                token = guard.token,
                "shardlock could not release a CAS take whose caller went away: no runtime left"
            );
            return;
        };
        let release = async move {
            let Err(e) = router.cas_release(guard.clone()).await else {
                return;
            };
            tracing::warn!(error = %shardlock_core::Report(&e), "shardlock could not release a CAS take whose caller went away; given back by its token once the shard answers");
            // Retried until the key's shard answers, as a take of unknown outcome is.
            let Ok(lock_key) = LockKey::new(&guard.key) else {
                return;
            };
            let shard = router.inner.topology.load().locate(&lock_key).clone();
            let then = Some(router.follow_key(&lock_key, &shard));
            shard.give_back_cas(lock_key.stored().to_vec(), guard.token, UNDONE, then);
        };
        runtime.spawn(release.in_current_span());
    }
}

/// What one try of [`LockRouter::cas_acquire`] under one topology came to.
enum CasTry {
    /// Taken: the row's version now, and the take's token.
    Taken(u64, String),
    /// Someone else owns the key.
    Owned,
    /// A reload replaced the topology while the key was being taken: what was taken was
    /// given back; take it again.
    Replaced,
}

impl LockRouter {
    /// Takes `key` by compare-and-set: reads the row's version and, if nobody owns it, sets
    /// `owner` where the version is still the one read. `None` when someone else owns it (or
    /// won the race). Two statements; the row is created on first use. A retry after a lost
    /// reply learns that its first try won (a token per call is written with the owner); a
    /// key already held under the same owner name by another call is not given twice. A take
    /// whose outcome stays unknown (its retry failed too) is given back by that token in the
    /// background once the shard answers.
    ///
    /// While a reload's move is in progress, a key that moved is taken on the shards it lived
    /// on before as well (and given back there if it cannot be taken everywhere); once the
    /// move is over, rows still owned on the old shards are carried to the new one, so a lock
    /// taken before a reload stays taken, and releasable, after it.
    ///
    /// Cancellation: the take runs to its end in a task of its own, which releases what it
    /// took if the caller went away meanwhile (CAS rows never expire: a take that committed
    /// with nobody to release it would keep the key owned for good). Best effort: a runtime
    /// shutting down meanwhile may drop that task.
    ///
    /// `owner` takes at most 191 bytes ([`shardlock_core::Error::InvalidArgument`] otherwise).
    pub async fn cas_acquire(&self, key: &str, owner: &str) -> Result<Option<CasGuard>> {
        let lock_key = LockKey::new(key)?;
        super::check_fits("owner", owner.len(), owner.len(), super::MAX_NAME_BYTES)?;
        let lapses = self.joined(&lock_key)?;
        let Some(runtime) = self.inner.shared.runtime() else {
            return self.cas_acquire_here(&lock_key, key, owner, lapses).await;
        };
        let (router, key, owner) = (self.clone(), key.to_owned(), owner.to_owned());
        let take = async move {
            let taken = router
                .cas_acquire_here(&lock_key, &key, &owner, lapses)
                .await;
            // A caller gone before this ends drops its output, the take, which releases it.
            taken.map(|guard| {
                guard.map(|guard| UnseenTake {
                    guard: Some(guard),
                    router: router.clone(),
                })
            })
        };
        match runtime.spawn(take.in_current_span()).await {
            Ok(taken) => Ok(taken?.and_then(|mut take| take.guard.take())),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(shardlock_core::Error::Shutdown),
        }
    }

    /// [`LockRouter::cas_acquire`], in the caller's task.
    async fn cas_acquire_here(
        &self,
        lock_key: &LockKey,
        key: &str,
        owner: &str,
        lapses: u64,
    ) -> Result<Option<CasGuard>> {
        loop {
            match self.cas_take(lock_key, owner, lapses).await? {
                CasTry::Taken(version, token) => {
                    return Ok(Some(CasGuard {
                        key: key.to_owned(),
                        owner: owner.to_owned(),
                        version,
                        token,
                    }))
                }
                CasTry::Owned => return Ok(None),
                CasTry::Replaced => {}
            }
        }
    }

    /// [`LockRouter::cas_acquire`] under the topology in force.
    async fn cas_take(&self, lock_key: &LockKey, owner: &str, lapses: u64) -> Result<CasTry> {
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(lock_key).clone();
        // Each shard whose row this call took.
        let mut taken: Vec<Arc<ShardState>> = Vec::new();
        let mut version = Ok(None);
        let token = self.inner.shared.next_owner().1;
        for at in topology
            .previous_locations(lock_key)
            .into_iter()
            .chain([shard.clone()])
        {
            let took = at
                .call(|b| b.take_cas(lock_key.stored(), owner, &token))
                .await;
            // The take may have been made (its reply lost, its retry failed): undone by its
            // token once the shard answers, or the row would stay owned for good with no guard
            // to release it.
            if took.as_ref().is_err_and(|e| e.maybe_applied) {
                let then = Some(self.follow_key(lock_key, &shard));
                at.give_back_cas(lock_key.stored().to_vec(), token.clone(), UNDONE, then);
            }
            version = took.map_err(|e| e.into_error(at.name()));
            match version {
                Ok(Some(_)) => taken.push(at),
                _ => break,
            }
        }
        // Taken under a placement a reload replaced (see `placed_elsewhere_since`): a row
        // taken after the move's end carried the owned rows over is nobody's to carry.
        let replaced = !taken.is_empty() && self.placed_elsewhere_since(&topology, lock_key);
        let version = match version.and_then(|v| self.still_joined(lock_key, lapses).map(|()| v)) {
            Ok(Some(version)) if !replaced => Ok(version),
            // Someone owns it somewhere, or a shard failed, or the heartbeat lapsed meanwhile:
            // give back what was taken, by this call's token: a give-back applied late never
            // frees a later take under the same owner name (a row that cannot be given back
            // now stays owned until its owner releases it). On the key's shard too: a move's
            // carry may have brought a take there meanwhile, as a copy bearing the token.
            // Taken again under the new placement after a reload.
            failed => Err(failed),
        };
        match version {
            Ok(version) => {
                // Taken on a previous shard whose carry began: that row excludes nobody the
                // key's shard does not, and if it landed after the carry's scan passed the key
                // it would be left behind, owned for good, once the move ends. Given back by
                // this call's token (a carry that moved it meanwhile left nothing there),
                // oldest placement first: a carry from an older shard writes its copy on a
                // newer one while holding the older row, so the give-back there waits for it
                // and the one on the newer shard then finds the copy. Freed marked carried,
                // not undone: the lock lives on where the key lives now, so a carry of this
                // row whose outcome is unknown keeps its copies (this take's own row among
                // them: a copy that changed nothing there looks just like it).
                for at in topology.previous_shards_oldest_first(lock_key) {
                    let was_taken = taken.iter().any(|t| t.same_database(&at));
                    if was_taken && !at.same_database(&shard) && topology.carrying_at(lock_key, &at)
                    {
                        let passed = CasGiveBack::PassedOn;
                        let given = at
                            .run(|b| b.give_back_cas(lock_key.stored(), &token, passed))
                            .await;
                        if given.is_err() {
                            let key = lock_key.stored().to_vec();
                            at.give_back_cas(key, token.clone(), passed, None);
                        }
                    }
                }
                Ok(CasTry::Taken(version, token))
            }
            Err(failed) => {
                let mut given_back = Ok(false);
                if !taken.is_empty() && !taken.iter().any(|at| Arc::ptr_eq(at, &shard)) {
                    taken.push(shard.clone());
                }
                for at in taken {
                    let freed = at
                        .run(|b| b.give_back_cas(lock_key.stored(), &token, UNDONE))
                        .await;
                    if freed.is_err() {
                        // Left to the background, until the shard answers (and then where
                        // the key lives by then, where a carry may have brought it).
                        let then = Some(self.follow_key(lock_key, &shard));
                        at.give_back_cas(lock_key.stored().to_vec(), token.clone(), UNDONE, then);
                        given_back = freed;
                    }
                }
                // A shard's failure is the answer. Else a row left owned is: it would stay
                // owned with no guard to release it, and read as someone else's.
                failed?;
                given_back?;
                Ok(if replaced {
                    CasTry::Replaced
                } else {
                    CasTry::Owned
                })
            }
        }
    }

    /// Releases a CAS lock: only the rows its take made (or a move carried), named by the
    /// guard's token. `false` when there were none (someone force-changed the row, or the guard
    /// was released already), and also when a release whose reply was lost freed a row carried
    /// in with another shard's version, or when the key was taken again before its retry (the
    /// retry cannot tell its own release then: the row is no longer free at the version it
    /// left). While a
    /// reload's move is in progress, the take's rows on the key's previous shards are released
    /// too, and every shard twice (a carry running meanwhile may copy a row of the take onto a
    /// shard already released).
    ///
    /// A release never frees another take, whatever its owner name: a clone of a guard
    /// released already, released again after the key was taken anew under the same owner,
    /// answers `false` and leaves the new take whole on every shard (processes still running
    /// the old topology take the key on the old shard alone).
    ///
    /// With the `heartbeat` registry, a process not joined to its fleet during the call (its
    /// heartbeat lapsed, or the fleet runs another topology) that finds none of the take's
    /// rows answers [`crate::Error::Unavailable`] rather than `false`: the fleet may have
    /// ended a move without it and carried the lock to where its topology puts the key.
    /// Release again once this process has joined (reloaded onto the fleet's topology:
    /// [`LockRouter::wait_joined`]). A release that finds nothing after a reload placed the
    /// key elsewhere during it releases again under the new topology.
    ///
    /// Cancellation: rows freed before the drop stay free, a release in flight may have committed,
    /// and the others stay owned (CAS rows never expire): call again with a clone of the guard (a
    /// row already freed answers `false`, or `Unavailable` while this process is not joined).
    pub async fn cas_release(&self, guard: CasGuard) -> Result<bool> {
        let lock_key = LockKey::new(&guard.key)?;
        let (lapses, closed) = (self.lapses(), self.inner.gate.is_closed());
        loop {
            let topology = self.inner.topology.load_full();
            if self.release_under(&topology, &lock_key, &guard).await? {
                return Ok(true);
            }
            // Nothing of the take where this process placed the key. Reloaded meanwhile onto a
            // placement of the key it did not look at: the fleet may have carried it to where
            // the new topology puts the key. (A reload that placed the key as before sends no
            // release round again: a config-sync job reloading faster than it runs would keep
            // it going.)
            if !self.inner.topology.load().places_like(&topology, &lock_key) {
                continue;
            }
            // Not joined to its fleet, now or at any moment of this call (its heartbeat lapsed,
            // or the fleet runs another topology): the fleet may have ended a move without it
            // and carried the take to where the fleet's topology puts the key, which this
            // process does not know. `false` would leave that copy owned for good.
            self.inner.notice_lapse();
            let why = match self.inner.gate.why() {
                Some(why) => why,
                None if self.lapses() != lapses => {
                    "its heartbeat lapsed during this release (paused, or cut off from every \
                     shard)"
                        .to_owned()
                }
                None if closed => "it joined only during this release".to_owned(),
                None => return Ok(false),
            };
            let what = format!(
                "this CAS release of `{}` (token {}) found no row of its take where this \
                 process places the key, and this process was not joined to its fleet: {why}",
                self.inner.shared.telemetry.key_label(&lock_key),
                guard.token
            );
            let then = if self.inner.gate.is_replaced() {
                "it never joins again: free the row by its token where the fleet places the key"
            } else {
                "a move the fleet ended meanwhile may have carried the lock to where its \
                 topology puts the key; release again, with a clone of the guard, once this \
                 process has joined its fleet (reloaded onto the fleet's topology; see \
                 LockRouter::wait_joined)"
            };
            return Err(self.not_granting(&lock_key, format!("{what}. {then}")));
        }
    }

    /// Where a take of `key` given back in the background may have been carried: the key's
    /// shards under the topology in force each time it is asked (earlier placements still in
    /// force, then the current one) and that topology's epoch, so that a reload after the take
    /// is followed too. Asked once this process has joined its fleet: before that (its
    /// heartbeat lapsed, or it runs another topology than the fleet) the fleet may have
    /// carried the take where this process does not look. `shard`, the key's shard at the take, once the router is gone.
    fn follow_key(&self, key: &LockKey, shard: &Arc<ShardState>) -> CasFollow {
        let (inner, key, shard) = (Arc::downgrade(&self.inner), key.clone(), shard.clone());
        let gate = self.inner.gate.watch();
        Box::new(move || {
            let (inner, key, shard) = (inner.clone(), key.clone(), shard.clone());
            let mut gate = gate.clone();
            Box::pin(async move {
                if gate.wait_for(|closed| !closed).await.is_err() {
                    return (0, vec![shard]);
                }
                let Some(inner) = inner.upgrade() else {
                    return (0, vec![shard]);
                };
                let topology = inner.topology.load();
                let mut at = topology.previous_locations(&key);
                at.push(topology.locate(&key).clone());
                (topology.epoch, at)
            })
        })
    }

    /// One release of `guard`'s take under `topology`: whether a row of it was freed.
    async fn release_under(
        &self,
        topology: &Topology,
        lock_key: &LockKey,
        guard: &CasGuard,
    ) -> Result<bool> {
        let shard = topology.locate(lock_key).clone();
        let previous = topology.previous_locations(lock_key);
        // Every shard is tried; the first failure is reported after (release again to retry).
        let mut released = false;
        let mut failure = None;
        // While a move is in force, twice: a carry of another process (one whose topology puts
        // the key elsewhere, a reload undone or chained) may copy a row of this take onto a
        // shard released a moment before, while holding the row where it copies from. This
        // release waited for that row lock on the first pass, so the copy is there by the
        // second.
        let passes = if previous.is_empty() { 1 } else { 2 };
        for _ in 0..passes {
            for old in &previous {
                match old
                    .run(|b| b.give_back_cas(lock_key.stored(), &guard.token, UNDONE))
                    .await
                {
                    Ok(freed) => released |= freed,
                    Err(e) => drop(failure.get_or_insert(e)),
                }
            }
            match shard
                .run(|b| b.release_cas(lock_key.stored(), &guard.token, guard.version))
                .await
            {
                Ok(freed) => released |= freed,
                Err(e) => drop(failure.get_or_insert(e)),
            }
        }
        failure.map_or(Ok(released), Err)
    }
}
