//! The lock router: validates keys, places them on shards, waits, and grants guards.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use shardlock_core::config::{check_ttl, DEFAULT_NAMESPACE};
use shardlock_core::{Backoff, Config, ConfigError, Error, LockKey, Result, Ring};
use shardlock_mysql::{GrantRequest, LeaseRow, MigrateReport, PoolStatus, Shard};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::guard::{release_through_shard, Hold, LockGuard};
use crate::keeper::{spawn_keeper, Grant, LeaseState, ShardState, Shared};
use crate::options::AcquireOptions;
use crate::queue::{Entry, Handoff, Want};

/// Routes lock keys to MySQL shards and grants leases on them.
///
/// Cheap to clone (it is an `Arc` inside); share one per process. It must be created inside a
/// Tokio runtime: every shard gets a background lease keeper.
#[derive(Debug, Clone)]
pub struct LockRouter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    topology: ArcSwap<Topology>,
}

/// Everything that placement depends on, swapped as one.
#[derive(Debug)]
struct Topology {
    config: Arc<Config>,
    ring: Ring,
    shards: Vec<Arc<ShardState>>,
}

/// Counters of one router since it started (this process only).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LockStats {
    /// Locks granted (hand-offs included).
    pub grants: u64,
    /// Grants handed from a releasing holder to a waiting task of this process in the same
    /// statement as the release.
    pub handoffs: u64,
    /// Grants handed from a releasing holder to a waiting task of this process in memory,
    /// without a statement (each with a new, larger fence from the range the shard grant
    /// reserved).
    pub local_handoffs: u64,
    /// Acquire statements sent to shards (one per attempt).
    pub acquire_statements: u64,
    /// Acquires that gave up after their wait.
    pub timeouts: u64,
    /// Leases released (explicitly or on drop).
    pub releases: u64,
    /// Leases reported lost.
    pub lost: u64,
    /// Renewal ticks that renewed at least one lease (summed over shards).
    pub renew_ticks: u64,
    /// Renewal statements sent (summed over shards).
    pub renew_statements: u64,
    /// Renewal attempts that failed (summed over shards).
    pub renew_failures: u64,
    /// Tasks waiting in memory for a key another task of this router holds or polls (now).
    pub queued: u64,
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
}

impl LockRouter {
    /// A router for `config` (already validated by [`Config::from_yaml_str`] or
    /// [`Config::validate`]). Connects lazily; call [`LockRouter::migrate`] once per deployment.
    pub async fn new(config: Config) -> Result<Self> {
        config.validate()?;
        Self::build(config, None, None)
    }

    /// Parses YAML text (see `config/reference.yaml`) and builds the router.
    pub async fn from_yaml_str(text: &str) -> Result<Self> {
        let config = Config::from_yaml_str(text)?;
        Self::build(config, Some(text), None)
    }

