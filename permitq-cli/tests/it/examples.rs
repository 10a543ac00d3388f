//! The documentation runs: every block of the README, as written and in order, on a fresh
//! database (the `sh` and `sql` blocks here; the Rust block is compiled as a doctest of the
//! library), the Python example, and the command lines of `deploy/`.

use permitq_test_support as common;

use std::process::{Child, Command, Stdio};

use common::{quiet_config, TestDb};

/// (language, code) of every fenced block, in order.
fn blocks(readme: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        let Some(language) = line.strip_prefix("```") else {
            continue;
        };
        let code: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        blocks.push((language.to_string(), code.join("\n")));
    }
    blocks
}

/// SQL statements of a block, split at a `;` that ends a line (comments dropped), each with the
/// result its line documents after `-- => ` (columns joined by ` | `, rows by `; `; anything
/// after two spaces is prose).
fn statements(code: &str) -> Vec<(String, Option<String>)> {
    let mut out = Vec::new();
    let mut current = String::new();
    let mut expected = None;
    for line in code.lines() {
        if let Some((_, result)) = line.split_once("-- => ") {
            expected = Some(result.split("  ").next().unwrap_or("").trim().to_string());
        }
        let line = line.split("--").next().unwrap_or("").trim_end();
        if line.trim().is_empty() {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if line.ends_with(';') {
            out.push((std::mem::take(&mut current), expected.take()));
        }
    }
    assert!(
        current.trim().is_empty(),
        "unterminated statement: {current}"
    );
    out
}

/// The rows of a simple query as the README writes them: columns joined by ` | `, rows by `; `.
fn result_text(messages: &[tokio_postgres::SimpleQueryMessage]) -> String {
    let rows: Vec<String> = messages
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(row) => Some(
                (0..row.len())
                    .map(|i| row.get(i).unwrap_or("NULL"))
                    .collect::<Vec<_>>()
                    .join(" | "),
            ),
            _ => None,
        })
        .collect();
    rows.join("; ")
}

/// The login roles a block creates (`CREATE ROLE name ...`).
fn created_roles(code: &str) -> Vec<String> {
    code.lines()
        .filter_map(|l| l.trim().strip_prefix("CREATE ROLE "))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(String::from)
        .collect()
}

/// Background processes (a block's `command &`, a test's workers), stopped when dropped.
pub(crate) struct Background(pub(crate) Vec<Child>);

