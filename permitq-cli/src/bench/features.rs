//! What templates, rate limits and priorities cost: full cycles (submit → acquired → release) by
//! 16 clients and 2 workers on a plain semaphore, on per-key instances of a template (one key per
//! client, made on first use), on a rate-limited semaphore whose limit never binds (every grant
//! is logged and counted in its window), and on a semaphore of capacity 8 (so that requests
//! queue) with every priority 0 and with priorities from -3 to 3, side by side in one run.

use std::time::Duration;

use permitq::Client;

use super::load::cycle_run;
use super::{tag, BenchArgs, Report};
use crate::error::Result;

const CLIENTS: usize = 16;
const WORKERS: u16 = 2;

pub(super) async fn run(url: &str, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let client = Client::connect_with_pool_size(url, CLIENTS + 2).await?;
    let t = tag();
    let plain = format!("feat-plain-{t}");
    client.set_capacity(&plain, 64, Some(true)).await?;
    let template = format!("feat-key-{t}:*");
    client.set_capacity(&template, 4, Some(true)).await?;
    let rated = format!("feat-rate-{t}");
    let window = Duration::from_secs(60);
    client
        .set_rate_limit(&rated, 1_000_000_000, window, Some(true))
        .await?;

    let d = args.duration;
    let queued = format!("feat-queue-{t}");
    client.set_capacity(&queued, 8, Some(true)).await?;

    let base = cycle_run(url, &client, CLIENTS, WORKERS, d, |_| (plain.clone(), 0)).await?;
    let keyed = cycle_run(url, &client, CLIENTS, WORKERS, d, |c| {
        (format!("feat-key-{t}:{c}"), 0)
    })
    .await?;
    let limited = cycle_run(url, &client, CLIENTS, WORKERS, d, |_| (rated.clone(), 0)).await?;
    let fifo = cycle_run(url, &client, CLIENTS, WORKERS, d, |_| (queued.clone(), 0)).await?;
    let ranked = cycle_run(url, &client, CLIENTS, WORKERS, d, |c| {
        let priority = i16::try_from(c % 7).unwrap_or(0) - 3;
        (queued.clone(), priority)
    })
    .await?;
    let in_window = client
        .usage()
        .await?
        .into_iter()
        .find(|u| u.name == rated)
        .map_or(0, |u| u.in_window);

    report.line(format!(
        "\n## Templates, rate limits and priorities: full cycles, {CLIENTS} clients, {WORKERS} workers"
    ));
    report.line("| semaphores | cycles/s | ÷ plain |\n|---|---:|---:|");
    report.line(format!(
        "| one plain semaphore (capacity 64) | {base:.0} | 1.00× |"
    ));
    report.line(format!(
        "| a template, one instance per client (capacity 4 each, made on first use) | {keyed:.0} | {:.2}× |",
        keyed / base.max(1e-9)
    ));
    report.line(format!(
        "| one rate-limited semaphore, limit never reached (per {}) | {limited:.0} | {:.2}× |",
        humantime::format_duration(window),
        limited / base.max(1e-9)
    ));
    report.line(format!(
        "| capacity 8 (requests queue), every priority 0 | {fifo:.0} | {:.2}× |",
        fifo / base.max(1e-9)
    ));
    report.line(format!(
        "| capacity 8 (requests queue), priorities -3..3 (7 levels) | {ranked:.0} | {:.2}× ({:.2}× the same queue at priority 0) |",
        ranked / base.max(1e-9),
        ranked / fifo.max(1e-9)
    ));
    report.line(format!(
        "A rate-limited semaphore's decision sums the grants in its window ({in_window} at the end of its run): \
         the cost grows with grants per window, not with the backlog."
    ));
    Ok(())
}
