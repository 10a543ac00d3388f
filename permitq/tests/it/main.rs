//! The library's integration tests against real PostgreSQL (one test binary: link time).

mod adaptive;
mod explain;
mod failover;
mod fairness;
mod leases;
mod nesting;
mod nesting_tree;
mod notifications;
mod patroni;
mod priorities;
mod rate_limits;
mod robustness;
mod roles;
mod schema;
mod sql_api;
mod templates;
mod tokens;
mod trust;
mod worker;
