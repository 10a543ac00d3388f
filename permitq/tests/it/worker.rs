//! Workers against real PostgreSQL: every state and error code, all-or-nothing, wake-ups,
//! fairness across workers, and the invariants under concurrent workers.

use permitq_test_support as common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{check_invariants, quiet_config, settled_state, state_of, wait_until, TestDb};
use permitq::{ReleaseOutcome, Request, State};

const SOON: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_goes_new_acquired_released() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("db", 3, None).await.unwrap();
    let worker = db.notified_worker("w1");
    let submitted = client
        .submit(&Request::new("r1").permit("db", 2).owner("me"))
        .await
        .unwrap();
    assert_eq!(submitted.state, State::New);
    let r = client.wait_settled("r1", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired);
    assert!(r.fencing_token.is_some() && r.acquired_at >= r.created_at);
    assert_eq!(r.worker_id.as_deref(), Some("w1"));
    assert_eq!(client.semaphores().await.unwrap()[0].used, 2);
    assert_eq!(
        client.release("r1").await.unwrap(),
        ReleaseOutcome::Released
    );
    assert_eq!(
        client.release("r1").await.unwrap(),
        ReleaseOutcome::AlreadyReleased
    );
    let r = client.status("r1").await.unwrap().unwrap();
    assert_eq!(
        (r.state, r.release_reason),
        (State::Released, Some(permitq::ReleaseReason::Released))
    );
    assert!(r.released_at >= r.acquired_at);
    common::wait_folded(&db.url).await;
    assert_eq!(client.semaphores().await.unwrap()[0].used, 0);
    let conn = db.conn().await;
    let permit: (String, i32) = {
        let row = conn
            .query_one("SELECT state, count FROM permitq.permit", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(permit, ("released".to_string(), 2));
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_code() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("small", 1, None).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("holder").permit("small", 1))
        .await
        .unwrap();
    wait_until(SOON, "holder acquired", || async {
        state_of(&client, "holder").await == "acquired"
    })
    .await;

    client
        .submit(&Request::new("unknown").permit("small", 1).permit("nope", 1))
        .await
        .unwrap();
    client
        .submit(&Request::new("too-big").permit("small", 2))
        .await
        .unwrap();
    client
        .submit(&Request::new("fast").permit("small", 1).wait(Duration::ZERO))
        .await
        .unwrap();
    client
        .submit(
            &Request::new("patient")
                .permit("small", 1)
                .wait(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    client
        .submit(&Request::new("cancel-me").permit("small", 1))
        .await
        .unwrap();
    for (id, expected) in [
        ("unknown", "error/unknown_semaphore"),
        ("too-big", "error/exceeds_capacity"),
        ("fast", "error/no_capacity"),
    ] {
        let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
        assert!(r.is_settled(), "{id}");
        assert_eq!(state_of(&client, id).await, expected);
    }
    // Timeout: within wait + 2 sweep intervals (+ slack), by the database's own timestamps.
    let r = client.wait_settled("patient", SOON).await.unwrap().unwrap();
    assert_eq!(state_of(&client, "patient").await, "error/timeout");
    let waited = r
        .settled_at
        .unwrap()
        .duration_since(r.created_at.unwrap())
        .unwrap();
    assert!(
        waited >= Duration::from_millis(300),
        "timed out early: {waited:?}"
    );
    assert!(
        waited <= Duration::from_millis(300 + 2 * 200 + 300),
        "timed out late: {waited:?}"
    );
    assert_eq!(
        client.release("cancel-me").await.unwrap(),
        ReleaseOutcome::Cancelled
    );
    assert_eq!(state_of(&client, "cancel-me").await, "error/cancelled");
    // Nothing errored holds capacity.
    assert_eq!(client.semaphores().await.unwrap()[0].used, 1);
    check_invariants(&db.conn().await).await.unwrap();
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_semaphore_requests_are_all_or_nothing_while_one_is_full() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("a", 5, None).await.unwrap();
    client.set_capacity("b", 1, None).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("b-holder").permit("b", 1))
        .await
        .unwrap();
    wait_until(SOON, "b held", || async {
        state_of(&client, "b-holder").await == "acquired"
    })
    .await;

    client
        .submit(&Request::new("both").permit("a", 2).permit("b", 1))
        .await
        .unwrap();
    // It is examined and left waiting: a waiter row per semaphore, nothing taken from `a`.
    let conn = db.conn().await;
    wait_until(SOON, "both examined", || async {
        conn.query_one(
            "SELECT examined FROM permitq.permit_request WHERE external_id = 'both'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
    })
    .await;
    let used: BTreeMap<String, i64> = client
        .semaphores()
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.name, s.used))
        .collect();
    assert_eq!(used, BTreeMap::from([("a".into(), 0), ("b".into(), 1)]));
    let permits: i64 = conn
        .query_one("SELECT count(*) FROM permitq.permit p JOIN permitq.permit_request r ON r.id = p.request_id WHERE r.external_id = 'both'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(permits, 0);
    assert_eq!(state_of(&client, "both").await, "new");

    client.release("b-holder").await.unwrap();
    let r = client.wait_settled("both", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired);
    let used: BTreeMap<String, i64> = client
        .semaphores()
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.name, s.used))
        .collect();
    assert_eq!(used, BTreeMap::from([("a".into(), 2), ("b".into(), 1)]));
    check_invariants(&conn).await.unwrap();
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_and_capacity_increase_wake_the_workers() {
    // The fallback poll is 120s: only NOTIFY can grant within the deadline.
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("one", 1, None).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("first").permit("one", 1))
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "first").await, State::Acquired);
    client
        .submit(&Request::new("second").permit("one", 1))
        .await
        .unwrap();
    client
        .submit(&Request::new("third").permit("one", 1))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(state_of(&client, "second").await, "new");

    client.release("first").await.unwrap();
    let r = client
        .wait_settled("second", Duration::from_secs(3))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(r.state, State::Acquired, "release woke a worker");
    assert_eq!(state_of(&client, "third").await, "new");

    client.set_capacity("one", 2, None).await.unwrap();
    let r = client
        .wait_settled("third", Duration::from_secs(3))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        r.state,
        State::Acquired,
        "a capacity increase woke a worker"
    );
    worker.stop().await;
}

