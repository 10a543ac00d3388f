//! The worker: LISTENs for work, walks the queue in passes and grants what fits.
//!
//! A pass walks pending requests in id order from cursor 0 in batches. Each batch is one
//! transaction: claim up to `batch_size` rows after the cursor (`FOR UPDATE SKIP LOCKED`, lock
//! order step 1), lock the union of their semaphores in id order (step 2), read the heads of the
//! fair ones, [`decide`], write the outcome set-based and commit. The cursor then moves to the
//! batch's last id: rows another worker held are left behind (a line in the sand). A pass that
//! granted or failed anything starts again from 0 at once, because capacity or heads may have
//! changed for rows it passed; a pass that did nothing sleeps until a notification on
//! `permitq_work`, a reconnect of the LISTEN connection, or the `poll_interval` fallback.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio::sync::{watch, Notify};
use tracing::Instrument;

use crate::db::Backoff;
use crate::decision::{decide, Candidate, SemaphoreView, Verdict, Waiter};
use crate::error::Result;
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
    /// The sweeps and retention this worker runs beside its claim loop.
    pub maintenance: MaintenanceConfig,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            id: format!("worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]),
            batch_size: 100,
            poll_interval: Duration::from_secs(1),
            lock_timeout: Duration::from_secs(1),
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
}

impl PassOutcome {
    /// Whether the pass changed anything (then the next pass starts at once).
    pub(crate) fn did_work(&self) -> bool {
        self.granted + self.errored > 0
    }
}

/// A worker. Cheap to clone; clones share the pool.
#[derive(Clone)]
pub struct Worker {
    pool: Pool,
    listen_config: tokio_postgres::Config,
    config: Arc<WorkerConfig>,
    liveness: Option<Arc<dyn OwnerLiveness>>,
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
    /// A worker over `pool` (its connections should carry the worker's settings, see
    /// [`crate::db::with_settings`]) that LISTENs through its own connection made from
    /// `listen_config`.
    pub fn new(pool: Pool, listen_config: tokio_postgres::Config, config: WorkerConfig) -> Worker {
        Worker {
            pool,
            listen_config,
            config: Arc::new(config),
            liveness: None,
        }
    }

    /// Connects a worker to `url`: a pool of 4 connections with `lock_timeout` and
    /// `idle_in_transaction_session_timeout` set, and `application_name` = the worker id.
    pub fn connect(url: &str, config: WorkerConfig) -> Result<Worker> {
        let mut base = crate::db::parse_config(url)?;
        base.application_name(format!("permitq {}", config.id));
        let pooled = crate::db::with_settings(
            base.clone(),
            &[
                (
                    "lock_timeout",
                    format!("{}ms", config.lock_timeout.as_millis()),
                ),
                ("idle_in_transaction_session_timeout", "30s".to_string()),
            ],
        );
        Ok(Worker::new(crate::db::pool(pooled, 4)?, base, config))
    }

    /// Installs the owner-liveness hook, asked during each sweep which owners are gone.
    #[must_use]
    pub fn with_owner_liveness(mut self, hook: Arc<dyn OwnerLiveness>) -> Worker {
        self.liveness = Some(hook);
        self
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
        maintenance::retention_once(&self.pool, &self.config.maintenance, None).await
    }

    /// Runs until `shutdown` resolves, then finishes the transaction in flight and returns.
    pub async fn run(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<()> {
        let (stop_tx, stop) = watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });

        let listener = Listener::start(self.listen_config.clone(), &[sql::WORK_CHANNEL]);
        let wake = Arc::new(Notify::new());
        let mut events = listener.subscribe();
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
        let sweeper = tokio::spawn(maintenance::run_sweeps(
            self.pool.clone(),
            Arc::new(self.config.maintenance.clone()),
            self.liveness.clone(),
            stop.clone(),
        ));
        let cleaner = tokio::spawn(maintenance::run_retention(
            self.pool.clone(),
            Arc::new(self.config.maintenance.clone()),
            stop.clone(),
        ));

        tracing::info!(worker = %self.config.id, "worker started");
        self.claim_loop(&wake, stop.clone()).await;

