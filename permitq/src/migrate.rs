//! Embedded, versioned schema migrations (`schema/V<n>__<name>.sql`).
//!
//! `permitq migrate` applies the ones a database lacks, each in its own transaction, under a
//! session advisory lock: running it twice, or twice at once, is safe (the second waits, then
//! finds nothing to do).

use tokio_postgres::Client;

use crate::error::{Error, Result, SqlState};
use crate::sql;

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
    Migration {
        version: 3,
        name: "hot_path",
        sql: include_str!("../schema/V3__hot_path.sql"),
    },
    Migration {
        version: 4,
        name: "robustness",
        sql: include_str!("../schema/V4__robustness.sql"),
    },
    Migration {
        version: 5,
        name: "operators",
        sql: include_str!("../schema/V5__operators.sql"),
    },
    Migration {
        version: 6,
        name: "cached_plans",
        sql: include_str!("../schema/V6__cached_plans.sql"),
    },
    Migration {
        version: 7,
        name: "failover_tokens",
        sql: include_str!("../schema/V7__failover_tokens.sql"),
    },
    Migration {
        version: 8,
        name: "templates_rate_limits_priorities",
        sql: include_str!("../schema/V8__templates_rate_limits_priorities.sql"),
    },
];

/// V1's first statement, redundant once the bookkeeping table's schema exists.
const V1_CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS permitq;";

/// Advisory lock key taken while migrating ("permitq" in ASCII).
const MIGRATION_LOCK_KEY: i64 = 0x0070_6572_6d69_7471;

/// Applies the missing migrations and returns the versions it applied (empty: already current).
/// Use a dedicated connection: the lock is held by the session.
///
/// Every applied migration's checksum (SHA-256 of its SQL) is recorded; a database whose applied
/// migration differs from this build's file (edited after it was applied), or that has a
/// migration this build does not know (a newer permitq migrated it), is refused with an error
/// that says which, and nothing is applied.
pub async fn migrate(client: &mut Client) -> Result<Vec<i32>> {
    client
        .execute(sql::MIGRATION_LOCK, &[&MIGRATION_LOCK_KEY])
        .await?;
    let result = apply_missing(client).await.map_err(explain_privilege);
    let unlock = client
        .execute(sql::MIGRATION_UNLOCK, &[&MIGRATION_LOCK_KEY])
        .await;
    let applied = result?;
    unlock?;
    Ok(applied)
}

async fn apply_missing(client: &mut Client) -> Result<Vec<i32>> {
    client.batch_execute(sql::MIGRATION_TABLE).await?;
    let mut done = Vec::new();
    for row in client.query(sql::APPLIED_MIGRATIONS, &[]).await? {
        let (version, name, recorded): (i32, String, Option<Vec<u8>>) =
            (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
        let Some(m) = MIGRATIONS.iter().find(|m| m.version == version) else {
            return Err(Error::config(format!(
                "the database has migration {version} ({name}), which this build of permitq does not know: upgrade permitq"
            )));
        };
        let expected: Vec<u8> = client
            .query_one(sql::MIGRATION_CHECKSUM, &[&m.sql])
            .await?
            .try_get(0)?;
        match recorded {
            // Applied before checksums were recorded: record this build's.
            None => {
                client
                    .execute(sql::RECORD_MIGRATION_CHECKSUM, &[&version, &m.sql])
                    .await?;
            }
            Some(recorded) if recorded != expected => {
                return Err(Error::config(format!(
                    "migration {version} ({name}) was edited after it was applied: its checksum in the database is {} but this build's is {}; restore the original file or migrate a fresh database",
                    hex(&recorded),
                    hex(&expected)
                )));
            }
            Some(_) => {}
        }
        done.push(version);
    }
    let mut applied = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        let tx = client.transaction().await?;
        // The schema exists by now (see MIGRATION_TABLE). V1's own `CREATE SCHEMA IF NOT
        // EXISTS` would still demand CREATE on the database, so it is skipped; the checksum
        // stays that of the file as written.
        tx.batch_execute(&m.sql.replacen(V1_CREATE_SCHEMA, "", 1))
            .await?;
        tx.execute(sql::RECORD_MIGRATION, &[&m.version, &m.name, &m.sql])
            .await?;
        tx.commit().await?;
        tracing::info!(version = m.version, name = m.name, "applied migration");
        applied.push(m.version);
    }
    Ok(applied)
}

/// A missing privilege, said with what migrating needs.
fn explain_privilege(e: Error) -> Error {
    let Some(db) = e.as_postgres().and_then(|p| p.as_db_error()) else {
        return e;
    };
    if db.code() != &SqlState::INSUFFICIENT_PRIVILEGE {
        return e;
    }
    Error::config(format!(
        "cannot migrate: {}{}. The migrating role must own the database or the permitq schema \
         (or have CREATE on the database), and needs CREATEROLE only while the roles \
         permitq_producer, permitq_worker and permitq_admin do not exist",
        db.message(),
        db.hint().map(|h| format!(" ({h})")).unwrap_or_default()
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
