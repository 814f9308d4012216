//! Leader election across processes on real shards: three campaigners, the leader frozen past
//! its lease and then killed; a new leader each time, terms strictly rising, and never two
//! processes believing they lead at one instant (a history of beliefs, checked afterwards).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::history::{self, Hold, Recorder};
use shardlock::{AcquireOptions, Leader, LockRouter};
use shardlock_testkit::Worker;

const NAME: &str = "leader:billing";
const DIR_ENV: &str = "SHARDLOCK_TEST_HISTORY_DIR";
const EVENT: Duration = Duration::from_secs(60);

fn opts() -> AcquireOptions {
    AcquireOptions::new().ttl(Duration::from_secs(2))
}

/// A lock of the name released in this process goes to a campaigner through the shard, never
/// in memory: the row then names the new leader, and its term is the row's fence.
#[tokio::test(flavor = "multi_thread")]
async fn a_campaigner_is_elected_through_the_shard_not_handed_a_lock_in_memory() {
    // Hand-offs allowed for long after the grant, so that the release below could hand over.
    let (_cluster, router, _) = common::start(
        1,
        "namespaces:\n  default:\n    ttl: 120s\n    handoff-max-time: 60s\n",
    )
    .await;
    let held = router.acquire(NAME, AcquireOptions::new()).await.unwrap();
    let campaign = tokio::spawn({
        let router = router.clone();
        async move { router.campaign(NAME, AcquireOptions::new()).await }
    });
    let queued = common::eventually(EVENT, || async { router.stats().queued == 1 }).await;
    assert!(queued, "the campaigner waits in memory behind the holder");
    let (owner, fence, handoffs) = (
        held.owner().to_owned(),
        held.fence(),
        router.stats().local_handoffs,
    );
    held.release().await.unwrap();
    let leadership = campaign.await.unwrap().unwrap();
    assert_eq!(
        router.stats().local_handoffs,
        handoffs,
        "handed over in memory"
    );
    let leader = router
        .leader(NAME, AcquireOptions::new())
        .await
        .unwrap()
        .expect("a leader");
    assert_ne!(
        leader.owner, owner,
        "the row still names the released holder"
    );
    assert_eq!(leader.term, leadership.term());
    assert!(leadership.term() > fence);
    leadership.resign().await.unwrap();
}

/// Waits until `name` is led by an instance for which `pick` holds.
/// `leader` reads every shard the name may live on: during a reload's move, a leader that has
/// not reloaded leads on the shard the name left (a reloaded process answered that nobody
/// led), and a leadership that followed its name to the new shard reports its grant's term
/// (the new shard's row has a higher fence).
#[tokio::test(flavor = "multi_thread")]
async fn the_leader_is_found_where_it_leads_during_a_move() {
    let cluster = shardlock_testkit::Cluster::start(2).await.unwrap();
    let config = |shards: usize| {
        let mut yaml = String::from("shards:\n");
        for s in &cluster.shards()[..shards] {
            yaml.push_str(&format!("  - name: {}\n    url: {}\n", s.name(), s.url()));
        }
        shardlock::Config::from_yaml_str(&format!(
            "{yaml}routing:\n  move-window: 60s\ncleaner:\n  heartbeat-interval: 100ms\n"
        ))
        .unwrap()
    };
    let (one, two) = (config(1), config(2));
    LockRouter::new(two.clone())
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let placed = LockRouter::new(two.clone()).await.unwrap();
    let name = (0..)
        .map(|i| format!("leader:{i}"))
        .find(|n| placed.shard_for(n).unwrap() == "s2")
        .unwrap();
    placed.shutdown().await.unwrap();

    let leading = LockRouter::new(one.clone()).await.unwrap();
    let reloaded = LockRouter::new(one).await.unwrap();
    let leadership = leading.campaign(&name, opts()).await.unwrap();
    reloaded.reload(two.clone()).await.unwrap();
    let seen = reloaded.leader(&name, opts()).await.unwrap();
    assert_eq!(
        seen.as_ref().map(|l| l.owner.as_str()),
        Some(leadership.guard().owner()),
        "a reloaded process did not find the leader on the shard its name left"
    );

    leading.reload(two).await.unwrap();
    let followed = common::eventually(EVENT, || async { leading.stats().followed >= 1 }).await;
    assert!(followed, "the leadership never followed its name");
    let seen = reloaded.leader(&name, opts()).await.unwrap().unwrap();
    assert_eq!(seen.term, leadership.term(), "{seen:?}");
    leadership.resign().await.unwrap();
}

