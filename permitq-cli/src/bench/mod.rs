//! `permitq bench`: permitq's workloads and the baselines they are judged against, in one run on
//! one cluster, with ratios.
//!
//! The throwaway cluster runs with `fsync=on` and `synchronous_commit=on` (fsync off hides
//! exactly the commit costs that matter); `--fsync off` may compare. Producers use the public
//! API ([`permitq::Client`]); baselines are plain SQL on their own tables in the same database:
//! the naive per-request transaction of seed 000, the conditional counter of seed 001, one
//! durable single-row INSERT per statement, and a plain `FOR UPDATE SKIP LOCKED` batched drain.

mod adaptive;
mod baselines;
mod clients;
mod deep;
mod fairness;
mod features;
mod grant_path;
mod hostile;
mod load;
mod nesting;
mod targets;

use std::fmt::Write as _;
use std::time::Duration;

use clap::Args;
use permitq::Client;
use permitq_embedded_pg::EmbeddedPostgres;
use permitq_fleet::{Percentiles, WorkerFleet};

use crate::error::Result;

/// `permitq bench` options.
#[derive(Debug, Clone, Args)]
pub(crate) struct BenchArgs {
    /// Length of each throughput run.
    #[arg(long, default_value = "3s", value_parser = humantime::parse_duration)]
    pub(crate) duration: Duration,
    /// Sequential requests for the idle-latency measurements.
    #[arg(long, default_value_t = 300)]
    pub(crate) requests: u32,
    /// Requests queued for the drain runs.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) drain_rows: i64,
    /// Requests waiting on full semaphores in the deep-queue run (0 skips it).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) deep_rows: i64,
    /// `fsync` of the throwaway cluster.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub(crate) fsync: String,
    /// Load pg_stat_statements and print the statements that took the most time.
    #[arg(long)]
    pub(crate) profile: bool,
    /// With an explicit --database-url that already holds permitq data: run there anyway
    /// (only what this run creates is removed at the end).
    #[arg(long)]
    pub(crate) yes: bool,
    /// Each drain of the flat-cost targets this many times (the median counts).
    #[arg(long, default_value_t = 1)]
    pub(crate) repeat: u32,
    /// Only these parts (comma-separated: grant-path, clients, targets (or some of them: hot, priorities,
    /// depth, rate, templates), hot-cycle, idle, cycle, release, drain, features, nesting, deep,
    /// hostile, fairness, adaptive); all by default.
    #[arg(long, value_delimiter = ',')]
    pub(crate) only: Vec<String>,
}

impl BenchArgs {
    fn runs(&self, part: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == part)
    }
}

/// The report, built as the parts run and printed at the end (and as it goes, to stderr).
#[derive(Debug, Default)]
struct Report {
    text: String,
}

impl Report {
    fn line(&mut self, line: impl AsRef<str>) {
        errln!("{}", line.as_ref());
        let _ = writeln!(self.text, "{}", line.as_ref());
    }
}

/// Runs the benchmark and prints the results.
pub(crate) async fn run(named: Option<&str>, args: BenchArgs) -> Result<()> {
    let fsync = if args.fsync == "off" { "off" } else { "on" };
    let profile = args.profile;
    errln!("bench: fsync={fsync}");
    let scratch = crate::scratch::open(named, args.yes, false, "bench", move || {
        // pg_stat_statements always: the grant path's statements per cycle are read from it.
        let mut settings = vec![
            ("fsync", fsync),
            ("shared_preload_libraries", "pg_stat_statements"),
        ];
        if profile {
            settings.push(("pg_stat_statements.track", "all"));
        }
        EmbeddedPostgres::start_with(&settings)
    })
    .await?;
    let result = measure(&scratch.url, &args, named.is_none()).await;
    scratch.clean_up().await?;
    result
}

