//! The instance registry: which processes are alive, and which topology each runs.
//!
//! Every router writes a heartbeat row on each shard of its topology (instance id, host, pid,
//! the topology's fingerprint, which database each shard name reaches, whether a move is in
//! force, its fleet). Three decisions read it:
//! the cleaner deletes a lease that ended without a release only when its holder is dead here
//! (or in the registry set in code, [`InstanceRegistry`]); a router refuses to start under a
//! configured instance id that is live elsewhere (two processes writing one owner would both
//! pass owner checks); and a router, or a reload's move, waits while a live instance of the
//! same fleet runs another topology, or the same one on other databases (it would place a
//! moved key where this one no longer looks). Those last two fail closed: a shard whose
//! registry does not answer counts as "maybe somebody", never as "nobody".
//!
//! The functions take the topology in force and this process's instance id rather than the
//! router: the registry sits below the router and the moves that consult it.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::future::{join_all, BoxFuture};
use shardlock_core::config::RegistryKind;
use shardlock_core::{BackendError, BackendErrorKind, Config, Error, Result};
use shardlock_mysql::{Beat, Heartbeat, InstanceRow};

use crate::clock::Moment;
use crate::shard::{ShardState, Shared};
use crate::sync::LockExt;
use crate::topology::{Previous, Topology};

/// Says which instances are dead, so that the cleaner may delete their leases that ended
/// without a release. Built in: the heartbeat table (`cleaner.registry: heartbeat`) and a
/// static list ([`StaticRegistry`], `cleaner.registry: static`); set your own with
/// [`LockRouter::set_registry`](crate::LockRouter::set_registry).
pub trait InstanceRegistry: Send + Sync + fmt::Debug {
    /// Of `instances` — the instance ids of owners whose leases on shard `shard` ended longer
    /// than the grace ago — those known to be dead. Only their leases are deleted; an error
    /// deletes nothing, and so does an answer that takes longer than the shard's
    /// `statement-timeout`. Such a registry knows ids, not starts: a lease of an earlier
    /// start under the cleaning router's own id is dead whatever it answers (that start
    /// is this one now), one under another id it calls alive is kept.
    fn dead<'a>(
        &'a self,
        shard: &'a str,
        instances: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<String>>>;
}

/// A fixed set of live instances; every other instance is dead. Empty: any lease that ended
/// longer than the grace ago may be deleted.
#[derive(Debug, Clone, Default)]
pub struct StaticRegistry {
    live: BTreeSet<String>,
}

impl StaticRegistry {
    /// A registry in which exactly `live` are alive.
    pub fn new(live: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            live: live.into_iter().map(Into::into).collect(),
        }
    }
}

impl InstanceRegistry for StaticRegistry {
    fn dead<'a>(
        &'a self,
        _shard: &'a str,
        instances: &'a [String],
    ) -> BoxFuture<'a, Result<Vec<String>>> {
        let dead = instances
            .iter()
            .filter(|i| !self.live.contains(*i))
            .cloned()
            .collect();
        Box::pin(async move { Ok(dead) })
    }
}

/// The instance ids of this process's live routers. The heartbeat registry keeps one row per
/// id, and a router leaves its own id out when it reads which topology the others run
/// ([`live_fleet`]): two routers of one process under one id would read as one instance, and
/// one could end a reload's move while the other still places keys the old way.
static IN_USE: std::sync::Mutex<BTreeSet<String>> = std::sync::Mutex::new(BTreeSet::new());

/// One router's hold on its instance id in this process: given up when dropped (with the
/// router, or at the end of its shutdown).
#[derive(Debug)]
pub(crate) struct IdClaim(String);

impl IdClaim {
    /// Claims `id` for a router of this process; `None` while another live router has it.
    pub(crate) fn take(id: &str) -> Option<Self> {
        IN_USE
            .locked()
            .insert(id.to_owned())
            .then(|| Self(id.to_owned()))
    }

    /// The error for a configured `id` that [`IdClaim::take`] refused.
    pub(crate) fn refused(id: &str) -> Error {
        Error::InvalidArgument {
            name: "instance.id",
            reason: format!(
                "`{id}` is the id of another router of this process that has not shut down. Give \
                 each router its own id (or `auto`), or shut the other one down first"
            ),
        }
    }
}

