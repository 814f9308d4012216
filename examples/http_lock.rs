//! An HTTP service (axum) whose payment callbacks run under the payment's lock, through
//! `shardlock::tower::LockLayer` (feature `tower`): a provider that retries a callback while
//! the first is still being handled gets 409 instead of a second, concurrent booking.
//!
//! ```sh
//! cargo run -p shardlock-cli --features dev-tools -- dev up
//! cargo run --example http_lock
//! ```

use std::sync::Arc;

use axum::extract::Path;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use shardlock::tower::{LockLayer, Refused};
use shardlock::LockRouter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let config = std::env::var("SHARDLOCK_CONFIG").unwrap_or_else(|_| "config/local.yaml".into());
    let router = LockRouter::from_yaml_file(&config).await?;
    router.migrate().await?;

    // `/callback/{payment}` locks `payment:{payment}` for the length of the request.
    let layer = LockLayer::new(
        router.clone(),
        |req: &axum::extract::Request| {
            let payment = req.uri().path().strip_prefix("/callback/")?;
            Some(format!("payment:{payment}"))
        },
        |refused: Refused| -> Response {
            match refused {
                Refused::Busy => (StatusCode::CONFLICT, "callback in progress").into_response(),
                Refused::Failed(e) => {
                    (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response()
                }
                Refused::Lost => (StatusCode::SERVICE_UNAVAILABLE, "lock lost").into_response(),
            }
        },
    );
    // Booking a payment takes a while: here, until `main` says so.
    let (entered, finish) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let book = {
        let (entered, finish) = (entered.clone(), finish.clone());
        move |Path(payment): Path<String>| async move {
            entered.notify_one();
            finish.notified().await;
            format!("booked {payment}")
        }
    };
    let app = Router::new()
        .route("/callback/{payment}", post(book))
        .layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The provider sends the callback, and again while the first is still being booked.
    let first = tokio::spawn(post_callback(addr, "p-881"));
    entered.notified().await;
    let retry = post_callback(addr, "p-881").await?;
    finish.notify_one();
    let first = first.await??;
    println!("first callback: {first}; retry while it ran: {retry}");
    assert_eq!((first, retry), (200, 409));
    router.shutdown().await?;
    Ok(())
}

/// POSTs a callback over a fresh connection; the status code.
async fn post_callback(
    addr: std::net::SocketAddr,
    payment: &str,
) -> Result<u16, Box<dyn std::error::Error + Send + Sync>> {
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    let request = format!(
        "POST /callback/{payment} HTTP/1.1\r\nHost: shop\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    conn.write_all(request.as_bytes()).await?;
    let mut reply = String::new();
    conn.read_to_string(&mut reply).await?;
    Ok(reply.split(' ').nth(1).ok_or("no status")?.parse()?)
}
