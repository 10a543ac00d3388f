//! What a run did, read back from the database: outcome counts, submit → acquired latency, and
//! the exact peak concurrent use per semaphore from the permit intervals. Used by `demo`,
//! `bench`, `chaos` and the tests.

use std::collections::BTreeMap;

use crate::sql;
use crate::Result;

/// Latency percentiles in milliseconds.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum.
    pub max: f64,
}

impl Percentiles {
    /// The p50, p99 and max of `samples` (sorted in place), nearest rank; zeros when empty.
    pub fn of(samples: &mut [f64]) -> Percentiles {
        samples.sort_by(f64::total_cmp);
        Percentiles {
            p50: quantile(samples, 500),
            p99: quantile(samples, 990),
            max: quantile(samples, 1000),
        }
    }
}

/// The sample at `permille`/1000 of the way through sorted `samples` (nearest rank).
pub fn quantile(sorted: &[f64], permille: usize) -> f64 {
    let last = sorted.len().saturating_sub(1);
    sorted
        .get((last * permille.min(1000) + 500) / 1000)
        .copied()
        .unwrap_or(0.0)
}

/// A run's outcome, for requests whose external_id starts with a prefix.
#[derive(Debug, Default, Clone)]
pub struct RunReport {
    /// Requests submitted.
    pub submitted: i64,
    /// Requests that were granted at some point.
    pub granted: i64,
    /// Released requests by `release_reason`.
    pub released_by_reason: BTreeMap<String, i64>,
    /// Failed requests by `error_code`.
    pub errors_by_code: BTreeMap<String, i64>,
    /// Still `new` or `acquired`.
    pub open: i64,
    /// created_at → acquired_at.
    pub latency_ms: Percentiles,
    /// Per semaphore, the largest sum of counts held at one instant (all permits in the table);
    /// for a rate-limited semaphore, the most permits granted in one window of its length.
    pub peak_concurrent: BTreeMap<String, i64>,
    /// Semaphores whose permits, at some instant (or in one window), summed to more than the
    /// capacity in force:
    /// (name, peak, capacity). Must be empty.
    pub over_capacity: Vec<(String, i64, i64)>,
}

/// Reads the report for requests whose external_id starts with `prefix`.
pub async fn collect(conn: &tokio_postgres::Client, prefix: &str) -> Result<RunReport> {
    let pattern = format!("{}%", like_escape(prefix));
    let mut report = RunReport::default();
    for row in conn.query(sql::RUN_OUTCOMES, &[&pattern]).await? {
        let (state, detail, n): (String, Option<String>, i64) =
            (row.get(0), row.get(1), row.get(2));
        report.submitted += n;
        match state.as_str() {
            "released" => {
                report.granted += n;
                *report
                    .released_by_reason
                    .entry(detail.unwrap_or_default())
                    .or_default() += n;
            }
            "acquired" => {
                report.granted += n;
                report.open += n;
            }
            "error" => {
                *report
                    .errors_by_code
                    .entry(detail.unwrap_or_default())
                    .or_default() += n
            }
            _ => report.open += n,
        }
    }
    let row = conn.query_one(sql::RUN_LATENCY, &[&pattern]).await?;
    report.latency_ms = Percentiles {
        p50: row.get::<_, Option<f64>>(0).unwrap_or(0.0),
        p99: row.get::<_, Option<f64>>(1).unwrap_or(0.0),
        max: row.get::<_, Option<f64>>(2).unwrap_or(0.0),
    };
    let peaks = |rows: Vec<tokio_postgres::Row>| -> Vec<(String, i64, i64)> {
        rows.iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect()
    };
    let rate_limited = peaks(conn.query(sql::WINDOW_PEAK, &[]).await?);
    // A rate-limited semaphore bounds grants per window, not holders: its window peak counts.
    let concurrency: Vec<_> = peaks(conn.query(sql::PEAK_CONCURRENT_USE, &[]).await?)
        .into_iter()
        .filter(|(name, _, _)| !rate_limited.iter().any(|(n, _, _)| n == name))
        .collect();
    for (name, peak, capacity) in concurrency.into_iter().chain(rate_limited) {
        report.peak_concurrent.insert(name.clone(), peak);
        if peak > capacity {
            report.over_capacity.push((name, peak, capacity));
        }
    }
    Ok(report)
}

/// Queue depth and grants so far, for requests whose external_id starts with `prefix`.
pub async fn queue_and_grants(conn: &tokio_postgres::Client, prefix: &str) -> Result<(i64, i64)> {
    let row = conn
        .query_one(sql::RUN_PROGRESS, &[&format!("{}%", like_escape(prefix))])
        .await?;
    Ok((row.get(0), row.get(1)))
}

/// Checks the invariants that hold in every snapshot ([`sql::INVARIANT_SNAPSHOT`]): `used`
/// never under-counts (it is at least the exact held count; it may run ahead until the workers
/// fold releases in). With `capacity_fixed` (no capacity was lowered), also held ≤ capacity and
/// `used` ≤ capacity. Returns one message per violation.
pub async fn invariant_violations(
    conn: &tokio_postgres::Client,
    capacity_fixed: bool,
) -> std::result::Result<Vec<String>, tokio_postgres::Error> {
    let mut found = Vec::new();
    for row in conn.query(sql::INVARIANT_SNAPSHOT, &[]).await? {
        let (name, capacity, used, held): (String, i64, i64, i64) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let (rate_limited, in_window): (bool, i64) = (row.get(4), row.get(5));
        if rate_limited {
            if capacity_fixed && in_window > capacity {
                found.push(format!(
                    "{name}: {in_window} granted in one window > capacity {capacity}"
                ));
            }
            if used < held {
                found.push(format!(
                    "{name}: used {used} under-counts the {held} permits held"
                ));
            }
            continue;
        }
        if capacity_fixed && held > capacity {
            found.push(format!("{name}: held {held} > capacity {capacity}"));
        }
        if capacity_fixed && used > capacity {
            found.push(format!("{name}: used {used} > capacity {capacity}"));
        }
        if used < held {
            found.push(format!(
                "{name}: used {used} under-counts the {held} permits held"
            ));
        }
    }
    Ok(found)
}

fn like_escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('%', "\\%")
        .replace('_', "\\_")
}
