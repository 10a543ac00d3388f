//! The baselines, plain SQL on their own tables (schema `bench`), each client on its own
//! connection with prepared statements:
//! - seed 000's naive per-request transaction: `SELECT ... FOR UPDATE` on the semaphore row,
//!   `SUM` of held permits, INSERT request and permit, COMMIT; then release (two UPDATEs);
//! - seed 001's conditional counter: `UPDATE ... SET used = used + 1 WHERE used < capacity`, then
//!   `- 1`;
//! - one durable single-row INSERT per statement: the box's commit-rate limit;
//! - a plain `FOR UPDATE SKIP LOCKED` batched drain of a queue table.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Result;

const TABLES: &str = "
CREATE SCHEMA IF NOT EXISTS bench;
CREATE TABLE IF NOT EXISTS bench.naive_semaphore (name text PRIMARY KEY, capacity int NOT NULL);
CREATE TABLE IF NOT EXISTS bench.naive_request (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, external_id text UNIQUE NOT NULL,
    state text NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS bench.naive_permit (
    request_id bigint NOT NULL REFERENCES bench.naive_request (id), semaphore text NOT NULL,
    count int NOT NULL, state text NOT NULL, PRIMARY KEY (request_id, semaphore));
CREATE INDEX IF NOT EXISTS naive_permit_held ON bench.naive_permit (semaphore) WHERE state = 'ACQUIRED';
CREATE TABLE IF NOT EXISTS bench.counter (name text PRIMARY KEY, capacity int NOT NULL, used int NOT NULL);
CREATE TABLE IF NOT EXISTS bench.insert_only (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload text NOT NULL);
CREATE TABLE IF NOT EXISTS bench.queue (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, payload text NOT NULL, state text NOT NULL DEFAULT 'new');
CREATE INDEX IF NOT EXISTS queue_new ON bench.queue (id) WHERE state = 'new';
";

/// Creates the baseline tables.
pub(super) async fn create_tables(conn: &tokio_postgres::Client) -> Result<()> {
    conn.batch_execute(TABLES).await?;
    Ok(())
}

/// Runs `clients` tasks for `duration`, each on its own connection, counting the cycles
/// `cycle` completes. Returns cycles per second.
async fn per_connection<F, Fut>(
    url: &str,
    clients: usize,
    duration: Duration,
    cycle: F,
) -> Result<f64>
where
    F: Fn(Arc<tokio_postgres::Client>, usize, u64) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = Result<bool, tokio_postgres::Error>> + Send,
{
    let done = Arc::new(AtomicU64::new(0));
    let mut conns = Vec::with_capacity(clients);
    for _ in 0..clients {
        conns.push(Arc::new(permitq_embedded_pg::try_connect(url).await?));
    }
    let started = Instant::now();
    let deadline = started + duration;
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(c, conn)| {
            let (done, cycle) = (done.clone(), cycle.clone());
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    if cycle(conn.clone(), c, i).await? {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok::<_, tokio_postgres::Error>(())
            })
        })
        .collect();
    for t in tasks {
        t.await
            .map_err(|e| crate::error::CliError::runtime(e.to_string()))??;
    }
    Ok(rate(done.load(Ordering::Relaxed), started.elapsed()))
}

/// Events per second.
pub(super) fn rate(n: u64, elapsed: Duration) -> f64 {
    let n = u32::try_from(n).unwrap_or(u32::MAX);
    f64::from(n) / elapsed.as_secs_f64().max(1e-9)
}

