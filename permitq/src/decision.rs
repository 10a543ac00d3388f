//! The grant decision: a pure function, no database.
//!
//! Given the semaphores a worker has locked and the requests it claimed, in id (FIFO) order, say
//! who is granted, who errors (and why) and who waits. The worker applies the result in the same
//! transaction, under the same locks.
//!
//! What a grant takes ([`charges`]): its count on each semaphore it names and on each of their
//! ancestors (a semaphore with a parent is a limit inside its parent's), summed per semaphore.
//!
//! Rules, checked in this order for each request:
//! 0. the stored row is invalid (see [`Candidate::invalid`]) → `invalid`;
//! 1. a named semaphore (or an ancestor) is missing → `unknown_semaphore`;
//! 2. a count it takes is larger than that semaphore's capacity → `exceeds_capacity`;
//! 3. its `wait` deadline has passed → `timeout`;
//! 4. it fits on **every** semaphore it takes from → granted on all of them (all-or-nothing);
//! 5. otherwise `wait = 0` → `no_capacity`, else it waits.
//!
//! "Fits" on a semaphore means `capacity - used >= count` at every level, and on a `fair`
//! semaphore it names (or borrows at, see below) also that
//! the request waiting there that is first in line (the head), if ahead of this one, keeps its
//! room: `capacity - used - count >= head's count`. The head is the first in line of the
//! semaphore's recorded waiters outside this batch ([`SemaphoreView::head`]) and the requests of
//! this batch already left waiting. A waiting request is the head on every fair semaphore it
//! names, not only the one that is full: otherwise later requests could drain the others while
//! it waits (starvation). A fair semaphore's head that borrows nowhere (within the guarantee at
//! every level above it) keeps its count free on each of its ancestors as well, against the
//! requests that name that semaphore: the room it waits for may be short on a parent, and a
//! later request of the same child must not take it there.
//!
//! Guarantees: a child's `guarantee` is a share of its parent kept for it while it is active
//! (holds permits, or has a request waiting within its unused guarantee: one that would borrow
//! keeps nothing in reserve, so that it cannot wait for a borrower that waits for its reserve).
//! Where a request *borrows* at a parent, taking more through a
//! child than the child's unused guarantee there (or naming the parent itself), it fits only if
//! the parent keeps room for every other active child's unused guarantee afterwards
//! (`reserve_after`), and it keeps the parent's head's room: borrowers take their turns in the
//! parent's line. Within its guarantee a child needs only room (and on a fair child, to leave
//! its own head's count free, as above): it is never refused because others borrowed, as long
//! as it was active when they did.
//!
//! "In line" is [`Rank`]: the higher effective priority first, and among equals the older (lower
//! id) first. The effective priority is the request's priority plus one per
//! [`crate::AGING_STEP`] it has waited; compared at any one instant that orders requests
//! by `priority × AGING_STEP − created_at`, the key the database computes
//! (`permitq.rule_place_in_line`, µs): the order never changes as they wait, and a request is
//! never overtaken by one submitted more than (their priority difference) × AGING_STEP after it.
//! With every priority 0 the order is FIFO.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BTreeSet};

use crate::outcome::ErrorDetail;
use crate::types::ErrorCode;

/// A request's place in line: compares as "ahead" (less) when its effective priority is higher,
/// or equal and its id lower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rank {
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
pub struct Head {
    /// The request's id (its FIFO position).
    pub request_id: i64,
    /// Its count on this semaphore.
    pub count: i64,
    /// Its effective priority (see [`Rank`]).
    pub effective: i64,
}

impl Head {
    /// Its place in line.
    pub fn rank(&self) -> Rank {
        Rank {
            effective: self.effective,
            id: self.request_id,
        }
    }
}

/// A locked semaphore, as the decision sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SemaphoreView {
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
    /// Its parent, whose room a grant here also takes.
    pub parent: Option<String>,
    /// Its guaranteed share of its parent while active.
    pub guarantee: i64,
    /// It holds permits, or a request waits on it (or below it) within its unused guarantee:
    /// a guaranteed child is active.
    pub active: bool,
}

