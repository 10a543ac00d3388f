//! Nested limits, guarantees and borrowing in the decision.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::tests::{cand, verdicts};
use super::*;

fn sem(capacity: i64, used: i64) -> SemaphoreView {
    SemaphoreView {
        capacity,
        used,
        fair: false,
        head: None,
        refused: false,
        parent: None,
        guarantee: 0,
        active: false,
    }
}

fn child(parent: &str, capacity: i64, used: i64, guarantee: i64) -> SemaphoreView {
    SemaphoreView {
        parent: Some(parent.to_string()),
        guarantee,
        ..sem(capacity, used)
    }
}

fn tree(list: &[(&str, SemaphoreView)]) -> BTreeMap<String, SemaphoreView> {
    list.iter()
        .map(|(n, s)| (n.to_string(), s.clone()))
        .collect()
}

use Verdict::{Fail, Grant, Wait};

#[test]
fn a_grant_on_a_child_takes_from_every_ancestor() {
    let t = tree(&[
        ("root", sem(10, 0)),
        ("pool", child("root", 6, 0, 0)),
        ("a", child("pool", 4, 0, 0)),
    ]);
    let d = decide(&t, &[cand(1, &[("a", 3)])]);
    assert_eq!(verdicts(&d), [Grant]);
    for name in ["root", "pool", "a"] {
        assert_eq!(d.semaphores[name].used, 3, "{name}");
    }
    let expected: BTreeMap<String, i64> = [("a", 3), ("pool", 3), ("root", 3)]
        .map(|(n, k)| (n.to_string(), k))
        .into();
    assert_eq!(d.charges[&1], expected);
}

