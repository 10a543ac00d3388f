//! Stateright's explorer on the protocol's model: browse states and step through a
//! counterexample in a web page.
//!
//!     cargo run --release -p permitq-model --example explore -- [wait|first] [sync|async] [PLANT]
//!
//! then open http://localhost:3000. PLANT is one of the planted bugs by name (e.g.
//! `LocksUnsorted`), to see the counterexample that catches it.

use permitq_model::{GrantProtocol, LockMode, Plant, Replication};
use stateright::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let lock_mode = match args.first().map(String::as_str) {
        Some("first") => LockMode::LockFirst,
        _ => LockMode::Wait,
    };
    let replication = match args.get(1).map(String::as_str) {
        Some("async") => Replication::Asynchronous,
        _ => Replication::Synchronous,
    };
    let mut model = GrantProtocol::standard(lock_mode, replication);
    model.plant = args.get(2).map(|name| match name.as_str() {
        "NoEpochRaise" => Plant::NoEpochRaise,
        "ReleasesFoldedTwice" => Plant::ReleasesFoldedTwice,
        "ClaimLockedRows" => Plant::ClaimLockedRows,
        "DecideWithoutLocks" => Plant::DecideWithoutLocks,
        "NoHeads" => Plant::NoHeads,
        "LocksUnsorted" => Plant::LocksUnsorted,
        "ClaimNotReturnedOnCrash" => Plant::ClaimNotReturnedOnCrash,
        "ReserveIgnored" => Plant::ReserveIgnored,
        "SweepWithoutRecheck" => Plant::SweepWithoutRecheck,
        other => panic!("no plant named {other}"),
    });
    eprintln!(
        "explore {lock_mode:?} {replication:?} {:?} at http://localhost:3000",
        model.plant
    );
    model.checker().serve("localhost:3000");
}
