//! Leases whose key moved in a reload follow it: the holder takes the key on its new shard as
//! well, so that the lease is visible where every process looks once the move window is over.
//!
//! The move window only bounds how long processes that have not reloaded yet are tolerated
//! (they still place the key on its old shard, where this lease stays held). It never bounds
//! the life of a lease: a lease granted before a reload is taken on the key's new shard, with
//! a fence above every fence it reserved, within half the window; if that cannot be done (the
//! new shard does not answer, or someone else holds the key there all that time), the lease is
//! reported lost instead; so is one whose try of unknown outcome may have taken the key there
//! in a row that ran out unrenewed. Either way nobody is left believing it holds a key that
//! another process can take.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::future::BoxFuture;
use shardlock_core::{BackendError, BackendErrorKind, Backoff, LockKey};
use shardlock_mysql::{Attempt, CasGiveBack, CasRow, GrantRequest, FLOOR_BATCH};

use crate::clock::Moment;
use crate::queue::Want;
use crate::registry;
use crate::shard::ShardState;
use crate::shard::{Grant, LeaseState};
use crate::state::Inner;
use crate::topology::{Previous, Topology};

/// Makes `lease` (held on `shard`) visible where its key lives under the topology in force,
/// in a task of its own. Several calls for one lease run one after the other; each does
/// nothing once the lease is placed under the newest epoch.
pub(crate) fn follow(router: Weak<Inner>, shard: Arc<ShardState>, lease: Arc<LeaseState>) {
    let shared = shard.shared.clone();
    shared.spawn(async move {
        let _one_at_a_time = lease.following.lock().await;
        let Some(topology) = router.upgrade().map(|inner| inner.topology.load_full()) else {
            return;
        };
        if lease.placed_epoch.load(Ordering::Acquire) >= topology.epoch || lease.is_lost() {
            return;
        }
        let target = topology.locate(&lease.key).clone();
        // Held in process, with no row: the keeper would re-acquire it where the key no
        // longer lives. It ends, visibly, for the processes that take the key where it lives
        // now (its holder keeps the key's turn here until it lets go). So it does when its
        // shard now connects otherwise (a new URL for the same database, new credentials):
        // the keeper of the old state would go on trying its old address, with its old
        // breaker, which nothing shows any more, while other processes take the key through
        // the new one. (A state rebuilt for its pool or timeouts alone keeps it.)
        let elsewhere = !target.same_database(&shard) || !target.connects_like(&shard);
        if elsewhere && shard.remove_local(lease.id) {
            let why = match target.same_database(&shard) {
                true => "its shard got another address in a reload while it was held in process",
                false => "its key moved in a reload while it was held in process",
            };
            // Released so, before its holder hears of the loss: its guard's release sends
            // nothing and answers that it was lost (not the old shard's outage, should it
            // still be down).
            lease.release_claimed.store(true, Ordering::Release);
            lease.mark_lost(why, &shard.shared);
            // A re-acquire whose reply was lost may have taken the row (see `end_hold`).
            if lease.maybe_on_shard.swap(false, Ordering::SeqCst) {
                let key = lease.key.stored().to_vec();
                shard.give_back(key, lease.owner.clone(), lease.row_ttl());
            }
            return;
        }
        let there_already = target.same_database(&shard)
            || lease
                .companion_shards()
                .iter()
                .any(|c| c.same_database(&target));
        if there_already || take_on(&shard, &lease, &target, &topology).await {
            lease
                .placed_epoch
                .fetch_max(topology.epoch, Ordering::AcqRel);
        }
    });
}

/// Every lease registered on this router's shards that was placed under an epoch older than
/// `topology`'s follows its key.
pub(crate) fn follow_all(router: &Arc<Inner>, topology: &Topology) {
    for shard in router.shared.shard_states() {
        for lease in shard.held().into_iter().chain(shard.locals()) {
            if !lease.is_companion() && lease.placed_epoch.load(Ordering::Acquire) < topology.epoch
            {
                follow(Arc::downgrade(router), shard.clone(), lease);
            }
        }
    }
}

