//! Priorities: higher first on fair semaphores, FIFO among equals, and aging (one step per 10 s
//! waited) so that a stream of higher priorities cannot hold a request back forever.

use permitq_test_support as common;

use std::time::Duration;

use common::{check_invariants, state_of, TestDb};
use permitq::{Request, State};

const SOON: Duration = Duration::from_secs(10);

async fn granted(client: &permitq::Client, id: &str) {
    let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired, "{id}");
}

/// Submits `id` (priority `p`) on `s` and waits until a worker has queued it.
async fn queue(db: &TestDb, client: &permitq::Client, id: &str, p: i16) {
    client
        .submit(&Request::new(id).permit("s", 1).priority(p))
        .await
        .unwrap();
    let conn = db.conn().await;
    common::wait_until(SOON, "queued", || {
        let conn = &conn;
        async move {
            let n: i64 = conn
                .query_one(
                    "SELECT count(*) FROM permitq.waiter w JOIN permitq.permit_request r
                     ON r.id = w.request_id WHERE r.external_id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .get(0);
            n == 1
        }
    })
    .await;
}

/// Semaphore `s` (capacity 1), a worker, and `holder` holding `s`: later requests wait.
async fn held_by_holder(db: &TestDb) -> (permitq::Client, common::RunningWorker) {
    all_held_by_holder(db, 1).await
}

/// Semaphore `s` of `capacity`, a worker, and `holder` holding all of it.
async fn all_held_by_holder(
    db: &TestDb,
    capacity: i32,
) -> (permitq::Client, common::RunningWorker) {
    let client = db.client().await;
    client.set_capacity("s", capacity, None).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("s", i64::from(capacity)))
        .await
        .unwrap();
    granted(&client, "holder").await;
    (client, worker)
}

/// Makes waiting request `id` `secs` seconds older (its row and its place in the queue), as if
/// it had waited that long.
async fn backdate(db: &TestDb, id: &str, secs: i32) {
    db.conn()
        .await
        .execute(
            "WITH r AS (UPDATE permitq.permit_request
                        SET created_at = created_at - make_interval(secs => $2)
                        WHERE external_id = $1 RETURNING id, created_at)
             UPDATE permitq.waiter w SET created_at = r.created_at FROM r WHERE w.request_id = r.id",
            &[&id, &f64::from(secs)],
        )
        .await
        .unwrap();
}

