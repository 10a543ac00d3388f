//! HTTP endpoints (axum), served by `permitq serve --http-addr` and `permitq worker --http-addr`:
//!
//! - `GET /metrics`: Prometheus text. Counters and histograms (real buckets, aggregatable across
//!   workers) from the worker; gauges read from the database at each scrape, per semaphore
//!   (`permitq_semaphore_capacity`, `_used`, `_held`, `_waiting`, `_oldest_wait_seconds`); on a
//!   worker also `permitq_worker_listener_connected` and `permitq_worker_last_pass_age_seconds`.
//! - `GET /healthz`: the process is up. `GET /readyz`: the database answers, its schema is the one
//!   this build expects, and (on a worker) the LISTEN connection is up; else 503 with the reason.
//! - `GET /api/semaphores`, `GET /api/semaphores/{name}` (usage, holders, the first 100 waiters,
//!   the last 20 capacity changes): JSON, read-only (see [`api`]).
//! - `GET /`: a status page (one self-contained HTML file compiled into the binary) that polls
//!   the JSON API every second.

mod api;

pub(crate) use api::{detail, Detail};

use std::net::SocketAddr;
use std::time::SystemTime;

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use permitq::{Client, WorkerHealth};

use crate::error::{CliError, Result};

/// Histogram buckets (seconds) for every `*_seconds` histogram.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// What the handlers read.
#[derive(Clone)]
struct State {
    metrics: PrometheusHandle,
    client: Client,
    worker: Option<WorkerHealth>,
}

/// Installs the Prometheus recorder (once per process) and serves the endpoints on `addr` in
/// the background, reading the database through `client` (and, in a worker, its `health`).
/// Returns the bound address (useful with port 0).
pub(crate) async fn serve(
    addr: SocketAddr,
    client: Client,
    worker: Option<WorkerHealth>,
) -> Result<SocketAddr> {
    let metrics = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| CliError::runtime(format!("bad histogram buckets: {e}")))?
        .install_recorder()
        .map_err(|e| CliError::runtime(format!("cannot install metrics recorder: {e}")))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| CliError::runtime(format!("cannot listen on {addr} for HTTP: {e}")))?;
    let bound = listener.local_addr()?;
    let app = router(State {
        metrics,
        client,
        worker,
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });
    Ok(bound)
}

fn router(state: State) -> Router {
    Router::new()
        .route("/", get(|| async { page() }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/semaphores", get(api::semaphores))
        .route("/api/semaphores/{name}", get(api::semaphore))
        .with_state(state)
}

fn page() -> Response {
    (
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        include_str!("page.html"),
    )
        .into_response()
}

async fn readyz(axum::extract::State(state): axum::extract::State<State>) -> Response {
    let not_ready =
        |why: String| (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")).into_response();
    match state.client.schema_is_current().await {
        Ok(true) => {}
        Ok(false) => {
            return not_ready("schema is not at this build's version: run `permitq migrate`".into())
        }
        Err(e) => {
            return not_ready(format!(
                "database: {}",
                crate::error::one_line(&e.to_string())
            ))
        }
    }
    if let Some(worker) = &state.worker {
        if !worker.listener_connected() {
            return not_ready("the worker's LISTEN connection is down".into());
        }
    }
    "ready\n".into_response()
}

async fn metrics(axum::extract::State(state): axum::extract::State<State>) -> Response {
    match state.client.usage().await {
        Ok(usage) => {
            let now = SystemTime::now();
            for s in usage {
                let name = s.name.clone();
                let gauge = |metric: &'static str, value: i64| {
                    #[allow(clippy::cast_precision_loss, reason = "a gauge is a float")]
                    metrics::gauge!(metric, "semaphore" => name.clone()).set(value as f64);
                };
                gauge("permitq_semaphore_capacity", s.capacity);
                gauge("permitq_semaphore_used", s.used);
                gauge("permitq_semaphore_held", s.held);
                gauge("permitq_semaphore_waiting", s.waiting);
                #[allow(clippy::cast_sign_loss, reason = "a counter from 0 up")]
                metrics::counter!("permitq_semaphore_grants_total", "semaphore" => name.clone())
                    .absolute(s.granted as u64);
                let oldest = s
                    .oldest_wait_since
                    .and_then(|t| now.duration_since(t).ok())
                    .map_or(0.0, |d| d.as_secs_f64());
                metrics::gauge!("permitq_semaphore_oldest_wait_seconds", "semaphore" => name)
                    .set(oldest);
            }
            metrics::gauge!("permitq_database_up").set(1.0);
        }
        Err(e) => {
            tracing::debug!(error = %e, "metrics: cannot read semaphore usage");
            metrics::gauge!("permitq_database_up").set(0.0);
        }
    }
    if let Some(worker) = &state.worker {
        let age = worker
            .last_pass()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .map_or(-1.0, |d| d.as_secs_f64());
        metrics::gauge!("permitq_worker_last_pass_age_seconds").set(age);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}
