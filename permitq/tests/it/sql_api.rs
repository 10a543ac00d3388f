//! The SQL API against real PostgreSQL: validation, idempotency, triggers, release outcomes,
//! the capacity audit and fencing.

use permitq_test_support as common;

use std::time::Duration;

use common::TestDb;
use futures_util::future::join_all;
use permitq::{Request, SqlState};

async fn request_count(conn: &tokio_postgres::Client) -> i64 {
    conn.query_one("SELECT count(*) FROM permitq.permit_request", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn every_bad_submit_is_rejected_with_22023_naming_the_field_and_writes_nothing() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    let long_id = "x".repeat(256);
    let many: String = (0..65)
        .map(|i| format!("\"s{i}\": 1"))
        .collect::<Vec<_>>()
        .join(",");
    let many = format!("{{{many}}}");
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "external_id",
            "permitq.submit('', '{\"a\":1}')".into(),
            "empty external_id",
        ),
        (
            "external_id",
            format!("permitq.submit('{long_id}', '{{\"a\":1}}')"),
            "256 chars",
        ),
        (
            "external_id",
            "permitq.submit(NULL, '{\"a\":1}')".into(),
            "null external_id",
        ),
        ("permits", "permitq.submit('r', '[1]')".into(), "array"),
        ("permits", "permitq.submit('r', '\"a\"')".into(), "string"),
        (
            "permits",
            "permitq.submit('r', '{}')".into(),
            "empty object",
        ),
        (
            "permits",
            "permitq.submit('r', NULL)".into(),
            "null permits",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"a\":0}')".into(),
            "zero count",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"a\":-3}')".into(),
            "negative count",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"a\":1.5}')".into(),
            "fractional count",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"a\":\"1\"}')".into(),
            "string count",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"a\":null}')".into(),
            "null count",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"a\":2147483648}')".into(),
            "count too large",
        ),
        (
            "permits",
            "permitq.submit('r', '{\"\":1}')".into(),
            "empty semaphore name",
        ),
        (
            "permits",
            format!("permitq.submit('r', '{many}')"),
            "65 semaphores",
        ),
        (
            "ttl",
            "permitq.submit('r', '{\"a\":1}', ttl => '-1s')".into(),
            "negative ttl",
        ),
        (
            "ttl",
            "permitq.submit('r', '{\"a\":1}', ttl => '0')".into(),
            "zero ttl",
        ),
        (
            "wait",
            "permitq.submit('r', '{\"a\":1}', wait => '-5 minutes')".into(),
            "negative wait",
        ),
        (
            "ttl",
            "permitq.submit('r', '{\"a\":1}', ttl => '1 mon -30 days 00:00:00.000001')".into(),
            "a ttl of mixed signs (negative in February)",
        ),
        (
            "ttl",
            "permitq.submit('r', '{\"a\":1}', ttl => '121 months')".into(),
            "121 months, past 10 years",
        ),
    ];
    for (field, call, what) in cases {
        let err = conn
            .query_one(&format!("SELECT * FROM {call}"), &[])
            .await
            .expect_err(what);
        let db_err = err
            .as_db_error()
            .unwrap_or_else(|| panic!("{what}: not a database error: {err}"));
        assert_eq!(
            db_err.code(),
            &SqlState::INVALID_PARAMETER_VALUE,
            "{what}: {}",
            db_err.message()
        );
        assert!(
            db_err.message().contains(field),
            "{what}: message {:?} must name {field}",
            db_err.message()
        );
        assert_eq!(request_count(&conn).await, 0, "{what} wrote a row");
    }
    // 64 semaphores and the largest count are fine.
    let ok: String = (0..64)
        .map(|i| format!("\"s{i}\": 2147483647"))
        .collect::<Vec<_>>()
        .join(",");
    conn.execute(&format!("SELECT permitq.submit('ok', '{{{ok}}}')"), &[])
        .await
        .unwrap();
    assert_eq!(request_count(&conn).await, 1);
    // Ten years exactly, as months, is the longest ttl.
    conn.execute(
        "SELECT permitq.submit('decade', '{\"a\":1}', ttl => '120 months')",
        &[],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn explain_of_counts_past_an_integer_under_one_parent_answers() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("p", 10, None).await.unwrap();
    for child in ["p:a", "p:b"] {
        client
            .set_semaphore(child, 10, &permitq::SemaphoreSettings::new().parent("p"))
            .await
            .unwrap();
    }
    let conn = db.conn().await;
    conn.execute(
        "SELECT permitq.submit('huge', '{\"p:a\": 2147483647, \"p:b\": 2147483647}')",
        &[],
    )
    .await
    .unwrap();
    let rows = conn
        .query(
            "SELECT semaphore, needs, shortfall FROM permitq.explain('huge') ORDER BY semaphore",
            &[],
        )
        .await
        .unwrap();
    let parent = rows
        .iter()
        .find(|r| r.get::<_, String>(0) == "p")
        .expect("the parent's row");
    assert_eq!(
        parent.get::<_, i32>(1),
        i32::MAX,
        "the most an integer holds"
    );
    assert_eq!(parent.get::<_, i32>(2), i32::MAX - 10);
}

