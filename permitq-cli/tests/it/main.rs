//! The `permitq` binary's integration tests against real PostgreSQL: the CLI contract, and
//! worker processes under faults (kill -9, dropped connections, database restarts), and what
//! operators use (top in tmux, the HTTP endpoints, the status page in headless Chromium).

mod answers;
mod answers_newcomer;
mod cli;
mod clients;
mod examples;
mod faults;
mod http;
mod network;
mod operators;
mod pooler;
