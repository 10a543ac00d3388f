//! The grant decision: a pure function, no database.
//!
//! Given the semaphores a worker has locked and the requests it claimed, in id (FIFO) order, say
//! who is granted, who errors (and why) and who waits. The worker applies the result in the same
//! transaction, under the same locks.
//!
//! Rules, checked in this order for each request:
//! 0. the stored row is invalid (see [`Candidate::invalid`]) → `invalid`;
//! 1. a named semaphore is missing → `unknown_semaphore`;
//! 2. a count is larger than its semaphore's capacity → `exceeds_capacity`;
//! 3. its `wait` deadline has passed → `timeout`;
//! 4. it fits on **every** semaphore it names → granted on all of them (all-or-nothing);
//! 5. otherwise `wait = 0` → `no_capacity`, else it waits.
//!
//! "Fits" on a semaphore means `capacity - used >= count`, and on a `fair` semaphore also that
//! the request waiting there that is first in line (the head), if ahead of this one, keeps its
//! room: `capacity - used - count >= head's count`. The head is the first in line of the
//! semaphore's recorded waiters outside this batch ([`SemaphoreView::head`]) and the requests of
//! this batch already left waiting. A waiting request is the head on every fair semaphore it
//! names, not only the one that is full: otherwise later requests could drain the others while
//! it waits (starvation).
//!
//! "In line" is [`Rank`]: the higher effective priority first, and among equals the older (lower
//! id) first. The effective priority is the request's priority plus one per
//! [`crate::AGING_STEP`] it has waited; compared at any one instant that orders requests
//! by `priority × AGING_STEP − created_at`, the key the database computes
//! (`permitq.rule_place_in_line`, µs): the order never changes as they wait, and a request is
//! never overtaken by one submitted more than (their priority difference) × AGING_STEP after it.
//! With every priority 0 the order is FIFO.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use crate::types::ErrorCode;

/// A request's place in line: compares as "ahead" (less) when its effective priority is higher,
/// or equal and its id lower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rank {
    /// `priority × AGING_STEP − created_at`, in µs: higher is ahead.
    pub effective: i64,
    /// The request's id (FIFO among equals).
    pub id: i64,
}

impl Ord for Rank {
    fn cmp(&self, other: &Rank) -> Ordering {
        other
            .effective
            .cmp(&self.effective)
            .then(self.id.cmp(&other.id))
    }
}

impl PartialOrd for Rank {
    fn partial_cmp(&self, other: &Rank) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A semaphore's head: the waiting request first in line there, that a fair semaphore keeps
/// room for (or a candidate for that place).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Head {
    /// The request's id (its FIFO position).
    pub request_id: i64,
    /// Its count on this semaphore.
    pub count: i64,
    /// Its effective priority (see [`Rank`]).
    pub effective: i64,
}

impl Head {
    /// Its place in line.
    pub(crate) fn rank(&self) -> Rank {
        Rank {
            effective: self.effective,
            id: self.request_id,
        }
    }
}

/// A locked semaphore, as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SemaphoreView {
    /// Capacity now.
    pub capacity: i64,
    /// Held now. May exceed capacity after the capacity was lowered.
    pub used: i64,
    /// Strict head-of-line with safe backfill, or greedy.
    pub fair: bool,
    /// The first in line of the requests waiting on it that are not in this batch, if any.
    pub head: Option<Head>,
    /// An instance its template may not make (it has as many as it may): requests naming it
    /// fail with `too_many_instances`.
    pub refused: bool,
}

impl SemaphoreView {
    fn free(&self) -> i64 {
        self.capacity - self.used
    }
}

/// A claimed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// Request id.
    pub id: i64,
    /// Its effective priority (see [`Rank`]); candidates come in [`Rank`] order.
    pub effective: i64,
    /// Semaphore name → count.
    pub permits: Vec<(String, i64)>,
    /// `wait = 0`: error with `no_capacity` instead of waiting.
    pub fail_fast: bool,
    /// Its `wait` deadline has passed.
    pub deadline_passed: bool,
    /// The row cannot be decided (the database's `permitq.request_problem`): it fails alone.
    pub invalid: bool,
}

