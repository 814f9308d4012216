//! The lease cleaner and fenced force-release.
//!
//! Rows of released locks, and leases that ended without a release (their holder crashed),
//! stay in `shardlock_lease`: the first keep fences rising, the second are taken over by the
//! next acquire. The cleaner removes them so tables stay small, without ever touching a live
//! lease: a row goes only when its lease ended longer than `cleaner.grace` ago, when the shard
//! clock has passed its fence (so the key's next grant, floored at the clock, still gets a
//! larger fence), and — for a lease that was never released — when the instance registry says
//! its holder is dead. Every condition is checked again by the `DELETE` itself.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::join_all;
use shardlock_core::config::{CleanerConfig, RegistryKind};
use shardlock_core::{BackendError, BackendErrorKind, Error, LockKey, Result};
use shardlock_mysql::{InstanceRow, LeaseRow};

use crate::registry::{InstanceRegistry, StaticRegistry};
use crate::shard::ShardState;
use crate::{AcquireOptions, Leadership, LockGuard, LockRouter};

/// The key of the lock that elects the one cleaner of a deployment.
pub const CLEANER_LOCK_KEY: &str = "shardlock:cleaner";

/// How far the shard clock must have passed a row's fence before the row may go: covers a
/// clock stepping back a little (NTP) between the scan and the next grant.
const FENCE_MARGIN: Duration = Duration::from_secs(1);

/// What one cleaning pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CleanerReport {
    /// This router's pass number (1, 2, ...).
    pub pass: u64,
    /// Whether this instance held the cleaner lock and cleaned; `false`: another instance is
    /// the cleaner, nothing was touched.
    pub leader: bool,
    /// Per shard, when leader.
    pub shards: Vec<ShardCleaned>,
}

impl CleanerReport {
    /// Rows deleted in the pass, all shards and reasons together.
    pub fn deleted(&self) -> u64 {
        self.shards.iter().map(|s| s.released + s.abandoned).sum()
    }
}

/// What a pass did on one shard.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardCleaned {
    /// The shard.
    pub shard: String,
    /// Rows of released locks deleted.
    pub released: u64,
    /// Leases of dead instances deleted (ended without a release).
    pub abandoned: u64,
    /// Ended leases kept because the registry says their holder still lives (acquire may
    /// still take them over).
    pub kept_live_holder: u64,
    /// Ended rows passed over because another session held their row lock (a console's open
    /// transaction): left to a later pass instead of waited for.
    pub in_use: u64,
    /// Ended leases kept because the registry could not say whether their holder lives (its
    /// first error is in `error`; the pass went on through the shard, without asking a
    /// registry that did not answer in time again).
    pub unjudged: u64,
    /// Batches: scans of at most `cleaner.batch-size` rows, and up to two deletes each.
    pub batches: u64,
    /// Registry rows of instances silent longer than `cleaner.instance-retention`, deleted.
    pub instances_forgotten: u64,
    /// Why the pass stopped early on this shard, if it did, or the first error of the
    /// registry it went on after (see `unjudged`).
    pub error: Option<String>,
}

/// A stuck lock removed by [`LockRouter::force_release`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ForceReleased {
    /// The shard that held it.
    pub shard: String,
    /// The evicted owner.
    pub owner: String,
    /// Whether its lease was still live (not expired) when removed.
    pub was_live: bool,
    /// The key's fence now: above every fence the evicted holder had.
    pub fence: u64,
}

impl LockRouter {
    /// Makes the cleaner ask `registry` instead of the one configured under
    /// `cleaner.registry`.
    pub fn set_registry(&self, registry: Arc<dyn InstanceRegistry>) {
        *self.inner.cleaner.registry.write().unwrap() = Some(registry);
    }

