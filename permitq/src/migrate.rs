//! The embedded schema and the run that applies it (`permitq migrate`, [`crate::Client::migrate`]).
//!
//! The schema has three parts, applied in this order by one transaction that first locks the
//! bookkeeping table `permitq.schema_migration` (SHARE ROW EXCLUSIVE: running migrate twice, or
//! twice at once, is safe: the second waits, then finds nothing to do; a role without permitq
//! grants cannot hold that lock):
//!
//! 1. the rules (`permitq.rule_*`), written from the constants of `src/rules.rs`: the versioned
//!    migrations' constraints call them;
//! 2. the versioned migrations, `schema/migrations/V<n>__<name>.sql`: DDL and data changes only
//!    (tables, indexes, types, roles, grants on tables), each applied once, in order;
//! 3. the schema files, `schema/functions/*.sql`: every function, trigger and view, each defined
//!    in exactly one file, with its grants; a file is applied again whenever its checksum
//!    changes, in the order of [`SCHEMA_FILES`] (dependencies first). Every function but the
//!    rules is private (EXECUTE revoked from PUBLIC) unless its file grants it.
//!
//! Checksums (SHA-256, computed by the server) are recorded for both. A database whose applied
//! migration differs from this build's file, or that has a migration this build does not know,
//! is refused with an error that says which, and nothing is applied. A database migrated by a
//! pre-release permitq (migrations V1 to V8) is upgraded in place once
//! (`schema/migrations/prerelease_upgrade.sql`).

use tokio_postgres::Client;

use crate::error::{Error, Result, SqlState};
use crate::sql;

/// One versioned migration, compiled into the binary.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct Migration {
    /// Version number, applied in ascending order.
    pub version: i32,
    /// Short name, from the file name.
    pub name: &'static str,
    /// The SQL.
    pub sql: &'static str,
}

/// Every versioned migration this build knows, oldest first.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "baseline",
        sql: include_str!("../schema/migrations/V1__baseline.sql"),
    },
    Migration {
        version: 2,
        name: "decision_times",
        sql: include_str!("../schema/migrations/V2__decision_times.sql"),
    },
    Migration {
        version: 3,
        name: "trust",
        sql: include_str!("../schema/migrations/V3__trust.sql"),
    },
    Migration {
        version: 4,
        name: "flat_cost",
        sql: include_str!("../schema/migrations/V4__flat_cost.sql"),
    },
    Migration {
        version: 5,
        name: "lease_grace",
        sql: include_str!("../schema/migrations/V5__lease_grace.sql"),
    },
    Migration {
        version: 6,
        name: "nested_limits",
        sql: include_str!("../schema/migrations/V6__nested_limits.sql"),
    },
    Migration {
        version: 7,
        name: "answers",
        sql: include_str!("../schema/migrations/V7__answers.sql"),
    },
    Migration {
        version: 8,
        name: "token_floor",
        sql: include_str!("../schema/migrations/V8__token_floor.sql"),
    },
    Migration {
        version: 9,
        name: "audit_bounds",
        sql: include_str!("../schema/migrations/V9__audit_bounds.sql"),
    },
    Migration {
        version: 10,
        name: "semaphore_delete",
        sql: include_str!("../schema/migrations/V10__semaphore_delete.sql"),
    },
    Migration {
        version: 11,
        name: "waiter_place",
        sql: include_str!("../schema/migrations/V11__waiter_place.sql"),
    },
    Migration {
        version: 12,
        name: "explain_last_release",
        sql: include_str!("../schema/migrations/V12__explain_last_release.sql"),
    },
    Migration {
        version: 13,
        name: "adaptive_capacity",
        sql: include_str!("../schema/migrations/V13__adaptive_capacity.sql"),
    },
    Migration {
        version: 14,
        name: "fairness_keys",
        sql: include_str!("../schema/migrations/V14__fairness_keys.sql"),
    },
    Migration {
        version: 15,
        name: "fairness_answers",
        sql: include_str!("../schema/migrations/V15__fairness_answers.sql"),
    },
    Migration {
        version: 16,
        name: "waiter_keys",
        sql: include_str!("../schema/migrations/V16__waiter_keys.sql"),
    },
    Migration {
        version: 17,
        name: "worker_max_hold",
        sql: include_str!("../schema/migrations/V17__worker_max_hold.sql"),
    },
];

/// One schema file: functions, triggers or views, re-applied when it changes.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct SchemaFile {
    /// Its path under `schema/functions/`, also its key in `permitq.schema_file`.
    pub path: &'static str,
    /// The SQL.
    pub sql: &'static str,
}

