//! Nested limits: a grant on a child also takes from every ancestor, releases and leases give
//! back to every level, rate windows follow; guarantees are kept for active children and lent
//! while they are idle; bad trees are refused and write nothing.

use permitq_test_support as common;

use std::time::Duration;

use common::{check_invariants, state_of, wait_until, TestDb};
use permitq::{Client, Request, SemaphoreSettings, State};

const SOON: Duration = Duration::from_secs(10);

pub(crate) async fn nest(client: &Client, name: &str, capacity: i32, parent: &str, guarantee: i32) {
    client
        .set_semaphore(
            name,
            capacity,
            &SemaphoreSettings::new().parent(parent).guarantee(guarantee),
        )
        .await
        .unwrap_or_else(|e| panic!("nest {name} in {parent}: {e}"));
}

pub(crate) async fn acquired(client: &Client, id: &str) {
    let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired, "{id}: {r:?}");
}

/// Waits until a worker has looked at `id` and left it waiting.
pub(crate) async fn left_waiting(conn: &tokio_postgres::Client, id: &str) {
    wait_until(SOON, &format!("{id} examined and waiting"), || async {
        conn.query_one(
            "SELECT state = 'new' AND examined FROM permitq.permit_request WHERE external_id = $1",
            &[&id],
        )
        .await
        .is_ok_and(|r| r.get::<_, bool>(0))
    })
    .await;
}

/// Submits a fail-fast request and says how it ended (`Acquired/` or `Error/<code>`).
pub(crate) async fn fails_fast(client: &Client, id: &str, name: &str, count: i64) -> String {
    client
        .submit(&Request::new(id).permit(name, count).wait(Duration::ZERO))
        .await
        .unwrap();
    let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
    format!(
        "{:?}/{}",
        r.state,
        r.error_code
            .map(|c| c.as_str().to_string())
            .unwrap_or_default()
    )
}

async fn held(conn: &tokio_postgres::Client, name: &str) -> i64 {
    conn.query_one(
        "SELECT held FROM permitq.semaphore_usage WHERE name = $1",
        &[&name],
    )
    .await
    .unwrap()
    .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_takes_from_every_level_and_a_release_gives_every_level_back() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("global", 3, None).await.unwrap();
    nest(&client, "pool", 3, "global", 0).await;
    // Template children: each instance carries the parent (and guarantee 1, 3 instances at most).
    client
        .set_semaphore(
            "tenant:*",
            2,
            &SemaphoreSettings::new().parent("pool").guarantee(1),
        )
        .await
        .expect_err("an unbounded template may not promise 1 per instance of a pool of 3");
    conn.execute(
        "SELECT permitq.set_capacity('tenant:*', 2, max_instances => 3)",
        &[],
    )
    .await
    .unwrap();
    nest(&client, "tenant:*", 2, "pool", 1).await;
    let _worker = db.notified_worker("w1");

    for (id, tenant) in [("a1", "tenant:a"), ("a2", "tenant:a"), ("b1", "tenant:b")] {
        client
            .submit(&Request::new(id).permit(tenant, 1))
            .await
            .unwrap();
        acquired(&client, id).await;
    }
    let a = common::semaphore(&client, "tenant:a").await.unwrap();
    assert_eq!((a.parent.as_deref(), a.guarantee), (Some("pool"), 1));
    for level in ["pool", "global"] {
        assert_eq!(
            held(&conn, level).await,
            3,
            "{level} counts what is held below it"
        );
    }
    // b has room of its own (1 of 2), the pool has none: it waits, all or nothing.
    client
        .submit(&Request::new("b2").permit("tenant:b", 1))
        .await
        .unwrap();
    left_waiting(&conn, "b2").await;
    assert_eq!(
        client.status("b2").await.unwrap().unwrap().state,
        State::New
    );
    // A release gives back to the tenant, the pool and the global limit: b2 goes.
    client.release("a1").await.unwrap();
    acquired(&client, "b2").await;
    common::wait_folded(&db.url).await;
    for level in ["pool", "global"] {
        assert_eq!(held(&conn, level).await, 3, "{level}");
    }
    check_invariants(&conn).await.unwrap();

    // A lease that runs out gives every level back too.
    client.release("a2").await.unwrap();
    client
        .submit(
            &Request::new("leased")
                .permit("tenant:c", 1)
                .ttl(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    acquired(&client, "leased").await;
    client
        .submit(&Request::new("next").permit("tenant:a", 1))
        .await
        .unwrap();
    left_waiting(&conn, "next").await;
    let r = client
        .wait_settled("leased", Duration::from_secs(20))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.state, State::Acquired);
    acquired(&client, "next").await;
    assert_eq!(state_of(&client, "leased").await, "released/expired");
    common::wait_folded(&db.url).await;
    assert_eq!(held(&conn, "global").await, 3);
    check_invariants(&conn).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_active_childs_guarantee_comes_back_to_it_before_anyone_borrows_again() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 4, None).await.unwrap();
    nest(&client, "a", 4, "pool", 2).await;
    nest(&client, "b", 4, "pool", 2).await;
    let _worker = db.notified_worker("w1");

    // a is idle: b borrows its share, all four.
    for i in 1..=4 {
        let id = format!("b{i}");
        client
            .submit(&Request::new(&id).permit("b", 1))
            .await
            .unwrap();
        acquired(&client, &id).await;
    }
    // b5 comes first, then a1: both wait on the full pool.
    for (id, name) in [("b5", "b"), ("a1", "a")] {
        client
            .submit(&Request::new(id).permit(name, 1))
            .await
            .unwrap();
        left_waiting(&conn, id).await;
    }
    // One permit comes back. b is over its guarantee (it would borrow it); a, active now, is
    // under its own: a1 gets it although b5 came first.
    client.release("b1").await.unwrap();
    acquired(&client, "a1").await;
    // The next one too: a still has 1 of its 2 unused.
    client.release("b2").await.unwrap();
    client
        .submit(&Request::new("a2").permit("a", 1))
        .await
        .unwrap();
    acquired(&client, "a2").await;
    assert_eq!(state_of(&client, "b5").await, "new");
    // a at its guarantee: what comes back now is b's to borrow again.
    client.release("b3").await.unwrap();
    acquired(&client, "b5").await;
    check_invariants(&conn).await.unwrap();
}