    /// One cleaning pass over every shard, if this instance is the cleaner: it holds (or now
    /// takes) the cleaner lock, so only one instance of a deployment deletes at a time. It
    /// keeps the lock between passes; another instance's pass reports `leader: false`. An
    /// error when the cleaner lock could not be tried (its shard unavailable, this router not
    /// joined to its fleet): no pass ran here, and none may run elsewhere.
    ///
    /// Per shard, rows are scanned in key order and deleted in batches of
    /// `cleaner.batch-size` rows examined, with `cleaner.batch-pause` after each batch with
    /// rows to delete. A shard that fails
    /// is reported and skipped.
    ///
    /// Cancellation: rows already deleted stay deleted and a delete in flight may still commit
    /// (each rechecks every condition itself); a shard's fence floor may have been raised. A
    /// cleaner lock won stays held for the next pass, as after a completed one.
    pub async fn clean_once(&self) -> Result<CleanerReport> {
        let pass = self.inner.cleaner.passes.fetch_add(1, Ordering::Relaxed) + 1;
        let mut leader = self.inner.cleaner.leader.lock().await;
        if !leader.as_ref().is_some_and(Leadership::is_leader) {
            // A lost leadership's release holds the key's turn in process until its shard
            // answers: let go first, or the try below finds the key taken by it.
            if let Some(lost) = leader.take() {
                let _ = lost.resign().await;
            }
            // Tried through its shard: when that cannot be (the shard unavailable, this
            // router not joined to its fleet), the pass fails, rather than say that another
            // instance cleans while maybe none does.
            let once = AcquireOptions::new().wait(std::time::Duration::ZERO);
            match self.lead(CLEANER_LOCK_KEY, once).await {
                Ok(Some(leadership)) => *leader = Some(leadership),
                Ok(None) => {
                    return Ok(CleanerReport {
                        pass,
                        leader: false,
                        shards: Vec::new(),
                    })
                }
                Err(e) => return Err(e),
            }
        }
        let guard = leader.as_ref().expect("elected above").guard();
        let topology = self.inner.topology.load_full();
        let config = topology.config.cleaner.clone();
        let registry = self.registry(&config);
        let mut shards = Vec::new();
        // Not a shard that left and was drained: its rows are not this fleet's any more.
        for shard in topology.all_shards().iter().filter(|s| !s.is_closed()) {
            shards.push(clean_shard(shard, &config, &registry, guard).await);
        }
        let report = CleanerReport {
            pass,
            leader: true,
            shards,
        };
        tracing::info!(
            pass,
            deleted = report.deleted(),
            "shardlock cleaner pass done"
        );
        Ok(report)
    }

    /// Runs [`LockRouter::clean_once`] every `cleaner.interval` until `stop` completes (also
    /// during a pass, which then ends where it is), handing each report to `on_report`; then
    /// gives the cleaner lock back. Errors of a pass are logged and the next pass runs as
    /// planned. Ends too once another process took this router's instance id over
    /// ([`LockRouter::is_replaced`]): no pass could run again.
    ///
    /// Cancellation: as for [`LockRouter::clean_once`] during a pass. Dropped instead of ended by
    /// `stop`, it does not give the cleaner lock back: this router keeps holding (and renewing) it,
    /// so no other instance cleans until this one shuts down or is dropped.
    pub async fn run_cleaner(
        &self,
        stop: impl std::future::Future<Output = ()>,
        mut on_report: impl FnMut(&CleanerReport),
    ) {
        self.run_cleaner_passes(stop, |pass| {
            if let Ok(report) = pass {
                on_report(report);
            }
        })
        .await
    }