impl SemaphoreView {
    fn free(&self) -> i64 {
        self.capacity - self.used
    }

    /// What is left of its guarantee (0 past it): a take up to this is within the guarantee.
    fn unused_guarantee(&self) -> i64 {
        (self.guarantee - self.used).max(0)
    }
}

/// Semaphore `name` and its ancestors, nearest first, with their views: at most `steps` of
/// them, ending at a missing one (bounded: a cycle the schema failed to prevent cannot loop).
fn chain<'a>(
    name: &'a str,
    sems: &'a BTreeMap<String, SemaphoreView>,
    steps: usize,
) -> impl Iterator<Item = (&'a str, &'a SemaphoreView)> {
    let view = |n: &'a str| sems.get_key_value(n).map(|(n, s)| (n.as_str(), s));
    std::iter::successors(view(name), move |(_, s)| s.parent.as_deref().and_then(view)).take(steps)
}

/// A claimed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
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
pub enum Verdict {
    /// Granted on all its semaphores.
    Grant,
    /// Ends in `error` with this code.
    Fail(ErrorCode),
    /// Stays `new`.
    Wait,
}

/// The outcome of [`decide`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    /// One verdict per candidate, in candidate order.
    pub verdicts: Vec<(i64, Verdict)>,
    /// The semaphores after the grants (`used` updated).
    pub semaphores: BTreeMap<String, SemaphoreView>,
    /// What each granted or waiting candidate takes where that is more than it names (its
    /// semaphores have parents): semaphore → count.
    pub charges: BTreeMap<i64, BTreeMap<String, i64>>,
    /// For each failed candidate, what it hit ([`failure_detail`]).
    pub details: BTreeMap<i64, ErrorDetail>,
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

/// Whether another order of the same candidates could have decided otherwise than `decision`
/// did, on `semaphores` (those [`decide`] was given). Not when every candidate was granted, no
/// semaphore had a request waiting outside the batch (a head), and no guarantee is in play (a
/// grant may activate a child's guarantee, and so reserve room on its parent for what comes
/// after it): then the batch's total fits everywhere, and every order grants all of it.
///
/// The workers decide a batch naming a keyed semaphore on arrival order first, and place it by
/// fairness key (which reorders it) only when the order mattered.
pub fn order_mattered(semaphores: &BTreeMap<String, SemaphoreView>, decision: &Decision) -> bool {
    decision.verdicts.iter().any(|(_, v)| *v != Verdict::Grant)
        || semaphores
            .values()
            .any(|s| s.head.is_some() || s.guarantee > 0)
}

/// The semaphores where [`decide`] can grant nothing, whatever waits there and in whatever
/// order: no room left (a grant takes at least one permit). Their heads change no verdict.
/// Only those outside any nesting: an ancestor's heads are read up to the places of the
/// requests below it (a full child's among them), so leaving a child out would read its
/// parent's line less far.
pub fn without_room(semaphores: &BTreeMap<String, SemaphoreView>) -> Vec<String> {
    let parents: BTreeSet<&str> = semaphores
        .values()
        .filter_map(|s| s.parent.as_deref())
        .collect();
    semaphores
        .iter()
        .filter(|(name, s)| s.free() <= 0 && s.parent.is_none() && !parents.contains(name.as_str()))
        .map(|(name, _)| name.clone())
        .collect()
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

/// What granting `c` takes: its count on each semaphore it names and on each of their
/// ancestors, summed per semaphore. `None` when one of them is missing.
pub fn charges(
    c: &Candidate,
    sems: &BTreeMap<String, SemaphoreView>,
) -> Option<BTreeMap<String, i64>> {
    let mut taken: BTreeMap<String, i64> = BTreeMap::new();
    for (name, count) in &c.permits {
        let mut s = sems.get(name)?;
        *taken.entry(name.clone()).or_insert(0) += count;
        // Bounded: a cycle the schema failed to prevent cannot loop.
        for _ in 0..crate::rules::MAX_NESTING_DEPTH {
            let Some(parent) = &s.parent else { break };
            s = sems.get(parent)?;
            *taken.entry(parent.clone()).or_insert(0) += count;
        }
    }
    Some(taken)
}

/// Each parent's children that have a guarantee (the ones its reserve counts).
type GuaranteedChildren<'a> = BTreeMap<&'a str, Vec<&'a str>>;

fn guaranteed_children(sems: &BTreeMap<String, SemaphoreView>) -> GuaranteedChildren<'_> {
    let mut children: GuaranteedChildren<'_> = BTreeMap::new();
    for (name, s) in sems {
        if let (Some(parent), true) = (&s.parent, s.guarantee > 0) {
            children
                .entry(parent.as_str())
                .or_default()
                .push(name.as_str());
        }
    }
    children
}

