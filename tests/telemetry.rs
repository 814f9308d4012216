//! Telemetry against real shards: the Prometheus endpoint of `telemetry::init` serves every
//! metric the ops/ dashboard uses, with counts that match a known workload, for the routers
//! built with its meter provider and no other (nothing is installed globally), and hot-key
//! detection names the key that takes half the waits.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use shardlock::telemetry::TelemetryGuard;
use shardlock::{AcquireOptions, Config, LockRouter};
use shardlock_testkit::Cluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The default telemetry config, changed by `set`.
fn telemetry_config(
    set: impl FnOnce(&mut shardlock::config::TelemetryConfig),
) -> shardlock::config::TelemetryConfig {
    let mut config = shardlock::config::TelemetryConfig::default();
    set(&mut config);
    config
}

/// A router on `cluster` whose metrics go to `telemetry`'s meter provider.
async fn metered_router(cluster: &Cluster, extra: &str, telemetry: &TelemetryGuard) -> LockRouter {
    let config = Config::from_yaml_str(&cluster.config_yaml(extra)).unwrap();
    let router = LockRouter::builder(config)
        .meter_provider(telemetry.meter_provider())
        .build()
        .await
        .unwrap();
    router.migrate().await.unwrap();
    router
}

/// `GET /metrics` from `addr`, the body.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nhost: test\r\n\r\n")
        .await
        .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap()
}

