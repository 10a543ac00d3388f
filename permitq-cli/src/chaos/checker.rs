//! Checkers over the database's final state and the recorded history.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use super::history::{Op, OpKind, Outcome};
use super::nemesis::{Fault, Outage};
use super::state::{us, FinalState, Micros, Req};

/// Violations by checker, and the fairness figures.
#[derive(Debug, Default)]
pub(crate) struct Verdict {
    /// checker → violations (messages).
    pub violations: BTreeMap<&'static str, Vec<String>>,
    /// Waits (ms) on fair semaphores: (large p99, large max, small p99, small max).
    pub waits_ms: (f64, f64, f64, f64),
    /// Requests in the final state.
    pub requests: usize,
    /// Of which granted.
    pub granted: usize,
    /// How requests ended: `released/<reason>` or `error/<code>`.
    pub endings: BTreeMap<String, usize>,
    /// Per concurrency semaphore, the most held at once and the grants that took from it
    /// (worked out from the tree for the nested ones).
    pub peaks: BTreeMap<String, (i64, usize)>,
    /// The moves of fairness keys' finish tags the keys rule replayed (`keys`), one per batch
    /// and key.
    pub key_moves: usize,
}

impl Verdict {
    fn flag(&mut self, checker: &'static str, message: String) {
        self.violations.entry(checker).or_default().push(message);
    }
}

/// Inputs beyond the final state.
pub(crate) struct Context<'a> {
    /// The recorded history.
    pub ops: &'a [Op],
    /// external_id → the fencing tokens of its grants announced on `permitq_events` (read as
    /// `acquired` just after the announcement).
    pub acquired_events: &'a HashMap<String, Vec<Option<i64>>>,
    /// Every fault, for the liveness bounds (a worker or a semaphore may be held up by any).
    pub faults: &'a [Outage],
    /// The workers' sweep interval.
    pub sweep_interval: Duration,
    /// When the load stopped.
    pub load_end: SystemTime,
}

/// How soon a worker must first examine a request (plus faults).
const EXAMINE_BOUND: Micros = 10_000_000;
/// How soon a request first in line on every semaphore it names (all fair) must be granted once
/// it is (plus faults and a rate window): holders hold for at most 0.4 s, or to a TTL of at most
/// 1.5 s when they die.
const HEAD_BOUND: Micros = 10_000_000;
/// A request that names greedy semaphores too may be passed on them: it is judged as a head only
/// once every greedy one it names has had room for it this long, without a break, after
/// [`HEAD_BOUND`] (a worker passes at least every second).
const GREEDY_ROOM: Micros = 3_000_000;
/// The least share of the decided requests the load's mix grants (runs see 75–85 %).
const GRANTED_FLOOR: f64 = 0.6;
/// How much longer than its span a fault may hold things up: a partitioned worker keeps its
/// locks until the server's idle bound (5 s); killed workers and connections reconnect, a
/// restarted server recovers.
fn aftermath(kind: Fault) -> Micros {
    match kind {
        Fault::Partition => 6_000_000,
        Fault::RestartDatabase => 3_000_000,
        Fault::KillWorker | Fault::TerminateConnections | Fault::SlowLink => 2_000_000,
        Fault::PauseHolder | Fault::LowerCapacity | Fault::TimeoutBurst => 1_000_000,
        // A migration's locks are gone at its commit; a worker replaced starts in a second.
        Fault::Migrate | Fault::UpgradeWorker => 2_000_000,
        // The fault ends once the cluster is healthy; workers and producers then find the new
        // leader (connect_timeout 2 s per dead host), and leases have their grace.
        Fault::KillLeaderPostgres
        | Fault::KillLeaderPatroni
        | Fault::PartitionLeader
        | Fault::Switchover
        | Fault::RestartReplica => 6_000_000,
    }
}

impl Context<'_> {
    /// The instant by which `bound` of calm has passed since `from`: time with no fault running
    /// and none in its aftermath. So a bound is judged however often faults come, on the calm
    /// between them.
    fn deadline(&self, from: Micros, bound: Micros) -> Micros {
        let mut stormy: Vec<(Micros, Micros)> = self
            .faults
            .iter()
            .map(|f| (us(f.from), us(f.to) + aftermath(f.kind)))
            .collect();
        stormy.sort_unstable();
        let (mut t, mut calm_left) = (from, bound);
        for (start, end) in stormy {
            if end <= t {
                continue;
            }
            if start > t {
                let calm = (start - t).min(calm_left);
                t += calm;
                calm_left -= calm;
                if calm_left == 0 {
                    return t;
                }
            }
            t = t.max(end);
        }
        t + calm_left
    }

    /// The sweeps' slack: two intervals and three seconds (a loaded 2-core machine).
    fn sweep_slack(&self) -> Micros {
        2 * i64::try_from(self.sweep_interval.as_micros()).unwrap_or(i64::MAX / 4) + 3_000_000
    }
}

/// Runs every checker.
pub(crate) fn check(state: &FinalState, cx: &Context) -> Verdict {
    let mut v = Verdict {
        requests: state.requests.len(),
        ..Verdict::default()
    };
    v.granted = state
        .requests
        .iter()
        .filter(|r| r.acquired.is_some())
        .count();
    for r in &state.requests {
        let detail = r
            .release_reason
            .as_deref()
            .or(r.error_code.as_deref())
            .unwrap_or("");
        *v.endings
            .entry(format!("{}/{detail}", r.state))
            .or_default() += 1;
    }
    let held_after = safety(state, &mut v);
    no_double_grant(state, cx, &mut v);
    guarantees(state, &mut v);
    fencing(state, cx, &mut v);
    leases(state, cx, &mut v);
    nothing_lost(state, cx, &mut v);
    liveness(state, cx, &mut v);
    outcomes(state, cx, &mut v);
    for (name, used, _) in &state.semaphores {
        if *used != 0 {
            v.flag(
                "quiescence",
                format!("{name}: used = {used} after every release"),
            );
        }
    }
    fairness(state, &held_after, cx, &mut v);
    history(state, cx, &mut v);
    v
}

