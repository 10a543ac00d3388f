use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn sem(capacity: i64, used: i64, fair: bool) -> SemaphoreView {
    SemaphoreView {
        capacity,
        used,
        fair,
        head: None,
        refused: false,
        parent: None,
        guarantee: 0,
        active: false,
    }
}

pub(super) fn cand(id: i64, permits: &[(&str, i64)]) -> Candidate {
    Candidate {
        id,
        effective: 0,
        permits: permits.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
        fail_fast: false,
        deadline_passed: false,
        invalid: false,
    }
}

fn sems(list: &[(&str, SemaphoreView)]) -> BTreeMap<String, SemaphoreView> {
    list.iter()
        .map(|(n, s)| (n.to_string(), s.clone()))
        .collect()
}

pub(super) fn verdicts(d: &Decision) -> Vec<Verdict> {
    d.verdicts.iter().map(|(_, v)| *v).collect()
}

use Verdict::{Fail, Grant, Wait};

#[test]
fn grants_what_fits_and_counts_it() {
    let d = decide(
        &sems(&[("a", sem(3, 0, true))]),
        &[cand(1, &[("a", 2)]), cand(2, &[("a", 1)])],
    );
    assert_eq!(verdicts(&d), [Grant, Grant]);
    assert_eq!(d.semaphores["a"].used, 3);
}

#[test]
fn errors_in_rule_order() {
    let s = sems(&[("a", sem(3, 3, true))]);
    let mut timed_out = cand(3, &[("a", 1)]);
    timed_out.deadline_passed = true;
    let mut fast = cand(4, &[("a", 1)]);
    fast.fail_fast = true;
    let mut unknown_and_late = cand(5, &[("a", 1), ("zz", 1)]);
    unknown_and_late.deadline_passed = true;
    let d = decide(
        &s,
        &[
            cand(1, &[("nope", 1)]),
            cand(2, &[("a", 4)]),
            timed_out,
            fast,
            unknown_and_late,
        ],
    );
    assert_eq!(
        verdicts(&d),
        [
            Fail(ErrorCode::UnknownSemaphore),
            Fail(ErrorCode::ExceedsCapacity),
            Fail(ErrorCode::Timeout),
            Fail(ErrorCode::NoCapacity),
            Fail(ErrorCode::UnknownSemaphore),
        ]
    );
    assert_eq!(d.semaphores["a"].used, 3);
}

#[test]
fn an_invalid_row_fails_alone_before_any_other_rule_and_takes_nothing() {
    let s = sems(&[("a", sem(3, 0, true))]);
    let mut invalid = cand(1, &[("nope", 1)]);
    invalid.invalid = true;
    let mut invalid_but_fits = cand(2, &[("a", 1)]);
    invalid_but_fits.invalid = true;
    let d = decide(&s, &[invalid, invalid_but_fits, cand(3, &[("a", 3)])]);
    assert_eq!(
        verdicts(&d),
        [Fail(ErrorCode::Invalid), Fail(ErrorCode::Invalid), Grant]
    );
    assert_eq!(d.semaphores["a"].used, 3);
}

#[test]
fn all_or_nothing_when_one_semaphore_is_full() {
    let s = sems(&[("a", sem(5, 0, true)), ("b", sem(1, 1, true))]);
    let d = decide(&s, &[cand(1, &[("a", 1), ("b", 1)])]);
    assert_eq!(verdicts(&d), [Wait]);
    assert_eq!(d.semaphores["a"].used, 0);
}

#[test]
fn fair_head_is_not_overtaken_but_backfill_that_leaves_its_room_is_allowed() {
    // 10 capacity, 6 held: the head needs 5 and waits; a later 1 would leave 3 < 5, so it waits.
    let s = sems(&[("a", sem(10, 6, true))]);
    let d = decide(&s, &[cand(1, &[("a", 5)]), cand(2, &[("a", 1)])]);
    assert_eq!(verdicts(&d), [Wait, Wait]);
    // 7 free, head needs 8: a later 2 would leave 5 < 8, it waits; fail-fast fails.
    let s = sems(&[("a", sem(10, 3, true))]);
    let mut fast = cand(3, &[("a", 1)]);
    fast.fail_fast = true;
    let d = decide(&s, &[cand(1, &[("a", 8)]), cand(2, &[("a", 2)]), fast]);
    assert_eq!(verdicts(&d), [Wait, Wait, Fail(ErrorCode::NoCapacity)]);
    // 9 free, head 5 fits and goes; then 4 fits too.
    let s = sems(&[("a", sem(10, 1, true))]);
    let d = decide(&s, &[cand(1, &[("a", 5)]), cand(2, &[("a", 4)])]);
    assert_eq!(verdicts(&d), [Grant, Grant]);
    // 4 free, head (on b) needs 2 of a: a later 2 leaves exactly 2, allowed; a later 1 is not.
    let s = sems(&[("a", sem(10, 6, true)), ("b", sem(1, 1, true))]);
    let d = decide(
        &s,
        &[
            cand(1, &[("a", 2), ("b", 1)]),
            cand(2, &[("a", 2)]),
            cand(3, &[("a", 1)]),
        ],
    );
    assert_eq!(verdicts(&d), [Wait, Grant, Wait]);
}