impl Drop for Background {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Every `sh`, `sql`, `python` and `ts` block of the README runs as written, top to bottom, on
/// one fresh database (the TypeScript one in a project of its own that installs the package):
/// the tutorial's `permitq worker &` is the worker the later blocks rely on, and the tutorial
/// waits for its grant with `--await`, so nothing here retries or sleeps. A YAML block
/// (the Patroni settings) must hold only settings the HA test bed runs with. Three lines
/// cannot run inside a test and are checked instead: `cargo run --release -- ARGS` runs the
/// binary under test with ARGS (the same code), `cargo install --locked --path DIR` must name the crate
/// of that binary, and `scripts/test` (the command running this test) must be executable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_readme_block_runs_as_written_top_to_bottom_on_a_fresh_database() {
    let readme = include_str!("../../../README.md");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let blocks = blocks(readme);
    for (language, _) in &blocks {
        assert!(
            ["sh", "sql", "rust,no_run", "yaml", "toml", "python", "ts"]
                .contains(&language.as_str()),
            "a README block the test cannot run: {language:?}"
        );
    }
    // A YAML block is Patroni configuration: every setting in it is one the HA tests run with.
    let tested = common::PatroniOptions::new(true).bootstrap();
    let tested: Vec<&str> = tested.lines().map(str::trim).collect();
    // (They are in docs/high-availability.md, which the README points to.)
    let ha = std::fs::read_to_string(root.join("docs/high-availability.md")).unwrap();
    let ha_blocks = self::blocks(&ha);
    assert!(
        ha_blocks.iter().any(|(language, _)| language == "yaml"),
        "docs/high-availability.md shows the Patroni settings"
    );
    for (_, block) in blocks
        .iter()
        .chain(&ha_blocks)
        .filter(|(language, _)| language == "yaml")
    {
        for line in block.lines() {
            let setting = line.split(" #").next().unwrap_or_default().trim();
            assert!(
                tested.contains(&setting),
                "README's Patroni setting {setting:?} is not what the tests run with: {tested:?}"
            );
        }
    }
    let db = TestDb::empty().await;
    let conn = common::connect(&db.url).await;
    let binary = std::path::Path::new(env!("CARGO_BIN_EXE_permitq"));
    // This build's `permitq` first, then the Python with psycopg (the virtualenv scripts/test
    // makes, else the system's) as `python3`.
    let python_dir = std::path::Path::new(python_with_psycopg())
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(|d| format!("{}:", d.display()))
        .unwrap_or_default();
    let path = format!(
        "{}:{python_dir}/usr/bin:{}",
        binary.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The tutorial's commands run in a directory of this run's own (its worker log lands there),
    // with the clone's examples/ beside them as in a clone.
    let work_dir = common::scratch_dir("readme");
    std::os::unix::fs::symlink(root.join("examples"), work_dir.join("examples")).unwrap();
    let examples = rust_examples(&root, binary);
    let shell = |command: &str| {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", command])
            .current_dir(&work_dir)
            .env("PATH", &path)
            .env("DATABASE_URL", &db.url)
            .env("RUST_LOG", "off")
            .stdin(Stdio::null());
        cmd
    };
    let mut background = Background(Vec::new());
    let (mut ran, mut compared) = (0, 0);
    for (language, code) in &blocks {
        match language.as_str() {
            "sql" => {
                // Roles belong to the whole cluster: a block that creates them runs in a
                // transaction that is rolled back after its effect is checked (and a role of
                // that name already there is dropped only inside it), so the server is left as
                // it was.
                let roles = created_roles(code);
                if !roles.is_empty() {
                    conn.batch_execute("BEGIN").await.unwrap();
                    for role in &roles {
                        conn.batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
                            .await
                            .unwrap_or_else(|e| panic!("{role} exists and cannot be dropped: {e}"));
                    }
                }
                for (statement, expected) in statements(code) {
                    let messages = conn
                        .simple_query(&statement)
                        .await
                        .unwrap_or_else(|e| panic!("README SQL failed: {statement}: {e:?}"));
                    if let Some(expected) = expected {
                        assert_eq!(result_text(&messages), expected, "README SQL: {statement}");
                        compared += 1;
                    }
                    ran += 1;
                }
                if !roles.is_empty() {
                    for role in &roles {
                        let member: bool = conn
                            .query_one(
                                "SELECT count(*) = 1 FROM pg_auth_members m \
                                 JOIN pg_roles r ON r.oid = m.member JOIN pg_roles g ON g.oid = m.roleid \
                                 WHERE r.rolname = $1 AND r.rolcanlogin AND g.rolname LIKE 'permitq\\_%'",
                                &[role],
                            )
                            .await
                            .unwrap()
                            .get(0);
                        assert!(member, "{role} logs in and is a member of one permitq role");
                    }
                    conn.batch_execute("ROLLBACK").await.unwrap();
                }
            }
            "sh" => {
                for line in code.lines() {
                    let command = line.split(" # ").next().unwrap_or("").trim();
                    if command.is_empty() || command.starts_with('#') {
                        continue;
                    }
                    ran += 1;
                    if let Some(dir) = command.strip_prefix("cargo install --locked --path ") {
                        let manifest =
                            std::fs::read_to_string(root.join(dir).join("Cargo.toml")).unwrap();
                        assert!(manifest.contains("name = \"permitq\""), "{command}");
                        continue;
                    }
                    if command == "scripts/test" {
                        use std::os::unix::fs::PermissionsExt;
                        let mode = std::fs::metadata(root.join(command)).unwrap().permissions();
                        assert!(mode.mode() & 0o111 != 0, "{command} is executable");
                        continue;
                    }
                    let command = match command.strip_prefix("cargo run --release -- ") {
                        Some(args) => format!("permitq {args}"),
                        None => command.to_string(),
                    }
                    .replace(
                        "cargo run --release -p permitq --example ",
                        &format!("{}/", examples.display()),
                    );
                    if let Some(command) = command.strip_suffix('&') {
                        let child = shell(&format!("exec {}", command.trim()))
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .spawn()
                            .unwrap();
                        background.0.push(child);
                        continue;
                    }
                    let mut cmd = shell(&command);
                    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
                        .await
                        .unwrap();
                    assert!(
                        out.status.success(),
                        "README command failed: {command}: {}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
            "python" => {
                let printed = crate::clients::python_code(
                    python_with_psycopg(),
                    code.clone(),
                    db.url.clone(),
                )
                .await;
                assert!(
                    printed.contains("python: fencing token"),
                    "the README's Python block: {printed}"
                );
                ran += 1;
            }
            "ts" => {
                // In a project of its own, with the package installed as the README says.
                let project = work_dir.join("ts-project");
                let package = root.join("clients/typescript").canonicalize().unwrap();
                let (url, code) = (db.url.clone(), code.clone());
                let printed = tokio::task::spawn_blocking(move || {
                    crate::clients::user_project(&project, &package);
                    std::fs::write(project.join("readme.mjs"), code).unwrap();
                    crate::clients::run_ok(
                        &project,
                        "node",
                        &["readme.mjs"],
                        &[("DATABASE_URL", &url)],
                    )
                })
                .await
                .unwrap();
                assert!(
                    printed.contains("typescript: fencing token"),
                    "the README's TypeScript block: {printed}"
                );
                ran += 1;
            }
            "rust,no_run" => {
                let dependencies = blocks
                    .iter()
                    .find(|(language, _)| language == "toml")
                    .map(|(_, toml)| toml.as_str())
                    .expect("the README lists the Rust example's dependencies");
                let out =
                    build_and_run_rust_example(&root, &work_dir, dependencies, code, &db.url).await;
                assert!(
                    out.status.success(),
                    "the README's Rust example failed: {}{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
                assert!(
                    String::from_utf8_lossy(&out.stdout).contains("training with fencing token"),
                    "{}",
                    String::from_utf8_lossy(&out.stdout)
                );
                ran += 1;
            }
            _ => {}
        }
    }
    eprintln!("README: {ran} statements and commands ran, {compared} results compared");
    assert!(compared >= 10, "the README's SQL documents its results");
    assert!(!background.0.is_empty(), "the tutorial starts a worker");
    drop(background);
    common::check_invariants(&conn).await.unwrap();
}

/// Where the library's example binaries are (`cargo test` builds them; built here if missing).
fn rust_examples(root: &std::path::Path, binary: &std::path::Path) -> std::path::PathBuf {
    let dir = binary.parent().unwrap().join("examples");
    if !["producer", "fencing", "worker"]
        .iter()
        .all(|name| dir.join(name).exists())
    {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let built = Command::new(cargo)
            .args(["build", "--workspace", "--examples", "--quiet"])
            .current_dir(root)
            .stdin(Stdio::null())
            .status()
            .unwrap();
        assert!(built.success(), "cargo build --examples");
    }
    dir
}

/// The README's Rust example as a user would make it: a new cargo project in `dir`, its
/// `[dependencies]` from the README (the path to the library made absolute), `src/main.rs` the
/// README's code; built offline with this workspace's lock file (the versions this build tested)
/// and its profile, in a target directory kept between runs, then run with `url`.
async fn build_and_run_rust_example(
    root: &std::path::Path,
    dir: &std::path::Path,
    dependencies: &str,
    code: &str,
    url: &str,
) -> std::process::Output {
    let project = dir.join("trainer");
    std::fs::create_dir_all(project.join("src")).unwrap();
    let library = root.join("permitq").canonicalize().unwrap();
    let dependencies = dependencies.replace(
        "path = \"CLONE/permitq\"",
        &format!("path = {:?}", library.display().to_string()),
    );
    assert!(
        dependencies.contains(&library.display().to_string()),
        "{dependencies}"
    );
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).unwrap();
    let profiles = &workspace[workspace
        .find("[profile.")
        .expect("the workspace's profiles")..];
    std::fs::write(
        project.join("Cargo.toml"),
        format!(
            "[package]\nname = \"trainer\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n\
             {dependencies}\n\n[workspace]\n\n{profiles}"
        ),
    )
    .unwrap();
    std::fs::copy(root.join("Cargo.lock"), project.join("Cargo.lock")).unwrap();
    std::fs::write(project.join("src/main.rs"), code).unwrap();
    let target = root.join("target").join("readme-example");
    let (project, url) = (project.clone(), url.to_string());
    tokio::task::spawn_blocking(move || {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        let build = Command::new(&cargo)
            .args(["build", "--offline", "--quiet"])
            .current_dir(&project)
            .env("CARGO_TARGET_DIR", &target)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            build.status.success(),
            "the README's Rust example does not build in a new project: {}",
            String::from_utf8_lossy(&build.stderr)
        );
        Command::new(target.join("debug").join("trainer"))
            .env("DATABASE_URL", &url)
            .stdin(Stdio::null())
            .output()
            .unwrap()
    })
    .await
    .unwrap()
}

/// The Python that has psycopg: `$PERMITQ_PYTHON` (the virtualenv scripts/test makes, with the
/// client package and pytest installed), else one with psycopg of its own (`/usr/bin/python3`
/// with Debian's python3-psycopg, or the first on PATH), for `cargo test` run directly.
/// Looked for once per test process.
pub(crate) fn python_with_psycopg() -> &'static str {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON.get_or_init(|| {
        std::env::var("PERMITQ_PYTHON")
            .ok()
            .filter(|p| !p.is_empty())
            .into_iter()
            .chain(["/usr/bin/python3".to_string(), "python3".to_string()])
            .find(|p| {
                Command::new(p)
                    .args(["-c", "import psycopg"])
                    .output()
                    .is_ok_and(|o| o.status.success())
            })
            .expect(
                "a Python with psycopg: run the tests with scripts/test (it makes a virtualenv)",
            )
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_example_submits_waits_heartbeats_and_releases() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("python"));
    let python = python_with_psycopg();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/python/permitq_example.py");
    let run = |setup: &str| {
        let (url, script, setup) = (db.url.clone(), script.clone(), setup.to_string());
        tokio::task::spawn_blocking(move || {
            Command::new(python)
                .arg(script)
                .env("DATABASE_URL", url)
                .env("PERMITQ_EXAMPLE_SETUP", setup)
                .output()
                .unwrap()
        })
    };
    // Without its semaphores: exit 1, one line saying how to make them.
    let out = run("0").await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains("permitq semaphore set gpu"), "{stderr}");
    // It runs twice: each run submits a request of its own.
    assert!(run("1").await.unwrap().status.success());
    let out = run("1").await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("acquired with fencing token"), "{stdout}");
    assert!(stdout.contains("release: released"), "{stdout}");
    let client = db.client().await;
    let id = stdout
        .lines()
        .find_map(|l| l.strip_prefix("acquiring as "))
        .and_then(|rest| rest.split(':').next())
        .unwrap()
        .to_string();
    let row = client.status(&id).await.unwrap().unwrap();
    assert_eq!(row.state, permitq::State::Released);
    worker.stop().await;
}