fn capacity_at(state: &FinalState, semaphore: &str, t: Micros) -> i64 {
    state
        .capacity
        .get(semaphore)
        .and_then(|changes| changes.iter().rev().find(|(at, _)| *at <= t))
        .map_or(0, |c| c.1)
}

/// Interval sweep: at every grant, the counts held must fit the capacity in force. Returns the
/// amount held on the semaphore just after each (request, semaphore) grant.
fn safety(state: &FinalState, v: &mut Verdict) -> HashMap<(i64, String), i64> {
    let mut by_semaphore: HashMap<&str, Vec<(Micros, i64, i64)>> = HashMap::new();
    for (request, semaphore, count, acquired, released, _) in &state.permits {
        let events = by_semaphore.entry(semaphore.as_str()).or_default();
        events.push((*acquired, *count, *request));
        if let Some(r) = released {
            events.push((*r, -count, *request));
        }
    }
    let mut held_after = HashMap::new();
    for (semaphore, mut events) in by_semaphore {
        events.sort_by_key(|(t, delta, id)| (*t, *delta, *id));
        if let Some(per) = state.windows.get(semaphore) {
            // Rate-limited: no window of `per` may hold more grants than the capacity.
            let grants: Vec<(Micros, i64, i64)> =
                events.iter().filter(|e| e.1 > 0).copied().collect();
            for (i, (t, _, request)) in grants.iter().enumerate() {
                let in_window: i64 = grants[..=i]
                    .iter()
                    .filter(|(u, _, _)| *u > t - per)
                    .map(|g| g.1)
                    .sum();
                let cap = capacity_at(state, semaphore, *t);
                if in_window > cap {
                    v.flag("safety", format!("{semaphore}: {in_window} granted within {per} us > limit {cap} when request {request} was granted"));
                }
            }
            continue;
        }
        let mut held = 0i64;
        let mut peak = (0i64, 0usize);
        for (t, delta, request) in events {
            held += delta;
            if delta > 0 {
                peak = (peak.0.max(held), peak.1 + 1);
                held_after.insert((request, semaphore.to_string()), held);
                let cap = capacity_at(state, semaphore, t);
                if held > cap {
                    v.flag("safety", format!("{semaphore}: {held} held > capacity {cap} when request {request} was granted"));
                }
            }
        }
        v.peaks.insert(semaphore.to_string(), peak);
    }
    held_after
}

/// A request granted twice shows up three ways, each checked: a second announced grant, an
/// announced grant whose token is not the request's, and a semaphore's `granted` counter (kept by the
/// grant's own UPDATE) above the number of requests granted on it.
fn no_double_grant(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let by_key: HashMap<&str, &Req> = state
        .requests
        .iter()
        .map(|r| (r.external_id.as_str(), r))
        .collect();
    for (id, tokens) in cx.acquired_events {
        if tokens.len() > 1 {
            v.flag(
                "no double grant",
                format!("{id}: {} grants announced", tokens.len()),
            );
        }
        let stored = by_key.get(id.as_str()).and_then(|r| r.token);
        for token in tokens {
            if *token != stored {
                v.flag(
                    "no double grant",
                    format!(
                        "{id}: a grant announced with token {token:?}, the request has {stored:?}"
                    ),
                );
            }
        }
    }
    // Every level counts the grant once: those it names and their ancestors.
    let mut granted_on: HashMap<String, i64> = HashMap::new();
    for r in state.requests.iter().filter(|r| r.acquired.is_some()) {
        for name in state.tree.takes(&r.permits).into_keys() {
            *granted_on.entry(name).or_default() += 1;
        }
    }
    for (name, counter) in &state.granted_counter {
        let granted = granted_on.get(name.as_str()).copied().unwrap_or(0);
        if *counter != granted {
            v.flag(
                "no double grant",
                format!("{name}: its granted counter is {counter}, {granted} requests were granted on it"),
            );
        }
    }
    let mut ids: HashMap<&str, &str> = HashMap::new();
    for op in cx.ops.iter().filter(|o| o.kind == OpKind::Submit) {
        if let Outcome::Ok(id) = &op.outcome {
            if let Some(prev) = ids.insert(&op.key, id) {
                if prev != id {
                    v.flag(
                        "no double grant",
                        format!("{}: submits returned rows {prev} and {id}", op.key),
                    );
                }
            }
        }
    }
}

fn fencing(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let mut by_semaphore: HashMap<&str, Vec<(Micros, i64)>> = HashMap::new();
    for (_, semaphore, _, acquired, _, token) in &state.permits {
        by_semaphore
            .entry(semaphore)
            .or_default()
            .push((*acquired, *token));
    }
    for (semaphore, mut grants) in by_semaphore {
        grants.sort();
        for w in grants.windows(2) {
            if w[1].1 <= w[0].1 {
                v.flag(
                    "fencing",
                    format!(
                        "{semaphore}: token {} granted after token {}",
                        w[1].1, w[0].1
                    ),
                );
            }
        }
    }
    let fences: Vec<&Op> = cx.ops.iter().filter(|o| o.kind == OpKind::Fence).collect();
    // A token is accepted only while its request holds: not once released, nor once its lease
    // ran out, even before the sweep released it (after a promotion, leases have a grace).
    let by_token: HashMap<i64, &Req> = state
        .requests
        .iter()
        .filter_map(|r| Some((r.token?, r)))
        .collect();
    let promoted = cx.faults.iter().any(|f| Fault::HA_ONLY.contains(&f.kind));
    for f in fences
        .iter()
        .filter(|o| o.outcome == Outcome::Ok("true".into()))
    {
        let Some(r) = by_token.get(&f.arg) else {
            continue;
        };
        let at = us(f.invoked);
        let why = if r.released.is_some_and(|released| released < at) {
            "was released"
        } else if r.expires.is_some_and(|expires| expires < at) && !promoted {
            "had run out (not swept yet)"
        } else {
            continue;
        };
        v.flag(
            "fencing",
            format!(
                "{}: token {} accepted by fence after its lease {why}",
                f.key, f.arg
            ),
        );
    }
    for a in fences
        .iter()
        .filter(|o| o.key.starts_with("holder-a-") && o.outcome == Outcome::Ok("true".into()))
    {
        let overtaken = fences.iter().any(|b| {
            b.outcome == Outcome::Ok("true".into()) && b.arg > a.arg && b.completed <= a.invoked
        });
        if overtaken {
            v.flag(
                "fencing",
                format!(
                    "stale holder {} (token {}) wrote after a higher token",
                    a.key, a.arg
                ),
            );
        }
    }
}

