//! Notifications are coalesced: outcomes travel in batches, one notification per worker
//! transaction (up to 40 outcomes each); releases and cancels notify nobody themselves, and
//! producers wake workers only while one sleeps.

use permitq_test_support as common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{event_ids, quiet_config, requests_by_id, wait_until, TestDb};
use permitq::{Request, State};

const SOON: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_grants_and_a_batch_of_releases_send_a_few_notifications_not_one_each() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 1000, None).await.unwrap();
    let (events_listener, mut events) = common::listen(&db.url, "permitq_events").await;
    // 100 requests queued while no worker runs, then one worker grants them in one batch.
    db.conn()
        .await
        .batch_execute(
            "INSERT INTO permitq.permit_request (external_id, permits)
             SELECT 'r-' || i, '{\"s\": 1}' FROM generate_series(1, 100) i",
        )
        .await
        .unwrap();
    let mut config = quiet_config("w1");
    config.batch_size = 100;
    let worker = db.worker(config);
    wait_until(SOON, "all granted", || async {
        client.semaphores().await.unwrap()[0].used == 100
    })
    .await;
    worker.stop().await;
    let grants = common::until_marker(&events_listener, "permitq_events", &mut events).await;
    let granted: Vec<i64> = grants.iter().flat_map(|p| event_ids(p)).collect();
    assert_eq!(granted.len(), 100, "every grant announced once");
    let rows = requests_by_id(&db.conn().await, &granted).await;
    assert_eq!(rows.len(), 100, "100 distinct requests");
    assert!(rows.iter().all(|(_, _, state, _)| state == "acquired"));
    assert_eq!(grants.len(), 1, "one batch, one notification: {grants:?}");

    // 100 releases while no worker runs: none notifies; the fold sends their outcomes.
    for i in 1..=100 {
        client.release(&format!("r-{i}")).await.unwrap();
    }
    assert!(
        common::until_marker(&events_listener, "permitq_events", &mut events)
            .await
            .is_empty(),
        "a release sends nothing itself"
    );
    assert_eq!(
        client.semaphores().await.unwrap()[0].used,
        100,
        "used runs ahead until the fold"
    );
    let worker = db.worker(quiet_config("w2"));
    wait_until(SOON, "releases folded", || async {
        client.semaphores().await.unwrap()[0].used == 0
    })
    .await;
    let releases = common::until_marker(&events_listener, "permitq_events", &mut events).await;
    let mut released: BTreeMap<i64, usize> = BTreeMap::new();
    for id in releases.iter().flat_map(|p| event_ids(p)) {
        *released.entry(id).or_default() += 1;
    }
    assert_eq!(released.len(), 100);
    let ids: Vec<i64> = released.keys().copied().collect();
    for (_, external_id, state, reason) in requests_by_id(&db.conn().await, &ids).await {
        assert_eq!(
            (state.as_str(), reason.as_deref()),
            ("released", Some("released")),
            "{external_id}"
        );
    }
    assert!(released.values().all(|n| *n == 1), "{released:?}");
    assert!(
        releases.len() <= 4,
        "one fold, {} notifications",
        releases.len()
    );
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_load_producers_do_not_notify_per_request() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("hot", 64, None).await.unwrap();
    let (work_listener, mut work) = common::listen(&db.url, "permitq_work").await;
    let (events_listener, mut events) = common::listen(&db.url, "permitq_events").await;
    let workers: Vec<_> = (0..2)
        .map(|i| db.worker(quiet_config(&format!("w{i}"))))
        .collect();
    const PRODUCERS: usize = 16;
    const CYCLES: usize = 25;
    let tasks: Vec<_> = (0..PRODUCERS)
        .map(|p| {
            let client = client.clone();
            tokio::spawn(async move {
                for i in 0..CYCLES {
                    let id = format!("c-{p}-{i}");
                    client
                        .submit(&Request::new(&id).permit("hot", 1))
                        .await
                        .unwrap();
                    let r = client.wait_settled(&id, SOON).await.unwrap().unwrap();
                    assert_eq!(r.state, State::Acquired);
                    client.release(&id).await.unwrap();
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    wait_until(SOON, "releases folded", || async {
        client.semaphores().await.unwrap()[0].used == 0
    })
    .await;
    let cycles = PRODUCERS * CYCLES;
    let wakeups = common::until_marker(&work_listener, "permitq_work", &mut work)
        .await
        .len();
    let event_notes = common::until_marker(&events_listener, "permitq_events", &mut events).await;
    let outcomes: usize = event_notes.iter().map(|p| event_ids(p).len()).sum();
    assert_eq!(
        outcomes,
        2 * cycles,
        "each grant and each release announced once"
    );
    assert!(
        wakeups < cycles,
        "{wakeups} wake-up notifications for {cycles} submits and {cycles} releases"
    );
    assert!(
        event_notes.len() < 2 * cycles,
        "{} event notifications for {} outcomes",
        event_notes.len(),
        2 * cycles
    );
    for w in workers {
        w.stop().await;
    }
}

/// Releases beside a sleeping worker wake it once, not once each: a release that sees another
/// release of its semaphore still to fold does not notify. None is left unfolded: before it
/// naps, the worker checks, once the wake gate is free, that no release is left to fold, and
/// folds again until none is; here with a poll interval too long to matter, with every pass
/// ending on a batch that claims a waiter it cannot grant (no idle fold), and across a release
/// whose transaction was still open (so unseen) when a fold ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_beside_a_sleeping_worker_wake_it_once_and_all_are_folded() {
    const HELD: usize = 20;
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 100, None).await.unwrap();
    client.set_capacity("f", 2, Some(true)).await.unwrap();
    let worker = db.worker(quiet_config("w"));
    // On the fair f, one permit held, the head wanting 2 and a request for 1 behind it: every
    // pass claims that one (it fits the room) and leaves it waiting (the room is the head's).
    for (id, count) in [("f-held", 1), ("f-head", 2), ("f-behind", 1)] {
        client
            .submit(&Request::new(id).permit("f", count))
            .await
            .unwrap();
        if id == "f-held" {
            assert_eq!(common::settled_state(&client, id).await, State::Acquired);
        }
    }
    for i in 0..=HELD {
        client
            .submit(&Request::new(format!("h-{i}")).permit("s", 1))
            .await
            .unwrap();
    }
    for i in 0..=HELD {
        assert_eq!(
            common::settled_state(&client, &format!("h-{i}")).await,
            State::Acquired
        );
    }
    let conn = db.conn().await;
    wait_until(SOON, "f's head and the request behind it wait", || async {
        let waiting: i64 = conn
            .query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE state = 'new' AND examined",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        waiting == 2
    })
    .await;
    wait_until(SOON, "the worker sleeps", || async {
        conn.query_one(
            "SELECT coalesce(bool_and(sleeping), false) FROM permitq.worker_wake",
            &[],
        )
        .await
        .unwrap()
        .get(0)
    })
    .await;
    let (work_listener, mut work) = common::listen(&db.url, "permitq_work").await;
    // The fold cannot take the semaphore while this transaction holds it (it skips what is
    // locked): the releases stay to fold.
    let holder = db.conn().await;
    holder
        .batch_execute("BEGIN; SELECT 1 FROM permitq.semaphore WHERE name = 's' FOR UPDATE")
        .await
        .unwrap();
    for i in 1..=HELD {
        client.release(&format!("h-{i}")).await.unwrap();
    }
    let wakeups = common::until_marker(&work_listener, "permitq_work", &mut work)
        .await
        .len();
    assert_eq!(
        wakeups, 1,
        "{HELD} releases, {wakeups} wake-up notifications"
    );
    // One more, its transaction open across the semaphore's freeing: the fold that follows
    // cannot see it, nor does it notify (the others are still to fold).
    let late = db.conn().await;
    late.batch_execute("BEGIN; SELECT permitq.release('h-0')")
        .await
        .unwrap();
    holder.batch_execute("COMMIT").await.unwrap();
    let used_of_s = || async {
        client
            .semaphores()
            .await
            .unwrap()
            .into_iter()
            .find(|x| x.name == "s")
            .unwrap()
            .used
    };
    wait_until(SOON, "the releases before it folded", || async {
        used_of_s().await == 1
    })
    .await;
    late.batch_execute("COMMIT").await.unwrap();
    wait_until(SOON, "every release folded", || async {
        used_of_s().await == 0
    })
    .await;
    worker.stop().await;
}
