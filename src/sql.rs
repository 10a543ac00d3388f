//! Every query the Rust side sends, in one place. The long ones live in `src/sql/*.sql` with a
//! comment each; the SQL API they call is in `schema/`.
//!
//! Lock order (see `schema/V1__core.sql`): request rows first, then semaphore rows in ascending
//! id. [`CLAIM_BATCH`] is step 1 for the worker, [`LOCK_SEMAPHORES`] step 2.

use std::sync::LazyLock;

/// Worker: claim pending requests after a cursor, FOR UPDATE SKIP LOCKED.
pub const CLAIM_BATCH: &str = include_str!("sql/claim_batch.sql");
/// Worker: lock the batch's semaphores in id order.
pub const LOCK_SEMAPHORES: &str = include_str!("sql/lock_semaphores.sql");
/// Worker: the waiters outside the batch that fair semaphores keep room for.
pub const SEMAPHORE_HEADS: &str = include_str!("sql/semaphore_heads.sql");
/// Worker: write a batch's outcome.
pub const APPLY_DECISION: &str = include_str!("sql/apply_decision.sql");

/// Columns of `permitq.permit_request` as [`crate::types::PermitRequest`] reads them.
pub const REQUEST_COLUMNS: &str = include_str!("sql/request_columns.sql");

/// Client: submit (validates, idempotent, wakes workers). Intervals travel as text.
pub static SUBMIT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {REQUEST_COLUMNS} FROM permitq.submit($1, $2, $3, $4::text::interval, $5::text::interval)"
    )
});

/// Client: one request by external_id.
pub static STATUS: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {REQUEST_COLUMNS} FROM permitq.permit_request WHERE external_id = $1")
});

/// Client: release (or cancel) by external_id.
pub const RELEASE: &str = "SELECT permitq.release($1)";
/// Operator: revoke by external_id.
pub const REVOKE: &str = "SELECT permitq.revoke($1)";
/// Holder: extend the lease.
pub const HEARTBEAT: &str = "SELECT permitq.heartbeat($1, $2::text::interval)";
/// Operator: create or change a semaphore.
pub const SET_CAPACITY: &str =
    "SELECT name, capacity::int8, used::int8, fair FROM permitq.set_capacity($1, $2, $3)";
/// All semaphores.
pub const LIST_SEMAPHORES: &str =
    "SELECT name, capacity::int8, used::int8, fair FROM permitq.semaphore ORDER BY name";
/// The capacity audit of one semaphore, oldest first.
pub const CAPACITY_HISTORY: &str = "SELECT semaphore, old_capacity::int8, new_capacity::int8, \
     old_fair, new_fair, changed_at, changed_by, application_name \
     FROM permitq.capacity_change WHERE semaphore = $1 ORDER BY id";
/// Downstream fencing check.
pub const FENCE: &str = "SELECT permitq.fence($1, $2)";

/// Sweeps: each takes a transaction-scoped advisory lock first, so one worker at a time runs it.
pub const TRY_SWEEP_LOCK: &str = "SELECT pg_try_advisory_xact_lock($1)";
/// Sweep: wait deadlines → `timeout`.
pub const SWEEP_WAIT_DEADLINES: &str = "SELECT permitq.sweep_wait_deadlines($1)";
/// Sweep: TTL leases past expires_at → released as `expired`.
pub const SWEEP_EXPIRED: &str = "SELECT permitq.sweep_expired($1)";
/// Sweep: held past --max-hold → released as `stale`.
pub const SWEEP_STALE: &str = "SELECT permitq.sweep_stale($1::text::interval, $2)";
/// Sweep: owners of held requests, for the liveness hook.
pub const HELD_OWNERS: &str = "SELECT DISTINCT owner FROM permitq.permit_request \
     WHERE state = 'acquired' AND owner IS NOT NULL";
/// Sweep: release the requests of dead owners as `revoked`.
pub const REVOKE_OWNERS: &str = "SELECT permitq.revoke_owners($1, $2)";
/// Retention: delete a batch of settled requests.
pub const DELETE_SETTLED: &str = "SELECT permitq.delete_settled($1::text::interval, $2)";
/// Retention: delete a batch of capacity audit rows.
pub const DELETE_CAPACITY_CHANGES: &str =
    "SELECT permitq.delete_capacity_changes($1::text::interval, $2)";

/// A duration as PostgreSQL interval text.
pub fn interval(d: std::time::Duration) -> String {
    format!("{} microseconds", d.as_micros())
}

/// Report: outcome counts of the requests matching a LIKE pattern.
pub const RUN_OUTCOMES: &str = "SELECT state, coalesce(error_code, release_reason), count(*) \
     FROM permitq.permit_request WHERE external_id LIKE $1 GROUP BY 1, 2";
/// Report: submit → acquired latency percentiles (ms) of the requests matching a pattern.
pub const RUN_LATENCY: &str = "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), \
     percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms) \
     FROM (SELECT extract(epoch FROM acquired_at - created_at)::float8 * 1000 AS ms \
           FROM permitq.permit_request \
           WHERE external_id LIKE $1 AND acquired_at IS NOT NULL) t";
/// Report: queue depth and grants so far of the requests matching a pattern.
pub const RUN_PROGRESS: &str = "SELECT count(*) FILTER (WHERE state = 'new'), \
     count(*) FILTER (WHERE acquired_at IS NOT NULL) \
     FROM permitq.permit_request WHERE external_id LIKE $1";
/// Safety check over the whole history: an interval sweep of the permit rows. Each permit
/// holds `count` from acquired_at until released_at (or now). At equal instants releases come
/// first (a permit released at t and one granted at t never overlap). Returns each semaphore's
/// peak concurrent use and the highest capacity it ever had (the audit's new_capacity values,
/// and the current one) — a peak above that is a violation whatever the timing of changes.
pub const PEAK_CONCURRENT_USE: &str = include_str!("sql/peak_concurrent_use.sql");

/// Invariants in one snapshot, per semaphore: capacity, `used`, the sum of its acquired permits,
/// and how many of its permits disagree with their request's state (acquired exactly when the
/// request is). Used by the tests' sampler and the chaos sampler.
pub const INVARIANT_SNAPSHOT: &str = "SELECT s.name, s.capacity, s.used, \
     coalesce((SELECT sum(p.count) FROM permitq.permit p \
               WHERE p.semaphore = s.name AND p.state = 'acquired'), 0)::int, \
     (SELECT count(*) FROM permitq.permit p JOIN permitq.permit_request r ON r.id = p.request_id \
      WHERE p.semaphore = s.name AND (p.state = 'acquired') <> (r.state = 'acquired')) \
     FROM permitq.semaphore s";
