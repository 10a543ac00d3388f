//! Deep queue: many requests waiting on full semaphores must not slow unrelated requests, nor
//! the hand-off on the full semaphore, nor grow the worker. One `permitq worker` *process*, so
//! its memory can be read from /proc.

use std::process::Stdio;
use std::time::{Duration, Instant};

use permitq::{Client, Request, State};
use permitq_fleet::Percentiles;

use super::load::{cycle, db_latency, hand_off};
use super::targets::Targets;
use super::{ms, tag, BenchArgs, Report};
use crate::error::{CliError, Result};

/// Runs the deep-queue measurements.
pub(super) async fn run(
    url: &str,
    args: &BenchArgs,
    report: &mut Report,
    targets: &mut Targets,
) -> Result<()> {
    let t = tag();
    let client = Client::connect(url).await?;
    let conn = permitq_embedded_pg::try_connect(url).await?;
    let idle = format!("deep-idle-{t}");
    client.set_capacity(&idle, 1_000_000, Some(true)).await?;
    let full = [format!("deep-full-a-{t}"), format!("deep-full-b-{t}")];
    for name in &full {
        client.set_capacity(name, 1, Some(true)).await?;
    }

    let mut worker = tokio::process::Command::new(std::env::current_exe()?)
        .args(["worker", "--id", "bench-deep"])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let pid = worker.id().unwrap_or(0);
    let result = measure(url, &client, &conn, args, &t, &idle, &full, pid).await;
    if let Some(pid) = worker.id() {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), worker.wait()).await;
    let m = result?;

    report.line(format!(
        "\n## Deep queue: {} requests waiting on 2 full semaphores, 1 worker process",
        args.deep_rows
    ));
    report
        .line("| measure | no backlog | with backlog | ratio | target |\n|---|---:|---:|---:|---|");
    for (what, before, after) in [
        ("p50", m.seen_before.p50, m.seen_after.p50),
        ("p99", m.seen_before.p99, m.seen_after.p99),
    ] {
        report.line(format!(
            "| as the producer sees it: submit call → `acquired` visible on another semaphore, {what} ms | {before:.2} | {after:.2} | {:.2}× | ≤ 1.3× |",
            after / before.max(1e-9)
        ));
    }
    report.line(format!(
        "| database side: `acquired_at - created_at` on another semaphore, p50 ms | {:.2} | {:.2} | {:.2}× | ≤ 1.5× |",
        m.before.p50,
        m.after.p50,
        m.after.p50 / m.before.p50.max(1e-9)
    ));
    report.line(format!(
        "| database side: `acquired_at - created_at` on another semaphore, p99 ms | {:.2} | {:.2} | {:.2}× | ≤ 2× |",
        m.before.p99,
        m.after.p99,
        m.after.p99 / m.before.p99.max(1e-9)
    ));
    report.line(format!(
        "| release on the full semaphore → its head granted, p50 / p99 ms | | {} | | ≤ 5 (p50) |",
        ms(m.head)
    ));
    targets.at_most(
        8,
        &format!(
            "deep queue ({} waiting): p50 elsewhere with ÷ without",
            args.deep_rows
        ),
        format!("{:.2} vs {:.2} ms", m.after.p50, m.before.p50),
        m.after.p50 / m.before.p50.max(1e-9),
        1.5,
    );
    targets.at_most(
        8,
        &format!(
            "deep queue ({} waiting): p99 elsewhere with ÷ without",
            args.deep_rows
        ),
        format!("{:.2} vs {:.2} ms", m.after.p99, m.before.p99),
        m.after.p99 / m.before.p99.max(1e-9),
        2.0,
    );
    report.line(format!(
        "| worker peak RSS (VmHWM) | | {:.1} MiB | | < 64 MiB |",
        m.peak_rss_kib / 1024.0
    ));
    report.line(format!(
        "| time for the worker to examine the backlog once | | {:.1} s | | |",
        m.examine.as_secs_f64()
    ));
    Ok(())
}

struct Measured {
    /// Database side: `acquired_at - created_at` (stamped before the grant commits).
    before: Percentiles,
    after: Percentiles,
    /// As the producer sees it: from the submit call's start until `acquired` is visible.
    seen_before: Percentiles,
    seen_after: Percentiles,
    head: Percentiles,
    peak_rss_kib: f64,
    examine: Duration,
}