impl Drop for IdClaim {
    fn drop(&mut self) {
        IN_USE.locked().remove(&self.0);
    }
}

/// The other live instances of `router`'s fleet in the registry: `Ok(None)` under a registry
/// other than `heartbeat` (nothing to read), `Err` naming the shards whose registry did not
/// answer. Read on every shard of the topology, those of moves still in force included
/// (processes that have not reloaded heartbeat there); every live row of each instance. A
/// live row under `me`'s instance id but of another start (its nonce) is another instance: a
/// twin still beating where `me` did not take the row over (a shard out of its reach at its
/// start, one it leaves).
async fn live_fleet(
    topology: &Topology,
    me: &Shared,
) -> std::result::Result<Option<Vec<InstanceRow>>, String> {
    if topology.config.cleaner.registry != RegistryKind::Heartbeat {
        return Ok(None);
    }
    read_live_fleet(topology, me).await.map(Some)
}

/// [`live_fleet`] read whatever `topology`'s registry is: an operator tool's router has none
/// of its own, and its fleet's processes may heartbeat all the same.
async fn read_live_fleet(
    topology: &Topology,
    me: &Shared,
) -> std::result::Result<Vec<InstanceRow>, String> {
    let fleet = topology.config.instance.fleet();
    let timeout = topology.config.cleaner.heartbeat_timeout;
    let shards = topology.registry_shards();
    let answers = join_all(shards.iter().map(|s| async move {
        s.unguarded()
            .instances()
            .await
            .map_err(|e| format!("shard {}: {}", s.name(), unmigrated_or(&e)))
    }))
    .await;
    let mut rows = Vec::new();
    let mut silent = Vec::new();
    for answer in answers {
        match answer {
            Ok(found) => rows.extend(found),
            Err(e) => silent.push(e),
        }
    }
    if !silent.is_empty() {
        return Err(format!(
            "the registry did not answer on {} (a process that cannot read all of it cannot \
             tell which topology the others run)",
            silent.join("; ")
        ));
    }
    // Every live row of an instance, not only its freshest: each shard dates its rows by its
    // own clock, so which row is an instance's latest cannot be told across shards (a clock
    // stepped back makes a row it left long ago look newest). An instance counts as running
    // every topology a live row of it says. Its rows agree once it has beaten on each: it
    // beats on every shard of a placement still in force, so a shard it leaves in a reload
    // keeps a row of the new topology, not of the one it left.
    rows.retain(|row| {
        !row.deregistered
            && u128::try_from(row.heartbeat_ms_ago).unwrap_or(0) < row.live_for(timeout).as_millis()
            && !(row.instance_id == me.instance_id && row.nonce.as_deref() == Some(me.nonce()))
            && row.fleet.as_deref() == Some(fleet)
    });
    Ok(rows)
}

/// For an operator tool whose view of where keys live is its config's: the live instances
/// of its fleet (heartbeat registry) that run another topology than `topology`, or move
/// keys, described; or why the registry could not be read. `None` when all run it.
pub(crate) async fn tool_disagreement(topology: &Topology, me: &Shared) -> Option<String> {
    let others = match read_live_fleet(topology, me).await {
        Ok(rows) => other_topologies(topology, rows),
        Err(why) => return Some(why),
    };
    (!others.is_empty()).then(|| {
        format!(
            "live instances of fleet `{}` do not run this config's topology ({}) as it is: {}. \
             A key may be held where this config does not look: run the command with the \
             fleet's config",
            topology.config.instance.fleet(),
            topology.fingerprint,
            others.into_iter().collect::<Vec<_>>().join("; ")
        )
    })
}

