//! Adaptive capacity: holders report, two workers apply each report once per cadence, a worker
//! dying mid-cadence loses none, a repeated release reports nothing again; bad settings and bad
//! reports are refused and write nothing.

use permitq_test_support as common;

use std::time::Duration;

use common::{quiet_config, wait_until, TestDb};
use permitq::{AdaptiveLimit, Algorithm, Outcome, Request, SqlState};

const SOON: Duration = Duration::from_secs(10);
const CADENCE: Duration = Duration::from_millis(150);

fn adaptive_worker(db: &TestDb, id: &str) -> common::RunningWorker {
    let mut config = quiet_config(id);
    config.maintenance.adaptive_cadence = CADENCE;
    db.worker(config)
}

async fn capacity(conn: &tokio_postgres::Client, name: &str) -> i32 {
    conn.query_one(
        "SELECT capacity FROM permitq.semaphore WHERE name = $1",
        &[&name],
    )
    .await
    .unwrap()
    .get(0)
}

/// Waits until every worker has run at least two cadences after now (the adaptive row's
/// `applied_at` moved twice), so that a change that should not come would have.
async fn two_more_cadences(conn: &tokio_postgres::Client) {
    for _ in 0..2 {
        let before: std::time::SystemTime = conn
            .query_one("SELECT clock_timestamp()", &[])
            .await
            .unwrap()
            .get(0);
        wait_until(SOON, "a cadence ran", || async {
            let at: std::time::SystemTime = conn
                .query_one("SELECT applied_at FROM permitq.adaptive_limit", &[])
                .await
                .unwrap()
                .get(0);
            at > before
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_apply_each_report_once_and_a_dead_cadence_loses_none() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("api", 10, None).await.unwrap();
    let limit = AdaptiveLimit::new(Algorithm::Aimd, 2, 20);
    assert_eq!(
        client.set_adaptive("api", Some(&limit)).await.unwrap(),
        Some(limit.clone())
    );
    assert_eq!(client.adaptive("api").await.unwrap(), Some(limit));
    let _w1 = adaptive_worker(&db, "w1");
    let _w2 = adaptive_worker(&db, "w2");
    // Six held (at least half in use: AIMD grows), three come and go reporting ok, while a
    // session holds the nesting gate: no cadence runs until all three are in, so one applies
    // them together.
    let mut held = Vec::new();
    for i in 0..6 {
        held.push(
            client
                .acquire(&Request::new(format!("h{i}")).permit("api", 1), SOON)
                .await
                .unwrap(),
        );
    }
    let gate = db.conn().await;
    gate.batch_execute("BEGIN; LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE")
        .await
        .unwrap();
    for (i, ms) in [10, 20, 60].into_iter().enumerate() {
        let lease = client
            .acquire(&Request::new(format!("ok{i}")).permit("api", 1), SOON)
            .await
            .unwrap();
        lease
            .release_reporting(Outcome::Ok, Some(Duration::from_millis(ms)))
            .await
            .unwrap();
    }
    gate.batch_execute("COMMIT").await.unwrap();
    wait_until(SOON, "grown by one", || async {
        capacity(&conn, "api").await == 11
    })
    .await;
    two_more_cadences(&conn).await;
    assert_eq!(capacity(&conn, "api").await, 11, "one cadence applied them");
    let history = client.capacity_history("api").await.unwrap();
    let change = history.iter().max_by_key(|c| c.changed_at).unwrap();
    assert_eq!(
        (
            change.old_capacity,
            change.new_capacity,
            change.changed_by.as_str()
        ),
        (Some(10), 11, "adaptive (aimd)")
    );
    let inputs: serde_json::Value = conn
        .query_one(
            "SELECT inputs FROM permitq.capacity_change WHERE semaphore = 'api' ORDER BY id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        (inputs["ok"].as_i64(), inputs["overloaded"].as_i64()),
        (Some(3), Some(0))
    );
    // The latency the algorithms read: the 90th percentile of the reports' (10, 20, 60 ms:
    // 52), not their mean (30).
    let latency = inputs["latency_ms"].as_f64().unwrap();
    assert!((latency - 52.0).abs() < 1e-6, "{inputs}");

    // An overload: to 90%, at least one less (11 -> 9), once. Released again: no second report.
    let first = held.remove(0);
    first
        .release_reporting(Outcome::Overloaded, None)
        .await
        .unwrap();
    let again = client
        .release_reporting("h0", Outcome::Overloaded, None)
        .await
        .unwrap();
    assert_eq!(again, permitq::ReleaseOutcome::AlreadyReleased);
    wait_until(SOON, "backed off", || async {
        capacity(&conn, "api").await == 9
    })
    .await;
    two_more_cadences(&conn).await;
    assert_eq!(
        capacity(&conn, "api").await,
        9,
        "applied once, the repeat not at all"
    );
    let inputs: serde_json::Value = conn
        .query_one(
            "SELECT inputs FROM permitq.capacity_change WHERE semaphore = 'api' ORDER BY id DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        inputs["overloaded"].as_i64(),
        Some(1),
        "one report: {inputs}"
    );

    // A cadence that dies after reading (and deleting) the reports: they come back with its
    // rollback, and the workers apply them (9 -> 8). While it holds the gate, they move on.
    // The dying session takes the gate first, so that no worker applies the report before it.
    let dying = db.conn().await;
    dying
        .batch_execute("BEGIN; LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE")
        .await
        .unwrap();
    let second = held.remove(0);
    second
        .release_reporting(Outcome::Overloaded, None)
        .await
        .unwrap();
    let taken: i64 = dying
        .query_one(
            "SELECT overloaded FROM permitq.adaptive_turn('0 seconds')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(taken, 1, "it read the report (and deleted it, uncommitted)");
    assert_eq!(capacity(&conn, "api").await, 9);
    drop(dying);
    wait_until(SOON, "the report applied after all", || async {
        capacity(&conn, "api").await == 8
    })
    .await;
    two_more_cadences(&conn).await;
    assert_eq!(capacity(&conn, "api").await, 8);
    let left: i64 = conn
        .query_one("SELECT count(*) FROM permitq.outcome_report", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "every report applied is gone");

    // Fixed again: no more changes, the capacity stays where it was.
    client.set_adaptive("api", None).await.unwrap();
    assert_eq!(client.adaptive("api").await.unwrap(), None);
    assert_eq!(capacity(&conn, "api").await, 8);
    for lease in held {
        lease.release().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_and_bad_reports_are_refused_and_write_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("api", 10, None).await.unwrap();
    client.set_capacity("lab-*", 2, None).await.unwrap();
    client
        .set_rate_limit("quota", 5, Duration::from_secs(60), None)
        .await
        .unwrap();
    let refused = |e: permitq::Error, needle: &str| {
        assert_eq!(e.code(), Some(&SqlState::INVALID_PARAMETER_VALUE), "{e}");
        assert!(e.to_string().contains(needle), "{needle}: {e}");
    };
    for (name, limit, needle) in [
        (
            "nope",
            AdaptiveLimit::new(Algorithm::Aimd, 1, 5),
            "no semaphore named nope: create it first (`permitq semaphore set nope CAPACITY`)",
        ),
        (
            "lab-*",
            AdaptiveLimit::new(Algorithm::Aimd, 1, 5),
            "a template cannot adapt",
        ),
        (
            "quota",
            AdaptiveLimit::new(Algorithm::Aimd, 1, 5),
            "it is a rate limit (5 per 1m), and a rate limit cannot be adaptive",
        ),
        (
            "api",
            AdaptiveLimit::new(Algorithm::Aimd, 0, 5),
            "floor 0 and ceiling 5: need 1 <= floor <= ceiling",
        ),
        (
            "api",
            AdaptiveLimit::new(Algorithm::Gradient, 6, 5),
            "floor 6 and ceiling 5",
        ),
    ] {
        refused(
            client.set_adaptive(name, Some(&limit)).await.unwrap_err(),
            needle,
        );
    }
    let rows: i64 = conn
        .query_one("SELECT count(*) FROM permitq.adaptive_limit", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    let e = conn
        .query_one("SELECT permitq.set_adaptive('api', 'vegas', 1, 5)", &[])
        .await
        .unwrap_err();
    assert!(
        e.as_db_error().unwrap().message().contains(
            "invalid adaptive algorithm: vegas: use aimd (from overloaded and failed reports) or gradient"
        ),
        "{e:?}"
    );

    // The contract's form: set_capacity(..., adaptive => ...), and false to fix it again.
    let capacity_set: i32 = conn
        .query_one(
            "SELECT capacity FROM permitq.set_capacity('named', 30, \
             adaptive => '{\"algorithm\": \"gradient\", \"floor\": 2, \"ceiling\": 20}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(capacity_set, 20, "brought within its bounds");
    assert_eq!(
        client.adaptive("named").await.unwrap(),
        Some(AdaptiveLimit::new(Algorithm::Gradient, 2, 20))
    );
    conn.query_one(
        "SELECT permitq.set_capacity('named', 20, adaptive => 'false')",
        &[],
    )
    .await
    .unwrap();
    assert_eq!(client.adaptive("named").await.unwrap(), None);
    for bad in ["'{\"algorithm\": \"aimd\"}'", "'true'", "'[1]'"] {
        let e = conn
            .query_one(
                &format!("SELECT permitq.set_capacity('named', 5, adaptive => {bad})"),
                &[],
            )
            .await
            .unwrap_err();
        assert!(
            e.as_db_error().unwrap().message().contains(
                "give {\"algorithm\": \"aimd\" or \"gradient\", \"floor\": N, \"ceiling\": N}, or false"
            ),
            "{bad}: {e:?}"
        );
    }
    assert_eq!(
        capacity(&conn, "named").await,
        20,
        "a refused change writes nothing"
    );

    // Bounds bring the capacity within them at once.
    client
        .set_adaptive("api", Some(&AdaptiveLimit::new(Algorithm::Aimd, 2, 8)))
        .await
        .unwrap();
    assert_eq!(capacity(&conn, "api").await, 8);

    // A report that says nothing valid: refused, and the release with it did not happen.
    let _worker = db.notified_worker("w");
    let lease = client
        .acquire(&Request::new("r1").permit("api", 1), SOON)
        .await
        .unwrap();
    let e = conn
        .query_one("SELECT permitq.release('r1', 'great')", &[])
        .await
        .unwrap_err();
    assert!(
        e.as_db_error().unwrap().message().contains(
            "invalid outcome 'great': ok, overloaded (a 429, a timeout, a pool exhausted) or failed"
        ),
        "{e:?}"
    );
    let e = conn
        .query_one("SELECT permitq.release('r1', latency => '1 second')", &[])
        .await
        .unwrap_err();
    assert!(
        e.as_db_error()
            .unwrap()
            .message()
            .contains("invalid latency: it is reported with an outcome"),
        "{e:?}"
    );
    let e = conn
        .query_one("SELECT permitq.report('r1', 'ok', '-1 second')", &[])
        .await
        .unwrap_err();
    assert!(
        e.as_db_error()
            .unwrap()
            .message()
            .contains("invalid latency"),
        "{e:?}"
    );
    let (state, reports): (String, i64) = {
        let row = conn
            .query_one(
                "SELECT (SELECT state::text FROM permitq.permit_request WHERE external_id = 'r1'),
                        (SELECT count(*) FROM permitq.outcome_report)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((state.as_str(), reports), ("acquired", 0));
    // While it holds, a report counts; once released, none.
    assert!(client
        .report("r1", Outcome::Ok, Some(Duration::from_millis(5)))
        .await
        .unwrap());
    lease.release().await.unwrap();
    assert!(!client.report("r1", Outcome::Ok, None).await.unwrap());
    // Nor on a held request of no adaptive semaphore, nor on an id no request has.
    client.set_capacity("plain", 1, Some(true)).await.unwrap();
    let plain = client
        .acquire(&Request::new("p1").permit("plain", 1), SOON)
        .await
        .unwrap();
    assert!(!client.report("p1", Outcome::Ok, None).await.unwrap());
    assert!(!client.report("nope", Outcome::Ok, None).await.unwrap());
    plain.release().await.unwrap();
}

/// An adaptive parent never goes below what its children are promised (a template's guarantee
/// once per instance it may make), nor a child below its own guarantee: set_adaptive refuses
/// such a floor, and a cadence's capacity is clamped to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_capacity_keeps_the_nesting_promises() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 60, None).await.unwrap();
    let team = permitq::SemaphoreSettings::new()
        .parent("pool")
        .guarantee(5)
        .max_instances(10);
    client.set_semaphore("team:*", 6, &team).await.unwrap();
    let kid = permitq::SemaphoreSettings::new()
        .parent("pool")
        .guarantee(4);
    client.set_semaphore("kid", 8, &kid).await.unwrap();
    let e = client
        .set_adaptive("pool", Some(&AdaptiveLimit::new(Algorithm::Aimd, 1, 100)))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("floor 1 is below the 54 its children are guaranteed: raise the floor to 54"),
        "{e}"
    );
    let e = client
        .set_adaptive("kid", Some(&AdaptiveLimit::new(Algorithm::Aimd, 1, 10)))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("floor 1 is below the 4 it is guaranteed in its parent"),
        "{e}"
    );
    client
        .set_adaptive("pool", Some(&AdaptiveLimit::new(Algorithm::Aimd, 54, 100)))
        .await
        .unwrap();
    // Whatever an algorithm asks, the promise holds (the cadence's second step, called as a
    // worker's would be).
    let id: i64 = conn
        .query_one("SELECT id FROM permitq.semaphore WHERE name = 'pool'", &[])
        .await
        .unwrap()
        .get(0);
    let set: i32 = conn
        .query_one("SELECT permitq.adaptive_apply($1, 1, '{}', '{}')", &[&id])
        .await
        .unwrap()
        .get(0);
    assert_eq!((set, capacity(&conn, "pool").await), (54, 54));
}

/// Only admins make a semaphore adaptive, only workers run a cadence; a producer reports only
/// on its own requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_admins_set_it_and_only_workers_apply_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("api", 10, None).await.unwrap();
    client
        .set_adaptive("api", Some(&AdaptiveLimit::new(Algorithm::Aimd, 1, 20)))
        .await
        .unwrap();
    let user = format!("adapt_producer_{}", std::process::id());
    db.conn()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {user} LOGIN PASSWORD 'pw' IN ROLE permitq_producer"
        ))
        .await
        .unwrap();
    let producer = common::connect(&common::as_user(&db.url, &user, "pw")).await;
    for statement in [
        "SELECT permitq.set_adaptive('api', 'aimd', 1, 2)",
        "SELECT * FROM permitq.adaptive_turn('0 seconds')",
        "SELECT permitq.adaptive_apply(1, 1, '{}', '{}')",
    ] {
        let e = producer.query(statement, &[]).await.unwrap_err();
        assert_eq!(
            e.code(),
            Some(&SqlState::INSUFFICIENT_PRIVILEGE),
            "{statement}: {e:?}"
        );
    }
    // Another login's request: its report is refused.
    let _worker = db.notified_worker("w");
    let _lease = client
        .acquire(&Request::new("admins").permit("api", 1), SOON)
        .await
        .unwrap();
    let e = producer
        .query("SELECT permitq.report('admins', 'overloaded')", &[])
        .await
        .unwrap_err();
    assert_eq!(e.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{e:?}");
    drop(producer);
    db.conn()
        .await
        .batch_execute(&format!("DROP OWNED BY {user}; DROP ROLE {user}"))
        .await
        .unwrap();
}

/// A waiting request that an adaptive back-off no longer covers ends in exceeds_capacity whose
/// detail says the workers moved the capacity (`adaptive`, with `from`), not that it can never be
/// granted; after a manual lowering, the detail has no `from`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_back_off_that_ends_a_waiter_says_the_workers_moved_the_capacity() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("calls", 8, None).await.unwrap();
    client
        .set_adaptive("calls", Some(&AdaptiveLimit::new(Algorithm::Aimd, 2, 10)))
        .await
        .unwrap();
    let _worker = adaptive_worker(&db, "w1");
    let holder = client
        .acquire(&Request::new("holder").permit("calls", 8), SOON)
        .await
        .unwrap();
    let ended = |id: &'static str| {
        let client = &client;
        async move {
            wait_until(SOON, "the waiter ended", || async {
                client.status(id).await.unwrap().unwrap().state == permitq::State::Error
            })
            .await;
            client.status(id).await.unwrap().unwrap()
        }
    };
    for (id, lower) in [
        ("waiter", "SELECT permitq.adaptive_apply(id, 7, '{}', '{}') FROM permitq.semaphore WHERE name = 'calls'"),
        ("waiter-2", "SELECT permitq.set_capacity('calls', 6)"),
    ] {
        // Back at 8 by hand (the back-off above left 7), so that the request waits.
        conn.batch_execute("SELECT permitq.set_capacity('calls', 8)")
            .await
            .unwrap();
        client
            .submit(&Request::new(id).permit("calls", 8).wait(Duration::from_secs(60)))
            .await
            .unwrap();
        wait_until(SOON, "a worker examined it", || async {
            client.status(id).await.unwrap().unwrap().examined_at.is_some()
        })
        .await;
        // What a cadence's back-off does (its second step, as a worker calls it), or an admin.
        conn.batch_execute(lower).await.unwrap();
        let r = ended(id).await;
        let detail: serde_json::Value = conn
            .query_one(
                "SELECT error_detail FROM permitq.permit_request WHERE external_id = $1",
                &[&id],
            )
            .await
            .unwrap()
            .get(0);
        let outcome = r.outcome().unwrap();
        if id == "waiter" {
            assert_eq!(
                detail["adaptive"],
                serde_json::json!({"algorithm": "aimd", "floor": 2, "ceiling": 10, "from": 8}),
                "{detail}"
            );
            assert!(
                outcome.contains("the workers backed it off from 8 (adaptive, aimd from 2 to 10)")
                    && outcome.contains("it may grow back")
                    && outcome.contains("ask for at most 2 (its floor, which always fits)")
                    && !outcome.contains("never"),
                "{outcome}"
            );
        } else {
            assert_eq!(
                detail["adaptive"],
                serde_json::json!({"algorithm": "aimd", "floor": 2, "ceiling": 10}),
                "{detail}"
            );
            assert!(
                outcome.contains("calls has capacity 6 now (adaptive, aimd from 2 to 10: the workers move it)"),
                "{outcome}"
            );
        }
    }
    holder.release().await.unwrap();
}

/// A holder reports while it holds (the lease's `report`, beside its heartbeats), and again on
/// release: until a cadence applies them, one report per request stands, and a later one that
/// says less does not replace it (ok < failed < overloaded), so an overload said mid-use is not
/// lost to an `ok` release in the same cadence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_while_holding_is_not_undone_by_a_milder_one_in_the_same_cadence() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    // A cadence that does not come during the test: the reports stay to be read.
    let mut config = quiet_config("slow-cadence");
    config.maintenance.adaptive_cadence = Duration::from_secs(3600);
    let worker = db.worker(config);
    client.set_capacity("api", 4, None).await.unwrap();
    client
        .set_adaptive("api", Some(&AdaptiveLimit::new(Algorithm::Aimd, 1, 8)))
        .await
        .unwrap();
    let stored = || async {
        let rows = conn
            .query(
                "SELECT o.outcome, o.latency_ms::float8 FROM permitq.outcome_report o
                 JOIN permitq.permit_request r ON r.id = o.request_id
                 WHERE r.external_id = 'h1'",
                &[],
            )
            .await
            .unwrap();
        rows.iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, f64>(1)))
            .collect::<Vec<_>>()
    };
    let lease = client
        .acquire(&Request::new("h1").permit("api", 1), SOON)
        .await
        .unwrap();
    assert!(lease
        .report(Outcome::Ok, Some(Duration::from_millis(20)))
        .await
        .unwrap());
    assert_eq!(stored().await, [("ok".to_string(), 20.0)]);
    // Worse: it replaces the ok.
    assert!(lease
        .report(Outcome::Overloaded, Some(Duration::from_millis(900)))
        .await
        .unwrap());
    assert_eq!(stored().await, [("overloaded".to_string(), 900.0)]);
    // Milder, while holding and then on release: the overload stands.
    assert!(lease.report(Outcome::Failed, None).await.unwrap());
    assert_eq!(stored().await, [("overloaded".to_string(), 900.0)]);
    lease
        .release_reporting(Outcome::Ok, Some(Duration::from_millis(5)))
        .await
        .unwrap();
    assert_eq!(stored().await, [("overloaded".to_string(), 900.0)]);
    worker.stop().await;
}
