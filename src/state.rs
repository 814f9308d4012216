//! What a router is made of, below the code that uses it: the shards' shared context, the
//! topology in force, the cleaner's and the registry's state, the transaction locks that
//! follow moved keys, and the gate that holds grants back until the fleet agrees.
//!
//! [`crate::LockRouter`] is a handle on an [`Inner`]; the modules that act for the router
//! (acquire, moves, the registry, patterns) take the parts of it they need from here, so none of
//! them has to reach up into `router.rs`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
/// move protocol's business) unless the router's heartbeat lapses.
///
/// A router whose latest heartbeat that reached a shard is older than halfway from
/// `cleaner.heartbeat-interval` to `cleaner.heartbeat-timeout` (a process paused, or cut off
/// from every shard) may soon count as dead in the registry, and
/// meanwhile the others may have ended a move without it, or another process may have
/// started under its instance id. Its gate closes ([`Gate::lapse_if_stale`]) and it joins its fleet
/// again as if it had just started (see [`spawn_heartbeat`]); a process whose heartbeat finds
/// its id taken over ([`Gate::replace`]) never opens again.
#[derive(Debug)]
pub(crate) struct Gate {
    closed: tokio::sync::watch::Sender<bool>,
    why: std::sync::Mutex<String>,
    /// The clock's origin for `beaten_ms`.
    born: Instant,
    /// When the latest heartbeat that reached a shard was sent, in ms after `born` plus one;
    /// 0 before the first.
    beaten_ms: AtomicU64,
    /// Set from a lapse until the router has joined its fleet again: only that opens the gate.
    rejoining: AtomicBool,
    /// Set when another process took this router's instance id over: the gate stays closed.
    replaced: AtomicBool,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            closed: tokio::sync::watch::channel(false).0,
            why: std::sync::Mutex::default(),
            born: Instant::now(),
            beaten_ms: AtomicU64::new(0),
            rejoining: AtomicBool::new(false),
            replaced: AtomicBool::new(false),
        }
    }
}

impl Gate {
    /// Closes the gate for `why` (a replaced router keeps the reason it was replaced for).
    pub(crate) fn close(&self, why: String) {
        if self.replaced.load(Ordering::Acquire) {
            return;
        }
        *self.why.locked() = why;
        self.closed.send_replace(true);
    }

    /// Opens the gate: the fleet agrees. Not while a lapse is being recovered from (only
    /// [`Gate::rejoined`] ends that) or after the router was replaced.
    pub(crate) fn open(&self) {
        if !self.rejoining.load(Ordering::Acquire) && !self.replaced.load(Ordering::Acquire) {
            self.closed.send_replace(false);
        }
    }

    /// The router joined its fleet again after a lapse.
    pub(crate) fn rejoined(&self) {
        self.rejoining.store(false, Ordering::Release);
        self.open();
    }

    /// Another process took this router's instance id over while it counted as dead: it
    /// grants nothing from now on, for `why`.
    pub(crate) fn replace(&self, why: String) {
        *self.why.locked() = why;
        self.replaced.store(true, Ordering::Release);
        self.closed.send_replace(true);
    }

    pub(crate) fn is_replaced(&self) -> bool {
        self.replaced.load(Ordering::Acquire)
    }

    pub(crate) fn is_rejoining(&self) -> bool {
        self.rejoining.load(Ordering::Acquire)
    }

    /// Records a heartbeat sent at `sent` that reached at least one shard.
    pub(crate) fn beaten(&self, sent: Instant) {
        let ms = u64::try_from(sent.saturating_duration_since(self.born).as_millis())
            .unwrap_or(u64::MAX - 1);
        self.beaten_ms.fetch_max(ms + 1, Ordering::AcqRel);
    }

    /// If the latest heartbeat that reached a shard is `lapse` old or older and no lapse is
    /// being recovered from yet: counts the lapse in `lapses`, closes the gate until the
    /// router has joined its fleet again, and answers `true`. No heartbeat yet: no lapse (the
    /// start joins the fleet).
    ///
    /// An acquire that passed the gate before a lapse and is granted after it gives the grant
    /// back: its statement may have waited out the pause unsent, or its waiting retried
    /// meanwhile, on a placement the fleet no longer uses.
    pub(crate) fn lapse_if_stale(&self, lapse: Duration, lapses: &AtomicU64) -> bool {
        let beaten = self.beaten_ms.load(Ordering::Acquire);
        if beaten == 0 {
            return false;
        }
        let age = Duration::from_millis(
            u64::try_from(self.born.elapsed().as_millis())
                .unwrap_or(u64::MAX)
                .saturating_sub(beaten - 1),
        );
        if age < lapse || self.rejoining.swap(true, Ordering::AcqRel) {
            return false;
        }
        lapses.fetch_add(1, Ordering::AcqRel);
        self.close(format!(
            "this process's heartbeat last reached a shard {} ms ago (paused, or cut off from \
             every shard): the others may count it dead, so it grants nothing until it has \
             joined its fleet again",
            age.as_millis()
        ));
        true
    }

