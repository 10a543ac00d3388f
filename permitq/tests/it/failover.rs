//! PostgreSQL failover: a primary and a streaming standby from `pg_basebackup`, the primary
//! killed (`pg_ctl stop -m immediate`) under load, the standby promoted. Workers, producers and a
//! lease holder use one multi-host URL (`target_session_attrs=read-write`) and carry on with no
//! operator action.
//!
//! - Synchronous replication: nothing acknowledged is lost (submits, grants with their tokens,
//!   releases, heartbeats), safety holds across the switch, tokens strictly increase in grant
//!   order, and the lease survives.
//! - Asynchronous replication: what the standby had not received when the primary died is lost
//!   (measured here: every request submitted and granted after replication was cut; a lease
//!   granted then learns at its next heartbeat that it is gone), but no
//!   fencing token is ever issued twice: the epoch in a token's high bits (one more per timeline) puts
//!   every token of the new primary above every token of the old one, although its sequence has
//!   gone back.

use permitq_test_support as common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{
    quiet_config, wait_until, EmbeddedPostgres, RunningWorker, StopMode, THROWAWAY_SETTINGS,
};
use permitq::{Client, Request, State};

/// What every operation of a producer may take, failover included.
const OPERATION_DEADLINE: Duration = Duration::from_secs(60);
const TOKEN_TIMELINE_SHIFT: u32 = 48;

/// The URL every process uses: both servers, whichever accepts writes.
fn multi_host_url(primary: &EmbeddedPostgres, standby: &EmbeddedPostgres) -> String {
    format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        primary.port(),
        standby.port()
    )
}

/// A primary with settings `primary_extra` and a streaming standby of it.
fn replicated_pair(primary_extra: &[(&str, &str)]) -> (EmbeddedPostgres, EmbeddedPostgres) {
    let mut settings = THROWAWAY_SETTINGS.to_vec();
    settings.extend_from_slice(primary_extra);
    let primary = EmbeddedPostgres::start_with(&settings).expect("primary");
    let standby = primary.start_standby(&THROWAWAY_SETTINGS).expect("standby");
    (primary, standby)
}

/// Kills the primary as a crash would, then promotes the standby. Returns when it accepts writes.
async fn fail_over(primary: &EmbeddedPostgres, standby: &EmbeddedPostgres) {
    primary.stop(StopMode::Immediate).expect("kill the primary");
    standby.promote().expect("promote the standby");
}

