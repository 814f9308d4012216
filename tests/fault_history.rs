//! The history checker: processes × tasks do fenced read-modify-writes under leases while a
//! seeded random schedule injects faults — holders paused (SIGSTOP) past their ttl or killed
//! (and replaced), shards killed or paused, links cut off, reset or losing a reply, shard
//! clocks stepped back. Every hold is logged with its instants; afterwards the checker asserts
//! that no two processes ever believed they held one key at the same instant (a belief ends
//! when the holder releases, learns it lost, or its local deadline passes), that fenced writes
//! rise per key in commit order, and that counts are exact.
//!
//! CI runs a fixed seed for about 45 s. `SHARDLOCK_HISTORY_SECS=600` runs longer;
//! `SHARDLOCK_HISTORY_SEED=random` (or a number) picks the schedule, printed at the start.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use shardlock::mysql_async::prelude::Queryable;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, LockMode, LockRouter};
use shardlock_testkit::{report, Cluster, Proxy, ProxyMode, Worker};

use common::history::{self, Recorder};

const KEYS: usize = 40;
const HOT: usize = 4;
const TASKS: usize = 8;
const PROCESSES: usize = 3;
const CONFIG_ENV: &str = "SHARDLOCK_TEST_CONFIG";
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";
const HISTORY_ENV: &str = "SHARDLOCK_TEST_HISTORY";
const UNTIL_ENV: &str = "SHARDLOCK_TEST_RUN_FOR_MS";
/// Lock shards (the fourth server holds the application's counters and is never faulted).
const SHARDS: usize = 3;

fn seed() -> u64 {
    match std::env::var("SHARDLOCK_HISTORY_SEED").as_deref() {
        Ok("random") => rand::random(),
        Ok(n) => n
            .parse()
            .expect("SHARDLOCK_HISTORY_SEED: a number or `random`"),
        Err(_) => 20261130,
    }
}

fn run_for() -> Duration {
    let secs = std::env::var("SHARDLOCK_HISTORY_SECS")
        .ok()
        .map(|s| s.parse().expect("SHARDLOCK_HISTORY_SECS: seconds"))
        .unwrap_or(45);
    Duration::from_secs(secs)
}

#[tokio::test(flavor = "multi_thread")]
async fn no_two_holders_under_a_seeded_schedule_of_faults() {
    let seed = seed();
    eprintln!("fault schedule seed {seed} (SHARDLOCK_HISTORY_SEED={seed} replays it)");
    let mut rng = StdRng::seed_from_u64(seed);
    // s1 and s2 run under libfaketime, so their clocks can be stepped.
    let cluster = Cluster::start_with_clocks(SHARDS + 1, &[(0, "+0"), (1, "+0")])
        .await
        .unwrap();
    let mut proxies = Vec::new();
    let mut yaml = String::from("shards:\n");
    for i in 0..SHARDS {
        let proxy = Proxy::start(cluster.shard(i).port()).await.unwrap();
        yaml.push_str(&format!(
            "  - name: s{}\n    url: {}\n    statement-timeout: 1s\n",
            i + 1,
            proxy.url()
        ));
        proxies.push(proxy);
    }
    yaml.push_str(
        "namespaces:\n  default:\n    ttl: 1s\n    wait: 3s\n\
         breaker:\n  consecutive-failures: 3\n  cooldown: 300ms\n",
    );
    LockRouter::from_yaml_str(&yaml)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let app_url = cluster.shard(SHARDS).url();
    let mut app = common::counters::create(&app_url, KEYS).await;
    let dir = tempfile::tempdir().unwrap();
    let histories: PathBuf = dir.path().to_owned();

    let run = run_for();
    let until = history::now_ns() + run.as_nanos() as u64;
    let env = [
        (CONFIG_ENV, yaml.clone()),
        (APP_ENV, app_url.clone()),
        (HISTORY_ENV, histories.display().to_string()),
        (UNTIL_ENV, until.to_string()),
    ];
    let spawn = || Worker::spawn("worker", "fenced", &env).unwrap();
    let mut workers: Vec<Worker> = (0..PROCESSES).map(|_| spawn()).collect();
    for w in &mut workers {
        w.expect("ready").await.unwrap();
    }

    // `SHARDLOCK_HISTORY_FAULTS=0,3,7` keeps only those kinds of fault (to find which one
    // breaks a promise); all by default.
    let faults: Vec<u32> = std::env::var("SHARDLOCK_HISTORY_FAULTS")
        .map(|s| {
            s.split(',')
                .map(|f| f.trim().parse().expect("fault numbers"))
                .collect()
        })
        .unwrap_or_else(|_| (0..8).collect());
    let mut round: Vec<u32> = Vec::new();
    let mut clock_offset = [0i64; 2];
    let mut injected = Vec::new();
    while history::now_ns() + 3_000_000_000 < until {
        tokio::time::sleep(Duration::from_millis(rng.random_range(800..1800))).await;
        // Every kind of fault once per round, in a random order.
        if round.is_empty() {
            round = faults.clone();
            round.shuffle(&mut rng);
        }
        let fault = round.pop().expect("refilled above");
        let what = match fault {
            0 => {
                // A holder frozen for longer than its ttl.
                let w = &workers[rng.random_range(0..workers.len())];
                w.pause().unwrap();
                tokio::time::sleep(Duration::from_millis(rng.random_range(1200..2500))).await;
                w.resume().unwrap();
                "holder paused past its ttl"
            }
            1 => {
                // A holder killed, and a new process in its place.
                let at = rng.random_range(0..workers.len());
                workers[at].kill().await.unwrap();
                let mut fresh = spawn();
                fresh.expect("ready").await.unwrap();
                workers[at] = fresh;
                "holder killed"
            }
            2 => {
                let s = cluster.shard(rng.random_range(0..SHARDS));
                s.pause().unwrap();
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
                s.resume().unwrap();
                "shard paused"
            }
            3 => {
                let s = cluster.shard(rng.random_range(0..SHARDS));
                s.restart().await.unwrap();
                "shard killed and restarted"
            }
            4 => {
                let p = &proxies[rng.random_range(0..SHARDS)];
                p.set(ProxyMode::Blackhole);
                tokio::time::sleep(Duration::from_millis(rng.random_range(500..2000))).await;
                p.set(ProxyMode::Pass);
                "link cut off"
            }
            5 => {
                let p = &proxies[rng.random_range(0..SHARDS)];
                p.set(ProxyMode::Reset);
                tokio::time::sleep(Duration::from_millis(100)).await;
                p.set(ProxyMode::Pass);
                "connections reset"
            }
            6 => {
                let p = &proxies[rng.random_range(0..SHARDS)];
                p.set(ProxyMode::LoseOneReply);
                "a reply lost"
            }
            _ => {
                // Backward only: a clock stepped forward past a lease's end frees it early
                // on the shard, which no client can see coming (fences still order writes).
                let at = rng.random_range(0..2);
                clock_offset[at] -= rng.random_range(1..4);
                cluster
                    .shard(at)
                    .set_clock(&format!("{}s", clock_offset[at]))
                    .unwrap();
                "a shard clock stepped back"
            }
        };
        eprintln!("{} ms: {what}", history::now_ns() / 1_000_000);
        injected.push(what);
    }
    for p in &proxies {
        p.set(ProxyMode::Pass);
    }
    let mut totals = [0u64; 3];
    for w in workers {
        let fields = w.finish_report("done ").await.unwrap();
        for (t, f) in totals.iter_mut().zip(&fields) {
            *t += f;
        }
    }
    // Writes of the killed workers count too: read them from the table.
    let holds = history::read(&histories);
    let checked = history::check_no_two_holders(&holds);
    let writes: Option<u64> = app
        .query_first("SELECT COUNT(*) FROM writes")
        .await
        .unwrap();
    let writes = writes.unwrap_or(0);
    eprintln!(
        "seed {seed}: {} faults ({injected:?}); {checked} holds checked, {writes} fenced \
         writes; survivors: {} written, {} lost before writing, {} writes rejected",
        injected.len(),
        totals[0],
        totals[1],
        totals[2]
    );
    assert!(writes > 100, "the run made progress: {writes}");
    common::counters::check(&mut app, writes as usize).await;
}