/// Takes `lease`'s key on `target` as a companion row (under the lease's own owner, so the
/// two rows are recognisably one lease), retrying until half the move window after the reload
/// has passed. On failure the lease is reported lost and its rows are given back. Whether the
/// lease now holds the key on `target`.
async fn take_on(
    shard: &Arc<ShardState>,
    lease: &Arc<LeaseState>,
    target: &Arc<ShardState>,
    topology: &Topology,
) -> bool {
    let shared = &shard.shared;
    let deadline = topology.reloaded_at + topology.config.move_window() / 2;
    let id = shared.next_id();
    let req = GrantRequest {
        key: lease.key.stored().to_vec(),
        owner: lease.owner.clone(),
        ttl_ms: u32::try_from(lease.ttl.as_millis()).unwrap_or(u32::MAX),
        fence_floor: lease.fence_top(),
        reserve: 0,
        trace: None,
    };
    let mut backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(200));
    let mut tried = false;
    // When the first try whose outcome is unknown was sent (its reply lost or still to come;
    // a row lock waited out, or someone else's row found, after a lost reply): the row it may
    // have taken counts as this lease's on the new shard (the fleet's move may end on it),
    // unrenewed, until its ttl runs out. Up to then, an answer that someone else holds the
    // key, with no lost try before it, proves no try took it;
    // past then, another process may have taken the key there alone, and the lease is lost,
    // whatever a try answers later (or does not).
    let mut unknown_since: Option<Moment> = None;
    let mut ran_out = false;
    // A try whose reply was lost to give back once the lease is lost: given back before, the
    // row another process's carry counted as this lease's would be freed while the lease
    // still said it held.
    let mut give_back = false;
    let runs_out = |since: Moment| {
        Want::end_by(
            since,
            lease.ttl,
            lease.want.drift_ppm.max(shared.drift_ppm()),
            lease.want.clock_skew.max(target.leases_skew()),
        )
    };
    let why = loop {
        if lease.is_lost() || lease.has_ended() {
            if tried {
                // A try whose reply was lost may have taken the row: give it back.
                give_back_try(target, &req, lease.ttl, lease.at_least()).await;
            }
            return false;
        }
        let sent = Moment::now();
        tried = true;
        // The lease ends by then on the spot (`is_held`), should this task be late.
        let end = runs_out(unknown_since.unwrap_or(sent));
        lease.end_by_unheard_row(Some(end));
        // The same request on every try: a retry after a lost reply finds its own row.
        let answered = before(end, target.acquire(&req)).await;
        let Some(answer) = answered else {
            // The try (this one, or one before) may have taken the key there, and run out.
            ran_out = true;
            break crate::shard::UNHEARD_ROW;
        };
        match answer {
            Ok(Attempt::Granted {
                fence,
                after_lost_try,
            }) => {
                let want = Want {
                    handoff_max_count: 0,
                    handoff_max_time: Duration::ZERO,
                    clock_skew: lease.want.clock_skew.max(target.clock_skew()),
                    ..lease.want
                };
                let grant = Grant {
                    id,
                    owner: req.owner.clone(),
                    fence,
                    reserve: 0,
                    sent,
                    // This try's, or an earlier one's of the same request, unanswered.
                    lost_try: after_lost_try || unknown_since.is_some(),
                };
                let companion = Arc::new(
                    LeaseState::new(lease.key.clone(), grant, want, Duration::ZERO, None)
                        .belonging_to(lease),
                );
                let at_least = lease.at_least();
                if let Some(at_least) = at_least {
                    companion.set_at_least(at_least, target);
                }
                // Renewed, and its end counted, before anything else is awaited.
                target.insert(companion.clone());
                if !lease.adopt(target.clone(), companion.clone()) {
                    // Released (or lost) meanwhile: give the row back.
                    target.remove(companion.id);
                    give_back_try(target, &req, lease.ttl, companion.at_least()).await;
                    companion.give_back_lost_try(target);
                    return false;
                }
                lease.end_by_unheard_row(None);
                // A hold that must outlast its release (a scheduled run) is kept as long on
                // the new shard, from the new row's later grant: also if its holder dies.
                if let Some(at_least) = at_least {
                    let _ = target
                        .call_row(|b| b.hold_until(&req.key, &req.owner, at_least, 0))
                        .await;
                }
                shared.stats.followed.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(
                    key = shared.telemetry.key_label(&lease.key),
                    from = shard.name(),
                    to = target.name(),
                    "shardlock lease followed its key to its new shard"
                );
                return true;
            }
            // Someone else's row there (a process whose move started earlier or later takes
            // the key's shards in another order, and gives back what it took once it finds
            // this lease's row), the shard unreachable, or the row locked by another
            // transaction: again, within the window. Nobody else can hold the key there for
            // good while this lease holds it where it lived: everyone placing the key there
            // takes it here too until the move is over.
            failed => {
                let unknown = match &failed {
                    Err(e) => e.maybe_applied,
                    Ok(Attempt::Locked) => true,
                    Ok(Attempt::Held { after_lost_try, .. }) => *after_lost_try,
                    Ok(Attempt::Granted { .. }) => false,
                };
                if unknown {
                    unknown_since.get_or_insert(sent);
                } else if unknown_since.is_none() {
                    // Answered, with no row taken: nothing unheard to end the lease by.
                    lease.end_by_unheard_row(None);
                }
                // A reload since replaced the topology this follow is for (undone, or moved
                // the key on): the newest one's follow, queued behind this one, takes the key
                // where it lives now, or finds it there already. No try of this one can have
                // landed, so it stops and the lease stays held: before, it kept trying a shard
                // the fleet may no longer place the key on, and was lost at this move's end.
                if unknown_since.is_none() && shared.epoch() > topology.epoch {
                    return false;
                }
                let delay = backoff.next_delay();
                if Moment::now() + delay < deadline {
                    tokio::time::sleep(delay).await;
                    continue;
                }
                if let Ok(Attempt::Held { .. }) = failed {
                    // A try before may still land.
                    give_back = unknown_since.is_some();
                    break "its key moved in a reload and someone else held it on the new shard \
                           for half the move window";
                }
                tracing::warn!(key = shared.telemetry.key_label(&lease.key), to = target.name(), error = ?failed.err(), "shardlock could not take a moved key on its new shard within half the move window");
                // The grant may have been made with its reply lost: give it back.
                give_back = true;
                break "its key moved in a reload and the new shard could not be reached in time";
            }
        }
    };
    // Lost: nobody may take the key on the old shard in this lease's name any more (no
    // renewal, no hand-off); its rows are given back.
    lease.mark_lost(why, shared);
    if ran_out {
        give_back_try(target, &req, lease.ttl, lease.at_least()).await;
    } else if give_back {
        target.give_back(req.key.clone(), req.owner.clone(), lease.ttl);
    }
    // The pools stay open until the rows are released (taken before a row leaves its keeper).
    let _settling = crate::shard::Settling::new(shard);
    if shard.remove(lease.id).is_some() {
        let released = shard
            .release_after(&req.key, &lease.owner, lease.at_least())
            .await;
        crate::guard::retry_if_failed(shard, lease, &released);
        lease.give_back_lost_try(shard);
    }
    for (other, row) in lease.end_companions() {
        let _settling = crate::shard::Settling::new(&other);
        other.remove(row.id);
        let released = other
            .release_after(row.key.stored(), &row.owner, row.at_least())
            .await;
        crate::guard::retry_if_failed(&other, &row, &released);
        row.give_back_lost_try(&other);
    }
    false
}