#[test]
fn a_full_parent_holds_a_child_with_room_all_or_nothing() {
    let t = tree(&[("pool", sem(4, 3)), ("a", child("pool", 4, 0, 0))]);
    let d = decide(&t, &[cand(1, &[("a", 2)]), cand(2, &[("a", 1)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
    assert_eq!(d.semaphores["pool"].used, 4);
    assert_eq!(d.semaphores["a"].used, 1);
}

#[test]
fn a_count_over_an_ancestors_capacity_fails_and_a_missing_ancestor_is_unknown() {
    let t = tree(&[
        ("pool", sem(2, 0)),
        ("a", child("pool", 5, 0, 0)),
        ("orphan", child("gone", 5, 0, 0)),
    ]);
    let d = decide(&t, &[cand(1, &[("a", 3)]), cand(2, &[("orphan", 1)])]);
    assert_eq!(
        verdicts(&d),
        [
            Fail(ErrorCode::ExceedsCapacity),
            Fail(ErrorCode::UnknownSemaphore)
        ]
    );
}

#[test]
fn two_children_in_one_request_take_their_sum_from_the_parent() {
    let t = tree(&[
        ("pool", sem(5, 1)),
        ("a", child("pool", 4, 0, 0)),
        ("b", child("pool", 4, 0, 0)),
    ]);
    let d = decide(
        &t,
        &[
            cand(1, &[("a", 2), ("b", 3)]),
            cand(2, &[("a", 2), ("b", 2)]),
        ],
    );
    assert_eq!(verdicts(&d), [Wait, Grant]);
    assert_eq!(d.semaphores["pool"].used, 5);
}

/// pool 10; a and b guaranteed 4 each, ceilings 10.
fn guaranteed(a_used: i64, a_waiting: bool, b_used: i64) -> BTreeMap<String, SemaphoreView> {
    let mut a = child("pool", 10, a_used, 4);
    a.active = a_waiting;
    tree(&[
        ("pool", sem(10, a_used + b_used)),
        ("a", a),
        ("b", child("pool", 10, b_used, 4)),
    ])
}

#[test]
fn an_idle_childs_guarantee_is_lent() {
    let d = decide(&guaranteed(0, false, 4), &[cand(1, &[("b", 6)])]);
    assert_eq!(verdicts(&d), [Grant]);
    assert_eq!(d.semaphores["pool"].used, 10);
}

#[test]
fn borrowing_leaves_room_for_an_active_childs_unused_guarantee() {
    // a holds 1 of its 4: the pool keeps 3 for it; b may borrow 2 of the 5 free, not 3.
    let d = decide(
        &guaranteed(1, false, 4),
        &[cand(1, &[("b", 3)]), cand(2, &[("b", 2)])],
    );
    assert_eq!(verdicts(&d), [Wait, Grant]);
    assert_eq!(d.semaphores["pool"].used, 7);
    // A waiting request makes a child active as much as a held permit does.
    let d = decide(&guaranteed(0, true, 4), &[cand(1, &[("b", 3)])]);
    assert_eq!(verdicts(&d), [Wait]);
}

#[test]
fn within_its_guarantee_a_child_needs_only_room() {
    // b borrowed 2 while a was idle; a, active now, gets the room that is left (4).
    let d = decide(&guaranteed(0, true, 6), &[cand(1, &[("a", 4)])]);
    assert_eq!(verdicts(&d), [Grant]);
    // a's request beyond its guarantee borrows, and b, active, keeps its share (b holds 1 of 4).
    let d = decide(
        &guaranteed(4, false, 1),
        &[cand(1, &[("a", 3)]), cand(2, &[("a", 2)])],
    );
    assert_eq!(verdicts(&d), [Wait, Grant]);
}

#[test]
fn a_request_left_waiting_in_the_batch_activates_its_child_for_the_rest() {
    // b borrowed 4 while a was idle. a's 3 do not fit (2 free); from then on a is active, and
    // b may not borrow the room a waits for. Without a's request b's would go.
    let batch = [cand(1, &[("a", 3)]), cand(2, &[("b", 1)])];
    let d = decide(&guaranteed(0, false, 8), &batch);
    assert_eq!(verdicts(&d), [Wait, Wait]);
    let d = decide(&guaranteed(0, false, 8), &batch[1..]);
    assert_eq!(verdicts(&d), [Grant]);
}

#[test]
fn a_request_naming_the_parent_itself_borrows() {
    let d = decide(
        &guaranteed(1, false, 4),
        &[cand(1, &[("pool", 3)]), cand(2, &[("pool", 2)])],
    );
    assert_eq!(verdicts(&d), [Wait, Grant]);
}

#[test]
fn guarantees_apply_at_every_level() {
    // root 10: pool guaranteed 6 (holds 2 through a), other guaranteed 2 (idle, lent).
    let t = tree(&[
        ("root", sem(10, 2)),
        ("pool", child("root", 10, 2, 6)),
        ("other", child("root", 10, 0, 2)),
        ("a", child("pool", 10, 2, 0)),
    ]);
    // other's 5 borrow at root and must leave pool's 4: 8 free - 5 = 3 < 4.
    let d = decide(&t, &[cand(1, &[("other", 5)]), cand(2, &[("other", 4)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
    // a has no guarantee in pool (it borrows there), but pool is within its own at root.
    let d = decide(&t, &[cand(1, &[("a", 4)])]);
    assert_eq!(verdicts(&d), [Grant]);
    assert_eq!(d.semaphores["root"].used, 6);
}

#[test]
fn borrowers_take_turns_in_the_parents_line_and_a_guarantee_skips_it() {
    // pool 6, fair; a guaranteed 2 (holds 2), b and c none. b's 3 waits (2 free); c's 1 behind
    // it may not take the room b waits for; a's next one borrows and waits too. Had a room
    // within its guarantee it would not wait for b.
    let mut t = tree(&[
        ("pool", sem(6, 4)),
        ("a", child("pool", 6, 2, 2)),
        ("b", child("pool", 6, 0, 0)),
        ("c", child("pool", 6, 2, 0)),
    ]);
    t.get_mut("pool").unwrap().fair = true;
    let d = decide(
        &t,
        &[
            cand(1, &[("b", 3)]),
            cand(2, &[("c", 1)]),
            cand(3, &[("a", 1)]),
        ],
    );
    assert_eq!(verdicts(&d), [Wait, Wait, Wait]);
    // a guaranteed 3 now (holds 2: the pool keeps 1 for it), c holds 1.
    t.get_mut("a").unwrap().guarantee = 3;
    t.get_mut("c").unwrap().used = 1;
    t.get_mut("pool").unwrap().used = 3;
    let d = decide(&t, &[cand(1, &[("b", 2)]), cand(3, &[("a", 1)])]);
    assert_eq!(verdicts(&d), [Grant, Grant]);
    let d = decide(&t, &[cand(1, &[("b", 3)]), cand(3, &[("a", 1)])]);
    assert_eq!(
        verdicts(&d),
        [Wait, Grant],
        "within its guarantee a skips the line"
    );
}

#[test]
fn a_parents_recorded_head_keeps_its_room_from_borrowers_not_from_guarantees() {
    // pool 6, fair, holds 3; its recorded head (a request of another batch, through some child)
    // needs 2. b (no guarantee) may take 1, not 2; a within its guarantee may take 2.
    let mut t = tree(&[
        ("pool", sem(6, 3)),
        ("a", child("pool", 6, 0, 2)),
        ("b", child("pool", 6, 3, 0)),
    ]);
    let pool = t.get_mut("pool").unwrap();
    pool.fair = true;
    pool.head = Some(Head {
        request_id: 0,
        count: 2,
        effective: 1,
    });
    let d = decide(&t, &[cand(1, &[("b", 2)]), cand(2, &[("b", 1)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
    let d = decide(&t, &[cand(1, &[("a", 2)])]);
    assert_eq!(verdicts(&d), [Grant]);
}

#[test]
fn a_fair_childs_head_keeps_its_room_on_the_parent_within_the_guarantee() {
    // pool 6, fair; x borrowed 5 while y was idle; y (fair, guaranteed 2) has 1 of pool's room.
    // y's first in line needs 2 (within its guarantee) and waits; y's later 1 would fit the
    // pool's free permit, but takes the room the head waits for: it waits behind it.
    let mut t = tree(&[
        ("pool", sem(6, 5)),
        ("x", child("pool", 6, 5, 0)),
        ("y", child("pool", 6, 0, 2)),
    ]);
    t.get_mut("pool").unwrap().fair = true;
    t.get_mut("y").unwrap().fair = true;
    let d = decide(&t, &[cand(1, &[("y", 2)]), cand(2, &[("y", 1)])]);
    assert_eq!(verdicts(&d), [Wait, Wait]);
    // The same with the head recorded (waiting since an earlier batch).
    t.get_mut("y").unwrap().head = Some(Head {
        request_id: 1,
        count: 2,
        effective: 0,
    });
    let d = decide(&t, &[cand(2, &[("y", 1)])]);
    assert_eq!(verdicts(&d), [Wait]);
    // Once the pool has room for both, the later one goes beside it.
    t.get_mut("pool").unwrap().used = 3;
    t.get_mut("x").unwrap().used = 3;
    let d = decide(&t, &[cand(2, &[("y", 1)])]);
    assert_eq!(verdicts(&d), [Grant]);
    // On a greedy child, anything that fits goes.
    t.get_mut("y").unwrap().fair = false;
    t.get_mut("pool").unwrap().used = 5;
    t.get_mut("x").unwrap().used = 5;
    let d = decide(&t, &[cand(2, &[("y", 1)])]);
    assert_eq!(verdicts(&d), [Grant]);
}

/// A child's head that borrows at the parent takes its turn in the parent's line, and keeps no
/// room there: kept, it would wait for the reserve of a sibling that the request it holds back
/// keeps active, and neither would ever go.
#[test]
fn a_borrowing_head_keeps_no_room_on_the_parent_so_that_nothing_waits_in_a_cycle() {
    // pool 10; y (fair) and z guaranteed 5 each, nothing held. y's head H wants 8: it borrows 3
    // and must leave z's 5 while z is active. W wants y=1 and z=2, within both guarantees: it
    // makes z active, and must not wait for H.
    let mut t = tree(&[
        ("pool", sem(10, 0)),
        ("y", child("pool", 10, 0, 5)),
        ("z", child("pool", 10, 0, 5)),
    ]);
    t.get_mut("y").unwrap().fair = true;
    t.get_mut("z").unwrap().active = true;
    let d = decide(&t, &[cand(1, &[("y", 8)]), cand(2, &[("y", 1), ("z", 2)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
    // The same with H recorded (waiting since an earlier batch).
    t.get_mut("y").unwrap().head = Some(Head {
        request_id: 1,
        count: 8,
        effective: 0,
    });
    let d = decide(&t, &[cand(2, &[("y", 1), ("z", 2)])]);
    assert_eq!(verdicts(&d), [Grant]);
    // Within y's guarantee (5), the head keeps its room on the pool.
    t.get_mut("y").unwrap().head.as_mut().unwrap().count = 5;
    t.get_mut("pool").unwrap().used = 5;
    t.get_mut("z").unwrap().used = 5;
    let d = decide(&t, &[cand(2, &[("y", 1)])]);
    assert_eq!(verdicts(&d), [Wait]);
}

/// A request that waits beyond its child's unused guarantee borrows: it keeps nothing in
/// reserve, so a borrower it may wait behind is not held back by it (they would wait for each
/// other). One within it does make the child active.
#[test]
fn only_a_request_waiting_within_the_guarantee_makes_its_child_active() {
    // pool 2 (greedy) holds 1 elsewhere; team guaranteed 1. team's 2 borrow 1 and wait; the
    // pool's 1 is then free to take.
    let t = tree(&[
        ("pool", sem(2, 1)),
        ("team", child("pool", 2, 0, 1)),
        ("other", child("pool", 2, 1, 0)),
    ]);
    let d = decide(&t, &[cand(1, &[("team", 2)]), cand(2, &[("other", 1)])]);
    assert_eq!(verdicts(&d), [Wait, Grant]);
    // Within the guarantee, it keeps its 1.
    let mut t = t;
    t.get_mut("pool").unwrap().used = 2;
    t.get_mut("other").unwrap().used = 2;
    t.get_mut("pool").unwrap().capacity = 3;
    t.get_mut("other").unwrap().capacity = 3;
    let d = decide(
        &t,
        &[
            cand(1, &[("team", 1), ("other", 1)]),
            cand(2, &[("other", 1)]),
        ],
    );
    assert_eq!(verdicts(&d), [Wait, Wait]);
}

/// A child a grant takes through is its own: the reserve is for the other children. (A request
/// that waited within y's guarantee left a waiter row that made y active, and kept y's unused
/// guarantee in reserve against itself for ever.)
#[test]
fn a_grant_keeps_no_reserve_for_a_child_it_takes_through() {
    let mut t = tree(&[("pool", sem(2, 0)), ("y", child("pool", 2, 0, 2))]);
    t.get_mut("y").unwrap().active = true;
    let d = decide(&t, &[cand(1, &[("y", 1), ("pool", 1)])]);
    assert_eq!(verdicts(&d), [Grant]);
}

// ---- properties ----

const NAMES: [&str; 7] = ["root", "pool", "a", "b", "c", "flat", "nope"];

/// root ← pool ← {a, b, c}, and flat beside them; guarantees within their parents' capacities;
/// each level's `used` counts what is held below it plus what was taken from it directly.
fn arb_tree() -> impl Strategy<Value = BTreeMap<String, SemaphoreView>> {
    let leaf = (1i64..8, 0i64..6, 0i64..4, any::<bool>(), any::<bool>());
    (
        proptest::collection::vec(leaf, 3),
        (0i64..4, 0i64..3, 0i64..4),
        (1i64..10, 0i64..4),
        any::<bool>(),
    )
        .prop_map(
            |(leaves, (pool_extra, pool_direct, root_direct), (flat_cap, flat_used), fair)| {
                let mut t = BTreeMap::new();
                let (mut held, mut promised) = (0, 0);
                for ((capacity, used, guarantee, waiting, leaf_fair), name) in
                    leaves.into_iter().zip(["a", "b", "c"])
                {
                    let guarantee = guarantee.min(capacity);
                    let used = used.min(capacity + 1);
                    held += used;
                    promised += guarantee;
                    let mut s = child("pool", capacity, used, guarantee);
                    s.active = waiting;
                    s.fair = leaf_fair;
                    t.insert(name.to_string(), s);
                }
                let pool_capacity = promised + pool_extra;
                let pool_used = held + pool_direct;
                let mut pool = child("root", pool_capacity, pool_used, pool_capacity.min(6));
                pool.fair = fair;
                t.insert("pool".into(), pool);
                t.insert(
                    "root".into(),
                    sem(pool_capacity.min(6) + 4, pool_used + root_direct),
                );
                t.insert("flat".into(), sem(flat_cap, flat_used));
                t
            },
        )
}

fn arb_batch() -> impl Strategy<Value = Vec<Candidate>> {
    let one = (
        proptest::sample::subsequence(NAMES.to_vec(), 1..=2),
        proptest::collection::vec(1i64..6, 2),
        prop_oneof![8 => Just(false), 1 => Just(true)],
    );
    proptest::collection::vec(one, 0..16).prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (names, counts, fail_fast))| {
                let permits: Vec<(&str, i64)> = names.into_iter().zip(counts).collect();
                let mut c = cand(i64::try_from(i).unwrap() + 1, &permits);
                c.fail_fast = fail_fast;
                c
            })
            .collect()
    })
}

/// What a grant takes, walked the plain way.
fn oracle_takes(
    c: &Candidate,
    t: &BTreeMap<String, SemaphoreView>,
) -> Option<BTreeMap<String, i64>> {
    let mut taken = BTreeMap::new();
    for (name, count) in &c.permits {
        let mut at = Some(name.clone());
        while let Some(n) = at {
            let s = t.get(&n)?;
            *taken.entry(n).or_insert(0) += count;
            at = s.parent.clone();
        }
    }
    Some(taken)
}

/// The state the decision had reached when it came to candidate `i`, and the semaphores the
/// batch's earlier waiters take from.
fn before(
    start: &BTreeMap<String, SemaphoreView>,
    cands: &[Candidate],
    d: &Decision,
    i: usize,
) -> (BTreeMap<String, SemaphoreView>, BTreeSet<String>) {
    let state = decide(start, &cands[..i]).semaphores;
    // Each earlier waiter activates the children where it waits within the unused guarantee
    // (as it stood when it was decided).
    let waiting = cands[..i]
        .iter()
        .enumerate()
        .zip(&d.verdicts)
        .filter(|(_, (_, v))| *v == Wait)
        .flat_map(|((j, c), _)| {
            let then = decide(start, &cands[..j]).semaphores;
            oracle_takes(c, start)
                .unwrap_or_default()
                .into_iter()
                .filter(move |(n, k)| *k <= (then[n].guarantee - then[n].used).max(0))
                .map(|(n, _)| n)
        })
        .collect();
    (state, waiting)
}

/// Whether the grant borrows at `parent`: names it, or takes more through a child than the
/// child's unused guarantee.
fn oracle_borrows(
    c: &Candidate,
    taken: &BTreeMap<String, i64>,
    t: &BTreeMap<String, SemaphoreView>,
    parent: &str,
) -> bool {
    c.permits.iter().any(|(n, _)| n == parent)
        || t.iter().any(|(n, s)| {
            s.parent.as_deref() == Some(parent)
                && taken
                    .get(n)
                    .is_some_and(|k| *k > (s.guarantee - s.used).max(0))
        })
}

/// Rule 4 stated plainly: room on every level; a fair semaphore it names keeps its first
/// waiter's (of this batch) count free there and on every level above it; where it borrows: a
/// fair parent's first waiter keeps its room, and the parent keeps every active guaranteed
/// child's unused guarantee.
fn oracle_fits(
    c: &Candidate,
    taken: &BTreeMap<String, i64>,
    t: &BTreeMap<String, SemaphoreView>,
    waiting: &BTreeSet<String>,
    first_waiter: impl Fn(&str) -> Option<i64>,
) -> bool {
    taken.iter().all(|(parent, count)| {
        let free_after = t[parent].capacity - t[parent].used - count;
        if free_after < 0 {
            return false;
        }
        let above_a_fair_named_one = c.permits.iter().any(|(named, _)| {
            named != parent
                && t[named].fair
                && oracle_takes(&cand(0, &[(named.as_str(), 1)]), t)
                    .is_some_and(|chain| chain.contains_key(parent))
                && first_waiter(named).is_some_and(|h| {
                    // A head that borrows anywhere above it takes its turn in the parents'
                    // lines instead.
                    let mut at = named.as_str();
                    let mut borrows = false;
                    while let Some(parent) = t[at].parent.as_deref() {
                        borrows |= h > (t[at].guarantee - t[at].used).max(0);
                        at = parent;
                    }
                    free_after < h && !borrows
                })
        });
        if above_a_fair_named_one {
            return false;
        }
        if !oracle_borrows(c, taken, t, parent) {
            return true;
        }
        if t[parent].fair && first_waiter(parent).is_some_and(|h| free_after < h) {
            return false;
        }
        let reserve: i64 = t
            .iter()
            .filter(|(n, s)| {
                s.parent.as_deref() == Some(parent.as_str())
                    && s.guarantee > 0
                    && !taken.contains_key(*n)
            })
            .map(|(n, s)| {
                let used = s.used + taken.get(n).copied().unwrap_or(0);
                if used > 0 || s.active || waiting.contains(n) {
                    (s.guarantee - used).max(0)
                } else {
                    0
                }
            })
            .sum();
        free_after >= reserve
    })
}

/// Why [`order_mattered`] counts guarantees in: granting `a` first activates its guarantee,
/// which keeps room on `pool` that `b` may not borrow; `b` first, with `a` idle, borrows it.
#[test]
fn a_guarantee_makes_the_order_matter_even_when_all_was_granted() {
    let t: BTreeMap<String, SemaphoreView> = [
        ("pool".to_string(), sem(10, 0)),
        ("a".to_string(), child("pool", 10, 0, 5)),
        ("b".to_string(), child("pool", 10, 0, 0)),
    ]
    .into();
    let b_first = [cand(1, &[("b", 8)]), cand(2, &[("a", 2)])];
    let d = decide(&t, &b_first);
    assert_eq!(verdicts(&d), vec![Grant, Grant]);
    let a_first = super::tests::reordered(&b_first, &[1, 0]);
    assert_eq!(verdicts(&decide(&t, &a_first)), vec![Grant, Wait]);
    assert!(order_mattered(&t, &d));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]

    #[test]
    fn without_guarantees_when_the_order_did_not_matter_every_order_grants_the_whole_batch(
        start in arb_tree().prop_map(|mut t| {
            for s in t.values_mut() {
                s.guarantee = 0;
            }
            t
        }),
        (cands, order) in arb_batch().prop_flat_map(|c| {
            let n = c.len();
            (Just(c), Just((0..n).collect::<Vec<usize>>()).prop_shuffle())
        })
    ) {
        let d = decide(&start, &cands);
        if order_mattered(&start, &d) {
            return Ok(());
        }
        let other = decide(&start, &super::tests::reordered(&cands, &order));
        prop_assert!(other.verdicts.iter().all(|(_, v)| *v == Grant), "{:?}", other.verdicts);
        prop_assert_eq!(other.semaphores, d.semaphores);
    }

    #[test]
    fn no_level_is_ever_over_capacity_and_each_counts_exactly_what_was_taken_below_it(
        start in arb_tree(), cands in arb_batch()
    ) {
        let d = decide(&start, &cands);
        for (name, s) in &start {
            let taken: i64 = cands.iter().zip(&d.verdicts)
                .filter(|(_, (_, v))| *v == Grant)
                .filter_map(|(c, _)| oracle_takes(c, &start)?.get(name).copied())
                .sum();
            let after = &d.semaphores[name];
            prop_assert_eq!(after.used, s.used + taken, "{} must move by what its subtree took", name);
            if taken > 0 {
                prop_assert!(after.used <= after.capacity, "{} over capacity: {:?}", name, after);
            }
        }
    }

    #[test]
    fn granted_exactly_when_every_level_has_room_and_no_reserve_is_borrowed(
        start in arb_tree(), cands in arb_batch()
    ) {
        // No recorded heads: the batch's own waiters are the heads. Nothing waits that fits,
        // nothing goes that does not.
        let d = decide(&start, &cands);
        for (i, (c, (_, v))) in cands.iter().zip(&d.verdicts).enumerate() {
            let Some(taken) = oracle_takes(c, &start) else {
                prop_assert_eq!(*v, Fail(ErrorCode::UnknownSemaphore));
                continue;
            };
            if taken.iter().any(|(n, k)| *k > start[n].capacity) {
                prop_assert_eq!(*v, Fail(ErrorCode::ExceedsCapacity));
                continue;
            }
            let (state, waiting) = before(&start, &cands, &d, i);
            let fits = oracle_fits(c, &taken, &state, &waiting, |n| {
                first_batch_waiter(n, &cands[..i], &d, &start)
            });
            let expected = if fits { Grant } else if c.fail_fast { Fail(ErrorCode::NoCapacity) } else { Wait };
            prop_assert_eq!(*v, expected, "candidate {:?} in {:?}", c, state);
        }
    }

    #[test]
    fn a_child_within_its_guarantee_is_refused_only_for_want_of_room(
        start in arb_tree(), cands in arb_batch()
    ) {
        let d = decide(&start, &cands);
        for (i, (c, (_, v))) in cands.iter().zip(&d.verdicts).enumerate() {
            let [(name, count)] = c.permits.as_slice() else { continue };
            if !["a", "b", "c"].contains(&name.as_str()) || c.fail_fast {
                continue;
            }
            let (state, _) = before(&start, &cands, &d, i);
            let s = &state[name];
            let within = *count <= s.guarantee - s.used
                && state["pool"].guarantee - state["pool"].used >= *count;
            let room = ["root", "pool", name.as_str()]
                .iter()
                .all(|n| state[*n].capacity - state[*n].used >= *count);
            let head = s.fair && first_batch_waiter(name, &cands[..i], &d, &start).is_some();
            if within && room && !head {
                prop_assert_eq!(*v, Grant, "{:?} within its guarantee in {:?}", c, state);
            }
        }
    }
}

/// What the first of `earlier` left waiting takes from `name`, if any.
fn first_batch_waiter(
    name: &str,
    earlier: &[Candidate],
    d: &Decision,
    start: &BTreeMap<String, SemaphoreView>,
) -> Option<i64> {
    earlier.iter().zip(&d.verdicts).find_map(|(c, (_, v))| {
        (*v == Wait)
            .then(|| oracle_takes(c, start)?.get(name).copied())
            .flatten()
    })
}
