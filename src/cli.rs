//! The `permitq` command line: a thin layer over [`crate::Client`] and [`crate::Worker`].
//!
//! Exit codes: 0 success; 1 runtime error (one line on stderr); 2 usage error (including input
//! the database rejects as invalid, SQLSTATE 22023); 3 `submit --await` ended in `error`, or
//! `heartbeat` found the lease lost; 4 `submit --await` still `new` when the await ran out.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::error::{Error, Result, SqlState};
use crate::types::{PermitRequest, Request, State};
use crate::{Client, Worker, WorkerConfig};

/// Exit code: runtime error.
pub const EXIT_RUNTIME: u8 = 1;
/// Exit code: usage error.
pub const EXIT_USAGE: u8 = 2;
/// Exit code: the request ended in `error` (or the lease is lost).
pub const EXIT_NOT_GRANTED: u8 = 3;
/// Exit code: still `new` when `--await` ran out.
pub const EXIT_STILL_WAITING: u8 = 4;

/// permitq: a distributed counting semaphore served through a PostgreSQL work queue.
#[derive(Debug, Parser)]
#[command(name = "permitq", version, about, propagate_version = true)]
pub struct Cli {
    /// PostgreSQL URL, e.g. postgres://user:pass@host:5432/db.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the schema (safe to run twice, or concurrently).
    Migrate,
    /// Run a worker until SIGINT/SIGTERM.
    Worker(WorkerArgs),
    /// Manage semaphores.
    #[command(subcommand)]
    Semaphore(SemaphoreCommand),
    /// Submit a permit request: permitq submit ID NAME=COUNT... [--await [DUR]].
    Submit(SubmitArgs),
    /// Show a request.
    Status {
        /// The request's external_id.
        external_id: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Release a held request (or cancel a waiting one).
    Release {
        /// The request's external_id.
        external_id: String,
    },
    /// Operator: take a held request's permits away (release_reason = revoked).
    Revoke {
        /// The request's external_id.
        external_id: String,
    },
    /// Extend a held request's lease; exits 3 when the lease is lost.
    Heartbeat {
        /// The request's external_id.
        external_id: String,
        /// New lease length from now (default: the request's ttl).
        #[arg(long, value_parser = parse_duration)]
        extend: Option<Duration>,
    },
    /// Run the whole system on an embedded default: a throwaway PostgreSQL when DATABASE_URL
    /// is unset, several workers, simulated producers and holders, a live view and a summary.
    Demo(crate::demo::DemoArgs),
    /// Measure submit → acquired latency on an idle system, and throughput under load.
    Bench(crate::bench::BenchArgs),
    /// Fault-injection run with a history checker (its own throwaway PostgreSQL). Exits 1 when
    /// any checker finds a violation.
    Chaos(ChaosArgs),
    /// Holder process of the chaos pause-holder fault (internal).
    #[command(hide = true)]
    ChaosHolder {
        /// The request's external_id.
        external_id: String,
    },
}

/// `permitq chaos` options.
#[derive(Debug, Args)]
pub struct ChaosArgs {
    /// How long the load runs.
    #[arg(long, default_value = "2m", value_parser = parse_duration)]
    pub duration: Duration,
    /// Seeds the load and the fault schedule.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Worker processes.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub workers: u16,
    /// Concurrent clients.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..=200))]
    pub clients: u16,
    /// The workers' --sweep-interval.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// Time between faults.
    #[arg(long, default_value = "8s", value_parser = parse_duration)]
    pub fault_every: Duration,
    /// Run the load without faults.
    #[arg(long)]
    pub no_faults: bool,
    /// Plant a known bug (no-semaphore-lock, sweep-without-lock, double-release, skip-fairness).
    #[arg(long)]
    pub mutation: Option<crate::chaos::Mutation>,
}

/// `permitq worker` options.
#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Requests claimed per transaction.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=10000))]
    pub batch_size: i64,
    /// Fallback pass interval when no notification arrives.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub poll_interval: Duration,
    /// How often leases, wait deadlines and --max-hold are enforced.
    #[arg(long, default_value = "1s", value_parser = parse_duration)]
    pub sweep_interval: Duration,
    /// Release anything held longer than this (release_reason = stale). Off by default.
    #[arg(long, value_parser = parse_duration)]
    pub max_hold: Option<Duration>,
    /// Delete settled requests older than this, in small batches.
    #[arg(long, default_value = "7d", value_parser = parse_duration)]
    pub retention: Duration,
    /// Delete capacity audit rows older than this.
    #[arg(long, default_value = "30d", value_parser = parse_duration)]
    pub audit_retention: Duration,
    /// Serve Prometheus metrics on HOST:PORT (GET /metrics).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Worker name (logs, worker_id, application_name).
    #[arg(long)]
    pub id: Option<String>,
}

