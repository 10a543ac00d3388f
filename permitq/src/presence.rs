//! Whether anything is granting: the workers that say they run ([`WorkerSeen`], [`Granting`]),
//! from `permitq.workers` and `permitq.granting()` (schema/functions/workers.sql).

use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio_postgres::Row;

use crate::error::Result;
use crate::types::ser_time;

/// A worker seen in the last hour (a row of `permitq.workers`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct WorkerSeen {
    /// Its `--id`.
    pub worker_id: String,
    /// The host it runs on.
    pub host: String,
    /// The permitq version it runs.
    pub version: String,
    /// Its process id on that host.
    pub pid: i32,
    /// When it started.
    #[serde(serialize_with = "ser_time")]
    pub started_at: Option<SystemTime>,
    /// When it last said it is alive.
    #[serde(serialize_with = "ser_time")]
    pub seen_at: Option<SystemTime>,
    /// Whether it counts as running: it said so within the last few seconds.
    pub live: bool,
    /// When it stopped cleanly (SIGTERM, Ctrl-C), if it did: one that died or lost the
    /// database has none.
    #[serde(serialize_with = "ser_time")]
    pub stopped_at: Option<SystemTime>,
}

impl WorkerSeen {
    pub(crate) fn from_row(row: &Row) -> Result<WorkerSeen> {
        Ok(WorkerSeen {
            worker_id: row.try_get("worker_id")?,
            host: row.try_get("host")?,
            version: row.try_get("version")?,
            pid: row.try_get("pid")?,
            started_at: row.try_get("started_at")?,
            seen_at: row.try_get("seen_at")?,
            live: row.try_get("live")?,
            stopped_at: row.try_get("stopped_at")?,
        })
    }
}

/// Whether anything is granting ([`crate::Client::granting`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Granting {
    /// Workers that said they are alive within the last few seconds.
    pub live_workers: i32,
    /// When any worker last said so (`None`: none in the last hour).
    #[serde(serialize_with = "ser_time")]
    pub last_seen: Option<SystemTime>,
    /// The database asked: a worker started against another one is not seen here.
    pub database: String,
}

impl Granting {
    pub(crate) fn from_row(row: &Row) -> Result<Granting> {
        Ok(Granting {
            live_workers: row.try_get("live_workers")?,
            last_seen: row.try_get("last_seen")?,
            database: row.try_get("database")?,
        })
    }

    /// `None` while a worker runs; else what to tell a user whose request waits:
    /// `nothing is granting: no worker seen for 42s; start one with `permitq worker``.
    pub fn warning(&self) -> Option<String> {
        if self.live_workers > 0 {
            return None;
        }
        let since = match self.last_seen {
            Some(seen) => {
                let ago = SystemTime::now()
                    .duration_since(seen)
                    .unwrap_or_default()
                    .as_secs();
                format!(
                    "no worker seen for {}",
                    humantime::format_duration(Duration::from_secs(ago))
                )
            }
            None => "no worker seen in the last hour".to_string(),
        };
        Some(format!(
            "nothing is granting: {since}; start one with `permitq worker` (if you started \
             one, it has exited, or it works on another database than {}: its log says why, \
             unless it was killed, and its `worker started` line names its database; requests \
             wait until a worker runs)",
            self.database
        ))
    }
}
