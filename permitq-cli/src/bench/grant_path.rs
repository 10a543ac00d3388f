//! The grant path against the minimal design of its own architecture: one semaphore of capacity
//! 64, a producer INSERTs a request, a worker grants in batches under the semaphore's row lock
//! (folding releases from a side table), the producer polls the request's state every 0.5 ms,
//! then releases. No fairness, events, leases, validation, roles or multi-semaphore requests: the
//! floor of what permitq's design costs per cycle, run in the same cluster as permitq.
//!
//! Both sides use the same polling client (INSERT, a server-side poll every 0.5 ms, release, each
//! its own statement), so the ratio compares the designs, not the clients. Beside each throughput:
//! the CPU of every process per cycle (`/proc/stat`), the WAL bytes per cycle
//! (`pg_current_wal_lsn()` before and after) and the transactions per cycle
//! (`pg_stat_database`); and permitq's own client against the two-commit bound.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use permitq::Client;

use super::baselines::{self, rate};
use super::load::cycle_run;
use super::targets::{ratio, CpuClock, Targets};
use super::{fleet, stop, tag, BenchArgs, Report};
use crate::error::{CliError, Result};

/// Capacity of the one semaphore, as in the minimal design.
const CAPACITY: i32 = 64;
/// Producers in the cycle runs.
const CLIENTS: usize = 16;

/// The minimal design (one semaphore; its worker below). `minimal.await` is the polling client's
/// wait, shared in shape with [`PERMITQ_AWAIT`].
const MINIMAL_DESIGN: &str = "
DROP SCHEMA IF EXISTS minimal CASCADE;
CREATE SCHEMA minimal;
CREATE TABLE minimal.sem (id int PRIMARY KEY, cap int NOT NULL, used int NOT NULL);
INSERT INTO minimal.sem VALUES (1, 64, 0);
CREATE TABLE minimal.req (id bigserial PRIMARY KEY, ext text UNIQUE NOT NULL,
                          state text NOT NULL DEFAULT 'new', token bigint);
CREATE INDEX ON minimal.req (id) WHERE state = 'new';
CREATE TABLE minimal.pending (id bigserial PRIMARY KEY, n int NOT NULL);
CREATE SEQUENCE minimal.tok;
CREATE FUNCTION minimal.grant_batch() RETURNS int LANGUAGE plpgsql AS $$
DECLARE room int; freed int; got int;
BEGIN
  SELECT cap - used INTO room FROM minimal.sem WHERE id = 1 FOR UPDATE;
  WITH d AS (DELETE FROM minimal.pending RETURNING n) SELECT coalesce(sum(n), 0) INTO freed FROM d;
  room := room + freed;
  WITH c AS (SELECT id FROM minimal.req WHERE state = 'new' ORDER BY id
             LIMIT least(room, 100) FOR UPDATE SKIP LOCKED),
       u AS (UPDATE minimal.req r SET state = 'acquired', token = nextval('minimal.tok')
             FROM c WHERE r.id = c.id RETURNING 1)
  SELECT count(*) INTO got FROM u;
  UPDATE minimal.sem SET used = used - freed + got WHERE id = 1;
  RETURN got;