/// A child's first in line that borrows at the parent does not hold back a later request of
/// the child within its guarantee: that request keeps a sibling active, whose reserve the head
/// waits for, and neither would ever go. The later one goes; the head goes once the sibling is
/// idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrowing_head_and_a_request_within_two_guarantees_do_not_wait_for_each_other() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 10, None).await.unwrap();
    nest(&client, "y", 10, "pool", 5).await;
    nest(&client, "z", 10, "pool", 5).await;
    let _worker = db.notified_worker("w1");
    client
        .submit(&Request::new("z0").permit("z", 1))
        .await
        .unwrap();
    acquired(&client, "z0").await;
    // y's head borrows 3 beyond y's 5 and must leave z's unused 4: it waits.
    client
        .submit(&Request::new("h").permit("y", 8))
        .await
        .unwrap();
    left_waiting(&conn, "h").await;
    // Within both guarantees: granted, though behind h in y's line (h borrows: it takes its
    // turn in the pool's line, and keeps no room there).
    client
        .submit(&Request::new("w").permit("y", 1).permit("z", 2))
        .await
        .unwrap();
    acquired(&client, "w").await;
    assert_eq!(state_of(&client, "h").await, "new");
    // z idle again: h goes.
    client.release("z0").await.unwrap();
    client.release("w").await.unwrap();
    acquired(&client, "h").await;
    check_invariants(&conn).await.unwrap();
}

/// A request that waits beyond its child's guarantee borrows, and keeps no reserve: a borrower
/// ahead of it in the parent's line is not held back by it, which it waits behind (before, each
/// waited for the other with nothing held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waiting_beyond_its_guarantee_keeps_no_reserve_from_the_borrower_it_waits_behind()
{
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 2, None).await.unwrap();
    nest(&client, "team", 2, "pool", 1).await;
    let _worker = db.notified_worker("w1");
    client
        .submit(&Request::new("x").permit("pool", 1))
        .await
        .unwrap();
    acquired(&client, "x").await;
    for (id, name) in [("b", "pool"), ("t", "team")] {
        client
            .submit(&Request::new(id).permit(name, 2))
            .await
            .unwrap();
        left_waiting(&conn, id).await;
    }
    // The pool is free again: b goes first (t's 2 are beyond team's 1, and wait their turn).
    client.release("x").await.unwrap();
    acquired(&client, "b").await;
    assert_eq!(state_of(&client, "t").await, "new");
    client.release("b").await.unwrap();
    acquired(&client, "t").await;
    check_invariants(&conn).await.unwrap();
}

