//! Embedded, versioned schema migrations (`schema/V<n>__<name>.sql`).
//!
//! `permitq migrate` applies the ones a database lacks, each in its own transaction, under a
//! session advisory lock: running it twice, or twice at once, is safe (the second waits, then
//! finds nothing to do).

use tokio_postgres::Client;

use crate::error::Result;

/// One migration file, compiled into the binary.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Version number, applied in ascending order.
    pub version: i32,
    /// Short name, from the file name.
    pub name: &'static str,
    /// The SQL.
    pub sql: &'static str,
}

/// Every migration this build knows, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "core",
        sql: include_str!("../schema/V1__core.sql"),
    },
    Migration {
        version: 2,
        name: "leases",
        sql: include_str!("../schema/V2__leases.sql"),
    },
];

/// Advisory lock key taken while migrating ("permitq" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x0070_6572_6d69_7471;

/// Applies the missing migrations and returns the versions it applied (empty: already current).
/// Use a dedicated connection: the lock is held by the session.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>> {
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK_KEY])
        .await?;
    let result = apply_missing(client).await;
    let unlock = client
        .execute("SELECT pg_advisory_unlock($1)", &[&MIGRATION_LOCK_KEY])
        .await;
    let applied = result?;
    unlock?;
    Ok(applied)
}

async fn apply_missing(client: &mut Client) -> Result<Vec<i32>> {
    client
        .batch_execute(
            "SET client_min_messages = warning;
             CREATE SCHEMA IF NOT EXISTS permitq;
             CREATE TABLE IF NOT EXISTS permitq.schema_migration (
                 version    integer PRIMARY KEY,
                 name       text NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             );",
        )
        .await?;
    let done: Vec<i32> = client
        .query("SELECT version FROM permitq.schema_migration", &[])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut applied = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        let tx = client.transaction().await?;
        tx.batch_execute(m.sql).await?;
        tx.execute(
            "INSERT INTO permitq.schema_migration (version, name) VALUES ($1, $2)",
            &[&m.version, &m.name],
        )
        .await?;
        tx.commit().await?;
        tracing::info!(version = m.version, name = m.name, "applied migration");
        applied.push(m.version);
    }
    Ok(applied)
}
