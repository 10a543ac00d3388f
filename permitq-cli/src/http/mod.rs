//! HTTP endpoints (axum), served by `permitq serve --http-addr` and `permitq worker --http-addr`:
//!
//! - `GET /metrics`: Prometheus text. Counters and histograms (real buckets, aggregatable across
//!   workers) from the worker; gauges read from the database at each scrape, per semaphore
//!   (`permitq_semaphore_capacity`, `_used`, `_held`, `_waiting`, `_oldest_wait_seconds`); on a
//!   worker also `permitq_worker_listener_connected` and `permitq_worker_last_pass_age_seconds`.
//! - `GET /healthz`: the process is up. `GET /readyz`: the database answers, its schema is the one
//!   this build expects, and (on a worker) the LISTEN connection is up and a pass completed
//!   within twice the poll interval and 10 s; else 503 with the reason.
//! - `GET /api/semaphores`, `GET /api/semaphores/{name}` (usage, holders, the first 100 waiters,
//!   the last 20 capacity changes): JSON, read-only (see [`api`]).
//! - Access ([`access`]): probes open; `/metrics` open unless a token is set; the page and
//!   `/api/*` need the token, or a loopback address without one; a limit on requests at once.
//! - `GET /`: a status page (one self-contained HTML file compiled into the binary), its table
//!   rendered on the server; `GET /rows` is that table, which the page fetches every second (see
//!   [`page`]).

mod access;
mod api;
mod page;
mod reuse;

pub(crate) use api::{detail, Detail};

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use permitq::{Client, WorkerHealth};

use crate::error::{CliError, Result};
use reuse::{Reused, ReusedByKey};

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
    /// `/readyz`'s answer.
    ready: Arc<Reused<(StatusCode, String)>>,
    /// Every semaphore's usage and the workers: the page, its rows, `/metrics` and
    /// `/api/semaphores`.
    overview: Arc<Reused<Answer<Overview>>>,
    /// One semaphore in full, by name: `/api/semaphores/{name}`.
    details: Arc<ReusedByKey<Answer<api::Detail>>>,
    /// Who reads the database, for what an error tells the reader to do.
    reader: Reader,
}

/// The login this server reads the database as, and the permitq role it needs: what a refusal
/// names (the GRANT to run, by name).
#[derive(Clone, Debug)]
pub(crate) struct Reader {
    /// The login (as the database URL names it).
    pub(crate) login: String,
    /// Who needs the role: `serve`, `the worker`.
    pub(crate) who: &'static str,
    /// The role it needs, and what else would do.
    pub(crate) role: (&'static str, &'static str),
}

/// Every semaphore's usage, and the workers.
type Overview = (Vec<permitq::SemaphoreUsage>, crate::show::Presence);

/// An answer read from the database, shared by the callers that asked within its period, or
/// why it could not be read.
type Answer<T> = std::result::Result<Arc<T>, String>;

/// How long an answer read from the database is reused: however many clients ask, the
/// endpoints read the database at most once a second per answer (per semaphore, for one
/// semaphore's detail), and the backlog's size costs once per second at most.
const REUSED_FOR: Duration = Duration::from_secs(1);

impl State {
    fn new(
        metrics: PrometheusHandle,
        client: Client,
        worker: Option<WorkerHealth>,
        reader: Reader,
    ) -> Self {
        Self {
            metrics,
            client,
            worker,
            ready: Arc::new(Reused::new(REUSED_FOR)),
            overview: Arc::new(Reused::new(REUSED_FOR)),
            details: Arc::new(ReusedByKey::new(REUSED_FOR)),
            reader,
        }
    }

    /// Every semaphore's usage and the workers, read at most once per period.
    async fn overview(&self) -> Answer<Overview> {
        self.overview
            .get(|| async {
                read("overview");
                let usage = self
                    .client
                    .usage()
                    .await
                    .map_err(|e| self.reader.said(&e))?;
                let presence = crate::show::Presence::read(&self.client)
                    .await
                    .map_err(|e| self.reader.said(&e))?;
                Ok(Arc::new((usage, presence)))
            })
            .await
    }

    /// The semaphore of `usage` in full, with its children among `all` and the workers of
    /// `presence` (all from the overview), read at most once per period per name.
    async fn detail(
        &self,
        usage: &permitq::SemaphoreUsage,
        all: &[permitq::SemaphoreUsage],
        presence: &crate::show::Presence,
    ) -> Answer<api::Detail> {
        self.details
            .get(&usage.name, || async {
                read("detail");
                api::detail_of(&self.client, usage.clone(), all, presence.clone())
                    .await
                    .map(Arc::new)
                    .map_err(|e| self.reader.said(&e))
            })
            .await
    }
}

