//! The placements a fleet runs, recorded on its shards (migration 13).
//!
//! A reload moves keys from the placement it leaves: it carries their fences, the rows kept
//! past their release, the jobs and the CAS locks to where the keys live now. A process
//! started onto a changed config after every process of its fleet stopped has no placement to
//! leave and no one to reload. It reads the record instead and makes the move a reload of the
//! fleet would have made: it puts each recorded placement in force in turn, then reloads to
//! its own config. Until it has read the record on every shard and made that move, it grants
//! nothing (see [`crate::state::Gate`]): unread is not "no record". (Under `registry: static`
//! a shard that does not answer is left out, as its registry is.)
//!
//! A joined process that has granted (or is about to) records what it places keys by: the
//! placements of its moves in force, oldest first, then its current one. (One that grants
//! nothing, a `shardlock migrate` run say, places nothing.) It may replace a record only if
//! every placement named there is one it runs or ran (see `may_replace`); at rest it records
//! only while every live instance of its fleet agrees with it (under `registry: static`,
//! nothing to check). A process whose view is stale (paused past its heartbeat timeout, not
//! reloaded yet) therefore never drops a placement the fleet granted under since. Each shard's record is
//! replaced only over the one the writer read (compare and set on its `seq`), with a `seq`
//! above every record the process has seen; a start takes the record with the highest `seq`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::join_all;
use serde::{Deserialize, Serialize};
use shardlock_core::config::RegistryKind;
use shardlock_core::Config;

use crate::registry;
use crate::shard::ShardState;
use crate::state::Inner;
use crate::sync::LockExt;
use crate::topology::{Placement, Topology};

/// A placement as recorded: what places keys (each shard's name and weight, the ring's virtual
/// nodes) and which database each shard name reached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Recorded {
    virtual_nodes: u32,
    /// In name order.
    shards: Vec<RecordedShard>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct RecordedShard {
    name: String,
    weight: u32,
    /// The shard's identity as the recording process read it; its first word is the id
    /// migration 5 stores in the shard's database.
    identity: String,
}

/// The first word of a shard identity: the id its database stores (a promoted replica or a
/// restored copy keeps it, and holds the rows).
pub(crate) fn shard_id(identity: &str) -> &str {
    identity.split(' ').next().unwrap_or("")
}

impl Recorded {
    /// `placement`; `None` while a shard's identity is unknown.
    fn of(placement: &Placement) -> Option<Self> {
        let mut shards = Vec::with_capacity(placement.shards.len());
        for s in &placement.shards {
            shards.push(RecordedShard {
                name: s.name().to_owned(),
                weight: s.config.weight,
                identity: s.server_identity()?,
            });
        }
        shards.sort_by(|a, b| a.name.cmp(&b.name));
        Some(Self {
            virtual_nodes: placement.virtual_nodes,
            shards,
        })
    }

    /// Whether it and `other` place every key on the same database: the same shard names with
    /// the same weights and shard ids, and the same virtual nodes.
    fn places_like(&self, other: &Recorded) -> bool {
        self.virtual_nodes == other.virtual_nodes
            && self.shards.len() == other.shards.len()
            && (self.shards.iter().zip(&other.shards)).all(|(a, b)| {
                a.name == b.name
                    && a.weight == b.weight
                    && shard_id(&a.identity) == shard_id(&b.identity)
            })
    }

    /// `topology`'s config with this placement's shards and virtual nodes: each shard under
    /// its recorded name and weight, reached as that config reaches the recorded database (by
    /// the shard id: under any name, so that two URLs swapped while the fleet was down are
    /// moved between). `Err` names a recorded database this process does not reach, or says
    /// it cannot tell yet which database a shard of its own is.
    fn config_in(&self, topology: &Topology) -> Result<Config, String> {
        let mut config = (*topology.config).clone();
        config.routing.virtual_nodes = self.virtual_nodes;
        config.shards.clear();
        let mut known = Vec::with_capacity(topology.current.shards.len());
        for state in &topology.current.shards {
            let Some(identity) = state.server_identity() else {
                return Err(format!(
                    "this process cannot tell yet which database shard `{}` is",
                    state.name()
                ));
            };
            known.push((state, identity));
        }
        for recorded in &self.shards {
            // The same server first; else the one copy of the database (a promoted replica
            // keeps its id); two copies under different names cannot be told apart.
            let same = |(_, identity): &&(&Arc<ShardState>, String)| *identity == recorded.identity;
            let copy = |(_, identity): &&(&Arc<ShardState>, String)| {
                shard_id(identity) == shard_id(&recorded.identity)
            };
            let state = match known.iter().find(same) {
                Some((state, _)) => state,
                None => match known.iter().filter(copy).collect::<Vec<_>>()[..] {
                    [(state, _)] => state,
                    [] => {
                        return Err(format!(
                            "it last ran shard `{}` at database {}, which this config does not \
                             reach",
                            recorded.name, recorded.identity
                        ))
                    }
                    _ => {
                        return Err(format!(
                            "it last ran shard `{}` at database {}, and this config reaches \
                             several copies of it: which one holds its rows cannot be told",
                            recorded.name, recorded.identity
                        ))
                    }
                },
            };
            let mut shard = state.config.clone();
            shard.name = recorded.name.clone();
            shard.weight = recorded.weight;
            config.shards.push(shard);
        }
        Ok(config)
    }
}