#[test]
fn greedy_lets_any_request_that_fits_go_first() {
    let s = sems(&[("a", sem(10, 6, false))]);
    let d = decide(&s, &[cand(1, &[("a", 5)]), cand(2, &[("a", 4)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
}

#[test]
fn a_waiting_request_reserves_every_fair_semaphore_it_names() {
    // 1 needs a and b; b is full. 2 wants all of a: it must leave 1's share of a.
    let s = sems(&[("a", sem(4, 0, true)), ("b", sem(1, 1, true))]);
    let d = decide(
        &s,
        &[
            cand(1, &[("a", 2), ("b", 1)]),
            cand(2, &[("a", 3)]),
            cand(3, &[("a", 2)]),
        ],
    );
    assert_eq!(verdicts(&d), [Wait, Wait, Grant]);
    assert_eq!(d.semaphores["a"].used, 2);
}

#[test]
fn recorded_head_from_another_batch_is_respected_only_by_younger_requests() {
    let mut a = sem(10, 5, true);
    a.head = Some(Head {
        request_id: 50,
        count: 4,
        effective: 0,
    });
    let s = sems(&[("a", a)]);
    // 40 is older than the head: it is the head itself. 60 would leave 5-3=2 < 4.
    let d = decide(&s, &[cand(60, &[("a", 3)]), cand(70, &[("a", 1)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
    let d = decide(&s, &[cand(40, &[("a", 5)])]);
    assert_eq!(verdicts(&d), [Grant]);
}

fn ranked(id: i64, effective: i64, permits: &[(&str, i64)]) -> Candidate {
    Candidate {
        effective,
        ..cand(id, permits)
    }
}

#[test]
fn a_higher_priority_goes_first_and_an_older_one_keeps_its_place_among_equals() {
    // One permit left: 9 (effective 3) is ahead of 2 and 5 (effective 0), though younger.
    let s = sems(&[("a", sem(3, 2, true))]);
    let mut cands = vec![
        ranked(2, 0, &[("a", 1)]),
        ranked(5, 0, &[("a", 1)]),
        ranked(9, 3, &[("a", 1)]),
    ];
    cands.sort_by_key(Candidate::rank);
    assert_eq!(cands.iter().map(|c| c.id).collect::<Vec<_>>(), [9, 2, 5]);
    let d = decide(&s, &cands);
    assert_eq!(verdicts(&d), [Grant, Wait, Wait]);
}

#[test]
fn a_recorded_head_ahead_in_line_keeps_its_room_from_an_older_request() {
    // The recorded head (id 50, effective 2) is ahead of the older request 40 (effective 0):
    // 40 may only take what leaves the head's 4.
    let mut a = sem(10, 4, true);
    a.head = Some(Head {
        request_id: 50,
        count: 4,
        effective: 2,
    });
    let s = sems(&[("a", a)]);
    let d = decide(&s, &[ranked(40, 0, &[("a", 3)])]);
    assert_eq!(verdicts(&d), [Wait]);
    let d = decide(&s, &[ranked(40, 0, &[("a", 2)])]);
    assert_eq!(verdicts(&d), [Grant]);
    // Aged past it (effective 3 > 2), 40 is ahead and takes what it needs.
    let d = decide(&s, &[ranked(40, 3, &[("a", 3)])]);
    assert_eq!(verdicts(&d), [Grant]);
}

#[test]
fn capacity_lowered_below_used_grants_nothing_until_room() {
    let s = sems(&[("a", sem(2, 5, true))]);
    let d = decide(&s, &[cand(1, &[("a", 1)])]);
    assert_eq!(verdicts(&d), [Wait]);
    assert_eq!(d.semaphores["a"].used, 5);
}

fn detail(d: &Decision, id: i64) -> ErrorDetail {
    d.details.get(&id).cloned().unwrap_or_default()
}

#[test]
fn each_failure_names_the_semaphore_and_the_bound_it_hit() {
    let s = sems(&[("a", sem(3, 3, true)), ("b", sem(5, 0, true))]);
    let mut fast = cand(3, &[("b", 1), ("a", 1)]);
    fast.fail_fast = true;
    let mut late = cand(4, &[("a", 1)]);
    late.deadline_passed = true;
    let mut late_with_room = cand(6, &[("b", 1)]);
    late_with_room.deadline_passed = true;
    let d = decide(
        &s,
        &[
            cand(1, &[("a", 1), ("nope", 1)]),
            cand(2, &[("b", 1), ("a", 4)]),
            fast,
            late,
            late_with_room,
        ],
    );
    let named = |name: &str| Some(name.to_string());
    assert_eq!(
        detail(&d, 1),
        ErrorDetail {
            semaphore: named("nope"),
            ..ErrorDetail::default()
        }
    );
    assert_eq!(
        detail(&d, 2),
        ErrorDetail {
            semaphore: named("a"),
            count: Some(4),
            capacity: Some(3),
            ..ErrorDetail::default()
        }
    );
    // Fail fast: the semaphore without room, not the one with.
    assert_eq!(
        detail(&d, 3),
        ErrorDetail {
            semaphore: named("a"),
            count: Some(1),
            capacity: Some(3),
            free: Some(0),
            ..ErrorDetail::default()
        }
    );
    // A timeout: where it had no room when its wait ran out; nothing where it had room.
    assert_eq!(
        detail(&d, 4),
        ErrorDetail {
            semaphore: named("a"),
            count: Some(1),
            capacity: Some(3),
            free: Some(0),
            ..ErrorDetail::default()
        }
    );
    assert!(detail(&d, 6).is_empty(), "{:?}", detail(&d, 6));
    assert!(!d.details.contains_key(&5));
}

#[test]
fn a_bound_at_a_parent_names_the_parent_and_the_semaphore_named_below_it() {
    let child = |parent: &str| SemaphoreView {
        parent: Some(parent.to_string()),
        ..sem(6, 0, true)
    };
    let s = sems(&[
        ("pool", sem(4, 0, true)),
        ("team", child("pool")),
        ("orphan", child("gone")),
    ]);
    let d = decide(&s, &[cand(1, &[("team", 5)]), cand(2, &[("orphan", 1)])]);
    assert_eq!(
        detail(&d, 1),
        ErrorDetail {
            semaphore: Some("pool".into()),
            named: Some("team".into()),
            count: Some(5),
            capacity: Some(4),
            ..ErrorDetail::default()
        }
    );
    assert_eq!(
        detail(&d, 2),
        ErrorDetail {
            semaphore: Some("gone".into()),
            named: Some("orphan".into()),
            ..ErrorDetail::default()
        }
    );
}

// ---- properties ----

const NAMES: [&str; 5] = ["a", "b", "c", "d", "e"]; // "e" never exists

fn arb_semaphores() -> impl Strategy<Value = BTreeMap<String, SemaphoreView>> {
    let one = (
        0i64..10,
        0i64..12,
        any::<bool>(),
        proptest::option::of((0i64..40, 1i64..8, -2i64..3)),
    );
    proptest::collection::vec(one, 4).prop_map(|v| {
        v.into_iter()
            .zip(NAMES)
            .map(|((capacity, used, fair, head), name)| {
                let head = head.map(|(request_id, count, effective)| Head {
                    request_id,
                    count,
                    effective,
                });
                (
                    name.to_string(),
                    SemaphoreView {
                        capacity,
                        used,
                        fair,
                        head,
                        refused: false,
                        parent: None,
                        guarantee: 0,
                        active: false,
                    },
                )
            })
            .collect()
    })
}

fn arb_candidates() -> impl Strategy<Value = Vec<Candidate>> {
    let one = (
        1i64..4,
        proptest::sample::subsequence(NAMES.to_vec(), 1..=3),
        proptest::collection::vec(1i64..9, 3),
        prop_oneof![8 => Just(false), 1 => Just(true)],
        prop_oneof![8 => Just(false), 1 => Just(true)],
        // Mostly equal priorities (FIFO), some ahead or behind.
        prop_oneof![6 => Just(0i64), 1 => -2i64..3],
    );
    proptest::collection::vec(one, 0..24).prop_map(|v| {
        let mut id = 0;
        let mut cands: Vec<Candidate> = v
            .into_iter()
            .map(
                |(gap, names, counts, fail_fast, deadline_passed, effective)| {
                    id += gap;
                    let permits = names
                        .into_iter()
                        .zip(counts)
                        .map(|(n, c)| (n.to_string(), c))
                        .collect();
                    Candidate {
                        id,
                        effective,
                        permits,
                        fail_fast,
                        deadline_passed,
                        invalid: false,
                    }
                },
            )
            .collect();
        cands.sort_by_key(Candidate::rank);
        cands
    })
}

/// The first in line waiting on `name` ahead of `before`: the recorded head or a batch candidate
/// that waits.
fn first_waiter(
    name: &str,
    before: Rank,
    start: &BTreeMap<String, SemaphoreView>,
    cands: &[Candidate],
    d: &Decision,
) -> Option<Head> {
    let recorded = start[name].head;
    let batch = cands
        .iter()
        .zip(&d.verdicts)
        .filter(|(_, (_, v))| *v == Wait)
        .find_map(|(c, _)| {
            c.permits
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, count)| Head {
                    request_id: c.id,
                    count: *count,
                    effective: c.effective,
                })
        });
    [recorded, batch]
        .into_iter()
        .flatten()
        .filter(|w| w.rank() < before)
        .min_by_key(Head::rank)
}

#[test]
fn a_waiting_request_or_a_refusal_makes_the_order_matter() {
    let free: BTreeMap<String, SemaphoreView> = [("a".to_string(), sem(4, 0, true))].into();
    let d = decide(&free, &[cand(1, &[("a", 1)]), cand(2, &[("a", 1)])]);
    assert!(!order_mattered(&free, &d));
    // A head outside the batch: another order may leave it less room.
    let mut waited = free.clone();
    waited.get_mut("a").unwrap().head = Some(Head {
        request_id: 9,
        count: 2,
        effective: -5,
    });
    assert!(order_mattered(
        &waited,
        &decide(&waited, &[cand(1, &[("a", 1)])])
    ));
    // One left waiting.
    let d = decide(&free, &[cand(1, &[("a", 3)]), cand(2, &[("a", 3)])]);
    assert!(order_mattered(&free, &d));
}

/// `cands` put in the order `order` gives (a permutation of their indexes): each gets the
/// place of its position there, first in line first.
pub(super) fn reordered(cands: &[Candidate], order: &[usize]) -> Vec<Candidate> {
    order
        .iter()
        .enumerate()
        .map(|(position, &i)| Candidate {
            effective: -i64::try_from(position).unwrap(),
            ..cands[i].clone()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn the_heads_of_semaphores_without_room_change_no_verdict(
        start in arb_semaphores(), cands in arb_candidates()
    ) {
        let mut headless = start.clone();
        for name in without_room(&start) {
            headless.get_mut(&name).unwrap().head = None;
        }
        prop_assert_eq!(decide(&headless, &cands).verdicts, decide(&start, &cands).verdicts);
    }

    #[test]
    fn when_the_order_did_not_matter_every_order_grants_the_whole_batch(
        // Mostly without heads: a head makes the order matter.
        start in (arb_semaphores(), any::<bool>(), any::<bool>()).prop_map(|(mut t, x, y)| {
            if x || y {
                for s in t.values_mut() {
                    s.head = None;
                }
            }
            t
        }),
        (cands, order) in arb_candidates().prop_flat_map(|c| {
            let n = c.len();
            (Just(c), Just((0..n).collect::<Vec<usize>>()).prop_shuffle())
        })
    ) {
        let d = decide(&start, &cands);
        if order_mattered(&start, &d) {
            return Ok(());
        }
        let other = decide(&start, &reordered(&cands, &order));
        prop_assert!(other.verdicts.iter().all(|(_, v)| *v == Grant), "{:?}", other.verdicts);
        prop_assert_eq!(other.semaphores, d.semaphores);
    }

    #[test]
    fn capacity_is_never_exceeded_and_used_counts_exactly_the_grants(
        start in arb_semaphores(), cands in arb_candidates()
    ) {
        let d = decide(&start, &cands);
        prop_assert_eq!(d.verdicts.len(), cands.len());
        for (name, before) in &start {
            let granted: i64 = cands.iter().zip(&d.verdicts)
                .filter(|(_, (_, v))| *v == Grant)
                .flat_map(|(c, _)| c.permits.iter().filter(|(n, _)| n == name).map(|(_, k)| *k))
                .sum();
            let after = &d.semaphores[name];
            prop_assert_eq!(after.used, before.used + granted, "used must move by exactly the grants (all-or-nothing)");
            if granted > 0 {
                prop_assert!(after.used <= after.capacity, "{} over capacity: {:?}", name, after);
            }
        }
    }

    #[test]
    fn every_failure_and_only_a_failure_has_a_detail_that_holds(
        start in arb_semaphores(), cands in arb_candidates()
    ) {
        let d = decide(&start, &cands);
        for (c, (id, v)) in cands.iter().zip(&d.verdicts) {
            let detail = d.details.get(id);
            prop_assert_eq!(detail.is_some(), matches!(v, Fail(_)), "{:?}", v);
            let Some(detail) = detail else { continue };
            let names = |s: &Option<String>| s.as_ref().is_some_and(|n| c.permits.iter().any(|(p, _)| p == n));
            match v {
                Fail(ErrorCode::UnknownSemaphore) => prop_assert!(
                    names(&detail.semaphore)
                        && !start.contains_key(detail.semaphore.as_deref().unwrap_or_default()),
                    "{:?}", detail
                ),
                Fail(ErrorCode::ExceedsCapacity) => prop_assert!(
                    names(&detail.semaphore) && detail.count > detail.capacity
                        && detail.capacity == detail.semaphore.as_ref().map(|n| start[n].capacity),
                    "{:?}", detail
                ),
                Fail(ErrorCode::NoCapacity) => prop_assert!(
                    names(&detail.semaphore) && detail.free.is_some() && detail.count.is_some(),
                    "{:?}", detail
                ),
                // Where it did not fit, or nothing when it fitted everywhere.
                Fail(ErrorCode::Timeout) => prop_assert!(
                    detail.is_empty()
                        || (names(&detail.semaphore) && detail.free.is_some()
                            && detail.count.is_some()),
                    "{:?}", detail
                ),
                Fail(ErrorCode::TooManyInstances) => prop_assert!(names(&detail.semaphore)),
                _ => prop_assert!(detail.is_empty(), "{:?}", detail),
            }
        }
    }

    #[test]
    fn error_codes_follow_the_rules(start in arb_semaphores(), cands in arb_candidates()) {
        let d = decide(&start, &cands);
        for (c, (id, v)) in cands.iter().zip(&d.verdicts) {
            prop_assert_eq!(c.id, *id);
            let unknown = c.permits.iter().any(|(n, _)| !start.contains_key(n));
            let exceeds = !unknown && c.permits.iter().any(|(n, k)| *k > start[n].capacity);
            if unknown {
                prop_assert_eq!(*v, Fail(ErrorCode::UnknownSemaphore));
            } else if exceeds {
                prop_assert_eq!(*v, Fail(ErrorCode::ExceedsCapacity));
            } else if c.deadline_passed {
                prop_assert_eq!(*v, Fail(ErrorCode::Timeout));
            } else if c.fail_fast {
                prop_assert!(*v == Grant || *v == Fail(ErrorCode::NoCapacity));
            } else {
                prop_assert!(*v == Grant || *v == Wait);
            }
        }
    }

    #[test]
    fn a_fair_head_is_never_overtaken(start in arb_semaphores(), cands in arb_candidates()) {
        let d = decide(&start, &cands);
        for (name, s) in &start {
            if !s.fair {
                continue;
            }
            let last = Rank { effective: i64::MIN, id: i64::MAX };
            let Some(head) = first_waiter(name, last, &start, &cands, &d) else { continue };
            let overtaken = cands.iter().zip(&d.verdicts).any(|(c, (_, v))| {
                *v == Grant && c.rank() > head.rank() && c.permits.iter().any(|(n, _)| n == name)
            });
            if overtaken {
                let free = d.semaphores[name].capacity - d.semaphores[name].used;
                prop_assert!(free >= head.count,
                    "a later grant on {} left {} free, head {:?} needs {}", name, free, head, head.count);
            }
        }
    }

    #[test]
    fn nothing_waits_that_could_have_been_granted(start in arb_semaphores(), cands in arb_candidates()) {
        // Backfill happens whenever it leaves the head's room: a request that waits (or fails
        // fast) would not fit even in the final state, which has no more room than it had.
        let d = decide(&start, &cands);
        for (c, (_, v)) in cands.iter().zip(&d.verdicts) {
            if !(*v == Wait || *v == Fail(ErrorCode::NoCapacity)) {
                continue;
            }
            let blocked = c.permits.iter().any(|(name, count)| {
                let s = &d.semaphores[name];
                let free_after = s.capacity - s.used - count;
                free_after < 0
                    || (s.fair
                        && first_waiter(name, c.rank(), &start, &cands, &d)
                            .is_some_and(|h| free_after < h.count))
            });
            prop_assert!(blocked, "{:?} waited although it fits: {:?}", c, d.semaphores);
        }
    }
}