/// No holder works past its lease: a holder under a [`permitq::Lease`] works only while the
/// guard says the lease is not lost, and the guard must say so before the lease the database
/// kept ends (its `expires_at` as last extended), and before the sweep or anyone released it.
fn leases(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let by_key: HashMap<&str, &Req> = state
        .requests
        .iter()
        .map(|r| (r.external_id.as_str(), r))
        .collect();
    for work in cx.ops.iter().filter(|o| o.kind == OpKind::Work) {
        let Some(r) = by_key.get(work.key.as_str()) else {
            continue;
        };
        let worked_until = us(work.completed);
        let ended = match (r.expires, r.released, r.release_reason.as_deref()) {
            (Some(expires), Some(released), Some(reason)) if reason != "released" => {
                Some((expires.min(released), reason))
            }
            (Some(expires), _, _) => Some((expires, "its expiry")),
            _ => None,
        };
        if let Some((end, why)) = ended.filter(|(end, _)| worked_until > *end) {
            v.flag(
                "leases",
                format!(
                    "{}: its holder worked {} ms past the end of its lease ({why})",
                    work.key,
                    (worked_until - end) / 1000
                ),
            );
        }
    }
}

/// Permits held on one semaphore: (acquired, released, count).
type HeldSpan = (Micros, Option<Micros>, i64);
/// One worker transaction: (worker, its start).
type BatchKey<'a> = (Option<&'a str>, Option<Micros>);

/// Guaranteed children keep their share: after every batch of grants on a parent (one worker
/// transaction: its grants' `acquired_at` differ by microseconds), if any of them borrowed
/// there (named the parent, or took through a child more than that child's unused guarantee),
/// the parent's free room is at least the unused guarantee of each child that held permits
/// just before the batch. Held counts are worked out from the requests and the tree, with
/// releases counted from when the holder released (a release the batch did not see lowers
/// the parent and the child alike), so the bound is one the decision must have kept. (A child
/// active only through waiters is left to the decision's property tests.)
fn guarantees(state: &FinalState, v: &mut Verdict) {
    let guaranteed: Vec<(&str, &str, i64)> = state
        .held_semaphores()
        .into_iter()
        .filter_map(|name| {
            let (parent, guarantee) = state.tree.guarantee(name)?;
            Some((name, parent, guarantee))
        })
        .collect();
    let by_id: HashMap<i64, &Req> = state.requests.iter().map(|r| (r.id, r)).collect();
    // semaphore → (acquired, released, count) of what was held on it
    let mut spans: HashMap<&str, Vec<HeldSpan>> = HashMap::new();
    for p in &state.permits {
        spans.entry(p.1.as_str()).or_default().push((p.3, p.4, p.2));
    }
    // Held on `semaphore` just before `at`, or (`through`) with what was granted at `at`.
    let held = |semaphore: &str, at: Micros, through: bool| -> i64 {
        let counts = |t: Micros| if through { t <= at } else { t < at };
        spans.get(semaphore).map_or(0, |s| {
            s.iter()
                .filter(|(acquired, released, _)| {
                    counts(*acquired) && !released.is_some_and(counts)
                })
                .map(|span| span.2)
                .sum()
        })
    };
    let parents: std::collections::BTreeSet<&str> = guaranteed.iter().map(|g| g.1).collect();
    for parent in parents {
        let children: Vec<(&str, i64)> = guaranteed
            .iter()
            .filter(|g| g.1 == parent)
            .map(|g| (g.0, g.2))
            .collect();
        // The batches that granted on the parent: (worker, transaction start) → grants.
        let mut batches: BTreeMap<BatchKey<'_>, Vec<(&Req, Micros)>> = BTreeMap::new();
        for p in state.permits.iter().filter(|p| p.1 == parent) {
            if let Some(r) = by_id.get(&p.0) {
                batches
                    .entry((r.worker_id.as_deref(), r.decided))
                    .or_default()
                    .push((r, p.3));
            }
        }
        for grants in batches.values() {
            let first = grants.iter().map(|g| g.1).min().unwrap_or_default();
            let last = grants.iter().map(|g| g.1).max().unwrap_or_default();
            let borrowed = grants.iter().any(|(r, _)| {
                let taken = state.tree.takes(&r.permits);
                r.count_on(parent) > 0
                    || children.iter().any(|(child, guarantee)| {
                        taken
                            .get(*child)
                            .is_some_and(|n| *n > (guarantee - held(child, first, false)).max(0))
                    })
            });
            if !borrowed {
                continue;
            }
            let free = capacity_at(state, parent, last) - held(parent, last, true);
            let kept: i64 = children
                .iter()
                .filter(|(child, _)| held(child, first, false) > 0)
                .map(|(child, guarantee)| (guarantee - held(child, last, true)).max(0))
                .sum();
            if free < kept {
                v.flag(
                    "guarantees",
                    format!(
                        "{parent}: a batch borrowed there at {last} µs and left {free} free, under the {kept} kept for its active guaranteed children"
                    ),
                );
            }
        }
    }
}

