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

use crate::clock::Moment;
use crate::queue::KeyQueues;
use crate::registry::{self, InstanceRegistry};
use crate::shard::{ShardState, Shared};
use crate::sync::LockExt;
use crate::topology::Topology;

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
    /// One queue per key busy in this process: waiters in memory, one poller per key.
    pub(crate) queues: Arc<KeyQueues>,
    pub(crate) topology: ArcSwap<Topology>,
    /// One reload at a time, and what namespaces removed by earlier reloads locked, by name.
    pub(crate) reloading: tokio::sync::Mutex<crate::router::Retired>,
    /// The cleaner's election lock and pass count, and a registry set in code.
    pub(crate) cleaner: CleanerState,
    /// Transaction locks held in this process, for reloads to make them follow moved keys.
    pub(crate) tx_locks: std::sync::Mutex<Vec<Weak<dyn FollowsKey>>>,
    /// Closed while this router waits to join its fleet (see [`Gate`]).
    pub(crate) gate: Gate,
    /// Set once the heartbeat registered this router on its shards.
    pub(crate) registered: std::sync::atomic::AtomicBool,
    /// Set by a shutdown that found a transaction lock's `COMMIT` that may still land: this
    /// instance stays in the registry (a later call of `shutdown` too) until it times out.
    pub(crate) commit_kept: std::sync::atomic::AtomicBool,
    /// One heartbeat-and-join at a time (the heartbeat task's, `migrate`'s): two beats of one
    /// router never cross on a shard, and joins see each other's outcome.
    pub(crate) joining: tokio::sync::Mutex<()>,
    /// Wakes the heartbeat before its interval: a reload or a move's end changes what this
    /// router advertises (topology, moving), which routers starting meanwhile rely on.
    pub(crate) beat_now: Arc<tokio::sync::Notify>,
    /// The heartbeat task, which shutdown waits for before deregistering: a heartbeat still on
    /// its way would register the instance again, live, after it is gone.
    pub(crate) heartbeat: std::sync::Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// This router's instance id, claimed in this process until it is dropped or shut down.
    pub(crate) id_claim: std::sync::Mutex<Option<registry::IdClaim>>,
    /// Its side of the placements its fleet records (see [`crate::placement_record`]).
    pub(crate) placement: crate::placement_record::PlacementState,
}

/// Whether a router may grant yet. A router grants nothing until one heartbeat has reached
/// every shard of its topology (unregistered there, a reload's move or a start under its id
/// could miss it), nor while another live instance in the registry runs another topology, or
/// still has a reload's move in force: it knows only its own placement, not the one the
/// others still use, so a key it places elsewhere could be held there already. Checked at
/// start, and again with each heartbeat (every [`REJOIN_RETRY`]) until it has joined; once
/// open it stays open (reloads from then on are the move protocol's business) unless the
/// router's heartbeat lapses.
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
    /// The clock's origin for `beaten_ms` (the lease clock: a suspend of the host counts).
    born: Moment,
    /// When the latest heartbeat that reached a shard was sent, in ms after `born` plus one;
    /// 0 before the first.
    beaten_ms: AtomicU64,
    /// The shortest lapse (see [`Gate::lapse_if_stale`]) of the configurations whose
    /// heartbeats the registry may still hold somewhere, in ms; `u64::MAX` before the first.
    /// Others count this process dead by the timeout its row says, so after a reload that
    /// lengthens `cleaner.heartbeat-timeout` the old, shorter lapse holds until a heartbeat
    /// with the new one has reached every shard.
    advertised_lapse_ms: AtomicU64,
    /// Set from a lapse (or a start that has not joined yet) until the router has joined its
    /// fleet: only that opens the gate.
    rejoining: AtomicBool,
    /// Set while joining after a lapse, not after a start: only then may a namespace with the
    /// `local` failure policy grant in process through the closed gate.
    lapsed: AtomicBool,
    /// Set when another process took this router's instance id over: the gate stays closed.
    replaced: AtomicBool,
    /// Counts the reasons to join again (a lapse, a silence, a switch of registry), those
    /// that come while joining already too: a join whose reads came before one of them (the
    /// fleet, the placement record, read before a freeze) must not open the gate.
    asked: AtomicU64,
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            closed: tokio::sync::watch::channel(false).0,
            why: std::sync::Mutex::default(),
            born: Moment::now(),
            beaten_ms: AtomicU64::new(0),
            advertised_lapse_ms: AtomicU64::new(u64::MAX),
            rejoining: AtomicBool::new(false),
            lapsed: AtomicBool::new(false),
            replaced: AtomicBool::new(false),
            asked: AtomicU64::new(0),
        }
    }
}

// Every change of state takes the `why` lock: a join (the heartbeat task's, or `migrate`'s)
// and a lapse, or two joins, that run at the same time must not leave the gate closed with
// nothing left to open it.
impl Gate {
    /// How many reasons to join again there were so far (see [`Gate::rejoined`]).
    pub(crate) fn asked(&self) -> u64 {
        self.asked.load(Ordering::Acquire)
    }

