//! Maintenance the workers run beside the claim loop: the sweeps (wait deadlines, expired
//! leases, `--max-hold`, the owner-liveness hook) and retention.
//!
//! Every sweep runs in its own transaction behind a transaction-scoped advisory lock, so with N
//! workers one of them does each sweep at a time; the others skip it. Each sweep is also safe to
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
}

impl Default for MaintenanceConfig {
    fn default() -> Self {
        MaintenanceConfig {
            sweep_interval: Duration::from_secs(1),
            max_hold: None,
            retention: Duration::from_secs(7 * 24 * 3600),
            audit_retention: Duration::from_secs(30 * 24 * 3600),
            idle_instance_after: Duration::from_secs(3600),
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

/// Advisory lock keys, one per sweep kind.
#[derive(Debug, Clone, Copy)]
#[repr(i64)]
enum SweepLock {
    WaitDeadlines = 0x7071_0001,
    Expired = 0x7071_0002,
    Stale = 0x7071_0003,
    Liveness = 0x7071_0004,
    Retention = 0x7071_0005,
    AuditRetention = 0x7071_0006,
    IdleInstances = 0x7071_0007,
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

/// Takes the sweep's transaction-scoped advisory lock; false when another worker holds it.
async fn try_sweep_lock(tx: &deadpool_postgres::Transaction<'_>, lock: SweepLock) -> Result<bool> {
    Ok(tx
        .query_one(sql::TRY_SWEEP_LOCK, &[&(lock as i64)])
        .await?
        .get(0))
}

/// Runs one batch of a sweep under its advisory lock. `None`: another worker holds the lock.
async fn locked_batch(
    pool: &Pool,
    lock: SweepLock,
    query: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Result<Option<u64>> {
    let mut conn = pool.get().await?;
    let tx = conn.transaction().await?;
    if !try_sweep_lock(&tx, lock).await? {
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

/// Runs a sweep in batches until a batch comes back short (or the lock is busy), pausing
/// `pause` between batches.
async fn sweep_all(
    pool: &Pool,
    lock: SweepLock,
    query: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    stop: Option<&watch::Receiver<bool>>,
    pause: Duration,
) -> Result<u64> {
    let mut total = 0;
    while let Some(n) = locked_batch(pool, lock, query, params).await? {
        total += n;
        if n < SWEEP_BATCH as u64 || stop.is_some_and(|s| *s.borrow()) {
            break;
        }
        tokio::time::sleep(pause).await;
    }
    Ok(total)
}

/// One round of the lease and deadline sweeps.
pub(crate) async fn sweep_once(
    pool: &Pool,
    config: &MaintenanceConfig,
    liveness: Option<&dyn OwnerLiveness>,
) -> Result<SweepOutcome> {
    let mut out = SweepOutcome {
        timed_out: sweep_all(
            pool,
            SweepLock::WaitDeadlines,
            sql::SWEEP_WAIT_DEADLINES,
            &[&SWEEP_BATCH],
            None,
            Duration::ZERO,
        )
        .await?,
        expired: sweep_all(
            pool,
            SweepLock::Expired,
            sql::SWEEP_EXPIRED,
            &[&SWEEP_BATCH],
            None,
            Duration::ZERO,
        )
        .await?,
        ..SweepOutcome::default()
    };
    if let Some(max_hold) = config.max_hold {
        let max_hold = sql::interval(max_hold);
        out.stale = sweep_all(
            pool,
            SweepLock::Stale,
            sql::SWEEP_STALE,
            &[&max_hold, &SWEEP_BATCH],
            None,
            Duration::ZERO,
        )
        .await?;
    }
    if let Some(hook) = liveness {
        out.revoked = sweep_dead_owners(pool, hook).await?;
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

async fn sweep_dead_owners(pool: &Pool, hook: &dyn OwnerLiveness) -> Result<u64> {
    let mut conn = pool.get().await?;
    let tx = conn.transaction().await?;
    if !try_sweep_lock(&tx, SweepLock::Liveness).await? {
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
        ?dead,
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
) -> Result<(u64, u64)> {
    let retention = sql::interval(config.retention);
    let requests = sweep_all(
        pool,
        SweepLock::Retention,
        sql::DELETE_SETTLED,
        &[&retention, &SWEEP_BATCH],
        stop,
        RETENTION_PAUSE,
    )
    .await?;
    let audit_retention = sql::interval(config.audit_retention);
    let audit = sweep_all(
        pool,
        SweepLock::AuditRetention,
        sql::DELETE_CAPACITY_CHANGES,
        &[&audit_retention, &SWEEP_BATCH],
        stop,
        RETENTION_PAUSE,
    )
    .await?;
    metrics::counter!("permitq_retention_deleted_total").increment(requests);
    let idle = sql::interval(config.idle_instance_after);
    let instances = sweep_all(
        pool,
        SweepLock::IdleInstances,
        sql::SWEEP_IDLE_INSTANCES,
        &[&idle, &SWEEP_BATCH],
        stop,
        RETENTION_PAUSE,
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

async fn every(
    interval: Duration,
    mut stop: watch::Receiver<bool>,
    mut round: impl FnMut() -> BoxFuture<'static, ()>,
) {
    while !*stop.borrow() {
        round().await;
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = stop.changed() => {}
        }
    }
}

/// The worker's sweep task: [`sweep_once`] every `sweep_interval` until `stop`.
pub(crate) async fn run_sweeps(
    pool: Pool,
    config: Arc<MaintenanceConfig>,
    liveness: Option<Arc<dyn OwnerLiveness>>,
    stop: watch::Receiver<bool>,
) {
    every(config.sweep_interval, stop, move || {
        let (pool, config, liveness) = (pool.clone(), config.clone(), liveness.clone());
        Box::pin(async move {
            match sweep_once(&pool, &config, liveness.as_deref()).await {
                Ok(out) if out != SweepOutcome::default() => tracing::info!(?out, "sweep"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "sweep failed"),
            }
        })
    })
    .await
}

/// The worker's retention task: [`retention_once`] every `sweep_interval` (at least 1s).
pub(crate) async fn run_retention(
    pool: Pool,
    config: Arc<MaintenanceConfig>,
    stop: watch::Receiver<bool>,
) {
    let interval = config.sweep_interval.max(Duration::from_secs(1));
    let stop_inner = stop.clone();
    every(interval, stop, move || {
        let (pool, config, stop) = (pool.clone(), config.clone(), stop_inner.clone());
        Box::pin(async move {
            match retention_once(&pool, &config, Some(&stop)).await {
                Ok((0, 0)) => {}
                Ok((requests, audit)) => tracing::info!(requests, audit, "retention deleted"),
                Err(e) => tracing::warn!(error = %e, "retention failed"),
            }
        })
    })
    .await
}