#[allow(clippy::too_many_arguments)]
async fn measure(
    url: &str,
    client: &Client,
    conn: &tokio_postgres::Client,
    args: &BenchArgs,
    t: &str,
    idle: &str,
    full: &[String; 2],
    pid: u32,
) -> Result<Measured> {
    let _ = url;
    // The holders that keep the two semaphores full.
    for name in full {
        let holder = format!("{name}-holder");
        client
            .submit(&Request::new(&holder).permit(name, 1))
            .await?;
        let r = client
            .wait_settled(&holder, Duration::from_secs(30))
            .await?;
        if r.map(|r| r.state) != Some(State::Acquired) {
            return Err(CliError::runtime("the deep-queue worker did not start"));
        }
    }
    // Both sides measured in the same steady state: whatever earlier parts of the bench left
    // (their releases still to fold, the dead rows of their requests) is folded and vacuumed
    // first, as it is after the backlog below.
    let started = Instant::now();
    while conn
        .query_one("SELECT EXISTS (SELECT 1 FROM permitq.pending_release)", &[])
        .await?
        .get::<_, bool>(0)
    {
        if started.elapsed() > Duration::from_secs(120) {
            return Err(CliError::runtime(
                "earlier releases still unfolded after 2 minutes",
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    vacuum(conn).await?;
    for i in 0..20 {
        cycle(client, &format!("deep-warm-{t}-{i}"), idle).await?;
    }
    let requests = args.requests.min(300);
    let before_prefix = format!("deep-before-{t}-");
    let mut seen = Vec::new();
    for i in 0..requests {
        seen.push(cycle(client, &format!("{before_prefix}{i}"), idle).await?);
    }
    let before = db_latency(conn, &before_prefix).await?;
    let seen_before = Percentiles::of(&mut seen);

    // The backlog, in one statement (as a bulk load would arrive), half on each.
    let started = Instant::now();
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits)
         SELECT $1::text || '-w-' || i, jsonb_build_object(CASE WHEN i % 2 = 0 THEN $1::text ELSE $2::text END, 1)
         FROM generate_series(1, $3::int8) i",
        &[&full[0], &full[1], &args.deep_rows],
    )
    .await?;
    wait_examined(conn, "backlog").await?;
    let examine = started.elapsed();
    // Steady state: what autovacuum would do after such a load, done now so it does not run
    // during the measurement.
    vacuum(conn).await?;

    let after_prefix = format!("deep-after-{t}-");
    let mut seen = Vec::new();
    for i in 0..requests {
        seen.push(cycle(client, &format!("{after_prefix}{i}"), idle).await?);
    }
    let after = db_latency(conn, &after_prefix).await?;
    let seen_after = Percentiles::of(&mut seen);

    // Hand-off on the full semaphore: release its holder, its head (the oldest waiter there,
    // request i = 2, 4, 6, ... of the backlog) is granted.
    let mut holder = format!("{}-holder", full[0]);
    let mut gaps = Vec::new();
    for k in 1..=30 {
        let next = format!("{}-w-{}", full[0], 2 * k);
        gaps.push(hand_off(client, conn, &holder, &next).await?.database);
        holder = next;
    }
    let head = Percentiles::of(&mut gaps);
    let peak_rss_kib = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u32>().ok())
        })
        .map_or(0.0, f64::from);
    Ok(Measured {
        before,
        after,
        seen_before,
        seen_after,
        head,
        peak_rss_kib,
        examine,
    })
}

/// Waits (up to 10 minutes, polling) until a worker has examined every request; `what` names
/// them in the error.
pub(super) async fn wait_examined(conn: &tokio_postgres::Client, what: &str) -> Result<()> {
    let started = Instant::now();
    loop {
        let unexamined: i64 = conn
            .query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE state = 'new' AND NOT examined",
                &[],
            )
            .await?
            .get(0);
        if unexamined == 0 {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(CliError::runtime(format!(
                "{unexamined} {what} requests still unexamined after 10 minutes"
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `VACUUM (ANALYZE)` of the tables a pass reads.
pub(super) async fn vacuum(conn: &tokio_postgres::Client) -> Result<()> {
    for table in [
        "permitq.permit_request",
        "permitq.waiter",
        "permitq.pending_release",
        "permitq.semaphore",
    ] {
        conn.batch_execute(&format!("VACUUM (ANALYZE) {table}"))
            .await?;
    }
    Ok(())
}
