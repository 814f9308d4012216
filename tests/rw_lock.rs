//! Read/write locks across processes on real shards: readers and writers of 2 processes on a
//! read-modify-write counter. No writer overlaps any other holder (a history of holds), a
//! reader never sees the counter change under it, no write is lost, and readers do share.

mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::history::{self, Recorder};
use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Error, LockRouter};
use shardlock_testkit::Worker;

const NAME: &str = "rw:catalog";
const READERS: u32 = 8;
const TASKS: usize = 8;
const ROUNDS: usize = 6;
/// Every fourth task writes.
const WRITERS: usize = TASKS / 4;
const DIR_ENV: &str = "SHARDLOCK_TEST_HISTORY_DIR";
const APP_ENV: &str = "SHARDLOCK_TEST_APP_URL";

#[tokio::test(flavor = "multi_thread")]
async fn writers_exclude_everyone_and_readers_share() {
    let (cluster, router, yaml) = common::start(2, "").await;
    let app_url = cluster.shard(0).url();
    let mut app = common::app_conn(
        &app_url,
        &[
            "CREATE TABLE rw_counter (id INT PRIMARY KEY, n BIGINT NOT NULL)",
            "INSERT INTO rw_counter VALUES (1, 0)",
        ],
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let env = [
        (common::CONFIG_ENV, yaml),
        (DIR_ENV, dir.path().display().to_string()),
        (APP_ENV, app_url),
    ];
    let workers: Vec<Worker> = (0..2)
        .map(|_| Worker::spawn("worker", "rw", &env).unwrap())
        .collect();
    for w in workers {
        w.finish_report("done").await.unwrap();
    }
    let n: u64 = app
        .query_first("SELECT n FROM rw_counter WHERE id = 1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(n, (2 * WRITERS * ROUNDS) as u64, "no write lost");

    let holds = history::read(dir.path());
    let (writes, reads): (Vec<_>, Vec<_>) = holds.iter().partition(|h| h.key == "rw:W");
    assert_eq!(writes.len(), 2 * WRITERS * ROUNDS);
    for w in &writes {
        for other in &holds {
            if std::ptr::eq(*w, other) {
                continue;
            }
            assert!(
                other.end <= w.start || w.end <= other.start,
                "a writer overlapped another holder: {w:?} and {other:?}"
            );
        }
    }
    // Writers' fences rise in the order they held the lock.
    history::check_no_two_holders(&writes.iter().map(|h| (*h).clone()).collect::<Vec<_>>());
    let shared = reads.iter().enumerate().any(|(i, a)| {
        reads[i + 1..]
            .iter()
            .any(|b| a.start < b.end && b.start < a.end)
    });
    println!(
        "{} reads, {} writes; readers overlapped: {shared}",
        reads.len(),
        writes.len()
    );

    for bad in [0, 1025] {
        assert!(matches!(
            router.rw_lock(NAME, bad),
            Err(Error::InvalidArgument {
                name: "readers",
                ..
            })
        ));
    }
    // A writer waits for the readers inside, and turns new readers away meanwhile.
    // Three slots, two taken: a reader gets in until a writer waits.
    let lock = router.rw_lock("rw:small", 3).unwrap();
    let r1 = lock.read(AcquireOptions::new()).await.unwrap();
    let r2 = lock.read(AcquireOptions::new()).await.unwrap();
    let quick = AcquireOptions::new().wait(Duration::from_millis(100));
    assert!(matches!(
        lock.write(quick.clone()).await,
        Err(Error::Timeout { .. })
    ));
    let writer = {
        let lock = lock.clone();
        tokio::spawn(async move { lock.write(AcquireOptions::new()).await })
    };
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            matches!(lock.read(quick.clone()).await, Err(Error::Timeout { .. }))
        })
        .await,
        "a waiting writer turns readers away"
    );
    r1.release().await.unwrap();
    r2.release().await.unwrap();
    let w = writer.await.unwrap().unwrap();
    assert!(w.is_held());
    w.release().await.unwrap();
    lock.read(AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

/// A write hold is handed out only with every part still its own: the intent and the first
/// slot may end while a later slot is waited for (here their ttl runs out, as a pause past it
/// would end them), and a reader come in on that slot meanwhile.
#[tokio::test(flavor = "multi_thread")]
async fn a_write_hold_whose_first_parts_ended_while_it_waited_is_not_handed_out_beside_a_reader() {
    // Its reader slots are the buckets of its name: `pair` reaches the second one.
    let pair = "namespaces:\n  pair:\n    buckets: 2\n";
    let (cluster, other, _) = common::start(1, pair).await;
    let router = LockRouter::from_yaml_str(&cluster.config_yaml(pair))
        .await
        .unwrap();
    let hint = (0..)
        .map(|i| format!("user:{i}"))
        .find(|h| shardlock_core::bucket_for(h.as_bytes(), 2) == 1)
        .unwrap();
    let slot_1 = other
        .acquire_bucket("rw:parts", &hint, AcquireOptions::new().namespace("pair"))
        .await
        .unwrap();
    assert_eq!(slot_1.bucket(), Some(1));
    let writing = {
        let lock = router.rw_lock("rw:parts", 2).unwrap();
        let opts = AcquireOptions::new()
            .lock_at_most(Duration::from_secs(1))
            .wait(Duration::from_secs(60));
        tokio::spawn(async move { lock.write(opts).await })
    };
    // It took the intent and slot 0, and waits for slot 1; those two end, and a reader of
    // another process comes in on slot 0 (no writer's intent in its way).
    let took_first = common::eventually(Duration::from_secs(60), || async {
        router.stats().grants >= 2
    })
    .await;
    assert!(
        took_first,
        "the writer never took its intent and first slot"
    );
    let reading = (other.rw_lock("rw:parts", 2).unwrap())
        .read(AcquireOptions::new().wait(Duration::from_secs(60)))
        .await
        .unwrap();
    // Slot 1 freed, the writer takes it, finds its first parts ended, gives all back and
    // takes the intent again: its fourth grant. It waits for slot 0 while the reader reads.
    slot_1.release().await.unwrap();
    let again = common::eventually(Duration::from_secs(60), || async {
        router.stats().grants >= 4 || writing.is_finished()
    })
    .await;
    assert!(
        again,
        "the writer neither finished nor took its parts again"
    );
    assert!(
        !writing.is_finished(),
        "a write hold was handed out beside a reader: {:?}",
        writing.await.unwrap().map(|w| w.is_held())
    );
    reading.release().await.unwrap();
    let written = writing.await.unwrap();
    assert!(written.is_ok(), "{:?}", written.map(|w| w.is_held()));
}

/// TASKS tasks, every fourth a writer: a writer adds one to the counter (read, pause, write),
/// a reader reads it twice with a pause between and must see one value.
async fn rw_worker() {
    let router = common::worker_router().await;
    let dir = PathBuf::from(std::env::var(DIR_ENV).unwrap());
    let app_url = std::env::var(APP_ENV).unwrap();
    let recorder = Arc::new(Recorder::create(&dir));
    let lock = router.rw_lock(NAME, READERS).unwrap();
    let opts = AcquireOptions::new().wait(Duration::from_secs(120));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (lock, recorder, opts) = (lock.clone(), recorder.clone(), opts.clone());
        let mut app = common::app_conn(&app_url, &[]).await;
        tasks.push(tokio::spawn(async move {
            let read = "SELECT n FROM rw_counter WHERE id = 1";
            for _ in 0..ROUNDS {
                if t % 4 == 0 {
                    let w = lock.write(opts.clone()).await.unwrap();
                    let start = history::now_ns();
                    let n: u64 = app.query_first(read).await.unwrap().unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    app.exec_drop("UPDATE rw_counter SET n = ? WHERE id = 1", (n + 1,))
                        .await
                        .unwrap();
                    let end = history::now_ns();
                    assert!(w.is_held(), "a write hold lost mid-write");
                    recorder.hold("rw:W", true, start, end, w.fence());
                    w.release().await.unwrap();
                } else {
                    let r = lock.read(opts.clone()).await.unwrap();
                    let start = history::now_ns();
                    let first: u64 = app.query_first(read).await.unwrap().unwrap();
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    let second: u64 = app.query_first(read).await.unwrap().unwrap();
                    let end = history::now_ns();
                    assert!(r.is_held(), "a read hold lost mid-read");
                    assert_eq!(first, second, "written under a reader");
                    recorder.hold("rw:R", true, start, end, 0);
                    r.release().await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    shardlock_testkit::report!("done");
    router.shutdown().await.unwrap();
}

crate::worker_entry! { "rw" => rw_worker() }
