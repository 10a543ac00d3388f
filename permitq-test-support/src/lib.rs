//! Test support for permitq (not published): a throwaway PostgreSQL from the system's binaries,
//! a freshly migrated database per test, in-process worker fleets, run reports and the
//! invariant queries every concurrency test and the chaos sampler check. Used by the library's
//! and the CLI's tests and by `permitq demo`, `bench` and `chaos`.

mod embedded;
mod fleet;
mod netns;
mod report;
mod sql;
mod testdb;

pub use embedded::{find_bin_dir, EmbeddedPostgres, StopMode, TEST_SETTINGS};
pub use fleet::{database, WorkerFleet};
pub use netns::NetworkBed;
pub use report::{
    collect, invariant_violations, quantile, queue_and_grants, Percentiles, RunReport,
};
pub use testdb::{
    check_invariants, connect, event_objects, init_logging, listen, quiet_config, semaphore_locked,
    settled_state, signal, state_of, try_connect, wait_folded, wait_until, with_dbname,
    RunningWorker, TestDb,
};

/// Errors of test support: anything, boxed, with a message.
pub type Error = Box<dyn std::error::Error + Send + Sync>;
/// Results of test support.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error with `message`.
pub fn error(message: impl Into<String>) -> Error {
    message.into().into()
}
