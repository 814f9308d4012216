//! Many reloads under load: three processes × 16 tasks do fenced read-modify-writes on 300
//! counters (five of them hot) with leases of 1 s held up to 3 s, while the topology grows,
//! shrinks, is reweighted and has a shard's URL pointed at another server, each process
//! reloading at its own moment within the move window. Counts are exact, fenced writes rise per
//! key, and no two processes ever believed they held one key at the same instant.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use rand::Rng;
use shardlock::mysql_async::Pool;
use shardlock::{AcquireOptions, LockMode, LockRouter};
use shardlock_testkit::{report, Cluster, Worker};

use common::history::{self, Recorder};

const KEYS: usize = 300;
const HOT: usize = 5;
const TASKS: usize = 16;
const PROCESSES: usize = 3;
const PATH_ENV: &str = "SHARDLOCK_TEST_CONFIG_PATH";
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";
const HISTORY_ENV: &str = "SHARDLOCK_TEST_HISTORY";
const RUN_FOR_ENV: &str = "SHARDLOCK_TEST_RUN_FOR_MS";
/// Time between topology changes, and the move window (processes reload within its half).
const STEP: Duration = Duration::from_secs(3);
const POLICY: &str =
    "routing:\n  move-window: 2s\nnamespaces:\n  default:\n    ttl: 1s\n    wait: 30s\n";

/// The topologies, in order: `(name, server index, weight)` per shard.
const TOPOLOGIES: &[&[(&str, usize, u32)]] = &[
    &[("s1", 0, 1), ("s2", 1, 1), ("s3", 2, 1)],
    // grow
    &[("s1", 0, 1), ("s2", 1, 1), ("s3", 2, 1), ("s4", 3, 1)],
    // shrink
    &[("s1", 0, 1), ("s2", 1, 1), ("s4", 3, 1)],
    // reweight
    &[("s1", 0, 3), ("s2", 1, 1), ("s4", 3, 1)],
    // s2's URL now reaches the fifth server
    &[("s1", 0, 3), ("s2", 4, 1), ("s4", 3, 1)],
    // grow again
    &[("s1", 0, 1), ("s2", 4, 1), ("s3", 2, 1), ("s4", 3, 1)],
];

fn config(cluster: &Cluster, shards: &[(&str, usize, u32)]) -> String {
    let mut yaml = String::from("shards:\n");
    for (name, server, weight) in shards {
        yaml.push_str(&format!(
            "  - name: {name}\n    url: {}\n    weight: {weight}\n",
            cluster.shard(*server).url()
        ));
    }
    yaml.push_str(POLICY);
    yaml
}

#[tokio::test(flavor = "multi_thread")]
async fn reloads_under_load_never_make_two_holders() {
    let cluster = Cluster::start(5).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("shardlock.yaml");
    let histories = dir.path().join("history");
    std::fs::create_dir(&histories).unwrap();
    let all: Vec<(&str, usize, u32)> = (0..5)
        .map(|i| (["a", "b", "c", "d", "e"][i], i, 1))
        .collect();
    LockRouter::from_yaml_str(&config(&cluster, &all))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    std::fs::write(&path, config(&cluster, TOPOLOGIES[0])).unwrap();
    let app_url = cluster.shard(0).url();
    let mut app = common::counters::create(&app_url, KEYS).await;

    let run_for = STEP * TOPOLOGIES.len() as u32 + Duration::from_secs(2);
    let env = [
        (PATH_ENV, path.display().to_string()),
        (APP_ENV, app_url.clone()),
        (HISTORY_ENV, histories.display().to_string()),
        (RUN_FOR_ENV, run_for.as_millis().to_string()),
    ];
    let mut workers: Vec<Worker> = (0..PROCESSES)
        .map(|_| Worker::spawn("worker", "soak", &env).unwrap())
        .collect();
    for w in &mut workers {
        w.expect("ready").await.unwrap();
    }
    for shards in &TOPOLOGIES[1..] {
        tokio::time::sleep(STEP).await;
        std::fs::write(&path, config(&cluster, shards)).unwrap();
        // Each process reloads at its own moment, within half the window.
        for (i, w) in workers.iter().enumerate() {
            if i > 0 {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(w.pid()),
                nix::sys::signal::Signal::SIGHUP,
            )
            .unwrap();
        }
    }
    let mut totals = [0u64; 5];
    for w in workers {
        let fields = w.finish_report("done ").await.unwrap();
        for (t, f) in totals.iter_mut().zip(&fields) {
            *t += f;
        }
        // Every SIGHUP was taken (a refused reload is only logged): a process left on an
        // earlier topology would test less than the run claims.
        assert_eq!(
            fields[5],
            TOPOLOGIES.len() as u64,
            "a worker did not take every reload"
        );
    }
    let [writes, lost, rejected, moved, followed] = totals;
    let holds = history::read(&histories);
    let checked = history::check_no_two_holders(&holds);
    eprintln!(
        "{writes} fenced writes, {checked} holds checked; {lost} leases lost, {rejected} \
         fenced writes rejected; {moved} grants of moved keys, {followed} held leases followed \
         their key"
    );
    assert!(writes > 200, "the run made progress: {writes}");
    assert!(
        moved > 0 && followed > 0,
        "keys moved while they were in use"
    );
    assert_eq!(
        rejected, 0,
        "a fenced write was rejected while its lease was held: a newer holder had written"
    );
    common::counters::check(&mut app, writes as usize).await;
}

