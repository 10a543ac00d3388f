//! `permitq bench`: latency on an idle system and throughput under load.
//!
//! *Idle latency*: one request at a time against `--workers` in-process workers on a semaphore
//! with room; for each, submit → acquired as the database recorded it (`acquired_at -
//! created_at`) and as the producer saw it (submit call to the `permitq_events` notification).
//! *Throughput*: `--concurrency` producers submit, hold briefly and release for `--duration`.
//! *Retention impact*: grant latency under the same load while the workers' retention deletes
//! `--old-rows` settled rows, against the same load without it, in the same run.

use std::time::{Duration, Instant};

use clap::Args;

use crate::error::{CliError, Result};
use permitq::Client;
use permitq::{Request, State};
use permitq_test_support::{self as report, Percentiles};
use permitq_test_support::{database, WorkerFleet};

/// `permitq bench` options.
#[derive(Debug, Clone, Args)]
pub(crate) struct BenchArgs {
    /// Sequential requests for the idle-latency measurement.
    #[arg(long, default_value_t = 500)]
    pub requests: u32,
    /// In-process workers.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u16).range(1..=32))]
    pub workers: u16,
    /// Concurrent producers for the throughput and retention phases.
    #[arg(long, default_value_t = 16)]
    pub concurrency: u32,
    /// Length of each load phase.
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// Settled rows to delete in the retention phase (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    pub old_rows: i64,
}

/// Runs the benchmark and prints the results.
pub(crate) async fn run(url: Option<&str>, args: BenchArgs) -> Result<()> {
    let (embedded, url) = database(url).await?;
    let client = Client::connect(&url).await?;
    client.migrate().await?;
    client
        .set_capacity("bench-idle", 1_000_000, Some(true))
        .await?;
    client.set_capacity("bench-load", 64, Some(true)).await?;
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let workers = WorkerFleet::start(&url, args.workers, "bench")?;

    // Warm up connections and the listener.
    for i in 0..20 {
        submit_acquire_release(&client, &format!("bench-{run}-warm-{i}"), "bench-idle").await?;
    }
    let prefix = format!("bench-{run}-idle-");
    let mut observed = Vec::with_capacity(args.requests as usize);
    for i in 0..args.requests {
        observed
            .push(submit_acquire_release(&client, &format!("{prefix}{i}"), "bench-idle").await?);
    }
    let db = report::collect(&client, &prefix).await?.latency_ms;
    println!(
        "idle submit->acquired, {} requests, {} workers",
        args.requests, args.workers
    );
    println!("  database (acquired_at - created_at): {}", fmt(db));
    println!(
        "  producer (submit call -> event):     {}",
        fmt(Percentiles::of(&mut observed))
    );

    let load = load_phase(&client, &format!("bench-{run}-load-"), &args, false).await?;
    println!(
        "load: {} producers, {:?}: {} grants, {:.0} grants/s, submit->acquired {}",
        args.concurrency,
        args.duration,
        load.0,
        load.1,
        fmt(load.2)
    );

    if args.old_rows > 0 {
        seed_settled_rows(&client, args.old_rows).await?;
        // The workers' own retention task deletes them (1,000 rows per transaction) while the
        // same load runs; the phase lasts until they are all gone.
        let cleanup_started = Instant::now();
        let during = load_phase(&client, &format!("bench-{run}-cleanup-"), &args, true).await?;
        println!(
            "retention: {} old settled rows deleted in {:.1}s while the load ran: submit->acquired p50 {:.2} ms, p99 {:.2} ms (without cleanup: p50 {:.2} ms, p99 {:.2} ms; p99 ratio {:.2}), {:.0} grants/s vs {:.0}",
            args.old_rows,
            cleanup_started.elapsed().as_secs_f64(),
            during.2.p50,
            during.2.p99,
            load.2.p50,
            load.2.p99,
            during.2.p99 / load.2.p99.max(0.001),
            during.1,
            load.1
        );
    }
    workers.stop().await;
    drop(client);
    drop(embedded);
    Ok(())
}

