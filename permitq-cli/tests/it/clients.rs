//! The producer clients in other languages (clients/), each run by its own test suite against
//! this test's database, with two real `permitq worker` processes granting.

use permitq_test_support as common;

use std::process::{Command, Stdio};

use common::{PgBouncer, TestDb};

use crate::examples::{python_with_psycopg, Background};

/// Two `permitq worker` processes on `url`, killed when dropped.
fn start_workers(url: &str) -> Background {
    Background(
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

/// The first ```LANG block of a client's README (clients/DIR/README.md), as written.
fn readme_block(dir: &str, lang: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../clients")
        .join(dir)
        .join("README.md");
    let text = std::fs::read_to_string(&path).unwrap();
    let start = text
        .find(&format!("```{lang}\n"))
        .unwrap_or_else(|| panic!("no {lang} block in {}", path.display()))
        + lang.len()
        + 4;
    let end = start + text[start..].find("```").unwrap();
    text[start..end].to_string()
}

/// What a README block prints when it ran through (its `write` prints each step).
const README_RAN: &str = "step 2, fencing token ";

/// The logins a client suite runs as, as the environment it reads them from: a producer
/// (`DATABASE_URL`), an admin, a second producer (ownership) and the superuser (stopping a
/// lease's backends).
async fn logins(db: &TestDb) -> Vec<(&'static str, String)> {
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
    vec![
        ("DATABASE_URL", producer),
        ("PERMITQ_ADMIN_URL", db.login("permitq_admin").await),
        (
            "PERMITQ_OTHER_URL",
            common::as_user(&db.url, &other_user, "pw"),
        ),
        ("PERMITQ_SUPER_URL", db.url.clone()),
    ]
}

/// The Python package (clients/python): its suite, as a producer login, an admin login, a second
/// producer login (ownership) and the superuser (stopping the lease's backends). Under pytest,
/// against the package installed into the virtualenv scripts/test makes (`$PERMITQ_PYTHON`); else
/// (cargo test run directly) under unittest, with the sources on the path and the system's psycopg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_passes_its_suite_against_real_workers() {
    let db = TestDb::new().await;
    let logins = logins(&db).await;
    let _workers = start_workers(&db.url);
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../clients/python")
        .canonicalize()
        .unwrap();
    let python = python_with_psycopg();
    let installed = std::env::var_os("PERMITQ_PYTHON").is_some();
    let suite_logins = logins.clone();
    let out = tokio::task::spawn_blocking(move || {
        let tests = root.join("tests");
        let mut command = Command::new(python);
        if installed {
            // From the tests' folder, so that `import permitq` is the installed package.
            command
                .args(["-m", "pytest", "-v", "-p", "no:cacheprovider", "-rs"])
                .arg(&tests)
                .current_dir(&tests);
        } else {
            command
                .args(["-m", "unittest", "discover", "-v", "-s"])
                .arg(&tests)
                .env("PYTHONPATH", &root);
        }
        command
            .envs(suite_logins)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{report}");
    if installed {
        assert!(
            report.contains(" passed") && !report.contains("skipped") && !report.contains("failed"),
            "every test ran: {report}"
        );
        assert!(
            report.contains("clients-venv"),
            "the suite ran under the virtualenv's pytest: {report}"
        );
    } else {
        assert!(
            report.contains("Ran ") && !report.contains("skipped"),
            "every test ran: {report}"
        );
    }
    // The package README's block runs as written, as the producer.
    db.client()
        .await
        .set_capacity("gpu", 4, None)
        .await
        .unwrap();
    let printed = python_code(
        python,
        readme_block("python", "python"),
        logins[0].1.clone(),
    )
    .await;
    assert!(printed.contains(README_RAN), "{printed}");
    // Through PgBouncer in transaction mode (one server connection), waiting by polling.
    let bouncer = PgBouncer::start(&db.url, "transaction", 1);
    let pooled = bouncer.url(&db.name);
    let printed = python_code(python, THROUGH_A_POOLER_PY.to_string(), pooled).await;
    assert_eq!(printed.trim(), "ok 3");
}

/// Runs `code` with the package on the path and `DATABASE_URL` set to `url`; what it printed
/// (panics with its output unless it succeeds).
pub(crate) async fn python_code(python: &'static str, code: String, url: String) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../clients/python");
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args(["-c", &code])
            .env("PYTHONPATH", &root)
            .env("DATABASE_URL", url)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let printed = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    printed
}

/// Three acquires with a lease each, through a pooler: `listen=False`, no prepared statements.
const THROUGH_A_POOLER_PY: &str = r#"
import permitq, os, uuid
with permitq.Client(os.environ["DATABASE_URL"], listen=False) as client:
    client.set_capacity("pooled", 1)
    tokens = []
    for i in range(3):
        with client.acquire(f"pool-{uuid.uuid4().hex[:6]}", {"pooled": 1}, ttl=3, timeout=15) as lease:
            client.heartbeat(lease.external_id)
            tokens.append(lease.fencing_token)
    assert tokens == sorted(tokens), tokens
    print("ok", len(tokens))
"#;

/// The same from Node.
const THROUGH_A_POOLER_JS: &str = r#"
import { Client, withLease } from "permitq";
const client = new Client({ connectionString: process.env.DATABASE_URL, listen: false });
await client.setCapacity("pooled-js", 1);
const tokens = [];
for (let i = 0; i < 3; i++) {
  await withLease(client, `pool-js-${i}-${Date.now()}`, { "pooled-js": 1 }, { ttlSeconds: 3, timeoutMs: 15000 },
    async (lease) => { await client.heartbeat(lease.externalId); tokens.push(lease.fencingToken); });
}
await client.end();
if (!(tokens[0] < tokens[1] && tokens[1] < tokens[2])) throw new Error(String(tokens));
console.log("ok", tokens.length);
"#;

/// An acquire on a database no worker serves, for 5 s: its warning, then its timeout's name.
const NO_WORKER_JS: &str = r#"
const permitq = await import("permitq");
const client = new permitq.Client({ connectionString: process.env.DATABASE_URL });
try { await client.acquire("ts-nw", { gpu: 1 }, { timeoutMs: 5000 }); } catch (e) { console.log(e.name, e.message); }
await client.end();
"#;

/// The same in Python, its `permitq` logger printed.
const NO_WORKER_PY: &str = r#"
import logging, os, sys
import permitq
logging.basicConfig(stream=sys.stdout, format="%(message)s")
with permitq.Client(os.environ["DATABASE_URL"]) as client:
    try:
        client.acquire("py-nw", {"gpu": 1}, timeout=5)
    except permitq.AcquireTimeout as e:
        print("AcquireTimeout", e)
"#;

/// A Python acquire with no worker running says so once while it waits (on the `permitq`
/// logger), not only at its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_acquire_says_while_it_waits_that_no_worker_runs() {
    let db = TestDb::new().await;
    db.client()
        .await
        .set_capacity("gpu", 4, None)
        .await
        .unwrap();
    let said = python_code(
        python_with_psycopg(),
        NO_WORKER_PY.to_string(),
        db.url.clone(),
    )
    .await;
    // Its timeout's message does not also say that a running worker examines it.
    assert!(
        said.contains("AcquireTimeout") && !said.contains("a running worker does"),
        "{said}"
    );
    assert_eq!(
        said.matches("permitq: py-nw waits, and nothing is granting: ")
            .count(),
        1,
        "{said}"
    );
}

/// Runs `program args` in `dir` with `envs`; panics with its output unless it succeeds.
pub(crate) fn run_ok(
    dir: &std::path::Path,
    program: &str,
    args: &[&str],
    envs: &[(&str, &str)],
) -> String {
    let out = Command::new(program)
        .args(args)
        .current_dir(dir)
        .envs(envs.iter().copied())
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{program} {args:?}: {text}");
    text
}

/// A new ES-module project in `dir` with the TypeScript package at `package` installed as its
/// README says (`npm install --install-links`: a copy with its own dependencies).
pub(crate) fn user_project(dir: &std::path::Path, package: &std::path::Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("package.json"),
        r#"{"name":"user","type":"module"}"#,
    )
    .unwrap();
    run_ok(
        dir,
        "npm",
        &[
            "install",
            "--no-audit",
            "--no-fund",
            "--install-links",
            package.to_str().unwrap(),
        ],
        &[],
    );
}

/// The TypeScript package (clients/typescript): its dependencies from the lock file, the
/// committed `dist/` equal to what `tsc` makes of `src/` now, its node:test suite as the three
/// logins, and an install into a new project that imports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_client_passes_its_suite_against_real_workers() {
    let db = TestDb::new().await;
    let logins = logins(&db).await;
    let _workers = start_workers(&db.url);
    // A database no worker serves: an acquire there says so while it waits.
    let unserved = TestDb::new().await;
    unserved
        .client()
        .await
        .set_capacity("gpu", 4, None)
        .await
        .unwrap();
    let unserved_url = unserved.url.clone();
    let superuser = db.url.clone();
    let db_name = db.name.clone();
    db.client()
        .await
        .set_capacity("gpu", 4, None)
        .await
        .unwrap();
    let producer = logins[0].1.clone();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../clients/typescript")
        .canonicalize()
        .unwrap();
    let report = tokio::task::spawn_blocking(move || {
        run_ok(&root, "npm", &["ci", "--no-audit", "--no-fund"], &[]);
        // The committed build is the build of the sources.
        let fresh = std::env::temp_dir().join(format!("permitq-ts-{}", std::process::id()));
        let fresh_dir = fresh.to_str().unwrap();
        run_ok(&root, "npx", &["tsc", "--outDir", fresh_dir], &[]);
        let names = |dir: &std::path::Path| -> std::collections::BTreeSet<String> {
            std::fs::read_dir(dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .collect()
        };
        let built = names(&fresh);
        assert_eq!(built, names(&root.join("dist")), "run `npm run build` in clients/typescript");
        for file in &built {
            assert_eq!(
                std::fs::read_to_string(fresh.join(file)).unwrap(),
                std::fs::read_to_string(root.join("dist").join(file)).unwrap(),
                "dist/{file} is not the build of src/: run `npm run build` in clients/typescript"
            );
        }
        let report = run_ok(
            &root,
            "node",
            &["--test", "test/"],
            &logins
                .iter()
                .map(|(name, url)| (*name, url.as_str()))
                .collect::<Vec<_>>(),
        );
        // Installed into a new project, it imports.
        let project = fresh.join("project");
        user_project(&project, &root);
        let imported = run_ok(
            &project,
            "node",
            &["--input-type=module", "-e", "const m = await import('permitq'); console.log(typeof m.Client, typeof m.withLease)"],
            &[],
        );
        assert_eq!(imported.trim(), "function function");
        // The package README's block runs as written (compiled by the package's tsc), as the
        // producer.
        std::fs::write(project.join("readme.ts"), readme_block("typescript", "ts")).unwrap();
        let tsc = root.join("node_modules/.bin/tsc");
        let types = root.join("node_modules/@types");
        run_ok(
            &project,
            tsc.to_str().unwrap(),
            &["--target", "ES2022", "--module", "NodeNext", "--moduleResolution", "NodeNext",
              "--lib", "ES2022,ESNext.Disposable", "--strict", "--skipLibCheck", "--types", "node",
              "--typeRoots", types.to_str().unwrap(), "readme.ts"],
            &[],
        );
        let ran = run_ok(&project, "node", &["readme.js"], &[("DATABASE_URL", &producer)]);
        assert!(ran.contains(README_RAN), "{ran}");
        // Through PgBouncer in transaction mode (one server connection), waiting by polling.
        let bouncer = PgBouncer::start(&superuser, "transaction", 1);
        let pooled = bouncer.url(&db_name);
        let through = run_ok(
            &project,
            "node",
            &["--input-type=module", "-e", THROUGH_A_POOLER_JS],
            &[("DATABASE_URL", &pooled)],
        );
        assert_eq!(through.trim(), "ok 3");
        let said = run_ok(
            &project,
            "node",
            &["--input-type=module", "-e", NO_WORKER_JS],
            &[("DATABASE_URL", &unserved_url)],
        );
        assert!(
            said.contains("AcquireTimeout") && !said.contains("a running worker does"),
            "{said}"
        );
        assert_eq!(
            said.matches("permitq: ts-nw waits, and nothing is granting: ").count(),
            1,
            "{said}"
        );
        let _ = std::fs::remove_dir_all(&fresh);
        report
    })
    .await
    .unwrap();
    assert!(
        report.contains("# fail 0") && report.contains("# skipped 0"),
        "{report}"
    );
}
