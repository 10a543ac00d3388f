//! The `permitq` binary's integration tests against real PostgreSQL: the CLI contract, and
//! worker processes under faults (kill -9, dropped connections, database restarts).

mod cli;
mod faults;
