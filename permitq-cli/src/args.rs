//! The command line's arguments (clap derive) and their parsers.

use std::net::SocketAddr;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use permitq::WorkerConfig;

/// permitq: a distributed counting semaphore served through a PostgreSQL work queue.
#[derive(Debug, Parser)]
#[command(
    name = "permitq",
    version,
    about,
    propagate_version = true,
    arg_required_else_help = true
)]
pub(crate) struct Cli {
    /// PostgreSQL URL, e.g. postgres://user:pass@host:5432/db [env: DATABASE_URL] (not `demo`:
    /// it starts a throwaway PostgreSQL of its own)
    // DATABASE_URL is read in main.rs, not by clap: clap writes an argument taken from the
    // environment into every usage line it prints, as if it had been typed.
    #[arg(long, global = true)]
    pub database_url: Option<String>,
    /// Log lines on stderr as `text` (colours only on a terminal) or `json` (one object per line).
    #[arg(long, global = true, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Create or upgrade the schema (safe to run twice, or concurrently).
    Migrate {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Run a worker until SIGINT/SIGTERM.
    Worker(WorkerArgs),
    /// The workers seen in the last hour, live first, or that nothing is granting (then exits 1).
    Workers {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// A live terminal view of every semaphore (q quits).
    Top {
        /// Refresh interval.
        #[arg(long, default_value = "1s", value_parser = parse_lease_duration)]
        interval: Duration,
    },
    /// Serve the status page, the JSON API, /metrics, /healthz and /readyz (read-only; beyond
    /// loopback, with --http-token-file).
    Serve {
        /// Where to listen, HOST:PORT (a host name or an address).
        #[arg(long, default_value = SERVE_ADDR, value_parser = parse_addr)]
        http_addr: SocketAddr,
        #[command(flatten)]
        http_access: HttpAccessArgs,
    },
    /// Manage semaphores.
    #[command(subcommand)]
    Semaphore(SemaphoreCommand),
    /// Admins (permitq_admin): fencing tokens.
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// Check the cluster's hardening against co-tenants (advisory locks, the lock table, each
    /// producer login's connection limit and idle-transaction timeout) and print the SQL that
    /// fixes what does not hold; exits 1 when something should change.
    Doctor {
        /// Print one JSON array.
        #[arg(long)]
        json: bool,
    },
    /// Submit a permit request: `permitq submit ID NAME=COUNT... [--await [DUR]]`.
    Submit(SubmitArgs),
    /// Show a request.
    Status {
        /// The request's external_id.
        external_id: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Why a request waits: per semaphore what is free and missing, its place in line, who
    /// holds the permits, the rule that holds it back, an estimated wait; or its outcome.
    Explain {
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
        /// How the holder's use went, for adaptive semaphores it held: ok, overloaded (a 429,
        /// a timeout, a pool exhausted) or failed. Left out: no report.
        #[arg(long, value_parser = parse_outcome)]
        outcome: Option<permitq::Outcome>,
        /// With --outcome: how long its calls took (250ms). Only an ok report's latency is
        /// used (the gradient compares them).
        #[arg(long, value_parser = parse_duration)]
        latency: Option<Duration>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Admins (permitq_admin): take a held request's permits away (release_reason = revoked).
    Revoke {
        /// The request's external_id.
        external_id: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Extend a held request's lease; exits 3 when the lease is lost.
    Heartbeat {
        /// The request's external_id.
        external_id: String,
        /// New lease length from now (default: the request's ttl).
        #[arg(long, value_parser = parse_lease_duration, allow_hyphen_values = true)]
        extend: Option<Duration>,
        /// How the holder's use went so far, for adaptive semaphores it holds: ok, overloaded
        /// (a 429, a timeout, a pool exhausted) or failed; the release may report again.
        #[arg(long, value_parser = parse_outcome)]
        outcome: Option<permitq::Outcome>,
        /// With --outcome: how long its calls took (250ms).
        #[arg(long, value_parser = parse_duration)]
        latency: Option<Duration>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Run the whole system for about 20 s: a throwaway PostgreSQL of its own (the DATABASE_URL
    /// environment variable is ignored here; only --database-url on the command line runs it on
    /// that database instead, which it must be allowed to fill), 3 workers, simulated producers
    /// and holders, a live view and a summary.
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
pub(crate) struct ChaosArgs {
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
    /// Plant a known bug (no-semaphore-lock, fold-twice, double-release, skip-fairness,
    /// ignore-window, never-claimed, lost-request, leases-never-expire, tokens-reused,
    /// tokens-backwards, grant-twice, starve-head, negative-room, ...).
    #[arg(long)]
    pub mutation: Option<crate::chaos::Mutation>,
    /// Run on a bed of network namespaces (needs root): PostgreSQL and each worker on a host of
    /// its own, and the network faults (partition, slow link) join the schedule.
    #[arg(long)]
    pub network: bool,
    /// Run under Patroni and etcd (needs root; implies --network): three PostgreSQL members,
    /// etcd, workers and this process each on a host of its own, and the HA faults (kill the
    /// leader's PostgreSQL, kill its Patroni, partition its host, switchover, restart a
    /// replica) join the schedule, with figures for each.
    #[arg(long)]
    pub ha: bool,
    /// With --ha: Patroni's synchronous_mode off (asynchronous replication).
    #[arg(long, requires = "ha")]
    pub asynchronous: bool,
    /// A rolling upgrade under load from an earlier build: start on the schema of this
    /// `permitq` binary with its workers, then migrate with this build a quarter into the load
    /// and replace the workers one at a time (SIGTERM, this build's in its place).
    #[arg(long, value_name = "BINARY", conflicts_with_all = ["mutation", "ha"])]
    pub previous: Option<std::path::PathBuf>,
    /// With --ha: etcd members.
    #[arg(long, default_value_t = 1, requires = "ha", value_parser = clap::builder::TypedValueParser::map(clap::builder::PossibleValuesParser::new(["1", "3"]), |s: String| s.parse::<usize>().unwrap_or(1)))]
    pub etcd_members: usize,
}

/// Where `permitq serve` listens by default. Workers serve their endpoints only when asked,
/// conventionally on [`WORKER_PORT`], so that both can run on one host.
pub(crate) const SERVE_ADDR: &str = "127.0.0.1:9188";
/// The port the README, deploy/ and `worker --help` use for a worker's endpoints.
pub(crate) const WORKER_PORT: u16 = 9187;

/// A capacity: a whole number, 0 or more, said so when it is not.
fn parse_permit_count(s: &str) -> std::result::Result<i32, String> {
    count_at_least_0(s, "0 grants nothing")
}

/// A guarantee: as a capacity, but 0 means none (the child only borrows).
fn parse_guarantee(s: &str) -> std::result::Result<i32, String> {
    count_at_least_0(s, "0 for none: the child then only borrows what is free")
}

/// A template's bound on its instances.
fn parse_max_instances(s: &str) -> std::result::Result<i32, String> {
    count_at_least_0(s, "0 makes none")
}

/// A count of permits (a capacity, a guarantee, a number of instances): a whole number, 0 or
/// more, said so when it is not, with what 0 means for it.
fn count_at_least_0(s: &str, zero_means: &str) -> std::result::Result<i32, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if n < 0 => Err(format!("{n} is below 0: give 0 or more ({zero_means})")),
        Ok(n) => i32::try_from(n).map_err(|_| format!("{n} is above the largest, {}", i32::MAX)),
        Err(_) => Err(format!(
            "{s:?} is not a whole number: give one in digits, 0 or more (for example 4)"
        )),
    }
}

/// A whole number from `low` to `high`, said in words when it is not (clap's own range check
/// says `-100..=100`).
fn whole_number_in(s: &str, low: i64, high: i64) -> std::result::Result<i64, String> {
    match s.trim().parse::<i64>() {
        Ok(n) if (low..=high).contains(&n) => Ok(n),
        Ok(n) => Err(format!(
            "{n} is outside the range: give a whole number from {low} to {high}"
        )),
        Err(_) => Err(format!(
            "{s:?} is not a whole number: give one from {low} to {high}"
        )),
    }
}

/// A priority, within [`permitq::PRIORITY_RANGE`].
fn parse_priority(s: &str) -> std::result::Result<i16, String> {
    let (low, high) = (
        *permitq::PRIORITY_RANGE.start(),
        *permitq::PRIORITY_RANGE.end(),
    );
    let n = whole_number_in(s, i64::from(low), i64::from(high))
        .map_err(|e| format!("{e} (higher goes first in line; 0 is the default)"))?;
    i16::try_from(n).map_err(|e| e.to_string())
}

/// A fairness weight, within [`permitq::FAIRNESS_WEIGHT_RANGE`].
fn parse_fairness_weight(s: &str) -> std::result::Result<i32, String> {
    let range = &permitq::FAIRNESS_WEIGHT_RANGE;
    let n = whole_number_in(s, i64::from(*range.start()), i64::from(*range.end()))
        .map_err(|e| format!("{e} (a key's share of the turns; 1 is the default)"))?;
    i32::try_from(n).map_err(|e| e.to_string())
}

/// HOST:PORT, where HOST is an IP address or a name (`localhost:9999`); the first address the
/// name resolves to.
fn parse_addr(s: &str) -> std::result::Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let expected = || {
        format!("expected HOST:PORT (for example 0.0.0.0:{WORKER_PORT} or localhost:{WORKER_PORT}), got {s:?}")
    };
    if s.rsplit_once(':')
        .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
    {
        return Err(expected());
    }
    // An IPv4 address first: `localhost` then binds where IPv4 clients look for it.
    let addrs: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {s:?}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(expected)
}

/// A duration as `--help` shows a default (`1s`, `7days`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HumanDuration(pub Duration);

impl std::fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", humantime::format_duration(self.0))
    }
}

/// [`parse_duration`] for an option whose default is shown.
fn human_duration(s: &str) -> std::result::Result<HumanDuration, String> {
    parse_duration(s).map(HumanDuration)
}

/// [`parse_lease_duration`] for an option whose default is shown.
fn human_lease_duration(s: &str) -> std::result::Result<HumanDuration, String> {
    parse_lease_duration(s).map(HumanDuration)
}

/// The library's defaults, which the worker's options show and start from.
fn worker_defaults() -> WorkerConfig {
    WorkerConfig::default()
}

/// `permitq worker` options. Their defaults are [`WorkerConfig::default`]'s.
#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// Requests claimed per transaction.
    #[arg(long, default_value_t = worker_defaults().batch_size,
          value_parser = clap::value_parser!(i64).range(1..=10000))]
    pub batch_size: i64,
    /// Fallback pass interval when no notification arrives.
    #[arg(long, default_value_t = HumanDuration(worker_defaults().poll_interval),
          value_parser = human_duration)]
    pub poll_interval: HumanDuration,
    /// How often leases, wait deadlines and --max-hold are enforced.
    #[arg(long, default_value_t = HumanDuration(worker_defaults().maintenance.sweep_interval),
          value_parser = human_duration)]
    pub sweep_interval: HumanDuration,
    /// How often adaptive semaphores' capacities are set from their holders' reports.
    #[arg(long, default_value_t = HumanDuration(worker_defaults().maintenance.adaptive_cadence),
          value_parser = human_duration)]
    pub adaptive_cadence: HumanDuration,
    /// Release anything held longer than this (release_reason = stale). Off by default.
    #[arg(long, value_parser = parse_lease_duration, allow_hyphen_values = true)]
    pub max_hold: Option<Duration>,
    /// Delete settled requests older than this, in small batches.
    #[arg(long, default_value_t = HumanDuration(worker_defaults().maintenance.retention),
          value_parser = human_lease_duration, allow_hyphen_values = true)]
    pub retention: HumanDuration,
    /// Delete capacity audit rows older than this.
    #[arg(long, default_value_t = HumanDuration(worker_defaults().maintenance.audit_retention),
          value_parser = human_lease_duration, allow_hyphen_values = true)]
    pub audit_retention: HumanDuration,
    /// Remove instances of templates ('tenant:*') idle this long (made again when named).
    #[arg(long, default_value_t = HumanDuration(worker_defaults().maintenance.idle_instance_after),
          value_parser = human_lease_duration)]
    pub idle_instance_after: HumanDuration,
    /// Serve /metrics, /healthz, /readyz, the JSON API and the status page on HOST:PORT
    /// (a host name or an address; conventionally port 9187, e.g. 0.0.0.0:9187).
    #[arg(long, visible_alias = "metrics-addr", value_parser = parse_addr)]
    pub http_addr: Option<SocketAddr>,
    #[command(flatten)]
    pub http_access: HttpAccessArgs,
    /// Worker name (logs, worker_id, application_name).
    #[arg(long)]
    pub id: Option<String>,
}