/// `own_cluster`: the bench started the server (and may add extensions to it).
async fn measure(url: &str, args: &BenchArgs, own_cluster: bool) -> Result<()> {
    let url = url.to_string();
    let client = Client::connect(&url).await?;
    client.migrate().await?;
    let conn = permitq_embedded_pg::try_connect(&url).await?;
    baselines::create_tables(&conn).await?;
    // Loaded in the bench's own cluster; on a server named with --database-url only with
    // --profile (the statements per cycle read n/a there otherwise).
    if own_cluster || args.profile {
        conn.batch_execute(
            "CREATE EXTENSION IF NOT EXISTS pg_stat_statements; SELECT pg_stat_statements_reset();",
        )
        .await?;
    }
    let settings: Vec<String> = conn
        .query(
            "SELECT name || '=' || setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'server_version') ORDER BY name",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut report = Report::default();
    report.line(format!(
        "permitq bench: one cluster ({}), {} cores, {:?} per throughput run",
        settings.join(", "),
        std::thread::available_parallelism().map_or(0, usize::from),
        args.duration
    ));

    // For profiling only: not part of a full run.
    if args.only.iter().any(|p| p == "hot-cycle") {
        targets::hot(&url, args, &mut report).await?;
    }
    let mut summary = targets::Targets::default();
    if args.runs("grant-path") {
        grant_path::run(&url, args, &mut report, &mut summary).await?;
    }
    if args.runs("targets") || targets::PARTS.iter().any(|p| args.runs(p)) {
        targets::run(&url, args, own_cluster, &mut report, &mut summary).await?;
    }
    if args.runs("idle") {
        load::idle(&url, args, &mut report, &mut summary).await?;
    }
    if args.runs("clients") {
        clients::run(&url, args, &mut report, &mut summary).await?;
    }
    if args.runs("cycle") {
        load::hot_cycle(&url, args, &mut report, &mut summary).await?;
    }
    if args.runs("release") {
        load::release(&url, &mut report, &mut summary).await?;
    }
    // Before the drain: what the drain leaves behind (20,000 settled rows, dead tuples) would
    // weigh on whichever of its rows ran first.
    if args.runs("features") {
        features::run(&url, args, &mut report).await?;
    }
    if args.runs("nesting") {
        nesting::run(&url, args, &mut report).await?;
    }
    if args.runs("drain") {
        load::drain(&url, args, &mut report).await?;
    }
    if args.runs("deep") && args.deep_rows > 0 {
        deep::run(&url, args, &mut report, &mut summary).await?;
    }
    if args.runs("hostile") {
        hostile::run(&url, &mut report, &mut summary).await?;
    }
    if args.runs("fairness") {
        fairness::run(&url, args, &mut report).await?;
    }
    if args.runs("adaptive") {
        adaptive::run(&url, args, &mut report).await?;
    }
    if args.profile {
        profile(&conn, &mut report).await?;
    }
    summary.print(&mut report);
    outln!("{}", report.text);
    Ok(())
}

/// The statements that took the most time (pg_stat_statements, `track = all`: statements inside
/// functions too).
async fn profile(conn: &tokio_postgres::Client, report: &mut Report) -> Result<()> {
    report.line("\nprofile: top statements by total time (pg_stat_statements)");
    report.line("| total ms | calls | mean ms | rows | statement |\n|---:|---:|---:|---:|---|");
    for row in conn
        .query(
            "SELECT total_exec_time, calls, mean_exec_time, rows, regexp_replace(left(query, 110), '\\s+', ' ', 'g')
             FROM pg_stat_statements ORDER BY total_exec_time DESC LIMIT 20",
            &[],
        )
        .await?
    {
        let (total, calls, mean, rows, query): (f64, i64, f64, i64, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        report.line(format!(
            "| {total:.0} | {calls} | {mean:.3} | {rows} | `{}` |",
            query.replace('|', "\\|")
        ));
    }
    Ok(())
}

/// `p50 / p99` in ms.
fn ms(p: Percentiles) -> String {
    format!("{:.2} / {:.2}", p.p50, p.p99)
}

/// In-process workers named after the run.
fn fleet(url: &str, workers: u16, name: &str) -> Result<Option<WorkerFleet>> {
    if workers == 0 {
        return Ok(None);
    }
    Ok(Some(WorkerFleet::start(url, workers, name)?))
}

async fn stop(fleet: Option<WorkerFleet>) {
    if let Some(f) = fleet {
        f.stop().await;
    }
}

/// A short unique tag for the names of one run.
fn tag() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_string()
}