/// A request that waited within a child's guarantee and names the parent too is granted once
/// there is room: its own waiter row does not keep the child's guarantee in reserve against it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_waited_keeps_no_reserve_against_itself() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 2, None).await.unwrap();
    nest(&client, "y", 2, "pool", 2).await;
    let _worker = db.notified_worker("w1");
    client
        .submit(&Request::new("x").permit("pool", 2))
        .await
        .unwrap();
    acquired(&client, "x").await;
    client
        .submit(&Request::new("r").permit("y", 1).permit("pool", 1))
        .await
        .unwrap();
    left_waiting(&conn, "r").await;
    client.release("x").await.unwrap();
    acquired(&client, "r").await;
    check_invariants(&conn).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_windows_follow_the_tree() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .set_rate_limit("api", 2, Duration::from_secs(3600), None)
        .await
        .unwrap();
    nest(&client, "api:search", 10, "api", 0).await;
    let _worker = db.notified_worker("w1");
    for id in ["s1", "s2"] {
        client
            .submit(&Request::new(id).permit("api:search", 1))
            .await
            .unwrap();
        acquired(&client, id).await;
        client.release(id).await.unwrap();
    }
    // The child has room; its parent's window has none, whatever was released.
    client
        .submit(
            &Request::new("s3")
                .permit("api:search", 1)
                .wait(Duration::ZERO),
        )
        .await
        .unwrap();
    let r = client.wait_settled("s3", SOON).await.unwrap().unwrap();
    assert_eq!(
        r.error_code.map(|c| c.as_str().to_string()).as_deref(),
        Some("no_capacity")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_that_cannot_be_kept_is_refused_and_writes_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 4, None).await.unwrap();
    nest(&client, "a", 4, "pool", 3).await;
    nest(&client, "deep1", 4, "pool", 0).await;
    client.set_capacity("tpl:*", 1, None).await.unwrap();
    let before: i64 = conn
        .query_one("SELECT count(*) FROM permitq.capacity_change", &[])
        .await
        .unwrap()
        .get(0);
    let refused = [
        (
            "b",
            4,
            SemaphoreSettings::new().parent("nope"),
            "does not exist",
        ),
        ("b", 4, SemaphoreSettings::new().parent("tpl:*"), "template"),
        (
            "b",
            4,
            SemaphoreSettings::new().parent("pool").guarantee(2),
            "add up to 5",
        ),
        (
            "b",
            2,
            SemaphoreSettings::new().parent("pool").guarantee(3),
            "more than the capacity",
        ),
        (
            "b",
            4,
            SemaphoreSettings::new().guarantee(1),
            "give it one (`permitq semaphore set b 4 --parent PARENT --guarantee 1`), or leave \
             --guarantee out",
        ),
        (
            "pool",
            4,
            SemaphoreSettings::new().parent("a"),
            "itself or below it",
        ),
        ("pool", 2, SemaphoreSettings::new(), "add up to 3"),
    ];
    for (name, capacity, settings, why) in refused {
        let e = client
            .set_semaphore(name, capacity, &settings)
            .await
            .expect_err(why);
        assert_eq!(e.code().map(|c| c.code()), Some("22023"), "{e}");
        assert!(e.to_string().contains(why), "{why}: {e}");
    }
    // Too deep: deep4 has 4 levels above it (deep3, deep2, deep1, pool); one more is refused.
    nest(&client, "deep2", 4, "deep1", 0).await;
    nest(&client, "deep3", 4, "deep2", 0).await;
    nest(&client, "deep4", 4, "deep3", 0).await;
    let e = client
        .set_semaphore("deep5", 4, &SemaphoreSettings::new().parent("deep4"))
        .await
        .expect_err("five levels above");
    assert!(
        e.to_string().contains(
            "nesting too deep: deep5 would have 5 levels above it, and a semaphore may have at \
             most 4 (its parents, their parents, and so on): choose a parent with at most 3 \
             above it, or none (`--no-parent`)"
        ),
        "{e}"
    );
    // A semaphore holding permits keeps its parent.
    let _worker = db.notified_worker("w1");
    client
        .submit(&Request::new("held").permit("a", 1))
        .await
        .unwrap();
    acquired(&client, "held").await;
    let e = client
        .set_semaphore("a", 4, &SemaphoreSettings::new().parent(""))
        .await
        .expect_err("a holds a permit");
    assert!(e.to_string().contains("once it is idle"), "{e}");
    // An instance takes its parent and guarantee from its template.
    client
        .submit(&Request::new("instance").permit("tpl:x", 1))
        .await
        .unwrap();
    acquired(&client, "instance").await;
    let e = client
        .set_semaphore("tpl:x", 1, &SemaphoreSettings::new().parent("pool"))
        .await
        .expect_err("an instance");
    assert!(e.to_string().contains("from its template"), "{e}");
    let after: i64 = conn
        .query_one(
            "SELECT count(*) FROM permitq.capacity_change WHERE semaphore <> 'tpl:x'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        after,
        before + 3,
        "only deep2, deep3 and deep4 were written"
    );
    // The audit has the tree.
    let audited: (Option<String>, i32) = conn
        .query_one(
            "SELECT new_parent, new_guarantee FROM permitq.capacity_change \
             WHERE semaphore = 'a' ORDER BY id DESC LIMIT 1",
            &[],
        )
        .await
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(audited, (Some("pool".to_string()), 3));
    // A worker cannot record a grant as taking less than it names.
    let id: i64 = conn
        .query_one(
            "SELECT id FROM permitq.permit_request WHERE external_id = 'held'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let e = conn
        .execute(
            "SELECT permitq.apply_decision('w', ARRAY[$1::bigint], '{}', '{}', '{}', \
             jsonb_build_object($1::text, '{\"pool\": 1}'::jsonb))",
            &[&id],
        )
        .await
        .expect_err("charges without the named semaphore");
    assert_eq!(
        e.code(),
        Some(&tokio_postgres::error::SqlState::INVALID_PARAMETER_VALUE)
    );
    assert!(common::semaphore(&client, "b").await.is_none());
    assert_eq!(
        common::semaphore(&client, "a")
            .await
            .unwrap()
            .parent
            .as_deref(),
        Some("pool")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guaranteed_request_waits_no_longer_than_max_hold_for_borrowed_room() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client.set_capacity("pool", 4, None).await.unwrap();
    nest(&client, "a", 4, "pool", 2).await;
    nest(&client, "b", 4, "pool", 0).await;
    let mut config = common::quiet_config("w1");
    config.maintenance.max_hold = Some(Duration::from_secs(2));
    let _worker = db.worker(config);
    // b borrows all four while a is idle, and never gives them back.
    client
        .submit(&Request::new("hog").permit("b", 4))
        .await
        .unwrap();
    acquired(&client, "hog").await;
    client
        .submit(&Request::new("a1").permit("a", 2))
        .await
        .unwrap();
    left_waiting(&conn, "a1").await;
    // --max-hold takes the borrowed permits back, and a gets its share: its wait is bounded by
    // how long a borrower may hold.
    let r = client
        .wait_settled("a1", Duration::from_secs(15))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.state, State::Acquired, "{r:?}");
    assert_eq!(state_of(&client, "hog").await, "released/stale");
    let waited = r
        .acquired_at
        .unwrap()
        .duration_since(r.created_at.unwrap())
        .unwrap();
    assert!(waited < Duration::from_secs(6), "a1 waited {waited:?}");
    check_invariants(&conn).await.unwrap();
}

