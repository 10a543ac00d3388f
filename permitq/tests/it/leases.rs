//! Leases and maintenance: TTL expiry, heartbeats and the Lease guard, --max-hold, the liveness
//! hook, revoke, retention, exactly-once sweeps, and fencing a paused holder.

use permitq_test_support as common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{check_invariants, quiet_config, settled_state, state_of, wait_until, TestDb};
use futures_util::future::BoxFuture;
use permitq::{OwnerLiveness, ReleaseOutcome, Request, SqlState, State, WorkerConfig};

const SOON: Duration = Duration::from_secs(10);
const SWEEP: Duration = Duration::from_millis(200);

fn sweeping(id: &str) -> WorkerConfig {
    let mut config = quiet_config(id);
    config.maintenance.sweep_interval = SWEEP;
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_hands_its_capacity_to_a_waiter_within_two_sweeps() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let worker = db.worker(sweeping("w1"));
    client
        .submit(
            &Request::new("crashed")
                .permit("s", 1)
                .ttl(Duration::from_millis(400)),
        )
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "crashed").await, State::Acquired);
    client
        .submit(&Request::new("waiter").permit("s", 1))
        .await
        .unwrap();

    let waiter = client.wait_settled("waiter", SOON).await.unwrap().unwrap();
    assert_eq!(waiter.state, State::Acquired);
    let crashed = client.status("crashed").await.unwrap().unwrap();
    assert_eq!(
        (crashed.state, crashed.release_reason),
        (State::Released, Some(permitq::ReleaseReason::Expired))
    );
    let expires = crashed.expires_at.unwrap();
    assert_eq!(
        expires,
        crashed.acquired_at.unwrap() + Duration::from_millis(400),
        "expires_at = acquired_at + ttl"
    );
    let handover = waiter.acquired_at.unwrap().duration_since(expires).unwrap();
    assert!(
        handover <= 2 * SWEEP,
        "waiter granted {handover:?} after the lease ran out"
    );
    assert!(crashed.released_at.unwrap() >= expires);
    check_invariants(&db.conn().await).await.unwrap();
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeating_lease_outlives_three_ttls_and_a_lost_one_is_reported() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let worker = db.worker(sweeping("w1"));
    let ttl = Duration::from_millis(500);
    let lease = client
        .acquire(&Request::new("held").permit("s", 1).ttl(ttl), SOON)
        .await
        .unwrap();
    let token = lease.fencing_token();
    tokio::time::sleep(ttl * 4).await;
    let r = client.status("held").await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.fencing_token),
        (State::Acquired, Some(token)),
        "kept for 4x its TTL"
    );
    assert!(r.heartbeat_at.is_some() && !lease.is_lost());

    // An operator revokes it: the guard notices at its next heartbeat.
    assert_eq!(
        client.revoke("held").await.unwrap(),
        ReleaseOutcome::Revoked
    );
    let reason = tokio::time::timeout(ttl * 2, lease.lost())
        .await
        .expect("the guard reports the loss");
    assert!(reason.contains("lease lost"), "{reason}");
    assert!(lease.is_lost());
    let err = client.heartbeat("held", None).await.unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE)
    );
    assert_eq!(
        lease.release().await.unwrap(),
        ReleaseOutcome::AlreadyReleased
    );
    assert_eq!(state_of(&client, "held").await, "released/revoked");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ran_out_refuses_heartbeats() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    // A slow sweep: the lease runs out before anyone releases it.
    let mut config = quiet_config("w1");
    config.maintenance.sweep_interval = Duration::from_secs(3600);
    let worker = db.worker(config);
    client
        .submit(
            &Request::new("late")
                .permit("s", 1)
                .ttl(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "late").await, State::Acquired);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = client
        .heartbeat("late", Some(Duration::from_secs(60)))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE)
    );
    assert!(err.to_string().contains("expired"), "{err}");
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_lease_releases_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let worker = db.notified_worker("w1");
    let lease = client
        .acquire(&Request::new("dropped").permit("s", 1), SOON)
        .await
        .unwrap();
    drop(lease);
    wait_until(SOON, "released on drop", || async {
        state_of(&client, "dropped").await == "released/released"
    })
    .await;
    // A request that is not granted in time is cancelled, and the error says how it ended.
    client
        .submit(&Request::new("blocker").permit("s", 1))
        .await
        .unwrap();
    client.wait_settled("blocker", SOON).await.unwrap();
    let err = client
        .acquire(
            &Request::new("patient").permit("s", 1),
            Duration::from_millis(300),
        )
        .await
        .err()
        .unwrap();
    assert_eq!(
        err.not_granted().map(|r| r.error_code),
        Some(Some(permitq::ErrorCode::Cancelled))
    );
    assert_eq!(
        err.to_string(),
        "request patient was not granted: still waiting after 300ms, so acquire cancelled it; s \
         had no room for it in that time (`permitq semaphore show s` shows who holds them: a \
         producer login sees its own holders, an operator login every one)"
    );
    // An acquire dropped while it waits (an outer timeout gave up on it) cancels its request:
    // nothing is granted to a caller that has gone.
    let abandoned = tokio::time::timeout(
        Duration::from_millis(300),
        client.acquire(&Request::new("abandoned").permit("s", 1), SOON),
    )
    .await;
    assert!(abandoned.is_err(), "the outer timeout gave up first");
    wait_until(SOON, "the abandoned request cancelled", || async {
        state_of(&client, "abandoned").await == "error/cancelled"
    })
    .await;
    // An error says what it was and what to do, as the CLI does.
    let err = client
        .acquire(&Request::new("huge").permit("s", 9), SOON)
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string().starts_with(
            "request huge was not granted: error exceeds_capacity: s=9 but s has capacity "
        ),
        "{err}"
    );
    worker.stop().await;
    // With no worker, the answer says that nothing grants.
    let err = client
        .acquire(
            &Request::new("unserved").permit("s", 1),
            Duration::from_millis(300),
        )
        .await
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("so acquire cancelled it; nothing is granting: ")
            && err.to_string().ends_with(
                "(this request is cancelled: acquire again under a new external_id once one runs)"
            ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_hold_releases_stale_holders() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 2, None).await.unwrap();
    let mut config = sweeping("w1");
    config.maintenance.max_hold = Some(Duration::from_millis(300));
    let worker = db.worker(config);
    client
        .submit(&Request::new("forever").permit("s", 1))
        .await
        .unwrap();
    wait_until(SOON, "released as stale", || async {
        state_of(&client, "forever").await == "released/stale"
    })
    .await;
    let r = client.status("forever").await.unwrap().unwrap();
    let held = r
        .released_at
        .unwrap()
        .duration_since(r.acquired_at.unwrap())
        .unwrap();
    assert!(
        held >= Duration::from_millis(300),
        "released after only {held:?}"
    );
    // Its outcome says which bound it was held past.
    assert_eq!(
        r.outcome().as_deref(),
        Some("released (stale): held longer than the workers' --max-hold (300ms)"),
        "{r:?}"
    );
    common::wait_folded(&db.url).await;
    assert_eq!(client.semaphores().await.unwrap()[0].used, 0);
    worker.stop().await;
}

