//! Nested limits: the tree's rules. Changes reach a template's instances; a semaphore keeps its
//! parent while it holds permits or has waiters (a template while an instance does); depth
//! counts the chain below; a move racing a batch is retried under the new parent; a template's
//! promise counts the instances it has beyond a lowered bound.

use permitq_test_support as common;

use std::time::Duration;

use common::{wait_until, TestDb};
use permitq::{Request, SemaphoreSettings, State};

use super::nesting::{acquired, fails_fast, left_waiting, nest, submit};

const SOON: Duration = Duration::from_secs(10);

/// A template's new parent and guarantee reach its existing (idle) instances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_templates_new_parent_and_guarantee_reach_its_instances() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("pool", 1, None).await.unwrap();
    client
        .set_semaphore("t:*", 2, &SemaphoreSettings::new().max_instances(1))
        .await
        .unwrap();
    let _worker = db.notified_worker("w1");
    submit(&client, "x1", "t:x", 1).await;
    acquired(&client, "x1").await;
    client.release("x1").await.unwrap();
    common::wait_folded(&db.url).await;
    nest(&client, "t:*", 2, "pool", 1).await;
    let x = common::semaphore(&client, "t:x").await.unwrap();
    assert_eq!((x.parent.as_deref(), x.guarantee), (Some("pool"), 1));
    // The pool (1) bounds the instance now.
    assert_eq!(
        fails_fast(&client, "x2", "t:x", 2).await,
        "Error/exceeds_capacity"
    );
}

/// Depth counts the chain below: d5 has 4 levels above it (d4..d1), so d1 may not get a parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_cannot_be_put_under_a_root_that_makes_it_too_deep() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("d1", 4, None).await.unwrap();
    nest(&client, "d2", 4, "d1", 0).await;
    nest(&client, "d3", 4, "d2", 0).await;
    nest(&client, "d4", 4, "d3", 0).await;
    nest(&client, "d5", 4, "d4", 0).await;
    client.set_capacity("root", 4, None).await.unwrap();
    let e = client
        .set_semaphore("d1", 4, &SemaphoreSettings::new().parent("root"))
        .await
        .expect_err("d5 would have 5 above it");
    assert!(
        e.to_string().contains(
            "nesting too deep: d1 would have 1 level above it and 4 below, so the semaphores \
             deepest below it would have 5 above them, and a semaphore may have at most 4 (its \
             parents, their parents, and so on): leave it without a parent (`--no-parent`), or \
             move what is below it up first"
        ),
        "{e}"
    );
}

/// A semaphore with waiters (holding nothing) keeps its parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_semaphore_with_waiters_keeps_its_parent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("p1", 1, None).await.unwrap();
    client.set_capacity("p2", 4, None).await.unwrap();
    nest(&client, "a", 4, "p1", 0).await;
    nest(&client, "b", 4, "p1", 0).await;
    let _worker = db.notified_worker("w1");
    submit(&client, "b1", "b", 1).await;
    acquired(&client, "b1").await;
    submit(&client, "a1", "a", 1).await;
    left_waiting(&conn, "a1").await;
    let e = client
        .set_semaphore("a", 4, &SemaphoreSettings::new().parent("p2"))
        .await
        .expect_err("a has a waiter");
    assert!(e.to_string().contains("once it is idle"), "{e}");
}

/// A template whose instance holds permits keeps its parent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_template_whose_instance_holds_keeps_its_parent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("pool", 4, None).await.unwrap();
    client
        .set_semaphore("t:*", 2, &SemaphoreSettings::new().max_instances(2))
        .await
        .unwrap();
    let _worker = db.notified_worker("w1");
    submit(&client, "x1", "t:x", 1).await;
    acquired(&client, "x1").await;
    let e = client
        .set_semaphore("t:*", 2, &SemaphoreSettings::new().parent("pool"))
        .await
        .expect_err("t:x holds a permit");
    assert!(e.to_string().contains("once it is idle"), "{e}");
}

/// A semaphore moved while a batch waits for its lock: the batch is retried (40001), and the
/// request is granted under the new parent, not failed as unknown_semaphore.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_while_a_batch_waits_for_the_lock_is_retried_under_the_new_parent() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut mover = db.conn().await;
    let conn = db.conn().await;
    client.set_capacity("p1", 4, None).await.unwrap();
    client.set_capacity("p2", 4, None).await.unwrap();
    nest(&client, "a", 4, "p1", 0).await;
    let _worker = db.notified_worker("w1");
    let tx = mover.transaction().await.unwrap();
    tx.execute("SELECT permitq.set_capacity('a', 4, parent => 'p2')", &[])
        .await
        .unwrap();
    submit(&client, "r", "a", 1).await;
    wait_until(SOON, "the batch waits for a's lock", || async {
        conn.query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
             AND (query LIKE '%permitq.next_batch(%' \
                  OR query LIKE '%permitq.lock_batch_and_heads(%'))",
            &[],
        )
        .await
        .is_ok_and(|r| r.get::<_, bool>(0))
    })
    .await;
    tx.commit().await.unwrap();
    let r = client.wait_settled("r", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired, "{r:?}");
    let charged: Option<serde_json::Value> = conn
        .query_one(
            "SELECT charged FROM permitq.permit_request WHERE external_id = 'r'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(charged, Some(serde_json::json!({"a": 1, "p2": 1})));
}

/// A request on a semaphore with 4 levels above is granted on all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_four_levels_deep_is_taken_from_the_top() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("d1", 4, None).await.unwrap();
    nest(&client, "d2", 4, "d1", 0).await;
    nest(&client, "d3", 4, "d2", 0).await;
    nest(&client, "d4", 4, "d3", 0).await;
    nest(&client, "d5", 4, "d4", 0).await;
    let _worker = db.notified_worker("w1");
    submit(&client, "r", "d5", 1).await;
    acquired(&client, "r").await;
    assert_eq!(common::semaphore(&client, "d1").await.unwrap().used, 1);
}

/// A template's existing instances beyond a lowered max_instances still count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_beyond_a_lowered_bound_still_count_in_the_promise() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("pool", 4, None).await.unwrap();
    client
        .set_semaphore(
            "t:*",
            2,
            &SemaphoreSettings::new()
                .max_instances(4)
                .parent("pool")
                .guarantee(1),
        )
        .await
        .unwrap();
    let worker = db.notified_worker("w1");
    for i in 0..4 {
        let id = format!("x{i}");
        client
            .submit(&Request::new(&id).permit(format!("t:{i}"), 1))
            .await
            .unwrap();
        acquired(&client, &id).await;
        client.release(&id).await.unwrap();
    }
    common::wait_folded(&db.url).await;
    worker.stop().await;
    client
        .set_semaphore("t:*", 2, &SemaphoreSettings::new().max_instances(2))
        .await
        .unwrap();
    let e = client
        .set_semaphore(
            "c",
            4,
            &SemaphoreSettings::new().parent("pool").guarantee(2),
        )
        .await
        .expect_err("4 instances promise 4 of the pool's 4");
    assert!(e.to_string().contains("add up to 6"), "{e}");
}
