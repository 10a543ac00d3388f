//! The `permitq` binary: exit codes, --json, malformed arguments, one-line errors.

use permitq_test_support as common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{quiet_config, wait_until, TestDb};

pub(crate) fn permitq(url: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_permitq"));
    cmd.args(args)
        .stdin(Stdio::null())
        .env_remove("DATABASE_URL")
        // libpq's variables stand in for a missing URL: none from the environment tests run in.
        .env_remove("PGHOST")
        .env_remove("PGPORT")
        .env_remove("PGUSER")
        .env_remove("PGDATABASE")
        .env("RUST_LOG", "off");
    if let Some(url) = url {
        cmd.env("DATABASE_URL", url);
    }
    cmd.output().expect("run permitq")
}

/// Runs the binary off the async runtime's threads.
pub(crate) async fn run(url: &str, args: &[&str]) -> Output {
    let (url, args): (String, Vec<String>) = (
        url.to_string(),
        args.iter().map(|s| s.to_string()).collect(),
    );
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        permitq(Some(&url), &args)
    })
    .await
    .unwrap()
}

/// Waits (15 s at most) until the worker process `id` holds its LISTEN connection.
async fn wait_until_listening(db: &TestDb, id: &str) {
    let conn = db.conn().await;
    let app = format!("permitq {id}");
    wait_until(Duration::from_secs(15), "the worker is listening", || async {
        let n: i64 = conn
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND query LIKE 'LISTEN%'",
                &[&app],
            )
            .await
            .unwrap()
            .get(0);
        n == 1
    })
    .await;
}

pub(crate) fn code(o: &Output) -> i32 {
    o.status
        .code()
        .expect("exited normally, not by a signal (no panic abort)")
}

pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).to_string()
}

#[test]
fn malformed_arguments_are_usage_errors_with_exit_2() {
    for args in [
        &[][..],
        &["frobnicate"],
        &["submit", "id-only"],
        &["submit", "x", "db"],
        &["submit", "x", "db=0"],
        &["submit", "x", "db=-1"],
        &["submit", "x", "db=1.5"],
        &["submit", "x", "=1"],
        &["submit", "x", "db=99999999999"],
        &["submit", "x", "db=1", "--ttl", "soon"],
        &["submit", "x", "db=1", "--await", "later"],
        &["semaphore", "set", "db"],
        &["semaphore", "set", "db", "-4"],
        &["semaphore", "set", "db", "2", "--fair", "--greedy"],
        &["worker", "--batch-size", "0"],
        &["worker", "--poll-interval", "fast"],
        &["worker", "--metrics-addr", "nowhere"],
        &["status"],
        &["status", "x"],
        &["submit", "x", "db=1", "--ttl", "-5s"],
        &["submit", "x", "db=1", "--ttl", "0s"],
        &["submit", "x", "db=1", "--ttl", "1000000y"],
        &["submit", "x", "db=1", "--ttl", "292270y"],
        &["submit", "x", "db=1", "--wait", "292270y"],
        &["submit", "x", "db=1", "--wait", "-1s"],
        &["submit", "x", "db=1", "db=2"],
        &["submit", "x", "db=1", "--permit", "db", "2"],
        &["submit", "x", "a=b=1"],
        &["submit", "x", "--permit", "a=b", "0"],
        &["submit", "x", "--permit", "a=b"],
        &["heartbeat", "x", "--extend", "11y"],
        &["heartbeat", "x", "--extend", "-5s"],
        &["worker", "--max-hold", "11y"],
        &["worker", "--retention", "-1d"],
        &["chaos", "--database-url", "postgres://localhost/x"],
    ] {
        let o = permitq(None, args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        // Rejected by clap: its whole message (what is wrong, for a missing or unexpected
        // argument the usage line, and --help; no
        // command at all: the help with the command list); rejected by permitq: one line naming
        // the field.
        assert!(
            (err.starts_with("error: ") && err.contains("try '--help'"))
                || (args.is_empty() && err.contains("Commands:"))
                || ((err.starts_with("permitq: invalid ") || err.starts_with("permitq: no "))
                    && err.trim().lines().count() == 1),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}");
    }
    let o = permitq(None, &["--help"]);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("submit"));
}

/// Usage errors show clap's whole message: the command list when no command is given, what is
/// missing, suggestions for a misspelt command, and the field a bad value was given for.
#[test]
fn usage_errors_show_the_whole_message() {
    let o = permitq(None, &[]);
    assert_eq!(code(&o), 2);
    for command in [
        "migrate",
        "worker",
        "submit",
        "semaphore",
        "release",
        "Commands:",
    ] {
        assert!(stderr(&o).contains(command), "{}", stderr(&o));
    }
    let o = permitq(None, &["submit"]);
    assert_eq!(code(&o), 2);
    assert!(
        // (The permits are checked by `submit` itself, which can tell one given in the id's
        // place: answers::a_submit_without_its_id_says_the_permit_was_taken_as_the_id.)
        stderr(&o).contains("<EXTERNAL_ID>") && stderr(&o).contains("[PERMITS]..."),
        "{}",
        stderr(&o)
    );
    let o = permitq(None, &["wokrer"]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("similar subcommands exist: 'workers', 'worker'"),
        "{}",
        stderr(&o)
    );
    let o = permitq(None, &["semaphore", "set", "gpu", "-3"]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("invalid value '-3' for '<CAPACITY>'"),
        "{}",
        stderr(&o)
    );
    let o = permitq(None, &["serve", "--http-addr", "nowhere"]);
    assert_eq!(code(&o), 2);
    assert!(stderr(&o).contains("--http-addr"), "{}", stderr(&o));
    // Ranges in words, not in Rust's notation.
    for (args, said) in [
        (
            &["submit", "z", "gpu=1", "--priority", "200"][..],
            "200 is outside the range: give a whole number from -100 to 100 (higher goes first \
             in line; 0 is the default)",
        ),
        (
            &[
                "semaphore",
                "set",
                "c",
                "4",
                "--parent",
                "p",
                "--guarantee",
                "-1",
            ][..],
            "-1 is below 0: give 0 or more (0 for none: the child then only borrows what is free)",
        ),
        (
            &["submit", "z", "gpu=1", "--fairness-weight", "0"][..],
            "0 is outside the range: give a whole number from 1 to 1000 (a key's share of the \
             turns; 1 is the default)",
        ),
    ] {
        let o = permitq(None, args);
        assert_eq!(code(&o), 2, "{}", stderr(&o));
        assert!(
            stderr(&o).contains(said) && !stderr(&o).contains("..="),
            "{}",
            stderr(&o)
        );
    }
}