/// `answer`, or `None` if `end` comes first (looked at again at least every
/// [`crate::clock::SUSPEND_NOTICED_WITHIN`], so that a suspend of the host counts).
async fn before<T>(end: Moment, answer: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::pin!(answer);
    while Moment::now() < end {
        if let Ok(answered) = tokio::time::timeout_at(end.checked_timer(), &mut answer).await {
            // Not if it was taken late (this task starved, the host suspended).
            return (Moment::now() < end).then_some(answered);
        }
    }
    None
}

/// Gives back the row on `target` that a try of a move (`req`) may have taken, for a lease
/// that no longer wants it: owner-checked, in the background and retried until the shard
/// answers (for up to `ttl`), so that a new shard failing at that moment does not leave the
/// key held by nobody for the lease's ttl. A row that must stay taken a while after its grant
/// (`at_least`) is released once, to that: its own end does the same.
async fn give_back_try(
    target: &Arc<ShardState>,
    req: &GrantRequest,
    ttl: Duration,
    at_least: Option<Duration>,
) {
    match at_least {
        None => target.give_back(req.key.clone(), req.owner.clone(), ttl),
        Some(_) => drop(target.release_after(&req.key, &req.owner, at_least).await),
    }
}

/// Once `previous`'s move window is over, copies the fence of every row on its shards to the
/// shards where the row's key lives now (and under every placement that came after it), as the
/// key's floor there. Until that is done, acquires of moved keys keep taking them on
/// `previous`'s shards too, so a fence never goes backwards across a move, whatever the
/// shards' clocks say and however far a key's fences ran ahead of its shard's clock. A shard
/// that cannot be read is retried until it can (its moved keys then keep depending on it).
///
/// The move is not over while a live instance of the fleet advertises another topology than
/// this process's in the registry: one still on `previous`'s has not reloaded and grants moved
/// keys only there, and one that reloaded elsewhere (a chained reload rolling out) takes keys
/// only where its own topology puts them, so this one keeps taking them on the old shards too
/// (and warns, naming it) however long the operator takes. The registry is read again before
/// every try, and a try stops if this process reloaded meanwhile. Nor is it over before every
/// move before it (see [`older_move`]).
///
/// Every process does this for itself; the copies are idempotent (`GREATEST`).
pub(crate) async fn carry_fences(inner: Weak<Inner>, previous: Previous) {
    tokio::time::sleep_until(previous.until.timer()).await;
    // The last reason warned of: each new one is warned of once.
    let mut warned: Option<String> = None;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
    loop {
        let Some(router) = inner.upgrade() else {
            return;
        };
        if router.shared.is_closed() {
            return;
        }
        // Read again before every try: a process may have reloaded since the last one.
        let topology = router.topology.load_full();
        let kept = match older_move(&topology, &previous).or_else(|| own_lag(&router, &topology)) {
            Some(why) => Some(why.to_owned()),
            None => registry::laggards(&topology, &router.shared, &previous).await,
        };
        if let Some(why) = kept {
            router
                .shared
                .stats
                .moves_kept
                .fetch_add(1, Ordering::Relaxed);
            if warned.as_ref() != Some(&why) {
                tracing::warn!(why, "shardlock keeps a move in force past its window");
                warned = Some(why);
            }
            let interval = router.config().cleaner.heartbeat_interval;
            drop((router, topology));
            tokio::time::sleep(interval).await;
            continue;
        }
        previous.carry_begun.store(true, Ordering::Release);
        match carry_once(&router, &previous, topology.epoch).await {
            Ok(carried) => {
                previous.fences_carried.store(true, Ordering::Release);
                router.beat_now.notify_one();
                router
                    .shared
                    .stats
                    .fences_carried
                    .fetch_add(carried, Ordering::Relaxed);
                tracing::info!(
                    carried,
                    "shardlock carried the fences of moved keys to their new shards"
                );
                return;
            }
            Err(e) => {
                router
                    .shared
                    .stats
                    .moves_kept
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %shardlock_core::Report(&e), "shardlock could not carry the fences of moved keys yet; moved keys keep taking their old shards meanwhile")
            }
        }
        drop((router, topology));
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

/// Why this process keeps its own moves in force: one of its transaction locks has not
/// followed its key to the topology in force (its follow still running, or failed while its
/// `COMMIT` may land where it was placed), which it advertises as the others' laggard (see
/// `Inner::advertised`). The registry's list of laggards leaves this process out; ended now,
/// its own next lock of the key would be taken where the key lives alone while that `COMMIT`
/// could still land on the old shard.
fn own_lag(router: &Inner, topology: &Topology) -> Option<&'static str> {
    (router.advertised(topology).0 != topology.fingerprint).then_some(
        "a transaction lock of this process has not followed its key yet (or its COMMIT may \
         still land where it was placed)",
    )
}

/// Why `previous`'s carry waits for a move before it: moves end oldest first. A carry of an
/// older placement may write its rows onto `previous`'s shards (where their keys lived when
/// it began) while this one's scan of them has passed already: a CAS lock's only row, a
/// fence, a queue's jobs, then left where nobody looks once both moves are over. An older
/// carry that began before a reload finishes under the topology it began with (only its CAS
/// copies check the epoch): what it wrote is found by this one, which reads those shards
/// after it. The order holds within each process; a process that lacks the older placement
/// (started, or rejoined, since) grants nothing until its fleet agrees and no move is in
/// force (see [`registry::fleet_disagreement`]).
fn older_move(topology: &Topology, previous: &Previous) -> Option<&'static str> {
    let own = |p: &Previous| Arc::ptr_eq(&p.fences_carried, &previous.fences_carried);
    // Not in the list (it stays there until carried): nothing is known to come before it.
    let at = topology.previous.iter().position(own)?;
    topology.previous[..at]
        .iter()
        .any(|p| !p.fences_carried.load(Ordering::Acquire))
        .then_some("a move before it is not over yet: moves end oldest first")
}

