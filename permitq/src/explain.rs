//! Why a request waits: [`Explanation`], read from `permitq.explain`.

use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio_postgres::Row;

use crate::error::Result;
use crate::types::{ser_secs, State};

/// What a request waits for, semaphore by semaphore; or, when it no longer waits, its outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct Explanation {
    /// The request.
    pub external_id: String,
    /// Where it is in its life.
    pub state: State,
    /// For a request that no longer waits: how it ended, in words
    /// ([`crate::PermitRequest::outcome`]: `acquired`, `released (expired)`,
    /// `error exceeds_capacity: gpu=5 but gpu has capacity 4; ...`).
    pub outcome: Option<String>,
    /// For a request that ended in `error`: what it hit.
    pub error_detail: Option<crate::ErrorDetail>,
    /// For a waiting request while no worker runs: that nothing is granting
    /// ([`crate::Granting::warning`]).
    pub nothing_granting: Option<String>,
    /// For a waiting request: each semaphore it names, in name order, then their parents
    /// (nested limits), nearest first.
    pub semaphores: Vec<SemaphoreWait>,
    /// For a waiting request with a `wait`: when that runs out (it then fails with `timeout`).
    #[serde(serialize_with = "crate::types::ser_time")]
    pub wait_ends_at: Option<SystemTime>,
    /// For a waiting request: the least `--max-hold` of the running workers (`None`: none has
    /// one), past which a holder is released as stale, with or without a lease. Seconds in
    /// JSON.
    #[serde(serialize_with = "ser_secs")]
    pub max_hold: Option<Duration>,
    /// For a waiting request: its priority as submitted.
    pub priority: Option<i16>,
    /// For a waiting request: its priority plus one per [`crate::AGING_STEP`] it has waited,
    /// which orders its line (see [`crate::Rank`]).
    pub aged_priority: Option<f64>,
}

/// A waiting request on one of its semaphores.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SemaphoreWait {
    /// The semaphore.
    pub semaphore: String,
    /// The count the request needs there.
    pub needs: i64,
    /// Its capacity (`None`: it does not exist yet).
    pub capacity: Option<i64>,
    /// The room free now (for a rate limit, what its window has left).
    pub free: Option<i64>,
    /// How much is missing: `needs - free`, at least 0.
    pub shortfall: Option<i64>,
    /// Its place in this semaphore's line, 1 first (`None` until a worker examined it).
    pub position: Option<i64>,
    /// The permits the requests ahead of it need.
    pub permits_ahead: Option<i64>,
    /// What holds it back here, in words.
    pub reason: String,
    /// The holders, soonest to end first (at most 10), where the request is short of room
    /// (`shortfall` > 0); none elsewhere.
    pub holders: Vec<BlockingHolder>,
    /// An estimate of the wait, from how fast this semaphore's permits were released lately
    /// (or when a spent rate window opens); `None` without history. Seconds in JSON.
    #[serde(serialize_with = "ser_secs")]
    pub estimated_wait: Option<Duration>,
    /// For a parent (nested limits): the semaphore the request names below it.
    pub via: Option<String>,
    /// For a parent: the room it keeps for its other active children's unused guarantees.
    pub kept: Option<i64>,
    /// How long ago the last release here was, among those the estimate is made from (`None`
    /// without one). Past the estimate, releases have stopped and `estimated_wait` is `None`.
    /// Seconds in JSON.
    #[serde(serialize_with = "ser_secs")]
    pub since_last_release: Option<Duration>,
    /// On a semaphore served by fairness key, in words: the request's key and weight, how far
    /// back its key's earlier turns placed it and which of its key's requests are ahead, and
    /// until when another key's arrival still goes ahead of it (`None` elsewhere).
    pub fairness: Option<String>,
}

