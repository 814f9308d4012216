//! Real shard failures with the `fail-fast` policy: a shard SIGKILLed then restarted,
//! SIGSTOPped then resumed, cut off by a blackholing proxy, slowed past the slow-call
//! threshold, its connections reset, its connection limit exhausted, its pool exhausted by
//! callers of a slow link, switched to read-only (a demoted primary). For each: what callers of
//! the failing shard receive and how fast (never later than their wait; once the breaker is
//! open, at once, having sent nothing), the breaker's transitions, recovery once the fault
//! ends, and that keys on the healthy shards keep being granted (their throughput is printed).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::faults::{Load, Rig, POOL, SMALL_POOL, WAIT};
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Conn;
use shardlock::BackendErrorKind::BreakerOpen;
use shardlock::{AcquireOptions, BreakerState, BreakerTransition, Error, LockRouter};
use shardlock_testkit::{ProxyMode, Worker};
use tokio::time::Instant;

/// What an acquire may take beyond its wait (scheduling on a loaded 2-core machine): an
/// acquire that waited for ever fails the check. One that waited for its statement (the rig's
/// 1 s statement timeout) instead of its wait is told by its error, not by its time.
const SLACK: Duration = Duration::from_secs(5);
/// The wait of an acquire while the key's shard breaker is open, and the bound on its
/// answer: "fail fast". Its answer's kind (`BreakerOpen`) says it sent nothing; this bound,
/// half its wait (room for any busy machine's scheduling), says it did not wait that out.
const OPEN_WAIT: Duration = Duration::from_secs(10);
const FAIL_FAST: Duration = Duration::from_secs(5);

#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Kill,
    Pause,
    Blackhole,
    SlowLink,
    Reset,
    ConnectionLimit,
    PoolExhausted,
    ReadOnly,
}

/// What a fault keeps alive until it is healed.
#[derive(Default)]
struct Injected {
    /// The connection holding the only slot of the connection limit.
    hog: Option<Conn>,
    /// Callers crowding the failing shard's small pool.
    crowd: Vec<tokio::task::JoinHandle<()>>,
    /// The router's connections to the shard before it turned read-only.
    before: Vec<u64>,
    stop: Arc<AtomicBool>,
}

/// The user `s1` is reached as in the connection-limit and read-only tests (its connections
/// are counted; it has no privilege to write to a read-only server).
const LIMITED_USER: &str = "locker";

impl Fault {
    async fn inject(self, rig: &Rig) -> Injected {
        let s1 = rig.cluster.shard(0);
        let mut injected = Injected::default();
        match self {
            Fault::Kill => s1.kill().unwrap(),
            Fault::Pause => s1.pause().unwrap(),
            Fault::Blackhole => rig.proxy.set(ProxyMode::Blackhole),
            Fault::SlowLink => rig.proxy.set(ProxyMode::Delay(common::faults::SLOW_LINK)),
            Fault::Reset => rig.proxy.set(ProxyMode::Reset),
            Fault::ConnectionLimit => {
                // One connection of the user holds the only slot; every other one is killed,
                // so the router's pool must reconnect and is refused (MySQL error 1226).
                let url = s1.url().replace("root@", &format!("{LIMITED_USER}@"));
                let mut hog = Conn::from_url(url).await.unwrap();
                let mut root = s1.connect().await.unwrap();
                root.query_drop(format!(
                    "ALTER USER '{LIMITED_USER}'@'%' WITH MAX_USER_CONNECTIONS 1"
                ))
                .await
                .unwrap();
                root.query_drop("FLUSH PRIVILEGES").await.unwrap();
                let others: Vec<u64> = root
                    .exec(
                        "SELECT id FROM information_schema.processlist WHERE user = ? AND id <> ?",
                        (LIMITED_USER, hog.id()),
                    )
                    .await
                    .unwrap();
                for id in others {
                    let _ = root.query_drop(format!("KILL CONNECTION {id}")).await;
                }
                hog.query_drop("SELECT 1").await.unwrap();
                injected.hog = Some(hog);
            }
            Fault::ReadOnly => {
                // As a failover demotes a primary: it still answers, and refuses every write
                // (1290). The connections the router had open before are noted, to check
                // that none survives.
                let mut root = s1.connect().await.unwrap();
                injected.before = root
                    .exec(
                        "SELECT id FROM information_schema.processlist WHERE user = ?",
                        (LIMITED_USER,),
                    )
                    .await
                    .unwrap();
                assert!(
                    !injected.before.is_empty(),
                    "the router has no connection open"
                );
                root.query_drop("SET GLOBAL read_only = ON").await.unwrap();
            }
            Fault::PoolExhausted => {
                // Statements slowed below the slow-call threshold, and 16 callers on a pool of
                // 2: most wait for a connection longer than pool.wait-timeout.
                rig.proxy.set(ProxyMode::Delay(Duration::from_millis(60)));
                injected.crowd = rig
                    .keys("crowd", 16, false)
                    .into_iter()
                    .map(|key| {
                        let (router, stop) = (rig.router.clone(), injected.stop.clone());
                        tokio::spawn(async move {
                            while !stop.load(Ordering::Relaxed) {
                                match router.acquire(&key, AcquireOptions::new().wait(WAIT)).await {
                                    Ok(guard) => drop(guard.release().await),
                                    Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
                                }
                            }
                        })
                    })
                    .collect();
            }
        }
        injected
    }