/// Stored keys and the fences they carry.
type Floors = Vec<(Vec<u8>, u64)>;

/// Why a move cannot end yet: something of it is still only on an old shard.
fn not_yet(shard: &ShardState, why: String) -> shardlock_core::Error {
    shardlock_core::Error::Backend {
        shard: shard.name().to_owned(),
        source: shardlock_core::BackendError::new(
            shardlock_core::BackendErrorKind::Other,
            None,
            why,
        ),
    }
}

/// Why a carry that began under one topology stops: a reload came since the registry said the
/// whole fleet runs it (see [`registry::laggards`]), so it is read again before the next try.
const RELOADED_SINCE: &str =
    "a reload came since this carry began: the fleet's topology is checked again first";

/// A backend error of `shard`, named.
fn on(shard: &ShardState) -> impl Fn(shardlock_core::BackendError) -> shardlock_core::Error + '_ {
    move |e| e.into_error(shard.name())
}

/// One pass of [`carry_fences`]: how many floors it wrote. It fails, to be retried, while
/// anything of the move is still only on an old shard: a live lease of a moved key not visible
/// on the key's new shard under the same owner (a process that has not reloaded yet, a lease
/// still following), a job of a moved queue still running there, an owned CAS row of a key
/// whose placement cannot be told (over 255 bytes), or a shard whose identity is unknown (it
/// might be the same database as another: nothing is moved between them).
async fn carry_once(
    router: &Inner,
    previous: &Previous,
    epoch: u64,
) -> shardlock_core::Result<u64> {
    let mut sources: Vec<&Arc<ShardState>> = Vec::new();
    for s in &previous.placement.shards {
        if !sources.iter().any(|o| o.same_database(s)) {
            sources.push(s);
        }
    }
    let topology = router.topology.load_full();
    if let (Some(first), true) = (sources.first(), topology.epoch != epoch) {
        return Err(not_yet(first, RELOADED_SINCE.to_owned()));
    }
    let mut everywhere: Vec<&Arc<ShardState>> = sources.clone();
    everywhere.extend(topology.current.shards.iter());
    everywhere.extend(
        topology
            .previous
            .iter()
            .flat_map(|p| p.placement.shards.iter()),
    );
    futures_util::future::join_all(everywhere.iter().map(|s| s.resolve_identity())).await;
    for source in &sources {
        if let Some(unknown) = everywhere
            .iter()
            .find(|t| !t.same_database(source) && !t.surely_other_database(source))
        {
            return Err(not_yet(
                unknown,
                format!(
                    "its identity (or {}'s) is unknown: nothing is moved until it can be read",
                    source.name()
                ),
            ));
        }
    }
    let mut carried = 0;
    for &source in &sources {
        carried += carry_leases(router, previous, source).await?;
        // Rows the cleaner deleted there had fences below its clock and its floor (raised to
        // a row's fence before it is deleted): that is the floor of every shard its keys may
        // have moved to. Read after the scan: a row deleted while the scan ran was not found
        // by it, and its fence may have been ahead of the clock when the scan began (fences
        // reserved for hand-offs).
        let clock = source
            .call_waiting(|b| b.clock_us())
            .await
            .map_err(on(source))?;
        for target in &topology.current.shards {
            if !target.same_database(source) {
                target
                    .call_waiting(|b| b.raise_shard_floor(clock))
                    .await
                    .map_err(on(target))?;
            }
        }
        carry_cas(router, source, epoch).await?;
        carry_jobs(router, source, JobScope::All)
            .await?
            .done(source)?;
        // This process's last heartbeat there names the topology it moved to. It takes a row
        // as the heartbeat does: not while the router joins its fleet again (see `Beat::take`).
        let advertised = router.advertised(&topology);
        let silent = |shard: &str| router.silence_seen(shard);
        router.notice_lapse();
        let take = !router.gate.is_rejoining();
        registry::beat_before_leaving(
            &topology,
            &advertised,
            &router.shared,
            source,
            take,
            &silent,
        )
        .await
        .map_err(|e| {
            not_yet(
                source,
                format!(
                    "its registry did not take this process's heartbeat of the topology it \
                         moved to: {}",
                    shardlock_core::Report(&e)
                ),
            )
        })?;
        crate::placement_record::names_the_move_on(router, source, &topology)
            .await
            .map_err(|why| not_yet(source, why))?;
    }
    // A job whose move a reload undid half way may sit on a shard this move does not leave: a
    // restart of the whole fleet (onto the config before that reload) replays one placement
    // of the two from the fleet's record, and the shard that marked the job moving is then
    // no source of any move.
    let mut staying: Vec<&Arc<ShardState>> = Vec::new();
    for shard in &topology.current.shards {
        if !(sources.iter().chain(&staying)).any(|o| o.same_database(shard)) {
            staying.push(shard);
        }
    }
    for shard in staying {
        carry_jobs(router, shard, JobScope::UndoneMoves)
            .await?
            .done(shard)?;
    }
    Ok(carried)
}

