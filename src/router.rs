//! The lock router: validates keys, places them on shards, waits, and grants guards.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use shardlock_core::config::{NamespaceConfig, RegistryKind, DEFAULT_NAMESPACE};
use shardlock_core::{BackendError, BackendErrorKind, Config, Error, LockKey, Result};
use tokio::time::Instant;

use crate::guard::{release_through_shard, LockGuard, LockMode};
use crate::moves;
use crate::options::AcquireOptions;
use crate::registry::{self, host_name, IdClaim};
use crate::shard::{ShardState, Shared};
use crate::state::{spawn_heartbeat, CleanerState, Gate, Inner};
use crate::sync::LockExt;
use crate::topology::Topology;

/// Routes lock keys to MySQL shards and grants leases on them.
///
/// Cheap to clone (it is an `Arc` inside); share one per process. It must be created inside a
/// Tokio runtime: every shard gets a background lease keeper.
#[derive(Debug, Clone)]
pub struct LockRouter {
    pub(crate) inner: Arc<Inner>,
}

/// Builds a [`LockRouter`]: [`LockRouter::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is awaited"]
pub struct RouterBuilder {
    config: Config,
    /// The YAML text the config was parsed from, and its file: topology errors name its lines.
    source: Option<(String, Option<PathBuf>)>,
    meter: Option<opentelemetry::metrics::Meter>,
    tool: bool,
}

impl RouterBuilder {
    /// Records the router's metrics through `provider` (the host's, or the one
    /// `telemetry::init` made) instead of the global provider. Nothing is installed globally.
    pub fn meter_provider(mut self, provider: &impl opentelemetry::metrics::MeterProvider) -> Self {
        self.meter = Some(provider.meter("shardlock"));
        self
    }

    /// The YAML text the config was parsed from (and the file it was read from): errors found
    /// while building the topology then name its file, line and column, as
    /// [`LockRouter::from_yaml_file`]'s do.
    pub fn yaml_source(mut self, text: impl Into<String>, path: Option<&Path>) -> Self {
        self.source = Some((text.into(), path.map(Path::to_owned)));
        self
    }

    /// Makes the router an operator's tool (the `shardlock` commands `status`, `inspect`,
    /// `list`, `release`, `migrate`): it grants nothing (a grant answers
    /// [`crate::Error::InvalidArgument`]), so it neither moves keys from the placement its
    /// fleet last ran (a tool started with another config than a live fleet's would carry
    /// that fleet's CAS locks and jobs away) nor records its own.
    pub fn operator_tool(mut self) -> Self {
        self.tool = true;
        self
    }

    /// Validates the config and builds the router, as [`LockRouter::new`] does.
    ///
    /// Cancellation: as for [`LockRouter::new`].
    pub async fn build(self) -> Result<LockRouter> {
        self.config.validate()?;
        let source = self.source.as_ref();
        let text = source.map(|(text, _)| text.as_str());
        let path = source.and_then(|(_, path)| path.as_deref());
        let router = LockRouter::build(self.config, text, path, self.meter)?;
        if self.tool {
            router.inner.placement.tool();
        }
        router.started().await
    }
}

/// Why a grant sought across a heartbeat lapse was given back.
pub(crate) const LAPSED: &str = "this process's heartbeat lapsed while it sought the lock \
     (paused, or cut off from every shard); what it was granted was given back";

impl LockRouter {
    /// A router for `config` (already validated by [`Config::from_yaml_str`] or
    /// [`Config::validate`]). Pools connect lazily, but its first heartbeat is refused, and
    /// the router with it, on a shard where another live start beats under the same
    /// instance id (heartbeat registry). Call [`LockRouter::migrate`] once per deployment.
    ///
    /// Cancellation: nothing is granted before this returns; the half-built router is dropped with
    /// its pools and keepers (once a move from its fleet's placement record under way, which
    /// runs on a task of its own, is made), and deregisters in the background if its first
    /// heartbeat completed.
    /// Dropped during that heartbeat, a row it wrote stays live until `cleaner.heartbeat-timeout`.
    pub async fn new(config: Config) -> Result<Self> {
        Self::builder(config).build().await
    }

    /// A builder for a router with more than its config: the OpenTelemetry meter provider its
    /// metrics go to.
    ///
    /// ```no_run
    /// # async fn demo(config: shardlock::Config, provider: opentelemetry_sdk::metrics::SdkMeterProvider) -> shardlock::Result<()> {
    /// let router = shardlock::LockRouter::builder(config)
    ///     .meter_provider(&provider)
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn builder(config: Config) -> RouterBuilder {
        RouterBuilder {
            config,
            source: None,
            meter: None,
            tool: false,
        }
    }

    /// Parses YAML text (see `config/reference.yaml`) and builds the router.
    ///
    /// Cancellation: as for [`LockRouter::new`].
    pub async fn from_yaml_str(text: &str) -> Result<Self> {
        let config = Config::from_yaml_str(text)?;
        Self::builder(config).yaml_source(text, None).build().await
    }

