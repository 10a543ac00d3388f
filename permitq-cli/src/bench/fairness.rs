//! Fairness keys (`--only fairness`): what serving a line by key costs, and what it buys.
//!
//! - **cost**: a drain of 20,000 queued requests over 10,000 keys (two each) on a semaphore
//!   served by key, against the same backlog on one that is not, alternated, one worker; every
//!   request examined on a keyed semaphore reads and writes its key's finish tag;
//! - **a line**: the same backlog examined into the line of a full semaphore (capacity 1), so
//!   that every batch waits and is placed by key (a drain with room for all is granted whole,
//!   batch after batch, and placed by no key);
//! - **a noisy tenant**: 10,000 requests of tenant A queued on a keyed semaphore of capacity 4,
//!   then one of tenant B; holders release at once: how many of A's are granted before B's.

use std::time::{Duration, Instant};

use permitq::{Client, SemaphoreSettings};

use super::baselines::rate;
use super::load::{db_now, wait_drained};
use super::{fleet, stop, tag, BenchArgs, Report};
use crate::error::{CliError, Result};

/// Requests per drain, and keys they are spread over.
const ROWS: i64 = 20_000;
const KEYS: i64 = 10_000;

pub(super) async fn run(url: &str, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let client = Client::connect(url).await?;
    let conn = permitq_embedded_pg::try_connect(url).await?;
    report.line(format!(
        "\n## Fairness keys: a drain of {ROWS} queued requests over {KEYS} keys, 1 worker, each \
         alternated with the same backlog on a semaphore not served by key"
    ));
    report.line("| run | without keys (grants/s) | with keys (grants/s) | with ÷ without |\n|---:|---:|---:|---:|");
    let mut ratios = Vec::new();
    for run in 1..=args.repeat.max(2) {
        let plain = drain(url, &client, &conn, false).await?;
        let keyed = drain(url, &client, &conn, true).await?;
        ratios.push(keyed / plain.max(1e-9));
        report.line(format!(
            "| {run} | {plain:.0} | {keyed:.0} | {:.2}× |",
            keyed / plain.max(1e-9)
        ));
    }
    ratios.sort_by(f64::total_cmp);
    report.line(format!(
        "fairness keys: drain with ÷ without, median {:.2}× (goal ≥ 0.8×: {})",
        ratios[ratios.len() / 2],
        if ratios[ratios.len() / 2] >= 0.8 {
            "met"
        } else {
            "not met"
        }
    ));
    // The same backlog on a full semaphore: every batch waits, so every batch is placed by key.
    report.line(format!(
        "\n## Fairness keys, a line: {ROWS} queued requests over {KEYS} keys examined into the \
         line of a full semaphore (every batch placed by key), 1 worker, alternated with the \
         same without keys"
    ));
    report.line("| run | without keys (placed/s) | with keys (placed/s) | with ÷ without |\n|---:|---:|---:|---:|");
    let mut lines = Vec::new();
    for run in 1..=args.repeat.max(2) {
        let plain = line(url, &client, &conn, false).await?;
        let keyed = line(url, &client, &conn, true).await?;
        lines.push(keyed / plain.max(1e-9));
        report.line(format!(
            "| {run} | {plain:.0} | {keyed:.0} | {:.2}× |",
            keyed / plain.max(1e-9)
        ));
    }
    lines.sort_by(f64::total_cmp);
    report.line(format!(
        "fairness keys: a line placed with ÷ without, median {:.2}×",
        lines[lines.len() / 2]
    ));
    noisy_tenant(url, &client, &conn, report).await
}