async fn soak_worker() {
    let path = std::env::var(PATH_ENV).unwrap();
    let router = LockRouter::from_yaml_file(&path).await.unwrap();
    let _reloads = router.reload_on_sighup(&path).unwrap();
    let pool = Pool::new(std::env::var(APP_ENV).unwrap().as_str());
    let recorder = std::sync::Arc::new(Recorder::create(
        std::env::var(HISTORY_ENV).unwrap().as_ref(),
    ));
    let run_for: u64 = std::env::var(RUN_FOR_ENV).unwrap().parse().unwrap();
    let until = tokio::time::Instant::now() + Duration::from_millis(run_for);
    report!("ready");
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (router, pool, recorder) = (router.clone(), pool.clone(), recorder.clone());
            tokio::spawn(async move {
                let mut counts = [0u64; 3];
                while tokio::time::Instant::now() < until {
                    let (key, hold) = {
                        let mut rng = rand::rng();
                        if rng.random_bool(0.3) {
                            (rng.random_range(0..HOT), rng.random_range(0..20))
                        } else {
                            (rng.random_range(HOT..KEYS), rng.random_range(0..3000))
                        }
                    };
                    let key = format!("c:{key}");
                    let outcome = hold_and_write(&router, &pool, &recorder, &key, hold).await;
                    counts[outcome as usize] += 1;
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
    let stats = router.stats();
    report!(
        "done {} {} {} {} {} {}",
        counts[Outcome::Wrote as usize],
        counts[Outcome::Lost as usize],
        counts[Outcome::Rejected as usize],
        stats.moved_grants,
        stats.followed,
        router.epoch()
    );
    router.shutdown().await.unwrap();
}

#[derive(Debug, Clone, Copy)]
enum Outcome {
    Wrote = 0,
    Lost = 1,
    Rejected = 2,
}

/// Acquires `key`, holds it `hold_ms` (unless the lease is lost meanwhile), then increments its
/// counter through a fenced write and logs the write, recording the hold in the history.
async fn hold_and_write(
    router: &LockRouter,
    pool: &Pool,
    recorder: &Recorder,
    key: &str,
    hold_ms: u64,
) -> Outcome {
    let opts = AcquireOptions::new();
    let guard = loop {
        match router.acquire(key, opts.clone()).await {
            Ok(guard) => break guard,
            Err(e) if e.is_unavailable() => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("acquire {key}: {e}"),
        }
    };
    let start = history::now_ns();
    let remote = guard.mode() == LockMode::Remote;
    let lost = tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(hold_ms)) => false,
        _ = guard.lost() => true,
    };
    let outcome = if lost || !guard.is_held() {
        Outcome::Lost
    } else {
        match common::counters::fenced_increment(pool, key, guard.fence(), false).await {
            Ok(true) => Outcome::Wrote,
            // The lease ended on the way (a stall on a loaded machine past its 1 s ttl): a
            // newer holder rightly wrote first. The history says whether the holds overlapped.
            Ok(false) if !guard.is_held() => Outcome::Lost,
            Ok(false) => Outcome::Rejected,
            Err(e) => panic!("write {key}: {e}"),
        }
    };
    // The end of the belief: before the release is sent (or when the loss was noticed), or
    // the lease's own end if that came first (a stall past it during the write: the next
    // holder may rightly have taken the key by then).
    let ended_ago = tokio::time::Instant::now().saturating_duration_since(guard.held_until());
    let end = history::now_ns().saturating_sub(u64::try_from(ended_ago.as_nanos()).unwrap());
    recorder.hold(key, remote, start, end, guard.fence());
    match guard.release().await {
        Err(e) if !e.is_unavailable() && !matches!(e, shardlock::Error::LockLost { .. }) => {
            panic!("release {key}: {e}")
        }
        _ => {}
    }
    outcome
}

crate::worker_entry! { "soak" => soak_worker() }