/// A liveness hook that knows a fixed set of dead owners and records what it was asked.
struct Orchestrator {
    dead: Vec<String>,
    asked: Mutex<Vec<Vec<String>>>,
}

impl OwnerLiveness for Orchestrator {
    fn dead_owners<'a>(&'a self, owners: &'a [String]) -> BoxFuture<'a, Vec<String>> {
        self.asked.lock().unwrap().push(owners.to_vec());
        Box::pin(async move {
            owners
                .iter()
                .filter(|o| self.dead.contains(o))
                .cloned()
                .collect()
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_liveness_hook_revokes_dead_owners_only() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 10, None).await.unwrap();
    for (id, owner) in [
        ("a1", "job-alive"),
        ("d1", "job-dead"),
        ("d2", "job-dead"),
        ("n1", ""),
    ] {
        let mut r = Request::new(id).permit("s", 1);
        if !owner.is_empty() {
            r = r.owner(owner);
        }
        client.submit(&r).await.unwrap();
    }
    let hook = Arc::new(Orchestrator {
        dead: vec!["job-dead".into()],
        asked: Mutex::new(Vec::new()),
    });
    let worker = permitq::Worker::connect(&db.url, sweeping("w1"))
        .unwrap()
        .with_owner_liveness(hook.clone());
    let (stop, mut rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(worker.run(async move {
        let _ = rx.wait_for(|s| *s).await;
    }));
    for id in ["d1", "d2"] {
        wait_until(SOON, "dead owner's request revoked", || async {
            state_of(&client, id).await == "released/revoked"
        })
        .await;
    }
    tokio::time::sleep(SWEEP * 2).await;
    assert_eq!(state_of(&client, "a1").await, "acquired");
    assert_eq!(state_of(&client, "n1").await, "acquired");
    assert_eq!(client.semaphores().await.unwrap()[0].used, 2);
    for asked in hook.asked.lock().unwrap().iter() {
        let mut unique = asked.clone();
        unique.dedup();
        assert_eq!(&unique, asked, "each owner once per sweep");
        assert!(!asked.iter().any(|o| o.is_empty()));
    }
    let _ = stop.send(true);
    task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_only_old_settled_rows_in_batches() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 5, None).await.unwrap();
    let worker = db.notified_worker("w1");
    // Old released, old error, recent released, waiting (old), held (old).
    for id in ["old-released", "recent-released", "held"] {
        client
            .submit(&Request::new(id).permit("s", 1))
            .await
            .unwrap();
        client.wait_settled(id, SOON).await.unwrap();
    }
    client.release("old-released").await.unwrap();
    client.release("recent-released").await.unwrap();
    client
        .submit(&Request::new("old-error").permit("nope", 1))
        .await
        .unwrap();
    client.wait_settled("old-error", SOON).await.unwrap();
    client
        .submit(&Request::new("waiting").permit("s", 9))
        .await
        .unwrap();
    worker.stop().await;
    let conn = db.conn().await;
    conn.batch_execute(
        "UPDATE permitq.permit_request SET created_at = now() - interval '30 days'
         WHERE external_id IN ('old-released', 'old-error', 'waiting', 'held');
         UPDATE permitq.permit_request SET settled_at = now() - interval '8 days'
         WHERE external_id IN ('old-released', 'old-error');
         -- 2,500 more old settled rows, to see the batches.
         INSERT INTO permitq.permit_request (external_id, permits)
         SELECT 'bulk-' || i, '{\"s\": 1}' FROM generate_series(1, 2500) i;
         UPDATE permitq.permit_request SET state = 'error', error_code = 'cancelled',
             settled_at = now() - interval '9 days' WHERE external_id LIKE 'bulk-%';
         UPDATE permitq.capacity_change SET changed_at = now() - interval '40 days';",
    )
    .await
    .unwrap();
    let batches: Vec<i32> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(
                conn.query_one(
                    "SELECT permitq.delete_settled('8 days 12 hours', 1000)",
                    &[],
                )
                .await
                .unwrap()
                .get(0),
            );
        }
        v
    };
    assert_eq!(
        batches,
        [1000, 1000, 500],
        "bulk rows go in batches of at most 1,000, oldest first"
    );