/// The room `parent` keeps after a grant taking `taken`: the unused guarantee of each of its
/// other children (not one the grant takes through) that is active (holds permits, or a request
/// waits on it within the guarantee, in the database or in this batch). A child the grant takes
/// through is its own: its unused guarantee was kept for it, and its waiter rows, left by this
/// very request when it waited before, kept it in reserve against itself for ever.
fn reserve_after(
    parent: &str,
    taken: &BTreeMap<String, i64>,
    sems: &BTreeMap<String, SemaphoreView>,
    children: &GuaranteedChildren<'_>,
    batch_waiting: &BTreeSet<String>,
) -> i64 {
    children.get(parent).map_or(0, |names| {
        names
            .iter()
            .filter(|name| !taken.contains_key(**name))
            .map(|name| {
                let s = &sems[*name];
                if s.used > 0 || s.active || batch_waiting.contains(*name) {
                    s.unused_guarantee()
                } else {
                    0
                }
            })
            .sum()
    })
}

/// Whether a grant taking `taken` borrows at `parent`: it names `parent` itself, or takes more
/// through one of its children than that child's unused guarantee (a child without a guarantee
/// borrows everything it takes).
fn borrows_at(
    parent: &str,
    c: &Candidate,
    taken: &BTreeMap<String, i64>,
    sems: &BTreeMap<String, SemaphoreView>,
) -> bool {
    c.permits.iter().any(|(name, _)| name == parent)
        || taken.iter().any(|(name, count)| {
            let s = &sems[name];
            s.parent.as_deref() == Some(parent) && *count > s.unused_guarantee()
        })
}

/// The state [`decide`] carries from one candidate to the next.
struct Batch<'a> {
    sems: BTreeMap<String, SemaphoreView>,
    children: GuaranteedChildren<'a>,
    /// Per semaphore, the first in line of this batch's candidates left waiting on it.
    heads: BTreeMap<String, Head>,
    /// The semaphores this batch's waiting candidates take from: active from then on.
    waiting: BTreeSet<String>,
}

