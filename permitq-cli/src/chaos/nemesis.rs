//! Fault injection on a seeded schedule, while the load runs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::error::{CliError, Result};

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Mutex;

use super::ha::Database;
use super::history::{History, Op, OpKind, Outcome};
use super::{FENCED, SEMAPHORES};
use permitq::Client;
use permitq::Request;
use permitq_embedded_pg::{NetworkBed, StopMode};

/// The kinds of fault, each injected at least once per run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Fault {
    /// SIGKILL a worker process, then restart it.
    KillWorker,
    /// SIGSTOP a holder past its TTL, let another holder write, SIGCONT it.
    PauseHolder,
    /// pg_terminate_backend of every worker connection (LISTEN and pool).
    TerminateConnections,
    /// PostgreSQL stopped with -m immediate and restarted.
    RestartDatabase,
    /// A fair semaphore's capacity lowered while permits are held, then raised back.
    LowerCapacity,
    /// statement_timeout and idle_in_transaction_session_timeout set very short for a while.
    TimeoutBurst,
    /// (--network) A worker's host cut off the network for 1-8 s (packets dropped both ways,
    /// sockets left open), then reconnected.
    Partition,
    /// (--network) A worker's link throttled to 64-512 kbit/s for 3 s (queueing delay that
    /// varies with its traffic, drops past a second of queue).
    SlowLink,
    /// (--ha) SIGKILL of the leader's PostgreSQL; its Patroni restarts it.
    KillLeaderPostgres,
    /// (--ha) SIGKILL of the leader's Patroni; its PostgreSQL runs on until the Patroni,
    /// restarted once another member leads (or after 15 s, as a supervisor would), demotes it.
    KillLeaderPatroni,
    /// (--ha) The leader's host cut off until another member leads, then reconnected.
    PartitionLeader,
    /// (--ha) `patronictl switchover`.
    Switchover,
    /// (--ha) A replica's Patroni and PostgreSQL killed and started again.
    RestartReplica,
    /// (--previous, a rolling upgrade) This build's `permitq migrate`, while the previous
    /// build's workers grant under load. Not drawn at random.
    Migrate,
    /// (--previous) A previous build's worker stopped with SIGTERM and this build's started in
    /// its place. Not drawn at random.
    UpgradeWorker,
}

impl Fault {
    /// The kinds that need no network bed.
    const LOCAL: [Fault; 6] = [
        Fault::KillWorker,
        Fault::PauseHolder,
        Fault::TerminateConnections,
        Fault::RestartDatabase,
        Fault::LowerCapacity,
        Fault::TimeoutBurst,
    ];

    /// The kinds of a run under Patroni. A restart of the database is Patroni's to make, and
    /// `ALTER SYSTEM` (the timeout burst) changes one member only.
    const HA: [Fault; 9] = [
        Fault::KillWorker,
        Fault::PauseHolder,
        Fault::TerminateConnections,
        Fault::LowerCapacity,
        Fault::KillLeaderPostgres,
        Fault::KillLeaderPatroni,
        Fault::PartitionLeader,
        Fault::Switchover,
        Fault::RestartReplica,
    ];

    /// The faults only a run under Patroni injects.
    pub(crate) const HA_ONLY: [Fault; 5] = [
        Fault::KillLeaderPostgres,
        Fault::KillLeaderPatroni,
        Fault::PartitionLeader,
        Fault::Switchover,
        Fault::RestartReplica,
    ];

    /// Every kind a run injects: the local ones (or with `ha` those of a Patroni cluster), and
    /// with `network` the network ones.
    pub(crate) fn kinds(network: bool, ha: bool) -> Vec<Fault> {
        let mut kinds = if ha {
            Fault::HA.to_vec()
        } else {
            Fault::LOCAL.to_vec()
        };
        if network {
            kinds.extend([Fault::Partition, Fault::SlowLink]);
        }
        kinds
    }
}

/// The span of a fault: the liveness deadlines allow for it (and for its aftermath: a
/// partitioned worker keeps its locks until the server's idle bound).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outage {
    /// Which fault.
    pub kind: Fault,
    /// When it began.
    pub from: SystemTime,
    /// When it ended.
    pub to: SystemTime,
}