/// What a process places keys by under `topology`: its moves in force, oldest first, then its
/// current placement; `None` while a shard's identity is unknown.
fn own(topology: &Topology) -> Option<Vec<Recorded>> {
    let now = crate::clock::Moment::now();
    let mut out = Vec::new();
    for previous in topology.previous.iter().filter(|p| p.in_force(now)) {
        out.push(Recorded::of(&previous.placement)?);
    }
    out.push(Recorded::of(&topology.current)?);
    Some(out)
}

/// A router's side of its fleet's record.
#[derive(Debug)]
pub(crate) struct PlacementState {
    /// Why the router has not made the move from its fleet's record yet; `None` once made (or
    /// none was needed).
    unsettled: Mutex<Option<String>>,
    /// Whether a move from the record was begun and failed half way: it is not tried again.
    failed: std::sync::atomic::AtomicBool,
    /// What this router recorded last.
    recorded: Mutex<Option<Vec<Recorded>>>,
    /// The highest `seq` this router has seen or written.
    seq: AtomicU64,
    /// Set at the router's first grant (see [`PlacementState::granting`]).
    granting: std::sync::atomic::AtomicBool,
    /// The placements this router has run since it last recorded (moved from, or current),
    /// each once.
    ran: Mutex<Vec<Recorded>>,
    /// The highest `seq` of a record this router moved from or wrote (0: none): a newer one
    /// was written by others since.
    known_seq: AtomicU64,
    /// An operator's tool (see `RouterBuilder::operator_tool`): it grants nothing, so it
    /// neither moves from the record nor writes it.
    tool: std::sync::atomic::AtomicBool,
    /// Held by each write of the record, and by a reload from its write ahead until its swap:
    /// a heartbeat's write never reads the topology in force and what the router ran at two
    /// sides of a swap (it would take its old placement for one it may record alone).
    writing: tokio::sync::Mutex<()>,
}

impl Default for PlacementState {
    fn default() -> Self {
        Self {
            unsettled: Mutex::new(Some(
                "this process has not read yet where its fleet last placed keys".to_owned(),
            )),
            failed: Default::default(),
            recorded: Mutex::default(),
            seq: AtomicU64::new(0),
            granting: Default::default(),
            ran: Mutex::default(),
            known_seq: AtomicU64::new(0),
            tool: Default::default(),
            writing: Default::default(),
        }
    }
}

impl PlacementState {
    /// Why the router may not grant yet as far as its fleet's record goes (see
    /// [`to_move_from`]).
    pub(crate) fn unsettled(&self) -> Option<String> {
        self.unsettled.locked().clone()
    }

    /// Whether a move from the record may be tried (again).
    pub(crate) fn may_try(&self) -> bool {
        self.unsettled().is_some() && !self.failed.load(Ordering::Acquire)
    }

    /// The outcome of a try: `None` settled, else why not yet; `failed` if not to be tried
    /// again.
    pub(crate) fn tried(&self, outcome: Option<String>, failed: bool) {
        *self.unsettled.locked() = outcome;
        self.failed.store(failed, Ordering::Release);
    }

    /// Notes a grant about to be sought: the router records its placements from now on, the
    /// first time at once (`beat_now` wakes the heartbeat, which records). `false` for an
    /// operator's tool, which grants nothing.
    pub(crate) fn granting(&self, beat_now: &tokio::sync::Notify) -> bool {
        if self.tool.load(Ordering::Relaxed) {
            return false;
        }
        if !self.granting.load(Ordering::Relaxed) && !self.granting.swap(true, Ordering::AcqRel) {
            beat_now.notify_one();
        }
        true
    }