/// Decides a batch. `candidates` must be in [`Rank`] order (first in line first).
pub fn decide(semaphores: &BTreeMap<String, SemaphoreView>, candidates: &[Candidate]) -> Decision {
    debug_assert!(
        candidates.windows(2).all(|w| w[0].rank() < w[1].rank()),
        "candidates out of order"
    );
    let mut batch = Batch {
        sems: semaphores.clone(),
        children: guaranteed_children(semaphores),
        heads: BTreeMap::new(),
        waiting: BTreeSet::new(),
    };
    let mut verdicts = Vec::with_capacity(candidates.len());
    let mut all_charges = BTreeMap::new();
    let mut details = BTreeMap::new();

    for c in candidates {
        let taken = charges(c, &batch.sems);
        let verdict = verdict_for(c, taken.as_ref(), &batch);
        if let Verdict::Fail(code) = verdict {
            details.insert(c.id, failure_detail(code, c, taken.as_ref(), &batch));
        }
        let Some(taken) = taken else {
            verdicts.push((c.id, verdict));
            continue;
        };
        match verdict {
            Verdict::Grant => {
                for (name, count) in &taken {
                    batch.sems.get_mut(name).expect("charged").used += count;
                }
            }
            Verdict::Wait => {
                // It waits in the line of every semaphore it takes from, for what it takes there;
                // a guaranteed child is active from then on where it waits within the unused
                // guarantee (a request beyond it borrows, and keeps no reserve).
                for (name, count) in &taken {
                    batch.heads.entry(name.clone()).or_insert(Head {
                        request_id: c.id,
                        count: *count,
                        effective: c.effective,
                    });
                    if *count <= batch.sems[name].unused_guarantee() {
                        batch.waiting.insert(name.clone());
                    }
                }
            }
            Verdict::Fail(_) => {}
        }
        let nested = taken.len() != c.permits.len()
            || c.permits
                .iter()
                .any(|(name, count)| taken.get(name) != Some(count));
        if nested && matches!(verdict, Verdict::Grant | Verdict::Wait) {
            all_charges.insert(c.id, taken);
        }
        verdicts.push((c.id, verdict));
    }
    Decision {
        verdicts,
        semaphores: batch.sems,
        charges: all_charges,
        details,
    }
}

fn verdict_for(c: &Candidate, taken: Option<&BTreeMap<String, i64>>, batch: &Batch<'_>) -> Verdict {
    if c.invalid {
        return Verdict::Fail(ErrorCode::Invalid);
    }
    let Some(taken) = taken else {
        return Verdict::Fail(ErrorCode::UnknownSemaphore);
    };
    let sems = &batch.sems;
    if c.permits.iter().any(|(name, _)| sems[name].refused) {
        return Verdict::Fail(ErrorCode::TooManyInstances);
    }
    if taken
        .iter()
        .any(|(name, count)| *count > sems[name].capacity)
    {
        return Verdict::Fail(ErrorCode::ExceedsCapacity);
    }
    if c.deadline_passed {
        return Verdict::Fail(ErrorCode::Timeout);
    }
    if fits(c, taken, batch) {
        Verdict::Grant
    } else if c.fail_fast {
        Verdict::Fail(ErrorCode::NoCapacity)
    } else {
        Verdict::Wait
    }
}

/// Rule 4, on every semaphore `c` takes from: room; and where it names the semaphore or borrows
/// there, the head's room on a fair one and the active children's reserve. Within a child's
/// guarantee, its parent's room is all it needs.
fn fits(c: &Candidate, taken: &BTreeMap<String, i64>, batch: &Batch<'_>) -> bool {
    taken
        .iter()
        .all(|(name, count)| fits_at(name, *count, c, taken, batch))
}

/// Rule 4 on one semaphore `name`, where `c` takes `count`.
fn fits_at(
    name: &str,
    count: i64,
    c: &Candidate,
    taken: &BTreeMap<String, i64>,
    batch: &Batch<'_>,
) -> bool {
    let sems = &batch.sems;
    let s = &sems[name];
    let free_after = s.free() - count;
    if free_after < 0 {
        return false;
    }
    // A fair semaphore it names keeps its first in line's room on every level above it too,
    // when that head borrows nowhere (within every guarantee on its chain, it waits for room
    // alone): a later request of the same child does not take the parent's room the head waits
    // for. A head that borrows takes its turn in the parents' lines instead: kept here, it
    // could wait for a reserve that the request it holds back keeps active (a cycle of waits).
    let heads_below_kept = c.permits.iter().all(|(named, _)| {
        let below = &sems[named];
        named == name
            || !below.fair
            || !is_below(named, name, sems)
            || head_before(c.rank(), below.head, batch.heads.get(named).copied()).is_none_or(
                |head| free_after >= head.count || borrows_on_its_chain(named, head.count, sems),
            )
    });
    if !heads_below_kept {
        return false;
    }
    if !borrows_at(name, c, taken, sems) {
        return true;
    }
    let head_kept = !s.fair
        || head_before(c.rank(), s.head, batch.heads.get(name).copied())
            .is_none_or(|head| free_after >= head.count);
    head_kept
        && (!batch.children.contains_key(name)
            || free_after >= reserve_after(name, taken, sems, &batch.children, &batch.waiting))
}

