//! Two routers configured with one instance id (a copy-pasted config, an old incarnation
//! still running): the second one is refused at start, in this process or another, and the
//! owners of two starts under one id never collide. A process that comes back from a pause
//! longer than the heartbeat timeout joins its fleet again before it grants, and grants nothing
//! if another process started under its id meanwhile.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Config, Error, InstanceVerdict, LockRouter};
use shardlock_testkit::{report, Cluster, Proxy, ProxyMode, Worker};

const TWIN: &str = "instance:\n  id: twin\n";

#[tokio::test(flavor = "multi_thread")]
async fn two_routers_with_one_instance_id_never_share_an_owner() {
    let (cluster, _router, _) = common::start(2, "").await;
    let yaml = cluster.config_yaml(TWIN);
    let a = LockRouter::from_yaml_str(&yaml).await.unwrap();
    // Another router of this same process is refused the id while `a` lives: the registry
    // keeps one row per id, so neither would see the other's topology in a reload.
    let refused = LockRouter::from_yaml_str(&yaml).await.unwrap_err();
    assert!(
        matches!(
            refused,
            Error::InvalidArgument {
                name: "instance.id",
                ..
            }
        ) && refused
            .to_string()
            .contains("another router of this process"),
        "{refused}"
    );
    let once = || AcquireOptions::new().wait(Duration::ZERO);
    let held = a.acquire("k", once()).await.unwrap();
    assert_ne!(held.owner(), "twin:1");
    assert!(held.owner().starts_with("twin:"), "{}", held.owner());

    // A process on another pid with the same id is refused while `a` heartbeats.
    let registered = common::eventually(Duration::from_secs(10), || async {
        a.instances().await.iter().all(|(_, rows)| {
            rows.as_ref()
                .is_ok_and(|r| r.iter().any(|i| i.instance_id == "twin"))
        })
    })
    .await;
    assert!(registered, "a registered");
    let mut twin = Worker::spawn("worker", "twin", &[(common::CONFIG_ENV, yaml.clone())]).unwrap();
    let said = twin.expect("refused ").await.unwrap();
    assert!(
        said.contains("instance.id") && said.contains("`twin` is live in the registry"),
        "{said}"
    );

    // Shut down, `a` gives the id back; the next router of this process under it is a new
    // start whose owners never look like `a`'s, and whose fences go on rising.
    let (owner, fence) = (held.owner().to_owned(), held.fence());
    a.shutdown().await.unwrap();
    let b = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let next = b.try_acquire("k", once()).await.unwrap().expect("free");
    assert!(
        next.owner().starts_with("twin:") && next.owner() != owner,
        "{}",
        next.owner()
    );
    assert!(next.fence() > fence);
    next.release().await.unwrap();
}

/// Heartbeats every 100 ms; dead after 2 s without one.
const BEATS: &str =
    "cleaner:\n  registry: heartbeat\n  heartbeat-interval: 100ms\n  heartbeat-timeout: 2s\n";

/// A worker under instance id `twin` in `role`, once it said `first`.
async fn twin_in(role: &str, yaml: &str, first: &str) -> Worker {
    let mut worker =
        Worker::spawn("worker", role, &[(common::CONFIG_ENV, yaml.to_owned())]).unwrap();
    worker.expect(first).await.unwrap();
    worker
}

/// Freezes `worker` until the registry counts it dead on every shard.
async fn pause_until_dead(router: &LockRouter, worker: &Worker) {
    worker.pause().unwrap();
    let timeout = Duration::from_secs(2);
    let dead = common::eventually(Duration::from_secs(60), || async {
        router.instances().await.iter().all(|(_, rows)| {
            rows.as_ref().is_ok_and(|rows| {
                rows.iter()
                    .any(|i| i.instance_id == "twin" && i.verdict(timeout) == InstanceVerdict::Dead)
            })
        })
    })
    .await;
    assert!(dead, "the frozen worker counts as dead");
}