/// Who may read the HTTP endpoints, and how many at once (`serve`, and `worker --http-addr`).
#[derive(Debug, clap::Args)]
pub(crate) struct HttpAccessArgs {
    /// A file holding the token the status page, /api/* and /metrics need (`Authorization:
    /// Bearer TOKEN`, or HTTP Basic with the token as password). Without it, the page and /api/*
    /// are served on a loopback address only.
    #[arg(long, env = "PERMITQ_HTTP_TOKEN_FILE", value_name = "FILE")]
    pub http_token_file: Option<std::path::PathBuf>,
    /// Serve the page and /api/* without a token beyond loopback: only behind a proxy that
    /// authenticates.
    #[arg(long, conflicts_with = "http_token_file")]
    pub http_no_auth: bool,
    /// Requests served at once; more are answered 429 at once.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub http_max_concurrent: u16,
}

impl WorkerArgs {
    /// The worker configuration these options describe.
    pub(crate) fn config(&self) -> WorkerConfig {
        let mut config = worker_defaults();
        if let Some(id) = &self.id {
            config.id = id.clone();
        }
        config.batch_size = self.batch_size;
        config.poll_interval = self.poll_interval.0;
        config.maintenance.sweep_interval = self.sweep_interval.0;
        config.maintenance.adaptive_cadence = self.adaptive_cadence.0;
        config.maintenance.max_hold = self.max_hold;
        config.maintenance.retention = self.retention.0;
        config.maintenance.audit_retention = self.audit_retention.0;
        config.maintenance.idle_instance_after = self.idle_instance_after.0;
        config
    }
}

