//! Semaphore templates (`tenant:*`): instances made on demand from the most specific template,
//! once however many workers race, changed with their template, removed when idle.

use permitq_test_support as common;

use std::time::Duration;

use common::{check_invariants, quiet_config, state_of, wait_until, TestDb};
use permitq::{Request, State};

const SOON: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_without_a_semaphore_gets_one_from_the_most_specific_template() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let template = client.set_capacity("tenant:*", 2, None).await.unwrap();
    assert!(template.is_template && template.template.is_none());
    client
        .set_capacity("tenant:eu:*", 1, Some(false))
        .await
        .unwrap();
    let _worker = db.notified_worker("w1");

    // tenant:acme: capacity 2 from `tenant:*`; the third waits.
    for id in ["acme-1", "acme-2", "acme-3"] {
        client
            .submit(&Request::new(id).permit("tenant:acme", 1))
            .await
            .unwrap();
    }
    for id in ["acme-1", "acme-2"] {
        let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
        assert_eq!(r.state, State::Acquired, "{id}");
    }
    let acme = common::semaphore(&client, "tenant:acme")
        .await
        .expect("made");
    assert_eq!((acme.capacity, acme.fair), (2, true));
    assert_eq!(acme.template.as_deref(), Some("tenant:*"));
    assert!(!acme.is_template);
    assert_eq!(state_of(&client, "acme-3").await, "new");

    // tenant:eu:x: the longer prefix wins (capacity 1, greedy).
    client
        .submit(&Request::new("eu-1").permit("tenant:eu:x", 1))
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("eu-1", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    let eu = common::semaphore(&client, "tenant:eu:x")
        .await
        .expect("made");
    assert_eq!((eu.capacity, eu.fair), (1, false));
    assert_eq!(eu.template.as_deref(), Some("tenant:eu:*"));

    // All-or-nothing with instances and plain semaphores together.
    client.set_capacity("gpu", 1, None).await.unwrap();
    client
        .submit(
            &Request::new("both")
                .permit("gpu", 1)
                .permit("tenant:beta", 1),
        )
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("both", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );

    // A template is never granted itself, and a name no template matches is unknown.
    for (id, name) in [("literal", "tenant:*"), ("nomatch", "other:acme")] {
        client
            .submit(&Request::new(id).permit(name, 1))
            .await
            .unwrap();
        client.wait_settled(id, SOON).await.unwrap();
        assert_eq!(
            state_of(&client, id).await,
            "error/unknown_semaphore",
            "{name}"
        );
    }
    check_invariants(&db.conn().await).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_a_template_changes_every_instance_and_is_audited() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("job:*", 1, None).await.unwrap();
    let _worker = db.notified_worker("w1");
    for key in ["a", "b"] {
        let id = format!("r-{key}");
        client
            .submit(&Request::new(&id).permit(format!("job:{key}"), 1))
            .await
            .unwrap();
        client.wait_settled(&id, SOON).await.unwrap();
    }
    client.set_capacity("job:*", 4, Some(false)).await.unwrap();
    for key in ["job:a", "job:b"] {
        let s = common::semaphore(&client, key).await.unwrap();
        assert_eq!((s.capacity, s.fair), (4, false), "{key}");
        let history = client.capacity_history(key).await.unwrap();
        assert_eq!(
            history
                .iter()
                .map(|c| (c.old_capacity, c.new_capacity))
                .collect::<Vec<_>>(),
            vec![(None, 1), (Some(1), 4)],
            "{key}"
        );
    }
    // An instance changed on its own keeps its value until the template changes again.
    client.set_capacity("job:a", 9, None).await.unwrap();
    assert_eq!(
        common::semaphore(&client, "job:a").await.unwrap().capacity,
        9
    );
    assert_eq!(
        common::semaphore(&client, "job:b").await.unwrap().capacity,
        4
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_racing_to_make_the_same_instances_make_each_once_and_respect_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("key:*", 2, None).await.unwrap();
    let workers: Vec<_> = (1..=3)
        .map(|i| db.worker(quiet_config(&format!("w{i}"))))
        .collect();
    // 10 keys, 12 requests each, some naming two keys at once, all submitted together.
    let mut ids = Vec::new();
    for i in 0..120 {
        let id = format!("r{i}");
        let mut request = Request::new(&id)
            .permit(format!("key:{}", i % 10), 1)
            .ttl(Duration::from_millis(300));
        if i % 3 == 0 {
            request = request.permit(format!("key:{}", (i + 1) % 10), 1);
        }
        client.submit(&request).await.unwrap();
        ids.push(id);
    }
    // Leases expire, so every request is eventually granted; none fails.
    let conn = db.conn().await;
    wait_until(
        Duration::from_secs(60),
        "every request granted once",
        || {
            let conn = &conn;
            async move {
                let report = common::collect(conn, "r").await.unwrap();
                report.granted == 120
            }
        },
    )
    .await;
    let report = common::collect(&conn, "r").await.unwrap();
    assert!(
        report.errors_by_code.is_empty(),
        "{:?}",
        report.errors_by_code
    );
    assert!(
        report.over_capacity.is_empty(),
        "{:?}",
        report.over_capacity
    );
    let instances: Vec<_> = client
        .semaphores()
        .await
        .unwrap()
        .into_iter()
        .filter(|s| s.template.as_deref() == Some("key:*"))
        .collect();
    assert_eq!(instances.len(), 10);
    for s in &instances {
        let history = client.capacity_history(&s.name).await.unwrap();
        assert_eq!(history.len(), 1, "{} made once: {history:?}", s.name);
    }
    check_invariants(&db.conn().await).await.unwrap();
    for w in workers {
        w.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_instances_are_removed_and_made_again_when_named() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("tmp:*", 1, None).await.unwrap();
    let mut config = quiet_config("w1");
    config.maintenance.idle_instance_after = Duration::from_millis(300);
    let _worker = db.worker(config);

    client
        .submit(&Request::new("held").permit("tmp:k", 1))
        .await
        .unwrap();
    client.wait_settled("held", SOON).await.unwrap();
    client
        .submit(&Request::new("waiting").permit("tmp:k", 1))
        .await
        .unwrap();
    // Held, or waited on: never removed, however long. Proof that the sweep ran past the idle
    // bound meanwhile: an idle instance beside it goes.
    client
        .submit(&Request::new("idle").permit("tmp:idle", 1))
        .await
        .unwrap();
    client.wait_settled("idle", SOON).await.unwrap();
    client.release("idle").await.unwrap();
    wait_until(SOON, "the idle instance removed", || async {
        common::semaphore(&client, "tmp:idle").await.is_none()
    })
    .await;
    assert!(common::semaphore(&client, "tmp:k").await.is_some());
    client.release("held").await.unwrap();
    assert_eq!(
        client
            .wait_settled("waiting", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    client.release("waiting").await.unwrap();

    wait_until(Duration::from_secs(15), "the idle instance removed", || {
        let client = &client;
        async move { common::semaphore(client, "tmp:k").await.is_none() }
    })
    .await;
    assert!(
        common::semaphore(&client, "tmp:*").await.is_some(),
        "the template stays"
    );
    client
        .submit(&Request::new("again").permit("tmp:k", 1))
        .await
        .unwrap();
    assert_eq!(
        client
            .wait_settled("again", SOON)
            .await
            .unwrap()
            .unwrap()
            .state,
        State::Acquired
    );
    check_invariants(&db.conn().await).await.unwrap();
}

/// A rate-limited instance whose window still holds grants is not idle: removing it would drop
/// its window with it, and the instance made again would start with an empty one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_rate_limited_instance_is_kept_while_its_window_holds_grants() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client
        .set_rate_limit("rl:*", 1, Duration::from_secs(3600), None)
        .await
        .unwrap();
    client.set_capacity("tmp:*", 1, None).await.unwrap();
    let mut config = quiet_config("w1");
    config.maintenance.idle_instance_after = Duration::from_millis(300);
    let _worker = db.worker(config);
    for (id, name) in [("spent", "rl:k"), ("idle", "tmp:idle")] {
        client
            .submit(&Request::new(id).permit(name, 1))
            .await
            .unwrap();
        client.wait_settled(id, SOON).await.unwrap();
        client.release(id).await.unwrap();
    }
    // The sweep ran past the idle bound: the plain idle instance beside it went.
    wait_until(SOON, "the idle instance removed", || async {
        common::semaphore(&client, "tmp:idle").await.is_none()
    })
    .await;
    assert!(common::semaphore(&client, "rl:k").await.is_some());
    client
        .submit(&Request::new("again").permit("rl:k", 1).wait(Duration::ZERO))
        .await
        .unwrap();
    let r = client.wait_settled("again", SOON).await.unwrap().unwrap();
    assert_eq!(
        r.error_code.map(|c| c.as_str().to_string()).as_deref(),
        Some("no_capacity"),
        "the window still holds its grant"
    );
}

/// A template without `max_instances` has the default bound, and a request over it says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_instances_names_the_default_bound_of_a_template_without_one() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("lab:*", 1, None).await.unwrap();
    let detail: serde_json::Value = db
        .conn()
        .await
        .query_one(
            "SELECT permitq.completed_error_detail('too_many_instances', '{\"semaphore\": \"lab:1\"}', '{\"lab:1\": 1}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(detail["template"], "lab:*");
    assert_eq!(detail["max_instances"], i64::from(permitq::MAX_INSTANCES));
}

/// A request refused on the spot (a count beyond the template's capacity) takes none of the
/// template's `max_instances`: the instance made for it is removed again with its audit row, and
/// the next new instance is made. One that a granted request uses stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_on_the_spot_takes_no_instance_of_the_template() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let conn = db.conn().await;
    conn.batch_execute("SELECT permitq.set_capacity('lab:*', 2, max_instances => 1)")
        .await
        .unwrap();
    let worker = db.worker(quiet_config("w"));
    client
        .submit(&Request::new("big").permit("lab:a", 3))
        .await
        .unwrap();
    wait_until(SOON, "big fails", || async {
        state_of(&client, "big").await == "error/exceeds_capacity"
    })
    .await;
    let names: Vec<String> = client
        .semaphores()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert!(!names.contains(&"lab:a".to_string()), "{names:?}");
    assert!(
        client.capacity_history("lab:a").await.unwrap().is_empty(),
        "its creation is not in the audit"
    );
    // The template's one instance is free for another key.
    client
        .submit(&Request::new("fits").permit("lab:b", 1))
        .await
        .unwrap();
    wait_until(SOON, "fits granted", || async {
        state_of(&client, "fits").await == "acquired"
    })
    .await;
    // One a granted request uses stays.
    assert!(client
        .semaphores()
        .await
        .unwrap()
        .iter()
        .any(|s| s.name == "lab:b"));
    client.release("fits").await.unwrap();
    check_invariants(&db.conn().await).await.unwrap();
    worker.stop().await;
}

/// A request naming more new instances than a template's bound leaves fails with
/// too_many_instances, and its detail counts what the template had before the batch: the
/// instances the batch made for it (dropped again) are neither counted nor offered for
/// deletion, and the bound it names takes them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_more_new_instances_than_the_bound_is_told_the_bound_for_all() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let settings = permitq::SemaphoreSettings::new().max_instances(2);
    client.set_semaphore("q:*", 1, &settings).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let three = |id: &str| {
        Request::new(id)
            .permit("q:a", 1)
            .permit("q:b", 1)
            .permit("q:c", 1)
    };
    client.submit(&three("qi-1")).await.unwrap();
    let r = client.wait_settled("qi-1", SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Error);
    let d = r.error_detail.clone().unwrap();
    assert_eq!(
        (d.instances, d.new_instances, d.idle_instances.len()),
        (Some(0), Some(3), 0),
        "{d:?}"
    );
    let outcome = r.outcome().unwrap();
    assert!(
        outcome.contains("the request names 3 new instances of template q:*, which has 0")
            && outcome.contains("--max-instances 3`"),
        "{outcome}"
    );
    assert!(client
        .semaphores()
        .await
        .unwrap()
        .iter()
        .all(|s| s.template.is_none()));
    // The bound it names takes them all.
    let settings = permitq::SemaphoreSettings::new().max_instances(3);
    client.set_semaphore("q:*", 1, &settings).await.unwrap();
    client.submit(&three("qi-2")).await.unwrap();
    assert_eq!(
        common::settled_state(&client, "qi-2").await,
        State::Acquired
    );
}

/// The same for a nested template: the parent capacity and the bound the answer names take all
/// of the request's new instances, so that doing both is enough.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_template_names_the_parent_capacity_for_all_the_new_instances() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("acc", 8, None).await.unwrap();
    let lab = |max: i32| {
        permitq::SemaphoreSettings::new()
            .parent("acc")
            .guarantee(2)
            .max_instances(max)
    };
    client.set_semaphore("lab:*", 2, &lab(3)).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    for x in ["a", "b", "c"] {
        let id = format!("{x}-1");
        client
            .submit(&Request::new(&id).permit(format!("lab:{x}"), 1))
            .await
            .unwrap();
        assert_eq!(common::settled_state(&client, &id).await, State::Acquired);
    }
    let three = |id: &str| {
        Request::new(id)
            .permit("lab:d", 1)
            .permit("lab:e", 1)
            .permit("lab:f", 1)
    };
    client.submit(&three("n6")).await.unwrap();
    let r = client.wait_settled("n6", SOON).await.unwrap().unwrap();
    let d = r.error_detail.clone().unwrap();
    assert_eq!(
        (d.instances, d.new_instances, d.parent_needs),
        (Some(3), Some(3), Some(12)),
        "{d:?}"
    );
    let outcome = r.outcome().unwrap();
    assert!(
        outcome.contains("so acc needs capacity 12 first (`permitq semaphore set acc 12`)")
            && outcome.contains("--max-instances 6`"),
        "{outcome}"
    );
    // Doing what it says is enough.
    client.set_capacity("acc", 12, None).await.unwrap();
    client.set_semaphore("lab:*", 2, &lab(6)).await.unwrap();
    client.submit(&three("n7")).await.unwrap();
    assert_eq!(common::settled_state(&client, "n7").await, State::Acquired);
}