/// Carries the fences of `source`'s rows to every later placement of their keys (see
/// [`Topology::later_locations`]), and checks that every live lease of a moved key there is
/// also live on the key's current shard under the same owner. How many floors it wrote.
async fn carry_leases(
    router: &Inner,
    previous: &Previous,
    source: &Arc<ShardState>,
) -> shardlock_core::Result<u64> {
    let mut carried = 0;
    let mut uncovered: Vec<(Vec<u8>, String)> = Vec::new();
    // Of them, leases of keys over 255 bytes, kept for as long as they live.
    let mut digests = 0;
    let mut after = Vec::new();
    loop {
        let rows = source
            .call_waiting(|b| b.fences_after(&after, FLOOR_BATCH))
            .await
            .map_err(on(source))?;
        let scanned = Moment::now();
        let Some(last) = rows.last() else { break };
        after.clone_from(&last.key);
        let full = rows.len() == FLOOR_BATCH;
        let topology = router.topology.load_full();
        let mut by_target: Vec<(Arc<ShardState>, Floors)> = Vec::new();
        // Live leases of moved keys, by the shards one of which must show them too.
        let mut live: Vec<Live> = Vec::new();
        for row in rows {
            let placement = LockKey::placement_of_stored(&row.key);
            for target in topology.later_locations(&previous.placement, source, placement) {
                match by_target.iter_mut().find(|(t, _)| Arc::ptr_eq(t, &target)) {
                    Some((_, floors)) => floors.push((row.key.clone(), row.fence)),
                    None => by_target.push((target, vec![(row.key.clone(), row.fence)])),
                }
            }
            let Some(owner) = row.live_owner else {
                continue;
            };
            // Where the key lives now. For a digest (placement unknown) nowhere can tell: the
            // owner's rows on other current shards may be ones its key left earlier (a lease
            // that followed two reloads, its follow to the third still under way), so the
            // lease keeps the move in force until it ends.
            let now: Vec<Arc<ShardState>> = match topology.current_location(&row.key) {
                Some(at) if at.same_database(source) => continue,
                Some(at) => vec![at.clone()],
                None => {
                    digests += 1;
                    Vec::new()
                }
            };
            live.push(Live {
                shards: now,
                key: row.key,
                owner,
                kept: row.kept_for.map(|left| (row.fence, left)),
            });
        }
        for (target, floors) in by_target {
            target
                .call_waiting(|b| b.raise_floors(&floors))
                .await
                .map_err(on(&target))?;
            carried += floors.len() as u64;
        }
        for Live {
            shards,
            key,
            owner,
            kept,
        } in live
        {
            let mut seen = false;
            for shard in &shards {
                // A row its holder released with a minimum hold is renewed by nobody, and
                // followed by nobody: it is copied to where its key lives now, so that the move
                // need not wait for its end, which may be a scheduled interval's (a day, say).
                // The copy's owner is marked as one: no statement of the holder (a give-back
                // of its follow still retrying there, a late release) names it.
                let copy = kept.map(|(fence, left)| (fence, left, kept_copy_owner(&owner)));
                if let Some((fence, left, copy_owner)) = &copy {
                    let left = left.saturating_sub(scanned.elapsed());
                    if !left.is_zero() {
                        let left = kept_margin(left, source, shard, router.shared.drift_ppm());
                        shard
                            .call_waiting(|b| b.keep_moved(&key, copy_owner, *fence, left))
                            .await
                            .map_err(on(shard))?;
                    }
                }
                let there = shard
                    .call_waiting(|b| b.live_owners(vec![key.clone()]))
                    .await
                    .map_err(on(shard))?;
                let copied = copy
                    .as_ref()
                    .map(|(.., c)| c)
                    .filter(|c| there.iter().any(|(_, o)| o == *c));
                if let Some(copy_owner) = copied {
                    give_back_copy_of_ended(source, shard, &key, &owner, copy_owner).await?;
                    seen = true;
                    break;
                }
                if there.iter().any(|(_, o)| *o == owner)
                    || (kept.is_some() && there.iter().any(|(_, o)| same_kept_hold(o, &owner)))
                {
                    seen = true;
                    break;
                }
            }
            if !seen {
                uncovered.push((key, owner));
            }
        }
        if !full {
            break;
        }
    }
    if let Some((key, owner)) = uncovered.first() {
        return Err(not_yet(
            source,
            format!(
                "{} lease(s) of moved keys are live there and not on their new shard (e.g. \
                 key `{}` held by {owner}), {digests} of them of keys over 255 bytes, whose \
                 rows cannot tell where their keys live now: a process that has not reloaded \
                 yet? The move stays in force until they end",
                uncovered.len(),
                source.shared.telemetry.stored_key_label(key),
            ),
        ));
    }
    Ok(carried)
}

/// The owner of the copy of a row kept past its release (see [`carry_leases`]): the row's
/// own, marked, once (a copy carried on by a later move keeps its name). Owners end with a
/// grant number, so no grant's owner ends with the mark.
pub(crate) fn kept_copy_owner(owner: &str) -> String {
    if owner.ends_with(KEPT_MARK) {
        owner.to_owned()
    } else {
        format!("{owner}{KEPT_MARK}")
    }
}

/// What marks the owner of a kept row's copy.
const KEPT_MARK: &str = "~kept";

/// Whether `found` holds the same kept hold as `owner`, the one or the other its copy (a move
/// back to a shard the row was copied from finds the row there as it was).
fn same_kept_hold(found: &str, owner: &str) -> bool {
    found.strip_suffix(KEPT_MARK) == Some(owner) || owner.strip_suffix(KEPT_MARK) == Some(found)
}

/// How long the copy of a kept row that had `left` on `source` by its clock stays taken on
/// `target`: longer by what the two clocks may drift apart meanwhile (each may run faster or
/// slower than ours by `drift_ppm`), by the skew of their nodes and by a millisecond the
/// clocks' precision may cut.
fn kept_margin(
    left: Duration,
    source: &ShardState,
    target: &ShardState,
    drift_ppm: u32,
) -> Duration {
    let drift = f64::from(drift_ppm) / 1e6;
    left.mul_f64((1.0 + drift) / (1.0 - drift).max(0.5))
        + source.clock_skew()
        + target.clock_skew()
        + Duration::from_millis(1)
}