#[tokio::test]
async fn other_bad_inputs_are_rejected_and_write_nothing() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    for (call, field) in [
        ("permitq.set_capacity('', 1)", "name"),
        ("permitq.set_capacity(NULL, 1)", "name"),
        ("permitq.set_capacity('s', -1)", "capacity"),
        ("permitq.set_capacity('s', NULL)", "capacity"),
        ("permitq.fence('', 1)", "resource"),
        ("permitq.fence('r', NULL)", "token"),
        ("permitq.fence(repeat('r', 1000000), 1)", "resource"),
        ("permitq.fence('', 'r', 1)", "semaphore"),
        ("permitq.fence('s', '', 1)", "resource"),
        ("permitq.fence('s', 'r', NULL)", "token"),
        // A semaphore nothing has: a typo, not a stale token.
        (
            "permitq.fence('s', 'r', 1)",
            "invalid semaphore s: no semaphore or template",
        ),
        ("permitq.heartbeat('x', '-1s')", "extend"),
    ] {
        let err = conn
            .query_one(&format!("SELECT {call}"), &[])
            .await
            .expect_err(call);
        let db_err = err.as_db_error().unwrap();
        assert_eq!(db_err.code(), &SqlState::INVALID_PARAMETER_VALUE, "{call}");
        assert!(
            db_err.message().contains(field),
            "{call}: {}",
            db_err.message()
        );
    }
    let counts: (i64, i64, i64) = {
        let r = conn
            .query_one(
                "SELECT (SELECT count(*) FROM permitq.semaphore), (SELECT count(*) FROM permitq.fence_token),
                        (SELECT count(*) FROM permitq.capacity_change)",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!(counts, (0, 0, 0));
}

#[tokio::test]
async fn plain_inserts_are_validated_by_constraints() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    for (values, what) in [
        ("('a', '{\"s\":0}')", "zero count"),
        ("('', '{\"s\":1}')", "empty external_id"),
        ("('a', '[]')", "not an object"),
        ("('a', '{}')", "empty"),
    ] {
        let err = conn
            .execute(
                &format!(
                    "INSERT INTO permitq.permit_request (external_id, permits) VALUES {values}"
                ),
                &[],
            )
            .await
            .expect_err(what);
        assert_eq!(
            err.code(),
            Some(&SqlState::CHECK_VIOLATION),
            "{what}: {err}"
        );
    }
    let err = conn
        .execute("INSERT INTO permitq.permit_request (external_id, permits, ttl) VALUES ('a', '{\"s\":1}', '-1s')", &[])
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(&SqlState::INVALID_PARAMETER_VALUE));
    assert!(format!("{err:?}").contains("invalid ttl"), "{err:?}");
    for (column, value) in [("ttl", "3654 days"), ("wait", "11 years"), ("wait", "-1s")] {
        let err = conn
            .execute(&format!("INSERT INTO permitq.permit_request (external_id, permits, {column}) VALUES ('a', '{{\"s\":1}}', '{value}')"), &[])
            .await
            .unwrap_err();
        assert_eq!(
            err.code(),
            Some(&SqlState::INVALID_PARAMETER_VALUE),
            "{column} {value}"
        );
        assert!(
            format!("{err:?}").contains(&format!("invalid {column}")),
            "{err:?}"
        );
    }
    let err = conn
        .execute("INSERT INTO permitq.permit_request (external_id, permits, state) VALUES ('a', '{\"s\":1}', 'acquired')", &[])
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_PARAMETER_VALUE),
        "{err}"
    );
    assert_eq!(request_count(&conn).await, 0);
    // A valid plain insert works, and ON CONFLICT DO NOTHING keeps one row.
    for _ in 0..2 {
        conn.execute(
            "INSERT INTO permitq.permit_request (external_id, permits, owner, ttl, wait)
             VALUES ('p1', '{\"s\": 2}', 'me', '30s', '5s') ON CONFLICT (external_id) DO NOTHING",
            &[],
        )
        .await
        .unwrap();
    }
    assert_eq!(request_count(&conn).await, 1);
    let row = conn
        .query_one("SELECT state, wait_until - created_at FROM permitq.permit_request WHERE external_id = 'p1'", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "new");
}

