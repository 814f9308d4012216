//! Batched acquires and releases on real shards: the batch statements against every kind of
//! row, the dispatcher forming batches under load without changing any answer, and callers
//! that give up while their key sits in a batch or keep their futures without polling them.

mod common;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Config, LockRouter};
use shardlock_mysql::{Attempt, GrantRequest, Shard, MAX_BATCH};

/// A backend for the cluster's first shard, as the router builds it.
fn backend(yaml: &str) -> Shard {
    let config = Config::from_yaml_str(yaml).unwrap();
    Shard::new(&config.shards[0], 0).unwrap()
}

/// What a key's row is before the batch.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Before {
    Fresh,
    Released,
    Expired,
    Held,
}

/// Every batch size from 1 to 40, and the largest ones, over keys whose rows are absent,
/// released, expired or held by someone else: the free ones are granted with a fence above
/// every earlier fence of the key (and the stored fence covers the reserve), the held ones are
/// answered `Held` and marked wanted; a batch release frees exactly the keys still ours.
#[tokio::test(flavor = "multi_thread")]
async fn batches_of_every_size_answer_each_key_as_a_single_acquire_would() {
    let (cluster, _router, yaml) = common::start(1, "").await;
    let shard = backend(&yaml);
    let mut raw = cluster.shards()[0].connect().await.unwrap();
    let sizes: Vec<usize> = (1..=40).chain([MAX_BATCH - 1, MAX_BATCH]).collect();
    for n in sizes {
        // Plain keys, and keys as stored for buckets (`0xFE` + number) and long keys (`0xFF` +
        // digest): bytes no UTF-8 text has, ordered as the primary key orders them.
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|i| {
                let mut key = format!("batch:{n}:{i}").into_bytes();
                match i % 3 {
                    1 => key.extend([0xFE, 0x01]),
                    2 => key.insert(0, 0xFF),
                    _ => {}
                }
                key
            })
            .collect();
        let before: Vec<Before> = (0..n)
            .map(|i| {
                [
                    Before::Fresh,
                    Before::Released,
                    Before::Expired,
                    Before::Held,
                ][i % 4]
            })
            .collect();
        // Earlier grants by someone else, so that fences have something to rise above.
        let mut earlier = Vec::new();
        for (key, b) in keys.iter().zip(&before) {
            if *b == Before::Fresh {
                earlier.push(0);
                continue;
            }
            let other = format!("other:{n}:{}", earlier.len());
            let Attempt::Granted { fence, .. } = shard
                .acquire(&common::grant_request(key, &other, 3))
                .await
                .unwrap()
            else {
                panic!("{key:?} should be free");
            };
            earlier.push(fence + 3);
            match b {
                Before::Released => {
                    assert!(shard.release(key, &other).await.unwrap().is_released())
                }
                Before::Expired => raw
                    .exec_drop(
                        "UPDATE shardlock_lease SET expires_at = NOW(3) - INTERVAL 1 SECOND \
                         WHERE lock_key = ?",
                        (key.as_slice(),),
                    )
                    .await
                    .unwrap(),
                _ => {}
            }
        }
        let reqs: Vec<GrantRequest> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| common::grant_request(key, &format!("mine:{n}:{i}"), (i % 3) as u32))
            .collect();
        let attempts = shard.acquire_batch(&reqs).await.unwrap().attempts;
        assert_eq!(attempts.len(), n);
        for (i, ((attempt, b), req)) in attempts.iter().zip(&before).zip(&reqs).enumerate() {
            let (stored_owner, stored_fence, wanted): (Option<Vec<u8>>, u64, bool) = raw
                .exec_first(
                    "SELECT owner, fence, wanted_at IS NOT NULL FROM shardlock_lease WHERE lock_key = ?",
                    (req.key.as_slice(),),
                )
                .await
                .unwrap()
                .unwrap();
            match (b, attempt) {
                (Before::Held, Attempt::Held { .. }) => {
                    assert_ne!(stored_owner.as_deref(), Some(req.owner.as_bytes()));
                    assert!(wanted, "size {n} key {i}: a held key is marked wanted");
                }
                (Before::Held, other) => panic!("size {n} key {i}: held, answered {other:?}"),
                (_, Attempt::Granted { fence, .. }) => {
                    assert!(
                        *fence > earlier[i],
                        "size {n} key {i} ({b:?}): fence {fence} after {}",
                        earlier[i]
                    );
                    assert_eq!(stored_owner.as_deref(), Some(req.owner.as_bytes()));
                    assert_eq!(stored_fence, fence + u64::from(req.reserve));
                    assert!(!wanted);
                }
                (b, other) => panic!("size {n} key {i}: {b:?}, answered {other:?}"),
            }
        }
        // A batch retried after a lost reply finds its own grants again.
        let again = shard.acquire_batch(&reqs).await.unwrap().attempts;
        for (first, second) in attempts.iter().zip(&again) {
            if let Attempt::Granted { .. } = first {
                assert!(matches!(second, Attempt::Granted { .. }), "{second:?}");
            }
        }
        let leases: Vec<(Vec<u8>, String)> = reqs
            .iter()
            .map(|r| (r.key.clone(), r.owner.clone()))
            .collect();
        let released = shard.release_batch(&leases).await.unwrap();
        for ((released, b), key) in released.iter().zip(&before).zip(&keys) {
            assert_eq!(
                released.is_released(),
                *b != Before::Held,
                "size {n}: {key:?} ({b:?}) released {released:?}"
            );
        }
        let live: Option<u64> = raw
            .exec_first(
                "SELECT COUNT(*) FROM shardlock_lease WHERE owner LIKE ?",
                (format!("mine:{n}:%"),),
            )
            .await
            .unwrap();
        assert_eq!(live, Some(0), "size {n}: nothing of ours left held");
    }
}