    let retention = permitq::Worker::connect(&db.url, WorkerConfig::default()).unwrap();
    let (requests, audit) = retention.run_retention_once().await.unwrap();
    assert_eq!(
        (requests, audit),
        (2, 1),
        "the two old settled rows and the old audit row"
    );
    let left: Vec<String> = conn
        .query(
            "SELECT external_id FROM permitq.permit_request ORDER BY external_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["held", "recent-released", "waiting"]);
    let orphans: i64 = conn
        .query_one("SELECT count(*) FROM permitq.permit p LEFT JOIN permitq.permit_request r ON r.id = p.request_id WHERE r.id IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(orphans, 0, "permit rows go with their request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_three_workers_each_expired_lease_is_released_exactly_once() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 60, None).await.unwrap();
    client.set_capacity("t", 60, None).await.unwrap();
    let (listener, mut events) = common::listen(&db.url, "permitq_events").await;
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let mut config = quiet_config(&format!("w{i}"));
            config.maintenance.sweep_interval = Duration::from_millis(50);
            db.worker(config)
        })
        .collect();
    for i in 0..60 {
        let r = Request::new(format!("lease-{i}"))
            .permit("s", 1)
            .permit("t", 1 + i % 2)
            .ttl(Duration::from_millis(300));
        client.submit(&r).await.unwrap();
    }
    wait_until(SOON, "every lease expired and folded in", || async {
        let n: i64 = db
            .conn()
            .await
            .query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE release_reason = 'expired'
                 AND NOT EXISTS (SELECT 1 FROM permitq.pending_release)",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        n == 60
    })
    .await;
    listener
        .batch_execute("NOTIFY permitq_events, 'marker'")
        .await
        .unwrap();
    // Each request is announced twice: when granted, and when its expiry is folded.
    let mut announced: BTreeMap<i64, usize> = BTreeMap::new();
    loop {
        let payload = tokio::time::timeout(SOON, events.recv())
            .await
            .unwrap()
            .unwrap();
        if payload == "marker" {
            break;
        }
        for id in common::event_ids(&payload) {
            *announced.entry(id).or_default() += 1;
        }
    }
    assert_eq!(announced.len(), 60);
    assert!(
        announced.values().all(|n| *n == 2),
        "released more than once: {announced:?}"
    );
    for s in client.semaphores().await.unwrap() {
        assert_eq!(s.used, 0, "{} is exact after the sweeps", s.name);
    }
    check_invariants(&db.conn().await).await.unwrap();
    for w in workers {
        w.stop().await;
    }
}