    /// Makes the router an operator's tool: settled at once, it never moves from the record
    /// nor writes it, and grants nothing.
    pub(crate) fn tool(&self) {
        self.tool.store(true, Ordering::Release);
        self.tried(None, false);
    }

    /// Why the router may not grant after `recorded`, a write before its gate opens: its
    /// fleet moved on (it is unsettled again, and moves from there first); `None` otherwise.
    pub(crate) fn moved_on(&self, recorded: Recording) -> Option<String> {
        let Recording::MovedOn(why) = recorded else {
            return None;
        };
        self.tried(Some(why.clone()), false);
        Some(why)
    }

    /// The right to write the record (see [`record_ahead`]).
    pub(crate) async fn writing(&self) -> Writing<'_> {
        Writing {
            _held: self.writing.lock().await,
        }
    }

    /// Whether the router is an operator's tool.
    pub(crate) fn is_tool(&self) -> bool {
        self.tool.load(Ordering::Acquire)
    }

    /// Notes that this router runs (or ran) `placement`; a placement whose identities are not
    /// all known is left out (it cannot be compared).
    pub(crate) fn runs(&self, placement: &Placement) {
        if let Some(placement) = Recorded::of(placement) {
            self.ran_too([placement]);
        }
    }

    fn ran_too(&self, placements: impl IntoIterator<Item = Recorded>) {
        let mut ran = self.ran.locked();
        for placement in placements {
            if !ran.iter().any(|r| r.places_like(&placement)) {
                ran.push(placement);
            }
        }
    }

    fn ran(&self) -> Vec<Recorded> {
        self.ran.locked().clone()
    }

    fn recorded(&self) -> Option<Vec<Recorded>> {
        self.recorded.locked().clone()
    }

    /// After a write of `recorded`: what it ran before is in the record no more. Written
    /// `ahead` of a reload, its last placement is not run yet (the reload may be dropped
    /// before it swaps): it counts as run once the reload swaps it in.
    fn set_recorded(&self, recorded: Vec<Recorded>, ahead: bool) {
        let mut ran = self.ran.locked();
        let before = std::mem::take(&mut *ran);
        let run = |r: &&Recorded| !ahead || before.iter().any(|b| b.places_like(r));
        *ran = recorded.iter().filter(run).cloned().collect();
        *self.recorded.locked() = Some(recorded);
    }

    /// Notes records up to `seen`.
    fn saw(&self, seen: u64) {
        self.seq.fetch_max(seen, Ordering::AcqRel);
    }

    /// A `seq` above every record seen, `seen` included (the writer takes it with
    /// [`PlacementState::saw`] before it writes).
    fn next_seq(&self, seen: u64) -> u64 {
        self.saw(seen);
        self.seq.load(Ordering::Acquire) + 1
    }

    /// Notes a record this router moved from, or wrote, as `seq`.
    fn knows(&self, seq: u64) {
        self.saw(seq);
        self.known_seq.fetch_max(seq, Ordering::AcqRel);
    }
}

/// The right to write a router's record, held (see [`PlacementState::writing`]).
pub(crate) struct Writing<'a> {
    _held: tokio::sync::MutexGuard<'a, ()>,
}

/// A shard's record as read: its `seq` and placements (`None`: the shard holds none).
type Read = Option<(u64, Vec<Recorded>)>;

/// The records of `fleet` on each of `shards`, in their order (see [`record_on`]).
async fn records(shards: &[Arc<ShardState>], fleet: &str) -> Vec<Result<Read, String>> {
    join_all(shards.iter().map(|s| record_on(s, fleet))).await
}

/// The record of `fleet` on shard `s`; `Err` says that the shard did not answer, or holds a
/// record this version cannot read.
async fn record_on(s: &ShardState, fleet: &str) -> Result<Read, String> {
    let found = (s.unguarded().fleet_placement(fleet).await)
        .map_err(|e| format!("shard {}: {}", s.name(), registry::unmigrated_or(&e)))?;
    match found {
        None => Ok(None),
        Some((seq, text)) => serde_json::from_str(&text)
            .map(|placements| Some((seq, placements)))
            .map_err(|e| {
                format!(
                    "shard {}: its record of fleet `{fleet}`'s placements is unreadable ({e})",
                    s.name()
                )
            }),
    }
}

