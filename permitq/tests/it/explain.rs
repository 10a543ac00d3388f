//! `permitq.explain`: why a request waits, semaphore by semaphore (what is free and missing, the
//! place in line, the holders, the rule that holds it back, an estimated wait), and the outcome
//! of one that no longer waits.

use permitq_test_support as common;

use std::time::Duration;

use common::TestDb;
use permitq::{Client, Request, State};

const SOON: Duration = Duration::from_secs(10);

/// Waits until a worker has examined `id` and left it waiting (its place in line is known).
async fn examined(client: &Client, id: &str) {
    common::wait_until(SOON, "examined and waiting", || async {
        client
            .explain(id)
            .await
            .unwrap()
            .is_some_and(|e| e.semaphores.iter().all(|s| s.position.is_some()))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_names_what_is_short_the_place_in_line_the_holders_and_the_rule() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 2, None).await.unwrap();
    client.set_capacity("disk", 5, None).await.unwrap();
    let _worker = db.notified_worker("explain-w");
    let holder = client
        .acquire(
            &Request::new("holder")
                .permit("gpu", 2)
                .ttl(Duration::from_secs(60)),
            SOON,
        )
        .await
        .unwrap();
    client
        .submit(&Request::new("first").permit("gpu", 2).permit("disk", 1))
        .await
        .unwrap();
    examined(&client, "first").await;
    client
        .submit(&Request::new("second").permit("gpu", 1))
        .await
        .unwrap();
    examined(&client, "second").await;

    // The head: short of 2 on gpu, held by `holder`; disk fits, so it waits for gpu.
    let first = client.explain("first").await.unwrap().unwrap();
    assert_eq!(first.state, State::New);
    assert_eq!(first.outcome, None);
    let names: Vec<&str> = first
        .semaphores
        .iter()
        .map(|s| s.semaphore.as_str())
        .collect();
    assert_eq!(names, ["disk", "gpu"]);
    let (disk, gpu) = (&first.semaphores[0], &first.semaphores[1]);
    assert_eq!(
        (disk.needs, disk.free, disk.shortfall),
        (1, Some(5), Some(0))
    );
    assert_eq!(disk.position, Some(1));
    assert!(
        disk.reason
            .ends_with("it fits here; what holds it back is on its other rows: gpu"),
        "{}",
        disk.reason
    );
    assert_eq!((gpu.needs, gpu.free, gpu.shortfall), (2, Some(0), Some(2)));
    assert_eq!((gpu.position, gpu.permits_ahead), (Some(1), Some(0)));
    assert!(gpu.reason.contains("2 more permits"), "{}", gpu.reason);
    assert_eq!(gpu.holders.len(), 1);
    assert_eq!(gpu.holders[0].external_id, "holder");
    assert_eq!(gpu.holders[0].count, 2);
    let ends_in = gpu.holders[0]
        .expires_at
        .expect("a lease")
        .duration_since(std::time::SystemTime::now())
        .unwrap();
    assert!(ends_in > Duration::from_secs(50), "{ends_in:?}");
    // Nothing was released on gpu yet: no history, no estimate.
    assert_eq!(gpu.estimated_wait, None);

    // Behind it: the fair rule names the head.
    let second = client.explain("second").await.unwrap().unwrap();
    let gpu = &second.semaphores[0];
    assert_eq!((gpu.position, gpu.permits_ahead), (Some(2), Some(2)));
    assert!(
        gpu.reason.contains(
            "request first is first in line (priority 0, needs 2), and 3 more permits must be \
             released (2 for the head first, then 1 for it)"
        ),
        "{}",
        gpu.reason
    );

    // The holder releases: the head is granted; explain gives its outcome. One release makes
    // no rate: still no estimate.
    holder.release().await.unwrap();
    let settled = client.wait_settled("first", SOON).await.unwrap().unwrap();
    assert_eq!(settled.state, State::Acquired);
    let first = client.explain("first").await.unwrap().unwrap();
    assert_eq!(first.outcome.as_deref(), Some("acquired"));
    assert!(first.semaphores.is_empty());
    let second = client.explain("second").await.unwrap().unwrap();
    let gpu = &second.semaphores[0];
    assert_eq!((gpu.position, gpu.shortfall), (Some(1), Some(1)));
    assert!(gpu.reason.contains("1 more permit "), "{}", gpu.reason);
    assert_eq!(
        (gpu.estimated_wait, gpu.since_last_release),
        (None, None),
        "{gpu:?}"
    );

    assert!(client.explain("nobody").await.unwrap().is_none());
    // From SQL, a settled request's outcome is in words, as `permitq status` says it.
    let outcome: String = db
        .conn()
        .await
        .query_one("SELECT outcome FROM permitq.explain('holder')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        outcome.starts_with("released (by its holder) after ")
            && outcome.contains(" held, ")
            && outcome.ends_with(" ago"),
        "{outcome}"
    );
    // An error's carries what it hit.
    client
        .submit(&Request::new("too-big").permit("gpu", 9))
        .await
        .unwrap();
    client.wait_settled("too-big", SOON).await.unwrap();
    let outcome: String = db
        .conn()
        .await
        .query_one("SELECT outcome FROM permitq.explain('too-big')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        outcome.starts_with("error exceeds_capacity {")
            && outcome.contains(r#""semaphore": "gpu""#)
            && outcome.contains(r#""capacity": "#),
        "{outcome}"
    );
    // A template named itself is said in words, from SQL too.
    client.set_capacity("lab:*", 2, None).await.unwrap();
    client
        .submit(&Request::new("tpl").permit("lab:*", 1))
        .await
        .unwrap();
    client.wait_settled("tpl", SOON).await.unwrap();
    let outcome: String = db
        .conn()
        .await
        .query_one("SELECT outcome FROM permitq.explain('tpl')", &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        outcome.starts_with(
            "error unknown_semaphore (lab:* is a template, which is never granted itself: name \
             an instance of it (lab:NAME, made at its first grant), under a new external_id) {"
        ),
        "{outcome}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_of_a_spent_rate_window_says_when_it_opens() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .set_rate_limit("api", 1, Duration::from_secs(60), None)
        .await
        .unwrap();
    let _worker = db.notified_worker("explain-rate");
    let lease = client
        .acquire(&Request::new("used").permit("api", 1), SOON)
        .await
        .unwrap();
    lease.release().await.unwrap();
    client
        .submit(&Request::new("next").permit("api", 1))
        .await
        .unwrap();
    examined(&client, "next").await;
    let next = client.explain("next").await.unwrap().unwrap();
    let api = &next.semaphores[0];
    assert_eq!((api.free, api.shortfall), (Some(0), Some(1)));
    assert!(
        api.reason.starts_with("rate limit: its window is spent"),
        "{}",
        api.reason
    );
    // The window counts grants in buckets of a 64th of it: it opens within a bucket of 60 s.
    let wait = api.estimated_wait.expect("the window's opening");
    assert!(
        wait > Duration::from_secs(50) && wait <= Duration::from_millis(60_000 + 60_000 / 64),
        "{wait:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_explains_only_its_own_requests() {
    let db = TestDb::new().await;
    let admin = db.client().await;
    admin.set_capacity("s", 1, None).await.unwrap();
    let alice = Client::connect(&db.login("permitq_producer").await)
        .await
        .unwrap();
    alice
        .submit(&Request::new("alices").permit("s", 1))
        .await
        .unwrap();
    let user = format!("bob_explain_{}", std::process::id());
    let bob_url = {
        db.conn()
            .await
            .batch_execute(&format!(
                "CREATE ROLE {user} LOGIN PASSWORD 'pw' IN ROLE permitq_producer"
            ))
            .await
            .unwrap();
        common::as_user(&db.url, &user, "pw")
    };
    let bob = Client::connect(&bob_url).await.unwrap();
    assert!(alice.explain("alices").await.unwrap().is_some());
    assert!(bob.explain("alices").await.unwrap().is_none());
    assert!(admin.explain("alices").await.unwrap().is_some());
    drop(bob);
    db.conn()
        .await
        .batch_execute(&format!("DROP OWNED BY {user}; DROP ROLE {user}"))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_parents_and_the_room_kept_for_guarantees() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let nested = |parent: &str, guarantee| {
        permitq::SemaphoreSettings::new()
            .parent(parent)
            .guarantee(guarantee)
    };
    client.set_capacity("pool", 4, None).await.unwrap();
    client
        .set_semaphore("a", 4, &nested("pool", 2))
        .await
        .unwrap();
    client
        .set_semaphore("b", 4, &nested("pool", 0))
        .await
        .unwrap();
    let _worker = db.notified_worker("explain-w");
    // a holds 1 of its 2: the pool keeps 1 for it. b holds 2; b's next 1 would leave nothing.
    let mut held = Vec::new();
    for (id, name, count) in [("a1", "a", 1), ("b1", "b", 2)] {
        held.push(
            client
                .acquire(&Request::new(id).permit(name, count), SOON)
                .await
                .unwrap(),
        );
    }
    client
        .submit(&Request::new("b2").permit("b", 1))
        .await
        .unwrap();
    examined(&client, "b2").await;
    let e = client.explain("b2").await.unwrap().unwrap();
    let rows: Vec<(&str, Option<&str>, i64, Option<i64>)> = e
        .semaphores
        .iter()
        .map(|s| (s.semaphore.as_str(), s.via.as_deref(), s.needs, s.free))
        .collect();
    assert_eq!(
        rows,
        [("b", None, 1, Some(2)), ("pool", Some("b"), 1, Some(1))],
        "{e:?}"
    );
    let pool = &e.semaphores[1];
    assert_eq!(pool.kept, Some(1));
    assert_eq!(
        pool.shortfall,
        Some(1),
        "the one free permit is kept: one more must be released"
    );
    // The arithmetic is spelled out, and the child the room is kept for is named.
    assert!(
        pool.reason.contains("b borrows beyond its guarantee (0)")
            && pool
                .reason
                .contains("for the guarantees of its other active children: a (1 of its 2 unused)")
            && pool.reason.ends_with(
                "1 needed + 1 kept - 1 free = 1 more permit must be released here first"
            ),
        "{}",
        pool.reason
    );
    assert_eq!(pool.position, Some(1), "it is in the pool's line too");
    // The waiters view and first_waiters list the same line: on a parent, what waits below it.
    let conn = db.conn().await;
    for query in [
        "SELECT external_id, position, count FROM permitq.waiters WHERE semaphore = 'pool'",
        "SELECT external_id, position, count FROM permitq.first_waiters('pool', 10)",
    ] {
        let line: Vec<(String, i64, i32)> = conn
            .query(query, &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        assert_eq!(line, [("b2".to_string(), 1, 1)], "{query}");
    }
    let usage = client.usage().await.unwrap();
    let waiting = |name: &str| usage.iter().find(|u| u.name == name).unwrap().waiting;
    assert_eq!(
        (waiting("b"), waiting("pool"), waiting("a")),
        (1, 1, 0),
        "a parent counts the requests waiting below it"
    );
    let held: Vec<&str> = pool
        .holders
        .iter()
        .map(|h| h.external_id.as_str())
        .collect();
    assert_eq!(
        held.len(),
        2,
        "the pool's holders are those below it: {held:?}"
    );

    // A second borrower behind b2: what b2 takes first is in its arithmetic (the pool is fair).
    client
        .submit(&Request::new("b3").permit("b", 1))
        .await
        .unwrap();
    examined(&client, "b3").await;
    let e = client.explain("b3").await.unwrap().unwrap();
    let pool = &e.semaphores[1];
    assert_eq!(pool.position, Some(2));
    assert!(
        pool.reason.ends_with(
            "1 needed + 1 kept + 1 for the request ahead in its line - 1 free = 2 more permits \
             must be released here first"
        ),
        "{}",
        pool.reason
    );
    client.release("b3").await.unwrap();

    // a's 2 go beyond its guarantee (it has 1 of it unused): a borrows, and takes its turn in
    // the pool's line, behind b2.
    client
        .submit(&Request::new("a2").permit("a", 2))
        .await
        .unwrap();
    examined(&client, "a2").await;
    let e = client.explain("a2").await.unwrap().unwrap();
    let pool = &e.semaphores[1];
    assert_eq!(pool.position, Some(2));
    assert!(
        pool.reason.contains("request b2 is first in line"),
        "{}",
        pool.reason
    );
}

/// A request within its child's guarantee, short on the parent: the explanation names who holds
/// the parent's room beyond their guarantees, and the ways their permits end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_within_a_guarantee_names_the_borrowers_and_the_ways_out() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("pool", 2, None).await.unwrap();
    for (name, guarantee) in [("a", 1), ("b", 0)] {
        let settings = permitq::SemaphoreSettings::new()
            .parent("pool")
            .guarantee(guarantee);
        client.set_semaphore(name, 2, &settings).await.unwrap();
    }
    let _worker = db.notified_worker("explain-w");
    // b borrows the whole pool while a is idle; then a asks within its guarantee.
    let _b = client
        .acquire(&Request::new("b1").permit("b", 2), SOON)
        .await
        .unwrap();
    client
        .submit(&Request::new("a1").permit("a", 1))
        .await
        .unwrap();
    examined(&client, "a1").await;
    let e = client.explain("a1").await.unwrap().unwrap();
    let (a, pool) = (&e.semaphores[0], &e.semaphores[1]);
    assert_eq!(
        a.reason, "it fits here; what holds it back is on its other rows: pool",
        "{e:?}"
    );
    assert_eq!(pool.shortfall, Some(1), "{e:?}");
    assert!(
        pool.reason.starts_with(
            "parent: within the guarantee of a (1), waits for 1 more permit to be released \
             (its room is lent beyond their guarantees to: b (2 held, guarantee 0))"
        ) && pool.reason.contains("past a worker's --max-hold")
            && pool.reason.contains("`permitq revoke ID`"),
        "{}",
        pool.reason
    );
}

/// Within a fair child's guarantee, a later request of the child does not take the parent's
/// room that the child's first in line waits for: it waits behind it, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_childs_first_in_line_keeps_its_room_on_the_parent_and_explain_says_so() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("pool", 6, None).await.unwrap();
    for (name, guarantee) in [("x", 0), ("y", 2)] {
        let settings = permitq::SemaphoreSettings::new()
            .parent("pool")
            .guarantee(guarantee);
        client.set_semaphore(name, 6, &settings).await.unwrap();
    }
    let _worker = db.notified_worker("explain-w");
    // x borrows 5 while y is idle; y's 2, within its guarantee, wait for 1 more permit.
    let x = client
        .acquire(&Request::new("x1").permit("x", 5), SOON)
        .await
        .unwrap();
    client
        .submit(&Request::new("y1").permit("y", 2))
        .await
        .unwrap();
    examined(&client, "y1").await;
    // y's later 1 would fit the pool's free permit, but that is y1's room.
    client
        .submit(&Request::new("y2").permit("y", 1))
        .await
        .unwrap();
    common::wait_until(SOON, "y2 examined", || async {
        client.explain("y2").await.unwrap().is_some_and(|e| {
            e.state != State::New || e.semaphores.iter().all(|s| s.position.is_some())
        })
    })
    .await;
    let e = client.explain("y2").await.unwrap().unwrap();
    assert_eq!(e.state, State::New, "{e:?}");
    let pool = &e.semaphores[1];
    assert_eq!(pool.semaphore, "pool");
    assert_eq!(
        pool.reason,
        "parent: request y1 is first in line at y (priority 0, needs 2) and waits for room here \
         too; a later request there goes after it, so 2 more permits must be released here \
         first (2 for it, then 1 for this one; 1 free now)"
    );
    // x's release makes room for both (granted together, or y1 first).
    x.release().await.unwrap();
    for id in ["y1", "y2"] {
        common::wait_until(SOON, "both granted", || async {
            client.status(id).await.unwrap().unwrap().state == State::Acquired
        })
        .await;
    }
}

/// Behind its child's head within the guarantee, a request that the head's grant will push
/// beyond the guarantee is told that the room kept for the other children counts then too; a
/// request within the guarantee of a greedy child is told that later, smaller ones may use it
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_says_when_a_request_will_borrow_and_what_a_greedy_child_allows() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("pool", 8, None).await.unwrap();
    for (name, guarantee, fair) in [
        ("x", 0, true),
        ("y", 2, true),
        ("z", 2, true),
        ("g", 2, false),
    ] {
        let settings = permitq::SemaphoreSettings::new()
            .parent("pool")
            .guarantee(guarantee)
            .fair(fair);
        client.set_semaphore(name, 8, &settings).await.unwrap();
    }
    let _worker = db.notified_worker("explain-w");
    // z holds 1 of its 2 (1 kept for it); x borrows 6: 1 free.
    let _z = client
        .acquire(&Request::new("z1").permit("z", 1), SOON)
        .await
        .unwrap();
    let _x = client
        .acquire(&Request::new("x1").permit("x", 6), SOON)
        .await
        .unwrap();
    client
        .submit(&Request::new("y1").permit("y", 2))
        .await
        .unwrap();
    examined(&client, "y1").await;
    client
        .submit(&Request::new("y2").permit("y", 1))
        .await
        .unwrap();
    examined(&client, "y2").await;
    let e = client.explain("y2").await.unwrap().unwrap();
    assert!(
        e.semaphores[1].reason.ends_with(
            "; once it is granted, this request goes beyond the guarantee of y and borrows, so \
             the 1 kept for the other children's guarantees must be free as well"
        ),
        "{}",
        e.semaphores[1].reason
    );
    client
        .submit(&Request::new("g1").permit("g", 2))
        .await
        .unwrap();
    examined(&client, "g1").await;
    let e = client.explain("g1").await.unwrap().unwrap();
    assert!(
        e.semaphores[1].reason.contains(
            "g is greedy: a later, smaller request of it may take part of the guarantee first, \
             and this one then borrows (`permitq semaphore set g 8 --fair` keeps its line)"
        ),
        "{}",
        e.semaphores[1].reason
    );
}

/// A row that fits names the rows short of room as what holds the request back, not every
/// other row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_fits_names_only_the_rows_that_are_short() {
    let db = TestDb::new().await;
    let client = db.client().await;
    for (name, capacity) in [("a", 2), ("b", 2), ("c", 1)] {
        client.set_capacity(name, capacity, None).await.unwrap();
    }
    let _worker = db.notified_worker("explain-w");
    let _c = client
        .acquire(&Request::new("c1").permit("c", 1), SOON)
        .await
        .unwrap();
    client
        .submit(
            &Request::new("r")
                .permit("a", 1)
                .permit("b", 1)
                .permit("c", 1),
        )
        .await
        .unwrap();
    examined(&client, "r").await;
    let e = client.explain("r").await.unwrap().unwrap();
    for row in &e.semaphores[..2] {
        assert_eq!(
            row.reason, "it fits here; what holds it back is on its other rows: c",
            "{e:?}"
        );
    }
}

/// Requests no worker has examined yet but that are placed ahead (a higher priority) count in
/// the place in line and the permits ahead: they will be served first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unexamined_requests_placed_ahead_count_in_the_place_in_line() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 1, None).await.unwrap();
    let worker = db.notified_worker("explain-w");
    let _holder = client
        .acquire(
            &Request::new("holder")
                .permit("gpu", 1)
                .ttl(Duration::from_secs(60)),
            SOON,
        )
        .await
        .unwrap();
    client
        .submit(&Request::new("waiting").permit("gpu", 1))
        .await
        .unwrap();
    examined(&client, "waiting").await;
    // No worker from here on: what is submitted now stays unexamined.
    worker.stop().await;
    for id in ["urgent-1", "urgent-2"] {
        client
            .submit(&Request::new(id).permit("gpu", 1).priority(10))
            .await
            .unwrap();
    }
    let gpu = &client.explain("waiting").await.unwrap().unwrap().semaphores[0];
    assert_eq!(
        (gpu.position, gpu.permits_ahead),
        (Some(3), Some(2)),
        "two unexamined requests of priority 10 go before it: {gpu:?}"
    );
}

/// A request that fits behind a fair head and leaves it its room, while no worker runs: the
/// reason says it is granted at the next pass (it named no other semaphore to wait for).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_fits_beside_the_head_is_granted_at_the_next_pass() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 3, Some(true)).await.unwrap();
    let worker = db.notified_worker("explain-w");
    client
        .submit(&Request::new("holder").permit("gpu", 2))
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("holder", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    for (id, count) in [("head", 2), ("small", 1)] {
        client
            .submit(&Request::new(id).permit("gpu", count))
            .await
            .unwrap();
        examined(&client, id).await;
    }
    worker.stop().await;
    client.release("holder").await.unwrap();
    let e = client.explain("small").await.unwrap().unwrap();
    // It fits and leaves the head its room: fairness holds nothing back, so it is not named
    // (and with the worker stopped, it waits for one to run).
    assert_eq!(
        e.semaphores[0].reason,
        "it fits: a worker grants it once one runs (none does: start one, `permitq worker`)",
        "{e:?}"
    );
}

/// Behind a fair head, a request that fits and leaves the head its room is not held back by
/// fairness: its explanation points at its other rows; one that would take the head's room
/// says how many permits must be released first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fairness_is_named_only_where_it_holds_a_request_back() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 4, Some(true)).await.unwrap();
    client
        .set_capacity("licence", 2, Some(false))
        .await
        .unwrap();
    let _worker = db.notified_worker("explain-w");
    let hold = client
        .acquire(&Request::new("m-h").permit("licence", 2), SOON)
        .await
        .unwrap();
    // The head of gpu's line waits for licence; m-w behind it takes 1 of 4 free gpus.
    let mut head = Request::new("m-x").permit("licence", 1).permit("gpu", 1);
    head.priority = 50;
    client.submit(&head).await.unwrap();
    examined(&client, "m-x").await;
    client
        .submit(&Request::new("m-w").permit("gpu", 1).permit("licence", 1))
        .await
        .unwrap();
    examined(&client, "m-w").await;
    let e = client.explain("m-w").await.unwrap().unwrap();
    let gpu = e.semaphores.iter().find(|s| s.semaphore == "gpu").unwrap();
    assert_eq!(
        gpu.reason, "it fits here; what holds it back is on its other rows: licence",
        "{e:?}"
    );
    hold.release().await.unwrap();
    for id in ["m-x", "m-w"] {
        assert_eq!(common::settled_state(&client, id).await, State::Acquired);
        client.release(id).await.unwrap();
    }

    // gpu: 3 held, 1 free; the head needs 2, w3 needs 1: taking it would leave the head 0.
    let held = client
        .acquire(&Request::new("f-h").permit("gpu", 3), SOON)
        .await
        .unwrap();
    for (id, count) in [("f-head", 2), ("f-1", 1)] {
        client
            .submit(&Request::new(id).permit("gpu", count))
            .await
            .unwrap();
        examined(&client, id).await;
    }
    let e = client.explain("f-1").await.unwrap().unwrap();
    assert!(
        e.semaphores[0].reason.ends_with(
            "what is free would not leave it its room, so 2 more permits must be released first"
        ),
        "{e:?}"
    );
    // A head that needs the whole capacity: no release lets f-1 go before it, so explain does
    // not ask for more releases than there are permits held.
    let mut whole = Request::new("f-whole").permit("gpu", 4);
    whole.priority = 50;
    client.submit(&whole).await.unwrap();
    examined(&client, "f-whole").await;
    let e = client.explain("f-1").await.unwrap().unwrap();
    assert!(
        e.semaphores[0].reason.ends_with(
            "it cannot go before it (the head needs 4 of the capacity 4, so with this \
             request's 1 held it could never fit), so it goes after it: once the head is granted (3 more permits released) and 1 permit is \
             free again"
        ),
        "{e:?}"
    );
    held.release().await.unwrap();
}

/// Explain says when a capacity was lowered below what is held (its arithmetic would not add
/// up otherwise), and when a request's wait ran out with no pass to end it yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_says_a_capacity_under_what_is_held_and_a_wait_that_ran_out() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 4, None).await.unwrap();
    let worker = db.notified_worker("explain-w");
    let _held = client
        .acquire(&Request::new("holder").permit("gpu", 4), SOON)
        .await
        .unwrap();
    client
        .submit(
            &Request::new("late")
                .permit("gpu", 1)
                .wait(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    examined(&client, "late").await;
    worker.stop().await;
    client.set_capacity("gpu", 2, None).await.unwrap();
    common::wait_until(SOON, "the wait ran out, and explain says so", || async {
        let e = client.explain("late").await.unwrap().unwrap();
        let reason = &e.semaphores[0].reason;
        reason.starts_with("its wait ran out ")
            // No worker runs (stopped above): no pass is promised.
            && reason.contains("a worker ends it as timeout once one runs, not granted")
            && reason.contains(
                "(4 held here, more than its capacity 2: it was lowered below what is held",
            )
    })
    .await;
}

/// Behind several requests on a fair semaphore, what must be released counts all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_shortfall_counts_every_request_ahead() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 4, Some(true)).await.unwrap();
    let _worker = db.notified_worker("explain-w");
    let _held = client
        .acquire(&Request::new("h1").permit("gpu", 4), SOON)
        .await
        .unwrap();
    for (id, count, priority) in [("a1", 1, 10), ("b1", 1, 0), ("c1", 3, 0)] {
        client
            .submit(&Request::new(id).permit("gpu", count).priority(priority))
            .await
            .unwrap();
        examined(&client, id).await;
    }
    let e = client.explain("c1").await.unwrap().unwrap();
    assert!(
        e.semaphores[0].reason.ends_with(
            "and 5 more permits must be released (2 for the 2 requests ahead first, then 3 for it)"
        ),
        "{e:?}"
    );
}

/// A request naming a full parent, behind children's requests within their guarantees: what
/// those take is in the room kept for them already, so it is not counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_ahead_within_their_guarantees_are_not_counted_twice() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("acc", 8, None).await.unwrap();
    let lab = permitq::SemaphoreSettings::new()
        .parent("acc")
        .guarantee(2)
        .max_instances(4);
    client.set_semaphore("lab:*", 6, &lab).await.unwrap();
    let _worker = db.notified_worker("explain-w");
    let mut held = Vec::new();
    for (id, name, count) in [("la-1", "lab:a", 6), ("lb-1", "lab:b", 2)] {
        held.push(
            client
                .acquire(&Request::new(id).permit(name, count), SOON)
                .await
                .unwrap(),
        );
    }
    // c and d ask within their guarantees; then a request on the parent itself borrows.
    for (id, name, count) in [
        ("lc-1", "lab:c", 2),
        ("ld-1", "lab:d", 1),
        ("acc-1", "acc", 1),
    ] {
        client
            .submit(&Request::new(id).permit(name, count))
            .await
            .unwrap();
        examined(&client, id).await;
    }
    let e = client.explain("acc-1").await.unwrap().unwrap();
    let acc = &e.semaphores[0];
    assert_eq!(
        (acc.kept, acc.shortfall, acc.position),
        (Some(4), Some(5), Some(3)),
        "{e:?}"
    );
    assert!(
        acc.reason
            .ends_with("1 needed + 4 kept - 0 free = 5 more permits must be released here first"),
        "{}",
        acc.reason
    );
}