    /// Reads a YAML file and builds the router; errors name the file, line, column and field.
    pub async fn from_yaml_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = shardlock_core::config::read_file(path)?;
        let config = Config::from_yaml_text(&text, path)?;
        Self::build(config, Some(&text), Some(path))
    }

    fn build(config: Config, text: Option<&str>, path: Option<&Path>) -> Result<Self> {
        let instance_id = match config.instance.id.as_deref() {
            None | Some("auto") => auto_instance_id(),
            Some(id) => id.to_owned(),
        };
        let shared = Arc::new(Shared::new(instance_id));
        let mut shards = Vec::with_capacity(config.shards.len());
        for (i, sc) in config.shards.iter().enumerate() {
            let shard = Shard::new(sc, i).map_err(|e| locate(e, text, path))?;
            let state = ShardState::new(shard, shared.clone());
            spawn_keeper(&state, shared.closed.subscribe());
            shards.push(state);
        }
        let ring = Ring::new(
            config.shards.iter().map(|s| (s.name.as_str(), s.weight)),
            config.routing.virtual_nodes,
        );
        let topology = Topology {
            config: Arc::new(config),
            ring,
            shards,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                shared,
                topology: ArcSwap::from_pointee(topology),
            }),
        })
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
        let runs = topology.shards.iter().map(|s| async move {
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
        let topology = self.inner.topology.load();
        Ok(topology.shards[topology.ring.locate(key.placement())]
            .shard
            .name()
            .to_owned())
    }

    /// Acquires `key`, waiting up to the wait of `opts` (or of its namespace).
    ///
    /// Errors: [`Error::Timeout`] when not granted in time, [`Error::InvalidKey`],
    /// [`Error::Unavailable`] when the key's shard cannot be reached.
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
        let deadline = Instant::now() + opts.wait.unwrap_or(ns.wait);
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
    async fn acquire_inner(
        &self,
        key: LockKey,
        opts: &AcquireOptions,
        wait: Option<Duration>,
    ) -> Result<Option<LockGuard>> {
        if self.inner.shared.is_closed() {
            return Err(Error::Shutdown);
        }
        let topology = self.inner.topology.load_full();
        let ns = self.namespace_of(opts)?;
        let ttl = opts.ttl.unwrap_or(ns.ttl);
        check_ttl(ttl).map_err(|reason| Error::InvalidArgument {
            name: "ttl",
            reason,
        })?;
        let deadline = Instant::now() + wait.or(opts.wait).unwrap_or(ns.wait);
        let shard = topology.shards[topology.ring.locate(key.placement())].clone();

        // One poller per key in this process: the others wait in memory, and may be handed the
        // lease directly by the holder when it releases.
        let want = Want {
            ttl,
            renew_every: ns.renew_interval_for(ttl),
            handoff_max_count: ns.handoff_max_count,
            handoff_max_time: ns.handoff_max_time,
        };
        let turn = match self.inner.shared.queues.enter(key.stored(), want) {
            Entry::Turn(turn) => turn,
            Entry::Queued(mut waiter) => {
                match tokio::time::timeout_at(deadline, waiter.wait()).await {
                    Err(_) => return Ok(None),
                    Ok(None) => return Err(Error::Shutdown),
                    Ok(Some(Handoff::Granted(guard))) => return Ok(Some(guard)),
                    Ok(Some(Handoff::Turn { turn, yield_first })) => {
                        if yield_first {
                            // The key was released for another process; give it one backoff step.
                            let now = Instant::now();
                            tokio::time::sleep(
                                ns.backoff_cap.min(deadline.saturating_duration_since(now)),
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
            let (id, owner) = self.inner.shared.next_owner();
            let req = GrantRequest {
                key: key.stored().to_vec(),
                owner,
                ttl_ms: want.ttl_ms(),
                fence_floor: 0,
                reserve: want.handoff_max_count,
            };
            let sent = Instant::now();
            if let Some(fence) = self.attempt(&shard, &req).await? {
                self.inner
                    .shared
                    .stats
                    .grants
                    .fetch_add(1, Ordering::Relaxed);
                let grant = Grant {
                    id,
                    owner: req.owner,
                    fence,
                    reserve: req.reserve,
                    sent,
                };
                let lease = Arc::new(LeaseState::new(
                    key,
                    grant,
                    want,
                    want.handoff_max_time,
                    turn,
                ));
                shard.insert(lease.clone());
                return Ok(Some(LockGuard::new(Hold::new(lease, shard, fence))));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(backoff.next_delay().min(deadline - now)).await;
        }
    }

    /// One acquire statement, run in its own task so that it always completes. If the caller
    /// goes away meanwhile, whoever sees a winning result last releases it: the task (when the
    /// caller was gone before the answer) or [`PendingAttempt`]'s drop (when the answer was
    /// already sent but not yet taken).
    async fn attempt(&self, shard: &Arc<ShardState>, req: &GrantRequest) -> Result<Option<u64>> {
        self.inner
            .shared
            .stats
            .acquire_statements
            .fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let (task_shard, task_req) = (shard.clone(), req.clone());
        tokio::spawn(async move {
            let result = task_shard.shard.acquire(&task_req).await;
            if let Err(Ok(Some(_fence))) = tx.send(result) {
                let _ = task_shard
                    .shard
                    .release(&task_req.key, &task_req.owner)
                    .await;
            }
        });
        let mut pending = PendingAttempt {
            rx,
            shard: shard.clone(),
            key: req.key.clone(),
            owner: req.owner.clone(),
            taken: false,
        };
        let result = (&mut pending.rx).await;
        pending.taken = true;
        result
            .map_err(|_| Error::Shutdown)?
            .map_err(|e| e.into_error(shard.shard.name()))
    }

    /// Where `key` lives and what its lease row says.
    pub async fn inspect(&self, key: &str) -> Result<(String, Option<LeaseRow>)> {
        let key = LockKey::new(key)?;
        let topology = self.inner.topology.load_full();
        let shard = &topology.shards[topology.ring.locate(key.placement())];
        let row = shard
            .shard
            .inspect(key.stored())
            .await
            .map_err(|e| e.into_error(shard.shard.name()))?;
        Ok((shard.shard.name().to_owned(), row))
    }

    /// Every shard's reachability, pool and lease counts.
    pub async fn status(&self) -> Vec<ShardStatus> {
        let topology = self.inner.topology.load_full();
        let probes = topology.shards.iter().map(|s| async move {
            let held = s.shard.count_held().await;
            ShardStatus {
                name: s.shard.name().to_owned(),
                reachable: held.is_ok(),
                error: held.as_ref().err().map(|e| e.to_string()),
                held_leases: held.ok(),
                local_leases: s.held().len(),
                pool: s.shard.pool_status(),
            }
        });
        join_all(probes).await
    }

    /// This router's counters.
    pub fn stats(&self) -> LockStats {
        let s = &self.inner.shared.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LockStats {
            grants: get(&s.grants),
            handoffs: get(&s.handoffs),
            local_handoffs: get(&s.local_handoffs),
            acquire_statements: get(&s.acquire_statements),
            timeouts: get(&s.timeouts),
            releases: get(&s.releases),
            lost: get(&s.lost),
            renew_ticks: get(&s.renew_ticks),
            renew_statements: get(&s.renew_statements),
            renew_failures: get(&s.renew_failures),
            queued: self.inner.shared.queues.waiting() as u64,
        }
    }

    /// Stops granting, releases every lease this router holds, stops the keepers and closes
    /// the pools. Guards still alive afterwards report their lease as lost.
    pub async fn shutdown(&self) -> Result<()> {
        self.inner.shared.closed.send_replace(true);
        let topology = self.inner.topology.load_full();
        let releases = topology.shards.iter().flat_map(|s| {
            s.held().into_iter().map(move |lease| {
                let s = s.clone();
                async move {
                    let turn = lease.turn.lock().unwrap().take();
                    let r = release_through_shard(s.clone(), lease.clone(), turn).await;
                    lease.mark_lost("router shut down", &s.shared.stats);
                    r
                }
            })
        });
        let mut first_error = None;
        for r in join_all(releases).await {
            if let Err(e) = r {
                first_error.get_or_insert(e);
            }
        }
        for s in &topology.shards {
            s.shard.close();
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// The caller's end of an attempt in flight (see [`LockRouter::attempt`]).
struct PendingAttempt {
    rx: oneshot::Receiver<std::result::Result<Option<u64>, shardlock_core::BackendError>>,
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
        if let Ok(Ok(Some(_fence))) = self.rx.try_recv() {
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let (shard, key, owner) = (
                    self.shard.clone(),
                    std::mem::take(&mut self.key),
                    std::mem::take(&mut self.owner),
                );
                runtime.spawn(async move {
                    let _ = shard.shard.release(&key, &owner).await;
                });
            }
        }
    }
}

fn locate(e: ConfigError, text: Option<&str>, path: Option<&Path>) -> ConfigError {
    match text {
        Some(text) => e.located(text, path),
        None => e,
    }
}

/// `<host>-<pid>-<random>`: unique per process start, readable in `inspect`.
fn auto_instance_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().replace(':', "-"))
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "host".to_owned());
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        rand::random::<u16>()
    )
}