/// [`record_on`], given up after `within` if set.
async fn record_within(
    s: &ShardState,
    fleet: &str,
    within: Option<Duration>,
) -> Result<Read, String> {
    let read = record_on(s, fleet);
    match within {
        None => read.await,
        Some(wait) => (tokio::time::timeout(wait, read).await)
            .unwrap_or_else(|_| Err(format!("shard {}: no answer", s.name()))),
    }
}

/// Whether two records name the same placements in the same order.
fn same_record(a: &[Recorded], b: &[Recorded]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| a.places_like(b))
}

/// The newest records of `reads` (the highest `seq`): one, or several that differ when two
/// processes recorded at once and each won some shards; empty if none.
fn newest(reads: &[Read]) -> Vec<&Vec<Recorded>> {
    let Some(top) = reads.iter().flatten().map(|(seq, _)| *seq).max() else {
        return Vec::new();
    };
    let mut out: Vec<&Vec<Recorded>> = Vec::new();
    for (_, record) in reads.iter().flatten().filter(|(seq, _)| *seq == top) {
        if !out.iter().any(|o| same_record(o, record)) {
            out.push(record);
        }
    }
    out
}

/// The records of `topology`'s fleet on its current shards, as a start reads them: `Err` for
/// the first shard that did not answer; under `registry: static` (nothing else is checked at
/// a start either) such a shard is left out instead, its error returned beside the records.
async fn current_records(topology: &Topology) -> Result<(Vec<Read>, Vec<String>), String> {
    let fleet = topology.config.instance.fleet();
    let (mut reads, mut skipped) = (Vec::new(), Vec::new());
    for read in records(&topology.current.shards, fleet).await {
        match read {
            Ok(read) => reads.push(read),
            Err(e) if topology.config.cleaner.registry == RegistryKind::Static => skipped.push(e),
            Err(e) => return Err(e),
        }
    }
    Ok((reads, skipped))
}

/// The highest `seq` among `reads` (0: none).
fn top_seq(reads: &[Read]) -> u64 {
    (reads.iter().flatten().map(|(seq, _)| *seq))
        .max()
        .unwrap_or(0)
}

/// The configs of the placements a process starting onto `topology` must move from, oldest
/// first (empty: none). `Err` says why it cannot tell or cannot make that move yet: a shard's
/// record unread, a recorded shard it cannot reach. It grants nothing until this answers `Ok`
/// and the move is made; the start tries again with each heartbeat.
pub(crate) async fn to_move_from(
    topology: &Topology,
    state: &PlacementState,
) -> Result<Vec<Config>, String> {
    let fleet = topology.config.instance.fleet();
    let why = |why: String| {
        format!(
            "this process has not read where fleet `{fleet}` last placed keys, and grants nothing \
             until it has: {why}"
        )
    };
    let (reads, skipped) = current_records(topology).await.map_err(why)?;
    for error in skipped {
        tracing::warn!(fleet, error, "shardlock starts without reading its fleet's placement record on a shard (registry: static)");
    }
    state.knows(top_seq(&reads));
    // Of records written at once, every placement either names (each once, in order).
    let mut recorded: Vec<Recorded> = Vec::new();
    for record in newest(&reads) {
        for placement in record {
            if !recorded.iter().any(|r| r.places_like(placement)) {
                recorded.push(placement.clone());
            }
        }
    }
    if recorded.is_empty() {
        // Either the fleet's first start, or a start onto none of the databases its fleet
        // runs on (whose registry and record it cannot see): said, since only a reload of the
        // fleet moves it onto new databases safely.
        tracing::info!(fleet, "shardlock found no placement record of its fleet on any of its shards: it starts as the fleet's first placement (a fleet running on other databases is not seen: move a fleet onto new databases by reloading it)");
        return Ok(Vec::new());
    }
    join_all(topology.current.shards.iter().map(|s| s.resolve_identity())).await;
    let Some(own) = Recorded::of(&topology.current) else {
        return Err(why(
            "it cannot tell yet which database each of its shards is".to_owned(),
        ));
    };
    let moves: Vec<&Recorded> = recorded.iter().filter(|r| !r.places_like(&own)).collect();
    let mut configs = Vec::with_capacity(moves.len());
    for r in moves {
        configs.push(r.config_in(topology).map_err(|e| {
            format!(
                "this process cannot move from the placement fleet `{fleet}` last ran: {e}. \
                 Start one process with the config that fleet ran, then reload it to this one; \
                 or, to give up what the keys that left had there (fences, rows kept past their \
                 release, jobs, CAS locks), delete fleet `{fleet}`'s row of shardlock_placement \
                 on every shard it has used"
            )
        })?);
    }
    // Moved from now: it carries what keys had there.
    state.ran_too(recorded.iter().cloned());
    if !configs.is_empty() {
        tracing::info!(
            fleet,
            placements = configs.len(),
            "shardlock starts onto another placement than its fleet last ran: it moves from \
             that one as a reload would"
        );
    }
    Ok(configs)
}

