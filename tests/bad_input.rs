//! Bad input gets a clear error that says what and where, and changes nothing.

mod common;

use std::time::Duration;

use shardlock::{AcquireOptions, Error, LockRouter};

#[tokio::test(flavor = "multi_thread")]
async fn bad_keys_and_options_are_rejected_before_touching_a_shard() {
    let (cluster, router, _) = common::start(1, common::NO_HEARTBEAT).await;
    let before = common::dml_statements(cluster.shard(0)).await;

    let err = router.acquire("", AcquireOptions::new()).await.unwrap_err();
    assert!(matches!(err, Error::InvalidKey { .. }), "{err}");
    let err = router
        .acquire(&"k".repeat(2048), AcquireOptions::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidKey { .. }) && err.to_string().contains("2048"),
        "{err}"
    );
    let err = router
        .acquire("k", AcquireOptions::new().ttl(Duration::ZERO))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "ttl", .. }),
        "{err}"
    );
    let err = router
        .acquire("k", AcquireOptions::new().namespace("nope"))
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("`nope` is not configured"),
        "{err}"
    );
    assert!(matches!(
        router.shard_for(""),
        Err(Error::InvalidKey { .. })
    ));

    assert_eq!(
        common::dml_statements(cluster.shard(0)).await,
        before,
        "nothing was written"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wait_for_ever_is_a_wait_not_a_panic() {
    let (_cluster, router, _) = common::start(
        1,
        "namespaces:\n  stock:\n    buckets: 4\n    bucket-spill: true\n",
    )
    .await;
    let forever = AcquireOptions::new().wait(Duration::MAX);
    // A bucket, spilling, for ever.
    let bucket = forever.clone().namespace("stock");
    let spilled = router.acquire_bucket("sku", "h", bucket).await.unwrap();
    spilled.release().await.unwrap();
    let g = router.acquire("k", forever.clone()).await.unwrap();
    // A waiter behind it, for ever: granted when the holder lets go.
    let waiter = tokio::spawn({
        let router = router.clone();
        async move { router.acquire("k", forever).await.unwrap() }
    });
    let queued = common::eventually(Duration::from_secs(10), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued);
    g.release().await.unwrap();
    waiter.await.unwrap().release().await.unwrap();
    let tx = router
        .lock_in_transaction("k", Duration::MAX)
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    let err = router
        .acquire("k", AcquireOptions::new().ttl(Duration::MAX))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "ttl", .. }),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn unreachable_shard_is_named_and_others_keep_working() {
    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    // A port nobody listens on: bind, note the port, close.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let yaml = format!(
        "{}  - name: ghost\n    url: mysql://root@127.0.0.1:{dead}/shardlock\n    statement-timeout: 500ms\n    pool:\n      create-timeout: 300ms\n",
        cluster.config_yaml("")
    );
    // Without a registry to read (see the end for the heartbeat registry).
    let static_registry = "cleaner:\n  registry: static\n";
    let router = LockRouter::from_yaml_str(&format!("{yaml}{static_registry}"))
        .await
        .unwrap();
    let err = router.migrate().await.unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable { shard, .. } if shard == "ghost"),
        "{err}"
    );
    assert!(err.to_string().contains("ghost"), "{err}");

    // Find keys on each shard: the live one works, the dead one fails fast and by name.
    let on = |name: &str| common::key_on(&router, "key", name);
    let (live_key, dead_key) = (on("s1"), on("ghost"));
    shardlock::LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let g = router
        .acquire(&live_key, AcquireOptions::new())
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let err = router
        .acquire(
            &dead_key,
            AcquireOptions::new().wait(Duration::from_secs(5)),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Unavailable { shard, .. } if shard == "ghost"),
        "{err}"
    );
    eprintln!("unreachable shard reported after {:?}", started.elapsed());
    g.release().await.unwrap();

    // A router that cannot read the registry of one of its shards cannot tell which topology
    // the rest of its fleet runs: it grants nothing, and says why.
    let strict = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let err = strict
        .try_acquire(&live_key, AcquireOptions::new())
        .await
        .unwrap_err();
    let said = err.report().to_string();
    // Nor where its fleet last placed keys (its record there unread), whichever it says first.
    assert!(
        said.contains("ghost") && (said.contains("registry") || said.contains("placed keys")),
        "{said}"
    );
}

