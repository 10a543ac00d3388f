//! Failure isolation: whatever a stored row contains, the worker settles it alone and everything
//! else keeps flowing. Rows are planted past the constraints, as a superuser can: triggers off
//! (`session_replication_role = replica`), a CHECK dropped and re-added `NOT VALID` (a row from
//! before V4), and a trigger that makes one request's grant fail (an unforeseen write error).

use permitq_test_support as common;

use std::time::Duration;

use common::{check_invariants, state_of, wait_until, TestDb};
use permitq::{Request, State};

const SOON: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_rows_fail_alone_as_invalid_and_other_semaphores_keep_granting() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("a", 100, None).await.unwrap();
    client.set_capacity("b", 100, None).await.unwrap();
    let conn = db.conn().await;
    // Written with triggers off: the permits check is a trigger.
    conn.batch_execute(
        r#"SET session_replication_role = replica;
        INSERT INTO permitq.permit_request (external_id, permits) VALUES
            ('not-an-object', '"a"'),
            ('text-count', '{"a": "x"}'),
            ('zero-count', '{"a": 0}'),
            ('fraction', '{"a": 1.5}'),
            ('huge-count', '{"a": 1e30}'),
            ('no-semaphores', '{}'),
            ('null-count', '{"a": null}');
        SET session_replication_role = DEFAULT;"#,
    )
    .await
    .unwrap();
    // Out-of-bound intervals, as stored before the bounds existed.
    conn.batch_execute(
        "ALTER TABLE permitq.permit_request DROP CONSTRAINT permit_request_ttl_valid,
             DROP CONSTRAINT permit_request_wait_valid;
         SET session_replication_role = replica;
         INSERT INTO permitq.permit_request (external_id, permits, ttl) VALUES
             ('ttl-292270y', '{\"a\": 1}', '292270 years');
         INSERT INTO permitq.permit_request (external_id, permits, wait, wait_until) VALUES
             ('wait-292270y', '{\"a\": 1}', '200000 years', NULL);
         SET session_replication_role = DEFAULT;
         ALTER TABLE permitq.permit_request
             ADD CONSTRAINT permit_request_ttl_valid
                 CHECK (ttl > interval '0' AND ttl <= interval '3653 days') NOT VALID,
             ADD CONSTRAINT permit_request_wait_valid
                 CHECK (wait >= interval '0' AND wait <= interval '3653 days') NOT VALID;",
    )
    .await
    .unwrap();
    // A request whose grant cannot be written (here a trigger; in the wild, an overflow).
    conn.batch_execute(
        "CREATE FUNCTION public.poison() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.external_id = 'poison-grant' AND NEW.state = 'acquired' THEN
                 RAISE EXCEPTION 'timestamp out of range' USING ERRCODE = '22008';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER poison BEFORE UPDATE ON permitq.permit_request
             FOR EACH ROW EXECUTE FUNCTION public.poison();",
    )
    .await
    .unwrap();
    client
        .submit(&Request::new("poison-grant").permit("a", 1))
        .await
        .unwrap();
    for i in 0..5 {
        client
            .submit(&Request::new(format!("good-a-{i}")).permit("a", 1))
            .await
            .unwrap();
        client
            .submit(&Request::new(format!("good-b-{i}")).permit("b", 1))
            .await
            .unwrap();
    }

    let worker = db.notified_worker("w1");
    let planted = [
        "not-an-object",
        "text-count",
        "zero-count",
        "fraction",
        "huge-count",
        "no-semaphores",
        "null-count",
        "ttl-292270y",
        "wait-292270y",
        "poison-grant",
    ];
    for id in planted {
        wait_until(SOON, &format!("{id} settled"), || async {
            state_of(&client, id).await != "new"
        })
        .await;
        assert_eq!(state_of(&client, id).await, "error/invalid", "{id}");
    }
    for i in 0..5 {
        for s in ["a", "b"] {
            let id = format!("good-{s}-{i}");
            let r = client.wait_settled(&id, SOON).await.unwrap().unwrap();
            assert_eq!(r.state, State::Acquired, "{id}");
        }
    }
    // And the worker still grants afterwards.
    client
        .submit(&Request::new("after").permit("b", 1))
        .await
        .unwrap();
    let r = client.wait_settled("after", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired);
    // An invalid request's out-of-bound interval is cleared, so the row is valid again.
    let ttl: Option<String> = conn
        .query_one(
            "SELECT ttl::text FROM permitq.permit_request WHERE external_id = 'ttl-292270y'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(ttl, None);
    conn.batch_execute("DROP TRIGGER poison ON permitq.permit_request")
        .await
        .unwrap();
    check_invariants(&conn).await.unwrap();
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_long_external_ids_is_granted_and_every_event_arrives() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("wide", 1000, None).await.unwrap();
    let (_listener, mut events) = common::listen(&db.url, "permitq_events").await;
    // 255 characters each, half of them escaped in JSON (\u0001 is 6 bytes): 100 such events
    // are ~100 KB, far over one notification's 8000 bytes.
    let ids: Vec<String> = (0..100)
        .map(|i| {
            let head = format!("{i:03}-");
            let fill: String = (0..255 - head.len())
                .map(|k| if k % 2 == 0 { '\u{1}' } else { 'x' })
                .collect();
            head + &fill
        })
        .collect();
    for id in &ids {
        client
            .submit(&Request::new(id.clone()).permit("wide", 1))
            .await
            .unwrap();
    }
    let worker = db.notified_worker("w1");
    let mut acquired = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + SOON;
    while acquired.len() < ids.len() {
        let payload = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("every acquired event before the deadline")
            .expect("listener alive");
        assert!(payload.len() < 8000);
        for event in common::event_objects(&payload) {
            if event["state"] == "acquired" {
                acquired.insert(event["external_id"].as_str().unwrap().to_string());
            }
        }
    }
    assert_eq!(acquired.len(), ids.len());
    worker.stop().await;
}
