//! Adaptive capacity against a simulated downstream, in process: a service whose latency is its
//! base while at most C calls run at once, and rises with the square of the excess past C (a
//! server with C workers and a queue that slows as it grows), and which answers "overloaded" at
//! once past 1.5 C. Holders acquire a permit of one semaphore, call it with a timeout of 1.5×
//! the base latency, and release reporting `ok` with the call's latency, or `overloaded` (a
//! timeout or the service's answer). Measured: goodput (`ok` calls per second) at
//! fixed capacities (a sweep: the best one is the reference), and for each algorithm, from a
//! start of 2 and of 50, when the capacity reaches and stays within ±25% of C, and its goodput
//! after that; then C doubled, and C halved, mid-run, and when each algorithm follows.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use permitq::{AdaptiveLimit, Algorithm, Client, Outcome, Request, WorkerConfig};

use super::{tag, BenchArgs, Report};
use crate::error::Result;

/// The downstream's true capacity.
const C: usize = 12;
/// Its latency with room.
const BASE: Duration = Duration::from_millis(40);
/// The holders' timeout: a call that would take longer is given up and reported overloaded.
const TIMEOUT: Duration = Duration::from_millis(60);
/// Holders calling it at once: more than 1.5 C, so that a capacity past it overloads it.
const HOLDERS: usize = 40;
/// The machines they run on: each a [`Client`] (one listener, a pool) shared by
/// `HOLDERS / MACHINES` holders, as a service's callers share its client.
const MACHINES: usize = 4;
/// The workers' cadence in this bench.
const CADENCE: Duration = Duration::from_millis(250);
/// How long each adaptive run lasts, and each fixed capacity of the sweep.
const RUN: Duration = Duration::from_secs(40);
const SWEEP_STEP: Duration = Duration::from_secs(8);

/// The simulated service: calls in flight, and its capacity (changed mid-run).
struct Downstream {
    in_flight: AtomicUsize,
    capacity: AtomicUsize,
    ok: AtomicI64,
}

impl Downstream {
    /// One call: its outcome and latency.
    async fn call(&self) -> (Outcome, Duration) {
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        let c = self.capacity.load(Ordering::Relaxed);
        let result = if n * 2 > c * 3 {
            tokio::time::sleep(Duration::from_millis(2)).await;
            (Outcome::Overloaded, Duration::from_millis(2))
        } else {
            #[allow(clippy::cast_precision_loss)]
            let factor = (n as f64 / c as f64).max(1.0).powi(2);
            let latency = BASE.mul_f64(factor);
            if latency > TIMEOUT {
                tokio::time::sleep(TIMEOUT).await;
                (Outcome::Overloaded, TIMEOUT)
            } else {
                tokio::time::sleep(latency).await;
                self.ok.fetch_add(1, Ordering::Relaxed);
                (Outcome::Ok, latency)
            }
        };
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        result
    }
}

/// One run's samples: (seconds since start, capacity), and the `ok` calls per second over its
/// last `tail`.
struct Trace {
    samples: Vec<(f64, i32)>,
    goodput_tail: f64,
}