#[tokio::test]
async fn config_errors_name_file_line_column_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.yaml");
    std::fs::write(
        &path,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n  - name: [unclosed\n",
    )
    .unwrap();
    let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
    let Error::Config(e) = &err else {
        panic!("{err}")
    };
    assert_eq!(e.path.as_deref(), Some(path.as_path()));
    assert!(e.line.is_some() && e.column.is_some(), "{err}");
    assert!(
        err.to_string().starts_with(&path.display().to_string()),
        "{err}"
    );

    std::fs::write(&path, "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n    pool:\n      max-sise: 3\n").unwrap();
    let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
    let Error::Config(e) = &err else {
        panic!("{err}")
    };
    assert_eq!(
        (e.line, e.field.as_deref()),
        (Some(5), Some("shards[0].pool.max-sise")),
        "{err}"
    );
    assert!(e.message.contains("unknown field `max-sise`"), "{err}");

    std::fs::write(&path, "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\nnamespaces:\n  stock:\n    ttl: 0s\n").unwrap();
    let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(":6:5: field `namespaces.stock.ttl`"),
        "{err}"
    );

    std::fs::write(
        &path,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:notaport/x\n",
    )
    .unwrap();
    let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
    assert!(
        err.to_string().contains(":3:5: field `shards[0].url`"),
        "{err}"
    );

    // Breaker thresholds and failure policies are checked the same way.
    let shard = "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n";
    // A pool that could never connect, lend or reuse a connection is refused, not run.
    for timeout in ["wait-timeout", "create-timeout", "recycle-timeout"] {
        std::fs::write(&path, format!("{shard}    pool:\n      {timeout}: 0s\n")).unwrap();
        let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("field `shards[0].pool.{timeout}`")),
            "{err}"
        );
    }
    std::fs::write(&path, format!("{shard}breaker:\n  failure-rate: 1.5\n")).unwrap();
    let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(":5:3: field `breaker.failure-rate`"),
        "{err}"
    );
    std::fs::write(
        &path,
        format!("{shard}namespaces:\n  jobs:\n    on-shard-failure: reroute\n"),
    )
    .unwrap();
    let err = LockRouter::from_yaml_file(&path).await.unwrap_err();
    assert!(
        err.to_string().contains("namespaces.jobs.on-shard-failure")
            && err.to_string().contains("fail-fast"),
        "{err}"
    );
}

#[test]
fn reference_and_shipped_configs_parse() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    for file in ["reference.yaml", "local.yaml", "production.yaml"] {
        // production.yaml reads its password from the environment.
        std::env::set_var("SHARDLOCK_DB_PASSWORD", "example");
        let c =
            shardlock::Config::from_yaml_file(root.join(file)).unwrap_or_else(|e| panic!("{e}"));
        assert!(!c.shards.is_empty(), "{file}");
    }
}

