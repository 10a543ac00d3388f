//! Every answer says what happened and what to do: one test per situation a newcomer met, each
//! asserting the words of the answer (the semaphore, the bound, the role, the command), not only
//! the exit code.

use permitq_test_support as common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{quiet_config, wait_until, TestDb};

use crate::cli::{code, permitq, run, stderr, stdout};

const SOON: Duration = Duration::from_secs(15);

/// Waits until a worker has examined request `id` (the waiters list holds unexamined requests
/// too, and explain says less of them).
async fn examined(client: &permitq::Client, id: &str) {
    wait_until(SOON, &format!("{id} examined"), || async {
        client
            .status(id)
            .await
            .unwrap()
            .is_some_and(|r| r.examined_at.is_some())
    })
    .await;
}

/// The request's `--json` line.
fn json(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_str(stdout(o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_semaphore_is_named_with_the_nearest_existing_names() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("w"));
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    let o = run(url, &["submit", "t2", "GPU=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with(
            "t2 error unknown_semaphore: no semaphore named GPU, and no template matches it; \
             did you mean gpu? (submit again under a new external_id; or, if GPU is a new one, \
             create it first: `permitq semaphore set GPU CAPACITY`)"
        ),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["status", "t2", "--json"]).await;
    assert_eq!(
        json(&o)["error_detail"],
        serde_json::json!({ "semaphore": "GPU", "similar": ["gpu"] })
    );
    // Nothing near: how to create it.
    let o = run(url, &["submit", "t2b", "zzz=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains("create it with `permitq semaphore set zzz CAPACITY`"),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_a_capacity_names_the_waiters_it_no_longer_covers() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "low", "4"]).await;
    // No worker yet: both wait, the first asking more than the capacity about to be set.
    for (id, permit) in [("lw-big", "low=3"), ("lw-small", "low=1")] {
        let o = run(url, &["submit", id, permit]).await;
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let o = run(url, &["semaphore", "set", "low", "2"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: 1 waiting request asks more than the new capacity 2: lw-big (low=3); \
             a worker ends it as error exceeds_capacity (the new capacity in its error_detail) \
             when it comes to it: at once (perhaps already), unless others are ahead of it in \
             line. To keep such \
             requests waiting, raise the capacity again (`permitq semaphore set low 3`)"
        ),
        "{}",
        stderr(&o)
    );
    // Raising it back says nothing of the kind.
    let o = run(url, &["semaphore", "set", "low", "3"]).await;
    assert!(!stderr(&o).contains("waiting request"), "{}", stderr(&o));
    // What it said is what happens.
    run(url, &["semaphore", "set", "low", "2"]).await;
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "lw-big", "low=3", "--await", "10s"]).await;
    // Its owner, who never saw `semaphore set`'s warning, reads that it was lowered, by whom,
    // and that this was after it was submitted.
    assert!(
        stdout(&o).starts_with(
            "lw-big error exceeds_capacity: low=3 but low has capacity 2 (lowered from 3 by "
        ) && stdout(&o).contains(", after this request was submitted): it can never be granted"),
        "{}",
        stdout(&o)
    );
    let detail = json(&run(url, &["status", "lw-big", "--json"]).await)["error_detail"].clone();
    assert_eq!(detail["lowered_from"], 3, "{detail}");
    assert!(detail["lowered_at_ms"].is_i64(), "{detail}");
    let o = run(url, &["submit", "lw-small", "low=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    // With a worker running, which may end it before `semaphore set` could read it after the
    // change: still named (read before).
    run(url, &["semaphore", "set", "low", "4"]).await;
    run(url, &["release", "lw-small"]).await;
    let o = run(url, &["submit", "lw-hold", "low=2", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["submit", "lw-big2", "low=3"]).await;
    let client = db.client().await;
    examined(&client, "lw-big2").await;
    let o = run(url, &["semaphore", "set", "low", "2"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: 1 waiting request asks more than the new capacity 2: lw-big2 (low=3)"
        ),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}

/// On a new greedy semaphore `name` of `capacity` + 1: `NAME-hold` holding `capacity` with a 60s
/// lease and `NAME-wait` asking all of it behind (examined), then three requests of 1 granted
/// and released on the permit left (a rate of 2 permits over their span), the last just now.
async fn a_holder_a_waiter_then_releases(
    url: &str,
    client: &permitq::Client,
    name: &str,
    capacity: i32,
) {
    run(
        url,
        &[
            "semaphore",
            "set",
            name,
            &(capacity + 1).to_string(),
            "--greedy",
        ],
    )
    .await;
    let all = format!("{name}={capacity}");
    let hold = format!("{name}-hold");
    let o = run(
        url,
        &["submit", &hold, &all, "--ttl", "60s", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let wait = format!("{name}-wait");
    run(url, &["submit", &wait, &format!("{name}={}", capacity + 1)]).await;
    examined(client, &wait).await;
    for i in 0..3 {
        let id = format!("{name}-done-{i}");
        let o = run(
            url,
            &["submit", &id, &format!("{name}=1"), "--await", "10s"],
        )
        .await;
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        run(url, &["release", &id]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_estimated_wait_says_what_it_is_made_from() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w"));
    run(url, &["semaphore", "set", "est", "1"]).await;
    // No release here yet: no estimate, and it says why.
    run(url, &["semaphore", "set", "fresh", "1"]).await;
    let o = run(
        url,
        &[
            "submit", "f-hold", "fresh=1", "--ttl", "60s", "--await", "10s",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["submit", "f-wait", "fresh=1"]).await;
    wait_until(
        SOON,
        "explain has no estimate to give, and says so",
        || async {
            stdout(&run(url, &["explain", "f-wait"]).await).contains(
            "  no estimated wait yet: too few releases here recently (two at least) to estimate a \
             rate from (the holders' leases are above)",
        )
        },
    )
    .await;
    // A holder of 50 with a long lease, a request of 51 behind it, then releases of the permit
    // left make a rate (2 permits over the span of 3 releases): 50 more are about 25 spans away,
    // counted from the last release, just now.
    let client = db.client().await;
    a_holder_a_waiter_then_releases(url, &client, "est", 50).await;
    let o = run(url, &["explain", "est-wait"]).await;
    assert!(
        stdout(&o).contains("lease ends in")
            && stdout(&o).contains("(from the rate of recent releases here, the last ")
            && stdout(&o).contains(" ago: about ")
            && stdout(&o).contains(
                " of that gone, not from these holders' leases: a holder may release early, or \
                 heartbeat past its lease's end)"
            )
            // Beside it, what est-hold's 60s lease says.
            // (59.5 s and more are said, rounded, as 1m.)
            && (stdout(&o).contains("  by the holders' leases: enough of them end in 5")
                || stdout(&o).contains("  by the holders' leases: enough of them end in 1m "))
            && stdout(&o).contains(" if none heartbeats (a heartbeat extends one"),
        "{}",
        stdout(&o)
    );
    // No release for three mean gaps between them (at least a second): releases stopped, and
    // the estimate does not grow with the time since (it is gone, and says since when).
    a_holder_a_waiter_then_releases(url, &client, "halt", 1).await;
    wait_until(
        SOON,
        "the estimate is gone, since releases stopped",
        || async {
            let out = stdout(&run(url, &["explain", "halt-wait"]).await);
            out.contains("  no estimated wait: nothing was released here for ")
            && out.contains(
                ", longer than the recent releases took to make as much room (they have stopped, \
                 so their rate says nothing); the holders' leases are above",
            )
            && !out.contains("estimated wait: about")
        },
    )
    .await;
    // Releases 10 s apart: one permit every 10 s, the one missing due 10 s after the last.
    // Counted down from it while due; once due and still none came, no estimate (never "about
    // 1s" beside a holder that holds on), though three mean gaps have not passed.
    a_holder_a_waiter_then_releases(url, &client, "due", 1).await;
    let db = &db;
    let released_ago = |last: u32| async move {
        for i in 0..3u32 {
            db.conn()
                .await
                .execute(
                    "UPDATE permitq.permit_request SET released_at = now() - make_interval(secs => $1) \
                     WHERE external_id = $2",
                    &[&f64::from(last + 20 - 10 * i), &format!("due-done-{i}")],
                )
                .await
                .unwrap();
        }
    };
    // The holder was granted before those releases (else they say nothing of it, below).
    db.conn()
        .await
        .execute(
            "UPDATE permitq.permit_request SET acquired_at = now() - interval '60 seconds' \
             WHERE external_id = 'due-hold'",
            &[],
        )
        .await
        .unwrap();
    released_ago(4).await;
    let out = stdout(&run(url, &["explain", "due-wait"]).await);
    // 10 s from the last release, 4 s ago (and the moments explain takes): about 5.x s, said
    // to a tenth of a second.
    assert!(
        ["about 4.", "about 5.", "about 6.0s"]
            .iter()
            .any(|about| out.contains(&format!("  estimated wait: {about}")))
            && (out.contains("s (from the rate of recent releases here, the last 4.")
                || out.contains("s (from the rate of recent releases here, the last 5.")),
        "{out}"
    );
    released_ago(12).await;
    let out = stdout(&run(url, &["explain", "due-wait"]).await);
    assert!(
        out.contains("  no estimated wait: nothing was released here for 12s, longer than")
            && !out.contains("estimated wait: about"),
        "{out}"
    );
    // Quick releases, then a holder with a long lease: those releases were of other holders,
    // and say nothing of when this one ends.
    run(url, &["semaphore", "set", "newer", "1"]).await;
    for i in 0..3 {
        let id = format!("newer-quick-{i}");
        let o = run(url, &["submit", &id, "newer=1", "--await", "10s"]).await;
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        run(url, &["release", &id]).await;
    }
    let o = run(
        url,
        &[
            "submit",
            "newer-long",
            "newer=1",
            "--ttl",
            "60s",
            "--await",
            "10s",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["submit", "newer-wait", "newer=1"]).await;
    examined(&client, "newer-wait").await;
    let out = stdout(&run(url, &["explain", "newer-wait"]).await);
    // No estimate from those releases. Why, of two true reasons, depends on the clock: its
    // holders came after the last release, or (on a loaded machine, where the explain comes
    // later than the quick releases were apart) the releases have stopped.
    assert!(
        (out.contains(
            "  no estimated wait: its holders were all granted after the last release here ("
        ) && out.contains("so the rate of earlier releases says nothing of when they end")
            || out.contains("longer than the recent releases took to make as much room"))
            && !out.contains("estimated wait: about"),
        "{out}"
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_without_any_permitq_role_is_told_the_role_its_command_needs() {
    let db = TestDb::new().await;
    let user = format!("plain_{}", std::process::id());
    db.conn()
        .await
        .batch_execute(&format!("CREATE ROLE {user} LOGIN PASSWORD 'pw'"))
        .await
        .unwrap();
    let url = common::as_user(&db.url, &user, "pw");
    for (args, role, why) in [
        (&["worker"][..], "permitq_worker", ""),
        (&["submit", "p-1", "gpu=1"][..], "permitq_producer", ""),
        // Listing semaphores reads no request: a producer is enough, and an operator too.
        (
            &["semaphore", "list"][..],
            "permitq_producer",
            " (or permitq_operator, to look without submitting)",
        ),
        (
            &["workers"][..],
            "permitq_producer",
            " (or permitq_operator, to look without submitting)",
        ),
        (
            &["semaphore", "show", "gpu"][..],
            "permitq_operator",
            " to read every request (permitq_producer reads its own alone)",
        ),
        (&["semaphore", "set", "gpu", "2"][..], "permitq_admin", ""),
    ] {
        let o = tokio::time::timeout(SOON, run(&url, args))
            .await
            .expect("it fails at once");
        assert_eq!(code(&o), 1, "{args:?}: {}", stderr(&o));
        assert!(
            stderr(&o).contains(&format!(
                "the login {user} has no permitq role (permission denied for schema permitq): \
                 this command needs {role}{why}; a DBA runs GRANT {role} TO {user}, or use a \
                 login that has it"
            )),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_schema_names_the_database_it_was_looked_for_in() {
    let db = TestDb::empty().await;
    let o = run(&db.url, &["submit", "nm-1", "gpu=1"]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let user = common::user_of(&db.url);
    assert!(
        stderr(&o).contains("the permitq schema is missing or out of date: run `permitq migrate`")
            && stderr(&o).contains(&format!(
                "(looked in database {} at 127.0.0.1:",
                common::db_of(&db.url)
            ))
            && stderr(&o).contains(&format!(
                " as {user}: if permitq was migrated into another database, fix the URL instead)"
            )),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_run_out_with_no_worker_says_it_is_no_longer_held() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "kw", "1"]).await;
    let worker = db.worker(quiet_config("w"));
    let o = run(
        url,
        &["submit", "kw-1", "kw=1", "--ttl", "1s", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // The only worker gone, nothing sweeps it: the row still reads acquired.
    worker.stop().await;
    let client = db.client().await;
    wait_until(SOON, "the lease run out", || async {
        let r = client.status("kw-1").await.unwrap().unwrap();
        r.expires_at
            .is_some_and(|t| t < std::time::SystemTime::now())
    })
    .await;
    let o = run(url, &["status", "kw-1"]).await;
    assert!(stdout(&o).starts_with("kw-1 acquired"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("kw-1's lease ran out at ")
            && stderr(&o).contains(
                "with no heartbeat in time: it is no longer held (a heartbeat says lease lost), \
                 and a worker's next sweep releases it; stop the work it guarded"
            )
            && stderr(&o).contains("permitq: kw-1 is not swept, and nothing is granting"),
        "{}",
        stderr(&o)
    );
    // The holders table says so too.
    let o = run(url, &["semaphore", "show", "kw"]).await;
    assert!(
        stdout(&o).contains("lease") && stdout(&o).contains("ran out "),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["heartbeat", "kw-1"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "stop the work it guarded (its fencing token is refused from now on); submit again \
             under a new external_id to hold it again"
        ),
        "{}",
        stderr(&o)
    );
    // A request cancelled before any grant had no work to stop, and no token.
    run(url, &["submit", "kw-2", "kw=1"]).await;
    run(url, &["release", "kw-2"]).await;
    let o = run(url, &["heartbeat", "kw-2"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: no lease: kw-2 was never granted: error cancelled: released while it was \
             still waiting; submit again under a new external_id to hold it"
        ) && !stderr(&o).contains("stop the work"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_counts_what_is_held_beyond_a_lowered_capacity_in_the_shortfall() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "low-h", "gpu=3", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["semaphore", "set", "gpu", "2"]).await;
    run(url, &["submit", "low-w2", "gpu=2"]).await;
    let client = db.client().await;
    // Examined by the worker (the waiters list holds unexamined requests too).
    examined(&client, "low-w2").await;
    // 3 held against 2: all 3 must go before 2 fit.
    let o = run(url, &["explain", "low-w2"]).await;
    assert!(
        stdout(&o).contains("gpu: needs 2, 0 free of 2, short 3"),
        "{}",
        stdout(&o)
    );
    // Behind it, the one held beyond the capacity is in the head's part: 3 for it (2, and the
    // 1 over), then 1 for this one.
    run(url, &["submit", "low-w3", "gpu=1"]).await;
    examined(&client, "low-w3").await;
    let o = run(url, &["explain", "low-w3"]).await;
    assert!(
        stdout(&o)
            .contains("and 4 more permits must be released (3 for the head first, then 1 for it)"),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_await_that_runs_out_says_how_long_the_request_stays_in_line() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    // No worker: both still wait when the await runs out.
    let o = run(url, &["submit", "nw-1", "gpu=1", "--await", "1s"]).await;
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: nw-1 stays in line with no time limit (`--wait DUR` bounds a request's \
             wait), and is granted when its turn comes, whether anyone waits for it then or not; \
             `permitq release nw-1` cancels it"
        ),
        "{}",
        stderr(&o)
    );
    let o = run(
        url,
        &["submit", "nw-2", "gpu=1", "--wait", "5m", "--await", "1s"],
    )
    .await;
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permitq: nw-2 stays in line until its wait ends at "),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_semaphore_says_it_is_new_and_what_it_is_near() {
    let db = TestDb::new().await;
    let url = &db.url;
    let o = run(url, &["semaphore", "set", "gpu", "4"]).await;
    assert!(
        stderr(&o)
            .trim_end()
            .ends_with("permitq: created gpu, a new semaphore"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["semaphore", "set", "gpu", "5"]).await;
    assert!(
        !stderr(&o).contains("created"),
        "a change, not a creation: {}",
        stderr(&o)
    );
    let o = run(url, &["semaphore", "set", "gpuu", "5"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: created gpuu, a new semaphore: did you mean gpu? (`permitq semaphore \
             delete gpuu` removes this one while nothing uses it)"
        ),
        "{}",
        stderr(&o)
    ); // A template is said to be one.
    let o = run(url, &["semaphore", "set", "lab:*", "2"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: created lab:*, a new template: a semaphore of this capacity is made for \
             each name it matches, on first use"
        ),
        "{}",
        stderr(&o)
    );
    // Made adaptive in the same command: created, though its audit row came after.
    let adaptive = [
        "semaphore",
        "set",
        "calls",
        "8",
        "--adaptive",
        "aimd",
        "--floor",
        "2",
        "--ceiling",
        "10",
    ];
    let o = run(url, &adaptive).await;
    assert!(
        stderr(&o).contains("permitq: created calls, a new semaphore"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &adaptive).await;
    assert!(!stderr(&o).contains("created"), "{}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_of_a_rate_window_with_some_room_says_when_room_for_the_count_opens() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w"));
    run(url, &["semaphore", "set", "rl2", "3", "--per", "10m"]).await;
    let o = run(url, &["submit", "r2-1", "rl2=2", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["release", "r2-1"]).await;
    run(url, &["submit", "r2-2", "rl2=2"]).await;
    let client = db.client().await;
    // Examined by the worker (the waiters list holds unexamined requests too).
    examined(&client, "r2-2").await;
    // Nothing is held: it waits for r2-1's grant to leave the window, about 10 minutes.
    let o = run(url, &["explain", "r2-2"]).await;
    let text = stdout(&o);
    assert!(
        text.contains(
            "rate limit: its window has room for 1 of the 2 it needs (2 / 3 granted per 10m); \
             room for 2 opens in "
        ) && text.contains(", as earlier grants leave the window")
            // About ten minutes (the window's buckets round a grant's time up).
            && (text.contains("estimated wait: about 10m") || text.contains("estimated wait: about 9m 5"))
            && text.contains("(when its rate window opens)")
            && !text.contains("released"),
        "{text}"
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exceeds_capacity_names_the_semaphore_or_parent_and_its_capacity_also_in_explain() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("w"));
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    let o = run(url, &["submit", "t3", "gpu=5", "--await", "10s"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with(
            "t3 error exceeds_capacity: gpu=5 but gpu has capacity 4: it can never be granted"
        ),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["explain", "t3"]).await;
    assert!(
        stdout(&o)
            .starts_with("t3 is not waiting: error exceeds_capacity: gpu=5 but gpu has capacity 4"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["explain", "t3", "--json"]).await;
    assert_eq!(
        json(&o)["error_detail"],
        serde_json::json!({ "semaphore": "gpu", "count": 5, "capacity": 4 })
    );
    // The bound is a parent's.
    run(url, &["semaphore", "set", "pool", "4"]).await;
    run(url, &["semaphore", "set", "team", "6", "--parent", "pool"]).await;
    let o = run(url, &["submit", "t4", "team=5", "--await", "10s"]).await;
    assert!(
        stdout(&o).starts_with(
            "t4 error exceeds_capacity: team=5 takes 5 from its parent pool, which has capacity 4"
        ),
        "{}",
        stdout(&o)
    );
    // An instance's capacity is its template's: the fix names the template.
    run(url, &["semaphore", "set", "tenant:*", "5"]).await;
    let o = run(url, &["submit", "t5", "tenant:acme=6", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains(
            "or raise the capacity (`permitq semaphore set 'tenant:*' 6`); then submit again under \
             a new external_id"
        ),
        "{}",
        stdout(&o)
    );
    // The same id again is the same request: the answer says so, and exits as it ended.
    run(url, &["semaphore", "set", "gpu", "5"]).await;
    let o = run(url, &["submit", "t3", "gpu=5", "--await", "10s"]).await;
    assert_eq!(code(&o), 3, "{}", stdout(&o));
    assert!(
        stderr(&o).contains(
            "permitq: t3 was submitted before and has ended; this is that request: submit under a \
             new external_id for another"
        ),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_instances_names_the_template_and_its_bound_also_in_json() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("w"));
    let url = &db.url;
    let o = run(
        url,
        &["semaphore", "set", "lab-*", "1", "--max-instances", "4"],
    )
    .await;
    assert!(stdout(&o).contains("max_instances=4"), "{}", stdout(&o));
    for i in 1..=4 {
        let id = format!("lab-{i}");
        let o = run(url, &["submit", &id, &format!("{id}=1"), "--await", "10s"]).await;
        assert_eq!(code(&o), 0, "{}", stdout(&o));
    }
    let o = run(url, &["submit", "lab-5", "lab-5=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 3);
    assert!(
        stdout(&o).starts_with(
            "lab-5 error too_many_instances: lab-5 would be a new instance of template lab-*, \
             which has its max_instances of 4 already (`permitq semaphore show 'lab-*'` lists \
             them); each holds permits or has waiters: once one is idle, delete it (`permitq \
             semaphore delete NAME`) or the workers remove an instance idle for \
             --idle-instance-after (1h by default); or raise the bound (`permitq semaphore set \
             'lab-*' 1 --max-instances 5`); then submit again under a new external_id"
        ),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["status", "lab-5", "--json"]).await;
    assert_eq!(
        json(&o)["error_detail"],
        serde_json::json!({ "semaphore": "lab-5", "template": "lab-*", "capacity": 1, "max_instances": 4, "instances": 4 })
    );
    // The bound and how many it has, where the template is shown.
    let o = run(url, &["semaphore", "show", "lab-*"]).await;
    assert!(
        stdout(&o).contains(
            "4 of at most 4 instances (max_instances), which hold 4 and have 0 waiting (the \
             counts above are the template's own: it holds nothing itself)"
        )
            && stdout(&o).contains("instances: lab-1, lab-2, lab-3, lab-4\n")
            // A template holds nothing itself: its capacity is each instance's.
            && stdout(&o).starts_with("lab-*  capacity 1 for each instance, 0 waiting"),
        "{}",
        stdout(&o)
    );
    // An instance that holds nothing is named, and the command it gives frees a place.
    assert_eq!(code(&run(url, &["release", "lab-2"]).await), 0);
    let o = run(url, &["submit", "lab-6", "lab-6=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains(
            "lab-2 holds nothing: delete one (`permitq semaphore delete lab-2`), or let the \
             workers remove an instance idle for --idle-instance-after (1h by default)"
        ),
        "{}",
        stdout(&o)
    );
    assert!(stdout(&run(url, &["status", "lab-6"]).await).contains("lab-2 holds nothing"));
    wait_until(SOON, "lab-2 deleted once its release is folded", || async {
        code(&run(url, &["semaphore", "delete", "lab-2"]).await) == 0
    })
    .await;
    let o = run(url, &["submit", "lab-7", "lab-7=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    // Nested and guaranteed: raising the bound must fit the parent, and the answer says so.
    run(url, &["semaphore", "set", "gpus", "4"]).await;
    run(
        url,
        &[
            "semaphore",
            "set",
            "glab-*",
            "2",
            "--parent",
            "gpus",
            "--guarantee",
            "2",
            "--max-instances",
            "2",
        ],
    )
    .await;
    for i in 1..=2 {
        let id = format!("glab-{i}");
        let o = run(url, &["submit", &id, &format!("{id}=1"), "--await", "10s"]).await;
        assert_eq!(code(&o), 0, "{}", stdout(&o));
    }
    let o = run(url, &["submit", "glab-3", "glab-3=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 3);
    assert!(
        stdout(&o).contains(
            "or raise the bound: each instance is guaranteed 2 of gpus, so gpus needs capacity 6 \
             first (`permitq semaphore set gpus 6`), then `permitq semaphore set 'glab-*' 2 \
             --max-instances 3`; then submit"
        ),
        "{}",
        stdout(&o)
    );
    // Following it past the parent's capacity says what to run next.
    let o = run(
        url,
        &["semaphore", "set", "glab-*", "2", "--max-instances", "3"],
    )
    .await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("or raise gpus (`permitq semaphore set gpus 6`)"),
        "{}",
        stderr(&o)
    );
    // The two commands the answer gave, in its order, are accepted.
    assert_eq!(code(&run(url, &["semaphore", "set", "gpus", "6"]).await), 0);
    let o = run(
        url,
        &["semaphore", "set", "glab-*", "2", "--max-instances", "3"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    worker.stop().await;
}

#[test]
fn a_server_that_is_not_there_is_named_with_its_host_and_port() {
    // A port nobody listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://app@127.0.0.1:{port}/app");
    let o = permitq(Some(&url), &["status", "x"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!("cannot reach PostgreSQL at 127.0.0.1:{port}"))
            && err.contains("is PostgreSQL running, and listening on that host and port?"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // A heartbeat that does not get through says the lease was not extended, and until when.
    let o = permitq(Some(&url), &["heartbeat", "job-1"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the lease was NOT extended: it still ends at the expires_at the last heartbeat that got through printed (`permitq status job-1` once"),
        "{}",
        stderr(&o)
    );
}

/// A URL that asks for TLS is told that permitq connects without it, not "is PostgreSQL up?".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_url_asking_for_tls_is_told_that_permitq_connects_without_it() {
    let db = TestDb::new().await;
    let sep = if db.url.contains('?') { '&' } else { '?' };
    for mode in ["require", "verify-full"] {
        let url = format!("{}{sep}sslmode={mode}", db.url);
        let o = permitq(Some(&url), &["status", "x"]);
        let err = stderr(&o);
        assert!(
            err.contains("permitq connects without TLS (sslmode disable or prefer)")
                && err.contains("take sslmode=require or verify-* out of the URL")
                && !err.contains("is PostgreSQL up"),
            "{mode}: {err}"
        );
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    // A server of another kind than target_session_attrs asks for is not told "is it up?".
    let url = format!("{}{sep}target_session_attrs=read-only", db.url);
    let err = stderr(&permitq(Some(&url), &["status", "x"]));
    assert!(
        err.contains("not the kind the URL's target_session_attrs asks for")
            && !err.contains("is PostgreSQL up"),
        "{err}"
    );
}

/// `top` without a terminal (a pipe, a script) says what to use instead.
#[test]
fn top_without_a_terminal_names_what_to_use_instead() {
    let o = permitq(Some("postgres://app@127.0.0.1:1/app"), &["top"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("`permitq top` draws on an interactive terminal, and this is not one: for a snapshot use `permitq semaphore list`"),
        "{}",
        stderr(&o)
    );
}

/// A password with an unencoded @ ends there: the host then holds the rest and does not
/// resolve. The answer says to percent-encode it.
#[test]
fn a_password_with_an_at_sign_is_told_to_percent_encode_it() {
    let o = permitq(
        Some("postgres://u:p@ss@localhost:5432/app"),
        &["status", "x"],
    );
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("a password (or user name) with an @ in it ends at that @")
            && err.contains("Percent-encode it in the URL (@ as %40"),
        "{err}"
    );
    // With a / in it too, the URL does not even parse: the same advice.
    let o = permitq(
        Some("postgres://prod_at:p@ss:w/rd#1@127.0.0.1:5613/app"),
        &["status", "x"],
    );
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("must be percent-encoded in the URL (@ as %40, : as %3A, / as %2F"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_url_naming_a_host_and_a_socket_directory_names_both_and_which_failed_last() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("postgres://app@127.0.0.1:{port}/app?host=/nonexistent-dir");
    let o = permitq(Some(&url), &["status", "x"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "cannot reach PostgreSQL at any of 127.0.0.1:{port}, /nonexistent-dir/.s.PGSQL.{port} \
             (tried in that order); the last, /nonexistent-dir/.s.PGSQL.{port}: "
        )) && err.contains("names both a host and a socket directory (?host=/dir)"),
        "{err}"
    );
}

#[test]
fn a_password_the_server_asks_for_names_pgpassword_and_the_url_form() {
    let port = common::password_asking_server();
    let url = format!("postgres://me@127.0.0.1:{port}/app");
    let o = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["status", "x"])
        .env("DATABASE_URL", &url)
        .env_remove("PGPASSWORD")
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(code(&o), 1, "{err}");
    assert!(
        err.contains("password missing")
            && err.contains("PGPASSWORD")
            && err.contains("postgres://user:password@host/db"),
        "{err}"
    );
}

#[test]
fn a_malformed_url_shows_the_form_expected() {
    let o = permitq(Some("localhost/app"), &["status", "x"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("invalid database URL")
            && stderr(&o).contains("expected postgres://user[:password]@host[:port]/database"),
        "{}",
        stderr(&o)
    );
    // What in it was wrong is named.
    for (url, named) in [
        (
            "postgres:///app?sslmod=require",
            "(unknown option `sslmod`)",
        ),
        (
            "postgres:///app?port=abc",
            "(invalid value for option `port`)",
        ),
        (
            "mysql://localhost/app",
            "(mysql: is not PostgreSQL's scheme: use postgres://)",
        ),
        (
            "postgress:/foo",
            "(postgress: is not PostgreSQL's scheme: use postgres://)",
        ),
        (
            "postgres:/app",
            "(postgres: is followed by //, as in postgres://host/database)",
        ),
    ] {
        let o = permitq(Some(url), &["status", "x"]);
        assert_eq!(code(&o), 2, "{}", stderr(&o));
        assert!(stderr(&o).contains(named), "{url}: {}", stderr(&o));
    }
}

/// An admin's revoke of a request still waiting is not recorded as its owner's cancel: its
/// history names the login that revoked it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoke_of_a_waiting_request_is_recorded_as_a_revoke() {
    let db = TestDb::new().await;
    let url = &db.url;
    let admin = common::user_of(url);
    run(url, &["semaphore", "set", "rv", "1"]).await;
    // No worker runs: both wait; one is revoked, the other cancelled by its owner.
    for id in ["rv-revoked", "rv-cancelled"] {
        let o = run(url, &["submit", id, "rv=1"]).await;
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let o = run(url, &["revoke", "rv-revoked"]).await;
    assert!(
        stdout(&o).contains("it was still waiting: it held nothing and will not be granted"),
        "{}",
        stdout(&o)
    );
    run(url, &["release", "rv-cancelled"]).await;
    let o = run(url, &["status", "rv-revoked"]).await;
    assert!(
        stdout(&o).contains(&format!(
            "error cancelled: revoked by {admin} (`permitq revoke`) while it was still waiting"
        )),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["status", "rv-revoked", "--json"]).await;
    assert_eq!(
        json(&o)["error_detail"],
        serde_json::json!({ "revoked_by": admin })
    );
    let o = run(url, &["status", "rv-cancelled"]).await;
    assert!(
        stdout(&o).contains("error cancelled: released while it was still waiting"),
        "{}",
        stdout(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permission_error_names_the_role_needed() {
    let db = TestDb::new().await;
    let producer = db.login("permitq_producer").await;
    let user = common::user_of(&producer);
    let o = run(&producer, &["semaphore", "set", "gpu", "4"]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permission denied for function set_capacity")
            && stderr(&o).contains("this needs the role permitq_admin")
            && stderr(&o).contains(&format!("GRANT permitq_admin TO {user}")),
        "{}",
        stderr(&o)
    );
    // A producer revoking its own request is shown the release it may run instead.
    run(&db.url, &["semaphore", "set", "gpu", "4"]).await;
    run(&producer, &["submit", "mine-1", "gpu=1"]).await;
    let o = run(&producer, &["revoke", "mine-1"]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("this needs the role permitq_admin")
            && stderr(&o).contains("`permitq release ID` (or release()) needs no admin"),
        "{}",
        stderr(&o)
    );
    let o = run(&producer, &["release", "mine-1"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // An operator or worker login submitting is told the producer's role, not its own.
    let mut operator = String::new();
    for role in ["permitq_operator", "permitq_worker"] {
        let login = db.login(role).await;
        if role == "permitq_operator" {
            operator.clone_from(&login);
        }
        let user = common::user_of(&login);
        let o = run(&login, &["submit", "op-1", "gpu=1"]).await;
        assert_eq!(code(&o), 1, "{}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.contains("permission denied for function submit")
                && err.contains("this needs the role permitq_producer (or permitq_admin)")
                && err.contains(&format!("GRANT permitq_producer TO {user}"))
                && !err.contains(&format!("{role} (")),
            "{role}: {err}"
        );
    }
    // An operator releasing another login's request: told that a producer acts on its own
    // requests alone, not only to take the producer's role.
    run(&producer, &["submit", "theirs-1", "gpu=1"]).await;
    let o = run(&operator, &["release", "theirs-1"]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("permission denied for function release")
            && stderr(&o).contains(
                "a producer acts on its own requests alone: another login's request is released \
                 by that login, or revoked by permitq_admin (`permitq revoke ID`)"
            ),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_a_producer_may_not_read_is_not_found_among_its_own() {
    let db = TestDb::new().await;
    run(&db.url, &["semaphore", "set", "gpu", "4"]).await;
    run(&db.url, &["submit", "theirs", "gpu=1"]).await;
    let producer = db.login("permitq_producer").await;
    for verb in ["status", "explain"] {
        let o = run(&producer, &[verb, "theirs"]).await;
        assert_eq!(code(&o), 5, "{}", stderr(&o));
        assert_eq!(
            stderr(&o).trim(),
            "permitq: no request named \"theirs\" among this login's own: this login submitted \
             none under that external_id, or retention removed it (a producer login sees only \
             the requests it submitted; one that another login submitted is that login's, and \
             `permitq release` refuses it as another role's; an operator login sees all)"
        );
    }
    // Nor is another login's id suggested for a typo of it (the admin login, which reads it,
    // is offered it).
    let o = run(&producer, &["status", "thiers"]).await;
    assert!(!stderr(&o).contains("did you mean"), "{}", stderr(&o));
    let o = run(&db.url, &["status", "thiers"]).await;
    assert!(
        stderr(&o).contains("did you mean theirs?"),
        "{}",
        stderr(&o)
    );
    // An admin submitting an id a producer used, with the same parameters, gets the producer's
    // request back: said whose it is, not "holds its grant ... release it".
    run(&producer, &["submit", "prod-1", "gpu=1"]).await;
    let o = run(&db.url, &["submit", "prod-1", "gpu=1"]).await;
    let user = common::user_of(&producer);
    assert!(
        stderr(&o).contains(&format!(
            "permitq: prod-1 was submitted by {user}, another login, with these same parameters: \
             this is {user}'s request"
        )) && !stderr(&o).contains("release it with"),
        "{}",
        stderr(&o)
    );
    // An id a shell would split is offered quoted, as it is typed.
    run(&db.url, &["submit", "it's mine", "gpu=1"]).await;
    let o = run(&db.url, &["status", "it's mien"]).await;
    assert!(
        stderr(&o).contains("did you mean 'it'\\''s mine'?"),
        "{}",
        stderr(&o)
    );
    // What release says of it agrees: it is another role's.
    let o = run(&producer, &["release", "theirs"]).await;
    assert!(
        stderr(&o).contains("request theirs belongs to another role"),
        "{}",
        stderr(&o)
    );
    let o = run(&db.url, &["status", "theirs"]).await;
    assert_eq!(code(&o), 0, "the admin login reads it: {}", stderr(&o));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_run_as_a_login_that_may_not_work_says_so_once_and_exits() {
    let db = TestDb::new().await;
    let producer = db.login("permitq_producer").await;
    let user = common::user_of(&producer);
    let o = tokio::time::timeout(SOON, run(&producer, &["worker"]))
        .await
        .expect("the worker stops by itself");
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!(
            "the login {user} is not a permitq worker: a worker needs the role permitq_worker \
             (GRANT permitq_worker TO {user}, run by a superuser, a CREATEROLE login"
        )) && !stderr(&o).contains("worker started"),
        "{}",
        stderr(&o)
    );
    // An admin login may do much, but not a worker's part: told so at start, too.
    let admin = db.login("permitq_admin").await;
    let o = tokio::time::timeout(SOON, run(&admin, &["worker"]))
        .await
        .expect("the worker stops by itself");
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("is not a permitq worker: a worker needs the role permitq_worker"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resubmit_with_other_parameters_shows_what_the_existing_request_asked() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    run(url, &["submit", "dup", "gpu=1", "--ttl", "5m"]).await;
    let o = run(url, &["submit", "dup", "gpu=2"]).await;
    assert!(
        stderr(&o).contains("already exists with different parameters (permits, ttl differ)"),
        "{}",
        stderr(&o)
    );
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("already exists with different parameters")
            && err.contains(r#"the existing request asked permits {"gpu": 1}"#)
            && err.contains(
                r#"ttl 5m, wait none (waits until granted), priority 0; this submit asked permits {"gpu": 2}, ttl "#
            )
            && err.contains("; its state now: new")
            && err.contains("a new request needs a new external_id"),
        "{err}"
    );
    // Ended: its state says how.
    run(url, &["release", "dup"]).await;
    let o = run(url, &["submit", "dup", "gpu=2"]).await;
    assert!(
        stderr(&o).contains("its state now: error cancelled"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_on_a_waiting_request_says_it_is_still_waiting() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    run(url, &["submit", "wait-1", "gpu=1"]).await;
    let o = run(url, &["heartbeat", "wait-1"]).await;
    // 4, as `submit --await` still waiting: a script tells "not granted yet" from "lost" (3).
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no lease yet: request wait-1 is still waiting to be granted")
            && stderr(&o).contains(
                "heartbeat once it is acquired; `permitq status wait-1` (or a client's status) \
                 shows when it is, and an acquire or `permitq submit --await` waits for it"
            )
            && !stderr(&o).contains("(permitq"),
        "{}",
        stderr(&o)
    );
    // Cancelled, it never had a lease; released, it says by whom, in words.
    run(url, &["release", "wait-1"]).await;
    let o = run(url, &["heartbeat", "wait-1"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    // (Said once: the database's line said the outcome again.)
    assert!(
        stderr(&o).contains(
            "permitq: no lease: wait-1 was never granted: error cancelled: released while it was \
             still waiting; submit again under a new external_id to hold it"
        ) && stderr(&o).lines().count() == 1,
        "{}",
        stderr(&o)
    );
    // Released again: said as the repeat it is.
    let o = run(url, &["release", "wait-1"]).await;
    assert!(
        stdout(&o).starts_with("not_acquired: it was already cancelled ")
            && stdout(&o).contains(
                " ago, while it was still waiting: it never held anything, and nothing more is \
                 to be done"
            ),
        "{}",
        stdout(&o)
    );
    let _worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "held-1", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["release", "held-1"]).await;
    let o = run(url, &["heartbeat", "held-1"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    // Given back by its holder: nothing was lost, and nothing says to stop the work.
    assert!(
        stderr(&o).contains("permitq: nothing to extend: held-1 was released by its holder ")
            && stderr(&o).contains(
                "ago, and it never had a lease (no ttl) (a heartbeat is for a holder that still \
             holds); submit again under a new external_id to hold it again"
            )
            && !stderr(&o).contains("lease lost")
            && !stderr(&o).contains("stop"),
        "{}",
        stderr(&o)
    );
    // Held until released: no lease to extend, and none is made.
    let o = run(url, &["submit", "untimed", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["heartbeat", "untimed"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("held until released (it has no ttl): no lease to extend"),
        "{}",
        stdout(&o)
    );
    let status = json(&run(url, &["status", "untimed", "--json"]).await);
    assert!(status["expires_at"].is_null(), "{status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_await_says_that_no_worker_is_running() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "nw", "4"]).await;
    let o = run(url, &["submit", "nw-1", "nw=1", "--await", "1s"]).await;
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    assert_eq!(stdout(&o).trim(), "nw-1 new");
    assert!(
        stderr(&o).contains(
            "nw-1 is queued, but nothing is granting: no worker seen in the last hour; start one \
             with `permitq worker`"
        ),
        "{}",
        stderr(&o)
    );
    // Said first, before the wait: the first line.
    assert!(
        stderr(&o).starts_with("permitq: nw-1 is queued, but nothing is granting: ")
            && stderr(&o)
                .lines()
                .next()
                .unwrap()
                .ends_with("; waiting up to 1s anyway"),
        "{}",
        stderr(&o)
    );
    // Said once: the end of the wait refers to it.
    assert_eq!(
        stderr(&o).matches("no worker seen").count(),
        1,
        "{}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains("permitq: nw-1 still waits: nothing is granting (as said above)"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["status", "nw-1"]).await;
    assert_eq!(stdout(&o).trim(), "nw-1 new");
    assert!(
        stderr(&o).starts_with("permitq: nw-1 waits, and nothing is granting: "),
        "{}",
        stderr(&o)
    );
    // A name no semaphore or template has is said at the submit, while it can be fixed, with
    // the nearest names; an instance of a template is not.
    run(url, &["semaphore", "set", "lab:*", "1"]).await;
    let o = run(url, &["submit", "nw-typo", "NW=1", "lab:a=1"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: nw-typo is queued, but no semaphore or template is named NW; did you mean \
             nw? A worker fails the request with unknown_semaphore: submit again naming it, under \
             a new external_id (or create NW with `permitq semaphore set NW CAPACITY` before a \
             worker examines it)"
        ) && !stderr(&o).contains("named lab:a"),
        "{}",
        stderr(&o)
    );
    // What a worker will fail at once is said at the submit too: a template named itself, a
    // count beyond a capacity, a parent's or a template's (an instance not made yet).
    run(url, &["semaphore", "set", "pool", "3"]).await;
    run(url, &["semaphore", "set", "kid", "3", "--parent", "pool"]).await;
    let o = run(url, &["submit", "nw-tpl", "lab:*=1"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: nw-tpl is queued, but lab:* is a template, which is never granted itself: a \
             worker fails the request with unknown_semaphore; submit again naming an instance of \
             it (lab:NAME, made at its first grant), under a new external_id"
        ),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "nw-big", "pool=5"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: nw-big is queued, but pool has capacity 3, less than the 5 it asks there: \
             a worker fails the request with exceeds_capacity; ask for at most 3 under a new \
             external_id, or raise the capacity first (`permitq semaphore set pool 5`), before a \
             worker examines it"
        ),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "nw-kid", "kid=2", "pool=2"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: nw-kid is queued, but kid's parent pool has capacity 3, \
                             less than the 4 it takes there"
        ),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "nw-inst", "lab:new=2"]).await;
    assert!(
        stderr(&o).contains("but lab:new has capacity 1, less than the 2 it asks there")
            && stderr(&o).contains("(`permitq semaphore set 'lab:*' 2`)"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "nw-fits", "kid=1", "pool=1"]).await;
    assert!(
        !stderr(&o).contains("a worker fails the request"),
        "{}",
        stderr(&o)
    );
    // A template is offered as the instance name it makes, not as itself (never granted).
    let o = run(url, &["submit", "nw-lab", "lab=1"]).await;
    assert!(
        stderr(&o).contains(
            "did you mean lab:NAME (an instance of the template lab:*)? A worker fails the request"
        ),
        "{}",
        stderr(&o)
    );
    let text = stdout(&run(url, &["explain", "nw-typo"]).await);
    assert!(
        text.contains("lab:a: needs 1, not there")
            && text.contains("not made yet: a worker makes it from template lab:* at the grant"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn once_the_last_worker_stops_explain_and_semaphore_show_say_nothing_is_granting() {
    let db = TestDb::new().await;
    let url = &db.url;
    let first_out = db.worker(quiet_config("first-out"));
    let worker = db.worker(quiet_config("only-worker"));
    run(url, &["semaphore", "set", "nw", "1"]).await;
    let o = run(
        url,
        &["submit", "held", "nw=1", "--ttl", "5m", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["submit", "nw-2", "nw=1"]).await;
    // Two running: each counted once.
    wait_until(SOON, "both workers counted", || async {
        json(&run(url, &["semaphore", "show", "nw", "--json"]).await)["granting"]["live_workers"]
            == 2
    })
    .await;
    // One stopped: only the running one is counted and listed.
    first_out.stop().await;
    wait_until(
        SOON,
        "semaphore show lists the running worker alone",
        || async {
            let text = stdout(&run(url, &["semaphore", "show", "nw"]).await);
            // Its host, version and when it was last seen.
            text.contains(&format!(
                "workers (1): only-worker on {} ({}, seen ",
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .unwrap()
                    .trim(),
                env!("CARGO_PKG_VERSION")
            )) && text.contains(" ago)")
                && !text.contains("first-out")
        },
    )
    .await;
    // `permitq workers` lists them: the running one, and the one gone.
    let o = run(url, &["workers"]).await;
    assert_eq!(code(&o), 0, "a worker runs: {}", stdout(&o));
    let text = stdout(&o);
    assert!(
        text.starts_with("workers (1): only-worker on ")
            && text.contains("  not running: first-out on ")
            && text.contains(", stopped cleanly "),
        "{text}"
    );
    // One that died (its row lived on to its end, 8 s past its last sign of life) is told apart.
    db.conn()
        .await
        .batch_execute(
            "INSERT INTO permitq.worker_seen (worker_id, host, version, pid, started_at, seen_at, \
             live_until) VALUES ('ghost', 'gone-host', '0.0.1', 1, now() - interval '1 minute', \
             now() - interval '30 seconds', now() - interval '22 seconds')",
        )
        .await
        .unwrap();
    let text = stdout(&run(url, &["workers"]).await);
    assert!(
        text.contains("  not running: ghost on gone-host (0.0.1, last seen ")
            && text.contains(
                " ago, without stopping cleanly: killed, or cut off from the database (its log \
                 says which))"
            ),
        "{text}"
    );
    let show = json(&run(url, &["semaphore", "show", "nw", "--json"]).await);
    assert_eq!(show["granting"]["live_workers"], 1, "{show}");
    let o = run(url, &["explain", "nw-2"]).await;
    assert!(
        !stdout(&o).contains("nothing is granting"),
        "{}",
        stdout(&o)
    );
    worker.stop().await;

    // Each answer names the database it looked in: a worker started on another is not seen.
    let elsewhere = format!("or it works on another database than {}", db.name);
    for args in [
        &["explain", "nw-2"][..],
        &["semaphore", "show", "nw"],
        &["workers"],
    ] {
        let o = run(url, args).await;
        // `workers` is a script's check: it fails while nothing grants.
        if args == ["workers"] {
            assert_eq!(code(&o), 1, "{}", stdout(&o));
        }
        assert!(
            stdout(&o).contains("nothing is granting: no worker seen for ")
                && stdout(&o).contains("start one with `permitq worker`")
                && stdout(&o).contains(&elsewhere),
            "{args:?}: {}",
            stdout(&o)
        );
    }
    // The holder's lease runs out unswept (shortened now that no worker sweeps): explain says
    // so as the holders table does, and gives no estimate while nothing grants.
    assert_eq!(
        code(&run(url, &["heartbeat", "held", "--extend", "1s"]).await),
        0
    );
    wait_until(SOON, "explain says the holder's lease ran out", || async {
        let text = stdout(&run(url, &["explain", "nw-2"]).await);
        text.contains("held by held (1 for ") && text.contains("lease ran out ")
    })
    .await;
    let text = stdout(&run(url, &["explain", "nw-2"]).await);
    assert!(
        text.contains("  no estimated wait: nothing grants it until a worker runs")
            && !text.contains("estimated wait: about")
            && !text.contains("lease ends"),
        "{text}"
    );
    assert!(stdout(&run(url, &["semaphore", "show", "nw"]).await).contains("ran out "));
    // A request submitted now: no worker will examine it, and explain does not say one will.
    run(url, &["submit", "nw-3", "nw=1"]).await;
    let text = stdout(&run(url, &["explain", "nw-3"]).await);
    assert!(
        text.contains("not examined by a worker yet, and no worker runs to examine it: start one")
            && !text.contains("a running worker does"),
        "{text}"
    );
    // One whose wait runs out: still `new` (no worker ends it), and explain says a worker
    // ends it once one runs, not at a pass, its reason before that in closed parentheses.
    run(url, &["submit", "nw-4", "nw=1", "--wait", "1s"]).await;
    wait_until(SOON, "explain says nw-4's wait ran out", || async {
        stdout(&run(url, &["explain", "nw-4"]).await).contains("its wait ran out ")
    })
    .await;
    let text = stdout(&run(url, &["explain", "nw-4"]).await);
    assert!(
        text.contains(
            " ago: a worker ends it as timeout once one runs, not granted (before that: not \
             examined by a worker yet, and no worker runs to examine it: start one (`permitq \
             worker`))\n"
        ) && !text.contains("next worker pass"),
        "{text}"
    );
    let o = run(url, &["status", "nw-4"]).await;
    assert!(stdout(&o).starts_with("nw-4 new"), "{}", stdout(&o));
    let o = run(url, &["semaphore", "show", "nw", "--json"]).await;
    let show = json(&o);
    assert_eq!(show["granting"]["live_workers"], 0, "{show}");
    let workers = show["workers"].as_array().expect("workers").clone();
    assert!(
        workers.iter().any(|w| w["worker_id"] == "only-worker")
            && workers.iter().all(|w| w["live"] == false),
        "{show}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_login_the_server_does_not_know_is_told_about_the_role_and_pg_hba() {
    let db = TestDb::new().await;
    let (scheme, rest) = db.url.split_once("://").unwrap();
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    let url = format!("{scheme}://no_such_role_here@{host}");
    let o = run(&url, &["semaphore", "list"]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("pg_hba.conf does not let this user in from here, or no such role"),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durations_read_as_semaphore_show_writes_them() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    for (interval, text) in [("59.9s", "59.9s"), ("60s", "1m"), ("10s", "10s")] {
        let got: String = conn
            .query_one(&format!("SELECT permitq.human_duration('{interval}')"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(got, text, "{interval}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_example_on_a_database_without_the_schema_says_to_migrate() {
    let db = TestDb::empty().await;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let url = db.url.clone();
    let o = tokio::task::spawn_blocking(move || {
        Command::new(crate::examples::python_with_psycopg())
            .arg(root.join("examples/python/permitq_example.py"))
            .env("DATABASE_URL", &url)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!(
            "the permitq schema is missing or older than this client in database {} at ",
            common::db_of(&db.url)
        )) && stderr(&o).contains(
            ": run `permitq migrate` there; or, if permitq was migrated into another database, \
             fix the URL"
        ),
        "{}",
        stderr(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_writes_a_rate_window_as_semaphore_show_does() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("w"));
    let url = &db.url;
    run(url, &["semaphore", "set", "api", "1", "--per", "50s"]).await;
    let o = run(url, &["submit", "a1", "api=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["submit", "a2", "api=1"]).await;
    wait_until(SOON, "explain says the window is spent", || async {
        stdout(&run(url, &["explain", "a2"]).await).contains("window is spent")
    })
    .await;
    let o = run(url, &["explain", "a2"]).await;
    let text = stdout(&o);
    assert!(
        text.contains("rate limit: its window is spent (1 / 1 granted per 50s); opens in ")
            && !text.contains("00:00:50")
            && !text.contains("+00"),
        "{text}"
    );
    // `opens in 8.9s`: seconds, one decimal, within the window: a grant counts for `per` from the
    // end of its bucket, at most per / 64 after the grant (functions/rate_windows.sql).
    let opens: f64 = text
        .split("opens in ")
        .nth(1)
        .and_then(|rest| rest.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!((0.0..=50.0 + 50.0 / 64.0 + 0.05).contains(&opens), "{text}");
    // What is left is grants in the window, and the estimate is when it opens.
    assert!(
        text.contains("api: needs 1, 0 of 1 grants left in its rate window, short 1")
            && text.contains("(when its rate window opens)")
            && !text.contains("held by a1"),
        "{text}"
    );
    // A request that fails fast there says so, and how to queue.
    let o = run(
        url,
        &["submit", "a3", "api=1", "--wait", "0s", "--await", "10s"],
    )
    .await;
    assert_eq!(code(&o), 3, "{}", stdout(&o));
    assert!(
        stdout(&o)
            .contains("a3 error no_capacity: api=1, 0 of 1 grants left in its 50s rate window")
            && stdout(&o).contains("submit again, under a new external_id, with a longer --wait"),
        "{}",
        stdout(&o)
    );
    // Not examined yet (the worker's batch waits here for the semaphore's row, held by this
    // transaction): the estimate is the window's, and it says so.
    let mut conn = db.conn().await;
    let tx = conn.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM permitq.semaphore WHERE name = 'api' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    run(url, &["submit", "a4", "api=1"]).await;
    let text = stdout(&run(url, &["explain", "a4"]).await);
    assert!(
        text.contains("api: needs 1, 0 of 1 grants left in its rate window, short 1")
            && text.contains("rate limit: its window has room for 0 of the 1 it needs")
            && text.contains("(not examined by a worker yet: ")
            && text.contains("(when its rate window opens)")
            && !text.contains("rate of recent releases"),
        "{text}"
    );
    tx.rollback().await.unwrap();
    worker.stop().await;
}

/// Awaiting a running worker's outcome, a name no semaphore has is said once, by the outcome a
/// moment later, not also as a warning that it is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_awaited_typo_with_a_worker_running_is_said_once() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "1"]).await;
    let worker = db.worker(quiet_config("w"));
    wait_until(SOON, "the worker is seen", || async {
        let o = run(url, &["workers"]).await;
        !stdout(&o).contains("nothing is granting")
    })
    .await;
    let o = run(url, &["submit", "typo-1", "gppu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 3, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("typo-1 error unknown_semaphore: no semaphore named gppu")
            && stdout(&o).contains("did you mean gpu?")
            && !stderr(&o).contains("is queued, but"),
        "{}{}",
        stdout(&o),
        stderr(&o)
    );
    worker.stop().await;
}

#[test]
fn demo_help_says_it_runs_on_a_throwaway_postgresql_of_its_own() {
    let o = permitq(Some("postgres://ignored@127.0.0.1/x"), &["demo", "--help"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let help = stdout(&o).split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        help.contains(
            "a throwaway PostgreSQL of its own (the DATABASE_URL environment variable is ignored \
             here; only --database-url on the command line runs it on that database instead"
        ),
        "{help}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_says_what_it_gave_back_or_why_there_was_nothing() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "1"]).await;
    // No worker yet: a plain submit says it is queued and that nothing grants.
    let o = run(url, &["submit", "queued-1", "gpu=1"]).await;
    assert_eq!(stdout(&o).trim(), "queued-1 new");
    assert!(
        stderr(&o).contains("permitq: queued-1 is queued, but nothing is granting: ")
            && stderr(&o).contains("start one with `permitq worker`"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["release", "queued-1"]).await;
    assert_eq!(
        stdout(&o).trim(),
        "cancelled: it was still waiting: it held nothing and will not be granted"
    );
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "too-big", "gpu=2", "--await", "10s"]).await;
    assert_eq!(code(&o), 3, "{}", stdout(&o));
    run(url, &["semaphore", "set", "gpu2", "4"]).await;
    let o = run(url, &["submit", "queued-2", "gpu2=1"]).await;
    assert!(
        stderr(&o).contains(
            "permitq: queued-2 is queued; `permitq status queued-2` shows its outcome (or submit \
             with --await 30s to wait for it)"
        ),
        "{}",
        stderr(&o)
    );
    // One that a worker will fail: said once, with why.
    let o = run(url, &["submit", "queued-3", "gpu=2"]).await;
    assert!(
        stderr(&o).contains("permitq: queued-3 is queued, but gpu has capacity 1")
            && stderr(&o).matches("is queued").count() == 1,
        "{}",
        stderr(&o)
    );
    let o = run(url, &["release", "too-big"]).await;
    assert!(
        stdout(&o).starts_with(
            "not_acquired: it was never granted, so it held nothing (error exceeds_capacity: "
        ),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["submit", "held-1", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let o = run(url, &["release", "held-1"]).await;
    assert!(
        stdout(&o).starts_with("released: gpu=1 given back after "),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_capacity_history_says_which_bound_moved_max_instances_and_windows_too() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(
        url,
        &["semaphore", "set", "lab-*", "2", "--max-instances", "4"],
    )
    .await;
    run(
        url,
        &["semaphore", "set", "lab-*", "2", "--max-instances", "8"],
    )
    .await;
    run(url, &["semaphore", "set", "api", "5", "--per", "1m"]).await;
    run(url, &["semaphore", "set", "api", "6", "--per", "2m"]).await;
    run(url, &["semaphore", "set", "api", "6", "--per", "2m"]).await;
    let lines = |o: &std::process::Output| {
        stdout(o)
            .lines()
            // Without the time before and the login after.
            .map(|l| {
                let rest = l.split_once(' ').map_or("", |(_, rest)| rest);
                rest.rsplit_once(" by ")
                    .map_or(rest, |(what, _)| what)
                    .to_string()
            })
            .collect::<Vec<_>>()
    };
    let o = run(url, &["semaphore", "history", "lab-*"]).await;
    assert_eq!(
        lines(&o),
        [
            "lab-* created: capacity 2, fair, max_instances 4",
            "lab-* max_instances 4 -> 8"
        ],
        "{}",
        stdout(&o)
    );
    let o = run(url, &["semaphore", "history", "api"]).await;
    assert_eq!(
        lines(&o),
        [
            "api created: capacity 5, fair, per 1m",
            "api capacity 5 -> 6; per 1m -> 2m",
            "api capacity 6 (set again, unchanged)"
        ],
        "{}",
        stdout(&o)
    );
    let o = run(url, &["semaphore", "history", "api", "--json"]).await;
    let history: serde_json::Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(history[1]["old_per"], 60.0);
    assert_eq!(history[1]["new_per"], 120.0);
    let o = run(url, &["semaphore", "show", "api"]).await;
    assert!(
        stdout(&o).contains(" capacity 5 -> 6; per 1m -> 2m by "),
        "{}",
        stdout(&o)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guaranteed_template_without_a_bound_is_told_to_set_max_instances() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpus", "8"]).await;
    let guaranteed = [
        "semaphore",
        "set",
        "t:*",
        "4",
        "--parent",
        "gpus",
        "--guarantee",
        "1",
    ];
    let o = run(url, &guaranteed).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "invalid nesting of t:*: template t:* needs --max-instances to keep a guarantee (each \
             instance it may make is guaranteed its share): the guarantees of the children of \
             gpus add up to 10000, more than its capacity 8 (t:*'s guarantee of 1 counts in that \
             sum: a lower `--guarantee N` on this command lowers it, `--guarantee 0` for none): \
             template t:* guarantees 1 to each of up to 10000 instances (its max_instances, by \
             default); bound them: `permitq semaphore set 't:*' CAPACITY --guarantee 1 \
             --max-instances N` with N at most 8 (its other children's guarantees leave 8 of \
             gpus); or give it none (`permitq semaphore set 't:*' CAPACITY --guarantee 0`: \
             its instances then borrow what is free, unbounded)"
        ) && !stderr(&o).contains("or raise gpus"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &[&guaranteed[..], &["--max-instances", "8"]].concat()).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // Nothing left for another guaranteed template: no N fits, and the answer says what to raise.
    let another = [
        "semaphore",
        "set",
        "u:*",
        "6",
        "--parent",
        "gpus",
        "--guarantee",
        "3",
    ];
    let o = run(url, &another).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    // The cause first: a bound would not help here.
    assert!(
        stderr(&o).contains(
            "invalid nesting of u:*: no room left in gpus for template u:*'s guarantee (its other \
             children guarantee 8 of 8): the guarantees of the children of gpus add up to"
        ),
        "{}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains(
            "its other children's guarantees leave 0 of gpus, less than one instance's 3: raise \
             gpus and bound the template (8 + N × 3 for N instances): for one, `permitq \
             semaphore set gpus 11`, then `permitq semaphore set 'u:*' CAPACITY --guarantee 3 \
             --max-instances 1`; or lower a guarantee"
        ),
        "{}",
        stderr(&o)
    );
    // Followed as said, both commands are accepted.
    let o = run(url, &["semaphore", "set", "gpus", "11"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &[&another[..], &["--max-instances", "1"]].concat()).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// A template's bound lowered below the instances it has: said at once, and the answers that
/// follow count the instances, so that following them works the first time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_lowered_below_a_templates_instances_is_counted_from_the_instances() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w"));
    run(url, &["semaphore", "set", "gpus", "8"]).await;
    let template = [
        "semaphore",
        "set",
        "lab:*",
        "2",
        "--parent",
        "gpus",
        "--guarantee",
        "2",
    ];
    let o = run(url, &[&template[..], &["--max-instances", "4"]].concat()).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    for lab in ["a", "b", "c"] {
        let id = format!("lab-{lab}");
        let o = run(
            url,
            &["submit", &id, &format!("lab:{lab}=1"), "--await", "10s"],
        )
        .await;
        assert_eq!(code(&o), 0, "{}", stdout(&o));
    }
    // The parent's show counts the template's instances.
    let o = run(url, &["semaphore", "show", "gpus"]).await;
    assert!(
        stdout(&o).contains(
            "  children: 'lab:*' (template: 3 instances, 3 used; each capacity 2, guarantee 2)"
        ),
        "{}",
        stdout(&o)
    );
    let o = run(url, &[&template[..], &["--max-instances", "2"]].concat()).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: lab:* has 3 instances, more than max_instances 2: none is removed; they \
             stay, their guarantees still promised by gpus, until deleted"
        ),
        "{}",
        stderr(&o)
    );
    // An instance's history says the template's change set it again.
    let o = run(url, &["semaphore", "show", "lab:a"]).await;
    assert!(
        stdout(&o).contains("capacity 2 (set again by a change of template lab:*, unchanged here)"),
        "{}",
        stdout(&o)
    );
    // The parent cannot shrink below what the 3 instances are promised: the answer says so.
    let o = run(url, &["semaphore", "set", "gpus", "2"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("(its max_instances), and has 3 now; bound them")
            && stderr(&o).contains("with N at most 1 ")
            && stderr(&o).contains("delete 2 of them"),
        "{}",
        stderr(&o)
    );
    // A new instance: refused, and the raise it names is one above the 3 there are.
    let o = run(url, &["submit", "lab-d-1", "lab:d=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains(
            "which has 3 instances, more than its max_instances of 2 (lowered below them"
        ) && stdout(&o).contains("--max-instances 4`"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &[&template[..], &["--max-instances", "4"]].concat()).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["submit", "lab-d-2", "lab:d=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    // The template's capacity lowered below what an instance holds, and below what a request
    // waiting on an instance asks: both said, as for a semaphore.
    let o = run(url, &["submit", "lab-a-2", "lab:a=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["submit", "lab-a-3", "lab:a=2"]).await;
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "lab:*",
            "1",
            "--parent",
            "gpus",
            "--guarantee",
            "1",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: lab:a holds 2, more than the new capacity 1 of each instance: nothing is \
             revoked"
        ) && stderr(&o).contains(
            "permitq: 1 waiting request asks more than the new capacity 1: lab-a-3 (lab:a=2)"
        ),
        "{}",
        stderr(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_of_a_wait_on_holders_without_a_lease_says_only_a_release_ends_it() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("w"));
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "1"]).await;
    let o = run(url, &["submit", "forever", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["submit", "behind", "gpu=1"]).await;
    let client = db.client().await;
    wait_until(SOON, "the waiter examined", || async {
        client
            .explain("behind")
            .await
            .unwrap()
            .is_some_and(|e| e.semaphores[0].position.is_some())
    })
    .await;
    let text = stdout(&run(url, &["explain", "behind"]).await);
    assert!(
        text.contains("held by forever (1 for ") && text.contains(", no lease)"),
        "{text}"
    );
    assert!(
        text.contains("its holders have no lease: it waits until one releases")
            && !text.contains("estimated wait"),
        "{text}"
    );
    // Where it fits, the holders there are not what it waits for: they are not named.
    run(url, &["semaphore", "set", "room", "4"]).await;
    let o = run(url, &["submit", "roomy", "room=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["submit", "both", "room=1", "gpu=1"]).await;
    wait_until(SOON, "both examined", || async {
        client
            .explain("both")
            .await
            .unwrap()
            .is_some_and(|e| e.semaphores.iter().all(|s| s.position.is_some()))
    })
    .await;
    let text = stdout(&run(url, &["explain", "both"]).await);
    assert!(
        text.contains("held by forever (1 for ") && !text.contains("held by roomy"),
        "{text}"
    );
    assert_eq!(
        text.matches("its holders have no lease").count(),
        1,
        "{text}"
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_answers_name_what_to_do() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    run(url, &["semaphore", "set", "gpus", "8"]).await;
    // A typo in show names the nearest semaphores.
    let o = run(url, &["semaphore", "show", "gpuu"]).await;
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim(),
        "permitq: no semaphore named \"gpuu\"; did you mean gpu or gpus?"
    );
    let o = run(url, &["semaphore", "history", "zzz"]).await;
    assert_eq!(
        stderr(&o).trim(),
        "permitq: no semaphore named \"zzz\" (`permitq semaphore list` shows them all)"
    );
    // A request's id where a semaphore's belongs: said, with where to look.
    run(url, &["submit", "train-1", "gpu=1"]).await;
    let o = run(url, &["semaphore", "show", "train-1"]).await;
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    assert_eq!(
        stderr(&o).trim(),
        "permitq: no semaphore named \"train-1\" (train-1 is a request's external_id: \
         `permitq status train-1` shows it, `permitq explain train-1` why it waits; `permitq \
         semaphore list` shows the semaphores)"
    );
    run(url, &["release", "train-1"]).await;
    // Permits after a bare --await.
    let o = permitq(Some(url), &["submit", "aw-1", "--await", "gpu=1"]);
    assert_eq!(code(&o), 2);
    assert!(
        stderr(&o).contains("put the permits before it (`permitq submit ID gpu=1 --await 30s`)"),
        "{}",
        stderr(&o)
    );
    let o = permitq(Some(url), &["submit", "d-1", "gpu=1", "--ttl", "11y"]);
    assert!(
        stderr(&o).contains("must be at most 10y (3653 days), got 11y"),
        "{}",
        stderr(&o)
    );
    // A parent cannot change under holders or waiters: the answer counts them.
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "h-1", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    // The same submit again (after a crash): the grant it holds, not an ended request.
    let o = run(url, &["submit", "h-1", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    assert!(
        stderr(&o).contains("h-1 was submitted before and holds its grant; this is that request (release it with `permitq release h-1` when done)")
            && !stderr(&o).contains("ended"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["semaphore", "set", "gpu", "4", "--parent", "gpus"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("gpu holds permits or has waiters (used 1, 0 waiting)")
            && stderr(&o).contains("`permitq semaphore show gpu` lists the holders and waiters"),
        "{}",
        stderr(&o)
    );
    // Lowering below what is held says that nothing is revoked.
    let o = run(url, &["semaphore", "set", "gpu", "0"]).await;
    assert!(
        stderr(&o).contains("1 permit is held (or released and not yet counted back), more than the new capacity 0: nothing is revoked"),
        "{}",
        stderr(&o)
    );
    // At 0, what it says is what happens: a new request fails at once.
    assert!(
        stderr(&o)
            .contains("while it is 0, every new request here ends at once in exceeds_capacity"),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "zero-1", "gpu=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).starts_with("zero-1 error exceeds_capacity"),
        "{}",
        stdout(&o)
    );
    run(url, &["semaphore", "set", "gpu", "4"]).await;
    // A change to an instance says that its template's next change sets it again.
    run(url, &["semaphore", "set", "inst-*", "2"]).await;
    let o = run(url, &["submit", "i-1", "inst-1=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let o = run(url, &["semaphore", "set", "inst-1", "3"]).await;
    assert!(
        stderr(&o).contains("inst-1 is an instance of template inst-*: the template's next change (`permitq semaphore set 'inst-*' ...`) sets it again"),
        "{}",
        stderr(&o)
    );
    // A template is never granted itself: naming one says to name an instance.
    let o = run(url, &["submit", "t-tpl", "inst-*=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains("inst-* is a template, which is never granted itself: name an instance of it (inst-NAME"),
        "{}",
        stdout(&o)
    );
    // A capacity of 0 is not "ask for at most 0".
    run(url, &["semaphore", "set", "off", "0"]).await;
    let o = run(url, &["submit", "z-1", "off=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains("off has capacity 0: it can never be granted; raise the capacity"),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

/// A request whose wait ran out says where it had no room then: `explain` can no longer ask.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_says_where_there_was_no_room_when_the_wait_ran_out() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "2"]).await;
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "h-1", "gpu=2", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let o = run(
        url,
        &["submit", "late", "gpu=1", "--wait", "1s", "--await", "10s"],
    )
    .await;
    let expected = "late error timeout: not granted within its wait of 1s: when it ran out, \
                    gpu=1, 0 of 2 free (`permitq semaphore show gpu` lists the holders); submit \
                    again under a new external_id, with a longer --wait";
    assert_eq!(stdout(&o).trim(), expected, "{}", stderr(&o));
    let o = run(url, &["explain", "late"]).await;
    assert!(
        stdout(&o).contains("when it ran out, gpu=1, 0 of 2 free"),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["status", "late", "--json"]).await;
    assert_eq!(
        json(&o)["error_detail"],
        serde_json::json!({"semaphore": "gpu", "count": 1, "capacity": 2, "free": 0}),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

/// `semaphore delete` removes what nothing uses, says what to do first otherwise, and the
/// capacity history keeps the deletion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_nothing_uses_can_be_deleted_and_its_history_says_so() {
    let db = TestDb::new().await;
    let url = &db.url;
    let refused = |o: &std::process::Output, expected: &str| {
        assert_eq!(code(o), 1, "{}", stderr(o));
        assert!(stderr(o).contains(expected), "{expected}: {}", stderr(o));
    };
    // Waiting, before any worker looked at it.
    run(url, &["semaphore", "set", "q", "1"]).await;
    run(url, &["submit", "q-1", "q=1"]).await;
    let o = run(url, &["semaphore", "delete", "q"]).await;
    refused(&o, "q has 1 request waiting: release (cancel) them");
    // Held.
    run(url, &["semaphore", "set", "gpu", "2"]).await;
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "h-1", "gpu=2", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    let o = run(url, &["semaphore", "delete", "gpu"]).await;
    refused(
        &o,
        "gpu holds 2 permits: release or revoke (`permitq revoke ID`) them",
    );
    // A parent, and a template with an instance.
    run(url, &["semaphore", "set", "pool", "4"]).await;
    run(url, &["semaphore", "set", "team", "2", "--parent", "pool"]).await;
    let o = run(url, &["semaphore", "delete", "pool"]).await;
    refused(
        &o,
        "pool is the parent of team: take it out (`permitq semaphore set team 2 --no-parent`;",
    );
    // A template's instances are named by their template.
    run(url, &["semaphore", "set", "kid-*", "1", "--parent", "pool"]).await;
    let o = run(url, &["submit", "k-1", "kid-1=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["release", "k-1"]).await;
    let o = run(url, &["semaphore", "delete", "pool"]).await;
    refused(&o, "pool is the parent of kid-*, team: take them out");
    run(url, &["semaphore", "set", "lab-*", "1"]).await;
    let o = run(url, &["submit", "l-1", "lab-1=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["release", "l-1"]).await;
    let o = run(url, &["semaphore", "delete", "lab-*"]).await;
    refused(&o, "lab-* has instances: lab-1; delete them first");
    // A name of the template with no instance now: nothing to delete, and why.
    let o = run(url, &["semaphore", "delete", "lab-9"]).await;
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "no semaphore named \"lab-9\" now: the template lab-* makes it for the first request \
             that names it (and the workers remove it again once idle); `permitq semaphore show \
             'lab-*'` lists the instances there are"
        ),
        "{}",
        stderr(&o)
    );
    // A rate limit whose window holds grants: deleting it would let them be granted again.
    run(url, &["semaphore", "set", "rl", "2", "--per", "1h"]).await;
    let o = run(url, &["submit", "r-1", "rl=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    run(url, &["release", "r-1"]).await;
    wait_until(SOON, "r-1's release folded", || async {
        let o = run(url, &["semaphore", "delete", "rl"]).await;
        stderr(&o).contains("rl granted 1 in its 1h rate window")
    })
    .await;
    let o = run(url, &["semaphore", "delete", "rl"]).await;
    refused(&o, "try again once the window has no grants (in ");
    // A producer may not.
    let producer = db.login("permitq_producer").await;
    let o = run(&producer, &["semaphore", "delete", "team"]).await;
    refused(&o, "this needs the role permitq_admin");
    // Nothing uses it: deleted, gone from the list, kept in its history.
    run(url, &["release", "h-1"]).await;
    wait_until(SOON, "gpu deleted once its release is folded", || async {
        code(&run(url, &["semaphore", "delete", "gpu"]).await) == 0
    })
    .await;
    let o = run(url, &["semaphore", "list"]).await;
    assert!(!stdout(&o).contains("gpu"), "{}", stdout(&o));
    let o = run(url, &["semaphore", "history", "gpu"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let last = stdout(&o).lines().last().unwrap_or_default().to_string();
    assert!(
        last.contains("gpu deleted (it had capacity 2) by "),
        "{}",
        stdout(&o)
    );
    for instance in ["lab-1", "kid-1"] {
        wait_until(
            SOON,
            "an instance deleted once its release is folded",
            || async { code(&run(url, &["semaphore", "delete", instance]).await) == 0 },
        )
        .await;
    }
    // --json prints the semaphore as it was.
    let o = run(url, &["semaphore", "delete", "lab-*", "--json"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(json(&o)["name"], "lab-*", "{}", stdout(&o));
    assert_eq!(json(&o)["capacity"], 1, "{}", stdout(&o));
    for name in ["kid-*", "team", "pool"] {
        let o = run(url, &["semaphore", "delete", name]).await;
        assert_eq!(code(&o), 0, "{name}: {}", stderr(&o));
        assert!(
            stdout(&o).starts_with(&format!("deleted {name} (capacity ")),
            "{}",
            stdout(&o)
        );
    }
    let o = run(url, &["semaphore", "delete", "gpu"]).await;
    assert_eq!(code(&o), 5, "{}", stderr(&o));
    // A request naming a deleted semaphore fails, naming what is left.
    let o = run(url, &["submit", "g-2", "gpu=1", "--await", "10s"]).await;
    assert!(
        stdout(&o).contains("g-2 error unknown_semaphore"),
        "{}",
        stdout(&o)
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submit_without_its_id_says_the_permit_was_taken_as_the_id() {
    let db = TestDb::new().await;
    let url = &db.url;
    let o = run(url, &["submit", "gpu=1"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            r#"no permits given: "gpu=1" was taken as the external_id, which comes first: `permitq submit ID gpu=1`"#
        ),
        "{}",
        stderr(&o)
    );
    let o = run(url, &["submit", "job-1"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "no permits given: name what to acquire after the external_id: `permitq submit job-1 NAME=COUNT` (e.g. gpu=1)"
        ),
        "{}",
        stderr(&o)
    );
    // With more permits after it, the first is not taken as the id either (it would hold the
    // licence alone).
    let o = run(url, &["submit", "gpu=2", "licence=1"]).await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            r#"invalid external_id: "gpu=2" looks like a permit: the external_id comes first, then every permit: `permitq submit ID gpu=2 licence=1`"#
        ),
        "{}",
        stderr(&o)
    );
    // Nothing was written.
    for id in ["gpu=1", "gpu=2"] {
        let o = run(url, &["status", id]).await;
        assert_eq!(code(&o), 5, "{}", stderr(&o));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_set_list_and_show_say_what_is_kept_what_zero_means_and_the_children() {
    let db = TestDb::new().await;
    let url = &db.url;
    // Nothing yet: the list says how to make one.
    let o = run(url, &["semaphore", "list"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!(
            "permitq: no semaphores yet in database {}",
            db.name
        )) && stderr(&o).contains("`permitq semaphore set NAME CAPACITY` makes one"),
        "{}",
        stderr(&o)
    );
    // A later set without --per keeps the window, and says it in its line.
    run(url, &["semaphore", "set", "api", "2", "--per", "1h"]).await;
    let o = run(url, &["semaphore", "set", "api", "3"]).await;
    assert!(
        stdout(&o).starts_with("api capacity=3 per=1h granted_in_window=0 held=0 "),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["semaphore", "list"]).await;
    assert!(
        stdout(&o).contains("per 1h (capacity and used: grants in the window; 0 held)"),
        "{}",
        stdout(&o)
    );
    // Capacity 0 is announced: what becomes of requests while it is.
    let o = run(url, &["semaphore", "set", "off", "0"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(
            "permitq: off has capacity 0: while it is, every new request naming it ends at once \
             in exceeds_capacity"
        ),
        "{}",
        stderr(&o)
    );
    assert!(!stderr(&o).contains("list"), "{}", stderr(&o));
    // A parent's show names its children.
    run(url, &["semaphore", "set", "pool", "4"]).await;
    for args in [
        &[
            "semaphore",
            "set",
            "team-a",
            "4",
            "--parent",
            "pool",
            "--guarantee",
            "2",
        ][..],
        &["semaphore", "set", "team-b", "2", "--parent", "pool"],
    ] {
        let o = run(url, args).await;
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let o = run(url, &["semaphore", "show", "pool"]).await;
    assert!(
        stdout(&o).contains(
            "  children: team-a (capacity 4, guarantee 2, 0 used), team-b (capacity 2, 0 used)"
        ),
        "{}",
        stdout(&o)
    );
    let o = run(url, &["semaphore", "show", "team-a"]).await;
    assert!(!stdout(&o).contains("children:"), "{}", stdout(&o));
}

/// A child within its guarantee, short on its parent: the room kept for the other children's
/// guarantees is shown with why it does not count against this request (its shortfall adds up).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn within_a_guarantee_the_room_kept_for_others_is_said_not_to_count() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w"));
    run(url, &["semaphore", "set", "accelerators", "8"]).await;
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "lab:*",
            "6",
            "--parent",
            "accelerators",
            "--guarantee",
            "2",
            "--max-instances",
            "4",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    for (id, permit) in [("la-1", "lab:a=6"), ("lb-1", "lab:b=1")] {
        let o = run(url, &["submit", id, permit, "--await", "10s"]).await;
        assert_eq!(code(&o), 0, "{}", stdout(&o));
    }
    run(url, &["submit", "lc-1", "lab:c=2"]).await;
    wait_until(SOON, "lc-1 explained on its parent", || async {
        stdout(&run(url, &["explain", "lc-1"]).await).contains(
            "accelerators (parent, through lab:c): needs 2, 1 free of 8 (1 of it kept for other \
             children's guarantees, which this request, within its own guarantee, may take all \
             the same), short 1",
        )
    })
    .await;
    worker.stop().await;
}

/// A borrower first in a parent's line is told that a child's request within its own guarantee
/// may take the free room before it (it needs only room), and how much it borrows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_is_told_that_requests_within_a_guarantee_may_go_first() {
    let db = TestDb::new().await;
    let url = &db.url;
    let worker = db.worker(quiet_config("w"));
    run(url, &["semaphore", "set", "accel", "8"]).await;
    let o = run(
        url,
        &[
            "semaphore",
            "set",
            "lab:*",
            "8",
            "--parent",
            "accel",
            "--guarantee",
            "2",
            "--max-instances",
            "4",
        ],
    )
    .await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["submit", "g-a", "lab:a=6", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["submit", "g-b", "lab:b=3"]).await;
    let client = db.client().await;
    examined(&client, "g-b").await;
    let out = stdout(&run(url, &["explain", "g-b"]).await);
    assert!(
        out.contains(
            "waits for 1 more permit to be released (first in line); it borrows 1 beyond the \
             guarantee of lab:b (2): a request within its child's guarantee needs only room, so \
             it may take the free room first: one of another child, or one of lab:b itself for \
             at most 2"
        ),
        "{out}"
    );
    // As said: a request of lab:b itself within its guarantee is granted past it, and then
    // one of lab:c.
    let o = run(url, &["submit", "g-b2", "lab:b=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = run(url, &["submit", "g-c", "lab:c=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    worker.stop().await;
}

#[test]
fn a_count_of_permits_that_is_not_one_says_what_is_expected() {
    for (args, said) in [
        (
            &["semaphore", "set", "gpu", "four"][..],
            "\"four\" is not a whole number: give one in digits, 0 or more (for example 4)",
        ),
        (
            &["semaphore", "set", "gpu", "-3"],
            "-3 is below 0: give 0 or more (0 grants nothing)",
        ),
        (
            &["semaphore", "set", "gpu", "99999999999"],
            "99999999999 is above the largest, 2147483647",
        ),
        (
            &["semaphore", "set", "gpu", "2", "--guarantee", "1.5"],
            "invalid value '1.5' for '--guarantee <GUARANTEE>': \"1.5\" is not a whole number",
        ),
    ] {
        let o = permitq(None, args);
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(said), "{args:?}: {}", stderr(&o));
    }
}

/// A waiting request's own terms: explain says when its `wait` runs out (and that it then fails
/// with timeout), and, once aging has raised its priority, to what and what that means for a
/// request submitted now; the head a later request waits for is named with its aged priority;
/// `semaphore show`'s waiters say why an older request of lower priority stands ahead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_says_when_a_wait_runs_out_and_what_aging_made_of_a_priority() {
    let db = TestDb::new().await;
    let url = &db.url;
    run(url, &["semaphore", "set", "gpu", "1"]).await;
    let worker = db.worker(quiet_config("w"));
    let o = run(url, &["submit", "age-h", "gpu=1", "--await", "10s"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    run(url, &["submit", "age-old", "gpu=1", "--wait", "5m"]).await;
    let client = db.client().await;
    examined(&client, "age-old").await;
    // As if it had waited a minute: six aging steps.
    db.conn()
        .await
        .batch_execute(
            "UPDATE permitq.permit_request SET created_at = created_at - interval '60 s' \
             WHERE external_id = 'age-old';
             UPDATE permitq.waiter w SET created_at = r.created_at FROM permitq.permit_request r \
             WHERE r.id = w.request_id AND r.external_id = 'age-old'",
        )
        .await
        .unwrap();
    run(url, &["submit", "age-new", "gpu=1", "--priority", "3"]).await;
    examined(&client, "age-new").await;
    let old = stdout(&run(url, &["explain", "age-old"]).await);
    assert!(
        (old.contains("its wait runs out in 3m ") || old.contains("its wait runs out in 4m:"))
            && old.contains(": then it fails with timeout"),
        "{old}"
    );
    assert!(
        old.contains(
            "priority 0, aged to 6 by its wait (one per 10s waited): a request submitted now \
             goes ahead of it only with priority 7 or more"
        ),
        "{old}"
    );
    let new = stdout(&run(url, &["explain", "age-new"]).await);
    assert!(
        new.contains("fair: request age-old is first in line (priority 0, aged to 6, needs 1)")
            && !new.contains("its wait runs out")
            && !new.contains("aged to 0"),
        "{new}"
    );
    // Its holder has no lease: no running worker has --max-hold, and explain says what one
    // would do; once one runs with it, when the holder is released as stale.
    assert!(
        new.contains(
            "or a worker runs with --max-hold DUR, which releases holders held that long as \
             stale (none running has it)"
        ),
        "{new}"
    );
    worker.stop().await;
    let mut config = quiet_config("w-max-hold");
    config.maintenance.max_hold = Some(Duration::from_secs(3600));
    let worker = db.worker(config);
    wait_until(SOON, "explain names the worker's --max-hold", || async {
        stdout(&run(url, &["explain", "age-new"]).await).contains(
            "or a worker's --max-hold 1h releases a holder held that long as stale: age-h (held ",
        )
    })
    .await;
    let json = json(&run(url, &["explain", "age-old", "--json"]).await);
    assert_eq!(json["priority"], 0, "{json}");
    assert!(
        json["aged_priority"].as_f64().is_some_and(|p| p >= 6.0),
        "{json}"
    );
    assert!(json["wait_ends_at"].is_string(), "{json}");
    let show = stdout(&run(url, &["semaphore", "show", "gpu"]).await);
    assert!(
        show.lines()
            .any(|l| l.contains("age-old") && l.contains(" 0 (+6) "))
            && show.contains("(+N: aged by its wait, one per 10s waited;"),
        "{show}"
    );
    worker.stop().await;
}