/// Notifications on permitq_work before a marker sent after `sql` (they arrive in commit order).
async fn work_notifications(db: &TestDb, sql: &str) -> usize {
    let (_listener, mut rx) = common::listen(&db.url, "permitq_work").await;
    db.conn()
        .await
        .batch_execute(&format!("{sql}; NOTIFY permitq_work, 'marker';"))
        .await
        .unwrap();
    let mut before_marker = 0;
    loop {
        let payload = tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .unwrap()
            .unwrap();
        if payload == "marker" {
            return before_marker;
        }
        before_marker += 1;
    }
}

#[tokio::test]
async fn inserts_wake_a_sleeping_worker_once_per_statement_and_an_awake_one_never() {
    let db = TestDb::new().await;
    let inserts = |tag: &str| {
        format!(
            "INSERT INTO permitq.permit_request (external_id, permits)
             SELECT '{tag}-' || i, '{{\"s\":1}}' FROM generate_series(1, 50) i;
             INSERT INTO permitq.permit_request (external_id, permits) VALUES ('{tag}-1', '{{\"s\":1}}')
             ON CONFLICT (external_id) DO NOTHING;
             SELECT permitq.submit('{tag}-x', '{{\"s\":1}}')"
        )
    };
    // No worker has said it sleeps: no notification at all.
    assert_eq!(work_notifications(&db, &inserts("a")).await, 0);
    // A worker that is awake: none either.
    db.conn()
        .await
        .batch_execute(
            "INSERT INTO permitq.worker_wake VALUES ('w-awake', false, now() + interval '1 hour')",
        )
        .await
        .unwrap();
    assert_eq!(work_notifications(&db, &inserts("b")).await, 0);
    // A sleeping worker: woken (50 rows in one statement, a no-op insert and a submit, in one
    // transaction: PostgreSQL folds identical notifications of a transaction into one).
    db.conn()
        .await
        .batch_execute(
            "INSERT INTO permitq.worker_wake VALUES ('w-asleep', true, now() + interval '1 hour')",
        )
        .await
        .unwrap();
    assert_eq!(work_notifications(&db, &inserts("c")).await, 1);
    // A worker that died asleep (its row's awake_by has passed) no longer counts.
    db.conn()
        .await
        .batch_execute("UPDATE permitq.worker_wake SET awake_by = now() - interval '1 second' WHERE worker_id = 'w-asleep'")
        .await
        .unwrap();
    assert_eq!(work_notifications(&db, &inserts("d")).await, 0);
}

