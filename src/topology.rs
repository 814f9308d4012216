//! The topology: which shards exist, where keys live, and where they lived before a reload.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::Moment;
use shardlock_core::config::ShardConfig;
use shardlock_core::{Config, ConfigError, LockKey, Result, Ring};
use shardlock_mysql::Shard;

use crate::shard::Shared;
use crate::shard::{spawn_keeper, ShardState};

/// Shards and the ring that places keys on them.
#[derive(Debug)]
pub(crate) struct Placement {
    ring: Ring,
    pub(crate) shards: Vec<Arc<ShardState>>,
    /// The ring's virtual nodes per unit of weight.
    pub(crate) virtual_nodes: u32,
}

impl Placement {
    pub(crate) fn locate(&self, key: &LockKey) -> &Arc<ShardState> {
        self.locate_bytes(key.placement())
    }

    pub(crate) fn locate_bytes(&self, placement: &[u8]) -> &Arc<ShardState> {
        &self.shards[self.ring.locate(placement)]
    }
}

/// A placement that was current before a reload, kept while leases granted under it may still
/// be live elsewhere or its rows' fences may still be needed.
#[derive(Debug, Clone)]
pub(crate) struct Previous {
    pub(crate) placement: Arc<Placement>,
    /// End of the move window: processes that have not reloaded may place keys here until then.
    pub(crate) until: Moment,
    /// Set once the fences of its shards' rows were copied to where their keys live now (see
    /// [`crate::moves::carry_fences`]); until then its shards are still consulted as a floor.
    pub(crate) fences_carried: Arc<AtomicBool>,
    /// Set once this process's carry of its shards' rows began: its window was over and (with
    /// the heartbeat registry) every live process of the fleet ran this one's topology, so rows taken
    /// here since exclude nobody the key's shards under later placements do not, and a CAS
    /// take here that lands after the carry's scan passed its key would be left behind (see
    /// [`Topology::carrying_at`]).
    pub(crate) carry_begun: Arc<AtomicBool>,
    /// The fingerprint of the topology it belonged to, to name it in warnings: processes of
    /// the fleet that advertise any topology but this process's keep the move in force, a
    /// reload back to it too (see [`crate::moves::carry_fences`]).
    pub(crate) fingerprint: String,
}

impl Previous {
    /// Whether acquires of keys that moved away from it must still take them here too.
    pub(crate) fn in_force(&self, now: Moment) -> bool {
        self.until > now || !self.fences_carried.load(Ordering::Acquire)
    }
}

/// Everything that placement depends on, swapped as one by a reload.
#[derive(Debug)]
pub(crate) struct Topology {
    /// Bumped by every reload.
    pub(crate) epoch: u64,
    /// When this topology was swapped in: leases placed before it follow their moved keys
    /// within half the move window from then (see [`crate::moves`]).
    pub(crate) reloaded_at: Moment,
    pub(crate) config: Arc<Config>,
    pub(crate) current: Arc<Placement>,
    /// Earlier placements, oldest first, each until its move window ends and its fences were
    /// carried over: leases granted under them may still be live, and their rows' fences are
    /// the floor of moved keys, so moved keys are also taken there.
    pub(crate) previous: Vec<Previous>,
    /// Metric attribute values of the namespaces, built once (cheap to clone per acquire).
    namespace_labels: std::collections::HashMap<String, opentelemetry::StringValue>,
    /// What decides where keys live, as a short fingerprint (see [`fingerprint`]): advertised
    /// with each heartbeat, so that a router starting with another topology than its fleet's
    /// can tell.
    pub(crate) fingerprint: String,
}