/// A request holding permits that a waiting request needs.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct BlockingHolder {
    /// The holding request.
    pub external_id: String,
    /// How many permits of the semaphore it holds.
    pub count: i64,
    /// How long it has held them, in seconds.
    pub held_for_s: f64,
    /// When its lease ends, if it has one.
    #[serde(serialize_with = "crate::types::ser_time")]
    pub expires_at: Option<SystemTime>,
}

/// Builds the explanation from the rows of `permitq.explain` (none: an unknown request).
pub(crate) fn explanation_from_rows(rows: &[Row]) -> Result<Option<Explanation>> {
    let Some(first) = rows.first() else {
        return Ok(None);
    };
    let mut explanation = Explanation {
        external_id: first.try_get(0)?,
        state: first.try_get::<_, String>(1)?.parse()?,
        outcome: first.try_get(2)?,
        error_detail: None,
        nothing_granting: None,
        semaphores: Vec::new(),
        wait_ends_at: None,
        max_hold: None,
        priority: None,
        aged_priority: None,
    };
    for row in rows {
        let Some(semaphore) = row.try_get::<_, Option<String>>(3)? else {
            continue;
        };
        let holders: serde_json::Value = row.try_get(11)?;
        let holders = holders
            .as_array()
            .map(|list| {
                list.iter()
                    .map(|h| BlockingHolder {
                        external_id: h["external_id"].as_str().unwrap_or_default().to_string(),
                        count: h["count"].as_i64().unwrap_or_default(),
                        held_for_s: h["held_for_s"].as_f64().unwrap_or_default(),
                        // The stored instant (not now + the rounded seconds left, which
                        // drifted from one call to the next).
                        expires_at: h["expires_epoch"].as_f64().and_then(|s| {
                            std::time::UNIX_EPOCH.checked_add(Duration::try_from_secs_f64(s).ok()?)
                        }),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let int = |i: usize| -> Result<Option<i64>> {
            Ok(row.try_get::<_, Option<i32>>(i)?.map(i64::from))
        };
        explanation.semaphores.push(SemaphoreWait {
            semaphore,
            needs: int(4)?.unwrap_or_default(),
            capacity: int(5)?,
            free: int(6)?,
            shortfall: int(7)?,
            position: row.try_get(8)?,
            permits_ahead: row.try_get(9)?,
            reason: row.try_get::<_, Option<String>>(10)?.unwrap_or_default(),
            holders,
            estimated_wait: row
                .try_get::<_, Option<f64>>(12)?
                .map(|s| Duration::from_secs_f64(s.max(0.0))),
            via: row.try_get(13)?,
            kept: int(14)?,
            since_last_release: row
                .try_get::<_, Option<f64>>(15)?
                .map(|s| Duration::from_secs_f64(s.max(0.0))),
            fairness: row.try_get(16)?,
        });
    }
    Ok(Some(explanation))
}

/// The words `permitq.explain` uses for a request no worker has examined yet, up to the end of
/// its reason: they speak of a running worker.
const NOT_EXAMINED: &str = "not examined by a worker yet: a running worker does";
/// The start of its reason for a request that fits: it speaks of a worker's next pass.
const FITS: &str = "it fits: a worker grants it at its next pass";
/// Its words for a request past its wait: they speak of a worker's next pass.
const WAIT_RAN_OUT: &str = "the next worker pass ends it as timeout";

impl Explanation {
    /// While nothing is granting, a request not examined yet is said to wait for a worker to
    /// run, not for a running one to examine it, one that fits to be granted once a worker
    /// runs, not at its next pass, and one past its wait to be ended once a worker runs (the
    /// reason's words would contradict [`Explanation::nothing_granting`]). The words replaced
    /// run to the end of the reason (or of the parenthesis it is in: `(before that: …)` for a
    /// request past its wait), so the parentheses left open before them are closed after.
    pub(crate) fn say_no_worker_examines(&mut self) {
        for s in &mut self.semaphores {
            s.reason =
                s.reason
                    .replacen(WAIT_RAN_OUT, "a worker ends it as timeout once one runs", 1);
            for (words, instead) in [
                (
                    FITS,
                    "it fits: a worker grants it once one runs (none does: start one, \
                     `permitq worker`)",
                ),
                (
                    NOT_EXAMINED,
                    "not examined by a worker yet, and no worker runs to examine it: start one \
                     (`permitq worker`)",
                ),
            ] {
                if let Some(at) = s.reason.find(words) {
                    s.reason.truncate(at);
                    let open = s
                        .reason
                        .matches('(')
                        .count()
                        .saturating_sub(s.reason.matches(')').count());
                    s.reason.push_str(instead);
                    s.reason.push_str(&")".repeat(open));
                    break;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(reason: &str) -> Explanation {
        Explanation {
            external_id: "r".into(),
            state: State::New,
            outcome: None,
            error_detail: None,
            nothing_granting: Some("nothing is granting".into()),
            semaphores: vec![SemaphoreWait {
                semaphore: "gpu".into(),
                needs: 1,
                capacity: Some(1),
                free: Some(0),
                shortfall: Some(1),
                position: None,
                permits_ahead: None,
                reason: reason.into(),
                holders: Vec::new(),
                estimated_wait: None,
                via: None,
                kept: None,
                since_last_release: None,
                fairness: None,
            }],
            wait_ends_at: None,
            max_hold: None,
            priority: None,
            aged_priority: None,
        }
    }

    #[test]
    fn a_request_that_fits_while_nothing_grants_waits_for_a_worker_to_run() {
        let mut e = waiting(
            "it fits: a worker grants it at its next pass (within a second or so; if not, …)",
        );
        e.say_no_worker_examines();
        assert_eq!(
            e.semaphores[0].reason,
            "it fits: a worker grants it once one runs (none does: start one, `permitq worker`)"
        );
    }

    #[test]
    fn a_request_not_examined_while_nothing_grants_waits_for_a_worker_to_run() {
        let mut e = waiting(
            "not examined by a worker yet: a running worker does within a second or so (…)",
        );
        e.say_no_worker_examines();
        assert_eq!(
            e.semaphores[0].reason,
            "not examined by a worker yet, and no worker runs to examine it: start one \
             (`permitq worker`)"
        );
        let mut e = waiting(
            "rate limit: its window is spent; room opens in 3s (not examined by a worker yet: a \
             running worker does within a second or so, and then …)",
        );
        e.say_no_worker_examines();
        assert!(
            e.semaphores[0].reason.ends_with(
                "opens in 3s (not examined by a worker yet, and no worker runs to examine it: \
                 start one (`permitq worker`))"
            ),
            "{}",
            e.semaphores[0].reason
        );
        // Past its wait: the reason before it is in parentheses, closed again, and the end of
        // the request is not promised at a pass.
        let mut e = waiting(
            "its wait ran out 3s ago: the next worker pass ends it as timeout, not granted \
             (before that: not examined by a worker yet: a running worker does within a second \
             or so (…))",
        );
        e.say_no_worker_examines();
        assert_eq!(
            e.semaphores[0].reason,
            "its wait ran out 3s ago: a worker ends it as timeout once one runs, not granted \
             (before that: not examined by a worker yet, and no worker runs to examine it: start \
             one (`permitq worker`))"
        );
        let mut e = waiting(
            "its wait ran out 3s ago: the next worker pass ends it as timeout, not granted \
             (before that: it fits: a worker grants it at its next pass (within a second or so; \
             if not, …))",
        );
        e.say_no_worker_examines();
        assert_eq!(
            e.semaphores[0].reason,
            "its wait ran out 3s ago: a worker ends it as timeout once one runs, not granted \
             (before that: it fits: a worker grants it once one runs (none does: start one, \
             `permitq worker`))"
        );
        let mut e = waiting("waits for 1 more permit to be released (first in line)");
        e.say_no_worker_examines();
        assert_eq!(
            e.semaphores[0].reason,
            "waits for 1 more permit to be released (first in line)"
        );
    }
}
