//! What operators use, for real: `permitq top` in tmux, the HTTP endpoints, and the status page
//! in headless Chromium (driven through chromedriver's WebDriver API).

use permitq_test_support as common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{quiet_config, wait_until, TestDb};
use permitq::{Client, Request, State};

use crate::cli::{code, run, stderr, stdout};
use crate::http::{get, get_async, get_with, request, spawn_server};

const SOON: Duration = Duration::from_secs(15);

/// Where the tests leave screenshots (kept as CI artifacts, copied into the README's docs).
fn screenshots() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Two semaphores, two holders and two waiters on `gpu`, five holders on `db`.
async fn populated(db: &TestDb) -> (Client, common::RunningWorker) {
    let client = db.client().await;
    client.set_capacity("gpu", 2, None).await.unwrap();
    client.set_capacity("db", 16, None).await.unwrap();
    let worker = db.worker(quiet_config("ops"));
    for i in 1..=4 {
        client
            .submit(
                &Request::new(format!("train-{i}"))
                    .permit("gpu", 1)
                    .owner(format!("node-{i}")),
            )
            .await
            .unwrap();
    }
    for i in 1..=5 {
        client
            .submit(&Request::new(format!("query-{i}")).permit("db", 3))
            .await
            .unwrap();
    }
    for id in ["train-1", "train-2", "query-5"] {
        assert_eq!(common::settled_state(&client, id).await, State::Acquired);
    }
    wait_until(SOON, "train-3 and train-4 examined", || async {
        client.waiters("gpu", 10).await.unwrap().len() == 2
    })
    .await;
    (client, worker)
}

/// Kills its tmux session when dropped (an ended session is no error).
struct TmuxSession(String);

impl Drop for TmuxSession {
    fn drop(&mut self) {
        let _ = tmux(&["kill-session", "-t", &self.0]);
    }
}

fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux").args(args).output().expect("tmux");
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_semaphores_holders_and_waiters_in_80x24_and_quits_on_q() {
    let db = TestDb::new().await;
    let (client, worker) = populated(&db).await;
    client.set_capacity("lab-*", 2, None).await.unwrap();
    // Served by fairness key: the detail names the keys that wait (train-3 and -4 have none)
    // and each one's share of the turns to come (team-a's weight 3 to the others' 1).
    client
        .set_semaphore(
            "gpu",
            2,
            &permitq::SemaphoreSettings::new().fairness_keys(true),
        )
        .await
        .unwrap();
    client
        .submit(
            &Request::new("train-5")
                .permit("gpu", 1)
                .fairness_key("team-a")
                .fairness_weight(3),
        )
        .await
        .unwrap();
    wait_until(SOON, "train-5 examined", || async {
        client.waiters("gpu", 10).await.unwrap().len() == 3
    })
    .await;
    // A rate limit: one grant in its window, released, holds nothing; its bar is the window's.
    client
        .set_semaphore(
            "quota",
            4,
            &permitq::SemaphoreSettings::new().per(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    let lease = client
        .acquire(&Request::new("quota-1").permit("quota", 1), SOON)
        .await
        .unwrap();
    lease.release().await.unwrap();
    // A kind longer than its column at 80 columns: cut, ending in `..`.
    client.set_capacity("shared-pool", 8, None).await.unwrap();
    client
        .set_semaphore(
            "t-*",
            2,
            &permitq::SemaphoreSettings::new()
                .parent("shared-pool")
                .per(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    // An adaptive semaphore says so in its kind.
    client.set_capacity("llm", 3, None).await.unwrap();
    client
        .set_adaptive(
            "llm",
            Some(&permitq::AdaptiveLimit::new(
                permitq::Algorithm::Aimd,
                1,
                10,
            )),
        )
        .await
        .unwrap();
    let session = format!("permitq-top-{}", std::process::id());
    let _ = tmux(&["kill-session", "-t", &session]);
    // A failed assertion below leaves no `top` running in a detached session.
    let _session_ends = TmuxSession(session.clone());
    let command = format!(
        "DATABASE_URL='{}' {} top --interval 200ms",
        db.url,
        env!("CARGO_BIN_EXE_permitq")
    );
    tmux(&[
        "new-session",
        "-d",
        "-s",
        &session,
        "-x",
        "80",
        "-y",
        "24",
        &command,
    ]);
    let capture = || tmux(&["capture-pane", "-p", "-t", &session]);
    wait_until(
        SOON,
        "top lists the semaphores, the template as one",
        || async {
            let screen = capture();
            screen.contains("gpu")
                && screen.contains("2/2")
                && screen.contains("15/16")
                && screen
                    .lines()
                    .any(|l| l.contains("lab-*") && l.contains("template"))
                && screen.lines().any(|l| {
                    l.contains("quota") && l.contains("[==......]") && l.contains("per 1h")
                })
                && screen.lines().any(|l| {
                    l.contains("t-*")
                        && l.contains("template; in shared-pool")
                        && l.trim_end().ends_with("..")
                })
                && screen
                    .lines()
                    .any(|l| l.contains("llm") && l.contains("adaptive aimd"))
        },
    )
    .await;
    // `db` is first (by name); select `gpu` and open its holders and waiters.
    tmux(&["send-keys", "-t", &session, "Down", "Enter"]);
    wait_until(SOON, "gpu's holders and waiters", || async {
        let screen = capture();
        [
            "gpu: served by fairness key; turns by key: ",
            "(no key) 2×w1 25%",
            "team-a 1×w3 75%",
            "holders (2)",
            "waiters (3)",
            "train-1",
            "train-2",
            "train-3",
            "train-4",
        ]
        .iter()
        .all(|s| screen.contains(s))
    })
    .await;
    let screen = capture();
    assert!(screen.lines().all(|l| l.chars().count() <= 80), "{screen}");
    assert!(
        screen.contains("enter or esc: back"),
        "the way back is shown: {screen}"
    );
    // Every column's header is whole at 80 columns, and the workers line names the worker.
    let header = screen
        .lines()
        .find(|l| l.contains("semaphore") && l.contains("use/cap"))
        .unwrap_or_else(|| panic!("{screen}"));
    for column in [
        "semaphore",
        "use",
        "use/cap",
        "wait",
        "oldest",
        "grant/s",
        "kind",
    ] {
        assert!(
            header.split_whitespace().any(|w| w == column),
            "{column}: {header}"
        );
    }
    assert!(screen.contains("workers (1): "), "{screen}");
    std::fs::write(screenshots().join("top.txt"), &screen).unwrap();
    // With the worker gone, that nothing is granting, and what to do, is there whole (wrapped
    // at 80 columns), the detail still open below it.
    worker.stop().await;
    wait_until(SOON, "top says nothing is granting, whole", || async {
        let screen = capture();
        let said: String = screen.lines().map(str::trim).collect::<Vec<_>>().join(" ");
        said.contains("nothing is granting: ")
            && said.contains("requests wait until a worker runs)")
            && said.contains("holders (2)")
    })
    .await;
    let screen = capture();
    assert!(screen.lines().all(|l| l.chars().count() <= 80), "{screen}");
    // The adaptive one's detail: its kind, and its capacities over time.
    tmux(&[
        "send-keys",
        "-t",
        &session,
        "Enter",
        "Down",
        "Down",
        "Enter",
    ]);
    wait_until(SOON, "llm's capacities over time", || async {
        capture().contains("llm: adaptive (aimd, 1 to 10); capacity 3")
    })
    .await;
    tmux(&["send-keys", "-t", &session, "q"]);
    wait_until(SOON, "top quit on q", || async {
        !Command::new("tmux")
            .args(["has-session", "-t", &session])
            .status()
            .unwrap()
            .success()
    })
    .await;
}

/// Checks Prometheus text format line by line: comments, or `name{labels} value` with a float
/// value; every family has a `# HELP` line; every histogram has buckets, a `+Inf` bucket, `_sum`
/// and `_count`.
fn check_prometheus_text(text: &str) {
    let mut histograms = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            let (name, kind) = (parts.next().unwrap(), parts.next().unwrap());
            assert!(
                text.lines()
                    .any(|l| l.starts_with(&format!("# HELP {name} ")) && l.len() > name.len() + 12),
                "{name} has no # HELP line"
            );
            assert!(
                ["counter", "gauge", "histogram"].contains(&kind),
                "{line}: no summaries"
            );
            if kind == "histogram" {
                histograms.push(name.to_string());
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect(line);
        assert!(value.parse::<f64>().is_ok(), "{line}");
        let name = series.split('{').next().unwrap();
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{line}"
            );
        }
    }
    for h in histograms {
        assert!(text.contains(&format!("{h}_bucket{{le=\"+Inf\"}}")), "{h}");
        assert!(
            text.contains(&format!("{h}_sum")) && text.contains(&format!("{h}_count")),
            "{h}"
        );
    }
}

/// A worker whose passes fail (here: a function it calls is gone) is not ready, and says why;
/// ready again once its passes complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_passes_fail_is_not_ready() {
    let db = TestDb::new().await;
    db.client().await.migrate().await.unwrap();
    let url = db.url.clone();
    let (_child, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(
            &url,
            &[
                "worker",
                "--id",
                "failing",
                "--poll-interval",
                "100ms",
                "--http-addr",
                "127.0.0.1:0",
            ],
        )
    })
    .await
    .unwrap();
    wait_until(SOON, "ready", || async {
        get_async(addr, "/readyz").await.0 == 200
    })
    .await;
    let conn = db.conn().await;
    let rename = |from: &str, to: &str| {
        format!("ALTER FUNCTION permitq.{from}(bigint, bigint, boolean) RENAME TO {to}")
    };
    conn.batch_execute(&rename("next_batch", "next_batch_gone"))
        .await
        .unwrap();
    wait_until(Duration::from_secs(30), "not ready, and why", || async {
        let (status, body) = get_async(addr, "/readyz").await;
        status == 503
            && body.contains("no pass of this worker has completed for ")
            && body.contains("its log says why")
    })
    .await;
    conn.batch_execute(&rename("next_batch_gone", "next_batch"))
        .await
        .unwrap();
    wait_until(SOON, "ready again", || async {
        get_async(addr, "/readyz").await.0 == 200
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_http_serves_health_readiness_metrics_and_the_json_api() {
    let db = TestDb::new().await;
    let (client, worker) = populated(&db).await;
    let url = db.url.clone();
    let (child, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(
            &url,
            &["worker", "--id", "http", "--http-addr", "127.0.0.1:0"],
        )
    })
    .await
    .unwrap();
    let get = |path: &'static str| get_async(addr, path);
    assert_eq!(get("/healthz").await.0, 200);
    wait_until(SOON, "ready (listener connected)", || async {
        get("/readyz").await.0 == 200
    })
    .await;
    // A grant through this worker, so that its histograms have samples.
    client.set_capacity("http", 1, None).await.unwrap();
    worker.stop().await;
    client
        .submit(&Request::new("via-http-worker").permit("http", 1))
        .await
        .unwrap();
    assert_eq!(
        common::settled_state(&client, "via-http-worker").await,
        State::Acquired
    );
    let expected = [
        "permitq_semaphore_capacity{semaphore=\"gpu\"} 2",
        "permitq_semaphore_held{semaphore=\"gpu\"} 2",
        "permitq_semaphore_waiting{semaphore=\"gpu\"} 2",
        "permitq_semaphore_oldest_wait_seconds{semaphore=\"gpu\"}",
        "permitq_worker_listener_connected 1",
        "permitq_worker_last_pass_age_seconds",
        "permitq_grant_wait_seconds_bucket",
        "permitq_batch_seconds_bucket",
    ];
    // Scraped until every series is there (each scrape reads the database afresh).
    let deadline = Instant::now() + SOON;
    loop {
        let (status, metrics) = get("/metrics").await;
        assert_eq!(status, 200);
        check_prometheus_text(&metrics);
        let missing: Vec<&str> = expected
            .iter()
            .copied()
            .filter(|series| !metrics.contains(series))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "missing {missing:?} in:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A semaphore that goes (an idle template instance, removed by the sweep) leaves no
    // series behind: they are written from the database (at most once a second), not kept.
    client.set_capacity("tmp:gone", 1, None).await.unwrap();
    wait_until(SOON, "tmp:gone's series", || async {
        get("/metrics")
            .await
            .1
            .contains("permitq_semaphore_capacity{semaphore=\"tmp:gone\"} 1")
    })
    .await;
    db.conn()
        .await
        .batch_execute("DELETE FROM permitq.semaphore WHERE name = 'tmp:gone'")
        .await
        .unwrap();
    wait_until(SOON, "no series of tmp:gone", || async {
        !get("/metrics").await.1.contains("tmp:gone")
    })
    .await;
    let (status, body) = get("/api/semaphores").await;
    assert_eq!(status, 200);
    let list: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 3, "{body}");
    let (status, body) = get("/api/semaphores/gpu").await;
    assert_eq!(status, 200);
    let gpu: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(gpu["usage"]["held"], 2);
    assert_eq!(gpu["holders"].as_array().unwrap().len(), 2);
    assert_eq!(gpu["waiters"][0]["external_id"], "train-3");
    assert_eq!(gpu["waiters"][0]["position"], 1);
    assert_eq!(get("/api/semaphores/nope").await.0, 404);
    // A typo is answered with the nearest names, as the CLI does.
    let (status, body) = get("/api/semaphores/gpuu").await;
    assert_eq!(status, 404);
    assert!(
        body.contains(r#"no semaphore named \"gpuu\"; did you mean gpu?"#),
        "{body}"
    );
    drop(child);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_says_that_it_stopped_on_sigterm() {
    let db = TestDb::new().await;
    let url = db.url.clone();
    let (mut serve, _) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    common::signal(serve.id(), "TERM");
    let deadline = Instant::now() + SOON;
    let status = loop {
        if let Some(status) = serve.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "serve did not stop within 15 s of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status.code(), Some(0), "{status:?}");
    wait_until(SOON, "serve's last line", || {
        let said = serve.stderr_after_serving();
        async move { said.contains("permitq: stopped serving http://127.0.0.1:") }
    })
    .await;
}

/// `serve` runs without workers: while none runs, `/readyz` (still ready: the page serves) and
/// the page's first row say that nothing is granting; once one runs, the row lists it with its
/// host, version and when it was last seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_says_on_readyz_and_the_page_when_nothing_is_granting() {
    let db = TestDb::new().await;
    db.client().await.migrate().await.unwrap();
    let url = db.url.clone();
    let (_serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    let (status, body) = get_async(addr, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("ready; nothing is granting: no worker seen")
            && body.contains("start one with `permitq worker`"),
        "{body}"
    );
    let (_, rows) = get_async(addr, "/rows").await;
    assert!(
        rows.contains(
            "<tr class=\"workers none\"><td colspan=\"7\">nothing is granting: no worker seen"
        ),
        "{rows}"
    );
    let worker = db.worker(quiet_config("page-worker"));
    wait_until(SOON, "/readyz and the page see the worker", || async {
        let (_, body) = get_async(addr, "/readyz").await;
        let (_, rows) = get_async(addr, "/rows").await;
        body == "ready\n"
            && rows.contains(&format!(
                "<tr class=\"workers\"><td colspan=\"7\">workers (1): page-worker on {} ({}, seen ",
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .unwrap()
                    .trim(),
                env!("CARGO_PKG_VERSION")
            ))
            && rows.contains(" ago)</td></tr>")
    })
    .await;
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_is_not_ready_without_the_schema_and_a_worker_waits_for_it() {
    let db = TestDb::new().await;
    db.conn()
        .await
        .batch_execute("DROP SCHEMA permitq CASCADE")
        .await
        .unwrap();
    let url = db.url.clone();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "localhost:0"])
    })
    .await
    .unwrap();
    let (status, body) = get_async(addr, "/readyz").await;
    assert_eq!(status, 503);
    // Where it looked: a URL naming another database reads as an unmigrated one.
    assert!(
        body.contains(&format!(
            "the permitq schema in database {} at 127.0.0.1:",
            db.name
        )) && body.contains(
            "is missing or not at this build's version: run `permitq migrate` with this \
             server's database URL (if permitq was migrated into another database, fix the URL \
             instead)"
        ),
        "{body}"
    );
    // It says so when it starts, too: not only "serving".
    let mut again = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["serve", "--http-addr", "localhost:0"])
        .env("DATABASE_URL", &db.url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = again.stderr.take().unwrap();
    let said = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("cannot read the database now"))
    });
    let said = tokio::time::timeout(SOON, said).await;
    let _ = again.kill();
    let _ = again.wait();
    let said = said.expect("serve said it within SOON").unwrap();
    assert!(
        said.as_deref().is_some_and(|l| l
            .contains("serving anyway: the page, the API and /readyz say so")
            && l.contains("run `permitq migrate`")
            && !l.contains("Client::migrate")),
        "{said:?}"
    );
    // A worker started now waits (it does not exit, it says why) and starts once the schema
    // is there.
    let mut worker = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["worker", "--id", "early"])
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "permitq=info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = worker.stderr.take().unwrap();
    let said = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        let mut lines = std::io::BufReader::new(stderr).lines();
        let said = lines
            .by_ref()
            .map_while(Result::ok)
            .find(|l| l.contains("run `permitq migrate`"));
        std::thread::spawn(move || lines.for_each(drop));
        said
    });
    let said = tokio::time::timeout(SOON, said)
        .await
        .expect("the worker says it waits for the schema")
        .unwrap();
    assert!(said.is_some(), "the worker exited instead of waiting");
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker is still running"
    );
    let client = db.client().await;
    client.migrate().await.unwrap();
    client.set_capacity("late", 1, None).await.unwrap();
    client
        .submit(&Request::new("after-migrate").permit("late", 1))
        .await
        .unwrap();
    assert_eq!(
        common::settled_state(&client, "after-migrate").await,
        State::Acquired
    );
    // Ready within a second or so (/readyz answers from a result at most a second old).
    wait_until(SOON, "serve ready once migrated", || async {
        get_async(addr, "/readyz").await.0 == 200
    })
    .await;
    drop(serve);
    let _ = worker.kill();
    let _ = worker.wait();
}