/// Seed 000: per cycle, one acquire transaction (lock the semaphore row, sum the held permits,
/// insert request and permit, commit) and a release (two UPDATEs). Cycles per second.
pub(super) async fn naive_cycle(
    url: &str,
    clients: usize,
    capacity: i32,
    duration: Duration,
) -> Result<f64> {
    let name = format!("naive-{}", super::tag());
    let conn = permitq_embedded_pg::try_connect(url).await?;
    conn.execute(
        "INSERT INTO bench.naive_semaphore (name, capacity) VALUES ($1, $2)",
        &[&name, &capacity],
    )
    .await?;
    let name = Arc::new(name);
    per_connection(url, clients, duration, move |conn, c, i| {
        let name = name.clone();
        async move {
            let external_id = format!("{name}-{c}-{i}");
            conn.batch_execute("BEGIN").await?;
            let cap: i32 = conn
                .query_one(
                    "SELECT capacity FROM bench.naive_semaphore WHERE name = $1 FOR UPDATE",
                    &[&*name],
                )
                .await?
                .get(0);
            let held: i64 = conn
                .query_one(
                    "SELECT coalesce(sum(count), 0)::int8 FROM bench.naive_permit WHERE semaphore = $1 AND state = 'ACQUIRED'",
                    &[&*name],
                )
                .await?
                .get(0);
            if held + 1 > i64::from(cap) {
                conn.batch_execute("ROLLBACK").await?;
                tokio::time::sleep(Duration::from_millis(1)).await;
                return Ok(false);
            }
            let id: i64 = conn
                .query_one(
                    "INSERT INTO bench.naive_request (external_id, state) VALUES ($1, 'ACQUIRED') RETURNING id",
                    &[&external_id],
                )
                .await?
                .get(0);
            conn.execute(
                "INSERT INTO bench.naive_permit (request_id, semaphore, count, state) VALUES ($1, $2, 1, 'ACQUIRED')",
                &[&id, &*name],
            )
            .await?;
            conn.batch_execute("COMMIT").await?;
            conn.execute(
                "UPDATE bench.naive_permit SET state = 'RELEASED' WHERE request_id = $1 AND state <> 'RELEASED'",
                &[&id],
            )
            .await?;
            conn.execute(
                "UPDATE bench.naive_request SET state = 'RELEASED' WHERE id = $1 AND state <> 'RELEASED'",
                &[&id],
            )
            .await?;
            Ok(true)
        }
    })
    .await
}

/// Seed 001: the conditional counter, acquire then release. Cycles per second.
pub(super) async fn counter_cycle(
    url: &str,
    clients: usize,
    capacity: i32,
    duration: Duration,
) -> Result<f64> {
    let name = format!("counter-{}", super::tag());
    let conn = permitq_embedded_pg::try_connect(url).await?;
    conn.execute(
        "INSERT INTO bench.counter (name, capacity, used) VALUES ($1, $2, 0)",
        &[&name, &capacity],
    )
    .await?;
    let name = Arc::new(name);
    per_connection(url, clients, duration, move |conn, _, _| {
        let name = name.clone();
        async move {
            let got = conn
                .execute(
                    "UPDATE bench.counter SET used = used + 1 WHERE name = $1 AND used < capacity",
                    &[&*name],
                )
                .await?;
            if got == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
                return Ok(false);
            }
            conn.execute(
                "UPDATE bench.counter SET used = used - 1 WHERE name = $1",
                &[&*name],
            )
            .await?;
            Ok(true)
        }
    })
    .await
}

/// One durable single-row INSERT per statement. Rows per second.
pub(super) async fn insert_rate(url: &str, clients: usize, duration: Duration) -> Result<f64> {
    per_connection(url, clients, duration, |conn, _, _| async move {
        conn.execute("INSERT INTO bench.insert_only (payload) VALUES ('x')", &[])
            .await?;
        Ok(true)
    })
    .await
}

/// A plain batched `FOR UPDATE SKIP LOCKED` drain of `rows` queued rows by `workers`
/// connections, 100 rows per transaction. Rows per second.
pub(super) async fn skip_locked_drain(url: &str, rows: i64, workers: usize) -> Result<f64> {
    let conn = permitq_embedded_pg::try_connect(url).await?;
    conn.batch_execute("TRUNCATE bench.queue").await?;
    conn.execute(
        "INSERT INTO bench.queue (payload) SELECT 'job-' || i FROM generate_series(1, $1::int8) i",
        &[&rows],
    )
    .await?;
    conn.batch_execute("ANALYZE bench.queue").await?;
    let mut conns = Vec::new();
    for _ in 0..workers {
        conns.push(permitq_embedded_pg::try_connect(url).await?);
    }
    let started = Instant::now();
    let tasks: Vec<_> = conns
        .into_iter()
        .map(|conn| {
            tokio::spawn(async move {
                loop {
                    let n = conn
                        .execute(
                            "WITH c AS (SELECT id FROM bench.queue WHERE state = 'new' ORDER BY id
                                        LIMIT 100 FOR UPDATE SKIP LOCKED)
                             UPDATE bench.queue q SET state = 'done' FROM c WHERE q.id = c.id",
                            &[],
                        )
                        .await?;
                    if n == 0 {
                        return Ok::<_, tokio_postgres::Error>(());
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await
            .map_err(|e| crate::error::CliError::runtime(e.to_string()))??;
    }
    let n = u64::try_from(rows).unwrap_or(0);
    Ok(rate(n, started.elapsed()))
}