/// What the nemesis did.
#[derive(Debug, Default)]
pub(crate) struct Injected {
    /// Faults injected, by kind.
    pub counts: BTreeMap<Fault, u32>,
    /// Every fault's span.
    pub faults: Vec<Outage>,
    /// Injections that failed, and why (the fault may have happened in part).
    pub failed: Vec<(Fault, String)>,
}

/// The worker processes, restartable; each runs the binary of its slot (a rolling upgrade
/// replaces them one at a time).
pub(crate) struct Workers {
    url: String,
    /// Where each worker's log goes (`w<i>.log`, appended across restarts): ERROR lines at the
    /// least, for [`Workers::failed_passes`].
    logs: PathBuf,
    /// How many run.
    count: usize,
    /// With --network: worker i runs in namespace `namespaces[i]`.
    namespaces: Option<Vec<String>>,
    sweep_interval: Duration,
    children: Mutex<Vec<(Child, PathBuf)>>,
}

impl Workers {
    /// Starts `n` `permitq worker` processes.
    pub(crate) async fn start(
        binary: PathBuf,
        url: String,
        n: usize,
        namespaces: Option<Vec<String>>,
        sweep_interval: Duration,
    ) -> Result<Workers> {
        let nanos = SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let logs =
            std::env::temp_dir().join(format!("permitq-chaos-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&logs)?;
        let workers = Workers {
            url,
            logs,
            count: n,
            namespaces,
            sweep_interval,
            children: Mutex::new(Vec::new()),
        };
        for i in 0..n {
            let child = workers.spawn(i, &binary)?;
            workers.children.lock().await.push((child, binary.clone()));
        }
        Ok(workers)
    }

    fn spawn(&self, i: usize, binary: &PathBuf) -> Result<Child> {
        let mut cmd = match &self.namespaces {
            None => Command::new(binary),
            Some(namespaces) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", &namespaces[i]]).arg(binary);
                cmd
            }
        };
        // The workers' logs, in files of their own: their errors at the least, or the filter
        // PERMITQ_CHAOS_WORKER_LOG (e.g. `warn`), whose lines also go to this process's stderr.
        let filter = std::env::var("PERMITQ_CHAOS_WORKER_LOG").ok();
        let log = filter
            .clone()
            .unwrap_or_else(|| "permitq::worker=error".to_string());
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.logs.join(format!("w{i}.log")))?;
        Ok(cmd
            .args([
                "worker",
                "--id",
                &format!("chaos-w{i}"),
                "--batch-size",
                "20",
            ])
            .args([
                "--sweep-interval",
                &format!("{}ms", self.sweep_interval.as_millis()),
            ])
            .env("DATABASE_URL", &self.url)
            .env("RUST_LOG", &log)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(if filter.is_some() {
                Stdio::inherit()
            } else {
                Stdio::from(file)
            })
            .kill_on_drop(true)
            .spawn()?)
    }

    async fn kill_and_restart(&self, i: usize) -> Result<()> {
        let mut children = self.children.lock().await;
        let i = i % children.len();
        let (child, binary) = &mut children[i];
        child.kill().await?; // SIGKILL
        tokio::time::sleep(Duration::from_millis(300)).await;
        *child = self.spawn(i, binary)?;
        Ok(())
    }