/// Which database each current shard name of `topology` reaches, as a digest (FNV-1a, 64
/// bits, hex) of each name with its identity as the latest heartbeat there read it: the random
/// shard id its database stores (migration 5) and the server as it names itself (host name,
/// port, server id, schema), the same through any URL or proxy that reaches that server. A
/// copy of the database (a promoted replica, a restored backup) carries the id but is another
/// server. For a Galera shard (listed with `nodes`, or a Galera node reached by `url` alone),
/// the id alone, as versions before the cluster's state UUID was part of the identity wrote
/// it, so that a fleet mid-upgrade agrees. `None` while some shard's identity is unknown
/// (unreachable since this process started or reloaded).
///
/// The topology's fingerprint leaves URLs out (one database has many), so processes with the
/// same fingerprint may still reach one name at two databases (a reload pointing a shard at
/// another server applied by some of them, two URLs swapped, an old config started): their
/// digests differ.
pub(crate) fn servers(topology: &Topology) -> Option<String> {
    let mut lines = Vec::new();
    for shard in &topology.current.shards {
        let identity = shard.server_identity()?;
        let id = match identity.split_once(' ') {
            Some((id, server))
                if (!shard.config.nodes.is_empty() || server.starts_with("galera:"))
                    && !id.is_empty() =>
            {
                id
            }
            _ => identity.as_str(),
        };
        lines.push(format!("{}={id}", shard.name()));
    }
    lines.sort();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in lines.join("\n").bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    Some(format!("{hash:016x}"))
}

/// Why `topology` may not be moved onto, if two of its current shards reach one database, by
/// the identities read so far (a shard not read yet is nobody's twin): a lease a move takes
/// from one to the other would take its companion row in its own row (releasing the row it
/// left would free the key it holds). Without a move they are one table, and exclusion holds.
/// The config refuses two entries that name one host and database; two names for one server
/// (an alias, an IP and a host name, a proxy) are told only by what the server says it is.
pub(crate) fn shared_database(topology: &Topology) -> Option<String> {
    let shards = &topology.current.shards;
    shards.iter().enumerate().find_map(|(i, shard)| {
        let identity = shard.server_identity()?;
        let first = shards[..i]
            .iter()
            .find(|other| other.server_identity().as_deref() == Some(identity.as_str()))?;
        Some(format!(
            "shards `{}` and `{}` reach one database ({identity}): two names for one server? \
             Each shard needs a database of its own (its rows would be the other's; a \
             Galera cluster copied from another's data files shares its identity too)",
            first.name(),
            shard.name()
        ))
    })
}

/// What a heartbeat advertises while [`servers`] is unknown: matches no process's digest.
const SERVERS_UNKNOWN: &str = "unknown";

/// Reads the identity of each current shard of `topology` that no heartbeat has read yet,
/// within half a heartbeat interval (a shard that does not answer stays unknown).
pub(crate) async fn learn_servers(topology: &Topology) {
    if topology.config.cleaner.registry != RegistryKind::Heartbeat {
        return;
    }
    let unknown = (topology.current.shards.iter()).filter(|s| s.server_identity().is_none());
    let reads = join_all(unknown.map(|s| async move {
        if let Ok(identity) = s.call(|b| b.identity()).await {
            s.saw_identity(identity);
        }
    }));
    let _ = tokio::time::timeout(topology.config.cleaner.heartbeat_interval / 2, reads).await;
}

/// The live instances among `rows` that run `topology`'s fingerprint but reach some shard name
/// at another database than this process (see [`servers`]), each described; every one of them
/// when this process does not know yet which database each of its shards is. Instances of
/// versions that do not say it (before migration 12) are not counted.
fn placed_elsewhere(topology: &Topology, rows: &[InstanceRow]) -> BTreeSet<String> {
    let own = servers(topology);
    rows.iter()
        .filter(|row| row.topology.as_deref() == Some(topology.fingerprint.as_str()))
        .filter_map(|row| {
            let theirs = row.servers.as_deref()?;
            let why = match &own {
                Some(own) if own == theirs => return None,
                Some(_) if theirs == SERVERS_UNKNOWN => "runs this topology but does not say \
                     yet which server each shard name reaches (a shard it has not reached \
                     since it started or reloaded, or a transaction lock still following its \
                     key)"
                    .to_owned(),
                Some(own) => format!(
                    "runs this topology but reaches some shard name at another database than \
                     this process (servers {theirs} against {own}): reload it with this config"
                ),
                None => "runs this topology, and this process does not know yet which \
                         database each of its shards is (one was unreachable)"
                    .to_owned(),
            };
            Some(format!("{} {why}", describe(row)))
        })
        .collect()
}

