//! Maintenance the workers run beside the claim loop: the sweeps (wait deadlines, expired
//! leases, `--max-hold`, the owner-liveness hook) and retention.
//!
//! Every sweep runs in its own transaction holding its task's turn (a row of
//! `permitq.maintenance_turn`, locked FOR UPDATE SKIP LOCKED: only roles of the permitq schema can
//! take one), so with N workers one of them does each sweep at a time; the others skip it. Skips
//! are counted (`permitq_maintenance_skipped_total`), and a task skipped for longer than
//! [`SKIPPED_TOO_LONG`] sweep intervals is logged at warn. Each sweep is also safe to
//! run twice: it locks its rows `FOR UPDATE SKIP LOCKED`, re-checks its condition on the locked
//! version and releases through `permitq.release_locked`, which takes the semaphore locks in id
//! order.

use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use futures_util::future::BoxFuture;
use tokio::sync::watch;

use crate::error::Result;
use crate::sql;
use crate::worker::Outage;

/// How the maintenance beside each worker runs: the sweeps and retention. Part of
/// [`crate::WorkerConfig`]; [`MaintenanceConfig::default`] matches the CLI defaults.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MaintenanceConfig {
    /// How often wait deadlines, leases and `max_hold` are enforced.
    pub sweep_interval: Duration,
    /// Release anything held longer than this (`stale`). Off when `None`.
    pub max_hold: Option<Duration>,
    /// Delete settled requests older than this.
    pub retention: Duration,
    /// Delete capacity audit rows older than this.
    pub audit_retention: Duration,
    /// Remove instances of templates that held nothing, had nobody waiting and saw no grant or
    /// release for this long (they are made again when named).
    pub idle_instance_after: Duration,
    /// How often the workers set adaptive semaphores' capacities from their reports.
    pub adaptive_cadence: Duration,
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        MaintenanceConfig {
            sweep_interval: Duration::from_secs(1),
            max_hold: None,
            retention: Duration::from_secs(7 * 24 * 3600),
            audit_retention: Duration::from_secs(30 * 24 * 3600),
            idle_instance_after: Duration::from_secs(3600),
            adaptive_cadence: Duration::from_secs(1),
        }
    }
}

/// Rows per sweep or retention transaction.
pub(crate) const SWEEP_BATCH: i32 = 1000;

/// Pause between two full retention batches, so that a large cleanup yields the CPU and the
/// disk to production traffic instead of running flat out (measured by `permitq bench`).
pub(crate) const RETENTION_PAUSE: Duration = Duration::from_millis(20);

/// The answer to "which of these owners are gone?", for holders whose death the database cannot
/// see by itself (a job orchestrator knows a job ended, a cluster manager knows a node left).
/// Their requests are released with `release_reason = 'revoked'`.
///
/// ```
/// use futures_util::future::BoxFuture;
/// struct Finished(Vec<String>);
/// impl permitq::OwnerLiveness for Finished {
///     fn dead_owners<'a>(&'a self, owners: &'a [String]) -> BoxFuture<'a, Vec<String>> {
///         Box::pin(async move { owners.iter().filter(|o| self.0.contains(o)).cloned().collect() })
///     }
/// }
/// ```
pub trait OwnerLiveness: Send + Sync + 'static {
    /// Of `owners` (each owner of a held request, once), the ones that are dead.
    fn dead_owners<'a>(&'a self, owners: &'a [String]) -> BoxFuture<'a, Vec<String>>;
}

/// The maintenance tasks, one turn (a row of `permitq.maintenance_turn`) each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Task {
    WaitDeadlines,
    Expired,
    Stale,
    Liveness,
    Retention,
    AuditRetention,
    IdleInstances,
}

impl Task {
    /// Its row's key.
    fn name(self) -> &'static str {
        match self {
            Task::WaitDeadlines => "wait_deadlines",
            Task::Expired => "expired",
            Task::Stale => "stale",
            Task::Liveness => "liveness",
            Task::Retention => "retention",
            Task::AuditRetention => "audit_retention",
            Task::IdleInstances => "idle_instances",
        }
    }
}

