//! The schema is one thing: a database migrated fresh and one migrated by the pre-release
//! migrations (V1 to V8, kept in tests/fixtures) and then upgraded in place are the same,
//! object for object, as `pg_dump --schema-only` sees them.

use permitq_test_support::{find_bin_dir, TestDb};

/// The pre-release migrations as the pre-release `migrate` applied them: each in a
/// transaction, recorded in `permitq.schema_migration` with its checksum.
const PRERELEASE: [(i32, &str, &str); 8] = [
    (
        1,
        "core",
        include_str!("../fixtures/prerelease_migrations/V1__core.sql"),
    ),
    (
        2,
        "leases",
        include_str!("../fixtures/prerelease_migrations/V2__leases.sql"),
    ),
    (
        3,
        "hot_path",
        include_str!("../fixtures/prerelease_migrations/V3__hot_path.sql"),
    ),
    (
        4,
        "robustness",
        include_str!("../fixtures/prerelease_migrations/V4__robustness.sql"),
    ),
    (
        5,
        "operators",
        include_str!("../fixtures/prerelease_migrations/V5__operators.sql"),
    ),
    (
        6,
        "cached_plans",
        include_str!("../fixtures/prerelease_migrations/V6__cached_plans.sql"),
    ),
    (
        7,
        "failover_tokens",
        include_str!("../fixtures/prerelease_migrations/V7__failover_tokens.sql"),
    ),
    (
        8,
        "templates_rate_limits_priorities",
        include_str!("../fixtures/prerelease_migrations/V8__templates_rate_limits_priorities.sql"),
    ),
];