/// The server's "table does not exist" and "unknown column" errors.
const ER_NO_SUCH_TABLE: u16 = 1146;
const ER_BAD_FIELD: u16 = 1054;

/// `e` as a log line or error says it, and what to do when it is the registry's schema (or
/// the placement record's, see [`crate::placement_record`]) that predates this version (a
/// binary rolled out before `shardlock migrate` ran): such a shard's registry can neither
/// record this process nor say which topology the others run, nor where its fleet last placed
/// keys, so the process grants nothing until it is migrated.
pub(crate) fn unmigrated_or(e: &BackendError) -> String {
    let report = shardlock_core::Report(e);
    if matches!(e.code, Some(ER_NO_SUCH_TABLE | ER_BAD_FIELD)) {
        format!(
            "its tables predate this version of shardlock ({report}): run `shardlock migrate` \
             (or `LockRouter::migrate`) on it"
        )
    } else {
        report.to_string()
    }
}

/// How the registry names an instance in a log line or error.
fn describe(row: &InstanceRow) -> String {
    format!("{} (host {}, pid {})", row.instance_id, row.host, row.pid)
}

/// Why a router with `topology`, the start `me`, may not grant yet, if so: another live instance of its fleet runs another
/// topology, or reaches one of its shard names at another database ([`servers`]), or has a
/// reload's move in force, or the registry cannot be read on every shard
/// (it fails closed: unread is not "nobody there"). Instances of versions that do not say
/// their topology are not counted.
pub(crate) async fn fleet_disagreement(topology: &Topology, me: &Shared) -> Option<String> {
    let rows = match live_fleet(topology, me).await {
        Ok(rows) => rows?,
        Err(why) => return Some(format!("this process grants nothing yet: {why}")),
    };
    let mut others = placed_elsewhere(topology, &rows);
    others.extend(other_topologies(topology, rows));
    disagreement(topology, others)
}

/// The instances among `rows` that run another topology than `topology`, or move keys.
fn other_topologies(topology: &Topology, rows: Vec<InstanceRow>) -> BTreeSet<String> {
    let own = &topology.fingerprint;
    let mut others = BTreeSet::new();
    for row in rows {
        let what = match row.topology.as_deref() {
            Some(theirs) if theirs != own.as_str() => format!("runs topology {theirs}"),
            _ if row.moving => "is moving keys after a reload".to_owned(),
            _ => continue,
        };
        others.insert(format!("{} {what}", describe(&row)));
    }
    others
}

/// What [`fleet_disagreement`] answers for the instances `others` it found.
fn disagreement(topology: &Topology, others: BTreeSet<String>) -> Option<String> {
    let own = &topology.fingerprint;
    let fleet = topology.config.instance.fleet();
    (!others.is_empty()).then(|| {
        format!(
            "this process started with topology {own} and grants nothing until every live \
             instance of fleet `{fleet}` runs it with no move in force: {}. Reload them with \
             this config (or stop them); a process started during a move cannot know where the \
             others still place a moved key. (Services that never share keys may run different \
             topologies on the same shards: give each its own `instance.fleet`.)",
            others.into_iter().collect::<Vec<_>>().join("; ")
        )
    })
}