/// Many tasks of two routers (2 x 64) locking keys of one shard at once, half of them drawn
/// from 1,000 keys every task shares: batches form (counted), no key is ever held twice, no
/// error or deadlock reaches a caller, and every lease is gone at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_form_under_load_and_never_grant_a_key_twice() {
    let (cluster, a, yaml) = common::start(1, "").await;
    let b = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let holders: Arc<std::sync::Mutex<HashSet<String>>> = Arc::default();
    let deadlocks_before = common::status_sum(&cluster, "Innodb_deadlocks").await;
    let mut tasks = Vec::new();
    for (p, router) in [a.clone(), b.clone()].into_iter().enumerate() {
        for t in 0..64 {
            let (router, holders) = (router.clone(), holders.clone());
            tasks.push(tokio::spawn(async move {
                for i in 0..40 {
                    // Half the keys are shared by every task of both processes.
                    let key = if i % 2 == 0 {
                        format!("load:shared:{}", (t * 7 + i * 13) % 1000)
                    } else {
                        format!("load:own:{p}:{t}:{i}")
                    };
                    let guard = router
                        .acquire(&key, AcquireOptions::new().wait(Duration::from_secs(30)))
                        .await
                        .unwrap_or_else(|e| panic!("{key}: {e}"));
                    assert!(
                        holders.lock().unwrap().insert(key.clone()),
                        "{key} granted while held"
                    );
                    tokio::task::yield_now().await;
                    assert!(holders.lock().unwrap().remove(&key));
                    guard
                        .release()
                        .await
                        .unwrap_or_else(|e| panic!("{key}: {e}"));
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (sa, sb) = (a.stats(), b.stats());
    assert!(
        sa.acquire_batches + sb.acquire_batches > 0,
        "128 tasks on one shard formed no acquire batch: {sa:?}"
    );
    assert!(sa.batched_acquires >= 2 * sa.acquire_batches);
    assert_eq!(sa.lost + sb.lost, 0);
    // Deadlocks the server chose victims for were retried inside, never surfaced (every
    // acquire and release above succeeded); counted here for the record only.
    let deadlocks = common::status_sum(&cluster, "Innodb_deadlocks").await - deadlocks_before;
    eprintln!(
        "batches: {} acquire ({} keys), {} release ({} keys); server deadlocks {deadlocks}",
        sa.acquire_batches + sb.acquire_batches,
        sa.batched_acquires + sb.batched_acquires,
        sa.release_batches + sb.release_batches,
        sa.batched_releases + sb.batched_releases,
    );
    assert_eq!(common::live_leases(&cluster).await, 0);
}

/// Callers that give up at random moments while their key may sit in a batch: whatever they
/// were granted is given back, so no lease is left and every key can be taken again at once,
/// and no connection stays checked out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn callers_giving_up_while_in_a_batch_leave_no_lease() {
    let (cluster, router, _yaml) = common::start(1, "").await;
    let mut tasks = Vec::new();
    for t in 0..48u64 {
        let router = router.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..20u64 {
                let key = format!("cancel:{t}:{i}");
                // Dropped after 0 to 3 ms: before, while or after its batch is sent.
                let give_up = Duration::from_micros((t * 131 + i * 977) % 3000);
                let _ = tokio::time::timeout(give_up, router.acquire(&key, AcquireOptions::new()))
                    .await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(
        router.stats().acquire_batches > 0,
        "48 tasks on one shard formed no batch: nothing was cancelled inside one"
    );
    // Given back in the background: wait for the rows to be free, then take every key.
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            common::live_leases(&cluster).await == 0
        })
        .await,
        "leases left behind by callers that gave up"
    );
    for t in 0..48u64 {
        for i in 0..20u64 {
            let key = format!("cancel:{t}:{i}");
            let guard = router
                .try_acquire(&key, AcquireOptions::new())
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("{key} still held"));
            guard.release().await.unwrap();
        }
    }
    // Nor a connection: every one the pool opened is back in it.
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            let pool = router.status().await[0].pool;
            pool.available == pool.size
        })
        .await,
        "connections left checked out: {:?}",
        router.status().await[0].pool
    );
}

