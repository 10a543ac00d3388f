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
    /// Unix time in ms of the last pass that ran to the end (0: none yet).
    last_pass_ms: AtomicU64,
}

impl WorkerHealth {
    /// Whether the worker's LISTEN connection is up right now.
    pub fn listener_connected(&self) -> bool {
        self.inner.listener_connected.load(Ordering::Relaxed)
    }

    /// When the worker last completed a pass (None before the first one).
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

    pub(crate) fn pass_done(&self) {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        self.inner.last_pass_ms.store(ms, Ordering::Relaxed);
    }
}