async fn fenced_worker() {
    let router = LockRouter::from_yaml_str(&std::env::var(CONFIG_ENV).unwrap())
        .await
        .unwrap();
    let pool = Pool::new(std::env::var(APP_ENV).unwrap().as_str());
    let dir = std::env::var(HISTORY_ENV).unwrap();
    let recorder = std::sync::Arc::new(Recorder::create(Path::new(&dir)));
    let until: u64 = std::env::var(UNTIL_ENV).unwrap().parse().unwrap();
    report!("ready");
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (router, pool, recorder) = (router.clone(), pool.clone(), recorder.clone());
            tokio::spawn(async move {
                let mut counts = [0u64; 3];
                while history::now_ns() < until {
                    let (key, hold) = {
                        let mut rng = rand::rng();
                        if rng.random_bool(0.4) {
                            (rng.random_range(0..HOT), rng.random_range(0..10))
                        } else {
                            (rng.random_range(HOT..KEYS), rng.random_range(0..300))
                        }
                    };
                    let key = format!("c:{key}");
                    if let Some(outcome) =
                        hold_and_write(&router, &pool, &recorder, &key, hold).await
                    {
                        counts[outcome] += 1;
                    }
                }
                counts
            })
        })
        .collect();
    let mut counts = [0u64; 3];
    for t in tasks {
        for (c, n) in counts.iter_mut().zip(t.await.unwrap()) {
            *c += n;
        }
    }
    report!("done {} {} {}", counts[0], counts[1], counts[2]);
    let _ = router.shutdown().await;
}

/// One hold: acquire (`None` when not granted this time), hold `hold_ms` unless lost, then a
/// fenced increment if still held. Returns 0 (written), 1 (lost first) or 2 (rejected).
async fn hold_and_write(
    router: &LockRouter,
    pool: &Pool,
    recorder: &Recorder,
    key: &str,
    hold_ms: u64,
) -> Option<usize> {
    let Ok(guard) = router.acquire(key, AcquireOptions::new()).await else {
        tokio::time::sleep(Duration::from_millis(20)).await;
        return None;
    };
    let start = history::now_ns();
    let remote = guard.mode() == LockMode::Remote;
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(hold_ms)) => {}
        _ = guard.lost() => {}
    }
    let outcome = if !guard.is_held() {
        1
    } else {
        match common::counters::fenced_increment(pool, key, guard.fence(), true).await {
            Ok(true) => 0,
            Ok(false) => 2,
            Err(_) => 1, // the application's database is never faulted; a paused worker's
                         // transaction may have been cut short
        }
    };
    // The end of the belief: now, or the lease's local deadline if that passed first (this
    // process may have been frozen past it).
    let now = tokio::time::Instant::now();
    let end_ns = history::now_ns();
    let until = guard.held_until();
    let end = if until < now {
        end_ns.saturating_sub((now - until).as_nanos() as u64)
    } else {
        end_ns
    };
    let at = format!("{key}@{}@{}", guard.shard(), guard.owner());
    recorder.hold(&at, remote, start, end.max(start), guard.fence());
    let _ = guard.release().await;
    Some(outcome)
}

crate::worker_entry! { "fenced" => fenced_worker() }
