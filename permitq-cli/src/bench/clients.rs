//! The producer clients side by side: idle acquire latency (from the `acquire` call until the
//! lease is in hand; each cycle releases it) of the Python and TypeScript clients beside the Rust
//! client's, one request at a time, 2 workers. Each runs from this clone's `clients/` folder: a
//! client whose runtime is missing (Python with psycopg, Node with `clients/typescript`'s
//! dependencies installed) is reported as not measured, with what to install.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use permitq::{Client, Request};
use permitq_fleet::Percentiles;

use super::targets::{ratio, Targets};
use super::{fleet, ms, stop, tag, BenchArgs, Report};
use crate::error::{CliError, Result};

/// Cycles before the measured ones (connections, plans).
const WARM_UP: u32 = 10;

/// The Python client's cycles: prints each one's latency in ms.
const PYTHON: &str = r#"
import os, time, uuid
import permitq
sem, n, warm = os.environ["SEM"], int(os.environ["N"]), int(os.environ["WARM"])
lat = []
with permitq.Client(os.environ["DATABASE_URL"]) as client:
    for i in range(warm + n):
        started = time.perf_counter()
        lease = client.acquire(f"py-{uuid.uuid4().hex[:12]}", {sem: 1}, timeout=30)
        took = (time.perf_counter() - started) * 1000
        lease.release()
        if i >= warm:
            lat.append(took)
print(" ".join(f"{x:.4f}" for x in lat))
"#;

/// The TypeScript client's cycles (its build, `dist/`): prints each one's latency in ms.
const NODE: &str = r#"
const { Client } = await import(process.env.CLIENT_MODULE);
const [sem, n, warm] = [process.env.SEM, Number(process.env.N), Number(process.env.WARM)];
const client = new Client({ connectionString: process.env.DATABASE_URL });
const lat = [];
for (let i = 0; i < warm + n; i++) {
  const started = performance.now();
  const lease = await client.acquire(`ts-${process.pid}-${i}-${Date.now()}`, { [sem]: 1 }, { timeoutMs: 30_000 });
  const took = performance.now() - started;
  await lease.release();
  if (i >= warm) lat.push(took);
}
await client.end();
console.log(lat.join(" "));
"#;

/// This clone's `clients/` folder, if the binary runs from one.
fn clients_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients");
    dir.canonicalize().ok()
}

/// A Python with psycopg: `$PERMITQ_PYTHON`, else `/usr/bin/python3`, else `python3`.
fn python() -> Option<String> {
    std::env::var("PERMITQ_PYTHON")
        .ok()
        .filter(|p| !p.is_empty())
        .into_iter()
        .chain(["/usr/bin/python3".to_string(), "python3".to_string()])
        .find(|p| {
            Command::new(p)
                .args(["-c", "import psycopg"])
                .stdin(Stdio::null())
                .output()
                .is_ok_and(|o| o.status.success())
        })
}

/// Runs a client's cycles, off the runtime's threads; the percentiles of what it printed.
async fn run_cycles(mut command: Command) -> Result<Percentiles> {
    let out = tokio::task::spawn_blocking(move || command.stdin(Stdio::null()).output())
        .await
        .map_err(|e| CliError::runtime(e.to_string()))??;
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() {
        return Err(CliError::runtime(format!(
            "a client's bench run failed: {printed}{}",
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut numbers: Vec<f64> = printed
        .split_whitespace()
        .filter_map(|n| n.parse().ok())
        .collect();
    if numbers.is_empty() {
        return Err(CliError::runtime(format!(
            "a client's bench run printed {printed:?}, not its latencies"
        )));
    }
    Ok(Percentiles::of(&mut numbers))
}

/// The Rust client's cycles, as the others run theirs.
async fn rust_cycles(url: &str, semaphore: &str, n: u32) -> Result<Percentiles> {
    let client = Client::connect(url).await?;
    let mut lat = Vec::new();
    for i in 0..WARM_UP + n {
        let started = Instant::now();
        let lease = client
            .acquire(
                &Request::new(format!("rs-{}-{i}", tag())).permit(semaphore, 1),
                Duration::from_secs(30),
            )
            .await?;
        let took = started.elapsed().as_secs_f64() * 1000.0;
        lease.release().await?;
        if i >= WARM_UP {
            lat.push(took);
        }
    }
    Ok(Percentiles::of(&mut lat))
}

/// Measures each client and adds the targets.
pub(super) async fn run(
    url: &str,
    args: &BenchArgs,
    report: &mut Report,
    targets: &mut Targets,
) -> Result<()> {
    let n = args.requests.min(300);
    let client = Client::connect(url).await?;
    let semaphore = format!("clients-{}", tag());
    client
        .set_capacity(&semaphore, 1_000_000, Some(true))
        .await?;
    let workers = fleet(url, 2, &format!("bench-clients-{}", tag()))?;
    let result = measure(url, &semaphore, n).await;
    stop(workers).await;
    let (rust, others) = result?;
    report.line(format!(
        "\n## Clients: idle acquire (call → lease in hand), {n} one at a time, 2 workers"
    ));
    report.line("| client | p50 / p99 ms | p50 ÷ Rust's |\n|---|---:|---:|");
    report.line(format!("| Rust | {} | 1.00× |", ms(rust)));
    for (name, measured) in others {
        match measured {
            Ok(p) => {
                let vs_rust = ratio(p.p50, rust.p50);
                report.line(format!("| {name} | {} | {vs_rust:.2}× |", ms(p)));
                targets.at_most(
                    "C",
                    &format!("clients: {name} idle acquire p50 ÷ the Rust client's"),
                    format!("{:.2} vs {:.2} ms", p.p50, rust.p50),
                    vs_rust,
                    1.5,
                );
            }
            Err(why) => report.line(format!("| {name} | not measured: {why} | |")),
        }
    }
    Ok(())
}

/// The Rust client's figures, then each other client's (or why it was not measured).
async fn measure(
    url: &str,
    semaphore: &str,
    n: u32,
) -> Result<(
    Percentiles,
    Vec<(&'static str, std::result::Result<Percentiles, String>)>,
)> {
    let rust = rust_cycles(url, semaphore, n).await?;
    let Some(dir) = clients_dir() else {
        let why = "run the bench from a clone of permitq (its clients/ folder)".to_string();
        return Ok((
            rust,
            vec![("Python", Err(why.clone())), ("TypeScript", Err(why))],
        ));
    };
    let envs = [
        ("DATABASE_URL", url.to_string()),
        ("SEM", semaphore.to_string()),
        ("N", n.to_string()),
        ("WARM", WARM_UP.to_string()),
    ];
    let python = match python() {
        None => Err("no Python with psycopg 3 (pip install ./clients/python)".to_string()),
        Some(python) => {
            let mut command = Command::new(python);
            command
                .args(["-c", PYTHON])
                .env("PYTHONPATH", dir.join("python"))
                .envs(envs.clone());
            run_cycles(command).await.map_err(|e| e.to_string())
        }
    };
    let ts = dir.join("typescript");
    let node = if ts.join("node_modules/pg").is_dir() {
        let mut command = Command::new("node");
        command
            .args(["--input-type=module", "-e", NODE])
            .env(
                "CLIENT_MODULE",
                format!("file://{}", ts.join("dist/index.js").display()),
            )
            .envs(envs);
        run_cycles(command).await.map_err(|e| e.to_string())
    } else {
        Err("its dependencies are not installed (npm ci in clients/typescript)".to_string())
    };
    Ok((rust, vec![("Python", python), ("TypeScript", node)]))
}
