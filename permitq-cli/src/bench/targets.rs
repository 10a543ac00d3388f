//! The flat-cost targets, each a ratio within this run (fsync on), with the CPU every process of
//! the machine spent per grant or cycle beside each throughput (from `/proc/stat`, so that runs on
//! a noisy machine can be compared): priorities, templates, queue depth, rate windows, workers,
//! the hot semaphore, and the earlier targets (deep queue, notifications, releases), which the
//! other parts measure.
//!
//! Drains insert their backlog in one statement while no worker runs, then start the workers and
//! read the grant times back from the database (`acquired_at`), so the rate is the database's
//! own: from the workers' start to the last grant. In the bench's own cluster each drain runs in
//! a database made and migrated for it, and drains by different numbers of workers run most
//! workers first, the order rotated at each `--repeat`: never one after another in rising order
//! over what the previous drain left.

use std::time::{Duration, Instant};

use permitq::Client;
use permitq_fleet::Percentiles;

use super::baselines;
use super::load::{cycle, cycle_run, db_latency, db_now};
use super::{fleet, stop, tag, BenchArgs, Report};
use crate::error::{CliError, Result};

/// Busy CPU time of the whole machine (every core, every process), from `/proc/stat`.
#[derive(Debug, Clone, Copy)]
pub(super) struct CpuClock {
    busy_ticks: u64,
}

impl CpuClock {
    /// Now. Zero where `/proc/stat` cannot be read.
    pub(super) fn now() -> CpuClock {
        let busy_ticks = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                let line = s.lines().next()?.to_string();
                let v: Vec<u64> = line
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|f| f.parse().ok())
                    .collect();
                // user nice system idle iowait irq softirq steal: busy = all but idle and iowait.
                let total: u64 = v.iter().take(8).sum();
                Some(total - v.get(3).copied().unwrap_or(0) - v.get(4).copied().unwrap_or(0))
            })
            .unwrap_or(0);
        CpuClock { busy_ticks }
    }

    /// CPU milliseconds spent since `self`, per one of `n` operations.
    pub(super) fn ms_per(&self, n: f64) -> f64 {
        // USER_HZ is 100 on Linux.
        let ticks = CpuClock::now().busy_ticks.saturating_sub(self.busy_ticks);
        let ms = f64::from(u32::try_from(ticks).unwrap_or(u32::MAX)) * 10.0;
        ms / n.max(1.0)
    }
}

/// A throughput with the CPU it cost.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    per_s: f64,
    cpu_ms: f64,
}

impl Rate {
    fn show(&self) -> String {
        format!("{:.0}/s ({:.2} ms CPU each)", self.per_s, self.cpu_ms)
    }
}

/// One line of the summary.
struct Target {
    /// The target's number (the flat-cost round's), or `G1`.. for the grant path's.
    label: String,
    what: String,
    measured: String,
    ratio: f64,
    goal: String,
    met: bool,
}

/// The summary table, printed at the end of the run.
#[derive(Default)]
pub(super) struct Targets {
    rows: Vec<Target>,
}

impl Targets {
    /// A ratio that must reach `goal`.
    pub(super) fn at_least(
        &mut self,
        label: impl std::fmt::Display,
        what: &str,
        measured: String,
        ratio: f64,
        goal: f64,
    ) {
        self.push(
            label.to_string(),
            what,
            measured,
            ratio,
            format!("≥ {goal}×"),
            ratio >= goal,
        );
    }

    /// `rate` ÷ `against`, which must reach `goal`; both shown with their CPU.
    fn rates_at_least(
        &mut self,
        label: impl std::fmt::Display,
        what: &str,
        rate: &Rate,
        against: &Rate,
        goal: f64,
    ) {
        self.at_least(
            label,
            what,
            format!("{} vs {}", rate.show(), against.show()),
            ratio(rate.per_s, against.per_s),
            goal,
        );
    }

    /// A ratio that must stay within `goal`.
    pub(super) fn at_most(
        &mut self,
        label: impl std::fmt::Display,
        what: &str,
        measured: String,
        ratio: f64,
        goal: f64,
    ) {
        self.push(
            label.to_string(),
            what,
            measured,
            ratio,
            format!("≤ {goal}×"),
            ratio <= goal,
        );
    }