/// A router with one shard behind a proxy, sending acquires in one batch at a time.
async fn batching_behind_proxy(
    cluster: &shardlock_testkit::Cluster,
    statement_timeout: &str,
) -> (LockRouter, shardlock_testkit::Proxy) {
    let proxy = shardlock_testkit::Proxy::start(cluster.shard(0).port())
        .await
        .unwrap();
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n    statement-timeout: {statement_timeout}\n    \
         pool:\n      max-size: 4\n      batches-in-flight: 1\ncleaner:\n  registry: static\n",
        proxy.url()
    ))
    .await
    .unwrap();
    // Warm the pool, so that statements travel on open connections.
    let g = router.acquire("warm", AcquireOptions::new()).await.unwrap();
    g.release().await.unwrap();
    (router, proxy)
}

/// Asserts that `other` can take every key of `keys` at once (and lets it go again).
async fn every_key_is_free(other: &LockRouter, keys: &[String]) {
    for key in keys {
        let g = other
            .try_acquire(key, AcquireOptions::new())
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("{key} still held"));
        g.release().await.unwrap();
    }
}

/// Acquires `keys` at once from `router`, each within `wait`: the guards granted, and how many
/// callers got an error.
async fn acquire_all(
    router: &LockRouter,
    keys: &[String],
    wait: Duration,
) -> (Vec<shardlock::LockGuard>, usize) {
    let calls = keys.iter().map(|key| {
        let router = router.clone();
        let key = key.clone();
        async move {
            // Long enough that only a give-back frees a key within the test.
            let opts = AcquireOptions::new()
                .wait(wait)
                .ttl(Duration::from_secs(120));
            router.acquire(&key, opts).await
        }
    });
    let (mut guards, mut errors) = (Vec::new(), 0);
    for r in futures_util::future::join_all(calls).await {
        match r {
            Ok(g) => guards.push(g),
            Err(_) => errors += 1,
        }
    }
    (guards, errors)
}

/// A batch chosen as a deadlock's victim half way (it has locked its first rows and waits for
/// its last one, which a heavier transaction holds and which then asks for the first): the
/// server rolls the whole batch back, it is sent again, and every key is granted once the
/// competitor ends, with no error reaching the callers.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_chosen_as_a_deadlock_victim_half_way_is_retried_and_grants_every_key() {
    let (cluster, _router, yaml) = common::start(1, "").await;
    let (shard, server) = (backend(&yaml), cluster.shard(0));
    // Rows that exist (taken and released), so the batch's write locks each in key order.
    let keys: Vec<Vec<u8>> = (0..8).map(|i| format!("dl:{i}").into_bytes()).collect();
    for key in &keys {
        assert!(matches!(
            shard
                .acquire(&common::grant_request(key, "before", 0))
                .await
                .unwrap(),
            Attempt::Granted { .. }
        ));
        assert!(shard.release(key, "before").await.unwrap().is_released());
    }
    let mut competitor = shardlock_testkit::Competitor::begin(server, true)
        .await
        .unwrap();
    competitor.lock(&keys[7]).await.unwrap();
    let deadlocks = server.global_status("Innodb_deadlocks").await.unwrap();
    let reqs: Vec<GrantRequest> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| common::grant_request(key, &format!("dl-mine:{i}"), 1))
        .collect();
    let batch = {
        let reqs = reqs.clone();
        tokio::spawn(async move { shard.acquire_batch(&reqs).await })
    };
    // The batch has locked the first seven rows and waits for the last...
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            server.lock_waits_now().await.unwrap() > 0
        })
        .await,
        "the batch never waited for the competitor's row"
    );
    // ... and the competitor asking for the first closes the cycle. Having written more, it
    // is not the victim: the batch is rolled back, and sent again.
    competitor
        .lock(&keys[0])
        .await
        .expect("the server rolled back the competitor, not the batch");
    assert_eq!(
        server.global_status("Innodb_deadlocks").await.unwrap(),
        deadlocks + 1
    );
    competitor.end().await.unwrap();
    let grants = batch
        .await
        .unwrap()
        .expect("the deadlock reached the caller");
    let mut raw = server.connect().await.unwrap();
    for (req, attempt) in reqs.iter().zip(&grants.attempts) {
        let Attempt::Granted { fence, .. } = attempt else {
            panic!("{:?}: {attempt:?}", req.key);
        };
        let stored: Option<(Vec<u8>, u64)> = raw
            .exec_first(
                "SELECT owner, fence FROM shardlock_lease WHERE lock_key = ?",
                (req.key.as_slice(),),
            )
            .await
            .unwrap();
        assert_eq!(stored, Some((req.owner.clone().into_bytes(), fence + 1)));
    }
}

