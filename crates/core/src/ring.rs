//! Placement of keys on shards: a consistent-hash ring with virtual nodes and weights.
//!
//! The ring itself is the `consistent_hash` crate. That crate hashes through
//! `std::hash::Hash`, whose output is not promised to be stable across platforms or compiler
//! versions (integers are fed in native byte order, for one), yet every process must agree on
//! where a key lives. So everything it hashes goes through [`RingHash`], which feeds only byte
//! strings and fixed-width little-endian integers into SipHash-1-3 with a zero key. Golden
//! placement tests pin the result.

use std::hash::{Hash, Hasher};

use consistent_hash::{Node, StaticHashRing};
use siphasher::sip::SipHasher13;

/// The portable hash used for ring positions (see the module documentation).
///
/// Changing anything it feeds or how (a byte, an order, the SipHash key) moves keys between
/// shards. In a fleet running two versions, the two would then grant the same key on two
/// shards at once, so the golden tests below must fail first.
#[derive(Debug, Clone, Copy, Default)]
pub struct RingHash;

/// A hasher that only accepts what our own `Hash` impls feed it: raw bytes.
///
/// The integer overrides are a guard: our impls call `write` only, but a derived `Hash` added
/// later would feed integers, which `Hasher`'s defaults pass on in native byte order. Signed
/// integers reach the overrides through those defaults; `u128`/`i128` are not overridden, so
/// nothing hashed with it may write 128-bit integers.
struct StableHasher(SipHasher13);

impl Hasher for StableHasher {
    fn finish(&self) -> u64 {
        self.0.finish()
    }
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }
    // Integers are fed little-endian whatever the platform; `usize` is widened to 64 bits.
    fn write_u8(&mut self, i: u8) {
        self.0.write(&[i]);
    }
    fn write_u16(&mut self, i: u16) {
        self.0.write(&i.to_le_bytes());
    }
    fn write_u32(&mut self, i: u32) {
        self.0.write(&i.to_le_bytes());
    }
    fn write_u64(&mut self, i: u64) {
        self.0.write(&i.to_le_bytes());
    }
    fn write_usize(&mut self, i: usize) {
        self.0.write(&(i as u64).to_le_bytes());
    }
}

impl StableHasher {
    fn new() -> Self {
        Self(SipHasher13::new_with_keys(0, 0))
    }
}

impl consistent_hash::RingHash for RingHash {
    fn hash_item<T: Hash>(&self, item: &T) -> u64 {
        let mut h = StableHasher::new();
        item.hash(&mut h);
        h.finish()
    }

    fn hash_vnode<K: Hash>(&self, node_key: &K, vnode_seq: usize) -> u64 {
        let mut h = StableHasher::new();
        node_key.hash(&mut h);
        // Written out as 8 bytes rather than hashed as a `usize`, whose width is the
        // platform's.
        h.write(&(vnode_seq as u64).to_le_bytes());
        h.finish()
    }
}

/// The bucket (of `buckets`) that `hint` picks: a stable hash of its bytes, the same in every
/// process, so that callers with one hint start at the same bucket wherever they run. The
/// modulo's bias is negligible: at most 1024 buckets out of 2^64 hash values.
pub fn bucket_for(hint: &[u8], buckets: u32) -> u32 {
    let mut h = StableHasher::new();
    h.write(hint);
    (h.finish() % u64::from(buckets.max(1))) as u32
}

/// A shard's name as a ring node: hashed as its length (u64 LE) followed by its bytes. The
/// length prefix makes the encoding unambiguous whatever `hash_vnode` appends after it. The
/// name, not the URL, is the node: a shard can move to another host without moving its keys,
/// and renaming one moves them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct ShardName(String);

impl Hash for ShardName {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(&(self.0.len() as u64).to_le_bytes());
        state.write(self.0.as_bytes());
    }
}

/// A point to place: hashed as its raw bytes, nothing else.
struct Point<'a>(&'a [u8]);

impl Hash for Point<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write(self.0);
    }
}

/// The consistent-hash ring over the configured shards.
///
/// Shards are identified by name; [`Ring::locate`] returns the index of the shard in the order
/// given to [`Ring::new`].
pub struct Ring {
    ring: StaticHashRing<'static, ShardName, usize, RingHash>,
    shards: usize,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("shards", &self.shards)
            .field("vnodes", &self.ring.len())
            .finish()
    }
}