/// `permitq tokens ...`
#[derive(Debug, Subcommand)]
pub(crate) enum TokensCommand {
    /// Make every token issued from now on greater than N (after restoring a copy of the
    /// database that another copy outlived; docs/concepts.md, "Leases and fencing", says when).
    Raise {
        /// The highest token any copy may have issued.
        #[arg(long, value_name = "N")]
        above: i64,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

/// `permitq semaphore ...`
#[derive(Debug, Subcommand)]
pub(crate) enum SemaphoreCommand {
    /// Create a semaphore or change its capacity (and fairness, window, parent, guarantee).
    /// Options left out keep their current values: `set api 50` keeps api's `--per` window.
    Set {
        /// Name.
        name: String,
        /// How many permits may be held at once (or granted per window, with --per).
        #[arg(allow_negative_numbers = true, value_parser = parse_permit_count)]
        capacity: i32,
        /// Serve the line in order (priority, then arrival) with safe backfill (the default for
        /// new semaphores; a change keeps the semaphore's setting unless given).
        #[arg(long, conflicts_with = "greedy")]
        fair: bool,
        /// Any request that fits may go first.
        #[arg(long)]
        greedy: bool,
        /// Rate-limit it: at most CAPACITY permits granted in any window of this length
        /// (sliding), whatever the holders do. `--per 0` removes the window.
        #[arg(long, value_parser = parse_wait, allow_hyphen_values = true)]
        per: Option<Duration>,
        /// Nest it in PARENT (an existing plain semaphore): a grant here also takes from PARENT
        /// and its ancestors.
        #[arg(long, value_name = "PARENT", conflicts_with = "no_parent")]
        parent: Option<String>,
        /// Take it out of its parent.
        #[arg(long)]
        no_parent: bool,
        /// Its guaranteed share of its parent while it holds permits or has waiters within it.
        #[arg(long, allow_negative_numbers = true, value_parser = parse_guarantee)]
        guarantee: Option<i32>,
        /// For a template: the most instances it makes (a guaranteed template's guarantee
        /// counts once per instance it may make).
        #[arg(long, allow_negative_numbers = true, value_parser = parse_max_instances)]
        max_instances: Option<i32>,
        /// Let the workers set the capacity from what holders report (`permitq release ID
        /// --outcome overloaded`): aimd (from overloaded reports) or gradient (from latency as
        /// well), between --floor and --ceiling; CAPACITY is where it starts.
        #[arg(long, value_parser = parse_algorithm, requires_all = ["floor", "ceiling"],
              conflicts_with = "no_adaptive")]
        adaptive: Option<permitq::Algorithm>,
        /// With --adaptive: the lowest capacity it sets.
        #[arg(long, requires = "adaptive", value_parser = clap::value_parser!(i32).range(1..))]
        floor: Option<i32>,
        /// With --adaptive: the highest capacity it sets.
        #[arg(long, requires = "adaptive", value_parser = clap::value_parser!(i32).range(1..))]
        ceiling: Option<i32>,
        /// The capacity is fixed again (at CAPACITY): the workers no longer adapt it.
        #[arg(long)]
        no_adaptive: bool,
        /// Serve its line across the requests' fairness keys (`submit --fairness-key TENANT`)
        /// in proportion to their weights, arrival order within a key: one tenant's burst does
        /// not make another's request wait behind it (a fair semaphore; on a template, every
        /// instance, each a line of its own).
        #[arg(long, conflicts_with_all = ["no_fairness_keys", "greedy"])]
        fairness_keys: bool,
        /// Serve its line by priority and arrival alone again.
        #[arg(long)]
        no_fairness_keys: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete a semaphore, template or instance nothing uses (no holders, no waiters, no
    /// children or instances); its capacity history records it.
    Delete {
        /// Name.
        name: String,
        /// Print one JSON object: the semaphore as it was.
        #[arg(long)]
        json: bool,
    },
    /// Show one semaphore: usage, holders, waiters, recent capacity changes.
    Show {
        /// Name.
        name: String,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
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
pub(crate) struct SubmitArgs {
    /// Idempotency key chosen by you (1..255 characters).
    pub external_id: String,
    /// What to acquire, all or nothing: NAME=COUNT, one or more (each semaphore once). A
    /// NAME=COUNT given first, in the id's place, is refused with that said.
    #[arg(value_parser = parse_permit)]
    pub permits: Vec<(String, i64)>,
    /// One more semaphore and its count, for names NAME=COUNT cannot express (containing `=`).
    #[arg(long = "permit", num_args = 2, value_names = ["NAME", "COUNT"], action = clap::ArgAction::Append)]
    pub permit: Vec<String>,
    /// Who will hold it.
    #[arg(long)]
    pub owner: Option<String>,
    /// Lease length once granted (heartbeat to extend); at most 10y.
    #[arg(long, value_parser = parse_lease_duration, allow_hyphen_values = true)]
    pub ttl: Option<Duration>,
    /// How long it may wait for capacity (0 = fail fast; default forever); at most 10y.
    #[arg(long, value_parser = parse_wait, allow_hyphen_values = true)]
    pub wait: Option<Duration>,
    /// Higher first on fair semaphores, within permitq's priority range (-100 to 100); waiting
    /// adds one per aging step (10 s).
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = parse_priority)]
    pub priority: i16,
    /// The tenant (or caller) whose share it counts in, where a semaphore is served by
    /// fairness key (`semaphore set NAME N --fairness-keys`); 1 to 64 characters.
    #[arg(long, value_name = "KEY")]
    pub fairness_key: Option<String>,
    /// This request's weight (1 to 1000, default 1; each request carries its own, so give
    /// every request of a key the same): its turn is 10s × count ÷ weight.
    #[arg(long, value_name = "WEIGHT", allow_negative_numbers = true,
          value_parser = parse_fairness_weight)]
    pub fairness_weight: Option<i32>,
    /// Wait for the outcome, up to DUR (default: until it settles). Exit 0 acquired, 3 error,
    /// 4 still waiting.
    #[arg(long = "await", value_name = "DUR", num_args = 0..=1, default_missing_value = "forever",
          value_parser = parse_await)]
    pub await_for: Option<Duration>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    if s.trim_start().starts_with('-') {
        return Err(format!("must not be negative, got {s}"));
    }
    humantime::parse_duration(s).map_err(|e| format!("{e} (examples: 250ms, 30s, 5m)"))
}

