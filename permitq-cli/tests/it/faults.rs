//! Faults: a worker killed mid-transaction, the LISTEN and pool connections terminated, and the
//! database restarted under running workers.

use permitq_test_support as common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{
    check_invariants, quiet_config, semaphore_locked, settled_state, signal, state_of, wait_until,
    TestDb,
};
use permitq::{Client, Request, State};
use permitq_test_support::{EmbeddedPostgres, StopMode};

const SOON: Duration = Duration::from_secs(15);

fn spawn_worker_process(url: &str, id: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["worker", "--id", id, "--poll-interval", "120s"])
        .env("DATABASE_URL", url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn permitq worker")
}

async fn backends(conn: &tokio_postgres::Client, app: &str, extra: &str) -> i64 {
    conn.query_one(
        &format!("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 {extra}"),
        &[&app],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_transaction_leaves_the_request_new_for_another() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    // Hold the semaphore's row lock so the worker blocks inside its batch transaction.
    let blocker = db.conn().await;
    blocker
        .batch_execute("BEGIN; SELECT * FROM permitq.semaphore WHERE name = 's' FOR UPDATE")
        .await
        .unwrap();
    let mut doomed = spawn_worker_process(&db.url, "doomed");
    client
        .submit(&Request::new("r1").permit("s", 1))
        .await
        .unwrap();

    let watcher = db.conn().await;
    wait_until(
        SOON,
        "the worker waits for the semaphore lock inside its transaction",
        || async {
            backends(&watcher, "permitq doomed", "AND wait_event_type = 'Lock'").await == 1
        },
    )
    .await;
    // It holds r1's row lock (the claim) right now: a SKIP LOCKED reader does not see it.
    let visible: i64 = watcher
        .query_one(
            "SELECT count(*) FROM (SELECT 1 FROM permitq.permit_request FOR UPDATE SKIP LOCKED) t",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(visible, 0, "the dying worker holds the claim");

    doomed.kill().expect("kill -9");
    doomed.wait().unwrap();
    blocker.batch_execute("COMMIT").await.unwrap();
    wait_until(SOON, "the dead worker's sessions end", || async {
        backends(&watcher, "permitq doomed", "").await == 0
    })
    .await;
    assert_eq!(
        state_of(&client, "r1").await,
        "new",
        "the transaction rolled back"
    );

    let survivor = db.notified_worker("survivor");
    let r = client.wait_settled("r1", SOON).await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.worker_id.as_deref()),
        (State::Acquired, Some("survivor"))
    );
    check_invariants(&watcher).await.unwrap();
    survivor.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_flows_after_the_listen_and_pool_connections_are_terminated() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1000, None).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("warm").permit("s", 1))
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "warm").await, State::Acquired);

    let admin = db.conn().await;
    for (round, filter) in ["AND query LIKE 'LISTEN%'", ""].into_iter().enumerate() {
        let killed: i64 = admin
            .query_one(
                &format!(
                    "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                     WHERE application_name = 'permitq w1' {filter}) t"
                ),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert!(killed >= 1, "round {round}: terminated {killed} backends");
        // Submitted while the worker may be disconnected: their notifications can be lost.
        for i in 0..5 {
            client
                .submit(&Request::new(format!("after-{round}-{i}")).permit("s", 1))
                .await
                .unwrap();
        }
        for i in 0..5 {
            let id = format!("after-{round}-{i}");
            let r = client.wait_settled(&id, SOON).await.unwrap().unwrap();
            assert_eq!(
                r.state,
                State::Acquired,
                "{id}: the reconnect's re-scan grants the backlog"
            );
        }
        wait_until(SOON, "a new LISTEN connection", || async {
            backends(&admin, "permitq w1", "AND query LIKE 'LISTEN%'").await == 1
        })
        .await;
    }
    // And new work is still woken by NOTIFY (the poll is 120s).
    client
        .submit(&Request::new("later").permit("s", 1))
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("later", Duration::from_secs(3))
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    check_invariants(&admin).await.unwrap();
    worker.stop().await;
}

