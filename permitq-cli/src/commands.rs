//! Running each subcommand.

use std::time::Duration;

use permitq::{Client, PermitRequest, ReleaseOutcome, Request, SqlState, State, Worker};

use crate::args::{Cli, Command, SemaphoreCommand, SubmitArgs, TokensCommand};
use crate::error::{
    CliError, Result, EXIT_INTERRUPTED, EXIT_NOT_GRANTED, EXIT_RUNTIME, EXIT_STILL_WAITING,
};

/// No request named `name` among those this login reads: the error says whether it reads all,
/// and the ids nearest it (a failed read suggests none).
async fn not_visible(client: &Client, name: String) -> CliError {
    let similar = client.similar_requests(&name).await.unwrap_or_default();
    let semaphore = names_a_semaphore(client, &name).await;
    match client.reads_every_request().await {
        Ok(sees_all) => CliError::NotVisible {
            name,
            sees_all,
            similar,
            semaphore,
        },
        Err(e) => e.into(),
    }
}

/// Whether a semaphore (or template) named exactly `name` exists.
async fn semaphore_exists(client: &Client, name: &str) -> permitq::Result<bool> {
    Ok(client.semaphores().await?.iter().any(|s| s.name == name))
}

/// A semaphore as `semaphore list --json` and `semaphore set --json` print it: its row, with
/// the settings kept outside it (whether it is adaptive, and how; whether it is served by
/// fairness key), as `usage` (every semaphore's) says them.
fn semaphore_json(s: &permitq::Semaphore, usage: &[permitq::SemaphoreUsage]) -> serde_json::Value {
    let mut row = serde_json::to_value(s).expect("serializable");
    let u = usage.iter().find(|u| u.name == s.name);
    row["adaptive"] = u
        .and_then(|u| u.adaptive.as_ref())
        .map_or(serde_json::Value::Null, |a| {
            serde_json::to_value(a).expect("serializable")
        });
    row["fairness_keys"] = u.is_some_and(|u| u.fairness_keys).into();
    row
}

/// Whether `name`, given where a request's id belongs, is an existing semaphore's name:
/// `permitq release gpu`. A failed read says no.
async fn names_a_semaphore(client: &Client, name: &str) -> bool {
    semaphore_exists(client, name).await.unwrap_or(false)
}

/// Runs one command. `explicit_url`: `--database-url` was given on the command line (not only
/// through `DATABASE_URL`), which `demo` and `bench` require before they write to a database.
pub(crate) async fn run(cli: Cli, explicit_url: bool) -> Result<u8> {
    let url = cli.database_url.clone().filter(|u| !u.trim().is_empty());
    match run_command(cli, explicit_url).await {
        // A missing schema may be a URL naming the wrong database: the CLI's own words for it
        // (crate::error), and which database was looked in.
        Err(CliError::Permitq(e)) if e.is_missing_schema() => {
            let place = match url {
                Some(url) => Client::connect(&url).await.ok().map(|c| c.database()),
                None => None,
            };
            let e = CliError::Permitq(e);
            Err(match place {
                Some(place) => CliError::runtime(format!(
                    "{e} (looked in {place}: if permitq was migrated into another database, fix \
                     the URL instead)"
                )),
                None => e,
            })
        }
        other => other,
    }
}

