//! Counters of one router: one list, from which both the atomics the router bumps and the
//! snapshot [`LockStats`] that `LockRouter::stats` returns are made, so that a counter cannot
//! be added to one and forgotten in the other.

use std::sync::atomic::{AtomicU64, Ordering};

/// Declares every counter once: its doc, its name. `queued` and `settling` are not counters
/// (they are read when the snapshot is taken), so they are added to the snapshot by hand.
macro_rules! counters {
    ($($(#[doc = $doc:literal])+ $name:ident,)+) => {
        /// Counters of one router since it started (this process only).
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        #[non_exhaustive]
        pub struct LockStats {
            $($(#[doc = $doc])+ pub $name: u64,)+
            /// Tasks waiting in memory for a key another task of this router holds or polls
            /// (now).
            pub queued: u64,
            /// Releases and give-backs on their way to a shard (now): those retrying in the
            /// background because their shard did not answer (the keys they free stay held by
            /// nobody until they land or the rows expire) among them, and transaction locks
            /// whose `COMMIT` may still land, waiting for their session to end.
            pub settling: u64,
        }

        /// The live counters behind [`LockStats`], bumped with relaxed atomics: each is a
        /// count on its own, no two are read as one consistent state.
        #[derive(Debug, Default)]
        pub(crate) struct Stats {
            $(pub(crate) $name: AtomicU64,)+
        }

        impl Stats {
            /// Every counter now, with `queued` tasks waiting in memory and `settling` calls
            /// in the background.
            pub(crate) fn snapshot(&self, queued: u64, settling: u64) -> LockStats {
                LockStats {
                    $($name: self.$name.load(Ordering::Relaxed),)+
                    queued,
                    settling,
                }
            }
        }
    };
}

counters! {
    /// Locks granted (hand-offs included).
    grants,
    /// Grants handed from a releasing holder to a waiting task of this process in the same
    /// statement as the release.
    handoffs,
    /// Grants handed from a releasing holder to a waiting task of this process in memory,
    /// without a statement (each with a new, larger fence from the range the shard grant
    /// reserved).
    local_handoffs,
    /// Grants of keys that moved in a recent reload, also taken on their previous shard(s).
    moved_grants,
    /// Acquire statements sent to shards: one for an attempt sent alone; for a batch of
    /// attempts sent together, its write and, unless the shard reported every key's row as
    /// new, a read-back; attempts refused by an open breaker send none.
    acquire_statements,
    /// Batches of several acquire attempts sent together to one shard (see `stats.rs`'s
    /// neighbour `shard/lanes.rs`): they form when attempts arrive while that shard's
    /// statements are in flight.
    acquire_batches,
    /// Acquire attempts sent in those batches (`batched_acquires / acquire_batches` is the
    /// mean batch size).
    batched_acquires,
    /// Batches of several releases sent together to one shard, in one statement.
    release_batches,
    /// Releases sent in those batches.
    batched_releases,
    /// Acquires that gave up after their wait.
    timeouts,
    /// Leases released (explicitly or on drop).
    releases,
    /// Leases reported lost (not counting those this router's `shutdown()` ended while live).
    lost,
    /// Renewal ticks that renewed at least one lease (summed over shards).
    renew_ticks,
    /// Renewal statements sent (summed over shards).
    renew_statements,
    /// Time spent in renewal ticks, from the first statement sent to the last answer handled, in
    /// microseconds (summed over shards): `renew_micros / renew_ticks` is a tick's mean
    /// duration.
    renew_micros,
    /// Renewal attempts that failed (summed over shards).
    renew_failures,
    /// Renewals of one lease not made because another transaction held its row locked (a
    /// console session, a batch job): renewed apart at the next ticks, lost at its end if the
    /// lock outlasts it.
    renewals_blocked,
    /// Heartbeats to the instance registry that failed (a warning is logged once one shard
    /// misses three in a row).
    heartbeat_failures,
    /// Times this router's heartbeat lapsed: the latest one that reached a shard was older
    /// than halfway from `cleaner.heartbeat-interval` to `cleaner.heartbeat-timeout`, the
    /// process paused or cut off from every shard. It then grants nothing from shards until
    /// it has joined its fleet again.
    heartbeat_lapses,
    /// Calls not sent because the shard's breaker was open (acquires answered
    /// `Unavailable` at once, or granted locally; renewals and releases skipped).
    breaker_rejections,
    /// Times a shard breaker opened (summed over shards).
    breaker_opened,
    /// Times a shard breaker closed again after probes succeeded (summed over shards).
    breaker_closed,
    /// In-process grants made while a shard breaker was open (`local` policy).
    local_grants,
    /// Locally held keys re-acquired on their shard once it was back.
    reconciled,
    /// Locally held keys found held by another process when their shard came back (each
    /// reported to its holder through `lost()`).
    reconcile_conflicts,
    /// Leases whose key moved in a reload while they were held, taken on the key's new shard
    /// as well (see [`LockRouter::reload`](crate::LockRouter::reload)).
    followed,
    /// Fences of moved keys copied from the shards they left to their new shards, as their
    /// floor there, once a move window was over.
    fences_carried,
    /// Looks, once a move window was over, that kept the move in force: a live instance of
    /// the fleet ran another topology than this process, the registry could not be read on
    /// every shard, or a move before it was not over yet (moves end oldest first), looked at
    /// again every `cleaner.heartbeat-interval`; or its carry could not finish (a shard did
    /// not answer, a live lease of a moved key is not where the key lives now), tried again
    /// with a backoff.
    moves_kept,
    /// Records of this router's placements written on its shards for its fleet (one per change
    /// of its placements: a start, a reload, a move's end), read by a process started onto a
    /// changed config after the fleet stopped (see the README's "A process started with
    /// another topology").
    placements_recorded,
    /// Grants (leases, transaction locks, CAS takes) given back because a reload came while
    /// their statement was out: it may have run after the fleet ended the key's move, where
    /// nobody looks for it any more. The key is taken again under the new placement.
    stale_grants,
}
