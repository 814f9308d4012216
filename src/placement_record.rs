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
//! nothing, a `shardlock migrate` run say, places nothing.) While a move is in force it may only add to the record
//! (every recorded placement is one of its own); at rest, with every live instance of its fleet
//! agreeing (under `registry: static`, nothing to check), it may only shorten a record that
//! ends with its placement. A process whose view is stale (paused past its heartbeat timeout,
//! say) therefore never drops a placement the fleet granted under. Each shard's record is
//! replaced only over the one the writer read (compare and set on its `seq`), with a `seq`
//! above every record the process has seen; a start takes the record with the highest `seq`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use futures_util::future::join_all;
use serde::{Deserialize, Serialize};
use shardlock_core::config::RegistryKind;
use shardlock_core::Config;

use crate::registry;
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
fn shard_id(identity: &str) -> &str {
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
        for recorded in &self.shards {
            let mut reaching = None;
            for state in &topology.current.shards {
                let Some(identity) = state.server_identity() else {
                    return Err(format!(
                        "this process cannot tell yet which database shard `{}` is",
                        state.name()
                    ));
                };
                if shard_id(&identity) == shard_id(&recorded.identity) {
                    reaching = Some(state);
                }
            }
            let Some(state) = reaching else {
                return Err(format!(
                    "it last ran shard `{}` at database {}, which this config does not reach",
                    recorded.name, recorded.identity
                ));
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
    /// first time at once (`beat_now` wakes the heartbeat, which records).
    pub(crate) fn granting(&self, beat_now: &tokio::sync::Notify) {
        if !self.granting.load(Ordering::Relaxed) && !self.granting.swap(true, Ordering::AcqRel) {
            beat_now.notify_one();
        }
    }

    fn recorded(&self) -> Option<Vec<Recorded>> {
        self.recorded.locked().clone()
    }

    fn set_recorded(&self, recorded: Vec<Recorded>) {
        *self.recorded.locked() = Some(recorded);
    }

    /// Notes records up to `seen`.
    fn saw(&self, seen: u64) {
        self.seq.fetch_max(seen, Ordering::AcqRel);
    }

    /// A `seq` above every record seen, `seen` included.
    fn next_seq(&self, seen: u64) -> u64 {
        self.saw(seen);
        self.seq.fetch_add(1, Ordering::AcqRel) + 1
    }
}

/// A shard's record as read: its `seq` and placements (`None`: the shard holds none).
type Read = Option<(u64, Vec<Recorded>)>;

/// The records of `topology`'s fleet on each of its current shards, in their order; `Err`
/// says which shard did not answer, or holds a record this version cannot read.
async fn records(topology: &Topology) -> Vec<Result<Read, String>> {
    let fleet = topology.config.instance.fleet();
    join_all(topology.current.shards.iter().map(|s| async move {
        let found = (s.call(|b| b.fleet_placement(fleet)).await)
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
    }))
    .await
}

/// The newest of `reads`: `Err` if two shards hold records of the same `seq` that differ
/// (two processes recorded at once; the later of them records again).
fn newest(reads: &[Read]) -> Result<Option<&(u64, Vec<Recorded>)>, String> {
    let mut newest: Option<&(u64, Vec<Recorded>)> = None;
    for read in reads.iter().flatten() {
        match newest {
            Some(n) if n.0 > read.0 => {}
            Some(n) if n.0 == read.0 && n.1 != read.1 => {
                return Err(format!(
                    "its shards hold two records numbered {} that differ (written at once by \
                     two processes)",
                    read.0
                ))
            }
            _ => newest = Some(read),
        }
    }
    Ok(newest)
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
    // Under `registry: static` nothing else is checked at a start either: a shard that does
    // not answer is left out (its record too), as its registry would be.
    let mut reads = Vec::new();
    for read in records(topology).await {
        match read {
            Ok(read) => reads.push(read),
            Err(e) if topology.config.cleaner.registry == RegistryKind::Static => {
                tracing::warn!(fleet, error = e, "shardlock starts without reading its fleet's placement record on a shard (registry: static)");
            }
            Err(e) => return Err(why(e)),
        }
    }
    state.saw(
        (reads.iter().flatten().map(|(seq, _)| *seq))
            .max()
            .unwrap_or(0),
    );
    let Some((_, recorded)) = newest(&reads).map_err(why)?.cloned() else {
        return Ok(Vec::new());
    };
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
                 on every shard"
            )
        })?);
    }
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