    fn push(
        &mut self,
        label: String,
        what: &str,
        measured: String,
        ratio: f64,
        goal: String,
        met: bool,
    ) {
        self.rows.push(Target {
            label,
            what: what.to_string(),
            measured,
            ratio,
            goal,
            met,
        });
    }

    /// A figure the run reports rather than a ratio with a goal.
    pub(super) fn reported(&mut self, label: impl std::fmt::Display, what: &str, measured: String) {
        self.push(
            label.to_string(),
            what,
            measured,
            f64::NAN,
            "reported".to_string(),
            true,
        );
    }

    pub(super) fn print(&self, report: &mut Report) {
        report.line("\n## Targets (ratios within this run; G: the grant path's)");
        report.line("| # | target | measured | ratio | goal | met |\n|---:|---|---|---:|---|---|");
        for t in &self.rows {
            let ratio = if t.ratio.is_nan() {
                String::new()
            } else {
                format!("{:.2}×", t.ratio)
            };
            report.line(format!(
                "| {} | {} | {} | {ratio} | {} | {} |",
                t.label,
                t.what,
                t.measured,
                t.goal,
                if t.met { "met" } else { "**not met**" }
            ));
        }
    }
}

/// A backlog: `rows` requests, request `i` on `semaphores[i % len]` at `priorities[i % len]`,
/// inserted in one statement.
struct Backlog<'a> {
    rows: i64,
    semaphores: &'a [String],
    priorities: &'a [i16],
}

/// What a drain measured.
struct Drained {
    all: Rate,
    /// Grants per second of the first and of the last 10% of the backlog.
    first_tenth: f64,
    last_tenth: f64,
}