async fn migrate_prerelease(db: &TestDb, through: usize) {
    let mut conn = db.conn().await;
    conn.batch_execute(
        "CREATE SCHEMA permitq;
         CREATE TABLE permitq.schema_migration (version integer PRIMARY KEY, name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now(), checksum bytea);",
    )
    .await
    .unwrap();
    for (version, name, sql) in &PRERELEASE[..through] {
        let tx = conn.transaction().await.unwrap();
        tx.batch_execute(&sql.replacen("CREATE SCHEMA IF NOT EXISTS permitq;", "", 1))
            .await
            .unwrap_or_else(|e| panic!("pre-release migration {version}: {e}"));
        tx.execute(
            "INSERT INTO permitq.schema_migration (version, name, checksum) \
             VALUES ($1, $2, sha256(convert_to($3::text, 'UTF8')))",
            &[version, name, sql],
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
}

/// `pg_dump --schema-only` of `db`, as a sorted list of its statements (ordering ignored;
/// comments and the dump's random `\restrict` key left out).
fn schema_dump(db: &TestDb) -> Vec<String> {
    let output = std::process::Command::new(find_bin_dir().unwrap().join("pg_dump"))
        .args(["--schema-only", "--no-owner", "--dbname", &db.url])
        .output()
        .expect("run pg_dump");
    assert!(
        output.status.success(),
        "pg_dump: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            !l.starts_with("--") && !l.starts_with("\\restrict") && !l.starts_with("\\unrestrict")
        })
        .collect();
    let mut statements: Vec<String> = kept
        .join("\n")
        .split("\n\n")
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect();
    statements.sort();
    statements
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_schema_and_an_upgraded_prerelease_schema_are_identical() {
    let fresh = TestDb::empty().await;
    let migrated = fresh.client().await.migrate().await.unwrap();
    let every: Vec<i32> = permitq::migrate::MIGRATIONS
        .iter()
        .map(|m| m.version)
        .collect();
    assert_eq!(migrated.versions, every);
    assert_eq!(migrated.files.len(), permitq::migrate::SCHEMA_FILES.len());

    let old = TestDb::empty().await;
    migrate_prerelease(&old, PRERELEASE.len()).await;
    let client = old.client().await;
    assert!(!client.schema_is_current().await.unwrap());
    let upgraded = client.migrate().await.unwrap();
    assert!(upgraded.upgraded_prerelease, "{upgraded:?}");
    assert!(client.schema_is_current().await.unwrap());
    assert!(
        client.migrate().await.unwrap().is_empty(),
        "a second run finds nothing to do"
    );

    let (fresh_dump, upgraded_dump) = (schema_dump(&fresh), schema_dump(&old));
    assert!(fresh_dump.len() > 100, "{fresh_dump:#?}");
    let only_fresh: Vec<&String> = fresh_dump
        .iter()
        .filter(|s| !upgraded_dump.contains(s))
        .collect();
    let only_upgraded: Vec<&String> = upgraded_dump
        .iter()
        .filter(|s| !fresh_dump.contains(s))
        .collect();
    assert!(
        only_fresh.is_empty() && only_upgraded.is_empty(),
        "only in the fresh schema: {only_fresh:#?}\nonly in the upgraded one: {only_upgraded:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_prerelease_database_keeps_its_requests_and_grants_them() {
    let old = TestDb::empty().await;
    migrate_prerelease(&old, PRERELEASE.len()).await;
    let conn = old.conn().await;
    conn.batch_execute(
        "SELECT permitq.set_capacity('gpu', 1);
         SELECT permitq.submit('before-upgrade', '{\"gpu\": 1}');",
    )
    .await
    .unwrap();
    let client = old.client().await;
    client.migrate().await.unwrap();
    let worker = old.worker(permitq_test_support::quiet_config("upgraded"));
    let settled = client
        .wait_settled("before-upgrade", std::time::Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(settled.state, permitq::State::Acquired);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incomplete_prerelease_schema_is_refused_with_what_to_do() {
    let old = TestDb::empty().await;
    migrate_prerelease(&old, 5).await;
    let err = old.client().await.migrate().await.unwrap_err().to_string();
    assert!(
        err.contains("incomplete pre-release permitq schema (migrations [1, 2, 3, 4, 5])")
            && err.contains("drop the permitq schema and migrate again"),
        "{err}"
    );
}

#[test]
fn every_schema_file_is_applied_and_no_function_is_defined_twice() {
    let on_disk: std::collections::BTreeSet<String> =
        std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/schema/functions"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
    let applied: std::collections::BTreeSet<String> = permitq::migrate::SCHEMA_FILES
        .iter()
        .map(|f| f.path.to_string())
        .collect();
    assert_eq!(
        on_disk, applied,
        "every file under schema/functions is in SCHEMA_FILES"
    );

    let mut defined = std::collections::BTreeMap::new();
    let files = permitq::migrate::SCHEMA_FILES
        .iter()
        .map(|f| (f.path, f.sql));
    let migrations = permitq::migrate::MIGRATIONS.iter().map(|m| (m.name, m.sql));
    for (file, sql) in files.chain(migrations) {
        for line in sql.lines() {
            let lower = line.to_lowercase();
            for kind in ["function ", "view ", "trigger "] {
                if let Some(rest) = lower.strip_prefix(&format!("create or replace {kind}")) {
                    // The name and the arguments on its line: one definition per signature (an
                    // overload, such as the deprecated two-argument fence, is another function).
                    let name: String = rest
                        .split(" returns")
                        .next()
                        .unwrap_or(rest)
                        .split(" as")
                        .next()
                        .unwrap_or(rest)
                        .trim()
                        .to_string();
                    if let Some(first) = defined.insert(name.clone(), file) {
                        panic!("{name} is defined in {first} and again in {file}");
                    }
                }
            }
            assert!(
                !lower.starts_with("create function") && !lower.starts_with("create view"),
                "{file}: functions and views are written CREATE OR REPLACE in schema/functions: {line}"
            );
        }
    }
}

/// A URL naming a database without the schema (the wrong one, often): the client's errors say
/// which database it looked in, beside "run `permitq migrate`".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_schema_names_the_database_the_client_looked_in() {
    let db = TestDb::empty().await;
    let client = permitq::Client::connect(&db.url).await.unwrap();
    let looked_in = format!(
        "(looked in database {} at 127.0.0.1:",
        permitq_test_support::db_of(&db.url)
    );
    let submitted = client
        .submit(&permitq::Request::new("nm-1").permit("gpu", 1))
        .await
        .expect_err("no schema");
    let read = client.status("nm-1").await.expect_err("no schema");
    for err in [submitted, read] {
        assert!(err.is_missing_schema(), "{err}");
        let said = err.to_string();
        assert!(
            said.contains("run `permitq migrate`")
                && said.contains(&looked_in)
                && said.contains(
                    "if permitq was migrated into another database, fix the URL instead)"
                ),
            "{said}"
        );
    }
}