    /// Reads a YAML file and builds the router; errors name the file, line, column and field.
    ///
    /// Cancellation: as for [`LockRouter::new`].
    pub async fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = shardlock_core::config::read_file(path)?;
        let config = Config::from_yaml_text(&text, path)?;
        Self::builder(config)
            .yaml_source(text, Some(path))
            .build()
            .await
    }

    /// The checks a new router makes before it is handed out: a configured instance id that
    /// another live process uses is refused (see `instance.id` in the reference config).
    async fn started(self) -> Result<Self> {
        // Its fleet last ran another placement and no process of it is left to reload: it
        // moves from that one as a reload would (carries fences, kept rows, jobs and CAS locks
        // from the shards its keys left). If others of the fleet are live, it waits for them
        // to agree below as any start does. Until it has read the record everywhere and made
        // that move, it grants nothing; the heartbeat tries again.
        if let Err(why) = self.settle_placement().await {
            tracing::info!(
                why,
                "shardlock grants nothing until it has moved from where its fleet last placed keys"
            );
            self.inner.gate.unjoined(why);
        }
        let topology = self.inner.topology.load_full();
        // Registered before reading the others: of two routers starting at once, the later
        // reader sees the earlier one (else both could read an empty registry and both grant,
        // each under its own topology). A heartbeat is refused where another live start beats
        // under the same id: a copy-pasted config, or an old incarnation still running (looked
        // for by a read first: see `Inner::beat_asked`).
        let beats = self.inner.beat(&mut Default::default()).await;
        if let Some(twin) = beats.taken_by {
            self.inner.shared.closed.send_replace(true);
            let id = self.instance_id();
            // Rows it did take (of a start under the same id at the same moment, each may
            // win some shards) must not keep the id live: neither start would run.
            let shards = &topology.current.shards;
            registry::deregister(&topology.config, id, self.inner.shared.nonce(), shards).await;
            return Err(Error::InvalidArgument {
                name: "instance.id",
                reason: format!(
                    "`{id}` is live in the registry: {twin}. Give each process its own id (or \
                     `auto`), or wait until that process has stopped (its heartbeat older than \
                     the longer of cleaner.heartbeat-timeout and the timeout it runs with)"
                ),
            });
        }
        // Two names for one database: one table, so exclusion holds, but no move may go between
        // them (a reload onto them is refused). Said, not refused: a copy that shares an id
        // would otherwise stop a fleet that ran.
        if let Some(why) = registry::shared_database(&topology) {
            tracing::warn!(
                why,
                "shardlock runs a topology with two names for one database"
            );
        }
        if let Some(why) = beats.unreached() {
            // Unregistered there, it could be missed by a reload's move, or by a start under
            // its id: it joins once a heartbeat has reached every shard (a shard migrated
            // later, or back). Made before `migrate` (the usual first run) it joins in
            // `migrate`; failures that go on are warned of by the heartbeat.
            tracing::info!(
                why,
                "shardlock grants nothing until its heartbeat reaches every shard"
            );
            self.inner.gate.unjoined(why);
        } else if let Some(why) = registry::fleet_disagreement(&topology, &self.inner.shared).await
        {
            tracing::warn!(why, "shardlock grants nothing until its fleet agrees");
            self.inner.gate.unjoined(why);
        } else if let Err(why) =
            crate::placement_record::still_settled(&topology, &self.inner.placement).await
        {
            // Read after the registry: a process of the old fleet that recorded a move and
            // stopped since the first read is not missed.
            self.inner.gate.unjoined(why);
        } else {
            // Granting from now on: by a placement its fleet's record names.
            let writing = self.inner.placement.writing().await;
            let within = crate::state::join_bound(&topology.config);
            let recorded =
                crate::placement_record::record_ahead(&self.inner, &topology, &writing, within)
                    .await;
            if let Some(why) = self.inner.placement.moved_on(recorded) {
                self.inner.gate.unjoined(why);
            }
        }
        spawn_heartbeat(&self.inner);
        Ok(self)
    }

    /// Reads where this router's fleet last placed keys and, if elsewhere than its topology
    /// does, makes the move from there (see [`crate::placement_record`]); `Err` says why not
    /// yet. Done once: at the start, else at a later heartbeat or `migrate`, before the router
    /// first grants.
    pub(crate) async fn settle_placement(&self) -> std::result::Result<(), String> {
        completed(self.settle_placement_task())
            .await
            .unwrap_or_else(|| Err("its runtime shut down".to_owned()))
    }

    /// [`LockRouter::settle_placement`] on a task of its own, as a reload: a caller that gives
    /// up (a `migrate` call, a heartbeat's bounded wait) must not leave the move from the
    /// record half made, the router on a recorded placement.
    pub(crate) fn settle_placement_task(
        &self,
    ) -> Option<tokio::task::JoinHandle<std::result::Result<(), String>>> {
        let router = self.clone();
        (self.inner.shared).spawn(async move { router.settle_placement_now().await })
    }

    /// [`LockRouter::settle_placement`], on the caller's task.
    async fn settle_placement_now(&self) -> std::result::Result<(), String> {
        let mut retired = self.inner.reloading.lock().await;
        let state = &self.inner.placement;
        if !state.may_try() {
            return state.unsettled().map_or(Ok(()), Err);
        }
        let start = self.inner.topology.load_full();
        // Bounded: it holds the reload lock (a reload, a shutdown wait for it).
        let bound = start
            .config
            .cleaner
            .heartbeat_interval
            .max(Duration::from_secs(1));
        let read = crate::placement_record::to_move_from(&start, state);
        let read = tokio::time::timeout(bound, read).await.unwrap_or_else(|_| {
            Err("its fleet's placement record did not answer in time".to_owned())
        });
        let from = match read {
            Ok(from) => from,
            Err(why) => {
                state.tried(Some(why.clone()), false);
                return Err(why);
            }
        };
        let moved = self.move_from(from, &start, &mut retired).await;
        state.tried(moved.clone().err(), moved.is_err());
        moved
    }

    /// Puts the placements of `from` in force in turn (oldest first), then reloads back to
    /// `start`'s config: the move reloads through them would make. A move that cannot be
    /// made leaves the router granting nothing (it is not tried again: restart the process).
    async fn move_from(
        &self,
        from: Vec<Config>,
        start: &Arc<Topology>,
        retired: &mut Retired,
    ) -> std::result::Result<(), String> {
        let mut from = from.into_iter();
        let Some(first) = from.next() else {
            return Ok(());
        };
        let failed = |e: Error| {
            format!(
                "this process could not move from where its fleet last placed keys ({}); it \
                 grants nothing: restart it",
                shardlock_core::Report(&e)
            )
        };
        let shared = &self.inner.shared;
        let then = Topology::build(
            first,
            start.epoch + 1,
            &start.all_shards(),
            start.previous.clone(),
            shared,
            None,
        )
        .map_err(failed)?;
        self.inner.topology.store(Arc::new(then));
        for config in from.chain(std::iter::once((*start.config).clone())) {
            self.reload_under(config, retired).await.map_err(failed)?;
        }
        Ok(())
    }

    /// Refuses a grant of `key` while this router waits to join its fleet (see [`Gate`]).
    pub(crate) fn check_joined(&self, key: &LockKey) -> Result<()> {
        self.inner.notice_lapse();
        match self.inner.gate.why() {
            None if self.inner.placement.granting(&self.inner.beat_now) => Ok(()),
            None => Err(operator_tool()),
            Some(why) => Err(self.not_granting(key, why)),
        }
    }

    /// [`LockRouter::check_joined`], answering what [`LockRouter::still_joined`] compares
    /// once the grant is made: the lapses counted before the check.
    pub(crate) fn joined(&self, key: &LockKey) -> Result<u64> {
        let lapses = self.lapses();
        self.check_joined(key)?;
        Ok(lapses)
    }

    /// Times this router's heartbeat lapsed so far.
    pub(crate) fn lapses(&self) -> u64 {
        self.inner
            .shared
            .stats
            .heartbeat_lapses
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// After a grant of `key` sought since [`LockRouter::joined`] answered `since`: an error if
    /// the heartbeat lapsed meanwhile, or the router stopped granting. The grant must then be
    /// given back: its statements may have waited out a pause unsent, or been retried
    /// meanwhile, on a placement the fleet no longer uses (see `Gate` in `state.rs`).
    pub(crate) fn still_joined(&self, key: &LockKey, since: u64) -> Result<()> {
        self.inner.notice_lapse();
        if self.inner.gate.is_closed() || self.lapses() != since {
            return Err(self.not_granting(key, LAPSED.to_owned()));
        }
        Ok(())
    }

    /// Whether a grant of `key` made under `topology` must be given back and sought again: a
    /// reload has replaced `topology` since and placed the key elsewhere. Its statement may
    /// have run only after the fleet ended the key's move (held up behind a row lock, a slow
    /// shard, a pause), where nobody looks for the key any more while the others may hold it
    /// where it lives now. Counted in `stats().stale_grants`. (A grant checked before a
    /// reload is found by it and follows its key.)
    pub(crate) fn placed_elsewhere_since(&self, topology: &Topology, key: &LockKey) -> bool {
        let stale = self.placement_changed_since(topology, key);
        if stale {
            self.inner
                .shared
                .stats
                .stale_grants
                .fetch_add(1, Ordering::Relaxed);
        }
        stale
    }

    /// Whether a reload has replaced `topology` since and placed `key` elsewhere (see
    /// [`LockRouter::placed_elsewhere_since`], which counts a grant so found).
    pub(crate) fn placement_changed_since(&self, topology: &Topology, key: &LockKey) -> bool {
        let now = self.inner.topology.load();
        now.epoch != topology.epoch && !now.places_like(topology, key)
    }

    /// The error of a grant of `key` refused for `why` by this router itself.
    pub(crate) fn not_granting(&self, key: &LockKey, why: String) -> Error {
        Error::Unavailable {
            shard: self.inner.topology.load().locate(key).name().to_owned(),
            source: BackendError::new(BackendErrorKind::Other, None, why),
        }
    }

    fn build(
        config: Config,
        text: Option<&str>,
        path: Option<&Path>,
        meter: Option<opentelemetry::metrics::Meter>,
    ) -> Result<Self> {
        let (instance_id, id_claim) = match config.instance.id.as_deref() {
            // Another router of this process may have drawn the same random suffix.
            None | Some("auto") => loop {
                let id = auto_instance_id();
                if let Some(claim) = IdClaim::take(&id) {
                    break (id, claim);
                }
            },
            Some(id) => (
                id.to_owned(),
                IdClaim::take(id).ok_or_else(|| IdClaim::refused(id))?,
            ),
        };
        let telemetry = crate::telemetry::Telemetry::new(&config.telemetry, meter);
        let shared = Arc::new(Shared::new(instance_id, telemetry));
        shared.allow_drift(config.instance.clock_drift_ppm());
        let topology =
            Topology::build(config, 1, &[], Vec::new(), &shared, text.map(|t| (t, path)))?;
        let router = Self {
            inner: Arc::new(Inner {
                shared,
                queues: Arc::default(),
                topology: ArcSwap::from_pointee(topology),
                reloading: tokio::sync::Mutex::new(Retired::new()),
                cleaner: CleanerState::default(),
                tx_locks: std::sync::Mutex::default(),
                gate: Gate::default(),
                registered: std::sync::atomic::AtomicBool::new(false),
                commit_kept: std::sync::atomic::AtomicBool::new(false),
                joining: tokio::sync::Mutex::new(()),
                beat_now: Arc::default(),
                heartbeat: std::sync::Mutex::default(),
                id_claim: std::sync::Mutex::new(Some(id_claim)),
                placement: Default::default(),
            }),
        };
        // Leases registered on a shard under an older topology than the one in force follow
        // their keys (see `ShardState::insert`).
        let weak = Arc::downgrade(&router.inner);
        (router.inner.shared).set_follow(move |shard, lease| {
            moves::follow(weak.clone(), shard, lease);
        });
        // Weak: the meter provider keeps the callbacks for ever; a dropped router reports nothing.
        let weak = Arc::downgrade(&router.inner);
        let meter = router.inner.shared.telemetry.meter();
        crate::telemetry::register_observers(meter, move || {
            weak.upgrade().map(|inner| Self { inner }.observed())
        });
        Ok(router)
    }

    /// Swaps in a new configuration: shards, weights, routing and namespace policies. Never
    /// lets two holders of a key exist, and fences keep rising across the move (see the
    /// README's "Routing and reload"):
    ///
    /// - for the move window (`routing.move-window`), an acquire of a key that moved also takes
    ///   it on the shard(s) it lived on before, where processes that have not reloaded yet
    ///   still place it;
    /// - a lease held when its key moves takes the key on its new shard too, within half the
    ///   window, or is reported lost;
    /// - after the window, the moved keys' fences, owned CAS rows and unfinished jobs are
    ///   carried to their new shards; until then, and while a live lease of a moved key is
    ///   only on its old shard, the move stays in force ([`LockRouter::moves_in_progress`]).
    ///
    /// Shards are told apart by the database they reach, not their name: a URL that reaches
    /// another server moves every key of the shard. A change of a namespace's `buckets` is
    /// refused. Shards that stay keep their pools; the pools of shards that left are closed
    /// once no move needs them and no lease of this process is held there. An invalid config
    /// is rejected and the old one stays in force; one equal to the configuration in force
    /// changes nothing, the epoch included. A change of `instance.id` or `instance.fleet` is
    /// refused (restart the process for either), and so is any reload after
    /// [`LockRouter::shutdown`] ([`Error::Shutdown`]).
    ///
    /// Reload every process of the fleet: with the `heartbeat` registry the move stays in
    /// force while any live instance of the fleet runs another topology (not yet reloaded, or
    /// reloaded elsewhere); under
    /// `registry: static`, every process must apply a change within half the move window of
    /// every other.
    ///
    /// Cancellation: the reload runs on a task of its own, on the runtime the router was
    /// built on (with the keepers of the shards it adds, and its move), and a call dropped
    /// completes it all the same. Half a reload cannot be undone: the fleet's placement
    /// record names the new placement before the router swaps it in, and a record naming a
    /// placement no process ran would stay (no process could replace it).
    pub async fn reload(&self, config: Config) -> Result<()> {
        let router = self.clone();
        let reload = self.inner.shared.spawn(async move {
            let mut retired = router.inner.reloading.lock().await;
            router.reload_under(config, &mut retired).await
        });
        completed(reload).await.unwrap_or(Err(Error::Shutdown))
    }

    /// [`LockRouter::reload`] under the reload lock, whose guarded list is `retired`.
    async fn reload_under(&self, config: Config, retired: &mut Retired) -> Result<()> {
        config.validate()?;
        // Its shards would never be closed, nor would the router deregister from them.
        if self.inner.shared.is_closed() {
            return Err(Error::Shutdown);
        }
        let old = self.inner.topology.load_full();
        // The configuration in force again (a periodic SIGHUP, a config-sync job): nothing to
        // move. A new epoch would stop the carry of a move under way and send a release that
        // found nothing round again, each for nothing. (No current shard's pool is closed: a
        // drain closes a shard that left only between reloads, see `drain`.)
        if *old.config == config {
            tracing::info!(
                epoch = old.epoch,
                "shardlock reload: the configuration is the one in force; nothing changes"
            );
            return Ok(());
        }
        keep_instance(&old.config, &config)?;
        keep_lock_identities(&old.config, &config, retired)?;

        let window = config.move_window().max(old.config.move_window());
        let shared = &self.inner.shared;
        let mut next = Topology::build(
            config,
            old.epoch + 1,
            &old.all_shards(),
            Vec::new(),
            shared,
            None,
        )?;
        // Which database each shard reaches, so that a shard that got a new URL (or a new name
        // for a database already in use) is told apart from a move to another server.
        let mut shards = old.all_shards();
        shards.extend(next.current.shards.iter().cloned());
        // Shards that stay are in both lists: one read each.
        shards.sort_by_key(Arc::as_ptr);
        shards.dedup_by(|a, b| Arc::ptr_eq(a, b));
        join_all(shards.iter().map(|s| s.resolve_identity())).await;
        let kept = old.all_shards();
        let is_kept = |shard: &Arc<ShardState>| kept.iter().any(|k| Arc::ptr_eq(k, shard));
        if let Some(why) = registry::shared_database(&next) {
            // Nothing of the refused topology stays: its new shards close (those it shares with
            // the one in force were not changed).
            for shard in next.current.shards.iter().filter(|s| !is_kept(s)) {
                shard.close();
            }
            return Err(shardlock_core::ConfigError::field("shards", why).into());
        }
        // The shards kept take the new breaker settings only now that the topology is taken.
        for shard in next.current.shards.iter().filter(|s| is_kept(s)) {
            shard.reconfigure_breaker(next.config.breaker.clone());
        }
        next.previous = old.previous_for_next(&next, window);
        // Shards that were current and are not any more (those that left earlier are being
        // drained already).
        let leaving: Vec<Arc<ShardState>> = old
            .current
            .shards
            .iter()
            .filter(|s| !next.current.shards.iter().any(|n| Arc::ptr_eq(n, s)))
            .cloned()
            .collect();
        tracing::info!(
            epoch = next.epoch,
            shards = next.current.shards.len(),
            "shardlock topology reloaded"
        );
        let next = Arc::new(next);
        // Recorded before a grant can be placed by it (a whole fleet stopped right after
        // starts from it). A router not joined grants nothing yet: it records as it joins,
        // which takes `writing` too, so not between this look and the swap. (Not under
        // `joining`: the heartbeat must not wait for the record's writes.)
        let writing = self.inner.placement.writing().await;
        if !self.inner.gate.is_closed() {
            let within = crate::placement_record::ahead_bound(&next.config);
            crate::placement_record::record_ahead(&self.inner, &next, &writing, within).await;
        }
        // Not between a join's heartbeat and its reading of the fleet: the join vouches for
        // the topology it beat with.
        let joining = self.inner.joining.lock().await;
        // A shard rebuilt for changed settings judges its first heartbeat as the one it
        // replaces would have. (Under `joining`: no heartbeat is on its way meanwhile.)
        for shard in &next.current.shards {
            shard.inherit_beats(&old.current.shards);
        }
        if old.config.cleaner.registry != RegistryKind::Heartbeat
            && next.config.cleaner.registry == RegistryKind::Heartbeat
        {
            // Unregistered so far: it joins as a start does (its first heartbeat is not late,
            // a lapse).
            self.inner.gate.unjoined(
                "this process switched to the heartbeat registry and has not joined its fleet \
                 in it yet"
                    .to_owned(),
            );
            // Its leases end: no registry knew of it, so a process started onto another
            // topology before its heartbeat lands finds none of it, and may take their keys
            // where that topology puts them. (After the gate closed: a grant that registers
            // its lease after this finds the gate closed and gives it back.)
            shared.lose_shard_leases(crate::shard::REGISTRY_SWITCHED);
        }
        if next.config.cleaner.registry != RegistryKind::Heartbeat {
            shared.registry_unlimited();
        }
        // A raised `instance.clock-drift` applies to the leases held too (a lowered one to
        // later grants only), and so does the shorter lapse it (or a raised node clock skew)
        // makes: to the heartbeats already sent.
        shared.allow_drift(next.config.instance.clock_drift_ppm());
        if next.config.cleaner.registry == RegistryKind::Heartbeat {
            shared.shorten_lapse(crate::state::lapse(&next.config));
        }
        allow_raised_skews(shared, &next);
        self.inner.topology.store(next.clone());
        for shard in &leaving {
            shard.set_left(true);
        }
        for shard in &next.current.shards {
            shard.set_left(false);
        }
        // A lapse the shorter one makes closes the gate now, not at the next look.
        self.inner.notice_lapse();
        // For the fleet's placement record: what it ran and runs now.
        self.inner.placement.runs(&old.current);
        self.inner.placement.runs(&next.current);
        drop(writing);
        drop(joining);
        for (name, ns) in &old.config.namespaces {
            if !next.config.namespaces.contains_key(name) {
                retired.insert(name.clone(), LockIdentity::of(ns));
            }
        }
        retired.retain(|name, _| !next.config.namespaces.contains_key(name));
        // Published after the swap: a lease registered from now on sees the new epoch and
        // follows its key itself; those registered before are found here.
        shared.epoch.store(next.epoch, Ordering::SeqCst);
        // Every shard state, those draining after an earlier reload included.
        self.inner.beat_now.notify_one();
        moves::follow_all(&self.inner, &next);
        self.inner.follow_tx_locks(&next);
        if let Some(moved) = next
            .previous
            .last()
            .filter(|p| Arc::ptr_eq(&p.placement, &old.current))
        {
            tokio::spawn(moves::carry_fences(
                Arc::downgrade(&self.inner),
                moved.clone(),
            ));
        }
        for shard in leaving {
            tokio::spawn(drain(Arc::downgrade(&self.inner), shard, window));
        }
        if *shared.telemetry.started_with() != next.config.telemetry {
            // Exporters and what spans record are set up once, at the start.
            tracing::warn!(
                "shardlock reload: the telemetry section differs from the one this process \
                 started with; it takes effect at the next start (record-keys, exporters and \
                 endpoints stay as they were)"
            );
        }
        Ok(())
    }

    /// Reloads the YAML file at `path` whenever this process receives SIGHUP; an invalid file
    /// is logged (with its line, column and field) and the topology in force stays. The task
    /// ends when the router is dropped. Unix only.
    #[cfg(unix)]
    pub fn reload_on_sighup(
        &self,
        path: impl Into<std::path::PathBuf>,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let path = path.into();
        let mut hangups = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        let weak = Arc::downgrade(&self.inner);
        Ok(tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let Some(inner) = weak.upgrade() else { return };
                let router = LockRouter { inner };
                if let Err(e) = router.reload_from_file(&path).await {
                    tracing::error!(error = %shardlock_core::Report(&e), "shardlock reload failed; the old topology stays");
                }
            }
        }))
    }

    /// [`LockRouter::reload`] with the config in the YAML file at `path`, as
    /// [`LockRouter::reload_on_sighup`] reloads it: an error the reload finds in a field is
    /// placed in the file, as a parse error is.
    ///
    /// Cancellation: as for [`LockRouter::reload`].
    pub async fn reload_from_file(&self, path: &std::path::Path) -> Result<()> {
        let text = shardlock_core::config::read_file(path)?;
        let config = Config::from_yaml_text(&text, path)?;
        self.reload(config).await.map_err(|e| match e {
            Error::Config(e) => Error::Config(e.located(&text, Some(path))),
            e => e,
        })
    }

    /// Earlier placements still in force: their move window is open, or the fences of the
    /// keys that moved away from them are not yet carried to their new shards. While one is,
    /// an acquire of a key that moved also takes the key where it lived.
    pub fn moves_in_progress(&self) -> usize {
        self.inner.topology.load().moves_in_progress()
    }

    /// Whether this process grants locks now: it has joined its fleet. With the `heartbeat`
    /// registry it has not while its heartbeat has not yet reached every shard (a start), the
    /// fleet runs another topology than this process, its heartbeat lapsed (paused, or cut
    /// off from every shard) until it has joined again, or for good once another process
    /// took its instance id over; grants meanwhile answer [`crate::Error::Unavailable`] saying
    /// which. Under `registry: static` too until it has read where its fleet last placed keys
    /// and moved from there (see the README's "A process started with another topology"),
    /// then always, until the router shuts down.
    pub fn is_joined(&self) -> bool {
        self.inner.notice_lapse();
        !self.inner.gate.is_closed() && !self.inner.shared.is_closed()
    }

    /// Whether another process took this router's instance id over while this one counted as
    /// dead (see [`LockRouter::is_joined`]): it grants nothing and heartbeats no more, for
    /// good. Shut it down, and give each process its own id (or `auto`).
    pub fn is_replaced(&self) -> bool {
        self.inner.gate.is_replaced()
    }

    /// Completes once this process has joined its fleet (see [`LockRouter::is_joined`]): at
    /// once if it has; never if another process took its instance id over. For a caller told
    /// to retry once joined (a CAS release by a process whose heartbeat lapsed). Completes
    /// also when the router shuts down (check [`LockRouter::is_joined`]). Cancel-safe.
    pub async fn wait_joined(&self) {
        self.inner.notice_lapse();
        let mut closed = self.inner.shared.closed.subscribe();
        tokio::select! {
            () = self.inner.gate.opened() => {}
            _ = closed.wait_for(|closed| *closed) => {}
        }
    }

    /// The topology epoch: 1 at start, one more per reload that changes the configuration (a
    /// reload of the configuration in force changes nothing).
    pub fn epoch(&self) -> u64 {
        self.inner.topology.load().epoch
    }

    /// This process's instance id (the first part of every owner it writes).
    pub fn instance_id(&self) -> &str {
        &self.inner.shared.instance_id
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.inner.topology.load().config.clone()
    }

    /// The shard that owns `key` now.
    pub fn shard_for(&self, key: &str) -> Result<String> {
        Ok(self.shard_for_key(&LockKey::new(key)?))
    }

    /// [`LockRouter::shard_for`] a lock already named (see [`LockRouter::scoped_key`]).
    pub fn shard_for_key(&self, key: &LockKey) -> String {
        self.inner.topology.load().locate(key).name().to_owned()
    }

    /// The lock named `key`, for operator tools: with `namespace`, the lock an application
    /// takes as `key` in it (under its `key-prefix`, if it has one); without, `key` is the
    /// lock's whole name, as [`LockRouter::list`] shows it (the prefix included). With
    /// `bucket`, that bucket of it: one of a hot key's sub-locks, a semaphore's permit, a
    /// rw-lock's reader slot or its writer's intent (`u32::MAX`), as `list` shows the lease's
    /// bucket. See [`LockRouter::inspect_key`], [`LockRouter::holders_of_key`],
    /// [`LockRouter::force_release_key_everywhere`].
    ///
    /// Errors: [`Error::InvalidKey`], or [`Error::InvalidArgument`] for a namespace the config
    /// lacks.
    pub fn scoped_key(
        &self,
        key: &str,
        namespace: Option<&str>,
        bucket: Option<u32>,
    ) -> Result<LockKey> {
        let key = match bucket {
            Some(bucket) => LockKey::bucket(key, bucket)?,
            None => LockKey::new(key)?,
        };
        match namespace {
            Some(namespace) => {
                let opts = AcquireOptions {
                    namespace: Some(namespace.to_owned()),
                    ..Default::default()
                };
                self.scope(key, &opts)
            }
            None => Ok(key),
        }
    }

    /// Acquires `key`, waiting up to the wait of `opts` (or of its namespace).
    ///
    /// Errors: [`Error::Timeout`] when not granted in time, [`Error::InvalidKey`],
    /// [`Error::Unavailable`] when the key's shard cannot be reached. While the shard's
    /// breaker is open, the namespace's `on-shard-failure` policy answers at once:
    /// `Unavailable` (`fail-fast`), or an in-process lock ([`crate::LockMode::LocalFallback`],
    /// `local`). The key is never moved to another shard. No call outlives its wait: an
    /// attempt still unanswered when the wait ends finishes in the background (a late grant is
    /// released).
    ///
    /// Inside this process only one task polls the shard for a key; the others wait in memory
    /// in FIFO order. Between polls the waiter backs off exponentially with jitter.
    ///
    /// Cancellation: dropping the future at any point leaves no lease behind. An attempt in
    /// flight completes in its own task and, if it won, releases the lease it got.
    pub async fn acquire(&self, key: &str, opts: AcquireOptions) -> Result<LockGuard> {
        let key = LockKey::new(key)?;
        self.acquire_key(key, &opts, None).await
    }

    /// Tries once: `Ok(None)` when someone else holds `key` (in this process or another).
    /// Cancellation as for [`LockRouter::acquire`].
    pub async fn try_acquire(&self, key: &str, opts: AcquireOptions) -> Result<Option<LockGuard>> {
        let key = LockKey::new(key)?;
        self.acquire_inner(key, &opts, Some(Duration::ZERO)).await
    }

    /// Acquires one bucket of a hot key: bucket `hash(hint) % buckets` of the namespace's
    /// `buckets` sub-locks, each placed on the ring on its own. With `bucket-spill`, every other
    /// bucket is tried once (in order after the hint's) before waiting for the hint's own; one
    /// whose shard is down is passed over (neither its error nor an in-process lock of the
    /// `local` policy is answered for it).
    /// [`LockGuard::bucket`] says which one was granted.
    ///
    /// Use it when the protected resource can be split the same way (stock counted per bucket
    /// row, say). Errors and cancellation as for [`LockRouter::acquire`].
    pub async fn acquire_bucket(
        &self,
        key: &str,
        hint: &str,
        opts: AcquireOptions,
    ) -> Result<LockGuard> {
        LockKey::new(key)?;
        let buckets = self.namespace_of(&opts)?.buckets;
        let spill = self.namespace_of(&opts)?.bucket_spill;
        let home = shardlock_core::bucket_for(hint.as_bytes(), buckets);
        if spill && buckets > 1 {
            let started = Instant::now();
            let wait = opts.wait.unwrap_or(self.namespace_of(&opts)?.wait);
            let deadline = crate::state::instant_after(wait);
            for offset in 0..buckets {
                let bucket = LockKey::bucket(key, (home + offset) % buckets)?;
                let spilled = offset > 0;
                let tried = self.acquire_inner(bucket, &opts, Some(Duration::ZERO));
                // Each try once, within the caller's wait (a slow shard, or a bucket's row
                // behind another transaction's lock, answers a try only after its statement
                // timeout): once it is over, the rest go untried and the hint's own bucket is
                // not tried again. (Dropped, a try leaves nothing behind.) A zero wait tries
                // each bucket once.
                let tried = if wait.is_zero() {
                    tried.await
                } else {
                    match tokio::time::timeout_at(deadline, tried).await {
                        Ok(tried) => tried,
                        Err(_) => {
                            return Err(crate::semaphore::slots_timeout(self, key, &opts, started))
                        }
                    }
                };
                match tried {
                    // Another bucket whose shard is down spills nowhere: neither its error
                    // nor an in-process lock (the `local` policy) stands in for waiting on
                    // the hint's own bucket.
                    Ok(Some(guard)) if spilled && guard.mode() != LockMode::Remote => {
                        guard.refuse_local();
                    }
                    Ok(Some(guard)) => return Ok(guard),
                    Ok(None) => {}
                    Err(e) if spilled && e.is_unavailable() => {}
                    Err(e) => return Err(e),
                }
            }
            // (A zero wait tried the hint's own bucket once already.)
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(crate::semaphore::slots_timeout(self, key, &opts, started));
            }
            return self
                .acquire_key(LockKey::bucket(key, home)?, &opts, Some(left))
                .await;
        }
        self.acquire_key(LockKey::bucket(key, home)?, &opts, None)
            .await
    }

    /// Acquires every bucket of `key` (for whole-key operations such as a restock), in bucket
    /// order: two callers doing this, and any number of single-bucket holders, can never
    /// deadlock. Every bucket any namespace may take of the lock: as many as the most that a
    /// namespace whose scope holds it counts (the same `key-prefix`, one the lock's name begins
    /// with, or none), so that a bucket taken through another namespace than `opts`' is
    /// excluded too: the guards may outnumber `opts`' namespace's `buckets` (pick rows by
    /// [`LockGuard::bucket`]). The wait of `opts` covers all of them; on failure the buckets already taken
    /// are given back. Returns the guards in bucket order, each still held once the last was
    /// taken (one may have ended meanwhile: a short ttl, a pause; then all are given back and
    /// taken again within the wait).
    ///
    /// Do not call it while holding one of the key's buckets in the same task: it would wait
    /// for that bucket until it times out.
    ///
    /// Cancellation: as for [`LockRouter::acquire`] for the bucket in flight; the guards of the
    /// buckets already taken are given back in the background.
    pub async fn acquire_all_buckets(
        &self,
        key: &str,
        opts: AcquireOptions,
    ) -> Result<Vec<LockGuard>> {
        LockKey::new(key)?;
        let namespace = self.namespace_of(&opts)?;
        let name = format!(
            "{}{key}",
            namespace.key_prefix.as_deref().unwrap_or_default()
        );
        let buckets = (self.inner.topology.load().config.namespaces.values())
            .filter(|n| name.starts_with(n.key_prefix.as_deref().unwrap_or_default()))
            .map(|n| n.buckets)
            .fold(namespace.buckets, u32::max);
        let parts = (0..buckets)
            .map(|bucket| LockKey::bucket(key, bucket))
            .collect::<Result<Vec<_>>>()?;
        crate::semaphore::take_every_part(self, key, &parts, &opts, false).await
    }

    /// The policy of the namespace `opts` names.
    pub(crate) fn namespace_of(
        &self,
        opts: &AcquireOptions,
    ) -> Result<shardlock_core::config::NamespaceConfig> {
        let name = opts.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
        self.inner
            .topology
            .load()
            .config
            .namespace(name)
            .cloned()
            .ok_or_else(|| unknown_namespace(name))
    }

    /// Every shard of the topology, current and leaving.
    pub(crate) fn shard_states(&self) -> Vec<Arc<ShardState>> {
        self.inner.topology.load().all_shards()
    }

    /// Stops granting, releases every lease this router holds, stops the keepers and closes
    /// the pools. Guards still alive afterwards report their lease as lost, and so does the
    /// guard of a grant whose answer came after shutdown began (its row is given back if the
    /// pool is still open, else it ends at its ttl). Transaction locks are lost too: their
    /// `commit` rolls back. A `COMMIT` sent before is waited for (its session ended) for up to
    /// half of `cleaner.heartbeat-timeout`; one that may still land after that leaves the
    /// instance in the registry until its heartbeat times out, not deregistered.
    ///
    /// Cancellation: the router is closed at its first poll (no grants; keepers stop renewing). A
    /// release that reached its shard may have committed; other rows end by ttl. Deregistering and
    /// closing the pools are skipped (the instance counts as live): call `shutdown` again.
    pub async fn shutdown(&self) -> Result<()> {
        // Transaction locks are lost too: a `commit` from now on rolls back.
        self.inner.shared.closed.send_replace(true);
        // After a reload under way, whose shards are then released, deregistered and closed
        // too (a later one is refused).
        drop(self.inner.reloading.lock().await);
        // Draining shards (left in a reload, leases still held there) included.
        let shards = self.inner.shared.shard_states();
        // A local lease a reconcile moved to a shard's leases just now is released below too,
        // not left renewed by nobody until its ttl.
        for s in &shards {
            s.settle_reconcile();
        }
        let releases = shards.iter().flat_map(|s| {
            s.held()
                .into_iter()
                .filter(|l| !l.is_companion())
                .map(move |lease| {
                    let s = s.clone();
                    async move {
                        // Lost before the release is sent: the moment the row is free, nobody
                        // here believes they hold the key any more.
                        lease.mark_lost(crate::shard::SHUT_DOWN, &s.shared);
                        let turn = lease.turn.locked().take();
                        match release_through_shard(s.clone(), lease.clone(), turn).await {
                            Err(Error::LockLost { .. }) => Ok(()),
                            other => other,
                        }
                    }
                })
        });
        let mut first_error = None;
        for r in join_all(releases).await {
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        // The heartbeat stops at its next turn, now that the router is closed; one on its way
        // to a shard would mark the instance live again after the deregistration.
        let heartbeat = self.inner.heartbeat.locked().take();
        if let Some(heartbeat) = heartbeat {
            let _ = heartbeat.await;
        }
        // Nor may one of `migrate` (which beats no more once it holds this, the router closed).
        let _no_more_beats = self.inner.joining.lock().await;
        // A `COMMIT` that may still land (sent before, its answer not come or lost) keeps a
        // move of its key in force through this instance's row in the registry: gone from
        // there, the fleet would end the move and lock the key where it lives now. Its session
        // is ended while the pools are open; waited for, within half the heartbeat timeout
        // (the row counts as live that long at least), else the row is left to time out.
        let bound = self.config().cleaner.heartbeat_timeout / 2;
        let settled = tokio::time::timeout(bound, async {
            while self.inner.commit_may_land() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if settled.is_err() {
            self.inner.commit_kept.store(true, Ordering::Release);
        }
        if self.inner.commit_kept.load(Ordering::Acquire) {
            tracing::warn!(
                "shardlock shutdown while a transaction lock's COMMIT may still land: this \
                 instance stays in the registry until its heartbeat times out \
                 (cleaner.heartbeat-timeout)"
            );
        } else {
            registry::deregister(
                &self.config(),
                self.instance_id(),
                self.inner.shared.nonce(),
                &shards,
            )
            .await;
        }
        for s in &shards {
            for lease in s.take_local() {
                lease.mark_lost(crate::shard::SHUT_DOWN, &s.shared);
                // A re-acquire whose reply was lost may have taken the row: once, before the
                // pool closes (else it ends by expiry).
                if lease
                    .maybe_on_shard
                    .swap(false, std::sync::atomic::Ordering::SeqCst)
                {
                    let _ = s.release(lease.key.stored(), &lease.owner).await;
                }
            }
            s.close();
        }
        // Another router of this process may take the id now.
        self.inner.id_claim.locked().take();
        first_error.map_or(Ok(()), Err)
    }
}

/// The error of a call naming a namespace the config does not have.
pub(crate) fn unknown_namespace(name: &str) -> Error {
    Error::InvalidArgument {
        name: "namespace",
        reason: format!("`{name}` is not configured; add it under `namespaces:` or use `default`"),
    }
}

/// A raised `node-clock-skew` of a Galera shard applies to the leases held on it too: the
/// shard's new pool takes nodes whose clocks run that far ahead, which may free their rows
/// that much sooner. The shard state is made anew; its leases stay on the old one, or on one
/// an earlier reload made, and so may a grant in flight: every live state of the shard (its
/// name, or its database) is raised.
fn allow_raised_skews(shared: &crate::shard::Shared, next: &Topology) {
    let now = next.all_shards();
    for shard in shared.shard_states() {
        let raised = (now.iter())
            .filter(|n| n.name() == shard.name() || n.same_database(&shard))
            .map(|n| n.clock_skew())
            .max()
            .filter(|&skew| skew > shard.leases_skew());
        if let Some(skew) = raised {
            shard.raise_skew(skew);
        }
    }
}

/// Refuses a reload that changes who this process is: its instance id is its own for its life
/// (owners, registry rows), and a process moved to another fleet would grant at once under
/// that fleet's topology without having joined it.
fn keep_instance(old: &Config, next: &Config) -> Result<()> {
    let field = |name: &str, from: &str, to: &str, why: &str| {
        Err(shardlock_core::ConfigError::field(
            format!("instance.{name}"),
            format!("cannot change from `{from}` to `{to}` in a reload: {why}. Restart the process to change it"),
        )
        .into())
    };
    // Absent or `auto`: one drawn at the start.
    let id = |config: &Config| {
        config
            .instance
            .id
            .clone()
            .unwrap_or_else(|| "auto".to_owned())
    };
    let (from, to) = (id(old), id(next));
    if from != to {
        return field(
            "id",
            &from,
            &to,
            "this process's owners and registry rows bear the id it started with",
        );
    }
    let (from, to) = (old.instance.fleet(), next.instance.fleet());
    if from != to {
        return field(
            "fleet",
            from,
            to,
            "the process would grant under the other fleet's topology without having joined it",
        );
    }
    Ok(())
}

/// Which locks a namespace's keys are: its key prefix and its number of buckets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LockIdentity {
    key_prefix: Option<String>,
    buckets: u32,
}

impl LockIdentity {
    fn of(namespace: &NamespaceConfig) -> Self {
        Self {
            key_prefix: namespace.key_prefix.clone(),
            buckets: namespace.buckets,
        }
    }
}

/// The lock identities of namespaces that reloads removed, by name.
pub(crate) type Retired = HashMap<String, LockIdentity>;

/// Refuses a reload that changes which locks a namespace's keys are: how many buckets it has
/// (a holder of a bucket that no longer exists would not be excluded by
/// [`LockRouter::acquire_all_buckets`]) or its key prefix (a holder under the old prefix
/// would not exclude a caller under the new one); also for a namespace an earlier reload
/// removed (`retired`), brought back: leases taken in it before stay held (a leader's, a
/// permit's), and keys under other ones would be other locks.
fn keep_lock_identities(old: &Config, next: &Config, retired: &Retired) -> Result<()> {
    // Removed and added back in a later reload, a namespace would escape the checks below.
    for (name, before) in &old.namespaces {
        if !next.namespaces.contains_key(name)
            && (before.key_prefix.is_some() || before.buckets > 1)
        {
            return Err(shardlock_core::ConfigError::field(
                format!("namespaces.{name}"),
                "cannot be removed in a reload while it has buckets or a key-prefix: added back \
                 later with other ones, its keys would be other locks than those held now. \
                 Restart the processes without it instead",
            )
            .into());
        }
    }
    for (name, ns) in &next.namespaces {
        let Some(before) = old.namespaces.get(name) else {
            match retired.get(name) {
                Some(was) if *was != LockIdentity::of(ns) => {
                    return Err(shardlock_core::ConfigError::field(
                        format!("namespaces.{name}"),
                        format!(
                            "cannot come back with other locks than it had when an earlier \
                             reload removed it (key-prefix {:?}, {} buckets): leases taken in \
                             it then may still be held, and would not exclude callers under \
                             the new ones. Bring it back as it was, or add a namespace of \
                             another name",
                            was.key_prefix, was.buckets
                        ),
                    )
                    .into());
                }
                _ => continue,
            }
        };
        if before.key_prefix != ns.key_prefix {
            return Err(shardlock_core::ConfigError::field(
                format!("namespaces.{name}.key-prefix"),
                format!(
                    "cannot change from {:?} to {:?} in a reload: a holder under the old prefix \
                     would not exclude a caller under the new one. Introduce a new namespace \
                     with the new prefix and move callers to it",
                    before.key_prefix, ns.key_prefix
                ),
            )
            .into());
        }
        if before.buckets != ns.buckets {
            return Err(shardlock_core::ConfigError::field(
                format!("namespaces.{name}.buckets"),
                format!(
                    "cannot change from {} to {} in a reload: holders of the old buckets would \
                     not be excluded by acquire_all_buckets. Introduce a new namespace with the \
                     new count and move callers to it (a reload adds one only within the count \
                     its scope has; restart the fleet to add more)",
                    before.buckets, ns.buckets
                ),
            )
            .into());
        }
    }
    // A namespace added may not bucket a key into more than the namespaces in force count
    // for it: a whole-key hold taken before the reload (or while it lands) holds only the
    // buckets they count, and would not exclude the new namespace's past them. The key that
    // reaches the fewest: for a prefix, the namespaces of that prefix and those without one;
    // without a prefix, those without one.
    for (name, ns) in &next.namespaces {
        if old.namespaces.contains_key(name) || ns.buckets <= 1 {
            continue;
        }
        let counted = (old.namespaces.values())
            .filter(|o| o.key_prefix.is_none() || o.key_prefix == ns.key_prefix)
            .map(|o| o.buckets)
            .max()
            .unwrap_or(1);
        if ns.buckets > counted {
            return Err(shardlock_core::ConfigError::field(
                format!("namespaces.{name}.buckets"),
                format!(
                    "a namespace added in a reload may bucket keys into at most {counted} (the \
                     most the namespaces in force count for its keys), not {}: a whole-key hold \
                     taken before the reload would not exclude its buckets past those. Restart \
                     the fleet with it instead (a process started with it grants nothing until \
                     every process runs it)",
                    ns.buckets
                ),
            )
            .into());
        }
    }
    Ok(())
}

/// Closes the pool of a shard that left the topology, once its move window has passed and no
/// lease of this process is held there any more, nor any transaction lock, give-back retrying
/// or transaction lock waiting for its session there to end (or it comes back in a later
/// reload).
async fn drain(inner: std::sync::Weak<Inner>, shard: Arc<ShardState>, window: Duration) {
    tokio::time::sleep(window).await;
    loop {
        let Some(inner) = inner.upgrade() else { return };
        // Not while a reload runs: it may have picked this shard up to bring it back, and
        // would then store it closed in the topology in force.
        let no_reload = inner.reloading.lock().await;
        let topology = inner.topology.load_full();
        if topology
            .current
            .shards
            .iter()
            .any(|s| Arc::ptr_eq(s, &shard))
        {
            return; // back in the topology
        }
        // A give-back still retrying would stop with the pool, leaving its key held by nobody
        // until the row expires; so would a transaction lock's wait for its session to end.
        if shard.held().is_empty()
            && shard.local_count() == 0
            // A transaction lock counts as ended only once it counts as settling there.
            && !inner.tx_lock_on(&shard)
            && !shard.settling()
            && !topology.still_needed(&shard)
        {
            shard.close();
            tracing::info!(
                shard = shard.name(),
                "shardlock closed the pool of a shard that left"
            );
            return;
        }
        drop(no_reload);
        drop((inner, topology));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `<host>-<pid>-<random>`: unique per process start, readable in `inspect`.
fn auto_instance_id() -> String {
    format!(
        "{}-{}-{:04x}",
        host_name().replace(':', "-"),
        std::process::id(),
        rand::random::<u16>()
    )
}

/// The error of a grant asked of an operator's tool router (see
/// [`RouterBuilder::operator_tool`]).
pub(crate) fn operator_tool() -> Error {
    Error::InvalidArgument {
        name: "router",
        reason: "an operator's tool router (`RouterBuilder::operator_tool`) grants nothing: \
                 build the router without it to take locks"
            .to_owned(),
    }
}

/// The outcome of `task`, which its caller's cancellation does not stop (a reload, a move from
/// the placement record: half of either cannot be undone); its panic resumed here; `None` once
/// its runtime shut down.
pub(crate) async fn completed<T>(task: Option<tokio::task::JoinHandle<T>>) -> Option<T> {
    match task?.await {
        Ok(done) => Some(done),
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(_) => None,
    }
}