/// The binary of `permitq/examples/NAME.rs`, which `cargo test` builds beside the test binary.
fn built_example(name: &str) -> std::path::PathBuf {
    std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("examples")
        .join(name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_holder_paused_past_its_ttl_has_its_fenced_write_rejected() {
    // examples/fencing.rs: holder A (a child process) is SIGSTOPped past its TTL, B acquires
    // and writes, A resumes and its write is rejected by a store that checks tokens.
    let example = built_example("fencing");
    assert!(
        example.exists(),
        "cargo test builds examples: {}",
        example.display()
    );
    let db = TestDb::new().await;
    let url = db.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(example)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "off")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("B: write -> OK"), "{stdout}");
    assert!(
        stdout.contains("A (resumed): write -> REJECTED"),
        "{stdout}"
    );
    assert!(
        stdout.contains("A's request is now released (expired): its lease ran out"),
        "A's lease was released as expired: {stdout}"
    );
}

/// examples/producer.rs runs twice in a row (its id is unique per run), and on failure exits 1
/// with one line that says what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_producer_example_runs_twice_and_fails_in_one_line() {
    let example = built_example("producer");
    assert!(example.exists(), "cargo test builds examples");
    let db = TestDb::new().await;
    let run = |url: String| {
        let example = example.clone();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(example)
                .env("DATABASE_URL", url)
                .env("RUST_LOG", "off")
                .output()
                .unwrap()
        })
    };
    // No semaphore yet: one line naming the fix, exit 1.
    let worker = db.notified_worker("producer-example");
    let out = run(db.url.clone()).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("unknown_semaphore") && stderr.contains("permitq semaphore set example"),
        "{stderr}"
    );
    db.client()
        .await
        .set_capacity("example", 1, None)
        .await
        .unwrap();
    for _ in 0..2 {
        let out = run(db.url.clone()).await.unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("release: released"), "{stdout}");
    }
    worker.stop().await;
}

