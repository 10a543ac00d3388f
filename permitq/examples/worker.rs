//! A worker embedded in your own binary, with an owner-liveness hook.
//!
//! ```sh
//! DATABASE_URL=postgres://... cargo run --example worker
//! ```
//! Ctrl-C stops it after the transaction in flight.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use permitq::{OwnerLiveness, Worker, WorkerConfig};

/// Treats owners named `pid:<n>` as processes on this machine: dead when /proc/<n> is gone.
struct LocalProcesses;

impl OwnerLiveness for LocalProcesses {
    fn dead_owners<'a>(&'a self, owners: &'a [String]) -> BoxFuture<'a, Vec<String>> {
        Box::pin(async move {
            owners
                .iter()
                .filter(|o| {
                    o.strip_prefix("pid:")
                        .is_some_and(|pid| !std::path::Path::new("/proc").join(pid).exists())
                })
                .cloned()
                .collect()
        })
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Errors as their message says them (not Rust's debug dump).
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("worker: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> permitq::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter("permitq=info")
        // Colours only on a terminal: a log file gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("DATABASE_URL").expect("set DATABASE_URL");
    let mut config = WorkerConfig::default();
    config.id = "example-worker".into();
    config.maintenance.max_hold = Some(Duration::from_secs(3600));
    Worker::connect(&url, config)?
        .with_owner_liveness(Arc::new(LocalProcesses))
        .run(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
}