    /// [`LockRouter::run_cleaner`], handing `on_pass` every pass's outcome, the failed ones'
    /// errors too (they are logged as well): what a daemon whose output a script reads says
    /// of a pass that could not run (the cleaner lock's shard down, say).
    ///
    /// Cancellation: as for [`LockRouter::run_cleaner`].
    pub async fn run_cleaner_passes(
        &self,
        stop: impl std::future::Future<Output = ()>,
        mut on_pass: impl FnMut(std::result::Result<&CleanerReport, &Error>),
    ) {
        tokio::pin!(stop);
        loop {
            // `stop` ends a pass under way too (see `clean_once` on cancellation): a pass over
            // millions of rows may outlast a service manager's stop timeout, whose kill would
            // leave the cleaner lock and this instance's registry row to time out.
            let pass = tokio::select! {
                _ = &mut stop => break,
                pass = self.clean_once() => pass,
            };
            if let Err(e) = &pass {
                tracing::error!(error = %shardlock_core::Report(e), "shardlock cleaner pass failed");
            }
            on_pass(pass.as_ref());
            let interval = self.config().cleaner.interval;
            tokio::select! {
                _ = &mut stop => break,
                () = self.inner.gate.replaced() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
        if let Some(leadership) = self.inner.cleaner.leader.lock().await.take() {
            let _ = leadership.resign().await;
        }
    }

    /// Removes a stuck lock: frees `key` whoever holds it and raises its fence above every
    /// fence the holder had, so the holder's writes through [`crate::fenced_exec`] are
    /// rejected once a new holder has written, and the holder sees
    /// [`LockGuard::lost`] at its next renewal (a lease that is not renewed, with
    /// `keep_alive(false)` or `lock_at_most`, only at its end: until then only `fenced_exec`
    /// stops its writes). `None` when nobody holds the key.
    ///
    /// The key is freed on every shard of this router's config where it is held: on the shards
    /// it lived on before while a reload's move is in progress (where a process that has not
    /// reloaded may hold it), and on the others too (a process of another topology, or a
    /// fleet's move this router does not know of: an operator's tool run with the new config
    /// or the old one). The answer is the release on its current shard if it was held there,
    /// else the first other one ([`LockRouter::force_release_everywhere`] answers them all).
    /// `key` is the lock's whole name, as [`LockRouter::list`] shows it: no namespace's
    /// prefix is added ([`LockRouter::scoped_key`] names a namespace's lock, or a bucket).
    ///
    /// An error from a shard where the key lives comes after the key was freed on every other
    /// shard that answered: it names each holder evicted there.
    ///
    /// Cancellation: a release that reached a shard may have committed (holder evicted, fence
    /// raised) unreported; calling again answers `None` there, or evicts whoever took the key
    /// since.
    pub async fn force_release(&self, key: &str) -> Result<Option<ForceReleased>> {
        Ok(self.force_release_of(key, None).await?.into_iter().next())
    }

    /// [`LockRouter::force_release`], answering every shard where the key was released (its
    /// current shard first).
    ///
    /// Cancellation: as for [`LockRouter::force_release`].
    pub async fn force_release_everywhere(&self, key: &str) -> Result<Vec<ForceReleased>> {
        self.force_release_of(key, None).await
    }

    /// Every shard of this router's config where `key`'s row has an owner (its current shard
    /// first, then those it lived on before, then the others), and that row: what
    /// [`LockRouter::force_release`] would free. A shard where the key does not live that does
    /// not answer is passed over (warned of); the key's own shards must answer.
    ///
    /// Cancellation: reads only; nothing changes.
    pub async fn holders(&self, key: &str) -> Result<Vec<(String, LeaseRow)>> {
        self.holders_of_key(&LockKey::new(key)?).await
    }

    /// [`LockRouter::holders`] of a lock already named: see [`LockRouter::scoped_key`].
    ///
    /// Cancellation: reads only; nothing changes.
    pub async fn holders_of_key(&self, key: &LockKey) -> Result<Vec<(String, LeaseRow)>> {
        Ok(self.search_holders(key).await?.held)
    }

    /// Whether the live instances of this router's fleet (by the heartbeat registry, whatever
    /// this router's own `cleaner.registry`) run another topology than its config, or move
    /// keys after a reload: then a key may be held where this router does not look. What
    /// an operator tool checks before it says who holds a key or evicts one. `None` when
    /// they all run it; otherwise which do not, or why the registry could not be read.
    ///
    /// Cancellation: reads only; nothing changes.
    pub async fn fleet_disagreement(&self) -> Option<String> {
        let topology = self.inner.topology.load_full();
        crate::registry::tool_disagreement(&topology, &self.inner.shared).await
    }

    /// [`LockRouter::holders_of_key`], saying which shards where the key does not live did
    /// not answer: a holder under another config may be there unseen (what an operator
    /// deciding that nobody holds a key must be told).
    ///
    /// Cancellation: reads only; nothing changes.
    pub async fn search_holders(&self, key: &LockKey) -> Result<HolderSearch> {
        let mut found = HolderSearch::default();
        for (shard, placed) in self.shards_holding(key) {
            let row = match shard.unguarded().inspect(key.stored()).await {
                Ok(row) => row,
                Err(e) if !placed => {
                    passed_over(&shard, &e);
                    let why = shardlock_core::Report(&e).to_string();
                    found.unread.push((shard.name().to_owned(), why));
                    continue;
                }
                Err(e) => return Err(e.into_error(shard.name())),
            };
            if let Some(row) = row.filter(|r| r.owner.is_some()) {
                found.held.push((shard.name().to_owned(), row));
            }
        }
        Ok(found)
    }

    /// Where a row of `key` may be held, each database once: its current shard and those it
    /// lived on before (a move in force), marked `true`; then every other shard of the config.
    fn shards_holding(&self, key: &LockKey) -> Vec<(Arc<ShardState>, bool)> {
        let topology = self.inner.topology.load_full();
        let mut shards = vec![(topology.locate(key).clone(), true)];
        shards.extend(
            topology
                .previous_locations(key)
                .into_iter()
                .map(|s| (s, true)),
        );
        for shard in topology.all_shards() {
            if !shards.iter().any(|(s, _)| s.same_database(&shard)) {
                shards.push((shard, false));
            }
        }
        shards
    }

    /// [`LockRouter::force_release`], only if `owner` holds `key`: what an operator who looked
    /// at the holder (`inspect`) and confirmed it should evict, rather than whoever took the
    /// key since. `None` when `owner` holds it nowhere (released, or evicted, meanwhile).
    ///
    /// Cancellation: as for [`LockRouter::force_release`].
    pub async fn force_release_owner(
        &self,
        key: &str,
        owner: &str,
    ) -> Result<Option<ForceReleased>> {
        Ok(self
            .force_release_of(key, Some(owner))
            .await?
            .into_iter()
            .next())
    }

    /// [`LockRouter::force_release_owner`], answering every shard where `owner`'s row of the
    /// key was released (a lease of a moved key has rows on several).
    ///
    /// Cancellation: as for [`LockRouter::force_release`].
    pub async fn force_release_owner_everywhere(
        &self,
        key: &str,
        owner: &str,
    ) -> Result<Vec<ForceReleased>> {
        self.force_release_of(key, Some(owner)).await
    }

    async fn force_release_of(&self, key: &str, owner: Option<&str>) -> Result<Vec<ForceReleased>> {
        self.force_release_in(&LockKey::new(key)?, owner).await
    }

    /// [`LockRouter::force_release_everywhere`] of a lock already named: see
    /// [`LockRouter::scoped_key`].
    ///
    /// Cancellation: as for [`LockRouter::force_release`].
    pub async fn force_release_key_everywhere(&self, key: &LockKey) -> Result<Vec<ForceReleased>> {
        self.force_release_in(key, None).await
    }

    /// [`LockRouter::force_release_owner_everywhere`] of a lock already named: see
    /// [`LockRouter::scoped_key`].
    ///
    /// Cancellation: as for [`LockRouter::force_release`].
    pub async fn force_release_owner_key_everywhere(
        &self,
        key: &LockKey,
        owner: &str,
    ) -> Result<Vec<ForceReleased>> {
        self.force_release_in(key, Some(owner)).await
    }

    /// Releases on the key's own shards (which must answer: the first error is returned),
    /// then on the others that answer. Every shard is tried: an error says what was released
    /// on the others, so that an operator knows who was evicted.
    async fn force_release_in(
        &self,
        key: &LockKey,
        owner: Option<&str>,
    ) -> Result<Vec<ForceReleased>> {
        let (mut released, mut failed) = (Vec::new(), None);
        for (shard, placed) in self.shards_holding(key) {
            match force_release_on(&shard, key, owner).await {
                Ok(one) => released.extend(one),
                Err(e) if !placed => passed_over(&shard, &e),
                Err(e) => match &failed {
                    None => failed = Some(e),
                    Some(_) => {
                        tracing::warn!(shard = shard.name(), error = %shardlock_core::Report(&e), "shardlock could not force-release the key on one of its shards")
                    }
                },
            }
        }
        match failed {
            None => Ok(released),
            Some(e) => Err(released_before(e, &released)),
        }
    }

    /// The instances registered on each shard (`heartbeat` registry), current shards first.
    ///
    /// Cancellation: reads only; nothing changes. A connection dropped mid-statement is discarded
    /// at the pool's next checkout, never reused.
    pub async fn instances(&self) -> Vec<(String, Result<Vec<InstanceRow>>)> {
        let shards = self.inner.topology.load().current.shards.clone();
        join_all(shards.iter().map(|s| async move {
            let rows = s
                .unguarded()
                .instances()
                .await
                .map_err(|e| e.into_error(s.name()));
            (s.name().to_owned(), rows)
        }))
        .await
    }

    fn registry(&self, config: &CleanerConfig) -> Registry {
        if let Some(custom) = self.inner.cleaner.registry.read().unwrap().clone() {
            return Registry::Custom(custom);
        }
        match config.registry {
            RegistryKind::Heartbeat => Registry::Heartbeat(config.heartbeat_timeout),
            RegistryKind::Static => Registry::Custom(Arc::new(StaticRegistry::new(
                config.live_instances.iter().cloned(),
            ))),
        }
    }
}

/// The registry a pass asks.
enum Registry {
    /// The heartbeat table of the shard being cleaned, with this timeout.
    Heartbeat(Duration),
    Custom(Arc<dyn InstanceRegistry>),
}

impl Registry {
    /// Of `owners` (of leases on `shard` that ended), those whose holder is dead. An owner
    /// without an instance id is never.
    async fn dead_owners(
        &self,
        shard: &ShardState,
        owners: Vec<String>,
    ) -> Result<BTreeSet<String>> {
        let instances: Vec<String> = owners
            .iter()
            .filter_map(|o| instance_of(o))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        match self {
            Registry::Custom(registry) => {
                // Bounded as a heartbeat table's read is: a registry that hangs must not stop
                // cleaning for the whole fleet (the pass holds the cleaner lock meanwhile).
                let limit = shard.unguarded().statement_timeout();
                let asked = tokio::time::timeout(limit, registry.dead(shard.name(), &instances));
                let dead: BTreeSet<String> = match asked.await {
                    Ok(dead) => dead?.into_iter().collect(),
                    Err(_) => {
                        return Err(Error::Unavailable {
                            shard: shard.name().to_owned(),
                            source: BackendError::new(
                                BackendErrorKind::Timeout,
                                None,
                                format!(
                                    "the instance registry did not answer within {limit:?} \
                                     (the shard's statement-timeout); nothing was deleted"
                                ),
                            ),
                        })
                    }
                };
                // Such a registry knows ids, not starts: a lease of an earlier start under
                // this router's own id is dead too (this start took the id over), whatever
                // it says of the id.
                let (own_id, own_nonce) = (shard.shared.instance_id.as_str(), shard.shared.nonce());
                let earlier_start = |owner: &String| {
                    instance_of(owner).is_some_and(|i| i == own_id)
                        && nonce_of(owner).is_some_and(|n| n != own_nonce)
                };
                Ok(owners
                    .into_iter()
                    .filter(|o| {
                        instance_of(o).is_some_and(|i| dead.contains(&i)) || earlier_start(o)
                    })
                    .collect())
            }
            Registry::Heartbeat(timeout) => {
                let alive: BTreeMap<String, Option<String>> = shard
                    .call(|b| b.alive_instances(&instances, *timeout))
                    .await
                    .map_err(|e| e.into_error(shard.name()))?
                    .into_iter()
                    .collect();
                // A live row of the id whose start nonce is another's: that start took the id
                // over once the owner's start had counted as dead (silent past its timeout, or
                // deregistered), which has lost its leases since (see `Shared::beaten`).
                let dead = |owner: &String| {
                    let Some(instance) = instance_of(owner) else {
                        return false;
                    };
                    match (alive.get(&instance), nonce_of(owner)) {
                        (None, _) => true,
                        (Some(Some(live)), Some(nonce)) => live != nonce,
                        (Some(_), _) => false,
                    }
                };
                Ok(owners.into_iter().filter(dead).collect())
            }
        }
    }
}

/// One pass over one shard, in batches, while this instance holds the cleaner lock.
async fn clean_shard(
    shard: &ShardState,
    config: &CleanerConfig,
    registry: &Registry,
    leader: &LockGuard,
) -> ShardCleaned {
    let mut out = ShardCleaned {
        shard: shard.name().to_owned(),
        ..ShardCleaned::default()
    };
    let cleaned = clean_batches(shard, config, registry, leader, &mut out).await;
    // No longer the cleaner: another instance may be cleaning now.
    let leading = !matches!(cleaned, Err(Error::LockLost { .. }));
    if let Err(e) = cleaned {
        out.error = Some(shardlock_core::Report(&e).to_string());
    }
    let forgotten = match leading {
        true => Some(
            shard
                .call(|b| b.forget_instances(config.instance_retention))
                .await,
        ),
        false => None,
    };
    match forgotten {
        Some(Ok(n)) => out.instances_forgotten = n,
        Some(Err(e)) if out.error.is_none() => {
            out.error = Some(e.into_error(shard.name()).report().to_string())
        }
        _ => {}
    }
    shard
        .shared
        .telemetry
        .cleaned(&out.shard, out.released, out.abandoned);
    if out.released + out.abandoned + out.instances_forgotten > 0 {
        tracing::info!(
            shard = %out.shard,
            released = out.released,
            abandoned = out.abandoned,
            instances_forgotten = out.instances_forgotten,
            "shardlock cleaner deleted rows"
        );
    }
    out
}

async fn clean_batches(
    shard: &ShardState,
    config: &CleanerConfig,
    registry: &Registry,
    leader: &LockGuard,
    out: &mut ShardCleaned,
) -> Result<()> {
    let name = shard.name();
    let backend = |e: shardlock_core::BackendError| e.into_error(name);
    let (grace, batch) = (config.grace, config.batch_size);
    let mut after = Vec::new();
    // A registry that did not answer in time is asked no more in this pass: each batch would
    // cost its timeout, and a pass over millions of rows hours, holding the cleaner lock.
    let mut registry_hung = false;
    // The fence floor this pass raised the shard's to (it only rises).
    let mut floor = 0;
    loop {
        if !leader.is_held() {
            return Err(Error::LockLost {
                key_label: CLEANER_LOCK_KEY.into(),
            });
        }
        // At most a batch of rows examined per statement, whatever they hold (see
        // `Shard::cleanup_candidates`).
        let scanned = shard
            .call(|b| b.cleanup_candidates(&after, grace, FENCE_MARGIN, batch))
            .await
            .map_err(backend)?;
        if scanned.examined == 0 {
            return Ok(());
        }
        out.batches += 1;
        let rows = scanned.candidates;
        // The shard's fence floor first: a deleted row's fence must bound the key's next
        // grant even if the shard's clock steps back. (A row granted again since the scan
        // is not deleted; the floor is then merely higher than needed.) As seldom and as
        // briefly as can be: a raise waits for an exclusive lock on the floor's row, which
        // every acquire of the shard reads under a shared one for its whole statement, a wait
        // for its own row included; while one raise waits behind such an acquire, every other
        // acquire of the shard waits behind the raise. So it is raised to the scan's horizon,
        // above every fence found: the rows of later batches, whose leases ended longer than
        // the grace ago, have fences below it but for a hot key's that ran ahead of the clock,
        // and a pass raises it once (a raise per batch repeated the stall batch after batch).
        // And a second at most is waited for it: the rest of the shard is left to the next
        // pass rather than every acquire held up for the server's whole lock wait.
        let highest = rows.iter().map(|r| r.fence).max().unwrap_or(0);
        if highest > floor {
            let raise = scanned.horizon.max(highest);
            match shard
                .call_row_waited(|b| b.raise_shard_floor_briefly(raise))
                .await
            {
                Ok(()) => floor = raise,
                Err(e) if e.kind == BackendErrorKind::LockWaitTimeout => {
                    out.error = Some(format!(
                        "the fence floor of shard {name} stayed locked for a second (an acquire \
                         waiting behind another transaction's lock on its row holds it): the \
                         rest of the shard is left to the next pass"
                    ));
                    return Ok(());
                }
                Err(e) => return Err(backend(e)),
            }
        }
        let (released, ended): (Vec<_>, Vec<_>) = rows.iter().partition(|r| r.owner.is_none());
        let released: Vec<Vec<u8>> = released.into_iter().map(|r| r.key.clone()).collect();
        if !released.is_empty() {
            let deleted = shard
                .call(|b| b.delete_ended(&released, None, grace, FENCE_MARGIN, highest))
                .await
                .map_err(backend)?;
            out.released += deleted.rows;
            out.in_use += deleted.in_use;
        }
        // Released by their holders, kept only until a minimum hold ended: no registry to
        // ask (their holders may live on, and kept such rows for as long as they did).
        let (kept, ended): (Vec<_>, Vec<_>) = ended.into_iter().partition(|r| r.kept);
        if !kept.is_empty() {
            let deleted = delete_owned(shard, &kept, grace, highest).await?;
            out.released += deleted.rows;
            out.in_use += deleted.in_use;
        }
        let owners: BTreeSet<String> = ended.iter().filter_map(|r| r.owner.clone()).collect();
        let judged = match ended.is_empty() {
            true => None,
            false if registry_hung => {
                out.unjudged += ended.len() as u64;
                None
            }
            false => match registry
                .dead_owners(shard, owners.into_iter().collect())
                .await
            {
                Ok(dead) => Some(dead),
                // Kept, and on to the next batch: a registry that cannot judge these owners
                // (a column or a grant missing, a registry of one's own failing) must not stop
                // the shard's cleaning at the first ended lease in key order, pass after pass.
                Err(e) => {
                    registry_hung = matches!(
                        &e,
                        Error::Unavailable { source, .. } if source.kind == BackendErrorKind::Timeout
                    );
                    out.unjudged += ended.len() as u64;
                    let why = shardlock_core::Report(&e).to_string();
                    out.error.get_or_insert(why);
                    None
                }
            },
        };
        if let Some(dead) = judged {
            let (doomed, spared): (Vec<_>, Vec<_>) = ended
                .into_iter()
                .partition(|r| r.owner.as_ref().is_some_and(|o| dead.contains(o)));
            out.kept_live_holder += spared.len() as u64;
            let deleted = delete_owned(shard, &doomed, grace, highest).await?;
            out.abandoned += deleted.rows;
            out.in_use += deleted.in_use;
        }
        let Some(next) = scanned.next else {
            return Ok(());
        };
        after = next;
        // After a batch with rows to delete: a scan alone is a primary-key range read, and a
        // pause after each would make a pass over millions of live leases take minutes.
        if !rows.is_empty() {
            tokio::time::sleep(config.batch_pause).await;
        }
    }
}

/// Deletes `rows` of `shard` that still carry their owner (owner-checked; every condition of
/// the scan re-checked on the row), after the fence floor was raised to `highest`.
async fn delete_owned(
    shard: &ShardState,
    rows: &[&shardlock_mysql::Candidate],
    grace: Duration,
    highest: u64,
) -> Result<shardlock_mysql::Deleted> {
    let keys: Vec<Vec<u8>> = rows.iter().map(|r| r.key.clone()).collect();
    let owners: Vec<String> = rows.iter().filter_map(|r| r.owner.clone()).collect();
    shard
        .call(|b| b.delete_ended(&keys, Some(&owners), grace, FENCE_MARGIN, highest))
        .await
        .map_err(|e| e.into_error(shard.name()))
}

/// The instance id of an owner (`<instance id>:<start nonce>:<grant seq>`; before the nonce,
/// `<instance id>:<grant seq>`). Instance ids have no `:`.
fn instance_of(owner: &str) -> Option<String> {
    owner
        .split_once(':')
        .map(|(instance, _)| instance.to_owned())
}

/// The start nonce of an owner, if it has one (see [`instance_of`]).
fn nonce_of(owner: &str) -> Option<&str> {
    let mut parts = owner.split(':');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(_), Some(nonce), Some(_), None) => Some(nonce),
        _ => None,
    }
}

