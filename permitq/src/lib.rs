//! permitq: a distributed counting semaphore served through a PostgreSQL work queue.
//!
//! Producers submit *permit requests* (one row each, idempotent by `external_id`) naming one or
//! more semaphores with a count each. Any number of [`Worker`]s LISTEN for work, claim requests
//! with `FOR UPDATE SKIP LOCKED`, and grant a request only when every semaphore it names has
//! room, in one transaction, under semaphore row locks taken in id order. Holders release;
//! TTL leases with heartbeats reclaim permits from holders that died; fencing tokens let
//! downstream stores reject a holder whose lease ran out.
//!
//! The SQL API (the schema this crate migrates) is the contract any language can use; this
//! crate is its Rust side:
//!
//! | item | for |
//! |---|---|
//! | [`Client`] | producers, holders and operators: submit, status, wait, acquire, release, revoke, heartbeat, capacity, usage, holders, waiters, fencing |
//! | [`Lease`] | a held request that heartbeats itself and tells you when it is lost |
//! | [`Request`] | a request to submit, built with its methods |
//! | [`PermitRequest`], [`State`], [`ErrorCode`], [`ErrorDetail`], [`ReleaseReason`], [`ReleaseOutcome`] | a request as stored, where it is in its life and how it ended (and [`PermitRequest::outcome`], in words; [`shell_word`], a name as the commands it suggests type it) |
//! | [`Granting`], [`WorkerSeen`] | whether anything is granting: the workers that run ([`Client::granting`], [`Client::workers`]) |
//! | [`Semaphore`], [`CapacityChange`] | a semaphore, and its capacity audit |
//! | [`Finding`] | a check of the cluster's hardening against co-tenants ([`Client::hardening`], `permitq doctor`) |
//! | [`SemaphoreUsage`], [`Holder`], [`Waiter`] | what operators watch: exact use, who holds, who waits |
//! | [`Explanation`], [`SemaphoreWait`], [`BlockingHolder`] | why a request waits ([`Client::explain`]) |
//! | [`Worker`], [`WorkerConfig`], [`WorkerHealth`], [`MaintenanceConfig`], [`OwnerLiveness`] | embedding a worker in your own process (or run `permitq worker`) |
//! | [`PRIORITY_RANGE`], [`AGING_STEP`], [`MAX_DURATION`], [`MAX_NAME_LENGTH`], [`MAX_SEMAPHORES_PER_REQUEST`], [`MAX_INSTANCES`], [`MAX_NESTING_DEPTH`], [`NOTIFY_QUEUE_LIMIT`] | the bounds and rules the schema shares, stated once |
//! | [`DURABILITY_BARRIER`] | the statement that confirms an outcome you read has reached the synchronous standby (for SQL clients and raw listeners; [`Client`] runs it itself) |
//! | [`migrate`] | the embedded schema: versioned migrations and schema files, applied by checksum |
//! | [`decision_model`] | the pure grant decision the workers run, for the protocol's model checker (not a stable interface) |
//! | [`Error`], [`Result`], [`SqlState`], [`UnknownValue`] | one opaque error that tells you its SQLSTATE and whether to retry; a string that names no enum value |
//!
//! ```no_run
//! use std::time::Duration;
//! use permitq::{Client, Request, Worker, WorkerConfig};
//!
//! # async fn run() -> permitq::Result<()> {
//! let url = "postgres://postgres@127.0.0.1/app";
//! let client = Client::connect(url).await?;
//! client.migrate().await?;
//! client.set_capacity("gpu", 2, None).await?;
//!
//! // Usually a separate process: `permitq worker`.
//! let worker = Worker::connect(url, WorkerConfig::default())?;
//! tokio::spawn(worker.run(std::future::pending()));
//!
//! let lease = client
//!     .acquire(&Request::new("train-7").permit("gpu", 1).ttl(Duration::from_secs(30)),
//!              Duration::from_secs(10))
//!     .await?;
//! println!("granted, fencing token {}", lease.fencing_token());
//! lease.release().await?;
//! # Ok(()) }
//! ```

mod adaptive;
mod client;
mod db;
mod decision;
mod error;
mod explain;
mod fairness;
mod hardening;
mod lease;
mod listener;
mod maintenance;
pub mod migrate;
mod outcome;
mod presence;
mod rules;
mod sql;
mod types;
mod usage;
mod worker;

pub use adaptive::{
    next_capacity, AdaptiveLimit, Algorithm, Memory, Outcome, Signals, QUEUEING, TOLERANCE,
};
pub use client::Client;
pub use error::{Error, Result, SqlState};
pub use explain::{BlockingHolder, Explanation, SemaphoreWait};
pub use fairness::{shown_key, KeyShare};
pub use hardening::Finding;
pub use lease::Lease;
pub use maintenance::{MaintenanceConfig, OwnerLiveness};
pub use outcome::{shell_word, AdaptiveBound, ErrorDetail};
pub use presence::{Granting, WorkerSeen};
pub use rules::{
    AGING_STEP, FAIRNESS_WEIGHT_RANGE, MAX_DURATION, MAX_FAIRNESS_KEY_LENGTH, MAX_INSTANCES,
    MAX_NAME_LENGTH, MAX_NESTING_DEPTH, MAX_SEMAPHORES_PER_REQUEST, NOTIFY_QUEUE_LIMIT,
    PRIORITY_RANGE,
};
pub use sql::DURABILITY_BARRIER;
pub use types::{
    CapacityChange, ErrorCode, PermitRequest, ReleaseOutcome, ReleaseReason, Request, Semaphore,
    SemaphoreSettings, State, UnknownValue,
};
pub use usage::{Holder, SemaphoreUsage, Waiter};
pub use worker::{Worker, WorkerConfig, WorkerHealth};

/// The grant decision the workers run, a pure function: exposed for the protocol's model
/// (`permitq-model`, which checks every interleaving of workers, holders, sweeps and failover
/// around this very function) and for anyone who wants to test it. Not a stable interface.
pub mod decision_model {
    pub use crate::decision::{
        charges, decide, order_mattered, without_room, Candidate, Decision, Head, Rank,
        SemaphoreView, Verdict,
    };
}

/// The README's Rust example, compiled with the doctests (`no_run`: it needs a database).
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
