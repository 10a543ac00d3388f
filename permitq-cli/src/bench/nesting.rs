//! What nested limits cost: full cycles (submit → acquired → release) by 16 clients and 2
//! workers on one semaphore of capacity 64, flat; nested one level deep (a grant also takes from
//! its parent); two levels deep; and one level deep with guarantees (the parent keeps room for
//! three guaranteed siblings, whose rows the batch also locks), side by side in one run. The
//! runs alternate (flat, one, two, guarantees, then backwards, `2 × --repeat` rounds) and each
//! variant's mean counts: drift over the run (a table that grows, a vacuum) falls on all alike.

use permitq::{Client, SemaphoreSettings};

use super::load::cycle_run;
use super::{tag, BenchArgs, Report};
use crate::error::Result;

const CLIENTS: usize = 16;
const WORKERS: u16 = 2;
const CAPACITY: i32 = 64;

pub(super) async fn run(url: &str, args: &BenchArgs, report: &mut Report) -> Result<()> {
    let client = Client::connect_with_pool_size(url, CLIENTS + 2).await?;
    let t = tag();
    let fair = SemaphoreSettings::new().fair(true);
    let in_parent = |parent: &str, guarantee: i32| fair.clone().parent(parent).guarantee(guarantee);
    let flat = format!("nest-flat-{t}");
    client.set_semaphore(&flat, CAPACITY, &fair).await?;
    // One level: child ← parent.
    let (parent1, child1) = (format!("nest-p1-{t}"), format!("nest-c1-{t}"));
    client.set_semaphore(&parent1, CAPACITY, &fair).await?;
    client
        .set_semaphore(&child1, CAPACITY, &in_parent(&parent1, 0))
        .await?;
    // Two levels: child ← middle ← root.
    let (root, middle, child2) = (
        format!("nest-r2-{t}"),
        format!("nest-m2-{t}"),
        format!("nest-c2-{t}"),
    );
    client.set_semaphore(&root, CAPACITY, &fair).await?;
    client
        .set_semaphore(&middle, CAPACITY, &in_parent(&root, 0))
        .await?;
    client
        .set_semaphore(&child2, CAPACITY, &in_parent(&middle, 0))
        .await?;
    // One level with guarantees: four children guaranteed 16 each, the load on one of them.
    let parent_g = format!("nest-pg-{t}");
    client.set_semaphore(&parent_g, CAPACITY, &fair).await?;
    for i in 0..4 {
        client
            .set_semaphore(
                &format!("nest-cg{i}-{t}"),
                CAPACITY,
                &in_parent(&parent_g, CAPACITY / 4),
            )
            .await?;
    }
    let guaranteed = format!("nest-cg0-{t}");

    let d = args.duration;
    let variants = [&flat, &child1, &child2, &guaranteed];
    let mut rates = [0.0f64; 4];
    let rounds = 2 * args.repeat.max(1);
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..variants.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let name = variants[i].clone();
            rates[i] += cycle_run(url, &client, CLIENTS, WORKERS, d, |_| (name.clone(), 0)).await?
                / f64::from(rounds);
        }
    }
    let [base, one, two, kept] = rates;

    report.line(format!(
        "\n## Nested limits: full cycles, {CLIENTS} clients, {WORKERS} workers, capacity {CAPACITY} at every level, mean of {rounds} alternating runs"
    ));
    report.line("| semaphores | cycles/s | flat ÷ this | per level |\n|---|---:|---:|---:|");
    let row = |what: &str, rate: f64, levels: i32| {
        let slower = base / rate.max(1e-9);
        let per_level = if levels > 0 {
            format!("{:.2}×", slower.powf(1.0 / f64::from(levels)))
        } else {
            "-".to_string()
        };
        format!("| {what} | {rate:.0} | {slower:.2}× | {per_level} |")
    };
    report.line(row("flat: one semaphore", base, 0));
    report.line(row("one level: a child and its parent", one, 1));
    report.line(row("two levels: a child, its parent and theirs", two, 2));
    report.line(row(
        "one level, with guarantees: a child among four guaranteed siblings",
        kept,
        1,
    ));
    Ok(())
}