/// [`LockRouter::force_release`] on one shard, of `expected`'s lease only if given.
/// Warns of a shard where a key does not live that did not answer a look for its rows.
/// Where [`LockRouter::search_holders`] found a key held, and where it could not look.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct HolderSearch {
    /// Each shard holding a row of the key with an owner (held, or ended and not yet freed).
    pub held: Vec<(String, LeaseRow)>,
    /// Shards where the key does not live under this config that did not answer, with the
    /// error.
    pub unread: Vec<(String, String)>,
}

fn passed_over(shard: &ShardState, e: &(dyn std::error::Error + 'static)) {
    tracing::warn!(shard = shard.name(), error = %shardlock_core::Report(e), "shardlock could not look for the key on a shard where it does not live; passed over");
}

/// `e`, a force-release's failure on one of its key's own shards, saying what `released` on
/// the others.
fn released_before(e: Error, released: &[ForceReleased]) -> Error {
    if released.is_empty() {
        return e;
    }
    let done = released
        .iter()
        .map(|r| {
            format!(
                "on shard {} (owner {} evicted, fence now {})",
                r.shard, r.owner, r.fence
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    crate::shard::done_before(e, format!("the key was force-released {done}"))
}

async fn force_release_on(
    shard: &ShardState,
    key: &LockKey,
    expected: Option<&str>,
) -> Result<Option<ForceReleased>> {
    let name = shard.name().to_owned();
    let backend = |e: shardlock_core::BackendError| e.into_error(&name);
    // The holder may change between the look and the release: look again, a few times (once
    // for an expected owner: another is never evicted).
    for _ in 0..3 {
        let row = shard
            .unguarded()
            .inspect(key.stored())
            .await
            .map_err(backend)?;
        let Some((owner, row)) = row.and_then(|r| Some((r.owner.clone()?, r))) else {
            return Ok(None);
        };
        // A row kept past its release is found under its copy's name on a shard a move
        // carried it to: that is the same hold.
        if expected.is_some_and(|o| o != owner && crate::moves::kept_copy_owner(o) != owner) {
            return Ok(None);
        }
        let released = shard
            .unguarded()
            .force_release(key.stored(), &owner, row.fence)
            .await
            .map_err(backend)?;
        if let Some(fence) = released {
            tracing::warn!(shard = %name, key = shard.shared.telemetry.key_label(key), owner = %owner, "shardlock lock force-released");
            return Ok(Some(ForceReleased {
                shard: name,
                owner,
                was_live: row.is_held(),
                fence,
            }));
        }
        if expected.is_some() {
            return Ok(None);
        }
    }
    Err(Error::Backend {
        shard: name,
        source: shardlock_core::BackendError::new(
            BackendErrorKind::Other,
            None,
            "the key changed hands three times while being force-released; try again",
        ),
    })
}
