//! The queries test support sends: run reports and invariant checks read back from the
//! database. (The library's own statements live in `permitq/src/sql.rs`.)

/// Report: outcome counts of the requests matching a LIKE pattern.
pub(crate) const RUN_OUTCOMES: &str =
    "SELECT state, coalesce(error_code, release_reason), count(*) \
     FROM permitq.permit_request WHERE external_id LIKE $1 GROUP BY 1, 2";
/// Report: submit → acquired latency percentiles (ms) of the requests matching a pattern.
pub(crate) const RUN_LATENCY: &str = "SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY ms), \
     percentile_cont(0.99) WITHIN GROUP (ORDER BY ms), max(ms) \
     FROM (SELECT extract(epoch FROM acquired_at - created_at)::float8 * 1000 AS ms \
           FROM permitq.permit_request \
           WHERE external_id LIKE $1 AND acquired_at IS NOT NULL) t";
/// Report: queue depth and grants so far of the requests matching a pattern.
pub(crate) const RUN_PROGRESS: &str = "SELECT count(*) FILTER (WHERE state = 'new'), \
     count(*) FILTER (WHERE acquired_at IS NOT NULL) \
     FROM permitq.permit_request WHERE external_id LIKE $1";
/// Safety check over the whole history: an interval sweep of the permit rows. Each permit
/// holds `count` from acquired_at until released_at (or now). At equal instants releases come
/// first (a permit released at t and one granted at t never overlap). Returns each semaphore's
/// peak concurrent use and the highest capacity it ever had (the audit's new_capacity values,
/// and the current one) — a peak above that is a violation whatever the timing of changes.
pub(crate) const PEAK_CONCURRENT_USE: &str = include_str!("sql_peak_concurrent_use.sql");

/// Invariants in one snapshot, per semaphore (permitq.semaphore_usage): capacity, `used` (the
/// workers' running count) and held (the exact sum of acquired permits). Used by the tests'
/// sampler and the chaos sampler.
/// For a rate-limited semaphore `used` and `held` count holders (any number of windows), so its
/// capacity bounds `in_window`, the permits granted in its current window.
pub(crate) const INVARIANT_SNAPSHOT: &str =
    "SELECT name, capacity::int8, used, held, per IS NOT NULL, in_window::int8 \
     FROM permitq.semaphore_usage";
/// Rate-limited semaphores over the whole history: per semaphore, the most permits granted in
/// any window of its length (each window ending at a grant), next to its highest capacity.
pub(crate) const WINDOW_PEAK: &str = "SELECT s.name, \
       coalesce(max((SELECT sum(p2.count) FROM permitq.permit p2 \
                     WHERE p2.semaphore = p.semaphore \
                       AND p2.acquired_at > p.acquired_at - s.per \
                       AND p2.acquired_at <= p.acquired_at)), 0)::int8, \
       greatest(s.capacity, (SELECT max(c.new_capacity) FROM permitq.capacity_change c \
                             WHERE c.semaphore = s.name))::int8 \
     FROM permitq.semaphore s LEFT JOIN permitq.permit p ON p.semaphore = s.name \
     WHERE s.per IS NOT NULL GROUP BY s.name, s.capacity";