/// The value of the sample of `metric` whose labels include every `label="value"` of `with`
/// (summed over the samples that match).
fn sample(text: &str, metric: &str, with: &[&str]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{metric}{{")) || l.starts_with(&format!("{metric} ")))
        .filter(|l| with.iter().all(|w| l.contains(w)))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Every query of the Grafana dashboard, as written (template variables and all).
fn dashboard_queries() -> Vec<String> {
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/grafana/shardlock.json"
    ))
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    json["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|panel| panel["targets"].as_array().unwrap())
        .map(|target| target["expr"].as_str().unwrap().to_owned())
        .collect()
}

/// Every `shardlock_…` metric the dashboard queries (a name its selector follows; label
/// names, `shardlock_shard` say, are followed by `=` or a `,`).
fn dashboard_metrics() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for expr in dashboard_queries() {
        let mut rest = expr.as_str();
        while let Some(at) = rest.find("shardlock_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            if rest.starts_with('{') {
                names.insert(name);
            }
        }
    }
    names
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_endpoint_serves_every_dashboard_metric_with_exact_counts() {
    let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
        c.prometheus_listen = Some("127.0.0.1:0".into());
    }))
    .await
    .unwrap();
    let addr = telemetry.prometheus_addr().unwrap();
    let extra = "namespaces:\n  orders:\n    ttl: 5s\ncleaner:\n  grace: 100ms\n";
    let cluster = Cluster::start(2).await.unwrap();
    let router = metered_router(&cluster, extra, &telemetry).await;
    // Built without the provider: it records nothing there, whatever it does. The same
    // config: two routers of one fleet on two topologies would wait for each other.
    let unmetered = LockRouter::from_yaml_str(&cluster.config_yaml(extra))
        .await
        .unwrap();
    unmetered
        .acquire("unmetered", AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    // A known workload: 50 grants, then 3 tries of a key that is held.
    let opts = AcquireOptions::new().namespace("orders");
    common::lock_cycles(&router, "o", 50, opts.clone()).await;
    let held = router.acquire("busy", opts.clone()).await.unwrap();
    let other = metered_router(&cluster, extra, &telemetry).await;
    for _ in 0..3 {
        assert!(other
            .try_acquire("busy", AcquireOptions::new())
            .await
            .unwrap()
            .is_none());
    }
    held.release().await.unwrap();
    // Rows released more than a second ago (the fence margin) are the cleaner's.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let cleaned = router.clean_once().await.unwrap();
    assert!(cleaned.deleted() >= 50, "{cleaned:?}");

    let text = scrape(addr).await;
    let unmetered = format!("shardlock_instance=\"{}\"", unmetered.instance_id());
    assert!(
        !text.contains(&unmetered),
        "a router built without the provider reported there:\n{text}"
    );
    let count = "shardlock_acquire_duration_seconds_count";
    assert_eq!(
        sample(
            &text,
            count,
            &[
                "shardlock_namespace=\"orders\"",
                "shardlock_outcome=\"granted\""
            ]
        ),
        51.0
    );
    assert_eq!(
        sample(&text, count, &["shardlock_outcome=\"timeout\""]),
        3.0
    );
    assert_eq!(
        sample(&text, count, &["shardlock_outcome=\"unavailable\""]),
        0.0
    );
    assert_eq!(
        sample(
            &text,
            "shardlock_hold_duration_seconds_count",
            &["shardlock_mode=\"remote\""]
        ),
        51.0,
        "every released hold is timed (the cleaner still holds its election lock)"
    );
    assert_eq!(
        sample(
            &text,
            "shardlock_cleaner_deleted_total",
            &["shardlock_reason=\"released\""]
        ),
        cleaned.deleted() as f64
    );
    for shard in ["s1", "s2"] {
        let shard = format!("shardlock_shard=\"{shard}\"");
        let ours = format!("shardlock_instance=\"{}\"", router.instance_id());
        let breaker = |with: &[&str]| {
            let with = [&[shard.as_str(), ours.as_str()], with].concat();
            sample(&text, "shardlock_breaker_state", &with)
        };
        assert_eq!(breaker(&["shardlock_state=\"closed\""]), 1.0);
        assert_eq!(breaker(&[]), 1.0, "one state at a time");
        assert!(sample(&text, "shardlock_pool_connections_max", &[&shard, &ours]) > 0.0);
    }
    let missing: Vec<String> = dashboard_metrics()
        .into_iter()
        .filter(|m| {
            !text
                .lines()
                .any(|l| !l.starts_with('#') && l.starts_with(m.as_str()))
        })
        .collect();
    // The hot-key gauge only has samples once a key made someone wait.
    assert_eq!(
        missing,
        vec!["shardlock_hot_key_wait_seconds".to_owned()],
        "dashboard metrics the endpoint does not serve:\n{text}"
    );
    drop(other);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_key_with_half_the_waits_is_reported_hottest() {
    let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
        c.prometheus_listen = Some("127.0.0.1:0".into());
    }))
    .await
    .unwrap();
    let extra = "telemetry:\n  record-keys: true\n";
    let cluster = Cluster::start(1).await.unwrap();
    let router = metered_router(&cluster, extra, &telemetry).await;
    // Eight tasks take turns on `hot`; sixteen tasks share four other keys four by four: the
    // hot key's waits are about half of all (each waiter waits for the others in line).
    let run = |key: String, router: LockRouter| async move {
        for _ in 0..200 {
            let g = router.acquire(&key, AcquireOptions::new()).await.unwrap();
            tokio::time::sleep(Duration::from_micros(300)).await;
            g.release().await.unwrap();
        }
    };
    let mut tasks = Vec::new();
    for _ in 0..8 {
        tasks.push(tokio::spawn(run("hot".into(), router.clone())));
    }
    for i in 0..16 {
        tasks.push(tokio::spawn(run(format!("warm:{}", i / 4), router.clone())));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let top = router.hot_keys(3);
    let total: Duration = router.hot_keys(100).iter().map(|(_, w)| *w).sum();
    let share = top[0].1.as_secs_f64() / total.as_secs_f64();
    eprintln!(
        "hottest {top:?} of {total:?} waited in all ({:.0}%)",
        share * 100.0
    );
    assert_eq!(top[0].0, "hot", "{top:?}");
    assert!(
        (0.35..=0.70).contains(&share),
        "the workload should give the hot key about half the waits, gave {share:.2}"
    );
    let text = scrape(telemetry.prometheus_addr().unwrap()).await;
    let hottest = text
        .lines()
        .filter(|l| l.starts_with("shardlock_hot_key_wait_seconds{"))
        .max_by(|a, b| {
            let value = |l: &str| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
            value(a).total_cmp(&value(b))
        })
        .unwrap_or_else(|| panic!("no hot-key sample:\n{text}"));
    assert!(hottest.contains("shardlock_key=\"hot\""), "{hottest}");
}

