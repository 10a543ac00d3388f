//! High availability on real tools: Patroni (with etcd) runs three PostgreSQL members with
//! `synchronous_mode`, workers and producers use the multi-host URL with
//! `target_session_attrs=read-write`, and under load the leader is killed outright, or handed
//! over with `patronictl switchover`. Patroni promotes the synchronous standby on its own.
//! Checked on the new leader: every acknowledged submit, grant (with the token the producer was
//! shown) and release is there; no semaphore was ever over capacity (from the permit
//! intervals); fencing tokens increase in grant order on each semaphore, and every token issued
//! after the promotion is above every token issued before it; grants resume within a bound; a
//! lease longer than the failover, heartbeating through it, is kept.

use permitq_test_support as common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{check_invariants, quiet_config, PatroniCluster, PatroniOptions, RunningWorker};
use permitq::{Client, ReleaseOutcome, Request, State};

/// What the producers were told: submits acknowledged, and grants with their tokens.
#[derive(Default)]
struct Acknowledged {
    submitted: Vec<String>,
    granted: Vec<(String, i64)>,
}

/// One Patroni cluster at a time: two in parallel on 2 cores starve Patroni's loop.
static ONE_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Retries `op` (an idempotent call) until it succeeds: during the failover calls fail.
async fn retried<T, F, Fut>(mut op: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = permitq::Result<T>>,
{
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) => {
                assert!(Instant::now() < deadline, "still failing after 90 s: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One producer: submit, wait for the grant, release; again, until `stop`.
async fn producer(
    client: Client,
    n: usize,
    log: Arc<Mutex<Acknowledged>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) {
    let mut i = 0;
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let id = format!("p{n}-{i}");
        i += 1;
        // A lease far longer than the test: a release that went missing cannot hide as an
        // expiry.
        let request = Request::new(&id)
            .permit("gpu", 1)
            .ttl(Duration::from_secs(600));
        retried(|| client.submit(&request)).await;
        log.lock().unwrap().submitted.push(id.clone());
        let token = loop {
            let row = retried(|| client.wait_settled(&id, Duration::from_secs(5))).await;
            match row {
                Some(r) if r.state == State::Acquired => break r.fencing_token.unwrap(),
                Some(r) if r.state == State::New => continue,
                other => panic!("{id} ended {other:?}"),
            }
        };
        log.lock().unwrap().granted.push((id.clone(), token));
        let outcome = retried(|| client.release(&id)).await;
        assert!(
            matches!(
                outcome,
                ReleaseOutcome::Released | ReleaseOutcome::AlreadyReleased
            ),
            "{id}: {outcome}"
        );
    }
}

/// How the leader goes away.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// SIGKILL of its Patroni and its PostgreSQL: its leader key runs out (ttl 10 s).
    KillLeader,
    /// `patronictl switchover`: a planned handover.
    Switchover,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patroni_failover_under_load_loses_nothing_and_tokens_keep_increasing() {
    under_load(Fault::KillLeader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patroni_switchover_under_load_loses_nothing_and_tokens_keep_increasing() {
    under_load(Fault::Switchover).await;
}

async fn under_load(fault: Fault) {
    let _one = ONE_CLUSTER.lock().await;
    let mut cluster =
        tokio::task::spawn_blocking(|| PatroniCluster::start(PatroniOptions::new(true), None))
            .await
            .unwrap()
            .expect("a Patroni cluster (scripts/test installs patroni and etcd-server)");
    let url = cluster.url("postgres");
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("gpu", 2, None).await.unwrap();
    client.set_capacity("probe", 1, None).await.unwrap();
    client.set_capacity("lease", 1, None).await.unwrap();
    // synchronous_mode is in force: the leader has a synchronous standby.
    let sync: i64 = common::connect(&url)
        .await
        .query_one(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(sync, 1, "one synchronous standby");
    let workers = [
        RunningWorker::start(&url, quiet_config("ha-1")),
        RunningWorker::start(&url, quiet_config("ha-2")),
    ];
    let log = Arc::new(Mutex::new(Acknowledged::default()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let producers: Vec<_> = (0..4)
        .map(|n| {
            let client = client.clone();
            tokio::spawn(producer(client, n, log.clone(), stop.clone()))
        })
        .collect();
    common::wait_until(
        Duration::from_secs(30),
        "grants before the fault",
        || async { log.lock().unwrap().granted.len() >= 20 },
    )
    .await;

    // A holder with a lease longer than the failover, heartbeating in the background.
    let lease = client
        .acquire(
            &Request::new("ha-lease")
                .permit("lease", 1)
                .ttl(Duration::from_secs(30)),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    let old_leader = cluster.wait_for_leader(Duration::from_secs(30)).unwrap();
    let highest_before: i64 = common::connect(&url)
        .await
        .query_one("SELECT max(fencing_token) FROM permitq.permit_request", &[])
        .await
        .unwrap()
        .get(0);
    let killed_at = Instant::now();
    let killed_wall = std::time::SystemTime::now();
    tokio::task::block_in_place(|| match fault {
        Fault::KillLeader => cluster.kill_member(old_leader),
        Fault::Switchover => cluster.switchover().unwrap(),
    });
    // Grants resume: a request submitted after the fault (on a semaphore of its own, so the
    // load does not delay it) is granted.
    let probe = Request::new("probe").permit("probe", 1);
    retried(|| client.submit(&probe)).await;
    let probe_token = loop {
        let row = retried(|| client.wait_settled("probe", Duration::from_secs(5))).await;
        if let Some(r) = row.filter(|r| r.state == State::Acquired) {
            break r.fencing_token.unwrap();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs(60),
            "no grant after the fault"
        );
    };
    let resumed_after = killed_at.elapsed();
    let before = log.lock().unwrap().granted.len();
    common::wait_until(
        Duration::from_secs(60),
        "the load goes on after the fault",
        || async { log.lock().unwrap().granted.len() >= before + 20 },
    )
    .await;
    // Another member leads now (for a kill: the dead one no longer answers at all).
    let deadline = Instant::now() + Duration::from_secs(30);
    let new_leader = loop {
        match cluster.leader() {
            Some(leader) if leader != old_leader => break leader,
            _ => {
                assert!(
                    Instant::now() < deadline,
                    "no other member leads: {}",
                    cluster.logs()
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for p in producers {
        p.await.unwrap();
    }
    eprintln!(
        "patroni {fault:?}: leader m{} gone; m{} promoted; grants resumed after {:.1} s",
        old_leader + 1,
        new_leader + 1,
        resumed_after.as_secs_f64()
    );
    assert!(resumed_after < Duration::from_secs(45), "{resumed_after:?}");
    // The promotion started a new epoch: the first grant after it is above everything before.
    assert!(
        probe_token >> 48 > highest_before >> 48 && probe_token > highest_before,
        "token {probe_token} after the promotion, {highest_before} before"
    );

    // The lease survived: a heartbeat reached the new leader (it heartbeats every 10 s), it
    // was never lost, and it still fences.
    common::wait_until(
        Duration::from_secs(30),
        "a heartbeat of the lease on the new leader",
        || async {
            let Ok(conn) = common::try_connect(&url).await else {
                return false;
            };
            let at: Option<std::time::SystemTime> = conn
                .query_one(
                    "SELECT heartbeat_at FROM permitq.permit_request WHERE external_id = 'ha-lease'",
                    &[],
                )
                .await
                .map_or(None, |row| row.get(0));
            at.is_some_and(|at| at > killed_wall)
        },
    )
    .await;
    let lease_kept = !lease.is_lost()
        && client
            .fence("lease", "ha-resource", lease.fencing_token())
            .await
            .unwrap();
    eprintln!("patroni {fault:?}: a 30 s lease heartbeating through it kept: {lease_kept}");
    assert!(lease_kept, "the lease was lost");
    lease.release().await.unwrap();

    // On the new leader: every acknowledged submit, grant and release.
    client.release("probe").await.unwrap();
    let conn = common::connect(&url).await;
    let (submitted, granted) = {
        let log = log.lock().unwrap();
        (log.submitted.clone(), log.granted.clone())
    };
    for id in &submitted {
        let row = retried(|| client.status(id)).await;
        let row = row.unwrap_or_else(|| panic!("acknowledged submit {id} was lost"));
        assert_eq!(row.state, State::Released, "{id}");
        assert_eq!(
            row.release_reason,
            Some(permitq::ReleaseReason::Released),
            "{id}"
        );
    }
    for (id, token) in &granted {
        let row = client.status(id).await.unwrap().unwrap();
        assert_eq!(
            row.fencing_token,
            Some(*token),
            "{id}: the grant acknowledged"
        );
    }
    // Tokens increase in grant order on each semaphore.
    for semaphore in ["gpu", "probe"] {
        let tokens: Vec<i64> = conn
            .query(
                "SELECT fencing_token FROM permitq.permit_request
                 WHERE permits ? $1 AND fencing_token IS NOT NULL
                 ORDER BY acquired_at, fencing_token",
                &[&semaphore],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "{semaphore}: tokens increase in grant order: {tokens:?}"
        );
    }
    // Never over capacity, from the permit intervals; and nothing left held.
    let report = common::collect(&conn, "").await.unwrap();
    assert!(
        report.over_capacity.is_empty(),
        "{:?}",
        report.over_capacity
    );
    check_invariants(&conn).await.unwrap();
    for w in workers {
        w.stop().await;
    }
}