#[tokio::test]
async fn submit_is_idempotent_and_rejects_other_parameters_with_23505() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    let first: i64 = conn
        .query_one(
            "SELECT id FROM permitq.submit('job', '{\"a\":1,\"b\":2}', 'me', '60s', '5s')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Same parameters, spelled differently (key order, equal intervals): the same row.
    let again: i64 = conn
        .query_one("SELECT id FROM permitq.submit('job', '{\"b\":2,\"a\":1}', 'me', '1 minute', '5000 ms')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(first, again);
    for call in [
        "permitq.submit('job', '{\"a\":1,\"b\":3}', 'me', '60s', '5s')",
        "permitq.submit('job', '{\"a\":1}', 'me', '60s', '5s')",
        "permitq.submit('job', '{\"a\":1,\"b\":2}', 'you', '60s', '5s')",
        "permitq.submit('job', '{\"a\":1,\"b\":2}', NULL, '60s', '5s')",
        "permitq.submit('job', '{\"a\":1,\"b\":2}', 'me', '61s', '5s')",
        "permitq.submit('job', '{\"a\":1,\"b\":2}', 'me', '60s', NULL)",
    ] {
        let err = conn
            .query_one(&format!("SELECT * FROM {call}"), &[])
            .await
            .expect_err(call);
        assert_eq!(err.code(), Some(&SqlState::UNIQUE_VIOLATION), "{call}");
    }
    // Whatever its state, the same submit returns the row unchanged.
    assert_eq!(
        conn.query_one("SELECT permitq.release('job')", &[])
            .await
            .unwrap()
            .get::<_, String>(0),
        "cancelled"
    );
    let row = conn
        .query_one("SELECT id, state, error_code FROM permitq.submit('job', '{\"a\":1,\"b\":2}', 'me', '60s', '5s')", &[])
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, String>(1)),
        (first, "error".to_string())
    );
    assert_eq!(row.get::<_, String>(2), "cancelled");
    assert_eq!(request_count(&conn).await, 1);
}

#[tokio::test]
async fn sixteen_concurrent_same_key_submits_give_one_row() {
    let db = TestDb::new().await;
    let mut conns = Vec::new();
    for _ in 0..16 {
        conns.push(db.conn().await);
    }
    for round in 0..5 {
        let key = format!("race-{round}");
        let results = join_all(conns.iter().map(|c| {
            let key = key.clone();
            async move {
                c.query_one("SELECT id FROM permitq.submit($1, '{\"s\": 1}')", &[&key])
                    .await
            }
        }))
        .await;
        let ids: Vec<i64> = results
            .into_iter()
            .map(|r| r.expect("every racer succeeds").get(0))
            .collect();
        assert!(
            ids.windows(2).all(|w| w[0] == w[1]),
            "all racers get the same row: {ids:?}"
        );
        let n: i64 = conns[0]
            .query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE external_id = $1",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);
    }
}

#[tokio::test]
async fn status_and_release_outcomes_without_a_worker() {
    let db = TestDb::new().await;
    let client = db.client().await;
    assert!(client.status("nope").await.unwrap().is_none());
    let conn = db.conn().await;
    let rows = conn
        .query("SELECT * FROM permitq.status('nope')", &[])
        .await
        .unwrap();
    assert!(rows.is_empty(), "status of an unknown id returns no row");
    assert_eq!(
        client.release("nope").await.unwrap(),
        permitq::ReleaseOutcome::Unknown
    );
    client
        .submit(&permitq::Request::new("w").permit("s", 1))
        .await
        .unwrap();
    assert_eq!(
        client.release("w").await.unwrap(),
        permitq::ReleaseOutcome::Cancelled
    );
    assert_eq!(
        client.release("w").await.unwrap(),
        permitq::ReleaseOutcome::NotAcquired
    );
    let r = client.status("w").await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.error_code),
        (permitq::State::Error, Some(permitq::ErrorCode::Cancelled))
    );
    assert!(r.settled_at.is_some());
}

#[tokio::test]
async fn set_capacity_creates_changes_and_audits() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let s = client.set_capacity("gpu", 4, None).await.unwrap();
    assert_eq!(
        (s.capacity, s.used, s.fair),
        (4, 0, true),
        "fair by default"
    );
    let s = client.set_capacity("gpu", 2, Some(false)).await.unwrap();
    assert_eq!((s.capacity, s.fair), (2, false));
    let s = client.set_capacity("gpu", 2, None).await.unwrap();
    assert!(!s.fair, "fair = NULL keeps the current mode");
    let conn = db.conn().await;
    conn.execute(
        "UPDATE permitq.semaphore SET capacity = 9 WHERE name = 'gpu'",
        &[],
    )
    .await
    .unwrap();
    let history = client.capacity_history("gpu").await.unwrap();
    let changes: Vec<(Option<i64>, i64)> = history
        .iter()
        .map(|c| (c.old_capacity, c.new_capacity))
        .collect();
    assert_eq!(
        changes,
        [(None, 4), (Some(4), 2), (Some(2), 2), (Some(2), 9)]
    );
    assert!(history
        .iter()
        .all(|c| c.changed_by == "postgres" && c.changed_at.is_some()));
    assert_eq!(history[1].old_fair, Some(true));
    assert!(!history[1].new_fair);
}