/// Gives back the copy on `target` of the kept row of `owner` if that row no longer stands
/// on `source`: one force-released there meanwhile (or ended) must not live on in its copy.
/// Owner-checked, as any release.
async fn give_back_copy_of_ended(
    source: &Arc<ShardState>,
    target: &Arc<ShardState>,
    key: &[u8],
    owner: &str,
    copy_owner: &str,
) -> shardlock_core::Result<()> {
    let still = source
        .call_waiting(|b| b.live_owners(vec![key.to_vec()]))
        .await
        .map_err(on(source))?;
    if !still.iter().any(|(_, o)| o == owner) {
        target
            .call_waiting(|b| b.release(key, copy_owner))
            .await
            .map_err(on(target))?;
    }
    Ok(())
}

/// A live lease of a moved key on the shard it left, and the shards one of which must show it
/// too (none when its key's placement cannot be told).
struct Live {
    shards: Vec<Arc<ShardState>>,
    key: Vec<u8>,
    owner: String,
    /// For a row kept past its release: its fence and how long it is still kept.
    kept: Option<(u64, Duration)>,
}

/// Moves the owned CAS rows of moved keys from `source` to where their keys live now, one row
/// at a time (see [`carry_cas_row`]). A row whose key's placement cannot be told (a
/// digest) is not moved: the move stays in force until its holder releases it.
async fn carry_cas(
    router: &Inner,
    source: &Arc<ShardState>,
    epoch: u64,
) -> shardlock_core::Result<()> {
    let mut after = Vec::new();
    let mut stuck = 0;
    loop {
        let rows = source
            .call_waiting(|b| b.owned_cas_after(&after, FLOOR_BATCH))
            .await
            .map_err(on(source))?;
        let Some(last) = rows.last() else { break };
        after.clone_from(&last.0);
        let full = rows.len() == FLOOR_BATCH;
        for row in rows {
            if LockKey::placement_of_stored(&row.0).is_none() {
                stuck += 1;
                continue;
            }
            carry_cas_row(router, source, &row.0, epoch).await?;
        }
        if !full {
            break;
        }
    }
    if stuck > 0 {
        return Err(not_yet(
            source,
            format!(
                "{stuck} CAS lock(s) of keys over 255 bytes are held there; their placement \
                 cannot be told, so the move stays in force until they are released"
            ),
        ));
    }
    Ok(())
}

/// Carries the CAS row of `key` from `source` to where the key lives now, if it is owned and
/// moved: its copy, named by the token of the take that made the row (or, lacking one, a
/// token of this carry's own), is written while the row is held locked on `source`, and the
/// row is freed there in the same transaction. Where the key lives is read with the row held,
/// under the topology of `epoch`, which the whole fleet ran when this carry began (see
/// [`registry::laggards`]): every process takes the key there, and every holder releases it
/// there, whatever earlier placements it still has in force. (Copies on the shards of those
/// placements would be left where a holder that skipped them, or whose move ended, never
/// releases.) A reload since stops the carry, to be checked again. Copies nobody counts on
/// (the carry failed, and the holder then released the row) are given back by that token and
/// their version: never a row owned there by another take, whatever its owner name.
async fn carry_cas_row(
    router: &Inner,
    source: &Arc<ShardState>,
    key: &[u8],
    epoch: u64,
) -> shardlock_core::Result<()> {
    // The row copied, its copy's token and where it went, once: a try after the one that
    // wrote the copy (a deadlock, say) is refused rather than copying the row as it is then,
    // so one look settles the copy.
    type Copied = (CasRow, String, Arc<ShardState>);
    let copied: Mutex<Option<Copied>> = Mutex::new(None);
    let copied_ref = &copied;
    let copy = move |row: CasRow, token: Option<String>| {
        let copying: BoxFuture<'_, Result<bool, BackendError>> = Box::pin(async move {
            let topology = router.topology.load_full();
            if topology.epoch != epoch {
                return Err(BackendError::new(
                    BackendErrorKind::Other,
                    None,
                    RELOADED_SINCE,
                ));
            }
            let placement = LockKey::placement_of_stored(&row.0).unwrap_or_default();
            // A key that lives on `source` (it did not move, or a reload was undone while its
            // move was in force) stays.
            let target = topology.current.locate_bytes(placement);
            if target.same_database(source) {
                return Ok(false);
            }
            let token = token.unwrap_or_else(|| router.shared.next_owner().1);
            let first = {
                let mut slot = copied_ref.lock().unwrap();
                let first = slot.is_none();
                slot.get_or_insert_with(|| (row.clone(), token.clone(), target.clone()));
                first
            };
            if !first {
                return Err(BackendError::new(
                    BackendErrorKind::Other,
                    None,
                    "a try before this one wrote the row's copies: settled before it is \
                     carried again",
                ));
            }
            let landed = target
                .call_waiting(|b| b.adopt_cas(std::slice::from_ref(&row), &token))
                .await
                .map_err(|e| {
                    BackendError::new(
                        e.kind,
                        e.code,
                        format!("writing its copy on shard `{}`: {e}", target.name()),
                    )
                })?;
            // The key's row there is another take's (one whose release has not reached it
            // yet): freed here, this lock would be nowhere. It stays, and so does the move,
            // until that row is freed.
            if !landed {
                return Err(BackendError::new(
                    BackendErrorKind::Other,
                    None,
                    format!(
                        "the key's CAS row on shard `{}` is owned by another take (a release \
                         that has not reached it yet): the lock is carried once that row is \
                         freed",
                        target.name()
                    ),
                ));
            }
            Ok(true)
        });
        copying
    };
    let carried = source.call_waiting(|b| b.carry_cas_row(key, &copy)).await;
    if let (Some((row, token, target)), false) =
        (copied.into_inner().unwrap(), matches!(carried, Ok(true)))
    {
        settle_copy(source.clone(), target, row, token);
    }
    carried.map(drop).map_err(on(source))
}

