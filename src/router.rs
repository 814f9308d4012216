//! The lock router: validates keys, places them on shards, waits, and grants guards.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use shardlock_core::config::{check_ttl, FailurePolicy, DEFAULT_NAMESPACE};
use shardlock_core::{
    BackendError, BackendErrorKind, Backoff, BreakerState, Config, Error, LockKey, Result,
    Transition,
};
use shardlock_mysql::{Attempt, GrantRequest, LeaseRow, MigrateReport, PoolStatus};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::guard::{release_through_shard, Hold, LockGuard, LockMode, LOCAL_FENCE_BIT};
use crate::lease::{Grant, LeaseState};
use crate::options::AcquireOptions;
use crate::queue::{Entry, Handoff, Turn, Want};
use crate::shard::ShardState;
use crate::shared::Shared;
use crate::stats::LockStats;
use crate::topology::Topology;

/// Routes lock keys to MySQL shards and grants leases on them.
///
/// Cheap to clone (it is an `Arc` inside); share one per process. It must be created inside a
/// Tokio runtime: every shard gets a background lease keeper.
#[derive(Debug, Clone)]
pub struct LockRouter {
    pub(crate) inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) shared: Arc<Shared>,
    pub(crate) topology: ArcSwap<Topology>,
    /// One reload at a time.
    reloading: tokio::sync::Mutex<()>,
    /// The cleaner's side: its election lock, pass count, and a registry set in code.
    pub(crate) cleaner: crate::cleaner::CleanerState,
    /// Transaction locks held in this process, for reloads to make them follow moved keys.
    pub(crate) tx_locks: std::sync::Mutex<Vec<std::sync::Weak<crate::patterns::TxLockState>>>,
    /// Closed while this router waits to join its fleet (see [`Gate`]).
    pub(crate) gate: Gate,
    /// Set once the heartbeat registered this router on its shards.
    pub(crate) registered: std::sync::atomic::AtomicBool,
    /// Wakes the heartbeat before its interval: a reload or a move's end changes what this
    /// router advertises (topology, moving), which routers starting meanwhile rely on.
    pub(crate) beat_now: Arc<tokio::sync::Notify>,
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
    fn close(&self, why: String) {
        *self.why.lock().unwrap() = why;
        self.closed.send_replace(true);
    }

    fn open(&self) {
        self.closed.send_replace(false);
    }

    fn is_closed(&self) -> bool {
        *self.closed.borrow()
    }

    fn why(&self) -> Option<String> {
        self.is_closed().then(|| self.why.lock().unwrap().clone())
    }

    /// Completes when the gate is open.
    async fn opened(&self) {
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
        runtime.spawn(async move {
            join_all(shards.iter().map(|s| s.shard.deregister(&id))).await;
        });
    }
}

/// One shard as `status` sees it.
#[derive(Debug, Clone)]
pub struct ShardStatus {
    /// The shard's name.
    pub name: String,
    /// Whether it answered.
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
}

impl LockRouter {
    /// A router for `config` (already validated by [`Config::from_yaml_str`] or
    /// [`Config::validate`]). Pools connect lazily, but a configured (not `auto`) instance id is first
    /// checked against the heartbeat registry of every shard that answers (a live twin is
    /// refused). Call [`LockRouter::migrate`] once per deployment.
    pub async fn new(config: Config) -> Result<Self> {
        config.validate()?;
        Self::build(config, None, None)?.started().await
    }

    /// Parses YAML text (see `config/reference.yaml`) and builds the router.
    pub async fn from_yaml_str(text: &str) -> Result<Self> {
        let config = Config::from_yaml_str(text)?;
        Self::build(config, Some(text), None)?.started().await
    }

