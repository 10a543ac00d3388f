//! `permitq`, the command line: a thin layer over the `permitq` library's [`permitq::Client`]
//! and [`permitq::Worker`], plus the tools that exercise them (`demo`, `bench`, `chaos`) and the
//! HTTP endpoints.
//!
//! Exit codes: 0 success; 1 runtime error (one line on stderr); 2 usage error (including input
//! the database rejects as invalid, SQLSTATE 22023); 3 `submit --await` ended in `error`, or
//! `heartbeat` found the lease lost; 4 `submit --await` still `new` when the await ran out.

mod args;
mod bench;
mod chaos;
mod commands;
mod demo;
mod error;
mod http;

use std::process::ExitCode;

use clap::Parser;

use crate::args::{Cli, Command};
use crate::error::{EXIT_RUNTIME, EXIT_USAGE};

/// Parses arguments, runs, and maps the outcome to an exit code. Never panics on any input.
fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EXIT_USAGE } else { 0 });
        }
    };
    let default_filter = match cli.command {
        Command::Worker(_) => "permitq=info,permitq_cli=info",
        Command::Chaos(_) => "permitq=error,permitq_cli=error",
        _ => "permitq=warn,permitq_cli=warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();

    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("permitq: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_RUNTIME);
        }
    };
    match runtime.block_on(commands::run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("permitq: {}", error::one_line(&e.to_string()));
            ExitCode::from(e.exit_code())
        }
    }
}
