//! The rules Rust and the schema share, each stated once, here.
//!
//! `migrate` writes them into the database as immutable SQL functions (`permitq.rule_*`), which
//! the schema's constraints and functions call; PostgreSQL inlines them, so they cost nothing.

use std::fmt::Write as _;
use std::ops::RangeInclusive;
use std::time::Duration;

use crate::types::{ErrorCode, ReleaseReason, State};

/// The lowest and highest priority a request may have.
pub const PRIORITY_RANGE: RangeInclusive<i16> = -100..=100;

/// Waiting raises a request's effective priority by one per step, so on a fair semaphore a
/// request of priority p is never overtaken by one submitted more than (p' − p) steps after it.
pub const AGING_STEP: Duration = Duration::from_secs(10);

/// [`MAX_DURATION`] in days.
const MAX_DURATION_DAYS: u64 = 3653;

/// The longest `ttl`, `wait`, heartbeat `extend`, rate window `per`, `max_hold` or retention
/// permitq accepts: 10 years, counted as 3653 days (humantime's `10y` is 3652.5 days), so every
/// timestamp computed from one stays far inside PostgreSQL's range.
pub const MAX_DURATION: Duration = Duration::from_secs(MAX_DURATION_DAYS * 86_400);

/// The longest `external_id` and semaphore name, in characters.
pub const MAX_NAME_LENGTH: usize = 255;

/// The most semaphores one request may name.
pub const MAX_SEMAPHORES_PER_REQUEST: usize = 64;

/// The most instances a template makes, unless it says otherwise (`max_instances`): a request
/// that would need one more fails with `too_many_instances`.
pub const MAX_INSTANCES: u32 = 10_000;

/// The most ancestors a semaphore may have (a parent, its parent, ...): a grant takes its count
/// from each, under their locks.
pub const MAX_NESTING_DEPTH: usize = 4;

/// The longest `fairness_key`, in characters.
pub const MAX_FAIRNESS_KEY_LENGTH: usize = 64;

/// The weights a fairness key may have: while keys wait on a keyed semaphore, each is served in
/// proportion to its weight (1 when none is given).
pub const FAIRNESS_WEIGHT_RANGE: RangeInclusive<i32> = 1..=1000;

/// How full the cluster's NOTIFY queue may be before permitq stops notifying (its commits would
/// fail once it is full): a fraction, overridden by the setting `permitq.notify_queue_limit`
/// (schema/functions/notifications.sql).
pub const NOTIFY_QUEUE_LIMIT: f64 = 0.5;

/// [`MAX_DURATION`] as messages say it.
fn max_duration_text() -> String {
    format!(
        "{} years ({MAX_DURATION_DAYS} days)",
        MAX_DURATION_DAYS / 365
    )
}

/// Why `value` is out of bounds (longer than [`MAX_DURATION`], or zero where that is not
/// allowed), or None when it is fine; the caller names the field. The schema's twin is
/// `permitq.interval_problem`.
pub(crate) fn duration_problem(value: Option<Duration>, zero_allowed: bool) -> Option<String> {
    let value = value?;
    if value.is_zero() && !zero_allowed {
        Some("must be positive, got 0s".to_string())
    } else if value > MAX_DURATION {
        Some(format!(
            "must be at most {}, got {}s",
            max_duration_text(),
            value.as_secs()
        ))
    } else {
        None
    }
}

/// Why `priority` is out of [`PRIORITY_RANGE`], or None.
pub(crate) fn priority_problem(priority: i16) -> Option<String> {
    (!PRIORITY_RANGE.contains(&priority)).then(|| {
        format!(
            "must be between {} and {}, got {priority}",
            PRIORITY_RANGE.start(),
            PRIORITY_RANGE.end()
        )
    })
}