/// A row that another transaction keeps locked past the server's lock wait undoes the whole
/// batch it is in, and the server does not say which key waited: the batch's keys are sent
/// again one by one, so that the free ones are granted (not answered busy) and only the locked
/// key's caller is refused.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_locked_past_the_lock_wait_leaves_the_other_keys_of_its_batch_granted() {
    let (cluster, _migrated, _) = common::start(1, "").await;
    // The default statement timeout: a lock wait of 1 s, and each caller waits 2.05 s for
    // its answer, so the free keys must be answered before the locked one is (after a second
    // lock wait).
    let (router, _proxy) = batching_behind_proxy(&cluster, "2s").await;
    let server = cluster.shard(0);
    for key in ["lw:busy", "lw:locked"] {
        let g = router.acquire(key, AcquireOptions::new()).await.unwrap();
        g.release().await.unwrap();
    }
    let mut holds_busy = shardlock_testkit::Competitor::begin(server, false)
        .await
        .unwrap();
    holds_busy.lock(b"lw:busy").await.unwrap();
    let mut holds_locked = shardlock_testkit::Competitor::begin(server, false)
        .await
        .unwrap();
    holds_locked.lock(b"lw:locked").await.unwrap();
    let try_acquire = |key: String| {
        let router = router.clone();
        tokio::spawn(async move { router.try_acquire(&key, AcquireOptions::new()).await })
    };

    // The one runner waits on `lw:busy`'s row while the others queue behind it...
    let busy = try_acquire("lw:busy".into());
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            server.lock_waits_now().await.unwrap() > 0
        })
        .await,
        "the first acquire never waited"
    );
    let mut keys = vec!["lw:locked".to_owned()];
    keys.extend((0..4).map(|i| format!("lw:free:{i}")));
    let calls: Vec<_> = keys.iter().cloned().map(try_acquire).collect();
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            router.status().await[0].batch_waiting == keys.len()
        })
        .await,
        "the acquires never queued"
    );
    // ... and go as one batch once it is free, which waits on `lw:locked` and is undone.
    let batches = router.stats().acquire_batches;
    holds_busy.end().await.unwrap();
    busy.await
        .unwrap()
        .unwrap()
        .expect("free")
        .release()
        .await
        .unwrap();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    assert_eq!(router.stats().acquire_batches, batches + 1);
    assert!(
        !matches!(answers[0], Ok(Some(_))),
        "granted while another transaction held its row"
    );
    for (key, answer) in keys.iter().zip(answers).skip(1) {
        match answer {
            Ok(Some(guard)) => guard.release().await.unwrap(),
            other => panic!("{key}, free, was answered {other:?}"),
        }
    }
    holds_locked.end().await.unwrap();
}

/// A batch of fresh keys whose write's reply is lost (the server acted, the connection broke)
/// is retried on another connection and finds its own grants: every caller is granted its
/// key, and holds it on the shard under its own owner.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_write_reply_was_lost_is_retried_and_each_caller_holds_its_key() {
    // The write carries its keys as hex; nothing else sent carries these bytes.
    let marked: String = b"lost-once:MARKED"
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect();
    lose_one_batch_reply(Box::leak(marked.into_bytes().into_boxed_slice()), false).await;
}

/// The same when the batch's write found rows of its keys (earlier leases, released), so the
/// batch reads them back, and that read's reply is lost after the write committed.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_read_back_reply_was_lost_is_retried_and_each_caller_holds_its_key() {
    // The read-back carries its keys as they are; the write carries them as hex.
    lose_one_batch_reply(b"lost-once:MARKED", true).await;
}