/// Waits until one of `ids` not in `done` is acquired, and returns it (panics after 10 s, or if
/// two are).
async fn next_granted(client: &permitq::Client, ids: &[&str], done: &[String]) -> String {
    let deadline = std::time::Instant::now() + SOON;
    loop {
        let mut now_granted = Vec::new();
        for id in ids.iter().filter(|id| !done.iter().any(|d| d == *id)) {
            if state_of(client, id).await == "acquired" {
                now_granted.push(id.to_string());
            }
        }
        assert!(
            now_granted.len() <= 1,
            "capacity 1, yet {now_granted:?} hold it"
        );
        if let Some(id) = now_granted.pop() {
            return id;
        }
        assert!(std::time::Instant::now() < deadline, "nobody was granted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_highest_priority_waiter_goes_first_and_equals_go_in_order() {
    let db = TestDb::new().await;
    let (client, _worker) = held_by_holder(&db).await;
    queue(&db, &client, "low-1", 0).await;
    queue(&db, &client, "low-2", 0).await;
    queue(&db, &client, "high", 5).await;
    let row = client.status("high").await.unwrap().unwrap();
    assert_eq!(row.priority, 5);

    let mut order = Vec::new();
    let mut holder = "holder".to_string();
    for _ in 0..3 {
        client.release(&holder).await.unwrap();
        let next = next_granted(&client, &["high", "low-1", "low-2"], &order).await;
        order.push(next.clone());
        holder = next;
    }
    assert_eq!(order, ["high", "low-1", "low-2"]);
    check_invariants(&db.conn().await).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waited_long_enough_goes_ahead_of_a_higher_priority() {
    let db = TestDb::new().await;
    let (client, _worker) = held_by_holder(&db).await;
    queue(&db, &client, "old-low", 0).await;
    // It has waited a minute: effective priority 0 + 60 s / 10 s = 6, ahead of a new 5.
    backdate(&db, "old-low", 60).await;
    queue(&db, &client, "new-high", 5).await;
    client.release("holder").await.unwrap();
    granted(&client, "old-low").await;
    assert_eq!(state_of(&client, "new-high").await, "new");
    client.release("old-low").await.unwrap();
    granted(&client, "new-high").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_priority_is_validated_and_part_of_the_idempotency_key() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    for bad in [101i16, -101] {
        let err = conn
            .query_one(
                "SELECT permitq.submit('p', '{\"s\": 1}', priority => $1::int2)",
                &[&bad],
            )
            .await
            .unwrap_err();
        let e = err.as_db_error().unwrap();
        assert_eq!(e.code().code(), "22023");
        assert!(e.message().starts_with("invalid priority"), "{e:?}");
        let err = client
            .submit(&Request::new("p").permit("s", 1).priority(bad))
            .await
            .unwrap_err();
        assert_eq!(err.invalid_field(), Some("priority"));
    }
    assert!(
        client.status("p").await.unwrap().is_none(),
        "nothing written"
    );
    client
        .submit(&Request::new("p").permit("s", 1).priority(3))
        .await
        .unwrap();
    let err = client
        .submit(&Request::new("p").permit("s", 1).priority(4))
        .await
        .unwrap_err();
    assert_eq!(err.code().map(|c| c.code()), Some("23505"));
}

/// A backlog queued while no worker runs, on a fair semaphore of capacity 1 (no room to backfill
/// beside the head), with three priority levels: it is granted strictly in place order (every
/// level-2 request before any level-1 one, arrival order within a level), although the worker
/// claims it in batches smaller than it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_priority_backlog_is_granted_in_place_order() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let conn = db.conn().await;
    // 60 requests, ids in arrival order, priorities 0, 1, 2 interleaved.
    conn.execute(
        "INSERT INTO permitq.permit_request (external_id, permits, priority, ttl)
         SELECT 'b-' || i, '{\"s\": 1}', (i % 3)::int2, interval '1 hour'
         FROM generate_series(1, 60) i",
        &[],
    )
    .await
    .unwrap();
    let mut config = common::quiet_config("w1");
    config.batch_size = 7;
    let worker = db.worker(config);
    // Each time the semaphore is full, release its holder to make room for the next.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let granted_order: Vec<(i16, i64)> = loop {
        assert!(
            std::time::Instant::now() < deadline,
            "backlog not granted in time"
        );
        let rows = conn
            .query(
                "SELECT priority, id, state FROM permitq.permit_request
                 WHERE fencing_token IS NOT NULL ORDER BY fencing_token",
                &[],
            )
            .await
            .unwrap();
        if rows.len() == 60 {
            break rows.iter().map(|r| (r.get(0), r.get(1))).collect();
        }
        let held = rows
            .iter()
            .filter(|r| r.get::<_, String>(2) == "acquired")
            .count();
        if held == 1 {
            conn.execute(
                "SELECT count(permitq.release(external_id)) FROM permitq.permit_request
                 WHERE state = 'acquired'",
                &[],
            )
            .await
            .unwrap();
        } else {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    worker.stop().await;
    let mut expected = granted_order.clone();
    expected.sort_by_key(|(p, id)| (-p, *id));
    assert_eq!(granted_order, expected, "grants out of place order");
    check_invariants(&conn).await.unwrap();
}

/// The heads a batch reads among requests no worker has examined yet: the best placed one on
/// each semaphore ahead of the batch's last there; and where more than the scan's bound lie
/// ahead, a stand-in (request 0, count 2147483647) that holds the semaphore for them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unexamined_heads_are_read_in_bounded_work() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for name in ["s", "t"] {
        client.set_capacity(name, 5, None).await.unwrap();
    }
    let conn = db.conn().await;
    let heads = |bound: i64| {
        let conn = &conn;
        async move {
            conn.query(
                "SELECT semaphore, request_id, count FROM permitq.semaphore_heads(ARRAY['s'], ARRAY[$1::int8], '{}')",
                &[&bound],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1), r.get::<_, i32>(2)))
            .collect::<Vec<_>>()
        }
    };
    // The place in line of a priority-0 request submitted now: every request below is ahead.
    let bound: i64 = conn
        .query_one(
            "SELECT permitq.rule_place_in_line(0::int2, clock_timestamp())",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(heads(bound).await, vec![]);

    // 999 requests ahead on another semaphore: read, none is a head of s.
    let backlog = |from: i32, to: i32| {
        let conn = &conn;
        async move {
            conn.execute(
                "INSERT INTO permitq.permit_request (external_id, permits, priority)
                 SELECT 't-' || i, '{\"t\": 1}', 5 FROM generate_series($1::int4, $2::int4) i",
                &[&from, &to],
            )
            .await
            .unwrap();
        }
    };
    backlog(1, 999).await;
    assert_eq!(heads(bound).await, vec![]);

    // One more: the scan stops short of the bound, so s is held for what lies beyond.
    backlog(1000, 1000).await;
    assert_eq!(
        heads(bound).await,
        vec![("s".to_string(), 0, 2_147_483_647)]
    );

    // A request on s placed ahead of all of them is the head, with its count.
    client
        .submit(&Request::new("first").permit("s", 2).priority(9))
        .await
        .unwrap();
    let first = client.status("first").await.unwrap().unwrap();
    assert_eq!(heads(bound).await, vec![("s".to_string(), first.id, 2)]);
}

