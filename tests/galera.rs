//! A shard served by a three-node Galera cluster (`nodes:`): every process writes through the
//! first node in the cluster's primary component, moves to the next when it dies, and never
//! takes a grant from a node cut off from the majority.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::{Cluster, GaleraCluster, Worker};

const KEYS: usize = 200;
const TASKS: usize = 32;
const ROUNDS: usize = 150;
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";

/// Statements and pool waits for the Galera tests: bounded at 6 s, above the time the
/// testkit's clusters take to evict a dead node (1-1.5 s, at most 3.25 s), during which every
/// node's commits wait: a statement sent to a survivor then waits it out rather than timing
/// out, failing its caller and leaving a healthy node. Connections: 1 s per node.
const SETTINGS: &str = "
    statement-timeout: 6s
    pool: { max-size: 16, create-timeout: 3s, wait-timeout: 6s, recycle-timeout: 1s }
";

/// A config with the plain shards of `plain` and the Galera shard `g`.
fn config(plain: &Cluster, galera: &GaleraCluster, extra: &str) -> String {
    let mut yaml = plain.config_yaml("");
    yaml.push_str(&galera.shard_yaml("g"));
    yaml.push_str(SETTINGS);
    yaml.push_str(extra);
    yaml
}

/// `key` acquired through `router` as soon as its shard serves: an acquire answered
/// `Unavailable` (a breaker open for its cool-down, a node being left) is tried again; panics
/// once the shard stayed unavailable for a minute, or on any other error.
async fn acquire_when_served(router: &LockRouter, key: &str) -> shardlock::LockGuard {
    let started = std::time::Instant::now();
    loop {
        match router
            .acquire(key, AcquireOptions::new().wait(Duration::from_secs(10)))
            .await
        {
            Ok(guard) => return guard,
            Err(e) if e.is_unavailable() => {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "the shard stayed unavailable for a minute: {}",
                    e.report()
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("acquire {key}: {}", e.report()),
        }
    }
}

/// Node `i` of `galera` as a shard of its own (its only node), as a process whose preferred
/// node it is would reach the cluster.
fn through(galera: &GaleraCluster, i: usize) -> shardlock_mysql::Shard {
    let yaml = format!(
        "shards:\n  - name: g\n    url: {}\n    nodes: [127.0.0.1:{}]\n    statement-timeout: 20s\n",
        galera.node(i).url(),
        galera.node(i).port()
    );
    let config = shardlock::Config::from_yaml_str(&yaml).unwrap();
    shardlock_mysql::Shard::new(&config.shards[0], 0).unwrap()
}

/// `plain` plain shards and the three-node Galera shard `g`, their config, and a migrated
/// router over them.
async fn start(plain: usize) -> (Cluster, GaleraCluster, String, LockRouter) {
    let plain = Cluster::start(plain).await.unwrap();
    let galera = GaleraCluster::start(3).await.unwrap();
    let yaml = config(&plain, &galera, "");
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    (plain, galera, yaml, router)
}

/// Keys of `c:0..KEYS` that the router places on shard `g`.
fn keys_on_g(router: &LockRouter) -> Vec<String> {
    (0..KEYS)
        .map(|i| format!("c:{i}"))
        .filter(|k| router.shard_for(k).unwrap() == "g")
        .collect()
}

/// Two processes × 32 tasks run fenced read-modify-write rounds on 200 keys over two plain
/// shards and a Galera shard; the node they write the Galera shard through is SIGKILLed mid
/// run and later restarted. Counts stay exact (no fenced write rejected: never two holders),
/// fences rise per key in commit order, no deadlock reaches a caller, the shard's breaker
/// never opens (calls slowed while the survivors evict the dead node do not count against
/// it), no acquire finds the shard unavailable once it serves again, and its keys are granted
/// again as soon as the survivors have evicted the dead node (the times are reported).
#[tokio::test(flavor = "multi_thread")]
async fn the_node_in_use_dies_mid_run_and_no_update_is_lost() {
    let (plain, galera, yaml, router) = start(2).await;
    assert!(
        !keys_on_g(&router).is_empty(),
        "some keys live on the Galera shard"
    );
    // A key of the Galera shard that the workers do not use.
    let probe = (0..)
        .map(|i| format!("probe:{i}"))
        .find(|k| router.shard_for(k).unwrap() == "g")
        .unwrap();
    let app_url = plain.shard(0).url();
    let mut app = common::counters::create(&app_url, KEYS).await;

    let writes_on_g1 = || async { common::dml_statements(galera.node(0)).await };
    let before = writes_on_g1().await;

    let env = [(common::CONFIG_ENV, yaml.clone()), (APP_ENV, app_url)];
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "counter", &env).unwrap())
        .collect();
    // Every process writes the Galera shard through g1, its first node; kill it once a
    // good part of the run has gone through it.
    loop {
        if writes_on_g1().await >= before + 300 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // When the survivors evict g1 (their commits wait until then), as g2 reports it.
    let mut g2 = galera.node(1).connect().await.unwrap();
    let evicted = tokio::spawn(async move {
        loop {
            let size: Option<(String, u64)> = g2
                .query_first("SHOW GLOBAL STATUS LIKE 'wsrep_cluster_size'")
                .await
                .unwrap();
            if size.is_some_and(|(_, n)| n == 2) {
                return common::counters::epoch_ms();
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    galera.node(0).kill().unwrap();
    let killed = common::counters::epoch_ms();
    // The shard serves again through g2: the first grant of one of its keys after the kill.
    let guard = acquire_when_served(&router, &probe).await;
    let served = common::counters::epoch_ms();
    guard.release().await.unwrap();
    let evicted = evicted.await.unwrap();
    eprintln!(
        "failover: first grant on the Galera shard {} ms after the kill; the survivors \
         evicted the dead node {} ms after the kill, the grant \
         came {} ms after that",
        served - killed,
        evicted - killed,
        served as i64 - evicted as i64
    );
    assert_eq!(
        router.breaker_transitions("g"),
        vec![],
        "a node's death is not the shard's"
    );
    // g1 comes back and rejoins while the workers still run.
    galera.restart_node(0).await.unwrap();

    let mut done = 0;
    let mut unavailable = 0;
    let mut last_unavailable = 0;
    let mut refused = 0;
    for w in workers {
        let reported = w.finish_report("done ").await.unwrap();
        done += reported[0] as usize;
        unavailable += reported[1];
        last_unavailable = last_unavailable.max(reported[2]);
        refused += reported[3];
    }
    assert_eq!(done, 2 * TASKS * ROUNDS);
    // Every call slowed while the survivors evicted g1 waited no longer than the cluster's
    // eviction time: no worker's breaker opened.
    assert_eq!(
        refused, 0,
        "calls refused by an open breaker in the workers"
    );
    eprintln!("acquires answered unavailable (and retried by the workload): {unavailable}");
    // Callers may find the shard unavailable while it fails over, never once it serves again.
    assert!(
        unavailable == 0 || last_unavailable <= served,
        "an acquire answered unavailable {} ms after the shard served again",
        last_unavailable - served
    );
    common::counters::check(&mut app, 2 * TASKS * ROUNDS).await;
    // This process's connections, moved to g2 by the failover, meet on g1 again now that it is
    // back: it is every process's first node.
    let on_g2 = writes_on_g1().await;
    let returned = common::eventually(Duration::from_secs(30), || async {
        let guard = router.acquire(&probe, AcquireOptions::new()).await.unwrap();
        guard.release().await.unwrap();
        writes_on_g1().await > on_g2
    })
    .await;
    assert!(
        returned,
        "the router's writes went back to g1 once it had rejoined"
    );
    // The rejoined node has every grant: the cluster is one copy.
    let mut g1 = galera.node(0).connect().await.unwrap();
    let rows: Option<u64> = g1
        .query_first("SELECT COUNT(*) FROM shardlock_lease")
        .await
        .unwrap();
    let mut g2 = galera.node(1).connect().await.unwrap();
    let rows_g2: Option<u64> = g2
        .query_first("SELECT COUNT(*) FROM shardlock_lease")
        .await
        .unwrap();
    assert_eq!(rows, rows_g2);
    router.shutdown().await.unwrap();
}

/// Each of the 32 tasks does ROUNDS read-modify-write rounds under the key's lock; reports
/// the rounds done and how many acquires found a shard unavailable.
async fn counter_worker() {
    common::counters::worker(APP_ENV, TASKS, ROUNDS, KEYS, Duration::from_secs(30))
        .await
        .unwrap();
}

crate::worker_entry! { "counter" => counter_worker() }

/// The two other nodes freeze (SIGSTOP): g1 is alone, a minority, and leaves the primary
/// component. It refuses every statement; a router grants nothing through it, and a holder
/// whose lease lives there learns it lost it. Once the others are back, the key was never
/// taken by anyone else.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_cut_off_from_the_majority_grants_nothing() {
    let (_plain, galera, yaml, router) = start(1).await;
    let on_g = keys_on_g(&router);
    // A transaction lock's row lock would hold on one node only: refused on this shard.
    let refused = router
        .lock_in_transaction(&on_g[2], Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(
        matches!(refused, shardlock::Error::InvalidArgument { .. }),
        "{refused}"
    );
    // A lease shorter than twice the shard's clock margin (2 × 250 ms) would end locally
    // before its first renewal: refused.
    let refused = router
        .acquire(
            &on_g[2],
            AcquireOptions::new().ttl(Duration::from_millis(900)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(
            &refused,
            shardlock::Error::InvalidArgument { name: "ttl", .. }
        ),
        "{refused}"
    );
    // So is such a ttl of a waiter in memory behind a holder of this process, when the key is
    // released to it: told so, not handed a lease lost before its first renewal.
    let held = router
        .acquire(&on_g[1], AcquireOptions::new())
        .await
        .unwrap();
    let waiter = tokio::spawn({
        let (router, key) = (router.clone(), on_g[1].clone());
        let opts = AcquireOptions::new()
            .ttl(Duration::from_millis(900))
            .wait(Duration::from_secs(30));
        async move { router.acquire(&key, opts).await }
    });
    let queued = common::eventually(Duration::from_secs(30), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the waiter never queued behind the holder");
    held.release().await.unwrap();
    let refused = waiter.await.unwrap();
    assert!(
        matches!(
            &refused,
            Err(shardlock::Error::InvalidArgument { name: "ttl", .. })
        ),
        "a waiter with a ttl too short for the shard was answered {refused:?}"
    );
    let holder = router
        .acquire(&on_g[0], AcquireOptions::new().ttl(Duration::from_secs(3)))
        .await
        .unwrap();

    galera.node(1).pause().unwrap();
    galera.node(2).pause().unwrap();
    galera
        .wait_non_primary(0, Duration::from_secs(30))
        .await
        .unwrap();
    // The node itself refuses to act (Galera's 1047).
    let mut g1 = galera.node(0).connect().await.unwrap();
    let refused = g1
        .query_drop("UPDATE shardlock_lease SET wanted_at = NOW(3) WHERE lock_key = 'x'")
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, shardlock::mysql_async::Error::Server(e) if e.code == 1047),
        "{refused}"
    );
    // No grant through it: the key held elsewhere...
    let other = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let err = other
        .acquire(&on_g[1], AcquireOptions::new().wait(Duration::from_secs(1)))
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{}", err.report());
    // ... and the holder's lease cannot be renewed: it is reported lost.
    tokio::time::timeout(Duration::from_secs(30), holder.lost())
        .await
        .expect("the holder learns its lease is gone");

    galera.node(1).resume().unwrap();
    galera.node(2).resume().unwrap();
    for i in 0..3 {
        galera.wait_synced(i).await.unwrap();
    }
    // Nothing was granted while the majority was away: on_g[1] has no owner.
    let (_, row) = other.inspect(&on_g[1]).await.unwrap();
    assert!(row.as_ref().is_none_or(|r| !r.is_held()), "{row:?}");
    let again = acquire_when_served(&other, &on_g[1]).await;
    again.release().await.unwrap();
    // It learnt it lost the lease; its release may find the key free, taken, or the shard
    // still recovering.
    let _ = holder.release().await;
    other.shutdown().await.unwrap();
    router.shutdown().await.unwrap();
}

/// The node in use freezes (SIGSTOP): it stays in the cluster's view for a moment, then the
/// other two evict it and go on. The router moves to another node; the holder of a lease whose
/// renewals went to the frozen node learns it lost the lease before anyone else is granted the
/// key; and once the node thaws it grants nothing until it has rejoined.
#[tokio::test(flavor = "multi_thread")]
async fn a_frozen_node_is_left_and_its_holders_learn_they_lost() {
    let (_plain, galera, yaml, router) = start(1).await;
    let on_g = keys_on_g(&router);
    let holder = router
        .acquire(&on_g[0], AcquireOptions::new().ttl(Duration::from_secs(3)))
        .await
        .unwrap();
    // The node the holder's renewals go to: its first node, unless a statement slowed by a
    // busy machine made the router leave it (then another, for a while).
    let in_use = node_in_use(&galera, &router).await;
    let other = LockRouter::from_yaml_str(&yaml).await.unwrap();

    galera.node(in_use).pause().unwrap();
    // Another process takes the key as soon as the shard lets it: never while the holder
    // still believes it holds it.
    let taken = acquire_when_served(&other, &on_g[0]).await;
    assert!(
        !holder.is_held(),
        "granted to another process while the holder still held it"
    );
    assert!(taken.fence() > holder.fence());
    taken.release().await.unwrap();

    galera.node(in_use).resume().unwrap();
    galera.wait_synced(in_use).await.unwrap();
    // Statements that timed out on the frozen node counted for the breaker, which may be
    // open for its cool-down: the shard serves again once it closes.
    let again = acquire_when_served(&other, &on_g[1]).await;
    again.release().await.unwrap();
    let _ = holder.release().await;
    other.shutdown().await.unwrap();
    router.shutdown().await.unwrap();
}

/// The node of `galera` that `router`'s lease renewals (and heartbeats) go through: the one
/// its connections are open to (no other client is connected to the cluster; every node
/// counts the cluster's writes, so their counters cannot tell).
async fn node_in_use(galera: &GaleraCluster, router: &LockRouter) -> usize {
    // A renewal went out since the lease was granted, so its connection is open.
    let ticks = router.stats().renew_ticks;
    let renewed = common::eventually(Duration::from_secs(30), || async {
        router.stats().renew_ticks > ticks
    })
    .await;
    assert!(renewed, "the lease was not renewed");
    // Connections to a node left for another are closed as they come back: wait for one.
    let started = std::time::Instant::now();
    loop {
        let mut clients = Vec::new();
        for node in galera.nodes() {
            let mut c = node.connect().await.unwrap();
            let n: Option<u64> = c
                .query_first(
                    "SELECT COUNT(*) FROM information_schema.processlist \
                     WHERE user <> 'system user' AND command <> 'Daemon' \
                     AND id <> CONNECTION_ID()",
                )
                .await
                .unwrap();
            clients.push(n.unwrap_or(0));
        }
        let in_use: Vec<usize> = (0..clients.len()).filter(|&i| clients[i] > 0).collect();
        if let [node] = in_use.as_slice() {
            return *node;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the router's connections are not open to one node: {clients:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A node applies the cluster's writes a moment after they commit. A renewal sent to a node
/// that has not applied the lease's grant yet (made through another node, as just before a
/// failover) must wait for it and extend the lease: it may never answer "held" for a lease it
/// did not extend, or the holder would go on after the lease ended on the cluster.
///
/// g2 is kept behind by a large transaction committed through g1 just before each grant
/// (a node applies in commit order); a read on g2 that skips the causality wait shows that
/// it had not applied the grant when the renewal was sent.
#[tokio::test(flavor = "multi_thread")]
async fn a_renewal_through_a_node_behind_extends_what_it_reports_held() {
    use shardlock_mysql::{Attempt, GrantRequest};

    let galera = GaleraCluster::start(3).await.unwrap();
    // Each node as a shard of its own: the grant goes through g1, the renewal through g2.
    let (g1, g2) = (through(&galera, 0), through(&galera, 1));
    g1.migrate().await.unwrap();
    let mut raw1 = galera.node(0).connect().await.unwrap();
    raw1.query_drop("CREATE TABLE ballast (id INT PRIMARY KEY, pad CHAR(200) NOT NULL)")
        .await
        .unwrap();
    // Reads on g2 as it is, not waiting for the cluster's latest writes.
    let mut dirty2 = galera.node(1).connect().await.unwrap();
    dirty2
        .query_drop("SET SESSION wsrep_sync_wait = 0")
        .await
        .unwrap();
    // Reads on g1 after every write the cluster committed (the renewal's included).
    raw1.query_drop("SET SESSION wsrep_sync_wait = 1, time_zone = '+00:00'")
        .await
        .unwrap();

    let mut behind = 0;
    for round in 0..5u32 {
        let key = format!("lag:{round}");
        let rows = 50_000 * (round + 1);
        raw1.query_drop(format!(
            "INSERT INTO ballast SELECT {base} + seq, 'x' FROM seq_1_to_{rows}",
            base = round * 1_000_000
        ))
        .await
        .unwrap();
        let owner = format!("test:{round}");
        let req = GrantRequest {
            key: key.clone().into_bytes(),
            owner: owner.clone(),
            ttl_ms: 60_000,
            fence_floor: 0,
            reserve: 0,
            trace: None,
        };
        assert!(matches!(
            g1.acquire(&req).await.unwrap(),
            Attempt::Granted { .. }
        ));
        let granted_until = expires_at(&mut raw1, &key).await;
        // The renewal's clock reading is then at least a millisecond past the grant's (the
        // nodes share this host's clock): an extension shows as a later end.
        tokio::time::sleep(Duration::from_millis(2)).await;
        let seen_on_g2: Option<u64> = dirty2
            .query_first(format!(
                "SELECT COUNT(*) FROM shardlock_lease WHERE lock_key = '{key}'"
            ))
            .await
            .unwrap();
        let was_behind = seen_on_g2 == Some(0);
        let renewed = g2
            .renew(
                &[(key.as_bytes(), owner.as_str())],
                Duration::from_secs(20),
                false,
            )
            .await
            .unwrap();
        let renewed_until = expires_at(&mut raw1, &key).await;
        eprintln!(
            "round {round}: g2 behind {was_behind}, held {:?}, expiry moved {} ms",
            renewed.held,
            renewed_until as i64 - granted_until as i64
        );
        assert_eq!(
            renewed.held,
            vec![shardlock_mysql::Renewal::Extended],
            "the lease is live: the renewal must find it"
        );
        assert!(
            renewed_until > granted_until,
            "round {round}: answered held, but the lease still ends when it was granted to"
        );
        behind += u32::from(was_behind);
        if behind >= 2 {
            break;
        }
    }
    assert!(
        behind > 0,
        "g2 never lagged behind the grant: the test did not test anything"
    );
}

/// When the lease row of `key` ends, in ms since the epoch (`conn` reads in UTC).
async fn expires_at(conn: &mut shardlock::mysql_async::Conn, key: &str) -> u64 {
    conn.query_first(format!(
        "SELECT CAST(UNIX_TIMESTAMP(expires_at) * 1000 AS UNSIGNED) FROM shardlock_lease \
         WHERE lock_key = '{key}'"
    ))
    .await
    .unwrap()
    .expect("the lease row")
}

/// What else runs on a shard runs on a Galera shard: the registry (both instances register),
/// the cleaner (elected, it deletes a released row and a dead instance's ended lease, and the
/// key's next fence is still above the deleted row's), a job queue (a job is claimed once) and
/// CAS locks (one owner at a time).
#[tokio::test(flavor = "multi_thread")]
async fn the_registry_cleaner_jobs_and_cas_work_on_a_galera_shard() {
    let galera = GaleraCluster::start(3).await.unwrap();
    let yaml = galera.config_yaml(
        "g",
        &format!(
            "{SETTINGS}cleaner:\n  interval: 200ms\n  grace: 300ms\n  registry: heartbeat\n  \
             heartbeat-interval: 100ms\n  heartbeat-timeout: 3s\n\
             namespaces:\n  default:\n    ttl: 2s\n    wait: 2s\n"
        ),
    );
    let a = LockRouter::from_yaml_str(&yaml).await.unwrap();
    a.migrate().await.unwrap();
    let b = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let ids = [a.instance_id().to_owned(), b.instance_id().to_owned()];
    let registered = common::eventually(Duration::from_secs(10), || async {
        a.instances().await.iter().all(|(_, rows)| {
            rows.as_ref()
                .is_ok_and(|r| ids.iter().all(|id| r.iter().any(|i| &i.instance_id == id)))
        })
    })
    .await;
    assert!(registered, "both instances register on the Galera shard");

    // A released row, and an ended lease of an instance that never registered.
    let g = a.acquire("gone", AcquireOptions::new()).await.unwrap();
    let old_fence = g.fence();
    g.release().await.unwrap();
    let mut g3 = galera.node(2).connect().await.unwrap();
    g3.query_drop(
        "INSERT INTO shardlock_lease (lock_key, owner, fence, ttl_ms, expires_at, acquired_at) \
         VALUES ('ghost', 'ghost-instance:1', 1, 1000, NOW(3) - INTERVAL 10 SECOND, \
         NOW(3) - INTERVAL 11 SECOND)",
    )
    .await
    .unwrap();
    // Once their grace has passed.
    let started = std::time::Instant::now();
    let mut deleted = 0;
    while deleted < 2 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the cleaner deleted {deleted} of the 2 rows"
        );
        let report = a.clean_once().await.unwrap();
        assert!(report.leader, "the only cleaner is elected");
        deleted += report.deleted();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Read on another node than the one the routers write through, after the cluster's
    // latest writes.
    g3.query_drop("SET SESSION wsrep_sync_wait = 1")
        .await
        .unwrap();
    let left: Option<u64> = g3
        .query_first("SELECT COUNT(*) FROM shardlock_lease WHERE lock_key IN ('gone', 'ghost')")
        .await
        .unwrap();
    assert_eq!(left, Some(0));
    let again = b.acquire("gone", AcquireOptions::new()).await.unwrap();
    assert!(
        again.fence() > old_fence,
        "the deleted row's fence is a floor"
    );
    again.release().await.unwrap();

    // One job, claimed once.
    let id = a.enqueue_job("q", b"x", Duration::ZERO, 3).await.unwrap();
    let job = a
        .claim_job("q", "w1", Duration::from_secs(30))
        .await
        .unwrap()
        .expect("the job");
    assert_eq!(job.id, id);
    assert!(b
        .claim_job("q", "w2", Duration::from_secs(30))
        .await
        .unwrap()
        .is_none());
    assert!(a.complete_job(&job).await.unwrap());

    // A CAS lock has one owner at a time.
    let mine = a.cas_acquire("c", "me").await.unwrap().expect("free");
    assert!(b.cas_acquire("c", "other").await.unwrap().is_none());
    assert!(a.cas_release(mine).await.unwrap());
    let theirs = b
        .cas_acquire("c", "other")
        .await
        .unwrap()
        .expect("released");
    assert!(b.cas_release(theirs).await.unwrap());

    // A lease handed from its holder to a task waiting in memory through the release
    // statement (held past `handoff-max-time`) ends locally as early as a polled grant on this
    // shard does, allowing for the nodes' clock skew, though the waiter never polled: at most
    // the ttl (2 s) less 2 × `node-clock-skew` (250 ms) from now.
    let first = a.acquire("h", AcquireOptions::new()).await.unwrap();
    let handoffs = a.stats().handoffs;
    let waiter = tokio::spawn({
        let a = a.clone();
        async move { a.acquire("h", AcquireOptions::new()).await }
    });
    let queued =
        common::eventually(Duration::from_secs(10), || async { a.stats().queued == 1 }).await;
    assert!(queued, "the second acquire waits in memory");
    // Past `handoff-max-time` (20 ms): not handed over in memory.
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.release().await.unwrap();
    let second = waiter.await.unwrap().unwrap();
    assert_eq!(a.stats().handoffs, handoffs + 1);
    assert!(
        second.held_until() <= tokio::time::Instant::now() + Duration::from_millis(1500),
        "a lease handed over on a Galera shard ends {:?} from now",
        second.held_until() - tokio::time::Instant::now()
    );
    second.release().await.unwrap();

    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// Two processes migrate a fresh Galera shard at once, each through another node: no lock
/// serializes them (a named lock would hold on one node only), yet both succeed (their
/// statements conflict in certification, 1213, which is retried), every migration is
/// recorded and the schema is whole on every node (DDL runs in total order
/// across the cluster, and every step is idempotent).
#[tokio::test(flavor = "multi_thread")]
async fn two_processes_migrate_a_galera_shard_through_different_nodes_at_once() {
    let galera = GaleraCluster::start(3).await.unwrap();
    let (g1, g2) = (through(&galera, 0), through(&galera, 1));
    let (one, two) = tokio::join!(g1.migrate(), g2.migrate());
    let latest = shardlock_mysql::MIGRATIONS.last().unwrap().0;
    assert_eq!(one.unwrap().version, latest);
    assert_eq!(two.unwrap().version, latest);
    // One database, whichever node answers: a reload that lists the nodes otherwise, or two
    // processes whose pools sit on different nodes, must not take it for two (a move of
    // every key to itself; jobs carried twice).
    assert_eq!(
        g1.identity().await.unwrap(),
        g2.identity().await.unwrap(),
        "the Galera shard's identity depends on the node that answers"
    );
    for node in 0..3 {
        let mut conn = galera.node(node).connect().await.unwrap();
        // After every write the cluster committed before this read.
        conn.query_drop("SET SESSION wsrep_sync_wait = 1")
            .await
            .unwrap();
        let versions: Vec<u32> = conn
            .query("SELECT version FROM shardlock_schema_version ORDER BY version")
            .await
            .unwrap();
        let every: Vec<u32> = shardlock_mysql::MIGRATIONS.iter().map(|m| m.0).collect();
        assert_eq!(versions, every, "node g{}", node + 1);
        let columns: Option<u64> = conn
            .query_first(
                "SELECT COUNT(*) FROM information_schema.columns \
                 WHERE table_schema = DATABASE() AND table_name = 'shardlock_lease'",
            )
            .await
            .unwrap();
        assert_eq!(columns, Some(10), "node g{}", node + 1);
    }

    // A node reached as a plain shard (`url:` alone, no `nodes:`) is refused, saying how to
    // list it: without the safeguards `nodes:` brings, two processes whose connections sat on
    // two nodes both took one transaction lock (its row lock holds on one node only).
    for node in 0..2 {
        let bare = format!(
            "shards:\n  - name: g\n    url: {}\n{SETTINGS}cleaner:\n  registry: static\n",
            galera.node(node).url()
        );
        let router = LockRouter::from_yaml_str(&bare).await.unwrap();
        for answer in [
            router.lock_in_transaction("k", Duration::ZERO).await.err(),
            router.try_acquire("k", AcquireOptions::new()).await.err(),
        ] {
            let Some(e) = answer else {
                panic!("a Galera node reached without `nodes:` served");
            };
            let why = shardlock::Report(&e).to_string();
            assert!(
                why.contains("Galera node") && why.contains("nodes:"),
                "{why}"
            );
        }
        router.shutdown().await.unwrap();
    }
}

/// Fences rise across a node failover although the nodes' clocks differ: g2 and g3 run 8 s
/// behind g1 (the shard allows 10 s of skew), so a fence taken from the clock of the node
/// that answers would go down by 8 s less the failover's time after g1 dies. A key granted again through g2 is above
/// its last fence (kept in its replicated row), and a key whose row the cleaner deleted
/// through g2 is above the deleted row's fence (the shard's replicated fence floor).
#[tokio::test(flavor = "multi_thread")]
async fn fences_rise_across_a_failover_to_nodes_whose_clocks_are_behind() {
    use shardlock::mysql_async::prelude::Queryable;

    let galera = GaleraCluster::start_with_clocks(3, &[(1, "-8s"), (2, "-8s")])
        .await
        .unwrap();
    let yaml = galera.config_yaml(
        "g",
        &format!(
            "    node-clock-skew: 10s\n{SETTINGS}cleaner:\n  grace: 100ms\n  registry: static\n\
             namespaces:\n  default:\n    ttl: 120s\n    wait: 10s\n"
        ),
    );
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    router.migrate().await.unwrap();
    // The skew is real: g2's clock reads about 8 s before g1's.
    let now_us = |i: usize| {
        let node = galera.node(i);
        async move {
            let mut c = node.connect().await.unwrap();
            let us: Option<u64> = c
                .query_first("SELECT CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS UNSIGNED)")
                .await
                .unwrap();
            us.unwrap()
        }
    };
    let behind = now_us(0).await.saturating_sub(now_us(1).await);
    assert!(behind > 7_000_000, "g2 is {behind} µs behind g1");

    let held = router.acquire("held", AcquireOptions::new()).await.unwrap();
    let held_fence = held.fence();
    held.release().await.unwrap();
    let cleaned = router
        .acquire("cleaned", AcquireOptions::new())
        .await
        .unwrap();
    let cleaned_fence = cleaned.fence();
    cleaned.release().await.unwrap();

    galera.node(0).kill().unwrap();
    let again = acquire_when_served(&router, "held").await;
    assert!(
        again.fence() > held_fence,
        "fence of a key granted again through g2: {} after {held_fence}",
        again.fence()
    );
    again.release().await.unwrap();

    // The cleaner deletes the released row through g2 once its grace has passed.
    let deleted = common::eventually(Duration::from_secs(20), || async {
        common::clean_pass(&router).await;
        router.inspect("cleaned").await.unwrap().1.is_none()
    })
    .await;
    assert!(deleted, "the cleaner deleted the released row");
    let fresh = router
        .acquire("cleaned", AcquireOptions::new())
        .await
        .unwrap();
    assert!(
        fresh.fence() > cleaned_fence,
        "fence of a deleted key granted again through g2: {} after {cleaned_fence}",
        fresh.fence()
    );
    fresh.release().await.unwrap();
    router.shutdown().await.unwrap();
}

/// A node whose replication an operator switched off (`SET GLOBAL wsrep_on = OFF`) commits
/// what it is sent on its own: grants through it would be invisible to the other nodes. It
/// no longer says it is synced (its sessions see no `wsrep_local_state_comment`), so it is
/// passed over, and served again once replication is back on.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_whose_replication_is_off_is_passed_over() {
    let galera = GaleraCluster::start(3).await.unwrap();
    let mut admin = galera.node(0).connect().await.unwrap();
    admin.query_drop("SET GLOBAL wsrep_on = OFF").await.unwrap();
    let off = through(&galera, 0).migrate().await;
    let why = format!("{:?}", off.as_ref().err());
    assert!(
        why.contains("not a synced member"),
        "a node with replication off served: {why}"
    );
    admin.query_drop("SET GLOBAL wsrep_on = ON").await.unwrap();
    through(&galera, 0).migrate().await.unwrap();
}

/// A transaction lock whose key a reload moves to a Galera shard cannot follow it (its row
/// lock would hold on one node only, and such locks are refused there): it is lost, and its
/// `commit` says so. It took the row on one node and went on as if it held the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_whose_key_moves_to_a_galera_shard_is_lost() {
    let (plain, _galera, yaml, both) = start(1).await;
    let key = keys_on_g(&both).into_iter().next().unwrap();
    both.shutdown().await.unwrap();
    let alone = format!("{}cleaner:\n  registry: static\n", plain.config_yaml(""));
    let router = LockRouter::from_yaml_str(&alone).await.unwrap();
    let held = router
        .lock_in_transaction(&key, Duration::from_secs(5))
        .await
        .unwrap();
    let moved = format!("{yaml}cleaner:\n  registry: static\n");
    router
        .reload(shardlock::Config::from_yaml_str(&moved).unwrap())
        .await
        .unwrap();
    match held.commit().await {
        Err(shardlock::Error::LockLost { .. }) => {}
        other => panic!("a transaction lock followed its key onto a Galera shard: {other:?}"),
    }
    router.shutdown().await.unwrap();
}
