//! [`WorkerHealth`]: what a running worker reports about itself (for readiness probes and
//! gauges).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A live view of one worker's health, from [`crate::Worker::health`]; cheap to clone, readable
/// from any thread while the worker runs.
#[derive(Debug, Clone, Default)]
pub struct WorkerHealth {
    inner: Arc<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    listener_connected: AtomicBool,
    /// Unix time in ms of the last pass, or batch of a long pass, that ran to the end (0: none
    /// yet).
    last_pass_ms: AtomicU64,
    /// How long a pass may take before it is overdue, in ms (0: never).
    overdue_after_ms: AtomicU64,
    /// Unix time in ms when the worker was made: the first pass is due from then.
    made_ms: AtomicU64,
}

impl WorkerHealth {
    /// Whether the worker's LISTEN connection is up right now.
    pub fn listener_connected(&self) -> bool {
        self.inner.listener_connected.load(Ordering::Relaxed)
    }

    /// When the worker last completed a pass, or a batch of a long one (None before the first).
    pub fn last_pass(&self) -> Option<SystemTime> {
        match self.inner.last_pass_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(UNIX_EPOCH + Duration::from_millis(ms)),
        }
    }

    pub(crate) fn set_listener_connected(&self, connected: bool) {
        self.inner
            .listener_connected
            .store(connected, Ordering::Relaxed);
    }

    /// How long since the last completed pass, when that is longer than a working worker
    /// ever goes without one (twice its poll interval and 10 s: an idle worker completes a
    /// pass every poll interval). Its passes fail, or one hangs: its log says why.
    /// A worker none of whose passes completed yet counts from when it was made.
    pub fn pass_overdue(&self) -> Option<Duration> {
        let bound = self.inner.overdue_after_ms.load(Ordering::Relaxed);
        let since = self.last_pass().unwrap_or_else(|| {
            UNIX_EPOCH + Duration::from_millis(self.inner.made_ms.load(Ordering::Relaxed))
        });
        let age = SystemTime::now().duration_since(since).ok()?;
        (bound > 0 && age > Duration::from_millis(bound)).then_some(age)
    }

    /// Made for a worker that passes at least every `poll_interval`.
    pub(crate) fn for_poll_interval(poll_interval: Duration) -> WorkerHealth {
        let health = WorkerHealth::default();
        let bound = poll_interval * 2 + Duration::from_secs(10);
        health.inner.overdue_after_ms.store(
            u64::try_from(bound.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        health.inner.made_ms.store(now_ms(), Ordering::Relaxed);
        health
    }

    pub(crate) fn pass_done(&self) {
        self.inner.last_pass_ms.store(now_ms(), Ordering::Relaxed);
    }
}

/// Now, in ms since the Unix epoch.
fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