async fn submit_retrying(client: &Client, request: &Request) {
    wait_until(SOON, "submit succeeds", || async {
        client.submit(request).await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_ride_out_a_database_restart() {
    common::init_logging();
    let pg = tokio::task::spawn_blocking(EmbeddedPostgres::start)
        .await
        .unwrap()
        .unwrap();
    let url = pg.url("postgres");
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("s", 5, None).await.unwrap();
    let workers: Vec<_> = (0..2)
        .map(|i| common::RunningWorker::start(&url, quiet_config(&format!("w{i}"))))
        .collect();
    for i in 0..10 {
        client
            .submit(&Request::new(format!("before-{i}")).permit("s", 1))
            .await
            .unwrap();
    }
    wait_until(SOON, "5 granted before the restart", || async {
        client
            .semaphores()
            .await
            .map(|s| s[0].used == 5)
            .unwrap_or(false)
    })
    .await;

    for (round, mode) in [StopMode::Immediate, StopMode::Fast]
        .into_iter()
        .enumerate()
    {
        let pg_ref = &pg;
        tokio::task::block_in_place(|| {
            pg_ref.stop(mode).unwrap();
            pg_ref.start_server().unwrap();
        });
        for i in 0..5 {
            let id = format!("before-{i}");
            if round == 0 {
                wait_until(SOON, "release succeeds", || async {
                    client.release(&id).await.is_ok()
                })
                .await;
            }
        }
        for i in 0..5 {
            submit_retrying(
                &client,
                &Request::new(format!("after-{round}-{i}")).permit("s", 1),
            )
            .await;
        }
    }
    // before-5..9 waited through both restarts and after-* queued behind them. As holders
    // release, every one of them is granted (backfill may reorder those behind the head).
    let mut waiting: Vec<String> = (5..10)
        .map(|i| format!("before-{i}"))
        .chain((0..2).flat_map(|round| (0..5).map(move |i| format!("after-{round}-{i}"))))
        .collect();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !waiting.is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "never granted: {waiting:?}"
        );
        let mut still = Vec::new();
        for id in waiting.drain(..) {
            match client.status(&id).await.ok().flatten().map(|r| r.state) {
                Some(State::Acquired) => {
                    client.release(&id).await.unwrap();
                }
                Some(State::New) | None => still.push(id),
                Some(other) => panic!("{id} ended {other}"),
            }
        }
        waiting = still;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let conn = common::connect(&url).await;
    check_invariants(&conn).await.unwrap();
    common::wait_folded(&url).await;
    assert_eq!(client.semaphores().await.unwrap()[0].used, 0);
    for w in workers {
        w.stop().await;
    }
    drop(client);
    drop(conn);
}

/// Sends `signal` (STOP, CONT) to a process.
/// A worker that stops answering in the middle of a batch (SIGSTOP while it holds a semaphore's
/// row lock: its socket stays open, nothing is sent) blocks that semaphore for at most its
/// `idle_in_transaction_session_timeout` (5 s by default): then the server ends its session,
/// the locks go, and once resumed the worker reconnects and carries on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_worker_holding_a_semaphore_lock_blocks_it_for_at_most_the_idle_bound() {
    const BOUND: Duration = Duration::from_secs(5);
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1_000_000, None).await.unwrap();
    let mut child = spawn_worker_process(&db.url, "paused");
    let conn = db.conn().await;
    wait_until(SOON, "the worker is listening", || async {
        backends(&conn, "permitq paused", "AND query LIKE 'LISTEN%'").await == 1
    })
    .await;
    // Keep it busy: requests on `s`, submitted and released all along.
    let stop_load = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (client, stop) = (client.clone(), stop_load.clone());
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i += 1;
                let _ = client
                    .submit(&Request::new(format!("load-{i}")).permit("s", 1))
                    .await;
                tokio::task::yield_now().await;
            }
        })
    };
    // Pause it until it is caught holding the lock (a few tries: it must be mid-batch).
    let mut probe = db.conn().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let paused_at = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "never caught the worker holding the lock"
        );
        signal(child.id(), "STOP");
        let paused_at = std::time::Instant::now();
        // Still locked 100 ms into the pause: the server waits on the worker for the rest of
        // the batch (not finishing a pipelined COMMIT it already has).
        if semaphore_locked(&mut probe, "s").await && {
            tokio::time::sleep(Duration::from_millis(100)).await;
            semaphore_locked(&mut probe, "s").await
        } {
            break paused_at;
        }
        signal(child.id(), "CONT");
        tokio::time::sleep(Duration::from_millis(3)).await;
    };
    stop_load.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    // The semaphore is blocked until the server ends the paused session.
    while semaphore_locked(&mut probe, "s").await {
        assert!(
            paused_at.elapsed() < BOUND + Duration::from_secs(10),
            "the paused worker still blocks the semaphore after {:?}",
            paused_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let blocked = paused_at.elapsed();
    assert!(
        blocked >= BOUND - Duration::from_secs(1) && blocked <= BOUND + Duration::from_secs(2),
        "blocked for {blocked:?}: the server's idle bound, not luck, frees the lock"
    );
    // Resumed, the worker finds its session gone, reconnects and grants again.
    signal(child.id(), "CONT");
    client
        .submit(&Request::new("after-pause").permit("s", 1))
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "after-pause").await, State::Acquired);
    eprintln!("paused worker blocked the semaphore for {blocked:?} (bound {BOUND:?})");
    check_invariants(&conn).await.unwrap();
    let _ = child.kill();
    let _ = child.wait();
}