/// Releases reaching a sleeping worker a few ms apart: the fold of the later ones is deferred
/// (a worker folds at most every 10 ms), and the worker comes back for it then, not after its
/// 120 s fallback poll. Until the fold, `used` is stale and the `released` events unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_close_together_are_folded_while_the_worker_sleeps() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 10, None).await.unwrap();
    let worker = db.notified_worker("w1");
    let conn = db.conn().await;
    for round in 0..8 {
        let ids: Vec<String> = (0..4).map(|i| format!("r{round}-{i}")).collect();
        for id in &ids {
            client
                .submit(&Request::new(id.as_str()).permit("s", 1))
                .await
                .unwrap();
        }
        for id in &ids {
            assert_eq!(settled_state(&client, id).await, State::Acquired);
        }
        wait_until(SOON, "the worker sleeps", || async {
            conn.query_one(
                "SELECT coalesce(bool_and(sleeping), false) FROM permitq.worker_wake",
                &[],
            )
            .await
            .is_ok_and(|row| row.get(0))
        })
        .await;
        for id in &ids {
            client.release(id).await.unwrap();
        }
        // Within 10 s, far below the worker's 120 s fallback poll.
        common::wait_folded(&db.url).await;
        assert_eq!(client.semaphores().await.unwrap()[0].used, 0);
    }
    worker.stop().await;
}

