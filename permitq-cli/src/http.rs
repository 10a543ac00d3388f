//! HTTP endpoints (axum): `GET /metrics` (Prometheus text) and `GET /healthz`.
//!
//! Exported metrics (all prefixed `permitq_`): `grants_total`, `request_errors_total{code}`,
//! `timeouts_total`, `sweep_released_total{reason}`, `retention_deleted_total`,
//! `batch_retries_total`, `listener_reconnects_total`, and the histograms `batch_seconds`,
//! `pass_seconds` and `grant_wait_seconds` (submit → grant).

use std::net::SocketAddr;

use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

use crate::error::{CliError, Result};

/// Installs the Prometheus recorder (once per process) and serves the endpoints on `addr` in
/// the background. Returns the bound address (useful with port 0).
pub(crate) async fn serve(addr: SocketAddr) -> Result<SocketAddr> {
    let handle = PrometheusBuilder::new()
        .install_recorder()
        .map_err(|e| CliError::runtime(format!("cannot install metrics recorder: {e}")))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::runtime(format!("cannot listen on {addr} for HTTP: {e}")))?;
    let bound = listener.local_addr()?;
    let app = router(handle);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });
    Ok(bound)
}

fn router(metrics: PrometheusHandle) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let body = metrics.render();
                async move {
                    (
                        [(
                            axum::http::header::CONTENT_TYPE,
                            "text/plain; version=0.0.4",
                        )],
                        body,
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok\n" }))
}