    /// The router joined its fleet: its heartbeat reached every shard, and the fleet agrees,
    /// by checks that began when [`Gate::asked`] answered `asked`. `false`, the gate left
    /// closed, if another reason to join came since: a lapse (or a silence the registry
    /// showed) while those checks ran may have come after their reads.
    pub(crate) fn rejoined(&self, asked: u64) -> bool {
        let _state = self.why.locked();
        if self.asked.load(Ordering::Acquire) != asked {
            return false;
        }
        self.rejoining.store(false, Ordering::Release);
        self.lapsed.store(false, Ordering::Release);
        if !self.replaced.load(Ordering::Acquire) {
            self.closed.send_replace(false);
        }
        true
    }

    /// While the router joins its fleet: why it may not grant yet. Nothing once it has
    /// joined (a join that ran meanwhile found every shard reached and the fleet agreeing).
    pub(crate) fn not_yet(&self, why: String) {
        let mut current = self.why.locked();
        if self.rejoining.load(Ordering::Acquire) && !self.replaced.load(Ordering::Acquire) {
            *current = why;
            self.closed.send_replace(true);
        }
    }

    /// Another process took this router's instance id over while it counted as dead: it
    /// grants nothing from now on, for `why`.
    pub(crate) fn replace(&self, why: String) {
        let mut current = self.why.locked();
        *current = why;
        self.replaced.store(true, Ordering::Release);
        self.closed.send_replace(true);
    }

    pub(crate) fn is_replaced(&self) -> bool {
        self.replaced.load(Ordering::Acquire)
    }

    /// Completes once another process has taken this router's instance id over.
    pub(crate) async fn replaced(&self) {
        let mut closed = self.closed.subscribe();
        let _ = closed.wait_for(|_| self.is_replaced()).await;
    }

    pub(crate) fn is_rejoining(&self) -> bool {
        self.rejoining.load(Ordering::Acquire)
    }

    /// Joining its fleet again after a lapse (see [`Gate::lapse_if_stale`]).
    pub(crate) fn is_lapsed(&self) -> bool {
        self.lapsed.load(Ordering::Acquire)
    }

    /// The router has not joined its fleet yet, for `why`: at its start (its first heartbeat
    /// did not reach every shard, or the fleet disagrees), or on a switch to the heartbeat
    /// registry. It grants nothing until a heartbeat has reached every shard and the fleet
    /// agrees (as after a lapse, see [`spawn_heartbeat`]).
    pub(crate) fn unjoined(&self, why: String) {
        self.join_again(why, false);
    }

    /// Records a heartbeat sent at `sent` that reached a shard, from a configuration whose
    /// lapse is `lapse`.
    pub(crate) fn beaten(&self, sent: Moment, lapse: Duration) {
        let ms = u64::try_from(sent.saturating_duration_since(self.born).as_millis())
            .unwrap_or(u64::MAX - 1);
        self.beaten_ms.fetch_max(ms + 1, Ordering::AcqRel);
        self.advertised_lapse_ms
            .fetch_min(millis(lapse), Ordering::AcqRel);
    }

    /// The lapse that holds with `lapse` configured: the shortest of it and those the
    /// registry may still hold somewhere.
    pub(crate) fn lapse_in_force(&self, lapse: Duration) -> Duration {
        lapse.min(Duration::from_millis(
            self.advertised_lapse_ms.load(Ordering::Acquire),
        ))
    }

    /// Whether a heartbeat ever reached a shard.
    pub(crate) fn ever_beaten(&self) -> bool {
        self.beaten_ms.load(Ordering::Acquire) > 0
    }

    /// A heartbeat from a configuration whose lapse is `lapse` reached every shard: the
    /// registry holds no other configuration's any more.
    pub(crate) fn beaten_everywhere(&self, lapse: Duration) {
        self.advertised_lapse_ms
            .store(millis(lapse), Ordering::Release);
    }

    /// If the latest heartbeat that reached a shard is `lapse` old or older (or the shorter
    /// lapse a heartbeat still in the registry advertised), and no lapse is being recovered
    /// from yet: counts the lapse in `lapses`, closes the gate until the router has joined its
    /// fleet again, and answers `true`. No heartbeat yet: the time since the router was made
    /// counts (a start whose first heartbeat reached every shard has one).
    ///
    /// An acquire that passed the gate before a lapse and is granted after it gives the grant
    /// back: its statement may have waited out the pause unsent, or its waiting retried
    /// meanwhile, on a placement the fleet no longer uses.
    ///
    /// Judged as of `at`: now, or the moment a heartbeat is sent, so that a pause just before
    /// it counts though the heartbeat then reaches a shard.
    pub(crate) fn lapse_if_stale(&self, at: Moment, lapse: Duration, lapses: &AtomicU64) -> bool {
        let Some(age) = self.stale(at, lapse) else {
            return false;
        };
        let why = format!(
            "this process's heartbeat last reached a shard {} ms ago (paused, or cut off from \
             every shard): the others may count it dead, so it grants nothing until it has \
             joined its fleet again",
            age.as_millis()
        );
        self.lapse_for(why, lapses)
    }

