//! `permitq chaos`: a fault-injection run with a history checker.
//!
//! It starts its own PostgreSQL (it must restart it), worker *processes*, and client tasks with
//! their own connections that submit random requests (1–4 semaphores, random counts, `wait`
//! NULL/0/short, `ttl` NULL/short), hold, heartbeat and release, with racing duplicate submits.
//! Every operation is recorded as invoke + ok/fail/info ([`history`]). A seeded [`nemesis`]
//! injects every kind of fault at least once. A sampler checks every snapshot while it runs;
//! afterwards the load stops, everything is released, and the [`checker`]s read the final state
//! and the history. [`mutation`] plants known bugs to prove the checkers catch them.

pub(crate) mod checker;
pub(crate) mod ha;
pub(crate) mod history;
pub(crate) mod keys;
pub(crate) mod load;
pub(crate) mod mutation;
pub(crate) mod nemesis;
pub(crate) mod state;
pub(crate) mod upgrade;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::error::{CliError, Result};
use permitq::{Client, SemaphoreSettings};
use permitq_embedded_pg::{EmbeddedPostgres, NetworkBed};

pub(crate) use mutation::Mutation;
pub(crate) use nemesis::Fault;

/// The semaphores under test: (name, capacity, fair).
pub(crate) const SEMAPHORES: &[(&str, i32, bool)] = &[
    ("c-a", 3, true),
    ("c-b", 5, true),
    ("c-c", 4, true),
    ("c-d", 8, false),
];
/// The semaphore of the pause-holder fault (capacity 1, fair).
pub(crate) const FENCED: &str = "c-fenced";
/// A template: requests name `c-key:k0`..`c-key:k3`, instances of capacity 2 made on demand.
pub(crate) const KEY_TEMPLATE: (&str, i32) = ("c-key:*", 2);
/// Keys of [`KEY_TEMPLATE`] the load names.
pub(crate) const KEYS: usize = 4;
/// A rate-limited semaphore: (name, grants, per window).
pub(crate) const RATE_LIMITED: (&str, i32, Duration) = ("c-rate", 4, Duration::from_secs(1));
/// Nested limits, three levels: a root of capacity 6 (some requests name it directly), a pool
/// of capacity 5 in it guaranteed 4 of it, and in the pool the instances of a template,
/// `c-tenant:t0`..`t2`, each of ceiling 3 and guaranteed 1 of the pool (2 of it unguaranteed,
/// what a borrower takes at once).
pub(crate) const NESTED_ROOT: (&str, i32) = ("c-root", 6);
/// The pool: (name, capacity, guarantee in the root).
pub(crate) const NESTED_POOL: (&str, i32, i32) = ("c-pool", 5, 4);
/// The tenants' template: (name, ceiling, guarantee in the pool).
pub(crate) const TENANT_TEMPLATE: (&str, i32, i32) = ("c-tenant:*", 3, 1);
/// Tenants the load names (the template makes at most this many).
pub(crate) const TENANTS: usize = 3;
/// A rate limit at a parent: (name, grants, per window), over [`RATE_CHILDREN`], concurrency
/// semaphores of capacity 2 that requests name (the window is charged through them).
pub(crate) const RATE_PARENT: (&str, i32, Duration) = ("c-rp", 3, Duration::from_secs(1));
/// The rate-limited parent's children.
pub(crate) const RATE_CHILDREN: [&str; 2] = ["c-rp-a", "c-rp-b"];
/// A semaphore served by fairness key: (name, capacity). The load's requests on it name it
/// alone, each with one of [`FAIRNESS_KEYS`] (its weight) or none ([`keys`] checks its order).
pub(crate) const KEYED: (&str, i32) = ("c-keyed", 3);
/// The fairness keys of the requests on [`KEYED`], and their weights.
pub(crate) const FAIRNESS_KEYS: [(&str, i32); 3] =
    [("tenant-a", 1), ("tenant-b", 2), ("tenant-c", 3)];

/// A chaos run.
#[derive(Debug, Clone)]
pub(crate) struct ChaosConfig {
    /// How long the load runs.
    pub duration: Duration,
    /// Seeds the load and the fault schedule.
    pub seed: u64,
    /// Worker processes.
    pub workers: usize,
    /// Client tasks.
    pub clients: usize,
    /// The workers' `--sweep-interval`.
    pub sweep_interval: Duration,
    /// Time between faults; `None`: no faults.
    pub fault_every: Option<Duration>,
    /// A planted bug.
    pub mutation: Option<Mutation>,
    /// The `permitq` binary (worker and holder processes).
    pub binary: PathBuf,
    /// On a bed of network namespaces, with the network faults.
    pub network: bool,
    /// Under Patroni (on the bed), with the HA faults.
    pub ha: Option<ha::HaConfig>,
    /// A rolling upgrade from this earlier build's binary (chaos/upgrade.rs).
    pub previous: Option<PathBuf>,
}