    /// Stops worker `i` as a rolling restart does (SIGTERM, then waits for it to exit, at most
    /// 15 s) and starts `binary` in its place. Its exit status is returned: a worker that stopped
    /// on its own before (an old worker that refused the new schema) shows here.
    pub(crate) async fn replace(
        &self,
        i: usize,
        binary: &PathBuf,
    ) -> Result<std::process::ExitStatus> {
        let mut children = self.children.lock().await;
        let (child, slot) = &mut children[i];
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status()
                .await;
        }
        let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .map_err(|_| {
                CliError::runtime(format!("worker {i} did not stop within 15 s of SIGTERM"))
            })??;
        *child = self.spawn(i, binary)?;
        *slot = binary.clone();
        Ok(status)
    }

    /// How many workers run.
    fn len(&self) -> usize {
        self.count
    }

    /// The workers' passes that failed on a program error: a data exception (SQLSTATE class
    /// 22), an undefined or invalid object (42), an internal error (XX). No fault makes those
    /// (faults make connection errors, timeouts, cancels and serialization failures): each one
    /// stalled every semaphore of the worker until it passed. With PERMITQ_CHAOS_WORKER_LOG set
    /// the lines go to stderr instead, and none is found.
    pub(crate) fn failed_passes(&self) -> Vec<String> {
        let Ok(dir) = std::fs::read_dir(&self.logs) else {
            return Vec::new();
        };
        let mut found = Vec::new();
        for entry in dir.flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            found.extend(
                text.lines()
                    .filter(|l| l.contains("pass failed"))
                    .filter(|l| {
                        ["(SQLSTATE 22", "(SQLSTATE 42", "(SQLSTATE XX"]
                            .iter()
                            .any(|class| l.contains(class))
                    })
                    .map(|l| format!("{}: {l}", entry.file_name().to_string_lossy())),
            );
        }
        found
    }

    /// Removes the workers' logs.
    pub(crate) fn remove_logs(&self) {
        let _ = std::fs::remove_dir_all(&self.logs);
    }

    /// SIGTERM to every worker; waits for them to exit.
    pub(crate) async fn stop(&self) {
        for (child, _) in self.children.lock().await.iter_mut() {
            if let Some(pid) = child.id() {
                let _ = Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(15), child.wait()).await;
        }
    }
}

/// Injects faults until `stop`: every kind once first (shuffled by the seed), then at random.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run(
    seed: u64,
    every: Duration,
    db: Arc<Database>,
    url: String,
    binary: PathBuf,
    workers: Arc<Workers>,
    bed: Option<Arc<NetworkBed>>,
    history: History,
    stop: Arc<AtomicBool>,
) -> Injected {
    let mut rng = fastrand::Rng::with_seed(seed);
    let kinds = Fault::kinds(bed.is_some(), db.is_ha());
    let mut schedule = kinds.clone();
    rng.shuffle(&mut schedule);
    // Under Patroni the HA faults go first (each takes until the cluster is healthy again), so
    // that a short run has every one of them.
    schedule.sort_by_key(|k| !Fault::HA_ONLY.contains(k));
    let mut injected = Injected::default();
    let mut next = 0usize;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(every).await;
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let fault = schedule
            .get(next)
            .copied()
            .unwrap_or_else(|| kinds[rng.usize(..kinds.len())]);
        next += 1;
        let started = SystemTime::now();
        let result = inject(
            fault,
            &mut rng,
            &db,
            &url,
            &binary,
            &workers,
            bed.as_ref(),
            &history,
        )
        .await;
        match result {
            Ok(()) => *injected.counts.entry(fault).or_insert(0) += 1,
            Err(e) => {
                tracing::warn!(?fault, error = %e, "fault injection failed");
                injected.failed.push((fault, e.to_string()));
            }
        }
        let during = Outage {
            kind: fault,
            from: started,
            to: SystemTime::now(),
        };
        injected.faults.push(during);
    }
    injected
}