/// A WebDriver session on chromedriver, headless Chromium with the flags this machine needs.
struct Browser {
    driver: std::process::Child,
    addr: std::net::SocketAddr,
    session: String,
}

impl Browser {
    fn start() -> Browser {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("chromedriver (Debian's chromium-driver, installed by .ci/run)");
        let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + SOON;
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        let profile = std::env::temp_dir().join(format!("permitq-chromium-{port}"));
        let capabilities = serde_json::json!({"capabilities": {"alwaysMatch": {
        "goog:chromeOptions": {
            "binary": "/usr/bin/chromium",
            "args": ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                     "--no-first-run", "--disable-background-networking",
                     "--disable-component-update", "--disable-sync",
                     "--window-size=1280,1024",
                     format!("--user-data-dir={}", profile.display())]
        }}}});
        let (status, body) = request(addr, "POST", "/session", Some(&capabilities.to_string()));
        assert_eq!(status, 200, "{body}");
        let reply: serde_json::Value = serde_json::from_str(&body).unwrap();
        let session = reply["value"]["sessionId"].as_str().unwrap().to_string();
        Browser {
            driver,
            addr,
            session,
        }
    }

    fn command(&self, method: &str, path: &str, body: serde_json::Value) -> serde_json::Value {
        let body = body.to_string();
        let (status, reply) = request(
            self.addr,
            method,
            &format!("/session/{}{path}", self.session),
            (method != "GET").then_some(body.as_str()),
        );
        assert_eq!(status, 200, "{path}: {reply}");
        serde_json::from_str::<serde_json::Value>(&reply).unwrap()["value"].take()
    }

    fn open(&self, url: &str) {
        self.command("POST", "/url", serde_json::json!({ "url": url }));
    }

    /// Runs `script` (a function body) in the page and returns its result.
    fn eval(&self, script: &str) -> serde_json::Value {
        self.command(
            "POST",
            "/execute/sync",
            serde_json::json!({ "script": script, "args": [] }),
        )
    }

    /// Sets the window's size, in CSS pixels.
    fn resize(&self, width: u32, height: u32) {
        self.command(
            "POST",
            "/window/rect",
            serde_json::json!({ "width": width, "height": height }),
        );
    }

    fn screenshot(&self) -> Vec<u8> {
        let png = self.command("GET", "/screenshot", serde_json::Value::Null);
        decode_base64(png.as_str().unwrap())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = request(
            self.addr,
            "DELETE",
            &format!("/session/{}", self.session),
            None,
        );
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn decode_base64(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let digits: Vec<u8> = s
        .bytes()
        .filter(|c| *c != b'=' && !c.is_ascii_whitespace())
        .map(value)
        .collect();
    digits
        .chunks(4)
        .flat_map(|c| {
            let n = c
                .iter()
                .enumerate()
                .fold(0u32, |n, (i, d)| n | u32::from(*d) << (18 - 6 * i));
            let bytes = n.to_be_bytes();
            bytes[1..c.len()].to_vec()
        })
        .collect()
}

/// The status page, in headless Chromium, with 50 semaphores: the first paint comes from the
/// server (the HTML holds every row before any script runs), all 50 fit on one 1280×1024 screen,
/// a refresh is one request for all of them, the search box filters, a selected semaphore shows
/// its holders and its waiters in line order with priorities, times are relative, and the page
/// follows a capacity change on its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_50_semaphores_on_one_screen_and_follows_a_capacity_change() {
    let db = TestDb::new().await;
    let (client, worker) = populated(&db).await;
    client
        .set_rate_limit("api", 2, Duration::from_secs(60), None)
        .await
        .unwrap();
    client.set_capacity("tenant:*", 3, None).await.unwrap();
    for i in 0..44 {
        client
            .set_capacity(&format!("pool-{i:02}"), 10, None)
            .await
            .unwrap();
    }
    // Producers name instances (through templates), so names are escaped on the page.
    client
        .set_capacity("<b>\"pool\"&'44'</b>", 10, None)
        .await
        .unwrap();
    client
        .submit(&Request::new("t-acme").permit("tenant:acme", 1))
        .await
        .unwrap();
    assert_eq!(
        common::settled_state(&client, "t-acme").await,
        State::Acquired
    );
    assert_eq!(client.usage().await.unwrap().len(), 50);
    let url = db.url.clone();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    // The first paint is the server's: every row is in the HTML itself.
    let (status, html) = get_async(addr, "/").await;
    assert_eq!(status, 200);
    assert_eq!(html.matches("<tr class=\"sem\"").count(), 50, "{html}");
    assert!(html.contains("data-name=\"tenant:acme\"") && html.contains("from tenant:*"));
    assert!(
        html.contains("0 / 2 granted per 1m"),
        "the rate window is shown"
    );
    // What a bar is, said: on the page and on each bar.
    assert!(
        html.contains("<p class=\"legend\">use: permits held of the capacity")
            && html.contains("title=\"0 of 2 granted in its rate window\"")
            && html.contains("title=\"1 of 3 held\""),
        "{html}"
    );
    assert!(
        html.contains("&lt;b&gt;&quot;pool&quot;&amp;&#39;44&#39;&lt;/b&gt;")
            && !html.contains("<b>\"pool"),
        "names are escaped"
    );

    let browser = tokio::task::spawn_blocking(Browser::start).await.unwrap();
    let browser = std::sync::Arc::new(browser);
    let page = format!("http://{addr}/");
    {
        let b = browser.clone();
        tokio::task::spawn_blocking(move || b.open(&page))
            .await
            .unwrap();
    }
    let eval = |script: &'static str| {
        let b = browser.clone();
        async move {
            tokio::task::spawn_blocking(move || b.eval(script))
                .await
                .unwrap()
        }
    };
    // All 50 rows on one screen, and refreshed by the script.
    wait_until(SOON, "the script refreshed the rows", || async {
        eval("return document.body.dataset.updated || ''")
            .await
            .as_str()
            != Some("")
    })
    .await;
    let on_screen = eval(
        "return [...document.querySelectorAll('tr.sem')].filter(r => { \
           const b = r.getBoundingClientRect(); \
           return !r.hidden && b.height > 0 && b.top >= 0 && b.bottom <= window.innerHeight; \
         }).length",
    )
    .await;
    assert_eq!(on_screen, 50, "every semaphore fits on one screen");
    // One request per refresh while no semaphore is selected: every request the page made is
    // for the rows, about one a second.
    wait_until(SOON, "three more refreshes", || async {
        eval("return performance.getEntriesByType('resource').length")
            .await
            .as_u64()
            .unwrap_or(0)
            >= 4
    })
    .await;
    let requests = eval(
        "return performance.getEntriesByType('resource')\
         .map(e => new URL(e.name).pathname).join(' ')",
    )
    .await;
    let requests = requests.as_str().unwrap();
    assert!(
        requests.split(' ').all(|path| path == "/rows"),
        "only /rows: {requests}"
    );
    let count = requests.split(' ').count();
    let since_load_s = eval("return performance.now()").await.as_f64().unwrap() / 1000.0;
    assert!(
        count as f64 <= since_load_s + 1.0,
        "one request a second: {count} in {since_load_s:.1}s"
    );

    // Search, then select gpu: its holders, and its waiters in line order with priorities.
    eval(
        "const s = document.getElementById('search'); s.value = 'gpu'; \
          s.dispatchEvent(new Event('input')); return 0",
    )
    .await;
    let visible = eval(
        "return [...document.querySelectorAll('tr.sem')].filter(r => !r.hidden)\
         .map(r => r.dataset.name).join(' ')",
    )
    .await;
    assert_eq!(visible, "gpu");
    eval("document.querySelector('tr.sem[data-name=\"gpu\"]').click(); return 0").await;
    let ids = "return [...document.querySelectorAll('#detail tr.holder, #detail tr.waiter')]\
               .map(r => r.className + ':' + r.dataset.externalId).join(' ')";
    wait_until(
        SOON,
        "the details list gpu's holders and waiters",
        || async {
            eval(ids).await.as_str().unwrap_or("")
                == "holder:train-1 holder:train-2 waiter:train-3 waiter:train-4"
        },
    )
    .await;
    let texts = eval("return document.getElementById('detail').innerText").await;
    let texts = texts.as_str().unwrap();
    assert!(
        texts.contains("priority") && texts.contains(" ago"),
        "{texts}"
    );
    let iso_date = texts
        .as_bytes()
        .windows(5)
        .any(|w| w[..4].iter().all(u8::is_ascii_digit) && w[4] == b'-');
    assert!(!iso_date, "relative times only, no timestamps: {texts}");
    // At 1000 and 1280 pixels wide the details are readable (at least 24rem, beside the table
    // or under it), their tables inside them, no word in a cell broken across lines (a token
    // is one number), and the page does not scroll sideways.
    for width in [1000u32, 1280] {
        {
            let b = browser.clone();
            tokio::task::spawn_blocking(move || b.resize(width, 1024))
                .await
                .unwrap();
        }
        let fits = format!(
            "const d = document.getElementById('detail').getBoundingClientRect(); \
             return innerWidth <= {width} && document.documentElement.scrollWidth <= innerWidth \
               && d.width >= 384 && [...document.querySelectorAll('#detail table')] \
               .every(t => t.getBoundingClientRect().right <= d.right + 1) \
               && [...document.querySelectorAll('#detail td')] \
               .filter(td => td.textContent.trim() && !/\\s/.test(td.textContent.trim())) \
               .every(td => {{ const r = document.createRange(); r.selectNodeContents(td); \
                              return r.getClientRects().length <= 1; }})"
        );
        wait_until(SOON, &format!("the details fit {width} pixels"), || async {
            let (b, fits) = (browser.clone(), fits.clone());
            tokio::task::spawn_blocking(move || b.eval(&fits))
                .await
                .unwrap()
                .as_bool()
                == Some(true)
        })
        .await;
    }
    // A phone's width: the table scrolls within itself, the page does not scroll sideways.
    {
        let b = browser.clone();
        tokio::task::spawn_blocking(move || b.resize(390, 900))
            .await
            .unwrap();
    }
    wait_until(SOON, "the page fits 390 pixels", || async {
        eval("return innerWidth <= 390 && document.documentElement.scrollWidth <= innerWidth")
            .await
            .as_bool()
            == Some(true)
    })
    .await;
    {
        let b = browser.clone();
        tokio::task::spawn_blocking(move || b.resize(1280, 1024))
            .await
            .unwrap();
    }
    // The screenshot of all 50 (search cleared, gpu's details open).
    eval(
        "const s = document.getElementById('search'); s.value = ''; \
          s.dispatchEvent(new Event('input')); return 0",
    )
    .await;
    let png = {
        let b = browser.clone();
        tokio::task::spawn_blocking(move || b.screenshot())
            .await
            .unwrap()
    };
    assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
    std::fs::write(screenshots().join("status-page.png"), &png).unwrap();

    // Raise gpu's capacity: the waiters are granted, and the page follows on its own.
    client.set_capacity("gpu", 4, None).await.unwrap();
    wait_until(SOON, "the page shows 4/4 held and no waiter", || async {
        eval("const r = document.querySelector('tr.sem[data-name=\"gpu\"]'); return r && \
              r.querySelector('.held').textContent + '/' + r.querySelector('.capacity').textContent \
              + ' ' + document.querySelectorAll('#detail tr.waiter').length")
            .await
            .as_str()
            .unwrap_or("")
            == "4/4 0"
    })
    .await;
    // A change of mode moves no capacity: the changes say what moved, in words.
    client.set_capacity("gpu", 4, Some(false)).await.unwrap();
    wait_until(SOON, "the changes say fair -> greedy", || async {
        eval(
            "return [...document.querySelectorAll('#detail tr.change')]\
              .map(r => r.innerText).join('\\n')",
        )
        .await
        .as_str()
        .unwrap_or("")
        .lines()
        .next()
        .is_some_and(|newest| newest.contains("fair -> greedy"))
    })
    .await;
    drop(browser);
    drop(serve);
    worker.stop().await;
}