/// What a run did and found.
#[derive(Debug)]
pub(crate) struct ChaosReport {
    /// The configuration.
    pub config: ChaosConfig,
    /// Operations by (kind, outcome).
    pub ops: BTreeMap<(history::OpKind, &'static str), u64>,
    /// Faults injected by kind.
    pub faults: BTreeMap<Fault, u32>,
    /// Snapshots the sampler checked.
    pub snapshots: u64,
    /// The checkers' verdict (the sampler's findings under "sampler").
    pub verdict: checker::Verdict,
    /// Each semaphore when the load stopped: (name, capacity, used, waiting, held without TTL,
    /// oldest waiting age in seconds). A stall shows up here.
    pub at_load_end: Vec<(String, i32, i64, i64, i64, f64)>,
    /// Under Patroni: each fault and what it did.
    pub ha: Vec<ha::FaultFigures>,
    /// Fault injections that failed, and why.
    pub failed_injections: Vec<(Fault, String)>,
    /// Every fault's span, to place a violation on the timeline.
    pub timeline: Vec<nemesis::Outage>,
}

/// Checker names, in report order.
pub(crate) const CHECKERS: [&str; 13] = [
    "safety",
    "guarantees",
    "no double grant",
    "fencing",
    "leases",
    "nothing lost",
    "liveness",
    "outcomes",
    "quiescence",
    "fairness",
    "history",
    "sampler",
    "passes",
];

impl ChaosReport {
    /// Total violations.
    pub(crate) fn violations(&self) -> usize {
        self.verdict.violations.values().map(Vec::len).sum()
    }