/// Before a start opens its gate: `Err` if its fleet recorded placements since the start
/// moved from its record (a process of the old fleet reloaded meanwhile, then stopped), or the
/// record cannot be read; the start then moves from the newer record too.
pub(crate) async fn still_settled(
    topology: &Topology,
    state: &PlacementState,
) -> Result<(), String> {
    if state.is_tool() {
        return Ok(());
    }
    let fleet = topology.config.instance.fleet();
    let (reads, _) = current_records(topology).await.map_err(|e| {
        format!("this process cannot read where fleet `{fleet}` last placed keys: {e}")
    })?;
    let newest = top_seq(&reads);
    if newest <= state.known_seq.load(Ordering::Acquire) {
        return Ok(());
    }
    // Written by others since: nothing to move from if it names only placements this router
    // runs or moved from (the same move recorded by another process, say).
    let own = own(topology);
    let ran = state.ran();
    let known = |record: &&Vec<Recorded>| {
        own.as_ref()
            .is_some_and(|own| may_replace(own, &ran, record))
    };
    if self::newest(&reads).iter().all(known) {
        state.knows(newest);
        return Ok(());
    }
    let why = moved_on(fleet);
    state.tried(Some(why.clone()), false);
    Err(why)
}

/// Whether a process placing keys by `own` (its moves in force, oldest first, then its
/// current placement), that has run `ran` too (placements it moved from, their moves over),
/// may replace the record `theirs`: only if it names no placement but those. So a process whose
/// view is stale (paused, not reloaded yet) never drops a placement the fleet granted under
/// since; one in a move adds to the record; one whose moves are over may drop a placement it
/// moved from itself (its carry from there is done, and a move ends only once every live
/// process of the fleet runs its topology).
fn may_replace(own: &[Recorded], ran: &[Recorded], theirs: &[Recorded]) -> bool {
    (theirs.iter()).all(|t| own.iter().chain(ran).any(|o| o.places_like(t)))
}

/// Records the placements of `inner`'s router on its current shards if they changed since it
/// last did and it may (see the module's doc); tried again at the next heartbeat otherwise.
pub(crate) async fn record_if_due(inner: &Inner) {
    let _writing = inner.placement.writing().await;
    if !inner.gate.is_closed() {
        record(inner, &inner.topology.load_full()).await;
    }
}

/// What a write of the record came to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Recording {
    /// The record names the placements (written now or before, or by another router of the
    /// fleet that wrote the same), or need not: nothing to record, not this router's to
    /// write at rest while its fleet disagrees.
    Named,
    /// Not written: a shard did not answer, or another write of other placements won it.
    NotYet,
    /// The fleet recorded placements since that this router does not run: it moves from
    /// them before it grants (see [`still_settled`]).
    MovedOn(String),
}

/// Records `topology`'s placements before `inner`'s router places keys by them: a reload
/// about to swap it in (holding `_writing` until its swap), a start or a rejoin about to open
/// its gate. So a whole fleet that stops right after still has its record name the placement
/// it granted under (a start onto the placement before would miss what the keys that moved
/// got where they live now: a job enqueued there). Best effort: when the record does not name
/// it `within` that time (a current shard silent, say), it warns and the caller goes on (a
/// reload away from a failing shard must not wait for it); the heartbeat records it later.
pub(crate) async fn record_ahead(
    inner: &Inner,
    topology: &Topology,
    _writing: &Writing<'_>,
    within: Duration,
) -> Recording {
    let recorded = tokio::time::timeout(within, record(inner, topology)).await;
    let recorded = recorded.unwrap_or(Recording::NotYet);
    if recorded != Recording::Named {
        tracing::warn!(
            epoch = topology.epoch,
            "shardlock places keys before its fleet's placement record names where: a whole \
             fleet stopped before its heartbeat records it would start from the placement before"
        );
    }
    recorded
}