/// A request waiting on a fair semaphore whose capacity is then lowered below its count can
/// never be granted: it fails as `exceeds_capacity`, naming the new capacity, instead of keeping
/// the line's room for ever (the next request then goes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_a_lowered_capacity_no_longer_covers_fails_and_frees_the_line() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("licence", 3, None).await.unwrap();
    let worker = db.notified_worker("w1");
    client
        .submit(&Request::new("hold").permit("licence", 1))
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "hold").await, State::Acquired);
    client
        .submit(&Request::new("big").permit("licence", 3))
        .await
        .unwrap();
    wait_until(SOON, "big examined and waiting", || async {
        client
            .status("big")
            .await
            .unwrap()
            .is_some_and(|r| r.state == State::New && r.examined_at.is_some())
    })
    .await;
    client.set_capacity("licence", 2, None).await.unwrap();
    client.release("hold").await.unwrap();
    let big = client.wait_settled("big", SOON).await.unwrap().unwrap();
    assert_eq!(state_of(&client, "big").await, "error/exceeds_capacity");
    let detail = big.error_detail.expect("an error_detail");
    assert_eq!(
        (detail.semaphore.as_deref(), detail.count, detail.capacity),
        (Some("licence"), Some(3), Some(2)),
        "{detail:?}"
    );
    client
        .submit(&Request::new("small").permit("licence", 1))
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "small").await, State::Acquired);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lowering_capacity_revokes_nothing_and_holds_new_grants() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 3, None).await.unwrap();
    let worker = db.notified_worker("w1");
    for i in 0..3 {
        client
            .submit(&Request::new(format!("h{i}")).permit("s", 1))
            .await
            .unwrap();
    }
    for i in 0..3 {
        assert_eq!(
            settled_state(&client, &format!("h{i}")).await,
            State::Acquired
        );
    }
    client.set_capacity("s", 1, None).await.unwrap();
    client
        .submit(&Request::new("late").permit("s", 1))
        .await
        .unwrap();
    for i in 0..2 {
        assert_eq!(
            state_of(&client, &format!("h{i}")).await,
            "acquired",
            "nothing is revoked"
        );
        client.release(&format!("h{i}")).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            state_of(&client, "late").await,
            "new",
            "used {} is not below capacity 1",
            2 - i
        );
    }
    client.release("h2").await.unwrap();
    assert_eq!(settled_state(&client, "late").await, State::Acquired);
    worker.stop().await;
}