    /// The summary table.
    pub(crate) fn summary(&self) -> String {
        let c = &self.config;
        let mut s = format!(
            "=== permitq chaos: seed {}, {:?}, {} workers, {} clients{} ===\n",
            c.seed,
            c.duration,
            c.workers,
            c.clients,
            c.mutation
                .map_or(String::new(), |m| format!(", planted bug: {m}"))
        );
        s += &format!(
            "{:<12} {:>8} {:>8} {:>8}\n",
            "operations", "ok", "fail", "info"
        );
        for kind in [
            history::OpKind::Submit,
            history::OpKind::Release,
            history::OpKind::Heartbeat,
            history::OpKind::Fence,
            history::OpKind::Work,
        ] {
            let n = |o| self.ops.get(&(kind, o)).copied().unwrap_or(0);
            s += &format!(
                "{:<12} {:>8} {:>8} {:>8}\n",
                format!("{kind:?}").to_lowercase(),
                n("ok"),
                n("fail"),
                n("info")
            );
        }
        if let Some(h) = c.ha {
            s += &format!(
                "under Patroni: 3 members on hosts of their own, etcd {} member(s), synchronous_mode {}\n",
                h.etcd_members,
                if h.synchronous { "on" } else { "off" }
            );
        }
        s += "faults injected:";
        let upgrade = [Fault::Migrate, Fault::UpgradeWorker];
        let upgrade = if c.previous.is_some() {
            &upgrade[..]
        } else {
            &[]
        };
        for fault in Fault::kinds(c.network, c.ha.is_some())
            .into_iter()
            .chain(upgrade.iter().copied())
        {
            s += &format!(
                " {fault:?} {}",
                self.faults.get(&fault).copied().unwrap_or(0)
            );
        }
        for (fault, why) in &self.failed_injections {
            s += &format!("\ninjection failed: {fault:?}: {why}");
        }
        s += &format!(
            "\nrequests {}, granted {}, sampler snapshots {}\n",
            self.verdict.requests, self.verdict.granted, self.snapshots
        );
        s += &format!("endings: {:?}\n", self.verdict.endings);
        s += "at load end: semaphore capacity used waiting held-without-ttl oldest-waiting\n";
        for (name, capacity, used, waiting, untimed, oldest) in &self.at_load_end {
            s += &format!(
                "  {name:<10} {capacity:>3} {used:>3} {waiting:>4} {untimed:>4} {oldest:>7.1}s\n"
            );
        }
        s += "violations by checker:\n";
        for name in CHECKERS {
            let found = self
                .verdict
                .violations
                .get(name)
                .map_or(&[][..], Vec::as_slice);
            s += &format!("  {name:<16} {}\n", found.len());
            for message in found.iter().take(3) {
                s += &format!("      {message}\n");
            }
        }
        if !self.ha.is_empty() {
            s += &format!(
                "each fault: longest pause between grants of a probe around it, acknowledged operations lost,\n\
                 first probe token after it in a higher epoch, above every token before it, a {}s lease heartbeating through it kept (of those held when it began)\n",
                ha::KEEPER_TTL.as_secs()
            );
            s += &ha::table(&self.ha);
        }
        let nested: Vec<String> = self
            .verdict
            .peaks
            .iter()
            .filter(|(name, _)| {
                [NESTED_ROOT.0, NESTED_POOL.0].contains(&name.as_str())
                    || name.starts_with(TENANT_TEMPLATE.0.trim_end_matches('*'))
            })
            .map(|(name, (peak, grants))| format!("{name} {grants} grants, peak {peak}"))
            .collect();
        s += &format!("nested limits: {}\n", nested.join("; "));
        let (lp99, lmax, sp99, smax) = self.verdict.waits_ms;
        s += &format!(
            "waits on fair semaphores: large requests p99 {lp99:.0} ms, max {lmax:.0} ms; small p99 {sp99:.0} ms, max {smax:.0} ms\n"
        );
        s += &format!(
            "fairness keys: {} moves of a key's finish tag by a batch replayed\n",
            self.verdict.key_moves
        );
        if self.violations() > 0 {
            // Where the violations' times (µs since the epoch) fall among the faults.
            s += "faults (from, to, in s since the epoch):\n";
            for f in &self.timeline {
                let secs = |t: SystemTime| {
                    t.duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs_f64()
                };
                s += &format!("  {:?} {:.3} {:.3}\n", f.kind, secs(f.from), secs(f.to));
            }
        }
        s += &format!(
            "result: {}\n",
            if self.violations() == 0 {
                "PASS"
            } else {
                "FAIL"
            }
        );
        s
    }
}

/// Runs a chaos test end to end.
pub(crate) async fn run(config: ChaosConfig) -> Result<ChaosReport> {
    // With --network: PostgreSQL on host `db`, worker i on host `w<i>`, each its own network
    // namespace; this process (producers, sampler, nemesis) reaches PostgreSQL over its Unix
    // socket, the workers over the bed.
    // With --network: PostgreSQL on host `db` (under --ha: Patroni members on `pg1`..`pg3` and
    // etcd on `etcd1`..), worker i on host `w<i>`, each its own network namespace. This process
    // (producers, sampler, nemesis) reaches a single server over its Unix socket; under --ha it
    // joins the bed as a host of its own and uses the multi-host URL, like the workers.
    let network = config.network || config.ha.is_some();
    let options = config.ha.map(|h| {
        permitq_embedded_pg::PatroniOptions::new(h.synchronous).etcd_members(h.etcd_members)
    });
    let bed = if network {
        let hosts: Vec<String> = match &options {
            None => vec!["db".to_string()],
            Some(o) => o.hosts(),
        }
        .into_iter()
        .chain((0..config.workers).map(|i| format!("w{i}")))
        .collect();
        Some(Arc::new(
            NetworkBed::new(&hosts.iter().map(String::as_str).collect::<Vec<_>>())
                .map_err(|e| CliError::runtime(format!("--network: {e}")))?,
        ))
    } else {
        None
    };
    let (db, url, worker_url) = match options {
        Some(options) => {
            let bed = bed.clone().expect("a bed");
            bed.link_here()
                .map_err(|e| CliError::runtime(format!("--ha: {e}")))?;
            let cluster = tokio::task::spawn_blocking(move || {
                permitq_embedded_pg::PatroniCluster::start(options, Some(bed))
            })
            .await
            .map_err(|e| CliError::runtime(e.to_string()))?
            .map_err(|e| CliError::runtime(format!("--ha: {e}")))?;
            let url = cluster.url("postgres");
            (
                Arc::new(ha::Database::Patroni(Mutex::new(cluster))),
                url.clone(),
                url,
            )
        }
        None => {
            let placement = bed
                .as_ref()
                .map(|b| (b.namespace("db").to_string(), b.address("db").to_string()));
            let pg = Arc::new(
                tokio::task::spawn_blocking(move || match placement {
                    None => EmbeddedPostgres::start(),
                    Some((ns, address)) => EmbeddedPostgres::start_in_namespace(&ns, &address),
                })
                .await
                .map_err(|e| CliError::runtime(e.to_string()))??,
            );
            let (url, worker_url) = match &bed {
                None => (pg.url("postgres"), pg.url("postgres")),
                Some(b) => (
                    pg.socket_config("postgres"),
                    format!(
                        "postgres://postgres@{}:{}/postgres",
                        b.address("db"),
                        pg.port()
                    ),
                ),
            };
            (Arc::new(ha::Database::Single(pg)), url, worker_url)
        }
    };
    let client = Client::connect(&url).await?;
    match &config.previous {
        // The previous build's schema, as its users have it.
        Some(previous) => upgrade::migrate_with(previous, &url).await?,
        None => {
            client.migrate().await?;
        }
    }
    // Hardened as `permitq doctor` says (the stranger below tries what it guards against).
    harden(&url, &client).await?;
    // Fairness keys, unless the run starts on the schema of a build before them (its
    // producers could not name them).
    let keyed = config.previous.is_none();
    if keyed {
        permitq_embedded_pg::try_connect(&url)
            .await?
            .batch_execute(keys::INSTALL)
            .await?;
        client
            .set_semaphore(
                KEYED.0,
                KEYED.1,
                &SemaphoreSettings::new().fair(true).fairness_keys(true),
            )
            .await?;
    }
    for (name, capacity, fair) in SEMAPHORES {
        client.set_capacity(name, *capacity, Some(*fair)).await?;
    }
    client.set_capacity(FENCED, 1, Some(true)).await?;
    client
        .set_capacity(KEY_TEMPLATE.0, KEY_TEMPLATE.1, Some(true))
        .await?;
    client
        .set_rate_limit(RATE_LIMITED.0, RATE_LIMITED.1, RATE_LIMITED.2, Some(true))
        .await?;
    let fair = SemaphoreSettings::new().fair(true);
    client
        .set_semaphore(NESTED_ROOT.0, NESTED_ROOT.1, &fair)
        .await?;
    client
        .set_semaphore(
            NESTED_POOL.0,
            NESTED_POOL.1,
            &fair.clone().parent(NESTED_ROOT.0).guarantee(NESTED_POOL.2),
        )
        .await?;
    let rate_parent = SemaphoreSettings::new().fair(true).per(RATE_PARENT.2);
    client
        .set_semaphore(RATE_PARENT.0, RATE_PARENT.1, &rate_parent)
        .await?;
    for child in RATE_CHILDREN {
        client
            .set_semaphore(child, 2, &fair.clone().parent(RATE_PARENT.0))
            .await?;
    }
    let tenants = i32::try_from(TENANTS).expect("a few");
    client
        .set_semaphore(
            TENANT_TEMPLATE.0,
            TENANT_TEMPLATE.1,
            &fair
                .parent(NESTED_POOL.0)
                .guarantee(TENANT_TEMPLATE.2)
                .max_instances(tenants),
        )
        .await?;
    if config.ha.is_some() {
        client.set_capacity(ha::PROBE, 100, Some(false)).await?;
        client.set_capacity(ha::KEEPER, 1, Some(true)).await?;
    }
    if let Some(m) = config.mutation {
        let planted = m.sql().map_err(CliError::Runtime)?;
        permitq_embedded_pg::try_connect(&url)
            .await?
            .batch_execute(&planted)
            .await?;
    }

    let workers = Arc::new(
        nemesis::Workers::start(
            config
                .previous
                .clone()
                .unwrap_or_else(|| config.binary.clone()),
            worker_url,
            config.workers,
            bed.as_ref().map(|b| {
                (0..config.workers)
                    .map(|i| b.namespace(&format!("w{i}")).to_string())
                    .collect()
            }),
            config.sweep_interval,
        )
        .await?,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let history = history::History::default();
    let acquired_events = record_acquired_events(url.clone());
    let stranger = tokio::spawn(stranger(url.clone()));
    let sampler_findings = Arc::new(Mutex::new(Vec::new()));
    let snapshots = Arc::new(AtomicU64::new(0));
    let sampler = tokio::spawn(sample(
        url.clone(),
        stop.clone(),
        sampler_findings.clone(),
        snapshots.clone(),
    ));

    let (watch, watchers) = if config.ha.is_some() {
        let (watch, tasks) = ha::Watch::start(&url, &stop);
        (Some(watch), tasks)
    } else {
        (None, Vec::new())
    };
    let clients: Vec<_> = (0..config.clients)
        .map(|i| {
            tokio::spawn(load::client_loop(
                i,
                url.clone(),
                config.seed,
                false,
                history.clone(),
                stop.clone(),
            ))
        })
        .chain((0..load::ROOT_BORROWERS).map(|i| {
            tokio::spawn(load::borrower_loop(
                config.clients + i,
                url.clone(),
                history.clone(),
                stop.clone(),
            ))
        }))
        .chain((0..if keyed { load::KEYED_CLIENTS } else { 0 }).map(|i| {
            tokio::spawn(load::client_loop(
                config.clients + load::ROOT_BORROWERS + i,
                url.clone(),
                config.seed,
                true,
                history.clone(),
                stop.clone(),
            ))
        }))
        .collect();
    let nemesis = config.fault_every.map(|every| {
        tokio::spawn(nemesis::run(
            config.seed,
            every,
            db.clone(),
            url.clone(),
            config.binary.clone(),
            workers.clone(),
            bed.clone(),
            history.clone(),
            stop.clone(),
        ))
    });

    let upgrade = config.previous.as_ref().map(|_| {
        tokio::spawn(upgrade::roll(
            config.binary.clone(),
            url.clone(),
            workers.clone(),
            config.workers,
            config.duration,
        ))
    });

    tokio::time::sleep(config.duration).await;
    stop.store(true, Ordering::Relaxed);
    let load_end = SystemTime::now();
    let at_load_end = snapshot(&url).await.unwrap_or_default();
    let mut injected = match nemesis {
        Some(n) => n.await.map_err(|e| CliError::runtime(e.to_string()))?,
        None => nemesis::Injected::default(),
    };
    if let Some(upgrade) = upgrade {
        let rolled = upgrade
            .await
            .map_err(|e| CliError::runtime(e.to_string()))?;
        injected.counts.extend(rolled.counts);
        injected.faults.extend(rolled.faults);
        injected.failed.extend(rolled.failed);
    }
    for c in clients.into_iter().chain(watchers) {
        let _ = c.await;
    }
    drain(&url).await?;
    workers.stop().await;
    let _ = sampler.await;

    let conn = permitq_embedded_pg::try_connect(&url).await?;
    let state = state::load(&conn).await?;
    let ops = history.ops();
    let events = acquired_events.0.lock().expect("events").clone();
    let cx = checker::Context {
        ops: &ops,
        acquired_events: &events,
        faults: &injected.faults,
        sweep_interval: config.sweep_interval,
        load_end,
    };
    let mut verdict = checker::check(&state, &cx);
    if keyed {
        let (found, checked) = keys::replay(&conn).await?;
        verdict.key_moves = checked;
        verdict
            .violations
            .entry("fairness")
            .or_default()
            .extend(found);
    }
    let ha_figures = match &watch {
        Some(watch) => {
            let lost = checker::lost_acknowledged(&state, &ops);
            let figures = ha::figures(&injected.faults, watch, &lost, load_end);
            for f in figures.iter().filter(|f| f.tokens_rose == Some(false)) {
                verdict
                    .violations
                    .entry("fencing")
                    .or_default()
                    .push(format!(
                        "the probe's first token after {:?} is not above every token before it",
                        f.outage.kind
                    ));
            }
            figures
        }
        None => Vec::new(),
    };
    // A worker pass that failed on a program error: every semaphore of that worker stalled.
    let failed_passes = workers.failed_passes();
    for line in &failed_passes {
        verdict
            .violations
            .entry("passes")
            .or_default()
            .push(line.clone());
    }
    if failed_passes.is_empty() {
        workers.remove_logs();
    }
    for finding in sampler_findings.lock().expect("findings").drain(..) {
        verdict
            .violations
            .entry("sampler")
            .or_default()
            .push(finding);
    }
    acquired_events.1.abort();
    stranger.abort();
    drop((conn, client));
    Ok(ChaosReport {
        config,
        ops: history.counts(),
        faults: injected.counts,
        timeline: injected.faults.clone(),
        snapshots: snapshots.load(Ordering::Relaxed),
        verdict,
        at_load_end,
        ha: ha_figures,
        failed_injections: injected.failed,
    })
}

/// Runs the SQL of every `permitq doctor` finding on the database under test.
async fn harden(url: &str, client: &Client) -> Result<()> {
    let conn = permitq_embedded_pg::try_connect(url).await?;
    for finding in client.hardening().await? {
        if let Some(fix) = finding.fix.filter(|_| !finding.ok) {
            if !fix.starts_with("ALTER SYSTEM") {
                conn.batch_execute(&fix).await?;
            }
        }
    }
    Ok(())
}

/// Every advisory key permitq ever took (wake key, sweep keys, migration key): a stranger holds
/// them all through the run.
const OLD_ADVISORY_KEYS: [i64; 9] = [
    0x7071_0100,
    0x7071_0001,
    0x7071_0002,
    0x7071_0003,
    0x7071_0004,
    0x7071_0005,
    0x7071_0006,
    0x7071_0007,
    0x0070_6572_6d69_7471,
];

/// A stranger beside the load: a login with no permitq grant that tries to fill the shared lock
/// table with advisory locks, a thousand at a time, starting with every key permitq ever used
/// and 5,000 temporary tables (both refused on a hardened cluster; permitq takes no advisory lock
/// anyway), and LISTENs to `permitq_events`
/// while idle in a transaction (the NOTIFY queue cannot empty past it). Reconnects after a
/// restart; runs until aborted.
async fn stranger(url: String) {
    let Ok(admin) = permitq_embedded_pg::try_connect(&url).await else {
        return;
    };
    let _ = admin
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE chaos_stranger LOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END $$",
        )
        .await;
    drop(admin);
    let Ok(mut config) = url.parse::<tokio_postgres::Config>() else {
        return;
    };
    config.user("chaos_stranger");
    loop {
        let connect = || async {
            let (client, connection) = config.connect(tokio_postgres::NoTls).await.ok()?;
            tokio::spawn(async move {
                let _ = connection.await;
            });
            Some(client)
        };
        if let (Some(keys), Some(listener)) = (connect().await, connect().await) {
            let mut held = keys
                .query(
                    "SELECT pg_advisory_lock(k) FROM unnest($1::int8[]) k",
                    &[&&OLD_ADVISORY_KEYS[..]],
                )
                .await
                .is_ok();
            // The lock table, a thousand keys at a time, until the server says no.
            let mut from = 1i64;
            while held && from < 10_000_000 {
                held = keys
                    .query(
                        "SELECT pg_advisory_lock(k) FROM generate_series($1::int8, $1 + 999) k",
                        &[&from],
                    )
                    .await
                    .is_ok();
                from += 1000;
            }
            // And temporary tables, each a slot of the lock table while its transaction lasts:
            // kept open (refused on a hardened cluster).
            let temp_refused = keys
                .batch_execute(
                    "BEGIN; DO $$ BEGIN FOR i IN 1..5000 LOOP \
                     EXECUTE format('CREATE TEMP TABLE chaos_t%s (x int)', i); END LOOP; END $$",
                )
                .await
                .is_err();
            if temp_refused {
                let _ = keys.batch_execute("ROLLBACK").await;
            }
            let listening = listener
                .batch_execute("LISTEN permitq_events")
                .await
                .is_ok()
                && listener.batch_execute("BEGIN; SELECT 1").await.is_ok();
            if listening {
                tracing::info!(
                    advisory_locks_refused = !held,
                    temp_tables_refused = temp_refused,
                    "a stranger tried the lock table and LISTENs to permitq_events idle in a transaction"
                );
                // Until the server goes away (a restart fault): then again.
                while keys.simple_query("SELECT 1").await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

type EventCounts = (
    Arc<Mutex<HashMap<String, Vec<Option<i64>>>>>,
    tokio::task::JoinHandle<()>,
);

/// Records the fencing token of every announced grant per external_id ([`count_acquired`]: a
/// second grant would show up as a second one, or a token that is not the request's), once it is durable
/// ([`permitq::DURABILITY_BARRIER`]). LISTENs on its own connection and reconnects when the
/// database restarts.
fn record_acquired_events(url: String) -> EventCounts {
    let counts = Arc::new(Mutex::new(HashMap::new()));
    let sink = counts.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok(config) = url.parse::<tokio_postgres::Config>() else {
                return;
            };
            if let Ok((client, mut connection)) = config.connect(tokio_postgres::NoTls).await {
                let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
                let driver = tokio::spawn(async move {
                    let mut stream =
                        futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    while let Some(Ok(msg)) = futures_util::StreamExt::next(&mut stream).await {
                        if let tokio_postgres::AsyncMessage::Notification(n) = msg {
                            let _ = tx.send(n.payload().to_string());
                        }
                    }
                });
                if client.batch_execute("LISTEN permitq_events").await.is_ok() {
                    // As a client must: an event counts once the durability barrier says the
                    // grant reached the synchronous standby (an old primary, cut off in a
                    // failover, can notify a grant that its demotion discards).
                    while let Some(payload) = rx.recv().await {
                        if client
                            .simple_query(permitq::DURABILITY_BARRIER)
                            .await
                            .is_err()
                            || count_acquired(&client, &sink, &payload).await.is_err()
                        {
                            break;
                        }
                    }
                }
                driver.abort();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (counts, task)
}

/// Records the requests one `permitq_events` payload names (ids only, as any listener sees them)
/// that are `acquired` when read just after it, with their token, as a producer reads its own
/// outcome after an event. A grant's announcement reads `acquired`; a release's reads `released`
/// (its state changed before the fold that announces it): a request read `acquired` twice was
/// announced granted twice, and a token read that is not the request's final one was replaced.
async fn count_acquired(
    client: &tokio_postgres::Client,
    sink: &Mutex<HashMap<String, Vec<Option<i64>>>>,
    payload: &str,
) -> Result<(), tokio_postgres::Error> {
    let ids: Vec<i64> = serde_json::from_str(payload).unwrap_or_default();
    let rows = client
        .query(
            "SELECT external_id, fencing_token FROM permitq.permit_request
             WHERE id = ANY($1) AND state = 'acquired'",
            &[&ids],
        )
        .await?;
    let mut sink = sink.lock().expect("events");
    for row in rows {
        sink.entry(row.get(0)).or_default().push(row.get(1));
    }
    Ok(())
}

/// Checks every snapshot it can take while the run goes on, per semaphore: `used` never
/// under-counts the permits held; held permits fit the capacity (see [`CapacityEpochs`]); and a
/// rate-limited semaphore's current window holds at most its limit, unless the limit changed
/// within the window.
async fn sample(
    url: String,
    stop: Arc<AtomicBool>,
    findings: Arc<Mutex<Vec<String>>>,
    snapshots: Arc<AtomicU64>,
) {
    let mut epochs = CapacityEpochs::default();
    while !stop.load(Ordering::Relaxed) {
        let Ok(conn) = permitq_embedded_pg::try_connect(&url).await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        while !stop.load(Ordering::Relaxed) {
            let Ok(rows) = conn.query(SAMPLE, &[]).await else {
                break;
            };
            snapshots.fetch_add(1, Ordering::Relaxed);
            let mut found = Vec::new();
            for row in rows {
                let snapshot = Snapshot {
                    name: row.get(0),
                    capacity: row.get(1),
                    used: row.get(2),
                    held: row.get(3),
                    in_window: row.get::<_, Option<i64>>(4),
                    window_since_change: row.get(5),
                    epoch: row.get(6),
                };
                found.extend(epochs.check(&snapshot));
            }
            {
                let mut f = findings.lock().expect("findings");
                let room = 1000usize.saturating_sub(f.len());
                f.extend(found.into_iter().take(room));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// One semaphore in one snapshot: (name, capacity, used, held, permits granted in the current
/// window for a rate-limited one, whether no capacity change fell in that window, the id of the
/// latest capacity change). `held` is worked out from what the acquired requests name and the
/// semaphores' parents (a parent holds what is held below it), not from what permitq recorded
/// a grant took. The window ends at `clock_timestamp()`, read after the statement's snapshot:
/// `now()` (`permitq.in_window`'s end) is the transaction's start, which may come before the
/// snapshot, and a window ending before the snapshot counts an old bucket beside grants that
/// were decided after that bucket had left their own windows.
const SAMPLE: &str = "WITH RECURSIVE up(name, ancestor, depth) AS (
            SELECT s.name, s.name, 0 FROM permitq.semaphore s WHERE NOT s.is_template
            UNION ALL
            SELECT up.name, s.parent, up.depth + 1
            FROM up JOIN permitq.semaphore s ON s.name = up.ancestor
            WHERE s.parent IS NOT NULL AND up.depth < 8
        ),
        held AS (
            SELECT up.ancestor AS name, sum(e.value::int8) AS held
            FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
            JOIN up ON up.name = e.key
            WHERE r.state = 'acquired'
            GROUP BY up.ancestor
        )
     SELECT u.name, u.capacity::int8, u.used, coalesce(h.held, 0)::int8,
        CASE WHEN u.per IS NOT NULL THEN
            (SELECT coalesce(sum(b.count), 0) FROM permitq.rate_bucket b
             WHERE b.semaphore_id = s.id AND b.ends_at > clock_timestamp() - u.per)::int8 END,
        coalesce((SELECT max(c.changed_at) FROM permitq.capacity_change c
                  WHERE c.semaphore = u.name) <= clock_timestamp() - u.per, true),
        (SELECT max(c.id) FROM permitq.capacity_change c WHERE c.semaphore = u.name)
     FROM permitq.semaphore_usage u JOIN permitq.semaphore s ON s.name = u.name
     LEFT JOIN held h ON h.name = u.name
     WHERE NOT u.is_template";

/// A semaphore as the sampler saw it.
struct Snapshot {
    name: String,
    capacity: i64,
    used: i64,
    held: i64,
    in_window: Option<i64>,
    window_since_change: bool,
    epoch: Option<i64>,
}

/// Held ≤ capacity, when capacity can be lowered below what is held (lowering revokes nothing):
/// within one capacity epoch (between two changes), held may only fall while it is above the
/// capacity, and never rise above it, since every grant must fit. So held above the capacity
/// and above the least held seen in the epoch is a grant that did not fit.
#[derive(Default)]
struct CapacityEpochs {
    /// semaphore → (epoch, least held seen in it)
    least_held: HashMap<String, (Option<i64>, i64)>,
}

impl CapacityEpochs {
    fn check(&mut self, s: &Snapshot) -> Vec<String> {
        let mut found = Vec::new();
        if s.used < s.held {
            found.push(format!(
                "{}: used {} under-counts the {} permits held",
                s.name, s.used, s.held
            ));
        }
        if let Some(in_window) = s.in_window {
            if in_window > s.capacity && s.window_since_change {
                found.push(format!(
                    "{}: {in_window} granted in one window > limit {}",
                    s.name, s.capacity
                ));
            }
            return found; // its holders may exceed the limit: it bounds grants per window
        }
        let least = self
            .least_held
            .entry(s.name.clone())
            .or_insert((s.epoch, s.held));
        if least.0 != s.epoch {
            *least = (s.epoch, s.held);
        }
        if s.held > s.capacity && s.held > least.1 {
            found.push(format!(
                "{}: held {} > capacity {} after a grant (least held since the capacity was set: {})",
                s.name, s.held, s.capacity, least.1
            ));
        }
        least.1 = least.1.min(s.held);
        found
    }
}

async fn snapshot(url: &str) -> Result<Vec<(String, i32, i64, i64, i64, f64)>> {
    let conn = permitq_embedded_pg::try_connect(url).await?;
    let rows = conn
        .query(
            "SELECT s.name, s.capacity, s.used,
                    (SELECT count(*) FROM permitq.permit_request r WHERE r.state = 'new' AND r.permits ? s.name),
                    (SELECT count(*) FROM permitq.permit p JOIN permitq.permit_request r ON r.id = p.request_id
                     WHERE p.semaphore = s.name AND p.state = 'acquired' AND r.ttl IS NULL),
                    coalesce((SELECT extract(epoch FROM now() - min(r.created_at))::float8
                              FROM permitq.permit_request r WHERE r.state = 'new' AND r.permits ? s.name), 0)
             FROM permitq.semaphore s ORDER BY s.name",
            &[],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
        .collect())
}

/// After the load: release whatever is held, until nothing is waiting (workers still run), so
/// "nothing lost" and "quiescence" can be checked. Gives up after 30 s: a live system drains its
/// backlog in seconds once nothing is held.
async fn drain(url: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let Ok(conn) = permitq_embedded_pg::try_connect(url).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let step = async {
            conn.batch_execute("SELECT permitq.release(external_id) FROM permitq.permit_request WHERE state = 'acquired'").await?;
            let open: i64 = conn.query_one("SELECT (SELECT count(*) FROM permitq.permit_request WHERE state IN ('new', 'acquired')) + (SELECT count(*) FROM permitq.pending_release)", &[]).await?.get(0);
            Ok::<_, tokio_postgres::Error>(open)
        };
        if let Ok(0) = step.await {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}