/// The worker's next outcome that is not a grant, within a minute (it grants in a loop
/// while nothing stops it).
async fn next_refusal(worker: &mut Worker) -> String {
    tokio::time::timeout(Duration::from_secs(60), worker.expect("refused"))
        .await
        .expect("the worker went on granting")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_process_resumed_after_its_twin_started_grants_nothing() {
    let (cluster, router, _) = common::start(2, BEATS).await;
    let yaml = cluster.config_yaml(&format!("{TWIN}{BEATS}"));
    let mut paused = twin_in("looping-twin", &yaml, "granted").await;
    pause_until_dead(&router, &paused).await;
    let twin = LockRouter::from_yaml_str(&yaml)
        .await
        .expect("the frozen process counts as dead: its id is free");
    paused.resume().unwrap();

    // It may first say that its heartbeat lapsed, then that its id was taken over.
    let mut said = next_refusal(&mut paused).await;
    while !said.contains("taken over") {
        assert!(said.contains("heartbeat"), "{said}");
        said = next_refusal(&mut paused).await;
    }
    assert!(
        said.contains(&format!("pid {}", std::process::id())),
        "{said}"
    );
    // From then on it grants nothing (the window of tries under way may hold some from
    // before), and its heartbeat leaves the twin's row alone.
    paused.expect("tries").await.unwrap();
    for _ in 0..2 {
        let tries = paused.expect("tries").await.unwrap();
        assert_eq!(tries, "refused", "after being taken over");
    }
    for (shard, rows) in router.instances().await {
        let row = rows.unwrap().into_iter().find(|i| i.instance_id == "twin");
        assert_eq!(
            row.map(|r| r.pid),
            Some(std::process::id()),
            "shard {shard}"
        );
    }
    let once = AcquireOptions::new().wait(Duration::ZERO);
    let held = twin.try_acquire("k", once).await.unwrap().expect("free");
    held.release().await.unwrap();
    twin.shutdown().await.unwrap();
}

/// A process under the id `twin` reaching s2 through `cut`, which now resets its connections,
/// its row on s2 made silent for a minute (dead to the fleet); `held`, a proxy to s1 for a
/// start under the same id. Dead after 30 s without a heartbeat: a busy machine does not make
/// the live process's row on s1 look dead.
struct CutOff {
    _cluster: Cluster,
    router: LockRouter,
    yaml: String,
    s1_url: String,
    cut: Proxy,
    held: Proxy,
    live: Worker,
    worker: u32,
}

const CUT_OFF_BEATS: &str = "cleaner:\n  registry: heartbeat\n  heartbeat-interval: 100ms\n  \
                             heartbeat-timeout: 30s\n";

async fn cut_off_twin() -> CutOff {
    let (cluster, router, _) = common::start(2, CUT_OFF_BEATS).await;
    let (s1, s2) = (cluster.shard(0), cluster.shard(1));
    let yaml = cluster.config_yaml(&format!("{TWIN}{CUT_OFF_BEATS}"));
    let (cut, held) = (
        Proxy::start(s2.port()).await.unwrap(),
        Proxy::start(s1.port()).await.unwrap(),
    );
    let live = twin_in(
        "looping-twin",
        &yaml.replace(&s2.url(), &cut.url()),
        "granted",
    )
    .await;
    // Refused at once there (a hanging shard would slow its heartbeats on s1 too).
    cut.set(ProxyMode::Reset);
    let worker = u32::try_from(live.pid()).unwrap();
    silence_on_s2(&router, s2, worker, "the cut-off process's").await;
    let s1_url = s1.url();
    CutOff {
        _cluster: cluster,
        router,
        yaml,
        s1_url,
        cut,
        held,
        live,
        worker,
    }
}

/// Makes the registry row of `twin` on s2, `pid`'s (`whose`), silent for a minute: dead to the
/// fleet. Again if a heartbeat on its way as the link was cut landed after the update.
async fn silence_on_s2(router: &LockRouter, s2: &shardlock_testkit::Shard, pid: u32, whose: &str) {
    let silent = common::eventually(Duration::from_secs(60), || async {
        (s2.connect().await.unwrap())
            .exec_drop(
                "UPDATE shardlock_instance SET heartbeat_at = NOW(3) - INTERVAL 60 SECOND \
                 WHERE instance_id = 'twin'",
                (),
            )
            .await
            .unwrap();
        row_on_s2(router, pid, InstanceVerdict::Dead).await
    })
    .await;
    assert!(silent, "{whose} row on s2 is silent");
}

/// Whether the registry row of `twin` on s2 is `pid`'s, with `verdict` (after 30 s of silence).
async fn row_on_s2(router: &LockRouter, pid: u32, verdict: InstanceVerdict) -> bool {
    let rows = router.instances().await;
    let (_, rows) = rows.iter().find(|(shard, _)| shard == "s2").unwrap();
    rows.as_ref().is_ok_and(|rows| {
        rows.iter().any(|i| {
            i.instance_id == "twin" && i.pid == pid && i.verdict(Duration::from_secs(30)) == verdict
        })
    })
}

impl CutOff {
    /// A start under the id, reaching s1 through `held`.
    fn start(&self) -> tokio::task::JoinHandle<shardlock::Result<LockRouter>> {
        let yaml = self.yaml.replace(&self.s1_url, &self.held.url());
        tokio::spawn(async move { LockRouter::from_yaml_str(&yaml).await })
    }

    /// The cut-off process's link comes back, and its heartbeat reaches s2 again: its row there
    /// is its own and live again, or it finds its id taken over (what it said).
    async fn link_back(&mut self) -> String {
        self.cut.set(ProxyMode::Pass);
        let reached = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                tokio::select! {
                    line = self.live.line() => {
                        let line = line.unwrap().expect("the worker ended");
                        if line.contains("taken over") {
                            return line;
                        }
                    }
                    () = tokio::time::sleep(Duration::from_millis(20)) => {
                        if row_on_s2(&self.router, self.worker, InstanceVerdict::Running).await {
                            return "its row on s2 live again".to_owned();
                        }
                    }
                }
            }
        })
        .await;
        reached.expect("the cut-off process's heartbeat never reached s2 again")
    }

    /// Asserts that the cut-off process joins its fleet again and grants (having said `reached`).
    async fn grants_again(&mut self, reached: &str) {
        let granting = tokio::time::timeout(Duration::from_secs(60), async {
            while self.live.expect("tries").await.unwrap() != "granted" {}
        })
        .await;
        assert!(
            granting.is_ok(),
            "a process whose id a start took where it was cut off stopped granting (it said \
             {reached})"
        );
    }
}

