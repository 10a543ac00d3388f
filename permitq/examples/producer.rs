//! A producer: submits a request, waits for the grant, does its work, releases.
//!
//! ```sh
//! DATABASE_URL=postgres://... cargo run --example producer -- job-1 db=2 gpu=1
//! ```
//! Run `permitq worker` (or `cargo run --example worker`) beside it.

use std::time::Duration;

use permitq::{Client, Request, State};

#[tokio::main]
async fn main() -> permitq::Result<()> {
    let url = std::env::var("DATABASE_URL").expect("set DATABASE_URL");
    let mut args = std::env::args().skip(1);
    let external_id = args
        .next()
        .unwrap_or_else(|| format!("example-{}", std::process::id()));
    let mut request = Request::new(&external_id).ttl(Duration::from_secs(30));
    for arg in args {
        let (name, count) = arg.split_once('=').expect("NAME=COUNT");
        request = request.permit(name, count.parse().expect("a count"));
    }
    if request.permits.is_empty() {
        request = request.permit("example", 1);
    }

    let client = Client::connect(&url).await?;
    client.submit(&request).await?;
    println!("submitted {external_id}; waiting up to 30s");
    match client
        .wait_settled(&external_id, Duration::from_secs(30))
        .await?
    {
        Some(r) if r.state == State::Acquired => {
            println!(
                "acquired with fencing token {:?}; working for 1s",
                r.fencing_token
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
            println!("release: {}", client.release(&external_id).await?);
        }
        Some(r) if r.state == State::New => {
            println!(
                "not granted in 30s; cancelling: {}",
                client.release(&external_id).await?
            );
        }
        other => println!("not granted: {other:?}"),
    }
    Ok(())
}
