//! Workers on other hosts: PostgreSQL, two worker hosts and a client host, each a network
//! namespace with its own address on a private bridge ([`NetworkBed`]); the test watches the
//! database over its Unix socket.

use std::process::Stdio;
use std::time::{Duration, Instant};

use permitq::{Client, Request, State};
use permitq_test_support::{
    check_invariants, connect, semaphore_locked, signal, wait_until, EmbeddedPostgres, NetworkBed,
};

const PERMITQ: &str = env!("CARGO_BIN_EXE_permitq");
/// `WorkerConfig::idle_in_transaction_timeout`'s default.
const IDLE_BOUND: Duration = Duration::from_secs(5);

/// Starts `permitq worker --id ID` on host `host`, connecting over the bed. Returns its pid.
fn start_worker(bed: &NetworkBed, host: &str, url: &str) -> u32 {
    let mut cmd = bed.command(host, PERMITQ);
    cmd.args(["worker", "--id", host, "--poll-interval", "120s"])
        .env("DATABASE_URL", url)
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    bed.spawn(cmd).expect("start a worker on the bed")
}

/// A worker host that drops off the network in the middle of a batch (its packets dropped both
/// ways, its sockets left open) blocks the semaphore it had locked for at most the server's
/// `idle_in_transaction_session_timeout`; a worker on another host then carries on, and once the
/// network heals the cut-off worker reconnects and grants again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_worker_host_blocks_a_semaphore_for_at_most_the_idle_bound_then_rejoins() {
    let bed = NetworkBed::new(&["db", "w1", "w2", "client"])
        .expect("a bed of network namespaces (the tests run as root)");
    let pg = EmbeddedPostgres::start_in_namespace(bed.namespace("db"), bed.address("db"))
        .expect("PostgreSQL on the db host");
    let observer = Client::connect(&pg.socket_config("postgres"))
        .await
        .unwrap();
    observer.migrate().await.unwrap();
    observer.set_capacity("s", 1_000_000, None).await.unwrap();
    let mut probe = connect(&pg.socket_config("postgres")).await;
    let url = format!(
        "postgres://postgres@{}:{}/postgres",
        bed.address("db"),
        pg.port()
    );

    let w1 = start_worker(&bed, "w1", &url);
    wait_until(Duration::from_secs(20), "w1 listens", || {
        let probe = &probe;
        async move {
            let n: i64 = probe
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE application_name = 'permitq w1' AND query LIKE 'LISTEN%'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            n == 1
        }
    })
    .await;

    // Producers on the client host, over the bed: `permitq submit` in a loop (bounded; killed
    // with the bed).
    let mut load = bed.command("client", "/bin/sh");
    load.args([
        "-c",
        r#"i=0; while [ $i -lt 20000 ]; do i=$((i+1)); "$0" submit "load-$i" s=1 >/dev/null 2>&1; done"#,
        PERMITQ,
    ])
    .env("DATABASE_URL", &url)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    bed.spawn(load).unwrap();
    wait_until(
        Duration::from_secs(20),
        "grants from the client host",
        || {
            let observer = &observer;
            async move {
                observer
                    .usage()
                    .await
                    .unwrap()
                    .iter()
                    .any(|u| u.name == "s" && u.granted > 5)
            }
        },
    )
    .await;

    // Cut w1's host off while it holds the semaphore's row lock: pause it, and if it is caught
    // mid-batch, partition it, then let it run (cut off) again.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "never caught w1 holding the lock"
        );
        signal(w1, "STOP");
        // Still locked 100 ms into the pause: the server waits on w1 for the rest of the batch
        // (not finishing a pipelined COMMIT it already has).
        if semaphore_locked(&mut probe, "s").await && {
            tokio::time::sleep(Duration::from_millis(100)).await;
            semaphore_locked(&mut probe, "s").await
        } {
            bed.partition("w1").unwrap();
            signal(w1, "CONT");
            break;
        }
        signal(w1, "CONT");
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let cut_at = Instant::now();
    while semaphore_locked(&mut probe, "s").await {
        assert!(
            cut_at.elapsed() < IDLE_BOUND + Duration::from_secs(10),
            "the cut-off worker still blocks the semaphore after {:?}",
            cut_at.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let blocked = cut_at.elapsed();
    eprintln!("a partitioned worker blocked the semaphore for {blocked:?} (bound {IDLE_BOUND:?})");
    assert!(
        blocked + Duration::from_millis(100) >= IDLE_BOUND - Duration::from_secs(1)
            && blocked <= IDLE_BOUND + Duration::from_secs(2),
        "blocked for {blocked:?}: the server's idle bound, not luck, frees the lock"
    );

    // A worker on another host carries on.
    let w2 = start_worker(&bed, "w2", &url);
    observer
        .submit(&Request::new("during-partition").permit("s", 1))
        .await
        .unwrap();
    let granted = observer
        .wait_settled("during-partition", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(granted.state, State::Acquired);
    assert_eq!(granted.worker_id.as_deref(), Some("w2"));

    // Healed, w1 finds its session gone, reconnects and grants again (w2 stopped, so only w1
    // can grant).
    bed.heal("w1").unwrap();
    signal(w2, "TERM");
    wait_until(Duration::from_secs(20), "w2 stopped", || {
        let probe = &probe;
        async move {
            let n: i64 = probe
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'permitq w2'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            n == 0
        }
    })
    .await;
    observer
        .submit(&Request::new("after-heal").permit("s", 1))
        .await
        .unwrap();
    let granted = observer
        .wait_settled("after-heal", Duration::from_secs(90))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        granted.state,
        State::Acquired,
        "w1 grants again after the heal"
    );
    assert_eq!(granted.worker_id.as_deref(), Some("w1"));
    check_invariants(&probe).await.unwrap();
    let conn = permitq_test_support::connect(&pg.socket_config("postgres")).await;
    let report = permitq_test_support::collect(&conn, "").await.unwrap();
    assert!(
        report.over_capacity.is_empty(),
        "{:?}",
        report.over_capacity
    );
    // Dropped in reverse order: PostgreSQL stops, then the bed kills its processes and goes.
}
