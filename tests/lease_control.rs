//! Explicit lease control on real shards: a lease without keep-alive ends at its ttl unless
//! extended, `extend` moves a lease's end on the shard and locally, renewals never bring an
//! extended end forward, and a lost lease cannot be extended.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, Error};

fn once() -> AcquireOptions {
    AcquireOptions::new().wait(Duration::ZERO)
}

/// Generous bound for an event that must come: a test that hangs is worse than one that
/// fails with a message.
const EVENT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_without_keep_alive_ends_at_its_ttl() {
    let (cluster, router, _yaml) = common::start(1, "").await;
    let other = common::worker_router_from(&cluster).await;

    let g = router
        .acquire(
            "report:daily",
            AcquireOptions::new().lock_at_most(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    assert!(g.is_held());
    assert!(other
        .try_acquire("report:daily", once())
        .await
        .unwrap()
        .is_none());
    tokio::time::timeout(EVENT, g.lost())
        .await
        .expect("a lease without keep-alive ends");
    assert!(!g.is_held());
    assert!(g.held_until() <= tokio::time::Instant::now());
    // Ended, not renewed: the keeper sent nothing for it.
    assert_eq!(router.stats().renew_statements, 0);
    assert_eq!(router.stats().lost, 1);
    // The shard ends it too: another instance gets the key.
    let next = other
        .acquire("report:daily", AcquireOptions::new().wait(EVENT))
        .await
        .unwrap();
    assert!(next.fence() > g.fence());
    assert!(matches!(g.release().await, Err(Error::LockLost { .. })));
    next.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn extend_moves_the_end_of_a_lease_and_renewals_keep_it() {
    let (cluster, router, _yaml) = common::start(1, "").await;
    let other = common::worker_router_from(&cluster).await;

    // Without keep-alive: only `extend` makes it last.
    let g = router
        .acquire(
            "report:weekly",
            AcquireOptions::new().lock_at_most(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    g.extend(Duration::from_secs(60)).await.unwrap();
    let local = g.held_until() - tokio::time::Instant::now();
    assert!(local > Duration::from_secs(50), "{local:?}");
    let (_, row) = router.inspect("report:weekly").await.unwrap();
    let row = row.unwrap();
    assert!(row.expires_in_ms > 50_000, "{row:?}");
    assert!(g.is_held());
    assert!(other
        .try_acquire("report:weekly", once())
        .await
        .unwrap()
        .is_none());
    g.release().await.unwrap();

    // With keep-alive (ttl 1 s, renewed every few hundred ms): renewals after the extension
    // leave its end where it is.
    let g = router
        .acquire(
            "report:monthly",
            AcquireOptions::new().ttl(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    g.extend(Duration::from_secs(60)).await.unwrap();
    let ticks = router.stats().renew_ticks;
    assert!(
        common::eventually(EVENT, || async { router.stats().renew_ticks >= ticks + 2 }).await,
        "the keeper renews"
    );
    let (_, row) = router.inspect("report:monthly").await.unwrap();
    let row = row.unwrap();
    assert!(
        row.expires_in_ms > 50_000,
        "a renewal brought the end forward: {row:?}"
    );
    assert!(g.held_until() - tokio::time::Instant::now() > Duration::from_secs(50));
    g.release().await.unwrap();
    // Released: free at once, however far its end was.
    assert!(other
        .try_acquire("report:monthly", once())
        .await
        .unwrap()
        .is_some());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lease_taken_over_cannot_be_extended() {
    let (_cluster, router, _yaml) = common::start(1, "").await;

    let g = router
        .acquire("report:yearly", AcquireOptions::new())
        .await
        .unwrap();
    let before = g.held_until();
    router
        .force_release("report:yearly")
        .await
        .unwrap()
        .unwrap();
    let err = g.extend(Duration::from_secs(60)).await.unwrap_err();
    assert!(matches!(err, Error::LockLost { .. }), "{err}");
    tokio::time::timeout(EVENT, g.lost())
        .await
        .expect("reported lost");
    assert_eq!(g.held_until(), before, "the local end did not move");
    drop(g);

    let g = router
        .acquire("report:yearly", AcquireOptions::new())
        .await
        .unwrap();
    for bad in [Duration::ZERO, Duration::from_secs(2 * 86_400)] {
        match g.extend(bad).await {
            Err(Error::InvalidArgument { name: "extend", .. }) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    g.release().await.unwrap();
}
