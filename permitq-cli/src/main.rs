//! `permitq`, the command line: a thin layer over the `permitq` library's [`permitq::Client`]
//! and [`permitq::Worker`], plus the tools that exercise them (`demo`, `bench`, `chaos`) and the
//! HTTP endpoints.
//!
//! Exit codes: 0 success; 1 runtime error (one line on stderr); 2 usage error or input rejected
//! as invalid (by the CLI or the database, SQLSTATE 22023), one line naming the field; 3
//! `submit --await` ended in `error`, or `heartbeat` found the lease lost; 4 `submit --await`
//! still `new` when the await ran out; 5 not found (unknown external_id or semaphore).
//!
//! Output never panics: a closed stdout or stderr (`permitq worker 2>&1 | head -1`) loses the
//! text, not the process, so SIGTERM still reaches the worker's loop.

/// `println!` that ignores a closed stdout (EPIPE) instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `print!` that ignores a closed stdout.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that ignores a closed stderr.
macro_rules! errln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

mod args;
mod bench;
mod chaos;
mod commands;
mod demo;
mod error;
mod http;
mod scratch;
mod show;
mod top;

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};

use crate::args::{Cli, Command};
use crate::error::{EXIT_RUNTIME, EXIT_USAGE};

/// Parses arguments, runs, and maps the outcome to an exit code. Never panics on any input.
fn main() -> ExitCode {
    let parsed = Cli::command()
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let mut cli = match parsed {
        Ok(parsed) => parsed,
        Err(e) if e.use_stderr() => {
            // clap's whole message: what is wrong or missing, suggestions ("did you mean"), the
            // usage line, or the command list when no command is given.
            let styled = if std::io::stderr().is_terminal() {
                e.render().ansi().to_string()
            } else {
                e.render().to_string()
            };
            errln!("{}", styled.trim_end());
            if let Some(tip) = tip_for(&e) {
                errln!("\n{tip}");
            }
            return ExitCode::from(EXIT_USAGE);
        }
        Err(e) => {
            out!("{}", e.render());
            return ExitCode::SUCCESS;
        }
    };
    let explicit_url = cli.database_url.is_some();
    if !explicit_url {
        cli.database_url = std::env::var("DATABASE_URL").ok();
    }
    let default_filter = match cli.command {
        Command::Worker(_) => "permitq=info",
        Command::Chaos(_) => "permitq=error",
        _ => "permitq=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(|| LossyStderr);
    if cli.log_format == "json" {
        logs.json().init();
    } else {
        logs.init();
    }

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            errln!("permitq: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_RUNTIME);
        }
    };
    let login = login_of(cli.database_url.as_deref());
    let role = role_needed(&cli.command);
    match runtime.block_on(commands::run(cli, explicit_url)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let message = match role {
                // No permitq role at all: the one this command needs, not a list.
                Some((role, also)) if e.is_schema_refused() => {
                    error::no_permitq_role(&login, "this command", role, also)
                }
                _ => error::for_the_cli(&e.to_string()).replace("<your login>", &login),
            };
            errln!("permitq: {}", error::one_line(&message));
            ExitCode::from(e.exit_code())
        }
    }
}

/// The permitq role `command` needs, and what else would do (None: it needs none, or runs its
/// own database).
pub(crate) fn role_needed(command: &Command) -> Option<(&'static str, &'static str)> {
    use args::{SemaphoreCommand, TokensCommand};
    Some(match command {
        Command::Worker(_) => ("permitq_worker", ""),
        Command::Submit(_)
        | Command::Status { .. }
        | Command::Explain { .. }
        | Command::Release { .. }
        | Command::Heartbeat { .. } => ("permitq_producer", ""),
        // Listing semaphores or workers reads no request: a producer may, and an operator,
        // who only looks.
        Command::Semaphore(SemaphoreCommand::List { .. }) | Command::Workers { .. } => (
            "permitq_producer",
            " (or permitq_operator, to look without submitting)",
        ),
        // The reading commands also work for a producer, on its own requests.
        Command::Top { .. }
        | Command::Serve { .. }
        | Command::Doctor { .. }
        | Command::Semaphore(SemaphoreCommand::Show { .. } | SemaphoreCommand::History { .. }) => {
            OPERATOR
        }
        Command::Revoke { .. }
        | Command::Semaphore(SemaphoreCommand::Set { .. } | SemaphoreCommand::Delete { .. })
        | Command::Tokens(TokensCommand::Raise { .. }) => ("permitq_admin", ""),
        _ => return None,
    })
}