async fn leader_where(router: &LockRouter, pick: impl Fn(&Leader) -> bool) -> Leader {
    let deadline = tokio::time::Instant::now() + EVENT;
    loop {
        if let Some(l) = router
            .leader(NAME, opts())
            .await
            .unwrap()
            .filter(|l| pick(l))
        {
            return l;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no such leader came"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn worker_of(leader: &Leader) -> usize {
    leader
        .instance_id
        .strip_prefix("campaigner-")
        .unwrap()
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn three_campaigners_one_leader_at_a_time_terms_rising() {
    let (cluster, router, _yaml) = common::start(2, "").await;
    let dir = tempfile::tempdir().unwrap();
    let mut workers: Vec<Worker> = (0..3)
        .map(|i| {
            let yaml = cluster.config_yaml(&format!("instance:\n  id: campaigner-{i}\n"));
            let env = [
                (common::CONFIG_ENV, yaml),
                (DIR_ENV, dir.path().display().to_string()),
            ];
            Worker::spawn("worker", "campaigner", &env).unwrap()
        })
        .collect();

    let first = leader_where(&router, |_| true).await;
    let a = worker_of(&first);
    // Each leader is acted on once it has recorded a belief: frozen or killed while it
    // believes it leads.
    workers[a]
        .expect(&format!("leading {}", first.term))
        .await
        .unwrap();
    // Frozen past its lease: another is elected, and the frozen one steps down when it wakes.
    workers[a].pause().unwrap();
    let paused = tokio::time::Instant::now();
    let second = leader_where(&router, |l| l.instance_id != first.instance_id).await;
    println!("frozen leader replaced after {:?}", paused.elapsed());
    assert!(second.term > first.term, "{first:?} then {second:?}");
    workers[a].resume().unwrap();
    workers[a].expect("stepped-down").await.unwrap();
    // Killed: another is elected.
    let b = worker_of(&second);
    workers[b]
        .expect(&format!("leading {}", second.term))
        .await
        .unwrap();
    workers[b].kill().await.unwrap();
    let killed = tokio::time::Instant::now();
    let third = leader_where(&router, |l| l.instance_id != second.instance_id).await;
    println!("killed leader replaced after {:?}", killed.elapsed());
    assert!(third.term > second.term, "{second:?} then {third:?}");
    let c = worker_of(&third);
    workers[c]
        .expect(&format!("leading {}", third.term))
        .await
        .unwrap();

    std::fs::write(dir.path().join("stop"), b"").unwrap();
    for (i, w) in workers.into_iter().enumerate() {
        if i != b {
            let (status, lines) = w.finish().await.unwrap();
            assert!(status.success(), "{lines:?}");
        }
    }
    // Beliefs are recorded in slices; one leadership is one hold from its first slice to
    // its last.
    let mut merged: Vec<Hold> = Vec::new();
    for h in history::read(dir.path()) {
        match merged
            .iter_mut()
            .find(|m| m.process == h.process && m.fence == h.fence)
        {
            Some(m) => {
                m.start = m.start.min(h.start);
                m.end = m.end.max(h.end);
            }
            None => merged.push(h),
        }
    }
    let terms = history::check_no_two_holders(&merged);
    assert!(terms >= 3, "{merged:?}");
    assert!(
        router.leader(NAME, opts()).await.unwrap().is_none(),
        "the last leader resigned"
    );
}

fn stop_file(dir: &Path) -> PathBuf {
    dir.join("stop")
}

/// Campaigns until the stop file appears; while leading, records every 20 ms the instant up
/// to which it believed it led (taken before the check that vouches for it).
async fn campaigner() {
    let router = common::worker_router().await;
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let recorder = Recorder::create(&dir);
    'campaign: while !stop_file(&dir).exists() {
        let leadership = tokio::select! {
            l = router.campaign(NAME, opts()) => l.unwrap(),
            _ = async {
                while !stop_file(&dir).exists() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            } => break 'campaign,
        };
        let term = leadership.term();
        shardlock_testkit::report!("leader {term}");
        let started = history::now_ns();
        let mut since = started;
        loop {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let now = history::now_ns();
            if !leadership.is_leader() {
                shardlock_testkit::report!("stepped-down {term}");
                break;
            }
            recorder.hold(NAME, true, since, now, term);
            if since == started {
                shardlock_testkit::report!("leading {term}");
            }
            since = now;
            if stop_file(&dir).exists() {
                leadership.resign().await.unwrap();
                break 'campaign;
            }
        }
    }
    router.shutdown().await.unwrap();
}

crate::worker_entry! { "campaigner" => campaigner() }