/// `serve` needs nothing more than the producer role (deploy/ runs it so): every page and
/// endpoint answers when it logs in as a member of `permitq_producer` only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_runs_as_an_operator_login_and_a_producer_sees_only_its_own_requests() {
    let db = TestDb::new().await;
    let (client, worker) = populated(&db).await;
    client
        .set_rate_limit("api", 2, Duration::from_secs(60), None)
        .await
        .unwrap();
    // A producer reads its own requests only, in the views too: none of these are its.
    let producer = db.login("permitq_producer").await;
    let o = run(&producer, &["semaphore", "show", "gpu", "--json"]).await;
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let shown: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(shown["holders"], serde_json::json!([]), "{shown}");
    assert_eq!(shown["waiters"], serde_json::json!([]), "{shown}");
    assert_eq!(shown["usage"]["held"], 2, "counts are everyone's: {shown}");
    let text = stdout(&run(&producer, &["semaphore", "show", "gpu"]).await);
    assert!(
        text.contains(
            "holders (0; 2 more permits held by other logins' requests, not shown to this one)"
        ),
        "{text}"
    );
    let operator = db.login("permitq_operator").await;
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&operator, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    for path in [
        "/",
        "/rows",
        "/api/semaphores",
        "/api/semaphores/gpu",
        "/api/semaphores/api",
        "/metrics",
        "/readyz",
    ] {
        let (status, body) = get_async(addr, path).await;
        assert_eq!(status, 200, "{path}: {body}");
        if path == "/api/semaphores/gpu" {
            // A name in another case: the nearest names, to an operator login too.
            let (status, missing) = get_async(addr, "/api/semaphores/GPU").await;
            assert_eq!(status, 404, "{missing}");
            assert!(missing.contains("did you mean gpu?"), "{missing}");
            assert!(
                body.contains("train-1") && body.contains("train-3"),
                "{body}"
            );
        }
    }
    drop(serve);
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_explains_a_request_and_answers_404_with_a_reason_for_an_unknown_one() {
    let db = TestDb::new().await;
    let (_client, worker) = populated(&db).await;
    let url = db.url.clone();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    let (status, body, typo, page_typo, post) = tokio::task::spawn_blocking(move || {
        (
            get(addr, "/api/requests/train-3/explain"),
            get(addr, "/api/requests/nope/explain"),
            get(addr, "/api/semaphore/gpu"),
            get(addr, "/metric"),
            request(addr, "POST", "/api/semaphores", Some("{}")),
        )
    })
    .await
    .unwrap();
    assert_eq!(post.0, 405);
    assert!(
        post.1.contains("permitq's HTTP API is read-only"),
        "{}",
        post.1
    );
    // A path that is not there says which are.
    let typo_body: serde_json::Value = serde_json::from_str(&typo.1).unwrap();
    assert_eq!(typo.0, 404);
    assert!(
        typo_body["error"]
            .as_str()
            .unwrap()
            .starts_with("no such path: /api/semaphore/gpu; permitq serves /, "),
        "{typo_body}"
    );
    assert_eq!(page_typo.0, 404);
    assert!(
        page_typo.1.contains("no such path: /metric;") && page_typo.1.contains("/metrics"),
        "{}",
        page_typo.1
    );
    let waiting: serde_json::Value = serde_json::from_str(&status.1).unwrap();
    assert_eq!(status.0, 200, "{}", status.1);
    assert_eq!(waiting["external_id"], "train-3");
    assert_eq!(waiting["semaphores"][0]["semaphore"], "gpu");
    assert_eq!(body.0, 404, "{}", body.1);
    let unknown: serde_json::Value = serde_json::from_str(&body.1).unwrap();
    assert!(
        unknown["error"].as_str().is_some_and(|e| e.starts_with(
            "no request named \"nope\": none was submitted under that external_id (check it)"
        )),
        "{unknown}"
    );
    drop(serve);
    worker.stop().await;
}