/// Queues 32 acquires behind a first one waiting on a row lock, loses the reply to the
/// statement that carries `pattern`, and checks that every caller holds its key. With
/// `taken_before`, every key was taken and released first, so its row exists.
async fn lose_one_batch_reply(pattern: &'static [u8], taken_before: bool) {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    // A statement timeout (and so a server lock wait) far longer than the test: the first
    // acquire stays behind the row lock until it is committed, however busy the machine.
    let (router, proxy) = batching_behind_proxy(&cluster, "60s").await;
    // The first acquire waits behind a row lock held here, so the others queue behind it and
    // go together, as one batch, once it is answered.
    direct
        .acquire("lost-once:first", AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    let mut blocker = cluster.shard(0).connect().await.unwrap();
    blocker.query_drop("BEGIN").await.unwrap();
    blocker
        .query_drop("SELECT * FROM shardlock_lease WHERE lock_key = 'lost-once:first' FOR UPDATE")
        .await
        .unwrap();
    let mut keys: Vec<String> = (0..31).map(|i| format!("lost-once:{i}")).collect();
    keys.push("lost-once:MARKED".to_owned());
    if taken_before {
        let (guards, errors) = acquire_all(&direct, &keys, Duration::from_secs(10)).await;
        assert_eq!(errors, 0);
        for g in guards {
            g.release().await.unwrap();
        }
    }
    let first = {
        let router = router.clone();
        tokio::spawn(async move {
            router
                .acquire(
                    "lost-once:first",
                    AcquireOptions::new().wait(Duration::from_secs(60)),
                )
                .await
        })
    };
    // The first acquire's statement waits on the row lock before the others are asked for, so
    // that they queue behind it rather than go ahead of it. (Read from the server's live
    // counter: `information_schema.INNODB_TRX` is a snapshot that the server renews only after
    // 100 ms without readers, so polled faster it can show a wait that began later never.)
    let waited = common::eventually(Duration::from_secs(30), || async {
        cluster.shard(0).lock_waits_now().await.unwrap() > 0
    })
    .await;
    if !waited {
        // What the first acquire came to, and what the server's sessions were doing.
        let first = if first.is_finished() {
            format!(
                "{:?}",
                first
                    .await
                    .unwrap()
                    .map(|g| (g.owner().to_owned(), g.fence()))
            )
        } else {
            "still waiting".to_owned()
        };
        let mut admin = cluster.shard(0).connect().await.unwrap();
        let sessions: Vec<String> = admin
            .query(
                "SELECT CONCAT_WS(' | ', ID, COMMAND, TIME, STATE, LEFT(INFO, 120)) \
                 FROM information_schema.PROCESSLIST",
            )
            .await
            .unwrap();
        let row: Option<(Option<Vec<u8>>, u64)> = admin
            .query_first(
                "SELECT owner, fence FROM shardlock_lease WHERE lock_key = 'lost-once:first'",
            )
            .await
            .unwrap();
        panic!(
            "the first acquire never waited on the row lock: it answered {first}; its row \
             {row:?}; the router {:?}; the server's sessions {sessions:?}",
            router.status().await
        );
    }
    let rest = {
        let (router, keys) = (router.clone(), keys.clone());
        tokio::spawn(async move { acquire_all(&router, &keys, Duration::from_secs(60)).await })
    };
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            router.status().await[0].batch_waiting == keys.len()
        })
        .await,
        "the other acquires did not queue behind the first"
    );
    // The reply to the batch's statement carrying the marked key is lost.
    proxy.set(shardlock_testkit::ProxyMode::LoseReplyTo(pattern));
    blocker.query_drop("COMMIT").await.unwrap();
    let first = first.await.unwrap().unwrap();
    let (guards, errors) = rest.await.unwrap();
    assert_eq!(errors, 0);
    assert_eq!(guards.len(), keys.len());
    assert!(router.stats().acquire_batches > 0, "no batch was sent");
    assert_eq!(
        proxy.mode(),
        shardlock_testkit::ProxyMode::Pass,
        "the batch's reply was not lost"
    );
    for g in &guards {
        let (_, row) = direct.inspect(g.key()).await.unwrap();
        let row = row.unwrap();
        assert_eq!(row.owner.as_deref(), Some(g.owner()), "{}", g.key());
        assert!(row.fence >= g.fence());
    }
    for g in guards.into_iter().chain([first]) {
        g.release().await.unwrap();
    }
    assert_eq!(common::live_leases(&cluster).await, 0);
}

/// A batch whose write committed but whose reply was lost is sent again; if that retry waits
/// out a row lock (another transaction took one of its rows meanwhile), the server undoes the
/// retry alone: the first try's rows stay. Callers that gave up by then are not asked again,
/// so those rows are given back: no key stays held by nobody for its ttl.
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_batch_reply_whose_retry_waits_out_a_row_lock_leaves_no_key_held_by_nobody() {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    // A server lock wait of 2 s, and 1.4 s more for the retry to get through the blackhole
    // (while the test locks a row).
    let (router, proxy) = batching_behind_proxy(&cluster, "3400ms").await;
    let mut keys: Vec<String> = (0..31).map(|i| format!("lost-retry:{i}")).collect();
    keys.push("lost-retry:MARKED".to_owned());
    let marked: String = b"lost-retry:MARKED"
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect();
    // Opened now: between the lost reply and the end of the blackhole, the test only locks
    // the row (the retry's statement timeout runs meanwhile).
    let mut blocker = cluster.shard(0).connect().await.unwrap();
    proxy.set(shardlock_testkit::ProxyMode::LoseReplyToThenBlackhole(
        Box::leak(marked.into_bytes().into_boxed_slice()),
    ));
    let callers = {
        let (router, keys) = (router.clone(), keys.clone());
        tokio::spawn(async move { acquire_all(&router, &keys, Duration::from_millis(200)).await })
    };
    let lost = tokio::time::timeout(
        Duration::from_secs(30),
        proxy.wait_for(shardlock_testkit::ProxyMode::Blackhole),
    )
    .await;
    assert!(lost.is_ok(), "no batch carried the marked key");
    // The marked key's row, written by the batch whose reply was lost, is locked here while
    // the retry waits in the blackhole.
    blocker.query_drop("BEGIN").await.unwrap();
    let row: Option<u8> = blocker
        .query_first(
            "SELECT 1 FROM shardlock_lease WHERE lock_key = 'lost-retry:MARKED' FOR UPDATE",
        )
        .await
        .unwrap();
    proxy.set(shardlock_testkit::ProxyMode::Pass);
    assert_eq!(row, Some(1), "the batch's write did not commit");
    // The retry waits on the row until the server's lock wait ends (1205): every key is
    // answered `Locked`, after a lost try, and given back; the callers gave up long before
    // (200 ms). Every key but the locked one is free then. (On a busy machine the retry may time out first instead: its
    // keys' outcomes are unknown and given back, which frees them too.)
    let all_but_one = common::eventually(Duration::from_secs(30), || async {
        common::live_leases(&cluster).await <= 1
    })
    .await;
    let (guards, _) = callers.await.unwrap();
    assert!(guards.is_empty(), "granted while the retry was blackholed");
    assert!(
        all_but_one,
        "keys of callers that gave up stayed held: {} live leases; the router {:?}",
        common::live_leases(&cluster).await,
        router.stats()
    );
    blocker.query_drop("ROLLBACK").await.unwrap();
    let freed = common::eventually(Duration::from_secs(30), || async {
        common::live_leases(&cluster).await == 0
    })
    .await;
    assert!(
        freed,
        "keys of callers that gave up stayed held: {} live leases; the router {:?}",
        common::live_leases(&cluster).await,
        router.stats()
    );
    every_key_is_free(&direct, &keys).await;
}