/// Why the move away from `previous` must stay in force, if it must: live instances of the
/// fleet of a router with `topology`, the start `me`, run another topology than this
/// router's, or the registry cannot be read on every shard (unread is not "nobody there").
///
/// Not only those still running `previous`'s topology: one that has not reloaded grants a
/// moved key where this process no longer looks, and one that reloaded elsewhere (a chained
/// reload still rolling out, a topology in between skipped) takes a key only where its own
/// topology puts it, so it would not see what this move's carry writes where this one puts
/// it, and its holders would not release there. The move ends once the fleet runs one
/// topology.
///
/// Under another registry than `heartbeat` nothing says which topology the others run: the
/// move stays in force until every move's window is over, by which time every process applied
/// this process's reload (the contract of a static registry).
pub(crate) async fn laggards(
    topology: &Topology,
    me: &Shared,
    previous: &Previous,
) -> Option<String> {
    // Also back to that topology (a reload undone): a process of the fleet may still run the
    // topology in between, its own move from this placement over, and take a moved key only
    // where that topology puts it, on one of this placement's shards, which the carry would
    // empty under it (a CAS lock's row copied away, then taken again there).
    let rows = match live_fleet(topology, me).await {
        Ok(Some(rows)) => rows,
        Ok(None) => {
            let now = Moment::now();
            return topology.previous.iter().any(|p| p.until > now).then(|| {
                "the registry is not `heartbeat`: a move's carry waits until every move's \
                     window is over, when every process has applied the reload"
                    .to_owned()
            });
        }
        Err(why) => return Some(why),
    };
    let fingerprint = previous.fingerprint.as_str();
    let own = topology.fingerprint.as_str();
    let mut lagging = placed_elsewhere(topology, &rows);
    lagging.extend(
        rows.iter()
            .filter(|row| row.topology.as_deref().is_some_and(|theirs| theirs != own))
            .map(|row| {
                let theirs = row.topology.as_deref().unwrap_or_default();
                let which = if theirs == fingerprint {
                    "the previous topology".to_owned()
                } else {
                    format!("topology {theirs}")
                };
                format!("{} runs {which}", describe(row))
            }),
    );
    (!lagging.is_empty()).then(|| {
        format!(
            "instances of this fleet run another topology than this process ({own}): {}; put \
             every instance on one config (reload them with this process's, or this process \
             with theirs; a `shardlock cleaner` reloads its file on SIGHUP)",
            lagging.into_iter().collect::<Vec<_>>().join("; ")
        )
    })
}

/// How one heartbeat on every shard goes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Round {
    /// Each shard's heartbeat, and the read that follows it, take no longer than this (see
    /// `heartbeat_round`).
    pub(crate) within: std::time::Duration,
    /// Whether it may take rows that are not this start's (see [`Beat::take`]); else it beats
    /// only where the row is still its own.
    pub(crate) take: bool,
}

/// Heartbeats missed in a row on one shard before a warning.
const HEARTBEATS_MISSED_BEFORE_WARNING: u32 = 3;

/// What one heartbeat on every current shard found.
#[derive(Debug, Default)]
pub(crate) struct Beats {
    /// Another start that beats under this instance id, live, described with the first shard
    /// where it does (this process's heartbeat was refused there).
    pub(crate) taken_by: Option<String>,
    /// The shards the heartbeat did not reach, each with why: a process reading the registry
    /// there may not know of this one.
    pub(crate) unreached: Vec<String>,
}

impl Beats {
    /// Why this process may be unknown in the registry of some shard, if it may.
    pub(crate) fn unreached(&self) -> Option<String> {
        (!self.unreached.is_empty()).then(|| {
            format!(
                "this process's heartbeat has not reached {}: a process reading the registry \
                 there may not know of it, so it grants nothing until it has",
                self.unreached.join("; ")
            )
        })
    }
}