    /// Reads a YAML file and builds the router; errors name the file, line, column and field.
    pub async fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = shardlock_core::config::read_file(path)?;
        let config = Config::from_yaml_text(&text, path)?;
        Self::build(config, Some(&text), Some(path))?
            .started()
            .await
    }

    /// The checks a new router makes before it is handed out: a configured instance id that
    /// another live process uses is refused (see `instance.id` in the reference config).
    async fn started(self) -> Result<Self> {
        if let Err(e) = crate::cleaner::refuse_twin(&self).await {
            self.inner.shared.closed.send_replace(true);
            return Err(e);
        }
        // Registered before reading the others: of two routers starting at once, the later
        // reader sees the earlier one (else both could read an empty registry and both grant,
        // each under its own topology).
        crate::cleaner::beat(&self, &mut Default::default()).await;
        if let Some(why) = crate::cleaner::fleet_disagreement(&self).await {
            tracing::warn!(why, "shardlock grants nothing until its fleet agrees");
            self.inner.gate.close(why);
            self.spawn_joining();
        }
        crate::cleaner::spawn_heartbeat(&self);
        Ok(self)
    }

    /// Reads the registry again every 250 ms until the fleet agrees, then opens the gate.
    fn spawn_joining(&self) {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let Some(inner) = weak.upgrade() else { return };
                if inner.shared.is_closed() {
                    return;
                }
                let router = LockRouter { inner };
                match crate::cleaner::fleet_disagreement(&router).await {
                    None => {
                        tracing::info!("shardlock's fleet agrees on its topology: granting");
                        router.inner.gate.open();
                        return;
                    }
                    Some(why) => router.inner.gate.close(why),
                }
            }
        });
    }

    /// Refuses a grant of `key` while this router waits to join its fleet (see [`Gate`]).
    pub(crate) fn check_joined(&self, key: &LockKey) -> Result<()> {
        match self.inner.gate.why() {
            None => Ok(()),
            Some(why) => Err(Error::Unavailable {
                shard: self
                    .inner
                    .topology
                    .load()
                    .locate(key)
                    .shard
                    .name()
                    .to_owned(),
                source: BackendError::new(BackendErrorKind::Other, None, why),
            }),
        }
    }

    fn build(config: Config, text: Option<&str>, path: Option<&Path>) -> Result<Self> {
        let instance_id = match config.instance.id.as_deref() {
            None | Some("auto") => auto_instance_id(),
            Some(id) => id.to_owned(),
        };
        let telemetry = crate::telemetry::Telemetry::new(&config.telemetry);
        let shared = Arc::new(Shared::new(instance_id, telemetry));
        let topology =
            Topology::build(config, 1, &[], Vec::new(), &shared, text.map(|t| (t, path)))?;
        let router = Self {
            inner: Arc::new(Inner {
                shared,
                topology: ArcSwap::from_pointee(topology),
                reloading: tokio::sync::Mutex::new(()),
                cleaner: crate::cleaner::CleanerState::default(),
                tx_locks: std::sync::Mutex::default(),
                gate: Gate::default(),
                registered: std::sync::atomic::AtomicBool::new(false),
                beat_now: Arc::default(),
            }),
        };
        let _ = router
            .inner
            .shared
            .router
            .set(Arc::downgrade(&router.inner));
        crate::telemetry::register_observers(Arc::downgrade(&router.inner));
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
    /// is rejected and the old one stays in force.
    ///
    /// Reload every process of the fleet: with the `heartbeat` registry the move stays in
    /// force while any live instance of the fleet still runs the old topology; under
    /// `registry: static`, every process must apply a change within half the move window of
    /// every other.
    ///
    /// Cancellation: the swap happens without an await after the shards' identities were
    /// read; a call dropped before that changes nothing.
    pub async fn reload(&self, config: Config) -> Result<()> {
        config.validate()?;
        let _one_at_a_time = self.inner.reloading.lock().await;
        let old = self.inner.topology.load_full();
        keep_bucket_counts(&old.config, &config)?;
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
        self.inner.topology.store(next.clone());
        // Published after the swap: a lease registered from now on sees the new epoch and
        // follows its key itself; those registered before are found here.
        shared.epoch.store(next.epoch, Ordering::SeqCst);
        // Every shard state, those draining after an earlier reload included.
        self.inner.beat_now.notify_one();
        crate::moves::follow_all(&shared.shard_states(), &next);
        crate::patterns::follow_tx_locks(&self.inner, &next);
        if let Some(moved) = next
            .previous
            .last()
            .filter(|p| Arc::ptr_eq(&p.placement, &old.current))
        {
            tokio::spawn(crate::moves::carry_fences(
                Arc::downgrade(&self.inner),
                moved.clone(),
            ));
        }
        for shard in leaving {
            tokio::spawn(drain(Arc::downgrade(&self.inner), shard, window));
        }
        Ok(())
    }

    /// Reloads the YAML file at `path` whenever this process receives SIGHUP; an invalid file
    /// is logged (with its line, column and field) and the topology in force stays. The task
    /// ends when the router is dropped.
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
                match Config::from_yaml_file(&path) {
                    Ok(config) => {
                        if let Err(e) = router.reload(config).await {
                            tracing::error!(error = %e, "shardlock reload failed; the old topology stays");
                        }
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "shardlock reload rejected; the old topology stays")
                    }
                }
            }
        }))
    }

    /// Earlier placements still in force: their move window is open, or the fences of the
    /// keys that moved away from them are not yet carried to their new shards. While one is,
    /// an acquire of a key that moved also takes the key where it lived.
    pub fn moves_in_progress(&self) -> usize {
        self.inner.topology.load().moves_in_progress()
    }

    /// The topology epoch: 1 at start, one more per reload.
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

    /// Creates or upgrades shardlock's tables on every shard; idempotent and safe to run from
    /// several processes at once. Returns what each shard applied.
    pub async fn migrate(&self) -> Result<Vec<(String, MigrateReport)>> {
        let topology = self.inner.topology.load_full();
        let runs = topology.current.shards.iter().map(|s| async move {
            let report = s
                .shard
                .migrate()
                .await
                .map_err(|e| e.into_error(s.shard.name()))?;
            Ok::<_, Error>((s.shard.name().to_owned(), report))
        });
        let mut out = Vec::new();
        for result in join_all(runs).await {
            out.push(result?);
        }
        Ok(out)
    }

    /// The shard that owns `key` now.
    pub fn shard_for(&self, key: &str) -> Result<String> {
        let key = LockKey::new(key)?;
        Ok(self
            .inner
            .topology
            .load()
            .locate(&key)
            .shard
            .name()
            .to_owned())
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
    /// bucket is tried once (in order after the hint's) before waiting for the hint's own.
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
            for offset in 0..buckets {
                let bucket = LockKey::bucket(key, (home + offset) % buckets)?;
                if let Some(guard) = self
                    .acquire_inner(bucket, &opts, Some(Duration::ZERO))
                    .await?
                {
                    return Ok(guard);
                }
            }
            let wait = self.namespace_of(&opts)?.wait;
            let left = opts.wait.unwrap_or(wait).saturating_sub(started.elapsed());
            return self
                .acquire_key(LockKey::bucket(key, home)?, &opts, Some(left))
                .await;
        }
        self.acquire_key(LockKey::bucket(key, home)?, &opts, None)
            .await
    }

    /// Acquires every bucket of `key` (for whole-key operations such as a restock), in bucket
    /// order: two callers doing this, and any number of single-bucket holders, can never
    /// deadlock. The wait of `opts` covers all of them; on failure the buckets already taken
    /// are released. Returns the guards in bucket order.
    ///
    /// Do not call it while holding one of the key's buckets in the same task: it would wait
    /// for that bucket until it times out.
    pub async fn acquire_all_buckets(
        &self,
        key: &str,
        opts: AcquireOptions,
    ) -> Result<Vec<LockGuard>> {
        LockKey::new(key)?;
        let ns = self.namespace_of(&opts)?;
        let deadline = instant_after(opts.wait.unwrap_or(ns.wait));
        let mut guards = Vec::with_capacity(ns.buckets as usize);
        for bucket in 0..ns.buckets {
            let left = deadline.saturating_duration_since(Instant::now());
            // On error the guards taken so far are dropped, which releases them.
            guards.push(
                self.acquire_key(LockKey::bucket(key, bucket)?, &opts, Some(left))
                    .await?,
            );
        }
        Ok(guards)
    }

    /// The policy of the namespace `opts` names.
    fn namespace_of(
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
            .ok_or_else(|| Error::InvalidArgument {
                name: "namespace",
                reason: format!(
                    "`{name}` is not configured; add it under `namespaces:` or use `default`"
                ),
            })
    }

    /// [`LockRouter::acquire_inner`], with a timeout turned into [`Error::Timeout`].
    async fn acquire_key(
        &self,
        key: LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<LockGuard> {
        let started = Instant::now();
        let text = key.to_string();
        match self.acquire_inner(key, opts, wait).await? {
            Some(guard) => Ok(guard),
            None => {
                self.inner
                    .shared
                    .stats
                    .timeouts
                    .fetch_add(1, Ordering::Relaxed);
                Err(Error::Timeout {
                    key: text,
                    waited: started.elapsed(),
                })
            }
        }
    }

    /// Acquires `key`, waiting `wait` (the namespace's when `None`); `Ok(None)` on timeout.
    /// Traced as a `shardlock.acquire` span and measured (see [`crate::telemetry`]).
    async fn acquire_inner(
        &self,
        key: LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<Option<LockGuard>> {
        let mut wait = wait;
        if self.inner.gate.is_closed() {
            // Waiting to join the fleet counts against the caller's wait.
            let budget = match wait {
                Some(w) => w,
                None => opts.wait.unwrap_or(self.namespace_of(opts)?.wait),
            };
            let started = Instant::now();
            let _ = tokio::time::timeout_at(instant_after(budget), self.inner.gate.opened()).await;
            self.check_joined(&key)?;
            wait = Some(budget.saturating_sub(started.elapsed()));
        }
        self.acquire_joined(key, opts, wait).await
    }

    /// [`LockRouter::acquire_inner`] once this router has joined its fleet.
    async fn acquire_joined(
        &self,
        key: LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<Option<LockGuard>> {
        use tracing::Instrument;
        let started = Instant::now();
        let telemetry = &self.inner.shared.telemetry;
        let namespace = opts.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE);
        let span = tracing::info_span!(
            "shardlock.acquire",
            namespace,
            shard = tracing::field::Empty,
            bucket = key.bucket_number(),
            key = tracing::field::Empty,
            attempts = tracing::field::Empty,
            wait_ms = tracing::field::Empty,
            outcome = tracing::field::Empty,
            mode = tracing::field::Empty,
        );
        if !span.is_disabled() {
            span.record("key", telemetry.key_label(&key));
        }
        let mut progress = Progress::default();
        let result = self
            .acquire_steps(&key, opts, wait, &mut progress)
            .instrument(span.clone())
            .await;
        let took = started.elapsed();
        let (outcome, mode) = match &result {
            Ok(Some(guard)) if guard.mode() == LockMode::LocalFallback => ("granted", "local"),
            Ok(Some(_)) => ("granted", "remote"),
            Ok(None) => ("timeout", "remote"),
            Err(Error::Unavailable { .. }) => ("unavailable", "remote"),
            Err(_) => ("error", "remote"),
        };
        let shard = progress
            .shard
            .as_ref()
            .map_or_else(|| opentelemetry::StringValue::from(""), |s| s.label.clone());
        if !span.is_disabled() {
            // A waiter handed the lock by its holder links to the holder's hold.
            if let Ok(Some(after)) = result
                .as_ref()
                .map(|g| g.as_ref().and_then(LockGuard::handed_from))
            {
                span.follows_from(after);
            }
            span.record("shard", shard.as_str());
            span.record("attempts", progress.attempts);
            span.record("wait_ms", took.as_secs_f64() * 1000.0);
            span.record("outcome", outcome);
            span.record("mode", mode);
        }
        let attrs = crate::telemetry::AcquireAttrs {
            namespace: progress
                .namespace
                .take()
                .unwrap_or_else(|| opentelemetry::StringValue::from(namespace.to_owned())),
            shard,
            outcome,
            mode,
        };
        let bound = progress.shard.as_ref().map(|s| &s.acquires);
        telemetry.acquired(&key, attrs, took, progress.waited(), bound);
        result
    }

    /// The steps of [`LockRouter::acquire_inner`]; `progress` says how far they got.
    async fn acquire_steps(
        &self,
        key: &LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
        progress: &mut Progress,
    ) -> Result<Option<LockGuard>> {
        if self.inner.shared.is_closed() {
            return Err(Error::Shutdown);
        }
        let ns = self.namespace_of(opts)?;
        let ttl = opts.ttl.unwrap_or(ns.ttl);
        check_ttl(ttl).map_err(|reason| Error::InvalidArgument {
            name: "ttl",
            reason,
        })?;
        let deadline = instant_after(wait.or(opts.wait).unwrap_or(ns.wait));
        {
            let topology = self.inner.topology.load();
            progress.shard = Some(topology.locate(key).clone());
            progress.namespace = Some(
                topology.namespace_label(opts.namespace.as_deref().unwrap_or(DEFAULT_NAMESPACE)),
            );
        }

        // One poller per key in this process: the others wait in memory, and may be handed the
        // lease directly by the holder when it releases.
        let want = Want {
            ttl,
            renew_every: ns.renew_interval_for(ttl),
            handoff_max_count: ns.handoff_max_count,
            handoff_max_time: ns.handoff_max_time,
            drift_ppm: self.inner.topology.load().config.instance.clock_drift_ppm(),
        };
        let turn = match self.inner.shared.queues.enter(key.stored(), want) {
            Entry::Turn(turn) => turn,
            Entry::Queued(mut waiter) => {
                progress.queued = true;
                match tokio::time::timeout_at(deadline, waiter.wait()).await {
                    Err(_) => return Ok(None),
                    Ok(None) => return Err(Error::Shutdown),
                    Ok(Some(Handoff::Granted(guard))) => return Ok(Some(guard)),
                    Ok(Some(Handoff::Turn { turn, yield_first })) => {
                        if yield_first {
                            // The key was released for another process. Its poller sees that our
                            // holds are short and polls every base step, so two base steps give it
                            // the key; longer would leave the key idle when it has nobody waiting.
                            let now = Instant::now();
                            tokio::time::sleep(
                                (ns.backoff_base * 2).min(deadline.saturating_duration_since(now)),
                            )
                            .await;
                        }
                        turn
                    }
                }
            }
        };
        let mut backoff = Backoff::new(ns.backoff_base, ns.backoff_cap);
        loop {
            if self.inner.shared.is_closed() {
                return Err(Error::Shutdown);
            }
            // Placement is read again on every poll: a reload meanwhile moves the key.
            let topology = self.inner.topology.load_full();
            let shard = topology.locate(key).clone();
            let previous = topology.previous_locations(key);
            progress.shard = Some(shard.clone());
            // A key that moved in a recent reload is also taken on the shards it lived on
            // before, in name order, each fence above the previous one; no hand-offs for it.
            let want = if previous.is_empty() {
                want
            } else {
                Want {
                    handoff_max_count: 0,
                    handoff_max_time: Duration::ZERO,
                    ..want
                }
            };
            // One owner for the grant's rows on every shard, so that a row where the key lived
            // and the row where it lives now are recognisably the same lease.
            let (_, owner) = self.inner.shared.next_owner();
            let mut companions = CompanionGrants(Vec::new(), key.stored().to_vec());
            let mut held_for = u64::MAX;
            let mut floor = 0;
            for old in &previous {
                progress.attempts += 1;
                match self
                    .try_grant(old, key, &owner, want, floor, deadline)
                    .await?
                {
                    Ok(grant) => {
                        floor = grant.fence;
                        companions.0.push((old.clone(), grant));
                    }
                    Err(held_for_ms) => {
                        held_for = held_for_ms;
                        break;
                    }
                }
            }
            if companions.0.len() == previous.len() {
                progress.attempts += 1;
                let tried = match self
                    .try_grant(&shard, key, &owner, want, floor, deadline)
                    .await
                {
                    Ok(tried) => tried,
                    // A moved key, or a failure that is not the shard's: nothing to fall back on.
                    Err(e) if !previous.is_empty() || !e.is_unavailable() => return Err(e),
                    Err(e) => match ns.on_shard_failure {
                        FailurePolicy::Local if shard.breaker_state() != BreakerState::Closed => {
                            return Ok(Some(self.hold_local(&shard, key, want, turn, &topology)));
                        }
                        // Not open yet: try again within the wait; the breaker opens soon if
                        // the shard keeps failing.
                        FailurePolicy::Local if Instant::now() < deadline => Err(u64::MAX),
                        _ => return Err(e),
                    },
                };
                if let Err(held_for_ms) = tried {
                    held_for = held_for_ms;
                    // A traced waiter links, once, to the trace of whoever holds the key.
                    if !progress.linked && crate::telemetry::tracing_current() {
                        progress.linked = true;
                        if let Ok(Some(parent)) =
                            shard.call(shard.shard.holder_trace(key.stored())).await
                        {
                            crate::telemetry::link_current_to(&parent);
                        }
                    }
                }
                if let Ok(grant) = tried {
                    // The previous shards' rows get this grant's fence too: a process still
                    // placing the key there must be granted a larger one.
                    let mut failed = None;
                    for (old, companion) in &companions.0 {
                        let raised = old
                            .call(old.shard.raise_fence(
                                key.stored(),
                                &companion.owner,
                                grant.fence,
                            ))
                            .await;
                        if !matches!(raised, Ok(true)) {
                            failed = Some((old.shard.name().to_owned(), raised));
                            break;
                        }
                    }
                    if let Some((name, raised)) = failed {
                        // Every row of this grant is given back as `companions` drops.
                        companions.0.push((shard.clone(), grant));
                        return Err(match raised {
                            Err(e) => e.into_error(&name),
                            Ok(_) => Error::LockLost {
                                key: key.to_string(),
                            },
                        });
                    }
                    if !previous.is_empty() {
                        self.inner
                            .shared
                            .stats
                            .moved_grants
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    let guard = self.hold(&shard, key, grant, want, Some(turn), &topology);
                    let lease = &guard.hold().lease;
                    while let Some((old, grant)) = companions.0.pop() {
                        let companion = Arc::new(
                            LeaseState::new(key.clone(), grant, want, Duration::ZERO, None)
                                .belonging_to(lease),
                        );
                        old.insert(companion.clone());
                        if !lease.adopt(old.clone(), companion.clone()) {
                            // Lost already (the guard reports it): this row and the rest are
                            // given back as `companions` drops.
                            old.remove(companion.id);
                            companions.0.push((
                                old,
                                Grant {
                                    id: companion.id,
                                    owner: companion.owner.clone(),
                                    fence: 0,
                                    reserve: 0,
                                    sent: Instant::now(),
                                },
                            ));
                            break;
                        }
                    }
                    return Ok(Some(guard));
                }
            }
            // Whatever was taken on earlier shards is released as `companions` drops.
            drop(companions);
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            // A key held only briefly is likely to be free again soon (a hot key changing hands):
            // poll again after the base step rather than backing off further.
            if u128::from(held_for) < ns.backoff_cap.as_millis() {
                backoff.reset();
            }
            tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
        }
    }

    /// One acquire attempt of `key` on `shard` for `owner` and `want`, with a first fence above
    /// `floor`:
    /// the grant, or how long the key has been held (`u64::MAX`: unknown, the attempt did not
    /// answer before `deadline`).
    async fn try_grant(
        &self,
        shard: &Arc<ShardState>,
        key: &LockKey,
        owner: &str,
        want: Want,
        floor: u64,
        deadline: Instant,
    ) -> Result<std::result::Result<Grant, u64>> {
        let id = self.inner.shared.next_id();
        let req = GrantRequest {
            key: key.stored().to_vec(),
            owner: owner.to_owned(),
            ttl_ms: want.ttl_ms(),
            fence_floor: floor,
            reserve: want.handoff_max_count,
            trace: crate::telemetry::current_traceparent(),
        };
        let sent = Instant::now();
        Ok(match self.attempt(shard, &req, deadline).await? {
            None => Err(u64::MAX),
            // Granted, but the answer came so late that the lease may already have ended on
            // the shard: no use to anyone. Given back; the key counts as busy.
            Some(Attempt::Granted(_)) if Instant::now() >= want.lease_end(sent) => {
                crate::guard::give_back(shard.clone(), req.key, req.owner, want.ttl);
                Err(u64::MAX)
            }
            Some(Attempt::Granted(fence)) => Ok(Grant {
                id,
                owner: req.owner,
                fence,
                reserve: req.reserve,
                sent,
            }),
            Some(Attempt::Held { held_for_ms }) => Err(held_for_ms),
            // The row was locked by another transaction: busy, poll again soon.
            Some(Attempt::Locked) => Err(0),
        })
    }

    /// An in-process grant while `shard`'s breaker is open (`local` policy). The caller holds
    /// the key's turn, so no other task of this process holds the key; the keeper re-acquires
    /// it on the shard when the shard is back.
    fn hold_local(
        &self,
        shard: &Arc<ShardState>,
        key: &LockKey,
        want: Want,
        turn: Turn,
        topology: &Topology,
    ) -> LockGuard {
        let shared = &self.inner.shared;
        shared.stats.grants.fetch_add(1, Ordering::Relaxed);
        shared.stats.local_grants.fetch_add(1, Ordering::Relaxed);
        let (id, owner) = shared.next_owner();
        // Grant numbers rise in this process, and shard fences never have the top bit.
        let fence = LOCAL_FENCE_BIT | id;
        tracing::debug!(shard = shard.shard.name(), key = %key, "shardlock granted a key in process: its shard is unavailable (exclusion inside this process only)");
        let grant = Grant {
            id,
            owner,
            fence,
            reserve: 0,
            sent: Instant::now(),
        };
        let lease =
            Arc::new(LeaseState::local(key.clone(), grant, want, turn).placed_at(topology.epoch));
        shard.insert_local(lease.clone());
        LockGuard::new(Hold::new(lease, shard.clone(), fence))
    }

    /// The guard of a fresh grant made under `topology`: its lease is registered with the
    /// shard's keeper (and follows its key if a reload came meanwhile).
    fn hold(
        &self,
        shard: &Arc<ShardState>,
        key: &LockKey,
        grant: Grant,
        want: Want,
        turn: Option<Turn>,
        topology: &Topology,
    ) -> LockGuard {
        self.inner
            .shared
            .stats
            .grants
            .fetch_add(1, Ordering::Relaxed);
        let fence = grant.fence;
        let lease = Arc::new(
            LeaseState::new(key.clone(), grant, want, want.handoff_max_time, turn)
                .placed_at(topology.epoch),
        );
        shard.insert(lease.clone());
        LockGuard::new(Hold::new(lease, shard.clone(), fence))
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
        &self,
        shard: &Arc<ShardState>,
        req: &GrantRequest,
        deadline: Instant,
    ) -> Result<Option<Attempt>> {
        let (tx, rx) = oneshot::channel();
        let (task_shard, task_req) = (shard.clone(), req.clone());
        tokio::spawn(async move {
            let stats = &task_shard.shared.stats;
            let result = task_shard.acquire(&task_req).await;
            if !matches!(&result, Err(e) if e.kind == BackendErrorKind::BreakerOpen) {
                stats.acquire_statements.fetch_add(1, Ordering::Relaxed);
            }
            // A statement that failed after it may have reached the server may have granted
            // the key (its reply was lost, or came too late): give it back, owner-checked,
            // like a grant the caller no longer wants.
            // So may a try before a `Locked` answer, if its connection broke after sending.
            let unknown = matches!(&result, Err(e) if e.maybe_applied)
                || matches!(&result, Ok(Attempt::Locked));
            if let Err(Ok(Attempt::Granted(_))) = tx.send(result) {
                let _ = task_shard
                    .call(task_shard.shard.release(&task_req.key, &task_req.owner))
                    .await;
            } else if unknown {
                let ttl = Duration::from_millis(u64::from(task_req.ttl_ms));
                crate::guard::give_back(task_shard, task_req.key, task_req.owner, ttl);
            }
        });
        let mut pending = PendingAttempt {
            rx,
            shard: shard.clone(),
            key: req.key.clone(),
            owner: req.owner.clone(),
            taken: false,
        };
        let sent = Instant::now();
        let until = if deadline > sent {
            deadline
        } else {
            sent + shard.shard.statement_timeout() + Duration::from_millis(50)
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
            .into_error(shard.shard.name()));
        };
        pending.taken = true;
        result
            .map_err(|_| Error::Shutdown)?
            .map(Some)
            .map_err(|e| e.into_error(shard.shard.name()))
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

    /// Every shard of the topology, current and leaving.
    pub(crate) fn shard_states(&self) -> Vec<Arc<ShardState>> {
        self.inner.topology.load().all_shards()
    }

    fn shard_state(&self, name: &str) -> Option<Arc<ShardState>> {
        self.inner
            .topology
            .load()
            .all_shards()
            .into_iter()
            .find(|s| s.shard.name() == name)
    }

    /// Where `key` lives and what its lease row says.
    pub async fn inspect(&self, key: &str) -> Result<(String, Option<LeaseRow>)> {
        let key = LockKey::new(key)?;
        let topology = self.inner.topology.load_full();
        let shard = topology.locate(&key);
        let row = shard
            .shard
            .inspect(key.stored())
            .await
            .map_err(|e| e.into_error(shard.shard.name()))?;
        Ok((shard.shard.name().to_owned(), row))
    }

    /// Every shard's reachability, pool and lease counts: the current ones, then those that
    /// left in a reload and are still kept for moved keys.
    pub async fn status(&self) -> Vec<ShardStatus> {
        let topology = self.inner.topology.load_full();
        let shards = topology.all_shards();
        let probes = shards.iter().map(|s| async {
            let current = topology.current.shards.iter().any(|c| Arc::ptr_eq(c, s));
            let closed = s.shard.is_closed();
            let held = if closed {
                Err(shardlock_core::BackendError::new(
                    shardlock_core::BackendErrorKind::ServerGone,
                    None,
                    "the shard left the topology and its pool was closed",
                ))
            } else {
                s.shard.count_held().await
            };
            ShardStatus {
                current,
                closed,
                name: s.shard.name().to_owned(),
                reachable: held.is_ok(),
                error: held.as_ref().err().map(|e| e.to_string()),
                held_leases: held.ok(),
                local_leases: s.held().len(),
                pool: s.shard.pool_status(),
                breaker: s.breaker_state(),
                local_fallback_leases: s.local_count(),
            }
        });
        join_all(probes).await
    }

    /// This router's counters.
    pub fn stats(&self) -> LockStats {
        let queued = self.inner.shared.queues.waiting() as u64;
        self.inner.shared.stats.snapshot(queued)
    }

    /// Stops granting, releases every lease this router holds, stops the keepers and closes
    /// the pools. Guards still alive afterwards report their lease as lost.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.shared.closed.send_replace(true);
        // Draining shards (left in a reload, leases still held there) included.
        let shards = self.inner.shared.shard_states();
        let releases = shards.iter().flat_map(|s| {
            s.held()
                .into_iter()
                .filter(|l| !l.is_companion())
                .map(move |lease| {
                    let s = s.clone();
                    async move {
                        // Lost before the release is sent: the moment the row is free, nobody
                        // here believes they hold the key any more.
                        lease.mark_lost(crate::lease::SHUT_DOWN, &s.shared.stats);
                        let turn = lease.turn.lock().unwrap().take();
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
        crate::cleaner::deregister(self, &shards).await;
        for s in &shards {
            for lease in s.take_local() {
                lease.mark_lost(crate::lease::SHUT_DOWN, &s.shared.stats);
            }
            s.shard.close();
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// How far an acquire got, for its span and metrics.
#[derive(Debug, Default)]
struct Progress {
    shard: Option<Arc<ShardState>>,
    namespace: Option<opentelemetry::StringValue>,
    attempts: u32,
    /// Waited in memory behind another task of this process.
    queued: bool,
    /// Linked to the trace of the key's holder in another process.
    linked: bool,
}

impl Progress {
    /// Whether the caller waited for the key (queued, or polled the shard more than once).
    fn waited(&self) -> bool {
        self.queued || self.attempts > 1
    }
}

/// Grants taken on a moved key's previous shards while its new shard is still to be tried:
/// released in the background if the acquire does not end in a guard.
#[derive(Debug)]
struct CompanionGrants(Vec<(Arc<ShardState>, Grant)>, Vec<u8>);

impl Drop for CompanionGrants {
    fn drop(&mut self) {
        if self.0.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // no runtime: the rows end by expiry
        };
        for (shard, grant) in self.0.drain(..) {
            let key = self.1.clone();
            runtime.spawn(async move {
                let _ = shard.call(shard.shard.release(&key, &grant.owner)).await;
            });
        }
    }
}

/// The caller's end of an attempt in flight (see [`LockRouter::attempt`]).
struct PendingAttempt {
    rx: oneshot::Receiver<std::result::Result<Attempt, shardlock_core::BackendError>>,
    shard: Arc<ShardState>,
    key: Vec<u8>,
    owner: String,
    taken: bool,
}

impl Drop for PendingAttempt {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        // After close() the task can no longer send; a grant sent before is ours to undo.
        self.rx.close();
        if let Ok(Ok(Attempt::Granted(_))) = self.rx.try_recv() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let (shard, key, owner) = (
                    self.shard.clone(),
                    std::mem::take(&mut self.key),
                    std::mem::take(&mut self.owner),
                );
                runtime.spawn(async move {
                    let _ = shard.call(shard.shard.release(&key, &owner)).await;
                });
            }
        }
    }
}

/// Refuses a reload that changes how many buckets a namespace has: a holder of a bucket that
/// no longer exists would not be excluded by [`LockRouter::acquire_all_buckets`].
fn keep_bucket_counts(old: &Config, next: &Config) -> Result<()> {
    for (name, ns) in &next.namespaces {
        let Some(before) = old.namespaces.get(name) else {
            continue;
        };
        if before.buckets != ns.buckets {
            return Err(shardlock_core::ConfigError::field(
                format!("namespaces.{name}.buckets"),
                format!(
                    "cannot change from {} to {} in a reload: holders of the old buckets would \
                     not be excluded by acquire_all_buckets. Introduce a new namespace with the \
                     new count and move callers to it",
                    before.buckets, ns.buckets
                ),
            )
            .into());
        }
    }
    Ok(())
}

/// Closes the pool of a shard that left the topology, once its move window has passed and no
/// lease of this process is held there any more (or it comes back in a later reload).
async fn drain(inner: std::sync::Weak<Inner>, shard: Arc<ShardState>, window: Duration) {
    tokio::time::sleep(window).await;
    loop {
        let Some(inner) = inner.upgrade() else { return };
        let topology = inner.topology.load_full();
        if topology
            .current
            .shards
            .iter()
            .any(|s| Arc::ptr_eq(s, &shard))
        {
            return; // back in the topology
        }
        if shard.held().is_empty() && shard.local_count() == 0 && !topology.still_needed(&shard) {
            shard.shard.close();
            tracing::info!(
                shard = shard.shard.name(),
                "shardlock closed the pool of a shard that left"
            );
            return;
        }
        drop((inner, topology));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The instant `wait` from now; a wait too long for the clock (`Duration::MAX`: wait for
/// ever) ends a century from now instead of overflowing.
pub(crate) fn instant_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
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

/// This machine's host name, as the registry records it.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned())
}
