//! What a router tells an operator: each shard's reachability, pool, breaker and lease counts,
//! a key's row, the hot keys, the counters, and the migrations. These calls go around the
//! breaker where they touch a shard ([`ShardState::unguarded`]): an operator looks exactly when
//! a shard is in trouble, and must see it as it is.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use shardlock_core::{BreakerState, LockKey, Result, Transition};
use shardlock_mysql::{LeaseRow, MigrateReport, PoolStatus};

use crate::router::LockRouter;
use crate::shard::ShardState;
use crate::stats::LockStats;

/// One shard as `status` sees it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ShardStatus {
    /// The shard's name.
    pub name: String,
    /// Whether it answered. Its answer may be an error of the server's (tables not migrated,
    /// a grant missing): then `error` says what.
    pub reachable: bool,
    /// Why not, if it did not.
    pub error: Option<String>,
    /// Live leases on the shard, all instances (when reachable).
    pub held_leases: Option<u64>,
    /// Leases this process holds there.
    pub local_leases: usize,
    /// The connection pool.
    pub pool: PoolStatus,
    /// False for a shard that left the topology in a reload and is kept only while moved
    /// keys may still have leases there (or until its pool is closed).
    pub current: bool,
    /// Whether its pool was closed (a shard that left, drained).
    pub closed: bool,
    /// This process's breaker for the shard.
    pub breaker: BreakerState,
    /// Keys this process holds in process (`local` policy) not yet re-acquired on the shard.
    pub local_fallback_leases: usize,
    /// Acquires and releases of this process waiting for the shard's next batch (see
    /// `LockStats::acquire_batches`): more than a few for long means the shard is the
    /// bottleneck.
    pub batch_waiting: usize,
    /// Acquire and release statements of this process's dispatcher out to the shard now (a
    /// lone request is a batch of one); at most twice `pool.batches-in-flight`, and up to
    /// twice that while many requests wait (see `PoolConfig::batches_in_flight`).
    pub batches_in_flight: usize,
}

impl LockRouter {
    /// Creates or upgrades shardlock's tables on every shard; idempotent and safe to run from
    /// several processes at once. Returns what each shard applied. A router made before its
    /// shards were migrated grants nothing until its heartbeat reaches them all (see
    /// `cleaner.registry` in the reference config); it heartbeats before this returns.
    ///
    /// Cancellation: steps already run stay (DDL commits on its own; a later call skips them). The
    /// connection goes back to the pool unmarked (reset, not discarded, at its next checkout) and
    /// may hold the migration lock (`GET_LOCK`) until then, stalling other `migrate` calls.
    pub async fn migrate(&self) -> Result<Vec<(String, MigrateReport)>> {
        (self.migrate_each().await.into_iter())
            .map(|(name, report)| Ok((name, report?)))
            .collect()
    }

    /// [`LockRouter::migrate`], each shard's outcome apart: a shard that failed says nothing
    /// of the others, which were migrated all the same (what an operator's report needs).
    ///
    /// Cancellation: as for [`LockRouter::migrate`].
    pub async fn migrate_each(&self) -> Vec<(String, Result<MigrateReport>)> {
        let topology = self.inner.topology.load_full();
        // Those of moves in force too: the registry is read there.
        let shards = topology.registry_shards();
        let runs = shards.iter().map(|s| async move {
            let report = s.unguarded().migrate().await;
            // Read again for the heartbeat's servers digest: the shard id it names may be new.
            if report.is_ok() {
                if let Ok(identity) = s.unguarded().identity().await {
                    s.saw_identity(identity);
                }
            }
            (
                s.name().to_owned(),
                report.map_err(|e| e.into_error(s.name())),
            )
        });
        let out = join_all(runs).await;
        // A router made before its shards were migrated could not heartbeat there, and
        // grants nothing until it has: it joins now rather than at its next retry. Every
        // router beats now too, with the servers digest read above: a heartbeat that raced
        // the migration (its digest taken before the shard ids were stored, its row written
        // after the tables were) would keep processes started after this call out until the
        // next heartbeat.
        // A router made before its shards were migrated could not read where its fleet last
        // placed keys either: it does now, before it joins.
        let _ = self.settle_placement().await;
        self.inner.beat_and_join(&mut Default::default()).await;
        out
    }

    /// The state of shard `name`'s breaker in this process (`None` for an unknown shard).
    pub fn breaker_state(&self, name: &str) -> Option<BreakerState> {
        self.shard_state(name).map(|s| s.breaker_state())
    }