    /// Closed, or rejoining, or replaced: the flags are read too, so that a gate opened by
    /// a join that raced with a lapse (or a replacement) still refuses.
    pub(crate) fn is_closed(&self) -> bool {
        *self.closed.borrow() || self.is_rejoining() || self.is_replaced()
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
        let shared = self.shared.clone();
        let id = shared.instance_id.clone();
        // The id stays this router's until it is deregistered: a router of this process that
        // took it sooner would be marked deregistered by this one.
        let claim = self.id_claim.locked().take();
        runtime.spawn(async move {
            join_all(
                shards
                    .iter()
                    .map(|s| s.unguarded().deregister(&id, shared.nonce())),
            )
            .await;
            drop(claim);
        });
    }
}

impl Inner {
    /// One heartbeat on every current shard (see [`registry::beat`]); from then on the router
    /// counts as registered, and deregisters when dropped. Returns another start that beats
    /// under this router's instance id, live, if one does (this router's heartbeat was
    /// refused there).
    pub(crate) async fn beat(&self, missed: &mut HashMap<String, u32>) -> Option<String> {
        let topology = self.topology.load_full();
        let sent = Instant::now();
        let reached = || self.gate.beaten(sent);
        let taken_by = registry::beat(&topology, &self.shared, missed, &reached).await;
        self.registered.store(true, Ordering::Release);
        taken_by
    }

    /// Closes the gate if this router's heartbeat has lapsed (see [`Gate`]), and wakes the
    /// heartbeat to join the fleet again at once.
    pub(crate) fn notice_lapse(&self) {
        let config = self.config();
        if config.cleaner.registry != shardlock_core::config::RegistryKind::Heartbeat {
            return;
        }
        let lapse = (config.cleaner.heartbeat_timeout + config.cleaner.heartbeat_interval) / 2;
        if self
            .gate
            .lapse_if_stale(lapse, &self.shared.stats.heartbeat_lapses)
        {
            self.beat_now.notify_one();
        }
    }

    /// Another start took this router's instance id over while this one counted as dead: it
    /// grants nothing from now on, and its heartbeat stops.
    fn replaced_by(&self, twin: &str) {
        let why = format!(
            "instance id `{}` was taken over by {twin} while this process counted as dead (its \
             heartbeat lapsed): it grants nothing and heartbeats no more. Shut it down; give \
             each process its own id (or `auto`)",
            self.instance_id()
        );
        tracing::error!(
            why,
            "shardlock router replaced by another start under its id"
        );
        self.gate.replace(why);
    }

    /// After a lapse, once this router heartbeats again: opens the gate if its fleet agrees.
    async fn rejoin(&self) {
        let topology = self.topology.load_full();
        match registry::fleet_disagreement(&topology, self.instance_id()).await {
            None => {
                tracing::info!("shardlock's heartbeat lapsed and its fleet agrees: granting again");
                self.gate.rejoined();
            }
            Some(why) => self.gate.close(why),
        }
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

/// How soon a router that is joining its fleet again after a lapse beats and asks again.
const REJOIN_RETRY: Duration = Duration::from_millis(250);

/// Starts the heartbeat of the router of `inner` on every current shard, every
/// `cleaner.heartbeat-interval` and whenever `beat_now` is notified, while the registry in
/// force is `heartbeat`. It ends with the router (shutdown or drop), or when another process
/// took its instance id over.
///
/// A heartbeat refused because another start beats under the same id ends it, the router
/// replaced. After a lapse (see [`Gate`]) it beats, then opens the gate once the fleet
/// agrees, every [`REJOIN_RETRY`] until then (live again, only not granting).
pub(crate) fn spawn_heartbeat(inner: &Arc<Inner>) {
    let weak = Arc::downgrade(inner);
    let mut closed = inner.shared.closed.subscribe();
    let beat_now = inner.beat_now.clone();
    let task = tokio::spawn(async move {
        // Heartbeats missed in a row, per shard.
        let mut missed = std::collections::HashMap::new();
        loop {
            let started = Instant::now();
            let interval = {
                let Some(inner) = weak.upgrade() else { return };
                inner.notice_lapse();
                let rejoining = inner.gate.is_rejoining();
                if let Some(twin) = inner.beat(&mut missed).await {
                    inner.replaced_by(&twin);
                    return;
                }
                if rejoining {
                    inner.rejoin().await;
                }
                if inner.gate.is_rejoining() {
                    REJOIN_RETRY
                } else {
                    inner.config().cleaner.heartbeat_interval
                }
            };
            tokio::select! {
                _ = closed.wait_for(|c| *c) => return,
                // At a steady rate, however long the beat took: the lapse allows for it.
                _ = tokio::time::sleep_until(started + interval) => {}
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