macro_rules! schema_files {
    ($($path:literal,)+) => {
        /// Every schema file, in the order they are applied: each after those it calls.
        pub const SCHEMA_FILES: &[SchemaFile] = &[$(SchemaFile {
            path: $path,
            sql: include_str!(concat!("../schema/functions/", $path)),
        },)+];
    };
}

schema_files! {
    "input_checks.sql",
    "ownership.sql",
    "queue_order.sql",
    "fairness.sql",
    "fencing_tokens.sql",
    "templates.sql",
    "nesting.sql",
    "rate_windows.sql",
    "error_details.sql",
    "notifications.sql",
    "request_triggers.sql",
    "capacity_audit.sql",
    "submit.sql",
    "release.sql",
    "heartbeat.sql",
    "fence.sql",
    "set_capacity.sql",
    "adaptive.sql",
    "claim.sql",
    "batch_semaphores.sql",
    "heads.sql",
    "next_batch.sql",
    "decision_outcome.sql",
    "sweeps.sql",
    "retention.sql",
    "views.sql",
    "explain.sql",
    "workers.sql",
}

/// The schema file named `path`, if this build has it.
pub fn schema_file(path: &str) -> Option<&'static SchemaFile> {
    SCHEMA_FILES.iter().find(|f| f.path == path)
}

/// The key of the generated rules in `permitq.schema_file`.
const RULES_PATH: &str = "rules (generated)";

/// The pre-release migrations a database may still record, by version: upgraded in place.
const PRERELEASE: [&str; 8] = [
    "core",
    "leases",
    "hot_path",
    "robustness",
    "operators",
    "cached_plans",
    "failover_tokens",
    "templates_rate_limits_priorities",
];

/// What one migrate run applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Migrated {
    /// The versioned migrations applied, in order.
    pub versions: Vec<i32>,
    /// The schema files applied (new or changed), in order.
    pub files: Vec<String>,
    /// Whether a pre-release schema was upgraded in place.
    pub upgraded_prerelease: bool,
}

impl Migrated {
    /// True when the database was already current.
    pub fn is_empty(&self) -> bool {
        self.versions.is_empty() && self.files.is_empty() && !self.upgraded_prerelease
    }
}

/// How often a run that waited too long for a lock (another session holds one it needs) is tried
/// again.
const LOCK_RETRIES: u32 = 5;

/// Applies what the database lacks, in one transaction.
pub(crate) async fn migrate(client: &mut Client) -> Result<Migrated> {
    let mut attempt = 0;
    loop {
        match migrate_once(client).await {
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) && attempt < LOCK_RETRIES => {
                attempt += 1;
                tracing::warn!(attempt, error = %e, "migrate waited too long for a lock; trying again");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => {
                return Err(Error::config(format!(
                    "cannot migrate: another session holds a lock on a permitq table for longer \
                     than migrate waits ({e}; tried {} times): look for long or idle \
                     transactions in pg_stat_activity",
                    LOCK_RETRIES + 1
                )));
            }
            other => return other,
        }
    }
}

/// One run, retried once when a concurrent first run made the bookkeeping at the same moment.
async fn migrate_once(client: &mut Client) -> Result<Migrated> {
    let result = match migrate_locked(client).await {
        // Two first runs made the schema or the bookkeeping tables at the same moment: the
        // second, again, finds them.
        Err(e)
            if e.code().is_some_and(|c| {
                [
                    SqlState::UNIQUE_VIOLATION,
                    SqlState::DUPLICATE_SCHEMA,
                    SqlState::DUPLICATE_TABLE,
                    SqlState::DUPLICATE_OBJECT,
                ]
                .contains(c)
            }) =>
        {
            migrate_locked(client).await
        }
        other => other,
    };
    match result {
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            let owners = client.query_one(sql::MIGRATE_OWNERS, &[]).await.ok();
            // Whether anything needed migrating: a deploy step run as this login wonders.
            let current = is_current(client).await.unwrap_or(false);
            Err(explain_privilege(e, owners.as_ref(), current))
        }
        other => other,
    }
}

