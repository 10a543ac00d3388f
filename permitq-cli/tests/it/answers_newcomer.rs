//! More answers a newcomer met: an interrupted `submit --await`, libpq's variables without a URL,
//! names that differ only in case or a space, an option from another tool, a port already taken.

use permitq_test_support as common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{wait_until, TestDb};

use crate::cli::{code, permitq, run, stderr, stdout};

const SOON: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_submit_await_cancels_the_request_it_made() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "1"]).await;
    // No worker: it waits the whole await unless interrupted.
    let o = interrupted_await(&db, &["int-1", "gpu=1", "--await"], "INT").await;
    assert_eq!(code(&o), 130, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: interrupted; int-1: cancelled it: it was still waiting")
            && stderr(&o).contains("waiting until it is granted (Ctrl-C cancels it) anyway"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["status", "int-1"]).await;
    assert!(
        stdout(&o).starts_with("int-1 error cancelled"),
        "{}",
        stdout(&o)
    );

    // SIGTERM too; and a request submitted before under this id is the same request.
    run(url, &["submit", "int-2", "gpu=1"]).await;
    let o = interrupted_await(&db, &["int-2", "gpu=1", "--await", "60s"], "TERM").await;
    assert_eq!(code(&o), 130, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: interrupted; int-2: cancelled it: it was still waiting"),
        "{}",
        stderr(&o)
    );
    let client = db.client().await;
    assert_eq!(
        client.status("int-2").await.unwrap().unwrap().state,
        permitq::State::Error
    );
}