impl Trace {
    /// The capacity every 2 s: `2 5 9 12 13 12`.
    fn every_2s(&self) -> String {
        self.samples
            .iter()
            .step_by(8)
            .map(|s| s.1.to_string())
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// When the capacity first entered `band` (seconds after `from`), and the share of the
    /// samples from then on that stayed in it.
    fn reached(&self, band: &std::ops::RangeInclusive<i32>, from: f64) -> Option<(f64, f64)> {
        let after: Vec<&(f64, i32)> = self.samples.iter().filter(|(t, _)| *t >= from).collect();
        let first = after.iter().position(|(_, c)| band.contains(c))?;
        let rest = &after[first..];
        #[allow(clippy::cast_precision_loss)]
        let share =
            rest.iter().filter(|(_, c)| band.contains(c)).count() as f64 / rest.len() as f64;
        Some((after[first].0 - from, share))
    }

    /// When the capacity entered `band` for good (seconds), if it did.
    fn settled(&self, band: std::ops::RangeInclusive<i32>, from: f64) -> Option<f64> {
        let mut since = None;
        for &(t, c) in self.samples.iter().filter(|(t, _)| *t >= from) {
            match (band.contains(&c), since) {
                (true, None) => since = Some(t),
                (false, _) => since = None,
                _ => {}
            }
        }
        since.map(|s| s - from)
    }
}

/// Runs the holders for `length` against `downstream` on semaphore `name`, sampling its capacity
/// every 250 ms; `change` sets C to a new value at that moment.
async fn drive(
    url: &str,
    name: &str,
    downstream: &Arc<Downstream>,
    length: Duration,
    tail: Duration,
    change: Option<(Duration, usize)>,
) -> Result<Trace> {
    let started = Instant::now();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    let mut machines = Vec::new();
    for _ in 0..MACHINES {
        machines.push(Client::connect_with_pool_size(url, HOLDERS / MACHINES + 1).await?);
    }
    for h in 0..HOLDERS {
        let (client, name, downstream, stop) = (
            machines[h % MACHINES].clone(),
            name.to_string(),
            downstream.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let request = Request::new(format!("{name}-{h}-{i}")).permit(&name, 1);
                let Ok(lease) = client.acquire(&request, Duration::from_secs(30)).await else {
                    continue;
                };
                let (outcome, latency) = downstream.call().await;
                lease.release_reporting(outcome, Some(latency)).await?;
            }
            Ok::<(), permitq::Error>(())
        }));
    }
    let conn = permitq_embedded_pg::try_connect(url).await?;
    let mut samples = Vec::new();
    let mut ok_at_tail = None;
    let mut changed = false;
    while started.elapsed() < length {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let t = started.elapsed();
        if let Some((at, to)) = change {
            if t >= at && !changed {
                downstream.capacity.store(to, Ordering::Relaxed);
                changed = true;
            }
        }
        if ok_at_tail.is_none() && t >= length - tail {
            ok_at_tail = Some((downstream.ok.load(Ordering::Relaxed), t));
        }
        let capacity: i32 = conn
            .query_one(
                "SELECT capacity FROM permitq.semaphore WHERE name = $1",
                &[&name],
            )
            .await?
            .get(0);
        samples.push((t.as_secs_f64(), capacity));
    }
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await
            .map_err(|e| crate::error::CliError::runtime(format!("a holder task failed: {e}")))??;
    }
    let (ok_then, at) = ok_at_tail.unwrap_or((0, Duration::ZERO));
    #[allow(clippy::cast_precision_loss)]
    let goodput_tail = (downstream.ok.load(Ordering::Relaxed) - ok_then) as f64
        / (started.elapsed() - at).as_secs_f64();
    Ok(Trace {
        samples,
        goodput_tail,
    })
}

fn downstream() -> Arc<Downstream> {
    Arc::new(Downstream {
        in_flight: AtomicUsize::new(0),
        capacity: AtomicUsize::new(C),
        ok: AtomicI64::new(0),
    })
}

/// One run of `algorithm` on a new semaphore `name` starting at `start` (floor 1, ceiling
/// 100), against a fresh downstream for `length`, its goodput over the last 15 s; `change` as
/// [`drive`] takes it.
async fn adaptive_run(
    client: &Client,
    url: &str,
    name: &str,
    algorithm: Algorithm,
    start: i32,
    length: Duration,
    change: Option<(Duration, usize)>,
) -> Result<Trace> {
    client.set_capacity(name, start, None).await?;
    client
        .set_adaptive(name, Some(&AdaptiveLimit::new(algorithm, 1, 100)))
        .await?;
    drive(
        url,
        name,
        &downstream(),
        length,
        Duration::from_secs(15),
        change,
    )
    .await
}