/// What the database lost of what clients were told: a submit acknowledged (`ok`) with no row
/// at the end, and a release acknowledged as `released` whose row was not released by the
/// holder by then (a lost release of a lease comes back as `expired`). With when
/// the client was told, to put each loss beside the fault that caused it.
pub(crate) fn lost_acknowledged(state: &FinalState, ops: &[Op]) -> Vec<(SystemTime, String)> {
    let by_key: HashMap<&str, &Req> = state
        .requests
        .iter()
        .map(|r| (r.external_id.as_str(), r))
        .collect();
    let mut lost = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for o in ops {
        let row = by_key.get(o.key.as_str());
        let what = match (o.kind, &o.outcome, row) {
            (OpKind::Submit, Outcome::Ok(_), None) => {
                format!("{}: submit returned ok but there is no row", o.key)
            }
            (OpKind::Release, Outcome::Ok(said), Some(r))
                if said == "released"
                    && (r.state != "released"
                        || r.release_reason.as_deref() != Some("released")
                        || r.released.is_none_or(|at| at > us(o.completed))) =>
            {
                format!(
                    "{}: release returned released but the request is {} {:?}",
                    o.key, r.state, r.release_reason
                )
            }
            _ => continue,
        };
        if seen.insert(what.clone()) {
            lost.push((o.completed, what));
        }
    }
    lost
}

fn nothing_lost(state: &FinalState, cx: &Context, v: &mut Verdict) {
    for (_, what) in lost_acknowledged(state, cx.ops) {
        v.flag("nothing lost", what);
    }
    for r in &state.requests {
        if r.state == "new" || r.state == "in_progress" {
            let submitted = cx
                .ops
                .iter()
                .any(|o| o.key == r.external_id && o.kind == OpKind::Submit);
            if submitted {
                v.flag(
                    "nothing lost",
                    format!("{}: still {} at the end", r.external_id, r.state),
                );
            }
        }
    }
}

/// Judged on what the database recorded, never on a client's patience:
/// - every request is first examined by a worker within [`EXAMINE_BOUND`] (plus faults), unless
///   it ended before that;
/// - a request with a `wait` is granted or timed out by `wait` plus the sweeps' slack;
/// - a lease is released by its expiry plus the sweeps' slack;
/// - a request whose semaphores are all fair is granted within [`HEAD_BOUND`] (plus faults, plus
///   a rate window) of becoming first in line on every one of them: no head starves.
///
/// Deadlines past the end of the load are not judged (the run's drain is not a stream).
fn liveness(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let load_end = us(cx.load_end);
    for r in &state.requests {
        let by = cx.deadline(r.created, EXAMINE_BOUND);
        let examined_in_time = r.examined.is_some_and(|e| e <= by);
        let ended_first = r.left().is_some_and(|l| l <= by);
        if by < load_end && !examined_in_time && !ended_first {
            v.flag(
                "liveness",
                format!(
                    "{}: never examined by a worker within {} ms (examined at {:?})",
                    r.external_id,
                    (by - r.created) / 1000,
                    r.examined.map(|e| (e - r.created) / 1000)
                ),
            );
        }
        if let Some(wait) = r.wait_us.filter(|w| *w > 0) {
            let by = cx.deadline(r.created + wait, cx.sweep_slack());
            if by < load_end && r.left().is_none_or(|l| l > by) {
                v.flag(
                    "liveness",
                    format!(
                        "{}: wait {} ms, still new {} ms after it was submitted",
                        r.external_id,
                        wait / 1000,
                        (by - r.created) / 1000
                    ),
                );
            }
        }
        if let Some(expires) = r.expires {
            let by = cx.deadline(expires, cx.sweep_slack());
            if by < load_end && r.released.is_none_or(|rel| rel > by) {
                v.flag(
                    "liveness",
                    format!(
                        "{}: lease held past its expiry (released {:?} ms after it)",
                        r.external_id,
                        r.released.map(|rel| (rel - expires) / 1000)
                    ),
                );
            }
        }
    }
    heads_are_granted(state, cx, v);
}

/// A request must be granted within [`HEAD_BOUND`] of becoming first in line on every fair
/// semaphore it takes from (with their parents): the moment every request ranked ahead of it
/// there, and waiting with it, has left the line. Where it also names greedy semaphores, which
/// may pass it, only once each of those has had room for it for [`GREEDY_ROOM`] after that
/// bound (otherwise the first request stuck on a fair semaphore often names a greedy one too,
/// and shields every head behind it). Requests on keyed semaphores are not judged here: their
/// line is in the order of places, not of arrival.
fn heads_are_granted(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let fair: HashMap<&str, bool> = state
        .semaphores
        .iter()
        .map(|(name, _, fair)| (name.as_str(), *fair))
        .collect();
    let load_end = us(cx.load_end);
    // Every semaphore each request takes from (with its parents') and its count there.
    let takes: HashMap<i64, BTreeMap<String, i64>> = state
        .requests
        .iter()
        .map(|r| (r.id, state.tree.takes(&r.permits)))
        .collect();
    let mut naming: HashMap<&str, Vec<&Req>> = HashMap::new();
    for r in &state.requests {
        for name in takes[&r.id].keys() {
            naming.entry(name).or_default().push(r);
        }
    }
    let held = HeldOver::new(state);
    for r in &state.requests {
        let taken = &takes[&r.id];
        if taken
            .keys()
            .any(|n| !fair.contains_key(n.as_str()) || state.keyed.contains(n))
        {
            continue;
        }
        let (fair_lines, greedy): (Vec<_>, Vec<_>) =
            taken.iter().partition(|(n, _)| fair[n.as_str()]);
        if fair_lines.is_empty() {
            continue;
        }
        let mut first_in_line = r.created;
        for (name, _) in &fair_lines {
            for w in naming.get(name.as_str()).into_iter().flatten() {
                let overlaps = w.created < r.left().unwrap_or(Micros::MAX)
                    && w.left().is_none_or(|l| l > r.created);
                if w.id != r.id && overlaps && w.rank() > r.rank() {
                    first_in_line = first_in_line.max(w.left().unwrap_or(Micros::MAX));
                }
            }
        }
        if first_in_line == Micros::MAX {
            continue; // something ahead of it never left: that one is judged instead
        }
        let window = taken
            .keys()
            .filter_map(|n| state.windows.get(n))
            .max()
            .copied()
            .unwrap_or(0);
        let mut by = cx.deadline(first_in_line, HEAD_BOUND + window);
        let mut with_room = String::new();
        if !greedy.is_empty() {
            // The first span of GREEDY_ROOM after the bound with room on every greedy one.
            let wanted: Vec<(&str, i64)> = greedy.iter().map(|(n, c)| (n.as_str(), **c)).collect();
            let Some((calm_from, calm_to)) = held.first_calm(&wanted, by, load_end, cx) else {
                continue; // passed on a greedy semaphore, as it may be, until the load's end
            };
            with_room = format!(
                ", then had room on {:?} for {} ms from {} ms after that",
                wanted.iter().map(|(n, _)| *n).collect::<Vec<_>>(),
                (calm_to - calm_from) / 1000,
                (calm_from - by) / 1000
            );
            by = calm_to;
        }
        if by < load_end && r.left().is_none_or(|l| l > by) {
            v.flag(
                "liveness",
                format!(
                    "{}: first in line on {:?} for {} ms{with_room} and not granted (a starved \
                     head)",
                    r.external_id,
                    fair_lines
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>(),
                    (by - first_in_line) / 1000
                ),
            );
        }
    }
}