/// A start refused because its id is live on one shard takes no row of it on another, where
/// that process is cut off: its link back, it would find its id taken over there, and stop
/// granting for good, although the start that took it gave up.
#[tokio::test(flavor = "multi_thread")]
async fn a_start_refused_while_its_id_is_live_leaves_the_id_where_its_process_is_cut_off() {
    let mut c = cut_off_twin().await;
    // Another start under the id: its heartbeat on s1 (where the id is live) is held back; one
    // on s2 would take the silent row there.
    c.held
        .set(ProxyMode::PauseTo(b"SET host = IF(LAST_INSERT_ID"));
    let start = c.start();
    let this = std::process::id();
    let acted = common::eventually(Duration::from_secs(60), || async {
        start.is_finished()
            || (c.held.mode() == ProxyMode::Paused
                && row_on_s2(&c.router, this, InstanceVerdict::Running).await)
    })
    .await;
    assert!(acted, "the start neither ended nor beat");
    let reached = c.link_back().await;
    c.held.set(ProxyMode::Pass);
    let refused = start.await.unwrap().expect_err("the id is live on s1");
    assert!(
        refused.to_string().contains("live in the registry"),
        "{refused}"
    );
    c.grants_again(&reached).await;
}

/// A start that cannot reach the shard where its id is live takes no row of it on another,
/// where that process is cut off, either (helper 237 F4): it could not look for that process
/// there, and its heartbeat on the other shard took the silent row; once the link came back,
/// the process found its id taken over and stopped granting for good, and the start was
/// refused once it reached the first shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_start_cut_off_from_where_its_id_is_live_leaves_the_id_where_its_process_is_cut_off() {
    let mut c = cut_off_twin().await;
    c.held.set(ProxyMode::Blackhole);
    // Built with its gate closed once its first heartbeat is done (s1 unreached).
    let start = c
        .start()
        .await
        .unwrap()
        .expect("a start with a shard out of reach");
    assert!(
        row_on_s2(&c.router, c.worker, InstanceVerdict::Dead).await,
        "a start that could not look for a live process under its id took that process's row \
         where it is cut off"
    );
    let reached = c.link_back().await;
    c.grants_again(&reached).await;
    drop(start);
}