/// A duration that may be zero, at most [`permitq::MAX_DURATION`] (10 years).
fn parse_wait(s: &str) -> std::result::Result<Duration, String> {
    let d = parse_duration(s)?;
    if d > permitq::MAX_DURATION {
        return Err(format!(
            "must be at most 10y ({} days), got {s}",
            permitq::MAX_DURATION.as_secs() / 86_400
        ));
    }
    Ok(d)
}

/// A positive duration, at most [`permitq::MAX_DURATION`] (10 years).
fn parse_lease_duration(s: &str) -> std::result::Result<Duration, String> {
    let d = parse_wait(s)?;
    if d.is_zero() {
        return Err(format!("must be positive, got {s}"));
    }
    Ok(d)
}

fn parse_outcome(s: &str) -> std::result::Result<permitq::Outcome, String> {
    s.parse()
}

fn parse_algorithm(s: &str) -> std::result::Result<permitq::Algorithm, String> {
    s.parse()
}

fn parse_await(s: &str) -> std::result::Result<Duration, String> {
    if s == "forever" {
        return Ok(Duration::from_secs(100 * 365 * 24 * 3600));
    }
    // `--await gpu=1`: the permits came after a bare --await.
    if s.contains('=') {
        return Err(format!(
            "--await takes a duration (30s, 5m) or nothing, got the permit {s:?}: put the \
             permits before it (`permitq submit ID {s} --await 30s`)"
        ));
    }
    parse_duration(s)
}