/// Queues `backlog` under `prefix`, then drains it with `workers` workers.
async fn drain(
    url: &str,
    conn: &tokio_postgres::Client,
    backlog: &Backlog<'_>,
    workers: u16,
) -> Result<Drained> {
    let prefix = format!("d{}-", tag());
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, priority)
         SELECT $1::text || i, jsonb_build_object(($2::text[])[1 + i % cardinality($2::text[])], 1),
                ($3::int2[])[1 + i % cardinality($3::int2[])]
         FROM generate_series(1, $4::int8) i",
        &[
            &prefix,
            &backlog.semaphores,
            &backlog.priorities,
            &backlog.rows,
        ],
    )
    .await?;
    conn.batch_execute("ANALYZE permitq.permit_request").await?;
    let since = db_now(conn).await?;
    let cpu = CpuClock::now();
    let running = fleet(url, workers, &format!("bench-{prefix}"))?;
    let started = Instant::now();
    loop {
        // The pending index only: cheap beside the drain.
        let waiting: i64 = conn
            .query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE state = 'new'",
                &[],
            )
            .await?
            .get(0);
        if waiting == 0 {
            break;
        }
        if started.elapsed() > Duration::from_secs(600) {
            return Err(CliError::runtime(format!(
                "{waiting} requests of {prefix} still waiting after 10 minutes"
            )));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let n = f64::from(u32::try_from(backlog.rows).unwrap_or(u32::MAX));
    let cpu_ms = cpu.ms_per(n);
    stop(running).await;
    let times: Vec<f64> = conn
        .query(
            "SELECT extract(epoch FROM acquired_at)::float8 FROM permitq.permit_request
             WHERE external_id LIKE $1 AND acquired_at IS NOT NULL ORDER BY acquired_at",
            &[&format!("{prefix}%")],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let start = since
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let tenth = times.len() / 10;
    let (Some(last), true) = (times.last(), tenth > 0) else {
        return Err(CliError::runtime(format!("{prefix}: nothing was granted")));
    };
    let per =
        |from: f64, to: f64| f64::from(u32::try_from(tenth).unwrap_or(0)) / (to - from).max(1e-6);
    Ok(Drained {
        all: Rate {
            per_s: times.len() as f64 / (last - start).max(1e-6),
            cpu_ms,
        },
        first_tenth: per(start, times[tenth - 1]),
        last_tenth: per(times[times.len() - tenth - 1], *last),
    })
}

/// Full cycles by `clients` producers on `semaphore` with `workers` workers.
async fn cycles(
    url: &str,
    client: &Client,
    semaphore: &str,
    clients: usize,
    workers: u16,
    duration: Duration,
) -> Result<Rate> {
    let cpu = CpuClock::now();
    let per_s = cycle_run(url, client, clients, workers, duration, |_| {
        (semaphore.to_string(), 0)
    })
    .await?;
    Ok(Rate {
        per_s,
        cpu_ms: cpu.ms_per(per_s * duration.as_secs_f64()),
    })
}

/// Idle submit → acquired: as the producer sees it (the acquire call until the grant is in
/// hand) and on the database's clock (`acquired_at - created_at`, stamped before the commit).
struct IdleLatency {
    producer: Percentiles,
    database: Percentiles,
}

/// Idle submit → acquired on `semaphore`, one request at a time, 2 workers.
async fn idle_latency(
    url: &str,
    client: &Client,
    semaphore: &str,
    requests: u32,
) -> Result<IdleLatency> {
    let conn = permitq_embedded_pg::try_connect(url).await?;
    let workers = fleet(url, 2, &format!("bench-idle-{}", tag()))?;
    let prefix = format!("i{}-", tag());
    for i in 0..10 {
        cycle(client, &format!("{prefix}warm-{i}"), semaphore).await?;
    }
    let measured = format!("{prefix}m-");
    let mut observed = Vec::new();
    for i in 0..requests {
        observed.push(cycle(client, &format!("{measured}{i}"), semaphore).await?);
    }
    stop(workers).await;
    Ok(IdleLatency {
        producer: Percentiles::of(&mut observed),
        database: db_latency(&conn, &measured).await?,
    })
}

/// `url` with its database replaced by `database`.
fn database_url(url: &str, database: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, None), |(b, q)| (b, Some(q)));
    let server = base.rsplit_once('/').map_or(base, |(server, _)| server);
    match query {
        Some(q) => format!("{server}/{database}?{q}"),
        None => format!("{server}/{database}"),
    }
}

/// The parts of the flat-cost run, each selectable with `--only` (`targets` runs them all).
pub(super) const PARTS: [&str; 5] = ["hot", "priorities", "depth", "rate", "templates"];

/// Runs the selected targets' measurements and prints their summary.
pub(super) async fn run(
    url: &str,
    args: &BenchArgs,
    own_cluster: bool,
    report: &mut Report,
    targets: &mut Targets,
) -> Result<()> {
    let run = Run {
        url,
        args,
        client: Client::connect_with_pool_size(url, 18).await?,
        conn: permitq_embedded_pg::try_connect(url).await?,
        t: tag(),
        fresh_databases: own_cluster,
    };
    report.line(format!(
        "\n## Flat cost: measurements (drains of {} requests unless said; CPU of all processes per grant or cycle; each drain the median of {})",
        args.drain_rows, args.repeat
    ));
    let wanted = |part: &str| args.runs("targets") || args.runs(part);
    if wanted("hot") {
        run.hot_semaphore(report, targets).await?;
    }
    if wanted("priorities") {
        run.priorities(report, targets).await?;
    }
    if wanted("depth") {
        run.depth(report, targets).await?;
    }
    if wanted("rate") {
        run.rate_window(report, targets).await?;
    }
    if wanted("templates") {
        run.templates(report, targets).await?;
    }
    Ok(())
}

/// What every part needs.
struct Run<'a> {
    url: &'a str,
    args: &'a BenchArgs,
    client: Client,
    conn: tokio_postgres::Client,
    t: String,
    /// Each drain in a database of its own (the bench's own cluster): the settled rows and dead
    /// tuples one drain leaves behind slow the next, and made earlier figures look like scaling
    /// (or its opposite). On a database named with `--database-url`, drains share it.
    fresh_databases: bool,
}