impl Reader {
    /// What a database error tells whoever runs this server (its stderr too).
    pub(crate) fn said(&self, e: &permitq::Error) -> String {
        let (role, also) = self.role;
        if crate::error::schema_refused(e) {
            crate::error::no_permitq_role(&self.login, self.who, role, also)
        } else {
            crate::error::for_the_cli(&e.to_string()).replace("<your login>", &self.login)
        }
    }
}

/// Counts a read of the database for the endpoints (`answer`: which).
fn read(answer: &'static str) {
    metrics::counter!("permitq_http_database_reads_total", "answer" => answer).increment(1);
}

/// Installs the Prometheus recorder (once per process) and serves the endpoints on `addr` in
/// the background, reading the database through `client` (and, in a worker, its `health`).
/// Returns the bound address (useful with port 0).
pub(crate) async fn serve(
    addr: SocketAddr,
    access: access::Access,
    client: Client,
    worker: Option<WorkerHealth>,
    reader: Reader,
) -> Result<SocketAddr> {
    let metrics = PrometheusBuilder::new()
        .set_buckets(BUCKETS)
        .map_err(|e| CliError::runtime(format!("bad histogram buckets: {e}")))?
        .install_recorder()
        .map_err(|e| CliError::runtime(format!("cannot install metrics recorder: {e}")))?;
    describe_metrics();
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        let hint = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                ": another process listens there (another `permitq serve` or worker?); give \
                     another port with --http-addr (serve and worker)"
            }
            std::io::ErrorKind::AddrNotAvailable => {
                ": that address is not one of this machine's; use 127.0.0.1 or 0.0.0.0"
            }
            _ => "",
        };
        CliError::runtime(format!("cannot listen on {addr} for HTTP: {e}{hint}"))
    })?;
    let bound = listener.local_addr()?;
    let app = router(State::new(metrics, client, worker, reader))
        .layer(axum::middleware::from_fn_with_state(access, access::guard));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "HTTP server stopped");
        }
    });
    Ok(bound)
}

/// The endpoints' guard for a server on `addr` with these options: the token read from its
/// file (an unreadable or empty file is an error naming it).
pub(crate) fn access(
    addr: SocketAddr,
    args: &crate::args::HttpAccessArgs,
) -> Result<access::Access> {
    let token = match &args.http_token_file {
        Some(path) => {
            // How to make a token file that only its owner reads.
            let make = format!(
                "(umask 077; head -c 32 /dev/urandom | base64 > {})",
                crate::show::quoted_name(&path.display().to_string())
            );
            let text = std::fs::read_to_string(path).map_err(|e| {
                let next = if e.kind() == std::io::ErrorKind::NotFound {
                    format!("make one, readable by you alone: {make}")
                } else {
                    "the file must be readable by the user this runs as".to_string()
                };
                CliError::usage(
                    "http-token-file",
                    format!("cannot read {}: {e} ({next})", path.display()),
                )
            })?;
            let token = text.trim().to_string();
            if token.len() < 16 {
                return Err(CliError::usage(
                    "http-token-file",
                    format!(
                        "{} holds {} characters; a token needs at least 16 (for example: {make})",
                        path.display(),
                        token.len()
                    ),
                ));
            }
            Some(token)
        }
        None => None,
    };
    let open_without_token = args.http_no_auth || addr.ip().is_loopback();
    if token.is_none() && !open_without_token {
        tracing::warn!(
            %addr,
            "no --http-token-file while listening beyond loopback: the status page and /api/* \
             answer 401 to every client, loopback ones too (give --http-token-file FILE, or \
             --http-no-auth behind a proxy that authenticates); /metrics and the probes are served"
        );
    }
    Ok(access::Access::new(
        token,
        open_without_token,
        usize::from(args.http_max_concurrent),
    ))
}