pub(crate) fn parse_permit(s: &str) -> std::result::Result<(String, i64), String> {
    // The last `=` splits, so NAME=COUNT is unambiguous for names without `=`; names with one
    // go through `--permit NAME COUNT`.
    let (name, count) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("expected NAME=COUNT, got {s:?}"))?;
    if name.contains('=') {
        return Err(format!(
            "{s:?} has more than one '=': a semaphore named {name:?} is given as `--permit \
             '{name}' {count}`; several permits go apart, each NAME=COUNT (`gpu=1 disk=2`)"
        ));
    }
    permit(name, count)
}

fn permit(name: &str, count: &str) -> std::result::Result<(String, i64), String> {
    if name.is_empty() {
        return Err("empty semaphore name".to_string());
    }
    match count.parse::<i64>() {
        Ok(c) if (1..=i64::from(i32::MAX)).contains(&c) => Ok((name.to_string(), c)),
        _ => Err(format!(
            "count for {name:?} must be an integer from 1 to 2147483647, got {count:?}"
        )),
    }
}

/// The `--permit NAME COUNT` pairs (clap delivers them flat, two values per occurrence).
pub(crate) fn permit_pairs(flat: &[String]) -> crate::error::Result<Vec<(String, i64)>> {
    flat.chunks(2)
        .map(|pair| match pair {
            [name, count] => {
                permit(name, count).map_err(|e| crate::error::CliError::usage("permit", e))
            }
            _ => Err(crate::error::CliError::usage(
                "permit",
                "expected --permit NAME COUNT",
            )),
        })
        .collect()
}
