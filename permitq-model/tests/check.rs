//! The protocol's model, checked exhaustively within its bounds (the crate's README states them,
//! with the states explored and the time).

use std::time::Instant;

use permitq_model::{GrantProtocol, LockMode, Replication};
use stateright::{Checker, Model};

fn check(lock_mode: LockMode, replication: Replication) {
    let started = Instant::now();
    let checker = GrantProtocol::standard(lock_mode, replication)
        .checker()
        .threads(2)
        .spawn_bfs()
        .join();
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
fn todays_path_waiting_for_locks_with_a_synchronous_standby() {
    check(LockMode::Wait, Replication::Synchronous);
}

#[test]
fn todays_path_waiting_for_locks_with_an_asynchronous_standby() {
    check(LockMode::Wait, Replication::Asynchronous);
}

#[test]
fn the_rebuilt_path_skipping_locked_semaphores_with_a_synchronous_standby() {
    check(LockMode::SkipLocked, Replication::Synchronous);
}

#[test]
fn the_rebuilt_path_skipping_locked_semaphores_with_an_asynchronous_standby() {
    check(LockMode::SkipLocked, Replication::Asynchronous);
}

/// Each planted bug is caught: some property finds a counterexample.
fn caught(plant: permitq_model::Plant, lock_mode: LockMode, replication: Replication) {
    let mut model = GrantProtocol::standard(lock_mode, replication);
    model.plant = Some(plant);
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
fn deciding_requests_whose_semaphores_were_skipped_is_caught() {
    caught(
        permitq_model::Plant::DecideWithoutLocks,
        LockMode::SkipLocked,
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
