//! The protocol's model, checked exhaustively within its bounds (the crate's README states them,
//! with the states explored and the time).

use std::time::Instant;

use permitq_model::{GrantProtocol, LockMode, Replication};
use stateright::{Checker, Model};

fn check(lock_mode: LockMode, replication: Replication) {
    check_model(GrantProtocol::standard(lock_mode, replication));
}

fn check_model(model: GrantProtocol) {
    let (lock_mode, replication) = (model.lock_mode, model.failover);
    let started = Instant::now();
    let checker = model.checker().threads(2).spawn_bfs().join();
    eprintln!(
        "{lock_mode:?}, {replication:?}: {} states ({} unique), depth {}, {:.1?}",
        checker.state_count(),
        checker.unique_state_count(),
        checker.max_depth(),
        started.elapsed()
    );
    checker.assert_properties();
}

#[test]
fn the_previous_path_waiting_for_locks_with_a_synchronous_standby() {
    check(LockMode::Wait, Replication::Synchronous);
}

#[test]
fn the_previous_path_waiting_for_locks_with_an_asynchronous_standby() {
    check(LockMode::Wait, Replication::Asynchronous);
}

#[test]
fn semaphores_locked_first_beside_waiting_claims_with_a_synchronous_standby() {
    check(LockMode::LockFirst, Replication::Synchronous);
}

#[test]
fn semaphores_locked_first_beside_waiting_claims_with_an_asynchronous_standby() {
    check(LockMode::LockFirst, Replication::Asynchronous);
}

/// Lock-first batches side by side on semaphores that are not nested, and a request that needs
/// a semaphore each worker holds.
#[test]
fn semaphores_locked_first_side_by_side_on_independent_semaphores() {
    check_model(GrantProtocol::independent(
        LockMode::LockFirst,
        Replication::Asynchronous,
    ));
}

/// A later request within a fair child's guarantee never takes, on the parent, the room the
/// child's first in line waits for (safe backfill at every level it takes from).
/// (Bounds without a crash or failover: those properties that say one happened are not asked.)
#[test]
fn a_childs_first_in_line_keeps_its_room_on_the_parent() {
    check_safety_and_reach(GrantProtocol::guarantee_line);
}

/// A child's head that borrows at the parent keeps no room there for itself: the request it
/// would hold back keeps a sibling active, whose reserve the head waits for. Neither is stuck.
#[test]
fn a_borrowing_head_and_a_request_within_two_guarantees_never_wait_for_each_other() {
    check_safety_and_reach(GrantProtocol::reserve_cycle);
}

/// A request left waiting within a guarantee keeps no reserve against itself when it is decided
/// again.
#[test]
fn a_waiting_request_keeps_no_reserve_against_itself() {
    check_safety_and_reach(GrantProtocol::self_reserve);
}

/// The always-properties hold in both lock modes, and a wait then grant and a borrow happen.
fn check_safety_and_reach(bounds: fn(LockMode) -> GrantProtocol) {
    for lock_mode in [LockMode::Wait, LockMode::LockFirst] {
        let model = bounds(lock_mode);
        let properties: Vec<(&'static str, bool)> = model
            .properties()
            .iter()
            .map(|p| (p.name, p.expectation == stateright::Expectation::Sometimes))
            .collect();
        let checker = model.checker().threads(2).spawn_bfs().join();
        for (name, sometimes) in properties {
            let found = checker.discovery(name).is_some();
            if !sometimes {
                assert!(
                    !found,
                    "{lock_mode:?}: {name}: {:?}",
                    checker.discovery(name)
                );
            } else if name.starts_with("a request waited") || name.starts_with("a grant borrowed") {
                assert!(found, "{lock_mode:?}: never reached: {name}");
            }
        }
        eprintln!("{lock_mode:?}: {} states", checker.unique_state_count());
    }
}

/// Each planted bug is caught: some property finds a counterexample. Each plant is checked in
/// the smallest model that can show it (a failover only for the epoch, a crash only for a
/// crash's leftovers): the full model takes a minute each.
fn caught(plant: permitq_model::Plant, lock_mode: LockMode, replication: Replication) {
    use permitq_model::Plant;
    // Where a plant shows only with a request waiting within a guarantee (a guaranteed child
    // active by its waiter, or a child's head short on the parent), bounds that have one.
    let mut model = match plant {
        Plant::ReserveIgnored => GrantProtocol::reserve_cycle(lock_mode),
        Plant::NoHeads => GrantProtocol::guarantee_line(lock_mode),
        _ => GrantProtocol::standard(lock_mode, replication),
    };
    model.plant = Some(plant);
    if plant != Plant::NoEpochRaise {
        model.failover = None;
    }
    if plant != Plant::ClaimNotReturnedOnCrash {
        model.crashes = 0;
    }
    model.capacity_change = None;
    let properties: Vec<&'static str> = model.properties().iter().map(|p| p.name).collect();
    let checker = model.checker().threads(2).spawn_bfs().join();
    let found: Vec<&str> = properties
        .iter()
        .copied()
        .filter(|name| {
            !name.starts_with("a ") && !name.starts_with("two ") && !name.starts_with("every ")
        })
        .filter(|name| checker.discovery(name).is_some())
        .collect();
    eprintln!("{plant:?}: caught by {found:?}");
    assert!(!found.is_empty(), "{plant:?} was not caught");
}

#[test]
fn a_failover_without_the_epoch_raise_is_caught() {
    caught(
        permitq_model::Plant::NoEpochRaise,
        LockMode::Wait,
        Replication::Asynchronous,
    );
}

#[test]
fn releases_folded_twice_are_caught() {
    caught(
        permitq_model::Plant::ReleasesFoldedTwice,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

#[test]
fn a_claim_of_rows_another_worker_holds_is_caught() {
    caught(
        permitq_model::Plant::ClaimLockedRows,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

#[test]
fn claiming_requests_whose_semaphores_another_worker_holds_is_caught() {
    caught(
        permitq_model::Plant::DecideWithoutLocks,
        LockMode::LockFirst,
        Replication::Synchronous,
    );
}

#[test]
fn a_decision_that_does_not_see_the_heads_is_caught() {
    caught(
        permitq_model::Plant::NoHeads,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

#[test]
fn locks_taken_unsorted_are_caught() {
    caught(
        permitq_model::Plant::LocksUnsorted,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

#[test]
fn a_claimed_row_not_returned_on_a_crash_is_caught() {
    caught(
        permitq_model::Plant::ClaimNotReturnedOnCrash,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

#[test]
fn a_borrower_ignoring_the_guarantee_reserve_is_caught() {
    caught(
        permitq_model::Plant::ReserveIgnored,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

#[test]
fn a_sweep_racing_a_heartbeat_is_caught() {
    caught(
        permitq_model::Plant::SweepWithoutRecheck,
        LockMode::Wait,
        Replication::Synchronous,
    );
}

/// Every step names a function the schema still has (or the Rust decision).
#[test]
fn every_step_names_a_function_the_schema_has() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../permitq");
    let schema: String = std::fs::read_dir(root.join("schema/functions"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    let decision = std::fs::read_to_string(root.join("src/decision.rs")).unwrap();
    for (step, function) in permitq_model::STEPS {
        let found = match function.strip_prefix("permitq.") {
            Some(name) => schema.contains(&format!("FUNCTION permitq.{name}(")),
            None => decision.contains("pub fn decide("),
        };
        assert!(
            found,
            "{step}: {function} is not in the schema any more: change the model first"
        );
    }
}