/// `# HELP` text for every metric family the worker and these endpoints record.
fn describe_metrics() {
    use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        "permitq_database_up",
        "1 when the last scrape could read the database, else 0."
    );
    describe_gauge!(
        "permitq_worker_last_pass_age_seconds",
        Unit::Seconds,
        "Time since this worker's last completed pass (-1: none yet)."
    );
    describe_gauge!(
        "permitq_worker_listener_connected",
        "1 while this worker's LISTEN connection is up."
    );
    describe_gauge!(
        "permitq_notify_queue_usage",
        "How full the cluster's NOTIFY queue is, 0 to 1."
    );
    describe_counter!(
        "permitq_notifications_skipped_total",
        "Notifications permitq did not send because the NOTIFY queue was filling up."
    );
    describe_counter!(
        "permitq_http_database_reads_total",
        "Reads of the database for the HTTP endpoints, by answer (each reused for a second)."
    );
    describe_counter!("permitq_grants_total", "Requests this worker granted.");
    describe_counter!(
        "permitq_request_errors_total",
        "Requests this worker settled in error, by error code."
    );
    describe_counter!(
        "permitq_timeouts_total",
        "Requests whose wait ran out (error code timeout)."
    );
    describe_counter!(
        "permitq_sweep_released_total",
        "Permits released by a sweep, by reason (expired, stale, revoked)."
    );
    describe_counter!(
        "permitq_retention_deleted_total",
        "Settled requests deleted after their retention."
    );
    describe_counter!(
        "permitq_idle_instances_removed_total",
        "Idle template instances removed."
    );
    describe_counter!(
        "permitq_maintenance_skipped_total",
        "Maintenance rounds skipped because another worker had the turn, by task."
    );
    describe_counter!(
        "permitq_listener_reconnects_total",
        "Times this worker reconnected its LISTEN connection."
    );
    describe_counter!(
        "permitq_failed_batches_total",
        "Batches that failed and were rolled back."
    );
    describe_counter!(
        "permitq_batch_retries_total",
        "Batches retried after a serialization failure or deadlock."
    );
    describe_counter!(
        "permitq_failed_passes_total",
        "Passes that failed (the worker retries after a pause)."
    );
    describe_histogram!(
        "permitq_pass_seconds",
        Unit::Seconds,
        "Duration of a worker pass (claim batches until none is left)."
    );
    describe_histogram!(
        "permitq_batch_seconds",
        Unit::Seconds,
        "Duration of one batch transaction."
    );
    describe_histogram!(
        "permitq_grant_wait_seconds",
        Unit::Seconds,
        "Time from submit to grant, for requests this worker granted."
    );
}

fn router(state: State) -> Router {
    Router::new()
        .route("/", get(status_page))
        .route("/rows", get(status_rows))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/api/semaphores", get(api::semaphores))
        .route("/api/semaphores/{name}", get(api::semaphore))
        .route("/api/requests/{external_id}/explain", get(api::explain))
        .fallback(no_such_path)
        .method_not_allowed_fallback(only_get)
        .with_state(state)
}

/// Another method than GET on a path there is: 405, saying why.
async fn only_get() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        [(header::ALLOW, "GET, HEAD")],
        "only GET is served here: permitq's HTTP API is read-only (change things with the CLI \
         or the SQL API)\n",
    )
        .into_response()
}

/// Any other path: 404, with the paths there are (under `/api/`, as the API's JSON errors).
async fn no_such_path(uri: axum::http::Uri) -> Response {
    let why = format!(
        "no such path: {}; permitq serves /, /rows, /healthz, /readyz, /metrics, \
         /api/semaphores, /api/semaphores/NAME and /api/requests/ID/explain",
        uri.path()
    );
    if uri.path().starts_with("/api/") {
        api::json(StatusCode::NOT_FOUND, &serde_json::json!({ "error": why }))
    } else {
        (StatusCode::NOT_FOUND, why + "\n").into_response()
    }
}

/// The status page, with every semaphore's row rendered for the first paint. On a database
/// error: 503, and the page says so in its table (its script keeps trying).
async fn status_page(axum::extract::State(state): axum::extract::State<State>) -> Response {
    match state.overview().await {
        Ok(overview) => html(page::page(&overview.0, &overview.1)),
        Err(e) => {
            let why = crate::error::one_line(&e);
            (
                StatusCode::SERVICE_UNAVAILABLE,
                html(page::page_unavailable(&why)),
            )
                .into_response()
        }
    }
}

/// The status page's table body, for its refresh: one request covers every semaphore.
async fn status_rows(axum::extract::State(state): axum::extract::State<State>) -> Response {
    match state.overview().await {
        Ok(overview) => html(page::rows(&overview.0, &overview.1)),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, crate::error::one_line(&e)).into_response(),
    }
}

fn html(body: String) -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], body).into_response()
}