async fn migrate_locked(client: &mut Client) -> Result<Migrated> {
    roles_creatable(client).await?;
    let tx = client.transaction().await?;
    tx.batch_execute(sql::MIGRATION_TABLES).await?;
    tx.batch_execute(sql::MIGRATION_LOCK).await?;
    let mut migrated = Migrated::default();
    let applied = applied_versions(&tx).await?;
    let prerelease = is_prerelease(&applied)?;
    if !prerelease {
        check_known(&tx, &applied).await?;
    }

    let rules = crate::rules::schema_sql();
    apply_file_if_changed(&tx, RULES_PATH, &rules).await?;
    if prerelease {
        tx.batch_execute(include_str!("../schema/migrations/prerelease_upgrade.sql"))
            .await?;
        tx.execute(sql::FORGET_PRERELEASE_MIGRATIONS, &[]).await?;
        let baseline = &MIGRATIONS[0];
        tx.execute(
            sql::RECORD_MIGRATION,
            &[&baseline.version, &baseline.name, &baseline.sql],
        )
        .await?;
        migrated.upgraded_prerelease = true;
        tracing::info!("upgraded a pre-release schema in place");
    }
    let done: Vec<i32> = if prerelease {
        vec![MIGRATIONS[0].version]
    } else {
        applied.iter().map(|(v, _, _)| *v).collect()
    };
    for m in MIGRATIONS.iter().filter(|m| !done.contains(&m.version)) {
        tx.batch_execute(m.sql).await?;
        tx.execute(sql::RECORD_MIGRATION, &[&m.version, &m.name, &m.sql])
            .await?;
        tracing::info!(version = m.version, name = m.name, "applied migration");
        migrated.versions.push(m.version);
    }
    for file in SCHEMA_FILES {
        if apply_file_if_changed(&tx, file.path, file.sql).await? {
            tracing::info!(path = file.path, "applied schema file");
            migrated.files.push(file.path.to_string());
        }
    }
    tx.batch_execute(sql::FUNCTIONS_PRIVATE).await?;
    tx.execute(sql::RAISE_TOKEN_EPOCH, &[]).await?;
    tx.commit().await?;
    Ok(migrated)
}

/// The versioned migrations the database records: (version, name, checksum).
async fn applied_versions(
    tx: &tokio_postgres::Transaction<'_>,
) -> Result<Vec<(i32, String, Option<Vec<u8>>)>> {
    tx.query(sql::APPLIED_MIGRATIONS, &[])
        .await?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?)))
        .collect()
}

/// Whether the database was migrated by a pre-release permitq (refused unless it is complete).
fn is_prerelease(applied: &[(i32, String, Option<Vec<u8>>)]) -> Result<bool> {
    let names: Vec<(i32, &str)> = applied.iter().map(|(v, n, _)| (*v, n.as_str())).collect();
    if !names.contains(&(1, PRERELEASE[0])) {
        return Ok(false);
    }
    let complete: Vec<(i32, &str)> = (1..).zip(PRERELEASE).collect();
    if names == complete {
        Ok(true)
    } else {
        Err(Error::config(format!(
            "the database has an incomplete pre-release permitq schema (migrations {:?}): \
             migrate it with the permitq release that made it first, or drop the permitq \
             schema and migrate again",
            names.iter().map(|(v, _)| v).collect::<Vec<_>>()
        )))
    }
}

/// Refuses a database with a migration this build does not know or whose file changed.
async fn check_known(
    tx: &tokio_postgres::Transaction<'_>,
    applied: &[(i32, String, Option<Vec<u8>>)],
) -> Result<()> {
    for (version, name, recorded) in applied {
        let Some(m) = MIGRATIONS.iter().find(|m| m.version == *version) else {
            return Err(Error::config(format!(
                "the database has migration {version} ({name}), which this build of permitq does not know: upgrade permitq"
            )));
        };
        let expected: Vec<u8> = tx.query_one(sql::CHECKSUM, &[&m.sql]).await?.try_get(0)?;
        if recorded.as_deref() != Some(expected.as_slice()) {
            return Err(Error::config(format!(
                "migration {version} ({name}) was edited after it was applied: its checksum in the database is {} but this build's is {}; restore the original file or migrate a fresh database",
                recorded.as_deref().map_or_else(|| "missing".to_string(), hex),
                hex(&expected)
            )));
        }
    }
    Ok(())
}

/// Runs a schema file when the database records another checksum for it (or none); true if
/// it ran.
async fn apply_file_if_changed(
    tx: &tokio_postgres::Transaction<'_>,
    path: &str,
    body: &str,
) -> Result<bool> {
    let changed: bool = tx
        .query_one(sql::SCHEMA_FILE_CHANGED, &[&path, &body])
        .await?
        .try_get(0)?;
    if changed {
        tx.batch_execute(body).await?;
        tx.execute(sql::RECORD_SCHEMA_FILE, &[&path, &body]).await?;
    }
    Ok(changed)
}

