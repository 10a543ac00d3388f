//! Failure isolation: whatever a stored row contains, the worker settles it alone and everything
//! else keeps flowing. Rows are planted past the constraints, as a superuser can: triggers off
//! (`session_replication_role = replica`), a CHECK dropped and re-added `NOT VALID` (a row written
//! before the constraint existed), and a trigger that makes one request's grant fail (an unforeseen
//! write error).

use permitq_test_support as common;

use std::time::Duration;

use common::{check_invariants, state_of, wait_until, TestDb};
use permitq::{Request, State};

const SOON: Duration = Duration::from_secs(20);

/// A capacity lowered below what is held while a request waits there revokes nothing and
/// stalls nothing: other semaphores keep granting, and the waiter is granted once enough is
/// released. (The claim's room there is below zero: it once made every pass fail.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capacity_lowered_below_what_is_held_with_a_waiter_stalls_nothing() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("gpu", 4, None).await.unwrap();
    client.set_capacity("licence", 2, None).await.unwrap();
    let _worker = db.notified_worker("w1");
    let held = client
        .acquire(&Request::new("q-1").permit("gpu", 4), SOON)
        .await
        .unwrap();
    client
        .submit(&Request::new("q-2").permit("gpu", 2))
        .await
        .unwrap();
    wait_until(SOON, "q-2 examined", || async {
        client
            .status("q-2")
            .await
            .unwrap()
            .is_some_and(|r| r.examined_at.is_some())
    })
    .await;
    client.set_capacity("gpu", 3, None).await.unwrap();
    let other = client
        .acquire(&Request::new("q-3").permit("licence", 1), SOON)
        .await
        .expect("another semaphore keeps granting");
    other.release().await.unwrap();
    held.release().await.unwrap();
    assert_eq!(
        client
            .wait_settled("q-2", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    check_invariants(&db.conn().await).await.unwrap();
}

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
                 CHECK (ttl > interval '0' AND ttl <= permitq.rule_max_duration()) NOT VALID,
             ADD CONSTRAINT permit_request_wait_valid
                 CHECK (wait >= interval '0' AND wait <= permitq.rule_max_duration()) NOT VALID;",
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
    let mut announced = std::collections::BTreeSet::new();
    let deadline = tokio::time::Instant::now() + SOON;
    while announced.len() < ids.len() {
        let payload = tokio::time::timeout_at(deadline, events.recv())
            .await
            .expect("every grant announced before the deadline")
            .expect("listener alive");
        assert!(payload.len() < 8000);
        // Ids only, whatever the external_ids are.
        assert!(!payload.contains('x'), "{payload}");
        announced.extend(common::event_ids(&payload));
    }
    let rows = common::requests_by_id(
        &db.conn().await,
        &announced.iter().copied().collect::<Vec<_>>(),
    )
    .await;
    let mut external_ids: Vec<String> = rows.into_iter().map(|(_, e, _, _)| e).collect();
    external_ids.sort();
    assert_eq!(external_ids, ids);
    worker.stop().await;
}