impl WorkerArgs {
    /// The worker configuration these options describe.
    pub fn config(&self) -> WorkerConfig {
        let default = WorkerConfig::default();
        WorkerConfig {
            id: self.id.clone().unwrap_or(default.id),
            batch_size: self.batch_size,
            poll_interval: self.poll_interval,
            sweep_interval: self.sweep_interval,
            max_hold: self.max_hold,
            retention: self.retention,
            audit_retention: self.audit_retention,
            lock_timeout: default.lock_timeout,
        }
    }
}

/// `permitq semaphore ...`
#[derive(Debug, Subcommand)]
pub enum SemaphoreCommand {
    /// Create a semaphore or change its capacity (and fairness).
    Set {
        /// Name.
        name: String,
        /// How many permits may be held at once.
        capacity: i32,
        /// Strict FIFO with safe backfill (the default for new semaphores).
        #[arg(long, conflicts_with = "greedy")]
        fair: bool,
        /// Any request that fits may go first.
        #[arg(long)]
        greedy: bool,
    },
    /// List semaphores with capacity and use.
    List {
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Show the capacity audit of a semaphore.
    History {
        /// Name.
        name: String,
        /// Print a JSON array.
        #[arg(long)]
        json: bool,
    },
}

/// `permitq submit` options.
#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// Idempotency key chosen by you (1..255 characters).
    pub external_id: String,
    /// What to acquire, all or nothing: NAME=COUNT, one or more.
    #[arg(required = true, value_parser = parse_permit)]
    pub permits: Vec<(String, i64)>,
    /// Who will hold it.
    #[arg(long)]
    pub owner: Option<String>,
    /// Lease length once granted (heartbeat to extend).
    #[arg(long, value_parser = parse_duration)]
    pub ttl: Option<Duration>,
    /// How long it may wait for capacity (0 = fail fast; default forever).
    #[arg(long, value_parser = parse_duration)]
    pub wait: Option<Duration>,
    /// Wait for the outcome, up to DUR (default: until it settles). Exit 0 acquired, 3 error,
    /// 4 still waiting.
    #[arg(long = "await", value_name = "DUR", num_args = 0..=1, default_missing_value = "forever",
          value_parser = parse_await)]
    pub await_for: Option<Duration>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 250ms, 30s, 5m)"))
}

fn parse_await(s: &str) -> std::result::Result<Duration, String> {
    if s == "forever" {
        return Ok(Duration::from_secs(100 * 365 * 24 * 3600));
    }
    parse_duration(s)
}

fn parse_permit(s: &str) -> std::result::Result<(String, i64), String> {
    let (name, count) = s
        .split_once('=')
        .ok_or_else(|| format!("expected NAME=COUNT, got {s:?}"))?;
    if name.is_empty() {
        return Err(format!("empty semaphore name in {s:?}"));
    }
    match count.parse::<i64>() {
        Ok(c) if (1..=i32::MAX as i64).contains(&c) => Ok((name.to_string(), c)),
        _ => Err(format!(
            "count must be an integer from 1 to 2147483647, got {count:?}"
        )),
    }
}