/// A ttl passed with the call on a Galera shard must leave its lease alive locally past its
/// first renewal (a third of it) once the shard's clock margin and the clock drift allowed
/// are taken off: with a large drift, a ttl above twice the margin was taken, and every such
/// lease was lost before its first renewal. Refused before any shard is asked (the shard's
/// node here answers nothing).
#[tokio::test(flavor = "multi_thread")]
async fn a_ttl_a_galera_shard_and_the_clock_drift_would_end_before_its_renewal_is_refused() {
    let config = |drift: &str| {
        format!(
            "instance:\n  clock-drift: {drift}\nshards:\n  - name: g\n    \
             url: mysql://root@127.0.0.1:1/shardlock\n    nodes: [127.0.0.1:1]\n    \
             statement-timeout: 300ms\n    pool: {{ create-timeout: 300ms }}\n\
             cleaner:\n  registry: static\n  heartbeat-interval: 1s\n  heartbeat-timeout: 10s\n"
        )
    };
    // 1.5 s less 40 % and the margin (2 × 250 ms) is 0.4 s, before the renewal at 0.5 s.
    let router = LockRouter::from_yaml_str(&config("0.4")).await.unwrap();
    let short = AcquireOptions::new()
        .ttl(Duration::from_millis(1500))
        .wait(Duration::ZERO);
    let err = router.acquire("k", short.clone()).await.unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument { name: "ttl", .. }),
        "{err}"
    );
    router.shutdown().await.unwrap();
    // With 1 % the same ttl lasts 0.98 s: taken (the shard, which does not answer, is asked).
    let router = LockRouter::from_yaml_str(&config("0.01")).await.unwrap();
    let err = router.acquire("k", short).await.unwrap_err();
    assert!(!matches!(err, Error::InvalidArgument { .. }), "{err}");
    router.shutdown().await.unwrap();
}

/// Two shard entries that reach one server under two names (`127.0.0.1` and `localhost`),
/// which the config's check of its text cannot tell apart, are told apart by what the server
/// says it is: a reload onto them is refused (a move between them would take a lease's
/// companion row in its own row), and nothing of the refused topology stays in force.
#[tokio::test(flavor = "multi_thread")]
async fn a_reload_onto_two_names_for_one_server_is_refused() {
    let (cluster, router, _) = common::start(2, "").await;
    let url = cluster.shard(0).url();
    let alias = format!(
        "{}?prefer_socket=false",
        url.replace("127.0.0.1", "localhost")
    );
    let yaml = format!("shards:\n  - name: s1\n    url: {url}\n  - name: s2\n    url: {alias}\n");
    let config = shardlock::Config::from_yaml_str(&yaml).expect("the text names two servers");
    let epoch = router.epoch();
    let refused = router.reload(config).await;
    assert!(
        matches!(&refused, Err(Error::Config(e)) if e.to_string().contains("reach one database")),
        "a reload onto one database twice was not refused: {refused:?}"
    );
    assert_eq!(router.epoch(), epoch, "the refused topology was swapped in");
    let guard = router.acquire("k", AcquireOptions::new()).await.unwrap();
    guard.release().await.unwrap();
}

/// A reload by SIGHUP that the router refuses (past the file's parse: a changed instance id)
/// logs its error placed in the file, as a parse error is: the path, line and field. Before,
/// the log said `<config>` and no line.
#[tokio::test(flavor = "multi_thread")]
async fn a_sighup_reload_the_router_refuses_names_the_files_line() {
    use std::io::Write;
    use std::sync::{Arc, Mutex};
    /// Appends what the log writes to a buffer the test reads.
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let logs = Arc::new(Mutex::new(Vec::new()));
    let into = logs.clone();
    tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || Captured(into.clone()))
        .init();

    let cluster = shardlock_testkit::Cluster::start(1).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shardlock.yaml");
    let file = |id: &str| format!("instance:\n  id: {id}\n{}", cluster.config_yaml(""));
    std::fs::write(&path, file("one")).unwrap();
    let router = LockRouter::from_yaml_file(&path).await.unwrap();
    let _reloads = router.reload_on_sighup(&path).unwrap();
    std::fs::write(&path, file("two")).unwrap();
    nix::sys::signal::raise(nix::sys::signal::Signal::SIGHUP).unwrap();
    let text = || String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    let logged = common::eventually(Duration::from_secs(30), || async {
        text().contains("reload failed")
    })
    .await;
    assert!(logged, "no reload error was logged: {}", text());
    let placed = format!("{}:2:", path.display());
    assert!(
        text().contains(&placed) && text().contains("instance.id"),
        "the reload error does not name {placed} and its field: {}",
        text()
    );
    assert_eq!(
        router.instance_id(),
        "one",
        "the refused reload changed nothing"
    );
}
