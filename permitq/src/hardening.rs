//! Cluster hardening against co-tenants (`permitq doctor`): what a role with no permitq grant,
//! or a producer, could exhaust that permitq shares with the whole cluster, and the SQL a DBA
//! runs to prevent it. Each [`Finding`] is one check of the connected database and cluster.

use serde::Serialize;

use crate::client::Client;
use crate::error::Result;
use crate::sql;

/// One hardening check: whether it holds, what was found, and the SQL that makes it hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Finding {
    /// What is checked, in a few words.
    pub check: String,
    /// Whether it holds.
    pub ok: bool,
    /// What was found.
    pub detail: String,
    /// The SQL to run when it does not hold: as a superuser (REVOKE on `pg_catalog`'s functions
    /// needs their owner; ALTER ROLE needs CREATEROLE), not as a permitq admin.
    pub fix: Option<String>,
}

impl Client {
    /// Checks the cluster against what co-tenants could exhaust: PUBLIC's advisory locks and
    /// temporary tables (the shared lock table), the lock table's size, and each producer login's connection limit
    /// and `idle_in_transaction_session_timeout`.
    pub async fn hardening(&self) -> Result<Vec<Finding>> {
        let conn = self.conn().await?;
        let mut findings = Vec::new();

        let advisory: Vec<String> = conn
            .query(sql::PUBLIC_ADVISORY_LOCKS, &[])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        findings.push(Finding {
            check: "advisory locks".into(),
            ok: advisory.is_empty(),
            detail: if advisory.is_empty() {
                "PUBLIC may not take advisory locks (permitq takes none)".into()
            } else {
                format!(
                    "any login may take advisory locks, a thousand at a time, until the shared \
                     lock table is full and every submit and release fails ({} functions)",
                    advisory.len()
                )
            },
            fix: (!advisory.is_empty()).then(|| {
                format!(
                    "REVOKE EXECUTE ON FUNCTION {} FROM PUBLIC; -- then GRANT EXECUTE on them to \
                     the logins of your own applications that take advisory locks (migration \
                     tools such as sqlx, Flyway and Liquibase do), or they stop working",
                    advisory.join(", ")
                )
            }),
        });

        let row = conn.query_one(sql::PUBLIC_TEMP, &[]).await?;
        let (temp, database): (bool, String) = (row.get(0), row.get(1));
        findings.push(Finding {
            check: "temporary tables".into(),
            ok: !temp,
            detail: if temp {
                "any login may create temporary tables here, thousands in one transaction, each \
                 holding a slot of the shared lock table (permitq creates none)"
                    .into()
            } else {
                "PUBLIC may not create temporary tables here".into()
            },
            fix: temp.then(|| {
                format!(
                    "REVOKE TEMPORARY ON DATABASE {database} FROM PUBLIC; -- GRANT it back to \
                     the logins of your own applications that need it"
                )
            }),
        });

        let row = conn.query_one(sql::LOCK_TABLE_SIZE, &[]).await?;
        let (per_transaction, slots): (i32, i64) = (row.get(0), row.get(1));
        findings.push(Finding {
            check: "lock table".into(),
            ok: per_transaction >= 64,
            detail: format!(
                "max_locks_per_transaction = {per_transaction}: the shared lock table holds \
                 about {slots} locks"
            ),
            fix: (per_transaction < 64).then(|| {
                "ALTER SYSTEM SET max_locks_per_transaction = 64; -- then restart the server"
                    .to_string()
            }),
        });

        for row in conn.query(sql::PRODUCER_LOGINS, &[]).await? {
            let (login, limit, idle): (String, i32, Option<String>) =
                (row.get(0), row.get(1), row.get(2));
            findings.push(Finding {
                check: format!("connections of {login}"),
                ok: limit >= 0,
                detail: if limit >= 0 {
                    format!("at most {limit} connections")
                } else {
                    "no connection limit: it can take every connection slot".into()
                },
                fix: (limit < 0).then(|| format!("ALTER ROLE {login} CONNECTION LIMIT 50;")),
            });
            let bounded = idle.as_deref().is_some_and(|v| v != "0");
            findings.push(Finding {
                check: format!("idle transactions of {login}"),
                ok: bounded,
                detail: match &idle {
                    Some(v) if bounded => format!("idle_in_transaction_session_timeout = {v}"),
                    _ => "a transaction left open holds the wake gate and the vacuum horizon \
                          without end (idle_in_transaction_session_timeout is off)"
                        .into(),
                },
                fix: (!bounded).then(|| {
                    format!("ALTER ROLE {login} SET idle_in_transaction_session_timeout = '60s';")
                }),
            });
        }
        Ok(findings)
    }
}