/// Names are the users' text: every column of the status page escapes them (semaphore,
/// template, parent, and the workers line's worker id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_column_of_the_status_page_escapes_what_users_named() {
    let db = TestDb::new().await;
    let client = db.client().await;
    client.set_capacity("<u>p", 10, None).await.unwrap();
    client
        .set_semaphore(
            "<i>t*",
            2,
            &permitq::SemaphoreSettings::new().parent("<u>p"),
        )
        .await
        .unwrap();
    client.set_capacity("<b>n</b>", 1, None).await.unwrap();
    let worker = db.worker(quiet_config("<s>w"));
    client
        .submit(&Request::new("x").permit("<i>tx", 1))
        .await
        .unwrap();
    assert_eq!(common::settled_state(&client, "x").await, State::Acquired);
    let url = db.url.clone();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    wait_until(SOON, "the page lists the worker", || async {
        let (_, rows) = get_async(addr, "/rows").await;
        rows.contains("&lt;s&gt;w")
    })
    .await;
    for path in ["/rows", "/"] {
        let (status, html) = get_async(addr, path).await;
        assert_eq!(status, 200);
        for raw in ["<u>", "<i>", "<b>", "<s>"] {
            assert!(!html.contains(raw), "{path}: {raw} unescaped:\n{html}");
        }
        for escaped in ["&lt;b&gt;n&lt;/b&gt;", "from &lt;i&gt;t*", "in &lt;u&gt;p"] {
            assert!(html.contains(escaped), "{path}: no {escaped}:\n{html}");
        }
    }
    drop(serve);
    worker.stop().await;
}