/// Every command line in `deploy/` (Kubernetes `args`, the Dockerfile's CMD, the systemd unit's
/// ExecStart) is one the CLI accepts: it gets past argument parsing and stops at the database
/// URL given here on purpose (exit code 2, naming the URL; a usage error would print clap's
/// usage instead).
#[test]
fn the_deploy_files_invoke_commands_the_cli_accepts() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut invocations: Vec<Vec<String>> = Vec::new();
    for entry in std::fs::read_dir(root.join("k8s")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines() {
            if let Some(args) = line.trim().strip_prefix("args: ") {
                let args: Vec<String> = serde_json::from_str(args).expect("args as a JSON array");
                invocations.push(args);
            }
        }
    }
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let cmd = dockerfile
        .lines()
        .find_map(|l| l.strip_prefix("CMD "))
        .expect("a CMD");
    invocations.push(serde_json::from_str(cmd).unwrap());
    let unit = std::fs::read_to_string(root.join("systemd/permitq-worker.service")).unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("an ExecStart");
    invocations.push(exec.split_whitespace().skip(1).map(String::from).collect());
    assert!(invocations.len() >= 5, "{invocations:?}");
    for args in &invocations {
        let args: Vec<String> = args
            .iter()
            .map(|a| a.replace("$(POD_NAME)", "pod-0"))
            .collect();
        let out = Command::new(env!("CARGO_BIN_EXE_permitq"))
            .args(&args)
            .env("DATABASE_URL", "not a url ::")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("Usage:"), "{args:?}: {stderr}");
        assert!(
            stderr.contains("invalid database URL"),
            "{args:?}: {stderr}"
        );
    }
}

