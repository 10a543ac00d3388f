//! Where demo, bench and chaos runs happen: a named database or a throwaway cluster, and a
//! fleet of in-process workers.

use tokio::sync::watch;

use permitq::{Worker, WorkerConfig};

use crate::Result;
use permitq_embedded_pg::EmbeddedPostgres;
use std::io::Write as _;

/// Starts a throwaway cluster when `url` is None; returns it (to keep alive) and the URL to use.
pub async fn database(url: Option<&str>) -> Result<(Option<EmbeddedPostgres>, String)> {
    match url {
        Some(url) => Ok((None, url.to_string())),
        None => {
            let _ = writeln!(
                std::io::stderr(),
                "no database named: starting a throwaway PostgreSQL..."
            );
            let pg = tokio::task::spawn_blocking(EmbeddedPostgres::start)
                .await
                .map_err(|e| crate::error(format!("start-up task failed: {e}")))??;
            let url = pg.url("postgres");
            let _ = writeln!(
                std::io::stderr(),
                "PostgreSQL is up on 127.0.0.1:{} (removed at the end)",
                pg.port()
            );
            Ok((Some(pg), url))
        }
    }
}

/// In-process workers started by [`WorkerFleet::start`].
#[derive(Debug)]
pub struct WorkerFleet {
    tasks: Vec<tokio::task::JoinHandle<permitq::Result<()>>>,
    stop: watch::Sender<bool>,
}

impl WorkerFleet {
    /// Starts `n` workers named `{prefix}-worker-{i}`.
    pub fn start(url: &str, n: u16, prefix: &str) -> Result<WorkerFleet> {
        Self::start_with(url, n, prefix, WorkerConfig::default())
    }

    /// Starts `n` workers named `{prefix}-worker-{i}`, each with `config` (its id replaced).
    pub fn start_with(
        url: &str,
        n: u16,
        prefix: &str,
        config: WorkerConfig,
    ) -> Result<WorkerFleet> {
        let (stop, stop_rx) = watch::channel(false);
        let mut tasks = Vec::new();
        for i in 0..n {
            let mut config = config.clone();
            config.id = format!("{prefix}-worker-{i}");
            let worker = Worker::connect(url, config)?;
            let mut stop = stop_rx.clone();
            tasks.push(tokio::spawn(worker.run(async move {
                let _ = stop.wait_for(|s| *s).await;
            })));
        }
        Ok(WorkerFleet { tasks, stop })
    }

    /// Stops them after their transactions in flight and waits for them.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}
