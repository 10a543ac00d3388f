//! Trust: the guarantees hold beside strangers (a login with no permitq grant), other producers,
//! a full NOTIFY queue, restores and upgrades, races with template maintenance, and a database
//! that stops answering a lease holder.

use permitq_test_support as common;

use std::time::{Duration, SystemTime};

use common::{quiet_config, wait_until, EmbeddedPostgres, TestDb};
use permitq::{Client, ErrorCode, Request, SqlState, State};

const SOON: Duration = Duration::from_secs(10);

/// `url` logging in as `user` with password `pw`.
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a postgres:// URL");
    let host = rest.split_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}:pw@{host}")
}

/// A login role unique to this test database, member of `role` (or of nothing).
async fn login(db: &TestDb, name: &str, role: Option<&str>) -> String {
    let user = format!("{name}_{}", &db.name[db.name.len() - 8..]);
    let member = role.map_or(String::new(), |r| format!(" IN ROLE {r}"));
    db.conn()
        .await
        .batch_execute(&format!("CREATE ROLE {user} LOGIN PASSWORD 'pw'{member}"))
        .await
        .unwrap();
    as_user(&db.url, &user)
}

async fn state(client: &Client, id: &str) -> State {
    client.status(id).await.unwrap().expect("known").state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_holding_advisory_keys_blocks_nothing() {
    let db = TestDb::new().await;
    let stranger = common::connect(&login(&db, "stranger", None).await).await;
    // Every key permitq ever used, and a lock on permitq's own tables, which it cannot take.
    stranger
        .batch_execute(
            "SELECT pg_advisory_lock(k) FROM unnest(ARRAY[1886454016, 1886453761, 1886453762, \
             1886453763, 1886453764, 1886453765, 1886453766, 1886453767, \
             31653311848445041]::bigint[]) k",
        )
        .await
        .unwrap();
    let err = stranger
        .batch_execute("BEGIN; LOCK TABLE permitq.wake_gate IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");

    let client = db.client().await;
    client.migrate().await.unwrap();
    client.set_capacity("s", 1, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    // Grants, releases, the lease sweep and the wait-deadline sweep all go on.
    client
        .submit(
            &Request::new("held")
                .permit("s", 1)
                .ttl(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("held", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    client
        .submit(
            &Request::new("waits")
                .permit("s", 1)
                .wait(Duration::from_secs(30)),
        )
        .await
        .unwrap();
    client
        .submit(
            &Request::new("times-out")
                .permit("s", 1)
                .wait(Duration::from_millis(100)),
        )
        .await
        .unwrap();
    wait_until(
        SOON,
        "the lease expires and the next waiter is granted",
        || async { state(&client, "waits").await == State::Acquired },
    )
    .await;
    let held = client.status("held").await.unwrap().unwrap();
    assert_eq!(held.release_reason, Some(permitq::ReleaseReason::Expired));
    let timed_out = client.status("times-out").await.unwrap().unwrap();
    assert_eq!(timed_out.error_code, Some(ErrorCode::Timeout));
    client.release("waits").await.unwrap();
    drop(stranger);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_go_on_when_the_notify_queue_fills_up() {
    let db = TestDb::new().await;
    let admin = db.conn().await;
    // A queue that counts as full almost at once: the limit far below what the filler writes.
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} SET permitq.notify_queue_limit = '0.000000001'",
            db.name
        ))
        .await
        .unwrap();
    // A listener idle in a transaction keeps the queue from emptying; a filler writes to it
    // (distinct payloads: a transaction's identical notifications are sent once).
    let listener = common::connect(&db.url).await;
    listener.batch_execute("LISTEN filler").await.unwrap();
    listener.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let filler = common::connect(&db.url).await;
    filler
        .batch_execute(
            "SELECT pg_notify('filler', i || repeat('x', 4000)) FROM generate_series(1, 3000) i",
        )
        .await
        .unwrap();
    let usage: f64 = admin
        .query_one("SELECT pg_notification_queue_usage()", &[])
        .await
        .unwrap()
        .get(0);

    assert!(
        usage > 0.000000001,
        "the queue holds the filler's notifications: {usage}"
    );

    let client = db.client().await;
    client.set_capacity("s", 10, None).await.unwrap();
    let (events_listener, mut events) = common::listen(&db.url, "permitq_events").await;
    let _worker = db.worker(quiet_config("w"));
    for i in 0..5 {
        client
            .submit(&Request::new(format!("r{i}")).permit("s", 1))
            .await
            .unwrap();
    }
    // Producers see their outcomes by polling status (wait_settled polls too).
    for i in 0..5 {
        let r = client
            .wait_settled(&format!("r{i}"), SOON)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.state, State::Acquired);
    }
    let skipped: i64 = admin
        .query_one(
            "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM permitq.notify_skipped_seq",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(skipped > 0, "the skipped notifications are counted");
    // Skipped means not sent: no outcome reached a listener while the queue was over its limit.
    assert_eq!(
        common::until_marker(&events_listener, "permitq_events", &mut events).await,
        Vec::<String>::new(),
        "nothing is sent over the queue's limit"
    );
    for i in 0..5 {
        client.release(&format!("r{i}")).await.unwrap();
    }
    drop((listener, filler));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_cannot_act_on_or_read_another_producers_requests() {
    let db = TestDb::new().await;
    let a = Client::connect(&login(&db, "prod_a", Some("permitq_producer")).await)
        .await
        .unwrap();
    let b_url = login(&db, "prod_b", Some("permitq_producer")).await;
    let b = Client::connect(&b_url).await.unwrap();
    let admin = Client::connect(&login(&db, "adm", Some("permitq_admin")).await)
        .await
        .unwrap();
    admin.set_capacity("s", 2, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));

    a.submit(
        &Request::new("a-1")
            .permit("s", 1)
            .ttl(Duration::from_secs(60)),
    )
    .await
    .unwrap();
    assert_eq!(
        a.wait_settled("a-1", SOON).await.unwrap().unwrap().state,
        State::Acquired
    );
    a.submit(
        &Request::new("a-2")
            .permit("s", 1)
            .ttl(Duration::from_millis(300)),
    )
    .await
    .unwrap();
    for refused in [b.release("a-1").await, b.revoke("a-1").await] {
        assert_eq!(
            refused.unwrap_err().code(),
            Some(&SqlState::INSUFFICIENT_PRIVILEGE)
        );
    }
    let err = b.heartbeat("a-1", None).await.unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
    // A request still waiting is A's too: B may not cancel it.
    a.submit(&Request::new("a-wait").permit("s", 2))
        .await
        .unwrap();
    for refused in [b.release("a-wait").await, b.revoke("a-wait").await] {
        assert_eq!(
            refused.unwrap_err().code(),
            Some(&SqlState::INSUFFICIENT_PRIVILEGE)
        );
    }
    assert_eq!(state(&a, "a-wait").await, State::New, "still waiting");
    assert_eq!(
        a.release("a-wait").await.unwrap(),
        permitq::ReleaseOutcome::Cancelled
    );
    let conn_b = common::connect(&b_url).await;
    let err = conn_b
        .batch_execute("SELECT permitq.cancel('a-1')")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
    // Nothing changed, and B reads none of A's requests.
    assert_eq!(state(&a, "a-1").await, State::Acquired);
    assert!(b.status("a-1").await.unwrap().is_none());
    let visible: i64 = conn_b
        .query_one("SELECT count(*) FROM permitq.permit_request", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(visible, 0);
    let none: i64 = conn_b
        .query_one("SELECT count(*) FROM permitq.status('a-1')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(none, 0);
    // Nor may it take A's external_id.
    let err = b
        .submit(
            &Request::new("a-1")
                .permit("s", 1)
                .ttl(Duration::from_secs(60)),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::UNIQUE_VIOLATION), "{err}");
    // It learns nothing of A's request, and is told that ids are one namespace.
    let text = err.to_string();
    assert!(
        !text.contains("asked permits") && text.contains("one namespace for the whole database"),
        "{text}"
    );
    // The owner and admins may; the workers' sweeps are unaffected (a-2's lease expires).
    a.heartbeat("a-1", None).await.unwrap();
    wait_until(SOON, "a-2 granted, then its lease expired", || async {
        state(&a, "a-2").await == State::Released
    })
    .await;
    assert_eq!(
        admin.release("a-1").await.unwrap(),
        permitq::ReleaseOutcome::Released
    );
    // An owner is bounded like an external_id.
    let err = a
        .submit(&Request::new("a-3").permit("s", 1).owner("o".repeat(300)))
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_PARAMETER_VALUE),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_decision_changes_nothing_on_a_request_that_is_not_new() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 5, None).await.unwrap();
    let worker = db.worker(quiet_config("w"));
    for id in ["held", "gone", "failed"] {
        let wait = if id == "failed" {
            Duration::ZERO
        } else {
            Duration::from_secs(10)
        };
        let count = if id == "failed" { 9 } else { 1 };
        client
            .submit(&Request::new(id).permit("s", count).wait(wait))
            .await
            .unwrap();
        client.wait_settled(id, SOON).await.unwrap();
    }
    client.release("gone").await.unwrap();
    common::wait_folded(&db.url).await;
    worker.stop().await;
    let conn = db.conn().await;
    let snapshot = || async {
        conn.query(
            "SELECT external_id, state, fencing_token, acquired_at, settled_at, \
                    (SELECT used FROM permitq.semaphore WHERE name = 's'), \
                    (SELECT granted FROM permitq.semaphore WHERE name = 's') \
             FROM permitq.permit_request ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{:?}",
                (
                    r.get::<_, String>(0),
                    r.get::<_, String>(1),
                    r.get::<_, Option<i64>>(2),
                    r.get::<_, Option<SystemTime>>(3),
                    r.get::<_, Option<SystemTime>>(4),
                    r.get::<_, i64>(5),
                    r.get::<_, i64>(6)
                )
            )
        })
        .collect::<Vec<_>>()
    };
    let before = snapshot().await;
    conn.batch_execute(
        "SELECT permitq.apply_decision('intruder', array_agg(id), '{}', '{}', '{}', '{}') \
         FROM permitq.permit_request;
         SELECT permitq.apply_decision('intruder', '{}', array_agg(id), \
                array_agg('timeout'::text), '{}', '{}') FROM permitq.permit_request;
         SELECT permitq.apply_decision('intruder', '{}', '{}', '{}', array_agg(id), '{}') \
         FROM permitq.permit_request;",
    )
    .await
    .unwrap();
    assert_eq!(snapshot().await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_semaphore_holds_more_than_an_int_without_overflow() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .set_rate_limit("big", 2_000_000_000, Duration::from_millis(500), None)
        .await
        .unwrap();
    let _worker = db.worker(quiet_config("w"));
    for id in ["a", "b"] {
        client
            .submit(&Request::new(id).permit("big", 1_500_000_000))
            .await
            .unwrap();
    }
    for id in ["a", "b"] {
        assert_eq!(
            client.wait_settled(id, SOON).await.unwrap().unwrap().state,
            State::Acquired,
            "{id}: granted once a window has room"
        );
    }
    let usage = client.usage().await.unwrap();
    let big = usage.iter().find(|u| u.name == "big").unwrap();
    assert_eq!(big.held, 3_000_000_000);
}

/// Waits until worker `id` waits for a lock (the test holds it).
async fn waits_for_a_lock(db: &TestDb, id: &str) {
    let conn = db.conn().await;
    let name = format!("permitq {id}");
    wait_until(
        SOON,
        "the worker waits for a lock the test holds",
        || async {
            conn.query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE application_name = $1 \
             AND wait_event_type = 'Lock')",
                &[&name],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_removed_while_its_request_is_decided_is_made_again() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("tmp:*", 1, None).await.unwrap();
    client
        .submit(&Request::new("first").permit("tmp:k", 1))
        .await
        .unwrap();
    let worker = db.worker(quiet_config("w"));
    client.wait_settled("first", SOON).await.unwrap();
    client.release("first").await.unwrap();
    common::wait_folded(&db.url).await;
    worker.stop().await;
    assert!(common::semaphore(&client, "tmp:k").await.is_some());
    // The idle sweep's transaction, held open: it has locked and deleted the instance.
    let mut sweep = db.conn().await;
    let tx = sweep.transaction().await.unwrap();
    tx.batch_execute("DELETE FROM permitq.semaphore WHERE name = 'tmp:k'")
        .await
        .unwrap();
    client
        .submit(&Request::new("second").permit("tmp:k", 1))
        .await
        .unwrap();
    let _worker = db.worker(quiet_config("w2"));
    waits_for_a_lock(&db, "w2").await;
    tx.commit().await.unwrap();
    let second = client.wait_settled("second", SOON).await.unwrap().unwrap();
    assert_eq!(second.state, State::Acquired, "{second:?}");
    assert!(common::semaphore(&client, "tmp:k").await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_change_reaches_an_instance_made_at_the_same_moment() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("tmp:*", 1, None).await.unwrap();
    // The template's change, held open.
    let mut admin = db.conn().await;
    let tx = admin.transaction().await.unwrap();
    tx.batch_execute("SELECT permitq.set_capacity('tmp:*', 5)")
        .await
        .unwrap();
    client
        .submit(&Request::new("r").permit("tmp:k", 1))
        .await
        .unwrap();
    let _worker = db.worker(quiet_config("w"));
    waits_for_a_lock(&db, "w").await;
    tx.commit().await.unwrap();
    client.wait_settled("r", SOON).await.unwrap();
    assert_eq!(
        common::semaphore(&client, "tmp:k").await.unwrap().capacity,
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_makes_at_most_its_bound_of_instances() {
    let db = TestDb::new().await;
    let client = db.client().await;
    db.conn()
        .await
        .batch_execute("SELECT permitq.set_capacity('tenant:*', 1, max_instances => 3)")
        .await
        .unwrap();
    let _worker = db.worker(quiet_config("w"));
    for i in 0..5 {
        client
            .submit(&Request::new(format!("t{i}")).permit(format!("tenant:{i}"), 1))
            .await
            .unwrap();
    }
    let mut codes = Vec::new();
    for i in 0..5 {
        let r = client
            .wait_settled(&format!("t{i}"), SOON)
            .await
            .unwrap()
            .unwrap();
        codes.push(r.error_code);
    }
    assert_eq!(
        codes.iter().filter(|c| c.is_none()).count(),
        3,
        "three instances: {codes:?}"
    );
    assert!(
        codes
            .iter()
            .flatten()
            .all(|c| *c == ErrorCode::TooManyInstances),
        "{codes:?}"
    );
    let err = db
        .conn()
        .await
        .batch_execute("SELECT permitq.set_capacity('plain', 1, max_instances => 3)")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INVALID_PARAMETER_VALUE));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_lost_before_it_runs_out_when_the_database_stops_answering() {
    let db = TestDb::new().await;
    db.client().await.set_capacity("s", 1, None).await.unwrap();
    // The holder logs in as a role of its own, so that new connections can be refused to it.
    let login = db.login("permitq_producer").await;
    let user = login
        .split("://")
        .nth(1)
        .unwrap()
        .split(':')
        .next()
        .unwrap()
        .to_string();
    let url = format!("{login}?application_name=stalled-holder");
    let holder = Client::connect(&url).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let ttl = Duration::from_secs(2);
    let lease = holder
        .acquire(&Request::new("h").permit("s", 1).ttl(ttl), SOON)
        .await
        .unwrap();
    // Let one heartbeat through, then stop every backend of the holder's connections.
    let conn = db.conn().await;
    let heartbeat_at = || async {
        conn.query_one(
            "SELECT heartbeat_at FROM permitq.permit_request WHERE external_id = 'h'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, Option<SystemTime>>(0)
    };
    wait_until(SOON, "a first heartbeat", || async {
        heartbeat_at().await.is_some()
    })
    .await;
    let pids: Vec<i32> = conn
        .query(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'stalled-holder'",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(!pids.is_empty());
    // Its sessions stop answering, and it cannot open new ones (a heartbeat that hangs is sent
    // again on another connection).
    conn.batch_execute(&format!("ALTER ROLE {user} NOLOGIN"))
        .await
        .unwrap();
    for pid in &pids {
        common::signal(u32::try_from(*pid).unwrap(), "STOP");
    }
    let expires: SystemTime = conn
        .query_one(
            "SELECT expires_at FROM permitq.permit_request WHERE external_id = 'h'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let reason = tokio::time::timeout(SOON, lease.lost()).await;
    let lost_at = SystemTime::now();
    for pid in &pids {
        common::signal(u32::try_from(*pid).unwrap(), "CONT");
    }
    let reason = reason.expect("the watchdog declares the lease lost");
    assert!(
        reason.contains("no heartbeat confirmed in time"),
        "{reason}"
    );
    assert!(
        lost_at < expires,
        "lost at {lost_at:?}, before the lease's end {expires:?}"
    );
    drop(lease);
}

/// Grants one request on `url`'s database and returns its token.
async fn grant_one(url: &str, id: &str) -> i64 {
    let client = Client::connect(url).await.unwrap();
    client.set_capacity("t", 100, None).await.unwrap();
    let worker = common::RunningWorker::start(url, quiet_config(&format!("w-{id}")));
    client
        .submit(&Request::new(id).permit("t", 1))
        .await
        .unwrap();
    let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
    worker.stop().await;
    r.fencing_token.expect("granted")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_go_back_after_a_restore_into_a_new_cluster_or_a_sequence_reset() {
    // The source: a cluster promoted to timeline 2, with grants on both timelines.
    let primary = EmbeddedPostgres::start().expect("primary");
    let standby = primary
        .start_standby(&common::THROWAWAY_SETTINGS)
        .expect("standby");
    let url = primary.url("postgres");
    Client::connect(&url)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let before = grant_one(&url, "tl1").await;
    primary.stop(common::StopMode::Immediate).unwrap();
    standby.promote().unwrap();
    let url2 = standby.url("postgres");
    wait_until(
        Duration::from_secs(30),
        "the standby accepts writes",
        || async {
            common::try_connect(&url2).await.is_ok_and(|c| {
                drop(c);
                true
            })
        },
    )
    .await;
    let on_timeline_2 = grant_one(&url2, "tl2").await;
    assert!(on_timeline_2 > before);

    // Dump it, restore it into a fresh cluster (timeline 1), migrate, grant.
    let bin = common::find_bin_dir().unwrap();
    let dump = std::env::temp_dir().join(format!("permitq-dump-{}", std::process::id()));
    let out = std::process::Command::new(bin.join("pg_dump"))
        .args(["--format=custom", "--file"])
        .arg(&dump)
        .args(["--dbname", &url2])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fresh = EmbeddedPostgres::start().expect("fresh cluster");
    let restored = fresh.url("postgres");
    // Roles are the cluster's, not the dump's: an operator creates them first.
    common::connect(&restored)
        .await
        .batch_execute(
            "CREATE ROLE permitq_producer NOLOGIN; CREATE ROLE permitq_worker NOLOGIN; \
             CREATE ROLE permitq_admin NOLOGIN; CREATE ROLE permitq_operator NOLOGIN;",
        )
        .await
        .unwrap();
    let out = std::process::Command::new(bin.join("pg_restore"))
        .args(["--no-owner", "--dbname", &restored])
        .arg(&dump)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&dump);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Client::connect(&restored)
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    let after_restore = grant_one(&restored, "restored").await;
    assert!(
        after_restore > on_timeline_2,
        "{after_restore} after {on_timeline_2}"
    );

    // Logical replication copies rows but not the sequence: a reset sequence, then a worker
    // starts (it raises the epoch).
    common::connect(&restored)
        .await
        .batch_execute("SELECT setval('permitq.fencing_token_seq', 1)")
        .await
        .unwrap();
    let after_reset = grant_one(&restored, "reset").await;
    assert!(
        after_reset > after_restore,
        "{after_reset} after {after_restore}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_never_go_back_after_pg_upgrade() {
    // A cluster promoted to timeline 2, as in production after a failover.
    let primary = EmbeddedPostgres::start().expect("primary");
    let standby = primary
        .start_standby(&common::THROWAWAY_SETTINGS)
        .expect("standby");
    Client::connect(&primary.url("postgres"))
        .await
        .unwrap()
        .migrate()
        .await
        .unwrap();
    primary.stop(common::StopMode::Fast).unwrap();
    standby.promote().unwrap();
    let url = standby.url("postgres");
    wait_until(
        Duration::from_secs(30),
        "the standby accepts writes",
        || async { common::try_connect(&url).await.is_ok() },
    )
    .await;
    let before = grant_one(&url, "before").await;
    assert_eq!(before >> 48, 2, "timeline 2's epoch");
    // pg_upgrade into a new cluster, which writes WAL on timeline 1 again.
    let new = tokio::task::spawn_blocking(move || standby.upgrade())
        .await
        .unwrap()
        .expect("pg_upgrade");
    let url = new.url("postgres");
    // Each grant checks the timeline itself (permitq.token_epoch), before any worker's start-up
    // raises the epoch: the epoch a grant would draw now is already past `before`'s.
    let epoch: i64 = common::connect(&url)
        .await
        .query_one("SELECT permitq.token_epoch()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        epoch >> 48 > before >> 48,
        "a grant right after pg_upgrade draws epoch {} after {}",
        epoch >> 48,
        before >> 48
    );
    let after = grant_one(&url, "after").await;
    assert!(after > before, "{after} after {before}");
}

/// Defence in depth: `apply_decision` refuses grants that would put any level over its
/// capacity, whoever calls it (here a worker login granting two requests of one permit on a
/// semaphore of one, and a child's grant past its parent), and writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn apply_decision_refuses_a_grant_over_capacity_whoever_calls_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("one", 1, None).await.unwrap();
    client.set_capacity("p", 1, None).await.unwrap();
    client
        .set_semaphore("p:c", 5, &permitq::SemaphoreSettings::new().parent("p"))
        .await
        .unwrap();
    for (id, name) in [("a", "one"), ("b", "one"), ("c1", "p:c"), ("c2", "p:c")] {
        client
            .submit(&Request::new(id).permit(name, 1))
            .await
            .unwrap();
    }
    let rogue = common::connect(&login(&db, "rogue", Some("permitq_worker")).await).await;
    for (ids, charges, over) in [
        (["a", "b"], "'{}'", "one"),
        (
            ["c1", "c2"],
            "(SELECT jsonb_object_agg(id::text, '{\"p\": 1, \"p:c\": 1}'::jsonb) FROM permitq.permit_request WHERE external_id IN ('c1', 'c2'))",
            "p",
        ),
    ] {
        let err = rogue
            .query_one(
                &format!(
                    "SELECT permitq.apply_decision('rogue', \
                     (SELECT array_agg(id ORDER BY id) FROM permitq.permit_request WHERE external_id = ANY($1)), \
                     '{{}}', '{{}}', '{{}}', {charges})"
                ),
                &[&&ids[..]],
            )
            .await
            .unwrap_err();
        let db_err = err.as_db_error().expect("a database error");
        assert_eq!(db_err.code(), &SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE, "{db_err:?}");
        assert!(
            db_err.message() == format!("refusing grants that would put {over} over capacity"),
            "{}",
            db_err.message()
        );
    }
    let granted: i64 = db
        .conn()
        .await
        .query_one(
            "SELECT count(*) FROM permitq.permit_request WHERE state <> 'new'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(granted, 0, "nothing written");
    // Leaving the parent out of the charges does not skip it.
    let err = rogue
        .query_one(
            "SELECT permitq.apply_decision('rogue', \
             (SELECT array_agg(id) FROM permitq.permit_request WHERE external_id = 'c1'), \
             '{}', '{}', '{}', '{}')",
            &[],
        )
        .await
        .unwrap_err();
    let db_err = err.as_db_error().expect("a database error");
    assert_eq!(
        db_err.code(),
        &SqlState::INVALID_PARAMETER_VALUE,
        "{db_err:?}"
    );
    assert!(
        db_err.message().contains("every ancestor"),
        "{}",
        db_err.message()
    );
    // A rate limit's window counts: a second grant in an hour of a limit of one is refused.
    client
        .set_semaphore(
            "api",
            1,
            &permitq::SemaphoreSettings::new().per(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    for id in ["r1", "r2"] {
        client
            .submit(&Request::new(id).permit("api", 1))
            .await
            .unwrap();
    }
    let apply = |id: &'static str| {
        let rogue = &rogue;
        async move {
            rogue
                .query_one(
                    "SELECT permitq.apply_decision('rogue', \
                     (SELECT array_agg(id) FROM permitq.permit_request WHERE external_id = $1), \
                     '{}', '{}', '{}', '{}')",
                    &[&id],
                )
                .await
        }
    };
    apply("r1").await.unwrap();
    let err = apply("r2").await.unwrap_err();
    let db_err = err.as_db_error().expect("a database error");
    assert_eq!(
        db_err.code(),
        &SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE,
        "{db_err:?}"
    );
    assert_eq!(
        db_err.message(),
        "refusing grants that would put api over capacity"
    );
    // A worker grants them in turn, as the decision says.
    let _worker = db.worker(quiet_config("w"));
    let r = client.wait_settled("a", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired);
}

/// After a promotion, a producer's transaction held open cannot stretch the leases' grace: the
/// grace is recorded by the workers, and reading it takes no lock. (The promotion is simulated:
/// the recorded timeline is not the server's.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_producer_transaction_cannot_keep_expired_leases_alive_after_a_promotion() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let mut config = quiet_config("w");
    config.maintenance.sweep_interval = Duration::from_millis(100);
    let _worker = db.worker(config);
    client
        .submit(
            &Request::new("short")
                .permit("s", 1)
                .ttl(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    let token = client
        .wait_settled("short", SOON)
        .await
        .unwrap()
        .unwrap()
        .fencing_token
        .expect("granted");
    db.conn()
        .await
        .batch_execute("UPDATE permitq.lease_grace SET timeline = timeline + 7")
        .await
        .unwrap();
    let producer = common::connect(&login(&db, "idler", Some("permitq_producer")).await).await;
    producer
        .batch_execute("BEGIN; SELECT permitq.lease_grace_since(); SELECT permitq.fence('r', 1)")
        .await
        .unwrap();
    // Run out: one ttl, plus the grace of one ttl from when a worker recorded the timeline.
    wait_until(Duration::from_secs(8), "the lease expires", || async {
        client.status("short").await.unwrap().unwrap().state == State::Released
    })
    .await;
    let r = client.status("short").await.unwrap().unwrap();
    assert_eq!(r.release_reason, Some(permitq::ReleaseReason::Expired));
    assert!(
        !client.fence("s", "r", token).await.unwrap(),
        "its token fences nothing"
    );
    producer.batch_execute("ROLLBACK").await.unwrap();
}

/// A producer idle in a transaction after a submit holds the wake gate: the workers poll
/// instead of sleeping, backing off to the poll interval, not a pass every millisecond; and
/// the other producers' requests are still granted at once (they notify).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_idle_in_a_transaction_does_not_make_workers_busy_poll() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 100, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let idler = common::connect(&login(&db, "idler", Some("permitq_producer")).await).await;
    idler
        .batch_execute("BEGIN; SELECT permitq.submit('idle-1', '{\"s\": 1}')")
        .await
        .unwrap();
    // The worker wakes for another request, grants it, and would sleep: the gate is taken.
    client
        .submit(&Request::new("other").permit("s", 1))
        .await
        .unwrap();
    client.wait_settled("other", SOON).await.unwrap();
    let commits = || async {
        let conn = db.conn().await;
        conn.batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .unwrap();
        let n: i64 = conn
            .query_one(
                "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        n
    };
    // Past the back-off's first second, then measure three seconds.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = commits().await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let per_second = (commits().await - before) / 3;
    assert!(
        per_second < 60,
        "{per_second} transactions a second while a producer idles in a transaction"
    );
    // Others still go at once.
    let started = std::time::Instant::now();
    client
        .submit(&Request::new("later").permit("s", 1))
        .await
        .unwrap();
    let r = client.wait_settled("later", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired);
    assert!(
        started.elapsed() < Duration::from_millis(800),
        "{:?}",
        started.elapsed()
    );
    idler.batch_execute("ROLLBACK").await.unwrap();
}

/// A producer holding nothing cannot fence others out with a genuine token read from another
/// producer's request; a resource is guarded by the semaphore it was first fenced with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_fences_only_for_its_own_holder_and_the_semaphore_guarding_the_resource() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.set_capacity("reports", 5, None).await.unwrap();
    admin.set_capacity("other", 5, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let p1 = Client::connect(&login(&db, "prod1", Some("permitq_producer")).await)
        .await
        .unwrap();
    let p2 = Client::connect(&login(&db, "prod2", Some("permitq_producer")).await)
        .await
        .unwrap();
    for (client, id, name) in [(&p1, "p1-job", "reports"), (&p1, "p1-other", "other")] {
        client
            .submit(&Request::new(id).permit(name, 1))
            .await
            .unwrap();
        client.wait_settled(id, SOON).await.unwrap();
    }
    let token = |id: &'static str| {
        let admin = admin.clone();
        async move {
            admin
                .status(id)
                .await
                .unwrap()
                .unwrap()
                .fencing_token
                .unwrap()
        }
    };
    let (job, other) = (token("p1-job").await, token("p1-other").await);
    // prod2 holds nothing: prod1's genuine, higher token fences nothing for it.
    assert!(!p2
        .fence("reports", "reports/2027-01", other.max(job))
        .await
        .unwrap());
    assert!(!p2.fence("reports", "reports/2027-01", job).await.unwrap());
    // The deprecated signature is held to the same rule.
    let conn2 = common::connect(&login(&db, "prod2b", Some("permitq_producer")).await).await;
    let accepted: bool = conn2
        .query_one("SELECT permitq.fence('reports/2027-01', $1)", &[&job])
        .await
        .unwrap()
        .get(0);
    assert!(!accepted);
    // prod1 fences with its own token of the guarding semaphore; its token of another
    // semaphore counts for nothing there.
    assert!(p1.fence("reports", "reports/2027-01", job).await.unwrap());
    assert!(
        !p1.fence("other", "reports/2027-02", job).await.unwrap(),
        "job holds no `other`"
    );
    // Fences are kept per semaphore: a holder of another semaphore fencing the same name (with a
    // higher token) takes nothing from the holders of `reports`, nor they from it.
    assert!(p1.fence("other", "reports/2027-01", other).await.unwrap());
    assert!(p1.fence("reports", "reports/2027-01", job).await.unwrap());
    let p2_url = login(&db, "prod2c", Some("permitq_producer")).await;
    let p2c = Client::connect(&p2_url).await.unwrap();
    p2c.submit(&Request::new("p2-other").permit("other", 1))
        .await
        .unwrap();
    p2c.wait_settled("p2-other", SOON).await.unwrap();
    let squat = token("p2-other").await;
    assert!(p2c.fence("other", "reports/2027-03", squat).await.unwrap());
    assert!(
        p1.fence("reports", "reports/2027-03", job).await.unwrap(),
        "a name fenced first under another semaphore is not taken from reports' holders"
    );
}

/// Reads follow ownership: through every view a producer sees only its own requests (with its
/// true place in line), an operator sees all and can change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_read_only_their_own_requests_through_the_views_and_operators_read_all() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.set_capacity("s", 1, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let a = Client::connect(&login(&db, "pa", Some("permitq_producer")).await)
        .await
        .unwrap();
    let b_url = login(&db, "pb", Some("permitq_producer")).await;
    let b = Client::connect(&b_url).await.unwrap();
    a.submit(&Request::new("a-held").permit("s", 1))
        .await
        .unwrap();
    a.wait_settled("a-held", SOON).await.unwrap();
    a.submit(&Request::new("a-wait").permit("s", 1))
        .await
        .unwrap();
    b.submit(&Request::new("b-wait").permit("s", 1))
        .await
        .unwrap();
    wait_until(SOON, "both waiting are examined", || async {
        admin.waiters("s", 10).await.unwrap().len() == 2
    })
    .await;
    let conn_b = common::connect(&b_url).await;
    let count = |sql: &'static str| {
        let conn = &conn_b;
        async move { conn.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    assert_eq!(count("SELECT count(*) FROM permitq.holders").await, 0);
    assert_eq!(count("SELECT count(*) FROM permitq.permit").await, 0);
    let own: Vec<(String, i64)> = conn_b
        .query("SELECT external_id, position FROM permitq.waiters", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        own,
        [("b-wait".to_string(), 2)],
        "its own row, at its true place"
    );
    assert_eq!(count("SELECT held FROM permitq.semaphore_usage").await, 1);
    // Explain tells B how long A's permit is held, not which request holds it.
    let why = b.explain("b-wait").await.unwrap().unwrap();
    let holders: Vec<&str> = why.semaphores[0]
        .holders
        .iter()
        .map(|h| h.external_id.as_str())
        .collect();
    assert_eq!(holders, ["(another login's request)"]);
    // An operator reads everything and writes nothing.
    let operator_url = login(&db, "op", Some("permitq_operator")).await;
    let operator = Client::connect(&operator_url).await.unwrap();
    assert_eq!(operator.holders("s").await.unwrap().len(), 1);
    assert_eq!(operator.waiters("s", 10).await.unwrap().len(), 2);
    assert!(operator.status("a-held").await.unwrap().is_some());
    assert!(operator.explain("b-wait").await.unwrap().is_some());
    for err in [
        operator.release("a-held").await.unwrap_err(),
        operator
            .submit(&Request::new("op-1").permit("s", 1))
            .await
            .unwrap_err(),
        operator.set_capacity("s", 5, None).await.unwrap_err(),
    ] {
        assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
    }
}

/// The capacity audit names the login that changed a semaphore (the functions run as the
/// schema's owner), and a producer's explain does not name another login's first in line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_names_the_login_and_explain_names_only_a_producers_own_head() {
    let db = TestDb::new().await;
    let admin_url = login(&db, "ops", Some("permitq_admin")).await;
    let admin = Client::connect(&admin_url).await.unwrap();
    admin.set_capacity("s", 2, None).await.unwrap();
    let user = common::user_of(&admin_url);
    let history = admin.capacity_history("s").await.unwrap();
    assert_eq!(history[0].changed_by, user);
    let _worker = db.worker(quiet_config("w"));
    let a = Client::connect(&login(&db, "pa", Some("permitq_producer")).await)
        .await
        .unwrap();
    let b = Client::connect(&login(&db, "pb", Some("permitq_producer")).await)
        .await
        .unwrap();
    a.submit(&Request::new("a-held").permit("s", 1))
        .await
        .unwrap();
    a.wait_settled("a-held", SOON).await.unwrap();
    a.submit(&Request::new("a-big").permit("s", 2))
        .await
        .unwrap();
    b.submit(&Request::new("b-small").permit("s", 1))
        .await
        .unwrap();
    wait_until(
        SOON,
        "b-small is examined and waits behind a-big",
        || async {
            b.explain("b-small")
                .await
                .unwrap()
                .is_some_and(|e| e.semaphores.iter().any(|s| s.reason.starts_with("fair:")))
        },
    )
    .await;
    let reason = b.explain("b-small").await.unwrap().unwrap().semaphores[0]
        .reason
        .clone();
    assert!(
        reason.starts_with("fair: request (another login's) is first in line")
            && !reason.contains("a-big"),
        "{reason}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_listening_to_events_learns_only_request_ids() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.set_capacity("s", 1, None).await.unwrap();
    let stranger_url = login(&db, "listener", None).await;
    let (stranger, mut events) = common::listen(&stranger_url, "permitq_events").await;
    let _worker = db.worker(quiet_config("w"));
    let producer = Client::connect(&login(&db, "pe", Some("permitq_producer")).await)
        .await
        .unwrap();
    let held = producer
        .submit(&Request::new("secret-held").permit("s", 1).ttl(SOON))
        .await
        .unwrap();
    let granted = producer
        .wait_settled("secret-held", SOON)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        granted.state,
        State::Acquired,
        "the client still wakes on ids"
    );
    let token = granted.fencing_token.unwrap().to_string();
    producer
        .submit(&Request::new("secret-fails").permit("s", 2))
        .await
        .unwrap();
    producer.wait_settled("secret-fails", SOON).await.unwrap();
    producer.release("secret-held").await.unwrap();
    common::wait_folded(&db.url).await;
    let payloads = common::until_marker(&stranger, "permitq_events", &mut events).await;
    let ids: Vec<i64> = payloads.iter().flat_map(|p| common::event_ids(p)).collect();
    assert!(ids.contains(&held.id), "{payloads:?}");
    for p in &payloads {
        for secret in [
            "secret",
            &token,
            "acquired",
            "exceeds_capacity",
            "released",
            "\"s\"",
        ] {
            assert!(!p.contains(secret), "{secret} in {p}");
        }
    }
    // And what an id names stays unreadable to it.
    let err = stranger
        .query_one("SELECT permitq.status('secret-held')", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INSUFFICIENT_PRIVILEGE), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_own_condition_on_a_view_sees_no_other_logins_rows() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.set_capacity("s", 1, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let bob = Client::connect(&login(&db, "bob", Some("permitq_producer")).await)
        .await
        .unwrap();
    bob.submit(&Request::new("bob-held").permit("s", 1))
        .await
        .unwrap();
    bob.wait_settled("bob-held", SOON).await.unwrap();
    bob.submit(&Request::new("bob-waits").permit("s", 1))
        .await
        .unwrap();
    wait_until(SOON, "bob's second request waits", || async {
        admin.waiters("s", 10).await.unwrap().len() == 1
    })
    .await;
    let alice = common::connect(&login(&db, "alice", Some("permitq_producer")).await).await;
    // A condition that fails on another login's row: evaluated before the view's own filter, it
    // would raise (division by zero) or, as a function of the caller's, print what it saw.
    for view in ["holders", "waiters"] {
        let sql = format!(
            "SELECT count(*) FROM permitq.{view} \
             WHERE 1 / (CASE WHEN external_id LIKE 'bob%' THEN 0 ELSE 1 END) = 1"
        );
        let n: i64 = alice.query_one(&sql, &[]).await.unwrap().get(0);
        assert_eq!(n, 0, "{view}");
    }
    let n: i64 = alice
        .query_one(
            "SELECT count(*) FROM permitq.permit WHERE 1 / (CASE WHEN request_id > 0 THEN 0 ELSE 1 END) = 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 0);
    alice
        .batch_execute(
            "CREATE FUNCTION pg_temp.leak(t text) RETURNS boolean LANGUAGE plpgsql COST 0.0000001
             AS $$ BEGIN RAISE EXCEPTION 'saw %', t; END $$",
        )
        .await
        .unwrap();
    for view in ["holders", "waiters"] {
        let n: i64 = alice
            .query_one(
                &format!("SELECT count(*) FROM permitq.{view} WHERE pg_temp.leak(external_id)"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 0, "{view}");
    }
}

/// A producer cannot read others' requests through the views by putting its own `=` ahead of
/// pg_catalog's on its search_path: the ownership functions name pg_catalog's operators.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_own_operator_on_its_search_path_reads_nothing_more() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.set_capacity("gpu", 4, None).await.unwrap();
    admin
        .submit(&Request::new("admins").permit("gpu", 1))
        .await
        .unwrap();
    let producer_url = login(&db, "hijacker", Some("permitq_producer")).await;
    let user = common::user_of(&producer_url);
    db.conn()
        .await
        .batch_execute(&format!("CREATE SCHEMA evil AUTHORIZATION {user}"))
        .await
        .unwrap();
    let producer = common::connect(&producer_url).await;
    producer
        .batch_execute(
            "CREATE FUNCTION evil.yes(text, name) RETURNS boolean LANGUAGE sql AS 'SELECT true';
             CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = name, FUNCTION = evil.yes);
             CREATE FUNCTION evil.yes2(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
             CREATE OPERATOR evil.= (LEFTARG = text, RIGHTARG = text, FUNCTION = evil.yes2);
             SET search_path = evil, pg_catalog",
        )
        .await
        .unwrap();
    let seen: i64 = producer
        .query_one(
            "SELECT count(*) FROM permitq.waiters WHERE external_id = 'admins'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 0, "another login's request read through the view");
}