/// Whether a process placing keys by `own` (its moves in force, oldest first, then its
/// current placement) may replace the record `theirs`: at rest (no move in force) only one that
/// ends with its placement (the end of a move it made too, or its own), else only one whose
/// every placement is among its own (it adds to the record). A process whose view is stale
/// never drops what the fleet granted under.
fn may_replace(own: &[Recorded], theirs: &[Recorded]) -> bool {
    match own {
        [current] => theirs.last().is_some_and(|last| last.places_like(current)),
        _ => (theirs.iter()).all(|t| own.iter().any(|o| o.places_like(t))),
    }
}

/// Records the placements of `inner`'s router on its current shards if they changed since it
/// last did and it may (see the module's doc); tried again at the next heartbeat otherwise.
pub(crate) async fn record_if_due(inner: &Inner) {
    let topology = inner.topology.load_full();
    let state = &inner.placement;
    if !state.granting.load(Ordering::Acquire)
        || inner.shared.is_closed()
        || inner.gate.is_closed()
        || state.unsettled().is_some()
    {
        return;
    }
    if own(&topology).is_none() {
        join_all(topology.all_shards().iter().map(|s| s.resolve_identity())).await;
    }
    let Some(own) = own(&topology) else { return };
    if state.recorded().as_ref() == Some(&own) {
        return;
    }
    if own.len() == 1
        && registry::fleet_disagreement(&topology, inner.instance_id())
            .await
            .is_some()
    {
        return;
    }
    let Ok(reads) = records(&topology)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
    else {
        return;
    };
    let Ok(newest) = newest(&reads) else { return };
    if let Some((_, theirs)) = newest {
        if !may_replace(&own, theirs) {
            tracing::debug!(
                "shardlock leaves its fleet's placement record alone: it names a placement \
                 this process does not run"
            );
            return;
        }
    }
    let seen = (reads.iter().flatten().map(|(seq, _)| *seq)).max();
    let seq = state.next_seq(seen.unwrap_or(0));
    let fleet = topology.config.instance.fleet();
    let text = serde_json::to_string(&own).expect("placements serialize");
    let writes = join_all(
        (topology.current.shards.iter().zip(&reads)).map(|(s, read)| {
            let (read, text) = (read.as_ref().map(|(seq, _)| *seq), &text);
            async move {
                if read.is_some() && read == Some(seq) {
                    return Ok(true);
                }
                s.call(|b| b.record_placement(fleet, read, seq, text)).await
            }
        }),
    )
    .await;
    if writes.iter().all(|w| matches!(w, Ok(true))) {
        state.set_recorded(own);
    }
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
    fn a_record_is_replaced_only_by_a_process_whose_placements_it_names() {
        let [p, q, r] = ["p", "q", "r"].map(|id| vec![recorded(&[("a", 1, id)], 160)]);
        let chain = |parts: &[&Vec<Recorded>]| {
            parts
                .iter()
                .flat_map(|p| p.iter().cloned())
                .collect::<Vec<_>>()
        };
        // At rest on q: the end of the move p -> q, and its own record, but nothing else.
        assert!(may_replace(&q, &chain(&[&p, &q])));
        assert!(may_replace(&q, &q));
        assert!(!may_replace(&q, &p), "a process that has not moved on");
        assert!(!may_replace(&q, &chain(&[&q, &r])), "a move after its own");
        // Moving p -> q: adds to a record of p, or its own, or q alone; never drops r.
        let moving = chain(&[&p, &q]);
        assert!(may_replace(&moving, &p));
        assert!(may_replace(&moving, &q));
        assert!(may_replace(&moving, &moving));
        assert!(!may_replace(&moving, &r));
        assert!(!may_replace(&moving, &chain(&[&q, &r])));
    }

    #[test]
    fn of_two_records_the_higher_seq_is_read_and_an_equal_one_that_differs_is_refused() {
        let (a, b) = (
            vec![recorded(&[("a", 1, "x")], 160)],
            vec![recorded(&[("b", 1, "y")], 160)],
        );
        let reads = vec![Some((3, a.clone())), None, Some((4, b.clone()))];
        assert_eq!(newest(&reads).unwrap().unwrap().1, b);
        let reads = vec![Some((4, a.clone())), Some((4, a.clone()))];
        assert_eq!(newest(&reads).unwrap().unwrap().1, a);
        assert!(newest(&[Some((4, a)), Some((4, b))]).is_err());
        assert!(newest(&[None, None]).unwrap().is_none());
    }
}