/// `permitq doctor` names what co-tenants could exhaust and the SQL that prevents it; once a DBA
/// ran that SQL, the same checks pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_prints_the_hardening_sql_and_passes_once_it_ran() {
    let db = TestDb::new().await;
    let producer_url = db.login("permitq_producer").await;
    let login = common::user_of(&producer_url);
    let o = run(&db.url, &["doctor"]).await;
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(!stderr(&o).contains("schema is not here"), "{}", stderr(&o));
    let text = stdout(&o);
    let fix = |prefix: &str| {
        text.lines()
            .find_map(|l| {
                l.trim()
                    .strip_prefix("run: ")
                    .filter(|sql| sql.starts_with(prefix))
            })
            .unwrap_or_else(|| panic!("no fix starting {prefix:?} in:\n{text}"))
            .to_string()
    };
    assert!(
        text.contains("change  advisory locks: any login may take advisory locks")
            && text.contains("to change: run the SQL above as a superuser"),
        "{text}"
    );
    let revoke = fix("REVOKE EXECUTE ON FUNCTION pg_advisory_lock(bigint)");
    // Other applications may take advisory locks: the fix says to grant them back.
    assert!(
        revoke.contains("take advisory locks (migration tools such as sqlx"),
        "{revoke}"
    );
    let temp = fix(&format!(
        "REVOKE TEMPORARY ON DATABASE {} FROM PUBLIC;",
        db.name
    ));
    let limit = fix(&format!("ALTER ROLE {login} CONNECTION LIMIT"));
    let idle = fix(&format!(
        "ALTER ROLE {login} SET idle_in_transaction_session_timeout"
    ));
    let conn = db.conn().await;
    for sql in [&revoke, &temp, &limit, &idle] {
        conn.batch_execute(sql).await.unwrap();
    }
    let o = run(&db.url, &["doctor", "--json"]).await;
    let findings: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
    let ok = |check: &str| {
        findings
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["check"] == check)
            .unwrap_or_else(|| panic!("no check {check:?}: {findings}"))["ok"]
            == true
    };
    assert!(ok("advisory locks"), "{findings}");
    assert!(ok("temporary tables"), "{findings}");
    assert!(ok(&format!("connections of {login}")), "{findings}");
    assert!(ok(&format!("idle transactions of {login}")), "{findings}");
    // And the producer login can no longer take an advisory lock.
    let err = common::connect(&producer_url)
        .await
        .batch_execute("SELECT pg_advisory_lock(1)")
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
    );
    // Nor a temporary table.
    let err = common::connect(&producer_url)
        .await
        .batch_execute("CREATE TEMP TABLE t (x int)")
        .await
        .unwrap_err();
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_a_token_answers_only_callers_that_send_it_probes_excepted() {
    let db = TestDb::new().await;
    let (_client, worker) = populated(&db).await;
    let dir = std::env::temp_dir().join(format!("permitq-token-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "0123456789abcdef-token\n").unwrap();
    let short = dir.join("short");
    std::fs::write(&short, "abc\n").unwrap();
    // A token too short to guess hard is refused before anything is served.
    let o = run(
        &db.url,
        &["serve", "--http-token-file", short.to_str().unwrap()],
    )
    .await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("holds 3 characters; a token needs at least 16"),
        "{}",
        stderr(&o)
    );
    // One that is not there: how to make it.
    let missing = dir.join("missing");
    let o = run(
        &db.url,
        &["serve", "--http-token-file", missing.to_str().unwrap()],
    )
    .await;
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!(
            "(make one, readable by you alone: (umask 077; head -c 32 /dev/urandom | base64 > {}))",
            missing.display()
        )),
        "{}",
        stderr(&o)
    );
    let url = db.url.clone();
    let file = token_file.to_str().unwrap().to_string();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(
            &url,
            &[
                "serve",
                "--http-addr",
                "127.0.0.1:0",
                "--http-token-file",
                &file,
            ],
        )
    })
    .await
    .unwrap();
    tokio::task::spawn_blocking(move || {
        use base64::Engine;
        for path in [
            "/",
            "/rows",
            "/api/semaphores",
            "/api/semaphores/gpu",
            "/metrics",
        ] {
            let (status, head, body) = get_with(addr, path, &[]);
            assert_eq!(status, 401, "{path}: {body}");
            assert!(
                head.contains("www-authenticate: Basic realm=\"permitq\""),
                "{head}"
            );
            assert!(body.contains("--http-token-file"), "{body}");
            let (status, _, body) =
                get_with(addr, path, &["Authorization: Bearer wrong-token-000000"]);
            assert_eq!(status, 401, "{path}");
            assert!(
                body.contains("the token sent is not the one given"),
                "{body}"
            );
            // The right token without its scheme: the answer says the scheme is missing.
            let (status, _, body) =
                get_with(addr, path, &["Authorization: 0123456789abcdef-token"]);
            assert_eq!(status, 401, "{path}");
            assert!(
                body.contains(
                    "the Authorization header has no scheme: send `Authorization: Bearer TOKEN`"
                ),
                "{body}"
            );
            let (status, _, body) = get_with(
                addr,
                path,
                &["Authorization: Bearer 0123456789abcdef-token"],
            );
            assert_eq!(status, 200, "{path}: {body}");
        }
        // What a browser sends after its prompt: any user, the token as password.
        let basic = base64::engine::general_purpose::STANDARD.encode("me:0123456789abcdef-token");
        let (status, _, body) = get_with(
            addr,
            "/api/semaphores/gpu",
            &[&format!("Authorization: Basic {basic}")],
        );
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("train-1"), "{body}");
        for probe in ["/healthz", "/readyz"] {
            assert_eq!(get(addr, probe).0, 200, "{probe}");
        }
    })
    .await
    .unwrap();
    drop(serve);
    std::fs::remove_dir_all(&dir).unwrap();
    worker.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_loopback_without_a_token_requests_are_not_shown_and_the_limit_answers_429() {
    let db = TestDb::new().await;
    let (_client, worker) = populated(&db).await;
    let url = db.url.clone();
    let (serve, bound) = tokio::task::spawn_blocking(move || {
        spawn_server(
            &url,
            &[
                "serve",
                "--http-addr",
                "0.0.0.0:0",
                "--http-max-concurrent",
                "1",
            ],
        )
    })
    .await
    .unwrap();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], bound.port()));
    let (page, api, metrics) = tokio::task::spawn_blocking(move || {
        (
            get(addr, "/"),
            get(addr, "/api/semaphores/gpu"),
            get(addr, "/metrics"),
        )
    })
    .await
    .unwrap();
    for (status, body) in [&page, &api] {
        assert_eq!(*status, 401, "{body}");
        assert!(
            body.contains("start it with --http-token-file FILE (or --http-no-auth"),
            "{body}"
        );
        assert!(!body.contains("train-1"), "{body}");
    }
    assert_eq!(
        metrics.0, 200,
        "counts per semaphore stay open: {}",
        metrics.1
    );

    // One request at a time: while one waits on the database (a lock held here), the next is
    // answered 429 at once. (Scrapes answer from the last read until it is a second old; the
    // first after that waits.)
    let mut admin = db.conn().await;
    let tx = admin.transaction().await.unwrap();
    tx.batch_execute("LOCK TABLE permitq.semaphore IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let slow = std::sync::Mutex::new(Vec::new());
    let watcher = db.conn().await;
    wait_until(SOON, "a scrape waits on the lock", || async {
        slow.lock()
            .unwrap()
            .push(tokio::task::spawn_blocking(move || get(addr, "/metrics")));
        watcher
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
                 AND application_name = 'permitq'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    })
    .await;
    let (status, body) = get_async(addr, "/metrics").await;
    assert_eq!(status, 429, "{body}");
    assert!(body.contains("too many requests at once"), "{body}");
    // The probes are not limited: a flood of requests does not make the server look dead.
    let (healthz, readyz) =
        tokio::task::spawn_blocking(move || (get(addr, "/healthz"), get(addr, "/readyz")))
            .await
            .unwrap();
    assert_eq!(healthz.0, 200, "{}", healthz.1);
    assert_ne!(readyz.0, 429, "{}", readyz.1);
    tx.rollback().await.unwrap();
    let scrapes = slow.into_inner().unwrap();
    let mut answered = Vec::new();
    for scrape in scrapes {
        answered.push(scrape.await.unwrap().0);
    }
    assert!(
        answered.iter().all(|s| [200, 429].contains(s)),
        "the scrape that waited is answered once the lock goes: {answered:?}"
    );
    drop(serve);
    worker.stop().await;
}

