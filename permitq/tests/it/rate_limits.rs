//! Rate-limited semaphores (`per`): at most `capacity` permits granted in any sliding window,
//! whatever the holders do; in all-or-nothing requests with concurrency semaphores; with
//! templates; with `wait`.

use permitq_test_support as common;

use std::time::Duration;

use common::{check_invariants, quiet_config, state_of, wait_folded, TestDb};
use permitq::{Request, State};

const WINDOW: Duration = Duration::from_millis(1500);

/// acquired_at of these requests, in ms since the first, sorted.
async fn grant_times(conn: &tokio_postgres::Client, prefix: &str) -> Vec<f64> {
    conn.query(
        "SELECT extract(epoch FROM acquired_at - min(acquired_at) OVER ())::float8 * 1000
         FROM permitq.permit_request WHERE external_id LIKE $1 AND acquired_at IS NOT NULL
         ORDER BY acquired_at",
        &[&format!("{prefix}%")],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_capacity_grants_in_any_window_however_quickly_holders_release() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let api = client.set_rate_limit("api", 3, WINDOW, None).await.unwrap();
    assert_eq!(api.per, Some(WINDOW));
    // Two workers with a poll of two minutes: only the window's opening wakes them.
    let _w1 = db.worker(quiet_config("w1"));
    let _w2 = db.worker(quiet_config("w2"));
    // One at a time, each released as soon as it is granted (releasing gives nothing back to a
    // rate-limited semaphore), each new when a worker first sees it.
    let started = std::time::Instant::now();
    for i in 0..8 {
        let id = format!("call-{i}");
        client
            .submit(&Request::new(&id).permit("api", 1))
            .await
            .unwrap();
        let r = client
            .wait_settled(&id, Duration::from_secs(20))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.state, State::Acquired, "{id}");
        client.release(&id).await.unwrap();
    }
    // 8 grants at 3 per window take two windows at least, and not much more.
    let elapsed = started.elapsed();
    assert!(
        elapsed >= WINDOW * 2 && elapsed < WINDOW * 2 + Duration::from_secs(3),
        "{elapsed:?}"
    );
    let conn = db.conn().await;
    let times = grant_times(&conn, "call-").await;
    let window_ms = WINDOW.as_secs_f64() * 1000.0;
    for (i, t) in times.iter().enumerate() {
        let in_window = times[..=i].iter().filter(|u| *u > &(t - window_ms)).count();
        assert!(
            in_window <= 3,
            "{in_window} grants in the window ending at {t} ms: {times:?}"
        );
    }
    let report = common::collect(&conn, "call-").await.unwrap();
    assert_eq!(report.peak_concurrent["api"], 3);
    assert!(
        report.over_capacity.is_empty(),
        "{:?}",
        report.over_capacity
    );
    check_invariants(&conn).await.unwrap();
    // The window's buckets keep only what is still in a window: the workers' retention round
    // (every second) removes the rest.
    common::wait_until(Duration::from_secs(15), "expired grants removed", || {
        let conn = &conn;
        async move {
            let left: i64 = conn
                .query_one(
                    "SELECT count(*) FROM permitq.rate_bucket
                     WHERE ends_at <= now() - interval '1.5 seconds'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            left == 0
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_and_concurrency_limits_in_one_all_or_nothing_request() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 1, None).await.unwrap();
    client
        .set_rate_limit("api", 2, Duration::from_secs(60), None)
        .await
        .unwrap();
    let worker = db.notified_worker("w1");
    for id in ["a", "b", "c"] {
        client
            .submit(&Request::new(id).permit("gpu", 1).permit("api", 1))
            .await
            .unwrap();
    }
    assert_eq!(
        client
            .wait_settled("a", Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    // b waits for the gpu; once a releases it, b takes the second grant of the window.
    assert_eq!(state_of(&client, "b").await, "new");
    client.release("a").await.unwrap();
    assert_eq!(
        client
            .wait_settled("b", Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    // c has the gpu free but the window spent: it gets neither. The pass that folds b's release
    // claims c (a claim counts releases not folded yet as room) and decides it with the gpu free.
    let released = std::time::SystemTime::now();
    client.release("b").await.unwrap();
    wait_folded(&db.url).await;
    worker.wait_for_pass_after(released).await;
    assert_eq!(state_of(&client, "c").await, "new");
    let gpu_free: i64 = db
        .conn()
        .await
        .query_one(
            "SELECT count(*) FROM permitq.holders WHERE semaphore = 'gpu'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(gpu_free, 0, "all or nothing: c holds no gpu either");
    // Fail-fast on a spent window: no_capacity.
    client
        .submit(&Request::new("fast").permit("api", 1).wait(Duration::ZERO))
        .await
        .unwrap();
    client
        .wait_settled("fast", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(state_of(&client, "fast").await, "error/no_capacity");
    check_invariants(&db.conn().await).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_template_limits_each_key_on_its_own() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .set_rate_limit("api-key:*", 1, Duration::from_secs(60), None)
        .await
        .unwrap();
    let worker = db.notified_worker("w1");
    for id in ["k1-a", "k1-b", "k2-a"] {
        let key = &id[..2];
        client
            .submit(&Request::new(id).permit(format!("api-key:{key}"), 1))
            .await
            .unwrap();
    }
    for id in ["k1-a", "k2-a"] {
        assert_eq!(
            client
                .wait_settled(id, Duration::from_secs(10))
                .await
                .unwrap()
                .unwrap()
                .state,
            State::Acquired,
            "{id}"
        );
    }
    // The pass that folds k1-a's release decides k1-b with its key's holder gone: its window is
    // spent, so it waits.
    let released = std::time::SystemTime::now();
    client.release("k1-a").await.unwrap();
    wait_folded(&db.url).await;
    worker.wait_for_pass_after(released).await;
    assert_eq!(state_of(&client, "k1-b").await, "new");
    let k1 = client
        .semaphores()
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.name == "api-key:k1")
        .unwrap();
    assert_eq!(k1.per, Some(Duration::from_secs(60)));

    // What operators see (permitq.semaphore_usage, and the CLI, `top`, the status page and the
    // API through it): the window, the permits granted in it and when the spent one opens, and
    // which semaphores are templates or instances.
    let usage = client.usage().await.unwrap();
    let find = |name: &str| usage.iter().find(|u| u.name == name).unwrap().clone();
    let (template, k1) = (find("api-key:*"), find("api-key:k1"));
    assert!(template.is_template && template.template.is_none());
    assert!(!k1.is_template);
    assert_eq!(k1.template.as_deref(), Some("api-key:*"));
    assert_eq!(k1.per, Some(Duration::from_secs(60)));
    assert_eq!((k1.in_window, k1.held, k1.waiting), (1, 0, 1));
    let opens = k1
        .window_opens_at
        .expect("a spent window says when it opens");
    let in_secs = opens
        .duration_since(std::time::SystemTime::now())
        .unwrap()
        .as_secs_f64();
    assert!((50.0..=62.0).contains(&in_secs), "opens in {in_secs}s");
    // A window with room has no opening time; a concurrency semaphore has no window.
    client.release("k1-b").await.unwrap();
    client
        .set_rate_limit("api-key:k1", 2, Duration::from_secs(60), None)
        .await
        .unwrap();
    let usage = client.usage().await.unwrap();
    let k1 = usage.iter().find(|u| u.name == "api-key:k1").unwrap();
    assert_eq!(k1.window_opens_at, None, "{k1:?}");
    let json = serde_json::to_value(k1).unwrap();
    assert_eq!(json["per"], 60.0);
    assert_eq!(json["template"], "api-key:*");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_is_validated_and_can_be_removed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    for bad in ["-1 second", "3654 days"] {
        let err = conn
            .query_one(
                "SELECT permitq.set_capacity('w', 1, NULL, $1::text::interval)",
                &[&bad],
            )
            .await
            .unwrap_err();
        let db_error = err.as_db_error().unwrap();
        assert_eq!(db_error.code().code(), "22023");
        assert!(
            db_error.message().starts_with("invalid per"),
            "{db_error:?}"
        );
    }
    assert!(
        client.semaphores().await.unwrap().is_empty(),
        "nothing written"
    );
    client
        .set_rate_limit("w", 1, Duration::from_secs(1), None)
        .await
        .unwrap();
    // Capacity alone leaves the window as it is; '0' removes it.
    assert_eq!(
        client.set_capacity("w", 2, None).await.unwrap().per,
        Some(Duration::from_secs(1))
    );
    let per: Option<String> = conn
        .query_one(
            "SELECT per::text FROM permitq.set_capacity('w', 2, NULL, '0')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(per, None);
}

/// A spent window says when it next has room for a permit: when enough of its oldest grants have
/// left it, which after a capacity was lowered below what the window holds is more than the
/// oldest alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_window_opens_when_enough_of_its_grants_have_left_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    client
        .set_rate_limit("w", 3, Duration::from_secs(60), None)
        .await
        .unwrap();
    // Two grants of 2, 30 s and 10 s ago: 4 in the window.
    conn.batch_execute(
        "INSERT INTO permitq.rate_bucket (semaphore_id, ends_at, count)
         SELECT id, now() - interval '30 seconds', 2 FROM permitq.semaphore WHERE name = 'w'
         UNION ALL
         SELECT id, now() - interval '10 seconds', 2 FROM permitq.semaphore WHERE name = 'w'",
    )
    .await
    .unwrap();
    let opens_in = |capacity: i32| {
        let conn = &conn;
        async move {
            conn.query_one(
                "SELECT extract(epoch FROM window_opens_at - now())::float8 FROM permitq.semaphore_usage
                 WHERE name = 'w' AND in_window = 4 AND capacity = $1",
                &[&capacity],
            )
            .await
            .unwrap()
            .get::<_, Option<f64>>(0)
        }
    };
    // Capacity 3: room again once the older grant leaves (4 - 2 < 3), in 30 s.
    let at_3 = opens_in(3).await.expect("spent");
    assert!((29.0..=31.0).contains(&at_3), "{at_3}");
    // Capacity 1: both must leave (4 - 2 is not below 1), in 50 s.
    client
        .set_rate_limit("w", 1, Duration::from_secs(60), None)
        .await
        .unwrap();
    let at_1 = opens_in(1).await.expect("spent");
    assert!((49.0..=51.0).contains(&at_1), "{at_1}");
    // Capacity 5: room now, so no opening time.
    client
        .set_rate_limit("w", 5, Duration::from_secs(60), None)
        .await
        .unwrap();
    assert_eq!(opens_in(5).await, None);
}

/// A grant counts in its window until `acquired_at + per`, never less: its bucket (a 64th of
/// the window) ends at or after the grant, by at most a bucket's width.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_is_bucketed_at_or_after_its_time_so_it_never_leaves_the_window_early() {
    let db = TestDb::new().await;
    let conn = db.conn().await;
    let rows = conn
        .query(
            "SELECT per::text,
                    extract(epoch FROM permitq.rate_bucket_end(t, per) - t)::float8 AS ahead_s,
                    extract(epoch FROM per)::float8 / 64 AS width_s
             FROM (VALUES (interval '64 seconds'), (interval '1 minute'), (interval '1.5 seconds'),
                          (interval '1 hour'), (interval '7 days')) w(per),
                  (SELECT timestamptz '2026-11-24 09:34:47.8125+00'
                          + n * interval '1.234567 seconds' AS t
                   FROM generate_series(0, 40) n) ts",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 5 * 41);
    let mut inside = 0;
    for row in &rows {
        let (per, ahead, width): (String, f64, f64) = (row.get(0), row.get(1), row.get(2));
        assert!(
            ahead >= 0.0,
            "per {per}: the bucket ends {ahead}s before the grant"
        );
        assert!(
            ahead <= width + 1e-6,
            "per {per}: the bucket ends {ahead}s after the grant, more than its width {width}s"
        );
        inside += usize::from(ahead > 0.0);
    }
    assert!(
        inside > rows.len() / 2,
        "most grants fall inside a bucket, not on its end"
    );
}