/// A process resumed after another start took its id over, which cannot read the shard where
/// that start beats, takes no row of it on another shard, where that start is cut off (helper
/// 240 F1): that start, its link back, would find its id taken over there and stop granting
/// for good, although it took the id over from a process that counted as dead. (The resumed
/// process still beats where its rows are its own: see the next test.)
#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_process_cut_off_from_where_its_id_lives_leaves_the_id_where_that_start_is_cut_off(
) {
    let (cluster, router, _) = common::start(2, BEATS).await;
    let (s1, s2) = (cluster.shard(0), cluster.shard(1));
    let yaml = cluster.config_yaml(&format!("{TWIN}{BEATS}"));
    // The old process reaches s1 through `held`, the start that takes its id over reaches s2
    // through `cut`.
    let (held, cut) = (
        Proxy::start(s1.port()).await.unwrap(),
        Proxy::start(s2.port()).await.unwrap(),
    );
    let mut paused = twin_in(
        "looping-twin",
        &yaml.replace(&s1.url(), &held.url()),
        "granted",
    )
    .await;
    pause_until_dead(&router, &paused).await;
    let _twin = LockRouter::from_yaml_str(&yaml.replace(&s2.url(), &cut.url()))
        .await
        .expect("the frozen process counts as dead: its id is free");
    // The start is cut off from s2, its row there silent; the old process cannot reach s1.
    cut.set(ProxyMode::Reset);
    let this = std::process::id();
    silence_on_s2(&router, s2, this, "the start's").await;
    held.set(ProxyMode::Blackhole);
    paused.resume().unwrap();
    // It tries to join its fleet again: it says it leaves the row on s2, or it took it.
    let looked = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let said = next_refusal(&mut paused).await;
            let worker = u32::try_from(paused.pid()).unwrap();
            if said.contains("is not taken while a shard could not be read")
                || row_on_s2(&router, worker, InstanceVerdict::Running).await
            {
                return;
            }
        }
    })
    .await;
    assert!(looked.is_ok(), "the resumed process never tried to join");
    assert!(
        row_on_s2(&router, this, InstanceVerdict::Dead).await,
        "a resumed process that could not look for the start that took its id over took that \
         start's row where it is cut off"
    );
}

/// A process resumed after a lapse, which cannot read one shard for another start of its id,
/// still beats where its rows are its own (helper 241): they are what keeps a key's move in
/// force while one of its transaction locks' `COMMIT` may still land; beating nowhere until it
/// could read every shard let them go silent, and the fleet could end the move.
#[tokio::test(flavor = "multi_thread")]
async fn a_resumed_process_that_cannot_read_a_shard_beats_its_own_rows_on_the_others() {
    let (cluster, router, _) = common::start(2, BEATS).await;
    let (s1, s2) = (cluster.shard(0), cluster.shard(1));
    let yaml = cluster.config_yaml(&format!("{TWIN}{BEATS}"));
    let held = Proxy::start(s1.port()).await.unwrap();
    let mut paused = twin_in(
        "looping-twin",
        &yaml.replace(&s1.url(), &held.url()),
        "granted",
    )
    .await;
    let worker = u32::try_from(paused.pid()).unwrap();
    pause_until_dead(&router, &paused).await;
    silence_on_s2(&router, s2, worker, "the frozen process's").await;
    held.set(ProxyMode::Blackhole);
    paused.resume().unwrap();
    let beaten = common::eventually(Duration::from_secs(60), || async {
        row_on_s2(&router, worker, InstanceVerdict::Running).await
    })
    .await;
    assert!(
        beaten,
        "a resumed process that could not read one shard left its own row silent on another"
    );
    // It has not joined: it could not look on s1.
    let said = next_refusal(&mut paused).await;
    assert!(said.contains("heartbeat"), "{said}");
}

/// Whether `router` comes to refuse a grant, within a minute, with an error that says `why`;
/// else how its last try went.
async fn refused_saying(router: &LockRouter, why: &str) -> Result<(), String> {
    let once = AcquireOptions::new().wait(Duration::ZERO);
    let last = std::sync::Mutex::new(String::new());
    let refused = common::eventually(Duration::from_secs(60), || async {
        let said = match router.try_acquire("other", once.clone()).await {
            Ok(granted) => format!("granted: {}", granted.is_some()),
            Err(e) => shardlock::Report(&e).to_string(),
        };
        let found = said.contains(why);
        *last.lock().unwrap() = said;
        found
    })
    .await;
    match refused {
        true => Ok(()),
        false => Err(last.into_inner().unwrap()),
    }
}

/// Makes the registry row of `twin` on the cluster's first shard a minute silent (as the
/// fleet sees a frozen process's) and starts another process under that id, with `beats`.
async fn take_the_id_over(cluster: &Cluster, beats: &str) -> Worker {
    (cluster.shard(0).connect().await.unwrap())
        .exec_drop(
            "UPDATE shardlock_instance SET heartbeat_at = heartbeat_at - INTERVAL 60 SECOND \
             WHERE instance_id = 'twin'",
            (),
        )
        .await
        .unwrap();
    let twin_yaml = cluster.config_yaml(&format!("{TWIN}{beats}"));
    let mut twin =
        Worker::spawn("worker", "staying-twin", &[(common::CONFIG_ENV, twin_yaml)]).unwrap();
    let started = twin.expect("").await.unwrap();
    assert_eq!(started, "started", "the silent process's id is free");
    twin
}