/// One generated call of the SQL API (text parameters, cast by the server like a client would).
#[derive(Debug, Clone)]
enum Call {
    Submit(
        String,
        String,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    Insert(
        String,
        String,
        Option<String>,
        Option<String>,
        Option<String>,
    ),
    SetCapacity(String, i64, Option<bool>),
    Heartbeat(String, Option<String>),
}

fn calls() -> impl proptest::strategy::Strategy<Value = Vec<Call>> {
    use proptest::prelude::*;
    let text = prop_oneof![
        "[a-z]{1,8}",
        "\\PC{0,40}",
        Just(String::new()),
        Just("x".repeat(255)),
        Just("x".repeat(256)),
        Just("é".repeat(255)),
        Just("'; DROP TABLE permitq.semaphore; --".to_string()),
        Just("\"quoted\" \\ back".to_string()),
        Just("tab\tnew\nline".to_string()),
        Just("a=b".to_string()),
    ];
    let names = prop_oneof![
        "[a-c]",
        "\\PC{0,6}",
        Just("x".repeat(256)),
        Just(String::new())
    ];
    let value = prop_oneof![
        (1i64..5).prop_map(|n| n.to_string()),
        Just("0".to_string()),
        Just("-1".to_string()),
        Just("1.5".to_string()),
        Just("2.0".to_string()),
        Just("1e30".to_string()),
        Just("2147483648".to_string()),
        Just("\"1\"".to_string()),
        Just("null".to_string()),
        Just("[1]".to_string()),
        Just("{}".to_string()),
    ];
    let object = proptest::collection::vec((names, value), 0..4).prop_map(|entries| {
        let body: Vec<String> = entries
            .iter()
            .map(|(k, v)| format!("{}: {v}", serde_json::Value::String(k.clone())))
            .collect();
        format!("{{{}}}", body.join(", "))
    });
    let permits = prop_oneof![
        4 => object,
        1 => Just("[]".to_string()),
        1 => Just("\"a\"".to_string()),
        1 => Just("42".to_string()),
        1 => Just("null".to_string()),
        1 => Just(format!(
            "{{{}}}",
            (0..65).map(|i| format!("\"s{i}\": 1")).collect::<Vec<_>>().join(",")
        )),
    ];
    let interval = proptest::option::of(prop_oneof![
        (1i64..100).prop_map(|n| format!("{n} seconds")),
        (-100i64..=0).prop_map(|n| format!("{n} seconds")),
        (0i64..400).prop_map(|n| format!("{n} months")),
        (1i64..50).prop_map(|n| format!("{n} years -3 days")),
        Just("292270 years".to_string()),
        Just("1000000 years".to_string()),
        Just(format!("{} days", permitq::MAX_DURATION.as_secs() / 86_400)),
        Just(format!(
            "{} days",
            permitq::MAX_DURATION.as_secs() / 86_400 + 1
        )),
        Just("1 month -40 days".to_string()),
        Just("9223372036854775807 microseconds".to_string()),
        Just("soon".to_string()),
    ]);
    let owner = proptest::option::of(text.clone());
    let call = prop_oneof![
        (
            text.clone(),
            permits.clone(),
            owner.clone(),
            interval.clone(),
            interval.clone()
        )
            .prop_map(|(e, p, o, t, w)| Call::Submit(e, p, o, t, w)),
        (
            text.clone(),
            permits,
            owner,
            interval.clone(),
            interval.clone()
        )
            .prop_map(|(e, p, o, t, w)| Call::Insert(e, p, o, t, w)),
        (
            text.clone(),
            prop_oneof![(-2i64..10), Just(i64::from(i32::MAX)), Just(1i64 << 40)],
            proptest::option::of(any::<bool>())
        )
            .prop_map(|(n, c, f)| Call::SetCapacity(n, c, f)),
        (text, interval).prop_map(|(e, x)| Call::Heartbeat(e, x)),
    ];
    proptest::collection::vec(call, 400)
}

/// Rows in every permitq table: a rejected call must not change it.
async fn footprint(conn: &tokio_postgres::Client) -> (i64, i64, i64) {
    let row = conn
        .query_one(
            "SELECT (SELECT count(*) FROM permitq.permit_request),
                    (SELECT count(*) FROM permitq.semaphore),
                    (SELECT count(*) FROM permitq.capacity_change)",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_of_bad_input_is_accepted_or_rejected_by_name_and_workers_still_grant() {
    use proptest::strategy::{Strategy, ValueTree};
    let db = TestDb::new().await;
    let conn = db.conn().await;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let calls = calls().new_tree(&mut runner).unwrap().current();
    let fields = [
        "external_id",
        "permits",
        "owner",
        "ttl",
        "wait",
        "name",
        "capacity",
        "extend",
    ];
    // Cast errors of a literal the caller wrote (the call never reached permitq).
    let literal = [
        "22007", "22008", "22015", "22P02", "22021", "22P05", "22003",
    ];
    let (mut accepted, mut rejected) = (0, 0);
    for call in &calls {
        let before = footprint(&conn).await;
        let result = match call {
            Call::Submit(e, p, o, t, w) => conn
                .execute(
                    "SELECT permitq.submit($1, $2::text::jsonb, $3, $4::text::interval, $5::text::interval)",
                    &[e, p, o, t, w],
                )
                .await,
            Call::Insert(e, p, o, t, w) => conn
                .execute(
                    "INSERT INTO permitq.permit_request (external_id, permits, owner, ttl, wait)
                     VALUES ($1, $2::text::jsonb, $3, $4::text::interval, $5::text::interval)
                     ON CONFLICT (external_id) DO NOTHING",
                    &[e, p, o, t, w],
                )
                .await,
            Call::SetCapacity(n, c, f) => conn
                .execute(
                    "SELECT permitq.set_capacity($1, $2::int8::int4, $3)",
                    &[n, c, f],
                )
                .await,
            Call::Heartbeat(e, x) => conn
                .execute(
                    "SELECT permitq.heartbeat($1, $2::text::interval)",
                    &[e, x],
                )
                .await,
        };
        match result {
            Ok(_) => accepted += 1,
            Err(err) => {
                rejected += 1;
                let db_error = err
                    .as_db_error()
                    .unwrap_or_else(|| panic!("{call:?}: {err}"));
                let code = db_error.code().code();
                let message = db_error.message();
                let ok = match code {
                    "22023" => fields.iter().any(|f| message.contains(f)),
                    "23505" | "23514" => true,
                    // heartbeat of a request that is not held: the lease is lost.
                    "55000" => matches!(call, Call::Heartbeat(..)),
                    c => literal.contains(&c),
                };
                assert!(ok, "{call:?}: unexpected {code} {message}");
                assert_eq!(
                    footprint(&conn).await,
                    before,
                    "{call:?} was rejected but wrote"
                );
            }
        }
    }
    eprintln!(
        "bad-input sweep: {} calls, {accepted} accepted, {rejected} rejected",
        calls.len()
    );
    assert!(accepted > 20 && rejected > 100, "{accepted} / {rejected}");

    // Everything accepted gets examined, and a worker still grants.
    let worker = db.notified_worker("after-sweep");
    let client = db.client().await;
    client.set_capacity("fresh", 1, None).await.unwrap();
    client
        .submit(&Request::new("fresh-1").permit("fresh", 1))
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("fresh-1", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    wait_until(SOON, "every accepted request examined", || async {
        common::unexamined_requests(&conn).await == 0
    })
    .await;
    worker.stop().await;
}

/// A release (and a fence) read their own holder by key, never every holder. Found: with the
/// table's statistics taken while nothing was held (autovacuum off, so they stay stale), the
/// release's plan read a whole partial index of holders at each call: work growing with the
/// holders, for every release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_reads_its_own_holder_not_every_holder() {
    const HELD: i32 = 2_000;
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("s", 10_000, None).await.unwrap();
    let conn = db.conn().await;
    conn.batch_execute(&format!(
        "ALTER TABLE permitq.permit_request SET (autovacuum_enabled = off);
         INSERT INTO permitq.permit_request (external_id, permits)
         SELECT 'h-' || i, '{{\"s\": 1}}' FROM generate_series(1, {HELD}) i;
         ANALYZE permitq.permit_request"
    ))
    .await
    .unwrap();
    let worker = db.worker(common::quiet_config("w"));
    wait_until(SOON, "every request granted", || async {
        let waiting: i64 = conn
            .query_one(
                "SELECT count(*) FROM permitq.permit_request WHERE state = 'new'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        waiting == 0
    })
    .await;
    // Its sweeps read the holders by expiry: stopped, so that only the calls below count.
    worker.stop().await;
    // Index entries read so far, on this connection (whose statistics it flushes first).
    let holders_read = || async {
        conn.batch_execute("SELECT pg_stat_force_next_flush()")
            .await
            .unwrap();
        let n: i64 = conn
            .query_one(
                "SELECT coalesce(sum(idx_tup_read), 0)::int8 FROM pg_stat_user_indexes
                 WHERE relname = 'permit_request'
                   AND indexrelname IN ('permit_request_acquired_at_idx',
                                        'permit_request_expires_at_idx')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        n
    };
    let before = holders_read().await;
    let said = conn
        .query_one(
            "SELECT permitq.fence('s', 'resource',
                                  (SELECT fencing_token FROM permitq.permit_request
                                   WHERE external_id = 'h-2')),
                    permitq.release('h-1')",
            &[],
        )
        .await
        .unwrap();
    assert!(said.get::<_, bool>(0), "the holder's token is accepted");
    assert_eq!(said.get::<_, String>(1), "released");
    let read = holders_read().await - before;
    assert!(
        read < 10,
        "a release and a fence read {read} entries of the holders' indexes ({HELD} holders)"
    );
}
