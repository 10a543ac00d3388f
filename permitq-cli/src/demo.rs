//! `permitq demo`: the whole system on an embedded default.
//!
//! With no database URL it starts a throwaway PostgreSQL (see [`permitq_embedded_pg::EmbeddedPostgres`]) and removes
//! it afterwards, or leaves it running with `--keep`. It migrates, creates three semaphores, runs several in-process workers plus
//! simulated producers and holders (some of which "crash" and leave their lease to expire),
//! shows a live view, and ends with a summary checked against the database.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;

use crate::error::{CliError, Result};
use permitq::Client;
use permitq::{Request, State};
use permitq_embedded_pg::EmbeddedPostgres;
use permitq_fleet::WorkerFleet;
use permitq_fleet::{self as report, RunReport};

/// `permitq demo` options.
#[derive(Debug, Clone, Args)]
pub(crate) struct DemoArgs {
    /// How long producers run.
    #[arg(long, default_value = "20s", value_parser = humantime::parse_duration)]
    pub duration: Duration,
    /// In-process workers.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=32))]
    pub workers: u16,
    /// Concurrent simulated producers/holders.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub producers: u16,
    /// With an explicit --database-url that already holds permitq data: run there anyway
    /// (only what this run creates is removed at the end).
    #[arg(long)]
    pub yes: bool,
    /// Leave the throwaway PostgreSQL running afterwards, emptied of the demo's data (the
    /// tutorial's `permitq migrate` starts on it), and print its DATABASE_URL and the command
    /// that stops and removes it. With `--duration 1s` it is quick.
    #[arg(long, conflicts_with = "database_url")]
    pub keep: bool,
}

/// The demo's semaphores: (name, capacity, fair).
const SEMAPHORES: &[(&str, i32, bool)] = &[
    ("demo-db-connections", 16, true),
    ("demo-gpu", 4, true),
    ("demo-api-quota", 40, false),
];

/// Runs the demo.
pub(crate) async fn run(named: Option<&str>, args: DemoArgs) -> Result<()> {
    let mut scratch =
        crate::scratch::open(named, args.yes, args.keep, "demo", EmbeddedPostgres::start).await?;
    let result = demo(&scratch.url, &args).await;
    scratch.clean_up().await?;
    if args.keep {
        // The demo's semaphores and its holders' leases would linger in the user's first steps
        // (a `gpu` of theirs beside `demo-gpu` reads as a typo): the kept database starts empty.
        scratch.empty().await?;
        if let Some(stop) = scratch.keep() {
            println!(
                "\nPostgreSQL keeps running (--keep), emptied of the demo's data: `permitq \
                 migrate` starts on it. For trying permitq, not for data you keep: fsync is \
                 off, and it lets any login in without checking its password (trust). \
                 Use it with:\n  export DATABASE_URL={}\nStop and remove it when done:\n  {stop}",
                scratch.url
            );
            if let Some(start) = scratch.start_command() {
                println!(
                    "(Stopped with its pg_ctl alone, it starts again on its port with:\n  {start})"
                );
            }
        }
    }
    result
}

async fn demo(url: &str, args: &DemoArgs) -> Result<()> {
    let url = url.to_string();
    let client = Client::connect(&url).await?;
    client.migrate().await?;
    for (name, capacity, fair) in SEMAPHORES {
        client.set_capacity(name, *capacity, Some(*fair)).await?;
    }
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let prefix = format!("demo-{run_id}-");
    let workers = WorkerFleet::start(&url, args.workers, "demo")?;

    let started = Instant::now();
    let deadline = started + args.duration;
    let counter = Arc::new(AtomicU64::new(0));
    let producers: Vec<_> = (0..args.producers)
        .map(|_| {
            tokio::spawn(producer(
                client.clone(),
                prefix.clone(),
                counter.clone(),
                deadline,
            ))
        })
        .collect();

    let reader = permitq_embedded_pg::try_connect(&url).await?;
    let peaks = live_view(&client, &reader, &prefix, deadline, started).await?;
    for p in producers {
        let _ = p.await;
    }
    // Let the last holders' leases and releases settle before the summary.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let report = report::collect(&reader, &prefix).await?;
    workers.stop().await;
    print_summary(&report, &peaks, started.elapsed());
    drop((client, reader)); // the connections first, then the server
    if report.over_capacity.is_empty() {
        Ok(())
    } else {
        Err(CliError::runtime(format!(
            "capacity exceeded: {:?}",
            report.over_capacity
        )))
    }
}

/// One simulated producer and holder: submits, waits, holds, releases; sometimes it fails fast,
/// gives up, or "crashes" (never releases: its 2s lease expires).
async fn producer(client: Client, prefix: String, counter: Arc<AtomicU64>, deadline: Instant) {
    let names: Vec<&str> = SEMAPHORES.iter().map(|s| s.0).collect();
    while Instant::now() < deadline {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        let mut request = Request::new(format!("{prefix}{n}")).ttl(Duration::from_secs(2));
        for name in fastrand::choose_multiple(names.iter(), fastrand::usize(1..=2)) {
            let count = if fastrand::u8(..20) == 0 { 3 } else { 1 };
            request = request.permit(*name, count);
        }
        request.wait = match fastrand::u8(..10) {
            0 => Some(Duration::ZERO),
            1..=3 => Some(Duration::from_secs(3)),
            _ => None,
        };
        if client.submit(&request).await.is_err() {
            continue;
        }
        let settled = client
            .wait_settled(&request.external_id, Duration::from_secs(5))
            .await;
        match settled {
            Ok(Some(r)) if r.state == State::Acquired => {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(20..400))).await;
                if fastrand::u8(..50) != 0 {
                    let _ = client.release(&request.external_id).await;
                } // else: this holder "crashed"; its lease expires.
            }
            Ok(Some(r)) if r.state == State::New => {
                let _ = client.release(&request.external_id).await; // gave up waiting
            }
            _ => {}
        }
    }
}

