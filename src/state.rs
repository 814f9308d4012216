//! What a router is made of, below the code that uses it: the shards' shared context, the
//! topology in force, the cleaner's and the registry's state, the transaction locks that
//! follow moved keys, and the gate that holds grants back until the fleet agrees.
//!
//! [`crate::LockRouter`] is a handle on an [`Inner`]; the modules that act for the router
//! (acquire, moves, the registry, patterns) take the parts of it they need from here, so none of
//! them has to reach up into `router.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use shardlock_core::Config;
use tokio::time::Instant;

use crate::queue::KeyQueues;
use crate::registry::{self, InstanceRegistry};
use crate::shard::Shared;
use crate::sync::LockExt;
use crate::topology::Topology;

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
    /// One queue per key busy in this process: waiters in memory, one poller per key.
    pub(crate) queues: Arc<KeyQueues>,
    pub(crate) topology: ArcSwap<Topology>,
    /// One reload at a time.
    pub(crate) reloading: tokio::sync::Mutex<()>,
    /// The cleaner's election lock and pass count, and a registry set in code.
    pub(crate) cleaner: CleanerState,
    /// Transaction locks held in this process, for reloads to make them follow moved keys.
    pub(crate) tx_locks: std::sync::Mutex<Vec<Weak<dyn FollowsKey>>>,
    /// Closed while this router waits to join its fleet (see [`Gate`]).
    pub(crate) gate: Gate,
    /// Set once the heartbeat registered this router on its shards.
    pub(crate) registered: std::sync::atomic::AtomicBool,
    /// Wakes the heartbeat before its interval: a reload or a move's end changes what this
    /// router advertises (topology, moving), which routers starting meanwhile rely on.
    pub(crate) beat_now: Arc<tokio::sync::Notify>,
    /// The heartbeat task, which shutdown waits for before deregistering: a heartbeat still on
    /// its way would register the instance again, live, after it is gone.
    pub(crate) heartbeat: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// This router's instance id, claimed in this process until it is dropped or shut down.
    pub(crate) id_claim: std::sync::Mutex<Option<registry::IdClaim>>,
}

/// Whether a router may grant yet. A router that starts while another live instance in the
/// registry runs another topology, or still has a reload's move in force, grants nothing until
/// that is over: it knows only its own placement, not the one the others still use, so a key
/// it places elsewhere could be held there already. Checked at start, and again with each
/// heartbeat until the fleet agrees; once open it stays open (reloads from then on are the
/// move protocol's business).
#[derive(Debug)]
pub(crate) struct Gate {
    closed: tokio::sync::watch::Sender<bool>,
    why: std::sync::Mutex<String>,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            closed: tokio::sync::watch::channel(false).0,
            why: std::sync::Mutex::default(),
        }
    }
}

impl Gate {
    pub(crate) fn close(&self, why: String) {
        *self.why.locked() = why;
        self.closed.send_replace(true);
    }

    pub(crate) fn open(&self) {
        self.closed.send_replace(false);
    }

    pub(crate) fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    pub(crate) fn why(&self) -> Option<String> {
        self.is_closed().then(|| self.why.locked().clone())
    }

    /// Completes when the gate is open.
    pub(crate) async fn opened(&self) {
        let _ = self.closed.subscribe().wait_for(|closed| !closed).await;
    }
}

