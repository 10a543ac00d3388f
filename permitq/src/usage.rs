//! What operators look at: per-semaphore usage, holders and waiters (the views
//! `permitq.semaphore_usage`, `permitq.holders` and `permitq.waiters`).

use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio_postgres::Row;

use crate::db::from_micros;
use crate::error::Result;
use crate::types::{ser_secs, ser_time};

/// One semaphore as operators see it (a row of `permitq.semaphore_usage`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct SemaphoreUsage {
    /// Unique name.
    pub name: String,
    /// How many permits may be held at once.
    pub capacity: i64,
    /// The workers' running count; may run ahead of `held` until releases are folded.
    pub used: i64,
    /// Exactly how many are held now.
    pub held: i64,
    /// How many requests wait on it (on a parent, also those waiting below it that a worker
    /// has examined).
    pub waiting: i64,
    /// Since when its oldest waiter waits.
    #[serde(serialize_with = "ser_time")]
    pub oldest_wait_since: Option<SystemTime>,
    /// Strict FIFO with safe backfill (`true`) or greedy (`false`).
    pub fair: bool,
    /// Grants so far (a counter: its rate is grants per second).
    pub granted: i64,
    /// For a rate-limited semaphore: permits granted in its current window (at most
    /// `capacity`); 0 otherwise.
    pub in_window: i64,
    /// For a rate-limited semaphore, its window (seconds in JSON); `None`: a concurrency
    /// semaphore.
    #[serde(serialize_with = "ser_secs")]
    pub per: Option<Duration>,
    /// When a spent window next has room (its oldest counted grant leaves it); `None` when it
    /// has room now or is no rate limit.
    #[serde(serialize_with = "ser_time")]
    pub window_opens_at: Option<SystemTime>,
    /// A template (its name ends in `*`): never granted itself.
    pub is_template: bool,
    /// For an instance, the template it was made from.
    pub template: Option<String>,
    /// The semaphore it is nested in (its `held` counts there too).
    pub parent: Option<String>,
    /// Its guaranteed share of its parent while active.
    pub guarantee: i64,
    /// When the workers set its capacity from its holders' reports: how.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<crate::AdaptiveLimit>,
    /// Its line served across the requests' fairness keys in proportion to their weights.
    pub fairness_keys: bool,
}

/// A request holding permits of one semaphore (a row of `permitq.holders`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Holder {
    /// The semaphore.
    pub semaphore: String,
    /// The request.
    pub external_id: String,
    /// Who holds it.
    pub owner: Option<String>,
    /// How many permits of this semaphore.
    pub count: i64,
    /// Granted at.
    #[serde(serialize_with = "ser_time")]
    pub acquired_at: Option<SystemTime>,
    /// Lease end (None: no TTL).
    #[serde(serialize_with = "ser_time")]
    pub expires_at: Option<SystemTime>,
    /// Its fencing token.
    pub fencing_token: Option<i64>,
}

/// A request waiting on one semaphore (a row of `permitq.waiters`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Waiter {
    /// The semaphore.
    pub semaphore: String,
    /// The request.
    pub external_id: String,
    /// Who will hold it.
    pub owner: Option<String>,
    /// How many permits of this semaphore it wants.
    pub count: i64,
    /// Its place in the semaphore's queue as the workers rank it (priority, aging, then
    /// arrival): 1 = the head.
    pub position: i64,
    /// Submitted at.
    #[serde(serialize_with = "ser_time")]
    pub waiting_since: Option<SystemTime>,
    /// When its `wait` runs out (None: waits indefinitely).
    #[serde(serialize_with = "ser_time")]
    pub deadline: Option<SystemTime>,
    /// Its priority (-100 to 100; aging raises its place in line as it waits).
    pub priority: i16,
    /// Its fairness key, if it has one (on a semaphore served by key, whose turns it takes).
    pub fairness_key: Option<String>,
}

/// A row of `permitq.holders` as [`crate::sql::HOLDERS`] selects it.
pub(crate) fn holder_from_row(row: &Row) -> Result<Holder> {
    Ok(Holder {
        semaphore: row.try_get(0)?,
        external_id: row.try_get(1)?,
        owner: row.try_get(2)?,
        count: row.try_get(3)?,
        acquired_at: row.try_get(4)?,
        expires_at: row.try_get(5)?,
        fencing_token: row.try_get(6)?,
    })
}

/// A row of `permitq.waiters` as [`crate::sql::WAITERS`] selects it.
pub(crate) fn waiter_from_row(row: &Row) -> Result<Waiter> {
    Ok(Waiter {
        semaphore: row.try_get(0)?,
        external_id: row.try_get(1)?,
        owner: row.try_get(2)?,
        count: row.try_get(3)?,
        position: row.try_get(4)?,
        waiting_since: row.try_get(5)?,
        deadline: row.try_get(6)?,
        priority: row.try_get(7)?,
        fairness_key: row.try_get(8)?,
    })
}

/// A row of `permitq.semaphore_usage` as [`crate::sql::USAGE`] selects it.
pub(crate) fn usage_from_row(row: &Row) -> Result<SemaphoreUsage> {
    Ok(SemaphoreUsage {
        name: row.try_get(0)?,
        capacity: row.try_get(1)?,
        used: row.try_get(2)?,
        held: row.try_get(3)?,
        waiting: row.try_get(4)?,
        oldest_wait_since: row.try_get(5)?,
        fair: row.try_get(6)?,
        granted: row.try_get(7)?,
        in_window: row.try_get(8)?,
        per: from_micros(row.try_get(9)?),
        window_opens_at: row.try_get(10)?,
        is_template: row.try_get(11)?,
        template: row.try_get(12)?,
        parent: row.try_get(13)?,
        guarantee: row.try_get(14)?,
        adaptive: match row.try_get::<_, Option<String>>(15)? {
            Some(algorithm) => Some(crate::AdaptiveLimit::new(
                algorithm
                    .parse()
                    .map_err(|e: String| crate::Error::invalid("adaptive", e))?,
                row.try_get(16)?,
                row.try_get(17)?,
            )),
            None => None,
        },
        fairness_keys: row.try_get(18)?,
    })
}