/// Refreshes a view every second until `deadline`; returns the peak `used` seen per semaphore.
async fn live_view(
    client: &Client,
    reader: &tokio_postgres::Client,
    prefix: &str,
    deadline: Instant,
    started: Instant,
) -> Result<BTreeMap<String, (i64, i64)>> {
    let tty = std::io::stdout().is_terminal();
    let mut peaks: BTreeMap<String, (i64, i64)> = BTreeMap::new();
    let mut last_grants = 0i64;
    let mut last_tick = Instant::now();
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let sems = client.semaphores().await?;
        for s in &sems {
            let peak = peaks.entry(s.name.clone()).or_insert((0, s.capacity));
            peak.0 = peak.0.max(s.used);
        }
        if last_tick.elapsed() < Duration::from_secs(1) && Instant::now() < deadline {
            continue;
        }
        let (depth, grants) = report::queue_and_grants(reader, prefix).await?;
        let rate = (grants - last_grants) as f64 / last_tick.elapsed().as_secs_f64();
        last_grants = grants;
        last_tick = Instant::now();
        let mut view = String::new();
        if tty {
            view.push_str("\x1b[H\x1b[2J");
        }
        view.push_str(&format!(
            "permitq demo  t={:>4.1}s  queue depth {depth:>4}  grants {grants:>6}  {rate:>6.0} grants/s\n",
            started.elapsed().as_secs_f64()
        ));
        for s in sems.iter().filter(|s| s.name.starts_with("demo-")) {
            let width = 30usize;
            let filled =
                usize::try_from((s.used.max(0) * 30 + s.capacity.max(1) / 2) / s.capacity.max(1))
                    .unwrap_or(width);
            view.push_str(&format!(
                "  {:<22} [{}{}] {:>3}/{:<3} {}\n",
                s.name,
                "#".repeat(filled.min(width)),
                " ".repeat(width - filled.min(width)),
                s.used,
                s.capacity,
                if s.fair { "fair" } else { "greedy" }
            ));
        }
        out!("{view}");
    }
    Ok(peaks)
}

fn print_summary(r: &RunReport, peaks: &BTreeMap<String, (i64, i64)>, elapsed: Duration) {
    outln!(
        "\n=== permitq demo summary ({:.1}s) ===",
        elapsed.as_secs_f64()
    );
    let list = |m: &BTreeMap<String, i64>| {
        if m.is_empty() {
            "none".to_string()
        } else {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let released: i64 = r.released_by_reason.values().sum();
    outln!("requests submitted   {}", r.submitted);
    outln!(
        "granted              {} ({} released since, {} still held when the demo stopped)",
        r.granted,
        released,
        r.granted - released
    );
    outln!("released by reason   {}", list(&r.released_by_reason));
    if r.released_by_reason.contains_key("expired") {
        // A holder that "crashed": its semaphore stays as full as it left it for up to 2s.
        outln!(
            "                     (on purpose: expired: 1 holder in 50 \"crashes\" without releasing; \
             its permits stay held until its 2s lease ends, so a full semaphore may grant \
             nothing for up to 2s)"
        );
    }
    outln!("errors by code       {}", list(&r.errors_by_code));
    // Errors here are the simulated producers' choices, not faults: say why each one happened.
    let why: Vec<&str> = r
        .errors_by_code
        .keys()
        .filter_map(|code| match code.as_str() {
            "no_capacity" => Some("no_capacity: 1 in 10 asks with wait 0 and finds no room"),
            "timeout" => Some("timeout: 3 in 10 wait at most 3s"),
            "cancelled" => Some("cancelled: one that gives up waiting after 5s cancels"),
            _ => None,
        })
        .collect();
    if !why.is_empty() {
        outln!("                     (on purpose: {})", why.join("; "));
    }
    outln!(
        "submit->acquired     p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms (includes waiting for \
         capacity: the semaphores are kept full on purpose)",
        r.latency_ms.p50,
        r.latency_ms.p99,
        r.latency_ms.max
    );
    let demo_peaks: Vec<_> = peaks
        .iter()
        .filter(|(n, _)| n.starts_with("demo-"))
        .collect();
    if demo_peaks.is_empty() {
        outln!("peak use vs capacity: none sampled (the run was shorter than a sample)");
    } else {
        outln!("peak use vs capacity (sampled / exact from permit intervals):");
    }
    for (name, (peak, capacity)) in demo_peaks {
        let exact = r.peak_concurrent.get(name).copied().unwrap_or(0);
        outln!("  {name:<22} {peak:>3} / {exact:>3} of {capacity}");
    }
    if r.over_capacity.is_empty() {
        outln!("safety: capacity was never exceeded");
    } else {
        outln!("SAFETY VIOLATION: {:?}", r.over_capacity);
    }
}