async fn run_command(cli: Cli, explicit_url: bool) -> Result<u8> {
    // An empty DATABASE_URL (`DATABASE_URL=`) is no URL, not the defaults of an empty one.
    let empty = cli
        .database_url
        .as_deref()
        .is_some_and(|u| u.trim().is_empty());
    // No URL, but libpq's variables name the database (PGHOST, PGDATABASE, ...): an empty URL,
    // which the library completes from them as libpq would.
    let from_pg_env = ["PGHOST", "PGPORT", "PGDATABASE", "PGUSER"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()));
    let url = match cli.database_url.filter(|u| !u.trim().is_empty()) {
        None if !empty && from_pg_env => Some("postgres://".to_string()),
        url => url,
    };
    let named = if explicit_url { url.as_deref() } else { None };
    let need_url = || {
        url.clone().ok_or_else(|| CliError::Missing {
            field: "database URL",
            hint: if empty {
                "DATABASE_URL is set but empty: set it to postgres://user@host/db, or pass \
                 --database-url"
                    .to_string()
            } else {
                "pass --database-url or set DATABASE_URL (or libpq's PGHOST, PGDATABASE, \
                 PGUSER)"
                    .to_string()
            },
        })
    };
    match cli.command {
        Command::Demo(args) => crate::demo::run(named, args).await.map(|_| 0),
        Command::Bench(args) => crate::bench::run(named, args).await.map(|_| 0),
        Command::Chaos(_) if named.is_some() => Err(CliError::usage(
            "database-url",
            "chaos runs only on its own throwaway cluster (it kills, restarts and reconfigures \
             the server); leave out --database-url",
        )),
        Command::Chaos(args) => {
            let config = crate::chaos::ChaosConfig {
                duration: args.duration,
                seed: args.seed,
                workers: args.workers.into(),
                clients: args.clients.into(),
                sweep_interval: args.sweep_interval,
                fault_every: (!args.no_faults).then_some(args.fault_every),
                mutation: args.mutation,
                binary: std::env::current_exe()?,
                network: args.network,
                ha: args.ha.then_some(crate::chaos::ha::HaConfig {
                    synchronous: !args.asynchronous,
                    etcd_members: args.etcd_members,
                }),
                previous: args.previous,
            };
            let report = crate::chaos::run(config).await?;
            out!("{}", report.summary());
            // Every violation, on stderr (the summary shows the first few of each checker).
            for (checker, messages) in &report.verdict.violations {
                for message in messages {
                    errln!("violation: {checker}: {message}");
                }
            }
            Ok(if report.violations() == 0 {
                0
            } else {
                EXIT_RUNTIME
            })
        }
        Command::ChaosHolder { external_id } => {
            crate::chaos::nemesis::holder_process(&need_url()?, &external_id).await?;
            Ok(0)
        }
        Command::Migrate { json } => {
            let client = Client::connect(&need_url()?).await?;
            let migrated = client.migrate().await?;
            if json {
                outln!("{}", serde_json::json!({ "applied": migrated }));
            } else if migrated.is_empty() {
                outln!("schema is up to date in {}", client.database());
            } else {
                outln!("migrated {}", client.database());
                if migrated.upgraded_prerelease {
                    outln!("upgraded a pre-release schema in place");
                }
                if !migrated.versions.is_empty() {
                    outln!("applied migrations {:?}", migrated.versions);
                }
                if !migrated.files.is_empty() {
                    outln!("applied schema files {}", migrated.files.join(", "));
                }
                if migrated.versions.first() == Some(&1) {
                    // A new schema: what comes next.
                    outln!(
                        "next: `permitq semaphore set NAME CAPACITY`, then `permitq worker`; \
                         other logins need a permitq role (e.g. GRANT permitq_producer TO YOUR_LOGIN; \
                         the README's Permissions part lists them)"
                    );
                }
            }
            Ok(0)
        }
        Command::Worker(args) => {
            // SIGTERM/SIGINT before the worker runs (connecting, waiting for the schema) is a
            // clean stop too: exit 0, as in every later state.
            let shutdown = Shutdown::install();
            let url = need_url()?;
            let client = Client::connect(&url).await?;
            // A token file that cannot serve is said now, not after the schema wait.
            let http = match args.http_addr {
                Some(addr) => Some((addr, crate::http::access(addr, &args.http_access)?)),
                None => None,
            };
            tokio::select! {
                ready = wait_for_schema(&client) => ready?,
                () = shutdown.signalled() => return Ok(0),
            }
            let worker = Worker::connect(&url, args.config())?;
            if let Some((addr, access)) = http {
                let reader = crate::http::Reader {
                    login: crate::login_of(Some(&url)),
                    who: "the worker",
                    role: ("permitq_worker", ""),
                };
                let bound =
                    crate::http::serve(addr, access, client, Some(worker.health()), reader).await?;
                tracing::info!(addr = %bound, "serving http://{bound}/");
            }
            worker.run(shutdown.signalled()).await?;
            Ok(0)
        }
        Command::Workers { json } => {
            let client = Client::connect(&need_url()?).await?;
            let presence = crate::show::Presence::read(&client).await?;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string(&presence).expect("serializable")
                );
            } else {
                outln!("{}", presence.summary());
                for w in presence.workers.iter().filter(|w| !w.live) {
                    // Stopped cleanly, or gone without a word (killed, or cut off).
                    let how = match w.stopped_at {
                        Some(at) => format!("stopped cleanly {} ago", crate::show::ago(Some(at))),
                        None => format!(
                            "last seen {} ago, without stopping cleanly: killed, or cut off from \
                             the database (its log says which)",
                            crate::show::ago(w.seen_at)
                        ),
                    };
                    outln!(
                        "  not running: {} on {} ({}, {how})",
                        w.worker_id,
                        w.host,
                        w.version
                    );
                }
            }
            // A script's check: exit 1 while nothing is granting.
            Ok(if presence.nothing_granting.is_some() {
                EXIT_RUNTIME
            } else {
                0
            })
        }
        Command::Top { interval } => {
            crate::top::check_terminal()?;
            crate::top::run(Client::connect(&need_url()?).await?, interval).await?;
            Ok(0)
        }
        Command::Serve {
            http_addr,
            http_access,
        } => {
            let shutdown = Shutdown::install();
            let url = need_url()?;
            let client = Client::connect(&url).await?;
            let access = crate::http::access(http_addr, &http_access)?;
            // A producer's login reads only its own requests: the page would show a part.
            let reads_all = client.reads_every_request().await;
            let reader = crate::http::Reader {
                login: crate::login_of(Some(&url)),
                who: "serve",
                role: crate::OPERATOR,
            };
            let said = reads_all.as_ref().err().map(|e| reader.said(e));
            let bound = crate::http::serve(http_addr, access, client, None, reader).await?;
            errln!("permitq: serving http://{bound}/ (Ctrl-C to stop)");
            if let Some(said) = said {
                errln!(
                    "permitq: cannot read the database now: {said}; serving anyway: the page, \
                     the API and /readyz say so until it can"
                );
            }
            if matches!(reads_all, Ok(false)) {
                errln!(
                    "permitq: this login reads only its own requests (a producer's): the page and \
                     the API show its holders and waiters only, while the counts are everyone's; \
                     run serve as a permitq_operator login to show all"
                );
            }
            shutdown.signalled().await;
            errln!("permitq: stopped serving http://{bound}/");
            Ok(0)
        }
        Command::Semaphore(cmd) => semaphore(&Client::connect(&need_url()?).await?, cmd).await,
        Command::Submit(args) => submit(&Client::connect(&need_url()?).await?, args).await,
        Command::Status { external_id, json } => {
            let client = Client::connect(&need_url()?).await?;
            match client.status(&external_id).await? {
                Some(r) => {
                    print_request(&r, json);
                    let lease_ran_out = lease_ran_out_at(&r).is_some();
                    if (r.state == State::New || lease_ran_out) && !json {
                        if let Some(warning) = client.granting().await?.warning() {
                            let what = if lease_ran_out {
                                "is not swept"
                            } else {
                                "waits"
                            };
                            errln!("permitq: {external_id} {what}, and {warning}");
                        }
                    }
                }
                None => return Err(not_visible(&client, external_id).await),
            }
            Ok(0)
        }
        Command::Explain { external_id, json } => {
            let client = Client::connect(&need_url()?).await?;
            let Some(explanation) = client.explain(&external_id).await? else {
                return Err(not_visible(&client, external_id).await);
            };
            if json {
                outln!(
                    "{}",
                    serde_json::to_string(&explanation).expect("serializable")
                );
            } else {
                for line in crate::show::explanation(&explanation) {
                    outln!("{line}");
                }
                // An adaptive capacity moves: what that means for this request.
                for s in &explanation.semaphores {
                    if let Ok(Some(limit)) = client.adaptive(&s.semaphore).await {
                        outln!("{}", adaptive_note(&s.semaphore, s.needs, &limit));
                    }
                }
            }
            Ok(0)
        }
        Command::Tokens(TokensCommand::Raise { above, json }) => {
            let client = Client::connect(&need_url()?).await?;
            let epoch = client.raise_token_floor(above).await?;
            if json {
                outln!("{}", serde_json::json!({ "above": above, "epoch": epoch }));
            } else {
                // Where they start: far above `above` when it was below them already.
                outln!(
                    "tokens issued from now on are above {above}: they start past {} (epoch \
                     {epoch})",
                    epoch.saturating_mul(1 << 48)
                );
            }
            Ok(0)
        }
        Command::Doctor { json } => {
            let client = Client::connect(&need_url()?).await?;
            let findings = client.hardening().await?;
            // The checks are of the database around permitq, and hold without its schema; say
            // so when it is not there (or not this version's), as the rest of the CLI would.
            if !json && !client.schema_is_current().await.unwrap_or(true) {
                errln!(
                    "permitq doctor: the permitq schema is not here, or not this version's: \
                     run `permitq migrate` (the checks below are of the database around it)"
                );
            }
            if json {
                outln!(
                    "{}",
                    serde_json::to_string(&findings).expect("serializable")
                );
            } else {
                for f in &findings {
                    outln!(
                        "{:<7} {}: {}",
                        if f.ok { "ok" } else { "change" },
                        f.check,
                        f.detail
                    );
                    if let Some(fix) = &f.fix {
                        outln!("        run: {fix}");
                    }
                }
                let changes = findings.iter().filter(|f| !f.ok).count();
                if changes > 0 {
                    outln!(
                        "{changes} to change: run the SQL above as a superuser (a permitq admin may \
                         not: REVOKE on pg_catalog's functions needs their owner, ALTER ROLE needs \
                         CREATEROLE), then run `permitq doctor` again"
                    );
                } else {
                    outln!("nothing to change");
                }
            }
            Ok(u8::from(findings.iter().any(|f| !f.ok)))
        }
        Command::Release {
            external_id,
            outcome: report,
            latency,
            json,
        } => {
            latency_needs_outcome(
                report,
                latency,
                "with the release that gives the permits back: a report comes only with that one",
            )?;
            let client = Client::connect(&need_url()?).await?;
            let said = match report {
                Some(report) => {
                    let said = client
                        .release_reporting(&external_id, report, latency)
                        .await?;
                    match said {
                        ReleaseOutcome::Released => {
                            say_where_reported(&client, &external_id, report, latency).await;
                        }
                        // Only a release reports: a repeated one would count its holder twice.
                        ReleaseOutcome::AlreadyReleased => errln!(
                            "permitq: no report kept: it was released before, and a report goes only with the release that gives the permits back (`permitq release ID --outcome ...` the first time)"
                        ),
                        ReleaseOutcome::Cancelled => errln!(
                            "permitq: no report kept: it was still waiting, so it never used the resource"
                        ),
                        _ => {}
                    }
                    said
                }
                None => client.release(&external_id).await?,
            };
            outcome(&client, said, &external_id, json).await
        }
        Command::Revoke { external_id, json } => {
            let client = Client::connect(&need_url()?).await?;
            let said = client.revoke(&external_id).await?;
            outcome(&client, said, &external_id, json).await
        }
        Command::Heartbeat {
            external_id,
            extend,
            outcome: report,
            latency,
            json,
        } => {
            latency_needs_outcome(
                report,
                latency,
                "with a heartbeat or the release: a report goes with one of them",
            )?;
            // Unreachable: the lease was not extended, and says so.
            let not_extended = |e: permitq::Error| -> CliError {
                if e.is_retryable() {
                    CliError::runtime(format!(
                        "{}; the lease was NOT extended: it still ends at the expires_at the last \
                         heartbeat that got through printed (`permitq status {external_id}` once \
                         the database answers); heartbeat again before then",
                        crate::error::one_line(&e.to_string())
                    ))
                } else {
                    e.into()
                }
            };
            let client = Client::connect(&need_url()?).await.map_err(not_extended)?;
            // The end before, to say when a heartbeat moved it earlier (it sets now + --extend,
            // or now + the ttl: after an --extend longer than the ttl, a plain one shortens
            // it), or gave a lease to a request held until released.
            let before = client
                .status(&external_id)
                .await
                .ok()
                .flatten()
                .filter(|r| r.state == State::Acquired)
                .map(|r| (r.expires_at, r.ttl));
            let ttl = before.and_then(|(_, ttl)| ttl);
            let before = before.map(|(expires, _)| expires);
            let beat = client.heartbeat(&external_id, extend).await;
            // Held (the heartbeat got through): the report counts, beside it.
            if let (Ok(_), Some(report)) = (&beat, report) {
                client.report(&external_id, report, latency).await?;
                say_where_reported(&client, &external_id, report, latency).await;
            }
            match beat {
                Ok(expiry) if json => outln!(
                    "{}",
                    serde_json::json!({
                        "external_id": external_id,
                        "expires_at": expiry.map(|t| humantime::format_rfc3339_micros(t).to_string()),
                    })
                ),
                Ok(Some(t)) => {
                    outln!("expires_at={}", humantime::format_rfc3339_seconds(t));
                    if let (Some(None), Some(_)) = (before, extend) {
                        errln!(
                            "permitq: note: it had no lease (held until released): it has one \
                             now, and is released when it runs out unless a heartbeat extends it"
                        );
                    }
                    match before.flatten() {
                        // The end printed may read as before (to the second): say what moved,
                        // to the second (`show::until` rounds minutes to a tenth).
                        Some(was) if was <= t && extend.is_some() => {
                            let from_now = |at: std::time::SystemTime| {
                                let left = at
                                    .duration_since(std::time::SystemTime::now())
                                    .unwrap_or_default();
                                humantime::format_duration(std::time::Duration::from_secs(
                                    (left + std::time::Duration::from_millis(500)).as_secs(),
                                ))
                            };
                            errln!(
                                "permitq: lease extended: it ends in {} (it was to end in {})",
                                from_now(t),
                                from_now(was)
                            );
                        }
                        Some(was) if was > t && extend.is_some() => errln!(
                            "permitq: note: the lease now ends earlier than before ({}): a \
                             heartbeat sets its end to now + --extend, and --extend was shorter \
                             than what was left",
                            humantime::format_rfc3339_seconds(was)
                        ),
                        Some(was) if was > t => errln!(
                            "permitq: note: the lease now ends earlier than before ({}): a \
                             heartbeat without --extend sets its end to now + its ttl ({}), \
                             shorter than what an earlier --extend left; give every heartbeat \
                             the same --extend to keep the longer lease",
                            humantime::format_rfc3339_seconds(was),
                            ttl.map_or("?".to_string(), |d| humantime::format_duration(d)
                                .to_string())
                        ),
                        _ => {}
                    }
                }
                Ok(None) => outln!(
                    "held until released (it has no ttl): no lease to extend; --extend DUR \
                     gives it one"
                ),
                Err(e) if e.code() == Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE) => {
                    let Some(row) = client.status(&external_id).await? else {
                        return Err(not_visible(&client, external_id).await);
                    };
                    if matches!(row.state, State::New | State::InProgress) {
                        // Still waiting: the database's words say so.
                        errln!("permitq: {}", crate::error::one_line(&e.to_string()));
                    } else if row.fencing_token.is_none() {
                        // Never granted: no work to stop; why, once, as `status` says it.
                        let why = row.outcome().unwrap_or_else(|| row.state.to_string());
                        let again = if why.contains("new external_id") {
                            ""
                        } else {
                            "; submit again under a new external_id to hold it"
                        };
                        errln!(
                            "permitq: no lease: {} was never granted: {why}{again}",
                            row.external_id
                        );
                    } else if row.release_reason == Some(permitq::ReleaseReason::Released) {
                        // Given back by its holder: nothing was lost, there is nothing to extend.
                        errln!(
                            "permitq: nothing to extend: {} was released by its holder {} ago{} \
                             (a heartbeat is for a holder that still holds); submit again under \
                             a new external_id to hold it again",
                            row.external_id,
                            crate::show::ago(row.released_at),
                            if row.ttl.is_none() {
                                ", and it never had a lease (no ttl)"
                            } else {
                                ""
                            }
                        );
                    } else {
                        errln!("permitq: {}", crate::error::one_line(&e.to_string()));
                        errln!(
                            "permitq: stop the work it guarded (its fencing token is refused \
                             from now on); submit again under a new external_id to hold it again"
                        );
                    }
                    // Not granted yet is not lost: a script tells them apart by the code.
                    return Ok(match row.state {
                        State::New | State::InProgress => EXIT_STILL_WAITING,
                        _ => EXIT_NOT_GRANTED,
                    });
                }
                Err(e) => return Err(not_extended(e)),
            }
            Ok(0)
        }
    }
}