/// A process whose id another start took over while the fleet counted it dead loses its
/// leases, and its transaction locks, at the heartbeat that finds its row taken: it only
/// stopped granting, and its guards said they held until its lapse came by its own clocks
/// (which may have stood still through the freeze that made it count as dead).
#[tokio::test(flavor = "multi_thread")]
async fn a_process_that_finds_its_id_taken_over_loses_its_leases_at_once() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    // A lapse of 15.1 s, far beyond the steps below.
    let beats = "cleaner:\n  registry: heartbeat\n  heartbeat-interval: 200ms\n  \
                 heartbeat-timeout: 30s\n";
    let holder = LockRouter::from_yaml_str(&format!(
        "{TWIN}shards:\n  - name: s1\n    url: {}\n{beats}",
        proxy.url()
    ))
    .await
    .unwrap();
    holder.migrate().await.unwrap();
    let guard = holder
        .acquire("k", AcquireOptions::new().ttl(Duration::from_secs(120)))
        .await
        .unwrap();
    let tx = holder
        .lock_in_transaction("tx", Duration::from_secs(10))
        .await
        .unwrap();
    // Its heartbeats stop reaching the shard, where its row is seen silent for a minute (as
    // the fleet sees a frozen process's), and another start takes its id over.
    proxy.set(ProxyMode::Blackhole);
    let twin = take_the_id_over(&cluster, beats).await;
    proxy.set(ProxyMode::Pass);

    // Its next heartbeat finds the row taken: it grants nothing more, and holds nothing.
    if let Err(last) = refused_saying(&holder, "taken over").await {
        panic!("the process never found its id taken over (last: {last})");
    }
    assert!(
        !guard.is_held(),
        "a process whose id was taken over still held its lease"
    );
    assert!(
        !tx.is_held(),
        "a process whose id was taken over still held its transaction lock"
    );
    // Lost to the takeover, not to a lapse of its own.
    assert_eq!(holder.stats().heartbeat_lapses, 0);
    tokio::time::timeout(Duration::from_secs(30), guard.lost())
        .await
        .expect("lost() never completed");
    // A campaign ends at once, saying why: waiting would never elect it.
    let campaign = holder.campaign("leader", AcquireOptions::new());
    match tokio::time::timeout(Duration::from_secs(60), campaign).await {
        Ok(Err(e)) => {
            let said = shardlock::Report(&e).to_string();
            assert!(said.contains("taken over"), "{said}");
        }
        Ok(Ok(_)) => panic!("a process whose id was taken over was elected"),
        Err(_) => panic!("a campaign of a process whose id was taken over waited on"),
    }
    drop((guard, tx, twin));
}

/// A caller that polls a key another process holds when its process finds its id taken over
/// is answered at once, saying why: every poll found the key busy, so none was granted and
/// given back, and it polled on to the end of its wait for a grant it could never be given.
#[tokio::test(flavor = "multi_thread")]
async fn a_caller_polling_a_busy_key_when_its_process_is_replaced_is_answered_at_once() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let beats = "cleaner:\n  registry: heartbeat\n  heartbeat-interval: 200ms\n  \
                 heartbeat-timeout: 30s\n";
    // Statements held at the cut answer once it ends: the poll on its way then finds the key
    // busy, instead of failing the caller for a shard that did not answer.
    let holder = LockRouter::from_yaml_str(&unhurried(&format!(
        "{TWIN}shards:\n  - name: s1\n    url: {}\n{beats}",
        proxy.url()
    )))
    .await
    .unwrap();
    holder.migrate().await.unwrap();
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap();
    let held = other
        .acquire("busy", AcquireOptions::new().ttl(Duration::from_secs(600)))
        .await
        .unwrap();
    let sent = holder.stats().acquire_statements;
    let waiter = {
        let holder = holder.clone();
        let wait = AcquireOptions::new().wait(Duration::from_secs(600));
        tokio::spawn(async move { holder.acquire("busy", wait).await })
    };
    let polling = common::eventually(Duration::from_secs(60), || async {
        holder.stats().acquire_statements >= sent + 2
    })
    .await;
    assert!(polling, "the caller never polled the busy key");

    proxy.set(ProxyMode::Blackhole);
    let twin = take_the_id_over(&cluster, beats).await;
    proxy.set(ProxyMode::Pass);
    // Ten times shorter than its wait.
    match tokio::time::timeout(Duration::from_secs(60), waiter).await {
        Ok(Ok(Err(e))) => {
            let said = shardlock::Report(&e).to_string();
            assert!(said.contains("taken over"), "{said}");
        }
        Ok(Ok(Ok(_))) => panic!("a process whose id was taken over was granted a held key"),
        Ok(Err(panicked)) => panic!("{panicked}"),
        Err(_) => panic!("a caller of a process whose id was taken over polled on"),
    }
    held.release().await.unwrap();
    drop(twin);
}