impl Ring {
    /// Builds a ring from `(name, weight)` pairs; each shard gets `virtual_nodes * weight`
    /// points. Names must be unique (config validation guarantees it): two nodes with one
    /// name would hash to the same points, and the config would no longer decide which of the
    /// two shards owns them.
    pub fn new<'a>(shards: impl IntoIterator<Item = (&'a str, u32)>, virtual_nodes: u32) -> Self {
        let nodes: Vec<_> = shards
            .into_iter()
            .enumerate()
            .map(|(index, (name, weight))| {
                Node::new(ShardName(name.to_owned()))
                    .value(index)
                    .quantity(virtual_nodes as usize * weight as usize)
            })
            .collect();
        let shards = nodes.len();
        Self {
            ring: StaticHashRing::new(RingHash, nodes.into_iter()),
            shards,
        }
    }

    /// The index of the shard that owns `point` (a key's bytes, or a bucket's name).
    ///
    /// # Panics
    /// If the ring has no shards; configuration validation rejects that.
    pub fn locate(&self, point: &[u8]) -> usize {
        self.ring
            .calc_candidates(&Point(point))
            .next()
            .map(|node| node.value)
            .expect("ring has at least one shard")
    }

    /// How many shards the ring places keys on.
    pub fn len(&self) -> usize {
        self.shards
    }

    /// Whether the ring has no shards.
    pub fn is_empty(&self) -> bool {
        self.shards == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DEFAULT_VIRTUAL_NODES;

    fn names(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("s{i}")).collect()
    }

    fn ring(names: &[String]) -> Ring {
        Ring::new(names.iter().map(|n| (n.as_str(), 1)), DEFAULT_VIRTUAL_NODES)
    }

    /// Placement must never change between releases or platforms: every process of a
    /// deployment has to agree on where a key lives.
    #[test]
    fn golden_placements() {
        let names = names(3);
        let r = ring(&names);
        let got: Vec<_> = GOLDEN_KEYS
            .iter()
            .map(|k| names[r.locate(k.as_bytes())].clone())
            .collect();
        assert_eq!(got, GOLDEN);
    }
    const GOLDEN_KEYS: [&str; 12] = [
        "order:1001",
        "order:1002",
        "sku:42",
        "user:7",
        "Order:1001",
        "k",
        "stock:9",
        "job:x",
        "coupon:ABC",
        "payment:77",
        "a",
        "\u{1F512}",
    ];
    const GOLDEN: [&str; 12] = [
        "s1", "s1", "s3", "s3", "s1", "s3", "s1", "s1", "s2", "s3", "s3", "s2",
    ];

    #[test]
    fn ring_hash_is_pinned() {
        use consistent_hash::RingHash as _;
        assert_eq!(
            RingHash.hash_item(&Point(b"order:1001")),
            15925242615169772569
        );
        assert_eq!(
            RingHash.hash_vnode(&ShardName("s1".into()), 7),
            11251037760922165313
        );
    }

    #[test]
    fn busiest_shard_carries_at_most_1_1_times_the_mean() {
        for n in [3usize, 4, 5, 8] {
            let names = names(n);
            let r = ring(&names);
            let mut counts = vec![0usize; n];
            for i in 0..100_000 {
                counts[r.locate(format!("key:{i}").as_bytes())] += 1;
            }
            let mean = 100_000.0 / n as f64;
            let max = *counts.iter().max().unwrap() as f64;
            assert!(
                max <= 1.1 * mean,
                "{n} shards: {counts:?} (max/mean {:.3})",
                max / mean
            );
        }
    }

    #[test]
    fn adding_a_shard_moves_about_one_share_and_only_to_the_new_shard() {
        for n in [3usize, 4, 7] {
            let before_names = names(n);
            let after_names = names(n + 1);
            let before = ring(&before_names);
            let after = ring(&after_names);
            let mut moved = 0;
            for i in 0..100_000 {
                let k = format!("key:{i}");
                let (a, b) = (before.locate(k.as_bytes()), after.locate(k.as_bytes()));
                if before_names[a] != after_names[b] {
                    moved += 1;
                    assert_eq!(
                        after_names[b],
                        format!("s{}", n + 1),
                        "{k} moved between old shards"
                    );
                }
            }
            let share = moved as f64 / 100_000.0;
            let expected = 1.0 / (n + 1) as f64;
            assert!(
                (share - expected).abs() < 0.2 * expected,
                "{n}->{}: moved {share:.4}, expected ~{expected:.4}",
                n + 1
            );
        }
    }

    #[test]
    fn bucket_choice_is_stable_and_spread() {
        assert_eq!(
            bucket_for(b"user:7", 16),
            4,
            "pinned: every process must agree"
        );
        let mut counts = [0u32; 16];
        for i in 0..16_000 {
            counts[bucket_for(format!("user:{i}").as_bytes(), 16) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(bucket_for(b"anything", 1), 0);
    }

    #[test]
    fn weights_scale_the_share() {
        let r = Ring::new([("a", 1), ("b", 3)], DEFAULT_VIRTUAL_NODES);
        let b = (0..40_000)
            .filter(|i| r.locate(format!("k{i}").as_bytes()) == 1)
            .count();
        let share = b as f64 / 40_000.0;
        assert!((share - 0.75).abs() < 0.05, "{share}");
    }
}
