//! Where `demo` and `bench` run: a throwaway PostgreSQL cluster, unless a database is named
//! explicitly with `--database-url` (`DATABASE_URL` alone is not enough: these tools write tens
//! of thousands of rows and hold permits). A named database must not hold permitq data already,
//! unless `--yes`; at the end the run removes what it created there (its semaphores, the
//! requests that name only those, the `bench` schema, and the permitq schema itself if the run
//! created it). Semaphores that existed before are left as they are.

use permitq_embedded_pg::EmbeddedPostgres;

use crate::error::{CliError, Result};

/// Is the permitq schema there; how many semaphores and requests; the highest ids.
const EXISTING_DATA: &str = "SELECT to_regclass('permitq.semaphore') IS NOT NULL";
const COUNTS: &str = "SELECT (SELECT count(*) FROM permitq.semaphore), \
     (SELECT count(*) FROM permitq.permit_request), \
     (SELECT coalesce(max(id), 0) FROM permitq.semaphore), \
     (SELECT coalesce(max(id), 0) FROM permitq.permit_request)";
/// Clean-up in a database that had permitq data: the requests created after the mark ($2) that
/// name only semaphores created after the mark ($1), then those semaphores. Workers are stopped
/// by then.
const CLEAN_UP_ROWS: &str = "
    WITH mine AS (
        SELECT r.id FROM permitq.permit_request r
        WHERE r.id > $2 AND NOT EXISTS (
            SELECT 1 FROM jsonb_object_keys(r.permits) k
            JOIN permitq.semaphore s ON s.name = k WHERE s.id <= $1)
    ),
    pending AS (DELETE FROM permitq.pending_release p WHERE p.request_id IN (SELECT id FROM mine))
    DELETE FROM permitq.permit_request r WHERE r.id IN (SELECT id FROM mine)";
const CLEAN_UP_SEMAPHORES: &str = "
    WITH created AS (
        SELECT s.id, s.name FROM permitq.semaphore s
        WHERE s.id > $1 AND NOT EXISTS (SELECT 1 FROM permitq.permit_request r
                                        WHERE r.permits ? s.name AND r.id <= $2)
    ),
    waiters AS (DELETE FROM permitq.waiter w WHERE w.semaphore_id IN (SELECT id FROM created)),
    pending AS (DELETE FROM permitq.pending_release p WHERE p.semaphore IN (SELECT name FROM created)),
    audit AS (DELETE FROM permitq.capacity_change c WHERE c.semaphore IN (SELECT name FROM created))
    DELETE FROM permitq.semaphore s WHERE s.id IN (SELECT id FROM created)";
const DROP_SCHEMAS: &str = "SET client_min_messages = warning; DROP SCHEMA IF EXISTS bench CASCADE";
const DROP_PERMITQ: &str = "DROP SCHEMA IF EXISTS permitq CASCADE";

/// The database a demo or bench run uses, and what to remove afterwards.
pub(crate) struct Scratch {
    /// Where to connect.
    pub(crate) url: String,
    /// Kept alive for the run; removed on drop unless kept.
    cluster: Option<EmbeddedPostgres>,
    /// For a named database: what was there before.
    mark: Option<Mark>,
}

struct Mark {
    schema_existed: bool,
    semaphore_id: i64,
    request_id: i64,
}

/// A throwaway cluster from `start_cluster` when `named` is None (to be left running when
/// `keep`: see [`Scratch::keep`]); else the named database, checked (see the module docs).
pub(crate) async fn open(
    named: Option<&str>,
    yes: bool,
    keep: bool,
    tool: &str,
    start_cluster: impl FnOnce() -> permitq_fleet::Result<EmbeddedPostgres> + Send + 'static,
) -> Result<Scratch> {
    let Some(url) = named else {
        errln!("no database named with --database-url: starting a throwaway PostgreSQL...");
        let cluster = tokio::task::spawn_blocking(start_cluster)
            .await
            .map_err(|e| CliError::runtime(format!("start-up task failed: {e}")))??;
        errln!(
            "PostgreSQL is up on 127.0.0.1:{} ({})",
            cluster.port(),
            if keep {
                "kept running afterwards (--keep): its DATABASE_URL is printed at the end"
            } else {
                "removed at the end"
            }
        );
        return Ok(Scratch {
            url: cluster.url("postgres"),
            cluster: Some(cluster),
            mark: None,
        });
    };
    let conn = permitq_embedded_pg::try_connect(url).await?;
    let schema_existed: bool = conn.query_one(EXISTING_DATA, &[]).await?.get(0);
    let (mut semaphores, mut requests, mut semaphore_id, mut request_id) = (0i64, 0i64, 0, 0);
    if schema_existed {
        let row = conn.query_one(COUNTS, &[]).await?;
        (semaphores, requests, semaphore_id, request_id) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
    }
    if semaphores + requests > 0 && !yes {
        return Err(CliError::usage(
            "database-url",
            format!(
                "the database already holds permitq data ({semaphores} semaphores, {requests} \
                 requests) and {tool} writes a lot there: pass --yes to run anyway (it removes \
                 only what it creates), or leave out --database-url for a throwaway cluster"
            ),
        ));
    }
    Ok(Scratch {
        url: url.to_string(),
        cluster: None,
        mark: Some(Mark {
            schema_existed,
            semaphore_id,
            request_id,
        }),
    })
}

impl Scratch {
    /// Drops what a run left in a throwaway cluster (the permitq schema and the bench's), so
    /// that a kept one starts empty. Nothing to do for a named database (`clean_up` did it).
    pub(crate) async fn empty(&self) -> Result<()> {
        if self.cluster.is_none() {
            return Ok(());
        }
        let conn = permitq_embedded_pg::try_connect(&self.url).await?;
        conn.batch_execute(&format!("{DROP_SCHEMAS}; {DROP_PERMITQ}"))
            .await?;
        Ok(())
    }

    /// Leaves a throwaway cluster running after this process: the command that stops and
    /// removes it, or `None` for a named database (nothing to keep).
    pub(crate) fn keep(&mut self) -> Option<String> {
        self.cluster.as_mut().map(EmbeddedPostgres::keep)
    }

    /// For a kept throwaway cluster: the command that starts it again after a stop.
    pub(crate) fn start_command(&self) -> Option<String> {
        self.cluster.as_ref().map(EmbeddedPostgres::start_command)
    }

    /// Removes what the run created in a named database (nothing to do for a throwaway one).
    pub(crate) async fn clean_up(&self) -> Result<()> {
        let Some(mark) = &self.mark else {
            return Ok(());
        };
        let mut conn = permitq_embedded_pg::try_connect(&self.url).await?;
        let tx = conn.transaction().await?;
        tx.batch_execute(DROP_SCHEMAS).await?;
        if mark.schema_existed {
            tx.execute(CLEAN_UP_ROWS, &[&mark.semaphore_id, &mark.request_id])
                .await?;
            tx.execute(CLEAN_UP_SEMAPHORES, &[&mark.semaphore_id, &mark.request_id])
                .await?;
        } else {
            tx.batch_execute(DROP_PERMITQ).await?;
        }
        tx.commit().await?;
        errln!("removed what this run created in the named database");
        Ok(())
    }
}