/// Batches whose replies are all lost for a while: every caller is answered (an error, since
/// it cannot know), and each key it may have been granted is given back once the link carries
/// replies again: nothing stays held, every key can be taken by another process at once.
#[tokio::test(flavor = "multi_thread")]
async fn batches_whose_replies_are_lost_leave_no_key_held_by_nobody() {
    let (cluster, direct, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let (router, proxy) = batching_behind_proxy(&cluster, "2s").await;
    let keys: Vec<String> = (0..32).map(|i| format!("lost-all:{i}")).collect();
    proxy.set(shardlock_testkit::ProxyMode::LoseReplies);
    let (guards, errors) = acquire_all(&router, &keys, Duration::from_millis(300)).await;
    assert!(guards.is_empty(), "granted without a reply");
    assert_eq!(errors, keys.len());
    proxy.set(shardlock_testkit::ProxyMode::Pass);
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            common::live_leases(&cluster).await == 0
        })
        .await,
        "keys granted with their replies lost were not given back: the router {:?}",
        router.status().await
    );
    every_key_is_free(&direct, &keys).await;
}

/// Acquire and release futures that were polled once and then kept without being polled (a
/// `select!` loop that took another branch, a stream not driven for a while) stall no other
/// caller of the shard: their statements are sent by the dispatcher's own tasks, so the lane
/// places and connections they took are given back as the statements end, not when the
/// callers look again. More such futures are kept than the lanes' steady runners (extra
/// runners start only while 8 requests queue).
#[tokio::test(flavor = "multi_thread")]
async fn futures_kept_without_polling_stall_no_other_caller() {
    use futures_util::FutureExt;
    let (cluster, router, _yaml) = common::start(1, "").await;
    // A future can be answered within its first poll: the thread may pause between sending
    // and reading, and find the reply there. Such a future is not kept (it is finished, and
    // another made) until four are pending.
    let mut acquires = Vec::new();
    let mut made = 0;
    while acquires.len() < 4 {
        assert!(made < 100, "no acquire stayed pending after its first poll");
        let (router, key) = (router.clone(), format!("kept:{made}"));
        made += 1;
        let mut acquire =
            Box::pin(async move { router.acquire(&key, AcquireOptions::new()).await });
        match (&mut acquire).now_or_never() {
            None => acquires.push(acquire),
            Some(answer) => answer.unwrap().release().await.unwrap(),
        }
    }
    let mut releases = Vec::new();
    let mut made = 0;
    while releases.len() < 4 {
        assert!(made < 100, "no release stayed pending after its first poll");
        let guard = router
            .acquire(&format!("kept-release:{made}"), AcquireOptions::new())
            .await
            .unwrap();
        made += 1;
        let mut release = Box::pin(guard.release());
        match (&mut release).now_or_never() {
            None => releases.push(release),
            Some(answer) => answer.unwrap(),
        }
    }
    let others = router.clone();
    let cycles = tokio::spawn(async move {
        common::lock_cycles(&others, "other", 50, AcquireOptions::new()).await
    });
    // Not a timing threshold: a stalled shard never finishes.
    tokio::time::timeout(Duration::from_secs(60), cycles)
        .await
        .expect("50 lock cycles stalled behind futures nobody polled")
        .unwrap();
    for acquire in acquires {
        acquire.await.unwrap().release().await.unwrap();
    }
    for release in releases {
        release.await.unwrap();
    }
    assert_eq!(common::live_leases(&cluster).await, 0);
}