/// Grants `n` requests (`prefix-0`..) on a semaphore of room enough and returns their tokens
/// (the requests stay held).
async fn held_tokens(db: &TestDb, prefix: &str, n: usize, ttl: Option<Duration>) -> Vec<i64> {
    let client = db.client().await;
    client.set_capacity("fenced", 1000, None).await.unwrap();
    let worker = db.notified_worker(&format!("{prefix}-w"));
    let mut tokens = Vec::new();
    for i in 0..n {
        let mut request = Request::new(format!("{prefix}-{i}")).permit("fenced", 1);
        if let Some(ttl) = ttl {
            request = request.ttl(ttl);
        }
        client.submit(&request).await.unwrap();
        let granted = client
            .wait_settled(&request.external_id, Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap();
        tokens.push(granted.fencing_token.expect("granted"));
    }
    worker.stop().await;
    tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_accepts_equal_or_higher_tokens_atomically() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let t = held_tokens(&db, "f", 4, None).await;
    assert!(client.fence("fenced", "file", t[1]).await.unwrap());
    assert!(
        client.fence("fenced", "file", t[1]).await.unwrap(),
        "the same token again is the same holder"
    );
    assert!(!client.fence("fenced", "file", t[0]).await.unwrap());
    assert!(
        client.fence("fenced", "other", t[0]).await.unwrap(),
        "resources are independent"
    );
    assert!(client.fence("fenced", "file", t[3]).await.unwrap());
    assert!(!client.fence("fenced", "file", t[2]).await.unwrap());

    // Concurrent fences: the survivor is the highest token, and no lower token is accepted
    // after a higher one (checked in commit order through the returned flags).
    let tokens = held_tokens(&db, "race", 20, None).await;
    let highest = *tokens.iter().max().unwrap();
    let results = join_all(tokens.iter().rev().map(|t| {
        let client = client.clone();
        let t = *t;
        async move { (t, client.fence("fenced", "race", t).await.unwrap()) }
    }))
    .await;
    assert!(
        results.iter().any(|(t, ok)| *t == highest && *ok),
        "the highest token is always accepted"
    );
    let conn = db.conn().await;
    let stored: i64 = conn
        .query_one(
            "SELECT token FROM permitq.fence_token WHERE resource = 'race'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, highest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_refuses_forged_released_and_expired_tokens_and_records_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let t = held_tokens(&db, "h", 2, None).await;
    let conn = db.conn().await;
    let stored = || async {
        conn.query_one(
            "SELECT coalesce((SELECT token FROM permitq.fence_token WHERE resource = 'db'), 0)",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
    };
    // A forged token, however high, is refused and locks nobody out.
    assert!(!client.fence("fenced", "db", i64::MAX).await.unwrap());
    // A valid token with a typo'd semaphore: an error that names the one meant, not a bare
    // false that looks like a stale holder.
    let typo = client
        .fence("fenceed", "db", t[0])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        typo.contains("invalid semaphore fenceed") && typo.contains("did you mean fenced?"),
        "{typo}"
    );
    assert_eq!(stored().await, 0, "nothing recorded");
    assert!(client.fence("fenced", "db", t[0]).await.unwrap());
    // A released holder's token is refused, even above the highest seen.
    client.release("h-1").await.unwrap();
    assert!(!client.fence("fenced", "db", t[1]).await.unwrap());
    assert_eq!(stored().await, t[0]);
    // A holder whose lease ran out is fenced before anyone else writes, and before any sweep
    // releases it (no worker runs now): its request is still `acquired`.
    let e = held_tokens(&db, "e", 1, Some(Duration::from_millis(300))).await;
    let expires = client
        .status("e-0")
        .await
        .unwrap()
        .unwrap()
        .expires_at
        .unwrap();
    common::wait_until(Duration::from_secs(10), "the lease runs out", || async {
        std::time::SystemTime::now() > expires + Duration::from_millis(50)
    })
    .await;
    assert!(!client.fence("fenced", "db", e[0]).await.unwrap());
    assert_eq!(
        client.status("e-0").await.unwrap().unwrap().state,
        permitq::State::Acquired
    );
    assert_eq!(stored().await, t[0]);
    client.release("h-0").await.unwrap();
}

/// A refused fence says why in a NOTICE: a token of no request of this login's, a request that
/// no longer holds, a lease run out, a semaphore the request does not hold, a later token seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_fence_says_why() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let t = held_tokens(&db, "n", 3, None).await;
    client.set_capacity("other", 1, None).await.unwrap();
    let leased = held_tokens(&db, "l", 1, Some(Duration::from_millis(300))).await;
    let expires = client
        .status("l-0")
        .await
        .unwrap()
        .unwrap()
        .expires_at
        .unwrap();
    common::wait_until(Duration::from_secs(10), "the lease runs out", || async {
        std::time::SystemTime::now() > expires + Duration::from_millis(50)
    })
    .await;
    client.release("n-0").await.unwrap();
    let (conn, notices) = noticing(&db.url).await;
    let fence = |semaphore: &'static str, token: i64| {
        let conn = &conn;
        async move {
            conn.query_one("SELECT permitq.fence($1, 'db', $2)", &[&semaphore, &token])
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    assert!(!fence("fenced", i64::MAX).await);
    assert!(!fence("fenced", t[0]).await);
    assert!(!fence("fenced", leased[0]).await);
    assert!(!fence("other", t[1]).await);
    assert!(fence("fenced", t[2]).await);
    assert!(!fence("fenced", t[1]).await);
    drop(conn);
    let said: Vec<String> = notices.await.unwrap();
    let expected = [
        format!("fence refused: no request of yours holds token {}", i64::MAX),
        format!("fence refused: token {} is request n-0's, which is released: it holds nothing now", t[0]),
        "fence refused: the lease of request l-0 ran out".to_string(),
        "fence refused: request n-1 holds this (fenced), not other: fence with the semaphore that guards db".to_string(),
        format!("fence refused: token {} is below the highest seen for db under fenced: a later holder has written since", t[1]),
    ];
    assert_eq!(said.len(), expected.len(), "{said:?}");
    for (said, expected) in said.iter().zip(&expected) {
        assert!(
            said.starts_with(expected.as_str()),
            "{said}\nexpected: {expected}"
        );
    }
    // A producer with another login's real token hears what it hears for a made-up one.
    let producer = db.login("permitq_producer").await;
    let (conn, notices) = noticing(&producer).await;
    for token in [t[2], i64::MAX] {
        let accepted: bool = conn
            .query_one("SELECT permitq.fence('fenced', 'db', $1)", &[&token])
            .await
            .unwrap()
            .get(0);
        assert!(!accepted);
    }
    drop(conn);
    let said: Vec<String> = notices.await.unwrap();
    assert_eq!(
        said,
        [t[2], i64::MAX].map(|t| format!(
            "fence refused: no request of yours holds token {t} (it is another login's, or made up)"
        )),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_refuses_a_database_whose_applied_migration_was_edited_or_is_unknown() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    let recorded: i64 = conn
        .query_one(
            "SELECT count(*) FROM permitq.schema_migration WHERE checksum IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        usize::try_from(recorded).unwrap(),
        permitq::migrate::MIGRATIONS.len(),
        "every applied migration has its checksum"
    );
    assert!(client.migrate().await.unwrap().is_empty());

    conn.batch_execute("UPDATE permitq.schema_migration SET checksum = '\\x00' WHERE version = 1")
        .await
        .unwrap();
    let err = client.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("migration 1 (baseline) was edited after it was applied"),
        "{err}"
    );
    conn.batch_execute("UPDATE permitq.schema_migration SET checksum = NULL WHERE version = 1")
        .await
        .unwrap();
    let err = client.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("its checksum in the database is missing"),
        "{err}"
    );
    conn.execute(
        "UPDATE permitq.schema_migration SET checksum = sha256(convert_to($1::text, 'UTF8')) \
         WHERE version = 1",
        &[&permitq::migrate::MIGRATIONS[0].sql],
    )
    .await
    .unwrap();
    assert!(client.migrate().await.unwrap().is_empty());

    conn.batch_execute(
        "INSERT INTO permitq.schema_migration (version, name) VALUES (999, 'future')",
    )
    .await
    .unwrap();
    let err = client.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("migration 999 (future), which this build of permitq does not know"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_schema_file_is_applied_again_and_only_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    // A function edited by hand, and its file's recorded checksum no longer this build's.
    conn.batch_execute(
        "CREATE OR REPLACE FUNCTION permitq.fence(resource text, token bigint) RETURNS boolean \
         LANGUAGE sql AS $$ SELECT false $$; \
         UPDATE permitq.schema_file SET checksum = '\\x00' WHERE path = 'fence.sql';",
    )
    .await
    .unwrap();
    assert!(!client.schema_is_current().await.unwrap());
    let migrated = client.migrate().await.unwrap();
    assert_eq!(migrated.files, vec!["fence.sql".to_string()]);
    assert!(migrated.versions.is_empty());
    assert!(client.schema_is_current().await.unwrap());
    let definition: String = conn
        .query_one(
            "SELECT pg_get_functiondef('permitq.fence(text, bigint)'::regprocedure)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        definition.contains("fence_checked") && !definition.contains("SELECT false"),
        "the file's fence is back: {definition}"
    );
    // Still private to the roles its file grants it to.
    let public: bool = conn
        .query_one(
            "SELECT has_function_privilege('public', 'permitq.fence(text, bigint)', 'EXECUTE')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!public);
}

/// `await_settled` waits at most 5 s a call, whatever it is asked: its statement's snapshot holds
/// back vacuum for the whole database while it waits.
#[tokio::test]
async fn await_settled_waits_at_most_five_seconds_a_call() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    conn.execute("SELECT permitq.submit('nobody-grants', '{\"a\": 1}')", &[])
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let state: String = conn
        .query_one(
            "SELECT state FROM permitq.await_settled('nobody-grants', '1 hour')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let waited = started.elapsed();
    assert_eq!(state, "new");
    assert!(
        waited >= std::time::Duration::from_secs(5) && waited < std::time::Duration::from_secs(9),
        "{waited:?}"
    );
    // The cut is said (a NOTICE), as is an id with no row; a wait within 5 s says nothing.
    let (conn, notices) = noticing(&db.url).await;
    conn.execute(
        "SELECT permitq.await_settled('nobody-grants', '1 hour')",
        &[],
    )
    .await
    .unwrap();
    conn.execute("SELECT permitq.await_settled('nobody-grants', '10ms')", &[])
        .await
        .unwrap();
    conn.execute("SELECT permitq.await_settled('no-such-id', '1s')", &[])
        .await
        .unwrap();
    drop(conn);
    let said: Vec<String> = notices.await.unwrap();
    assert_eq!(said.len(), 2, "{said:?}");
    assert!(
        said[0].contains(
            "still new after 5 s, the most one call waits (not the 1h asked): call again"
        ),
        "{said:?}"
    );
    assert!(
        said[1].contains("no request no-such-id among those this login may read"),
        "{said:?}"
    );
}

/// A connection whose NOTICEs are kept: their messages, once it is dropped.
async fn noticing(url: &str) -> (tokio_postgres::Client, tokio::task::JoinHandle<Vec<String>>) {
    let (client, mut connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let notices = tokio::spawn(async move {
        let mut said = Vec::new();
        while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            if let Ok(tokio_postgres::AsyncMessage::Notice(notice)) = message {
                said.push(notice.message().to_string());
            }
        }
        said
    });
    (client, notices)
}

/// The schema's `permitq.shell_word` and the library's are one rule: a command a message
/// suggests reads the same whichever side wrote it.
#[tokio::test]
async fn shell_words_are_quoted_alike_by_the_schema_and_the_library() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    for name in [
        "gpu",
        "team:*",
        "my gpu",
        "it's",
        "a-b_c.d:e/f@g",
        "gpü",
        "",
        "x\\y",
        "$HOME",
        "a'b c",
    ] {
        let quoted: String = conn
            .query_one("SELECT permitq.shell_word($1)", &[&name])
            .await
            .unwrap()
            .get(0);
        assert_eq!(quoted, permitq::shell_word(name), "{name:?}");
    }
    assert_eq!(permitq::shell_word("my gpu"), "'my gpu'");
    assert_eq!(permitq::shell_word("it's"), r"'it'\''s'");
    assert_eq!(permitq::shell_word("a-b_c.d:e/f@g"), "a-b_c.d:e/f@g");
}