/// One heartbeat of this process on every current shard of `topology`, if the registry in
/// force is `heartbeat`; `missed` counts failures in a row per shard (a warning at the
/// third). `reached` is called as each shard's heartbeat succeeds: a slow shard does not
/// hold back the proof that the others were reached; `silent`, before it, with the shard's
/// name, if this process's row there had gone unbeaten for longer than it can have known (see
/// `ShardState::went_silent`). `fingerprint` is the topology it advertises, with its servers
/// (see `Inner::advertised`). `round` bounds it, and says whether it takes rows.
pub(crate) async fn beat(
    topology: &Topology,
    round: Round,
    (fingerprint, servers): &(String, Option<String>),
    shared: &Shared,
    missed: &mut std::collections::HashMap<String, u32>,
    reached: &(dyn Fn() + Sync),
    silent: &(dyn Fn(&str) + Sync),
) -> Beats {
    let mut beats = Beats::default();
    if topology.config.cleaner.registry != RegistryKind::Heartbeat {
        return beats;
    }
    let Round {
        within: round,
        take,
    } = round;
    let host = host_name();
    let beat = Beat {
        take,
        ..this_beat(topology, fingerprint, servers.as_deref(), shared, &host)
    };
    // Also on the shards of earlier placements still in force, best effort: a shard left in
    // this reload then keeps a row of the topology moved to (see `live_fleet`). Their
    // failures are not this process's: only the current shards must know of it.
    let left: Vec<_> = topology
        .registry_shards()
        .into_iter()
        .filter(|s| {
            !(topology.current.shards.iter()).any(|c| Arc::ptr_eq(c, s) || c.same_database(s))
        })
        .collect();
    // Bounded by half an interval, and the round: a shard being left is often one being
    // retired, and a dead one must not hold back the heartbeat on the current shards.
    let bound = (topology.config.cleaner.heartbeat_interval / 2).min(round);
    let left = join_all(left.iter().map(|s| async move {
        match tokio::time::timeout(bound, s.call(|b| b.heartbeat(beat))).await {
            Ok(Ok(Heartbeat::TakenBy { host, pid })) => {
                tracing::warn!(shard = s.name(), host, pid, "shardlock heartbeat on a shard being left refused: another start beats under this instance id there");
            }
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::debug!(shard = s.name(), error = %shardlock_core::Report(&e), "shardlock heartbeat on a shard being left failed");
            }
            Err(_) => {
                tracing::debug!(shard = s.name(), "shardlock heartbeat on a shard being left took too long");
            }
        }
    }));
    let lapse = crate::state::lapse(&topology.config);
    let sent = topology.current.shards.iter().map(|s| async move {
        let at = Moment::now();
        let beat = Beat {
            judge_silence: s.silence_to_judge(lapse, &topology.config),
            ..beat
        };
        // A shard that hangs is given up on within `round` (see `heartbeat_round`), before
        // the next heartbeat to the others is due, rather than after its statement timeout,
        // which may be longer than the lapse. Cut that short, its timeout tells of the time
        // it was given, not of the shard (a Galera node stalled while the cluster evicts
        // another), and counts against no breaker.
        let outcome = match round < s.statement_timeout() {
            true => (s.call_waiting_cut(true, |b| b.heartbeat_within(beat, round))).await,
            false => s.call(|b| b.heartbeat(beat)).await,
        };
        if let Ok(Heartbeat::Beaten {
            silent_for,
            kept_silent,
        }) = &outcome
        {
            // Before the proof that it was reached: no grant passes in between.
            if s.went_silent(
                *silent_for,
                *kept_silent,
                Moment::now(),
                lapse,
                &topology.config,
            ) {
                silent(s.name());
            }
            // A silence left in the row for this process to see: the rest of the fleet still
            // sees the row silent, so it was not reached; the next heartbeat moves it on.
            if *kept_silent {
                return (s.name().to_owned(), outcome);
            }
            s.beat_landed(at);
            reached();
            // Which server it is, for the next heartbeat's digest: a shard id stored since
            // (a migration) is seen within a beat. Bounded: it holds up the next heartbeat.
            let bound = bound.min((at + round).saturating_duration_since(Moment::now()));
            if bound.is_zero() {
                return (s.name().to_owned(), outcome);
            }
            if let Ok(Ok(identity)) = tokio::time::timeout(bound, s.call(|b| b.identity())).await {
                s.saw_identity(identity);
            }
        }
        (s.name().to_owned(), outcome)
    });
    let (answers, _) = futures_util::future::join(join_all(sent), left).await;
    for (shard, beat) in answers {
        let missed = missed.entry(shard.clone()).or_default();
        match beat {
            Ok(Heartbeat::Beaten {
                kept_silent: true,
                silent_for,
            }) => {
                let found = if silent_for.is_some() {
                    "had gone unbeaten for longer than this process's lapse"
                } else {
                    "was no longer this start's (forgotten, or taken over and given up)"
                };
                beats.unreached.push(format!(
                    "shard {shard} (its registry row {found}, and was left silent for it to see)"
                ));
            }
            Ok(Heartbeat::Withheld) => {
                let why = "its registry row of this instance id is another start's, counted \
                           dead, and is not taken while a shard could not be read for a live \
                           start of the id";
                missed_beat(shared, missed, &shard, why.to_owned(), &mut beats);
            }
            Ok(outcome) => {
                *missed = 0;
                if let Heartbeat::TakenBy { host, pid } = outcome {
                    beats
                        .taken_by
                        .get_or_insert_with(|| format!("host {host}, pid {pid} (shard {shard})"));
                }
            }
            Err(e) => missed_beat(shared, missed, &shard, unmigrated_or(&e), &mut beats),
        }
    }
    beats
}