/// What each semaphore had free over the run (capacity less what was held), from the grants the
/// checker worked out: a step function per semaphore.
struct HeldOver<'a> {
    /// semaphore → (time, room just after it), by time; at one instant every grant comes before
    /// every release, so a step's dips are kept (room is never overstated).
    steps: HashMap<&'a str, Vec<(Micros, i64)>>,
}

impl<'a> HeldOver<'a> {
    fn new(state: &'a FinalState) -> HeldOver<'a> {
        // (time, order at that instant, held delta, capacity set): grants, then capacity
        // changes, then releases.
        type Event = (Micros, u8, i64, Option<i64>);
        let mut events: HashMap<&str, Vec<Event>> = HashMap::new();
        for (_, semaphore, count, acquired, released, _) in &state.permits {
            let e = events.entry(semaphore.as_str()).or_default();
            e.push((*acquired, 0, *count, None));
            if let Some(released) = released {
                e.push((*released, 2, -count, None));
            }
        }
        for (semaphore, changes) in &state.capacity {
            let e = events.entry(semaphore.as_str()).or_default();
            e.extend(
                changes
                    .iter()
                    .map(|(at, capacity)| (*at, 1, 0, Some(*capacity))),
            );
        }
        let steps = events
            .into_iter()
            .map(|(semaphore, mut events)| {
                events.sort_unstable_by_key(|e| (e.0, e.1));
                let (mut held, mut capacity) = (0, 0);
                let steps = events
                    .into_iter()
                    .map(|(at, _, delta, set)| {
                        held += delta;
                        capacity = set.unwrap_or(capacity);
                        (at, capacity - held)
                    })
                    .collect();
                (semaphore, steps)
            })
            .collect();
        HeldOver { steps }
    }

    /// The room on `semaphore` at `t` (none before it was made).
    fn room_at(&self, semaphore: &str, t: Micros) -> i64 {
        let steps = self.steps.get(semaphore).map(Vec::as_slice).unwrap_or(&[]);
        match steps.partition_point(|s| s.0 <= t) {
            0 => 0,
            n => steps[n - 1].1,
        }
    }

    /// Whether `semaphore` had room for `count` at every moment of `[from, to]`.
    fn room_throughout(&self, semaphore: &str, count: i64, from: Micros, to: Micros) -> bool {
        let steps = self.steps.get(semaphore).map(Vec::as_slice).unwrap_or(&[]);
        let first = steps.partition_point(|s| s.0 <= from);
        self.room_at(semaphore, from) >= count
            && steps[first..]
                .iter()
                .take_while(|s| s.0 <= to)
                .all(|s| s.1 >= count)
    }

    /// The first span from `from` on, [start, deadline(start, GREEDY_ROOM)], ending before
    /// `until`, in which every `(semaphore, count)` of `wanted` had room throughout. A span can
    /// only start at `from` or where room grew on one of them.
    fn first_calm(
        &self,
        wanted: &[(&str, i64)],
        from: Micros,
        until: Micros,
        cx: &Context,
    ) -> Option<(Micros, Micros)> {
        let mut starts: Vec<Micros> = vec![from];
        for (semaphore, _) in wanted {
            let steps = self.steps.get(semaphore).map(Vec::as_slice).unwrap_or(&[]);
            let first = steps.partition_point(|s| s.0 <= from);
            starts.extend(
                steps[first..]
                    .windows(2)
                    .filter(|w| w[1].1 > w[0].1)
                    .map(|w| w[1].0),
            );
            if let Some(s) = steps.get(first) {
                starts.push(s.0);
            }
        }
        starts.sort_unstable();
        starts.dedup();
        starts.into_iter().find_map(|start| {
            let end = cx.deadline(start, GREEDY_ROOM);
            (end < until
                && wanted
                    .iter()
                    .all(|(semaphore, count)| self.room_throughout(semaphore, *count, start, end)))
            .then_some((start, end))
        })
    }
}

/// Every ending must be one the request allowed, and the load's mix must mostly be granted:
/// `no_capacity` only for fail-fast requests, `timeout` only after the request's `wait`,
/// `exceeds_capacity` only for a count above the capacity then in force, `cancelled` only when
/// the client cancelled, `expired` only with a TTL, and never `invalid`, `unknown_semaphore`,
/// `stale` or `revoked` (the load sends valid requests, sets no --max-hold and revokes nothing).
fn outcomes(state: &FinalState, cx: &Context, v: &mut Verdict) {
    // external_id → when the client first asked to release or cancel it.
    let mut release_asked: HashMap<&str, Micros> = HashMap::new();
    for o in cx.ops.iter().filter(|o| o.kind == OpKind::Release) {
        if !matches!(o.outcome, Outcome::Fail(_)) {
            let at = release_asked.entry(o.key.as_str()).or_insert(Micros::MAX);
            *at = (*at).min(us(o.invoked));
        }
    }
    let mut decided = 0usize;
    for r in &state.requests {
        let wrong = match (
            r.state.as_str(),
            r.error_code.as_deref(),
            r.release_reason.as_deref(),
        ) {
            ("error", Some("no_capacity"), _) => (r.wait_us != Some(0)).then(|| {
                format!(
                    "no_capacity for a request that may wait ({:?} us)",
                    r.wait_us
                )
            }),
            ("error", Some("timeout"), _) => match (r.wait_us, r.settled) {
                (Some(wait), Some(settled)) if wait > 0 && settled - r.created >= wait => None,
                _ => Some(format!(
                    "timeout after {:?} ms for wait {:?} ms",
                    r.settled.map(|s| (s - r.created) / 1000),
                    r.wait_us.map(|w| w / 1000)
                )),
            },
            ("error", Some("exceeds_capacity"), _) => {
                let at = r.settled.unwrap_or(r.created);
                let over = r
                    .permits
                    .iter()
                    .any(|(n, c)| *c > capacity_at(state, n, at));
                (!over).then(|| "exceeds_capacity though every count fit its capacity".to_string())
            }
            ("error", Some("cancelled"), _) => {
                let asked_first = release_asked
                    .get(r.external_id.as_str())
                    .is_some_and(|at| r.settled.is_some_and(|s| *at <= s));
                (!asked_first).then(|| "cancelled, but the client had not cancelled it".to_string())
            }
            ("released", _, Some("released")) | ("acquired", _, _) | ("new", _, _) => None,
            ("released", _, Some("expired")) => {
                let ran_out = r
                    .expires
                    .is_some_and(|e| r.released.is_some_and(|rel| rel >= e));
                (!ran_out).then(|| {
                    format!(
                        "expired at {:?} though its lease ran to {:?}",
                        r.released, r.expires
                    )
                })
            }
            (state, code, reason) => Some(format!("ended {state} {code:?} {reason:?}")),
        };
        if let Some(what) = wrong {
            v.flag("outcomes", format!("{}: {what}", r.external_id));
        }
        if r.state != "new" {
            decided += 1;
        }
    }
    let share = v.granted as f64 / decided.max(1) as f64;
    if decided >= 20 && share < GRANTED_FLOOR {
        v.flag(
            "outcomes",
            format!(
                "only {} of {decided} decided requests were granted ({:.0} %, the floor is {:.0} %)",
                v.granted,
                share * 100.0,
                GRANTED_FLOOR * 100.0
            ),
        );
    }
}

/// On fair semaphores: at every grant, the request first in line among those waiting there, as
/// the granting transaction saw them, must still fit in what is left. Exact, with no margin and
/// no excuse. The transaction began at `decided_at` and read the heads before it wrote
/// `acquired_at`; so a request whose submit was acknowledged before `decided_at` and that still
/// waited at `acquired_at` was certainly seen, and one created after `acquired_at`, or gone
/// before `decided_at`, certainly not. Between the two (submitted, or settled, while the
/// transaction ran) it may have been: then every first in line the transaction could have seen
/// is tried, and the grant is a violation only if it leaves too little for each of them. When a
/// request left is [`gone_by`]'s. Also reports waits of large and small requests.
fn fairness(
    state: &FinalState,
    held_after: &HashMap<(i64, String), i64>,
    cx: &Context,
    v: &mut Verdict,
) {
    // Rate-limited semaphores' room is their window, which this model of held counts does not
    // follow: their fairness is left to the decision's property tests (their liveness is
    // checked).
    // Keyed semaphores' lines are in the order of the places their tags give, not of arrival:
    // their tags are the keys rule's to check (`super::keys`).
    let fair: Vec<&str> = state
        .semaphores
        .iter()
        .filter(|s| s.2 && !state.windows.contains_key(&s.0) && !state.keyed.contains(&s.0))
        .map(|s| s.0.as_str())
        .collect();
    let by_id: HashMap<i64, &Req> = state.requests.iter().map(|r| (r.id, r)).collect();
    // external_id → its first acknowledged submit (a submit may be retried).
    let mut acknowledged: HashMap<&str, Micros> = HashMap::new();
    for op in cx.ops {
        if op.kind == OpKind::Submit && matches!(op.outcome, Outcome::Ok(_)) {
            let at = us(op.completed);
            acknowledged
                .entry(op.key.as_str())
                .and_modify(|first| *first = (*first).min(at))
                .or_insert(at);
        }
    }
    let gone = gone_by(state, cx);
    let (mut large, mut small) = (Vec::new(), Vec::new());
    for semaphore in &fair {
        let mut naming: Vec<&Req> = state
            .requests
            .iter()
            .filter(|r| r.permits.iter().any(|(n, _)| n == semaphore))
            .collect();
        // First in line first.
        naming.sort_by_key(|r| std::cmp::Reverse(r.rank()));
        for (request, s, count, acquired, _, _) in
            state.permits.iter().filter(|p| p.1 == *semaphore)
        {
            let Some(granted) = by_id.get(request) else {
                continue;
            };
            // The grants that name it: one taken through a child within the child's guarantee
            // owes the parent's line nothing (borrowers' turns there are the decision's
            // property tests' to check, their liveness is checked).
            if granted.count_on(semaphore) == 0 {
                continue;
            }
            let Some(started) = granted.decided else {
                v.flag(
                    "fairness",
                    format!("{s}: request {request} was granted with no decided_at"),
                );
                continue;
            };
            let held = held_after.get(&(*request, s.clone())).copied().unwrap_or(0);
            let cap = capacity_at(state, s, *acquired);
            // The requests ahead of it the transaction may have seen waiting, first in line
            // first, up to and with the first it certainly saw.
            let mut seen_first = Vec::new();
            let mut certain = false;
            for w in naming.iter().filter(|w| w.rank() > granted.rank()) {
                let waiting_then = w.created < *acquired && gone[&w.id] > started;
                if !waiting_then {
                    continue;
                }
                seen_first.push(*w);
                let ack = acknowledged.get(w.external_id.as_str());
                if ack.is_some_and(|ack| *ack < started) && w.left().is_none_or(|l| l > *acquired) {
                    certain = true;
                    break;
                }
            }
            let too_little = |w: &&Req| held + w.count_on(semaphore) > cap;
            if certain && seen_first.iter().all(too_little) {
                let head = seen_first.last().expect("certain");
                let by = granted.worker_id.as_deref().unwrap_or("?");
                let before: Vec<String> = seen_first[..seen_first.len() - 1]
                    .iter()
                    .map(|w| {
                        format!(
                            "{} for {} ({})",
                            w.external_id,
                            w.count_on(semaphore),
                            w.state
                        )
                    })
                    .collect();
                v.flag("fairness", format!(
                    "{s}: request {request} took {count} leaving {} while {} (ahead of it: rank {:?} vs {:?}) waited for {}; granted by {by} in a transaction begun at {started} µs, the head acknowledged at {} µs; the transaction may also have seen ahead of it: [{}]",
                    cap - held, head.external_id, head.rank(), granted.rank(), head.count_on(semaphore),
                    acknowledged[head.external_id.as_str()], before.join(", ")
                ));
            }
            if let Some(r) = by_id.get(request) {
                let wait_ms = (acquired - r.created) as f64 / 1000.0;
                let cap = state
                    .capacity
                    .get(*semaphore)
                    .and_then(|c| c.first())
                    .map_or(1, |c| c.1);
                if *count * 2 > cap {
                    large.push(wait_ms)
                } else {
                    small.push(wait_ms)
                }
            }
        }
    }
    let p99 = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (
            permitq_fleet::quantile(v, 990),
            permitq_fleet::quantile(v, 1000),
        )
    };
    let (lp99, lmax) = p99(&mut large);
    let (sp99, smax) = p99(&mut small);
    v.waits_ms = (lp99, lmax, sp99, smax);
}