/// Whether the fleet's placement record on `source`, a shard a move of `topology` leaves,
/// names the placement the move went to; `Err` says why not. Once the move is over no write
/// of the record goes there any more: a whole fleet restarted onto the placement it left (a
/// rollback) would read there a record from before the move (its write there failed: the
/// shard slow, its row locked) and grant where it knows nothing of what the keys got since.
/// Not named, it is written there (as the heartbeat writes it, but waiting for that shard as
/// for any statement of it) and read again.
pub(crate) async fn names_the_move_on(
    inner: &Inner,
    source: &ShardState,
    topology: &Topology,
) -> Result<(), String> {
    let current = Recorded::of(&topology.current)
        .ok_or("the identity of a shard the move goes to is not known yet")?;
    let fleet = topology.config.instance.fleet();
    let named = || async {
        let found = (source.unguarded().fleet_placement(fleet).await)
            .map_err(|e| format!("shard {}: {}", source.name(), registry::unmigrated_or(&e)))?;
        // A record this version cannot read was written by a newer one, after this move
        // began: a start of this version refuses it.
        let theirs = found.map(|(_, text)| serde_json::from_str::<Vec<Recorded>>(&text));
        Ok::<_, String>(match theirs {
            Some(Ok(theirs)) => theirs.iter().any(|t| t.places_like(&current)),
            Some(Err(_)) => true,
            None => false,
        })
    };
    if named().await? {
        return Ok(());
    }
    {
        let _writing = inner.placement.writing().await;
        // Not once a reload replaced `topology` meanwhile: its record, written ahead of the
        // swap, names the placement granted under now, which this one does not.
        if inner.topology.load().epoch != topology.epoch {
            return Err("a reload replaced the topology meanwhile".to_owned());
        }
        if !inner.gate.is_closed() && !named().await? {
            record_waiting(inner, topology, Some(source)).await;
        }
    }
    match named().await? {
        true => Ok(()),
        false => Err(
            "its copy of the fleet's placement record does not name the placement \
                      moved to yet"
                .to_owned(),
        ),
    }
}

/// How long a reload waits for its record written ahead: a second, or half a heartbeat
/// interval if longer. (A join waits half its lapse at most: it beat just before.)
pub(crate) fn ahead_bound(config: &Config) -> Duration {
    (config.cleaner.heartbeat_interval / 2).max(Duration::from_secs(1))
}

/// How long a write of the record waits for a shard its router's moves leave (a shard gone
/// for good, or cut off, must not hold the write back; it is left out).
fn leaving_wait(topology: &Topology) -> Duration {
    (topology.config.cleaner.heartbeat_interval / 4).max(Duration::from_millis(250))
}

/// [`record_if_due`] of `topology`.
async fn record(inner: &Inner, topology: &Topology) -> Recording {
    record_waiting(inner, topology, None).await
}