/// A big request waits on a fair semaphore; a stream of small ones, decided by three workers,
/// must not take the room it needs. On a greedy semaphore the small ones go first.
async fn big_and_smalls(fair: bool) -> (String, Vec<String>) {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 10, Some(fair)).await.unwrap();
    let workers: Vec<_> = (0..3)
        .map(|i| db.worker(quiet_config(&format!("w{i}"))))
        .collect();
    client
        .submit(&Request::new("holder").permit("s", 6))
        .await
        .unwrap();
    assert_eq!(settled_state(&client, "holder").await, State::Acquired);
    // Submitted one by one and concurrently, so the workers split them between batches.
    client
        .submit(&Request::new("big").permit("s", 5))
        .await
        .unwrap();
    let smalls: Vec<_> = (0..30)
        .map(|i| {
            let client = client.clone();
            tokio::spawn(async move {
                client
                    .submit(&Request::new(format!("small-{i:02}")).permit("s", 1))
                    .await
            })
        })
        .collect();
    for s in smalls {
        s.await.unwrap().unwrap();
    }
    let conn = db.conn().await;
    wait_until(SOON, "every request examined or granted", || async {
        common::unexamined_requests(&conn).await == 0
    })
    .await;
    let big_before = state_of(&client, "big").await;
    let smalls_before: Vec<String> = {
        let mut v = Vec::new();
        for i in 0..30 {
            v.push(state_of(&client, &format!("small-{i:02}")).await);
        }
        v
    };
    client.release("holder").await.unwrap();
    if fair {
        assert_eq!(settled_state(&client, "big").await, State::Acquired);
    }
    check_invariants(&conn).await.unwrap();
    for w in workers {
        w.stop().await;
    }
    (big_before, smalls_before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fair_head_is_not_overtaken_across_workers() {
    let (big, smalls) = big_and_smalls(true).await;
    assert_eq!(big, "new");
    // 4 free, the head needs 5: any small grant would leave less than 5.
    assert!(
        smalls.iter().all(|s| s == "new"),
        "smalls overtook the head: {smalls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_greedy_semaphore_lets_later_requests_that_fit_go_first() {
    let (big, smalls) = big_and_smalls(false).await;
    assert_eq!(big, "new");
    assert_eq!(
        smalls.iter().filter(|s| *s == "acquired").count(),
        4,
        "{smalls:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_increase_in_grant_order() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 3, None).await.unwrap();
    let workers: Vec<_> = (0..2)
        .map(|i| db.worker(quiet_config(&format!("w{i}"))))
        .collect();
    for i in 0..40 {
        client
            .submit(&Request::new(format!("r{i}")).permit("s", 1))
            .await
            .unwrap();
        if i >= 2 {
            let id = format!("r{}", i - 2);
            client.wait_settled(&id, SOON).await.unwrap();
            client.release(&id).await.unwrap();
        }
    }
    for i in 38..40 {
        assert_eq!(
            settled_state(&client, &format!("r{i}")).await,
            State::Acquired
        );
    }
    let conn = db.conn().await;
    let tokens: Vec<i64> = conn
        .query(
            "SELECT fencing_token FROM permitq.permit_request ORDER BY acquired_at, id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(tokens.len(), 40);
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens out of grant order: {tokens:?}"
    );
    for w in workers {
        w.stop().await;
    }
}

/// Three workers, many producers and holders submitting random multi-semaphore requests
/// (some fail-fast, some wait-bounded), a sampler checking the invariants in every snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_workers_under_random_load_keep_every_invariant() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let names = ["a", "b", "c", "d"];
    let capacities = [3, 5, 2, 8];
    for (n, c) in names.iter().zip(capacities) {
        client.set_capacity(n, c, Some(*n != "d")).await.unwrap();
    }
    let workers: Vec<_> = (0..3)
        .map(|i| {
            let mut config = quiet_config(&format!("w{i}"));
            config.batch_size = 16;
            db.worker(config)
        })
        .collect();

    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (conn, done) = (db.conn().await, done.clone());
        tokio::spawn(async move {
            let mut snapshots = 0u64;
            while !done.load(Ordering::Relaxed) {
                check_invariants(&conn)
                    .await
                    .map_err(|e| format!("snapshot {snapshots}: {e}"))?;
                snapshots += 1;
            }
            Ok::<u64, String>(snapshots)
        })
    };

    const HOLDERS: usize = 24;
    const PER_HOLDER: usize = 25;
    let holders: Vec<_> = (0..HOLDERS)
        .map(|h| {
            let client = client.clone();
            tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(h as u64);
                for i in 0..PER_HOLDER {
                    let id = format!("h{h}-{i}");
                    let mut request = Request::new(&id);
                    let how_many = rng.usize(1..=3);
                    for n in rng.choose_multiple(names.iter(), how_many) {
                        let count = rng.i64(1..=2);
                        request = request.permit(*n, count);
                    }
                    request.wait = match rng.u8(..10) {
                        0 => Some(Duration::ZERO),
                        1 => Some(Duration::from_millis(50)),
                        _ => None,
                    };
                    client.submit(&request).await.unwrap();
                    let r = client
                        .wait_settled(&id, Duration::from_secs(30))
                        .await
                        .unwrap()
                        .unwrap();
                    match r.state {
                        State::Acquired => {
                            tokio::time::sleep(Duration::from_millis(rng.u64(0..8))).await;
                            assert_eq!(
                                client.release(&id).await.unwrap(),
                                ReleaseOutcome::Released
                            );
                        }
                        State::Error => {}
                        other => panic!("{id} still {other} after 30s"),
                    }
                }
            })
        })
        .collect();
    for h in holders {
        h.await.unwrap();
    }
    done.store(true, Ordering::Relaxed);
    let snapshots = sampler.await.unwrap().unwrap();
    assert!(snapshots > 10, "the sampler ran ({snapshots} snapshots)");

    let conn = db.conn().await;
    check_invariants(&conn).await.unwrap();
    let report = common::collect(&conn, "h").await.unwrap();
    assert_eq!(
        report.submitted,
        i64::try_from(HOLDERS * PER_HOLDER).unwrap(),
        "nothing lost, each external_id once"
    );
    assert_eq!(report.open, 0, "everything settled");
    assert!(
        report.granted > i64::try_from(HOLDERS * PER_HOLDER).unwrap() / 2,
        "{report:?}"
    );
    assert!(
        report.over_capacity.is_empty(),
        "interval sweep found overlap above capacity: {report:?}"
    );
    common::wait_folded(&db.url).await;
    for s in client.semaphores().await.unwrap() {
        assert_eq!(s.used, 0, "{} not back to 0", s.name);
    }
    let codes: Vec<&String> = report.errors_by_code.keys().collect();
    assert!(
        codes
            .iter()
            .all(|c| ["no_capacity", "timeout"].contains(&c.as_str())),
        "{codes:?}"
    );
    for w in workers {
        w.stop().await;
    }
}
