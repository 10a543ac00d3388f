//! Least privilege: log in as a member of each permitq role and try every allowed and forbidden
//! action. Also: a non-superuser that owns the database migrates it.

use permitq_test_support as common;

use std::time::Duration;

use common::{as_user, quiet_config, RunningWorker, TestDb};
use permitq::{Client, Request, SqlState, State};

/// A login role in `role`, unique to this test database.
async fn login(db: &TestDb, role: &str) -> String {
    db.login(role).await
}

/// Runs `sql` and expects permission denied (42501).
async fn denied(conn: &tokio_postgres::Client, sql: &str) {
    let err = conn
        .batch_execute(sql)
        .await
        .expect_err(&format!("forbidden: {sql}"));
    assert_eq!(
        err.code(),
        Some(&SqlState::INSUFFICIENT_PRIVILEGE),
        "{sql}: {err}"
    );
}

/// Runs `sql` and expects success.
async fn allowed(conn: &tokio_postgres::Client, sql: &str) {
    conn.batch_execute(sql)
        .await
        .unwrap_or_else(|e| panic!("allowed: {sql}: {e:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_can_do_exactly_its_part() {
    let db = TestDb::new().await;
    let admin_url = login(&db, "permitq_admin").await;
    let producer_url = login(&db, "permitq_producer").await;
    let worker_url = login(&db, "permitq_worker").await;

    // Admin: capacity, revoke, retention; reads everything; writes no table directly.
    let admin = common::connect(&admin_url).await;
    allowed(&admin, "SELECT permitq.set_capacity('gpu', 2)").await;
    allowed(&admin, "SELECT permitq.set_capacity('other', 1)").await;
    allowed(&admin, "SELECT * FROM permitq.semaphore_usage").await;
    allowed(&admin, "SELECT permitq.delete_settled('7 days', 10)").await;
    denied(&admin, "UPDATE permitq.semaphore SET capacity = 100").await;
    denied(&admin, "SELECT * FROM permitq.claim_batch(0, 10)").await;

    // Producer: submit, plain INSERT, status, heartbeat, release, fence, reads.
    let producer = common::connect(&producer_url).await;
    allowed(
        &producer,
        "SELECT permitq.submit('p1', '{\"gpu\": 1}', ttl => '1 minute')",
    )
    .await;
    allowed(
        &producer,
        "INSERT INTO permitq.permit_request (external_id, permits) VALUES ('p2', '{\"gpu\": 1}') ON CONFLICT (external_id) DO NOTHING",
    )
    .await;
    allowed(&producer, "SELECT * FROM permitq.status('p1')").await;
    allowed(&producer, "SELECT * FROM permitq.permit_request").await;
    allowed(&producer, "SELECT * FROM permitq.holders").await;
    allowed(&producer, "SELECT * FROM permitq.waiters").await;
    allowed(&producer, "LISTEN permitq_events").await;
    for forbidden in [
        "UPDATE permitq.semaphore SET capacity = 100",
        "DELETE FROM permitq.semaphore",
        "UPDATE permitq.permit_request SET state = 'acquired'",
        "DELETE FROM permitq.permit_request",
        "DELETE FROM permitq.waiter",
        "INSERT INTO permitq.permit_request (external_id, permits, state) VALUES ('p3', '{\"gpu\": 1}', 'new')",
        "SELECT permitq.set_capacity('gpu', 100)",
        "SELECT permitq.revoke('p1')",
        "SELECT * FROM permitq.claim_batch(0, 10)",
        "SELECT permitq.apply_decision('me', '{}', '{}', '{}', '{}', '{}')",
        "SELECT permitq.sweep_expired(10)",
        "SELECT nextval('permitq.fencing_token_seq')",
        "SELECT permitq.delete_settled('0 seconds', 1000)",
    ] {
        denied(&producer, forbidden).await;
    }

    // Worker: runs the claim loop and sweeps; cannot submit, change capacity or revoke.
    let worker_conn = common::connect(&worker_url).await;
    for forbidden in [
        "SELECT permitq.submit('w1', '{\"gpu\": 1}')",
        "SELECT permitq.set_capacity('gpu', 100)",
        "SELECT permitq.revoke('p1')",
        "UPDATE permitq.semaphore SET used = 0",
        "DELETE FROM permitq.permit_request",
    ] {
        denied(&worker_conn, forbidden).await;
    }
    let worker = RunningWorker::start(&worker_url, quiet_config("least-privilege"));
    let producer_client = Client::connect(&producer_url).await.unwrap();
    for id in ["p1", "p2"] {
        let r = producer_client
            .wait_settled(id, Duration::from_secs(15))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.state, State::Acquired, "{id}");
    }
    producer_client.heartbeat("p1", None).await.unwrap();
    producer_client.release("p1").await.unwrap();
    producer_client
        .submit(&Request::new("p4").permit("gpu", 1))
        .await
        .unwrap();
    let r = producer_client
        .wait_settled("p4", Duration::from_secs(15))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        r.state,
        State::Acquired,
        "the release was folded by the worker role"
    );
    let admin_client = Client::connect(&admin_url).await.unwrap();
    assert_eq!(
        admin_client.revoke("p4").await.unwrap(),
        permitq::ReleaseOutcome::Revoked
    );
    worker.stop().await;
    common::check_invariants(&db.conn().await).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_superuser_that_owns_the_database_or_the_schema_migrates_it() {
    let db = TestDb::new().await;
    let owner = format!("owner_{}", &db.name[db.name.len() - 8..]);
    let fresh = format!("fresh_{}", &db.name[db.name.len() - 8..]);
    let admin = db.conn().await;
    for statement in [
        format!("CREATE ROLE {owner} LOGIN PASSWORD 'pw' NOSUPERUSER NOCREATEROLE"),
        format!("CREATE DATABASE {fresh} OWNER {owner}"),
    ] {
        admin.batch_execute(&statement).await.unwrap();
    }
    let url = common::with_dbname(&as_user(&db.url, &owner, "pw"), &fresh);
    let client = Client::connect(&url).await.unwrap();
    // The roles exist (cluster-wide) already, so it needs no CREATEROLE.
    let applied = client.migrate().await.unwrap();
    assert_eq!(applied.versions.len(), permitq::migrate::MIGRATIONS.len());
    assert!(client.migrate().await.unwrap().is_empty());
    client.set_capacity("x", 1, None).await.unwrap();
    // The login that migrated acts as an admin: it reads and ends a producer's request.
    let producer = format!("prod_{}", &db.name[db.name.len() - 8..]);
    admin
        .batch_execute(&format!(
            "CREATE ROLE {producer} LOGIN PASSWORD 'pw' IN ROLE permitq_producer"
        ))
        .await
        .unwrap();
    let producer_client = Client::connect(&common::with_dbname(
        &as_user(&db.url, &producer, "pw"),
        &fresh,
    ))
    .await
    .unwrap();
    producer_client
        .submit(&permitq::Request::new("theirs").permit("x", 1))
        .await
        .unwrap();
    assert!(!producer_client.reads_every_request().await.unwrap());
    assert!(
        client.reads_every_request().await.unwrap(),
        "the owner reads every request"
    );
    assert!(
        client.explain("theirs").await.unwrap().is_some(),
        "the owner explains another login's request"
    );
    assert_eq!(
        client.release("theirs").await.unwrap(),
        permitq::ReleaseOutcome::Cancelled,
        "the owner cancels another login's request, as an admin does"
    );
    // And it may run a worker (it owns every function a worker calls).
    let worker = RunningWorker::start(&url, quiet_config("owner-w"));
    client
        .acquire(
            &Request::new("owners").permit("x", 1),
            Duration::from_secs(15),
        )
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
    worker.stop().await;
    drop((client, producer_client));

    // A role that owns only the permitq schema (no CREATE on the database) migrates too; one
    // that owns nothing is told what it needs.
    let schema_only = format!("schema_{}", &db.name[db.name.len() - 8..]);
    for statement in [
        format!("CREATE DATABASE {schema_only}"),
        format!("REVOKE CREATE ON DATABASE {schema_only} FROM PUBLIC"),
    ] {
        admin.batch_execute(&statement).await.unwrap();
    }
    let superuser = common::with_dbname(&db.url, &schema_only);
    let nothing = Client::connect(&common::with_dbname(
        &as_user(&db.url, &owner, "pw"),
        &schema_only,
    ))
    .await
    .unwrap();
    let err = nothing.migrate().await.unwrap_err();
    assert!(
        err.to_string()
            .contains("must own the database or the permitq schema"),
        "{err}"
    );
    // Who owns what, and whom to ask.
    let superuser_name = common::user_of(&db.url);
    assert!(
        err.to_string().contains(&format!(
            "there is no permitq schema yet, and {owner} may not create it in the database, \
             owned by {superuser_name}: migrate as {superuser_name}, or have {superuser_name} \
             run `GRANT CREATE ON DATABASE {schema_only} TO {owner}`"
        )),
        "{err}"
    );
    common::connect(&superuser)
        .await
        .batch_execute(&format!("CREATE SCHEMA permitq AUTHORIZATION {owner}"))
        .await
        .unwrap();
    let applied = nothing.migrate().await.unwrap();
    assert_eq!(applied.versions.len(), permitq::migrate::MIGRATIONS.len());
    drop(nothing);
    // Another login, after it: told who owns the schema, to migrate as them.
    let other = format!("other_{}", &db.name[db.name.len() - 8..]);
    admin
        .batch_execute(&format!("CREATE ROLE {other} LOGIN PASSWORD 'pw'"))
        .await
        .unwrap();
    let stranger = Client::connect(&common::with_dbname(
        &as_user(&db.url, &other, "pw"),
        &schema_only,
    ))
    .await
    .unwrap();
    let err = stranger.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "{other} does not own the permitq schema, {owner} does (and {superuser_name} the \
             database): migrate as {owner} (the schema's owner is permitq's admin: hand it \
             over only to a login meant to be one, by {owner} or a superuser running `ALTER \
             SCHEMA permitq OWNER TO {other}`). The migrating role"
        )),
        "{err}"
    );
    // With a permitq role it may read what is applied: it is told that nothing needed
    // migrating (a deploy step run as a producer wonders).
    admin
        .batch_execute(&format!("GRANT permitq_producer TO {other}"))
        .await
        .unwrap();
    let err = stranger.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains(
            "`). Nothing needed migrating now: the schema is already up to date for this \
             permitq (the next upgrade will need the owner). The migrating role"
        ),
        "{err}"
    );
    admin
        .batch_execute(&format!("REVOKE permitq_producer FROM {other}"))
        .await
        .unwrap();
    drop(stranger);

    // Leave nothing behind on the shared cluster.
    for statement in [
        format!("DROP DATABASE {fresh} WITH (FORCE)"),
        format!("DROP DATABASE {schema_only} WITH (FORCE)"),
        format!("DROP ROLE {owner}"),
        format!("DROP ROLE {other}"),
        format!("DROP ROLE {producer}"),
    ] {
        admin.batch_execute(&statement).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_createrole_and_without_the_roles_migrate_says_what_a_dba_must_run() {
    // A cluster of its own: the roles are cluster-wide and exist on the shared one.
    let cluster = tokio::task::spawn_blocking(permitq_test_support::EmbeddedPostgres::start)
        .await
        .unwrap()
        .unwrap();
    let admin = common::connect(&cluster.url("postgres")).await;
    for statement in [
        "CREATE ROLE app_owner LOGIN PASSWORD 'pw' NOSUPERUSER NOCREATEROLE",
        "CREATE DATABASE app OWNER app_owner",
    ] {
        admin.batch_execute(statement).await.unwrap();
    }
    let url = as_user(&cluster.url("app"), "app_owner", "pw");
    let client = Client::connect(&url).await.unwrap();
    let err = client.migrate().await.unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("may not create roles")
            && message.contains(
                "CREATE ROLE permitq_admin NOLOGIN; CREATE ROLE permitq_operator NOLOGIN; \
                 CREATE ROLE permitq_producer NOLOGIN; CREATE ROLE permitq_worker NOLOGIN;"
            )
            && message.contains("CREATEROLE"),
        "{message}"
    );
    // The run is one transaction: nothing is applied (nothing half-done), and the schema is
    // not current.
    assert!(!client.schema_is_current().await.unwrap());
    // Once a DBA created the roles, the same owner migrates.
    admin
        .batch_execute(
            "CREATE ROLE permitq_producer NOLOGIN; CREATE ROLE permitq_worker NOLOGIN; \
             CREATE ROLE permitq_admin NOLOGIN; CREATE ROLE permitq_operator NOLOGIN;",
        )
        .await
        .unwrap();
    client.migrate().await.unwrap();
    assert!(client.schema_is_current().await.unwrap());
    drop(client);
}

/// A login with no permitq role calling the library is told the producer's role first (a
/// library's calls are a producer's), and the GRANT by that login's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_library_call_without_a_role_names_the_producers_role_first() {
    let db = TestDb::new().await;
    let user = format!("bare_{}", &db.name[db.name.len() - 8..]);
    db.conn()
        .await
        .batch_execute(&format!("CREATE ROLE {user} LOGIN PASSWORD 'pw'"))
        .await
        .unwrap();
    let client = Client::connect(&as_user(&db.url, &user, "pw"))
        .await
        .unwrap();
    let err = client
        .submit(&Request::new("r-1").permit("gpu", 1))
        .await
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("this needs the role permitq_producer (a producer's calls: submit, acquire"),
        "{err}"
    );
    // The GRANT it gives names this login, not `<your login>`.
    assert!(
        err.to_string()
            .contains(&format!("GRANT that role TO {user}"))
            && !err.to_string().contains("<your login>"),
        "{err}"
    );
    drop(client);
    db.conn()
        .await
        .batch_execute(&format!("DROP ROLE {user}"))
        .await
        .unwrap();
}
