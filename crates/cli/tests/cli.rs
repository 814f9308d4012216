//! The `shardlock` command against real shards: migrate, status, inspect, demo, bench, and
//! the errors a user sees for bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;
use shardlock::mysql_async::prelude::Queryable;
use shardlock::{AcquireOptions, LockRouter};
use shardlock_testkit::Cluster;

fn shardlock(config: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_shardlock"))
        .arg("--config")
        .arg(config)
        .args(args)
        .env_remove("SHARDLOCK_CONFIG")
        .output()
        .expect("run shardlock")
}

fn json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

async fn cluster_with_config(n: usize) -> (Cluster, tempfile::TempDir, PathBuf) {
    let cluster = Cluster::start(n).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shardlock.yaml");
    std::fs::write(
        &path,
        cluster.config_yaml("namespaces:\n  stock:\n    ttl: 5s\n    wait: 5s\n"),
    )
    .unwrap();
    (cluster, dir, path)
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_status_and_inspect() {
    let (_cluster, _dir, config) = cluster_with_config(2).await;
    let first = json(&shardlock(&config, &["--json", "migrate"]));
    assert_eq!(
        first["shards"][0]["applied"],
        serde_json::json!([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13])
    );
    let again = json(&shardlock(&config, &["--json", "migrate"]));
    assert_eq!(
        again["shards"][1]["applied"],
        serde_json::json!([]),
        "idempotent"
    );

    let router = LockRouter::from_yaml_file(&config).await.unwrap();
    let guard = router
        .acquire("order:1001", AcquireOptions::new())
        .await
        .unwrap();

    let status = json(&shardlock(&config, &["--json", "status"]));
    let shards = status["shards"].as_array().unwrap();
    assert_eq!(shards.len(), 2);
    assert!(shards
        .iter()
        .all(|s| s["reachable"] == true && s["breaker"] == "closed"));
    let held: u64 = shards
        .iter()
        .map(|s| s["held_leases"].as_u64().unwrap())
        .sum();
    assert_eq!(held, 1);

    let inspect = json(&shardlock(&config, &["--json", "inspect", "order:1001"]));
    assert_eq!(inspect["shard"], guard.shard());
    assert_eq!(inspect["lease"]["held"], true);
    assert_eq!(inspect["lease"]["owner"], guard.owner());
    assert!(
        inspect["lease"]["fence"].as_u64().unwrap() >= guard.fence(),
        "the top of the grant's fences"
    );
    assert!(inspect["lease"]["expires_in_ms"].as_i64().unwrap() > 0);
    let text = shardlock(&config, &["inspect", "order:1001"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains(guard.owner()));

    // Data stored with the lease, and the list of leases.
    guard.set_data(b"refund 17").await.unwrap();
    let inspect = json(&shardlock(&config, &["--json", "inspect", "order:1001"]));
    assert_eq!(inspect["lease"]["data"], "refund 17");
    let other = router
        .acquire("invoice:7", AcquireOptions::new())
        .await
        .unwrap();
    other.release().await.unwrap();
    let listed = json(&shardlock(&config, &["--json", "list"]));
    let keys: Vec<&str> = listed["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    assert_eq!(keys, ["invoice:7", "order:1001"]);
    let held = json(&shardlock(
        &config,
        &["--json", "list", "--held", "--prefix", "order:"],
    ));
    assert_eq!(held["leases"].as_array().unwrap().len(), 1);
    assert_eq!(held["leases"][0]["owner"], guard.owner());
    assert_eq!(held["leases"][0]["data"], "refund 17");
    let text = shardlock(&config, &["list", "--held"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("order:1001") && text.contains("refund 17") && !text.contains("invoice:7"),
        "{text}"
    );

    guard.release().await.unwrap();
    let after = json(&shardlock(&config, &["--json", "inspect", "order:1001"]));
    assert_eq!(after["lease"]["held"], false);
    let never = json(&shardlock(&config, &["--json", "inspect", "never-used"]));
    assert!(never["lease"].is_null());
}

/// Usage errors are JSON with `--json` too; demo and bench, which write to the shards they
/// run on, take no deployment's config from the environment; `status --watch` draws no JSON.
#[test]
fn usage_errors_say_what_and_in_the_form_asked() {
    let run = |args: &[&str], config: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_shardlock"));
        command.args(args).env_remove("SHARDLOCK_CONFIG");
        if let Some(config) = config {
            command.env("SHARDLOCK_CONFIG", config);
        }
        command.output().unwrap()
    };
    let out = run(&["--json", "inspect"], None);
    assert_eq!(out.status.code(), Some(2));
    let err: Value = serde_json::from_slice(&out.stderr)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(err["error"]["kind"], "usage", "{err}");
    assert!(
        err["error"]["message"].as_str().unwrap().contains("<KEY>"),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("prod.yaml");
    std::fs::write(
        &config,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    for command in ["demo", "bench"] {
        let out = run(&[command], Some(config));
        assert_eq!(out.status.code(), Some(2), "{command}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("SHARDLOCK_CONFIG is set"), "{command}: {err}");
    }
    let out = run(&["--json", "status", "--watch"], Some(config));
    assert_eq!(out.status.code(), Some(2));
    let err: Value = serde_json::from_slice(&out.stderr).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("status --json"),
        "{err}"
    );
}

/// Output into a pipe its reader closed (`shardlock list | head -1`) ends the command quietly,
/// as SIGPIPE ends other tools, not with a panic.
#[tokio::test(flavor = "multi_thread")]
async fn output_into_a_closed_pipe_ends_quietly() {
    let (_cluster, _dir, config) = cluster_with_config(1).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_shardlock"))
        .arg("--config")
        .arg(&config)
        .args(["list"])
        .env_remove("SHARDLOCK_CONFIG")
        .stdout(writer)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(141), "{err}");
}

/// A shard whose tables are not migrated answers: `status` says so (reachable, with what to
/// run), and that its registry was not read (it said "unreachable", and "no instances
/// registered"); the command fails.
#[tokio::test(flavor = "multi_thread")]
async fn status_of_an_unmigrated_shard_says_to_migrate_it() {
    let (_cluster, _dir, config) = cluster_with_config(1).await;
    let out = shardlock(&config, &["--json", "status"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let status: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["shards"][0]["reachable"], true, "{status}");
    let error = status["shards"][0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("shardlock migrate"), "{status}");
    assert_eq!(status["registry_unread"][0]["shard"], "s1", "{status}");
    let text = shardlock(&config, &["status"]);
    let said = String::from_utf8_lossy(&text.stdout);
    assert!(said.contains("registry not read on s1"), "{said}");
}

/// A migrate that fails on one shard still migrates and reports the others, and fails.
#[tokio::test(flavor = "multi_thread")]
async fn a_migrate_with_a_shard_down_reports_every_shard() {
    let (cluster, _dir, config) = cluster_with_config(2).await;
    cluster.shard(1).kill().unwrap();
    let out = shardlock(&config, &["--json", "migrate"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["shards"][0]["shard"], "s1", "{report}");
    assert_eq!(report["shards"][0]["version"], 13, "{report}");
    assert_eq!(report["shards"][1]["shard"], "s2", "{report}");
    assert!(report["shards"][1]["error"].is_string(), "{report}");
}

#[tokio::test]
async fn bad_input_gets_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.yaml");
    let out = shardlock(&missing, &["status"]);
    assert_eq!(out.status.code(), Some(3), "a config error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("missing.yaml") && err.contains("cannot read"),
        "{err}"
    );

    // An operator command never guesses its deployment: no --config, no SHARDLOCK_CONFIG.
    let out = Command::new(env!("CARGO_BIN_EXE_shardlock"))
        .arg("status")
        .env_remove("SHARDLOCK_CONFIG")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--config") && err.contains("SHARDLOCK_CONFIG"),
        "{err}"
    );

    let broken = dir.path().join("broken.yaml");
    std::fs::write(
        &broken,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n    colour: blue\n",
    )
    .unwrap();
    let out = shardlock(&broken, &["status"]);
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        err.contains("broken.yaml:4:5") && err.contains("shards[0].colour"),
        "{err}"
    );
    // With --json the error is one JSON object on stderr.
    let out = shardlock(&broken, &["--json", "status"]);
    let err: Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(err["error"]["kind"], "config");
    assert_eq!(err["error"]["exit_code"], 3);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("broken.yaml:4:5"),
        "{err}"
    );

    let fine = dir.path().join("fine.yaml");
    std::fs::write(
        &fine,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n",
    )
    .unwrap();
    // A telemetry address the cleaner cannot listen on is a config error naming its field.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listening = dir.path().join("listening.yaml");
    std::fs::write(
        &listening,
        format!(
            "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\ntelemetry:\n  prometheus-listen: {}\n",
            taken.local_addr().unwrap()
        ),
    )
    .unwrap();
    let out = shardlock(&listening, &["cleaner", "--once"]);
    assert_eq!(out.status.code(), Some(3), "a config error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("telemetry.prometheus-listen"), "{err}");

    // Errors found only when the operator tool's router is built name the file too.
    let no_ca = dir.path().join("no-ca.yaml");
    std::fs::write(
        &no_ca,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\n    tls:\n      \
         mode: verify-ca\n      ca-file: /nonexistent/ca.pem\n",
    )
    .unwrap();
    let out = shardlock(&no_ca, &["status"]);
    assert_eq!(out.status.code(), Some(3), "a config error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no-ca.yaml:") && err.contains("shards[0].tls.ca-file"),
        "{err}"
    );
    let no_window = dir.path().join("no-window.yaml");
    std::fs::write(
        &no_window,
        "shards:\n  - name: s1\n    url: mysql://root@127.0.0.1:1/x\nrouting:\n  \
         move-window: 0s\n",
    )
    .unwrap();
    let out = shardlock(&no_window, &["migrate"]);
    assert_eq!(out.status.code(), Some(3), "a config error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("routing.move-window"), "{err}");
    let out = shardlock(&fine, &["inspect", "--namespace", "billing", "k"]);
    assert_eq!(out.status.code(), Some(2), "an unknown namespace");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("billing") && err.contains("namespace"),
        "{err}"
    );

    let out = shardlock(&fine, &["inspect", ""]);
    assert_eq!(out.status.code(), Some(2), "a bad key is a usage error");
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid lock key"));
    let out = shardlock(&fine, &["bench", "--rounds", "0"]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "clap rejects out-of-range arguments"
    );
    let out = shardlock(&fine, &["status"]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "an unreachable shard fails status"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("NO"));
    // Each part of an error's chain is printed once.
    let out = shardlock(&fine, &["inspect", "k"]);
    assert_eq!(out.status.code(), Some(4));
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let lines: Vec<&str> = err.lines().collect();
    assert!(
        lines[0].starts_with("error: shard `s1` is unavailable")
            && lines[1..].iter().all(|l| l.starts_with("  caused by: ")),
        "{err}"
    );
    for (i, line) in lines.iter().enumerate() {
        let text = line
            .trim_start_matches("error: ")
            .trim_start_matches("  caused by: ");
        for other in &lines[i + 1..] {
            assert!(!other.contains(text), "printed twice:\n{err}");
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn demo_sells_all_stock_and_oversells_nothing() {
    let (_cluster, _dir, config) = cluster_with_config(3).await;
    let out = shardlock(
        &config,
        &[
            "demo",
            "--skus",
            "6",
            "--stock",
            "40",
            "--processes",
            "2",
            "--buyers",
            "8",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("240 of 240 units sold"), "{stdout}");
    assert!(stdout.contains("nothing oversold"), "{stdout}");
}

/// `shardlock --json bench` with one round of 1 s and its report in `out_dir`, plus `args`:
/// the report.
fn short_bench(config: &Path, out_dir: &Path, args: &[&str]) -> Value {
    let out = out_dir.to_str().unwrap();
    let mut all = vec![
        "--json",
        "bench",
        "--duration",
        "1s",
        "--rounds",
        "1",
        "--out",
        out,
    ];
    all.extend_from_slice(args);
    json(&shardlock(config, &all))
}

#[tokio::test(flavor = "multi_thread")]
async fn bench_reports_statement_and_deadlock_counts() {
    let (_cluster, dir, config) = cluster_with_config(1).await;
    let out_dir = dir.path().join("bench");
    // One task: every acquire and release goes alone, so the count is exact (with more,
    // batches form and the count depends on timing).
    let report = short_bench(&config, &out_dir, &["--tasks", "1"]);
    assert!(out_dir.join("latest.json").exists());
    let picture = std::fs::read_to_string(out_dir.join("latest.svg")).unwrap();
    assert!(
        picture.starts_with("<svg")
            && picture.contains("Uncontended")
            && picture.contains("HotKey"),
        "a latency panel per scenario"
    );
    let comparisons = report["comparisons"].as_array().unwrap();
    let uncontended = &comparisons[0];
    assert_eq!(uncontended["scenario"], "uncontended");
    let per_cycle = uncontended["shardlock"]["statements_per_op"]
        .as_f64()
        .unwrap();
    // Counted server-wide: a few background statements (heartbeats) may join the cycles'
    // two each, however few cycles a loaded machine ran.
    let ops = uncontended["shardlock"]["ops"].as_f64().unwrap();
    let excess = (per_cycle - 2.0) * ops;
    assert!(
        ops > 0.0 && (-0.5..=10.5).contains(&excess),
        "two statements per lock cycle, got {per_cycle} over {ops} cycles"
    );
    // Linux tells how much of the machine's CPU time its host took during each round.
    for side in ["shardlock", "baseline"] {
        let steal = uncontended[side]["host_steal"].as_f64();
        assert!(
            steal.is_some_and(|s| (0.0..=1.0).contains(&s)),
            "{side}: the host's share of the round's CPU time, got {steal:?}"
        );
    }
    let hot = &comparisons[1];
    let ours = &hot["shardlock"];
    assert_eq!(ours["deadlock_errors_surfaced"], 0);
    assert_eq!(ours["innodb_deadlocks"], 0);
    assert!(ours["ops"].as_u64().unwrap() > 0);
    let (ours_stmts, naive_stmts) = (
        ours["statements_per_op"].as_f64().unwrap(),
        hot["baseline"]["statements_per_op"].as_f64().unwrap(),
    );
    assert!(
        ours_stmts < naive_stmts,
        "fewer statements per acquisition: {ours_stmts} vs {naive_stmts}"
    );
}

/// The shard-down scenario measures the healthy shards' keys of a service whose last shard
/// dies: every cycle of them completes, with no error, while the dead shard's keys are
/// refused by its breaker. (Its router once started with that shard unreachable, which, as a
/// router that cannot read every shard's registry grants nothing, measured 0 ops/s.)
#[tokio::test(flavor = "multi_thread")]
async fn bench_shard_down_serves_the_healthy_shards() {
    let (_cluster, dir, config) = cluster_with_config(2).await;
    let out_dir = dir.path().join("bench");
    let report = short_bench(
        &config,
        &out_dir,
        &["--scenario", "shard-down", "--tasks", "2"],
    );
    let down = &report["comparisons"][0];
    assert_eq!(down["scenario"], "shard-down", "{report}");
    for run in ["shardlock", "baseline"] {
        let m = &down[run];
        assert!(m["ops"].as_u64().unwrap() > 0, "{run}: {m}");
        assert_eq!(m["errors"], 0, "{run}: {m}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn release_force_cleaner_and_registered_instances() {
    let (_cluster, _dir, config) = cluster_with_config(2).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let yaml = std::fs::read_to_string(&config).unwrap();
    let router = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let guard = router
        .acquire("stuck:1", AcquireOptions::new())
        .await
        .unwrap();

    // The application's instance is registered; the command-line tools do not register.
    let status = json(&shardlock(&config, &["--json", "status"]));
    let instances = status["instances"].as_array().unwrap();
    assert!(
        instances
            .iter()
            .any(|i| i["instance"] == router.instance_id() && i["deregistered"] == false),
        "{status}"
    );
    assert_eq!(instances.len(), 1, "{status}");

    let refused = shardlock(&config, &["release", "stuck:1"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--force"));
    // Without --yes it asks; an empty answer (stdin closed) releases nothing.
    let unconfirmed = shardlock(&config, &["release", "--force", "stuck:1"]);
    assert_eq!(unconfirmed.status.code(), Some(5), "declined");
    assert!(guard.is_held());
    let released = json(&shardlock(
        &config,
        &["--json", "release", "--force", "--yes", "stuck:1"],
    ));
    assert_eq!(released["released"]["owner"], guard.owner());
    assert!(released["released"]["fence"].as_u64().unwrap() > guard.fence());
    tokio::time::timeout(std::time::Duration::from_secs(10), guard.lost())
        .await
        .expect("the evicted holder saw lost()");
    let nothing = json(&shardlock(
        &config,
        &["--json", "release", "--force", "--yes", "stuck:1"],
    ));
    assert!(nothing["released"].is_null());
    // A label as `list` shows a long key names no key: said so, beside "nobody held it".
    let label = shardlock(
        &config,
        &["release", "--force", "--yes", "#0123456789abcdef"],
    );
    assert_eq!(
        label.status.code(),
        Some(0),
        "a free key is released idempotently"
    );
    assert!(
        String::from_utf8_lossy(&label.stderr).contains("give the key itself"),
        "a key's label was taken for a key without a word"
    );

    let pass = json(&shardlock(&config, &["--json", "cleaner", "--once"]));
    assert_eq!(pass["leader"], true, "{pass}");
    assert_eq!(pass["shards"].as_array().unwrap().len(), 2);
    router.shutdown().await.unwrap();
    let status = json(&shardlock(&config, &["--json", "status"]));
    let me = status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["instance"] == router.instance_id())
        .cloned();
    assert_eq!(me.unwrap()["deregistered"], true, "shutdown deregisters");
}

/// `release --force` frees the key wherever the config reaches it held, not only on the shard
/// this config places it on: during a fleet's move, or run with a config older or newer than
/// the fleet's, the holder is elsewhere (it answered "nobody holds it" and left it held).
/// `inspect` says where it is held (it said "never granted on this shard" and no more). Both
/// say that the live fleet runs another topology than the config, and which shards they could
/// not look at (they said "nobody holds it", exit 0, with a holder perhaps there).
#[tokio::test(flavor = "multi_thread")]
async fn release_force_finds_the_holder_on_another_shard_than_its_config_places_the_key() {
    let (cluster, _dir, config) = cluster_with_config(2).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let yaml = std::fs::read_to_string(&config).unwrap();
    let tool = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let key = (0..)
        .map(|i| format!("moved:{i}"))
        .find(|k| tool.shard_for(k).unwrap() == "s1")
        .unwrap();
    tool.shutdown().await.unwrap();
    // The application runs a topology of s2 alone.
    let only_s2 = format!(
        "shards:\n  - name: s2\n    url: {}\n",
        cluster.shard(1).url()
    );
    let app = LockRouter::from_yaml_str(&only_s2).await.unwrap();
    let guard = app.acquire(&key, AcquireOptions::new()).await.unwrap();

    let seen = json(&shardlock(&config, &["--json", "inspect", &key]));
    assert_eq!(seen["shard"], "s1", "{seen}");
    let elsewhere = seen["held_elsewhere"].as_array().unwrap();
    assert_eq!(elsewhere.len(), 1, "{seen}");
    assert_eq!(elsewhere[0]["shard"], "s2", "{seen}");
    assert_eq!(elsewhere[0]["owner"], guard.owner(), "{seen}");
    // The application's topology is not the config's: said, naming it.
    let fleet = seen["doubts"]["fleet"].as_str().unwrap_or_default();
    assert!(fleet.contains(app.instance_id()), "{seen}");

    let released = json(&shardlock(
        &config,
        &["--json", "release", "--force", "--yes", &key],
    ));
    assert_eq!(released["shard"], "s1", "{released}");
    assert_eq!(released["released"]["shard"], "s2", "{released}");
    assert_eq!(released["released"]["owner"], guard.owner(), "{released}");
    tokio::time::timeout(std::time::Duration::from_secs(10), guard.lost())
        .await
        .expect("the evicted holder saw lost()");
    app.shutdown().await.unwrap();

    // A shard where the key does not live under this config does not answer: nobody is
    // found holding it, and the shard not looked at is said (its registry unread too).
    cluster.shard(1).kill().unwrap();
    let out = shardlock(&config, &["--json", "inspect", &key]);
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(seen["doubts"]["unread"][0]["shard"], "s2", "{seen}");
    let fleet = seen["doubts"]["fleet"].as_str().unwrap_or_default();
    assert!(fleet.contains("did not answer on shard s2"), "{seen}");
    let out = shardlock(&config, &["release", "--force", "--yes", &key]);
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{said}");
    assert!(said.contains("warning: shard s2 did not answer"), "{said}");
}

/// `shardlock --json cleaner` with `config`, and the first pass it reports (it led); the
/// passes after it are read and dropped (a pipe nobody reads would fill and stall it).
fn cleaner_daemon(config: &Path) -> (std::process::Child, Value) {
    use std::io::{BufRead, BufReader};
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_shardlock"))
        .arg("--config")
        .arg(config)
        .args(["--json", "cleaner"])
        .env_remove("SHARDLOCK_CONFIG")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(daemon.stdout.take().unwrap()).lines();
    let pass: Value = serde_json::from_str(&lines.next().unwrap().unwrap()).unwrap();
    assert_eq!(pass["leader"], true, "{pass}");
    std::thread::spawn(move || lines.for_each(drop));
    (daemon, pass)
}

/// Sends `signal` (`-TERM`, `-HUP`) to `child`.
fn signal(child: &std::process::Child, signal: &str) {
    let sent = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}

#[tokio::test(flavor = "multi_thread")]
async fn cleaner_daemon_stops_cleanly_on_sigterm() {
    let (_cluster, dir, config) = cluster_with_config(1).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    yaml.push_str("cleaner:\n  interval: 100ms\n");
    let fast = dir.path().join("fast.yaml");
    std::fs::write(&fast, yaml).unwrap();
    let (mut daemon, _) = cleaner_daemon(&fast);
    signal(&daemon, "-TERM");
    let status = daemon.wait().unwrap();
    assert!(status.success(), "exit after SIGTERM: {status}");
    // It gave up the cleaner lock and deregistered on the way out.
    let status = json(&shardlock(&config, &["--json", "status"]));
    assert!(status["instances"]
        .as_array()
        .unwrap()
        .iter()
        .all(|i| i["deregistered"] == true));
    assert!(status["shards"]
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["held_leases"] == 0));
}

/// A pass that could not run (the cleaner lock's shard down) is said where the passes' reports
/// go: a script reading the daemon's JSON saw nothing of it (the error went to the log only).
#[tokio::test(flavor = "multi_thread")]
async fn cleaner_daemon_reports_a_pass_that_could_not_run() {
    let (cluster, dir, config) = cluster_with_config(1).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let mut yaml = std::fs::read_to_string(&config).unwrap();
    yaml.push_str("cleaner:\n  interval: 100ms\n");
    let fast = dir.path().join("fast.yaml");
    std::fs::write(&fast, yaml).unwrap();
    let (mut daemon, passes) = daemon_read_apart(&fast, std::process::Stdio::null());
    let wait = std::time::Duration::from_secs(60);
    let first = passes.recv_timeout(wait).unwrap();
    assert_eq!(first["leader"], true, "{first}");
    cluster.shard(0).kill().unwrap();
    // Passes go on reporting the shard's error until the cleaner lock is lost; the next pass
    // cannot run.
    let failed = std::iter::from_fn(|| passes.recv_timeout(wait).ok())
        .take(500)
        .find(|pass| pass.get("pass_failed").is_some());
    daemon.kill().unwrap();
    let _ = daemon.wait();
    let failed = failed.expect("no pass reported as failed on stdout");
    assert!(failed["pass_failed"].is_string(), "{failed}");
}

/// A `shardlock --json cleaner` daemon on `config`, its stderr to `stderr`, and its stdout's
/// lines as they come: read apart, so that a daemon gone silent fails a test (a receive with
/// a timeout) rather than hanging it.
fn daemon_read_apart(
    config: &Path,
    stderr: std::process::Stdio,
) -> (std::process::Child, std::sync::mpsc::Receiver<Value>) {
    use std::io::{BufRead, BufReader};
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_shardlock"))
        .arg("--config")
        .arg(config)
        .args(["--json", "cleaner"])
        .env_remove("SHARDLOCK_CONFIG")
        .env_remove("SHARDLOCK_LOG")
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let (tx, lines) = std::sync::mpsc::channel::<Value>();
    let stdout = daemon.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if tx.send(serde_json::from_str(&line).unwrap()).is_err() {
                return;
            }
        }
    });
    (daemon, lines)
}

/// The first line of `lines` that has `field`, within a minute.
fn next_with(lines: &std::sync::mpsc::Receiver<Value>, field: &str) -> Option<Value> {
    let wait = std::time::Duration::from_secs(60);
    std::iter::from_fn(|| lines.recv_timeout(wait).ok())
        .take(1000)
        .find(|line| line.get(field).is_some())
}

/// What a SIGHUP did is said where the passes are reported: a reload that failed (the old
/// topology stays) was only in the log, and a script reading the daemon could not tell a
/// cleaner still on the fleet's old topology from one that took the new one.
#[tokio::test(flavor = "multi_thread")]
async fn cleaner_daemon_reports_each_reload() {
    let (_cluster, dir, config) = cluster_with_config(1).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let base = std::fs::read_to_string(&config).unwrap();
    let file = dir.path().join("cleaner.yaml");
    std::fs::write(&file, format!("{base}cleaner:\n  interval: 100ms\n")).unwrap();
    let (mut daemon, lines) = daemon_read_apart(&file, std::process::Stdio::null());
    next_with(&lines, "leader").expect("a first pass");

    std::fs::write(&file, "shards: [\n").unwrap();
    signal(&daemon, "-HUP");
    let failed = next_with(&lines, "reload_failed");
    let next = base.replace("namespaces:\n", "namespaces:\n  billing:\n    ttl: 5s\n");
    std::fs::write(&file, format!("{next}cleaner:\n  interval: 100ms\n")).unwrap();
    signal(&daemon, "-HUP");
    let reloaded = next_with(&lines, "reloaded");
    signal(&daemon, "-TERM");
    let status = daemon.wait().unwrap();
    let failed = failed.expect("a reload that failed was not reported on stdout");
    let why = failed["reload_failed"].as_str().unwrap();
    assert!(why.contains("cleaner.yaml"), "{failed}");
    let reloaded = reloaded.expect("a reload was not reported on stdout");
    assert_eq!(reloaded["reloaded"]["epoch"], 2, "{reloaded}");
    assert!(status.success(), "exit after SIGTERM: {status}");
}

/// A cleaner daemon whose instance id another process took over (it was frozen past its
/// heartbeat timeout) can never clean again: it exits, saying why. It logged a failed pass
/// every interval, for as long as it ran.
#[tokio::test(flavor = "multi_thread")]
async fn cleaner_daemon_whose_id_was_taken_over_exits_saying_so() {
    let (cluster, dir, config) = cluster_with_config(1).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let base = std::fs::read_to_string(&config).unwrap();
    let tail = "instance:\n  id: twin\ncleaner:\n  interval: 100ms\n  \
                heartbeat-interval: 100ms\n  heartbeat-timeout: 2s\n";
    let file = dir.path().join("cleaner.yaml");
    std::fs::write(&file, format!("{base}{tail}")).unwrap();
    let (mut daemon, lines) = daemon_read_apart(&file, std::process::Stdio::piped());
    // Read as it comes: a daemon that logs on must not block on a full pipe.
    let said = std::thread::spawn({
        let mut stderr = daemon.stderr.take().unwrap();
        move || {
            let mut said = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut said);
            said
        }
    });
    next_with(&lines, "leader").expect("a first pass");

    // Frozen, and counted dead: its heartbeat is old enough.
    signal(&daemon, "-STOP");
    (cluster.shard(0).connect().await.unwrap())
        .query_drop(
            "UPDATE shardlock_instance SET heartbeat_at = heartbeat_at - INTERVAL 60 SECOND \
             WHERE instance_id = 'twin'",
        )
        .await
        .unwrap();
    let twin = LockRouter::from_yaml_str(&format!("{base}{tail}"))
        .await
        .unwrap();
    twin.try_acquire("k", AcquireOptions::new())
        .await
        .unwrap()
        .expect("the twin grants")
        .release()
        .await
        .unwrap();
    signal(&daemon, "-CONT");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = daemon.try_wait().unwrap() {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            daemon.kill().unwrap();
            let _ = daemon.wait();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    twin.shutdown().await.unwrap();
    let status = status.expect("the replaced cleaner went on running");
    assert_eq!(status.code(), Some(1), "{status}");
    let said = said.join().unwrap();
    assert!(said.contains("took instance id `twin` over"), "{said}");
}

/// The cleaner daemon is an instance of its fleet like any service: when it never reloaded,
/// its old topology kept every process started with the fleet's new one from granting, for as
/// long as it ran. SIGHUP rereads its config file, as `reload_on_sighup` does for services.
#[tokio::test(flavor = "multi_thread")]
async fn cleaner_daemon_reloads_its_config_on_sighup() {
    let (_cluster, dir, config) = cluster_with_config(1).await;
    json(&shardlock(&config, &["--json", "migrate"]));
    let base = std::fs::read_to_string(&config).unwrap();
    let fast = "cleaner:\n  interval: 100ms\n  heartbeat-interval: 100ms\n\
                routing:\n  move-window: 500ms\n";
    // The fleet's next topology: one more namespace (its fingerprint changes, no key moves).
    let next = format!(
        "{}{fast}",
        base.replace("namespaces:\n", "namespaces:\n  billing:\n    ttl: 5s\n")
    );
    let file = dir.path().join("cleaner.yaml");
    std::fs::write(&file, format!("{base}{fast}")).unwrap();
    let (mut daemon, _) = cleaner_daemon(&file);

    // A service started with the next topology waits for the cleaner, which runs the old one.
    let service = LockRouter::from_yaml_str(&next).await.unwrap();
    match service.try_acquire("k", AcquireOptions::new()).await {
        Err(shardlock::Error::Unavailable { source, .. }) => {
            let why = shardlock::Report(&source).to_string();
            assert!(why.contains("runs topology"), "{why}");
        }
        other => panic!("granted beside a cleaner of another topology: {other:?}"),
    }
    std::fs::write(&file, &next).unwrap();
    signal(&daemon, "-HUP");
    let granted = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        loop {
            match service.try_acquire("k", AcquireOptions::new()).await {
                Err(shardlock::Error::Unavailable { .. }) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                other => break other.unwrap(),
            }
        }
    })
    .await
    .expect("the cleaner reloaded the fleet's topology on SIGHUP, so the service joined");
    granted.expect("nobody holds k").release().await.unwrap();
    service.shutdown().await.unwrap();
    assert!(
        daemon.try_wait().unwrap().is_none(),
        "SIGHUP ended the cleaner (the service joined once its heartbeat lapsed)"
    );
    signal(&daemon, "-TERM");
    let status = daemon.wait().unwrap();
    assert!(status.success(), "exit after SIGTERM: {status}");
}

/// `inspect` and `release --force` name a lock as the application takes it: in a namespace
/// with a key prefix (`--namespace`), and one bucket of a hot key (`--bucket`). Without them
/// they named a lock nobody holds, said so and exited 0, and a stuck bucket could not be
/// freed from the command line at all.
#[tokio::test(flavor = "multi_thread")]
async fn inspect_and_release_name_a_namespaces_lock_and_a_bucket() {
    let cluster = Cluster::start(1).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("shardlock.yaml");
    std::fs::write(
        &config,
        cluster.config_yaml(
            "namespaces:\n  billing:\n    key-prefix: billing/\n  hot:\n    buckets: 4\n",
        ),
    )
    .unwrap();
    json(&shardlock(&config, &["--json", "migrate"]));
    let yaml = std::fs::read_to_string(&config).unwrap();
    let app = LockRouter::from_yaml_str(&yaml).await.unwrap();
    let billing = AcquireOptions::new().namespace("billing");
    let order = app.acquire("order:1", billing).await.unwrap();
    let hot = AcquireOptions::new().namespace("hot");
    let bucket = app.acquire_bucket("sku:1", "buyer:7", hot).await.unwrap();
    let n = bucket.bucket().unwrap().to_string();

    let inspect = |args: &[&str]| {
        let mut all = vec!["--json", "inspect"];
        all.extend_from_slice(args);
        json(&shardlock(&config, &all))
    };
    // The key alone is another lock: nobody's.
    let plain = inspect(&["order:1"]);
    assert!(plain["lease"].is_null(), "{plain}");
    // The application's key in its namespace, or the lock's whole name as `list` shows it.
    let listed = json(&shardlock(&config, &["--json", "list", "--held"]));
    let names: Vec<&str> = (listed["leases"].as_array().unwrap().iter())
        .map(|l| l["key"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"billing/order:1"), "{listed}");
    for args in [
        &["--namespace", "billing", "order:1"][..],
        &["billing/order:1"],
    ] {
        let scoped = inspect(args);
        assert_eq!(scoped["key"], "billing/order:1", "{scoped}");
        assert_eq!(scoped["lease"]["held"], true, "{scoped}");
        assert_eq!(scoped["lease"]["owner"], order.owner(), "{scoped}");
    }
    let one = inspect(&["--namespace", "hot", "--bucket", &n, "sku:1"]);
    assert_eq!(one["key"], "sku:1", "{one}");
    assert_eq!(
        one["bucket"].as_u64(),
        bucket.bucket().map(u64::from),
        "{one}"
    );
    assert_eq!(one["lease"]["owner"], bucket.owner(), "{one}");

    for (args, guard) in [
        (vec!["--namespace", "billing", "order:1"], &order),
        (
            vec!["--namespace", "hot", "--bucket", n.as_str(), "sku:1"],
            &bucket,
        ),
    ] {
        let mut all = vec!["--json", "release", "--force", "--yes"];
        all.extend_from_slice(&args);
        let released = json(&shardlock(&config, &all));
        assert_eq!(released["released"]["owner"], guard.owner(), "{released}");
        tokio::time::timeout(std::time::Duration::from_secs(10), guard.lost())
            .await
            .expect("the evicted holder saw lost()");
    }
    app.shutdown().await.unwrap();
}

/// `cleaner --once` that could not clean a shard exits 4, as `list` does for a shard it could
/// not read: a cron job or a runbook step saw success (exit 0) and an error only in the report.
#[tokio::test(flavor = "multi_thread")]
async fn a_cleaner_pass_that_left_a_shard_uncleaned_fails() {
    let cluster = Cluster::start(1).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("shardlock.yaml");
    // s2 refuses connections; the cleaner lock (`shardlock:cleaner`) lives on s1.
    std::fs::write(
        &config,
        format!(
            "shards:\n  - name: s1\n    url: {}\n  - name: s2\n    url: \
             mysql://root@127.0.0.1:1/x\n    statement-timeout: 500ms\n    pool:\n      \
             create-timeout: 500ms\ncleaner:\n  registry: static\n",
            cluster.shard(0).url()
        ),
    )
    .unwrap();
    let setup = format!(
        "shards:\n  - name: s1\n    url: {}\n",
        cluster.shard(0).url()
    );
    let router = LockRouter::from_yaml_str(&setup).await.unwrap();
    router.migrate().await.unwrap();
    router.shutdown().await.unwrap();
    let out = shardlock(&config, &["--json", "cleaner", "--once"]);
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["leader"], true, "{report}");
    assert!(report["shards"][0]["error"].is_null(), "{report}");
    assert!(report["shards"][1]["error"].is_string(), "{report}");
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