/// A capacity no drain reaches.
const HUGE: i32 = 1_000_000;

impl Run<'_> {
    /// A new semaphore of capacity [`HUGE`] named after `what`.
    async fn semaphore(&self, what: &str) -> Result<String> {
        let name = format!("t-{what}-{}-{}", self.t, tag());
        self.client.set_capacity(&name, HUGE, Some(true)).await?;
        Ok(name)
    }

    /// The median of `--repeat` drains of `rows` requests over `semaphores` (new ones each time),
    /// by `workers` workers.
    async fn drains(
        &self,
        rows: i64,
        semaphores: usize,
        priorities: &[i16],
        workers: u16,
    ) -> Result<Drained> {
        let mut by_workers = self
            .drains_by_workers(rows, semaphores, priorities, &[workers])
            .await?;
        Ok(by_workers.swap_remove(0))
    }

    /// For each of `workers`, the median of `--repeat` drains as [`Run::drains`] makes them.
    /// Not in rising order of workers: the most first, the order rotated at each repeat.
    async fn drains_by_workers(
        &self,
        rows: i64,
        semaphores: usize,
        priorities: &[i16],
        workers: &[u16],
    ) -> Result<Vec<Drained>> {
        let mut runs: Vec<Vec<Drained>> = workers.iter().map(|_| Vec::new()).collect();
        for repeat in 0..self.args.repeat.max(1) {
            let mut order: Vec<usize> = (0..workers.len()).rev().collect();
            order.rotate_left(usize::try_from(repeat).unwrap_or(0) % workers.len().max(1));
            for i in order {
                let drained = self
                    .drain_once(rows, semaphores, priorities, workers[i])
                    .await?;
                runs[i].push(drained);
            }
        }
        Ok(runs
            .into_iter()
            .map(|mut r| {
                r.sort_by(|a, b| a.all.per_s.total_cmp(&b.all.per_s));
                r.swap_remove(r.len() / 2)
            })
            .collect())
    }

    /// One drain of `rows` requests over `semaphores` new semaphores, by `workers` workers: in a
    /// database of its own, made and migrated for it and dropped after, when the bench runs its
    /// own cluster.
    async fn drain_once(
        &self,
        rows: i64,
        semaphores: usize,
        priorities: &[i16],
        workers: u16,
    ) -> Result<Drained> {
        if !self.fresh_databases {
            let mut names = Vec::new();
            for _ in 0..semaphores {
                names.push(self.semaphore("drain").await?);
            }
            let backlog = Backlog {
                rows,
                semaphores: &names,
                priorities,
            };
            return drain(self.url, &self.conn, &backlog, workers).await;
        }
        let database = format!("permitq_drain_{}", tag());
        self.conn
            .batch_execute(&format!("CREATE DATABASE {database}"))
            .await?;
        let url = database_url(self.url, &database);
        let drained = async {
            let client = Client::connect_with_pool_size(&url, 2).await?;
            client.migrate().await?;
            let mut names = Vec::new();
            for i in 0..semaphores {
                let name = format!("drain-{i}");
                client.set_capacity(&name, HUGE, Some(true)).await?;
                names.push(name);
            }
            let conn = permitq_embedded_pg::try_connect(&url).await?;
            // The new database's catalogs, filled by the migration, vacuumed now and written
            // out: not by autovacuum or a checkpoint during the drain.
            conn.batch_execute("VACUUM ANALYZE").await?;
            conn.batch_execute("CHECKPOINT").await?;
            let backlog = Backlog {
                rows,
                semaphores: &names,
                priorities,
            };
            drain(&url, &conn, &backlog, workers).await
        }
        .await;
        self.conn
            .batch_execute(&format!("DROP DATABASE {database} WITH (FORCE)"))
            .await?;
        drained
    }

    /// Targets 5 and 6: one hot semaphore (capacity 64), and workers on it.
    async fn hot_semaphore(&self, report: &mut Report, targets: &mut Targets) -> Result<()> {
        let (url, args, rows) = (self.url, self.args, self.args.drain_rows);
        let idle_sem = self.semaphore("idle").await?;
        let idle = idle_latency(url, &self.client, &idle_sem, args.requests).await?;
        report.line(format!(
            "idle submit → acquired, as the producer sees it: p50 {:.2} ms, p99 {:.2} ms; database side: p50 {:.2} ms, p99 {:.2} ms",
            idle.producer.p50, idle.producer.p99, idle.database.p50, idle.database.p99
        ));
        let hot = format!("t-hot-{}", self.t);
        self.client.set_capacity(&hot, 64, Some(true)).await?;
        let mut hot_cycles = Vec::new();
        for workers in [1u16, 2, 4] {
            let r = cycles(url, &self.client, &hot, 16, workers, args.duration).await?;
            report.line(format!(
                "full cycle, capacity 64, 16 clients, {workers} workers: {}",
                r.show()
            ));
            hot_cycles.push(r);
        }
        let insert = baselines::insert_rate(url, 16, args.duration).await?;
        report.line(format!(
            "durable single-row INSERT, 16 clients: {insert:.0}/s; two-commit bound {:.0} cycles/s",
            insert / 2.0
        ));
        let where_drained = if self.fresh_databases {
            "each in a database of its own"
        } else {
            "in this database"
        };
        let mut hot_drains = Vec::new();
        let drained = self.drains_by_workers(rows, 1, &[0], &[1, 2, 4]).await?;
        for (workers, r) in [1, 2, 4].iter().zip(drained) {
            report.line(format!(
                "drain, one semaphore, {workers} workers ({where_drained}): {}",
                r.all.show()
            ));
            hot_drains.push(r.all);
        }
        let mut plain = Vec::new();
        for connections in [1, 2] {
            let per_s = baselines::skip_locked_drain(url, rows, connections).await?;
            report.line(format!(
                "plain FOR UPDATE SKIP LOCKED drain, 100 rows per transaction, {connections} connections: {per_s:.0}/s"
            ));
            plain.push(per_s);
        }
        let mut spread = Vec::new();
        let drained = self.drains_by_workers(rows, 64, &[0], &[1, 2, 4]).await?;
        for (workers, r) in [1, 2, 4].iter().zip(drained) {
            report.line(format!(
                "drain over 64 semaphores, {workers} workers ({where_drained}): {}",
                r.all.show()
            ));
            spread.push(r.all);
        }
        for (i, w) in [2u16, 4].iter().enumerate() {
            targets.rates_at_least(
                "G4",
                &format!("workers: hot drain, {w} workers ÷ 1"),
                &hot_drains[i + 1],
                &hot_drains[0],
                0.95,
            );
            targets.rates_at_least(
                "G4",
                &format!("workers: hot full cycle, {w} workers ÷ 1"),
                &hot_cycles[i + 1],
                &hot_cycles[0],
                0.95,
            );
        }
        targets.rates_at_least(
            "G4",
            "workers: drain over 64 semaphores, 2 workers ÷ 1",
            &spread[1],
            &spread[0],
            1.5,
        );
        targets.rates_at_least(
            "G4",
            "workers: drain over 64 semaphores, 4 workers ÷ 2",
            &spread[2],
            &spread[1],
            0.95,
        );
        targets.at_least(
            6,
            "hot: full cycle (16 clients, 2 workers) ÷ two-commit bound",
            format!("{} vs {:.0}/s", hot_cycles[1].show(), insert / 2.0),
            ratio(hot_cycles[1].per_s, insert / 2.0),
            0.25,
        );
        for (i, connections) in [1, 2].iter().enumerate() {
            targets.at_least(
                "G3",
                &format!(
                    "hot: drain ({connections} worker{}) ÷ plain SKIP LOCKED drain ({connections} connection{})",
                    if *connections == 1 { "" } else { "s" },
                    if *connections == 1 { "" } else { "s" }
                ),
                format!("{} vs {:.0}/s", hot_drains[i].show(), plain[i]),
                ratio(hot_drains[i].per_s, plain[i]),
                0.5,
            );
        }
        targets.at_most(
            "G6",
            "hot: idle submit → acquired p50, as the producer sees it (acquire call → grant in hand) ÷ 2 ms",
            format!(
                "{:.2} ms (database side, `acquired_at - created_at`: {:.2} ms)",
                idle.producer.p50, idle.database.p50
            ),
            idle.producer.p50 / 2.0,
            1.0,
        );
        targets.reported(
            7,
            "CPU of every process per cycle or grant, beside each throughput (/proc/stat)",
            format!(
                "{:.2} ms per hot cycle (2 workers), {:.2} ms per drained grant (2 workers)",
                hot_cycles[1].cpu_ms, hot_drains[1].cpu_ms
            ),
        );
        Ok(())
    }

    /// Target 1: the same backlog at priority 0, at priority 1, and over 7 levels.
    async fn priorities(&self, report: &mut Report, targets: &mut Targets) -> Result<()> {
        let rows = self.args.drain_rows;
        let mut by_priority = Vec::new();
        for (label, priorities) in [
            ("every request at priority 0", vec![0i16]),
            ("every request at priority 1", vec![1]),
            ("7 levels, -3..3", vec![-3, -2, -1, 0, 1, 2, 3]),
        ] {
            let r = self.drains(rows, 1, &priorities, 2).await?;
            report.line(format!("drain, {label}, 2 workers: {}", r.all.show()));
            by_priority.push(r.all);
        }
        for (i, what) in [(1, "at priority 1"), (2, "over 7 levels")] {
            targets.rates_at_least(
                1,
                &format!("priorities: {rows} backlog {what} ÷ at priority 0"),
                &by_priority[i],
                &by_priority[0],
                0.8,
            );
        }
        Ok(())
    }

    /// Target 3: a deep drain against a shallow one, and its last tenth against its first.
    async fn depth(&self, report: &mut Report, targets: &mut Targets) -> Result<()> {
        let deep_rows = self.args.deep_rows.max(self.args.drain_rows);
        let small = self.drains(deep_rows / 10, 1, &[0], 2).await?;
        let big = self.drains(deep_rows, 1, &[0], 2).await?;
        report.line(format!(
            "drain of {}: {}; of {deep_rows}: {} (first 10% {:.0}/s, last 10% {:.0}/s)",
            deep_rows / 10,
            small.all.show(),
            big.all.show(),
            big.first_tenth,
            big.last_tenth
        ));
        targets.at_least(
            3,
            &format!("depth: last 10% ÷ first 10% of a {deep_rows} drain"),
            format!("{:.0} vs {:.0}/s", big.last_tenth, big.first_tenth),
            ratio(big.last_tenth, big.first_tenth),
            0.8,
        );
        targets.rates_at_least(
            3,
            &format!("depth: {deep_rows} drain ÷ {} drain", deep_rows / 10),
            &big.all,
            &small.all,
            0.8,
        );
        Ok(())
    }

    /// Target 4: the same drain into an empty one-hour window, and into one that holds the
    /// grants of a deep drain.
    async fn rate_window(&self, report: &mut Report, targets: &mut Targets) -> Result<()> {
        let deep_rows = self.args.deep_rows.max(self.args.drain_rows);
        let rated = vec![format!("t-rate-{}", self.t)];
        self.client
            .set_rate_limit(
                &rated[0],
                1_000_000_000,
                Duration::from_secs(3600),
                Some(true),
            )
            .await?;
        let rows = deep_rows / 10;
        let backlog = |rows| Backlog {
            rows,
            semaphores: &rated,
            priorities: &[0],
        };
        let empty = drain(self.url, &self.conn, &backlog(rows), 2).await?;
        let filling = drain(self.url, &self.conn, &backlog(deep_rows), 2).await?;
        let full = drain(self.url, &self.conn, &backlog(rows), 2).await?;
        report.line(format!(
            "rate-limited (per 1 hour), drain of {rows}: empty window {}; after {} grants in it {} (filling it: {})",
            empty.all.show(),
            deep_rows + rows,
            full.all.show(),
            filling.all.show()
        ));
        targets.rates_at_least(
            4,
            &format!(
                "rate window: grants into a 1-hour window holding {} ÷ empty",
                deep_rows + rows
            ),
            &full.all,
            &empty.all,
            0.8,
        );
        Ok(())
    }

    /// Target 2: idle latency elsewhere with no instances, with 100,000, and with 100,000 and
    /// requests waiting on a full semaphore.
    async fn templates(&self, report: &mut Report, targets: &mut Targets) -> Result<()> {
        let (url, conn, t) = (self.url, &self.conn, &self.t);
        let idle_sem = self.semaphore("idle").await?;
        let none = idle_latency(url, &self.client, &idle_sem, self.args.requests)
            .await?
            .database;
        let template = format!("t-tpl-{t}:*");
        conn.execute(
            "SELECT permitq.set_capacity($1, 1, true, NULL, 200000)",
            &[&template],
        )
        .await?;
        conn.execute(
            "INSERT INTO permitq.semaphore (name, capacity, fair, template)
             SELECT left($1::text, -1) || i, 1, true, $1 FROM generate_series(1, 100000) i",
            &[&template],
        )
        .await?;
        conn.batch_execute("VACUUM ANALYZE permitq.semaphore")
            .await?;
        let instances = idle_latency(url, &self.client, &idle_sem, self.args.requests)
            .await?
            .database;
        let full_sem = format!("t-full-{t}");
        self.client.set_capacity(&full_sem, 1, Some(true)).await?;
        let waiting_prefix = format!("t-wait-{t}-");
        conn.execute(
            "INSERT INTO permitq.permit_request (external_id, permits)
             SELECT $1::text || i, jsonb_build_object($2::text, 1) FROM generate_series(1, 1000) i",
            &[&waiting_prefix, &full_sem],
        )
        .await?;
        let workers = fleet(url, 1, &format!("bench-examine-{t}"))?;
        let started = Instant::now();
        let examined = loop {
            let left: i64 = conn
                .query_one(
                    "SELECT count(*) FROM permitq.permit_request WHERE state = 'new' AND NOT examined",
                    &[],
                )
                .await?
                .get(0);
            if left == 0 || started.elapsed() > Duration::from_secs(60) {
                break left == 0;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        stop(workers).await;
        if !examined {
            return Err(CliError::runtime(
                "1,000 waiters still unexamined after a minute",
            ));
        }
        let waiting = idle_latency(url, &self.client, &idle_sem, self.args.requests)
            .await?
            .database;
        for i in 1..=1000 {
            self.client.release(&format!("{waiting_prefix}{i}")).await?;
        }
        report.line(format!(
            "idle p50 on another semaphore: {:.2} ms with no instances, {:.2} ms with 100,000, {:.2} ms with 100,000 and 1,000 requests waiting on a full semaphore",
            none.p50, instances.p50, waiting.p50
        ));
        targets.at_most(
            2,
            "templates: idle p50 with 100,000 instances ÷ none",
            format!("{:.2} vs {:.2} ms", instances.p50, none.p50),
            ratio(instances.p50, none.p50),
            1.3,
        );
        targets.at_most(
            2,
            "templates: the same, with 1,000 requests waiting elsewhere",
            format!("{:.2} vs {:.2} ms", waiting.p50, none.p50),
            ratio(waiting.p50, none.p50),
            1.3,
        );
        Ok(())
    }
}

/// `a ÷ b`, finite when `b` is 0.
pub(super) fn ratio(a: f64, b: f64) -> f64 {
    a / b.max(1e-9)
}

/// The hot cycle alone (capacity 64, 16 clients, 2 workers), for profiling it: `perf record -a`
/// around `permitq bench --only hot`.
pub(super) async fn hot(url: &str, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let client = Client::connect_with_pool_size(url, 18).await?;
    let hot = format!("t-hot-{}", tag());
    client.set_capacity(&hot, 64, Some(true)).await?;
    let r = cycles(url, &client, &hot, 16, 2, args.duration).await?;
    report.line(format!(
        "\nfull cycle, capacity 64, 16 clients, 2 workers: {}",
        r.show()
    ));
    Ok(())
}
