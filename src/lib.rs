//! permitq: a distributed counting semaphore served through a PostgreSQL work queue.
//!
//! Producers submit *permit requests* (one row each, idempotent by `external_id`) naming one or
//! more semaphores with a count each. Any number of [`Worker`]s LISTEN for work, claim requests
//! with `FOR UPDATE SKIP LOCKED`, and grant a request only when every semaphore it names has
//! room, in one transaction, under semaphore row locks taken in id order. Holders release;
//! TTL leases with heartbeats reclaim permits from holders that died; fencing tokens let
//! downstream stores reject a holder whose lease ran out.
//!
//! The SQL API in `schema/` is the contract; this crate is a client for it ([`Client`]), the
//! worker ([`Worker`]), and the pure grant decision ([`decision::decide`]).
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

pub mod bench;
pub mod chaos;
pub mod cli;
pub mod client;
pub mod db;
pub mod decision;
pub mod demo;
pub mod embedded;
pub mod error;
pub mod lease;
pub mod listener;
pub mod maintenance;
pub mod metrics;
pub mod migrate;
pub mod report;
pub mod sql;
pub mod types;
pub mod worker;

pub use client::Client;
pub use error::{Error, Result, SqlState};
pub use lease::Lease;
pub use maintenance::OwnerLiveness;
pub use types::{
    CapacityChange, ErrorCode, PermitRequest, ReleaseOutcome, ReleaseReason, Request, Semaphore,
    State,
};
pub use worker::{Worker, WorkerConfig};