/// Counts a heartbeat on `shard` that failed, or was not sent, for `why`: in `missed` (failures
/// in a row), in the stats, and as a shard `beats` did not reach.
pub(crate) fn missed_beat(
    shared: &Shared,
    missed: &mut u32,
    shard: &str,
    why: String,
    beats: &mut Beats,
) {
    *missed += 1;
    shared
        .stats
        .heartbeat_failures
        .fetch_add(1, Ordering::Relaxed);
    // Others' cleaners count this instance dead after `heartbeat-timeout` without one: worth
    // a warning once it keeps failing, not on one miss.
    if *missed == HEARTBEATS_MISSED_BEFORE_WARNING {
        tracing::warn!(shard, error = why, missed = *missed, "shardlock heartbeats keep failing: other instances' cleaners will count this one dead after cleaner.heartbeat-timeout");
    } else {
        tracing::debug!(shard, error = why, "shardlock heartbeat failed");
    }
    beats.unreached.push(format!("shard {shard} ({why})"));
}

/// Another start that beats live under this process's instance id on a current shard of
/// `topology`, if the registry in force is `heartbeat`: its host and pid, and the shard. Read
/// before a joining router's heartbeat, which would take the id's rows on the shards where
/// that start is silent (cut off from them, say): once its link came back, that start would
/// find its id taken over there before this one gave the rows up, and stop for good.
///
/// The shards that did not answer are the error, each with why, unless another shard names a
/// start: that start may beat there alone, cut off from the shards this one reaches. `bound` limits
/// each read (a router that ran: a shard that hangs must not hold back its heartbeat on the
/// others); a start's reads wait for their shards.
pub(crate) async fn live_twin(
    topology: &Topology,
    shared: &Shared,
    bound: Option<std::time::Duration>,
) -> std::result::Result<Option<String>, Vec<(String, String)>> {
    if topology.config.cleaner.registry != RegistryKind::Heartbeat {
        return Ok(None);
    }
    let (id, timeout) = (
        &shared.instance_id,
        topology.config.cleaner.heartbeat_timeout,
    );
    let found = join_all(topology.current.shards.iter().map(|s| async move {
        let read = s.call(|b| b.live_start(id, timeout));
        let read = match bound {
            Some(bound) => match tokio::time::timeout(bound, read).await {
                Ok(read) => read,
                Err(_) => {
                    let why = format!("no answer within {bound:?}");
                    return Err((s.name().to_owned(), why));
                }
            },
            None => read.await,
        };
        match read {
            Ok(Some((nonce, host, pid))) if nonce.as_deref() != Some(shared.nonce().as_bytes()) => {
                Ok(Some(format!("host {host}, pid {pid} (shard {})", s.name())))
            }
            Ok(_) => Ok(None),
            Err(e) => Err((s.name().to_owned(), unmigrated_or(&e))),
        }
    }))
    .await;
    let (found, failed): (Vec<_>, Vec<_>) = found.into_iter().partition(|r| r.is_ok());
    match found.into_iter().find_map(|r| r.ok().flatten()) {
        Some(twin) => Ok(Some(twin)),
        None if failed.is_empty() => Ok(None),
        None => Err(failed.into_iter().filter_map(|r| r.err()).collect()),
    }
}

