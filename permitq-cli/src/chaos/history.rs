//! What every chaos client saw: each operation as an invocation and a completion.
//!
//! A completion is `Ok`, `Fail` (definitely did not happen: the database refused it) or `Info`
//! (indeterminate: the connection was lost, perhaps during COMMIT, so it may or may not have
//! happened). Checkers must treat `Info` as "maybe".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

/// The kind of operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum OpKind {
    /// `permitq.submit`.
    Submit,
    /// `permitq.release`.
    Release,
    /// `permitq.heartbeat`.
    Heartbeat,
    /// `permitq.fence` (a downstream write).
    Fence,
    /// A holder's use of the resource under a [`permitq::Lease`]: invoked when it began,
    /// completed when its last slice of work ended (`Ok("lost")` when it stopped at the lease's
    /// lost signal, `Ok("done")` when it finished first).
    Work,
}

/// How an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// It happened; the value returned (request id, release outcome, ...).
    Ok(String),
    /// It definitely did not happen, and why.
    Fail(String),
    /// Unknown whether it happened (connection lost).
    Info(String),
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Ok(_) => "ok",
            Outcome::Fail(_) => "fail",
            Outcome::Info(_) => "info",
        }
    }
}

/// One completed operation.
#[derive(Debug, Clone)]
pub(crate) struct Op {
    /// Which client.
    #[allow(
        dead_code,
        reason = "part of the recorded history, shown in Debug dumps"
    )]
    pub client: usize,
    /// What.
    pub kind: OpKind,
    /// On which request (or resource, for fences).
    pub key: String,
    /// A detail of the invocation (the fencing token of a fence).
    pub arg: i64,
    /// Invocation time.
    pub invoked: SystemTime,
    /// Completion time.
    pub completed: SystemTime,
    /// Result.
    pub outcome: Outcome,
}

/// The shared, append-only history.
#[derive(Debug, Clone, Default)]
pub(crate) struct History {
    ops: Arc<Mutex<Vec<Op>>>,
}

impl History {
    /// Records a completed operation.
    pub(crate) fn record(&self, op: Op) {
        self.ops.lock().expect("history lock").push(op);
    }

    /// Everything recorded, in completion order.
    pub(crate) fn ops(&self) -> Vec<Op> {
        self.ops.lock().expect("history lock").clone()
    }

    /// Counts by (kind, outcome label).
    pub(crate) fn counts(&self) -> BTreeMap<(OpKind, &'static str), u64> {
        let mut counts = BTreeMap::new();
        for op in self.ops.lock().expect("history lock").iter() {
            *counts.entry((op.kind, op.outcome.label())).or_default() += 1;
        }
        counts
    }
}

/// Classifies an error from an operation: lost connection → Info, else Fail.
pub(crate) fn outcome_of_error(e: &permitq::Error) -> Outcome {
    if e.is_connection() {
        Outcome::Info(e.to_string())
    } else {
        Outcome::Fail(e.to_string())
    }
}