END $$;
CREATE FUNCTION minimal.await(e text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE s text;
BEGIN
  FOR i IN 1..20000 LOOP
    SELECT state INTO s FROM minimal.req WHERE ext = e;
    IF s IS DISTINCT FROM 'new' THEN RETURN s; END IF;
    PERFORM pg_sleep(0.0005);
  END LOOP;
  RETURN s;
END $$;
CREATE FUNCTION minimal.release(e text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
  UPDATE minimal.req SET state = 'released' WHERE ext = e AND state = 'acquired';
  IF FOUND THEN INSERT INTO minimal.pending (n) VALUES (1); END IF;
END $$;
";

/// The same polling wait on permitq's `status` (its contract columns, through ownership).
const PERMITQ_AWAIT: &str = "
CREATE OR REPLACE FUNCTION bench.permitq_await(e text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE s text;
BEGIN
  FOR i IN 1..20000 LOOP
    SELECT state INTO s FROM permitq.status(e);
    IF s IS DISTINCT FROM 'new' THEN RETURN s; END IF;
    PERFORM pg_sleep(0.0005);
  END LOOP;
  RETURN s;
END $$;
";

/// What one design cost per cycle.
#[derive(Debug, Clone, Copy)]
struct Work {
    per_s: f64,
    cpu_ms: f64,
    wal_bytes: f64,
    commits: f64,
    /// Top-level statements (pg_stat_statements), when the server tracks them.
    statements: Option<f64>,
}

impl Work {
    fn row(&self, what: &str) -> String {
        format!(
            "| {what} | {:.0} | {:.2} | {:.0} | {:.1} | {} |",
            self.per_s,
            self.cpu_ms,
            self.wal_bytes,
            self.commits,
            self.statements
                .map_or_else(|| "n/a".to_string(), |n| format!("{n:.1}"))
        )
    }
}

/// The WAL position (bytes) and the database's committed transactions, for the figures per cycle;
/// and the top-level statements run, where pg_stat_statements is loaded (the bench's own cluster
/// loads it): every statement a client or worker sends, pipelined or not, but the minimal
/// design's pause between batches (`SELECT pg_sleep(..)`), which is no work.
async fn counters(conn: &tokio_postgres::Client) -> Result<(f64, f64, Option<f64>)> {
    let row = conn
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8,
                    (SELECT (xact_commit + xact_rollback)::float8 FROM pg_stat_database
                     WHERE datname = current_database())",
            &[],
        )
        .await?;
    let statements = conn
        .query_one(
            "SELECT coalesce(sum(calls), 0)::float8 FROM pg_stat_statements
             WHERE toplevel AND query NOT LIKE 'SELECT pg_sleep(%'",
            &[],
        )
        .await
        .ok()
        .map(|r| r.get(0));
    Ok((row.get(0), row.get(1), statements))
}

/// Runs `cycles` (returning cycles per second) and measures its work per cycle.
async fn measured<F, Fut>(url: &str, duration: Duration, cycles: F) -> Result<Work>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<f64>>,
{
    let conn = permitq_embedded_pg::try_connect(url).await?;
    // pg_stat_database is read through a snapshot that a new transaction refreshes.
    conn.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await?;
    let (wal, commits, statements) = counters(&conn).await?;
    let cpu = CpuClock::now();
    let per_s = cycles().await?;
    let n = per_s * duration.as_secs_f64();
    // The statistics collector reports a backend's counts at its transaction ends, at most
    // every 0.5 s (PGSTAT_MIN_INTERVAL), and at its exit: the run's connections are closed.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    conn.batch_execute("SELECT pg_stat_clear_snapshot()")
        .await?;
    let (wal_after, commits_after, statements_after) = counters(&conn).await?;
    Ok(Work {
        per_s,
        cpu_ms: cpu.ms_per(n),
        wal_bytes: (wal_after - wal) / n.max(1.0),
        commits: (commits_after - commits) / n.max(1.0),
        statements: statements
            .zip(statements_after)
            .map(|(before, after)| (after - before) / n.max(1.0)),
    })
}

/// The minimal design: `CLIENTS` polling producers and one worker (grant, 200 µs pause).
async fn minimal_cycles(url: &str, duration: Duration) -> Result<f64> {
    let worker = permitq_embedded_pg::try_connect(url).await?;
    let stop_worker = Arc::new(AtomicBool::new(false));
    let stopping = stop_worker.clone();
    let granting = tokio::spawn(async move {
        let grant = worker.prepare("SELECT minimal.grant_batch()").await?;
        let pause = worker.prepare("SELECT pg_sleep(0.0002)").await?;
        while !stopping.load(Ordering::Relaxed) {
            worker.query_one(&grant, &[]).await?;
            worker.query_one(&pause, &[]).await?;
        }
        Ok::<_, tokio_postgres::Error>(())
    });
    let t = tag();
    let result = polling_cycles(
        url,
        duration,
        move |c, i| format!("m-{t}-{c}-{i}"),
        Polling {
            insert: "INSERT INTO minimal.req (ext) VALUES ($1)",
            wait: "SELECT minimal.await($1)",
            release: "SELECT minimal.release($1)",
            permits: None,
        },
    )
    .await;
    stop_worker.store(true, Ordering::Relaxed);
    granting
        .await
        .map_err(|e| CliError::runtime(e.to_string()))??;
    result
}

/// A polling client's statements.
struct Polling {
    insert: &'static str,
    wait: &'static str,
    release: &'static str,
    /// The `permits` JSON of permitq's insert.
    permits: Option<serde_json::Value>,
}

/// `CLIENTS` producers on connections of their own, each cycling: insert, wait (polling), release.
async fn polling_cycles(
    url: &str,
    duration: Duration,
    id: impl Fn(usize, u64) -> String + Send + Sync + Clone + 'static,
    statements: Polling,
) -> Result<f64> {
    let statements = Arc::new(statements);
    let done = Arc::new(AtomicU64::new(0));
    let mut conns = Vec::with_capacity(CLIENTS);
    for _ in 0..CLIENTS {
        conns.push(permitq_embedded_pg::try_connect(url).await?);
    }
    let started = Instant::now();
    let deadline = started + duration;
    let tasks: Vec<_> = conns
        .into_iter()
        .enumerate()
        .map(|(c, conn)| {
            let (done, statements, id) = (done.clone(), statements.clone(), id.clone());
            tokio::spawn(async move {
                let insert = conn.prepare(statements.insert).await?;
                let wait = conn.prepare(statements.wait).await?;
                let release = conn.prepare(statements.release).await?;
                let mut i = 0u64;
                while Instant::now() < deadline {
                    i += 1;
                    let external_id = id(c, i);
                    match &statements.permits {
                        Some(permits) => conn.execute(&insert, &[&external_id, permits]).await?,
                        None => conn.execute(&insert, &[&external_id]).await?,
                    };
                    let state: Option<String> =
                        conn.query_one(&wait, &[&external_id]).await?.get(0);
                    if state.as_deref() == Some("acquired") {
                        conn.query_one(&release, &[&external_id]).await?;
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok::<_, tokio_postgres::Error>(())
            })
        })
        .collect();
    for t in tasks {
        t.await.map_err(|e| CliError::runtime(e.to_string()))??;
    }
    Ok(rate(done.load(Ordering::Relaxed), started.elapsed()))
}

/// Runs the grant-path comparison and adds its targets.
pub(super) async fn run(
    url: &str,
    args: &BenchArgs,
    report: &mut Report,
    targets: &mut Targets,
) -> Result<()> {
    let d = args.duration;
    let conn = permitq_embedded_pg::try_connect(url).await?;
    conn.batch_execute(MINIMAL_DESIGN).await?;
    conn.batch_execute(PERMITQ_AWAIT).await?;
    let client = Client::connect_with_pool_size(url, CLIENTS + 2).await?;

    let minimal = measured(url, d, || minimal_cycles(url, d)).await?;

    let polled_sem = format!("gp-polled-{}", tag());
    client
        .set_capacity(&polled_sem, CAPACITY, Some(true))
        .await?;
    let polled = measured(url, d, || async {
        let workers = fleet(url, 2, &format!("bench-gp-{}", tag()))?;
        let t = tag();
        let result = polling_cycles(
            url,
            d,
            move |c, i| format!("p-{t}-{c}-{i}"),
            Polling {
                insert: "INSERT INTO permitq.permit_request (external_id, permits) VALUES ($1, $2)",
                wait: "SELECT bench.permitq_await($1)",
                release: "SELECT permitq.release($1)",
                permits: Some(serde_json::json!({ polled_sem.clone(): 1 })),
            },
        )
        .await;
        stop(workers).await;
        result
    })
    .await?;

    let own_sem = format!("gp-own-{}", tag());
    client.set_capacity(&own_sem, CAPACITY, Some(true)).await?;
    let own = measured(url, d, || {
        cycle_run(url, &client, CLIENTS, 2, d, |_| (own_sem.clone(), 0))
    })
    .await?;
    let insert = baselines::insert_rate(url, CLIENTS, d).await?;
    let bound = insert / 2.0;

    report.line(format!(
        "\n## The grant path against the minimal design: one semaphore (capacity {CAPACITY}), \
         {CLIENTS} clients, full cycles (submit → acquired → release)"
    ));
    report.line(
        "| design | cycles/s | CPU ms per cycle (all processes) | WAL bytes per cycle | transactions per cycle | statements per cycle |\n|---|---:|---:|---:|---:|---:|",
    );
    report.line(minimal.row("minimal design, polling client, 1 worker"));
    report.line(polled.row("permitq, the same polling client, 2 workers"));
    report.line(own.row("permitq, its own client (LISTEN), 2 workers"));
    report.line(format!(
        "durable single-row INSERT, {CLIENTS} clients: {insert:.0}/s; two-commit bound {bound:.0} cycles/s"
    ));
    targets.at_least(
        "G1",
        "hot cycle, polling client: permitq ÷ minimal design",
        format!("{:.0} vs {:.0} cycles/s", polled.per_s, minimal.per_s),
        ratio(polled.per_s, minimal.per_s),
        0.5,
    );
    targets.at_least(
        "G1",
        "hot cycle, permitq's own client ÷ two-commit bound",
        format!("{:.0} vs {bound:.0} cycles/s", own.per_s),
        ratio(own.per_s, bound),
        0.3,
    );
    targets.at_most(
        "G2",
        "CPU per cycle (polling client): permitq ÷ minimal design",
        format!("{:.2} vs {:.2} ms", polled.cpu_ms, minimal.cpu_ms),
        ratio(polled.cpu_ms, minimal.cpu_ms),
        2.0,
    );
    targets.at_most(
        "G2",
        "WAL per cycle (polling client): permitq ÷ minimal design",
        format!("{:.0} vs {:.0} bytes", polled.wal_bytes, minimal.wal_bytes),
        ratio(polled.wal_bytes, minimal.wal_bytes),
        1.7,
    );
    targets.reported(
        "G2",
        "transactions per cycle (polling client): permitq vs minimal design",
        format!("{:.1} vs {:.1}", polled.commits, minimal.commits),
    );
    if let (Some(permitq), Some(baseline)) = (polled.statements, minimal.statements) {
        targets.reported(
            "G2",
            "statements per cycle (polling client; pipelined ones share a round trip): permitq vs minimal design",
            format!("{permitq:.1} vs {baseline:.1}"),
        );
    }
    Ok(())
}