/// [`record`], waiting for each shard the router's moves leave a short while at most (see
/// [`leaving_wait`]), but for `waited_for` (one of them) as long as its statements take.
async fn record_waiting(
    inner: &Inner,
    topology: &Topology,
    waited_for: Option<&ShardState>,
) -> Recording {
    let state = &inner.placement;
    // A router that has granted, or that moves keys (it carries them whether or not it grants).
    let moving = topology.moves_in_progress() > 0;
    if !(state.granting.load(Ordering::Acquire) || moving)
        || state.is_tool()
        || inner.shared.is_closed()
        || state.unsettled().is_some()
    {
        return Recording::Named;
    }
    if own(topology).is_none() {
        join_all(topology.all_shards().iter().map(|s| s.resolve_identity())).await;
    }
    let Some(own) = own(topology) else {
        return Recording::NotYet;
    };
    // Not swapped in yet (a reload records ahead): not run until it is.
    let ahead = !std::ptr::eq(&**inner.topology.load(), topology);
    if !ahead {
        state.ran_too(own.iter().cloned());
    }
    if state.recorded().as_ref() == Some(&own) {
        return Recording::Named;
    }
    if own.len() == 1
        && registry::fleet_disagreement(topology, &inner.shared)
            .await
            .is_some()
    {
        return Recording::Named;
    }
    // On the shards of its moves in force too: a start onto a placement the fleet moved away
    // from reads there that it did.
    let shards = topology.registry_shards();
    let fleet = topology.config.instance.fleet();
    let current =
        |shard: &Arc<ShardState>| (topology.current.shards.iter()).any(|c| Arc::ptr_eq(c, shard));
    // Every current shard must answer (a start reads those); a shard a move leaves that does
    // not (gone for good, cut off) is left out.
    let wait = leaving_wait(topology);
    let waited = |shard: &Arc<ShardState>| waited_for.is_some_and(|w| w.same_database(shard));
    let within = |shard: &Arc<ShardState>| (!current(shard) && !waited(shard)).then_some(wait);
    let mut answered = Vec::with_capacity(shards.len());
    let mut reads = Vec::with_capacity(shards.len());
    // Reads of the current shards alone: what a start reads.
    let mut on_current = Vec::with_capacity(shards.len());
    let mut left_out = false;
    let read = join_all(shards.iter().map(|s| record_within(s, fleet, within(s)))).await;
    for (shard, read) in shards.iter().zip(read) {
        match read {
            Ok(read) => {
                if current(shard) {
                    on_current.push(read.clone());
                }
                answered.push(shard.clone());
                reads.push(read);
            }
            Err(_) if !current(shard) => left_out = true,
            Err(_) => return Recording::NotYet,
        }
    }
    let shards = answered;
    let ran = state.ran();
    let newest = newest(&reads);
    if !newest.iter().all(|theirs| may_replace(&own, &ran, theirs)) {
        tracing::debug!(
            "shardlock leaves its fleet's placement record alone: it names a placement this \
             process does not run"
        );
        // Another process recorded further. Judged where a start reads, on the current
        // shards (a record on a shard the move leaves alone is not read there): whether that
        // names these placements too, or others this process must move from first.
        let on_current = self::newest(&on_current);
        if on_current
            .iter()
            .all(|theirs| may_replace(&own, &ran, theirs))
        {
            return Recording::NotYet;
        }
        let names =
            |theirs: &&Vec<Recorded>| (own.iter()).all(|o| theirs.iter().any(|t| t.places_like(o)));
        return match on_current.iter().any(names) {
            true => Recording::Named,
            false => Recording::MovedOn(moved_on(fleet)),
        };
    }
    let seq = state.next_seq(top_seq(&reads));
    // Taken: a retry after a write that lost somewhere writes above it.
    state.saw(seq);
    let text = serde_json::to_string(&own).expect("placements serialize");
    let writes = join_all((shards.iter().zip(&reads)).map(|(s, read)| {
        let (read, text) = (read.as_ref().map(|(seq, _)| *seq), &text);
        async move {
            let write = s.unguarded().record_placement(fleet, read, seq, text);
            match within(s) {
                None => write.await.ok(),
                Some(wait) => (tokio::time::timeout(wait, write).await)
                    .ok()
                    .and_then(Result::ok),
            }
        }
    }))
    .await;
    if !writes.iter().all(|w| *w == Some(true)) {
        // Every shard answered, and where the write lost, another router of the fleet wrote
        // first: with the same placements (the whole fleet reloading at once), the record
        // names them all the same. Read back, nothing written again.
        let lost = (shards.iter().zip(&writes)).filter(|(_, w)| **w == Some(false));
        let read_back = join_all(lost.map(|(s, _)| record_within(s, fleet, within(s)))).await;
        let named = |read: &Result<Read, String>| {
            let theirs = read.as_ref().ok().and_then(Option::as_ref);
            theirs.is_some_and(|(_, theirs)| same_record(theirs, &own))
        };
        if !(writes.iter().all(Option::is_some) && read_back.iter().all(named)) {
            return Recording::NotYet;
        }
        // Named on every shard all the same (one database reached through two shards of
        // the placements in force, say: written twice under one `seq`, the second write
        // lost to the first): recorded (else each heartbeat writes it again).
        if !left_out {
            state.set_recorded(own, ahead);
        }
        return Recording::Named;
    }
    state.knows(seq);
    // Done once every shard took it, those a move leaves included (a start onto the
    // placement moved away from reads there where the fleet went): until then each heartbeat
    // writes it again.
    if !left_out {
        state.set_recorded(own, ahead);
        (inner.shared.stats.placements_recorded).fetch_add(1, Ordering::Relaxed);
    }
    Recording::Named
}