/// The `permitq.rule_*` functions, as `migrate` writes them.
pub(crate) fn schema_sql() -> String {
    let text_array = |values: Vec<&str>| {
        let quoted: Vec<String> = values.iter().map(|v| format!("'{v}'")).collect();
        format!("ARRAY[{}]::text[]", quoted.join(", "))
    };
    let rules: [(&str, &str, String); 16] = [
        (
            "priority_min",
            "smallint",
            format!("({})::smallint", PRIORITY_RANGE.start()),
        ),
        (
            "priority_max",
            "smallint",
            format!("({})::smallint", PRIORITY_RANGE.end()),
        ),
        (
            "aging_step_us",
            "bigint",
            format!("{}::bigint", AGING_STEP.as_micros()),
        ),
        (
            "max_duration",
            "interval",
            format!("interval '{MAX_DURATION_DAYS} days'"),
        ),
        (
            "max_duration_text",
            "text",
            format!("'{}'::text", max_duration_text()),
        ),
        ("max_name_length", "integer", MAX_NAME_LENGTH.to_string()),
        (
            "max_semaphores",
            "integer",
            MAX_SEMAPHORES_PER_REQUEST.to_string(),
        ),
        ("max_instances", "integer", MAX_INSTANCES.to_string()),
        (
            "max_fairness_key_length",
            "integer",
            MAX_FAIRNESS_KEY_LENGTH.to_string(),
        ),
        (
            "fairness_weight_min",
            "integer",
            FAIRNESS_WEIGHT_RANGE.start().to_string(),
        ),
        (
            "fairness_weight_max",
            "integer",
            FAIRNESS_WEIGHT_RANGE.end().to_string(),
        ),
        (
            "max_nesting_depth",
            "integer",
            MAX_NESTING_DEPTH.to_string(),
        ),
        (
            "notify_queue_limit",
            "float8",
            format!("{NOTIFY_QUEUE_LIMIT}::float8"),
        ),
        (
            "states",
            "text[]",
            text_array(State::ALL.iter().map(|s| s.as_str()).collect()),
        ),
        (
            "error_codes",
            "text[]",
            text_array(ErrorCode::ALL.iter().map(|c| c.as_str()).collect()),
        ),
        (
            "release_reasons",
            "text[]",
            text_array(ReleaseReason::ALL.iter().map(|r| r.as_str()).collect()),
        ),
    ];
    let mut sql = String::from(
        "-- The rules shared with Rust, written by `permitq migrate` from permitq/src/rules.rs.\n\
         -- PL/pgSQL, not SQL: a constraint or query calling one folds it to a constant when it is\n\
         -- planned, and PostgreSQL would parse a SQL function's body again every time.\n",
    );
    for (name, returns, value) in rules {
        let _ = writeln!(
            sql,
            "CREATE OR REPLACE FUNCTION permitq.rule_{name}() RETURNS {returns}\n\
             LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$ BEGIN RETURN {value}; END $$;"
        );
    }
    // The place in line (schema/functions/queue_order.sql): SQL, so that queries inline it, and
    // immutable (the epoch of a difference of two timestamptz does not depend on the time zone),
    // so that the unexamined requests and the waiters are indexed by it. A change of AGING_STEP
    // needs a migration that rebuilds permit_request_unexamined_place_idx and waiter_place_idx.
    let _ = writeln!(
        sql,
        "CREATE OR REPLACE FUNCTION permitq.rule_place_in_line(priority smallint, created_at timestamptz)\n\
         RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$\n    \
         SELECT priority::bigint * {}::bigint\n        \
         - (extract(epoch FROM created_at - timestamptz '1970-01-01 00:00:00+00') * 1000000)::bigint\n$$;",
        AGING_STEP.as_micros()
    );
    sql
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_bounded_by_the_rule() {
        assert_eq!(duration_problem(Some(MAX_DURATION), false), None);
        let over = MAX_DURATION + Duration::from_secs(1);
        assert_eq!(
            duration_problem(Some(over), true),
            Some(format!(
                "must be at most 10 years ({MAX_DURATION_DAYS} days), got {}s",
                over.as_secs()
            ))
        );
        assert_eq!(
            duration_problem(Some(Duration::ZERO), false).as_deref(),
            Some("must be positive, got 0s")
        );
        assert_eq!(duration_problem(Some(Duration::ZERO), true), None);
    }

    #[test]
    fn the_schema_functions_carry_the_constants() {
        let sql = schema_sql();
        assert!(
            sql.contains("rule_priority_min() RETURNS smallint"),
            "{sql}"
        );
        let min = PRIORITY_RANGE.start();
        assert!(sql.contains(&format!("RETURN ({min})::smallint")), "{sql}");
        let step = AGING_STEP.as_micros();
        assert!(sql.contains(&format!("RETURN {step}::bigint")), "{sql}");
        assert!(
            sql.contains("'unknown_semaphore', 'exceeds_capacity'"),
            "{sql}"
        );
        // The queue's order: priority steps of AGING_STEP, in the same unit (µs) as the age.
        let place = sql
            .split("FUNCTION permitq.rule_place_in_line(")
            .nth(1)
            .and_then(|rest| rest.split("$$;").next())
            .expect("rule_place_in_line is defined");
        assert!(
            place.contains(&format!("priority::bigint * {step}::bigint"))
                && place.contains("* 1000000)::bigint"),
            "{place}"
        );
        let above = PRIORITY_RANGE.end() + 1;
        assert_eq!(
            priority_problem(above),
            Some(format!(
                "must be between {min} and {}, got {above}",
                PRIORITY_RANGE.end()
            ))
        );
    }
}