    async fn heal(self, rig: &Rig, injected: Injected) {
        let s1 = rig.cluster.shard(0);
        match self {
            Fault::Kill => s1.restart().await.unwrap(),
            Fault::Pause => s1.resume().unwrap(),
            Fault::Blackhole | Fault::SlowLink | Fault::Reset => rig.proxy.set(ProxyMode::Pass),
            Fault::ConnectionLimit => {
                let mut root = s1.connect().await.unwrap();
                root.query_drop(format!(
                    "ALTER USER '{LIMITED_USER}'@'%' WITH MAX_USER_CONNECTIONS 1000"
                ))
                .await
                .unwrap();
                root.query_drop("FLUSH PRIVILEGES").await.unwrap();
                drop(injected.hog);
            }
            Fault::ReadOnly => {
                let mut root = s1.connect().await.unwrap();
                root.query_drop("SET GLOBAL read_only = OFF").await.unwrap();
            }
            Fault::PoolExhausted => {
                injected.stop.store(true, Ordering::Relaxed);
                for caller in injected.crowd {
                    caller.await.unwrap();
                }
                rig.proxy.set(ProxyMode::Pass);
            }
        }
    }
}

/// Runs one fault from start to recovery and checks everything the module doc promises.
async fn shard_fault(fault: Fault) {
    let user = matches!(fault, Fault::ConnectionLimit | Fault::ReadOnly).then_some(LIMITED_USER);
    let pool = if fault == Fault::PoolExhausted {
        SMALL_POOL
    } else {
        POOL
    };
    let rig = Rig::start("fail-fast", user, pool).await;
    let router = &rig.router;
    let failing = rig.keys("f", 4, false);
    let healthy = rig.keys("h", 64, true);
    let opts = || AcquireOptions::new().wait(WAIT);
    for key in &failing {
        router
            .acquire(key, opts())
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let load = Load::start(router, &healthy, 8);
    load.rate(Duration::from_millis(300)).await; // warm-up
    let before = load.rate(Duration::from_millis(1500)).await;

    let injected = fault.inject(&rig).await;
    // Until the breaker opens, callers of the failing shard still try it, each within its wait.
    let mut outcomes = std::collections::BTreeMap::<&str, u32>::new();
    let started = Instant::now();
    let mut i = 0;
    while router.stats().breaker_opened == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{fault:?}: the breaker never opened; outcomes {outcomes:?}"
        );
        let at = Instant::now();
        let result = router.acquire(&failing[i % failing.len()], opts()).await;
        let took = at.elapsed();
        i += 1;
        assert!(
            took <= WAIT + SLACK,
            "{fault:?}: an acquire took {took:?} with a wait of {WAIT:?}"
        );
        if let Err(e) = &result {
            let said = shardlock::Report(e).to_string();
            assert!(
                !said.contains("statement-timeout"),
                "{fault:?}: an acquire with a wait of {WAIT:?} waited for its statement: {said}"
            );
        }
        let outcome = match result {
            Ok(guard) => {
                drop(guard);
                "granted"
            }
            Err(Error::Unavailable { .. }) => "unavailable",
            Err(Error::Timeout { .. }) => "timeout",
            Err(e) => panic!("{fault:?}: unexpected {e}"),
        };
        *outcomes.entry(outcome).or_default() += 1;
    }
    let opened_after = started.elapsed();

    // While it is open (between probes), callers get Unavailable at once.
    let mut fast = 0;
    let started = Instant::now();
    while fast < 20 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{fault:?}: the breaker was never seen open"
        );
        if router.breaker_state("s1") != Some(BreakerState::Open) {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        let at = Instant::now();
        let open_wait = AcquireOptions::new().wait(OPEN_WAIT);
        let result = router
            .acquire(&failing[fast % failing.len()], open_wait)
            .await;
        let took = at.elapsed();
        match result {
            Err(Error::Unavailable { shard, source }) if source.kind == BreakerOpen => {
                assert_eq!(shard, "s1")
            }
            // The cool-down ended just now: this call went through as a half-open probe.
            Err(Error::Unavailable { .. }) | Ok(_) => continue,
            other => panic!("{fault:?}: open breaker, yet {other:?}"),
        }
        assert!(took < FAIL_FAST, "{fault:?}: fail-fast took {took:?}");
        // Never rerouted: the key still lives on its failed shard.
        assert_eq!(router.shard_for(&failing[0]).unwrap(), "s1");
        fast += 1;
    }
    let during = load.rate(Duration::from_millis(1500)).await;

    let before_fault = injected.before.clone();
    fault.heal(&rig, injected).await;
    let healed = Instant::now();
    let mut recovered = false;
    while healed.elapsed() < Duration::from_secs(30) {
        if let Ok(guard) = router.acquire(&failing[0], opts()).await {
            // Statements slowed by the fault may still finish late and open the breaker
            // again: a release it refuses leaves the lease to end by expiry. Recovery is the
            // breaker staying closed, checked below.
            match guard.release().await {
                Err(e) if !e.is_unavailable() => panic!("{fault:?}: release: {e}"),
                _ => {}
            }
            if router.breaker_state("s1") == Some(BreakerState::Closed) {
                recovered = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let recovered_after = healed.elapsed();
    assert!(recovered, "{fault:?}: no recovery within 30 s");
    if fault == Fault::ReadOnly {
        // Every connection opened to the read-only server was closed, in use or idle: after
        // a failover that moves a DNS name, none would still point at the demoted primary.
        let survivors = || async {
            let mut root = rig.cluster.shard(0).connect().await.unwrap();
            let now: Vec<u64> = root
                .exec(
                    "SELECT id FROM information_schema.processlist WHERE user = ?",
                    (LIMITED_USER,),
                )
                .await
                .unwrap();
            now.into_iter()
                .filter(|id| before_fault.contains(id))
                .collect::<Vec<_>>()
        };
        assert!(
            common::eventually(Duration::from_secs(10), || async {
                survivors().await.is_empty()
            })
            .await,
            "connections from before the shard turned read-only survived: {:?}",
            survivors().await
        );
    }
    // Every failing key is free again: a grant made by a statement the fault held up, whose
    // caller was gone, is given back (or ends with its 2 s ttl) once the shard answers.
    for key in &failing {
        router
            .acquire(key, AcquireOptions::new().wait(Duration::from_secs(10)))
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
    }
    let failed_healthy = load.stop().await;

    let transitions = router.breaker_transitions("s1");
    let first = transitions.first().copied();
    let last = transitions.last().copied();
    let t = |from, to| Some(BreakerTransition { from, to });
    assert_eq!(
        first,
        t(BreakerState::Closed, BreakerState::Open),
        "{transitions:?}"
    );
    assert_eq!(
        last,
        t(BreakerState::HalfOpen, BreakerState::Closed),
        "{transitions:?}"
    );
    for healthy_shard in ["s2", "s3"] {
        assert!(router.breaker_transitions(healthy_shard).is_empty());
    }
    assert_eq!(
        failed_healthy, 0,
        "{fault:?}: keys on healthy shards failed"
    );
    eprintln!(
        "{fault:?}: before the breaker opened (after {opened_after:?}) {outcomes:?}; \
         {} transitions; recovered {recovered_after:?} after the fault ended; healthy shards \
         {before:.0}/s before, {during:.0}/s during ({:.2}x)",
        transitions.len(),
        during / before
    );
    // The healthy shards' rate is printed, not asserted: it depends on the machine's load.
    // `shardlock bench --scenario shard-down` measures it against all shards up.
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_killed_then_restarted() {
    shard_fault(Fault::Kill).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_paused_then_resumed() {
    shard_fault(Fault::Pause).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_turned_read_only_then_writable() {
    shard_fault(Fault::ReadOnly).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_cut_off_by_a_blackhole() {
    shard_fault(Fault::Blackhole).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_behind_a_link_slower_than_the_slow_call_threshold() {
    shard_fault(Fault::SlowLink).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_connections_reset() {
    shard_fault(Fault::Reset).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shard_out_of_connections() {
    shard_fault(Fault::ConnectionLimit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_exhausted_by_callers_of_a_slow_shard() {
    shard_fault(Fault::PoolExhausted).await;
}

/// A lease held on a shard that becomes unreachable is reported lost when it can no longer be
/// trusted: not while it may still be live on the shard, and not later than its end.
#[tokio::test(flavor = "multi_thread")]
async fn lease_on_an_unreachable_shard_is_lost_at_its_end_not_before() {
    let rig = Rig::start("fail-fast", None, POOL).await;
    let key = &rig.keys("held", 1, false)[0];
    let ttl = Duration::from_secs(4);
    let granted = Instant::now();
    let guard = rig
        .router
        .acquire(key, AcquireOptions::new().ttl(ttl))
        .await
        .unwrap();
    rig.proxy.set(ProxyMode::Blackhole);
    // The local deadline runs from before the granting statement was sent, less the shard's
    // millisecond and the clock-drift allowance (1% by default): never before that, and never
    // after the ttl from the asking.
    let earliest = (ttl - Duration::from_millis(1)).mul_f64(0.99);
    // Renewals fail from now on; the last renewal (the grant itself) bounds the lease. Halfway
    // it is still held (unless this task was held up past its end).
    tokio::time::sleep(ttl / 2).await;
    let at = granted.elapsed();
    let held = guard.is_held();
    assert!(
        held || at >= earliest,
        "reported lost while the lease may still be live ({at:?} after the asking)"
    );
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("lost() did not complete once the lease ended");
    let at = granted.elapsed();
    assert!(at >= earliest && !guard.is_held(), "lost after {at:?}");
    assert!(
        guard.held_until() <= granted + ttl,
        "the lease's end came {:?} after its ttl from the asking",
        guard.held_until() - (granted + ttl)
    );
    assert!(rig.router.stats().renew_failures > 0);
}

const TASKS: usize = 16;
const ROUNDS: usize = 150;
const KEYS: usize = 40;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";

/// Read-modify-write counters across 2 processes while the shard of some keys is killed and
/// restarted: callers of that shard get `Unavailable` and retry, yet counts stay exact and
/// fences rise.
#[tokio::test(flavor = "multi_thread")]
async fn counters_stay_exact_across_processes_while_a_shard_dies_and_returns() {
    let rig = Rig::start("fail-fast", None, POOL).await;
    let app_url = rig.cluster.shard(1).url();
    let mut app = common::counters::create(&app_url, KEYS).await;
    let env = [
        (common::CONFIG_ENV, rig.yaml.clone()),
        (APP_ENV, app_url.clone()),
    ];
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "counter", &env).unwrap())
        .collect();
    // Let the workers get going, then take s1 away for a while.
    assert!(
        common::eventually(Duration::from_secs(20), || async {
            common::inserts(&rig.cluster).await > 200
        })
        .await
    );
    rig.cluster.shard(0).kill().unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    rig.cluster.shard(0).restart().await.unwrap();

    let mut done = 0;
    let mut unavailable = 0;
    for w in workers {
        let report = w.finish_report("done ").await.unwrap();
        done += report[0] as usize;
        unavailable += report[1];
    }
    assert_eq!(done, 2 * TASKS * ROUNDS);
    assert!(unavailable > 0, "the workers never met the dead shard");
    common::counters::check(&mut app, 2 * TASKS * ROUNDS).await;
    eprintln!("{done} rounds, {unavailable} acquires answered Unavailable and retried");
}

async fn counter_worker() {
    // A shard is dead: its leases' releases at shutdown may fail.
    let _ = common::counters::worker(APP_ENV, TASKS, ROUNDS, KEYS, Duration::from_secs(10)).await;
}

crate::worker_entry! { "counter" => counter_worker() }

/// The breaker runs on Tokio's clock: with time paused, its cool-down (doubling after a failed
/// probe) passes only when the test advances it. The shard is a closed port.
#[tokio::test(start_paused = true)]
async fn breaker_cooldowns_follow_a_paused_clock() {
    let router = LockRouter::from_yaml_str(
        "shards:\n  - name: gone\n    url: mysql://root@127.0.0.1:1/shardlock\n\
         breaker:\n  consecutive-failures: 3\n  cooldown: 10s\n  max-cooldown: 40s\n  probes: 1\n\
         cleaner:\n  registry: static\n", // no heartbeats: only this test's calls probe
    )
    .await
    .unwrap();
    let state = || router.breaker_state("gone").unwrap();
    let try_once = || router.try_acquire("k", AcquireOptions::new());
    for _ in 0..3 {
        assert!(try_once().await.unwrap_err().is_unavailable());
    }
    assert_eq!(state(), BreakerState::Open);
    tokio::time::advance(Duration::from_millis(9_999)).await;
    assert_eq!(state(), BreakerState::Open);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(state(), BreakerState::HalfOpen);
    // The probe fails: open again for twice as long.
    assert!(try_once().await.unwrap_err().is_unavailable());
    assert_eq!(state(), BreakerState::Open);
    tokio::time::advance(Duration::from_millis(19_999)).await;
    assert_eq!(state(), BreakerState::Open);
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(state(), BreakerState::HalfOpen);
    let refused = router.stats().breaker_rejections;
    assert_eq!(
        refused, 0,
        "nothing was refused: every call came after a cool-down"
    );
    assert!(router.breaker_state("nope").is_none());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_servers_prepared_statement_limit_counts_as_a_shard_failure() {
    let (cluster, _setup, _) = common::start(1, "").await;
    let router = LockRouter::from_yaml_str(&cluster.config_yaml(
        "breaker:\n  consecutive-failures: 3\n  cooldown: 200ms\ncleaner:\n  registry: static\n",
    ))
    .await
    .unwrap();
    // The server refuses every new prepared statement (error 1461), as it does once 1000
    // connections have each cached their statements.
    let mut admin = cluster.shard(0).connect().await.unwrap();
    admin
        .query_drop("SET GLOBAL max_prepared_stmt_count = 0")
        .await
        .unwrap();
    for _ in 0..3 {
        let err = router
            .try_acquire("k", AcquireOptions::new())
            .await
            .unwrap_err();
        assert!(err.is_unavailable(), "{err}");
    }
    assert_eq!(router.breaker_state("s1"), Some(BreakerState::Open));
    admin
        .query_drop("SET GLOBAL max_prepared_stmt_count = DEFAULT")
        .await
        .unwrap();
    let back = common::eventually(Duration::from_secs(10), || async {
        matches!(
            router.try_acquire("k", AcquireOptions::new()).await,
            Ok(Some(_))
        )
    })
    .await;
    assert!(back, "the shard is used again once it accepts statements");
}

/// Transaction locks waiting for their row while the breaker is half-open take none of its
/// probes' slots: the calls that close it still go through. (As probes they kept the slots
/// for their whole wait, refusing everything else of the process on the shard, renewals
/// included, then closed the breaker by a lock wait's end.)
#[tokio::test(flavor = "multi_thread")]
async fn transaction_locks_waiting_while_half_open_leave_the_probes_to_other_calls() {
    let rig = Rig::start("fail-fast", None, POOL).await;
    // Nothing but the test's calls reaches the shard (no heartbeat probes the breaker).
    let yaml = |s1: &str| {
        format!(
            "{}cleaner:\n  registry: static\n",
            common::faults::config_yaml(&rig.cluster, s1, POOL, "fail-fast")
        )
    };
    let router = LockRouter::from_yaml_str(&yaml(&rig.proxy.url()))
        .await
        .unwrap();
    let other = LockRouter::from_yaml_str(&yaml(&rig.cluster.shard(0).url()))
        .await
        .unwrap();
    let keys = rig.keys("t", 2, false);
    let (locked, free) = (keys[0].clone(), keys[1].clone());
    let held = other
        .lock_in_transaction(&locked, Duration::from_secs(10))
        .await
        .unwrap();

    rig.proxy.set(ProxyMode::Reset);
    let once = || AcquireOptions::new().wait(Duration::ZERO);
    let opened = common::eventually(Duration::from_secs(20), || async {
        let _ = router.try_acquire(&free, once()).await;
        router.stats().breaker_opened > 0
    })
    .await;
    assert!(opened, "the breaker never opened");
    rig.proxy.set(ProxyMode::Pass);
    let half_open = common::eventually(Duration::from_secs(20), || async {
        router.breaker_state("s1") == Some(BreakerState::HalfOpen)
    })
    .await;
    assert!(half_open, "the breaker never went half-open");

    // As many waiters as the breaker has probes (2).
    let waiters = common::tx_lock_waiters(&router, &locked, 2, rig.cluster.shard(0), 2).await;

    let tried = router.try_acquire(&free, once()).await;
    let granted = match tried {
        Ok(Some(granted)) => granted,
        other => panic!("refused while half-open, its probes waiting for a row: {other:?}"),
    };
    granted.release().await.unwrap();
    assert_eq!(router.breaker_state("s1"), Some(BreakerState::Closed));

    held.rollback().await.unwrap();
    for waiter in waiters {
        waiter.await.unwrap().unwrap();
    }
}

/// A shard that hangs holds up no heartbeat on the others. With heartbeats every 2 s, counted
/// dead after 4 s, a process stops granting and gives its leases up 3 s after its latest
/// heartbeat reached a shard (its lapse): sooner than the statement timeout (5 s) that a
/// heartbeat to a hung shard waits out. A heartbeat that waited for it sent the next one to the
/// other shards too late, and the process lost every lease on every shard and granted nothing
/// until the hung shard answered again.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_shard_holds_up_no_heartbeat_on_the_others() {
    let cluster = shardlock_testkit::Cluster::start(3).await.unwrap();
    let router = LockRouter::from_yaml_str(&tight_heartbeat(&cluster, "2s", "4s"))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let key = common::key_on(&router, "held", "s1");
    let opts = AcquireOptions::new().ttl(Duration::from_secs(60));
    let held = router.acquire(&key, opts.clone()).await.unwrap();
    let failures = router.stats().heartbeat_failures;
    cluster.shard(2).pause().unwrap();
    // Three heartbeats to the hung shard failed: three intervals at least, two lapses.
    let missed = common::eventually(Duration::from_secs(60), || async {
        router.stats().heartbeat_failures >= failures + 3
    })
    .await;
    let (lapses, still_held) = (router.stats().heartbeat_lapses, held.is_held());
    let granted = router
        .acquire(
            &common::key_on(&router, "new", "s1"),
            opts.wait(Duration::ZERO),
        )
        .await;
    cluster.shard(2).resume().unwrap();
    assert!(missed, "the heartbeats to the hung shard never failed");
    assert_eq!(
        lapses, 0,
        "the heartbeat lapsed while only one shard of three hung"
    );
    assert!(
        still_held,
        "a lease on a healthy shard was lost while another shard hung"
    );
    let granted = granted.expect("no grant on a healthy shard while another shard hung");
    granted.release().await.unwrap();
    held.release().await.unwrap();
}

/// The shards of `cluster`, with a statement timeout (5 s) longer than the lapse of heartbeats
/// every `interval`, dead after `timeout`.
fn tight_heartbeat(cluster: &shardlock_testkit::Cluster, interval: &str, timeout: &str) -> String {
    let mut yaml = String::from("shards:\n");
    for s in cluster.shards() {
        yaml.push_str(&format!(
            "  - name: {}\n    url: {}\n    statement-timeout: 5s\n",
            s.name(),
            s.url()
        ));
    }
    yaml.push_str(&format!(
        "cleaner:\n  heartbeat-interval: {interval}\n  heartbeat-timeout: {timeout}\n"
    ));
    yaml
}

/// A reload that lengthens the heartbeat's interval and timeout while a shard hangs: the hung
/// shard's registry row still says the old timeout, so the old lapse (2.96 s) stays in force
/// until a heartbeat reaches it. Sent at the new interval (8 s), every heartbeat came after
/// that lapse: the process lapsed at each one, and lost every lease on every shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_that_slows_the_heartbeat_while_a_shard_hangs_lapses_nothing() {
    let cluster = shardlock_testkit::Cluster::start(3).await.unwrap();
    let router = LockRouter::from_yaml_str(&tight_heartbeat(&cluster, "2s", "4s"))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let opts = AcquireOptions::new().ttl(Duration::from_secs(60));
    let held = router
        .acquire(&common::key_on(&router, "held", "s1"), opts.clone())
        .await
        .unwrap();
    let failures = router.stats().heartbeat_failures;
    cluster.shard(2).pause().unwrap();
    let seen = common::eventually(Duration::from_secs(60), || async {
        router.stats().heartbeat_failures > failures
    })
    .await;
    let slower = shardlock::Config::from_yaml_str(&tight_heartbeat(&cluster, "8s", "30s")).unwrap();
    let reloaded = router.reload(slower).await;
    // Three heartbeats to the hung shard failed since: three of the new intervals, or more.
    let failures = router.stats().heartbeat_failures;
    let missed = common::eventually(Duration::from_secs(90), || async {
        router.stats().heartbeat_failures >= failures + 3
    })
    .await;
    let (lapses, still_held) = (router.stats().heartbeat_lapses, held.is_held());
    cluster.shard(2).resume().unwrap();
    assert!(seen, "the first heartbeat to the hung shard never failed");
    reloaded.unwrap();
    assert!(missed, "the heartbeats to the hung shard never failed");
    assert_eq!(
        lapses, 0,
        "a reload that slowed the heartbeat while a shard hung made the process lapse"
    );
    assert!(still_held, "a lease on a healthy shard was lost");
    held.release().await.unwrap();
}