/// A heartbeat that answers late extends the lease from when it was sent (the server counts
/// `expires_at` from its transaction's start), so the guard declares the lease lost before the
/// server's `expires_at`, never after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_heartbeat_counts_the_lease_from_when_it_was_sent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let worker = db.worker(sweeping("w"));
    // Heartbeats every 2 s; the guard's safety margin is 0.6 s, under the 1.5 s delay below.
    let ttl = Duration::from_secs(6);
    let lease = client
        .acquire(&Request::new("slow").permit("s", 1).ttl(ttl), SOON)
        .await
        .unwrap();
    let heartbeat_at = || async {
        db.conn()
            .await
            .query_one(
                "SELECT CASE WHEN heartbeat_at > acquired_at THEN heartbeat_at END \
                 FROM permitq.permit_request WHERE external_id = 'slow'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, Option<std::time::SystemTime>>(0)
    };
    // The first heartbeat goes at once; then hold the row so that the next one (2 s later)
    // waits 1.5 s for it before it answers.
    wait_until(SOON, "the first heartbeat", || async {
        heartbeat_at().await.is_some()
    })
    .await;
    let first = heartbeat_at().await;
    let blocker = db.conn().await;
    let hold_the_row =
        "BEGIN; SELECT 1 FROM permitq.permit_request WHERE external_id = 'slow' FOR UPDATE";
    blocker.batch_execute(hold_the_row).await.unwrap();
    wait_until(SOON, "a heartbeat waits on the row", || async {
        db.conn()
            .await
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE wait_event_type = 'Lock' AND query LIKE '%heartbeat%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Let it through; once it has committed, take the row again before the next heartbeat
    // (2 s after this one answered): no later heartbeat gets through.
    blocker.batch_execute("COMMIT").await.unwrap();
    wait_until(SOON, "the slow heartbeat commits", || async {
        heartbeat_at().await != first
    })
    .await;
    blocker.batch_execute(hold_the_row).await.unwrap();
    let expires_at: std::time::SystemTime = blocker
        .query_one(
            "SELECT expires_at FROM permitq.permit_request WHERE external_id = 'slow'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    tokio::time::timeout(ttl * 3, lease.lost())
        .await
        .expect("the guard declares the lease lost");
    let lost_at = std::time::SystemTime::now();
    assert!(
        lost_at < expires_at,
        "declared lost {:?} after the server's expires_at: the lease was counted from the answer, \
         not from when the heartbeat was sent",
        lost_at.duration_since(expires_at).unwrap_or_default()
    );
    blocker.batch_execute("ROLLBACK").await.unwrap();
    worker.stop().await;
}

/// A waiting request whose `wait` ran out is timed out by the sweep whether or not a worker has
/// examined it yet (a backlog no worker reached keeps its deadlines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_times_out_requests_no_worker_has_examined_yet() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    // No worker runs: nothing examines these.
    for id in ["early-1", "early-2"] {
        client
            .submit(
                &Request::new(id)
                    .permit("s", 1)
                    .wait(Duration::from_millis(1)),
            )
            .await
            .unwrap();
    }
    let conn = db.conn().await;
    let unexamined: i64 = conn
        .query_one(
            "SELECT count(*) FROM permitq.permit_request WHERE NOT examined AND state = 'new'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unexamined, 2);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let swept: i32 = conn
        .query_one("SELECT permitq.sweep_wait_deadlines(100)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(swept, 2, "both deadlines enforced");
    for id in ["early-1", "early-2"] {
        let r = client.status(id).await.unwrap().unwrap();
        assert_eq!(
            (r.state, r.error_code),
            (State::Error, Some(permitq::ErrorCode::Timeout))
        );
    }
}

/// The log lines a test's own subscriber receives.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// An `acquire` with no worker running says so once while it waits, not only when its timeout
/// runs out (logged through `tracing`, as its retries are).
#[test]
fn an_acquire_with_no_worker_running_says_so_while_it_waits() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .finish();
    // A runtime on this thread alone: every task of the client logs to this subscriber.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    tracing::subscriber::with_default(subscriber, || {
        runtime.block_on(async {
            let db = TestDb::new().await;
            let client = db.client().await;
            client.set_capacity("idle-gpu", 1, None).await.unwrap();
            let e = client
                .acquire(
                    &Request::new("no-worker").permit("idle-gpu", 1),
                    Duration::from_secs(5),
                )
                .await
                .unwrap_err();
            assert!(e.to_string().contains("nothing is granting"), "{e}");
        });
    });
    let log = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert_eq!(
        log.matches("permitq: no-worker waits, and nothing is granting: ")
            .count(),
        1,
        "{log}"
    );
}
