//! The documentation runs: the README's blocks marked `<!-- readme-test: run -->` (SQL and
//! shell), top to bottom on a fresh database with a worker, and the Python example. (The
//! README's Rust example is compiled as a doctest of the library.)

use permitq_test_support as common;

use std::process::Command;

use common::{quiet_config, TestDb};

const MARK: &str = "<!-- readme-test: run -->";

/// (language, code) of every marked block, in order.
fn marked_blocks(readme: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if line.trim() != MARK {
            continue;
        }
        let fence = lines.next().expect("a block after the mark");
        let language = fence.trim_start_matches("```").to_string();
        assert!(
            fence.starts_with("```"),
            "the mark is followed by a fenced block"
        );
        let code: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        blocks.push((language, code.join("\n")));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_blocks_run_top_to_bottom_on_a_fresh_database() {
    let readme = include_str!("../../../README.md");
    let blocks = marked_blocks(readme);
    assert!(blocks.iter().any(|b| b.0 == "sql") && blocks.iter().any(|b| b.0 == "sh"));
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("readme"));
    let conn = db.conn().await;
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_permitq"))
        .parent()
        .unwrap()
        .to_path_buf();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let (mut ran, mut compared) = (0, 0);
    for (language, code) in &blocks {
        match language.as_str() {
            "sql" => {
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
            }
            "sh" => {
                for line in code.lines() {
                    let command = line.split(" # ").next().unwrap_or("").trim();
                    if command.is_empty() || command.starts_with('#') {
                        continue;
                    }
                    let (command_line, path, url) =
                        (command.to_string(), path.clone(), db.url.clone());
                    let out = tokio::task::spawn_blocking(move || {
                        Command::new("sh")
                            .args(["-c", &command_line])
                            .env("PATH", path)
                            .env("DATABASE_URL", url)
                            .env("RUST_LOG", "off")
                            .output()
                            .unwrap()
                    })
                    .await
                    .unwrap();
                    assert!(
                        out.status.success(),
                        "README command failed: {command}: {}{}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                    ran += 1;
                }
            }
            other => panic!("a marked block must be sql or sh, not {other:?}"),
        }
    }
    eprintln!("README: {ran} statements and commands ran, {compared} results compared");
    assert!(compared >= 10, "the README's SQL documents its results");
    worker.stop().await;
    common::check_invariants(&conn).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_example_submits_waits_heartbeats_and_releases() {
    let db = TestDb::new().await;
    let worker = db.worker(quiet_config("python"));
    let python = ["/usr/bin/python3", "python3"]
        .into_iter()
        .find(|p| {
            Command::new(p)
                .args(["-c", "import psycopg"])
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .expect("python3 with psycopg (Debian's python3-psycopg, installed by .ci/run)");
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/python/permitq_example.py");
    let url = db.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .env("DATABASE_URL", url)
            .env("PERMITQ_EXAMPLE_SETUP", "1")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
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
        .find_map(|l| l.strip_prefix("submitted "))
        .unwrap()
        .to_string();
    let row = client.status(&id).await.unwrap().unwrap();
    assert_eq!(row.state, permitq::State::Released);
    worker.stop().await;
}

/// Every command line in `deploy/` (Kubernetes `args`, the Dockerfile's CMD, the systemd unit's
/// ExecStart) is one the CLI accepts: it gets past argument parsing (exit code 2 is a usage
/// error) and stops at the database URL given here on purpose.
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
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains("invalid database URL"),
            "{args:?}: {stderr}"
        );
    }
}
