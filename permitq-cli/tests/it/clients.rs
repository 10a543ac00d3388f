//! The producer clients in other languages (clients/), each run by its own test suite against
//! this test's database, with two real `permitq worker` processes granting.

use permitq_test_support as common;

use std::process::{Child, Command, Stdio};

use common::TestDb;

/// Two `permitq worker` processes on `url`, killed when dropped.
struct Workers(Vec<Child>);

impl Workers {
    fn start(url: &str) -> Workers {
        Workers(
            ["clients-1", "clients-2"]
                .iter()
                .map(|id| {
                    Command::new(env!("CARGO_BIN_EXE_permitq"))
                        .args(["worker", "--id", id])
                        .env("DATABASE_URL", url)
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("spawn permitq worker")
                })
                .collect(),
        )
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The Python package (clients/python): its unittest suite, as a producer login, an admin login
/// and a second producer login (ownership), with psycopg from the system (Debian's
/// python3-psycopg, which scripts/test installs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_passes_its_suite_against_real_workers() {
    let db = TestDb::new().await;
    let producer = db.login("permitq_producer").await;
    // A second producer login (`login` makes one per role).
    let other_user = format!("other_{}", common::user_of(&producer));
    db.conn()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {other_user} LOGIN PASSWORD 'pw' IN ROLE permitq_producer"
        ))
        .await
        .unwrap();
    let other = common::as_user(&db.url, &other_user, "pw");
    let admin = db.login("permitq_admin").await;
    let _workers = Workers::start(&db.url);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python");
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .args(["-c", "import psycopg"])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("python3 with psycopg (Debian's python3-psycopg, installed by scripts/test)");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-m", "unittest", "discover", "-v", "-s"])
            .arg(root.join("tests"))
            .env("PYTHONPATH", &root)
            .env("DATABASE_URL", producer)
            .env("PERMITQ_ADMIN_URL", admin)
            .env("PERMITQ_OTHER_URL", other)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let report = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{report}");
    assert!(
        report.contains("Ran ") && !report.contains("skipped"),
        "every test ran: {report}"
    );
}