/// Settles the copy of `row` (named by `token`) that a carry wrote on `target` when its
/// outcome is unknown, in the background until done: the next pass would not find it once the
/// row is free on `source`. A copy cut off on its way (the try's time ran out) could still
/// land after what is decided: the target's next statement first ends such a session (on a
/// plain shard). The copy stays while the row is owned as copied (the next pass counts on it)
/// or once a carry freed it; else it is given back, by token and version (a copy of the same
/// take carried back and forth since has another version).
fn settle_copy(source: Arc<ShardState>, target: Arc<ShardState>, row: CasRow, token: String) {
    let shared = source.shared.clone();
    shared.spawn(async move {
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(500));
        loop {
            if source.is_closed() || target.is_closed() {
                tracing::warn!(
                    shard = source.name(),
                    key = source.shared.telemetry.stored_key_label(&row.0),
                    token,
                    "shardlock could not settle a CAS carry whose outcome is unknown (a shard \
                     left or the router shut down): a copy of the lock may stay owned on the \
                     key's new shard; free it by its token if its holder released it"
                );
                return;
            }
            if target.call_waiting(|b| b.clock_us()).await.is_ok() {
                if let Ok(kept) = source.call_waiting(|b| b.cas_carry_kept(&row)).await {
                    if !kept {
                        let undone = CasGiveBack::Undone(Some(row.2));
                        target.give_back_cas(row.0.clone(), token.clone(), undone, None);
                    }
                    return;
                }
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
    });
}

/// Moves the unfinished jobs of moved queues from `source` to where the queues live now: ready
/// jobs and abandoned claims with retries left are marked as moving to that shard (claimers
/// skip them; the first marker fixes where a job goes), enqueued there once each (by the
/// move's carry key, read off the row), then marked moved. Abandoned claims with no retries left fail on `source`. A job marked
/// moving whose queue lives on `source` again (a reload undone during its move) goes on to
/// where its move began for. Returns what the move still waits for (see [`JobsLeft`]).
async fn carry_jobs(
    router: &Inner,
    source: &Arc<ShardState>,
    scope: JobScope,
) -> shardlock_core::Result<JobsLeft> {
    let known = router.shared.shard_states();
    let (mut waiting, mut resumed) = (0, 0);
    let mut after = 0;
    loop {
        let jobs = source
            .call_waiting(|b| b.pending_jobs_after(after, FLOOR_BATCH))
            .await
            .map_err(on(source))?;
        let Some(last) = jobs.last() else {
            return Ok(JobsLeft {
                running: waiting,
                resumed,
            });
        };
        after = last.id;
        let full = jobs.len() == FLOOR_BATCH;
        let topology = router.topology.load_full();
        let mut by_target: Vec<(Arc<ShardState>, Vec<u64>)> = Vec::new();
        let mut exhausted = Vec::new();
        // Marked moving, but their queue lives here again: a reload undone during their
        // move. Claimed by nobody here, they go on to where that move began for (what was
        // marked may have arrived there), and the move away from there brings them back.
        let mut undone = Vec::new();
        for job in jobs {
            let Some(target) = topology.current_location(&job.queue) else {
                continue;
            };
            if target.same_database(source) {
                if job.moving {
                    undone.push(job.id);
                }
                continue;
            }
            if scope == JobScope::UndoneMoves {
                continue;
            }
            if job.running {
                waiting += 1;
                continue;
            }
            if job.exhausted {
                exhausted.push(job.id);
                continue;
            }
            match by_target.iter_mut().find(|(t, _)| Arc::ptr_eq(t, target)) {
                Some((_, ids)) => ids.push(job.id),
                None => by_target.push((target.clone(), vec![job.id])),
            }
        }
        if !exhausted.is_empty() {
            let failed = source
                .call_waiting(|b| b.fail_exhausted(&exhausted))
                .await
                .map_err(on(source))?;
            // A claim renewed since it was read (a claim's retry after a lost reply) is
            // running again: the move waits for it.
            waiting += exhausted.len().saturating_sub(failed);
        }
        let mut moving = Vec::new();
        if !undone.is_empty() {
            let begun = source
                .call_waiting(|b| b.moves_begun(&undone))
                .await
                .map_err(on(source))?;
            // Towards a shard this process does not know (gone from every config it runs):
            // left moving, said so; the move does not wait for it.
            // By identity alone: the shard-id match is for moves begun in force (see
            // `destination`); a copy of a shard gone from the config may not hold what was
            // marked.
            let (known_to, unknown_to): (Vec<_>, Vec<_>) = begun
                .into_iter()
                .partition(|job| known_as(&known, &job.moved_to).is_some());
            for job in unknown_to {
                tracing::warn!(
                    shard = source.name(),
                    job = job.id,
                    moved_to = job.moved_to,
                    "shardlock leaves a job whose move a reload undid half way: it was on its way \
                     to a shard this process does not know, and may be there; no claim takes it \
                     until a config with that shard finishes its move"
                );
            }
            resumed += known_to.len();
            moving.extend(known_to);
        }
        for (target, ids) in by_target {
            let to = target
                .identity
                .get()
                .cloned()
                .ok_or_else(|| not_yet(&target, "its identity is unknown".into()))?;
            let started = source
                .call_waiting(|b| b.start_moving(&ids, &to))
                .await
                .map_err(on(source))?;
            // A job it did not mark and nobody had was claimed (or finished) since it was
            // read: the move waits for it, as for a running one, or its claim would run out
            // on a shard no claim of its queue comes to once the move is over.
            waiting += ids.len().saturating_sub(started.len());
            moving.extend(started);
        }
        // Each to the shard its move started for (another process's carry may have started
        // it towards another shard: that is where it goes).
        let mut by_destination: Vec<(Arc<ShardState>, Vec<shardlock_mysql::MovingJob>)> =
            Vec::new();
        for job in moving {
            let Some(dest) = destination(&known, &job.moved_to) else {
                waiting += 1;
                continue;
            };
            match by_destination
                .iter_mut()
                .find(|(d, _)| Arc::ptr_eq(d, dest))
            {
                Some((_, jobs)) => jobs.push(job),
                None => by_destination.push((dest.clone(), vec![job])),
            }
        }
        for (dest, jobs) in by_destination {
            dest.call_waiting(|b| b.enqueue_moved(&jobs))
                .await
                .map_err(on(&dest))?;
            let moved: Vec<u64> = jobs.iter().map(|j| j.id).collect();
            source
                .call_waiting(|b| b.finish_moving(&moved))
                .await
                .map_err(on(source))?;
        }
        if !full {
            return Ok(JobsLeft {
                running: waiting,
                resumed,
            });
        }
    }
}

/// Carries job `id`, enqueued on `source` for `queue` under a placement a reload replaced
/// meanwhile, to where the queue lives now, as [`carry_jobs`] carries each job: its move's
/// carry may have scanned `source` before the job landed there, and no claim of its queue
/// would come to `source` once that move is over. A job claimed since (by a process that
/// still placed the queue there) is left to its claim, as the carry leaves running jobs; one
/// marked moving already goes where its mark says.
pub(crate) async fn carry_job(
    router: &Inner,
    source: &Arc<ShardState>,
    queue: &LockKey,
    id: u64,
) -> shardlock_core::Result<()> {
    let topology = router.topology.load_full();
    let target = topology.locate(queue);
    if target.same_database(source) {
        return Ok(());
    }
    let to = target
        .identity
        .get()
        .cloned()
        .ok_or_else(|| not_yet(target, "its identity is unknown".into()))?;
    let ids = [id];
    let moving = source
        .call_waiting(|b| b.start_moving(&ids, &to))
        .await
        .map_err(on(source))?;
    let known = router.shared.shard_states();
    for job in moving {
        let Some(dest) = destination(&known, &job.moved_to) else {
            return Err(not_yet(
                source,
                format!(
                    "job {id} is on its way to a shard this process does not know ({})",
                    job.moved_to
                ),
            ));
        };
        dest.call_waiting(|b| b.enqueue_moved(std::slice::from_ref(&job)))
            .await
            .map_err(on(dest))?;
        source
            .call_waiting(|b| b.finish_moving(&ids))
            .await
            .map_err(on(source))?;
    }
    Ok(())
}

/// The shard of `known` that a job marked moving to `moved_to` (a shard's identity when its
/// move began) goes to: the one with that identity; else the one database with its shard id
/// (that shard failed over to a promoted replica behind its URL since: the server part of its
/// identity changed, and its database, a copy, kept the shard id), as the placement record
/// takes the one copy of a database for it. Two databases with one shard id (copies) cannot
/// be told apart: none. (A restored copy that diverged, its original gone from the config,
/// would be taken for it: a job the original received may then run twice.)
fn destination<'a>(known: &'a [Arc<ShardState>], moved_to: &str) -> Option<&'a Arc<ShardState>> {
    let exact = known_as(known, moved_to);
    if exact.is_some() {
        return exact;
    }
    let id = crate::placement_record::shard_id(moved_to);
    if id.is_empty() {
        return None;
    }
    let mut copies = known.iter().filter(|s| {
        s.server_identity()
            .is_some_and(|i| crate::placement_record::shard_id(&i) == id)
    });
    let first = copies.next()?;
    copies.all(|c| c.same_database(first)).then_some(first)
}