/// A fingerprint of what places keys under `config`: each shard's name and weight, the ring's
/// virtual nodes and each namespace's buckets and key prefix. Two processes with equal fingerprints place
/// every key on the same shard name. (Not the URLs: one database is often reached by several,
/// through proxies or aliases. A shard pointed at another server is told apart by its
/// identity, at reloads.) FNV-1a, 64 bits, in hex: stable across processes, builds and
/// versions.
pub(crate) fn fingerprint(config: &Config) -> String {
    let mut lines: Vec<String> = config
        .shards
        .iter()
        .map(|s| format!("shard {} {}", s.name, s.weight))
        .collect();
    lines.push(format!("virtual-nodes {}", config.routing.virtual_nodes));
    for (name, ns) in &config.namespaces {
        // A prefix joins the line only when set: fleets without prefixes keep the fingerprint
        // earlier versions computed.
        match &ns.key_prefix {
            None => lines.push(format!("namespace {name} {}", ns.buckets)),
            Some(prefix) => lines.push(format!(
                "namespace {name} {} prefix {}",
                ns.buckets,
                prefix
                    .bytes()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
            )),
        }
    }
    lines.sort();
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in lines.join("\n").bytes() {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{hash:016x}")
}

impl Topology {
    /// The metric attribute value of namespace `name`.
    pub(crate) fn namespace_label(&self, name: &str) -> opentelemetry::StringValue {
        self.namespace_labels
            .get(name)
            .cloned()
            .unwrap_or_else(|| opentelemetry::StringValue::from(name.to_owned()))
    }

    /// Builds the topology of `config`. Shards whose name and settings are unchanged from
    /// `reuse` keep their pool, keeper and breaker (a reload gives them `config`'s breaker
    /// settings once it takes the topology); the others get new ones. Refused (a shard whose
    /// password file cannot be read, say), it changed nothing and started nothing.
    pub(crate) fn build(
        config: Config,
        epoch: u64,
        reuse: &[Arc<ShardState>],
        previous: Vec<Previous>,
        shared: &Arc<Shared>,
        source: Option<(&str, Option<&Path>)>,
    ) -> Result<Self> {
        // Every new shard's backend first: one that cannot be built refuses the topology
        // before a new shard's keeper is started.
        enum Part<'a> {
            Kept(Arc<ShardState>),
            New(Shard, &'a ShardConfig),
        }
        let mut parts = Vec::with_capacity(config.shards.len());
        for (i, sc) in config.shards.iter().enumerate() {
            if let Some(same) = reuse.iter().find(|s| s.config == *sc && !s.is_closed()) {
                parts.push(Part::Kept(same.clone()));
                continue;
            }
            let mut shard = Shard::new(sc, i).map_err(|e| locate(e, source))?;
            if let Some(old) = reuse.iter().find(|s| s.name() == sc.name) {
                shard = shard.with_stranded_of(old.unguarded());
            }
            parts.push(Part::New(shard, sc));
        }
        let shards = parts
            .into_iter()
            .map(|part| match part {
                Part::Kept(same) => same,
                Part::New(shard, sc) => {
                    let state =
                        ShardState::new(shard, sc.clone(), config.breaker.clone(), shared.clone());
                    spawn_keeper(&state, shared.closed.subscribe());
                    state
                }
            })
            .collect();
        let virtual_nodes = config.routing.virtual_nodes;
        let ring = Ring::new(
            config.shards.iter().map(|s| (s.name.as_str(), s.weight)),
            virtual_nodes,
        );
        let namespace_labels = config
            .namespaces
            .keys()
            .map(|n| {
                (
                    n.clone(),
                    opentelemetry::StringValue::from(Arc::<str>::from(n.as_str())),
                )
            })
            .collect();
        Ok(Self {
            namespace_labels,
            fingerprint: fingerprint(&config),
            epoch,
            reloaded_at: Moment::now(),
            config: Arc::new(config),
            current: Arc::new(Placement {
                ring,
                shards,
                virtual_nodes,
            }),
            previous,
        })
    }

    /// The shard `key` lives on now.
    pub(crate) fn locate(&self, key: &LockKey) -> &Arc<ShardState> {
        self.current.locate(key)
    }

    /// Whether this topology places `key` where `then` did: on the same shard, with no earlier
    /// location that `then` did not have too.
    pub(crate) fn places_like(&self, then: &Topology, key: &LockKey) -> bool {
        let before = then.previous_locations(key);
        self.locate(key).same_database(then.locate(key))
            && self
                .previous_locations(key)
                .iter()
                .all(|p| before.iter().any(|b| b.same_database(p)))
    }

    /// The shards `key` lived on under earlier placements whose move window is still open,
    /// other than its current one, without repeats and in name order (every process takes
    /// them in the same order).
    pub(crate) fn previous_locations(&self, key: &LockKey) -> Vec<Arc<ShardState>> {
        if self.previous.is_empty() {
            return Vec::new();
        }
        let now = Moment::now();
        let current = self.locate(key);
        let mut out: Vec<Arc<ShardState>> = Vec::new();
        for previous in &self.previous {
            let shard = previous.placement.locate(key);
            if previous.in_force(now)
                && !shard.same_database(current)
                && !out.iter().any(|s| s.same_database(shard))
            {
                out.push(shard.clone());
            }
        }
        out.sort_by(|a, b| a.name().cmp(b.name()));
        out
    }

    /// Whether `key`, taken on `at` as one of its previous locations, lives there only under
    /// placements whose carry began (see [`Previous::carry_begun`]): a later placement still
    /// waiting for processes that run it needs the row there.
    pub(crate) fn carrying_at(&self, key: &LockKey, at: &ShardState) -> bool {
        let mut placing = self
            .previous
            .iter()
            .filter(|p| p.placement.locate(key).same_database(at))
            .peekable();
        placing.peek().is_some() && placing.all(|p| p.carry_begun.load(Ordering::Acquire))
    }

    /// The shards `key` lived on under earlier placements, oldest placement first, without
    /// repeats.
    pub(crate) fn previous_shards_oldest_first(&self, key: &LockKey) -> Vec<Arc<ShardState>> {
        let mut out: Vec<Arc<ShardState>> = Vec::new();
        for p in &self.previous {
            let shard = p.placement.locate(key);
            if !out.iter().any(|s| s.same_database(shard)) {
                out.push(shard.clone());
            }
        }
        out
    }

    /// The placements a reload to a new topology must keep: earlier ones still in force, and
    /// this one until `window` from now (and its fences carried over). When the ring does not
    /// change at all, nothing moves and this placement is not kept.
    pub(crate) fn previous_for_next(&self, next: &Topology, window: Duration) -> Vec<Previous> {
        let now = Moment::now();
        let mut kept: Vec<_> = self
            .previous
            .iter()
            .filter(|p| p.in_force(now))
            .cloned()
            .collect();
        // The same shards (the same databases, whatever their URLs) with the same weights, in
        // any order: the ring is made of names and weights, not of the file's order.
        let (this, that) = (&self.config, &next.config);
        let same_ring = this.routing.virtual_nodes == that.routing.virtual_nodes
            && this.shards.len() == that.shards.len()
            && (this.shards.iter())
                .all(|a| (that.shards.iter()).any(|b| a.name == b.name && a.weight == b.weight))
            && (self.current.shards.iter()).all(|a| {
                (next.current.shards.iter()).any(|b| a.name() == b.name() && a.same_database(b))
            });
        if !same_ring {
            kept.push(Previous {
                placement: self.current.clone(),
                until: now + window,
                fences_carried: Arc::default(),
                carry_begun: Arc::default(),
                fingerprint: self.fingerprint.clone(),
            });
        }
        kept
    }

    /// Where a key placed at `placement` (by its placement bytes; `None`: a digest, whose
    /// placement is unknown, so every shard) lives under the placements that came after
    /// `previous`, the current one included, other than `from`, without repeats.
    pub(crate) fn later_locations(
        &self,
        previous: &Arc<Placement>,
        from: &ShardState,
        placement: Option<&[u8]>,
    ) -> Vec<Arc<ShardState>> {
        // Placements no longer in force have carried their own rows on already (and their
        // shards may be closed).
        let now = Moment::now();
        let later = self
            .previous
            .iter()
            .skip_while(|p| !Arc::ptr_eq(&p.placement, previous))
            .skip(1)
            .filter(|p| p.in_force(now))
            .map(|p| &p.placement)
            .chain(std::iter::once(&self.current));
        let mut out: Vec<Arc<ShardState>> = Vec::new();
        let mut add = |s: &Arc<ShardState>| {
            if !s.same_database(from) && !out.iter().any(|o| o.same_database(s)) {
                out.push(s.clone());
            }
        };
        for p in later {
            match placement {
                Some(bytes) => add(p.locate_bytes(bytes)),
                None => p.shards.iter().for_each(&mut add),
            }
        }
        out
    }

    /// The shard a lock stored as `stored` lives on now, if its placement can be told (not a
    /// digest).
    pub(crate) fn current_location(&self, stored: &[u8]) -> Option<&Arc<ShardState>> {
        LockKey::placement_of_stored(stored).map(|p| self.current.locate_bytes(p))
    }

    /// Whether `shard` is still needed by an earlier placement in force (its move window is
    /// open or its fences are still to be carried over).
    pub(crate) fn still_needed(&self, shard: &Arc<ShardState>) -> bool {
        let now = Moment::now();
        self.previous
            .iter()
            .any(|p| p.in_force(now) && p.placement.shards.iter().any(|s| Arc::ptr_eq(s, shard)))
    }

    /// How many earlier placements are still in force.
    pub(crate) fn moves_in_progress(&self) -> usize {
        let now = Moment::now();
        self.previous.iter().filter(|p| p.in_force(now)).count()
    }

    /// The shards whose registry says who runs what: the current ones and those of earlier
    /// placements still in force (processes that have not reloaded heartbeat there). A
    /// placement whose move is over is left out: its shards' pools close once drained.
    pub(crate) fn registry_shards(&self) -> Vec<Arc<ShardState>> {
        let now = Moment::now();
        self.shards_of(|p| p.in_force(now))
    }

    /// Every shard in this topology, current or still in a move window, without repeats.
    pub(crate) fn all_shards(&self) -> Vec<Arc<ShardState>> {
        self.shards_of(|_| true)
    }

    /// The current shards and those of the earlier placements `kept`, without repeats.
    fn shards_of(&self, kept: impl Fn(&Previous) -> bool) -> Vec<Arc<ShardState>> {
        let mut out: Vec<Arc<ShardState>> = self.current.shards.clone();
        for previous in self.previous.iter().filter(|p| kept(p)) {
            for s in &previous.placement.shards {
                if !out.iter().any(|o| Arc::ptr_eq(o, s)) {
                    out.push(s.clone());
                }
            }
        }
        out
    }
}

fn locate(e: ConfigError, source: Option<(&str, Option<&Path>)>) -> ConfigError {
    match source {
        Some((text, path)) => e.located(text, path),
        None => e,
    }
}

#[cfg(test)]
mod tests {
    use shardlock_core::Config;

    fn config(weight: u32, url: &str) -> Config {
        Config::from_yaml_str(&format!(
            "shards:\n  - name: a\n    url: {url}\n    weight: {weight}\n  - name: b\n    url: mysql://root@h:2/db\n"
        ))
        .unwrap()
    }

    #[test]
    fn the_fingerprint_follows_the_placement_not_the_urls() {
        let base = super::fingerprint(&config(1, "mysql://root@h:1/db"));
        assert_eq!(
            base,
            super::fingerprint(&config(1, "mysql://other:secret@proxy:9/db"))
        );
        assert_ne!(base, super::fingerprint(&config(2, "mysql://root@h:1/db")));
    }
}