/// What a loopback OTLP/HTTP collector received: the JSON body of every POST to
/// `/v1/traces` and to `/v1/metrics`, and how many TLS handshakes it saw fail.
#[derive(Debug, Clone, Default)]
struct Collected {
    traces: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    metrics: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
    failed_handshakes: std::sync::Arc<tokio::sync::watch::Sender<usize>>,
}

/// A loopback OTLP/HTTP collector, speaking https through `tls` when given.
async fn otlp_collector(
    tls: Option<tokio_rustls::TlsAcceptor>,
) -> (std::net::SocketAddr, Collected) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collected = Collected::default();
    let keep = collected.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (keep, tls) = (keep.clone(), tls.clone());
            tokio::spawn(async move {
                match tls {
                    None => answer_otlp(stream, keep).await,
                    Some(tls) => match tls.accept(stream).await {
                        Ok(stream) => answer_otlp(stream, keep).await,
                        Err(_) => keep.failed_handshakes.send_modify(|n| *n += 1),
                    },
                }
            });
        }
    });
    (addr, collected)
}

/// Reads one request from `stream`, keeps its body, answers 200.
async fn answer_otlp(
    mut stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    keep: Collected,
) {
    // Read the head, then as many body bytes as content-length says.
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let (head_end, length) = loop {
        let n = stream.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..at]).to_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse::<usize>().unwrap());
            break (at + 4, length);
        }
    };
    while buf.len() < head_end + length {
        let n = stream.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let body = || serde_json::from_slice(&buf[head_end..head_end + length]).unwrap();
    if head.starts_with("POST /v1/traces") {
        keep.traces.lock().unwrap().push(body());
    } else if head.starts_with("POST /v1/metrics") {
        keep.metrics.lock().unwrap().push(body());
    }
    let _ = stream
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        )
        .await;
    let _ = stream.shutdown().await;
}

/// A loopback OTLP/HTTP receiver: keeps the JSON body of every POST to `/v1/traces`.
async fn otlp_receiver() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
) {
    let (addr, collected) = otlp_collector(None).await;
    (addr, collected.traces)
}

/// Every span of every OTLP/JSON body received.
fn received_spans(received: &std::sync::Mutex<Vec<serde_json::Value>>) -> Vec<serde_json::Value> {
    let list =
        |v: &serde_json::Value, field: &str| v[field].as_array().cloned().unwrap_or_default();
    received
        .lock()
        .unwrap()
        .iter()
        .flat_map(|body| list(body, "resourceSpans"))
        .flat_map(|rs| list(&rs, "scopeSpans"))
        .flat_map(|ss| list(&ss, "spans"))
        .collect()
}

/// Spans exported over OTLP to a loopback receiver (what it received), through the `tracing`
/// layer of the telemetry `init` made, installed as this test process's subscriber.
async fn traced_to_otlp(
    record_keys: bool,
) -> (
    TelemetryGuard,
    std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
) {
    use tracing_subscriber::prelude::*;
    let (addr, received) = otlp_receiver().await;
    let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
        c.otlp_endpoint = Some(format!("http://{addr}"));
        c.record_keys = record_keys;
    }))
    .await
    .unwrap();
    tracing_subscriber::registry()
        .with(telemetry.layer())
        .init();
    (telemetry, received)
}

/// An attribute of an OTLP/JSON span, as text.
fn attribute(span: &serde_json::Value, key: &str) -> Option<String> {
    span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)
        .map(|a| {
            let v = &a["value"];
            v.get("stringValue")
                .or_else(|| v.get("intValue"))
                .or_else(|| v.get("doubleValue"))
                .map(|x| x.to_string().trim_matches('"').to_owned())
                .unwrap_or_default()
        })
}

