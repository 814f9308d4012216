//! Scheduled jobs on real shards: a hold with `lock_at_least` keeps its key taken after an early
//! release, and `run_exclusive` runs a job once per interval of the shard's clock across three
//! processes.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Error, LockRouter};
use shardlock_testkit::{Cluster, Worker};

const EVENT: Duration = Duration::from_secs(30);
const JOB: &str = "job:reindex";
const EVERY: Duration = Duration::from_secs(1);

fn once() -> AcquireOptions {
    AcquireOptions::new().wait(Duration::ZERO)
}

/// The shard clock at the latest grant of `key`, ms since the epoch.
async fn granted_at_ms(cluster: &Cluster, router: &LockRouter, key: &str) -> u64 {
    let name = router.shard_for(key).unwrap();
    let shard = cluster.shards().iter().find(|s| s.name() == name).unwrap();
    let mut conn = shard.connect().await.unwrap();
    conn.exec_first(
        "SELECT CAST(UNIX_TIMESTAMP(acquired_at) * 1000 AS UNSIGNED) FROM shardlock_lease \
         WHERE lock_key = ?",
        (key.as_bytes(),),
    )
    .await
    .unwrap()
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_released_hold_stays_taken_until_its_at_least_passes() {
    let (cluster, router, _yaml) = common::start(2, "").await;
    let other = common::worker_router_from(&cluster).await;

    // Released at once, taken for a minute: nobody else gets it, and the row says whose
    // run it was.
    let g = router
        .acquire(
            "job:a",
            AcquireOptions::new().lock_at_least(Duration::from_secs(60)),
        )
        .await
        .unwrap();
    let owner = g.owner().to_owned();
    g.release().await.unwrap();
    assert!(other.try_acquire("job:a", once()).await.unwrap().is_none());
    let (_, row) = router.inspect("job:a").await.unwrap();
    let row = row.unwrap();
    assert_eq!(row.owner.as_deref(), Some(owner.as_str()));
    assert!(row.expires_in_ms > 50_000, "{row:?}");
    // Not in this process either: no hand-off of such a hold.
    assert!(router.try_acquire("job:a", once()).await.unwrap().is_none());

    // A second's hold: the next grant comes no sooner than a second after the first, by the
    // shard's clock.
    let g = router
        .acquire(
            "job:b",
            AcquireOptions::new().lock_at_least(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    let first = granted_at_ms(&cluster, &router, "job:b").await;
    g.release().await.unwrap();
    let next = other
        .acquire("job:b", AcquireOptions::new().wait(EVENT))
        .await
        .unwrap();
    let second = granted_at_ms(&cluster, &router, "job:b").await;
    assert!(
        second >= first + 1000,
        "granted again {} ms after",
        second - first
    );
    next.release().await.unwrap();

    // Released after its at-least passed: freed at once.
    let g = router
        .acquire(
            "job:c",
            AcquireOptions::new().lock_at_least(Duration::from_millis(100)),
        )
        .await
        .unwrap();
    assert!(
        common::eventually(EVENT, || async {
            let (_, row) = router.inspect("job:c").await.unwrap();
            row.unwrap().held_for_ms > 100
        })
        .await
    );
    g.release().await.unwrap();
    let (_, row) = router.inspect("job:c").await.unwrap();
    assert_eq!(row.unwrap().owner, None);
    assert!(other.try_acquire("job:c", once()).await.unwrap().is_some());

    let err = router
        .acquire("job:d", AcquireOptions::new().lock_at_least(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidArgument {
                name: "lock_at_least",
                ..
            }
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn three_processes_on_one_schedule_run_each_interval_once() {
    let (_cluster, router, yaml) = common::start(2, "").await;
    let env = [(common::CONFIG_ENV, yaml)];
    let workers: Vec<Worker> = (0..3)
        .map(|_| Worker::spawn("worker", "scheduled", &env).unwrap())
        .collect();
    // interval -> (process, fence) of each run.
    let mut runs: BTreeMap<u64, Vec<(String, u64)>> = BTreeMap::new();
    for w in workers {
        let pid = w.pid().to_string();
        let (status, lines) = w.finish().await.unwrap();
        assert!(status.success(), "{lines:?}");
        for line in lines {
            let Some(run) = line.strip_prefix("ran ") else {
                continue;
            };
            let f: Vec<u64> = run.split(' ').map(|n| n.parse().unwrap()).collect();
            runs.entry(f[0]).or_default().push((pid.clone(), f[1]));
        }
    }
    let first = *runs.keys().next().expect("some run");
    let last = *runs.keys().last().unwrap();
    println!(
        "{} intervals, {first}..={last}, runs per process: {:?}",
        runs.len(),
        runs.values()
            .flatten()
            .fold(BTreeMap::<&str, usize>::new(), |mut m, (p, _)| {
                *m.entry(p).or_default() += 1;
                m
            })
    );
    assert!(last - first >= 8, "the schedule ran ten seconds");
    for (interval, ran) in &runs {
        assert_eq!(ran.len(), 1, "interval {interval} ran {ran:?}");
    }
    assert_eq!(
        runs.len() as u64,
        last - first + 1,
        "an interval ran nowhere: {:?}",
        runs.keys().collect::<Vec<_>>()
    );
    let fences: Vec<u64> = runs.values().map(|r| r[0].1).collect();
    assert!(fences.windows(2).all(|w| w[0] < w[1]), "{fences:?}");
    // Every run's row stays until its interval ends; the job is free after the last.
    assert!(
        common::eventually(EVENT, || async {
            router.try_acquire(JOB, once()).await.unwrap().is_some()
        })
        .await
    );
}

/// A run whose setup fails after its grant (the statement that holds the row to its
/// interval's end answered an error) runs nothing and gives the interval back: the next tick
/// runs it. Kept to the interval's end, the row would let that interval run nowhere.
#[tokio::test(flavor = "multi_thread")]
async fn a_run_whose_setup_failed_gives_its_interval_back() {
    let (cluster, router, _yaml) = common::start(1, "").await;
    let day = Duration::from_secs(24 * 3600);
    // A lease of an hour, so that nothing but a release frees the row during the test.
    let opts = || AcquireOptions::new().ttl(Duration::from_secs(3600));
    // The server refuses the interval's hold (it raises the fence of a grant it keeps) and a
    // release that keeps the row to the interval's end (its ttl set to 0); not a grant (a new
    // owner), a renewal (the same fence) or a plain release (a tombstone). Whatever the time
    // of day: the interval's end may be any time from now.
    let mut conn = cluster.shard(0).connect().await.unwrap();
    conn.query_drop(
        "CREATE TRIGGER refuse_long_holds BEFORE UPDATE ON shardlock_lease FOR EACH ROW \
         IF NEW.owner <=> OLD.owner AND NEW.acquired_at <=> OLD.acquired_at \
         AND (NEW.fence > OLD.fence OR (NEW.ttl_ms = 0 AND OLD.ttl_ms <> 0)) THEN \
         SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'refused by the test'; END IF",
    )
    .await
    .unwrap();
    let ran = std::sync::atomic::AtomicBool::new(false);
    let failed = router
        .run_exclusive("job:setup", day, opts(), |_| async {
            ran.store(true, std::sync::atomic::Ordering::SeqCst);
        })
        .await;
    assert!(
        failed.is_err(),
        "the interval's hold was refused: {failed:?}"
    );
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    conn.query_drop("DROP TRIGGER refuse_long_holds")
        .await
        .unwrap();
    let next = router
        .run_exclusive(
            "job:setup",
            day,
            opts(),
            |run| async move { run.interval() },
        )
        .await
        .unwrap();
    assert!(
        next.is_some(),
        "the interval whose run failed to set up ran nowhere after it"
    );
}

/// The shard's clock now, ms since the epoch.
async fn shard_now_ms(cluster: &Cluster) -> u64 {
    let mut conn = cluster.shard(0).connect().await.unwrap();
    conn.query_first("SELECT CAST(UNIX_TIMESTAMP(NOW(3)) * 1000 AS UNSIGNED)")
        .await
        .unwrap()
        .unwrap()
}

/// A run that outlasts its interval frees the key at its release; if the shard's clock then
/// steps back into that interval, the next run still belongs to a later one (its interval
/// comes from the fence, which the first run raised), so an interval never runs twice.
#[tokio::test(flavor = "multi_thread")]
async fn an_interval_never_runs_twice_when_the_shard_clock_steps_back() {
    let cluster = Cluster::start_with_clocks(1, &[(0, "+0")]).await.unwrap();
    let router = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let every_ms = EVERY.as_millis() as u64;

    // The run lasts until the shard's clock is past its interval.
    let first = router
        .run_exclusive("job:steps", EVERY, AcquireOptions::new(), |run| {
            let cluster = &cluster;
            async move {
                let end = (run.interval() + 1) * every_ms;
                while shard_now_ms(cluster).await <= end {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                run.interval()
            }
        })
        .await
        .unwrap()
        .expect("nobody else runs it");
    // Released after its interval: free now. The clock steps back five intervals (room for
    // a slow machine between the run's end and the check below).
    cluster.shard(0).set_clock("-5s").unwrap();
    assert!(
        common::eventually(EVENT, || async {
            shard_now_ms(&cluster).await < (first + 1) * every_ms
        })
        .await,
        "the shard's clock stepped back into the first run's interval"
    );
    let second = router
        .run_exclusive(
            "job:steps",
            EVERY,
            AcquireOptions::new(),
            |run| async move { run.interval() },
        )
        .await
        .unwrap()
        .expect("the key was free");
    assert!(
        second > first,
        "interval {first} ran again as {second} after the clock stepped back"
    );
}

/// Ticks four times per interval for ten seconds; each run reports its interval and fence and
/// takes a little while.
async fn scheduled_worker() {
    let router = common::worker_router().await;
    let end = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut tick = tokio::time::interval(EVERY / 4);
    while tokio::time::Instant::now() < end {
        tick.tick().await;
        let ran = router
            .run_exclusive(JOB, EVERY, AcquireOptions::new(), |run| async move {
                shardlock_testkit::report!("ran {} {}", run.interval(), run.fence());
                tokio::time::sleep(Duration::from_millis(50)).await;
            })
            .await
            .unwrap();
        let _ = ran;
    }
    router.shutdown().await.unwrap();
}

crate::worker_entry! { "scheduled" => scheduled_worker() }

/// A run refused because its lock was granted in process (the `local` policy while the shard
/// is down) keeps its interval for no one: once the shard is back, the next tick of the same
/// process runs it. (The refused grant kept its minimum hold, the whole interval, on the key's
/// turn in this process, so every later tick here was told another run held it.)
#[tokio::test(flavor = "multi_thread")]
async fn a_run_refused_in_process_leaves_its_interval_to_the_next_tick() {
    let rig = common::faults::Rig::start("local", None, common::faults::POOL).await;
    let key = rig.keys("job", 1, false).remove(0);
    let hour = Duration::from_secs(3600);
    let tick = || {
        rig.router
            .run_exclusive(&key, hour, AcquireOptions::new(), |run| async move {
                run.interval()
            })
    };
    rig.proxy.set(shardlock_testkit::ProxyMode::Reset);
    let refused_in_process = common::eventually(EVENT, || async {
        let ticked = tick().await;
        assert!(
            matches!(ticked, Err(Error::Unavailable { .. })),
            "a tick with its shard down: {ticked:?}"
        );
        rig.router.stats().local_grants > 0
    })
    .await;
    assert!(refused_in_process, "no tick was granted in process");
    rig.proxy.set(shardlock_testkit::ProxyMode::Pass);
    let closed = common::eventually(EVENT, || async {
        rig.router.breaker_state("s1") == Some(shardlock::BreakerState::Closed)
    })
    .await;
    assert!(closed, "the breaker never closed");
    let ran = tick().await.unwrap();
    assert!(
        ran.is_some(),
        "the interval whose run was refused in process did not run once the shard was back"
    );
}