/// What a failure with `code` hit, for the request's `error_detail`: the semaphore and bound
/// each rule saw (see [`ErrorDetail`]). The database adds the names nearest an unknown one and a
/// template's bound (schema/functions/error_details.sql).
fn failure_detail(
    code: ErrorCode,
    c: &Candidate,
    taken: Option<&BTreeMap<String, i64>>,
    batch: &Batch<'_>,
) -> ErrorDetail {
    let sems = &batch.sems;
    let mut detail = ErrorDetail::default();
    // The semaphore `c` names that `ancestor` is (or is above).
    let named_below = |ancestor: &str| -> Option<String> {
        c.permits.iter().find_map(|(name, _)| {
            let mut at = name.as_str();
            for _ in 0..=crate::rules::MAX_NESTING_DEPTH {
                if at == ancestor {
                    return (at != name).then(|| name.clone());
                }
                at = sems.get(at)?.parent.as_deref()?;
            }
            None
        })
    };
    match (code, taken) {
        (ErrorCode::UnknownSemaphore, _) => {
            for (name, _) in &c.permits {
                // The missing one: the name itself, or an ancestor above it.
                let mut at = name.clone();
                for _ in 0..=crate::rules::MAX_NESTING_DEPTH {
                    match sems.get(&at) {
                        None => {
                            detail.named = (at != *name).then(|| name.clone());
                            detail.semaphore = Some(at);
                            return detail;
                        }
                        Some(s) => match &s.parent {
                            Some(parent) => at = parent.clone(),
                            None => break,
                        },
                    }
                }
            }
        }
        (ErrorCode::TooManyInstances, _) => {
            detail.semaphore = c
                .permits
                .iter()
                .find(|(name, _)| sems.get(name).is_some_and(|s| s.refused))
                .map(|(name, _)| name.clone());
        }
        (ErrorCode::ExceedsCapacity, Some(taken)) => {
            if let Some((name, count)) = taken
                .iter()
                .find(|(name, count)| **count > sems[*name].capacity)
            {
                detail.named = named_below(name);
                detail.semaphore = Some(name.clone());
                detail.count = Some(*count);
                detail.capacity = Some(sems[name].capacity);
            }
        }
        // A timeout names where it had no room when its wait ran out (none, when it fit there
        // and the deadline came first), as a request that would not wait does.
        (ErrorCode::NoCapacity | ErrorCode::Timeout, Some(taken)) => {
            if let Some((name, count)) = taken
                .iter()
                .find(|(name, count)| !fits_at(name, **count, c, taken, batch))
            {
                let s = &sems[name];
                detail.named = named_below(name);
                detail.semaphore = Some(name.clone());
                detail.count = Some(*count);
                detail.capacity = Some(s.capacity);
                detail.free = Some(s.free().max(0));
            }
        }
        _ => {}
    }
    detail
}

/// Whether `count` on semaphore `name` borrows at one of its ancestors: more than the unused
/// guarantee of `name`, or of an ancestor below the top, at the level above it.
fn borrows_on_its_chain(name: &str, count: i64, sems: &BTreeMap<String, SemaphoreView>) -> bool {
    chain(name, sems, crate::rules::MAX_NESTING_DEPTH)
        .any(|(_, s)| s.parent.is_some() && count > s.unused_guarantee())
}

/// Whether `ancestor` is above semaphore `name` (its parent, or its parent's, and so on).
fn is_below(name: &str, ancestor: &str, sems: &BTreeMap<String, SemaphoreView>) -> bool {
    chain(name, sems, crate::rules::MAX_NESTING_DEPTH + 1)
        .skip(1)
        .any(|(n, _)| n == ancestor)
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

#[cfg(test)]
mod nesting_tests;
