//! Bounded cost against a hostile producer: what a producer's rows can cost everyone else. Each
//! case runs in a database of its own (created and dropped here), with one in-process worker:
//! unrelated idle submit → acquired (as the producer sees it) before and after the load, and the
//! cost of `explain` of a request on 64 semaphores in an empty database and beside 50,000 holders.
//!
//! - **priorities**: 20,100 and then 40,200 requests, each on a semaphore with room and a full
//!   one, spread over all 201 priority levels (every claim used to lock them all);
//! - **burst**: 50,000 requests inserted at once on a full semaphore, and an unrelated request
//!   submitted right after them (it waited seconds behind their examination);
//! - **explain**: a request on 64 semaphores, one of them full.

use std::time::{Duration, Instant};

use permitq::{Client, Request};
use permitq_fleet::Percentiles;

use super::deep::{vacuum, wait_examined};
use super::load::cycle;
use super::targets::Targets;
use super::{fleet, stop, tag, Report};
use crate::error::{CliError, Result};

/// Idle cycles measured before and after each load.
const SAMPLES: usize = 60;

/// Runs the three cases and adds their lines and targets (G8).
pub(super) async fn run(url: &str, report: &mut Report, targets: &mut Targets) -> Result<()> {
    report.line(
        "\n## Hostile producer: what its rows cost unrelated requests (a fresh database each)",
    );
    report.line("| case | none | with the load | ratio | target |\n|---|---:|---:|---:|---|");
    let priorities = in_fresh_database(url, "prio", priorities).await?;
    for (rows, before, after) in priorities {
        let what = format!(
            "{rows} requests on a free and a full semaphore over 201 priorities: idle p50 elsewhere"
        );
        line(report, targets, &what, before, after, 1.5);
    }
    let (before, after) = in_fresh_database(url, "burst", burst).await?;
    line(
        report,
        targets,
        "50,000 requests inserted at once: an unrelated request submitted right after, vs idle p50",
        before,
        after,
        1.5,
    );
    let (empty, crowded) = in_fresh_database(url, "explain", explain).await?;
    line(
        report,
        targets,
        "explain of a request on 64 semaphores, p50: beside 50,000 holders vs an empty database",
        empty,
        crowded,
        2.0,
    );
    Ok(())
}

/// One row of the table and its target.
fn line(
    report: &mut Report,
    targets: &mut Targets,
    what: &str,
    before: f64,
    after: f64,
    goal: f64,
) {
    let ratio = after / before.max(1e-9);
    report.line(format!(
        "| {what} | {before:.2} ms | {after:.2} ms | {ratio:.2}× | ≤ {goal}× |"
    ));
    targets.at_most(
        "G8",
        what,
        format!("{after:.2} vs {before:.2} ms"),
        ratio,
        goal,
    );
}

/// Runs `case` on a new database of the bench's server (migrated, one in-process worker), then
/// drops it.
async fn in_fresh_database<T, F, Fut>(url: &str, name: &str, case: F) -> Result<T>
where
    F: FnOnce(Client, tokio_postgres::Client) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let admin = permitq_embedded_pg::try_connect(url).await?;
    let db = format!("permitq_bench_hostile_{name}_{}", tag());
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .map_err(|e| {
            CliError::runtime(format!(
                "the hostile-producer bench needs to create databases on this server \
                 (CREATEDB), or run it in the bench's own cluster (no --database-url): {e}"
            ))
        })?;
    let fresh = url_with_dbname(url, &db);
    let result = async {
        let client = Client::connect(&fresh).await?;
        client.migrate().await?;
        let conn = permitq_embedded_pg::try_connect(&fresh).await?;
        let workers = fleet(&fresh, 1, &format!("hostile-{name}"))?;
        let result = case(client, conn).await;
        stop(workers).await;
        result
    }
    .await;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await?;
    result
}

/// `url` naming database `db` instead (the path of a `postgres://` URL).
fn url_with_dbname(url: &str, db: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let base = match base[scheme_end..].find('/') {
        Some(slash) => &base[..scheme_end + slash],
        None => base,
    };
    match query {
        Some(q) => format!("{base}/{db}?{q}"),
        None => format!("{base}/{db}"),
    }
}

/// Idle submit → acquired p50 (ms, as the producer sees it) on `semaphore`, after 10 cycles
/// not counted (a new database's first statements plan and cache).
async fn idle_p50(client: &Client, semaphore: &str, prefix: &str) -> Result<f64> {
    for i in 0..10 {
        cycle(client, &format!("{prefix}-warm-{i}"), semaphore).await?;
    }
    let mut seen = Vec::with_capacity(SAMPLES);
    for i in 0..SAMPLES {
        seen.push(cycle(client, &format!("{prefix}-{i}"), semaphore).await?);
    }
    Ok(Percentiles::of(&mut seen).p50)
}