/// A process whose id another start took over loses its in-process locks too (taken with
/// `on-shard-failure: local` while its shard did not answer): a replaced process re-acquires
/// nothing on the shard, where a conflict would be found and reported, so they said held for
/// ever while another process held their keys on the shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_that_finds_its_id_taken_over_loses_its_in_process_locks() {
    let cluster = Cluster::start(1).await.unwrap();
    let proxy = Proxy::start(cluster.shard(0).port()).await.unwrap();
    let beats = "cleaner:\n  registry: heartbeat\n  heartbeat-interval: 100ms\n  \
                 heartbeat-timeout: 2s\n";
    let holder = LockRouter::from_yaml_str(&format!(
        "{TWIN}shards:\n  - name: s1\n    url: {}\n    statement-timeout: 1s\n{beats}\
         breaker:\n  consecutive-failures: 2\n  cooldown: 300ms\n\
         namespaces:\n  default:\n    on-shard-failure: local\n",
        proxy.url()
    ))
    .await
    .unwrap();
    holder.migrate().await.unwrap();
    let remote = holder
        .acquire(
            "remote",
            AcquireOptions::new().ttl(Duration::from_secs(120)),
        )
        .await
        .unwrap();
    // Its shard stops answering: its breaker opens and it locks `k` in process.
    proxy.set(ProxyMode::Blackhole);
    let local = holder
        .acquire("k", AcquireOptions::new().wait(Duration::from_secs(60)))
        .await
        .unwrap();
    assert_eq!(local.mode(), shardlock::LockMode::LocalFallback);
    // Cut off past its heartbeat's lapse (its lease on the shard says so), it counts as dead,
    // another start takes its id over, and another process locks `k` on the shard.
    let lapsed = common::eventually(Duration::from_secs(60), || async { !remote.is_held() }).await;
    assert!(lapsed, "the cut-off process's lease never lapsed");
    let twin = take_the_id_over(&cluster, beats).await;
    let other = LockRouter::from_yaml_str(&cluster.config_yaml(beats))
        .await
        .unwrap();
    let on_shard = other.acquire("k", AcquireOptions::new()).await.unwrap();
    proxy.set(ProxyMode::Pass);

    if let Err(last) = refused_saying(&holder, "taken over").await {
        panic!("the process never found its id taken over (last: {last})");
    }
    assert!(
        !local.is_held(),
        "a process whose id was taken over still held a key in process while {} held it on \
         the shard",
        on_shard.owner()
    );
    tokio::time::timeout(Duration::from_secs(30), local.lost())
        .await
        .expect("lost() never completed");
    drop((remote, local, on_shard, twin));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_process_resumed_after_counting_as_dead_grants_again_once_it_has_rejoined() {
    let (cluster, router, _) = common::start(1, BEATS).await;
    let yaml = cluster.config_yaml(&format!("{TWIN}{BEATS}"));
    let mut paused = twin_in("looping-twin", &yaml, "granted").await;
    pause_until_dead(&router, &paused).await;
    paused.resume().unwrap();
    let lapses = tokio::time::timeout(Duration::from_secs(60), paused.expect("lapses"))
        .await
        .expect("its heartbeat lapsed")
        .unwrap();
    assert_eq!(lapses, "1");
    // Two windows of tries all granted: the second wholly after the lapse.
    for _ in 0..2 {
        let tries = tokio::time::timeout(Duration::from_secs(60), paused.expect("tries granted"))
            .await
            .expect("it rejoined its fleet");
        tries.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_grant_sought_across_a_lapse_is_given_back() {
    let (cluster, router, _) = common::start(1, BEATS).await;
    let yaml = unhurried(&cluster.config_yaml(&format!("{TWIN}{BEATS}")));
    let held = router
        .try_acquire(WAITED_FOR, AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap()
        .expect("free");
    let mut paused = twin_in("waiting-twin", &yaml, "waiting").await;
    // Its wait under way (it tried the key, which marks it wanted) before it freezes.
    let wanted = common::eventually(Duration::from_secs(60), || async {
        let (_, row) = router.inspect(WAITED_FOR).await.unwrap();
        row.is_some_and(|row| row.wanted_ms_ago.is_some())
    })
    .await;
    assert!(wanted, "the waiter tried the key");
    pause_until_dead(&router, &paused).await;
    // Freed while the waiter is frozen: its next try after the pause finds the key free, on
    // a placement it can no longer vouch for.
    held.release().await.unwrap();
    paused.resume().unwrap();
    let said = paused.expect("").await.unwrap();
    assert!(
        said.starts_with("refused") && said.contains("heartbeat"),
        "{said}"
    );
    let again = router
        .try_acquire(WAITED_FOR, AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap();
    assert!(again.is_some(), "the grant given back leaves no lease");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_transaction_lock_sought_across_a_lapse_is_given_back() {
    let (cluster, router, _) = common::start(1, BEATS).await;
    let yaml = unhurried(&cluster.config_yaml(&format!("{TWIN}{BEATS}")));
    let held = router
        .lock_in_transaction(WAITED_FOR, Duration::ZERO)
        .await
        .unwrap();
    let mut paused = twin_in("tx-waiting-twin", &yaml, "waiting").await;
    // Its wait under way: the server counts a row lock waited for.
    let waiting = common::eventually(Duration::from_secs(60), || async {
        let mut shard = cluster.shard(0).connect().await.unwrap();
        let waits: Option<(String, u64)> = shard
            .query_first("SHOW GLOBAL STATUS LIKE 'Innodb_row_lock_current_waits'")
            .await
            .unwrap();
        waits.is_some_and(|(_, n)| n == 1)
    })
    .await;
    assert!(waiting, "the waiter waits for the row");
    pause_until_dead(&router, &paused).await;
    // Freed while the waiter is frozen: the server hands it the row meanwhile.
    held.rollback().await.unwrap();
    paused.resume().unwrap();
    let said = paused.expect("").await.unwrap();
    assert!(
        said.starts_with("refused") && said.contains("heartbeat"),
        "{said}"
    );
    // Given back as its connection closes, which the server may finish after the waiter said
    // so: waited for (the row's lock wait), not tried once.
    let again = (router.lock_in_transaction(WAITED_FOR, Duration::from_secs(10))).await;
    assert!(again.is_ok(), "the row given back is free: {again:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_process_with_a_longer_heartbeat_timeout_counts_as_live_for_as_long_as_it_may_grant() {
    // The observer counts an instance dead after 2 s without a heartbeat; the worker, set for
    // a minute (a rolling change of the setting), grants until its own lapse, 30 s.
    let (cluster, router, _) = common::start(2, &format!("{BEATS}{WINDOW}")).await;
    let slow = BEATS.replace("heartbeat-timeout: 2s", "heartbeat-timeout: 60s");
    let yaml = cluster.config_yaml(&format!("{TWIN}{slow}"));
    let paused = twin_in("looping-twin", &yaml, "granted").await;
    paused.pause().unwrap();
    let silent_past_ours = common::eventually(Duration::from_secs(60), || async {
        router.instances().await.iter().all(|(_, rows)| {
            rows.as_ref().is_ok_and(|rows| {
                rows.iter()
                    .any(|i| i.instance_id == "twin" && i.heartbeat_ms_ago > 4_000)
            })
        })
    })
    .await;
    assert!(silent_past_ours, "the frozen worker's heartbeat is 4 s old");
    for (shard, rows) in router.instances().await {
        let row = rows.unwrap().into_iter().find(|i| i.instance_id == "twin");
        let verdict = row.map(|r| r.verdict(Duration::from_secs(2)));
        assert_eq!(verdict, Some(InstanceVerdict::Running), "shard {shard}");
    }

    // A move away from the topology it runs stays in force past its window: once it resumes,
    // it still grants moved keys on their old shard.
    let one = Config::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n{BEATS}{WINDOW}",
        cluster.shard(0).url()
    ))
    .unwrap();
    router.reload(one).await.unwrap();
    let checked = common::eventually(Duration::from_secs(60), || async {
        router.stats().moves_kept > 0 || router.moves_in_progress() == 0
    })
    .await;
    assert!(checked, "the move's window ended");
    assert!(
        router.stats().moves_kept > 0 && router.moves_in_progress() > 0,
        "the move ended while the worker may still grant by the topology it left"
    );
    // Nor may another start take its id over meanwhile.
    let twin = cluster.config_yaml(&format!("{TWIN}{BEATS}"));
    let refused = LockRouter::from_yaml_str(&twin).await.unwrap_err();
    assert!(
        refused.to_string().contains("live in the registry"),
        "{refused}"
    );
    paused.resume().unwrap();
}

/// `yaml` with statements given 30 s on every shard: a worker frozen past its statement
/// timeout with a statement on its way would otherwise answer that timeout when it resumes,
/// before anything it is tested for.
fn unhurried(yaml: &str) -> String {
    yaml.lines()
        .flat_map(|line| match line.trim_start().starts_with("url: ") {
            true => vec![line.to_owned(), "    statement-timeout: 30s".to_owned()],
            false => vec![line.to_owned()],
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

/// A short move window.
const WINDOW: &str = "routing:\n  move-window: 500ms\n";

/// The key `waiting-twin` waits for.
const WAITED_FOR: &str = "waited-for";

/// Waits up to two minutes for [`WAITED_FOR`], and says how that ended.
async fn waiting_twin_worker() {
    let router = common::worker_router().await;
    report!("waiting");
    let wait = AcquireOptions::new().wait(Duration::from_secs(120));
    match router.acquire(WAITED_FOR, wait).await {
        Ok(guard) => report!("granted {}", guard.fence()),
        Err(e) => report!("refused {}", shardlock::Report(&e)),
    }
}

/// Waits up to two minutes for [`WAITED_FOR`]'s transaction lock, and says how that ended.
async fn tx_waiting_twin_worker() {
    let router = common::worker_router().await;
    report!("waiting");
    match router
        .lock_in_transaction(WAITED_FOR, Duration::from_secs(120))
        .await
    {
        Ok(guard) => report!("granted {}", guard.shard()),
        Err(e) => report!("refused {}", shardlock::Report(&e)),
    }
}

/// Locks and releases a new key every 20 ms, reporting each change of outcome (`granted`,
/// `busy`, `refused` and why), how the last 20 tries went (`tries` and an outcome, or
/// `mixed`), and each heartbeat lapse (`lapses` and how many so far).
async fn looping_twin_worker() {
    let router = common::worker_router().await;
    let (mut last, mut recent, mut lapses) = (String::new(), Vec::new(), 0);
    for n in 0u64.. {
        if router.stats().heartbeat_lapses != lapses {
            lapses = router.stats().heartbeat_lapses;
            report!("lapses {lapses}");
        }
        let once = AcquireOptions::new().wait(Duration::ZERO);
        let said = match router.try_acquire(&format!("loop:{n}"), once).await {
            Ok(Some(guard)) => {
                let _ = guard.release().await;
                "granted".to_owned()
            }
            Ok(None) => "busy".to_owned(),
            Err(e) => format!("refused {}", shardlock::Report(&e)),
        };
        // Numbers (how long ago) aside, the same outcome is reported once.
        let outcome: String = said.chars().filter(|c| !c.is_ascii_digit()).collect();
        if outcome != last {
            report!("{said}");
            last = outcome;
        }
        recent.push(said.split(' ').next().unwrap_or_default().to_owned());
        if recent.len() == 20 {
            recent.dedup();
            let all = if recent.len() == 1 {
                &recent[0]
            } else {
                "mixed"
            };
            report!("tries {all}");
            recent.clear();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Starts a router and keeps it until killed (reporting `started`, or `refused` and why).
async fn staying_twin_worker() {
    let yaml = std::env::var(common::CONFIG_ENV).unwrap();
    match LockRouter::from_yaml_str(&yaml).await {
        Ok(_router) => {
            report!("started");
            std::future::pending::<()>().await;
        }
        Err(e) => report!("refused {e}"),
    }
}

async fn twin_worker() {
    let yaml = std::env::var(common::CONFIG_ENV).unwrap();
    match LockRouter::from_yaml_str(&yaml).await {
        Ok(_) => report!("started"),
        Err(e) => report!("refused {e}"),
    }
}

crate::worker_entry! {
    "twin" => twin_worker(),
    "looping-twin" => looping_twin_worker(),
    "waiting-twin" => waiting_twin_worker(),
    "tx-waiting-twin" => tx_waiting_twin_worker(),
    "staying-twin" => staying_twin_worker(),
}
