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

/// Every `shardlock_…` metric the dashboard queries.
fn dashboard_metrics() -> BTreeSet<String> {
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/ops/grafana/shardlock.json"
    ))
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
    let mut names = BTreeSet::new();
    for panel in json["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(at) = rest.find("shardlock_") {
                let name: String = rest[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[at + name.len()..];
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
    // Built without the provider: it records nothing there, whatever it does.
    let unmetered = common::worker_router_from(&cluster).await;
    unmetered
        .acquire("unmetered", AcquireOptions::new())
        .await
        .unwrap()
        .release()
        .await
        .unwrap();

    // A known workload: 50 grants, then 3 tries of a key that is held.
    let opts = AcquireOptions::new().namespace("orders");
    for i in 0..50 {
        let g = router
            .acquire(&format!("o:{i}"), opts.clone())
            .await
            .unwrap();
        g.release().await.unwrap();
    }
    let held = router.acquire("busy", opts.clone()).await.unwrap();
    let other = metered_router(&cluster, "", &telemetry).await;
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
    let unmetered = format!("instance=\"{}\"", unmetered.instance_id());
    assert!(
        !text.contains(&unmetered),
        "a router built without the provider reported there:\n{text}"
    );
    let count = "shardlock_acquire_duration_seconds_count";
    assert_eq!(
        sample(
            &text,
            count,
            &["namespace=\"orders\"", "outcome=\"granted\""]
        ),
        51.0
    );
    assert_eq!(sample(&text, count, &["outcome=\"timeout\""]), 3.0);
    assert_eq!(sample(&text, count, &["outcome=\"unavailable\""]), 0.0);
    assert_eq!(
        sample(
            &text,
            "shardlock_hold_duration_seconds_count",
            &["mode=\"remote\""]
        ),
        51.0,
        "every released hold is timed (the cleaner still holds its election lock)"
    );
    assert_eq!(
        sample(
            &text,
            "shardlock_cleaner_deleted_total",
            &["reason=\"released\""]
        ),
        cleaned.deleted() as f64
    );
    for shard in ["s1", "s2"] {
        let shard = format!("shard=\"{shard}\"");
        assert_eq!(sample(&text, "shardlock_breaker_state", &[&shard]), 0.0);
        assert!(
            sample(
                &text,
                "shardlock_pool_connections",
                &[&shard, "state=\"max\""]
            ) > 0.0
        );
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
        .find(|l| l.starts_with("shardlock_hot_key_wait_seconds{") && l.contains("rank=\"1\""))
        .unwrap_or_else(|| panic!("no hot-key sample:\n{text}"));
    assert!(hottest.contains("key=\"hot\""), "{hottest}");
}

/// A loopback OTLP/HTTP receiver: keeps the JSON body of every POST to `/v1/traces`.
async fn otlp_receiver() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = received.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let keep = keep.clone();
            tokio::spawn(async move {
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
                if head.starts_with("POST /v1/traces") {
                    let body: serde_json::Value =
                        serde_json::from_slice(&buf[head_end..head_end + length]).unwrap();
                    keep.lock().unwrap().push(body);
                }
                let _ = stream
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                    .await;
            });
        }
    });
    (addr, received)
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
    use tracing_subscriber::prelude::*;
    let (addr, received) = otlp_receiver().await;
    let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
        c.otlp_endpoint = Some(format!("http://{addr}"));
        c.record_keys = true;
    }))
    .await
    .unwrap();
    tracing_subscriber::registry()
        .with(telemetry.layer())
        .init();
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
                && attribute(s, "fence").as_deref() == Some(holder_fence.to_string().as_str())
        })
        .unwrap_or_else(|| panic!("no hold span of the holder in {spans:#?}"));
    let acquires: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| {
            s["name"] == "shardlock.acquire" && attribute(s, "key").as_deref() == Some("account:7")
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
    assert_eq!(attribute(waited, "outcome").as_deref(), Some("granted"));
    assert_eq!(attribute(waited, "mode").as_deref(), Some("remote"));
    assert_eq!(attribute(waited, "shard").as_deref(), Some("s1"));
    let wait_ms: f64 = attribute(waited, "wait_ms").unwrap().parse().unwrap();
    assert!(wait_ms >= 150.0, "waited {wait_ms} ms behind the holder");
    // Queued in memory behind the holder: it never polled the shard.
    assert_eq!(attribute(waited, "attempts").as_deref(), Some("0"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_waiter_elsewhere_links_to_the_holders_trace_stored_with_the_lease() {
    use tracing_subscriber::prelude::*;
    let (addr, received) = otlp_receiver().await;
    let telemetry = shardlock::telemetry::init(&telemetry_config(|c| {
        c.otlp_endpoint = Some(format!("http://{addr}"));
    }))
    .await
    .unwrap();
    tracing_subscriber::registry()
        .with(telemetry.layer())
        .init();
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
    let waiter = tokio::spawn(async move {
        let g = waiter_router
            .acquire("acct:9", AcquireOptions::new())
            .await
            .unwrap();
        g.release().await.unwrap();
        waiter_router.shutdown().await.unwrap();
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    holder.release().await.unwrap();
    waiter.await.unwrap();
    holder_router.shutdown().await.unwrap();
    telemetry.shutdown();

    let spans: Vec<serde_json::Value> = received_spans(&received)
        .into_iter()
        .filter(|s| {
            s["name"] == "shardlock.acquire" && attribute(s, "key").as_deref() == Some("acct:9")
        })
        .collect();
    assert_eq!(spans.len(), 2, "{spans:#?}");
    let attempts =
        |s: &serde_json::Value| attribute(s, "attempts").unwrap().parse::<u32>().unwrap();
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
    assert_eq!(attribute(waited, "outcome").as_deref(), Some("granted"));
}
