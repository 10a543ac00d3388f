//! The worker: LISTENs for work, runs passes and grants what fits.
//!
//! A pass ([`batch`]) claims, in batches, what could be granted now: requests no worker has
//! examined yet, and the first waiters of semaphores that have room. A full semaphore costs a
//! pass nothing, however long its queue. Awake, the worker runs passes back to back while they
//! find work. When one finds nothing it goes to sleep by the protocol of
//! `permitq.wake_workers` (schema/functions/notifications.sql), so that producers NOTIFY only while some
//! worker sleeps: it records that it sleeps, waits until no producer that may have seen it awake
//! is still in flight (running passes meanwhile), runs one more pass, and only then waits for a
//! notification on `permitq_work`, a reconnect of the LISTEN connection, or the
//! `poll_interval` fallback.

mod batch;
mod health;
mod outage;

pub use health::WorkerHealth;
pub(crate) use outage::Outage;

use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio::sync::{watch, Notify};

use crate::db::Backoff;
use crate::error::{Error, Result};
use crate::listener::Listener;
use crate::maintenance::{self, MaintenanceConfig, OwnerLiveness};
use crate::sql;

/// How a worker runs. [`WorkerConfig::default`] matches the CLI defaults.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerConfig {
    /// Name in logs, `worker_id` and `application_name`.
    pub id: String,
    /// Requests claimed per transaction.
    pub batch_size: i64,
    /// Fallback pass interval when no notification arrives.
    pub poll_interval: Duration,
    /// `lock_timeout` of the worker's transactions; a timeout is retried.
    pub lock_timeout: Duration,
    /// `idle_in_transaction_session_timeout` of the worker's sessions: the longest a worker that
    /// stops answering in the middle of a batch (paused, partitioned) keeps its locks before the
    /// server ends its session. Its transactions never wait on the client for longer than a
    /// round trip, so the default 5 s is far from any healthy batch.
    pub idle_in_transaction_timeout: Duration,
    /// The sweeps and retention this worker runs beside its claim loop.
    pub maintenance: MaintenanceConfig,
}

impl WorkerConfig {
    /// Every value in range, or the first one that is not, by name.
    fn validate(&self) -> Result<()> {
        use crate::rules::duration_problem;
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(Error::invalid(
                "batch_size",
                format!("must be from 1 to 10000, got {}", self.batch_size),
            ));
        }
        let m = &self.maintenance;
        for (field, value) in [
            ("poll_interval", Some(self.poll_interval)),
            ("lock_timeout", Some(self.lock_timeout)),
            (
                "idle_in_transaction_timeout",
                Some(self.idle_in_transaction_timeout),
            ),
            ("sweep_interval", Some(m.sweep_interval)),
            ("max_hold", m.max_hold),
            ("retention", Some(m.retention)),
            ("audit_retention", Some(m.audit_retention)),
        ] {
            if let Some(problem) = duration_problem(value, false) {
                return Err(Error::invalid(field, problem));
            }
        }
        Ok(())
    }
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            id: format!("worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            lock_timeout: Duration::from_secs(1),
            idle_in_transaction_timeout: Duration::from_secs(5),
            maintenance: MaintenanceConfig::default(),
        }
    }
}

/// Counts of what one pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PassOutcome {
    /// Transactions run.
    pub batches: u64,
    /// Requests granted.
    pub granted: u64,
    /// Requests failed.
    pub errored: u64,
    /// Requests left waiting.
    pub waiting: u64,
    /// Requests examined for the first time and left waiting (they joined the queues).
    pub queued: u64,
}

impl PassOutcome {
    /// Whether the pass changed anything (then the next pass starts at once).
    pub(crate) fn did_work(&self) -> bool {
        self.granted + self.errored + self.queued > 0
    }

    fn add(&mut self, batch: PassOutcome) {
        self.batches += batch.batches;
        self.granted += batch.granted;
        self.errored += batch.errored;
        self.waiting += batch.waiting;
        self.queued += batch.queued;
    }
}