/// What happens to one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Granted on all its semaphores.
    Grant,
    /// Ends in `error` with this code.
    Fail(ErrorCode),
    /// Stays `new`.
    Wait,
}

/// The outcome of [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decision {
    /// One verdict per candidate, in candidate order.
    pub verdicts: Vec<(i64, Verdict)>,
    /// The semaphores after the grants (`used` updated).
    pub semaphores: BTreeMap<String, SemaphoreView>,
}

impl Decision {
    /// Ids with the given verdict kind.
    pub(crate) fn ids(&self, pick: impl Fn(&Verdict) -> bool) -> Vec<i64> {
        self.verdicts
            .iter()
            .filter(|(_, v)| pick(v))
            .map(|(id, _)| *id)
            .collect()
    }
}

impl Candidate {
    /// Its place in line.
    pub(crate) fn rank(&self) -> Rank {
        Rank {
            effective: self.effective,
            id: self.id,
        }
    }
}

/// Decides a batch. `candidates` must be in [`Rank`] order (first in line first).
pub(crate) fn decide(
    semaphores: &BTreeMap<String, SemaphoreView>,
    candidates: &[Candidate],
) -> Decision {
    debug_assert!(
        candidates.windows(2).all(|w| w[0].rank() < w[1].rank()),
        "candidates out of order"
    );
    let mut sems = semaphores.clone();
    // Per semaphore, the first in line of this batch's candidates left waiting on it.
    let mut batch_heads: BTreeMap<&str, Head> = BTreeMap::new();
    let mut verdicts = Vec::with_capacity(candidates.len());

    for c in candidates {
        let verdict = verdict_for(c, &sems, &batch_heads);
        match verdict {
            Verdict::Grant => {
                for (name, count) in &c.permits {
                    sems.get_mut(name).expect("checked by verdict_for").used += count;
                }
            }
            Verdict::Wait => {
                for (name, count) in &c.permits {
                    batch_heads.entry(name.as_str()).or_insert(Head {
                        request_id: c.id,
                        count: *count,
                        effective: c.effective,
                    });
                }
            }
            Verdict::Fail(_) => {}
        }
        verdicts.push((c.id, verdict));
    }
    Decision {
        verdicts,
        semaphores: sems,
    }
}

fn verdict_for(
    c: &Candidate,
    sems: &BTreeMap<String, SemaphoreView>,
    batch_heads: &BTreeMap<&str, Head>,
) -> Verdict {
    if c.invalid {
        return Verdict::Fail(ErrorCode::Invalid);
    }
    let mut views = Vec::with_capacity(c.permits.len());
    for (name, count) in &c.permits {
        match sems.get(name) {
            Some(s) => views.push((name.as_str(), *count, s)),
            None => return Verdict::Fail(ErrorCode::UnknownSemaphore),
        }
    }
    if views.iter().any(|(_, _, s)| s.refused) {
        return Verdict::Fail(ErrorCode::TooManyInstances);
    }
    if views.iter().any(|(_, count, s)| *count > s.capacity) {
        return Verdict::Fail(ErrorCode::ExceedsCapacity);
    }
    if c.deadline_passed {
        return Verdict::Fail(ErrorCode::Timeout);
    }
    let fits = views.iter().all(|(name, count, s)| {
        let free_after = s.free() - count;
        free_after >= 0
            && (!s.fair
                || head_before(c.rank(), s.head, batch_heads.get(name).copied())
                    .is_none_or(|head| free_after >= head.count))
    });
    if fits {
        Verdict::Grant
    } else if c.fail_fast {
        Verdict::Fail(ErrorCode::NoCapacity)
    } else {
        Verdict::Wait
    }
}

/// The first in line ahead of `rank`: the semaphore's recorded head (outside the batch) or the
/// batch's own first waiter, whichever is ahead.
fn head_before(rank: Rank, recorded: Option<Head>, batch: Option<Head>) -> Option<Head> {
    [recorded, batch]
        .into_iter()
        .flatten()
        .filter(|w| w.rank() < rank)
        .min_by_key(Head::rank)
}

#[cfg(test)]
mod tests;
