//! `permitq chaos --ha`: PostgreSQL run by Patroni and etcd on a bed of network namespaces,
//! each member on a host of its own, workers on theirs, and this process (producers, sampler,
//! nemesis) on a host of its own too, all through the multi-host URL with
//! `target_session_attrs=read-write`. The nemesis adds the HA faults ([`inject`]); a probe
//! measures how long grants stop around each fault, and a holder with a lease longer than a
//! failover heartbeats through them all ([`Watch`]). [`figures`] puts each fault beside what it
//! did: time until grants resume, acknowledged operations lost, tokens across it, the lease.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::error::{CliError, Result};
use permitq::{Client, Request};
use permitq_embedded_pg::{EmbeddedPostgres, NetworkBed, PatroniCluster};

use super::nemesis::{Fault, Outage};

/// The shape of the Patroni cluster of a run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HaConfig {
    /// Patroni's `synchronous_mode`.
    pub synchronous: bool,
    /// etcd members (1 or 3).
    pub etcd_members: usize,
}

/// The database of a run: one server, or a Patroni cluster.
pub(crate) enum Database {
    /// One throwaway server (the nemesis restarts it).
    Single(Arc<EmbeddedPostgres>),
    /// Three members under Patroni.
    Patroni(Mutex<PatroniCluster>),
}

impl Database {
    /// Whether Patroni runs it.
    pub(crate) fn is_ha(&self) -> bool {
        matches!(self, Database::Patroni(_))
    }
}

/// The probe's semaphore: nothing else uses it, so a probe waits for nothing but the system.
pub(crate) const PROBE: &str = "c-probe";
/// The semaphore of the lease held through the faults.
pub(crate) const KEEPER: &str = "c-keeper";
/// That lease's ttl. A lease outlives an outage that starts just before a heartbeat only if
/// the outage is shorter than ttl × (1 − 1/3 − 1/10) (the heartbeat period and the watchdog's
/// margin): 25 s at 45 s, above the ~15 s of a partitioned leader plus reconnecting.
pub(crate) const KEEPER_TTL: Duration = Duration::from_secs(45);
/// How long a fault may take to be over: until the cluster is healthy again.
const RECOVERY: Duration = Duration::from_secs(90);
/// When a killed Patroni is started again if no other member took over: as a supervisor
/// (systemd's `Restart=`) would, 5 s after the leader key's ttl ran out.
const SUPERVISOR_RESTART: Duration = Duration::from_secs(permitq_embedded_pg::PATRONI_TTL + 5);

fn cluster_of(db: &Database) -> Result<&Mutex<PatroniCluster>> {
    match db {
        Database::Patroni(c) => Ok(c),
        Database::Single(_) => Err(CliError::runtime("HA faults need --ha")),
    }
}