/// [`ROWS`] requests queued on a semaphore of capacity 1 (the first is granted, the rest wait),
/// served by key or not: requests examined into its line per second. Then the line is ended
/// (capacity 0: the worker fails them) and the holder released.
async fn line(
    url: &str,
    client: &Client,
    conn: &tokio_postgres::Client,
    keyed: bool,
) -> Result<f64> {
    let semaphore = format!("line-{}", tag());
    client
        .set_semaphore(
            &semaphore,
            1,
            &SemaphoreSettings::new().fairness_keys(keyed),
        )
        .await?;
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, fairness_key)
         SELECT $1::text || '-' || i, jsonb_build_object($1::text, 1), 'tenant-' || (i % $3)
         FROM generate_series(1, $2::int8) i",
        &[&semaphore, &ROWS, &KEYS],
    )
    .await?;
    conn.batch_execute("ANALYZE permitq.permit_request").await?;
    let since = db_now(conn).await?;
    let running = fleet(url, 1, &format!("bench-{semaphore}"))?;
    let started = Instant::now();
    let took = loop {
        let row = conn
            .query_one(
                "SELECT count(*) FILTER (WHERE NOT examined), max(examined_at)
                 FROM permitq.permit_request WHERE state = 'new' AND permits ? $1",
                &[&semaphore],
            )
            .await?;
        let (unexamined, last): (i64, Option<std::time::SystemTime>) = (row.get(0), row.get(1));
        if unexamined == 0 {
            break last
                .and_then(|l| l.duration_since(since).ok())
                .unwrap_or_default();
        }
        if started.elapsed() > Duration::from_secs(300) {
            return Err(CliError::runtime(format!(
                "{unexamined} requests on {semaphore} not examined after {:?}",
                started.elapsed()
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // Capacity 0: the worker ends every waiter (exceeds_capacity); then the holder goes.
    client
        .set_semaphore(&semaphore, 0, &SemaphoreSettings::new())
        .await?;
    wait_drained(conn, &semaphore, since, Duration::from_secs(300)).await?;
    stop(running).await;
    conn.execute(
        "SELECT count(permitq.release(external_id)) FROM permitq.permit_request
         WHERE external_id LIKE $1 AND state = 'acquired'",
        &[&format!("{semaphore}-%")],
    )
    .await?;
    if keyed {
        conn.execute("SELECT permitq.set_fairness_keys($1, false)", &[&semaphore])
            .await?;
    }
    conn.batch_execute("VACUUM ANALYZE permitq.permit_request")
        .await?;
    Ok(rate(u64::try_from(ROWS - 1).unwrap_or(0), took))
}

/// One drain of [`ROWS`] requests on a semaphore of room enough for all, served by key or not:
/// grants per second.
async fn drain(
    url: &str,
    client: &Client,
    conn: &tokio_postgres::Client,
    keyed: bool,
) -> Result<f64> {
    let semaphore = format!("fair-{}", tag());
    client
        .set_semaphore(
            &semaphore,
            1_000_000,
            &SemaphoreSettings::new().fairness_keys(keyed),
        )
        .await?;
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, fairness_key)
         SELECT $1::text || '-' || i, jsonb_build_object($1::text, 1), 'tenant-' || (i % $3)
         FROM generate_series(1, $2::int8) i",
        &[&semaphore, &ROWS, &KEYS],
    )
    .await?;
    conn.batch_execute("ANALYZE permitq.permit_request").await?;
    let since = db_now(conn).await?;
    let running = fleet(url, 1, &format!("bench-{semaphore}"))?;
    let took = wait_drained(conn, &semaphore, since, Duration::from_secs(300)).await?;
    stop(running).await;
    conn.execute(
        "SELECT count(permitq.release(external_id)) FROM permitq.permit_request
         WHERE external_id LIKE $1 AND state = 'acquired'",
        &[&format!("{semaphore}-%")],
    )
    .await?;
    // Served by key no more: the next drain, keyed or not, runs beside no keyed semaphore (a
    // batch reads the keys' tags only where one of its semaphores is keyed, so a leftover one
    // would tell nothing, but it keeps the two sides' databases alike).
    if keyed {
        conn.execute("SELECT permitq.set_fairness_keys($1, false)", &[&semaphore])
            .await?;
    }
    conn.batch_execute("VACUUM ANALYZE permitq.permit_request")
        .await?;
    Ok(rate(u64::try_from(ROWS).unwrap_or(0), took))
}

/// Tenant A's 10,000 queued, then tenant B's one, on a keyed semaphore of capacity 4 whose
/// holders release at once: A's grants before B's.
async fn noisy_tenant(
    url: &str,
    client: &Client,
    conn: &tokio_postgres::Client,
    report: &mut Report,
) -> Result<()> {
    let semaphore = format!("noisy-{}", tag());
    client
        .set_semaphore(&semaphore, 4, &SemaphoreSettings::new().fairness_keys(true))
        .await?;
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, fairness_key)
         SELECT $1::text || '-a-' || i, jsonb_build_object($1::text, 1), 'A'
         FROM generate_series(1, 10000) i",
        &[&semaphore],
    )
    .await?;
    let b = format!("{semaphore}-b");
    client
        .submit(
            &permitq::Request::new(&b)
                .permit(&semaphore, 1)
                .fairness_key("B"),
        )
        .await?;
    let running = fleet(url, 2, &format!("bench-{semaphore}"))?;
    let started = Instant::now();
    // The holders: release whatever is granted, until B is.
    // The batch that granted B began at its `decided_at`: A's granted by earlier batches.
    let b_granted = loop {
        let granted: Vec<(String, Option<std::time::SystemTime>)> = conn
            .query(
                "SELECT external_id, decided_at FROM permitq.permit_request
                 WHERE state = 'acquired' AND permits ? $1",
                &[&semaphore],
            )
            .await?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        if let Some((_, at)) = granted.iter().find(|(id, _)| *id == b) {
            break *at;
        }
        for (id, _) in &granted {
            client.release(id).await?;
        }
        if started.elapsed() > Duration::from_secs(300) {
            return Err(CliError::runtime(format!(
                "{b} not granted after {:?}",
                started.elapsed()
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    stop(running).await;
    let before: i64 = conn
        .query_one(
            "SELECT count(*) FROM permitq.permit_request
             WHERE permits ? $1 AND fairness_key = 'A' AND decided_at < $2",
            &[&semaphore, &b_granted],
        )
        .await?
        .get(0);
    report.line(format!(
        "a noisy tenant: 10000 of A's requests queued on a keyed semaphore of capacity 4, then \
         one of B's: B granted after {before} of A's, in the batches before it (without keys: after every one of A's \
         queued ahead of it, 10000)"
    ));
    conn.execute(
        "SELECT count(permitq.release(external_id)) FROM permitq.permit_request
         WHERE permits ? $1 AND state IN ('new', 'acquired')",
        &[&semaphore],
    )
    .await?;
    Ok(())
}