/// Whether every migration and schema file of this build is applied, unchanged, and none newer.
pub(crate) async fn is_current(client: &tokio_postgres::Client) -> Result<bool> {
    let versions: Vec<i32> = MIGRATIONS.iter().map(|m| m.version).collect();
    let mut paths = vec![RULES_PATH.to_string()];
    let mut bodies = vec![crate::rules::schema_sql()];
    for file in SCHEMA_FILES {
        paths.push(file.path.to_string());
        bodies.push(file.sql.to_string());
    }
    Ok(client
        .query_typed_one(
            sql::SCHEMA_IS_CURRENT,
            &[
                (&versions, tokio_postgres::types::Type::INT4_ARRAY),
                (&paths, tokio_postgres::types::Type::TEXT_ARRAY),
                (&bodies, tokio_postgres::types::Type::TEXT_ARRAY),
            ],
        )
        .await?
        .try_get(0)?)
}

/// The roles migrate creates when they are missing: they are cluster-wide, and creating one
/// needs CREATEROLE. When some are missing and this login may not create them, one error lists
/// the statements a DBA runs, all of them, before anything is applied.
const ROLES: [&str; 4] = [
    "permitq_producer",
    "permitq_worker",
    "permitq_admin",
    "permitq_operator",
];

async fn roles_creatable(client: &Client) -> Result<()> {
    let row = client.query_one(sql::ROLES_MISSING, &[&&ROLES[..]]).await?;
    let (missing, may_create): (Vec<String>, bool) = (row.get(0), row.get(1));
    if missing.is_empty() || may_create {
        return Ok(());
    }
    let user: String = client
        .query_one("SELECT current_user::text", &[])
        .await?
        .get(0);
    Err(Error::config(format!(
        "permitq migrate needs the roles {}, and {user} may not create roles: run migrate once \
         as a role with CREATEROLE, or have a DBA run: {}",
        missing.join(", "),
        missing
            .iter()
            .map(|r| format!("CREATE ROLE {r} NOLOGIN;"))
            .collect::<Vec<_>>()
            .join(" ")
    )))
}

/// A missing privilege, said with what migrating needs and, from `owners`
/// ([`sql::MIGRATE_OWNERS`]), who owns what now: whom to migrate as, or whom to ask.
fn explain_privilege(e: Error, owners: Option<&tokio_postgres::Row>, current: bool) -> Error {
    let Some(db) = e.as_postgres().and_then(|p| p.as_db_error()) else {
        return e;
    };
    let who = owners.map_or(String::new(), |row| {
        let (user, db_owner, schema_owner, database): (String, String, Option<String>, String) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        match schema_owner {
            Some(owner) if owner != user => format!(
                ": {user} does not own the permitq schema, {owner} does (and {db_owner} the \
                 database): migrate as {owner} (the schema's owner is permitq's admin: hand it \
                 over only to a login meant to be one, by {owner} or a superuser running \
                 `ALTER SCHEMA permitq OWNER TO {user}`)"
            ),
            Some(_) => format!(
                ": {user} owns the permitq schema but may not change what it needs in the \
                 database, owned by {db_owner}: migrate as {db_owner}"
            ),
            None => format!(
                ": there is no permitq schema yet, and {user} may not create it in the \
                 database, owned by {db_owner}: migrate as {db_owner}, or have {db_owner} run \
                 `GRANT CREATE ON DATABASE {database} TO {user}`"
            ),
        }
    });
    let nothing_needed = if current {
        "Nothing needed migrating now: the schema is already up to date for this permitq (the \
         next upgrade will need the owner). "
    } else {
        ""
    };
    Error::config(format!(
        "cannot migrate: {}{}{who}. {nothing_needed}The migrating role must own the database or \
         the permitq schema (or have CREATE on the database), and needs CREATEROLE only while \
         the roles permitq_producer, permitq_worker, permitq_admin and permitq_operator do not \
         exist",
        db.message(),
        db.hint().map(|h| format!(" ({h})")).unwrap_or_default()
    ))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::MIGRATIONS;

    /// Every `V<n>__<name>.sql` under schema/migrations is in [`MIGRATIONS`], in order: a file
    /// left out would never run on a database migrated before (a fresh one would not notice).
    #[test]
    fn every_migration_file_is_listed_in_order() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/schema/migrations");
        let mut files: Vec<(i32, String)> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                let rest = name.strip_prefix('V')?.strip_suffix(".sql")?.to_string();
                let (version, label) = rest.split_once("__")?;
                Some((version.parse().ok()?, label.to_string()))
            })
            .collect();
        files.sort();
        let listed: Vec<(i32, String)> = MIGRATIONS
            .iter()
            .map(|m| (m.version, m.name.to_string()))
            .collect();
        assert_eq!(listed, files);
    }
}