/// deploy/ agrees with the README: the Secret's logins are the ones the README's Permissions
/// block creates (plus the owner that migrates), `serve` runs as the operator login, every image
/// has a pull policy and the version of this build, and the build context leaves out `target/`.
#[test]
fn the_deploy_files_use_the_readmes_logins_a_pinned_image_and_a_dockerignore() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let secret = std::fs::read_to_string(root.join("deploy/k8s/secret.example.yaml")).unwrap();
    let logins: Vec<&str> = secret
        .lines()
        .filter_map(|l| l.split("postgres://").nth(1))
        .filter_map(|rest| rest.split(':').next())
        .collect();
    assert_eq!(logins.len(), 5, "{secret}");
    for login in logins {
        assert!(
            login == "permitq_owner" || readme.contains(&format!("CREATE ROLE {login} LOGIN")),
            "{login} is not created in the README"
        );
    }
    assert!(
        readme.contains("`permitq_owner`"),
        "the README names the owner login"
    );
    let serve = std::fs::read_to_string(root.join("deploy/k8s/serve.yaml")).unwrap();
    assert!(serve.contains("key: operator-url"), "{serve}");
    assert!(
        serve.contains("\"--http-token-file\"") && secret.contains("http-token: "),
        "serve listens beyond loopback with a token: {serve}"
    );
    for entry in std::fs::read_dir(root.join("deploy/k8s")).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        let images = text.matches("image: ").count();
        assert_eq!(
            images,
            text.matches("imagePullPolicy: IfNotPresent").count()
        );
        assert_eq!(
            images,
            text.matches(&format!("image: permitq:{}", env!("CARGO_PKG_VERSION")))
                .count()
        );
    }
    let ignore = std::fs::read_to_string(root.join(".dockerignore")).unwrap();
    assert!(ignore.lines().any(|l| l.trim() == "target/"), "{ignore}");
}