/// For each request, when it was certainly no longer waiting to every transaction that began
/// then (µs; [`i64::MAX`] while that is not known). A grant or a worker's failure of it
/// (`decided_at` set) was written under the locks of the semaphores it names, which a granting
/// transaction takes before it reads the heads: its time is exact. A cancel or a wait deadline's
/// sweep takes no semaphore lock, and its `settled_at` is written before its commit, which a
/// worker cut off by a partition may send seconds later: until then the request still waits to
/// every other transaction. Its client learns of it only after that commit, so the first release
/// that client completed after it (the cancel itself, or the release after the failure) bounds
/// it; with none, it may have been seen waiting at any time.
fn gone_by(state: &FinalState, cx: &Context) -> HashMap<i64, Micros> {
    let mut released: HashMap<&str, Vec<Micros>> = HashMap::new();
    for op in cx.ops {
        if op.kind == OpKind::Release && matches!(op.outcome, Outcome::Ok(_)) {
            released
                .entry(op.key.as_str())
                .or_default()
                .push(us(op.completed));
        }
    }
    state
        .requests
        .iter()
        .map(|r| {
            let gone = match (r.left(), r.acquired, r.decided) {
                (None, _, _) => Micros::MAX,
                (Some(left), Some(_), _) | (Some(left), None, Some(_)) => left,
                (Some(left), None, None) => released
                    .get(r.external_id.as_str())
                    .and_then(|done| done.iter().copied().filter(|d| *d >= left).min())
                    .unwrap_or(Micros::MAX),
            };
            (r.id, gone)
        })
        .collect()
}