/// Before a worker starts: fail fast on a malformed URL or bad credentials, but wait (up to two
/// minutes, logged) for a database that is not up yet and for a schema that `permitq migrate`
/// has not created or upgraded yet, so that workers started beside a migration job (a
/// Kubernetes rollout) do not crash-loop. Once running, the worker rides out restarts itself.
async fn wait_for_schema(client: &Client) -> Result<()> {
    let started = std::time::Instant::now();
    let deadline = started + Duration::from_secs(120);
    // What was last logged, and when: the same reason again only every 30 s.
    let mut logged: Option<(String, std::time::Instant)> = None;
    loop {
        let why = match client.schema_is_current().await {
            Ok(true) => return Ok(()),
            Ok(false) => format!(
                "the schema is missing or not at this build's version in {} (run `permitq \
                 migrate` there; or, if permitq was migrated into another database, fix the URL)",
                client.database()
            ),
            Err(e) if e.is_retryable() => format!("database not reachable yet: {e}"),
            Err(e) => return Err(e.into()),
        };
        if std::time::Instant::now() >= deadline {
            return Err(CliError::runtime(format!("gave up after 2 minutes: {why}")));
        }
        let due = logged
            .as_ref()
            .is_none_or(|(said, at)| *said != why || at.elapsed() >= Duration::from_secs(30));
        if due {
            tracing::warn!(
                "{why}; waiting for it ({}s so far, giving up after 120s)",
                started.elapsed().as_secs()
            );
            logged = Some((why, std::time::Instant::now()));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// After the submit of a new request: what a worker will fail it with, said now, while it can
/// still be fixed: a name no semaphore or template has (unknown_semaphore), a template named
/// itself, a count beyond a capacity (exceeds_capacity). A failed read says nothing: the
/// request is submitted either way.
/// True if it said something.
async fn say_names_not_found(client: &Client, row: &permitq::PermitRequest) -> bool {
    let answers = client
        .answers_at_submit(&row.permits)
        .await
        .unwrap_or_default();
    for answer in &answers {
        errln!("permitq: {} is queued, but {answer}", row.external_id);
    }
    !answers.is_empty()
}

/// A fairness key on semaphores that are not keyed: accepted (a semaphore may be keyed later,
/// and requests are placed by key only there), but it changes nothing there: said, with how
/// to key them.
async fn say_key_unused(client: &Client, row: &permitq::PermitRequest) {
    let Some(key) = &row.fairness_key else {
        return;
    };
    let Ok(usage) = client.usage().await else {
        return;
    };
    // On a keyed one, a key that reads as one already there but is not (keys are compared
    // exactly): said, since it is served as another tenant.
    for u in usage
        .iter()
        .filter(|u| row.permits.contains_key(&u.name) && u.fairness_keys)
    {
        let alike: Vec<String> = client
            .key_shares(&u.name)
            .await
            .unwrap_or_default()
            .iter()
            .filter(|k| {
                k.fairness_key != *key
                    && crate::show::alike_form(&k.fairness_key) == crate::show::alike_form(key)
            })
            .map(crate::show::key_label)
            .collect();
        if !alike.is_empty() {
            errln!(
                "permitq: note: the fairness key {} is not {} on {} (keys are compared exactly, \
                 case and spaces included): it takes turns as a tenant of its own",
                serde_json::Value::from(key.as_str()),
                alike.join(" nor "),
                u.name
            );
        }
    }
    let plain: Vec<&permitq::SemaphoreUsage> = usage
        .iter()
        .filter(|u| row.permits.contains_key(&u.name) && !u.fairness_keys)
        .collect();
    let Some(first) = plain.first() else {
        return;
    };
    let names: Vec<&str> = plain.iter().map(|u| u.name.as_str()).collect();
    errln!(
        "permitq: note: {} {} not keyed, so the fairness key {key} changes nothing there \
         (`permitq semaphore set {} {}{} --fairness-keys` serves a line by key)",
        names.join(", "),
        if names.len() == 1 { "is" } else { "are" },
        crate::show::quoted_name(&first.name),
        // Its capacity as it is (the command takes one; the other settings are kept).
        first.capacity,
        // A greedy one serves no line: keyed, it is made fair too.
        if first.fair { "" } else { " --fair" }
    );
}

/// No semaphore `name`: the error, with the existing names nearest it (as an
/// `unknown_semaphore` error names them).
async fn no_semaphore(client: &Client, name: String) -> CliError {
    let similar = client.similar_semaphores(&name).await.unwrap_or_default();
    let request = matches!(client.status(&name).await, Ok(Some(_)));
    CliError::NoSemaphore {
        name,
        similar,
        request,
    }
}

/// After a template was set: what its new settings leave as it was in its instances. A bound
/// lowered below the instances there are removes none of them; a capacity lowered below what
/// an instance holds revokes nothing.
async fn say_instances_over_the_template(
    client: &Client,
    template: &permitq::Semaphore,
    waiting_before: &[(String, Vec<permitq::Waiter>)],
) {
    let Ok(all) = client.usage().await else {
        return;
    };
    let instances: Vec<&permitq::SemaphoreUsage> = all
        .iter()
        .filter(|i| i.template.as_deref() == Some(template.name.as_str()))
        .collect();
    let made = i64::try_from(instances.len()).unwrap_or(i64::MAX);
    if let Some(bound) = template.max_instances.filter(|bound| made > *bound) {
        let counted = match &template.parent {
            Some(parent) if template.guarantee > 0 => {
                format!(", their guarantees still promised by {parent},")
            }
            _ => String::new(),
        };
        errln!(
            "permitq: {} has {made} instances, more than max_instances {bound}: none is removed; \
             they stay{counted} until deleted (`permitq semaphore delete NAME` once one holds \
             nothing; `permitq semaphore show {}` lists them) or idle for \
             --idle-instance-after, and no new instance is made while {bound} or more remain",
            template.name,
            crate::show::quoted_name(&template.name)
        );
    }
    // The waiters of those that had any, read before the change (a worker may end those the
    // new capacity no longer covers before a read after it).
    for (instance, waiters) in waiting_before {
        say_waiters_no_longer_covered(waiters, instance, template.capacity);
    }
    let over: Vec<String> = instances
        .iter()
        .filter(|i| template.per.is_none() && i.used > template.capacity)
        .map(|i| format!("{} holds {}", i.name, i.used))
        .collect();
    if !over.is_empty() {
        errln!(
            "permitq: {}, more than the new capacity {} of each instance: nothing is revoked; \
             new grants there wait until fewer are held",
            over.join(", "),
            template.capacity
        );
    }
}

/// `--latency` without `--outcome`: a usage error (checked here, not by clap: its usage line
/// would show --latency as required). `goes_with` says which calls carry a report.
fn latency_needs_outcome(
    report: Option<permitq::Outcome>,
    latency: Option<std::time::Duration>,
    goes_with: &str,
) -> Result<()> {
    match (report, latency) {
        (None, Some(latency)) => Err(CliError::usage(
            "--latency",
            format!(
                "it goes with a report of how the use went: give --outcome ok --latency {} \
                 ({goes_with})",
                humantime::format_duration(latency)
            ),
        )),
        _ => Ok(()),
    }
}

/// After `release --outcome` or `heartbeat --outcome`: the adaptive semaphores the report went
/// to (those it held, and their parents), or that none of them adapts, so nothing was kept. A
/// failed read says nothing.
async fn say_where_reported(
    client: &Client,
    external_id: &str,
    report: permitq::Outcome,
    latency: Option<std::time::Duration>,
) {
    let (Ok(Some(row)), Ok(usage)) = (client.status(external_id).await, client.usage().await)
    else {
        return;
    };
    let mut held: Vec<String> = row.permits.keys().cloned().collect();
    // Their parents too: a grant takes from each ancestor, and the report goes there as well.
    let mut i = 0;
    while i < held.len() {
        if let Some(parent) = usage
            .iter()
            .find(|u| u.name == held[i])
            .and_then(|u| u.parent.clone())
        {
            if !held.contains(&parent) {
                held.push(parent);
            }
        }
        i += 1;
    }
    let adaptive: Vec<&str> = held
        .iter()
        .filter(|n| usage.iter().any(|u| &u.name == *n && u.adaptive.is_some()))
        .map(String::as_str)
        .collect();
    if adaptive.is_empty() {
        errln!(
            "permitq: no report kept: none of its semaphores ({}) is adaptive (`permitq semaphore \
             set NAME CAPACITY --adaptive ...` makes one)",
            held.join(", ")
        );
    } else {
        // Only ok reports' latencies are compared, and by gradient alone: an overloaded or
        // failed report says what it needs to without one.
        let gradient = adaptive.iter().any(|n| {
            usage.iter().any(|u| {
                &u.name == n
                    && u.adaptive
                        .as_ref()
                        .is_some_and(|a| a.algorithm == permitq::Algorithm::Gradient)
            })
        });
        let latency_unused = if latency.is_some() && !gradient {
            " (its latency is not used: aimd reads only how many reports say ok, overloaded or \
             failed; `semaphore show` still prints the ok reports' latency)"
                .to_string()
        } else if latency.is_some() && report != permitq::Outcome::Ok {
            let article = if report == permitq::Outcome::Overloaded {
                "an"
            } else {
                "a"
            };
            format!(
                " (its latency is not used: the gradient compares the latencies of ok reports \
                 only; {article} {} report counts as one by itself)",
                report.as_str()
            )
        } else {
            String::new()
        };
        errln!(
            "permitq: reported {} to {}: the next cadence counts it{latency_unused}",
            report.as_str(),
            adaptive.join(", ")
        );
    }
}

/// After `semaphore set`: the requests that waited before it (the first 1000 in line) and ask
/// more of `name` than its new `capacity`, which a worker ends as `exceeds_capacity` (perhaps
/// already). Said on stderr, as the other notes of a change; a failed read says nothing.
fn say_waiters_no_longer_covered(waiters: &[permitq::Waiter], name: &str, capacity: i64) {
    let uncovered: Vec<String> = waiters
        .iter()
        .filter(|w| w.count > capacity)
        .map(|w| format!("{} ({name}={})", w.external_id, w.count))
        .collect();
    if uncovered.is_empty() {
        return;
    }
    const SHOWN: usize = 5;
    let more = uncovered.len().saturating_sub(SHOWN);
    errln!(
        "permitq: {} waiting {} more than the new capacity {capacity}: {}{}; a worker ends {} \
         as error exceeds_capacity (the new capacity in its error_detail) when it comes to it: \
         at once (perhaps already), unless others are ahead of it in line. To keep such requests waiting, raise the capacity again \
         (`permitq semaphore set {} {}`); one already ended is submitted again under a new id",
        uncovered.len(),
        if uncovered.len() == 1 {
            "request asks"
        } else {
            "requests ask"
        },
        uncovered[..uncovered.len().min(SHOWN)].join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        },
        if uncovered.len() == 1 { "it" } else { "each" },
        crate::show::quoted_name(name),
        waiters.iter().map(|w| w.count).max().unwrap_or(capacity),
    );
}

async fn semaphore(client: &Client, cmd: SemaphoreCommand) -> Result<u8> {
    match cmd {
        SemaphoreCommand::Show { name, json } => {
            let Some(detail) = crate::http::detail(client, &name).await? else {
                return Err(no_semaphore(client, name).await);
            };
            if json {
                outln!("{}", serde_json::to_string(&detail).expect("serializable"));
            } else {
                crate::show::print(&detail, client.reads_every_request().await?);
            }
        }
        SemaphoreCommand::Set {
            name,
            capacity,
            fair,
            greedy,
            per,
            parent,
            no_parent,
            guarantee,
            max_instances,
            adaptive,
            floor,
            ceiling,
            no_adaptive,
            fairness_keys,
            no_fairness_keys,
            json,
        } => {
            let mut settings = permitq::SemaphoreSettings::new();
            if fairness_keys || no_fairness_keys {
                settings = settings.fairness_keys(fairness_keys);
            }
            if fair || greedy {
                settings = settings.fair(fair);
            }
            if let Some(per) = per {
                settings = settings.per(per);
            }
            if let Some(parent) = parent.as_deref().or(no_parent.then_some("")) {
                settings = settings.parent(parent);
            }
            if let Some(guarantee) = guarantee {
                settings = settings.guarantee(guarantee);
            }
            if let Some(max_instances) = max_instances {
                settings = settings.max_instances(max_instances);
            }
            // In the same change: a refused adaptive setting makes or changes nothing.
            match (adaptive, floor, ceiling, no_adaptive) {
                (Some(algorithm), Some(floor), Some(ceiling), _) => {
                    settings = settings
                        .adaptive(Some(permitq::AdaptiveLimit::new(algorithm, floor, ceiling)));
                }
                (_, _, _, true) => settings = settings.adaptive(None),
                _ => {}
            }
            // Read before the change: a worker may end those the new capacity no longer
            // covers before a read after it. For a template, its instances' (those that have
            // waiters: a read each, not one per instance).
            let waiting_before = client.waiters(&name, 1000).await.unwrap_or_default();
            let mut instances_waiting = Vec::new();
            if name.ends_with('*') {
                for u in client.usage().await.unwrap_or_default() {
                    if u.template.as_deref() == Some(name.as_str()) && u.waiting > 0 {
                        let waiters = client.waiters(&u.name, 1000).await.unwrap_or_default();
                        instances_waiting.push((u.name, waiters));
                    }
                }
            }
            // Whether it is new, and whether it was a rate limit, read before (an adaptive
            // setting audits after the creation).
            let before = client
                .semaphores()
                .await
                .map(|all| all.into_iter().find(|s| s.name == name));
            let was_rate_limited = matches!(&before, Ok(Some(b)) if b.per.is_some());
            let s = client.set_semaphore(&name, capacity, &settings).await?;
            // A typo makes a new semaphore: say that this one is new, and what it is near.
            let created = match before {
                Ok(before) => before.is_none(),
                Err(_) => client.capacity_history(&s.name).await.is_ok_and(|history| {
                    history
                        .iter()
                        .max_by_key(|c| c.changed_at)
                        .is_some_and(|c| c.old_capacity.is_none())
                }),
            };
            if created {
                // A new template is meant to match other names: none is a typo of it.
                let near: Vec<String> = if name.ends_with('*') {
                    Vec::new()
                } else {
                    client
                        .similar_semaphores(&name)
                        .await
                        .unwrap_or_default()
                        .into_iter()
                        .filter(|n| likely_typo(&name, n))
                        .collect()
                };
                // A name ending in `*` is a template (its instances are made on first use).
                let what = if s.name.ends_with('*') {
                    "a new template: a semaphore of this capacity is made for each name it matches, \
                     on first use"
                } else {
                    "a new semaphore"
                };
                errln!(
                    "permitq: created {}, {what}{}",
                    s.name,
                    if near.is_empty() {
                        String::new()
                    } else {
                        format!(
                            ": did you mean {}? (`permitq semaphore delete {}` removes this one \
                             while nothing uses it)",
                            near.join(" or "),
                            crate::show::quoted_name(&s.name)
                        )
                    }
                );
            }
            // `GPU` beside `gpu`: two semaphores, which is rarely what was meant. Said each time.
            let twins: Vec<String> = client
                .similar_semaphores(&name)
                .await
                .unwrap_or_default()
                .into_iter()
                .filter(|n| n.to_lowercase() == name.to_lowercase())
                .map(|n| format!("{n:?}"))
                .collect();
            if !twins.is_empty() {
                errln!(
                    "permitq: note: {} also exists, a separate semaphore: names match exactly, \
                     case included",
                    twins.join(" and ")
                );
            }
            if !s.is_template {
                say_waiters_no_longer_covered(&waiting_before, &s.name, s.capacity);
            }
            if s.is_template {
                say_instances_over_the_template(client, &s, &instances_waiting).await;
            }
            // `--per 0` took the window away (or there was none): what the capacity bounds now.
            if per == Some(Duration::ZERO) && s.per.is_none() {
                errln!(
                    "permitq: {} is not rate-limited{}: its capacity {} bounds the permits held \
                     at once (`--per 1m` makes it a rate limit{})",
                    s.name,
                    if was_rate_limited {
                        " any more"
                    } else {
                        " (it was not before either: --per 0 changed nothing)"
                    },
                    s.capacity,
                    if was_rate_limited { " again" } else { "" }
                );
            }
            // What adaptive means now, or that it still is (a capacity set by hand on it).
            match (adaptive, floor, ceiling, no_adaptive) {
                (Some(algorithm), Some(floor), Some(ceiling), _) => errln!(
                    "permitq: {} is adaptive ({}): the workers set its capacity between {floor} \
                     and {ceiling} from what its holders report (`permitq release ID --outcome \
                     ok|overloaded|failed [--latency 30ms]`), every --adaptive-cadence (1s){}",
                    s.name,
                    algorithm.as_str(),
                    if i64::from(capacity) == s.capacity {
                        String::new()
                    } else {
                        format!(
                            "; it starts at {}, within its bounds (not {capacity})",
                            s.capacity
                        )
                    }
                ),
                (_, _, _, true) => errln!(
                    "permitq: {} is fixed at {}: the workers no longer adapt it",
                    s.name,
                    s.capacity
                ),
                _ => {
                    if let Ok(Some(limit)) = client.adaptive(&s.name).await {
                        errln!(
                            "permitq: note: {} is adaptive ({}, {} to {}): the workers move its \
                             capacity again from its holders' reports; `--no-adaptive` fixes it",
                            s.name,
                            limit.algorithm.as_str(),
                            limit.floor,
                            limit.ceiling
                        );
                    }
                }
            }
            // Fairness keys turned on or off: what that means for its line.
            if fairness_keys {
                errln!(
                    "permitq: {} is served by fairness key: requests with a --fairness-key take \
                     turns by weight, in arrival order within a key (`permitq semaphore show {}` \
                     shows each key's share)",
                    s.name,
                    crate::show::quoted_name(&s.name)
                );
            } else if no_fairness_keys {
                errln!(
                    "permitq: {} is no longer served by fairness key: new requests line up by \
                     priority and arrival again, and its keys' turns are forgotten; requests \
                     already waiting keep the places their keys gave them",
                    s.name
                );
            }
            if json {
                // As `semaphore list --json` has it, the settings kept outside its row included.
                let usage = client.usage().await.unwrap_or_default();
                outln!("{}", semaphore_json(&s, &usage));
                return Ok(0);
            }
            // A rate limit's capacity bounds grants in its window: those, beside what is held.
            let used = match s.per {
                Some(_) => match client.usage().await {
                    Ok(usage) => usage
                        .iter()
                        .find(|u| u.name == s.name)
                        .map_or(format!("used={}", s.used), |u| {
                            format!("granted_in_window={} held={}", u.in_window, u.held)
                        }),
                    Err(_) => format!("used={}", s.used),
                },
                None => format!("used={}", s.used),
            };
            // An adaptive one says so: its capacity is the workers' to move.
            let adaptive = match client.adaptive(&s.name).await {
                Ok(Some(limit)) => format!(
                    " adaptive={} floor={} ceiling={}",
                    limit.algorithm.as_str(),
                    limit.floor,
                    limit.ceiling
                ),
                _ => String::new(),
            };
            let keyed = client
                .usage()
                .await
                .is_ok_and(|usage| usage.iter().any(|u| u.name == s.name && u.fairness_keys));
            let adaptive = if keyed {
                format!("{adaptive} fairness_keys")
            } else {
                adaptive
            };
            outln!(
                "{} capacity={}{} {used} {}{}{}{adaptive}",
                s.name,
                s.capacity,
                s.per
                    .map(|p| format!(" per={}", humantime::format_duration(p)))
                    .unwrap_or_default(),
                if s.fair { "fair" } else { "greedy" },
                s.parent
                    .as_ref()
                    .map(|p| format!(" parent={p} guarantee={}", s.guarantee))
                    .unwrap_or_default(),
                if s.is_template {
                    format!(
                        " max_instances={}",
                        s.max_instances.unwrap_or(i64::from(permitq::MAX_INSTANCES))
                    )
                } else {
                    String::new()
                }
            );
            // What the one line does not say: a change that will not last, or revokes nothing.
            if let Some(template) = &s.template {
                errln!(
                    "permitq: {} is an instance of template {template}: the template's next change \
                     (`permitq semaphore set {} ...`) sets it again",
                    s.name,
                    crate::show::quoted_name(template)
                );
            }
            if s.per.is_none() && s.used > s.capacity {
                errln!(
                    "permitq: {} {} held (or released and not yet counted back), more than the \
                     new capacity {}: nothing is revoked; {}",
                    s.used,
                    if s.used == 1 {
                        "permit is"
                    } else {
                        "permits are"
                    },
                    s.capacity,
                    if s.capacity == 0 {
                        "while it is 0, every new request here ends at once in exceeds_capacity \
                         (none can ever fit); raise it again to let requests wait"
                    } else {
                        "new grants wait until fewer are held"
                    }
                );
            } else if s.capacity == 0 {
                errln!(
                    "permitq: {} has capacity 0: while it is, every new request naming it ends at \
                     once in exceeds_capacity (none can ever fit); raise it to let requests wait",
                    s.name
                );
            }
        }
        SemaphoreCommand::List { json } => {
            let list = client.semaphores().await?;
            if json {
                // With the settings kept outside the semaphore's row, as the text list says
                // them: whether it is adaptive (and how) and served by fairness key.
                let usage = client.usage().await.unwrap_or_default();
                let rows: Vec<serde_json::Value> =
                    list.iter().map(|s| semaphore_json(s, &usage)).collect();
                outln!("{}", serde_json::to_string(&rows).expect("serializable"));
            } else {
                outln!("{:<32} {:>10} {:>10}  mode", "name", "capacity", "used");
                // A rate limit's `used` is its grants in the window (what its capacity bounds).
                let usage = client.usage().await.unwrap_or_default();
                if list.is_empty() {
                    errln!(
                        "permitq: no semaphores yet in {}: `permitq semaphore set NAME CAPACITY` \
                         makes one",
                        client.database()
                    );
                }
                for s in list {
                    let mut kind = crate::show::origin(s.is_template, s.template.as_deref())
                        .map(|o| format!("  {o}"))
                        .unwrap_or_default();
                    let mut used = s.used;
                    if let Some(per) = s.per {
                        let row = usage.iter().find(|u| u.name == s.name);
                        used = row.map_or(s.used, |u| u.in_window);
                        kind.push_str(&format!(
                            "  per {} (capacity and used: grants in the window; {} held)",
                            humantime::format_duration(per),
                            row.map_or(s.used, |u| u.held)
                        ));
                    }
                    if let Some(parent) = &s.parent {
                        kind.push_str(&format!("  under {parent}"));
                    }
                    if s.guarantee > 0 {
                        kind.push_str(&format!("  guarantee {}", s.guarantee));
                    }
                    let row = usage.iter().find(|u| u.name == s.name);
                    if let Some(a) = row.and_then(|u| u.adaptive.as_ref()) {
                        kind.push_str(&format!(
                            "  adaptive ({}, {} to {})",
                            a.algorithm.as_str(),
                            a.floor,
                            a.ceiling
                        ));
                    }
                    if row.is_some_and(|u| u.fairness_keys) {
                        kind.push_str("  served by fairness key");
                    }
                    outln!(
                        "{:<32} {:>10} {:>10}  {}{kind}",
                        s.name,
                        s.capacity,
                        used,
                        if s.fair { "fair" } else { "greedy" }
                    );
                }
            }
        }
        SemaphoreCommand::Delete { name, json } => match client.delete_semaphore(&name).await? {
            Some(s) if json => outln!("{}", serde_json::to_string(&s).expect("serializable")),
            Some(s) => outln!(
                "deleted {} (capacity {}); `permitq semaphore history {}` keeps its changes",
                s.name,
                s.capacity,
                crate::show::quoted_name(&s.name)
            ),
            None => return Err(no_semaphore(client, name).await),
        },
        SemaphoreCommand::History { name, json } => {
            // A deleted semaphore's history is still there.
            let history = client.capacity_history(&name).await?;
            if history.is_empty() && !client.semaphores().await?.iter().any(|s| s.name == name) {
                return Err(no_semaphore(client, name).await);
            }
            if json {
                outln!("{}", serde_json::to_string(&history).expect("serializable"));
            } else {
                for c in history {
                    let when = c
                        .changed_at
                        .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                        .unwrap_or_default();
                    outln!(
                        "{when} {} {} by {} ({}){}",
                        c.semaphore,
                        crate::show::capacity_change(&c, None),
                        c.changed_by,
                        c.application_name.as_deref().unwrap_or_default(),
                        c.inputs
                            .as_ref()
                            .map_or(String::new(), crate::show::change_inputs)
                    );
                }
            }
        }
    }
    Ok(0)
}

/// `explain`'s line for a request waiting on an adaptive semaphore: the capacity moves, and a
/// request it no longer covers ends in `exceeds_capacity`, as when an operator lowers it.
fn adaptive_note(name: &str, needs: i64, limit: &permitq::AdaptiveLimit) -> String {
    let head = format!(
        "  {name} is adaptive ({}, {} to {}): the workers move its capacity",
        limit.algorithm.as_str(),
        limit.floor,
        limit.ceiling
    );
    if needs <= i64::from(limit.floor) {
        format!("{head}; this request's {needs} is within the floor, so it always fits")
    } else {
        format!(
            "{head}; if it backs off below {needs}, this request ends in exceeds_capacity (a \
             request of at most the floor, {}, always fits)",
            limit.floor
        )
    }
}

/// Prints a release or revoke outcome, and what it means for the request's permits
/// (`released: gpu=2 given back after 12.3s`); `unknown` is exit 5.
async fn outcome(
    client: &Client,
    outcome: ReleaseOutcome,
    external_id: &str,
    json: bool,
) -> Result<u8> {
    if outcome == ReleaseOutcome::Unknown {
        // Another login's request is refused as such: unknown is none at all.
        return Err(CliError::NotVisible {
            name: external_id.to_string(),
            sees_all: true,
            similar: client
                .similar_requests(external_id)
                .await
                .unwrap_or_default(),
            semaphore: names_a_semaphore(client, external_id).await,
        });
    }
    if json {
        outln!(
            "{}",
            serde_json::json!({ "external_id": external_id, "outcome": outcome.to_string() })
        );
        return Ok(0);
    }
    match client.status(external_id).await? {
        Some(row) => outln!("{outcome}: {}", release_said(outcome, &row)),
        None => outln!("{outcome}"),
    }
    Ok(0)
}

/// What a release or revoke did to `row`, in words, read after it.
fn release_said(outcome: ReleaseOutcome, row: &PermitRequest) -> String {
    let permits = row
        .permits
        .iter()
        // Quoted as a shell word where the name needs it (`'a=b'=1`, not `a=b=1`).
        .map(|(name, count)| format!("{}={count}", crate::show::quoted_name(name)))
        .collect::<Vec<_>>()
        .join(" ");
    let held = match (row.acquired_at, row.released_at) {
        (Some(from), Some(to)) => to
            .duration_since(from)
            .map(|d| format!(" after {:.1}s", d.as_secs_f64()))
            .unwrap_or_default(),
        _ => String::new(),
    };
    match outcome {
        ReleaseOutcome::Released => format!("{permits} given back{held}"),
        ReleaseOutcome::Revoked => format!(
            "{permits} taken back from its holder{held}; its fencing token {} is now stale; {}",
            row.fencing_token.map_or("-".to_string(), |t| t.to_string()),
            // The client libraries heartbeat every third of the ttl; without a lease there is
            // no heartbeat to learn it from.
            row.ttl.map_or(
                "it had no lease, so no heartbeat tells its holder: its next `permitq status` \
                 or fenced write does"
                    .to_string(),
                |ttl| format!(
                    "the holder learns it at its next heartbeat (a client library's comes every \
                     third of its ttl: within {})",
                    humantime::format_duration(Duration::from_secs((ttl.as_secs() / 3).max(1)))
                )
            )
        ),
        ReleaseOutcome::AlreadyReleased => {
            let revoked_by = row.error_detail.as_ref().and_then(|d| d.revoked_by.clone());
            let by = match row.release_reason {
                Some(permitq::ReleaseReason::Expired) => "when its lease ran out".to_string(),
                Some(permitq::ReleaseReason::Stale) => "by a worker's --max-hold".to_string(),
                Some(permitq::ReleaseReason::Revoked) => match revoked_by {
                    Some(admin) => format!("by {admin} (revoked)"),
                    None => "by an admin (revoked)".to_string(),
                },
                _ => "by its holder".to_string(),
            };
            format!(
                "it was released {by} {} ago; nothing more to give back",
                crate::show::ago(row.released_at)
            )
        }
        // Where it had taken its fairness key's turn, the cancel does not give the turn back.
        ReleaseOutcome::Cancelled => format!(
            "it was still waiting: it held nothing and will not be granted{}",
            row.error_detail.as_ref().map_or(String::new(), |d| d
                .turn_kept_words(row.fairness_key.as_deref()))
        ),
        // Released again after a cancel: said as the repeat it is (as `already_released`).
        ReleaseOutcome::NotAcquired if row.error_code == Some(permitq::ErrorCode::Cancelled) => {
            format!(
                "it was already cancelled {} ago, while it was still waiting: it never held \
                 anything, and nothing more is to be done",
                crate::show::ago(row.settled_at)
            )
        }
        ReleaseOutcome::NotAcquired => format!(
            "it was never granted, so it held nothing ({})",
            row.outcome().unwrap_or_else(|| row.state.to_string())
        ),
        _ => format!("`permitq status {}` shows the request", row.external_id),
    }
}

async fn submit(client: &Client, args: SubmitArgs) -> Result<u8> {
    // An id of the form NAME=COUNT is a permit given in the id's place (the id left out): taken
    // as the id, it would submit a request for less than was meant. (SQL and the clients take
    // such an id; the CLI does not.)
    let id_is_a_permit = crate::args::parse_permit(&args.external_id).is_ok();
    if !args.permits.is_empty() && id_is_a_permit {
        let meant: Vec<String> = std::iter::once(args.external_id.clone())
            .chain(
                args.permits
                    .iter()
                    .map(|(name, count)| format!("{name}={count}")),
            )
            .collect();
        return Err(CliError::usage(
            "external_id",
            format!(
                "{:?} looks like a permit: the external_id comes first, then every permit: \
                 `permitq submit ID {}` (an id of the form NAME=COUNT is taken from SQL or a \
                 client, not the CLI)",
                args.external_id,
                meant.join(" ")
            ),
        ));
    }
    if args.permits.is_empty() && args.permit.is_empty() {
        let hint = if id_is_a_permit {
            format!(
                "{:?} was taken as the external_id, which comes first: \
                 `permitq submit ID {}`",
                args.external_id, args.external_id
            )
        } else {
            format!(
                "name what to acquire after the external_id: `permitq submit {} NAME=COUNT` \
                 (e.g. gpu=1)",
                args.external_id
            )
        };
        return Err(CliError::Missing {
            field: "permits",
            hint,
        });
    }
    if let (Some(weight), None) = (args.fairness_weight, &args.fairness_key) {
        return Err(CliError::usage(
            "fairness_weight",
            format!(
                "--fairness-weight {weight} weighs the turns of a fairness key, and no key was \
                 given: add the tenant's key (`--fairness-key TENANT --fairness-weight {weight}`)"
            ),
        ));
    }
    let mut request = Request::new(args.external_id);
    let mut named = std::collections::BTreeSet::new();
    for (name, count) in args
        .permits
        .into_iter()
        .chain(crate::args::permit_pairs(&args.permit)?)
    {
        if !named.insert(name.clone()) {
            return Err(CliError::usage(
                "permits",
                format!("semaphore {name:?} is named twice; name each semaphore once"),
            ));
        }
        request = request.permit(name, count);
    }
    request.owner = args.owner;
    request.ttl = args.ttl;
    request.wait = args.wait;
    request.priority = args.priority;
    request.fairness_key = args.fairness_key;
    request.fairness_weight = args.fairness_weight;
    let mut row = client.submit(&request).await?;
    // A new request is always `new`: one that is not was submitted before under this id.
    let earlier = row.state != State::New && row.state != State::InProgress;
    // Awaiting it: whether anything grants, said now, not when the await runs out.
    let nothing_grants = match args.await_for {
        Some(_) if !earlier => client.granting().await?.warning(),
        _ => None,
    };
    // What a worker will fail it with: said now, unless this awaits a running worker's
    // outcome, which says it a moment later.
    let outcome_soon = args.await_for.is_some() && nothing_grants.is_none();
    // (Said, the general line below would only repeat that it is queued.)
    let said_its_outcome = !earlier
        && row.state == State::New
        && !outcome_soon
        && say_names_not_found(client, &row).await;
    if !earlier {
        say_key_unused(client, &row).await;
    }
    let mut code = 0;
    let mut said_nothing_grants = false;
    if let Some(limit) = args.await_for {
        if let Some(warning) = nothing_grants {
            errln!(
                "permitq: {} is queued, but {warning}; waiting {} anyway",
                row.external_id,
                waiting_for(limit)
            );
            said_nothing_grants = true;
        }
        // Ctrl-C (or SIGTERM) while waiting: the caller gave up, so the request must not wait on
        // to be granted to nobody. (Submitted before under this id, it is the same request, which
        // this command was waiting for: the same answer.)
        let interrupt = Shutdown::install();
        let settled = client.wait_settled(&request.external_id, limit);
        tokio::pin!(settled);
        // Still waiting after a moment, with workers running: said once, with where to look.
        let mut told = said_nothing_grants || limit <= Duration::from_secs(3);
        let settled = loop {
            tokio::select! {
                settled = &mut settled => break settled,
                () = interrupt.signalled() => {
                    return interrupted(client, &request.external_id).await;
                }
                () = tokio::time::sleep(Duration::from_secs(2)), if !told => {
                    told = true;
                    errln!(
                        "permitq: {id} waits in line; `permitq explain {id}` says why (Ctrl-C \
                         cancels it)",
                        id = crate::show::quoted_name(&request.external_id)
                    );
                }
            }
        };
        row = match settled {
            Ok(settled) => settled.unwrap_or(row),
            Err(e) if e.is_connection() => {
                errln!(
                    "permitq: {id} was submitted, and the database stopped answering while this \
                     waited: it may still be waiting. Once the database answers, `permitq status \
                     {id}` says; `permitq release {id}` cancels it",
                    id = request.external_id
                );
                return Err(e.into());
            }
            Err(e) => return Err(e.into()),
        };
        code = match row.state {
            State::Acquired => 0,
            // Held no more (released, or ended): not a grant to work under.
            State::Error | State::Released => EXIT_NOT_GRANTED,
            _ => EXIT_STILL_WAITING,
        };
        if code == EXIT_STILL_WAITING {
            // Why it still waits, when the answer is that nothing grants.
            if let Some(warning) = client.granting().await?.warning() {
                if said_nothing_grants {
                    errln!(
                        "permitq: {} still waits: nothing is granting (as said above)",
                        row.external_id
                    );
                } else {
                    errln!("permitq: {} still waits: {warning}", row.external_id);
                }
            } else {
                errln!(
                    "permitq: {} still waits after {}; `permitq explain {}` says why",
                    row.external_id,
                    humantime::format_duration(limit),
                    row.external_id
                );
            }
            errln!("permitq: {}", stays_in_line(&row));
        }
    }
    print_request(&row, args.json);
    // An admin's submit of an id another login used, with the same parameters, returns that
    // login's request: say whose it is, before anything invites releasing it.
    // (Still `new`, it may be theirs too: the login is read either way.)
    let me = client.login().await.ok();
    let theirs = match (&row.submitted_by, &me) {
        (Some(by), Some(me)) if by != me => Some(by.clone()),
        _ => None,
    };
    if let Some(by) = theirs {
        errln!(
            "permitq: {id} was submitted by {by}, another login, with these same parameters: \
             this is {by}'s request ({state}), not a new one of yours, and releasing it \
             would end {by}'s; submit under a new external_id for your own (ids are one \
             namespace for every login: prefix yours, e.g. {me}:{id})",
            id = row.external_id,
            state = row.state,
            me = me.unwrap_or_default()
        );
    } else if earlier && row.state == State::Acquired {
        // The same submit again after a crash: the grant it already has, not a second one.
        errln!(
            "permitq: {id} was submitted before and holds its grant; this is that request (release \
             it with `permitq release {id}` when done)",
            id = row.external_id
        );
    } else if earlier && row.is_settled() {
        errln!(
            "permitq: {} was submitted before and has ended; this is that request: submit under \
             a new external_id for another",
            row.external_id
        );
    } else if earlier {
        errln!(
            "permitq: {} was submitted before and still waits; this is that request",
            row.external_id
        );
    }
    if args.await_for.is_none() && !args.json && !row.is_settled() && row.state != State::Acquired {
        // Queued, and nothing printed says what comes next: say it, and whether anything grants.
        match client.granting().await?.warning() {
            Some(warning) => errln!("permitq: {} is queued, but {warning}", row.external_id),
            None if said_its_outcome => {}
            // Fail fast: never queued; the next worker pass grants it or refuses it.
            None if row.wait == Some(Duration::ZERO) => errln!(
                "permitq: {id} fails fast (wait 0): the next worker pass grants it at once or \
                 refuses it (no_capacity), never queues it; `permitq status {id}` shows which \
                 (or submit with --await 5s to wait for the answer)",
                id = row.external_id
            ),
            None => errln!(
                "permitq: {id} is queued; `permitq status {id}` shows its outcome (or submit \
                 with --await 30s to wait for it)",
                id = row.external_id
            ),
        }
    }
    Ok(code)
}

fn print_request(r: &PermitRequest, json: bool) {
    if json {
        outln!("{}", serde_json::to_string(r).expect("serializable"));
        return;
    }
    // Errors and releases say how they ended (and an error what to do: PermitRequest::outcome).
    let said = match (r.state, r.fencing_token, r.outcome()) {
        (State::Acquired, Some(token), _) => format!("acquired fencing_token={token}"),
        (_, _, Some(outcome)) => outcome,
        (state, _, None) => state.to_string(),
    };
    let lease = match (r.state, r.expires_at) {
        (State::Acquired, Some(t)) => {
            format!(" expires_at={}", humantime::format_rfc3339_seconds(t))
        }
        _ => String::new(),
    };
    outln!("{} {said}{lease}", r.external_id);
    if let Some(t) = lease_ran_out_at(r) {
        errln!(
            "permitq: {id}'s lease ran out at {} with no heartbeat in time: it is no longer held \
             (a heartbeat says lease lost), and a worker's next sweep releases it; stop the work \
             it guarded",
            humantime::format_rfc3339_seconds(t),
            id = r.external_id
        );
    }
}

/// When the lease of a request still `acquired` on the books ran out, if it has: no worker has
/// swept it yet, and it is no longer held.
fn lease_ran_out_at(r: &PermitRequest) -> Option<std::time::SystemTime> {
    r.expires_at
        .filter(|t| r.state == State::Acquired && *t < std::time::SystemTime::now())
}

/// What becomes of a request `submit --await` stopped waiting for: how long it stays in line,
/// and how to take it out.
fn stays_in_line(r: &PermitRequest) -> String {
    let until = match (r.wait, r.created_at) {
        (Some(wait), Some(created)) => format!(
            "until its wait ends at {}",
            humantime::format_rfc3339_seconds(created + wait)
        ),
        _ => "with no time limit (`--wait DUR` bounds a request's wait)".to_string(),
    };
    format!(
        "{id} stays in line {until}, and is granted when its turn comes, whether anyone waits for \
         it then or not; `permitq release {id}` cancels it",
        id = r.external_id
    )
}

/// How long `submit --await` waits, in words: a bare `--await` waits until the outcome.
fn waiting_for(limit: Duration) -> String {
    if limit >= Duration::from_secs(365 * 24 * 3600) {
        "until it is granted (Ctrl-C cancels it)".to_string()
    } else {
        format!("up to {}", humantime::format_duration(limit))
    }
}

/// `submit --await` interrupted: cancels (or, if granted just then, releases) the request and
/// says so; exit 130, as a shell reports SIGINT.
async fn interrupted(client: &Client, external_id: &str) -> Result<u8> {
    match client.release(external_id).await {
        Ok(said) => {
            let what = match said {
                // As `release` says it: where it took its fairness key's turn, the turn stays.
                ReleaseOutcome::Cancelled => {
                    let kept = client
                        .status(external_id)
                        .await
                        .ok()
                        .flatten()
                        .and_then(|row| {
                            row.error_detail
                                .as_ref()
                                .map(|d| d.turn_kept_words(row.fairness_key.as_deref()))
                        })
                        .unwrap_or_default();
                    format!("cancelled it: it was still waiting{kept}")
                }
                ReleaseOutcome::Released => {
                    "released it: it was granted as you stopped".to_string()
                }
                _ => "it had already ended".to_string(),
            };
            errln!("permitq: interrupted; {external_id}: {what}");
        }
        Err(e) => errln!(
            "permitq: interrupted, and could not cancel {external_id} ({}): it may still be \
             granted; `permitq release {external_id}` cancels or releases it",
            crate::error::one_line(&e.to_string())
        ),
    }
    Ok(EXIT_INTERRUPTED)
}

/// SIGTERM or SIGINT, listened for from the moment a long-running command starts, so that a
/// signal in any state (connecting, waiting for the schema, running) is a clean stop, never the
/// default disposition's exit by signal.
struct Shutdown(tokio::sync::watch::Receiver<bool>);

impl Shutdown {
    /// Installs the handlers now (the streams register them when created) and watches them.
    fn install() -> Shutdown {
        use tokio::signal::unix::{signal, SignalKind};
        let (tx, rx) = tokio::sync::watch::channel(false);
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        tokio::spawn(async move {
            match (term, int) {
                (Ok(mut term), Ok(mut int)) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = int.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
            tracing::info!("shutting down: finishing the transaction in flight");
            let _ = tx.send(true);
        });
        Shutdown(rx)
    }

    /// Resolves once a signal arrived (at once if one already did).
    fn signalled(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.0.clone();
        async move {
            let _ = rx.wait_for(|stopped| *stopped).await;
        }
    }
}

/// Whether a new semaphore `new` reads as a typo of `existing` (a near name): the same parts
/// (split at `-`, `_`, `:`, `.`, `/` and spaces), one of them different, and that one a word of
/// three characters or more and not a number. Names made on purpose beside others (`child-b`
/// beside `child-a`, `pool` beside `gpu-pool`, `gpu-2` beside `gpu-1`) are not.
fn likely_typo(new: &str, existing: &str) -> bool {
    let parts = |s: &str| -> Vec<String> {
        s.split(['-', '_', ':', '.', '/', ' '])
            .map(str::to_string)
            .collect()
    };
    let (a, b) = (parts(new), parts(existing));
    if a.len() != b.len() {
        return false;
    }
    let differing: Vec<(&String, &String)> = a.iter().zip(&b).filter(|(x, y)| x != y).collect();
    match differing[..] {
        [(x, y)] => {
            let number = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit());
            x.chars().count() >= 3 && y.chars().count() >= 3 && !(number(x) && number(y))
        }
        // Only the separators differ (`gpu_pool`, `gpu-pool`).
        [] => true,
        _ => false,
    }
}

#[cfg(test)]
mod likely_typo_tests {
    use super::likely_typo;

    #[test]
    fn names_made_on_purpose_beside_others_are_not_typos() {
        assert!(likely_typo("gpuu", "gpu"));
        assert!(likely_typo("lisence", "licence"));
        assert!(likely_typo("gpu_pool", "gpu-pool"));
        assert!(likely_typo("team-alpah", "team-alpha"));
        assert!(!likely_typo("child-b", "child-a"));
        assert!(!likely_typo("pool", "gpu-pool"));
        assert!(!likely_typo("gpu-2", "gpu-1"));
        assert!(!likely_typo("gpu-10", "gpu-1"));
        assert!(!likely_typo("team-a-gpu", "team-b-cpu"));
    }
}

#[cfg(test)]
mod adaptive_note_tests {
    use super::adaptive_note;

    #[test]
    fn a_request_above_the_floor_is_told_it_may_end_in_exceeds_capacity() {
        let limit = permitq::AdaptiveLimit::new(permitq::Algorithm::Aimd, 2, 10);
        assert_eq!(
            adaptive_note("calls", 5, &limit),
            "  calls is adaptive (aimd, 2 to 10): the workers move its capacity; if it backs off \
             below 5, this request ends in exceeds_capacity (a request of at most the floor, 2, \
             always fits)"
        );
        assert!(adaptive_note("calls", 2, &limit).ends_with("within the floor, so it always fits"));
    }
}