/// The value of `series` (name and labels, exactly) in Prometheus text, 0 when absent.
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// However many clients ask at once (status pages, scrapes, API calls), `serve` reads the
/// database at most once a second per answer: clients share the last read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_clients_at_once_share_one_database_read_per_second() {
    let db = TestDb::new().await;
    let (_client, worker) = populated(&db).await;
    let url = db.url.clone();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(
            &url,
            &[
                "serve",
                "--http-addr",
                "127.0.0.1:0",
                "--http-max-concurrent",
                "64",
            ],
        )
    })
    .await
    .unwrap();
    let paths = [
        "/api/semaphores",
        "/api/semaphores/gpu",
        "/rows",
        "/metrics",
    ];
    let started = Instant::now();
    let clients: Vec<_> = (0..48)
        .map(|i| {
            let path = paths[i % paths.len()];
            std::thread::spawn(move || (path, get(addr, path)))
        })
        .collect();
    for client in clients {
        let (path, (status, body)) = client.join().unwrap();
        assert_eq!(status, 200, "{path}: {body}");
        if path == "/api/semaphores/gpu" {
            assert!(body.contains("\"train-3\""), "{body}");
        }
    }
    let (_, metrics) = get_async(addr, "/metrics").await;
    // One read per answer per second the clients took, and the scrape above may add one.
    let seconds = started.elapsed().as_secs_f64().ceil();
    let overview = sample(
        &metrics,
        "permitq_http_database_reads_total{answer=\"overview\"}",
    );
    let detail = sample(
        &metrics,
        "permitq_http_database_reads_total{answer=\"detail\"}",
    );
    assert!(
        (1.0..=seconds + 2.0).contains(&overview) && (1.0..=seconds + 1.0).contains(&detail),
        "48 requests in {seconds}s read the overview {overview} and gpu's detail {detail} times"
    );
    drop(serve);
    worker.stop().await;
}

/// `doctor` on a database without permitq's schema runs its checks (they are of the database
/// around it) and says that the schema is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn doctor_on_a_database_without_the_schema_says_to_migrate() {
    let db = TestDb::empty().await;
    let o = run(&db.url, &["doctor"]).await;
    assert!(
        stderr(&o).contains(
            "the permitq schema is not here, or not this version's: run `permitq migrate`"
        ) && stdout(&o).contains("advisory locks"),
        "{}\n{}",
        stdout(&o),
        stderr(&o)
    );
}