/// A worker. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct Worker {
    pool: Pool,
    listen_config: tokio_postgres::Config,
    config: Arc<WorkerConfig>,
    liveness: Option<Arc<dyn OwnerLiveness>>,
    /// When this worker (or a clone) last ran a fold-only transaction, and whether one is owed.
    fold_clock: Arc<std::sync::Mutex<batch::FoldClock>>,
    health: WorkerHealth,
    /// The database being unreachable, as all its tasks saw it.
    outage: Arc<Outage>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("config", &self.config)
            .field("liveness_hook", &self.liveness.is_some())
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker over `pool` that LISTENs through its own connection made from `listen_config`.
    /// The pool's connections should carry the settings [`Worker::connect`] gives them
    /// (`lock_timeout`, `idle_in_transaction_session_timeout`) in their `options`.
    fn new(pool: Pool, listen_config: tokio_postgres::Config, config: WorkerConfig) -> Worker {
        let health = WorkerHealth::for_poll_interval(config.poll_interval);
        Worker {
            pool,
            listen_config,
            config: Arc::new(config),
            liveness: None,
            fold_clock: Arc::default(),
            health,
            outage: Arc::default(),
        }
    }

    /// Connects a worker to `url`: a pool of 4 connections with `lock_timeout`,
    /// `idle_in_transaction_session_timeout` and no parallel query, and a LISTEN connection;
    /// all of them with server-side keepalives and `application_name` = `permitq <id>`.
    pub fn connect(url: &str, config: WorkerConfig) -> Result<Worker> {
        config.validate()?;
        let mut listen = crate::db::parse_config(url)?;
        listen.application_name(format!("permitq {}", config.id));
        let keepalives: Vec<(&str, String)> = crate::db::SERVER_KEEPALIVES
            .iter()
            .map(|(name, value)| (*name, (*value).to_string()))
            .collect();
        let listen = crate::db::with_settings(listen, &keepalives);
        let pooled = crate::db::with_settings(
            listen.clone(),
            &[
                (
                    "lock_timeout",
                    format!("{}ms", config.lock_timeout.as_millis()),
                ),
                (
                    "idle_in_transaction_session_timeout",
                    format!("{}ms", config.idle_in_transaction_timeout.as_millis()),
                ),
                // Every statement of a pass is small and index-driven; a parallel plan (chosen
                // on stale statistics after a burst) only adds the launch of parallel workers.
                ("max_parallel_workers_per_gather", "0".to_string()),
            ],
        );
        Ok(Worker::new(crate::db::pool(pooled, 4)?, listen, config))
    }

    /// Installs the owner-liveness hook, asked during each sweep which owners are gone.
    #[must_use]
    pub fn with_owner_liveness(mut self, hook: Arc<dyn OwnerLiveness>) -> Worker {
        self.liveness = Some(hook);
        self
    }

    /// A live view of this worker's health (listener connected, last pass), to read while
    /// [`Worker::run`] runs.
    pub fn health(&self) -> WorkerHealth {
        self.health.clone()
    }

    /// The configuration.
    pub fn config(&self) -> &WorkerConfig {
        &self.config
    }

    /// Deletes settled requests past [`MaintenanceConfig::retention`] and capacity audit rows
    /// past [`MaintenanceConfig::audit_retention`] now, in batches of 1,000 rows per
    /// transaction, as the running worker does every sweep interval. Returns (requests, audit
    /// rows) deleted.
    pub async fn run_retention_once(&self) -> Result<(u64, u64)> {
        let skips = maintenance::Skips::default();
        maintenance::retention_once(&self.pool, &self.config.maintenance, None, &skips).await
    }

    /// Runs until `shutdown` resolves, then finishes the transaction in flight and returns.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        self.config.validate()?;
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });

        // Tokens never go backwards: past every token issued, should this cluster have been
        // restored or upgraded (grants also check the timeline themselves). First: a login that
        // may not work is told so once, and the worker stops, rather than fail every pass.
        match self.pool.get().await {
            Ok(conn) => {
                if let Ok(row) = conn.query_one(sql::MAY_WORK, &[]).await {
                    let (may_work, login): (bool, String) = (row.get(0), row.get(1));
                    if !may_work {
                        return Err(Error::config(format!(
                            "the login {login} is not a permitq worker: a worker needs the role \
                             permitq_worker (GRANT permitq_worker TO {login}, run by a superuser, \
                             a CREATEROLE login, or one that has it with ADMIN OPTION), or run it \
                             with a worker login (or the login that ran `permitq migrate`)"
                        )));
                    }
                }
                if let Err(e) = conn.execute(sql::RAISE_TOKEN_EPOCH, &[]).await {
                    tracing::warn!(error = %Error::from(e), "could not check the fencing token epoch at start-up");
                }
            }
            Err(e) => {
                tracing::warn!(error = %Error::from(e), "could not check the fencing token epoch at start-up")
            }
        }
        let listener = Listener::start(self.listen_config.clone(), &[sql::WORK_CHANNEL]);
        let wake = Arc::new(Notify::new());
        let mut events = listener.subscribe();
        let listener_state = {
            let (health, mut connected) = (self.health.clone(), listener.connected());
            tokio::spawn(async move {
                loop {
                    let now = *connected.borrow_and_update();
                    health.set_listener_connected(now);
                    metrics::gauge!("permitq_worker_listener_connected")
                        .set(f64::from(u8::from(now)));
                    if connected.changed().await.is_err() {
                        break;
                    }
                }
            })
        };
        let forward = {
            let wake = wake.clone();
            tokio::spawn(async move {
                // Every event (a notification, a reconnect, or lag) means: run a full pass.
                while let Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) =
                    events.recv().await
                {
                    wake.notify_one();
                }
            })
        };
        let maintenance_config = Arc::new(self.config.maintenance.clone());
        let sweeper = tokio::spawn(maintenance::run_sweeps(
            self.pool.clone(),
            maintenance_config.clone(),
            self.liveness.clone(),
            self.outage.clone(),
            stop.clone(),
        ));
        let adapter = tokio::spawn(maintenance::run_adaptive(
            self.pool.clone(),
            maintenance_config.clone(),
            self.outage.clone(),
            stop.clone(),
        ));
        let cleaner = tokio::spawn(maintenance::run_retention(
            self.pool.clone(),
            maintenance_config,
            self.outage.clone(),
            stop.clone(),
        ));
        let seen = tokio::spawn(self.clone().say_alive(stop.clone()));

        tracing::info!(
            worker = %self.config.id,
            "worker started on {}",
            crate::db::place(&self.listen_config)
        );
        self.claim_loop(&wake, stop.clone()).await;

        forward.abort();
        listener_state.abort();
        drop(listener);
        let _ = sweeper.await;
        let _ = cleaner.await;
        let _ = adapter.await;
        let _ = seen.await;
        tracing::info!(worker = %self.config.id, "worker stopped");
        Ok(())
    }

    async fn claim_loop(&self, wake: &Notify, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(2));
        // When this worker last wrote `sleeping = true`; None while it is awake.
        let mut asleep_since: Option<Instant> = None;
        while !*stop.borrow() {
            let began = Instant::now();
            match self.step(wake, &mut stop, &mut asleep_since).await {
                Ok(()) => {
                    backoff.reset();
                    self.health.pass_done();
                    self.outage.succeeded(began);
                }
                Err(e) => {
                    metrics::counter!("permitq_failed_passes_total").increment(1);
                    let delay = backoff.next_delay();
                    if self.outage.failed("grant passes", &e) {
                        // Counted in the outage, which logs its start and end once.
                    } else if e.is_missing_schema() || !e.is_retryable() {
                        tracing::error!(error = %e, "pass failed; retrying in {delay:?}");
                    } else {
                        tracing::warn!(error = %e, "pass failed; retrying in {delay:?}");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = stop.changed() => {}
                    }
                }
            }
        }
        if let Ok(conn) = self.pool.get().await {
            let _ = conn.execute(sql::WORKER_GONE, &[&self.config.id]).await;
        }
    }

    /// Writes this worker's row of `permitq.worker_seen` every [`SEEN_EVERY`] until `stop`, so
    /// that readers can tell that something is granting (schema/functions/workers.sql).
    async fn say_alive(self, stop: watch::Receiver<bool>) {
        // Live for 8 s past the last sign of life (what `explain` tells a user, functions/explain.sql).
        let live_for = sql::interval(SEEN_EVERY * 3 + Duration::from_secs(2));
        let host = host_name();
        let version = env!("CARGO_PKG_VERSION").to_string();
        let pid = i32::try_from(std::process::id()).unwrap_or(i32::MAX);
        let max_hold = self.config.maintenance.max_hold.map(sql::interval);
        maintenance::every(SEEN_EVERY, stop, move || {
            let worker = self.clone();
            let (host, version, live_for) = (host.clone(), version.clone(), live_for.clone());
            let max_hold = max_hold.clone();
            Box::pin(async move {
                let began = Instant::now();
                let written = async {
                    worker
                        .pool
                        .get()
                        .await?
                        .execute(
                            sql::WORKER_SEEN,
                            &[
                                &worker.config.id,
                                &host,
                                &version,
                                &pid,
                                &live_for,
                                &max_hold,
                            ],
                        )
                        .await?;
                    Ok::<_, Error>(())
                };
                match written.await {
                    Ok(()) => worker.outage.succeeded(began),
                    Err(e) if worker.outage.failed("liveness updates", &e) => {}
                    Err(e) => tracing::warn!(error = %e, "could not record that this worker runs"),
                }
            })
        })
        .await;
    }

    /// One round of the claim loop: a pass; when it found nothing, the way to sleep.
    async fn step(
        &self,
        wake: &Notify,
        stop: &mut watch::Receiver<bool>,
        asleep_since: &mut Option<Instant>,
    ) -> Result<()> {
        if self.pass_did_work(stop, asleep_since).await? {
            return Ok(());
        }
        if asleep_since.is_none() {
            // Just out of work: under load the next request is a moment away. Look for it
            // cheaply for a while before going to sleep (when producers would have to notify).
            let until = Instant::now() + LINGER;
            while Instant::now() < until && !*stop.borrow() {
                tokio::time::sleep(BUSY_POLL).await;
                if self.work_waiting().await? {
                    return Ok(());
                }
            }
        }
        match asleep_since {
            None => {
                // From this commit on, producers NOTIFY.
                self.set_sleeping(true).await?;
                *asleep_since = Some(Instant::now());
                // A producer that read `sleeping = false` holds the wake key until its commit
                // is visible. While one is in flight, poll with passes instead of sleeping,
                // backing off to the poll interval: a producer that keeps its transaction open
                // costs a pass a second, not a thousand. Producers after the commit above
                // notify, which ends a pause at once.
                let mut pause = BUSY_POLL;
                while !self.wake_gate_free().await? {
                    // A fold owed soon (a pass deferred one) ends the pause sooner; one already
                    // due is the next pass's, which follows the pause either way.
                    let until = self
                        .fold_owed_in()
                        .filter(|fold_in| !fold_in.is_zero())
                        .map_or(pause, |fold_in| pause.min(fold_in));
                    tokio::select! {
                        _ = wake.notified() => {}
                        _ = tokio::time::sleep(until) => {}
                        _ = stop.changed() => {}
                    }
                    pause = (pause * 2).min(self.config.poll_interval);
                    if *stop.borrow() || self.pass_did_work(stop, asleep_since).await? {
                        return Ok(());
                    }
                }
                // Every producer that saw this worker awake has committed: this pass sees it.
                if self.pass_did_work(stop, asleep_since).await? {
                    return Ok(());
                }
            }
            // Still asleep: say so again before the row's `awake_by` runs out.
            Some(since) if since.elapsed() >= self.config.poll_interval => {
                self.set_sleeping(true).await?;
                *asleep_since = Some(Instant::now());
            }
            Some(_) => {}
        }
        // Releases that did not notify, counting on a fold that may have run before they
        // committed: owed a fold if any is left (see check_folds).
        self.check_folds().await?;
        // Waiters on a rate-limited semaphore can go when its window slides: no notification
        // says so, so the nap ends then at the latest. A fold owed (deferred by the last pass,
        // or by the check above) ends it too.
        let mut nap = match self.next_window_opening().await? {
            Some(opens_in) => opens_in.min(self.config.poll_interval),
            None => self.config.poll_interval,
        };
        if let Some(fold_in) = self.fold_owed_in() {
            nap = nap.min(fold_in);
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(nap) => {}
            _ = stop.changed() => {}
        }
        Ok(())
    }

    /// How long until the next window of a rate-limited semaphore that has waiters opens.
    async fn next_window_opening(&self) -> Result<Option<Duration>> {
        let conn = self.pool.get().await?;
        let statement = conn.prepare_cached(sql::NEXT_WINDOW_OPENING).await?;
        let seconds: Option<f64> = conn.query_one(&statement, &[]).await?.get(0);
        // A few ms late rather than early: at the opening the grant still counts.
        Ok(seconds.map(|s| Duration::from_secs_f64(s.max(0.0)) + Duration::from_millis(5)))
    }

    /// Runs a pass; when it did work and this worker was asleep, records that it is awake (so
    /// producers stop notifying). A spurious wake-up writes nothing.
    async fn pass_did_work(
        &self,
        stop: &watch::Receiver<bool>,
        asleep_since: &mut Option<Instant>,
    ) -> Result<bool> {
        let did_work = self.run_pass(stop).await?.did_work();
        if did_work && asleep_since.is_some() {
            self.set_sleeping(false).await?;
            *asleep_since = None;
        }
        Ok(did_work)
    }

    /// Records whether this worker sleeps. A sleeping worker's row counts until
    /// `2 × poll_interval + 10s` from now: it wakes by then and writes it again, unless it died.
    async fn set_sleeping(&self, sleeping: bool) -> Result<()> {
        let awake_by = sql::interval(self.config.poll_interval * 2 + Duration::from_secs(10));
        self.pool
            .get()
            .await?
            .execute(
                sql::WORKER_SLEEPING,
                &[&self.config.id, &sleeping, &awake_by],
            )
            .await?;
        Ok(())
    }

    /// Whether anything may be waiting for a worker: an unexamined request or a release to fold
    /// (one cheap statement, no transaction).
    async fn work_waiting(&self) -> Result<bool> {
        let conn = self.pool.get().await?;
        let probe = conn.prepare_cached(sql::WORK_WAITING).await?;
        Ok(conn.query_one(&probe, &[]).await?.get(0))
    }

    /// Whether no producer that may have seen this worker awake is still in flight.
    async fn wake_gate_free(&self) -> Result<bool> {
        Ok(self
            .pool
            .get()
            .await?
            .query_one(sql::WAKE_GATE_FREE, &[])
            .await?
            .get(0))
    }
}

/// How often a worker writes its liveness row (`permitq.worker_seen`); it counts as running for
/// three times that, plus 2 s.
pub(crate) const SEEN_EVERY: Duration = Duration::from_secs(2);

/// This machine's name, for the liveness row (`unknown` where the kernel does not say).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// How often a worker that would sleep looks for work while producers are still in flight.
const BUSY_POLL: Duration = Duration::from_millis(1);

/// How long a worker that just ran out of work keeps looking (every [`BUSY_POLL`]) before it
/// goes to sleep.
const LINGER: Duration = Duration::from_millis(20);