/// A worker that loses its database logs one line when it goes and one when it is back, with
/// what failed meanwhile, not a line per task per retry; and it grants again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_is_logged_once_when_it_starts_and_once_when_it_ends() {
    let pg = tokio::task::spawn_blocking(EmbeddedPostgres::start)
        .await
        .unwrap()
        .unwrap();
    let url = pg.url("postgres");
    let client = Client::connect(&url).await.unwrap();
    client.migrate().await.unwrap();
    client.set_capacity("s", 5, None).await.unwrap();
    let log = common::scratch_dir("outage").join("worker.log");
    let mut worker = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["worker", "--id", "outage", "--sweep-interval", "100ms"])
        .env("DATABASE_URL", &url)
        .env("RUST_LOG", "permitq=info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    // Its first line names where it works: a worker on another database is told apart.
    wait_until(SOON, "the worker started", || async {
        read_log().contains("worker started on database postgres at ")
    })
    .await;
    let pg_ref = &pg;
    tokio::task::block_in_place(|| pg_ref.stop(StopMode::Fast).unwrap());
    // Down for 3 s: passes, sweeps (every 100 ms), retention and the liveness row all fail.
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| pg_ref.start_server().unwrap());
    wait_until(
        Duration::from_secs(30),
        "the worker says the database is back",
        || async { read_log().contains("database reachable again") },
    )
    .await;
    submit_retrying(&client, &Request::new("after").permit("s", 1)).await;
    wait_until(SOON, "granted after the outage", || async {
        matches!(
            client.status("after").await.ok().flatten().map(|r| r.state),
            Some(State::Acquired)
        )
    })
    .await;
    signal(worker.id(), "TERM");
    worker.wait().unwrap();
    let text = read_log();
    let count = |s: &str| text.lines().filter(|l| l.contains(s)).count();
    assert_eq!(count("database unreachable"), 1, "{text}");
    assert_eq!(count("database reachable again"), 1, "{text}");
    assert!(
        text.contains("granting goes on (retried meanwhile: ") && text.contains("sweeps"),
        "{text}"
    );
    // The outage's two lines, the LISTEN connection's one, and at most one failure that was
    // not a connection error (a statement cut by the shutdown).
    let loud = text
        .lines()
        .filter(|l| l.contains(" WARN ") || l.contains(" ERROR "))
        .count();
    assert!(
        loud <= 5,
        "{loud} warnings and errors for one outage:\n{text}"
    );
}