#[tokio::test(flavor = "multi_thread")]
async fn otlp_exports_the_waiters_acquire_span_with_a_link_to_the_holder() {
    let (telemetry, received) = traced_to_otlp(true).await;
    let (_cluster, router, _yaml) = common::start(1, "telemetry:\n  record-keys: true\n").await;

    let holder = router
        .acquire("account:7", AcquireOptions::new())
        .await
        .unwrap();
    let holder_fence = holder.fence();
    let waiter = {
        let router = router.clone();
        tokio::spawn(async move {
            let guard = router
                .acquire("account:7", AcquireOptions::new())
                .await
                .unwrap();
            let fence = guard.fence();
            guard.release().await.unwrap();
            fence
        })
    };
    let queued = common::eventually(Duration::from_secs(10), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the second task never waited");
    // Held on: the waiter waits this long at least.
    tokio::time::sleep(Duration::from_millis(150)).await;
    holder.release().await.unwrap(); // handed to the waiter in memory
    let waiter_fence = waiter.await.unwrap();
    assert!(waiter_fence > holder_fence);
    router.shutdown().await.unwrap();
    telemetry.shutdown();

    let spans: Vec<serde_json::Value> = received_spans(&received).into_iter().collect();
    let hold = spans
        .iter()
        .find(|s| {
            s["name"] == "shardlock.hold"
                && attribute(s, "shardlock.fence").as_deref()
                    == Some(holder_fence.to_string().as_str())
        })
        .unwrap_or_else(|| panic!("no hold span of the holder in {spans:#?}"));
    let acquires: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| {
            s["name"] == "shardlock.acquire"
                && attribute(s, "shardlock.key").as_deref() == Some("account:7")
        })
        .collect();
    assert_eq!(acquires.len(), 2, "{acquires:#?}");
    let waited = acquires
        .iter()
        .find(|s| s["links"].as_array().is_some_and(|l| !l.is_empty()))
        .unwrap_or_else(|| panic!("no acquire span with a link: {acquires:#?}"));
    let link = &waited["links"][0];
    assert_eq!(
        link["spanId"], hold["spanId"],
        "the link names the holder's hold span"
    );
    assert_eq!(link["traceId"], hold["traceId"]);
    assert_eq!(
        attribute(waited, "shardlock.outcome").as_deref(),
        Some("granted")
    );
    assert_eq!(
        attribute(waited, "shardlock.mode").as_deref(),
        Some("remote")
    );
    assert_eq!(attribute(waited, "shardlock.shard").as_deref(), Some("s1"));
    let wait_ms: f64 = attribute(waited, "shardlock.wait_ms")
        .unwrap()
        .parse()
        .unwrap();
    assert!(wait_ms >= 150.0, "waited {wait_ms} ms behind the holder");
    // Queued in memory behind the holder: it never polled the shard.
    assert_eq!(
        attribute(waited, "shardlock.attempts").as_deref(),
        Some("0")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_elsewhere_links_to_the_holders_trace_stored_with_the_lease() {
    let (telemetry, received) = traced_to_otlp(false).await;
    let extra = "telemetry:\n  record-keys: true\n";
    let (cluster, holder_router, _yaml) = common::start(1, extra).await;
    // Another instance: it shares no memory with the holder, only the lease row.
    let waiter_router = LockRouter::from_yaml_str(&cluster.config_yaml(extra))
        .await
        .unwrap();

    let holder = holder_router
        .acquire("acct:9", AcquireOptions::new())
        .await
        .unwrap();
    let polled = waiter_router.clone();
    let waiter = tokio::spawn(async move {
        let g = waiter_router
            .acquire("acct:9", AcquireOptions::new())
            .await
            .unwrap();
        g.release().await.unwrap();
        waiter_router.shutdown().await.unwrap();
    });
    // Released once the waiter found the key held, so that its grant is a later attempt.
    let refused = common::eventually(Duration::from_secs(10), || async {
        polled.stats().acquire_statements >= 1
    })
    .await;
    assert!(refused, "the waiter never polled the shard");
    holder.release().await.unwrap();
    waiter.await.unwrap();
    holder_router.shutdown().await.unwrap();
    telemetry.shutdown();

    let spans: Vec<serde_json::Value> = received_spans(&received)
        .into_iter()
        .filter(|s| {
            s["name"] == "shardlock.acquire"
                && attribute(s, "shardlock.key").as_deref() == Some("acct:9")
        })
        .collect();
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let attempts = |s: &serde_json::Value| {
        attribute(s, "shardlock.attempts")
            .unwrap()
            .parse::<u32>()
            .unwrap()
    };
    let first = spans
        .iter()
        .find(|s| attempts(s) == 1)
        .expect("the holder's acquire");
    let waited = spans
        .iter()
        .find(|s| attempts(s) > 1)
        .expect("the waiter's acquire");
    let link = &waited["links"][0];
    assert_eq!(link["traceId"], first["traceId"], "{waited:#?}");
    assert_eq!(link["spanId"], first["spanId"]);
    assert_eq!(
        attribute(waited, "shardlock.outcome").as_deref(),
        Some("granted")
    );
}

/// `GET path` from `addr` over HTTP/1.0 (the server closes the connection after the answer,
/// with no chunked body): the status code and the body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nhost: test\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// `text` percent-encoded for a URL's query.
fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus' answer to an instant `query`: its result (a vector of series).
async fn prometheus_query(addr: std::net::SocketAddr, query: &str) -> Vec<serde_json::Value> {
    let path = format!("/api/v1/query?query={}", url_encode(query));
    let (status, body) = http_get(addr, &path).await.unwrap();
    let answer: serde_json::Value = serde_json::from_str(&body)
        .unwrap_or_else(|e| panic!("{query}: {e}: HTTP {status}: {body}"));
    assert_eq!(answer["status"], "success", "{query}: {answer}");
    answer["data"]["result"].as_array().unwrap().clone()
}

/// A Prometheus server on a free loopback port, scraping as `config` says, killed on drop.
struct Prometheus {
    addr: std::net::SocketAddr,
    _process: tokio::process::Child,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(config: &str) -> Prometheus {
        let binary = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .expect(
                "the Prometheus server (Debian package `prometheus`; the test command installs it)",
            );
        let dir = tempfile::tempdir().unwrap();
        let config_file = dir.path().join("prometheus.yml");
        std::fs::write(&config_file, config).unwrap();
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let process = tokio::process::Command::new(binary)
            .arg(format!("--config.file={}", config_file.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let ready = common::eventually(Duration::from_secs(60), || async {
            matches!(http_get(addr, "/-/ready").await, Ok((200, _)))
        })
        .await;
        assert!(ready, "Prometheus did not get ready at {addr}");
        Prometheus {
            addr,
            _process: process,
            _dir: dir,
        }
    }
}

/// The ops config as shipped, scraping the application at `target` every second.
fn ops_prometheus_config(target: std::net::SocketAddr) -> String {
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/prometheus/prometheus.yml"
    ))
    .unwrap();
    assert!(shipped.contains("scrape_interval: 15s") && shipped.contains("127.0.0.1:9464"));
    shipped
        .replace("scrape_interval: 15s", "scrape_interval: 1s")
        .replace("127.0.0.1:9464", &target.to_string())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_real_prometheus_answers_every_dashboard_query_with_series() {
    let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
        c.prometheus_listen = Some("127.0.0.1:0".into());
    }))
    .await
    .unwrap();
    let app = telemetry.prometheus_addr().unwrap();
    let prometheus = Prometheus::start(&ops_prometheus_config(app)).await;

    // A workload that gives every panel something: grants and timeouts, a hot key, cleaned
    // rows, and in-process grants on a shard that is down (s2, where nobody listens).
    let cluster = Cluster::start(1).await.unwrap();
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let extra = "namespaces:\n  orders:\n    ttl: 5s\n  cache:\n    on-shard-failure: local\n    wait: 1s\n\
                 cleaner:\n  grace: 100ms\n  registry: static\n\
                 breaker:\n  consecutive-failures: 1\n\
                 telemetry:\n  record-keys: true\n";
    let yaml = format!(
        "{}  - name: s2\n    url: mysql://root@127.0.0.1:{dead}/shardlock\n    statement-timeout: 500ms\n    pool:\n      create-timeout: 300ms\n{extra}",
        cluster.config_yaml("")
    );
    let config = Config::from_yaml_str(&yaml).unwrap();
    let router = LockRouter::builder(config)
        .meter_provider(telemetry.meter_provider())
        .build()
        .await
        .unwrap();
    let on = |shard: &'static str| {
        let router = router.clone();
        move |i: usize| {
            (i..)
                .map(|i| format!("k:{i}"))
                .find(|k| router.shard_for(k).unwrap() == shard)
                .unwrap()
        }
    };
    let (live, down) = (on("s1"), on("s2"));
    // Migrate the live shard only (the dead one cannot be).
    LockRouter::from_yaml_str(&cluster.config_yaml(""))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let orders = AcquireOptions::new().namespace("orders");
    for i in 0..20 {
        let g = router.acquire(&live(i * 10), orders.clone()).await.unwrap();
        g.release().await.unwrap();
    }
    // A hot key: a second task waits for it in memory while the first holds it.
    let hot = live(1000);
    let held = router.acquire(&hot, orders.clone()).await.unwrap();
    let waiter = {
        let (router, orders, hot) = (router.clone(), orders.clone(), hot.clone());
        tokio::spawn(async move { router.acquire(&hot, orders).await.unwrap().release().await })
    };
    let queued = common::eventually(Duration::from_secs(10), || async {
        router.stats().queued == 1
    })
    .await;
    assert!(queued, "the second task never waited");
    // Waits under a millisecond are not counted for hot keys.
    tokio::time::sleep(Duration::from_millis(5)).await;
    held.release().await.unwrap();
    waiter.await.unwrap().unwrap();
    let cache = AcquireOptions::new().namespace("cache");
    let local = common::eventually(Duration::from_secs(30), || async {
        match router.acquire(&down(0), cache.clone()).await {
            Ok(g) => {
                let local = g.mode() == shardlock::LockMode::LocalFallback;
                g.release().await.ok();
                local
            }
            Err(_) => false,
        }
    })
    .await;
    assert!(
        local,
        "the down shard's cache keys were never granted in-process"
    );
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let cleaned = router.clean_once().await.unwrap();
    assert!(cleaned.deleted() > 0, "{cleaned:?}");

    // Two scrapes after the workload, so that every rate has two samples of each series.
    let scrapes = r#"count_over_time(up{job="shardlock"}[10m])"#;
    let scrapes_before = prometheus_query(prometheus.addr, scrapes).await;
    let count = |series: &[serde_json::Value]| -> f64 {
        series
            .iter()
            .map(|s| s["value"][1].as_str().unwrap().parse::<f64>().unwrap())
            .sum()
    };
    let before = count(&scrapes_before);
    let scraped = common::eventually(Duration::from_secs(60), || async {
        count(&prometheus_query(prometheus.addr, scrapes).await) >= before + 2.0
    })
    .await;
    assert!(scraped, "Prometheus did not scrape twice");
    let up = prometheus_query(prometheus.addr, r#"up{job="shardlock"}"#).await;
    assert_eq!(up.len(), 1, "{up:?}");
    assert_eq!(up[0]["value"][1], "1", "the app's endpoint is up: {up:?}");

    let mut empty = Vec::new();
    for query in dashboard_queries() {
        let query = query
            .replace("$__rate_interval", "30s")
            .replace("$job", "shardlock")
            .replace("$instance", ".+")
            .replace("$namespace", ".*")
            .replace("$shard", ".*");
        if prometheus_query(prometheus.addr, &query).await.is_empty() {
            empty.push(query);
        }
    }
    assert!(
        empty.is_empty(),
        "queries with no series:\n{}",
        empty.join("\n")
    );
    drop(router);
}

