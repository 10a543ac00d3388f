//! Prometheus metrics: `--metrics-addr HOST:PORT` serves `GET /metrics`.
//!
//! Exported (all prefixed `permitq_`): `grants_total`, `request_errors_total{code}`,
//! `timeouts_total`, `sweep_released_total{reason}`, `retention_deleted_total`,
//! `batch_retries_total`, `listener_reconnects_total`, and the histograms `batch_seconds`,
//! `pass_seconds` and `grant_wait_seconds` (submit → grant).

use std::net::SocketAddr;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::error::{Error, Result};

/// Installs the Prometheus recorder (once per process) and serves it on `addr` in the
/// background. Returns the bound address (useful with port 0).
pub async fn serve(addr: SocketAddr) -> Result<SocketAddr> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| Error::config(format!("cannot install metrics recorder: {e}")))?;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| Error::config(format!("cannot listen on {addr} for metrics: {e}")))?;
    let bound = listener.local_addr()?;
    tokio::spawn(accept_loop(listener, handle));
    Ok(bound)
}

async fn accept_loop(listener: TcpListener, handle: PrometheusHandle) {
    loop {
        let Ok((mut socket, _)) = listener.accept().await else {
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            // One small request per connection; its content does not matter beyond the path.
            let mut buf = [0u8; 1024];
            let n = socket.read(&mut buf).await.unwrap_or(0);
            let request = String::from_utf8_lossy(&buf[..n]);
            let response = if request.starts_with("GET /metrics") {
                let body = handle.render();
                format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                )
            } else {
                "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    .to_string()
            };
            let _ = socket.write_all(response.as_bytes()).await;
        });
    }
}