/// Parses arguments, runs, and maps the outcome to an exit code. Never panics on any input.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { 0 });
        }
    };
    let default_filter = match cli.command {
        Command::Worker(_) => "permitq=info",
        Command::Chaos(_) => "permitq=error",
        _ => "permitq=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("permitq: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_RUNTIME);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("permitq: {}", one_line(&e.to_string()));
            let usage =
                e.invalid_field().is_some() || e.code() == Some(&SqlState::INVALID_PARAMETER_VALUE);
            ExitCode::from(if usage { EXIT_USAGE } else { EXIT_RUNTIME })
        }
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

async fn run(cli: Cli) -> Result<u8> {
    let url = cli.database_url;
    let need_url = || {
        url.clone().ok_or_else(|| {
            Error::invalid(
                "database-url",
                "no database: pass --database-url or set DATABASE_URL",
            )
        })
    };
    match cli.command {
        Command::Demo(args) => crate::demo::run(url.as_deref(), args).await.map(|_| 0),
        Command::Bench(args) => crate::bench::run(url.as_deref(), args).await.map(|_| 0),
        Command::Chaos(args) => {
            let config = crate::chaos::ChaosConfig {
                duration: args.duration,
                seed: args.seed,
                workers: args.workers.into(),
                clients: args.clients.into(),
                sweep_interval: args.sweep_interval,
                fault_every: (!args.no_faults).then_some(args.fault_every),
                mutation: args.mutation,
                binary: std::env::current_exe()?,
            };
            let report = crate::chaos::run(config).await?;
            print!("{}", report.summary());
            Ok(if report.violations() == 0 {
                0
            } else {
                EXIT_RUNTIME
            })
        }
        Command::ChaosHolder { external_id } => {
            crate::chaos::nemesis::holder_process(&need_url()?, &external_id).await?;
            Ok(0)
        }
        Command::Migrate => {
            let applied = Client::connect(&need_url()?).await?.migrate().await?;
            match applied.as_slice() {
                [] => println!("schema is up to date"),
                versions => println!("applied migrations {versions:?}"),
            }
            Ok(0)
        }
        Command::Worker(args) => {
            let url = need_url()?;
            wait_for_database(&url).await?;
            if let Some(addr) = args.metrics_addr {
                let bound = crate::metrics::serve(addr).await?;
                tracing::info!(%bound, "serving metrics");
            }
            Worker::connect(&url, args.config())?
                .run(shutdown_signal())
                .await?;
            Ok(0)
        }
        Command::Semaphore(cmd) => semaphore(&Client::connect(&need_url()?).await?, cmd).await,
        Command::Submit(args) => submit(&Client::connect(&need_url()?).await?, args).await,
        Command::Status { external_id, json } => {
            match Client::connect(&need_url()?)
                .await?
                .status(&external_id)
                .await?
            {
                Some(r) => print_request(&r, json),
                None => {
                    return Err(Error::config(format!(
                        "no request with external_id {external_id:?}"
                    )))
                }
            }
            Ok(0)
        }
        Command::Release { external_id } => {
            println!(
                "{}",
                Client::connect(&need_url()?)
                    .await?
                    .release(&external_id)
                    .await?
            );
            Ok(0)
        }
        Command::Revoke { external_id } => {
            println!(
                "{}",
                Client::connect(&need_url()?)
                    .await?
                    .revoke(&external_id)
                    .await?
            );
            Ok(0)
        }
        Command::Heartbeat {
            external_id,
            extend,
        } => {
            let client = Client::connect(&need_url()?).await?;
            match client.heartbeat(&external_id, extend).await {
                Ok(Some(t)) => println!("expires_at {}", humantime::format_rfc3339_micros(t)),
                Ok(None) => println!("acquired, no expiry"),
                Err(e) if e.code() == Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE) => {
                    eprintln!("permitq: {}", one_line(&e.to_string()));
                    return Ok(EXIT_NOT_GRANTED);
                }
                Err(e) => return Err(e),
            }
            Ok(0)
        }
    }
}

