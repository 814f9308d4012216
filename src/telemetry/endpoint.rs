//! The Prometheus endpoint: `GET /metrics` on the address `telemetry.prometheus-listen`
//! names. A scrape is one `GET` on its own connection, answered and closed, so a few lines
//! over the Tokio listener serve it without an HTTP server dependency.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The registry's metrics in the Prometheus text format.
pub(super) fn encode(registry: &prometheus::Registry) -> String {
    use prometheus::Encoder;
    let mut out = Vec::new();
    let _ = prometheus::TextEncoder::new().encode(&registry.gather(), &mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A minimal HTTP/1.1 server: `GET /metrics` answers the metrics, anything else 404.
pub(super) async fn serve(listener: tokio::net::TcpListener, registry: prometheus::Registry) {
    loop {
        // A failed accept (out of file descriptors, a connection reset before it was
        // accepted) ends that connection, not the endpoint.
        let mut stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!(error = %e, "shardlock metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let mut request = vec![0u8; 4096];
            let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_secs(5), stream.read(&mut request)).await
            else {
                return;
            };
            let line = String::from_utf8_lossy(&request[..n]);
            let response = if line.starts_with("GET /metrics") {
                let body = encode(&registry);
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\n\
                     content-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    .to_owned()
            };
            let _ = stream.write_all(response.as_bytes()).await;
            let _ = stream.shutdown().await;
        });
    }
}