/// pool 4 (fair or greedy), a (4, guaranteed `a_guarantee`) and b (4, no guarantee) in it.
async fn pool_of_a_and_b(client: &Client, fair: bool, a_guarantee: i32) {
    client.set_capacity("pool", 4, Some(fair)).await.unwrap();
    nest(client, "a", 4, "pool", a_guarantee).await;
    nest(client, "b", 4, "pool", 0).await;
}

/// Submits `id` for `count` of `name`.
pub(crate) async fn submit(client: &Client, id: &str, name: &str, count: i64) {
    client
        .submit(&Request::new(id).permit(name, count))
        .await
        .unwrap();
}

/// b holds 3 of the pool's 4 and a's request for 2 is left waiting (examined by a batch, so
/// recorded in the lines of a and the pool); then how b's fail-fast request for 1 more ends.
async fn b_borrows_while_a_waits(fair: bool, a_guarantee: i32) -> String {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    pool_of_a_and_b(&client, fair, a_guarantee).await;
    let _worker = db.notified_worker("w1");
    submit(&client, "hog", "b", 3).await;
    acquired(&client, "hog").await;
    submit(&client, "a1", "a", 2).await;
    left_waiting(&conn, "a1").await;
    fails_fast(&client, "b2", "b", 1).await
}

/// A sibling that only has waiters (it holds nothing, and is not in the deciding batch) keeps
/// its reserve. Greedy, so that no head hides a missed reserve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sibling_with_only_waiters_keeps_its_reserve_from_another_batch() {
    assert_eq!(b_borrows_while_a_waits(false, 2).await, "Error/no_capacity");
}

/// A sibling's release not folded yet (another transaction holds its row) counts as given
/// back: its unused guarantee grows at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_siblings_release_not_folded_yet_counts_as_given_back() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut locker = db.conn().await;
    pool_of_a_and_b(&client, false, 2).await;
    let _worker = db.notified_worker("w1");
    for id in ["a1", "a2"] {
        submit(&client, id, "a", 1).await;
        acquired(&client, id).await;
    }
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM permitq.semaphore WHERE name = 'a' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    client.release("a1").await.unwrap();
    // a holds 1 of its 2: the pool keeps 1; b's 3 would leave 0.
    assert_eq!(fails_fast(&client, "b1", "b", 3).await, "Error/no_capacity");
    tx.rollback().await.unwrap();
}