#[allow(clippy::too_many_arguments)]
async fn inject(
    fault: Fault,
    rng: &mut fastrand::Rng,
    db: &Arc<Database>,
    url: &str,
    binary: &PathBuf,
    workers: &Workers,
    bed: Option<&Arc<NetworkBed>>,
    history: &History,
) -> Result<()> {
    tracing::info!(?fault, "injecting");
    match fault {
        Fault::KillWorker => workers.kill_and_restart(rng.usize(..64)).await,
        Fault::PauseHolder => pause_holder(url, binary, history).await,
        Fault::TerminateConnections => {
            admin(url, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE 'permitq chaos-w%'").await
        }
        Fault::RestartDatabase => {
            let Database::Single(pg) = &**db else {
                return Err(CliError::runtime("under Patroni, Patroni restarts PostgreSQL"));
            };
            let pg = pg.clone();
            tokio::task::spawn_blocking(move || {
                pg.stop(StopMode::Immediate)?;
                std::thread::sleep(Duration::from_millis(300));
                pg.start_server()
            })
            .await
            .map_err(|e| crate::error::CliError::runtime(e.to_string()))?
            .map_err(CliError::from)
        }
        Fault::Migrate | Fault::UpgradeWorker => Err(CliError::runtime(
            "a rolling upgrade's steps are not drawn at random (--previous)",
        )),
        Fault::KillLeaderPostgres
        | Fault::KillLeaderPatroni
        | Fault::PartitionLeader
        | Fault::Switchover
        | Fault::RestartReplica => {
            let (db, bed, pick) = (db.clone(), bed.cloned(), rng.usize(..64));
            tokio::task::spawn_blocking(move || super::ha::inject(fault, &db, bed.as_deref(), pick))
                .await
                .map_err(|e| CliError::runtime(e.to_string()))?
        }
        Fault::LowerCapacity => lower_capacity(url, rng).await,
        Fault::TimeoutBurst => {
            admin(url, "ALTER SYSTEM SET statement_timeout = '30ms'").await?;
            admin(url, "ALTER SYSTEM SET idle_in_transaction_session_timeout = '50ms'").await?;
            admin(url, "SELECT pg_reload_conf()").await?;
            tokio::time::sleep(Duration::from_millis(1500)).await;
            retry_admin(url, "ALTER SYSTEM RESET statement_timeout").await?;
            retry_admin(url, "ALTER SYSTEM RESET idle_in_transaction_session_timeout").await?;
            retry_admin(url, "SELECT pg_reload_conf()").await
        }
        Fault::Partition | Fault::SlowLink => {
            let bed = bed.ok_or_else(|| CliError::runtime("network faults need --network"))?;
            let i = rng.usize(..workers.len());
            let host = format!("w{i}");
            if fault == Fault::Partition {
                let cut = Duration::from_millis(rng.u64(1_000..8_000));
                tracing::info!(%host, ?cut, "partition");
                bed.partition(&host)?;
                tokio::time::sleep(cut).await;
                bed.heal(&host)?;
            } else {
                let kbit = [64, 128, 256, 512][rng.usize(..4)];
                tracing::info!(%host, kbit, "slow link");
                bed.slow_link(&host, kbit)?;
                tokio::time::sleep(Duration::from_secs(3)).await;
                bed.clear_link(&host)?;
            }
            Ok(())
        }
    }
}

/// How long [`Fault::LowerCapacity`] lasts.
const LOWERED_FOR: Duration = Duration::from_millis(3000);

/// [`Fault::LowerCapacity`]: for [`LOWERED_FOR`], lowers fair semaphores' capacity to 1 while
/// each holds at least 2 and has waiters (its free room below 0, waiters to examine: what the
/// fault is for), waking the workers so that passes examine them while they are so; puts each
/// back once its room is 0 or more again (a release there), and lowers it again when it next
/// qualifies; at the end puts every capacity back. Each is picked in the statement that lowers
/// it. One window closes at the first release there, at times before a loaded machine's next
/// pass: a planted bug that fails such passes went unnoticed in CI with one window; with a
/// window per refill, there are dozens. None qualifying within 8 s, one is lowered anyway, with
/// a warning on stderr.
async fn lower_capacity(url: &str, rng: &mut fastrand::Rng) -> Result<()> {
    let fair: Vec<&(&str, i32, bool)> = SEMAPHORES.iter().filter(|s| s.2).collect();
    let names: Vec<String> = fair.iter().map(|s| s.0.to_string()).collect();
    let capacity_of = |name: &str| fair.iter().find(|s| s.0 == name).map_or(1, |s| s.1);
    let conn = permitq_embedded_pg::try_connect(url).await?;
    // Lowers the one that holds the most among those not lowered now, if one qualifies.
    let lower_one = |lowered: Vec<String>| {
        let (conn, names) = (&conn, &names);
        async move {
            let row = conn
                .query_opt(
                    "WITH pick AS (
                         SELECT s.name FROM permitq.semaphore s
                         WHERE s.name = ANY($1) AND s.name <> ALL($2)
                           AND s.capacity - permitq.free_room(s) >= 2
                           AND EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id)
                         ORDER BY s.capacity - permitq.free_room(s) DESC, s.name
                         LIMIT 1)
                     SELECT name, permitq.set_capacity(name, 1)::text FROM pick",
                    &[names, &lowered],
                )
                .await?;
            Ok::<_, CliError>(row.map(|r| r.get::<_, String>(0)))
        }
    };
    let mut lowered: Vec<String> = Vec::new();
    let mut windows = 0u32;
    let deadline = Instant::now() + Duration::from_secs(8);
    while lowered.is_empty() {
        if let Some(name) = lower_one(lowered.clone()).await? {
            lowered.push(name);
        } else if Instant::now() >= deadline {
            let name = fair[rng.usize(..fair.len())].0;
            tracing::warn!(
                name,
                "LowerCapacity: no fair semaphore held 2 with waiters within 8 s: lowered one anyway"
            );
            conn.execute("SELECT permitq.set_capacity($1, 1)", &[&name])
                .await?;
            lowered.push(name.to_string());
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    windows += 1;
    let until = Instant::now() + LOWERED_FOR;
    while Instant::now() < until {
        // Workers that are busy poll; one asleep takes the wake-up.
        let _ = conn
            .execute("SELECT pg_notify('permitq_work', '')", &[])
            .await;
        // Those whose room is back to 0 or more: their capacity back, to refill.
        if let Ok(rows) = conn
            .query(
                "SELECT s.name FROM permitq.semaphore s
                 WHERE s.name = ANY($1) AND permitq.free_room(s) >= 0",
                &[&lowered],
            )
            .await
        {
            for row in rows {
                let name: String = row.get(0);
                retry_admin(
                    url,
                    &format!(
                        "SELECT permitq.set_capacity('{name}', {})",
                        capacity_of(&name)
                    ),
                )
                .await?;
                lowered.retain(|l| *l != name);
            }
        }
        if let Ok(Some(name)) = lower_one(lowered.clone()).await {
            lowered.push(name);
            windows += 1;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for name in &lowered {
        retry_admin(
            url,
            &format!(
                "SELECT permitq.set_capacity('{name}', {})",
                capacity_of(name)
            ),
        )
        .await?;
    }
    tracing::info!(
        windows,
        "LowerCapacity: capacities lowered to 1 and put back"
    );
    Ok(())
}

async fn admin(url: &str, sql: &str) -> Result<()> {
    let conn = permitq_embedded_pg::try_connect(url).await?;
    conn.batch_execute(sql).await?;
    Ok(())
}

/// Undoing a fault must not be lost to the fault itself (or to the next one): retry for a while.
async fn retry_admin(url: &str, sql: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match admin(url, sql).await {
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(error = %e, "retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return other,
        }
    }
}

/// Holder A (a process) acquires the fenced semaphore with a short TTL and is SIGSTOPped; once
/// its lease is released as expired, holder B acquires, writes with its token; A is resumed and
/// writes with its stale token. Both writes are recorded as Fence operations.
async fn pause_holder(url: &str, binary: &PathBuf, history: &History) -> Result<()> {
    let a_id = format!("holder-a-{}", uuid::Uuid::new_v4().simple());
    let mut a = Command::new(binary)
        .args(["chaos-holder", &a_id])
        .env("DATABASE_URL", url)
        .env("RUST_LOG", "off")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(a.stdout.take().expect("piped")).lines();
    let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
    let Ok(Ok(Some(first))) = first else {
        return Err(crate::error::CliError::runtime("holder A did not acquire"));
    };
    let a_token: i64 = first.trim_start_matches("token ").parse().unwrap_or(-1);
    let pid = a.id().expect("running").to_string();
    Command::new("kill").args(["-STOP", &pid]).status().await?;

    let client = Client::connect(url).await?;
    let deadline = Instant::now() + Duration::from_secs(20);
    let b_id = format!("holder-b-{}", uuid::Uuid::new_v4().simple());
    let result = async {
        fence_between_expiry_and_sweep(url, &client, history, &a_id, a_token).await?;
        loop {
            if let Ok(Some(r)) = client.status(&a_id).await {
                if r.state != permitq::State::Acquired {
                    break;
                }
            }
            if Instant::now() > deadline {
                return Err(crate::error::CliError::runtime(
                    "holder A's lease was not reclaimed",
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let b = client
            .acquire(
                &Request::new(&b_id)
                    .permit(FENCED, 1)
                    .ttl(Duration::from_secs(30)),
                Duration::from_secs(20),
            )
            .await?;
        fence(&client, history, &b_id, b.fencing_token()).await;
        Ok(b)
    }
    .await;
    Command::new("kill").args(["-CONT", &pid]).status().await?;
    let second = tokio::time::timeout(Duration::from_secs(20), lines.next_line()).await;
    if let Ok(Ok(Some(line))) = second {
        let accepted = line.trim() == "fenced true";
        history.record(Op {
            client: usize::MAX,
            kind: OpKind::Fence,
            key: a_id.clone(),
            arg: a_token,
            invoked: SystemTime::now(),
            completed: SystemTime::now(),
            outcome: Outcome::Ok(accepted.to_string()),
        });
    }
    let _ = tokio::time::timeout(Duration::from_secs(10), a.wait()).await;
    result?.release().await?;
    Ok(())
}

/// A write of holder A's arriving after its lease ran out but before the sweep released it:
/// A's row is held (FOR SHARE, so the sweep's SKIP LOCKED passes it by) until its `expires_at`
/// has passed, and its token is offered to `permitq.fence` then. The *fencing* checker holds
/// that a lease that ran out fences its holder out even before anyone else writes.
async fn fence_between_expiry_and_sweep(
    url: &str,
    client: &Client,
    history: &History,
    a_id: &str,
    a_token: i64,
) -> Result<()> {
    let conn = permitq_embedded_pg::try_connect(url).await?;
    // In a transaction, so the lock lasts past the statement.
    conn.batch_execute("BEGIN").await?;
    let row = conn
        .query_opt(
            "SELECT 1 FROM permitq.permit_request WHERE external_id = $1 AND state = 'acquired' \
             FOR SHARE",
            &[&a_id],
        )
        .await?;
    if row.is_none() {
        return Ok(()); // already swept: nothing to offer between the two
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ran_out: bool = conn
            .query_one(
                "SELECT expires_at < clock_timestamp() FROM permitq.permit_request \
                 WHERE external_id = $1",
                &[&a_id],
            )
            .await?
            .get(0);
        if ran_out {
            break;
        }
        if Instant::now() > deadline {
            return Err(crate::error::CliError::runtime(
                "holder A's lease did not run out",
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    fence(client, history, a_id, a_token).await;
    conn.batch_execute("COMMIT").await?;
    Ok(())
}

async fn fence(client: &Client, history: &History, holder: &str, token: i64) {
    let invoked = SystemTime::now();
    let outcome = match client.fence(FENCED, FENCED, token).await {
        Ok(accepted) => Outcome::Ok(accepted.to_string()),
        Err(e) => super::history::outcome_of_error(&e),
    };
    history.record(Op {
        client: usize::MAX,
        kind: OpKind::Fence,
        key: holder.to_string(),
        arg: token,
        invoked,
        completed: SystemTime::now(),
        outcome,
    });
}

/// `permitq chaos-holder EXTERNAL_ID`: holder A of the pause-holder fault. Acquires the fenced
/// semaphore with a 500ms TTL, prints `token N`, "works" 300 ms (it is paused here), then writes
/// through `permitq.fence` and prints `fenced true|false`.
pub(crate) async fn holder_process(url: &str, external_id: &str) -> Result<()> {
    let client = Client::connect(url).await?;
    let request = Request::new(external_id)
        .permit(FENCED, 1)
        .ttl(Duration::from_millis(500));
    let lease = client.acquire(&request, Duration::from_secs(20)).await?;
    outln!("token {}", lease.fencing_token());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let accepted = client.fence(FENCED, FENCED, lease.fencing_token()).await?;
    outln!("fenced {accepted}");
    Ok(())
}
