//! [`Outage`]: a worker's tasks (passes, sweeps, retention, its liveness row) share one account
//! of the database being unreachable, so that an outage logs one line when it starts and one
//! when it ends, with what failed meanwhile, instead of a line per task per retry.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use crate::error::Error;

/// How often an outage that goes on is said again (with the latest error).
const STILL_DOWN_EVERY: std::time::Duration = std::time::Duration::from_secs(30);

/// The worker's account of an outage in progress (none while the database answers).
#[derive(Debug, Default)]
pub(crate) struct Outage {
    down: Mutex<Option<Down>>,
}

#[derive(Debug)]
struct Down {
    since: Instant,
    /// When the outage was last logged: it is said again every [`STILL_DOWN_EVERY`].
    said: Instant,
    /// Failed attempts per task while down.
    failed: BTreeMap<&'static str, u64>,
}

impl Outage {
    /// Records that `task` failed with `error`. A connection error starts the outage (logged
    /// once, as an error naming the server) or counts in it: true, nothing more to log. Any other
    /// error is the caller's to log: false.
    pub(crate) fn failed(&self, task: &'static str, error: &Error) -> bool {
        if !error.is_connection() {
            return false;
        }
        let mut down = self.lock();
        match down.as_mut() {
            Some(d) => {
                *d.failed.entry(task).or_insert(0) += 1;
                if d.said.elapsed() >= STILL_DOWN_EVERY {
                    d.said = Instant::now();
                    tracing::warn!(%error, task,
                        "database still unreachable after {:.0}s; retrying",
                        d.since.elapsed().as_secs_f64());
                }
            }
            None => {
                tracing::error!(%error, task,
                    "database unreachable; nothing is granted until it is back (retrying)");
                *down = Some(Down {
                    since: Instant::now(),
                    said: Instant::now(),
                    failed: BTreeMap::from([(task, 1)]),
                });
            }
        }
        true
    }

    /// Records that a task that began at `began` reached the database: ends an outage in
    /// progress, with one line, unless the task began before the outage did (a call already
    /// under way when the server went away, answered as it shut down, proves nothing).
    pub(crate) fn succeeded(&self, began: Instant) {
        let down = {
            let mut down = self.lock();
            match down.as_ref() {
                Some(d) if began >= d.since => down.take(),
                _ => None,
            }
        };
        let Some(down) = down else {
            return;
        };
        let failed = down
            .failed
            .iter()
            .map(|(task, n)| format!("{n} {task}"))
            .collect::<Vec<_>>()
            .join(", ");
        let down_s = down.since.elapsed().as_secs_f64();
        tracing::info!(
            down_s,
            "database reachable again after {down_s:.1}s; granting goes on (retried meanwhile: {failed})"
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Down>> {
        self.down
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}