#[tokio::test(flavor = "multi_thread")]
async fn shard_calls_are_database_client_spans_with_an_error_status_when_they_fail() {
    let (telemetry, received) = traced_to_otlp(false).await;
    let (cluster, router, _yaml) = common::start(1, "").await;
    let port = cluster.shard(0).port();
    router
        .acquire("db:1", AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    cluster.shard(0).kill().unwrap();
    let err = router
        .try_acquire("db:2", AcquireOptions::new())
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    drop(router);
    telemetry.shutdown();

    let spans = received_spans(&received);
    let calls: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| attribute(s, "db.operation.name").as_deref() == Some("acquire"))
        .collect();
    const CLIENT: i64 = 3;
    const ERROR: i64 = 2;
    let status = |s: &serde_json::Value| s["status"]["code"].as_i64().unwrap_or(0);
    let ok = calls
        .iter()
        .find(|s| status(s) != ERROR)
        .unwrap_or_else(|| panic!("no successful acquire call in {spans:#?}"));
    assert_eq!(
        ok["name"],
        format!("acquire {}", shardlock_testkit::DATABASE)
    );
    assert_eq!(ok["kind"].as_i64(), Some(CLIENT));
    for (key, value) in [
        // The testkit's shards are MariaDB.
        ("db.system.name", "mariadb".to_owned()),
        ("db.namespace", shardlock_testkit::DATABASE.to_owned()),
        ("server.address", "127.0.0.1".to_owned()),
        ("server.port", port.to_string()),
        ("shardlock.shard", "s1".to_owned()),
    ] {
        assert_eq!(attribute(ok, key), Some(value), "{key} in {ok:#}");
    }
    assert_eq!(attribute(ok, "error.type"), None, "{ok:#}");
    let failed = calls
        .iter()
        .find(|s| status(s) == ERROR)
        .unwrap_or_else(|| panic!("no failed acquire call in {calls:#?}"));
    assert!(attribute(failed, "error.type").is_some(), "{failed:#}");
}