/// An adaptive semaphore on the status page: its capacity over time as a plot (a dot per change,
/// red for down), and what moved the last change, as the audit has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_plots_an_adaptive_capacity_and_what_moved_it() {
    let db = TestDb::new().await;
    let client = db.client().await;
    let mut config = quiet_config("w");
    config.maintenance.adaptive_cadence = Duration::from_millis(150);
    let worker = db.worker(config);
    client.set_capacity("api", 10, None).await.unwrap();
    client
        .set_adaptive(
            "api",
            Some(&permitq::AdaptiveLimit::new(
                permitq::Algorithm::Aimd,
                2,
                20,
            )),
        )
        .await
        .unwrap();
    // Two overloads, a cadence apart: 10 -> 9 -> 8.
    for (i, expected) in [(0, 9), (1, 8)] {
        let lease = client
            .acquire(&Request::new(format!("o{i}")).permit("api", 1), SOON)
            .await
            .unwrap();
        lease
            .release_reporting(permitq::Outcome::Overloaded, None)
            .await
            .unwrap();
        wait_until(SOON, "the capacity backed off", || async {
            client
                .usage()
                .await
                .unwrap()
                .iter()
                .any(|u| u.name == "api" && u.capacity == expected)
        })
        .await;
    }
    let url = db.url.clone();
    let (serve, addr) = tokio::task::spawn_blocking(move || {
        spawn_server(&url, &["serve", "--http-addr", "127.0.0.1:0"])
    })
    .await
    .unwrap();
    let browser = std::sync::Arc::new(tokio::task::spawn_blocking(Browser::start).await.unwrap());
    let page = format!("http://{addr}/");
    {
        let b = browser.clone();
        tokio::task::spawn_blocking(move || b.open(&page))
            .await
            .unwrap();
    }
    let eval = |script: &'static str| {
        let b = browser.clone();
        async move {
            tokio::task::spawn_blocking(move || b.eval(script))
                .await
                .unwrap()
        }
    };
    eval("document.querySelector('tr.sem[data-name=\"api\"]').click(); return 0").await;
    wait_until(SOON, "the plot and what moved it", || async {
        let said = eval(
            "const p = document.querySelector('#detail svg.capacity'); \
             const s = document.querySelector('#detail .signal'); \
             return p && s ? p.querySelectorAll('circle.down').length + ' ' \
               + (p.querySelector('polyline').getAttribute('points').split(' ').length > 3) + ' ' \
               + s.textContent : ''",
        )
        .await;
        let said = said.as_str().unwrap_or("");
        said.starts_with("2 true last change ")
            && said.contains(": 9 → 8 by adaptive (aimd) from 0 ok, 1 overloaded, 0 failed")
    })
    .await;
    let kind =
        eval("return document.querySelector('tr.sem[data-name=\"api\"] td.kind').textContent")
            .await;
    assert_eq!(
        kind.as_str(),
        Some("adaptive aimd"),
        "the row says it adapts"
    );
    let heading = eval("return document.getElementById('detail').innerText").await;
    assert!(
        heading
            .as_str()
            .unwrap()
            .contains("capacity over time (adaptive: aimd, 2 to 20)"),
        "{heading}"
    );
    // The open detail is the page's address: opened afresh there, it shows again.
    let hash = eval("return location.hash").await;
    assert_eq!(hash.as_str(), Some("#api"));
    // Opens the page at `address` and waits until its detail shows `says`.
    let detail_at = |address: &'static str, says: &'static str| {
        let browser = browser.clone();
        async move {
            let (b, page) = (browser.clone(), format!("http://{addr}/{address}"));
            tokio::task::spawn_blocking(move || b.open(&page))
                .await
                .unwrap();
            let script = format!(
                "const d = document.getElementById('detail'); \
                 return !d.hidden && d.innerText.includes({says:?})"
            );
            wait_until(SOON, says, || {
                let (b, script) = (browser.clone(), script.clone());
                async move {
                    tokio::task::spawn_blocking(move || b.eval(&script))
                        .await
                        .unwrap()
                        == serde_json::Value::Bool(true)
                }
            })
            .await;
        }
    };
    detail_at("?again#api", "capacity over time").await;
    // A name that is not there says so, with the nearest names.
    detail_at("?typo#API", "no semaphore named \"API\"; did you mean api?").await;
    // A malformed address (a bad escape) does not stop the page: it asks for the name as given.
    detail_at(
        "?bad#50%",
        "no semaphore named \"50%\" (the list on this page shows them all)",
    )
    .await;
    // A semaphore served by fairness key: its row says so, and its detail lists each key's share.
    client
        .set_semaphore(
            "gpus",
            1,
            &permitq::SemaphoreSettings::new().fairness_keys(true),
        )
        .await
        .unwrap();
    let _holding = client
        .acquire(&Request::new("g-hold").permit("gpus", 1), SOON)
        .await
        .unwrap();
    for (id, key, weight) in [
        ("g-a1", "team-a", 1),
        ("g-a2", "team-a", 1),
        ("g-b1", "team-b", 3),
    ] {
        client
            .submit(
                &Request::new(id)
                    .permit("gpus", 1)
                    .fairness_key(key)
                    .fairness_weight(weight),
            )
            .await
            .unwrap();
    }
    wait_until(SOON, "gpus on the page", || async {
        eval("return document.querySelector('tr.sem[data-name=\"gpus\"]') !== null")
            .await
            .as_bool()
            == Some(true)
    })
    .await;
    eval("document.querySelector('tr.sem[data-name=\"gpus\"]').click(); return 0").await;
    wait_until(SOON, "each key's share", || async {
        let text = eval("return document.getElementById('detail').innerText").await;
        let text = text.as_str().unwrap_or("");
        text.contains("fairness keys (keys that wait are served in proportion to their weights)")
            && text.contains("waiting\tfairness key")
            && text.contains("team-a\t1\t2\t2\t0\t25%")
            && text.contains("team-b\t3\t1\t1\t0\t75%")
    })
    .await;
    let kind =
        eval("return document.querySelector('tr.sem[data-name=\"gpus\"] td.kind').textContent")
            .await;
    assert_eq!(
        kind.as_str(),
        Some("by key"),
        "the row says it is served by key"
    );
    // A rate limit's bar is its window's: a permit held past its 1s window leaves the bar empty
    // (it was drawn full, as if nothing could be granted).
    client
        .set_semaphore(
            "quota",
            1,
            &permitq::SemaphoreSettings::new().per(Duration::from_secs(1)),
        )
        .await
        .unwrap();
    let _held = client
        .acquire(&Request::new("q-held").permit("quota", 1), SOON)
        .await
        .unwrap();
    wait_until(
        SOON,
        "quota's bar empties once its window passes",
        || async {
            let (_, rows) = get_async(addr, "/rows").await;
            rows.split("<tr class=\"sem\"")
                .find(|r| r.contains("data-name=\"quota\""))
                .is_some_and(|r| r.contains("style=\"width:0%\""))
        },
    )
    .await;
    drop(browser);
    drop(serve);
    worker.stop().await;
}

/// `serve` as a login with no permitq role names the login and the role serve needs, on its
/// stderr and on `/readyz` (not a list of every role and `<your login>`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_as_a_login_with_no_permitq_role_names_it_and_the_role_it_needs() {
    let db = TestDb::new().await;
    let user = format!("noserve_{}", std::process::id());
    db.conn()
        .await
        .batch_execute(&format!("CREATE ROLE {user} LOGIN PASSWORD 'pw'"))
        .await
        .unwrap();
    let url = common::as_user(&db.url, &user, "pw");
    let told = format!(
        "the login {user} has no permitq role (permission denied for schema permitq): serve \
         needs permitq_operator to read every request (permitq_producer reads its own alone); a \
         DBA runs GRANT permitq_operator TO {user}, or use a login that has it"
    );
    let mut serve = Command::new(env!("CARGO_BIN_EXE_permitq"))
        .args(["serve", "--http-addr", "127.0.0.1:0"])
        .env("DATABASE_URL", &url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = serve.stderr.take().unwrap();
    let lines = tokio::task::spawn_blocking(move || {
        use std::io::BufRead as _;
        let mut lines = std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok);
        let mut seen = Vec::new();
        for l in lines.by_ref() {
            let done = l.contains("cannot read the database now");
            seen.push(l);
            if done {
                break;
            }
        }
        std::thread::spawn(move || lines.for_each(drop));
        seen
    });
    let lines = tokio::time::timeout(SOON, lines).await;
    let lines = match lines {
        Ok(lines) => lines.unwrap(),
        Err(_) => {
            let _ = serve.kill();
            panic!("serve said nothing of the database within SOON");
        }
    };
    let addr: std::net::SocketAddr = lines
        .iter()
        .find_map(|l| l.strip_prefix("permitq: serving http://"))
        .and_then(|rest| rest.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("serving line in {lines:?}"));
    let said = lines.last().unwrap();
    assert!(said.contains(&told), "{said}");
    assert!(!said.contains("<your login>"), "{said}");
    let (status, body) = get_async(addr, "/readyz").await;
    let _ = serve.kill();
    let _ = serve.wait();
    assert_eq!(status, 503);
    assert!(body.contains(&told), "{body}");
}