/// Fills `full` (capacity 1) with one holder.
async fn hold(client: &Client, full: &str) -> Result<()> {
    client.set_capacity(full, 1, Some(true)).await?;
    let holder = format!("{full}-holder");
    client
        .submit(&Request::new(&holder).permit(full, 1))
        .await?;
    let held = client
        .wait_settled(&holder, Duration::from_secs(30))
        .await?;
    if held.map(|r| r.state) != Some(permitq::State::Acquired) {
        return Err(CliError::runtime(
            "the hostile bench's worker did not grant",
        ));
    }
    Ok(())
}

/// Waits until the load is examined, then vacuums, as autovacuum would after such a load.
async fn examined_and_vacuumed(conn: &tokio_postgres::Client) -> Result<()> {
    wait_examined(conn, "hostile").await?;
    vacuum(conn).await
}

/// 20,100 then 40,200 requests on a semaphore with room and a full one, over 201 priorities:
/// (rows, idle p50 before, idle p50 with them waiting).
async fn priorities(
    client: Client,
    conn: tokio_postgres::Client,
) -> Result<Vec<(String, f64, f64)>> {
    client.set_capacity("idle", 1_000_000, Some(true)).await?;
    client.set_capacity("room", 1_000_000, Some(true)).await?;
    hold(&client, "full").await?;
    examined_and_vacuumed(&conn).await?;
    let before = idle_p50(&client, "idle", "before").await?;
    let mut measured = Vec::new();
    for (batch, rows) in [(1_i64, "20,100"), (2, "40,200")] {
        conn.execute(
            "INSERT INTO permitq.permit_request (external_id, permits, priority)
             SELECT 'hostile-' || $1::int8 || '-' || i, '{\"room\": 1, \"full\": 1}',
                    (i % 201 - 100)::int2
             FROM generate_series(1, 20100) i",
            &[&batch],
        )
        .await?;
        examined_and_vacuumed(&conn).await?;
        let after = idle_p50(&client, "idle", &format!("after-{batch}")).await?;
        measured.push((rows.to_string(), before, after));
    }
    Ok(measured)
}

/// 50,000 requests inserted at once on a full semaphore, then at once an unrelated request:
/// (idle p50 before, that request's submit → acquired).
async fn burst(client: Client, conn: tokio_postgres::Client) -> Result<(f64, f64)> {
    client.set_capacity("idle", 1_000_000, Some(true)).await?;
    hold(&client, "full").await?;
    examined_and_vacuumed(&conn).await?;
    let before = idle_p50(&client, "idle", "before").await?;
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits)
         SELECT 'burst-' || i, '{\"full\": 1}' FROM generate_series(1, 50000) i",
        &[],
    )
    .await?;
    let after = cycle(&client, "right-after", "idle").await?;
    Ok((before, after))
}

/// `explain` of a request on 64 semaphores (one full) in an empty database, then beside 50,000
/// holders on another semaphore: (p50 ms empty, p50 ms crowded).
async fn explain(client: Client, conn: tokio_postgres::Client) -> Result<(f64, f64)> {
    // 63 with room and the full one: 64, the most a request names.
    let mut request = Request::new("wide");
    for i in 0..63 {
        let name = format!("s{i:02}");
        client.set_capacity(&name, 4, Some(true)).await?;
        request = request.permit(&name, 1);
    }
    hold(&client, "full").await?;
    client.submit(&request.permit("full", 1)).await?;
    examined_and_vacuumed(&conn).await?;
    let empty = explain_p50(&client).await?;
    client.set_capacity("crowd", 1_000_000, Some(true)).await?;
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits)
         SELECT 'crowd-' || i, '{\"crowd\": 1}' FROM generate_series(1, 50000) i",
        &[],
    )
    .await?;
    let started = Instant::now();
    while conn
        .query_one(
            "SELECT count(*) < 50000 FROM permitq.permit_request WHERE state = 'acquired' \
             AND external_id LIKE 'crowd-%'",
            &[],
        )
        .await?
        .get::<_, bool>(0)
    {
        if started.elapsed() > Duration::from_secs(600) {
            return Err(CliError::runtime(
                "50,000 holders not granted in 10 minutes",
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    examined_and_vacuumed(&conn).await?;
    let crowded = explain_p50(&client).await?;
    Ok((empty, crowded))
}

/// `explain wide`, 30 times: p50 ms.
async fn explain_p50(client: &Client) -> Result<f64> {
    let mut took = Vec::new();
    for _ in 0..30 {
        let started = Instant::now();
        client.explain("wide").await?;
        took.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(Percentiles::of(&mut took).p50)
}