/// A TLS acceptor serving the test certificates' server certificate (for `localhost`).
fn tls_acceptor(certs: &shardlock_testkit::TestCerts) -> tokio_rustls::TlsAcceptor {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let (cert, key) = certs.server();
    let chain = CertificateDer::pem_file_iter(cert)
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_file(key).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(chain, key)
    .unwrap();
    tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config))
}

/// OTLP over https: metrics reach a collector whose certificate the configured CA signed, and
/// a collector the CA did not sign gets no byte of telemetry (the handshake fails).
#[tokio::test(flavor = "multi_thread")]
async fn otlp_exports_over_https_trusting_the_configured_ca_alone() {
    let certs = shardlock_testkit::TestCerts::generate().unwrap();
    let cluster = Cluster::start(1).await.unwrap();
    for (ca, trusted) in [(certs.ca(), true), (certs.other_ca(), false)] {
        let (addr, collected) = otlp_collector(Some(tls_acceptor(&certs))).await;
        let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
            // The certificate names `localhost`.
            c.otlp_endpoint = Some(format!("https://localhost:{}", addr.port()));
            c.otlp_ca_file = Some(ca.clone());
        }))
        .await
        .unwrap();
        let router = metered_router(&cluster, "", &telemetry).await;
        router
            .acquire("https:1", AcquireOptions::new())
            .await
            .unwrap()
            .release()
            .await
            .unwrap();
        router.shutdown().await.unwrap();
        // Flushes the metrics: one export, answered (or refused) before this returns.
        telemetry.shutdown();
        let metrics = collected.metrics.lock().unwrap().clone();
        if trusted {
            let text = serde_json::to_string(&metrics).unwrap();
            assert!(
                text.contains("shardlock.acquire.duration"),
                "no acquire metric over https: {text}"
            );
            // A collector keys series by their resource: processes of one service must differ.
            let resources: Vec<serde_json::Value> = metrics
                .iter()
                .flat_map(|body| {
                    body["resourceMetrics"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                })
                .map(|rm| rm["resource"].clone())
                .collect();
            let named = |r: &serde_json::Value| {
                attribute(r, "service.instance.id").is_some_and(|i| !i.is_empty())
            };
            assert!(
                !resources.is_empty() && resources.iter().all(named),
                "metrics exported without a service.instance.id: {resources:?}"
            );
            assert_eq!(*collected.failed_handshakes.borrow(), 0);
        } else {
            assert!(metrics.is_empty(), "{metrics:?}");
            let mut failed = collected.failed_handshakes.subscribe();
            tokio::time::timeout(Duration::from_secs(30), failed.wait_for(|n| *n > 0))
                .await
                .expect("the collector saw the refused handshake")
                .unwrap();
        }
    }
}