/// The bench part `adaptive`.
pub(crate) async fn run(url: &str, _args: &BenchArgs, report: &mut Report) -> Result<()> {
    let client = Client::connect(url).await?;
    let mut config = WorkerConfig::default();
    config.maintenance.adaptive_cadence = CADENCE;
    let fleet = permitq_fleet::WorkerFleet::start_with(url, 2, "adaptive", config)?;
    report.line(format!(
        "\n## Adaptive capacity: a simulated downstream (true capacity C = {C}, latency {}ms \
         with room, x (n/C)^2 past it, overloaded past 1.5 C; holders time out after {}ms), {HOLDERS} \
         holders on {MACHINES} machines (a client each), 2 workers, cadence {}ms",
        BASE.as_millis(),
        TIMEOUT.as_millis(),
        CADENCE.as_millis()
    ));
    // The sweep: goodput at fixed capacities; the best is the reference.
    report.line("| fixed capacity | goodput (ok calls/s) |\n|---:|---:|");
    let mut best = 0.0f64;
    for capacity in [6, 9, 12, 15, 18] {
        let name = format!("fixed-{capacity}-{}", tag());
        client.set_capacity(&name, capacity, None).await?;
        let trace = drive(url, &name, &downstream(), SWEEP_STEP, SWEEP_STEP / 2, None).await?;
        best = best.max(trace.goodput_tail);
        report.line(format!("| {capacity} | {:.0} |", trace.goodput_tail));
    }
    report.line(format!(
        "\n| algorithm | start | first within ±25% of C | in it from then on | for good after | goodput, last 15 s | ÷ best fixed ({best:.0}/s) | capacity at the end |\n|---|---:|---:|---:|---:|---:|---:|---:|"
    ));
    let band = |c: usize| {
        #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
        let c = c as i32;
        (c * 3 + 3) / 4..=(c * 5) / 4
    };
    let mut traces = Vec::new();
    for algorithm in [Algorithm::Gradient, Algorithm::Aimd] {
        for start in [2, 50] {
            let name = format!("adaptive-{}-{start}-{}", algorithm.as_str(), tag());
            let trace = adaptive_run(&client, url, &name, algorithm, start, RUN, None).await?;
            let settled = trace.settled(band(C), 0.0);
            let reached = trace.reached(&band(C), 0.0);
            report.line(format!(
                "| {} | {start} | {} | {} | {} | {:.0} | {:.2}× | {} |",
                algorithm.as_str(),
                reached.map_or("never".to_string(), |r| format!("{:.1} s", r.0)),
                reached.map_or("-".to_string(), |r| format!("{:.0}%", r.1 * 100.0)),
                settled.map_or("never".to_string(), |s| format!("{s:.1} s")),
                trace.goodput_tail,
                trace.goodput_tail / best.max(1.0),
                trace.samples.last().map_or(0, |s| s.1)
            ));
            traces.push(format!(
                "{} from {start}, capacity every 2 s: {}",
                algorithm.as_str(),
                trace.every_2s()
            ));
        }
    }
    for t in traces {
        report.line(t);
    }
    // C changed mid-run, doubled and halved, for each algorithm: does it follow?
    let change = Duration::from_secs(20);
    for algorithm in [Algorithm::Gradient, Algorithm::Aimd] {
        for to in [C * 2, C / 2] {
            let name = format!("adaptive-follow-{}-{to}-{}", algorithm.as_str(), tag());
            let length = change + RUN;
            let trace = adaptive_run(
                &client,
                url,
                &name,
                algorithm,
                2,
                length,
                Some((change, to)),
            )
            .await?;
            let followed = trace.settled(band(to), change.as_secs_f64());
            let reached = trace.reached(&band(to), change.as_secs_f64());
            report.line(format!(
                "\n{}, C {} to {to} at {}s: first within ±25% of it {} after ({} of the time from \
                 then on), for good {} after; capacity at the end {}",
                algorithm.as_str(),
                if to > C { "doubled" } else { "halved" },
                change.as_secs(),
                reached.map_or("never".to_string(), |r| format!("{:.1} s", r.0)),
                reached.map_or("-".to_string(), |r| format!("{:.0}%", r.1 * 100.0)),
                followed.map_or("never".to_string(), |s| format!("{s:.1} s")),
                trace.samples.last().map_or(0, |s| s.1)
            ));
            report.line(format!("capacity every 2 s: {}", trace.every_2s()));
        }
    }
    fleet.stop().await;
    Ok(())
}