/// Injects HA fault `fault` (blocking) and returns once the cluster is healthy again: a
/// leader, every member replicating and, with `synchronous_mode`, a synchronous standby.
/// `pick` chooses the replica to restart.
pub(crate) fn inject(
    fault: Fault,
    db: &Database,
    bed: Option<&NetworkBed>,
    pick: usize,
) -> Result<()> {
    let runtime = |e: permitq_embedded_pg::Error| CliError::runtime(e.to_string());
    let mut cluster = cluster_of(db)?
        .lock()
        .map_err(|_| CliError::runtime("the cluster's lock is poisoned"))?;
    let leader = cluster.wait_for_leader(RECOVERY).map_err(runtime)?;
    tracing::info!(?fault, leader = leader + 1, "HA fault");
    match fault {
        Fault::KillLeaderPostgres => cluster.kill_postgres(leader),
        Fault::KillLeaderPatroni => {
            // Restarted as a supervisor would: 2 s after another member took over, or after
            // SUPERVISOR_RESTART if none did. (Patroni 3.0 sometimes promotes nobody: the
            // asynchronous replica is ahead of the synchronous standby and each defers to the
            // other as "not the healthiest node"; see docs/chaos.md.)
            cluster.kill_patroni(leader);
            if another_leader(&cluster, leader, SUPERVISOR_RESTART).is_ok() {
                std::thread::sleep(Duration::from_secs(2));
            }
            cluster.restart_member(leader).map_err(runtime)?;
        }
        Fault::PartitionLeader => {
            let bed = bed.ok_or_else(|| CliError::runtime("a partition needs the bed"))?;
            let host = cluster
                .host(leader)
                .ok_or_else(|| CliError::runtime("the members are not on the bed"))?
                .to_string();
            bed.partition(&host)?;
            let promoted = another_leader(&cluster, leader, RECOVERY);
            std::thread::sleep(Duration::from_secs(2));
            bed.heal(&host)?;
            promoted?;
        }
        Fault::Switchover => cluster.switchover().map_err(runtime)?,
        Fault::RestartReplica => {
            let replicas: Vec<usize> = (0..cluster.len())
                .filter(|&i| i != leader && cluster.is_running(i))
                .collect();
            let Some(&replica) = replicas.get(pick % replicas.len().max(1)) else {
                return Err(CliError::runtime("no replica runs"));
            };
            cluster.kill_member(replica);
            std::thread::sleep(Duration::from_secs(1));
            cluster.restart_member(replica).map_err(runtime)?;
        }
        other => return Err(CliError::runtime(format!("{other:?} is not an HA fault"))),
    }
    let deadline = Instant::now() + RECOVERY;
    while !cluster.healthy() {
        if Instant::now() > deadline {
            return Err(CliError::runtime(format!(
                "the cluster was not healthy again within {RECOVERY:?}: {}",
                cluster.logs()
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Waits until a member other than `old` leads, for at most `timeout`.
fn another_leader(cluster: &PatroniCluster, old: usize, timeout: Duration) -> Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        match cluster.leader() {
            Some(new) if new != old => return Ok(new),
            _ if Instant::now() > deadline => {
                return Err(CliError::runtime(format!(
                    "no other member leads: {}",
                    cluster.logs()
                )))
            }
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// A lease's span: from its grant to its loss or release (`None`: still held).
pub(crate) type HeldSpan = (SystemTime, Option<SystemTime>);

/// What the probe and the lease holder saw.
#[derive(Debug, Default, Clone)]
pub(crate) struct Watch {
    /// Every probe grant: when the probe learnt of it, and its token.
    pub grants: Arc<Mutex<Vec<(SystemTime, i64)>>>,
    /// When the lease held through the faults was lost, and why.
    pub lease_losses: Arc<Mutex<Vec<(SystemTime, String)>>>,
    /// When each lease was held: from its grant to its loss or release (`None`: still held).
    pub leases_held: Arc<Mutex<Vec<HeldSpan>>>,
}

impl Watch {
    /// Starts the probe and the lease holder; they run until `stop`.
    pub(crate) fn start(
        url: &str,
        stop: &Arc<AtomicBool>,
    ) -> (Watch, Vec<tokio::task::JoinHandle<()>>) {
        let watch = Watch::default();
        let tasks = vec![
            tokio::spawn(probe(url.to_string(), stop.clone(), watch.grants.clone())),
            tokio::spawn(hold_lease(url.to_string(), stop.clone(), watch.clone())),
        ];
        (watch, tasks)
    }
}

/// Submits a request on [`PROBE`], waits for its grant, releases it; again every 100 ms. A
/// call that hangs (on a server that went away without a word) is given up after 10 s and the
/// client made anew.
async fn probe(url: String, stop: Arc<AtomicBool>, grants: Arc<Mutex<Vec<(SystemTime, i64)>>>) {
    let mut n = 0u64;
    let mut client = None;
    while !stop.load(Ordering::Relaxed) {
        let c = match &client {
            Some(c) => c,
            None => match Client::connect(&url).await {
                Ok(c) => client.insert(c),
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            },
        };
        n += 1;
        let id = format!("probe-{n}");
        // A ttl, so that a probe abandoned after its grant gives its permit back.
        let request = Request::new(&id)
            .permit(PROBE, 1)
            .ttl(Duration::from_secs(30));
        let acquired = tokio::time::timeout(
            Duration::from_secs(10),
            c.acquire(&request, Duration::from_secs(9)),
        )
        .await;
        match acquired {
            Ok(Ok(lease)) => {
                let token = lease.fencing_token();
                grants
                    .lock()
                    .expect("grants")
                    .push((SystemTime::now(), token));
                let _ = tokio::time::timeout(Duration::from_secs(10), lease.release()).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            _ => {
                // Maybe submitted: the run's drain releases it.
                client = None;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Holds a lease on [`KEEPER`] with a ttl of [`KEEPER_TTL`], heartbeating (the client's own
/// lease task) through every fault; records each loss and takes a new lease.
async fn hold_lease(url: String, stop: Arc<AtomicBool>, watch: Watch) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Ok(client) = Client::connect(&url).await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        n += 1;
        let request = Request::new(format!("keeper-{n}"))
            .permit(KEEPER, 1)
            .ttl(KEEPER_TTL);
        let acquired = tokio::time::timeout(
            Duration::from_secs(60),
            client.acquire(&request, Duration::from_secs(55)),
        )
        .await;
        let Ok(Ok(lease)) = acquired else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let held = {
            let mut held = watch.leases_held.lock().expect("leases");
            held.push((SystemTime::now(), None));
            held.len() - 1
        };
        let ended = |watch: &Watch| {
            watch.leases_held.lock().expect("leases")[held].1 = Some(SystemTime::now());
        };
        loop {
            tokio::select! {
                reason = lease.lost() => {
                    ended(&watch);
                    watch.lease_losses.lock().expect("losses").push((SystemTime::now(), reason));
                    break;
                }
                () = tokio::time::sleep(Duration::from_millis(200)) => {
                    if stop.load(Ordering::Relaxed) {
                        ended(&watch);
                        let _ = tokio::time::timeout(Duration::from_secs(10), lease.release()).await;
                        return;
                    }
                }
            }
        }
    }
}

/// One fault and what it did.
#[derive(Debug, Clone)]
pub(crate) struct FaultFigures {
    /// Which fault, and when.
    pub outage: Outage,
    /// The longest time without a probe grant around it.
    pub grants_paused: Duration,
    /// Acknowledged operations lost, told to the client before it ended (and after the one
    /// before it ended).
    pub lost: usize,
    /// Whether the first probe token after it is above every one before it (None: no grant on
    /// one side).
    pub tokens_rose: Option<bool>,
    /// Whether the first probe token after it is in a higher epoch (a promotion).
    pub new_epoch: bool,
    /// Whether the lease held when it began survived it (`None`: none was held then).
    pub lease_kept: Option<bool>,
}

/// Puts each fault beside the probe's grants, the losses and the lease.
pub(crate) fn figures(
    faults: &[Outage],
    watch: &Watch,
    lost: &[(SystemTime, String)],
    load_end: SystemTime,
) -> Vec<FaultFigures> {
    let mut grants = watch.grants.lock().expect("grants").clone();
    grants.sort_unstable();
    let held = watch.leases_held.lock().expect("leases").clone();
    let losses = watch.lease_losses.lock().expect("losses").clone();
    let mut sorted: Vec<Outage> = faults.to_vec();
    sorted.sort_by_key(|f| f.from);
    let settle = Duration::from_secs(5);
    // Each loss is charged to the first fault that ended after the client was told (by its
    // start): an asynchronous failover loses what was acknowledged just before it.
    let charged: Vec<Option<SystemTime>> = lost
        .iter()
        .map(|(at, _)| sorted.iter().find(|g| g.to >= *at).map(|g| g.from))
        .collect();
    sorted
        .iter()
        .map(|f| {
            // Gaps between consecutive grants that overlap the fault (or its settling).
            let mut paused = Duration::ZERO;
            let mut previous = grants.iter().rev().find(|g| g.0 <= f.from).map(|g| g.0);
            for g in grants.iter().filter(|g| g.0 > f.from) {
                if let Some(p) = previous {
                    if p > f.to + settle {
                        break;
                    }
                    paused = paused.max(g.0.duration_since(p).unwrap_or_default());
                }
                previous = Some(g.0);
            }
            let after = grants.iter().find(|g| g.0 > f.to);
            if after.is_none() {
                // No grant after it: paused until the load ended.
                let since = previous.unwrap_or(f.from);
                paused = paused.max(load_end.duration_since(since).unwrap_or_default());
            }
            let before = grants.iter().filter(|g| g.0 <= f.from).map(|g| g.1).max();
            let tokens_rose = match (before, after) {
                (Some(b), Some(a)) => Some(a.1 > b),
                _ => None,
            };
            let new_epoch = matches!((before, after), (Some(b), Some(a)) if a.1 >> 48 > b >> 48);
            // Judged if a lease was held when the fault began: kept unless a loss was noticed
            // by a ttl after the fault ended (the watchdog notices within a ttl). A lease
            // released because the load stopped was not lost.
            let lease_kept = held
                .iter()
                .any(|(from, until)| *from <= f.from && until.is_none_or(|t| t > f.from))
                .then(|| {
                    !losses
                        .iter()
                        .any(|(at, _)| *at >= f.from && *at <= f.to + KEEPER_TTL)
                });
            FaultFigures {
                outage: *f,
                grants_paused: paused,
                lost: charged.iter().filter(|c| **c == Some(f.from)).count(),
                tokens_rose,
                new_epoch,
                lease_kept,
            }
        })
        .collect()
}

/// The per-fault table of a run's summary: for each kind, how many, grants paused (p50 and
/// max), acknowledged operations lost, promotions seen in the tokens, tokens above all before,
/// leases kept.
pub(crate) fn table(figures: &[FaultFigures]) -> String {
    let mut by_kind: BTreeMap<Fault, Vec<&FaultFigures>> = BTreeMap::new();
    for f in figures {
        by_kind.entry(f.outage.kind).or_default().push(f);
    }
    let mut s = format!(
        "{:<22} {:>3} {:>13} {:>13} {:>5} {:>10} {:>11} {:>11}\n",
        "per fault",
        "n",
        "paused p50 s",
        "paused max s",
        "lost",
        "new epoch",
        "tokens rose",
        "lease kept"
    );
    for (kind, list) in by_kind {
        let mut paused: Vec<f64> = list.iter().map(|f| f.grants_paused.as_secs_f64()).collect();
        paused.sort_by(f64::total_cmp);
        let p50 = paused[paused.len() / 2];
        let max = paused.last().copied().unwrap_or(0.0);
        let judged: Vec<bool> = list.iter().filter_map(|f| f.tokens_rose).collect();
        s += &format!(
            "{:<22} {:>3} {:>13.1} {:>13.1} {:>5} {:>10} {:>11} {:>11}\n",
            format!("{kind:?}"),
            list.len(),
            p50,
            max,
            list.iter().map(|f| f.lost).sum::<usize>(),
            list.iter().filter(|f| f.new_epoch).count(),
            format!("{}/{}", judged.iter().filter(|r| **r).count(), judged.len()),
            format!(
                "{}/{}",
                list.iter().filter(|f| f.lease_kept == Some(true)).count(),
                list.iter().filter(|f| f.lease_kept.is_some()).count()
            ),
        );
    }
    s
}