/// After how many sweep intervals of skipping a task in a row a worker warns.
const SKIPPED_TOO_LONG: u32 = 5;

/// Since when each task was skipped without a break, because another session held its turn.
#[derive(Debug, Default)]
pub(crate) struct Skips {
    since: std::sync::Mutex<std::collections::HashMap<Task, std::time::Instant>>,
}

impl Skips {
    fn record(&self, task: Task, ran: bool, interval: Duration) {
        let mut since = self
            .since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if ran {
            since.remove(&task);
            return;
        }
        metrics::counter!("permitq_maintenance_skipped_total", "task" => task.name()).increment(1);
        let first = *since.entry(task).or_insert_with(std::time::Instant::now);
        let skipped = first.elapsed();
        if skipped > interval * SKIPPED_TOO_LONG {
            tracing::warn!(
                task = task.name(),
                skipped_for_s = skipped.as_secs_f64(),
                "maintenance task skipped: another session holds its turn (a row of \
                 permitq.maintenance_turn) all this time; a worker stuck in it, or a session \
                 of a permitq role holding the row, stops it"
            );
        }
    }
}

/// What one round of sweeps did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SweepOutcome {
    /// Waiting requests failed with `timeout`.
    pub timed_out: u64,
    /// Leases released as `expired`.
    pub expired: u64,
    /// Requests released as `stale`.
    pub stale: u64,
    /// Requests of dead owners released as `revoked`.
    pub revoked: u64,
}

/// Takes the task's turn for this transaction; false when another session holds it.
async fn take_turn(tx: &deadpool_postgres::Transaction<'_>, task: Task) -> Result<bool> {
    Ok(tx.query_one(sql::TAKE_TURN, &[&task.name()]).await?.get(0))
}

/// Runs one batch of a sweep in its task's turn. `None`: another session holds the turn.
async fn locked_batch(
    pool: &Pool,
    lock: Task,
    query: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<u64>> {
    let mut conn = pool.get().await?;
    let tx = conn.transaction().await?;
    if !take_turn(&tx, lock).await? {
        return Ok(None);
    }
    let n: i32 = tx.query_one(query, params).await?.get(0);
    if n > 0 && tracing::enabled!(tracing::Level::DEBUG) {
        // Name what this transaction swept (a scan: debug level only).
        for row in tx.query(sql::SWEPT_REQUESTS, &[]).await? {
            let (external_id, state, detail): (String, String, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            tracing::debug!(%external_id, %state, detail = detail.as_deref().unwrap_or(""), "swept");
        }
    }
    tx.commit().await?;
    Ok(Some(u64::try_from(n).unwrap_or(0)))
}

/// How a sweep runs: its task, statement and parameters, between-batch pause and stop signal.
struct Sweep<'a> {
    task: Task,
    query: &'a str,
    params: &'a [&'a (dyn tokio_postgres::types::ToSql + Sync)],
    stop: Option<&'a watch::Receiver<bool>>,
    pause: Duration,
}