/// The futures of a lock cycle stay small. Every layer above a statement (breaker, dispatcher
/// runner, acquire, release) holds the one below it, and a future is copied whole each time
/// it is moved — into a task, a box, an `instrument` wrapper. Inline in the pool checkout,
/// the driver's connect and reset futures made each statement's future 7 KiB and an
/// acquire's 17 KiB, and copying them cost a tenth of a lock cycle's client CPU. An acquire's
/// future also carried its shard-polling phase, which a caller handed the lease in memory
/// never reaches (5.2 KiB of this test's acquire future, boxed 1.5 KiB; copying it was a tenth
/// of a hand-off's instructions); that phase is boxed. Bounded
/// here: a shard's statement futures (what the dispatcher's runners and the breaker hold) and
/// the router's acquire futures. A count, not a timing: sizes as this build lays them out
/// (debug builds are the larger; a new compiler may move them a little).
#[tokio::test(flavor = "multi_thread")]
async fn the_futures_of_a_lock_cycle_stay_small() {
    let (_cluster, router, yaml) = common::start(1, "").await;
    let shard = backend(&yaml);
    let req = common::grant_request(b"small", "owner", 0);
    let statement = [
        (
            "a shard's acquire",
            std::mem::size_of_val(&shard.acquire(&req)),
        ),
        (
            "a shard's batch acquire",
            std::mem::size_of_val(&shard.acquire_batch(std::slice::from_ref(&req))),
        ),
        (
            "a shard's release",
            std::mem::size_of_val(&shard.release(b"small", "owner")),
        ),
    ];
    for (what, size) in statement {
        assert!(size <= 3 * 1024, "{what}'s future is {size} bytes");
    }
    let calls = [
        (
            "acquire",
            std::mem::size_of_val(&router.acquire("small", AcquireOptions::new())),
        ),
        (
            "try_acquire",
            std::mem::size_of_val(&router.try_acquire("small", AcquireOptions::new())),
        ),
    ];
    for (what, size) in calls {
        assert!(size <= 3 * 1024, "{what}'s future is {size} bytes");
    }
}

/// A batch that failed before anything was sent (no connection could be made) wrote nothing:
/// its callers are told so, and nothing is given back. Every such failure counted as maybe
/// written, and each key's give-back was retried against its never-written row until the
/// lease's ttl, beside the renewals, for every batch of a refusing shard.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_that_could_not_connect_gives_nothing_back() {
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    common::migrate_only(&cluster.config_yaml("")).await;
    let proxy = shardlock_testkit::Proxy::start(cluster.shard(0).port())
        .await
        .unwrap();
    // Refused from the start: the pool has no connection open to be cut mid-statement.
    proxy.set(shardlock_testkit::ProxyMode::Reset);
    let router = LockRouter::from_yaml_str(&format!(
        "shards:\n  - name: s1\n    url: {}\n    pool:\n      batches-in-flight: 1\n\
         breaker:\n  consecutive-failures: 100000\n  min-calls: 100000\n\
         cleaner:\n  registry: static\nnamespaces:\n  default:\n    ttl: 120s\n",
        proxy.url()
    ))
    .await
    .unwrap();
    let tries: Vec<_> = (0..64)
        .map(|i| {
            let router = router.clone();
            tokio::spawn(async move {
                let once = AcquireOptions::new().wait(Duration::ZERO);
                router.try_acquire(&format!("refused:{i}"), once).await
            })
        })
        .collect();
    for t in tries {
        let answer = t.await.unwrap();
        assert!(answer.is_err(), "{answer:?}");
    }
    let stats = router.stats();
    assert!(stats.acquire_batches > 0, "no batch formed: {stats:?}");
    proxy.set(shardlock_testkit::ProxyMode::Pass);
    // Each give-back would be answered "not held" until the lease's ttl, two minutes.
    let settled = common::eventually(Duration::from_secs(60), || async {
        router.stats().settling == 0
    })
    .await;
    assert!(
        settled,
        "batches that sent nothing left give-backs: {:?}",
        router.stats()
    );
}