fn fmt(p: Percentiles) -> String {
    format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        p.p50, p.p99, p.max
    )
}

/// Submits, waits for the grant, releases. Returns the producer-observed latency in ms.
async fn submit_acquire_release(client: &Client, id: &str, semaphore: &str) -> Result<f64> {
    let started = Instant::now();
    client
        .submit(&Request::new(id).permit(semaphore, 1))
        .await?;
    let r = client.wait_settled(id, Duration::from_secs(10)).await?;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    if r.map(|r| r.state) != Some(State::Acquired) {
        return Err(crate::error::CliError::runtime(format!(
            "bench request {id} was not granted in 10s"
        )));
    }
    client.release(id).await?;
    Ok(ms)
}

/// Whether retention has deleted every seeded old row.
async fn old_rows_gone(client: &Client) -> Result<bool> {
    let conn = client.pool().get().await?;
    let row = conn
        .query_one("SELECT NOT EXISTS (SELECT 1 FROM permitq.permit_request WHERE external_id LIKE 'bench-old-%')", &[])
        .await?;
    Ok(row.get(0))
}

/// Producers submit on a contended semaphore, hold ~1ms and release, for `args.duration` (or,
/// with `until_old_rows_gone`, until retention has deleted the seeded rows). Returns (grants,
/// grants/s, latency).
async fn load_phase(
    client: &Client,
    prefix: &str,
    args: &BenchArgs,
    until_old_rows_gone: bool,
) -> Result<(i64, f64, Percentiles)> {
    let started = Instant::now();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let tasks: Vec<_> = (0..args.concurrency)
        .map(|p| {
            let (client, prefix, stop) = (client.clone(), prefix.to_string(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let id = format!("{prefix}{p}-{i}");
                    i += 1;
                    client
                        .submit(&Request::new(&id).permit(
                            "bench-load",
                            1 + i64::from(u8::try_from(i % 4).unwrap_or(0)),
                        ))
                        .await?;
                    let r = client.wait_settled(&id, Duration::from_secs(10)).await?;
                    if r.map(|r| r.state) == Some(State::Acquired) {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    client.release(&id).await?;
                }
                Ok::<_, CliError>(())
            })
        })
        .collect();
    if until_old_rows_gone {
        while !old_rows_gone(client).await? {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    } else {
        tokio::time::sleep(args.duration).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in tasks {
        t.await.expect("producer task")?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let report = report::collect(client, prefix).await?;
    Ok((
        report.granted,
        report.granted as f64 / elapsed,
        report.latency_ms,
    ))
}

/// Inserts `n` requests that settled a year ago (past any retention). Triggers are off for
/// the insert (session_replication_role = replica, a superuser setting) so that seeding does not
/// send 100,000 notifications; without the privilege it falls back to insert-then-update.
async fn seed_settled_rows(client: &Client, n: i64) -> Result<()> {
    let conn = client.pool().get().await?;
    let direct = format!(
        "SET session_replication_role = replica;
         INSERT INTO permitq.permit_request (external_id, permits, state, error_code, created_at, settled_at)
         SELECT 'bench-old-' || i, '{{\"bench-load\": 1}}', 'error', 'cancelled',
                now() - interval '1 year', now() - interval '1 year'
         FROM generate_series(1, {n}) i;
         RESET session_replication_role;"
    );
    if conn.batch_execute(&direct).await.is_ok() {
        return Ok(());
    }
    conn.batch_execute(&format!(
        "INSERT INTO permitq.permit_request (external_id, permits)
         SELECT 'bench-old-' || i, '{{\"bench-load\": 1}}' FROM generate_series(1, {n}) i;
         UPDATE permitq.permit_request SET state = 'error', error_code = 'cancelled',
             settled_at = now() - interval '1 year'
         WHERE external_id LIKE 'bench-old-%' AND state = 'new';"
    ))
    .await?;
    Ok(())
}