        forward.abort();
        drop(listener);
        let _ = sweeper.await;
        let _ = cleaner.await;
        tracing::info!(worker = %self.config.id, "worker stopped");
        Ok(())
    }

    async fn claim_loop(&self, wake: &Notify, mut stop: watch::Receiver<bool>) {
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(2));
        while !*stop.borrow() {
            match self.run_pass(&stop).await {
                Ok(outcome) => {
                    backoff.reset();
                    if outcome.did_work() {
                        continue;
                    }
                    tokio::select! {
                        _ = wake.notified() => {}
                        _ = tokio::time::sleep(self.config.poll_interval) => {}
                        _ = stop.changed() => {}
                    }
                }
                Err(e) => {
                    let delay = backoff.next_delay();
                    if e.is_missing_schema() || !e.is_retryable() {
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
    }

    /// Runs one full pass from id 0, retrying each batch on transient errors. Stops early when
    /// `stop` becomes true (between transactions, never inside one).
    pub(crate) async fn run_pass(&self, stop: &watch::Receiver<bool>) -> Result<PassOutcome> {
        let span = tracing::debug_span!("pass", worker = %self.config.id);
        async {
            let started = Instant::now();
            let mut total = PassOutcome::default();
            let mut cursor = 0i64;
            while !*stop.borrow() {
                let Some((last_id, outcome)) = self.run_batch_retrying(cursor).await? else {
                    break;
                };
                cursor = last_id;
                total.batches += 1;
                total.granted += outcome.granted;
                total.errored += outcome.errored;
                total.waiting += outcome.waiting;
            }
            metrics::histogram!("permitq_pass_seconds").record(started.elapsed().as_secs_f64());
            tracing::debug!(?total, elapsed = ?started.elapsed(), "pass done");
            Ok(total)
        }
        .instrument(span)
        .await
    }

    async fn run_batch_retrying(&self, cursor: i64) -> Result<Option<(i64, PassOutcome)>> {
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(500));
        loop {
            match self.run_batch(cursor).await {
                Err(e) if e.is_retryable() && backoff.attempts() < 8 => {
                    metrics::counter!("permitq_batch_retries_total").increment(1);
                    tracing::debug!(error = %e, "batch failed; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                other => return other,
            }
        }
    }

    /// One batch transaction. Returns `None` when nothing is pending after `cursor`.
    async fn run_batch(&self, cursor: i64) -> Result<Option<(i64, PassOutcome)>> {
        let started = Instant::now();
        let mut conn = self.pool.get().await?;
        let tx = conn.transaction().await?;

        let claimed = tx
            .query(sql::CLAIM_BATCH, &[&cursor, &self.config.batch_size])
            .await?;
        let Some(last) = claimed.last() else {
            tx.commit().await?;
            return Ok(None);
        };
        let last_id: i64 = last.try_get("id")?;
        let mut candidates = Vec::with_capacity(claimed.len());
        let mut unexamined = BTreeSet::new();
        let mut ages = BTreeMap::new();
        for row in &claimed {
            let id: i64 = row.try_get("id")?;
            let permits: serde_json::Value = row.try_get("permits")?;
            let permits = crate::db::permits_from_json(&permits);
            if !row.try_get::<_, bool>("examined")? {
                unexamined.insert(id);
            }
            ages.insert(id, row.try_get::<_, f64>("age_seconds")?);
            candidates.push(Candidate {
                id,
                permits,
                fail_fast: row.try_get("fail_fast")?,
                deadline_passed: row.try_get("deadline_passed")?,
            });
        }
        let names: Vec<&str> = candidates
            .iter()
            .flat_map(|c| c.permits.iter().map(|(n, _)| n.as_str()))
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();

        let mut semaphores = BTreeMap::new();
        let mut semaphore_ids = Vec::new();
        for row in tx.query(sql::LOCK_SEMAPHORES, &[&names]).await? {
            semaphore_ids.push(row.try_get::<_, i64>("id")?);
            semaphores.insert(
                row.try_get::<_, String>("name")?,
                SemaphoreView {
                    capacity: row.try_get::<_, i32>("capacity")?.into(),
                    used: row.try_get::<_, i32>("used")?.into(),
                    fair: row.try_get("fair")?,
                    head: None,
                },
            );
        }
        let batch_ids: Vec<i64> = candidates.iter().map(|c| c.id).collect();
        if semaphores.values().any(|s| s.fair) {
            for row in tx
                .query(
                    sql::SEMAPHORE_HEADS,
                    &[&semaphore_ids, &batch_ids, &last_id],
                )
                .await?
            {
                let name: String = row.try_get(0)?;
                let waiter = Waiter {
                    request_id: row.try_get(1)?,
                    count: row.try_get::<_, i32>(2)?.into(),
                };
                if let Some(s) = semaphores.get_mut(&name) {
                    if s.head.is_none_or(|h| waiter.request_id < h.request_id) {
                        s.head = Some(waiter);
                    }
                }
            }
        }

        let decision = decide(&semaphores, &candidates);
        let granted = decision.ids(|v| *v == Verdict::Grant);
        let (mut errored, mut codes) = (Vec::new(), Vec::new());
        for (id, v) in &decision.verdicts {
            if let Verdict::Fail(code) = v {
                errored.push(*id);
                codes.push(code.as_str());
            }
        }
        let waiting: Vec<i64> = decision
            .ids(|v| *v == Verdict::Wait)
            .into_iter()
            .filter(|id| unexamined.contains(id))
            .collect();
        if !granted.is_empty() || !errored.is_empty() || !waiting.is_empty() {
            tx.execute(
                sql::APPLY_DECISION,
                &[&self.config.id, &granted, &errored, &codes, &waiting],
            )
            .await?;
        }
        tx.commit().await?;

        let outcome = PassOutcome {
            batches: 1,
            granted: granted.len() as u64,
            errored: errored.len() as u64,
            waiting: (candidates.len() - granted.len() - errored.len()) as u64,
        };
        metrics::histogram!("permitq_batch_seconds").record(started.elapsed().as_secs_f64());
        metrics::counter!("permitq_grants_total").increment(outcome.granted);
        for id in &granted {
            metrics::histogram!("permitq_grant_wait_seconds").record(ages[id]);
        }
        for code in &codes {
            metrics::counter!("permitq_request_errors_total", "code" => *code).increment(1);
        }
        tracing::trace!(?outcome, "batch committed");
        Ok(Some((last_id, outcome)))
    }
}
