//! A rolling upgrade under load (`permitq chaos --previous BINARY`): the run starts on the
//! previous build's schema with its workers; a quarter into the load this build migrates the
//! database (`permitq migrate`, as users run it), then, over the middle half, each worker is
//! stopped with SIGTERM and this build's started in its place, one at a time. Old and new
//! workers grant side by side on the new schema; the checkers judge the whole history.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::process::Command;

use super::nemesis::{Fault, Injected, Outage, Workers};
use crate::error::{CliError, Result};

/// `binary migrate` on `url`, as a user runs it; its stderr in the error when it fails.
pub(crate) async fn migrate_with(binary: &Path, url: &str) -> Result<()> {
    let out = Command::new(binary)
        .arg("migrate")
        .env("DATABASE_URL", url)
        .stdin(Stdio::null())
        .output()
        .await?;
    if out.status.success() {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "{} migrate failed ({}): {}",
            binary.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// The upgrade's steps over a load of `duration`: this build's migrate at a quarter, then the
/// workers replaced by `binary` one at a time across the middle half. Each step is an outage
/// in the timeline (the liveness bounds allow for it); a previous worker that had exited before
/// its SIGTERM, or exited with a failure, is a failed step.
pub(crate) async fn roll(
    binary: PathBuf,
    url: String,
    workers: Arc<Workers>,
    count: usize,
    duration: Duration,
) -> Injected {
    let mut injected = Injected::default();
    let mut step = |fault: Fault, from: SystemTime, result: Result<()>| {
        match result {
            Ok(()) => *injected.counts.entry(fault).or_insert(0) += 1,
            Err(e) => injected.failed.push((fault, e.to_string())),
        }
        injected.faults.push(Outage {
            kind: fault,
            from,
            to: SystemTime::now(),
        });
    };
    tokio::time::sleep(duration / 4).await;
    let from = SystemTime::now();
    step(Fault::Migrate, from, migrate_with(&binary, &url).await);
    let gap = duration / 2 / u32::try_from(count.max(1)).unwrap_or(1);
    for i in 0..count {
        tokio::time::sleep(gap).await;
        let from = SystemTime::now();
        let result = workers.replace(i, &binary).await.and_then(|status| {
            if status.success() {
                Ok(())
            } else {
                Err(CliError::runtime(format!(
                    "the previous build's worker {i} exited with {status} (before or at its \
                     SIGTERM)"
                )))
            }
        });
        step(Fault::UpgradeWorker, from, result);
    }
    injected
}