    /// Makes the lease keeper of shard `name` panic at its next tick; `false` if there is no
    /// such shard. For tests of the keeper's supervision only (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_keeper_panic(&self, name: &str) -> bool {
        self.shard_state(name)
            .map(|s| s.inject_keeper_panic())
            .is_some()
    }

    /// Makes the next look of shard `name`'s reconcile at whose row a key's is (a row found
    /// held when a local lease is re-acquired) fail as a shard that did not answer; `false` if
    /// there is no such shard. For tests only (feature `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn inject_reconcile_look_failure(&self, name: &str) -> bool {
        self.shard_state(name)
            .map(|s| (s.fail_next_look).store(true, std::sync::atomic::Ordering::Release))
            .is_some()
    }

    /// Holds back the next hand-off through a shard in this process (a release statement that
    /// grants the key to a waiting task) before it runs, until the answer is sent or dropped:
    /// a test acts between a hold's end and its hand-off. For tests only (feature
    /// `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn hold_next_handoff() -> tokio::sync::oneshot::Sender<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        *crate::guard::HANDOFF_HELD.lock().unwrap() = Some(rx);
        tx
    }

    /// Counts `d` as time the host spent suspended, just now, for every router of this process:
    /// by the lease clock, `d` passes at once, while the runtime's clock (and the shards')
    /// does not move. For tests of how leases and heartbeats meet a suspend only (feature
    /// `fault-injection`).
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn pretend_host_suspended(d: Duration) {
        crate::clock::pretend_suspend(d);
    }

    /// The last transitions (up to 64) of shard `name`'s breaker in this process, oldest first.
    pub fn breaker_transitions(&self, name: &str) -> Vec<Transition> {
        self.shard_state(name)
            .map(|s| s.breaker_transitions())
            .unwrap_or_default()
    }

    /// The keys that made callers of this router wait longest over the hot-key window
    /// (`telemetry.hot-key-window`), most first, with their total wait. Keys appear as
    /// `telemetry.record-keys` says: themselves, or a stable hash.
    pub fn hot_keys(&self, n: usize) -> Vec<(String, Duration)> {
        self.inner.shared.telemetry.hot_keys(n)
    }

    fn shard_state(&self, name: &str) -> Option<Arc<ShardState>> {
        self.inner
            .topology
            .load()
            .all_shards()
            .into_iter()
            .find(|s| s.name() == name)
    }

    /// What its observable metrics read (see `crate::telemetry::register_observers`).
    pub(crate) fn observed(&self) -> crate::telemetry::RouterSnapshot {
        crate::telemetry::RouterSnapshot {
            instance_id: self.instance_id().to_owned(),
            stats: self.stats(),
            shards: self
                .shard_states()
                .iter()
                .map(|s| crate::telemetry::ShardSnapshot {
                    name: s.name().to_owned(),
                    breaker: s.breaker_state(),
                    pool: s.pool_status(),
                    batch_waiting: s.lanes_waiting(),
                    batches_in_flight: s.batches_in_flight_now(),
                })
                .collect(),
            hot_keys: self.inner.shared.telemetry.reported_hot_keys(),
        }
    }

    /// Where `key` lives and what its lease row says. `key` is the lock's whole name, as
    /// [`LockRouter::list`] shows it: no namespace's prefix is added
    /// ([`LockRouter::scoped_key`] names a namespace's lock, or a bucket).
    ///
    /// Cancellation: a read only; nothing changes. A connection dropped mid-statement is discarded
    /// at the pool's next checkout, never reused.
    pub async fn inspect(&self, key: &str) -> Result<(String, Option<LeaseRow>)> {
        self.inspect_key(&LockKey::new(key)?).await
    }

    /// [`LockRouter::inspect`] of a lock already named: see [`LockRouter::scoped_key`].
    ///
    /// Cancellation: as for [`LockRouter::inspect`].
    pub async fn inspect_key(&self, key: &LockKey) -> Result<(String, Option<LeaseRow>)> {
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(key);
        let row = shard
            .unguarded()
            .inspect(key.stored())
            .await
            .map_err(|e| e.into_error(shard.name()))?;
        Ok((shard.name().to_owned(), row))
    }

    /// Every shard's reachability, pool and lease counts: the current ones, then those that
    /// left in a reload and are still kept for moved keys.
    ///
    /// Cancellation: reads only; nothing changes. A connection dropped mid-statement is discarded
    /// at the pool's next checkout, never reused.
    pub async fn status(&self) -> Vec<ShardStatus> {
        let topology = self.inner.topology.load_full();
        let shards = topology.all_shards();
        let probes = shards.iter().map(|s| async {
            let current = topology.current.shards.iter().any(|c| Arc::ptr_eq(c, s));
            let closed = s.is_closed();
            let held = if closed {
                Err(shardlock_core::BackendError::new(
                    shardlock_core::BackendErrorKind::ServerGone,
                    None,
                    "the shard left the topology and its pool was closed",
                ))
            } else {
                s.unguarded().count_held().await
            };
            ShardStatus {
                current,
                closed,
                name: s.name().to_owned(),
                // The server answered, with an error of its own that no retry fixes (tables
                // not migrated, a grant missing): reachable, and the error says what is
                // wrong. Not one the library counts as an outage (too many connections, a
                // server going away, a node out of its cluster's primary component).
                reachable: held.as_ref().map_or_else(
                    |e| e.kind == shardlock_core::BackendErrorKind::Other && e.code.is_some(),
                    |_| true,
                ),
                error: held.as_ref().err().map(crate::registry::unmigrated_or),
                held_leases: held.ok(),
                local_leases: s.held().len(),
                pool: s.pool_status(),
                breaker: s.breaker_state(),
                local_fallback_leases: s.local_count(),
                batch_waiting: s.lanes_waiting(),
                batches_in_flight: s.batches_in_flight_now(),
            }
        });
        join_all(probes).await
    }

    /// This router's counters.
    pub fn stats(&self) -> LockStats {
        let queued = self.inner.queues.waiting() as u64;
        let shared = &self.inner.shared;
        let settling = shared
            .shard_states()
            .iter()
            .map(|s| s.settling_count())
            .sum();
        shared.stats.snapshot(queued, settling)
    }
}
