//! Checkers over the database's final state and the recorded history.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, SystemTime};

use super::history::{Op, OpKind, Outcome};
use super::nemesis::{LinkFault, Outage};
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
    /// Grants the fairness checker would flag but for a fault on the granting worker's link
    /// (the head was acknowledged after the fault began): what they were.
    pub excused_by_link_faults: Vec<String>,
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
    /// external_id → number of `acquired` events seen on `permitq_events`.
    pub acquired_events: &'a HashMap<String, u32>,
    /// Stop-the-world faults, for the "nothing lost" deadline.
    pub outages: &'a [Outage],
    /// Faults on one worker's link, for the fairness checker's visibility.
    pub link_faults: &'a [LinkFault],
    /// The workers' sweep interval.
    pub sweep_interval: Duration,
    /// When the load stopped.
    pub load_end: SystemTime,
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
    fencing(state, cx, &mut v);
    nothing_lost(state, cx, &mut v);
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
        for (t, delta, request) in events {
            held += delta;
            if delta > 0 {
                held_after.insert((request, semaphore.to_string()), held);
                let cap = capacity_at(state, semaphore, t);
                if held > cap {
                    v.flag("safety", format!("{semaphore}: {held} held > capacity {cap} when request {request} was granted"));
                }
            }
        }
    }
    held_after
}