/// Before a worker starts: fail fast on a malformed URL, bad credentials or a missing schema,
/// but wait out a database that is not up yet (or restarting) for up to a minute. Once running,
/// the worker rides out restarts on its own.
async fn wait_for_database(url: &str) -> Result<()> {
    let client = Client::connect(url).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match client.semaphores().await {
            Ok(_) => return Ok(()),
            Err(e) if e.is_retryable() && std::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, "database not reachable yet; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

async fn semaphore(client: &Client, cmd: SemaphoreCommand) -> Result<u8> {
    match cmd {
        SemaphoreCommand::Set {
            name,
            capacity,
            fair,
            greedy,
        } => {
            let fairness = if fair {
                Some(true)
            } else if greedy {
                Some(false)
            } else {
                None
            };
            let s = client.set_capacity(&name, capacity, fairness).await?;
            println!(
                "{} capacity={} used={} {}",
                s.name,
                s.capacity,
                s.used,
                if s.fair { "fair" } else { "greedy" }
            );
        }
        SemaphoreCommand::List { json } => {
            let list = client.semaphores().await?;
            if json {
                println!("{}", serde_json::to_string(&list).expect("serializable"));
            } else {
                println!("{:<32} {:>10} {:>10}  mode", "name", "capacity", "used");
                for s in list {
                    println!(
                        "{:<32} {:>10} {:>10}  {}",
                        s.name,
                        s.capacity,
                        s.used,
                        if s.fair { "fair" } else { "greedy" }
                    );
                }
            }
        }
        SemaphoreCommand::History { name, json } => {
            let history = client.capacity_history(&name).await?;
            if json {
                println!("{}", serde_json::to_string(&history).expect("serializable"));
            } else {
                for c in history {
                    let when = c
                        .changed_at
                        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                        .unwrap_or_default();
                    let old = c.old_capacity.map_or("-".to_string(), |v| v.to_string());
                    println!(
                        "{when} {} {old} -> {} ({}) by {} ({})",
                        c.semaphore,
                        c.new_capacity,
                        if c.new_fair { "fair" } else { "greedy" },
                        c.changed_by,
                        c.application_name.unwrap_or_default()
                    );
                }
            }
        }
    }
    Ok(0)
}

async fn submit(client: &Client, args: SubmitArgs) -> Result<u8> {
    let mut request = Request::new(args.external_id);
    for (name, count) in args.permits {
        request = request.permit(name, count);
    }
    request.owner = args.owner;
    request.ttl = args.ttl;
    request.wait = args.wait;
    let mut row = client.submit(&request).await?;
    let mut code = 0;
    if let Some(limit) = args.await_for {
        row = client
            .wait_settled(&request.external_id, limit)
            .await?
            .unwrap_or(row);
        code = match row.state {
            State::Acquired | State::Released => 0,
            State::Error => EXIT_NOT_GRANTED,
            State::New | State::InProgress => EXIT_STILL_WAITING,
        };
    }
    print_request(&row, args.json);
    Ok(code)
}

fn print_request(r: &PermitRequest, json: bool) {
    if json {
        println!("{}", serde_json::to_string(r).expect("serializable"));
        return;
    }
    let detail = match (r.state, r.error_code, r.release_reason, r.fencing_token) {
        (State::Error, Some(code), _, _) => format!(" {code}"),
        (State::Released, _, Some(reason), _) => format!(" ({reason})"),
        (State::Acquired, _, _, Some(token)) => format!(" fencing_token={token}"),
        _ => String::new(),
    };
    println!("{} {}{detail}", r.external_id, r.state);
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutting down: finishing the transaction in flight");
}
