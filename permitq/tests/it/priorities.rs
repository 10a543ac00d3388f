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
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let _worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("s", 1))
        .await
        .unwrap();
    granted(&client, "holder").await;
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
    let client = db.client().await;
    client.set_capacity("s", 1, None).await.unwrap();
    let _worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("s", 1))
        .await
        .unwrap();
    granted(&client, "holder").await;
    queue(&db, &client, "old-low", 0).await;
    // It has waited a minute: effective priority 0 + 60 s / 10 s = 6, ahead of a new 5.
    db.conn()
        .await
        .batch_execute(
            "UPDATE permitq.permit_request SET created_at = created_at - interval '60 seconds'
             WHERE external_id = 'old-low';
             UPDATE permitq.waiter w SET created_at = r.created_at FROM permitq.permit_request r
             WHERE r.id = w.request_id AND r.external_id = 'old-low';",
        )
        .await
        .unwrap();
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
