//! Fencing tokens, end to end: the case Martin Kleppmann describes in "How to do distributed
//! locking".
//!
//! ```sh
//! cargo run --example fencing            # a throwaway PostgreSQL when DATABASE_URL is unset
//! ```
//!
//! 1. Holder A (a separate process) acquires the permit with a 1s TTL and gets fencing token N.
//! 2. A is paused (SIGSTOP: think of a long GC pause or a frozen VM) past its TTL. Its heartbeats
//!    stop, the worker's sweep releases the lease as `expired`.
//! 3. Holder B acquires the permit with token N+k and writes to the storage service.
//! 4. A resumes (SIGCONT) and, unaware, sends its write with token N. The storage service, which
//!    remembers the highest token it has seen, rejects it.
//!
//! The storage service here is a tiny TCP server outside PostgreSQL; any store that can compare
//! a token with the highest it has seen (a conditional write, a version column, an object-store
//! precondition) works the same way. Exits 0 when A's write is rejected and B's accepted.

use std::process::Stdio;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use permitq::{Client, Request};

/// Any error, boxed.
type AnyError = Box<dyn std::error::Error + Send + Sync>;
use permitq_test_support::{database, WorkerFleet};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

const RESOURCE: &str = "fencing-demo-file";

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Errors as their message says them, once (not Rust's debug dump).
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fencing: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> Result<(), AnyError> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("holder") {
        return holder(&args[2], &args[3]).await;
    }
    let url = std::env::var("DATABASE_URL").ok().filter(|u| !u.is_empty());
    let (embedded, url) = database(url.as_deref()).await?;
    let client = Client::connect(&url).await?;
    client.migrate().await?;
    client.set_capacity(RESOURCE, 1, None).await?;
    let workers = WorkerFleet::start(&url, 1, "fencing")?;
    let store = start_store().await?;

    // 1. Holder A, in its own process.
    let mut a = tokio::process::Command::new(std::env::current_exe()?)
        .args(["holder", &url, &store.to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut a_out = BufReader::new(a.stdout.take().expect("piped")).lines();
    let first = a_out.next_line().await?.unwrap_or_default();
    println!("A: {first}");
    let a_token: i64 = first
        .rsplit(' ')
        .next()
        .and_then(|t| t.parse().ok())
        .unwrap_or(-1);

    // 2. Pause A past its TTL.
    let pid = a.id().expect("running").to_string();
    signal("-STOP", &pid).await?;
    println!("A is paused (SIGSTOP); its 1s lease will expire");

    // 3. B waits for the permit, gets a higher token and writes.
    let b = client
        .acquire(
            &Request::new(format!("holder-b-{}", std::process::id()))
                .permit(RESOURCE, 1)
                .ttl(Duration::from_secs(30)),
            Duration::from_secs(30),
        )
        .await?;
    let a_state = client
        .status(&format!("holder-a-{pid}"))
        .await?
        .and_then(|r| r.outcome())
        .unwrap_or_else(|| "waiting".to_string());
    println!("A's request is now {a_state}");
    println!("B: acquired with fencing token {}", b.fencing_token());
    let b_reply = write(&store, b.fencing_token(), "written by B").await?;
    println!("B: write -> {b_reply}");

    // 4. A wakes up and writes with its stale token.
    signal("-CONT", &pid).await?;
    let a_reply = a_out.next_line().await?.unwrap_or_default();
    println!("A (resumed): {a_reply}");
    let _ = a.wait().await?;
    b.release().await?;
    workers.stop().await;
    drop(client);
    drop(embedded);

    let safe = b_reply == "OK" && a_reply.contains("REJECTED") && a_token > 0;
    println!(
        "{}",
        if safe {
            "fencing held: the stale holder's write was rejected"
        } else {
            "UNSAFE: the stale write was accepted"
        }
    );
    std::process::exit(if safe { 0 } else { 1 });
}

/// Holder A: acquire, report the token, "work" briefly (it is paused here), then write.
async fn holder(url: &str, store: &str) -> Result<(), AnyError> {
    let client = Client::connect(url).await?;
    let request = Request::new(format!("holder-a-{}", std::process::id()))
        .permit(RESOURCE, 1)
        .ttl(Duration::from_secs(1));
    let lease = client.acquire(&request, Duration::from_secs(30)).await?;
    println!("acquired with fencing token {}", lease.fencing_token());
    // The pause hits here, after any "is my lease still valid?" check A might have made.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let reply = write(store, lease.fencing_token(), "written by A").await?;
    println!("write -> {reply}");
    Ok(())
}

/// The storage service: accepts `WRITE <token> <data>` only if token >= the highest seen.
async fn start_store() -> Result<String, AnyError> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let highest = Arc::new(AtomicI64::new(i64::MIN));
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let highest = highest.clone();
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut lines = BufReader::new(read).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let token: i64 = line
                        .split(' ')
                        .nth(1)
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(i64::MIN);
                    // Atomically: accept and remember if token >= highest, else reject.
                    let previous = highest.fetch_max(token, Ordering::SeqCst);
                    let reply = if token >= previous {
                        "OK".to_string()
                    } else {
                        format!("REJECTED stale token {token} < {previous}")
                    };
                    let _ = write.write_all(format!("{reply}\n").as_bytes()).await;
                }
            });
        }
    });
    Ok(addr)
}

async fn write(store: &str, token: i64, data: &str) -> Result<String, AnyError> {
    let mut socket = TcpStream::connect(store).await?;
    socket
        .write_all(format!("WRITE {token} {data}\n").as_bytes())
        .await?;
    let mut lines = BufReader::new(socket).lines();
    Ok(lines.next_line().await?.unwrap_or_default())
}

async fn signal(sig: &str, pid: &str) -> Result<(), AnyError> {
    tokio::process::Command::new("kill")
        .args([sig, pid])
        .status()
        .await?;
    Ok(())
}