/// The shard of `known` whose identity is `moved_to`, as this process first read it or as its
/// latest heartbeat read it (another process may have marked the job after a failover of that
/// shard that this one read before, or the other way round).
fn known_as<'a>(known: &'a [Arc<ShardState>], moved_to: &str) -> Option<&'a Arc<ShardState>> {
    known.iter().find(|s| {
        s.identity.get().map(String::as_str) == Some(moved_to)
            || s.server_identity().as_deref() == Some(moved_to)
    })
}

/// Which jobs of a shard [`carry_jobs`] moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobScope {
    /// Every job of a queue that lives elsewhere now, and those whose move a reload undid: a
    /// shard the move leaves.
    All,
    /// Only jobs whose move a reload undid: a shard the move does not leave.
    UndoneMoves,
}

/// What a pass of [`carry_jobs`] over one shard left for a later pass.
#[must_use]
struct JobsLeft {
    /// Jobs of moved queues still running there (or on their way to a shard this process
    /// does not know).
    running: usize,
    /// Jobs whose move began towards a shard their queue has since left again, moved on
    /// there: the move away from that shard brings them back, and that shard may have been
    /// passed already.
    resumed: usize,
}

impl JobsLeft {
    /// `Err` while a later pass is needed.
    fn done(self, shard: &ShardState) -> shardlock_core::Result<()> {
        if self.running > 0 {
            return Err(not_yet(
                shard,
                format!(
                    "{} job(s) of moved queues are still running there; they are finished \
                     there, or carried over once their lease runs out",
                    self.running
                ),
            ));
        }
        if self.resumed > 0 {
            return Err(not_yet(
                shard,
                format!(
                    "{} job(s) whose move a reload undid half way went on to where that move \
                     began for; the next pass brings them back",
                    self.resumed
                ),
            ));
        }
        Ok(())
    }
}
