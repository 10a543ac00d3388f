//! Producers through PgBouncer 1.18 in transaction pooling mode: the CLI, the Rust client and the
//! SQL API work through it, run after run, while the worker connects directly (it LISTENs and
//! holds row locks across statements of one transaction only, but its session settings and its
//! LISTEN need a session of its own).

use permitq_test_support as common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{quiet_config, PgBouncer, TestDb};
use permitq::{Client, Request, State};

async fn permitq(url: &str, args: &[&str]) -> Output {
    let (url, args): (String, Vec<String>) = (
        url.to_string(),
        args.iter().map(|a| a.to_string()).collect(),
    );
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_permitq"))
            .args(&args)
            .env("DATABASE_URL", url)
            .env("RUST_LOG", "off")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

fn ok(o: &Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what}: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_work_through_pgbouncer_in_transaction_mode() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("direct"));
    // One server connection: every session's transactions share it, so a named statement one
    // CLI process leaves behind (`s0`) is there when the next process prepares its own `s0`:
    // before the client used unnamed statements, the second command failed with 42P05.
    let bouncer = PgBouncer::start(&db.url, "transaction", 1);
    let pooled = bouncer.url(&db.name);

    // The CLI, command after command (each a new session through the pooler).
    ok(
        &permitq(&pooled, &["semaphore", "set", "gpu", "2"]).await,
        "set",
    );
    for i in 0..3 {
        let id = format!("cli-{i}");
        let out = ok(
            &permitq(
                &pooled,
                &["submit", &id, "gpu=1", "--ttl", "30s", "--await", "15s"],
            )
            .await,
            "submit",
        );
        assert!(out.contains("acquired"), "{out}");
        ok(&permitq(&pooled, &["status", &id]).await, "status");
        ok(&permitq(&pooled, &["heartbeat", &id]).await, "heartbeat");
        let out = ok(&permitq(&pooled, &["release", &id]).await, "release");
        assert!(
            out.starts_with("released: gpu=1 given back after "),
            "{out}"
        );
    }
    ok(
        &permitq(&pooled, &["semaphore", "show", "gpu"]).await,
        "show",
    );

    // The Rust client: several concurrent producers on one pool, acquire with a lease (waiting
    // on notifications falls back to polling the status), heartbeat, release.
    let client = Client::connect_with_pool_size(&pooled, 4).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..6 {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let id = format!("rust-{i}");
            let lease = client
                .acquire(
                    &Request::new(&id)
                        .permit("gpu", 1)
                        .ttl(Duration::from_secs(30)),
                    Duration::from_secs(20),
                )
                .await
                .unwrap();
            client.heartbeat(&id, None).await.unwrap();
            lease.release().await.unwrap();
            client.status(&id).await.unwrap().unwrap().state
        }));
    }
    for task in tasks {
        assert_eq!(task.await.unwrap(), State::Released);
    }
    assert_eq!(client.usage().await.unwrap().len(), 1);

    // The SQL API, as psql sends it (simple queries).
    let sql = common::connect(&pooled).await;
    sql.batch_execute("SELECT permitq.submit('sql-1', '{\"gpu\": 1}')")
        .await
        .unwrap();
    let rows = sql
        .simple_query("SELECT state FROM permitq.await_settled('sql-1', '15 seconds')")
        .await
        .unwrap();
    let state = rows.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(String::from),
        _ => None,
    });
    assert_eq!(state.as_deref(), Some("acquired"));
    sql.batch_execute("SELECT permitq.release('sql-1')")
        .await
        .unwrap();
    worker.stop().await;
    common::check_invariants(&db.conn().await).await.unwrap();
}