/// `/readyz`: [`ready`]'s answer, read from the database at most once a second (one caller reads,
/// the others wait for it), so that no number of probes costs the database more.
async fn readyz(axum::extract::State(state): axum::extract::State<State>) -> Response {
    state
        .ready
        .get(|| {
            read("ready");
            ready(&state)
        })
        .await
        .into_response()
}

/// Whether this server is ready: the database answers with this build's schema, and (on a
/// worker) its LISTEN connection is up and its passes complete; `serve` adds that nothing is
/// granting.
async fn ready(state: &State) -> (StatusCode, String) {
    let not_ready = |why: String| (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n"));
    match state.client.schema_is_current().await {
        Ok(true) => {}
        Ok(false) => {
            return not_ready(format!(
                "the permitq schema in {} is missing or not at this build's version: run \
                 `permitq migrate` with this server's database URL (if permitq was migrated \
                 into another database, fix the URL instead)",
                state.client.database()
            ))
        }
        Err(e) => {
            return not_ready(format!(
                "database: {}",
                crate::error::one_line(&state.reader.said(&e))
            ))
        }
    }
    if let Some(worker) = &state.worker {
        if !worker.listener_connected() {
            return not_ready("the worker's LISTEN connection is down".into());
        }
        if let Some(age) = worker.pass_overdue() {
            return not_ready(format!(
                "no pass of this worker has completed for {}s: it grants nothing (its log says \
                 why: `pass failed` lines)",
                age.as_secs()
            ));
        }
        return (StatusCode::OK, "ready\n".to_string());
    }
    // `serve` is ready without workers, but says when nothing grants.
    match state.client.granting().await.map(|g| g.warning()) {
        Ok(Some(warning)) => (StatusCode::OK, format!("ready; {warning}\n")),
        Ok(None) => (StatusCode::OK, "ready\n".to_string()),
        Err(e) => not_ready(format!(
            "database: {}",
            crate::error::one_line(&state.reader.said(&e))
        )),
    }
}

async fn metrics(axum::extract::State(state): axum::extract::State<State>) -> Response {
    // The semaphores' series are written from the database at each scrape, not kept in the
    // registry: a template instance removed by the idle sweep leaves no series behind.
    let semaphores = match state.overview().await {
        Ok(overview) => {
            metrics::gauge!("permitq_database_up").set(1.0);
            semaphore_series(&overview.0, SystemTime::now())
        }
        Err(e) => {
            tracing::debug!(error = %e, "metrics: cannot read semaphore usage");
            metrics::gauge!("permitq_database_up").set(0.0);
            String::new()
        }
    };
    if let Some(worker) = &state.worker {
        let age = worker
            .last_pass()
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .map_or(-1.0, |d| d.as_secs_f64());
        metrics::gauge!("permitq_worker_last_pass_age_seconds").set(age);
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render() + &semaphores,
    )
        .into_response()
}

/// Each semaphore's series, in the Prometheus text format: one family after another, a sample
/// per semaphore that exists now.
fn semaphore_series(usage: &[permitq::SemaphoreUsage], now: SystemTime) -> String {
    type Value = fn(&permitq::SemaphoreUsage, SystemTime) -> f64;
    #[allow(clippy::cast_precision_loss, reason = "a sample is a float")]
    let families: [(&str, &str, &str, Value); 6] = [
        ("permitq_semaphore_capacity", "gauge",
         "How many permits the semaphore allows at once (per window, for a rate limit).",
         |s, _| s.capacity as f64),
        ("permitq_semaphore_used", "gauge",
         "The workers' running count of permits in use; may run ahead of held until releases are folded.",
         |s, _| s.used as f64),
        ("permitq_semaphore_held", "gauge", "Permits held now, exactly.", |s, _| s.held as f64),
        ("permitq_semaphore_waiting", "gauge", "Requests waiting on the semaphore.",
         |s, _| s.waiting as f64),
        ("permitq_semaphore_oldest_wait_seconds", "gauge",
         "How long the semaphore's oldest waiter has waited (0: none).",
         |s, now| s.oldest_wait_since.and_then(|t| now.duration_since(t).ok()).map_or(0.0, |d| d.as_secs_f64())),
        ("permitq_semaphore_grants_total", "counter",
         "Grants on the semaphore so far, read from the database.",
         |s, _| s.granted as f64),
    ];
    let mut out = String::new();
    for (name, kind, help, value) in families {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for s in usage {
            let label = s
                .name
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            out.push_str(&format!(
                "{name}{{semaphore=\"{label}\"}} {}\n",
                value(s, now)
            ));
        }
    }
    out
}
