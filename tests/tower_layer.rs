//! The tower layer through a real HTTP server (axum on loopback) over real shards: requests
//! for one payment run one at a time, a second request while one runs is answered busy (or
//! waits, when told to), requests for other payments run beside it, and a request without a
//! key is not locked.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use shardlock::tower::{LockLayer, Refused};
use shardlock::{AcquireOptions, LockRouter};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

/// GET `path` over a fresh connection; the status code.
async fn get_status(addr: std::net::SocketAddr, path: &str) -> u16 {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let mut reply = String::new();
    conn.read_to_string(&mut reply).await.unwrap();
    reply.split(' ').nth(1).unwrap().parse().unwrap()
}

/// The payment key of a request: `/pay/<id>` locks `payment:<id>`; other paths lock nothing.
fn payment_key(req: &axum::extract::Request) -> Option<String> {
    req.uri()
        .path()
        .strip_prefix("/pay/")
        .map(|id| format!("payment:{id}"))
}

/// A server whose `/pay/{id}` handler waits for `release` while holding the lock; `inside`
/// counts requests in the handler at once, `most` the highest count seen.
struct Server {
    addr: std::net::SocketAddr,
    release: Arc<Notify>,
    entered: Arc<Notify>,
    most: Arc<AtomicUsize>,
}

async fn serve(router: LockRouter, opts: AcquireOptions) -> Server {
    let release = Arc::new(Notify::new());
    let entered = Arc::new(Notify::new());
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (release, entered, inside, most) = (
            release.clone(),
            entered.clone(),
            inside.clone(),
            most.clone(),
        );
        move |Path(id): Path<String>| async move {
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            entered.notify_one();
            if id.starts_with("slow") {
                release.notified().await;
            }
            inside.fetch_sub(1, Ordering::SeqCst);
            "paid"
        }
    };
    let layer = LockLayer::new(router, payment_key, |refused: Refused| -> Response {
        match refused {
            Refused::Busy => (StatusCode::CONFLICT, "in progress").into_response(),
            Refused::Failed(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
            // Told apart from the others in the test below.
            Refused::Lost => (StatusCode::GONE, "lock lost").into_response(),
        }
    })
    .options(opts);
    let app = Router::new()
        .route("/pay/{id}", get(handler))
        .route("/health", get(|| async { "ok" }))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Server {
        addr,
        release,
        entered,
        most,
    }
}

/// Options that set no wait keep the layer's default (answer busy at once), not the
/// namespace's wait (a minute here: a request for a held key hung that long).
#[tokio::test(flavor = "multi_thread")]
async fn options_without_a_wait_still_answer_busy_at_once() {
    let (_cluster, router, _yaml) =
        common::start(1, "namespaces:\n  default:\n    wait: 60s\n").await;
    let server = serve(router, AcquireOptions::new().ttl(Duration::from_secs(10))).await;
    let slow = tokio::spawn(get_status(server.addr, "/pay/slow-held"));
    server.entered.notified().await;
    let busy = tokio::time::timeout(
        Duration::from_secs(20),
        get_status(server.addr, "/pay/slow-held"),
    )
    .await
    .expect("a request for a held key waited the namespace's wait");
    assert_eq!(busy, 409);
    server.release.notify_one();
    assert_eq!(slow.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_for_one_key_run_one_at_a_time() {
    let (cluster, router, _yaml) = common::start(2, "").await;

    // Answered busy at once while the key is held.
    let server = serve(router.clone(), AcquireOptions::new().wait(Duration::ZERO)).await;
    let slow = tokio::spawn(get_status(server.addr, "/pay/slow-1"));
    server.entered.notified().await;
    assert_eq!(get_status(server.addr, "/pay/slow-1").await, 409);
    // Another payment, and a request without a key, run meanwhile.
    assert_eq!(get_status(server.addr, "/pay/2").await, 200);
    assert_eq!(get_status(server.addr, "/health").await, 200);
    // The key is held on its shard: another instance cannot take it either.
    let other = common::worker_router_from(&cluster).await;
    assert!(other
        .try_acquire("payment:slow-1", AcquireOptions::new().wait(Duration::ZERO))
        .await
        .unwrap()
        .is_none());
    server.release.notify_one();
    assert_eq!(slow.await.unwrap(), 200);
    // Released with the response: free again.
    assert!(
        common::eventually(Duration::from_secs(30), || async {
            other
                .try_acquire("payment:slow-1", AcquireOptions::new().wait(Duration::ZERO))
                .await
                .unwrap()
                .is_some()
        })
        .await
    );

    // Told to wait: concurrent requests for one key queue and each runs alone.
    let server = serve(
        router.clone(),
        AcquireOptions::new().wait(Duration::from_secs(30)),
    )
    .await;
    let first = tokio::spawn(get_status(server.addr, "/pay/slow-3"));
    server.entered.notified().await;
    let queued: Vec<_> = (0..4)
        .map(|_| tokio::spawn(get_status(server.addr, "/pay/slow-3")))
        .collect();
    // All four wait for the key before any is let in: each then runs alone, or two overlap.
    let waiting = common::eventually(Duration::from_secs(30), || async {
        router.stats().queued == 4
    })
    .await;
    assert!(waiting, "the requests never queued: {:?}", router.stats());
    for _ in 0..5 {
        server.release.notify_one();
        // The next one in: released only after it entered, so each waits its turn.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Release whoever is still inside or on the way until every request answered.
    let release = server.release.clone();
    let keep_releasing = tokio::spawn(async move {
        loop {
            release.notify_one();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    assert_eq!(first.await.unwrap(), 200);
    for q in queued {
        assert_eq!(q.await.unwrap(), 200);
    }
    keep_releasing.abort();
    assert_eq!(
        server.most.load(Ordering::SeqCst),
        1,
        "two requests of one key at once"
    );

    // A key the router refuses is answered as failed, not run.
    let server = serve(router.clone(), AcquireOptions::new().wait(Duration::ZERO)).await;
    let long = format!("/pay/{}", "x".repeat(1100));
    assert_eq!(get_status(server.addr, &long).await, 503);

    // A request whose lock is lost mid-way (force-released: its next renewal finds it gone)
    // is stopped and answered as lost, though its handler never returned.
    let short = AcquireOptions::new()
        .wait(Duration::ZERO)
        .ttl(Duration::from_secs(3));
    let server = serve(router.clone(), short).await;
    let stuck = tokio::spawn(get_status(server.addr, "/pay/slow-9"));
    server.entered.notified().await;
    router.force_release("payment:slow-9").await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(60), stuck)
        .await
        .expect("a request whose lock was lost is answered");
    assert_eq!(answer.unwrap(), 410, "answered as lost");
}
