//! Test support: one PostgreSQL per test binary (DATABASE_URL, or a throwaway cluster), a fresh
//! database per test cloned from a migrated template, in-process workers, and waiting on a
//! condition with a deadline.

use std::future::Future;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use permitq::{Client, Worker, WorkerConfig};
use tokio::sync::{watch, OnceCell};

use permitq_embedded_pg::{try_connect, EmbeddedPostgres};

/// The server all tests of this binary share: (admin URL, the cluster if we started it).
fn server() -> &'static (String, Option<EmbeddedPostgres>) {
    init_logging();
    static SERVER: OnceLock<(String, Option<EmbeddedPostgres>)> = OnceLock::new();
    SERVER.get_or_init(|| match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => (url, None),
        _ => {
            let pg = EmbeddedPostgres::start().expect("start a throwaway PostgreSQL");
            (pg.url("postgres"), Some(pg))
        }
    })
}

/// Worker logs in test output (shown for failing tests); RUST_LOG overrides the level.
pub fn init_logging() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("permitq=info"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_test_writer()
            .try_init();
    });
}

/// `url` with its database name replaced by `db`.
pub fn with_dbname(url: &str, db: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, format!("?{q}")),
        None => (url, String::new()),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part = match base[scheme_end..].find('/') {
        Some(i) => &base[..scheme_end + i],
        None => base,
    };
    format!("{host_part}/{db}{query}")
}

async fn template() -> &'static str {
    static TEMPLATE: OnceCell<String> = OnceCell::const_new();
    TEMPLATE
        .get_or_init(|| async {
            let admin = &server().0;
            let name = format!("permitq_template_{}", std::process::id());
            let conn = connect(admin).await;
            conn.batch_execute(&format!("DROP DATABASE IF EXISTS {name}"))
                .await
                .expect("drop template");
            conn.batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .expect("create template");
            let client = Client::connect(&with_dbname(admin, &name)).await.unwrap();
            client.migrate().await.expect("migrate template");
            drop(client);
            name
        })
        .await
}

/// `url` logging in as `user` with `password`.
pub fn as_user(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}:{password}@{host}")
}

/// The login a URL connects as; panics when it names none.
pub fn user_of(url: &str) -> String {
    url.parse::<tokio_postgres::Config>()
        .expect("a database URL")
        .get_user()
        .expect("a URL with a user")
        .to_string()
}

/// The database a URL names.
pub fn db_of(url: &str) -> String {
    url.parse::<tokio_postgres::Config>()
        .expect("a database URL")
        .get_dbname()
        .expect("a URL with a database")
        .to_string()
}

/// A plain connection (driven on a task); panics when it cannot connect.
pub async fn connect(url: &str) -> tokio_postgres::Client {
    try_connect(url).await.expect("connect")
}

/// A freshly migrated, empty database of its own.
#[derive(Debug)]
pub struct TestDb {
    /// Its URL.
    pub url: String,
    /// Its name.
    pub name: String,
}

impl TestDb {
    /// Creates it from the migrated template.
    pub async fn new() -> TestDb {
        let template = template().await;
        let name = format!("permitq_test_{}", uuid::Uuid::new_v4().simple());
        let admin = connect(&server().0).await;
        // A template must have no other sessions; retry while one lingers.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match admin
                .batch_execute(&format!("CREATE DATABASE {name} TEMPLATE {template}"))
                .await
            {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("create test database: {e}"),
            }
        }
        TestDb {
            url: with_dbname(&server().0, &name),
            name,
        }
    }

    /// An empty database of its own: not migrated.
    pub async fn empty() -> TestDb {
        let name = format!("permitq_test_{}", uuid::Uuid::new_v4().simple());
        connect(&server().0)
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create an empty test database");
        TestDb {
            url: with_dbname(&server().0, &name),
            name,
        }
    }

    /// The URL of a new login role that is a member of `role` (a permitq role), unique to
    /// this database, password `pw`.
    pub async fn login(&self, role: &str) -> String {
        let user = format!("{}_{}", role, &self.name[self.name.len() - 8..]);
        self.conn()
            .await
            .batch_execute(&format!(
                "CREATE ROLE {user} LOGIN PASSWORD 'pw' IN ROLE {role}"
            ))
            .await
            .expect("create a login role");
        as_user(&self.url, &user, "pw")
    }

    /// A [`Client`] on it.
    pub async fn client(&self) -> Client {
        Client::connect(&self.url).await.expect("client")
    }

    /// A plain connection to it.
    pub async fn conn(&self) -> tokio_postgres::Client {
        connect(&self.url).await
    }

    /// Starts an in-process worker; it stops when the handle is stopped or dropped.
    pub fn worker(&self, config: WorkerConfig) -> RunningWorker {
        RunningWorker::start(&self.url, config)
    }

    /// A worker with a long poll interval: only notifications wake it quickly.
    pub fn notified_worker(&self, id: &str) -> RunningWorker {
        self.worker(quiet_config(id))
    }
}

/// A worker config whose fallback poll is too slow to matter in a test.
pub fn quiet_config(id: &str) -> WorkerConfig {
    let mut config = WorkerConfig::default();
    config.id = id.to_string();
    config.poll_interval = Duration::from_secs(120);
    config.maintenance.sweep_interval = Duration::from_millis(200);
    config
}

/// An in-process worker; stops when [`RunningWorker::stop`]ped or dropped.
#[derive(Debug)]
pub struct RunningWorker {
    stop: watch::Sender<bool>,
    task: Option<tokio::task::JoinHandle<permitq::Result<()>>>,
    health: permitq::WorkerHealth,
}

