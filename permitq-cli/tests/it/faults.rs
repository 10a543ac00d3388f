//! Faults: a worker killed mid-transaction, the LISTEN and pool connections terminated, and the
//! database restarted under running workers.

use permitq_test_support as common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{check_invariants, quiet_config, settled_state, state_of, wait_until, TestDb};
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
