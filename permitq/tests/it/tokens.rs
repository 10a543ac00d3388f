//! Fencing tokens never go backwards, whatever is restored where: a dump restored into another
//! database of the same cluster or in place over the original, the token sequence set back
//! under a running worker (before or after retention deleted the rows that held its tokens),
//! and the operator's floor for the one case no copy can see.

use permitq_test_support as common;

use std::path::PathBuf;
use std::time::Duration;

use common::{quiet_config, TestDb};
use permitq::{Client, Request, SqlState, State};

const SOON: Duration = Duration::from_secs(10);

/// Submits `id` for one permit of `t` and returns its token once a running worker granted it.
async fn granted(client: &Client, id: &str) -> i64 {
    client
        .submit(&Request::new(id).permit("t", 1))
        .await
        .unwrap();
    let r = client.wait_settled(id, SOON).await.unwrap().unwrap();
    assert_eq!(r.state, State::Acquired, "{id}: {r:?}");
    r.fencing_token.expect("granted")
}

/// `pg_dump --format=custom` of `url` into a temporary file.
fn dump(url: &str) -> PathBuf {
    let file = std::env::temp_dir().join(format!("permitq-dump-{}", uuid::Uuid::new_v4().simple()));
    let out = std::process::Command::new(common::find_bin_dir().unwrap().join("pg_dump"))
        .args(["--format=custom", "--file"])
        .arg(&file)
        .args(["--dbname", url])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    file
}