impl RunningWorker {
    /// Starts a worker on `url`.
    pub fn start(url: &str, config: WorkerConfig) -> RunningWorker {
        let worker = Worker::connect(url, config).expect("worker");
        let health = worker.health();
        let (stop, mut rx) = watch::channel(false);
        let task = tokio::spawn(worker.run(async move {
            let _ = rx.wait_for(|s| *s).await;
        }));
        RunningWorker {
            stop,
            task: Some(task),
            health,
        }
    }

    /// Waits (at most 10 s) until the worker has completed a pass after `instant`.
    pub async fn wait_for_pass_after(&self, instant: std::time::SystemTime) {
        wait_until(Duration::from_secs(10), "a worker pass", || async {
            self.health.last_pass().is_some_and(|t| t > instant)
        })
        .await;
    }

    /// Stops it and waits (at most 10 s) for it to finish cleanly.
    pub async fn stop(mut self) {
        let _ = self.stop.send(true);
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("worker stops within 10s")
                .expect("worker task")
                .expect("worker result");
        }
    }
}

impl Drop for RunningWorker {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The semaphore named `name`, if it exists.
pub async fn semaphore(client: &Client, name: &str) -> Option<permitq::Semaphore> {
    client
        .semaphores()
        .await
        .expect("list semaphores")
        .into_iter()
        .find(|s| s.name == name)
}

/// Polls `cond` every 20 ms until it is true; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits up to 10 s for a request to leave `new` and returns its state then.
pub async fn settled_state(client: &Client, id: &str) -> permitq::State {
    client
        .wait_settled(id, Duration::from_secs(10))
        .await
        .unwrap()
        .expect("request exists")
        .state
}

/// The state (and error code or release reason) of a request.
pub async fn state_of(client: &Client, id: &str) -> String {
    match client.status(id).await.unwrap() {
        None => "unknown".into(),
        Some(r) => match (r.error_code, r.release_reason) {
            (Some(c), _) => format!("error/{c}"),
            (_, Some(reason)) => format!("released/{reason}"),
            _ => r.state.to_string(),
        },
    }
}

/// Invariants checked in one snapshot (capacity is never lowered in these tests): no semaphore
/// over capacity, `used` equal to the sum of acquired permits, and permits acquired exactly when
/// their request is.
pub async fn check_invariants(conn: &tokio_postgres::Client) -> Result<(), String> {
    let found = permitq_fleet::invariant_violations(conn, true)
        .await
        .map_err(|e| e.to_string())?;
    match found.first() {
        None => Ok(()),
        Some(first) => Err(first.clone()),
    }
}

/// The request ids in one `permitq_events` payload (a JSON array of ids); none if unreadable.
pub fn event_ids(payload: &str) -> Vec<i64> {
    serde_json::from_str(payload).unwrap_or_default()
}

/// The requests with these ids as `(id, external_id, state, release_reason)`, read as `conn`'s
/// login may: what a producer does after an event names its request.
pub async fn requests_by_id(
    conn: &tokio_postgres::Client,
    ids: &[i64],
) -> Vec<(i64, String, String, Option<String>)> {
    conn.query(
        "SELECT id, external_id, state::text, release_reason::text FROM permitq.permit_request
         WHERE id = ANY($1) ORDER BY id",
        &[&ids],
    )
    .await
    .expect("read requests by id")
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
    .collect()
}

/// How many requests are `new` and not examined by any worker yet.
pub async fn unexamined_requests(conn: &tokio_postgres::Client) -> i64 {
    conn.query_one(
        "SELECT count(*) FROM permitq.permit_request WHERE state = 'new' AND NOT examined",
        &[],
    )
    .await
    .expect("count the unexamined requests")
    .get(0)
}

/// Waits (at most 10 s) until the workers have folded every release into `used`, so `used` is
/// exact again (it may run ahead of the held count until then).
pub async fn wait_folded(url: &str) {
    let conn = connect(url).await;
    wait_until(
        Duration::from_secs(10),
        "releases folded into used",
        || async {
            conn.query_one(
                "SELECT NOT EXISTS (SELECT 1 FROM permitq.pending_release)",
                &[],
            )
            .await
            .map(|r| r.get::<_, bool>(0))
            .unwrap_or(false)
        },
    )
    .await;
}

/// Sends `signal` (`STOP`, `CONT`, `TERM`, ...) to process `pid`; panics if `kill` fails.
pub fn signal(pid: u32, signal: &str) {
    let ok = std::process::Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .status()
        .expect("run kill")
        .success();
    assert!(ok, "kill -{signal} {pid}");
}

/// True when another transaction holds the row lock of semaphore `name` (probed with NOWAIT,
/// rolled back).
pub async fn semaphore_locked(conn: &mut tokio_postgres::Client, name: &str) -> bool {
    let tx = conn.transaction().await.expect("begin");
    let locked = tx
        .query(
            "SELECT 1 FROM permitq.semaphore WHERE name = $1 FOR UPDATE NOWAIT",
            &[&name],
        )
        .await
        .is_err();
    tx.rollback().await.expect("rollback");
    locked
}

/// The notification payloads `rx` (from [`crate::listen`] on `channel`) received before a
/// marker this sends on `channel` through `listener` after everything else: what was sent
/// until now, nothing missed, no sleep (20 s at most).
pub async fn until_marker(
    listener: &tokio_postgres::Client,
    channel: &str,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<String>,
) -> Vec<String> {
    listener
        .batch_execute(&format!("NOTIFY {channel}, 'marker'"))
        .await
        .expect("send the marker");
    let mut got = Vec::new();
    loop {
        let payload = tokio::time::timeout(std::time::Duration::from_secs(20), rx.recv())
            .await
            .expect("the marker arrives")
            .expect("the listener is up");
        if payload == "marker" {
            return got;
        }
        got.push(payload);
    }
}