/// A borrower does not pass the room of a parent's recorded head (a request of another child,
/// examined by an earlier batch). No guarantee, so no reserve hides a missed head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_keeps_the_room_of_the_parents_recorded_head() {
    assert_eq!(b_borrows_while_a_waits(true, 0).await, "Error/no_capacity");
}

/// A transaction holding request `id`'s row, as a worker's claim holds it: workers skip it, so
/// it stays unexamined while the transaction lasts.
async fn row_held<'a>(
    locker: &'a mut tokio_postgres::Client,
    id: &str,
) -> tokio_postgres::Transaction<'a> {
    let tx = locker.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM permitq.permit_request WHERE external_id = $1 FOR UPDATE",
        &[&id],
    )
    .await
    .unwrap();
    tx
}

/// A borrower does not pass the room of a parent's head that no worker has examined yet (another
/// worker holds its row): the request names a child, and is ahead on the parent too. No
/// guarantee, so no reserve hides a missed head.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_keeps_the_room_of_the_parents_unexamined_head() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut locker = db.conn().await;
    pool_of_a_and_b(&client, true, 0).await;
    let worker = db.notified_worker("w1");
    submit(&client, "hog", "b", 3).await;
    acquired(&client, "hog").await;
    worker.stop().await;
    // a1 is first in the pool's line, unexamined: its row held as a worker's claim holds it.
    submit(&client, "a1", "a", 1).await;
    let tx = row_held(&mut locker, "a1").await;
    let _worker = db.notified_worker("w2");
    // b2 comes after a1, and the pool's last free permit is a1's.
    assert_eq!(fails_fast(&client, "b2", "b", 1).await, "Error/no_capacity");
    tx.rollback().await.unwrap();
    acquired(&client, "a1").await;
}

/// The same for a request on a template's instance not made yet (a worker makes it at the
/// grant): its place on the template's parent is kept, examined or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_borrower_keeps_the_room_of_a_head_on_an_instance_not_made_yet() {
    for examined in [true, false] {
        let db = TestDb::new().await;
        let client = db.client().await;
        let conn = db.conn().await;
        let mut locker = db.conn().await;
        client.set_capacity("pool", 4, Some(true)).await.unwrap();
        nest(&client, "lab:*", 4, "pool", 0).await;
        nest(&client, "b", 4, "pool", 0).await;
        client.set_capacity("full", 1, Some(true)).await.unwrap();
        let worker = db.notified_worker("w1");
        for (id, name, count) in [("hog", "b", 3), ("filler", "full", 1)] {
            submit(&client, id, name, count).await;
            acquired(&client, id).await;
        }
        // a1 asks for the pool's last permit through lab:new, which does not exist yet, and
        // for `full`, which keeps it waiting; examined by a worker, or not (its row held).
        let a1 = Request::new("a1").permit("lab:new", 1).permit("full", 1);
        let tx = if examined {
            client.submit(&a1).await.unwrap();
            left_waiting(&conn, "a1").await;
            None
        } else {
            worker.stop().await;
            client.submit(&a1).await.unwrap();
            Some(row_held(&mut locker, "a1").await)
        };
        let _worker = db.notified_worker("w2");
        assert_eq!(
            fails_fast(&client, "b2", "b", 1).await,
            "Error/no_capacity",
            "examined: {examined}"
        );
        if let Some(tx) = tx {
            tx.rollback().await.unwrap();
        }
    }
}

/// Explain's `kept` counts a sibling active only by its waiters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_keeps_room_for_a_sibling_active_only_by_its_waiters() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    pool_of_a_and_b(&client, false, 2).await;
    let _worker = db.notified_worker("w1");
    submit(&client, "b1", "b", 3).await;
    acquired(&client, "b1").await;
    // Within a's guarantee (a request beyond it would keep no reserve).
    submit(&client, "a1", "a", 2).await;
    left_waiting(&conn, "a1").await;
    submit(&client, "b2", "b", 1).await;
    left_waiting(&conn, "b2").await;
    let e = client.explain("b2").await.unwrap().unwrap();
    let pool = &e.semaphores[1];
    assert_eq!(pool.kept, Some(2), "{e:?}");
    assert!(
        pool.reason.contains("kept for the guarantees"),
        "{}",
        pool.reason
    );
}