/// The views show the real queue: `permitq.waiters` (and `Client::waiters`, which the CLI, `top`
/// and the status page read) numbers waiters in the order the workers grant them, priorities and
/// aging included, and position 1 is always the request granted next; `permitq.explain` gives
/// each the same place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn position_1_in_the_waiters_view_is_the_request_granted_next() {
    let db = TestDb::new().await;
    let (client, _worker) = held_by_holder(&db).await;
    queue(&db, &client, "first-0", 0).await;
    queue(&db, &client, "second-3", 3).await;
    queue(&db, &client, "third-minus-2", -2).await;
    queue(&db, &client, "fourth-3", 3).await;
    queue(&db, &client, "aged-0", 0).await;
    // aged-0 has waited 70 s: 0 + 7 steps puts it ahead of the priority-3 requests.
    backdate(&db, "aged-0", 70).await;
    let ids = ["first-0", "second-3", "third-minus-2", "fourth-3", "aged-0"];
    let shown = client.waiters("s", 10).await.unwrap();
    let listed: Vec<(&str, i16, i64)> = shown
        .iter()
        .map(|w| (w.external_id.as_str(), w.priority, w.position))
        .collect();
    assert_eq!(
        listed,
        [
            ("aged-0", 0, 1),
            ("second-3", 3, 2),
            ("fourth-3", 3, 3),
            ("first-0", 0, 4),
            ("third-minus-2", -2, 5)
        ]
    );
    // `permitq.explain` places each one the same, and counts the permits ahead of it.
    for w in &shown {
        let why = client.explain(&w.external_id).await.unwrap().unwrap();
        let s = &why.semaphores[0];
        assert_eq!(s.position, Some(w.position), "{}", w.external_id);
        assert_eq!(s.permits_ahead, Some(w.position - 1), "{}", w.external_id);
        let first_in_line = w.position == 1 || s.reason.contains("is first in line (priority");
        assert!(first_in_line, "{}: {}", w.external_id, s.reason);
    }
    let mut order = Vec::new();
    let mut holder = "holder".to_string();
    for _ in 0..ids.len() {
        let head = client.waiters("s", 1).await.unwrap().remove(0);
        assert_eq!(head.position, 1);
        client.release(&holder).await.unwrap();
        let next = next_granted(&client, &ids, &order).await;
        assert_eq!(next, head.external_id, "position 1 was {head:?}");
        order.push(next.clone());
        holder = next;
    }
    check_invariants(&db.conn().await).await.unwrap();
}

/// Requests granted together, in one batch, get their fencing tokens (and `acquired_at`) in line
/// order, not in id order: the first in line gets the lowest, as a grant before the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_of_one_batch_follow_the_line() {
    let db = TestDb::new().await;
    let (client, _worker) = all_held_by_holder(&db, 3).await;
    // Submitted (ids) in another order than the line's: high, mid, low.
    queue(&db, &client, "mid", 0).await;
    queue(&db, &client, "low", -1).await;
    queue(&db, &client, "high", 1).await;
    client.release("holder").await.unwrap();
    let mut tokens = Vec::new();
    for id in ["high", "mid", "low"] {
        granted(&client, id).await;
        let r = client.status(id).await.unwrap().unwrap();
        tokens.push((r.fencing_token.unwrap(), r.acquired_at.unwrap(), id));
    }
    let mut by_token = tokens.clone();
    by_token.sort();
    assert_eq!(by_token, tokens, "tokens and acquired_at in line order");
    check_invariants(&db.conn().await).await.unwrap();
}
