//! One process holding leases by the hundred thousand on real shards: renewal keeps every one
//! of them, in a bounded number of statements per shard per tick.

mod common;

use std::time::{Duration, Instant};

use futures_util::stream::{self, StreamExt};
use shardlock::AcquireOptions;
use shardlock_mysql::MAX_RENEW_BATCH;

/// 100,000 leases over 3 shards, held for three ttls: none is lost, and each renewal tick of a
/// shard sends as many statements as its leases make chunks of `MAX_RENEW_BATCH` (about 33,000
/// leases a shard: 9 statements), whatever the count.
#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_thousand_leases_are_renewed_in_bounded_statements_and_none_is_lost() {
    const LEASES: usize = 100_000;
    // Long enough that a tick of a debug build on a busy machine is far inside a third of it.
    let ttl = Duration::from_secs(10);
    let (_cluster, router, _) = common::start(
        3,
        "namespaces:\n  default:\n    ttl: 10s\ncleaner:\n  registry: static\n",
    )
    .await;
    let guards: Vec<_> = stream::iter(0..LEASES)
        .map(|i| {
            let router = router.clone();
            async move {
                router
                    .acquire(&format!("scale:{i}"), AcquireOptions::new())
                    .await
                    .unwrap()
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    let chunks: Vec<u64> = router
        .status()
        .await
        .iter()
        .map(|s| s.local_leases.div_ceil(MAX_RENEW_BATCH) as u64)
        .collect();
    assert_eq!(chunks.len(), 3);
    let (fewest, most) = (*chunks.iter().min().unwrap(), *chunks.iter().max().unwrap());
    let before = router.stats();
    let held_from = Instant::now();
    // Three ttls, and at least as many renewal ticks as they take on every shard (one each
    // third of a ttl): the leases outlive their first lease length twice over.
    assert!(
        common::eventually(ttl * 6, || async {
            held_from.elapsed() >= ttl * 3 && router.stats().renew_ticks - before.renew_ticks >= 27
        })
        .await,
        "renewal ticks in three ttls: {}",
        router.stats().renew_ticks - before.renew_ticks
    );
    let after = router.stats();
    let lost: Vec<_> = guards
        .iter()
        .filter(|g| !g.is_held())
        .map(|g| g.key())
        .collect();
    assert!(
        lost.is_empty(),
        "{} leases lost, e.g. {:?}",
        lost.len(),
        lost.first()
    );
    assert_eq!(after.lost, before.lost);
    let ticks = after.renew_ticks - before.renew_ticks;
    let statements = after.renew_statements - before.renew_statements;
    // A tick that failed (a chunk not answered within the statement timeout) sent the chunks
    // before it and is tried again soon; every other tick sent each chunk once.
    let failed = after.renew_failures - before.renew_failures;
    assert!(
        (fewest * (ticks - failed)..=most * ticks).contains(&statements),
        "{statements} statements in {ticks} ticks ({failed} failed), expected {fewest}..={most} a \
         tick ({chunks:?})"
    );
    // Released as they were taken, 256 at a time. A release runs in a task of its own, and
    // 100,000 such tasks spawned at once keep a debug build's two cores busy for seconds: the
    // shard's batch runners, queued behind them, then read their replies past the statement
    // timeout. That measures this machine's run queue, not renewal.
    let released: Vec<_> = stream::iter(guards)
        .map(|g| g.release())
        .buffer_unordered(256)
        .collect()
        .await;
    released.into_iter().collect::<Result<Vec<_>, _>>().unwrap();
}
