//! Shard credentials given apart from the URL: a user and a password file (a mounted secret)
//! holding characters that YAML or a URL would misread if pasted into the URL, read again for
//! every new connection so that a rotated secret takes effect without a reload.

mod common;

use std::time::Duration;

use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, Config, LockRouter};
use shardlock_testkit::Cluster;

#[tokio::test(flavor = "multi_thread")]
async fn a_shard_is_reached_with_a_user_and_a_password_file() {
    const PASSWORD: &str = "p@ss: #w/rd";
    let cluster = Cluster::start(1).await.unwrap();
    let mut root = cluster.shard(0).connect().await.unwrap();
    root.query_drop(format!("CREATE USER 'app'@'%' IDENTIFIED BY '{PASSWORD}'"))
        .await
        .unwrap();
    root.query_drop("GRANT ALL ON shardlock.* TO 'app'@'%'")
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("password");
    // As `echo` writes it: the newline is not part of the password.
    std::fs::write(&file, format!("{PASSWORD}\n")).unwrap();
    let url = cluster.shard(0).url().replace("root@", "");
    let yaml = |password_file: &str| {
        format!(
            "shards:\n  - name: s1\n    url: {url}\n    user: app\n    password-file: {password_file}\n\
             cleaner:\n  registry: static\n"
        )
    };
    let router = LockRouter::from_yaml_str(&yaml(&file.display().to_string()))
        .await
        .unwrap();
    router.migrate().await.unwrap();
    let guard = router
        .acquire("credentials", AcquireOptions::new())
        .await
        .unwrap();
    // The lease row was written as the user given, not the URL's (which names none).
    let users: Vec<String> = root
        .query("SELECT DISTINCT user FROM information_schema.processlist WHERE db = 'shardlock'")
        .await
        .unwrap();
    assert!(users.iter().any(|u| u == "app"), "{users:?}");
    guard.release().await.unwrap();

    // The secret rotates: a new password on the server and in the file. Connections opened
    // from now on read the file again; the open ones are cut here, as a server restart would.
    const ROTATED: &str = "n3w/p@ss";
    root.query_drop(format!("ALTER USER 'app'@'%' IDENTIFIED BY '{ROTATED}'"))
        .await
        .unwrap();
    std::fs::write(&file, format!("{ROTATED}\n")).unwrap();
    let open: Vec<u64> = root
        .query("SELECT id FROM information_schema.processlist WHERE user = 'app'")
        .await
        .unwrap();
    for id in open {
        let _ = root.query_drop(format!("KILL CONNECTION {id}")).await;
    }
    let guard = router
        .acquire("credentials", AcquireOptions::new())
        .await
        .expect("a new connection with the rotated password");
    guard.release().await.unwrap();
    // The application's own connection next to its locks, reached the same way.
    let config = router.config();
    let mut own =
        shardlock::mysql_async::Conn::new(shardlock::connect_opts(&config.shards[0], 0).unwrap())
            .await
            .expect("connect_opts reaches the shard with the user and the password file");
    let me: Option<String> = own.query_first("SELECT CURRENT_USER()").await.unwrap();
    assert_eq!(me.as_deref(), Some("app@%"));
    router.shutdown().await.unwrap();

    let e = LockRouter::from_yaml_str(&yaml("/nonexistent/password"))
        .await
        .unwrap_err();
    let message = e.to_string();
    assert!(
        message.contains("shards[0].password-file") && message.contains("/nonexistent/password"),
        "{message}"
    );
}

/// A reload that changes a shard's user (the old one to be dropped next) moves a hot key's
/// chain of hand-offs to the new settings: the old state's pool is closed while tasks of this
/// process keep taking the key from each other. Before, each release handed the lease to the
/// next waiter through the old state, which stayed open, under the old user, for good.
#[tokio::test(flavor = "multi_thread")]
async fn a_hot_keys_hand_offs_move_to_the_user_a_reload_gave_its_shard() {
    let cluster = Cluster::start(1).await.unwrap();
    let mut root = cluster.shard(0).connect().await.unwrap();
    for user in ["old_user", "new_user"] {
        root.query_drop(format!("CREATE USER '{user}'@'%'"))
            .await
            .unwrap();
        root.query_drop(format!("GRANT ALL ON shardlock.* TO '{user}'@'%'"))
            .await
            .unwrap();
    }
    let url = cluster.shard(0).url().replace("root@", "");
    let yaml = |user: &str| {
        format!(
            "shards:\n  - name: s1\n    url: {url}\n    user: {user}\n\
             routing:\n  move-window: 500ms\ncleaner:\n  registry: static\n"
        )
    };
    let router = LockRouter::from_yaml_str(&yaml("old_user")).await.unwrap();
    router.migrate().await.unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let (router, stop) = (router.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let guard = router.acquire("hot", AcquireOptions::new()).await?;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    guard.release().await?;
                }
                Ok::<_, shardlock::Error>(())
            })
        })
        .collect();
    let chained = common::eventually(Duration::from_secs(30), || async {
        router.stats().local_handoffs > 100
    })
    .await;
    assert!(chained, "the tasks hand the key over in memory");

    router
        .reload(Config::from_yaml_str(&yaml("new_user")).unwrap())
        .await
        .unwrap();
    let moved = common::eventually(Duration::from_secs(30), || async {
        let mut conn = cluster.shard(0).connect().await.unwrap();
        let old: Option<u64> = conn
            .query_first(
                "SELECT COUNT(*) FROM information_schema.processlist WHERE user = 'old_user'",
            )
            .await
            .unwrap();
        old == Some(0)
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap().expect("every lock cycle went through");
    }
    assert!(
        moved,
        "sessions of the user the reload replaced stay open (a hot key keeps its old pool)"
    );
}