/// This process's heartbeat under `topology`, advertising `fingerprint` and `servers` (see
/// [`servers`]; unknown until every current shard's identity is).
fn this_beat<'a>(
    topology: &'a Topology,
    fingerprint: &'a str,
    servers: Option<&'a str>,
    shared: &'a Shared,
    host: &'a str,
) -> Beat<'a> {
    Beat {
        instance: &shared.instance_id,
        host,
        pid: std::process::id(),
        topology: fingerprint,
        moving: topology.moves_in_progress() > 0,
        fleet: topology.config.instance.fleet(),
        servers: servers.unwrap_or(SERVERS_UNKNOWN),
        nonce: shared.nonce(),
        timeout: topology.config.cleaner.heartbeat_timeout,
        // Judged by the callers, on current shards only.
        judge_silence: None,
        take: true,
    }
}

/// One heartbeat on `shard`, a shard of a placement whose move is about to end, if the registry
/// in force is `heartbeat`: after the end this process beats there no more, and its row there
/// must name the topology it moved to (see `live_fleet`), not the one it left, even if every
/// best-effort beat there failed. An error when the shard did not take it. `silent` is called
/// with the shard's name if this process's row there had gone unbeaten for longer than it
/// can have known, as in [`beat`].
pub(crate) async fn beat_before_leaving(
    topology: &Topology,
    (fingerprint, servers): &(String, Option<String>),
    shared: &Shared,
    shard: &ShardState,
    take: bool,
    silent: &(dyn Fn(&str) + Sync),
) -> Result<(), BackendError> {
    if topology.config.cleaner.registry != RegistryKind::Heartbeat {
        return Ok(());
    }
    let host = host_name();
    let beat = this_beat(topology, fingerprint, servers.as_deref(), shared, &host);
    // A shard the move leaves that stays current (a reload that adds shards) is judged as the
    // heartbeat judges it: unjudged, this write would move on a silence the heartbeat has yet
    // to see (see `ShardState::silence_to_judge`), and that heartbeat would find none.
    let current = (topology.current.shards.iter()).find(|c| c.same_database(shard));
    //
    // Unless it may `take` rows, its own row only (see `Beat::take`): while the router joins
    // its fleet again, another start of its id may have taken the row over and be cut off
    // from this shard. A row to take is then left to the heartbeat, which looks first.
    let lapse = crate::state::lapse(&topology.config);
    let beat = Beat {
        judge_silence: current.and_then(|c| c.silence_to_judge(lapse, &topology.config)),
        take,
        ..beat
    };
    let outcome = shard.call(|b| b.heartbeat(beat)).await?;
    // A silence found here is this process's lapse, as the heartbeat's is.
    if let (
        Some(current),
        Heartbeat::Beaten {
            silent_for,
            kept_silent,
        },
    ) = (current, &outcome)
    {
        if current.went_silent(
            *silent_for,
            *kept_silent,
            Moment::now(),
            lapse,
            &topology.config,
        ) {
            silent(current.name());
        }
    }
    let why = match outcome {
        Heartbeat::Beaten {
            kept_silent: true, ..
        } => {
            "this process's registry row there had gone unbeaten for longer than its lapse, or \
             was no longer its own: left silent for its heartbeat to see"
        }
        Heartbeat::Withheld => {
            "this process's registry row there is another start's, counted dead, or none: \
             left for its heartbeat to take"
        }
        Heartbeat::TakenBy { .. } => "another start beats under this instance id there, live",
        _ => return Ok(()),
    };
    Err(BackendError::new(BackendErrorKind::Other, None, why))
}

/// Marks this instance as shut down in the registry of every shard (router shutdown), where
/// its start (`nonce`) beat last.
pub(crate) async fn deregister(config: &Config, id: &str, nonce: &str, shards: &[Arc<ShardState>]) {
    if config.cleaner.registry != RegistryKind::Heartbeat {
        return;
    }
    // Not through the breaker: a deregistration skipped would keep the id live for
    // `heartbeat-timeout`, refusing a new start under it meanwhile.
    join_all(shards.iter().map(|s| async move {
        if let Err(e) = s.unguarded().deregister(id, nonce).await {
            tracing::debug!(shard = s.name(), error = %shardlock_core::Report(&e), "shardlock deregistration failed");
        }
    }))
    .await;
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