/// Interrupted on a semaphore served by fairness key, after a worker placed it: the cancel says
/// its turn stays taken, as `release` says it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_submit_await_says_its_keys_turn_stays_taken() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "kg", "1", "--fairness-keys"]).await;
    let worker = db.notified_worker("w1");
    let o = run(url, &["submit", "hold", "kg=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args([
            "submit",
            "k-1",
            "kg=1",
            "--fairness-key",
            "team-k",
            "--await",
            "60s",
        ])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let conn = db.conn().await;
    wait_until(SOON, "k-1 placed in line", || async {
        conn.query_one("SELECT count(*) FROM permitq.waiter", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    // Its own LISTEN beside the worker's: its signal handler is in place.
    wait_until(SOON, "submit --await is waiting on LISTEN", || async {
        conn.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query ILIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            >= 2
    })
    .await;
    common::signal(child.id(), "INT");
    let o = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap();
    assert_eq!(code(&o), 130, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: interrupted; k-1: cancelled it: it was still waiting; its turn on kg stays \
             taken for its fairness key team-k until the line passes it"
        ),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}

/// `permitq submit ARGS` run until it waits, then sent SIG`signal`: what it printed and its exit.
async fn interrupted_await(db: &TestDb, args: &[&str], signal: &str) -> std::process::Output {
    let child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .arg("submit")
        .args(args)
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its signal handler is in place before it opens its LISTEN connection to wait.
    waiting_on_listen(db).await;
    common::signal(child.id(), signal);
    tokio::task::spawn_blocking(move || child.wait_with_output().unwrap())
        .await
        .unwrap()
}

/// Until a `submit --await` waits: its LISTEN connection is open.
async fn waiting_on_listen(db: &TestDb) {
    let conn = db.conn().await;
    wait_until(SOON, "submit --await is waiting on LISTEN", || async {
        conn.query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND query ILIKE 'LISTEN%'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            > 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpq_variables_alone_name_the_database() {
    let db = TestDb::new().await;
    let config: tokio_postgres::Config = db.url.parse().unwrap();
    let host = match &config.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
    };
    let o = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["semaphore", "set", "from-env", "3"])
        .env_remove("DATABASE_URL")
        .env("PGHOST", host)
        .env("PGPORT", config.get_ports()[0].to_string())
        .env("PGUSER", config.get_user().unwrap())
        .env(
            "PGPASSWORD",
            String::from_utf8_lossy(config.get_password().unwrap_or_default()).to_string(),
        )
        .env("PGDATABASE", config.get_dbname().unwrap())
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        common::semaphore(&db.client().await, "from-env")
            .await
            .is_some(),
        "written to the database PG* named"
    );
    // Neither a URL nor a variable: what to set, the variables included.
    let o = permitq(None, &["semaphore", "list"]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("pass --database-url or set DATABASE_URL (or libpq's PGHOST"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_that_differ_only_in_case_or_a_space_are_pointed_out() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    let o = run(url, &["semaphore", "set", "GPU", "2"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // Said once, with the way out once (on the line that says it was created).
    assert!(
        stderr(&o).contains(
            "permitq: note: \"gpu\" also exists, a separate semaphore: names match exactly, case \
             included\n"
        ) && stderr(&o)
            .matches("`permitq semaphore delete GPU` removes this one")
            .count()
            == 1,
        "{}",
        stderr(&o)
    );
    // Changing the one that was there first: no advice to delete it.
    let o = run(url, &["semaphore", "set", "gpu", "5"]).await;
    assert!(
        stderr(&o).contains("note: \"GPU\" also exists") && !stderr(&o).contains("delete"),
        "{}",
        stderr(&o)
    );
    for name in ["gpu ", " gpu", "gpu\t"] {
        let o = run(url, &["semaphore", "set", name, "2"]).await;
        assert_eq!(code(&o), 2, "{name:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains("invalid name: ")
                && stderr(&o).contains("at its start or end; names match exactly: use 'gpu'"),
            "{name:?}: {}",
            stderr(&o)
        );
    }
    assert!(common::semaphore(&db.client().await, "gpu ")
        .await
        .is_none());
}

#[test]
fn an_option_from_another_tool_is_told_what_permitq_calls_it() {
    let o = permitq(None, &["submit", "a", "gpu=1", "--timeout", "5s"]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("unexpected argument '--timeout'")
            && stderr(&o).contains("tip: `submit --await DUR` waits up to DUR for the outcome")
            && stderr(&o).contains("`--wait DUR` ends the request in error `timeout`"),
        "{}",
        stderr(&o)
    );
    // No tip where clap has a real suggestion to make.
    let o = permitq(None, &["submit", "a", "gpu=1", "--awai", "5s"]);
    assert!(
        !stderr(&o).contains("tip: `submit --await"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_semaphore_command_guessed_from_another_tool_is_pointed_at_set() {
    for word in ["create", "add", "new"] {
        let o = permitq(None, &["semaphore", word, "foo", "3"]);
        assert_eq!(code(&o), 2);
        assert!(
            stderr(&o).contains(&format!("unrecognized subcommand '{word}'"))
                && stderr(&o).contains(
                    "tip: `permitq semaphore set NAME CAPACITY` creates a semaphore, and changes \
                     one that exists"
                ),
            "{word}: {}",
            stderr(&o)
        );
    }
    // A typo of a real command gets clap's own suggestion, not this tip.
    let o = permitq(None, &["semaphore", "sho", "foo"]);
    assert!(
        !stderr(&o).contains("creates a semaphore"),
        "{}",
        stderr(&o)
    );
    // And the other words other tools use.
    for (args, tip) in [
        (
            &["semaphore", "rm", "foo"][..],
            "tip: `permitq semaphore delete NAME`",
        ),
        (
            &["semaphore", "remove", "foo"][..],
            "tip: `permitq semaphore delete NAME`",
        ),
        (
            &["cancel", "g1"][..],
            "tip: `permitq release ID` cancels a request still waiting",
        ),
        (
            &["renew", "g1"][..],
            "tip: `permitq heartbeat ID` extends a held request's lease",
        ),
        (
            &["extend", "g1"][..],
            "tip: `permitq heartbeat ID` extends a held request's lease",
        ),
        (
            &["acquire", "g1", "gpu=1"][..],
            "tip: `permitq submit ID SEMAPHORE=COUNT --await 30s`",
        ),
        (&["list"][..], "tip: `permitq semaphore list`"),
        (&["show", "gpu"][..], "tip: `permitq semaphore show NAME`"),
    ] {
        let o = permitq(None, args);
        assert_eq!(code(&o), 2, "{args:?}");
        assert!(stderr(&o).contains(tip), "{args:?}: {}", stderr(&o));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_on_a_port_in_use_names_the_option_that_moves_it() {
    let db = TestDb::new().await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let o = run(&db.url, &["serve", "--http-addr", &addr]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("cannot listen on {addr} for HTTP"))
            && stderr(&o).contains("another process listens there")
            && stderr(&o).contains("--http-addr (serve and worker)"),
        "{}",
        stderr(&o)
    );
}

/// A name with a space is quoted in the commands the answers suggest, so they run as copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_with_a_space_is_quoted_in_the_commands_suggested() {
    let db = TestDb::new().await;
    let url = &db.url;
    let o = run(url, &["semaphore", "set", "my gpu", "1"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let worker = db.worker(common::quiet_config("w"));
    let o = run(url, &["submit", "q-1", "my gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["semaphore", "delete", "my gpu"]).await;
    assert!(
        stderr(&o).contains("(`permitq semaphore show 'my gpu'` lists the holders)"),
        "{}",
        stderr(&o)
    );
    // A name nothing has: the command that would create it, quoted.
    let o = run(url, &["submit", "q-2", "my gpux=1", "--await", "10s"]).await;
    assert!(
        stderr(&o).contains("`permitq semaphore set 'my gpux' CAPACITY`")
            || stdout(&o).contains("`permitq semaphore set 'my gpux' CAPACITY`"),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
    worker.stop().await;
}