/// Why a process does not grant once its fleet recorded placements it does not run.
fn moved_on(fleet: &str) -> String {
    format!(
        "fleet `{fleet}` recorded where it places keys since this process read it: it moves \
         from there too before it grants"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded(shards: &[(&str, u32, &str)], virtual_nodes: u32) -> Recorded {
        Recorded {
            virtual_nodes,
            shards: (shards.iter())
                .map(|(name, weight, id)| RecordedShard {
                    name: (*name).to_owned(),
                    weight: *weight,
                    identity: format!("{id} h:3306#1/db"),
                })
                .collect(),
        }
    }

    #[test]
    fn a_placement_is_compared_by_its_shards_weights_databases_and_virtual_nodes() {
        let r = recorded(&[("a", 1, "x"), ("b", 2, "y")], 160);
        let promoted = Recorded {
            shards: vec![
                r.shards[0].clone(),
                RecordedShard {
                    identity: "y replica:3306#2/db".to_owned(),
                    ..r.shards[1].clone()
                },
            ],
            ..r.clone()
        };
        assert!(r.places_like(&promoted), "a promoted replica keeps the id");
        assert!(!r.places_like(&recorded(&[("a", 1, "x"), ("b", 1, "y")], 160)));
        assert!(!r.places_like(&recorded(&[("a", 1, "x"), ("b", 2, "z")], 160)));
        assert!(!r.places_like(&recorded(&[("a", 1, "x"), ("b", 2, "y")], 100)));
        assert!(!r.places_like(&recorded(&[("a", 1, "x")], 160)));
    }

    #[test]
    fn a_placement_recorded_ahead_of_a_reload_counts_as_run_only_once_swapped_in() {
        let [p, q] = ["p", "q"].map(|id| recorded(&[("a", 1, id)], 160));
        let state = PlacementState::default();
        state.ran_too([p.clone()]);
        state.set_recorded(vec![p.clone(), q.clone()], true);
        assert!(
            matches!(&state.ran()[..], [only] if *only == p),
            "a reload dropped before its swap ran only p"
        );
        state.ran_too([q.clone()]);
        state.set_recorded(vec![p.clone(), q.clone()], false);
        assert_eq!(state.ran(), [p, q]);
    }

    #[test]
    fn a_record_is_replaced_only_by_a_process_whose_placements_it_names() {
        let [p, q, r] = ["p", "q", "r"].map(|id| vec![recorded(&[("a", 1, id)], 160)]);
        let chain = |parts: &[&Vec<Recorded>]| -> Vec<Recorded> {
            parts.iter().flat_map(|p| p.iter().cloned()).collect()
        };
        // At rest on q, having moved from p: the end of that move, or a record of p alone (no
        // grant during the move wrote it), but nothing else.
        assert!(may_replace(&q, &p, &chain(&[&p, &q])));
        assert!(may_replace(&q, &p, &p));
        assert!(may_replace(&q, &[], &q));
        assert!(!may_replace(&q, &[], &p), "a process that never ran p");
        assert!(
            !may_replace(&q, &p, &chain(&[&q, &r])),
            "a move after its own"
        );
        assert!(!may_replace(&q, &p, &r), "a process that has not moved on");
        // Moving p -> q: adds to a record of p, or its own, or q alone; never drops r.
        let moving = chain(&[&p, &q]);
        assert!(may_replace(&moving, &[], &p));
        assert!(may_replace(&moving, &[], &q));
        assert!(may_replace(&moving, &[], &moving));
        assert!(!may_replace(&moving, &[], &r));
        assert!(!may_replace(&moving, &[], &chain(&[&q, &r])));
    }

    #[test]
    fn of_the_records_the_highest_seq_is_read_and_several_written_at_once_are_all_read() {
        let (a, b) = (
            vec![recorded(&[("a", 1, "x")], 160)],
            vec![recorded(&[("b", 1, "y")], 160)],
        );
        let reads = vec![Some((3, a.clone())), None, Some((4, b.clone()))];
        assert_eq!(newest(&reads), vec![&b]);
        let reads = vec![Some((4, a.clone())), Some((4, a.clone()))];
        assert_eq!(newest(&reads), vec![&a]);
        let tied = [Some((4, a.clone())), Some((4, b.clone()))];
        assert_eq!(newest(&tied), vec![&a, &b]);
        assert!(newest(&[None, None]).is_empty());
    }
}
