//! A producer: submits a request, waits for the grant, does its work, releases.
//!
//! ```sh
//! permitq semaphore set example 1            # the semaphore it asks for by default
//! DATABASE_URL=postgres://... cargo run --example producer
//! DATABASE_URL=postgres://... cargo run --example producer -- job-1 db=2 gpu=1
//! ```
//! Run `permitq worker` (or `cargo run --example worker`) beside it. Without an id it makes one
//! that is unique per run. Exits 0 when the request was granted and released, else 1 with one
//! line on stderr.

use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use permitq::{Client, ErrorCode, Request, State};

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("producer: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), String> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL".to_string())?;
    let mut args = std::env::args().skip(1);
    let external_id = args.next().unwrap_or_else(|| {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        format!("example-{nanos}")
    });
    let mut request = Request::new(&external_id).ttl(Duration::from_secs(30));
    for arg in args {
        let (name, count) = arg
            .split_once('=')
            .ok_or_else(|| format!("expected NAME=COUNT, got {arg:?}"))?;
        let count = count
            .parse()
            .map_err(|_| format!("count of {name:?} must be a positive integer, got {count:?}"))?;
        request = request.permit(name, count);
    }
    if request.permits.is_empty() {
        request = request.permit("example", 1);
    }

    let client = Client::connect(&url).await.map_err(|e| e.to_string())?;
    client.submit(&request).await.map_err(|e| e.to_string())?;
    println!("submitted {external_id}; waiting up to 30s");
    let settled = client
        .wait_settled(&external_id, Duration::from_secs(30))
        .await
        .map_err(|e| e.to_string())?;
    match settled {
        Some(r) if r.state == State::Acquired => {
            println!(
                "acquired with fencing token {}; working for 1s",
                r.fencing_token.unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
            let outcome = client
                .release(&external_id)
                .await
                .map_err(|e| e.to_string())?;
            println!("release: {outcome}");
            Ok(())
        }
        Some(r) if r.state == State::New => {
            let outcome = client
                .release(&external_id)
                .await
                .map_err(|e| e.to_string())?;
            Err(format!(
                "{external_id} was not granted in 30s (is a worker running?); {outcome}"
            ))
        }
        Some(r) if r.error_code == Some(ErrorCode::UnknownSemaphore) => Err(format!(
            "{external_id} failed: unknown_semaphore; create the semaphores first, e.g. \
             `permitq semaphore set {} 1`",
            request.permits.keys().next().map_or("NAME", String::as_str)
        )),
        Some(r) => Err(format!(
            "{external_id} ended {}{}",
            r.state,
            r.error_code.map(|c| format!(": {c}")).unwrap_or_default()
        )),
        None => Err(format!("{external_id} is unknown")),
    }
}