/// A missing URL and a malformed one are both input errors: exit 2, one line naming it.
#[test]
fn database_url_errors_share_exit_code_2() {
    let o = permitq(None, &["status", "x"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim(),
        "permitq: no database URL given: pass --database-url or set DATABASE_URL (or libpq's \
         PGHOST, PGDATABASE, PGUSER)"
    );
    let o = permitq(Some("not a url ::"), &["status", "x"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert_eq!(stderr(&o).trim().lines().count(), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("invalid database URL"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn an_empty_database_url_is_no_url() {
    let o = permitq(Some(""), &["semaphore", "list"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("DATABASE_URL is set but empty"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn runtime_errors_are_one_line_with_exit_1() {
    // Nothing listens on port 1.
    let o = permitq(Some("postgres://nobody@127.0.0.1:1/none"), &["status", "x"]);
    assert_eq!(code(&o), 1);
    let err = stderr(&o);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.starts_with("permitq: ") && err.contains("refused"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_without_the_schema_says_run_migrate_and_migrate_is_idempotent() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    conn.batch_execute("DROP SCHEMA permitq CASCADE")
        .await
        .unwrap();
    let o = run(&db.url, &["semaphore", "list"]).await;
    assert_eq!(code(&o), 1);
    assert!(
        stderr(&o).contains("run `permitq migrate`"),
        "{}",
        stderr(&o)
    );
    assert_eq!(stderr(&o).trim().lines().count(), 1);

    // Two concurrent migrations, then a third: all succeed, the schema is applied once.
    let (a, b) = tokio::join!(run(&db.url, &["migrate"]), run(&db.url, &["migrate"]));
    assert_eq!(
        (code(&a), code(&b)),
        (0, 0),
        "{} {}",
        stderr(&a),
        stderr(&b)
    );
    let again = run(&db.url, &["migrate"]).await;
    assert_eq!(code(&again), 0);
    // It names the database it looked at: a URL naming another one would be seen here.
    assert!(
        stdout(&again).contains(&format!("schema is up to date in database {} at ", db.name)),
        "{}",
        stdout(&again)
    );
    let first = if stdout(&a).contains("applied") {
        &a
    } else {
        &b
    };
    assert!(
        stdout(first).starts_with(&format!("migrated database {} at ", db.name)),
        "{}",
        stdout(first)
    );
    let versions: i64 = conn
        .query_one("SELECT count(*) FROM permitq.schema_migration", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        usize::try_from(versions).unwrap(),
        permitq::migrate::MIGRATIONS.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_await_status_release_and_their_exit_codes() {
    let db = TestDb::new().await;
    let url = db.url.as_str();
    let o = run(url, &["semaphore", "set", "db", "3"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        code(&run(url, &["semaphore", "set", "gpu", "1", "--greedy"]).await),
        0
    );
    let list = run(url, &["semaphore", "list", "--json"]).await;
    let list: serde_json::Value = serde_json::from_str(&stdout(&list)).unwrap();
    assert_eq!(list[0]["name"], "db");
    assert_eq!(list[1]["fair"], false);

    // No worker yet: --await runs out with the request still new (exit 4).
    let o = run(url, &["submit", "early", "db=1", "--await", "300ms"]).await;
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(stdout(&o).contains("new"));

    let worker = db.worker(quiet_config("cli-worker"));
    let o = run(
        url,
        &[
            "submit", "job-1", "db=2", "gpu=1", "--owner", "me", "--ttl", "30s", "--await", "10s",
            "--json",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(json["state"], "acquired");
    assert_eq!(json["external_id"], "job-1");
    assert_eq!(json["permits"]["db"], 2);
    assert_eq!(json["ttl"], 30.0);
    assert!(json["fencing_token"].as_i64().unwrap() > 0);
    assert!(json["expires_at"].is_string() && json["error_code"].is_null());

    // Same key, same parameters: the same row; different parameters: a runtime error.
    let o = run(
        url,
        &[
            "submit", "job-1", "db=2", "gpu=1", "--owner", "me", "--ttl", "30s",
        ],
    )
    .await;
    assert_eq!(code(&o), 0);
    let o = run(url, &["submit", "job-1", "db=1"]).await;
    assert_eq!(code(&o), 2, "an id already taken is input rejected");
    assert!(
        stderr(&o).contains("different parameters"),
        "{}",
        stderr(&o)
    );

    let o = run(url, &["submit", "huge", "db=4", "--await"]).await;
    assert_eq!(
        code(&o),
        3,
        "exceeds capacity ends in error: {}",
        stdout(&o)
    );
    assert!(stdout(&o).contains("exceeds_capacity"));
    let o = run(
        url,
        &["submit", "fast", "db=1", "--wait", "0s", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 3);
    assert!(stdout(&o).contains("no_capacity"));

    // Invalid input the database rejects (22023) is a usage error.
    let long = "x".repeat(300);
    let o = run(url, &["submit", &long, "db=1"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("external_id"));

    let o = run(url, &["status", "job-1", "--json"]).await;
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(json["state"], "acquired");
    // The text shows the lease's end too.
    let o = run(url, &["status", "job-1"]).await;
    assert!(
        stdout(&o).starts_with("job-1 acquired fencing_token=")
            && stdout(&o).contains(" expires_at=20"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["status", "nope"]).await;
    assert_eq!(code(&o), 5, "not found: {}", stderr(&o));

    let o = run(url, &["heartbeat", "job-1", "--extend", "1m"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).starts_with("expires_at=20"));
    assert!(!stderr(&o).contains("ends earlier"), "{}", stderr(&o));
    // The end printed may read as the one before, to the second: what moved is said.
    assert!(
        stderr(&o).contains("permitq: lease extended: it ends in 1m (it was to end in "),
        "{}",
        stderr(&o)
    );
    // A shorter --extend moves the end earlier, and says so.
    let o = run(url, &["heartbeat", "job-1", "--extend", "5s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: note: the lease now ends earlier than before (20")
            && stderr(&o).contains("a heartbeat sets its end to now + --extend")
            && !stderr(&o).contains("lease extended"),
        "{}",
        stderr(&o)
    );
    run(url, &["heartbeat", "job-1", "--extend", "1m"]).await;
    // A plain heartbeat after a longer --extend sets now + the ttl (30s): it says so.
    let o = run(url, &["heartbeat", "job-1"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: note: the lease now ends earlier than before (20")
            && stderr(&o)
                .contains("a heartbeat without --extend sets its end to now + its ttl (30s)"),
        "{}",
        stderr(&o)
    );
    // Plain again: nothing moved earlier, nothing said.
    let o = run(url, &["heartbeat", "job-1"]).await;
    assert!(stderr(&o).is_empty(), "{}", stderr(&o));
    let o = run(url, &["release", "job-1"]).await;
    assert!(
        stdout(&o).starts_with("released: db=2 gpu=1 given back after "),
        "{}",
        stdout(&o)
    );
    // Its explain says how long it held and since when, as the release did.
    let o = run(url, &["explain", "job-1"]).await;
    assert!(
        stdout(&o).starts_with("job-1 is not waiting: released (by its holder) after ")
            && stdout(&o).contains("s held, "),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["release", "job-1"]).await;
    assert!(
        stdout(&o).starts_with("already_released: it was released by its holder ")
            && stdout(&o).ends_with(" ago; nothing more to give back\n"),
        "{}",
        stdout(&o)
    );
    for verb in ["release", "revoke", "heartbeat", "status", "explain"] {
        let o = run(url, &[verb, "nope"]).await;
        assert_eq!(code(&o), 5, "{verb} nope: {}", stderr(&o));
        assert_eq!(
            stderr(&o).trim(),
            "permitq: no request named \"nope\": none was submitted under that external_id, or \
             it ended long enough ago that retention removed it"
        );
    }
    // A semaphore's NAME=COUNT where an id belongs: said what the command takes.
    for verb in ["release", "revoke"] {
        let o = run(url, &[verb, "gpu=1"]).await;
        assert_eq!(code(&o), 5, "{verb} gpu=1: {}", stderr(&o));
        assert!(
            stderr(&o).contains(
                "(this command takes a request's external_id, the ID given to \
                                 `permitq submit ID NAME=COUNT`, not NAME=COUNT;"
            ),
            "{verb}: {}",
            stderr(&o)
        );
    }
    // A semaphore's plain name where an id belongs, likewise (status reads it too).
    for verb in ["release", "revoke", "status"] {
        let o = run(url, &[verb, "gpu"]).await;
        assert_eq!(code(&o), 5, "{verb} gpu: {}", stderr(&o));
        assert!(
            stderr(&o).contains(
                "(gpu is a semaphore: this command takes a request's external_id, the ID given \
                 to `permitq submit ID gpu=COUNT`; `permitq semaphore show gpu` lists its \
                 holders and their ids)"
            ),
            "{verb}: {}",
            stderr(&o)
        );
    }
    // A near id is suggested: another case, or two letters swapped.
    for (verb, typo) in [
        ("status", "JOB-1"),
        ("explain", "jbo-1"),
        ("heartbeat", "jbo-1"),
    ] {
        let o = run(url, &[verb, typo]).await;
        assert_eq!(code(&o), 5, "{verb} {typo}: {}", stderr(&o));
        assert_eq!(
            stderr(&o).trim(),
            format!("permitq: no request named \"{typo}\"; did you mean job-1?"),
            "{verb}"
        );
    }
    let o = run(url, &["semaphore", "history", "nope"]).await;
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    let o = run(url, &["heartbeat", "job-1"]).await;
    assert_eq!(
        code(&o),
        3,
        "a released request holds nothing: {}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains("nothing to extend: job-1 was released by its holder "),
        "{}",
        stderr(&o)
    );

    // `early` was waiting all along and gets granted now.
    let o = run(url, &["status", "early"]).await;
    assert!(stdout(&o).contains("acquired"), "{}", stdout(&o));
    let o = run(url, &["revoke", "early"]).await;
    assert!(
        stdout(&o).starts_with("revoked: db=")
            && stdout(&o).contains(" taken back from its holder after ")
            && stdout(&o).contains("; its fencing token ")
            && stdout(&o).contains(
                " is now stale; it had no lease, so no heartbeat tells its holder: its next \
                 `permitq status` or fenced write does"
            ),
        "{}",
        stdout(&o)
    );
    // Who took it back is named to the holder (status, heartbeat) and on a second release.
    let o = run(url, &["status", "early"]).await;
    assert!(
        stdout(&o).contains(" took it back (`permitq revoke`)")
            && !stdout(&o).contains("OwnerLiveness"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["heartbeat", "early"]).await;
    assert!(
        stderr(&o).contains("lease lost: request early was revoked by ")
            && !stderr(&o).contains("by an admin"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["release", "early"]).await;
    assert!(
        stdout(&o).starts_with("already_released: it was released by ")
            && stdout(&o).contains(" (revoked) ")
            && !stdout(&o).contains("by an admin"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["semaphore", "history", "db", "--json"]).await;
    let history: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(history[0]["new_capacity"], 3);
    assert!(history[0]["old_capacity"].is_null());
    assert_eq!(
        history[0]["application_name"], "permitq",
        "the CLI names itself in the audit"
    );

    // A window: --per sets it, --per 0 removes it (a concurrency semaphore again).
    let o = run(
        url,
        &["semaphore", "set", "api", "5", "--per", "1m", "--json"],
    )
    .await;
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(json["per"], 60.0, "{}", stdout(&o));
    let o = run(
        url,
        &["semaphore", "set", "api", "5", "--per", "0", "--json"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert!(json["per"].is_null(), "{}", stdout(&o));
    assert!(
        stderr(&o).contains(
            "api is not rate-limited any more: its capacity 5 bounds the permits held at once \
             (`--per 1m` makes it a rate limit again)"
        ),
        "{}",
        stderr(&o)
    );
    // Again, on what was never a rate limit: it says that nothing changed.
    let o = run(url, &["semaphore", "set", "api", "5", "--per", "0"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "api is not rate-limited (it was not before either: --per 0 changed nothing): its \
             capacity 5 bounds the permits held at once (`--per 1m` makes it a rate limit)"
        ),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}

/// SIGTERM while the worker waits for the schema (before it runs) is a clean stop: exit 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_waiting_for_the_schema_exits_0_on_sigterm() {
    let db = TestDb::empty().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["worker", "--id", "early-bird"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "permitq=warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // It says it is waiting (one warning a second) before the signal is sent.
    let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        std::io::BufRead::read_line(&mut stderr, &mut line).unwrap();
        line
    })
    .await
    .unwrap();
    assert!(line.contains("permitq migrate"), "{line}");
    common::signal(child.id(), "TERM");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_exits_0_on_sigterm() {
    let db = TestDb::new().await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["worker", "--id", "term-me"])
        .env("DATABASE_URL", &db.url)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_until_listening(&db, "term-me").await;
    common::signal(child.id(), "TERM");
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_of_a_lease_that_ran_out_exits_3() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    // A slow sweep: the lease runs out before anyone releases it.
    let mut config = quiet_config("w1");
    config.maintenance.sweep_interval = Duration::from_secs(3600);
    let worker = db.worker(config);
    client
        .submit(
            &permitq::Request::new("late")
                .permit("s", 1)
                .ttl(Duration::from_millis(200)),
        )
        .await
        .unwrap();
    assert_eq!(
        common::settled_state(&client, "late").await,
        permitq::State::Acquired
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = run(&db.url, &["heartbeat", "late"]).await;
    assert_eq!(code(&out), 3, "{}", stderr(&out));
    assert!(stderr(&out).contains("expired"), "{}", stderr(&out));
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_input_names_its_field_and_writes_nothing() {
    let db = TestDb::new().await;
    let url = &db.url;
    assert_eq!(code(&run(url, &["semaphore", "set", "db", "2"]).await), 0);
    for (args, field) in [
        (&["submit", "x", "db=1", "--ttl", "-5s"][..], "--ttl"),
        (&["submit", "x", "db=1", "--ttl", "1000000y"], "--ttl"),
        (&["submit", "x", "db=1", "--wait", "292270y"], "--wait"),
        (&["submit", "x", "db=1", "db=2"], "permits"),
        (&["submit", "", "db=1"], "external_id"),
        (&["semaphore", "set", "", "2"], "name"),
    ] {
        let o = run(url, args).await;
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(field),
            "{args:?} names {field}: {}",
            stderr(&o)
        );
    }
    let conn = db.conn().await;
    let rows: i64 = conn
        .query_one("SELECT count(*) FROM permitq.permit_request", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0, "a rejected call writes nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_whose_name_holds_an_equals_sign_is_requested_with_permit() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w1"));
    assert_eq!(code(&run(url, &["semaphore", "set", "a=b", "2"]).await), 0);
    let o = run(
        url,
        &["submit", "eq", "--permit", "a=b", "2", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).starts_with("eq acquired"), "{}", stdout(&o));
    // Said back as a shell word, not `a=b=2`.
    let o = run(url, &["release", "eq"]).await;
    assert!(
        stdout(&o).starts_with("released: 'a=b'=2 given back"),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_refuses_a_named_database_with_permitq_data_and_cleans_up_after_itself() {
    let db = TestDb::new().await;
    let url = db.url.clone();
    // DATABASE_URL alone does not name a database for demo: it would start a throwaway one.
    // Named explicitly and holding data: refused without --yes, nothing written.
    assert_eq!(
        code(&run(&url, &["semaphore", "set", "mine", "1"]).await),
        0
    );
    let o = run(&url, &["demo", "--database-url", &url, "--duration", "1s"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--yes"), "{}", stderr(&o));
    let o = run(
        &url,
        &[
            "demo",
            "--database-url",
            &url,
            "--duration",
            "2s",
            "--yes",
            "--workers",
            "1",
            "--producers",
            "3",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // A lease that ran out is the demo's doing, and the summary says so.
    assert!(
        !stdout(&o).contains("released by reason   expired") && !stdout(&o).contains(", expired")
            || stdout(&o).contains("1 holder in 50 \"crashes\" without releasing"),
        "{}",
        stdout(&o)
    );
    let conn = db.conn().await;
    let left: Vec<String> = conn
        .query("SELECT name FROM permitq.semaphore ORDER BY name", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["mine"], "only what was there before is left");
    let requests: i64 = conn
        .query_one("SELECT count(*) FROM permitq.permit_request", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(requests, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_keep_leaves_its_server_running_and_says_how_to_use_and_remove_it() {
    let (refused, o) = tokio::task::spawn_blocking(|| {
        (
            permitq(
                None,
                &["demo", "--keep", "--database-url", "postgres://x@h/d"],
            ),
            permitq(
                None,
                &["demo", "--keep", "--duration", "2s", "--workers", "1"],
            ),
        )
    })
    .await
    .unwrap();
    assert_eq!(code(&refused), 2, "--keep with a named database is refused");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("(kept running afterwards (--keep)")
            && !stderr(&o).contains("removed at the end"),
        "{}",
        stderr(&o)
    );
    let out = stdout(&o);
    assert!(
        out.contains("fsync is off, and it lets any login in without checking its password"),
        "what the kept server is not: {out}"
    );
    let url = out
        .lines()
        .find_map(|l| l.trim().strip_prefix("export DATABASE_URL="))
        .unwrap_or_else(|| panic!("no DATABASE_URL in: {out}"))
        .to_string();
    let stop = out
        .lines()
        .skip_while(|l| !l.starts_with("Stop and remove it"))
        .nth(1)
        .unwrap_or_else(|| panic!("no stop command in: {out}"))
        .trim()
        .to_string();
    // The server outlived the demo, emptied of its data: the tutorial starts on it.
    let migrated = run(&url, &["migrate"]).await;
    assert_eq!(code(&migrated), 0, "{}", stderr(&migrated));
    assert!(
        !stdout(&migrated).contains("up to date") && !stderr(&migrated).contains("up to date"),
        "the schema is created, not found: {}{}",
        stdout(&migrated),
        stderr(&migrated)
    );
    let created = run(&url, &["semaphore", "set", "gpu", "4"]).await;
    assert_eq!(code(&created), 0, "{}", stderr(&created));
    assert!(
        !stderr(&created).contains("did you mean"),
        "no demo semaphore is near: {}",
        stderr(&created)
    );
    // Stopped with its pg_ctl alone, the printed start command brings it back on its port.
    let start = out
        .lines()
        .skip_while(|l| !l.starts_with("(Stopped with its pg_ctl alone"))
        .nth(1)
        .unwrap_or_else(|| panic!("no start command in: {out}"))
        .trim()
        .trim_end_matches(')')
        .to_string();
    let pg_ctl_stop = stop.split(" && ").next().unwrap().to_string();
    for command in [&pg_ctl_stop, &start] {
        let ran = Command::new("/bin/sh")
            .args(["-c", command])
            .output()
            .unwrap();
        assert!(ran.status.success(), "{command}: {ran:?}");
    }
    let listed = run(&url, &["semaphore", "list"]).await;
    assert!(
        code(&listed) == 0 && stdout(&listed).contains("gpu"),
        "{start}: {}{}",
        stdout(&listed),
        stderr(&listed)
    );
    // The printed command stops it and removes its directory.
    let dir = stop.rsplit(' ').next().unwrap().to_string();
    assert!(std::path::Path::new(&dir).is_dir(), "{stop}");
    let stopped = Command::new("/bin/sh")
        .args(["-c", &stop])
        .output()
        .unwrap();
    assert!(stopped.status.success(), "{stop}: {stopped:?}");
    assert!(!std::path::Path::new(&dir).exists(), "{dir} is removed");
    assert!(permitq_embedded_pg::try_connect(&url).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_worker_whose_stdout_and_stderr_are_a_closed_pipe() {
    use std::io::Read as _;
    let db = TestDb::new().await;
    // `permitq worker 2>&1 | head -1`: the reader takes one line and goes away.
    let (mut reader, writer) = std::io::pipe().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["worker", "--id", "piped", "--poll-interval", "100ms"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "permitq=debug,permitq_cli=debug")
        .stdin(Stdio::null())
        .stdout(writer.try_clone().unwrap())
        .stderr(writer)
        .spawn()
        .unwrap();
    let mut first = [0u8; 1];
    reader.read_exact(&mut first).unwrap();
    drop(reader);
    wait_until_listening(&db, "piped").await;
    // A grant makes the worker log (debug) into the closed pipe: EPIPE.
    let client = db.client().await;
    client.set_capacity("p", 1, None).await.unwrap();
    client
        .submit(&permitq::Request::new("logged").permit("p", 1))
        .await
        .unwrap();
    let r = client
        .wait_settled("logged", Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.state, permitq::State::Acquired);
    common::signal(child.id(), "TERM");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = tokio::task::spawn_blocking(move || loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    })
    .await
    .unwrap();
    let status = status.expect("the worker stopped within 10 s of SIGTERM");
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_logs_name_every_grant_and_sweep_and_json_logs_are_json() {
    let db = TestDb::new().await;
    let log = std::env::temp_dir().join(format!("permitq-log-{}.jsonl", db.name));
    let mut child = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args([
            "worker",
            "--id",
            "logged",
            "--sweep-interval",
            "100ms",
            "--log-format",
            "json",
        ])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "permitq=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let client = db.client().await;
    client.set_capacity("logs", 1, None).await.unwrap();
    client
        .submit(
            &permitq::Request::new("named-in-logs")
                .permit("logs", 1)
                .ttl(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(15),
        "granted and swept, by name",
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let events: Vec<serde_json::Value> = text
                .lines()
                .map(|l| serde_json::from_str(l).expect("every log line is a JSON object"))
                .collect();
            let named = |message: &str| {
                events.iter().any(|e| {
                    e["fields"]["message"] == message
                        && e["fields"]["external_id"] == "named-in-logs"
                })
            };
            named("granted") && named("swept")
        },
    )
    .await;
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains('\u{1b}'), "no ANSI escapes off a terminal");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_file(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_says_why_a_request_waits_in_text_json_and_on_semaphore_show() {
    let db = TestDb::new().await;
    let url = db.url.as_str();
    assert_eq!(code(&run(url, &["semaphore", "set", "gpu", "1"]).await), 0);
    let _worker = db.worker(quiet_config("cli-explain"));
    let o = run(
        url,
        &["submit", "holder", "gpu=1", "--ttl", "1m", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(code(&run(url, &["submit", "waiter", "gpu=1"]).await), 0);
    let client = db.client().await;
    common::wait_until(Duration::from_secs(10), "the waiter examined", || async {
        client
            .explain("waiter")
            .await
            .unwrap()
            .is_some_and(|e| e.semaphores[0].position.is_some())
    })
    .await;

    let o = run(url, &["explain", "waiter"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.starts_with("waiter waits (new)"), "{text}");
    assert!(
        text.contains("gpu: needs 1, 0 free of 1, short 1; position 1, 0 permits ahead"),
        "{text}"
    );
    assert!(
        text.contains("waits for 1 more permit to be released (first in line)"),
        "{text}"
    );
    assert!(text.contains("held by holder (1 for"), "{text}");
    // Behind another: its own shortfall, apart from the permits ahead of it.
    assert_eq!(code(&run(url, &["submit", "waiter2", "gpu=1"]).await), 0);
    common::wait_until(Duration::from_secs(10), "waiter2 examined", || async {
        client
            .explain("waiter2")
            .await
            .unwrap()
            .is_some_and(|e| e.semaphores[0].position.is_some())
    })
    .await;
    let text = stdout(&run(url, &["explain", "waiter2"]).await);
    assert!(
        text.contains("gpu: needs 1, 0 free of 1, short 1 for itself; position 2, 1 permit ahead of it in line"),
        "{text}"
    );
    assert_eq!(code(&run(url, &["release", "waiter2"]).await), 0);

    let o = run(url, &["explain", "waiter", "--json"]).await;
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(json["state"], "new");
    assert_eq!(json["semaphores"][0]["shortfall"], 1);
    assert_eq!(json["semaphores"][0]["holders"][0]["external_id"], "holder");

    let o = run(url, &["explain", "holder"]).await;
    assert_eq!(stdout(&o).trim(), "holder is not waiting: acquired");

    let o = run(url, &["semaphore", "show", "gpu"]).await;
    assert!(
        stdout(&o).contains("why the first in line waits:\n  waiter waits (new)"),
        "{}",
        stdout(&o)
    );

    let o = run(url, &["explain", "nobody"]).await;
    assert_ne!(code(&o), 0);
    assert!(stderr(&o).contains("nobody"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_set_nests_shows_the_parent_and_refuses_a_tree_it_cannot_keep() {
    let db = TestDb::new().await;
    let url = &db.url;
    assert_eq!(code(&run(url, &["semaphore", "set", "pool", "4"]).await), 0);
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "a",
            "3",
            "--parent",
            "pool",
            "--guarantee",
            "2",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o).trim(),
        "a capacity=3 used=0 fair parent=pool guarantee=2"
    );
    let o = run(url, &["semaphore", "show", "a"]).await;
    assert!(
        stdout(&o).contains("in pool, guaranteed 2")
            // Nobody waits: said in a word, not as a table of none.
            && stdout(&o).contains("\nwaiters: none\n"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["semaphore", "list"]).await;
    assert!(
        stdout(&o).contains("fair  under pool  guarantee 2\n"),
        "{}",
        stdout(&o)
    );
    // Guarantees that add up to more than the pool, and a parent that does not exist: exit 2,
    // the whole reason, nothing written.
    for (args, why) in [
        (
            &[
                "semaphore",
                "set",
                "b",
                "3",
                "--parent",
                "pool",
                "--guarantee",
                "3",
            ][..],
            "the guarantees of the children of pool add up to 5 (b 3, a 2), more than its \
             capacity 4: the others guarantee 2 of 4, so b may have at most 2: give this command \
             `--guarantee 2` or less (`--guarantee 0` for none: b then only borrows what is \
             free), or raise pool first (`permitq semaphore set pool 5`)",
        ),
        // Beyond its capacity and beyond what the parent leaves: the way out that fits both.
        (
            &[
                "semaphore",
                "set",
                "b",
                "1",
                "--parent",
                "pool",
                "--guarantee",
                "3",
            ][..],
            "guarantee 3 is more than the capacity 1, and more than pool leaves it (its other \
             children guarantee 2 of 4): give this command `--guarantee 1` or less (or up to 2 \
             with a capacity of as much: `permitq semaphore set b 2 --parent pool --guarantee \
             2`)",
        ),
        // The parent lowered below its children's guarantees: they are named, and the least.
        (
            &["semaphore", "set", "pool", "1"],
            "the guarantees of the children of pool add up to 2 (a 2), more than its capacity 1: \
             give it at least 2 (`permitq semaphore set pool 2`), or lower a child's guarantee \
             first (`permitq semaphore set CHILD CAPACITY --guarantee N`; `--guarantee 0` for \
             none: that child then only borrows what is free)",
        ),
        (
            &["semaphore", "set", "b", "3", "--parent", "nope"],
            "parent nope does not exist: create it first (`permitq semaphore set nope CAPACITY`)",
        ),
        // A guarantee beyond the capacity: both ways out.
        (
            &[
                "semaphore",
                "set",
                "b",
                "1",
                "--parent",
                "pool",
                "--guarantee",
                "2",
            ],
            "guarantee 2 is more than the capacity 1: give it at least 2 (`permitq semaphore set \
             b 2 --parent pool --guarantee 2`), or a smaller guarantee (`--guarantee 1`)",
        ),
        // A near name is offered first (creating the typo would make a second pool).
        (
            &["semaphore", "set", "b", "3", "--parent", "pol"],
            "parent pol does not exist: did you mean pool? (or create pol first",
        ),
    ] {
        let o = run(url, args).await;
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(why), "{args:?}: {}", stderr(&o));
    }
    // The other children guarantee the whole pool: no guarantee but 0 fits ("or less" would
    // offer nothing), and making room is said as the other way out.
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "c",
            "2",
            "--parent",
            "pool",
            "--guarantee",
            "2",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "b",
            "1",
            "--parent",
            "pool",
            "--guarantee",
            "3",
        ],
    )
    .await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "guarantee 3 is more than the capacity 1, and more than pool leaves it (its other \
             children guarantee 4 of 4): none left for b: give this command `--guarantee 0` (b \
             then only borrows what is free), or make room first: raise pool (`permitq \
             semaphore set pool 7`) or lower what its other children guarantee, then give b a \
             capacity of at least 3"
        ),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["semaphore", "list", "--json"]).await;
    assert!(!stdout(&o).contains("\"b\""), "{}", stdout(&o));
    // --no-parent takes it out again (its guarantee with it).
    let o = run(
        url,
        &["semaphore", "set", "a", "3", "--no-parent", "--json"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let json: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(json["guarantee"], 0, "{json}");
    assert!(json["parent"].is_null(), "{json}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_raise_sets_the_floor_of_later_tokens_and_refuses_a_bad_one() {
    let db = TestDb::new().await;
    let url = &db.url;
    let above = (9_i64 << 48) + 5;
    let o = run(url, &["tokens", "raise", "--above", &above.to_string()]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains(&format!(
            "tokens issued from now on are above {above}: they start past {} (epoch 10)",
            10_i64 << 48
        )),
        "{}",
        stdout(&o)
    );
    let epoch: i64 = db
        .conn()
        .await
        .query_one("SELECT permitq.token_epoch() >> 48", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(epoch, 10);
    // A floor below them already: where they start says so.
    let o = run(url, &["tokens", "raise", "--above", "5"]).await;
    let said = stdout(&o);
    let start: i64 = said
        .split("they start past ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{said}"));
    assert!(start >= 10_i64 << 48, "{said}");
    let o = run(url, &["tokens", "raise", "--above=-1"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("invalid above"), "{}", stderr(&o));
}

/// A permit with two `=`: a name that has one, or two permits run together; both ways out said.
#[test]
fn a_permit_with_two_equals_signs_says_how_to_write_either_meaning() {
    let o = permitq(
        Some("postgres://ignored@127.0.0.1/x"),
        &["submit", "j", "a=b=1"],
    );
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "\"a=b=1\" has more than one '=': a semaphore named \"a=b\" is given as `--permit \
             'a=b' 1`; several permits go apart, each NAME=COUNT (`gpu=1 disk=2`)"
        ),
        "{}",
        stderr(&o)
    );
}

/// An adaptive semaphore from the command line: made, shown, moved by a holder's report, the
/// change audited with what moved it; bounds without --adaptive refused; fixed again.
/// A holder reports beside a heartbeat (`heartbeat --outcome`), and is told where the report
/// went; --latency alone is a usage error, and a semaphore that does not adapt keeps none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_reports_how_the_use_went_so_far() {
    let db = TestDb::new().await;
    let url = &db.url;
    let mut config = quiet_config("w");
    // No cadence during the test: the report stays to be read.
    config.maintenance.adaptive_cadence = Duration::from_secs(3600);
    let worker = db.worker(config);
    run(
        url,
        &[
            "semaphore",
            "set",
            "api",
            "4",
            "--adaptive",
            "aimd",
            "--floor",
            "1",
            "--ceiling",
            "8",
        ],
    )
    .await;
    let o = run(
        url,
        &["submit", "h1", "api=1", "--ttl", "1m", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(
        url,
        &[
            "heartbeat",
            "h1",
            "--outcome",
            "overloaded",
            "--latency",
            "900ms",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with("expires_at=")
            && stderr(&o).contains(
                "permitq: reported overloaded to api: the next cadence counts it (its latency is \
                 not used: aimd reads only how many reports say ok, overloaded or failed"
            ),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
    let outcome: String = db
        .conn()
        .await
        .query_one(
            "SELECT o.outcome FROM permitq.outcome_report o
             JOIN permitq.permit_request r ON r.id = o.request_id WHERE r.external_id = 'h1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(outcome, "overloaded");
    let o = run(url, &["heartbeat", "h1", "--latency", "1s"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "it goes with a report of how the use went: give --outcome ok --latency 1s (with a \
             heartbeat or the release: a report goes with one of them)"
        ),
        "{}",
        stderr(&o)
    );
    run(url, &["semaphore", "set", "plain", "1"]).await;
    run(
        url,
        &["submit", "p1", "plain=1", "--ttl", "1m", "--await", "10s"],
    )
    .await;
    let o = run(url, &["heartbeat", "p1", "--outcome", "ok"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: no report kept: none of its semaphores (plain) is adaptive"),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_semaphore_is_set_shown_and_moved_by_reports() {
    let db = TestDb::new().await;
    let url = &db.url;
    let mut config = quiet_config("w");
    config.maintenance.adaptive_cadence = Duration::from_millis(200);
    let worker = db.worker(config);
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "api",
            "10",
            "--adaptive",
            "aimd",
            "--floor",
            "2",
            "--ceiling",
            "20",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "api capacity=10 used=0 fair adaptive=aimd floor=2 ceiling=20\n"
    );
    assert!(
        stderr(&o).contains(
            "permitq: api is adaptive (aimd): the workers set its capacity between 2 and 20 from \
             what its holders report (`permitq release ID --outcome ok|overloaded|failed \
             [--latency 30ms]`)"
        ),
        "{}",
        stderr(&o)
    );
    // The list's JSON says how it adapts.
    let list = json(&run(url, &["semaphore", "list", "--json"]).await);
    let api = list
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "api")
        .cloned()
        .unwrap_or_else(|| panic!("no api in {list}"));
    assert!(
        api["adaptive"]["algorithm"] == "aimd" && api["adaptive"]["ceiling"] == 20,
        "{api}"
    );
    // Made and made adaptive in one command: one change, one audit row.
    let history = stdout(&run(url, &["semaphore", "history", "api"]).await);
    assert!(
        history.lines().count() == 1 && history.contains("(made adaptive: aimd, 2 to 20)"),
        "{history}"
    );
    let o = run(url, &["semaphore", "set", "api", "10", "--floor", "2"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--adaptive"), "{}", stderr(&o));
    // "off" is not an algorithm: the answer names the flag that turns it off.
    let o = run(url, &["semaphore", "set", "api", "10", "--adaptive", "off"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "to make a semaphore fixed again, `permitq semaphore set NAME \
                             CAPACITY --no-adaptive`"
        ),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "a1", "api=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(
        url,
        &[
            "release",
            "a1",
            "--outcome",
            "overloaded",
            "--latency",
            "900ms",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: reported overloaded to api: the next cadence counts it"),
        "{}",
        stderr(&o)
    );
    // Again: released before, so this report is not kept, and it says so.
    let o = run(url, &["release", "a1", "--outcome", "ok"]).await;
    assert!(
        stdout(&o).starts_with("already_released")
            && stderr(&o).contains(
                "permitq: no report kept: it was released before, and a report goes only with \
                 the release that gives the permits back"
            ),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
    // On a semaphore that does not adapt, the report is not kept, and it says so.
    run(url, &["semaphore", "set", "plain", "1"]).await;
    run(url, &["submit", "p1", "plain=1", "--await", "10s"]).await;
    let o = run(url, &["release", "p1", "--outcome", "ok"]).await;
    assert!(
        stderr(&o).contains("permitq: no report kept: none of its semaphores (plain) is adaptive"),
        "{}",
        stderr(&o)
    );
    // Refused bounds make nothing: the semaphore is not created half-way.
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "calls3",
            "5",
            "--adaptive",
            "aimd",
            "--floor",
            "10",
            "--ceiling",
            "3",
        ],
    )
    .await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("floor 10 and ceiling 3: need 1 <= floor <= ceiling")
            && !stderr(&o).contains("created calls3"),
        "{}",
        stderr(&o)
    );
    assert_eq!(code(&run(url, &["semaphore", "show", "calls3"]).await), 5);
    // A capacity outside the bounds starts within them, and says so.
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "calls4",
            "50",
            "--adaptive",
            "gradient",
            "--floor",
            "2",
            "--ceiling",
            "20",
        ],
    )
    .await;
    assert!(
        stderr(&o).contains("; it starts at 20, within its bounds (not 50)"),
        "{}",
        stderr(&o)
    );
    // A gradient reads latency: show's report command gives it (aimd's does not).
    let show = stdout(&run(url, &["semaphore", "show", "calls4"]).await);
    assert!(
        show.contains(
            "from what its holders report (`permitq release ID --outcome ok|overloaded|failed \
             --latency 30ms`)"
        ),
        "{show}"
    );
    wait_until(Duration::from_secs(10), "backed off to 9", || async {
        let show = stdout(&run(url, &["semaphore", "show", "api"]).await);
        show.contains("adaptive (aimd): the workers set its capacity between 2 and 20")
            && show
                .contains("capacity 10 -> 9 by adaptive (aimd) (from 0 ok, 1 overloaded, 0 failed")
    })
    .await;
    let show = stdout(&run(url, &["semaphore", "show", "api"]).await);
    assert!(
        show.contains("last reports counted ")
            && show.contains(": 0 ok, 1 overloaded, 0 failed, ")
            && show.contains(" in use: 10 -> 9")
            && show.contains(
                "(aimd: 90% when two reports, or a tenth of the ok and overloaded ones, say \
                 overloaded;"
            ),
        "{show}"
    );
    // A cadence that keeps the capacity (an ok with little in use) writes no audit row: show
    // still says what it counted.
    run(url, &["submit", "a2", "api=1", "--await", "10s"]).await;
    run(url, &["release", "a2", "--outcome", "ok"]).await;
    wait_until(
        Duration::from_secs(10),
        "the kept cadence shown",
        || async {
            let show = stdout(&run(url, &["semaphore", "show", "api"]).await);
            show.contains(": 1 ok, 0 overloaded, 0 failed, ") && show.contains(" in use: kept 9")
        },
    )
    .await;
    // A kept capacity says which rule kept it.
    run(url, &["submit", "a3", "api=1", "--await", "10s"]).await;
    let o = run(
        url,
        &["release", "a3", "--outcome", "failed", "--latency", "5s"],
    )
    .await;
    assert!(
        stderr(&o).contains(
            "(its latency is not used: aimd reads only how many reports say ok, overloaded or \
             failed; `semaphore show` still prints the ok reports' latency)"
        ),
        "{}",
        stderr(&o)
    );
    wait_until(
        Duration::from_secs(10),
        "the failed cadence shown",
        || async {
            let show = stdout(&run(url, &["semaphore", "show", "api"]).await);
            show.contains(": 0 ok, 0 overloaded, 1 failed, ")
                && show
                    .contains(" in use: kept 9: it grows only when more reports say ok than failed")
        },
    )
    .await;
    let o = run(url, &["release", "a1", "--outcome", "great"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("unknown outcome \"great\": ok, overloaded"),
        "{}",
        stderr(&o)
    );
    // A latency without a report says what it goes with (clap's usage line would show
    // --latency as required); nothing is released.
    let o = run(url, &["release", "a1", "--latency", "20ms"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "invalid --latency: it goes with a report of how the use went: give --outcome ok \
             --latency 20ms (with the release that gives the permits back: a report comes only \
             with that one)"
        ) && !stderr(&o).contains("Usage:"),
        "{}",
        stderr(&o)
    );
    // The list says which adapt; the history says when it was made adaptive.
    let list = stdout(&run(url, &["semaphore", "list"]).await);
    assert!(
        list.lines()
            .any(|l| l.starts_with("api ") && l.contains("adaptive (aimd, 2 to 20)")),
        "{list}"
    );
    let history = stdout(&run(url, &["semaphore", "history", "api"]).await);
    assert!(
        history.contains("(made adaptive: aimd, 2 to 20)"),
        "{history}"
    );
    // A capacity set by hand on it is noted; --no-adaptive fixes it.
    let o = run(url, &["semaphore", "set", "api", "12"]).await;
    assert!(
        stderr(&o).contains("permitq: note: api is adaptive (aimd, 2 to 20)"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["semaphore", "set", "api", "12", "--no-adaptive"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: api is fixed at 12: the workers no longer adapt it"),
        "{}",
        stderr(&o)
    );
    let history = stdout(&run(url, &["semaphore", "history", "api"]).await);
    assert!(
        history.contains("(made fixed: no longer adaptive)"),
        "{history}"
    );
    let show = stdout(&run(url, &["semaphore", "show", "api"]).await);
    assert!(!show.contains("adaptive (aimd):"), "{show}");
    worker.stop().await;
}

/// `heartbeat --extend` on a request held until released gives it a lease, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extending_a_request_without_a_lease_says_it_now_has_one() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w"));
    run(url, &["semaphore", "set", "nl", "1"]).await;
    let o = run(url, &["submit", "nl-1", "nl=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["heartbeat", "nl-1", "--extend", "1m"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: note: it had no lease (held until released): it has one now, and is \
             released when it runs out unless a heartbeat extends it"
        ),
        "{}",
        stderr(&o)
    );
    // Extended again: a lease it had, nothing to say.
    let o = run(url, &["heartbeat", "nl-1", "--extend", "2m"]).await;
    assert!(!stderr(&o).contains("note"), "{}", stderr(&o));
    worker.stop().await;
}

/// `semaphore set --fairness-keys` and `submit --fairness-key`: the line shows a newcomer key
/// ahead of another key's backlog, and `semaphore show` each key's share; what cannot be keyed
/// is refused with what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fairness_keys_from_the_command_line() {
    let db = TestDb::new().await;
    let url = &db.url;
    let o = run(url, &["semaphore", "set", "gpu", "1", "--fairness-keys"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o).trim(),
        "gpu capacity=1 used=0 fair fairness_keys"
    );
    // --json says it too, and whether it is adaptive, as `semaphore list --json` does.
    let set = json(
        &run(
            url,
            &[
                "semaphore",
                "set",
                "gpu",
                "1",
                "--adaptive",
                "aimd",
                "--floor",
                "1",
                "--ceiling",
                "4",
                "--json",
            ],
        )
        .await,
    );
    assert_eq!(set["fairness_keys"], true, "{set}");
    assert_eq!(
        set["adaptive"],
        serde_json::json!({"algorithm": "aimd", "floor": 1, "ceiling": 4}),
        "{set}"
    );
    let listed = json(&run(url, &["semaphore", "list", "--json"]).await);
    assert_eq!(listed[0], set, "the same object as the list's");
    let o = run(url, &["semaphore", "set", "gpu", "1", "--no-adaptive"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "hold", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    for i in 1..=5 {
        let id = format!("a-{i}");
        run(url, &["submit", &id, "gpu=1", "--fairness-key", "team-a"]).await;
    }
    let o = run(
        url,
        &[
            "submit",
            "b-1",
            "gpu=1",
            "--fairness-key",
            "team-b",
            "--fairness-weight",
            "2",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!stderr(&o).contains("not keyed"), "{}", stderr(&o));
    // A key on a semaphore that is not keyed: accepted, and said to change nothing there.
    let o = run(url, &["semaphore", "set", "plain", "2"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(
        url,
        &["submit", "p-1", "plain=1", "--fairness-key", "team-a"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: note: plain is not keyed, so the fairness key team-a changes nothing there \
             (`permitq semaphore set plain 2 --fairness-keys` serves a line by key)"
        ),
        "{}",
        stderr(&o)
    );
    wait_until(Duration::from_secs(15), "b-1 second in line", || async {
        let show = stdout(&run(url, &["semaphore", "show", "gpu"]).await);
        show.lines().any(|l| l.trim_start().starts_with("2 b-1"))
    })
    .await;
    let show = stdout(&run(url, &["semaphore", "show", "gpu"]).await);
    assert!(
        show.contains("served by fairness key")
            && show.contains("team-a                   weight 1    waiting 5 (5 permits), holds 0, 33.3% of the turns to come")
            && show.contains("team-b                   weight 2    waiting 1 (1 permit), holds 0, 66.7% of the turns to come")
            && show.contains("(no key)                 weight 1    waiting 0 (0 permits), holds 1"),
        "{show}"
    );
    // Each waiter's key, in the line.
    assert!(
        show.lines()
            .any(|l| l.trim_end().ends_with("waiting  fairness key"))
            && show
                .lines()
                .any(|l| l.contains(" a-2 ") && l.trim_end().ends_with(" team-a"))
            && show
                .lines()
                .any(|l| l.contains(" b-1 ") && l.trim_end().ends_with(" team-b")),
        "{show}"
    );
    let status = json(&run(url, &["status", "b-1", "--json"]).await);
    assert_eq!(status["fairness_key"], "team-b");
    assert_eq!(status["fairness_weight"], 2);
    // The list's JSON says which semaphores are served by key (and adaptive: none here).
    let list = json(&run(url, &["semaphore", "list", "--json"]).await);
    let row = |name: &str| {
        list.as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {list}"))
    };
    assert_eq!(row("gpu")["fairness_keys"], true, "{list}");
    assert_eq!(row("plain")["fairness_keys"], false, "{list}");
    assert!(row("gpu")["adaptive"].is_null(), "{list}");
    // No weight given: the default, 1, as it counts.
    let status = json(&run(url, &["status", "a-1", "--json"]).await);
    assert_eq!(status["fairness_weight"], 1, "{status}");
    // Explain says what the key did to the place, on a line of its own; show, how far back each
    // key's next request goes.
    let o = run(url, &["explain", "a-3"]).await;
    assert!(
        stdout(&o).lines().any(|l| l.starts_with(
            "  fairness key team-a, weight 1: placed 20s after its arrival, by its key's turns \
             that the line had not passed when a worker examined it here"
        )) && stdout(&o).lines().any(|l| l.starts_with(
            "  Its key's requests that took their turns before it and still wait here: a-1, a-2 (their turns: 20s);"
        )),
        "{}",
        stdout(&o)
    );
    assert!(
        show.lines().any(|l| l.trim_start().starts_with("team-a")
            && l.contains(
                "; its next request is placed 50.0s after its arrival, later in line (its turns \
                 reach that far past the line's turn, the start of the latest turn granted)"
            )),
        "{show}"
    );
    // A cancel says the turn it took stays taken.
    let o = run(url, &["release", "a-5"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains(
            "it was still waiting: it held nothing and will not be granted; its turn on gpu \
             stays taken for its fairness key team-a until the line passes it"
        ),
        "{}",
        stdout(&o)
    );
    // Keys that differ only in case or spaces are told apart, quoted, with a note.
    run(
        url,
        &["submit", "c-1", "gpu=1", "--fairness-key", "team-a "],
    )
    .await;
    let show = stdout(&run(url, &["semaphore", "show", "gpu"]).await);
    assert!(
        show.contains("  \"team-a \"  ")
            && show.contains(
                "note: team-a and \"team-a \" are different keys (keys are compared exactly, \
                 case and spaces included)"
            ),
        "{show}"
    );
    // A priority's net effect is said: 50s of turns back, 3 steps (30s) earlier.
    run(
        url,
        &[
            "submit",
            "p-3",
            "gpu=1",
            "--fairness-key",
            "team-a",
            "--priority",
            "3",
        ],
    )
    .await;
    wait_until(Duration::from_secs(15), "p-3 placed", || async {
        stdout(&run(url, &["explain", "p-3"]).await).contains(
            "placed 50s after its arrival, by its key's turns that the line had not passed",
        )
    })
    .await;
    let o = run(url, &["explain", "p-3"]).await;
    assert!(
        stdout(&o).contains(
            "\n  With its priority 3 (3 turns, 30s, earlier) it stands 20s after its arrival.\n"
        ),
        "{}",
        stdout(&o)
    );
    // What cannot be keyed, refused with what to do; nothing changed.
    for (args, said) in [
        (
            &["submit", "w-1", "gpu=1", "--fairness-key", ""][..],
            "invalid fairness_key: must be 1 to 64 characters, got 0",
        ),
        (
            &["submit", "w-2", "gpu=1", "--fairness-weight", "3"],
            "invalid fairness_weight: --fairness-weight 3 weighs the turns of a fairness key, \
             and no key was given: add the tenant's key (`--fairness-key TENANT \
             --fairness-weight 3`)",
        ),
    ] {
        let o = run(url, args).await;
        assert_ne!(code(&o), 0, "{args:?}");
        assert!(stderr(&o).contains(said), "{args:?}: {}", stderr(&o));
    }
    for id in ["w-1", "w-2"] {
        assert_eq!(
            code(&run(url, &["status", id]).await),
            5,
            "{id} was written"
        );
    }
    // A template is keyed for all its instances, and says so; a new template suggests no
    // similar name (it is meant to match others).
    let o = run(url, &["semaphore", "set", "lab:*", "2", "--fairness-keys"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!stderr(&o).contains("did you mean"), "{}", stderr(&o));
    let list = stdout(&run(url, &["semaphore", "list"]).await);
    assert!(
        list.lines()
            .any(|l| l.starts_with("lab:*") && l.contains("served by fairness key")),
        "{list}"
    );
    // Greedy serves no line: a keyed semaphore is not made greedy unless its keys go in the same
    // command.
    let o = run(url, &["semaphore", "set", "k2", "2", "--fairness-keys"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["semaphore", "set", "k2", "2", "--greedy"]).await;
    assert_ne!(code(&o), 0);
    assert!(
        stderr(&o).contains("invalid greedy semaphore k2: it is served by fairness key")
            && stderr(&o).contains("`permitq semaphore set k2 2 --greedy --no-fairness-keys`"),
        "{}",
        stderr(&o)
    );
    let show = stdout(&run(url, &["semaphore", "show", "k2"]).await);
    assert!(show.contains("served by fairness key"), "{show}");
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "k2",
            "2",
            "--greedy",
            "--no-fairness-keys",
        ],
    )
    .await;
    assert_eq!(
        stdout(&o).trim(),
        "k2 capacity=2 used=0 greedy",
        "{}",
        stderr(&o)
    );
    // Nor through its template: a keyed instance keeps its template fair.
    run(url, &["semaphore", "set", "t:*", "2"]).await;
    let o = run(url, &["submit", "t-1", "t:a=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["semaphore", "set", "t:a", "2", "--fairness-keys"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["semaphore", "set", "t:*", "2", "--greedy"]).await;
    assert_ne!(code(&o), 0);
    assert!(
        stderr(&o)
            .contains("invalid greedy semaphore t:*: its instances t:a are served by fairness key"),
        "{}",
        stderr(&o)
    );
    // Off again: the line is priority and arrival order from here on.
    let o = run(url, &["semaphore", "set", "gpu", "1", "--no-fairness-keys"]).await;
    assert_eq!(
        stdout(&o).trim(),
        "gpu capacity=1 used=1 fair",
        "{}",
        stderr(&o)
    );
    // And says what that changes.
    assert!(
        stderr(&o).contains(
            "permitq: gpu is no longer served by fairness key: new requests line up by priority \
             and arrival again, and its keys' turns are forgotten; requests already waiting keep \
             the places their keys gave them"
        ),
        "{}",
        stderr(&o)
    );
    // Both switches are in its history: on with its creation, off as a change of its own.
    let history = stdout(&run(url, &["semaphore", "history", "gpu"]).await);
    let lines: Vec<&str> = history.lines().collect();
    assert!(
        lines.len() >= 2
            && lines[0].contains("created: capacity 1, fair by ")
            && lines[0].ends_with("(served by fairness key from here on)")
            && lines.iter().any(|l| {
                l.contains("capacity 1 (unchanged) by ")
                && l.ends_with(
                    "(no longer served by fairness key: priority and arrival order from here on)"
                )
            }),
        "{history}"
    );
    worker.stop().await;
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_str(stdout(o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// An instance's guarantee is its template's: a capacity below it says so, and both ways out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_below_its_templates_guarantee_names_the_template() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "pool", "8"]).await;
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "team:*",
            "6",
            "--parent",
            "pool",
            "--guarantee",
            "3",
            "--max-instances",
            "2",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "t-1", "team:a=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["semaphore", "set", "team:a", "2"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "guarantee 3 (its template team:*'s: an instance takes its parent and guarantee from \
             its template) is more than the capacity 2: give it at least 3 (`permitq semaphore \
             set team:a 3`), or lower the template's guarantee for every instance (`permitq \
             semaphore set 'team:*' 6 --guarantee 2`)"
        ),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}