/// What a reading command (`top`, `serve`, `semaphore show`) needs to read every request.
pub(crate) const OPERATOR: (&str, &str) = (
    "permitq_operator",
    " to read every request (permitq_producer reads its own alone)",
);

/// What an option from another tool meant here, when clap has no near name to suggest
/// (`--timeout` is nowhere near `--await`).
fn tip_for(e: &clap::Error) -> Option<&'static str> {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    // A command named as other tools name it (`semaphore create`, `rm`, `cancel`): clap
    // suggests only names near the word.
    if e.kind() == ErrorKind::InvalidSubcommand {
        let Some(ContextValue::String(word)) = e.get(ContextKind::InvalidSubcommand) else {
            return None;
        };
        return match word.as_str() {
            "create" | "add" | "new" | "update" | "resize" | "capacity" => Some(
                "tip: `permitq semaphore set NAME CAPACITY` creates a semaphore, and changes one \
                 that exists (`permitq semaphore --help` lists the commands)",
            ),
            "rm" | "remove" | "del" | "drop" | "destroy" => Some(
                "tip: `permitq semaphore delete NAME` removes a semaphore nothing holds or \
                 waits on",
            ),
            "renew" | "extend" | "keepalive" | "refresh" | "touch" => Some(
                "tip: `permitq heartbeat ID` extends a held request's lease (not `permitq revoke`: \
                 that takes its permits away)",
            ),
            "cancel" | "abort" => Some(
                "tip: `permitq release ID` cancels a request still waiting (and gives back one \
                 held)",
            ),
            "acquire" | "lock" | "take" => Some(
                "tip: `permitq submit ID SEMAPHORE=COUNT --await 30s` asks for permits and \
                 waits for them (`permitq release ID` gives them back)",
            ),
            "list" | "ls" => Some("tip: `permitq semaphore list` lists the semaphores"),
            "show" | "get" | "describe" | "info" => Some(
                "tip: `permitq semaphore show NAME` shows a semaphore (`permitq status ID`, a \
                 request)",
            ),
            _ => None,
        };
    }
    if e.kind() != ErrorKind::UnknownArgument {
        return None;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    // `--await -1s`: taken as an option, as clap takes what starts with `-`.
    if arg
        .strip_prefix('-')
        .is_some_and(|rest| rest.starts_with(|c: char| c.is_ascii_digit()))
    {
        return Some(
            "tip: a duration is 0s or more (`--await 30s`, `--wait 1m`, `--ttl 30s`): a \
             negative one means nothing here",
        );
    }
    let name = arg.split('=').next().unwrap_or(arg);
    matches!(name, "--timeout" | "--deadline" | "--wait-for" | "--block").then_some(
        "tip: `submit --await DUR` waits up to DUR for the outcome (the request stays queued after \
         it, unless interrupted); `--wait DUR` ends the request in error `timeout` if it is not \
         granted within DUR",
    )
}

/// The login a database URL names (libpq's default, the OS user, when it names none), for the
/// GRANT an error tells a DBA to run.
pub(crate) fn login_of(url: Option<&str>) -> String {
    url.and_then(|u| u.parse::<tokio_postgres::Config>().ok())
        .and_then(|c| c.get_user().map(str::to_string))
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "<your login>".to_string())
}

/// stderr for the log: a failed write (EPIPE, a full disk) drops the line and reports success,
/// so that logging can never fail or panic.
struct LossyStderr;

impl Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().lock().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