fn history(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let by_key: HashMap<&str, &Req> = state
        .requests
        .iter()
        .map(|r| (r.external_id.as_str(), r))
        .collect();
    let released: HashMap<i64, Option<Micros>> = state.permits.iter().map(|p| (p.0, p.4)).collect();
    let mut released_ok: HashMap<&str, u32> = HashMap::new();
    for op in cx.ops {
        match (op.kind, &op.outcome) {
            (OpKind::Release, Outcome::Ok(o)) if o == "released" => {
                *released_ok.entry(&op.key).or_default() += 1;
            }
            (OpKind::Heartbeat, Outcome::Ok(_)) => {
                let Some(r) = by_key.get(op.key.as_str()) else {
                    continue;
                };
                let held_then = r.acquired.is_some_and(|a| a <= us(op.completed))
                    && released
                        .get(&r.id)
                        .copied()
                        .flatten()
                        .is_none_or(|rel| rel >= us(op.invoked));
                if !held_then {
                    v.flag(
                        "history",
                        format!("{}: heartbeat accepted while not held", op.key),
                    );
                }
            }
            _ => {}
        }
    }
    for (key, n) in released_ok {
        if n > 1 {
            v.flag(
                "history",
                format!("{key}: release returned `released` {n} times"),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chaos::state::Tree;

    const S: Micros = 1_000_000;

    fn waiting(id: i64, permits: &[(&str, i64)], created: Micros) -> Req {
        Req {
            id,
            external_id: format!("r{id}"),
            permits: permits.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
            wait_us: None,
            priority: 0,
            state: "new".into(),
            error_code: None,
            release_reason: None,
            created,
            acquired: None,
            settled: None,
            worker_id: None,
            examined: Some(created),
            decided: None,
            expires: None,
            released: None,
            token: None,
        }
    }

    /// A fair semaphore `f` (3) and a greedy `g` (8); `g_held` held on `g` from the start until
    /// `g_released` (or the end). `r1` names both and never leaves; `r2` names `f` alone, after it.
    fn heads_flagged(g_held: i64, g_released: Option<Micros>) -> Vec<String> {
        let state = FinalState {
            requests: vec![
                waiting(1, &[("f", 2), ("g", 1)], S),
                waiting(2, &[("f", 1)], 2 * S),
            ],
            permits: if g_held > 0 {
                vec![(9, "g".into(), g_held, 0, g_released, 1)]
            } else {
                Vec::new()
            },
            tree: Tree::default(),
            capacity: [("f".into(), vec![(0, 3)]), ("g".into(), vec![(0, 8)])].into(),
            semaphores: vec![("f".into(), 0, true), ("g".into(), g_held, false)],
            windows: HashMap::new(),
            granted_counter: HashMap::new(),
            keyed: Default::default(),
        };
        let events = HashMap::new();
        let cx = Context {
            ops: &[],
            acquired_events: &events,
            faults: &[],
            sweep_interval: Duration::from_millis(200),
            load_end: SystemTime::UNIX_EPOCH + Duration::from_secs(60),
        };
        let mut v = Verdict::default();
        heads_are_granted(&state, &cx, &mut v);
        v.violations.remove("liveness").unwrap_or_default()
    }

    fn op(kind: OpKind, key: &str, at: Micros) -> Op {
        let at = SystemTime::UNIX_EPOCH + Duration::from_micros(at.unsigned_abs());
        Op {
            client: 0,
            kind,
            key: key.into(),
            arg: 0,
            invoked: at,
            completed: at,
            outcome: Outcome::Ok(String::new()),
        }
    }

    /// Fair `f` (4), 2 held throughout by request 9. `r1` (1) waits first in line, then fails at
    /// 10 s (`by_worker`: in a worker's batch, else by a sweep or a cancel), and its client's
    /// release completes at `released` (if it does); `r2` (2) waits behind it to the end, its
    /// submit acknowledged; `r3` (1) is granted by a transaction begun at 10.5 s, leaving 1.
    fn fairness_flagged(by_worker: bool, released: Option<Micros>) -> Vec<String> {
        let mut first = waiting(1, &[("f", 1)], S);
        first.state = "error".into();
        first.error_code = Some("timeout".into());
        first.settled = Some(10 * S);
        first.decided = by_worker.then_some(10 * S - 1000);
        let mut granted = waiting(3, &[("f", 1)], 3 * S);
        granted.state = "acquired".into();
        granted.decided = Some(10 * S + S / 2);
        granted.acquired = Some(10 * S + S / 2 + 1000);
        let state = FinalState {
            requests: vec![first, waiting(2, &[("f", 2)], 2 * S), granted],
            permits: vec![
                (9, "f".into(), 2, 0, None, 1),
                (3, "f".into(), 1, 10 * S + S / 2 + 1000, None, 2),
            ],
            tree: Tree::default(),
            capacity: [("f".into(), vec![(0, 4)])].into(),
            semaphores: vec![("f".into(), 3, true)],
            windows: HashMap::new(),
            granted_counter: HashMap::new(),
            keyed: Default::default(),
        };
        let mut ops = vec![op(OpKind::Submit, "r2", 2 * S + 1000)];
        ops.extend(released.map(|at| op(OpKind::Release, "r1", at)));
        let events = HashMap::new();
        let cx = Context {
            ops: &ops,
            acquired_events: &events,
            faults: &[],
            sweep_interval: Duration::from_millis(200),
            load_end: SystemTime::UNIX_EPOCH + Duration::from_secs(60),
        };
        let held_after = [((3, "f".to_string()), 3)].into();
        let mut v = Verdict::default();
        fairness(&state, &held_after, &cx, &mut v);
        v.violations.remove("fairness").unwrap_or_default()
    }

    /// A head that a sweep or a cancel ended (no semaphore lock, `settled_at` written before a
    /// commit that a partitioned worker may send seconds later) may still have been the head
    /// the grant saw until its client learnt it had ended: a grant that keeps its room is not
    /// flagged. Ended by a worker's batch, or known ended before the grant began, it was gone,
    /// and the grant past the next in line is.
    #[test]
    fn a_head_that_a_sweep_ended_counts_as_seen_until_its_client_learnt_it() {
        assert_eq!(fairness_flagged(false, Some(11 * S)), Vec::<String>::new());
        assert_eq!(fairness_flagged(false, None), Vec::<String>::new());
        for flagged in [
            fairness_flagged(false, Some(10 * S + S / 4)),
            fairness_flagged(true, Some(11 * S)),
        ] {
            assert_eq!(flagged.len(), 1, "{flagged:?}");
            assert!(
                flagged[0].starts_with("f: request 3 took 1 leaving 1 while r2"),
                "{flagged:?}"
            );
        }
    }

    /// The first request stuck on a fair semaphore that also names a greedy one with room is a
    /// starved head (before, it went unjudged and shielded every head behind it), also when the
    /// room comes later than the head bound; with the greedy one full throughout, it may have
    /// been passed there, and is not.
    #[test]
    fn a_stuck_head_naming_a_greedy_semaphore_with_room_is_starved() {
        let flagged = heads_flagged(0, None);
        assert_eq!(
            flagged,
            [
                "r1: first in line on [\"f\"] for 13000 ms, then had room on [\"g\"] for 3000 ms \
              from 0 ms after that and not granted (a starved head)"
            ]
        );
        // Full until 20 s, past the head bound (11 s): judged from the room at 20 s.
        let flagged = heads_flagged(8, Some(20 * S));
        assert_eq!(
            flagged,
            [
                "r1: first in line on [\"f\"] for 22000 ms, then had room on [\"g\"] for 3000 ms \
              from 9000 ms after that and not granted (a starved head)"
            ]
        );
        assert_eq!(heads_flagged(8, None), Vec::<String>::new());
        // Room only within GREEDY_ROOM of the load's end: not judged.
        assert_eq!(heads_flagged(8, Some(58 * S)), Vec::<String>::new());
    }
}