/// A batch whose write committed and whose read-back then failed with a server's error (here
/// the server's limit on prepared statements, 1461, met by the read-back, then by the retry's
/// write on a new connection) says its outcome is unknown: its rows are granted, to owners
/// whose callers are told of a failure, and must be given back. It read as a failure that
/// wrote nothing, and the rows stayed taken until their ttl.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_read_back_failed_after_its_write_says_it_may_have_written() {
    let (cluster, _router, yaml) = common::start(1, "").await;
    // One connection, which the statements below are prepared on.
    let yaml = yaml.replacen("    url:", "    pool: { max-size: 1 }\n    url:", 1);
    let shard = backend(&yaml);
    // The write's statement prepared on the connection (a batch of two fresh keys).
    let warm: Vec<_> = [b"warm:a", b"warm:b"]
        .iter()
        .map(|k| common::grant_request(*k, "warm", 0))
        .collect();
    shard.acquire_batch(&warm).await.unwrap();
    // Rows there already (released), so that a batch of three reads its grants back, by a
    // statement of another shape (four keys) than any prepared yet.
    let keys: [&[u8]; 3] = [b"readback:a", b"readback:b", b"readback:c"];
    for key in keys {
        shard
            .acquire(&common::grant_request(key, "earlier", 0))
            .await
            .unwrap();
        shard.release(key, "earlier").await.unwrap();
    }

    let mut admin = cluster.shard(0).connect().await.unwrap();
    // No statement prepared from here on; those prepared stay (the write's among them).
    admin
        .query_drop("SET GLOBAL max_prepared_stmt_count = 0")
        .await
        .unwrap();
    let batch: Vec<_> = keys
        .iter()
        .map(|k| common::grant_request(k, "refused", 0))
        .collect();
    let answer = shard.acquire_batch(&batch).await;
    admin
        .query_drop("SET GLOBAL max_prepared_stmt_count = DEFAULT")
        .await
        .unwrap();
    let e = answer.expect_err("the read-back was refused");
    assert_eq!(e.code, Some(1461), "{e}");
    let owners: Vec<Option<String>> = admin
        .query("SELECT owner FROM shardlock_lease WHERE lock_key LIKE 'readback:%'")
        .await
        .unwrap();
    assert_eq!(
        owners,
        vec![Some("refused".to_owned()); 3],
        "the write committed"
    );
    assert!(
        e.maybe_applied,
        "a batch whose write committed answered as one that wrote nothing: {e}"
    );
}

/// A batch release that frees one lease while another of its leases had been lost before
/// (expired, and taken by another process a second ago) answers that one "not held", even
/// when the row it freed is taken by a waiter before it reads the rows back: a holder
/// granted before the statement's millisecond held the row before it. It answered "taken
/// since", which the caller reads as released while its lease may not have ended, and the
/// lost lease's holder was never told it had lost the key.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_release_tells_a_lease_lost_before_it_from_a_row_it_freed_and_that_was_taken_since()
{
    let (cluster, _router, _) = common::start(1, "cleaner:\n  registry: static\n").await;
    let proxy = shardlock_testkit::Proxy::start(cluster.shard(0).port())
        .await
        .unwrap();
    let direct = common::backend_at(&cluster.shard(0).url());
    let behind = common::backend_at(&proxy.url());
    let request = |key: &str, owner: &str| common::grant_request(key.as_bytes(), owner, 0);
    for (key, owner) in [("freed", "mine-1"), ("lost", "mine-2")] {
        let granted = behind.acquire(&request(key, owner)).await.unwrap();
        assert!(matches!(granted, Attempt::Granted { .. }), "{granted:?}");
    }
    // `lost` ended and another process took it, a second ago.
    let mut raw = cluster.shard(0).connect().await.unwrap();
    raw.query_drop(
        "UPDATE shardlock_lease SET expires_at = NOW(3) - INTERVAL 1 SECOND \
         WHERE lock_key = 'lost'",
    )
    .await
    .unwrap();
    let taken = direct.acquire(&request("lost", "other")).await.unwrap();
    assert!(matches!(taken, Attempt::Granted { .. }), "{taken:?}");
    raw.query_drop(
        "UPDATE shardlock_lease SET acquired_at = acquired_at - INTERVAL 1 SECOND \
         WHERE lock_key = 'lost'",
    )
    .await
    .unwrap();

    // The read-back waits while a waiter takes the row the release freed.
    proxy.set(shardlock_testkit::ProxyMode::PauseTo(
        b"SELECT lock_key, owner, CAST(UNIX_TIMESTAMP(acquired_at)",
    ));
    let releasing = tokio::spawn(async move {
        let leases = [("freed", "mine-1"), ("lost", "mine-2")]
            .map(|(k, o)| (k.as_bytes().to_vec(), o.to_owned()));
        behind.release_batch(&leases).await
    });
    proxy.wait_for(shardlock_testkit::ProxyMode::Paused).await;
    let waiter = direct.acquire(&request("freed", "waiter")).await.unwrap();
    assert!(matches!(waiter, Attempt::Granted { .. }), "{waiter:?}");
    proxy.set(shardlock_testkit::ProxyMode::Pass);
    let answers = releasing.await.unwrap().unwrap();
    assert_eq!(
        answers[1],
        shardlock_mysql::ReleaseAnswer::NotHeld,
        "a lease lost before the release was answered as one it may have freed: {answers:?}"
    );
    assert_eq!(
        answers[0],
        shardlock_mysql::ReleaseAnswer::TakenAfterLostReply,
        "{answers:?}"
    );
}