impl Drop for Inner {
    /// A router dropped without `shutdown()` deregisters too (best effort, if a runtime is
    /// still there): else it would count as live in the registry until its heartbeat times
    /// out, keeping routers that start with another topology waiting (see [`Gate`]).
    fn drop(&mut self) {
        // A guard can outlive its router, its lease still renewed: the instance is live
        // until that ends (its heartbeat then times out).
        let holding = self
            .shared
            .shard_states()
            .iter()
            .any(|s| !s.held().is_empty());
        if !self.registered.load(Ordering::Acquire) || self.shared.is_closed() || holding {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let shards = self.topology.load().current.shards.clone();
        let id = self.shared.instance_id.clone();
        // The id stays this router's until it is deregistered: a router of this process that
        // took it sooner would be marked deregistered by this one.
        let claim = self.id_claim.locked().take();
        runtime.spawn(async move {
            join_all(shards.iter().map(|s| s.unguarded().deregister(&id))).await;
            drop(claim);
        });
    }
}

impl Inner {
    /// One heartbeat on every current shard (see [`registry::beat`]); from then on the router
    /// counts as registered, and deregisters when dropped. Returns the interval to the next.
    pub(crate) async fn beat(&self, missed: &mut HashMap<String, u32>) -> Duration {
        let topology = self.topology.load_full();
        let interval = registry::beat(&topology, &self.shared, missed).await;
        self.registered.store(true, Ordering::Release);
        interval
    }

    /// The configuration in force.
    pub(crate) fn config(&self) -> Arc<Config> {
        self.topology.load().config.clone()
    }

    /// This process's instance id (the first part of every owner it writes).
    pub(crate) fn instance_id(&self) -> &str {
        &self.shared.instance_id
    }
}

/// The cleaner's state in one router: the guard of its election lock while it holds it, how
/// many passes it ran, and a registry set in code (which overrides `cleaner.registry`).
#[derive(Default)]
pub(crate) struct CleanerState {
    pub(crate) leader: tokio::sync::Mutex<Option<crate::Leadership>>,
    pub(crate) passes: AtomicU64,
    pub(crate) registry: RwLock<Option<Arc<dyn InstanceRegistry>>>,
}

impl std::fmt::Debug for CleanerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CleanerState")
            .field("passes", &self.passes)
            .finish_non_exhaustive()
    }
}

/// Starts the heartbeat of the router of `inner` on every current shard, every
/// `cleaner.heartbeat-interval` and whenever `beat_now` is notified, while the registry in
/// force is `heartbeat`. It ends with the router (shutdown or drop).
pub(crate) fn spawn_heartbeat(inner: &Arc<Inner>) {
    let weak = Arc::downgrade(inner);
    let mut closed = inner.shared.closed.subscribe();
    let beat_now = inner.beat_now.clone();
    let task = tokio::spawn(async move {
        // Heartbeats missed in a row, per shard.
        let mut missed = std::collections::HashMap::new();
        loop {
            let interval = {
                let Some(inner) = weak.upgrade() else { return };
                inner.beat(&mut missed).await
            };
            tokio::select! {
                _ = closed.wait_for(|c| *c) => return,
                _ = tokio::time::sleep(interval) => {}
                // A reload, or a move's end: advertise the change without waiting.
                _ = beat_now.notified() => {}
            }
        }
    });
    *inner.heartbeat.locked() = Some(task);
}

/// A transaction lock held in this process (see [`crate::patterns`]): when a reload moves its
/// key, it must lock the key's row on the new shard too, or report itself lost. Leases follow
/// their keys through their shard handles instead (see [`crate::moves`]); transaction locks are
/// registered here so that a reload finds them without the router knowing the pattern.
pub(crate) trait FollowsKey: Send + Sync + std::fmt::Debug {
    /// The topology epoch under which it is known to be placed where its key lives.
    fn placed_epoch(&self) -> u64;

    /// Starts following its key to where `topology` places it (in the background).
    fn follow(self: Arc<Self>, router: Weak<Inner>);
}

impl Inner {
    /// Every transaction lock placed under an older epoch than `topology`'s follows its key.
    pub(crate) fn follow_tx_locks(self: &Arc<Self>, topology: &Topology) {
        let locks: Vec<Arc<dyn FollowsKey>> = self
            .tx_locks
            .locked()
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for lock in locks {
            if lock.placed_epoch() < topology.epoch {
                lock.follow(Arc::downgrade(self));
            }
        }
    }
}

/// The instant `wait` from now; a wait too long for the clock (`Duration::MAX`: wait for
/// ever) ends a century from now instead of overflowing.
pub(crate) fn instant_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}