/// `pg_restore --no-owner [extra] --dbname url file`.
fn restore(file: &PathBuf, url: &str, extra: &[&str]) {
    let out = std::process::Command::new(common::find_bin_dir().unwrap().join("pg_restore"))
        .args(["--no-owner"])
        .args(extra)
        .args(["--dbname", url])
        .arg(file)
        .output()
        .unwrap();
    let _ = std::fs::remove_file(file);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A database with semaphore `t` and a running worker; the tokens of `before` grants, a dump,
/// then the highest token of `after` more grants (issued after the dump).
async fn grants_around_a_dump(db: &TestDb) -> (PathBuf, i64) {
    let client = db.client().await;
    client.set_capacity("t", 100, None).await.unwrap();
    let worker = db.worker(quiet_config("w"));
    granted(&client, "before").await;
    let file = dump(&db.url);
    let mut highest = 0;
    for i in 0..5 {
        highest = highest.max(granted(&client, &format!("after-{i}")).await);
    }
    worker.stop().await;
    (file, highest)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_restored_into_another_database_of_the_cluster_issues_tokens_above_the_original() {
    let db = TestDb::new().await;
    let (file, highest) = grants_around_a_dump(&db).await;
    // Same cluster, same timeline: only the database (and its token sequence) are new.
    let copy = TestDb::empty().await;
    restore(&file, &copy.url, &[]);
    let client = copy.client().await;
    client.migrate().await.unwrap();
    let _worker = copy.worker(quiet_config("w-copy"));
    let first = granted(&client, "in-the-copy").await;
    assert!(
        first > highest,
        "{first} after {highest}, issued by the original after the dump"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_restored_in_place_issues_tokens_above_those_issued_since_the_dump() {
    let db = TestDb::new().await;
    let (file, highest) = grants_around_a_dump(&db).await;
    restore(&file, &db.url, &["--clean", "--if-exists"]);
    let client = db.client().await;
    client.migrate().await.unwrap();
    let _worker = db.worker(quiet_config("w-restored"));
    let first = granted(&client, "restored").await;
    assert!(
        first > highest,
        "{first} after {highest}, issued before the restore"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_under_a_running_worker_fails_nothing_and_tokens_go_on_rising() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("t", 100, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let mut highest = 0;
    for i in 0..3 {
        highest = highest.max(granted(&client, &format!("a-{i}")).await);
    }
    db.conn()
        .await
        .batch_execute("SELECT setval('permitq.fencing_token_seq', 1)")
        .await
        .unwrap();
    // Each is granted (none ends `invalid` on a token drawn twice), above every earlier token.
    for i in 0..5 {
        let token = granted(&client, &format!("b-{i}")).await;
        assert!(token > highest, "{token} after {highest}");
        highest = token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_after_retention_deleted_its_tokens_is_still_seen() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("t", 100, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let mut highest = 0;
    for i in 0..3 {
        let id = format!("a-{i}");
        highest = highest.max(granted(&client, &id).await);
        client.release(&id).await.unwrap();
    }
    let conn = db.conn().await;
    common::wait_until(SOON, "the releases are settled", || async {
        conn.query_one(
            "SELECT count(*) FROM permitq.permit_request WHERE state = 'released'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0)
            == 3
    })
    .await;
    let deleted: i32 = conn
        .query_one("SELECT permitq.delete_settled('0', 100)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(deleted, 3, "no row holds the tokens any more");
    conn.batch_execute("SELECT setval('permitq.fencing_token_seq', 1)")
        .await
        .unwrap();
    let token = granted(&client, "after").await;
    assert!(
        token > highest,
        "{token} after {highest}, deleted by retention"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_raises_the_floor_above_a_token_no_copy_can_see() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("t", 100, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let before = granted(&client, "before").await;
    // A token another copy issued: two epochs up.
    let elsewhere = ((before >> 48) + 2) << 48 | 7;
    let epoch = client.raise_token_floor(elsewhere).await.unwrap();
    assert!(epoch > (elsewhere >> 48), "epoch {epoch}");
    let after = granted(&client, "after").await;
    assert!(after > elsewhere, "{after} after {elsewhere}");
    // Raising to a floor already passed changes nothing.
    assert_eq!(client.raise_token_floor(before).await.unwrap(), epoch);
    let err = client.raise_token_floor(-1).await.unwrap_err();
    assert_eq!(
        err.code(),
        Some(&SqlState::INVALID_PARAMETER_VALUE),
        "{err}"
    );
    assert!(err.to_string().contains("invalid above"), "{err}");
}

/// A sequence set with `setval(.., false)` draws its value itself next: a floor at exactly that
/// token is still passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_equal_to_the_next_value_of_a_sequence_set_uncalled_is_passed() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("t", 100, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let before = granted(&client, "before").await;
    let epoch = before >> 48;
    db.conn()
        .await
        .batch_execute("SELECT setval('permitq.fencing_token_seq', 100, false)")
        .await
        .unwrap();
    let floor = epoch << 48 | 100;
    client.raise_token_floor(floor).await.unwrap();
    let after = granted(&client, "after").await;
    assert!(after > floor, "{after} is not above the floor {floor}");
}

/// Retention deletes fence rows untouched as long as settled requests are kept, except those
/// whose token a request still holds, and keeps their tokens in the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_old_fence_rows_of_tokens_no_longer_held() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("t", 100, None).await.unwrap();
    let _worker = db.worker(quiet_config("w"));
    let gone = granted(&client, "gone").await;
    let held = granted(&client, "held").await;
    assert!(client.fence("t", "old-resource", gone).await.unwrap());
    assert!(client.fence("t", "held-resource", held).await.unwrap());
    client.release("gone").await.unwrap();
    let conn = db.conn().await;
    conn.batch_execute("UPDATE permitq.fence_token SET updated_at = now() - interval '8 days'")
        .await
        .unwrap();
    conn.query_one("SELECT permitq.delete_settled('7 days', 100)", &[])
        .await
        .unwrap();
    let left: Vec<String> = conn
        .query(
            "SELECT resource FROM permitq.fence_token ORDER BY resource",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, ["held-resource"], "the held token's row stays");
    let floor: i64 = conn
        .query_one("SELECT token_floor FROM permitq.token_epoch", &[])
        .await
        .unwrap()
        .get(0);
    assert!(floor >= gone, "{floor} keeps {gone}");
}