/// Retries `op` until it succeeds (a failover in between fails calls with connection errors);
/// panics after [`OPERATION_DEADLINE`].
async fn retrying<T, E, F, Fut>(what: &str, mut op: F) -> T
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + OPERATION_DEADLINE;
    loop {
        match op().await {
            Ok(v) => return v,
            Err(e) => {
                assert!(Instant::now() < deadline, "{what}: still failing: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Waits, riding out a failover, until `id` is granted; returns it as granted.
async fn granted(client: &Client, id: &str) -> permitq::PermitRequest {
    retrying("wait for the grant", || async {
        match client.wait_settled(id, Duration::from_secs(5)).await {
            Ok(Some(r)) if r.state == State::Acquired => Ok(r),
            other => Err(format!("{id} not granted yet: {other:?}")),
        }
    })
    .await
}

/// What producers were told: acknowledged submits, grants (with their tokens) and releases.
#[derive(Default)]
struct Acknowledged {
    submits: BTreeSet<String>,
    grants: BTreeMap<String, i64>,
    releases: BTreeSet<String>,
}

/// One producer's cycle: submit, wait for the grant, release; every acknowledgement recorded.
async fn acknowledged_cycle(
    client: &Client,
    id: &str,
    semaphore: &str,
    acks: &Mutex<Acknowledged>,
) {
    let request = Request::new(id).permit(semaphore, 1);
    retrying("submit", || client.submit(&request)).await;
    acks.lock().unwrap().submits.insert(id.to_string());
    let token = granted(client, id)
        .await
        .fencing_token
        .expect("a granted request has a token");
    acks.lock().unwrap().grants.insert(id.to_string(), token);
    retrying("release", || client.release(id)).await;
    acks.lock().unwrap().releases.insert(id.to_string());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn synchronous_failover_loses_nothing_acknowledged_and_tokens_keep_increasing() {
    common::init_logging();
    // The standby's walreceiver connects with application_name `walreceiver`.
    let (primary, standby) = replicated_pair(&[("synchronous_standby_names", "walreceiver")]);
    let url = multi_host_url(&primary, &standby);
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("fo", 4, Some(true)).await.unwrap();
    let workers: Vec<RunningWorker> = (1..=2)
        .map(|i| RunningWorker::start(&url, quiet_config(&format!("fo-w{i}"))))
        .collect();

    // A lease held across the switch: its heartbeats must reach the new primary.
    let lease = client
        .acquire(
            &Request::new("fo-lease")
                .permit("fo", 1)
                .ttl(Duration::from_secs(10)),
            Duration::from_secs(30),
        )
        .await
        .unwrap();

    let acks = Arc::new(Mutex::new(Acknowledged::default()));
    let cycles = Arc::new(AtomicUsize::new(0));
    let producers: Vec<_> = (0..6)
        .map(|p| {
            let (client, acks, cycles) = (client.clone(), acks.clone(), cycles.clone());
            tokio::spawn(async move {
                for i in 0..25 {
                    acknowledged_cycle(&client, &format!("fo-{p}-{i}"), "fo", &acks).await;
                    cycles.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    wait_until(
        Duration::from_secs(60),
        "40 cycles before the failover",
        || {
            let n = cycles.load(Ordering::Relaxed);
            async move { n >= 40 }
        },
    )
    .await;
    let before = acks.lock().unwrap().grants.len();
    fail_over(&primary, &standby).await;
    let promoted_at = std::time::SystemTime::now();
    for p in producers {
        p.await.unwrap();
    }
    assert!(
        before < 150,
        "the failover happened under load ({before} grants before it)"
    );

    // The lease's heartbeats reach the new primary, and it was never lost.
    let conn = common::connect(&url).await;
    wait_until(Duration::from_secs(30), "a heartbeat on the new primary", || {
        let conn = &conn;
        async move {
            let at: Option<std::time::SystemTime> = conn
                .query_one(
                    "SELECT heartbeat_at FROM permitq.permit_request WHERE external_id = 'fo-lease'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            at.is_some_and(|at| at > promoted_at)
        }
    })
    .await;
    assert!(!lease.is_lost(), "the lease survived the failover");
    lease.release().await.unwrap();

    // Nothing acknowledged is lost.
    let acks = std::mem::take(&mut *acks.lock().unwrap());
    assert_eq!(acks.releases.len(), 150, "every cycle completed");
    for row in conn
        .query(
            "SELECT external_id, state, fencing_token FROM permitq.permit_request
             WHERE external_id LIKE 'fo-%-%'",
            &[],
        )
        .await
        .unwrap()
    {
        let (id, state, token): (String, String, Option<i64>) =
            (row.get(0), row.get(1), row.get(2));
        if let Some(acked) = acks.grants.get(&id) {
            assert_eq!(token, Some(*acked), "{id}: the acknowledged token survived");
        }
        if acks.releases.contains(&id) {
            assert_eq!(state, "released", "{id}: the acknowledged release survived");
        }
    }
    let stored: i64 = conn
        .query_one(
            "SELECT count(*) FROM permitq.permit_request WHERE external_id = ANY($1)",
            &[&acks.submits.iter().cloned().collect::<Vec<_>>()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, 150, "every acknowledged submit survived");

    // Tokens: unique and strictly increasing in grant order, across both timelines.
    let tokens: Vec<i64> = conn
        .query(
            "SELECT fencing_token FROM permitq.permit_request
             WHERE fencing_token IS NOT NULL ORDER BY acquired_at, id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens strictly increase in grant order"
    );
    let timelines: BTreeSet<i64> = tokens.iter().map(|t| t >> TOKEN_TIMELINE_SHIFT).collect();
    assert_eq!(
        timelines,
        BTreeSet::from([1, 2]),
        "grants on both sides of the promotion"
    );

    // Safety over the whole history, on the new primary.
    let report = common::collect(&conn, "fo-").await.unwrap();
    assert!(
        report.over_capacity.is_empty(),
        "{:?}",
        report.over_capacity
    );
    common::check_invariants(&conn).await.unwrap();
    for w in workers {
        w.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn asynchronous_failover_loses_the_unreplicated_tail_but_never_reuses_a_token() {
    common::init_logging();
    let (primary, standby) = replicated_pair(&[]);
    let url = multi_host_url(&primary, &standby);
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("fa", 1_000, Some(true)).await.unwrap();
    let worker = RunningWorker::start(&url, quiet_config("fa-w1"));

    // Phase 1, replicated: 20 grants and releases; wait until the standby has replayed them.
    let acks = Mutex::new(Acknowledged::default());
    for i in 0..20 {
        acknowledged_cycle(&client, &format!("fa-kept-{i}"), "fa", &acks).await;
    }
    let primary_conn = common::connect(&format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        primary.port()
    ))
    .await;
    let standby_conn = common::connect(&format!(
        "postgres://postgres@127.0.0.1:{}/postgres",
        standby.port()
    ))
    .await;
    let written: String = primary_conn
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    wait_until(
        Duration::from_secs(30),
        "the standby replays phase 1",
        || {
            let (standby_conn, written) = (&standby_conn, &written);
            async move {
                standby_conn
                    .query_one(
                        "SELECT pg_last_wal_replay_lsn() >= $1::text::pg_lsn",
                        &[written],
                    )
                    .await
                    .unwrap()
                    .get(0)
            }
        },
    )
    .await;

    // Replication stops (the standby forgets its primary), as a lagging or partitioned
    // asynchronous standby would be.
    for statement in [
        "ALTER SYSTEM SET primary_conninfo = ''",
        "SELECT pg_reload_conf()",
    ] {
        standby_conn.batch_execute(statement).await.unwrap();
    }
    wait_until(Duration::from_secs(30), "replication stopped", || {
        let primary_conn = &primary_conn;
        async move {
            let n: i64 = primary_conn
                .query_one("SELECT count(*) FROM pg_stat_replication", &[])
                .await
                .unwrap()
                .get(0);
            n == 0
        }
    })
    .await;

    // Phase 2, not replicated: a lease, and 100 grants, acknowledged to their producers with
    // their tokens.
    let lease = client
        .acquire(
            &Request::new("fa-lease")
                .permit("fa", 1)
                .ttl(Duration::from_secs(10)),
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    for i in 0..100 {
        acknowledged_cycle(&client, &format!("fa-lost-{i}"), "fa", &acks).await;
    }
    drop(primary_conn);
    fail_over(&primary, &standby).await;

    // Phase 3, on the promoted standby.
    for i in 0..100 {
        acknowledged_cycle(&client, &format!("fa-after-{i}"), "fa", &acks).await;
    }
    worker.stop().await;

    // The lease granted on the lost tail learns at its next heartbeat that it is gone.
    let lost = tokio::time::timeout(Duration::from_secs(30), lease.lost())
        .await
        .expect("the lease learns it was lost within 30 s");
    assert!(
        lost.contains("no request named fa-lease: ")
            && lost.contains("a failover lost it with the primary's unreplicated tail"),
        "{lost}"
    );

    let acks = std::mem::take(&mut *acks.lock().unwrap());
    let token_of = |prefix: &str| -> Vec<i64> {
        acks.grants
            .iter()
            .filter(|(id, _)| id.starts_with(prefix))
            .map(|(_, t)| *t)
            .collect()
    };
    let (kept, lost, after) = (
        token_of("fa-kept-"),
        token_of("fa-lost-"),
        token_of("fa-after-"),
    );
    assert_eq!((kept.len(), lost.len(), after.len()), (20, 100, 100));

    // What asynchronous replication lost: exactly the requests of phase 2, although their
    // submits, grants and releases had all been acknowledged.
    let conn = common::connect(&url).await;
    let count = |pattern: &'static str| {
        let conn = &conn;
        async move {
            conn.query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE external_id LIKE $1",
                &[&pattern],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    assert_eq!(count("fa-kept-%").await, 20, "phase 1 was replicated");
    assert_eq!(
        count("fa-lost-%").await,
        0,
        "phase 2 was lost with the primary"
    );
    assert_eq!(count("fa-after-%").await, 100);

    // The hazard is real: the promoted server's sequence went back, so the sequence part of new
    // tokens repeats numbers already handed out for lost grants...
    let sequence_part = |t: &i64| t & ((1 << TOKEN_TIMELINE_SHIFT) - 1);
    let lost_numbers: BTreeSet<i64> = lost.iter().map(sequence_part).collect();
    assert!(
        after
            .iter()
            .map(sequence_part)
            .any(|n| lost_numbers.contains(&n)),
        "the standby's sequence was behind the primary's"
    );
    // ...but no token is ever issued twice, and every token after the promotion is above every
    // token before it (a downstream store that saw a lost grant's token still accepts new ones
    // and still refuses the lost holder).
    let highest_before = kept.iter().chain(&lost).max().copied().unwrap();
    assert!(
        after.iter().all(|t| *t > highest_before),
        "tokens after the promotion exceed every earlier token"
    );
    assert!(after.iter().all(|t| t >> TOKEN_TIMELINE_SHIFT == 2));
    let all: BTreeSet<i64> = kept.iter().chain(&lost).chain(&after).copied().collect();
    assert_eq!(all.len(), 220, "no token issued twice");
}

/// A lease whose expiry passes while there is no primary is not lost at the promotion: it runs
/// out no sooner than one ttl after the new primary is first seen (the grace, as etcd gives its
/// leases when its leader changes), so the holder's next heartbeat, and a fenced write, are
/// accepted there. Without heartbeats it then runs out and the next request is granted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lease_that_expires_during_a_failover_gets_one_ttl_of_grace_after_the_promotion() {
    common::init_logging();
    let (primary, standby) = replicated_pair(&[("synchronous_standby_names", "walreceiver")]);
    let url = multi_host_url(&primary, &standby);
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("grace", 1, None).await.unwrap();
    let worker = RunningWorker::start(&url, quiet_config("grace-w"));
    let ttl = Duration::from_secs(3);
    let holder = Request::new("grace-holder").permit("grace", 1).ttl(ttl);
    client.submit(&holder).await.unwrap();
    let held = granted(&client, "grace-holder").await;
    let expires_at = client
        .heartbeat("grace-holder", None)
        .await
        .unwrap()
        .expect("a lease");

    // The primary dies; the outage lasts past the lease's expiry.
    primary.stop(StopMode::Immediate).expect("kill the primary");
    wait_until(
        Duration::from_secs(20),
        "the lease's expiry passes",
        || async { std::time::SystemTime::now() > expires_at + Duration::from_millis(500) },
    )
    .await;
    standby.promote().expect("promote the standby");

    // The holder heartbeats on the new primary: the lease is kept, its token still fences.
    retrying("a heartbeat after the promotion", || {
        client.heartbeat("grace-holder", Some(Duration::from_millis(10)))
    })
    .await;
    let token = held.fencing_token.unwrap();
    assert!(client
        .fence("grace", "grace-resource", token)
        .await
        .unwrap());
    assert_eq!(
        client.status("grace-holder").await.unwrap().unwrap().state,
        State::Acquired
    );
    // Then it stops heartbeating: the lease runs out once the grace is over, and the waiting
    // request gets the permit.
    client
        .submit(&Request::new("grace-next").permit("grace", 1))
        .await
        .unwrap();
    let next = granted(&client, "grace-next").await;
    let ended = client.status("grace-holder").await.unwrap().unwrap();
    assert_eq!(ended.release_reason, Some(permitq::ReleaseReason::Expired));
    assert!(next.fencing_token.unwrap() > token);
    assert!(!client
        .fence("grace", "grace-resource", token)
        .await
        .unwrap());
    worker.stop().await;
}

/// The hazard of a primary that lost its synchronous standby (an old primary in a failover):
/// a grant whose wait for the standby is cancelled (as a demotion cancels it) is committed
/// locally and visible there, yet the standby never had it. `wait_settled` does not report it:
/// its confirmation (`DURABILITY_BARRIER`) cannot reach the standby, and the call fails as a
/// connection error would, to be asked again. Once the standby is back, the outcome is
/// reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_outcome_that_did_not_reach_the_synchronous_standby_is_not_reported() {
    common::init_logging();
    let (primary, standby) = replicated_pair(&[("synchronous_standby_names", "walreceiver")]);
    let url = primary.url("postgres");
    let admin = Client::connect(&url).await.unwrap();
    admin.migrate().await.unwrap();
    admin.set_capacity("sync", 1, None).await.unwrap();
    // A producer login: the confirmation needs no privilege beyond the producer role's.
    common::connect(&url)
        .await
        .batch_execute("CREATE ROLE sync_producer LOGIN PASSWORD 'pw' IN ROLE permitq_producer")
        .await
        .unwrap();
    let client = Client::connect(&common::as_user(&url, "sync_producer", "pw"))
        .await
        .unwrap();
    client
        .submit(&Request::new("unconfirmed").permit("sync", 1))
        .await
        .unwrap();
    // The standby goes away: every commit now waits for it.
    standby.stop(StopMode::Immediate).expect("stop the standby");
    let worker = RunningWorker::start(&url, quiet_config("sync-w"));
    let conn = common::connect(&url).await;
    wait_until(
        Duration::from_secs(20),
        "the grant's commit waits for the standby",
        || async {
            conn.query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE wait_event = 'SyncRep' AND application_name LIKE 'permitq sync-w%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
                > 0
        },
    )
    .await;
    // Cancel the waits, as a demotion does: the grant is committed locally, visible here.
    let acquired = || async {
        conn.batch_execute(
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        )
        .await
        .unwrap();
        conn.query_one(
            "SELECT state FROM permitq.permit_request WHERE external_id = 'unconfirmed'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, String>(0)
            == "acquired"
    };
    wait_until(
        Duration::from_secs(20),
        "the grant visible on the primary",
        acquired,
    )
    .await;
    let err = client
        .wait_settled("unconfirmed", Duration::from_secs(2))
        .await
        .expect_err("a grant the standby never had is not reported");
    assert!(err.is_connection() && err.is_retryable(), "{err}");
    assert!(err.to_string().contains("synchronous standby"), "{err}");

    // The standby back, the grant reaches it and is reported.
    standby.start_server().expect("the standby again");
    let row = retrying("the confirmed outcome", || {
        client.wait_settled("unconfirmed", Duration::from_secs(5))
    })
    .await
    .unwrap();
    assert_eq!(row.state, State::Acquired);
    worker.stop().await;
}

/// An acquire of one `restart` permit as `id`, running once its request is in the table.
async fn acquiring_in_line(
    client: &Client,
    url: &str,
    id: &'static str,
    timeout: Duration,
) -> tokio::task::JoinHandle<permitq::Result<permitq::Lease>> {
    let acquiring = tokio::spawn({
        let client = client.clone();
        async move {
            let request = Request::new(id).permit("restart", 1);
            client.acquire(&request, timeout).await
        }
    });
    let conn = common::connect(url).await;
    wait_until(Duration::from_secs(20), "the request waits", || async {
        conn.query_opt(
            "SELECT 1 FROM permitq.permit_request WHERE external_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .is_some()
    })
    .await;
    acquiring
}

/// The smallest failover, a restart: an acquire waiting when the server goes down waits on
/// through it (asking its idempotent submit and its status again until its timeout, as the
/// Python and TypeScript clients do) and is granted once a worker runs, instead of failing at
/// once. A database that stays down fails it at its deadline, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_waits_through_a_database_restart_until_its_timeout() {
    common::init_logging();
    let server = EmbeddedPostgres::start_with(&THROWAWAY_SETTINGS).expect("server");
    let url = server.url("postgres");
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("restart", 1, None).await.unwrap();
    // No worker yet: the request waits.
    let acquiring =
        acquiring_in_line(&client, &url, "through-restart", Duration::from_secs(60)).await;
    server.stop(StopMode::Immediate).expect("stop the server");
    // Down for a second: four of the acquire's 250 ms status reads meet no server.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!acquiring.is_finished(), "{:?}", acquiring.await);
    server.start_server().expect("the server again");
    let worker = RunningWorker::start(&url, quiet_config("restart-w"));
    let lease = acquiring.await.unwrap().expect("granted after the restart");
    assert_eq!(lease.request().state, State::Acquired);
    lease.release().await.unwrap();
    worker.stop().await;

    // Down from the middle of the wait until past its deadline: the acquire cannot cancel its
    // request, and says that it may still wait and how to cancel it.
    let acquiring = acquiring_in_line(&client, &url, "left-behind", Duration::from_secs(2)).await;
    server.stop(StopMode::Immediate).expect("stop the server");
    let err = acquiring
        .await
        .unwrap()
        .expect_err("no server at the deadline");
    assert!(err.is_connection(), "{err}");
    assert!(
        err.to_string().contains(
            "; request left-behind was submitted and could not be cancelled, so it may still be \
             waiting: once the database answers, cancel it (`permitq release left-behind`"
        ),
        "{err}"
    );
    server.start_server().expect("the server again");
    let waiting = client.status("left-behind").await.unwrap().unwrap();
    assert_eq!(waiting.state, State::New, "what the error said");

    // Down for good: the connection error, at the deadline.
    server.stop(StopMode::Immediate).expect("stop the server");
    let started = Instant::now();
    let request = Request::new("never").permit("restart", 1);
    let err = client
        .acquire(&request, Duration::from_millis(1500))
        .await
        .expect_err("no server");
    assert!(err.is_connection(), "{err}");
    assert!(
        started.elapsed() >= Duration::from_millis(1000),
        "gave up after {:?}, before its deadline",
        started.elapsed()
    );
}

/// What retrying cannot mend is not retried: a server that asks for a password the URL lacks
/// fails an acquire at once, with what to do, instead of at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquire_without_the_password_the_server_asks_for_fails_at_once() {
    let port = common::password_asking_server();
    let client = Client::connect(&format!("postgres://me@127.0.0.1:{port}/app"))
        .await
        .unwrap();
    let started = Instant::now();
    let err = client
        .acquire(&Request::new("x").permit("a", 1), Duration::from_secs(60))
        .await
        .expect_err("no password");
    assert!(!err.is_connection() && !err.is_retryable(), "{err}");
    assert!(
        err.to_string().contains(&format!(
            "PostgreSQL at 127.0.0.1:{port} asks for a password"
        )) && err.to_string().contains("PGPASSWORD"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "gave up after {:?}: it waited for its deadline",
        started.elapsed()
    );
}