impl<'a> Sweep<'a> {
    /// A sweep whose batches run back to back.
    fn new(
        task: Task,
        query: &'a str,
        params: &'a [&'a (dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Sweep<'a> {
        Sweep {
            task,
            query,
            params,
            stop: None,
            pause: Duration::ZERO,
        }
    }

    /// The same, pausing [`RETENTION_PAUSE`] between batches and stopping on `stop`.
    fn paced(mut self, stop: Option<&'a watch::Receiver<bool>>) -> Sweep<'a> {
        self.stop = stop;
        self.pause = RETENTION_PAUSE;
        self
    }
}

/// Runs a sweep in batches until a batch comes back short (or its turn is taken), pausing
/// between batches; records in `skips` whether it got its turn.
async fn sweep_all(
    pool: &Pool,
    sweep: Sweep<'_>,
    skips: &Skips,
    interval: Duration,
) -> Result<u64> {
    let mut total = 0;
    let mut ran = false;
    while let Some(n) = locked_batch(pool, sweep.task, sweep.query, sweep.params).await? {
        ran = true;
        total += n;
        if n < SWEEP_BATCH as u64 || sweep.stop.is_some_and(|s| *s.borrow()) {
            break;
        }
        tokio::time::sleep(sweep.pause).await;
    }
    skips.record(sweep.task, ran, interval);
    Ok(total)
}

/// One round of the lease and deadline sweeps.
pub(crate) async fn sweep_once(
    pool: &Pool,
    config: &MaintenanceConfig,
    liveness: Option<&dyn OwnerLiveness>,
    skips: &Skips,
) -> Result<SweepOutcome> {
    let interval = config.sweep_interval;
    let mut out = SweepOutcome {
        timed_out: sweep_all(
            pool,
            Sweep::new(
                Task::WaitDeadlines,
                sql::SWEEP_WAIT_DEADLINES,
                &[&SWEEP_BATCH],
            ),
            skips,
            interval,
        )
        .await?,
        expired: sweep_all(
            pool,
            Sweep::new(Task::Expired, sql::SWEEP_EXPIRED, &[&SWEEP_BATCH]),
            skips,
            interval,
        )
        .await?,
        ..SweepOutcome::default()
    };
    if let Some(max_hold) = config.max_hold {
        let max_hold = sql::interval(max_hold);
        out.stale = sweep_all(
            pool,
            Sweep::new(Task::Stale, sql::SWEEP_STALE, &[&max_hold, &SWEEP_BATCH]),
            skips,
            interval,
        )
        .await?;
    }
    if let Some(hook) = liveness {
        out.revoked = sweep_dead_owners(pool, hook, skips, interval).await?;
    }
    metrics::counter!("permitq_timeouts_total").increment(out.timed_out);
    for (reason, n) in [
        ("expired", out.expired),
        ("stale", out.stale),
        ("revoked", out.revoked),
    ] {
        metrics::counter!("permitq_sweep_released_total", "reason" => reason).increment(n);
    }
    Ok(out)
}

async fn sweep_dead_owners(
    pool: &Pool,
    hook: &dyn OwnerLiveness,
    skips: &Skips,
    interval: Duration,
) -> Result<u64> {
    let mut conn = pool.get().await?;
    let tx = conn.transaction().await?;
    let ran = take_turn(&tx, Task::Liveness).await?;
    skips.record(Task::Liveness, ran, interval);
    if !ran {
        return Ok(0);
    }
    let owners: Vec<String> = tx
        .query(sql::HELD_OWNERS, &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if owners.is_empty() {
        return Ok(0);
    }
    let dead = hook.dead_owners(&owners).await;
    if dead.is_empty() {
        return Ok(0);
    }
    let mut total = 0u64;
    loop {
        let n: i32 = tx
            .query_one(sql::REVOKE_OWNERS, &[&dead, &SWEEP_BATCH])
            .await?
            .get(0);
        total += u64::try_from(n).unwrap_or(0);
        if n < SWEEP_BATCH {
            break;
        }
    }
    tx.commit().await?;
    tracing::info!(
        dead_owners = dead.join(","),
        released = total,
        "released the requests of dead owners"
    );
    Ok(total)
}

/// One round of retention: settled requests past `retention`, audit rows past
/// `audit_retention`, idle instances of templates past `idle_instance_after`, each in batches of
/// [`SWEEP_BATCH`] rows per transaction. Returns the requests and audit rows deleted.
pub(crate) async fn retention_once(
    pool: &Pool,
    config: &MaintenanceConfig,
    stop: Option<&watch::Receiver<bool>>,
    skips: &Skips,
) -> Result<(u64, u64)> {
    let interval = config.sweep_interval.max(Duration::from_secs(1));
    let retention = sql::interval(config.retention);
    let requests = sweep_all(
        pool,
        Sweep::new(
            Task::Retention,
            sql::DELETE_SETTLED,
            &[&retention, &SWEEP_BATCH],
        )
        .paced(stop),
        skips,
        interval,
    )
    .await?;
    let audit_retention = sql::interval(config.audit_retention);
    let audit = sweep_all(
        pool,
        Sweep::new(
            Task::AuditRetention,
            sql::DELETE_CAPACITY_CHANGES,
            &[&audit_retention, &SWEEP_BATCH],
        )
        .paced(stop),
        skips,
        interval,
    )
    .await?;
    metrics::counter!("permitq_retention_deleted_total").increment(requests);
    let idle = sql::interval(config.idle_instance_after);
    let instances = sweep_all(
        pool,
        Sweep::new(
            Task::IdleInstances,
            sql::SWEEP_IDLE_INSTANCES,
            &[&idle, &SWEEP_BATCH],
        )
        .paced(stop),
        skips,
        interval,
    )
    .await?;
    if instances > 0 {
        tracing::debug!(instances, "removed idle instances of templates");
    }
    metrics::counter!("permitq_idle_instances_removed_total").increment(instances);
    // Rows of workers that died asleep, long ago (a handful at most).
    pool.get()
        .await?
        .execute(sql::DELETE_DEAD_WORKERS, &[])
        .await?;
    Ok((requests, audit))
}

/// Runs `round` until `stop`, pausing about `interval` after each (see [`jittered`]).
pub(crate) async fn every(
    interval: Duration,
    mut stop: watch::Receiver<bool>,
    mut round: impl FnMut() -> BoxFuture<'static, ()>,
) {
    while !*stop.borrow() {
        round().await;
        tokio::select! {
            _ = tokio::time::sleep(jittered(interval)) => {}
            _ = stop.changed() => {}
        }
    }
}

/// `interval`, made 10% shorter or longer at random: workers started together would otherwise
/// keep reaching a task's turn at the same instant, one of them always finding it held by the
/// other's sweep, and warn of skips that were no more than that.
/// (An interval too long to scale is kept as it is.)
fn jittered(interval: Duration) -> Duration {
    Duration::try_from_secs_f64(interval.as_secs_f64() * (0.9 + 0.2 * fastrand::f64()))
        .unwrap_or(interval)
}

/// How full the cluster's NOTIFY queue is, and what permitq skipped because of it: gauge
/// `permitq_notify_queue_usage` (alert well before 0.5, where permitq stops notifying), counter
/// `permitq_notifications_skipped_total`, and a warning whenever more were skipped since the
/// last look. Returns the skipped total.
pub(crate) async fn watch_notify_queue(pool: &Pool, seen: u64) -> Result<u64> {
    let row = pool.get().await?.query_one(sql::NOTIFY_HEALTH, &[]).await?;
    let (usage, skipped): (f64, i64) = (row.try_get(0)?, row.try_get(1)?);
    let skipped = u64::try_from(skipped).unwrap_or(0);
    metrics::gauge!("permitq_notify_queue_usage").set(usage);
    if skipped > seen {
        metrics::counter!("permitq_notifications_skipped_total").increment(skipped - seen);
        tracing::warn!(
            usage,
            skipped = skipped - seen,
            "the cluster's NOTIFY queue is filling up (a session LISTENs and stays idle in a \
             transaction?): notifications skipped; producers and workers poll meanwhile"
        );
    }
    Ok(skipped)
}

/// The worker's sweep task: [`sweep_once`] every `sweep_interval` until `stop`.
pub(crate) async fn run_sweeps(
    pool: Pool,
    config: Arc<MaintenanceConfig>,
    liveness: Option<Arc<dyn OwnerLiveness>>,
    outage: Arc<Outage>,
    stop: watch::Receiver<bool>,
) {
    let skips = Arc::new(Skips::default());
    let notifications_skipped = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    every(config.sweep_interval, stop, move || {
        let (pool, config, liveness) = (pool.clone(), config.clone(), liveness.clone());
        let (skips, notifications_skipped) = (skips.clone(), notifications_skipped.clone());
        let outage = outage.clone();
        Box::pin(async move {
            let began = std::time::Instant::now();
            match sweep_once(&pool, &config, liveness.as_deref(), &skips).await {
                Ok(out) => {
                    outage.succeeded(began);
                    if out != SweepOutcome::default() {
                        tracing::info!(
                            timed_out = out.timed_out,
                            expired = out.expired,
                            stale = out.stale,
                            revoked = out.revoked,
                            "sweep"
                        );
                    }
                }
                Err(e) if outage.failed("lease and deadline sweeps", &e) => return,
                Err(e) => tracing::warn!(error = %e, "sweep failed"),
            }
            // The first look only learns where the count stands.
            let seen = notifications_skipped.load(std::sync::atomic::Ordering::Relaxed);
            match watch_notify_queue(&pool, seen).await {
                Ok(now) => notifications_skipped.store(now, std::sync::atomic::Ordering::Relaxed),
                Err(e) if outage.failed("NOTIFY queue checks", &e) => {}
                Err(e) => tracing::warn!(error = %e, "NOTIFY queue check failed"),
            }
        })
    })
    .await
}

/// The worker's adaptive task: [`crate::adaptive::adapt_once`] every `adaptive_cadence`.
pub(crate) async fn run_adaptive(
    pool: Pool,
    config: Arc<MaintenanceConfig>,
    outage: Arc<Outage>,
    stop: watch::Receiver<bool>,
) {
    let cadence = config.adaptive_cadence.max(Duration::from_millis(100));
    every(cadence, stop, move || {
        let (pool, outage) = (pool.clone(), outage.clone());
        Box::pin(async move {
            let began = std::time::Instant::now();
            match crate::adaptive::adapt_once(&pool, cadence).await {
                Ok(changes) => {
                    outage.succeeded(began);
                    for c in changes {
                        tracing::info!(semaphore = %c.name, from = c.from, to = c.to, "adaptive capacity");
                    }
                }
                Err(e) if outage.failed("adaptive capacities", &e) => {}
                Err(e) => tracing::warn!(error = %e, "adaptive cadence failed"),
            }
        })
    })
    .await
}

/// The worker's retention task: [`retention_once`] every `sweep_interval` (at least 1s).
pub(crate) async fn run_retention(
    pool: Pool,
    config: Arc<MaintenanceConfig>,
    outage: Arc<Outage>,
    stop: watch::Receiver<bool>,
) {
    let interval = config.sweep_interval.max(Duration::from_secs(1));
    let stop_inner = stop.clone();
    let skips = Arc::new(Skips::default());
    every(interval, stop, move || {
        let (pool, config, stop) = (pool.clone(), config.clone(), stop_inner.clone());
        let (skips, outage) = (skips.clone(), outage.clone());
        Box::pin(async move {
            match retention_once(&pool, &config, Some(&stop), &skips).await {
                Ok((0, 0)) => {}
                Ok((requests, audit)) => tracing::info!(requests, audit, "retention deleted"),
                Err(e) if outage.failed("retention rounds", &e) => {}
                Err(e) => tracing::warn!(error = %e, "retention failed"),
            }
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::jittered;
    use std::time::Duration;

    #[test]
    fn pauses_are_jittered_within_a_tenth_of_the_interval() {
        let interval = Duration::from_secs(1);
        let pauses: Vec<Duration> = (0..200).map(|_| jittered(interval)).collect();
        assert!(pauses
            .iter()
            .all(|p| *p >= interval.mul_f64(0.9) && *p <= interval.mul_f64(1.1)));
        // Not one fixed pause: two workers started together drift apart.
        assert!(pauses.iter().any(|p| *p != pauses[0]), "{pauses:?}");
        // An interval too long to scale up is kept, not a panic (each call draws again).
        for _ in 0..50 {
            assert!(jittered(Duration::MAX) >= Duration::MAX.mul_f64(0.89));
        }
    }
}