fn no_double_grant(state: &FinalState, cx: &Context, v: &mut Verdict) {
    for (id, n) in cx.acquired_events {
        if *n > 1 {
            v.flag("no double grant", format!("{id}: {n} acquired events"));
        }
    }
    let mut permit_rows: HashMap<i64, usize> = HashMap::new();
    for p in &state.permits {
        *permit_rows.entry(p.0).or_default() += 1;
    }
    for r in &state.requests {
        let rows = permit_rows.get(&r.id).copied().unwrap_or(0);
        let expected = if r.acquired.is_some() {
            r.permits.len()
        } else {
            0
        };
        if rows != expected {
            v.flag(
                "no double grant",
                format!("{}: {rows} permit rows, expected {expected}", r.external_id),
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

fn nothing_lost(state: &FinalState, cx: &Context, v: &mut Verdict) {
    let by_key: HashMap<&str, &Req> = state
        .requests
        .iter()
        .map(|r| (r.external_id.as_str(), r))
        .collect();
    let mut submitted: Vec<&str> = cx
        .ops
        .iter()
        .filter(|o| o.kind == OpKind::Submit && !matches!(o.outcome, Outcome::Fail(_)))
        .map(|o| o.key.as_str())
        .collect();
    submitted.sort();
    submitted.dedup();
    for key in submitted {
        match by_key.get(key) {
            None => {
                let ok = cx
                    .ops
                    .iter()
                    .any(|o| o.key == key && matches!(o.outcome, Outcome::Ok(_)));
                if ok {
                    v.flag(
                        "nothing lost",
                        format!("{key}: submit returned ok but there is no row"),
                    );
                }
            }
            Some(r) if r.state == "new" || r.state == "in_progress" => {
                v.flag(
                    "nothing lost",
                    format!("{key}: still {} at the end", r.state),
                );
            }
            Some(_) => {}
        }
    }
    let slack =
        2 * i64::try_from(cx.sweep_interval.as_micros()).unwrap_or(i64::MAX / 4) + 1_500_000;
    for r in &state.requests {
        let Some(wait) = r.wait_us.filter(|w| *w > 0) else {
            continue;
        };
        let decided = if r.error_code.as_deref() == Some("timeout") {
            r.settled
        } else {
            r.acquired
        };
        let Some(decided) = decided else { continue };
        let mut allowed = wait + slack;
        for o in cx.outages {
            let (from, to) = (us(o.from), us(o.to));
            if from <= r.created + allowed && to >= r.created {
                allowed += (to - from) + 6_000_000;
            }
        }
        if decided - r.created > allowed {
            v.flag(
                "nothing lost",
                format!(
                    "{}: wait {}ms decided after {}ms",
                    r.external_id,
                    wait / 1000,
                    (decided - r.created) / 1000
                ),
            );
        }
    }
}

/// On fair semaphores: at every grant, the oldest request still waiting there (older than the
/// granted one, and visible to the worker: its submit was acknowledged, so committed, at least
/// 200 ms before the grant) must still fit in what is left. Also reports waits of large and small
/// requests, and flags starvation.
///
/// Visibility is judged by the acknowledgement, not by `created_at`: ids (the FIFO order) are
/// drawn at insert, but a request exists for workers only from its commit, and on a loaded
/// machine a submit's commit can come long after a younger one's. A worker decides on what it
/// read when its batch took the semaphore locks, and writes `acquired_at` when it applies: a
/// batch that a partition or a slow link (on its worker's host) stretched may have read long
/// before it wrote. For the grants of a worker whose link had a fault up to 10 s
/// before the grant (`LINK_RESUME`), only requests acknowledged before the fault began (less twice the margin)
/// were certainly visible.
fn fairness(
    state: &FinalState,
    held_after: &HashMap<(i64, String), i64>,
    cx: &Context,
    v: &mut Verdict,
) {
    const VISIBLE: Micros = 200_000;
    // After a heal, a stalled connection resumes at TCP's next retransmission (seconds).
    const LINK_RESUME: Micros = 10_000_000;
    // Rate-limited semaphores' room is their window, which this model of held counts does not
    // follow: their fairness is left to the decision's property tests.
    let fair: Vec<&str> = state
        .semaphores
        .iter()
        .filter(|s| s.2 && !state.windows.contains_key(&s.0))
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
    let (mut large, mut small) = (Vec::new(), Vec::new());
    for semaphore in &fair {
        let naming: Vec<&Req> = state
            .requests
            .iter()
            .filter(|r| r.permits.iter().any(|(n, _)| n == semaphore))
            .collect();
        for (request, s, count, acquired, _, _) in
            state.permits.iter().filter(|p| p.1 == *semaphore)
        {
            // The head: the first in line among those waiting at the grant (the worker keeps
            // room for it alone), judged only when it is ahead of this grant and had certainly
            // been visible to the worker (a request submitted a moment ago, with a high
            // priority, may be first in line already without any worker having seen it).
            let granted = by_id.get(request);
            let read_by =
                granted
                    .and_then(|g| g.worker_id.as_deref())
                    .map_or(*acquired, |worker| {
                        cx.link_faults
                            .iter()
                            .filter(|f| {
                                f.worker == worker
                                    && us(f.during.from) <= *acquired
                                    && us(f.during.to) + LINK_RESUME >= *acquired
                            })
                            .map(|f| us(f.during.from) - VISIBLE)
                            .fold(*acquired, Micros::min)
                    });
            let head = naming
                .iter()
                .filter(|w| w.id != *request && w.new_at(*acquired))
                .max_by_key(|w| w.rank())
                .filter(|w| granted.is_none_or(|g| w.rank() > g.rank()));
            let acknowledged_head =
                head.and_then(|h| Some((h, *acknowledged.get(h.external_id.as_str())?)));
            if let Some((head, ack)) = acknowledged_head {
                let need = head
                    .permits
                    .iter()
                    .find(|(n, _)| n == semaphore)
                    .map_or(0, |p| p.1);
                let held = held_after.get(&(*request, s.clone())).copied().unwrap_or(0);
                let cap = capacity_at(state, s, *acquired);
                if held + need > cap && ack + VISIBLE <= *acquired {
                    let by = granted.and_then(|g| g.worker_id.as_deref()).unwrap_or("?");
                    let what = format!("{s}: request {request} took {count} leaving {} while {} (ahead of it: rank {:?} vs {:?}) waited for {need}; granted by {by} at {acquired} µs, the head acknowledged at {ack} µs", cap - held, head.external_id, head.rank(), granted.map(|g| g.rank()));
                    if ack + VISIBLE <= read_by {
                        v.flag("fairness", what);
                    } else {
                        // Visible 200 ms before the grant, not before the fault on its link.
                        v.excused_by_link_faults.push(what);
                    }
                }
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
        for r in &naming {
            let count = r
                .permits
                .iter()
                .find(|(n, _)| n == semaphore)
                .map_or(0, |p| p.1);
            let cap = state
                .capacity
                .get(*semaphore)
                .and_then(|c| c.first())
                .map_or(1, |c| c.1);
            // Higher priorities may hold it back (3 - priority) aging steps longer.
            let allowance = 20_000_000 + (3 - r.priority).max(0) * 10_000_000;
            let starved = r.wait_us.is_none()
                && count * 2 > cap
                && r.new_at(us(cx.load_end))
                && r.created < us(cx.load_end) - allowance;
            if starved {
                v.flag(
                    "fairness",
                    format!(
                        "{}: large request starved past its bound while the stream ran",
                        r.external_id
                    ),
                );
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