    /// Counts a lapse for `why` (the registry may have counted this process dead, whatever its
    /// own clock says) in `lapses`, and closes the gate as [`Gate::lapse_if_stale`] does;
    /// `false` if it was joining already.
    pub(crate) fn lapse_for(&self, why: String, lapses: &AtomicU64) -> bool {
        if !self.join_again(why, true) {
            return false;
        }
        lapses.fetch_add(1, Ordering::AcqRel);
        true
    }

    /// How old the latest heartbeat that reached a shard is as of `at`, if that is a lapse
    /// (see [`Gate::lapse_if_stale`]).
    fn stale(&self, at: Moment, lapse: Duration) -> Option<Duration> {
        let beaten = self.beaten_ms.load(Ordering::Acquire).saturating_sub(1);
        let lapse = self.lapse_in_force(lapse);
        let lived = millis(at.saturating_duration_since(self.born));
        let age = Duration::from_millis(lived.saturating_sub(beaten));
        (age >= lapse).then_some(age)
    }

    /// Closes the gate until the router has joined its fleet, for `why`, after a lapse if
    /// `lapsed`; `false` if it was joining already (the reason it had stays). A router that
    /// joins for another reason than a lapse is never taken for a lapsed one.
    fn join_again(&self, why: String, lapsed: bool) -> bool {
        let mut current = self.why.locked();
        self.asked.fetch_add(1, Ordering::AcqRel);
        if !lapsed {
            self.lapsed.store(false, Ordering::Release);
        }
        if self.rejoining.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.lapsed.store(lapsed, Ordering::Release);
        if !self.replaced.load(Ordering::Acquire) {
            *current = why;
            self.closed.send_replace(true);
        }
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

    /// Completes when the gate is open, or once the router was replaced: then it never opens.
    pub(crate) async fn opened_or_replaced(&self) {
        let mut closed = self.closed.subscribe();
        let _ = closed
            .wait_for(|closed| !closed || self.is_replaced())
            .await;
    }

    /// Whether the gate is closed, to watch without holding the router: `wait_for` answers an
    /// error once the router is gone.
    pub(crate) fn watch(&self) -> tokio::sync::watch::Receiver<bool> {
        self.closed.subscribe()
    }
}

impl Drop for Inner {
    /// A router dropped without `shutdown()` deregisters too (best effort, if a runtime is
    /// still there): else it would count as live in the registry until its heartbeat times
    /// out, keeping routers that start with another topology waiting (see [`Gate`]).
    fn drop(&mut self) {
        // A guard can outlive its router, its lease still renewed (or a transaction lock its
        // row): the instance is live until that ends (its heartbeat then times out; the lease reads as held no longer
        // than a lapse after the last heartbeat, see `Shared::beaten`).
        let holding = self
            .shared
            .shard_states()
            .iter()
            .any(|s| !s.held().is_empty())
            || self.holds_tx_locks();
        if !self.registered.load(Ordering::Acquire) || self.shared.is_closed() || holding {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Where it beats: the shards of placements still in force too.
        let shards = self.topology.load().registry_shards();
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
    /// counts as registered, and deregisters when dropped.
    pub(crate) async fn beat(&self, missed: &mut HashMap<String, u32>) -> registry::Beats {
        self.beat_asked(missed).await.0
    }

    /// [`Inner::beat`], and what [`Gate::asked`] answered as it was sent (a pause before it
    /// counted): a join on this heartbeat opens the gate only if no lapse came since.
    async fn beat_asked(&self, missed: &mut HashMap<String, u32>) -> (registry::Beats, u64) {
        let topology = self.topology.load_full();
        let lapse = lapse(&topology.config);
        // How often it beats and for how long it waits, by the lapse in force now (a
        // heartbeat that reaches every shard may lengthen it, after it).
        let in_force = self.gate.lapse_in_force(lapse);
        let cadence = heartbeat_cadence(&topology.config, in_force);
        // Which server each shard is, for the servers this heartbeat advertises, where no
        // heartbeat has read it yet: before the first one only. Later (a shard added by a
        // reload, or rebuilt for changed settings) each heartbeat reads it where it landed,
        // and the next advertises it: a read here, of a shard that hangs, would take half an
        // interval before every heartbeat, the others' too, and the first of them after the
        // lapse.
        if !self.gate.ever_beaten() {
            registry::learn_servers(&topology).await;
        }
        let sent = Moment::now();
        // A pause since the last look at the lapse (the heartbeat loop's, a grant's) is one:
        // counted before this heartbeat, fresh once it reaches a shard, hides it. (Before the
        // first heartbeat, the start joins the fleet anyway.)
        if self.gate.ever_beaten() {
            self.notice_lapse_at(sent);
        }
        let asked = self.gate.asked();
        // While it joins (its start, or after a lapse), another start live under its id is
        // looked for first, by a read: this heartbeat would take the id's rows where that one
        // is silent (cut off from those shards), and it would stop for good if its link came
        // back before this router gave them up. (A router that ran reads within half an
        // interval: a shard that hangs must not keep its rows on the others unbeaten.) A start
        // that could not read a shard does not beat: that start may beat there alone (a start
        // cut off from one shard, taking the id on another where the live process is cut off,
        // would stop that process for good, and be refused itself once it reached the first).
        //
        // A router joining again after a lapse that could not read a shard beats where it
        // can, its own rows only (see `Beat::take`): they keep a key's move in force while a
        // transaction lock's `COMMIT` may still land (see `reload_under`), and beating nowhere
        // let them lapse; a row another start took over while this one counted as dead stays
        // that start's, which may beat on the shard not read, cut off from this one.
        let started = self.gate.ever_beaten();
        let mut take = true;
        if !started || self.gate.is_rejoining() {
            let bound = started.then(|| cadence / 2);
            let mut beats = registry::Beats::default();
            match registry::live_twin(&topology, &self.shared, bound).await {
                Ok(Some(twin)) => beats.taken_by = Some(twin),
                Err(failed) if !started => {
                    for (shard, why) in failed {
                        let why = format!(
                            "{why}; another start under this instance id was not looked for \
                             there, so this one beats nowhere yet"
                        );
                        let missed = missed.entry(shard.clone()).or_default();
                        registry::missed_beat(&self.shared, missed, &shard, why, &mut beats);
                    }
                }
                Err(_) => take = false,
                Ok(None) => {}
            }
            if beats.taken_by.is_some() || !beats.unreached.is_empty() {
                return (beats, asked);
            }
        }
        let first = std::sync::atomic::AtomicBool::new(true);
        let reached = || {
            // Judged again as its first shard took it: held up longer than the lapse (a slow
            // pool, a slow shard), its rows may have counted as dead already. (Its later
            // shards come after a row of its own: a slow one is no lapse.)
            if first.swap(false, Ordering::AcqRel) && self.gate.ever_beaten() {
                let landed = Moment::now();
                self.notice_lapse_at(landed);
                self.shared.lose_leases_if_lapsed(landed);
            }
            self.gate.beaten(sent, lapse);
            (self.shared).beaten(sent, self.gate.lapse_in_force(lapse));
        };
        let advertised = self.advertised(&topology);
        let silent = |shard: &str| self.silence_seen(shard);
        let round = registry::Round {
            within: heartbeat_round(in_force, cadence),
            take,
        };
        let beats = registry::beat(
            &topology,
            round,
            &advertised,
            &self.shared,
            missed,
            &reached,
            &silent,
        )
        .await;
        if beats.unreached.is_empty() && beats.taken_by.is_none() {
            self.gate.beaten_everywhere(lapse);
            // Every shard holds this lapse now: a longer one counts for the leases too.
            self.shared.lapse_in_force(self.gate.lapse_in_force(lapse));
        }
        self.registered.store(true, Ordering::Release);
        (beats, asked)
    }

    /// One heartbeat; then, while the router joins its fleet (its start, or after a lapse),
    /// opens the gate if the heartbeat reached every shard and the fleet agrees. Answers
    /// `false` once another start has taken this router's instance id over: the router is
    /// replaced, and grants and heartbeats no more.
    pub(crate) async fn beat_and_join(&self, missed: &mut HashMap<String, u32>) -> bool {
        let _one = self.joining.lock().await;
        if self.shared.is_closed() {
            // Shut down: a heartbeat now would register it again, live.
            return true;
        }
        let joining = self.gate.is_rejoining();
        let (beats, asked) = self.beat_asked(missed).await;
        if let Some(twin) = &beats.taken_by {
            self.replaced_by(twin);
            return false;
        }
        if joining {
            // A join records its fleet's placements before it opens the gate. A reload holds
            // the right to write them while it waits for `joining` (taken after it): waited
            // for half an interval at most, as the heartbeat's own write is, then the join is
            // left to the next beat.
            let bound = self.config().cleaner.heartbeat_interval / 2;
            let writing = match beats.unreached() {
                Some(why) => Err(why),
                None => {
                    (tokio::time::timeout(bound, self.placement.writing()).await).map_err(|_| {
                        "this process is applying a reload; it joins its fleet at its next \
                         heartbeat"
                            .to_owned()
                    })
                }
            };
            match writing {
                Err(why) => self.gate.not_yet(why),
                Ok(writing) => self.rejoin(&writing, asked).await,
            }
        }
        true
    }

    /// Closes the gate if this router's heartbeat has lapsed (see [`Gate`]), and wakes the
    /// heartbeat to join the fleet again at once.
    pub(crate) fn notice_lapse(&self) {
        self.notice_lapse_at(Moment::now());
    }

    /// [`Inner::notice_lapse`] as of `at`.
    fn notice_lapse_at(&self, at: Moment) {
        let config = self.config();
        if config.cleaner.registry != shardlock_core::config::RegistryKind::Heartbeat {
            return;
        }
        let lapse = lapse(&config);
        let lapses = &self.shared.stats.heartbeat_lapses;
        if self.gate.lapse_if_stale(at, lapse, lapses) {
            self.beat_now.notify_one();
        }
    }

    /// This process's row on `shard` had gone unbeaten for longer than its lapse by that
    /// shard's clock, and than its own clock saw since its heartbeat there was sent (see
    /// `ShardState::went_silent`): it stood still while the shard's ran
    /// on (a frozen virtual machine, a process restored from a checkpoint), and the others may
    /// have counted this process dead meanwhile, ended moves it had not made, and granted its
    /// keys where their topology places them. As after a lapse: its leases on shards are lost
    /// and it grants nothing until it has joined its fleet again.
    pub(crate) fn silence_seen(&self, shard: &str) {
        let why = format!(
            "this process's row in the registry of shard {shard} had gone unbeaten for longer \
             by that shard's clock than this process's clock saw since its heartbeat there, \
             and than its lapse (its clocks stood still: a frozen virtual machine, a restored \
             checkpoint): the others may count it dead, so it grants nothing until it has \
             joined its fleet again"
        );
        // The gate first: no grant comes after the leases are lost.
        let lapsed = (self.gate).lapse_for(why, &self.shared.stats.heartbeat_lapses);
        self.shared.lose_shard_leases(crate::shard::REGISTRY_LAPSED);
        if lapsed {
            self.beat_now.notify_one();
        }
    }

    /// Another start took this router's instance id over while this one counted as dead: it
    /// grants nothing from now on, and its heartbeat stops. Its leases on shards are lost at
    /// once, transaction locks too: the fleet counted it dead, so their keys may be another's
    /// already, whatever its own clocks say (they may have stood still, and its lapse not
    /// come by them).
    fn replaced_by(&self, twin: &str) {
        let why = format!(
            "instance id `{}` was taken over by {twin} while this process counted as dead (its \
             heartbeat lapsed), or before its heartbeat first reached that shard: it grants \
             nothing and heartbeats no more. Shut it down; give \
             each process its own id (or `auto`)",
            self.instance_id()
        );
        tracing::error!(
            why,
            "shardlock router replaced by another start under its id"
        );
        // The gate first: no grant comes after the leases are lost.
        self.gate.replace(why);
        self.shared.replaced();
    }

    /// Once this router's heartbeat reached every shard, at its start or after a lapse: opens
    /// the gate if its fleet agrees, and no lapse came since the heartbeat it joins on was
    /// sent (`asked`, what [`Gate::asked`] answered then): a silence another task saw, or a
    /// pause while it waited to write the record, may have come before its reads.
    async fn rejoin(&self, writing: &crate::placement_record::Writing<'_>, asked: u64) {
        if let Some(why) = self.placement.unsettled() {
            self.gate.not_yet(why);
            return;
        }
        let topology = self.topology.load_full();
        let disagreement = match registry::fleet_disagreement(&topology, &self.shared).await {
            // Records read after the registry: one written by a process that stopped since is
            // not missed.
            None => crate::placement_record::still_settled(&topology, &self.placement)
                .await
                .err(),
            why => why,
        };
        // Granting from now on: by a placement its fleet's record names.
        let disagreement = match disagreement {
            None => {
                let within = join_bound(&topology.config);
                let recorded =
                    crate::placement_record::record_ahead(self, &topology, writing, within).await;
                self.placement.moved_on(recorded)
            }
            why => why,
        };
        // Not on a heartbeat that is a lapse old by now: one sent before a pause that landed
        // after it, or one the checks above outlasted. The next beat is fresh.
        let disagreement = disagreement.or_else(|| {
            let beats =
                topology.config.cleaner.registry == shardlock_core::config::RegistryKind::Heartbeat;
            let age =
                (self.gate.stale(Moment::now(), lapse(&topology.config))).filter(|_| beats)?;
            Some(format!(
                "this process's heartbeat last reached a shard {} ms ago: it joins its fleet \
                 at its next heartbeat",
                age.as_millis()
            ))
        });
        match disagreement {
            None if self.gate.rejoined(asked) => tracing::info!(
                "shardlock's heartbeat reaches every shard and its fleet agrees: granting"
            ),
            None => self.gate.not_yet(
                "this process's heartbeat lapsed (or the registry showed its clocks stood \
                 still) while it joined its fleet: it joins at its next heartbeat"
                    .to_owned(),
            ),
            Some(why) => self.gate.not_yet(why),
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

/// How long after its latest heartbeat that reached a shard a router under `config` stops
/// granting: halfway from `cleaner.heartbeat-interval` to `cleaner.heartbeat-timeout`, well
/// before the others count it dead; and, by a clock that runs slow by `instance.clock-drift`,
/// still half an interval short of the timeout (halfway alone is, only up to a drift of a
/// third, which the timeout of at least two intervals allows), less how much older a Galera
/// shard's other node may read the heartbeat (its clock that far ahead of the node that
/// wrote it: [`Config::node_clock_spread`]).
pub(crate) fn lapse(config: &Config) -> Duration {
    let (interval, timeout) = (
        config.cleaner.heartbeat_interval,
        config.cleaner.heartbeat_timeout,
    );
    let drift = f64::from(config.instance.clock_drift_ppm()) / 1e6;
    let halfway = (timeout + interval) / 2;
    let spread = match config.cleaner.registry {
        shardlock_core::config::RegistryKind::Heartbeat => config.node_clock_spread(),
        _ => Duration::ZERO,
    };
    halfway.min(
        timeout
            .div_f64(1.0 + drift)
            .saturating_sub(interval / 2 + spread),
    )
}

/// How long a heartbeat may wait for its shards: the lapse in force (see
/// [`Gate::lapse_in_force`]: a reload's longer one counts only once a heartbeat reached every
/// shard) less half an interval, half an interval at least. A heartbeat waits for every
/// current shard, and the next is sent once it is done; one that waited out a hung shard's
/// statement timeout, longer than the lapse (a tight `heartbeat-timeout`, a Galera shard's
/// long statement timeout), sent the next heartbeat to the other shards after the lapse, and
/// the process lost every lease and granted nothing until the hung shard answered again.
pub(crate) fn heartbeat_round(lapse_in_force: Duration, interval: Duration) -> Duration {
    lapse_in_force
        .saturating_sub(interval / 2)
        .max(interval / 2)
}

/// How often heartbeats are sent under `config`: its `heartbeat-interval`, or half the lapse in
/// force if that is shorter than `config`'s own (see [`Gate::lapse_in_force`]: a reload
/// lengthened it, and a heartbeat of it has not reached every shard yet). While one shard hung,
/// a reload that raised the interval above the lapse still in force made the process lapse at
/// every heartbeat, losing every lease on every shard.
pub(crate) fn heartbeat_cadence(config: &Config, lapse_in_force: Duration) -> Duration {
    let interval = config.cleaner.heartbeat_interval;
    // In whole milliseconds, as the gate keeps the lapse in force.
    match millis(lapse_in_force) < millis(lapse(config)) {
        true => interval.min(lapse_in_force / 2),
        false => interval,
    }
}

/// How long a join (a start, a rejoin) waits for its fleet's placement record before it opens
/// the gate: half its lapse at most, for it beat just before (see
/// [`crate::placement_record::ahead_bound`]).
pub(crate) fn join_bound(config: &Config) -> Duration {
    crate::placement_record::ahead_bound(config).min(lapse(config) / 2)
}

/// `d` in whole milliseconds, `u64::MAX` if longer.
fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How soon a router that is joining its fleet (at its start, or again after a lapse)
/// beats and asks again.
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
        // The placement's settle under way, if one is (see below).
        let mut settling = None;
        loop {
            let started = Instant::now();
            let interval = {
                let Some(inner) = weak.upgrade() else { return };
                inner.notice_lapse();
                // One at a time, waited for half the cadence at most: it goes on in the
                // background (see `settle_placement_task`), and must not hold up the heartbeat
                // past the lapse. One still under way is waited for again, not joined by
                // another: they would queue on the reload lock, each with its record read's
                // wait, and a reload or a shutdown behind them all.
                if settling.is_none() && inner.placement.may_try() {
                    let router = crate::LockRouter {
                        inner: inner.clone(),
                    };
                    settling = router.settle_placement_task();
                }
                if let Some(task) = settling.as_mut() {
                    let config = inner.config();
                    let cadence =
                        heartbeat_cadence(&config, inner.gate.lapse_in_force(lapse(&config)));
                    if let Ok(settled) = tokio::time::timeout(cadence / 2, task).await {
                        settling = None;
                        // A panic (a bug): said, and tried again at the next heartbeat.
                        if let Err(e) = settled {
                            tracing::error!(error = %e, "shardlock's placement settle ended abnormally; it is tried again at the next heartbeat");
                        }
                    }
                }
                if !inner.beat_and_join(&mut missed).await {
                    return;
                }
                // Bounded: a slow shard must not hold back the next heartbeat (sent at once
                // if this one took its whole round, and then not tried: see
                // `heartbeat_round`).
                let config = inner.config();
                let lapse = inner.gate.lapse_in_force(lapse(&config));
                let interval = heartbeat_cadence(&config, lapse);
                let round_end = started + heartbeat_round(lapse, interval);
                let bound = (interval / 2).min(round_end.saturating_duration_since(Instant::now()));
                if !bound.is_zero() {
                    let record = crate::placement_record::record_if_due(&inner);
                    let _ = tokio::time::timeout(bound, record).await;
                }
                match inner.gate.is_rejoining() {
                    true => REJOIN_RETRY,
                    false => interval,
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

    /// If it still holds and has not yet followed its key to where the topology of `epoch`
    /// places it: the epoch and fingerprint of the topology it holds under.
    fn pending_since(&self, epoch: u64) -> Option<(u64, String)>;

    /// Whether it holds a row on `shard`, in a transaction still open.
    fn holds_on(&self, shard: &ShardState) -> bool;

    /// Whether its `COMMIT` may be on its way, or land yet (its answer lost).
    fn commit_may_land(&self) -> bool;
}

impl Inner {
    /// Whether a transaction lock of this router holds a row on `shard`: its pool stays open
    /// while one does (its session may need ending there).
    pub(crate) fn tx_lock_on(&self, shard: &ShardState) -> bool {
        self.live_tx_locks().iter().any(|lock| lock.holds_on(shard))
    }

    /// Whether a transaction lock of this router is still alive (its guard, or its `COMMIT`'s
    /// follow-up, not ended).
    pub(crate) fn holds_tx_locks(&self) -> bool {
        !self.live_tx_locks().is_empty()
    }

    /// Whether the `COMMIT` of a transaction lock of this router may be on its way or land yet.
    pub(crate) fn commit_may_land(&self) -> bool {
        self.live_tx_locks()
            .iter()
            .any(|lock| lock.commit_may_land())
    }

    /// The transaction locks of this router still alive (taken out of the list's lock).
    fn live_tx_locks(&self) -> Vec<Arc<dyn FollowsKey>> {
        let locks = self.tx_locks.locked();
        locks.iter().filter_map(Weak::upgrade).collect()
    }

    /// The topology this process advertises in the registry: while a transaction lock has
    /// not followed its key yet, the oldest one such a lock holds under. Such a lock leaves no
    /// row for the others' move to wait on: they must keep the move away from that topology
    /// in force (lock the key where it lived too) until the lock holds where the key lives
    /// now, as for a process that has not reloaded. With it, which server each shard name
    /// reaches ([`registry::servers`]); unknown while such a lock is pending, since a reload
    /// that only points a shard at another server keeps the fingerprint.
    pub(crate) fn advertised(&self, topology: &Topology) -> (String, Option<String>) {
        self.tx_locks
            .locked()
            .iter()
            .filter_map(Weak::upgrade)
            .filter_map(|lock| lock.pending_since(topology.epoch))
            .min_by_key(|(epoch, _)| *epoch)
            .map_or_else(
                || (topology.fingerprint.clone(), registry::servers(topology)),
                |(_, placed)| (placed, None),
            )
    }

    /// Every transaction lock placed under an older epoch than `topology`'s follows its key.
    pub(crate) fn follow_tx_locks(self: &Arc<Self>, topology: &Topology) {
        for lock in self.live_tx_locks() {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Heartbeats go at the configured interval while the lapse in force is the config's own
    /// (kept in whole milliseconds: a comparison with the exact lapse sent them every half
    /// lapse for good under tight configs), and at half a shorter lapse still in force.
    #[test]
    fn heartbeats_go_faster_only_while_a_shorter_lapse_is_in_force() {
        for (interval, timeout) in [(2, 4), (1, 2), (5, 30), (10, 20)] {
            let config = Config::from_yaml_str(&format!(
                "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:3306/test\n\
                 cleaner:\n  heartbeat-interval: {interval}s\n  heartbeat-timeout: {timeout}s\n"
            ))
            .unwrap();
            let interval = Duration::from_secs(interval);
            let own = Duration::from_millis(millis(lapse(&config)));
            let config_is = format!("every {interval:?}, dead after {timeout} s");
            assert_eq!(heartbeat_cadence(&config, own), interval, "{config_is}");
            let shorter = own / 2;
            assert_eq!(
                heartbeat_cadence(&config, shorter),
                interval.min(shorter / 2),
                "{config_is}"
            );
        }
    }

    /// Whatever the drift a config allows, a router's lapse, stretched by that drift, comes
    /// before the others count it dead, and after its next heartbeat is due.
    #[test]
    fn a_lapse_comes_before_the_timeout_by_a_clock_as_slow_as_the_drift_allows() {
        for (drift, interval, timeout) in [(0.01, 1, 30), (0.01, 1, 2), (0.5, 1, 3), (0.34, 5, 12)]
        {
            let config = Config::from_yaml_str(&format!(
                "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:3306/test\n\
                 instance:\n  clock-drift: {drift}\n\
                 cleaner:\n  heartbeat-interval: {interval}s\n  heartbeat-timeout: {timeout}s\n"
            ))
            .unwrap();
            let stretched = lapse(&config).mul_f64(1.0 + drift);
            assert!(
                stretched < Duration::from_secs(timeout),
                "drift {drift}: a lapse of {:?} is {stretched:?} by a slow clock",
                lapse(&config)
            );
            // And after the next heartbeat is due.
            assert!(
                lapse(&config) > Duration::from_secs(interval),
                "drift {drift}"
            );
        }
    }

    /// With a Galera shard, the others may read a heartbeat through a node whose clock is
    /// ahead of the writer's by twice `node-clock-skew`: the lapse, stretched by the drift,
    /// plus that, still comes before the timeout (and after the next heartbeat is due).
    #[test]
    fn a_lapse_comes_before_the_timeout_read_through_another_galera_node() {
        for (skew_ms, interval, timeout) in [(250, 1, 3), (800, 1, 4), (2000, 5, 15)] {
            let config = Config::from_yaml_str(&format!(
                "shards:\n  - name: g\n    url: mysql://root@127.0.0.1:3307/db\n    \
                 nodes: [127.0.0.1:3307, 127.0.0.1:3308]\n    node-clock-skew: {skew_ms}ms\n\
                 cleaner:\n  heartbeat-interval: {interval}s\n  heartbeat-timeout: {timeout}s\n\
                 namespaces:\n  default:\n    ttl: 20s\n"
            ))
            .unwrap();
            let drift = f64::from(config.instance.clock_drift_ppm()) / 1e6;
            let spread = Duration::from_millis(2 * skew_ms);
            let read = lapse(&config).mul_f64(1.0 + drift) + spread;
            assert!(
                read < Duration::from_secs(timeout),
                "skew {skew_ms} ms: a lapse of {:?} reads as {read:?} through another node",
                lapse(&config)
            );
            assert!(
                lapse(&config) > Duration::from_secs(interval),
                "skew {skew_ms} ms"
            );
        }
    }

    /// Sleeps past `d`: an age compared with `d` afterwards is at least `d`.
    fn past(d: Duration) {
        std::thread::sleep(d + Duration::from_millis(5));
    }

    #[test]
    fn a_router_whose_heartbeat_never_reached_a_shard_lapses_from_its_start() {
        let (gate, lapses) = (Gate::default(), AtomicU64::new(0));
        let lapse = Duration::from_millis(20);
        past(lapse);
        assert!(gate.lapse_if_stale(Moment::now(), lapse, &lapses));
        assert!(gate.is_closed() && gate.is_rejoining());
        assert_eq!(lapses.load(Ordering::Acquire), 1);
    }

    #[test]
    fn a_heartbeat_sent_after_a_pause_counts_the_lapse_though_it_then_reaches_a_shard() {
        let (gate, lapses) = (Gate::default(), AtomicU64::new(0));
        let lapse = Duration::from_millis(20);
        gate.beaten(Moment::now(), lapse);
        assert!(gate.ever_beaten());
        past(lapse);
        let sent = Moment::now();
        assert!(gate.lapse_if_stale(sent, lapse, &lapses));
        gate.beaten(sent, lapse);
        assert!(gate.is_closed(), "the fresh heartbeat hid the pause");
        assert_eq!(lapses.load(Ordering::Acquire), 1);
    }

    /// A lapse (or a silence the registry showed) that comes while the router joins its
    /// fleet again, after that join read the fleet and its placement record: the join must
    /// not open the gate on reads that may predate a freeze.
    #[test]
    fn a_lapse_during_a_join_keeps_that_join_from_opening_the_gate() {
        let (gate, lapses) = (Gate::default(), AtomicU64::new(0));
        gate.unjoined("not joined yet".to_owned());
        // The join's checks begin (its reads of the fleet and the record) ...
        let asked = gate.asked();
        // ... the process freezes, and on resuming another task sees the silence.
        gate.lapse_for("its clocks stood still".to_owned(), &lapses);
        assert!(
            !gate.rejoined(asked),
            "a join whose reads came before a lapse opened the gate"
        );
        assert!(gate.is_closed());
        // The next join, its reads after the lapse, opens it.
        assert!(gate.rejoined(gate.asked()));
        assert!(!gate.is_closed());
    }

    #[test]
    fn a_join_that_lost_a_race_leaves_the_gate_as_the_winner_left_it() {
        let gate = Gate::default();
        gate.unjoined("not reached yet".to_owned());
        assert!(gate.is_closed());
        // `migrate`'s join found every shard reached; the heartbeat task's, sent before the
        // migration, answers after it.
        assert!(gate.rejoined(gate.asked()));
        gate.not_yet("a shard not migrated".to_owned());
        assert!(!gate.is_closed(), "{:?}", gate.why());
    }

    #[test]
    fn a_lapse_counts_by_the_shortest_timeout_the_registry_may_still_hold() {
        let (gate, lapses) = (Gate::default(), AtomicU64::new(0));
        let (old, new) = (Duration::from_millis(20), Duration::from_secs(3600));
        // A heartbeat of the configuration before a reload reached a shard; the one after
        // the reload, with a longer timeout, has not reached every shard yet.
        gate.beaten(Moment::now(), old);
        gate.beaten(Moment::now(), new);
        past(old);
        assert!(
            gate.lapse_if_stale(Moment::now(), new, &lapses),
            "by the old timeout"
        );

        let (gate, lapses) = (Gate::default(), AtomicU64::new(0));
        gate.beaten(Moment::now(), old);
        gate.beaten_everywhere(new);
        past(old);
        assert!(
            !gate.lapse_if_stale(Moment::now(), new, &lapses),
            "every shard holds the new one"
        );
        assert!(!gate.is_closed());
    }
}
