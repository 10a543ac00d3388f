//! One pass of the claim loop, in batch transactions.
//!
//! Each batch is one transaction: claim what could be granted (`FOR UPDATE SKIP LOCKED`, lock
//! order step 1), lock the union of the batch's semaphores and of those with pending releases in
//! id order and fold the releases into `used` (step 2), read the heads of the fair ones,
//! [`decide`], write the outcome set-based and commit. Unexamined requests are claimed in place
//! in line order, best placed first, and the cursor moves past the last one claimed: rows
//! another worker holds are left behind (a line in the sand).
//! A pass ends with a batch that claims nothing or changes nothing.
//!
//! Failure isolation: a request the database reports as undecidable (`problem`) fails as
//! `invalid` within its batch. A batch that fails anyway on a data error (SQLSTATE class 22 or
//! 23, whatever a stored row made it do) is counted (`permitq_failed_batches_total`) and its
//! requests are decided one per transaction; one that fails alone is settled as `invalid` and
//! logged with its external_id. Nothing a row contains stops the others.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use tracing::Instrument;

use super::{PassOutcome, Worker};
use crate::db::Backoff;
use crate::decision::{
    decide, order_mattered, without_room, Candidate, Decision, Head, SemaphoreView, Verdict,
};
use crate::error::{Error, Result};
use crate::sql;
use crate::types::ErrorCode;

/// What a batch claims.
#[derive(Debug, Clone, Copy)]
enum Claim<'a> {
    /// Unexamined requests after this cursor, and the first waiters of semaphores with room:
    /// claimed, their semaphores locked and their heads read in one round trip
    /// (`permitq.next_batch`).
    After(i64),
    /// The same, a step a round trip: after [`Claim::After`] failed on a data error, which
    /// requests the batch claimed is known only this way.
    AfterStepwise(i64),
    /// Exactly these requests, if still `new` (isolating a failed batch).
    Only(&'a [i64]),
}

/// A failure that a stored row can cause (data exceptions, integrity violations), as opposed to
/// the database being unreachable, overloaded or on another schema version.
///
/// A token drawn twice (the token sequence was set back under a running worker) is not: the
/// batch is retried, and its next attempt raises the epoch (functions/fencing_tokens.sql), so
/// no valid request ends `invalid` for it.
fn caused_by_a_row(e: &Error) -> bool {
    let token_drawn_twice = e
        .as_postgres()
        .and_then(tokio_postgres::Error::as_db_error)
        .is_some_and(|d| d.constraint() == Some("permit_request_fencing_token_key"));
    !token_drawn_twice
        && e.code()
            .is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("23"))
}

/// How often at most a worker runs a transaction only to fold pending releases.
const FOLD_EVERY: Duration = Duration::from_millis(10);

/// When a worker last ran a fold of its own, and when the next one is owed.
#[derive(Debug)]
pub(crate) struct FoldClock {
    last: Instant,
    /// When a fold is owed (None: none is).
    owed_at: Option<Instant>,
    /// How long after a check the next fold is owed when releases were left to fold, or
    /// producers in flight: [`FOLD_EVERY`], doubled at each such check in a row, up to the poll
    /// interval (a producer idle in a transaction holds the gate: a pass a second, then).
    backoff: Duration,
}

impl Default for FoldClock {
    fn default() -> Self {
        Self {
            last: Instant::now(),
            owed_at: None,
            backoff: FOLD_EVERY,
        }
    }
}

impl Worker {
    fn fold_clock(&self) -> std::sync::MutexGuard<'_, FoldClock> {
        self.fold_clock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether a pass that claimed nothing folds now; when not, a fold is owed.
    fn fold_due(&self) -> bool {
        let mut clock = self.fold_clock();
        if clock.last.elapsed() < FOLD_EVERY {
            let due = clock.last + FOLD_EVERY;
            clock.owed_at = Some(clock.owed_at.map_or(due, |at| at.min(due)));
            return false;
        }
        clock.last = Instant::now();
        clock.owed_at = None;
        true
    }

    /// When a fold is owed: how long until it is due. A sleeping worker wakes then, so
    /// releases that came close together are folded within `FOLD_EVERY` (or the check's
    /// back-off), not a poll later.
    pub(crate) fn fold_owed_in(&self) -> Option<Duration> {
        self.fold_clock()
            .owed_at
            .map(|at| at.saturating_duration_since(Instant::now()))
    }

    /// Before a worker that found nothing to do naps: whether a fold may have left a release
    /// unfolded that no notification will announce. A release that saw another release of its
    /// semaphores still to fold does not notify (permitq.wake_workers_for_release), counting on
    /// the fold that one woke; a fold that ran before it committed (an idle one, or a batch's)
    /// did not see it. Once the wake gate is free, every such producer has committed, and a
    /// read of the pending releases after it sees theirs: none left, and nothing is owed; else
    /// a fold is owed, backing off while producers stay in flight.
    pub(crate) async fn check_folds(&self) -> Result<()> {
        let conn = self.pool.get().await?;
        let gate_free: bool = conn.query_one(sql::WAKE_GATE_FREE, &[]).await?.get(0);
        let left = if gate_free {
            let probe = conn.prepare_cached(sql::RELEASES_PENDING).await?;
            conn.query_one(&probe, &[]).await?.get(0)
        } else {
            true
        };
        let mut clock = self.fold_clock();
        if left {
            let after = clock.backoff;
            let due = Instant::now() + after;
            // A fold owed sooner (deferred by a pass) stays owed then.
            clock.owed_at = Some(match clock.owed_at {
                Some(at) if at > Instant::now() => at.min(due),
                _ => due,
            });
            clock.backoff = (after * 2).min(self.config.poll_interval).max(FOLD_EVERY);
        } else {
            // Nothing to fold, and nobody in flight who may have counted on a fold.
            clock.owed_at = None;
            clock.backoff = FOLD_EVERY;
        }
        Ok(())
    }

    /// Runs one pass, retrying each batch on transient errors. Stops early when `stop` becomes
    /// true (between transactions, never inside one).
    pub(crate) async fn run_pass(&self, stop: &watch::Receiver<bool>) -> Result<PassOutcome> {
        let span = tracing::debug_span!("pass", worker = %self.config.id);
        async {
            let started = Instant::now();
            let mut total = PassOutcome::default();
            // The line in the sand: the place in line of the last unexamined request claimed.
            let mut cursor = i64::MAX;
            while !*stop.borrow() {
                let Some((last_place, outcome)) = self.run_batch_isolating(cursor).await? else {
                    break;
                };
                cursor = cursor.min(last_place);
                total.add(outcome);
                // A long pass (a deep backlog) is progress too: readiness counts each batch.
                self.health.pass_done();
                if !outcome.did_work() {
                    break;
                }
            }
            metrics::histogram!("permitq_pass_seconds").record(started.elapsed().as_secs_f64());
            tracing::debug!(
                batches = total.batches,
                granted = total.granted,
                errored = total.errored,
                waiting = total.waiting,
                queued = total.queued,
                elapsed_ms = started.elapsed().as_secs_f64() * 1000.0,
                "pass done"
            );
            Ok(total)
        }
        .instrument(span)
        .await
    }

    /// One batch after `cursor`; when it fails on a data error, its requests one at a time.
    async fn run_batch_isolating(&self, cursor: i64) -> Result<Option<(i64, PassOutcome)>> {
        let failed = match self.run_batch_retrying(Claim::After(cursor)).await {
            Ok(done) => return Ok(done),
            // One call failed as a whole: again a step at a time, to learn what it claims.
            Err(failed) if caused_by_a_row(&failed.error) && failed.claimed.is_empty() => {
                match self.run_batch_retrying(Claim::AfterStepwise(cursor)).await {
                    Ok(done) => return Ok(done),
                    Err(failed) if caused_by_a_row(&failed.error) && !failed.claimed.is_empty() => {
                        failed
                    }
                    Err(failed) => return Err(failed.error),
                }
            }
            Err(failed) if caused_by_a_row(&failed.error) => failed,
            Err(failed) => return Err(failed.error),
        };
        let FailedBatch { error, claimed } = failed;
        metrics::counter!("permitq_failed_batches_total").increment(1);
        tracing::warn!(%error, requests = claimed.len(), "batch failed; deciding its requests one at a time");
        let mut total = PassOutcome::default();
        for (id, _) in &claimed {
            match self.run_batch_retrying(Claim::Only(&[*id])).await {
                Ok(Some((_, outcome))) => total.add(outcome),
                Ok(None) => {}
                Err(FailedBatch { error: e, .. }) if caused_by_a_row(&e) => {
                    match self.settle_invalid(*id, &e).await {
                        Ok(true) => total.add(PassOutcome {
                            batches: 1,
                            errored: 1,
                            ..PassOutcome::default()
                        }),
                        Ok(false) => {}
                        // It stays `new` and is passed over until the next pass; the rest flows.
                        Err(settle_error) => tracing::error!(request_id = id, %e, %settle_error,
                            "request failed a batch on its own and cannot be settled; skipped"),
                    }
                }
                Err(failed) => return Err(failed.error),
            }
        }
        let last_place = claimed
            .iter()
            .filter_map(|(_, unexamined_place)| *unexamined_place)
            .min()
            .unwrap_or(i64::MAX);
        Ok(Some((last_place, total)))
    }

    /// Ends a request that failed a batch on its own as `error` / `invalid`; true if it did.
    async fn settle_invalid(&self, id: i64, error: &Error) -> Result<bool> {
        let conn = self.pool.get().await?;
        let statement = conn.prepare_cached(sql::SETTLE_INVALID).await?;
        let problem = format!("it failed a worker's batch on its own: {error}");
        let external_id: Option<String> = conn
            .query_one(&statement, &[&id, &problem])
            .await?
            .try_get(0)?;
        let Some(external_id) = external_id else {
            return Ok(false);
        };
        metrics::counter!("permitq_request_errors_total", "code" => ErrorCode::Invalid.as_str())
            .increment(1);
        tracing::error!(%external_id, request_id = id, %error,
            "request failed a batch on its own; settled as error/invalid");
        Ok(true)
    }

    /// [`Worker::run_batch`], again on transient errors (with backoff, up to 8 times).
    async fn run_batch_retrying(&self, claim: Claim<'_>) -> BatchResult {
        let mut backoff = Backoff::new(Duration::from_millis(5), Duration::from_millis(500));
        loop {
            match self.run_batch(claim).await {
                Err(failed) if failed.error.is_retryable() && backoff.attempts() < 8 => {
                    metrics::counter!("permitq_batch_retries_total").increment(1);
                    tracing::debug!(error = %failed.error, "batch failed; retrying");
                    tokio::time::sleep(backoff.next_delay()).await;
                }
                other => return other,
            }
        }
    }

    /// One batch transaction. `None` when nothing could be claimed (after folding the pending
    /// releases), else the place in line of the last unexamined request it claimed
    /// ([`i64::MAX`] if none) and what it did.
    ///
    /// Statements are prepared once per connection, and BEGIN travels with the claim and COMMIT
    /// with the outcome (pipelined). A connection whose batch failed is not returned to the pool:
    /// it may still be inside the transaction.
    async fn run_batch(&self, claim: Claim<'_>) -> BatchResult {
        let started = Instant::now();
        let conn = self.pool.get().await.map_err(|e| FailedBatch {
            error: e.into(),
            claimed: Vec::new(),
        })?;
        let mut claimed = Vec::new();
        let read = match claim {
            Claim::After(cursor) => next_batch(&conn, cursor, self.config.batch_size)
                .await
                .map(|(rows, locked)| (rows, Some(locked))),
            _ => claim_rows(&conn, claim, self.config.batch_size)
                .await
                .map(|rows| (rows, None)),
        };
        let result = match read {
            Ok((rows, locked)) => {
                claimed = rows
                    .iter()
                    .map(|row| {
                        let examined = row.try_get::<_, bool>("examined").unwrap_or(true);
                        let place = row.try_get::<_, i64>("effective").ok();
                        (row.get("id"), place.filter(|_| !examined))
                    })
                    .collect();
                self.decide_claimed(&conn, &rows, locked, started).await
            }
            Err(e) => Err(e),
        };
        if let Err(error) = &result {
            if caused_by_a_row(error) {
                // A row's error leaves the connection sound: its locks go now, not when the
                // server notices the dropped connection. The retry that follows (stepwise, or
                // one at a time) claims with SKIP LOCKED, and passed over the rows this
                // transaction still held (seen in CI: a stepwise batch of one request).
                let _ = conn.batch_execute("ROLLBACK").await;
            }
        }
        result.map_err(|error| {
            drop(deadpool_postgres::Object::take(conn));
            FailedBatch { error, claimed }
        })
    }

    /// Steps 2 and 3 of a batch whose claim returned `rows`, to the commit; `locked` when
    /// step 2 came with the claim.
    async fn decide_claimed(
        &self,
        conn: &deadpool_postgres::Object,
        rows: &[tokio_postgres::Row],
        locked: Option<LockedBatch>,
        started: Instant,
    ) -> Result<Option<(i64, PassOutcome)>> {
        if rows.is_empty() {
            self.commit_idle(conn).await?;
            return Ok(None);
        }
        // This batch folds the pending releases of the semaphores it can lock; a fold owed
        // stays owed (what it could not lock, or what committed after it, is the check's: see
        // check_folds).
        let mut batch = ClaimedBatch::from_rows(rows)?;
        let mut locked = match locked {
            Some(locked) => locked,
            None => lock_semaphores_and_heads(conn, rows).await?,
        };
        // In line: the decision goes first in line first (see decision::Rank).
        batch.candidates.sort_by_key(Candidate::rank);
        let mut semaphores = locked.semaphores();
        let mut decision = decide(&semaphores, &batch.candidates);
        // A keyed semaphore's line is served by fairness key: decided on arrival order first,
        // the batch is placed by key (and decided again) unless placing would move none of its
        // requests and the decision left nothing waiting (functions/fairness.sql).
        if locked.keyed && (locked.moves_back || order_mattered(&semaphores, &decision)) {
            let placed = place_batch_by_keys(conn, rows, &without_room(&semaphores)).await?;
            for c in &mut batch.candidates {
                if let Some(place) = placed.ranked.get(&c.id) {
                    c.effective = *place;
                }
            }
            batch.candidates.sort_by_key(Candidate::rank);
            locked.heads = placed.heads;
            semaphores = locked.semaphores();
            decision = decide(&semaphores, &batch.candidates);
        }
        let outcome = Outcome::of(&decision, &batch);
        self.apply_and_commit(conn, &outcome).await?;
        let done = outcome.counts(batch.candidates.len());
        record(started, &done, &outcome, &batch);
        Ok(Some((batch.last_unexamined_place(), done)))
    }

    /// A batch that claimed nothing: commits, folding the pending releases (for the `released`
    /// events and an exact `used`) at most every [`FOLD_EVERY`], because the fold takes the
    /// semaphore locks that grants need. Grants fold anyway.
    async fn commit_idle(&self, conn: &deadpool_postgres::Object) -> Result<()> {
        if self.fold_due() {
            let fold = conn.prepare_cached(sql::FOLD_RELEASES).await?;
            let (folded, committed) =
                tokio::join!(conn.execute(&fold, &[]), conn.batch_execute("COMMIT"));
            folded?;
            committed?;
        } else {
            conn.batch_execute("COMMIT").await?;
        }
        Ok(())
    }

    /// Writes the outcome (if it changes anything) and commits, in one round trip.
    async fn apply_and_commit(
        &self,
        conn: &deadpool_postgres::Object,
        outcome: &Outcome,
    ) -> Result<()> {
        if outcome.granted.is_empty() && outcome.errored.is_empty() && outcome.queued.is_empty() {
            conn.batch_execute("COMMIT").await?;
            return Ok(());
        }
        let apply = conn.prepare_cached(sql::APPLY_DECISION).await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 7] = [
            &self.config.id,
            &outcome.granted,
            &outcome.errored,
            &outcome.codes,
            &outcome.queued,
            &outcome.charges,
            &outcome.details,
        ];
        let (applied, committed) =
            tokio::join!(conn.execute(&apply, &params), conn.batch_execute("COMMIT"));
        applied?;
        committed?;
        Ok(())
    }
}

/// What [`Worker::run_batch`] returns.
type BatchResult = std::result::Result<Option<(i64, PassOutcome)>, FailedBatch>;

/// A batch that failed, with the id of each request it had claimed and, if no worker had
/// examined it yet, its place in line.
struct FailedBatch {
    error: Error,
    claimed: Vec<(i64, Option<i64>)>,
}

/// Steps 1 and 2 (lock order steps 1 and 2) in one round trip with BEGIN: the claimed rows,
/// sorted by id, and the semaphores as the decision sees them (none when nothing was claimed).
async fn next_batch(
    conn: &deadpool_postgres::Object,
    cursor: i64,
    batch_size: i64,
) -> Result<(Vec<tokio_postgres::Row>, LockedBatch)> {
    let statement = conn.prepare_cached(sql::NEXT_BATCH).await?;
    // Keyed semaphores not placed in this call: the worker decides on arrival order first and
    // places only when placing would change something (Worker::decide_claimed).
    let place_keys = false;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
        [&cursor, &batch_size, &place_keys];
    let (begun, rows) = tokio::join!(conn.batch_execute("BEGIN"), conn.query(&statement, &params));
    begun?;
    let (mut claimed, mut locked) = (Vec::new(), LockedBatch::default());
    for row in rows? {
        if row_kind(&row)? == b'r' {
            claimed.push(row);
        } else {
            locked.read(&row, "permitq.next_batch")?;
        }
    }
    claimed.sort_by_key(|row| row.get::<_, i64>("id"));
    Ok((claimed, locked))
}

/// Step 1, lock order step 1: BEGIN and claim (`FOR UPDATE SKIP LOCKED`), in one round trip.
async fn claim_rows(
    conn: &deadpool_postgres::Object,
    claim: Claim<'_>,
    batch_size: i64,
) -> Result<Vec<tokio_postgres::Row>> {
    let rows = match claim {
        Claim::After(cursor) | Claim::AfterStepwise(cursor) => {
            let statement = conn.prepare_cached(sql::CLAIM_BATCH).await?;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&cursor, &batch_size];
            let (begun, rows) =
                tokio::join!(conn.batch_execute("BEGIN"), conn.query(&statement, &params));
            begun?;
            rows
        }
        Claim::Only(ids) => {
            let statement = conn.prepare_cached(sql::CLAIM_REQUESTS).await?;
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&ids];
            let (begun, rows) =
                tokio::join!(conn.batch_execute("BEGIN"), conn.query(&statement, &params));
            begun?;
            rows
        }
    };
    let mut rows = rows?;
    rows.sort_by_key(|row| row.get::<_, i64>("id"));
    Ok(rows)
}

/// The claimed requests, read for the decision.
struct ClaimedBatch {
    candidates: Vec<Candidate>,
    /// The ones no worker had examined yet.
    /// Where each was placed when claimed: the pass's cursor moves past the last of these (a
    /// keyed semaphore may rank it further back: functions/fairness.sql).
    unexamined: BTreeMap<i64, i64>,
    /// Seconds since each was submitted.
    ages: BTreeMap<i64, f64>,
    external_ids: BTreeMap<i64, String>,
    /// Why each undecidable one cannot be decided (the database's `permitq.request_problem`).
    problems: BTreeMap<i64, String>,
}

impl ClaimedBatch {
    fn from_rows(rows: &[tokio_postgres::Row]) -> Result<ClaimedBatch> {
        let mut batch = ClaimedBatch {
            candidates: Vec::with_capacity(rows.len()),
            unexamined: BTreeMap::new(),
            ages: BTreeMap::new(),
            external_ids: BTreeMap::new(),
            problems: BTreeMap::new(),
        };
        for row in rows {
            let id: i64 = row.try_get("id")?;
            let external_id: String = row.try_get("external_id")?;
            let claimed_at: i64 = row.try_get("effective")?;
            if !row.try_get::<_, bool>("examined")? {
                batch.unexamined.insert(id, claimed_at);
            }
            batch.ages.insert(id, row.try_get::<_, f64>("age_seconds")?);
            let problem: Option<String> = row.try_get("problem")?;
            if let Some(problem) = &problem {
                tracing::warn!(%external_id, request_id = id, %problem,
                    "request cannot be decided; failing it as error/invalid");
                batch.problems.insert(id, problem.clone());
            }
            let permits: serde_json::Value = row.try_get("permits")?;
            batch.candidates.push(Candidate {
                id,
                // Ranked where a keyed semaphore placed it (permitq.next_batch's `ranked`; a
                // stepwise claim has none, and ranks it where it was claimed).
                effective: row
                    .try_get::<_, Option<i64>>("ranked")
                    .ok()
                    .flatten()
                    .unwrap_or(claimed_at),
                permits: crate::db::permits_from_json(&permits),
                fail_fast: row.try_get("fail_fast")?,
                deadline_passed: row.try_get("deadline_passed")?,
                invalid: problem.is_some(),
            });
            batch.external_ids.insert(id, external_id);
        }
        Ok(batch)
    }

    /// The place in line of the last unexamined request claimed ([`i64::MAX`] if none).
    fn last_unexamined_place(&self) -> i64 {
        self.unexamined.values().copied().min().unwrap_or(i64::MAX)
    }
}

/// Step 2 for a batch claimed stepwise, lock order step 2: lock the semaphores that the claimed
/// `rows` name (and fold), then read the heads, in one call (`permitq.lock_batch_and_heads`, also
/// step 2 of `permitq.next_batch`); the semaphores as the decision sees them, each with its head.
async fn lock_semaphores_and_heads(
    conn: &deadpool_postgres::Object,
    rows: &[tokio_postgres::Row],
) -> Result<LockedBatch> {
    let (permits, places, ids) = batch_arrays(rows)?;
    let statement = conn.prepare_cached(sql::LOCK_BATCH_AND_HEADS).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&permits, &places, &ids];
    let mut locked = LockedBatch::default();
    for row in conn.query(&statement, &params).await? {
        locked.read(&row, "permitq.lock_batch_and_heads")?;
    }
    Ok(locked)
}

/// The claimed `rows`' permits, places in line (as claimed) and ids, in one order: what step 2
/// and step 2b take.
#[allow(clippy::type_complexity)]
fn batch_arrays(
    rows: &[tokio_postgres::Row],
) -> Result<(Vec<serde_json::Value>, Vec<i64>, Vec<i64>)> {
    let mut permits: Vec<serde_json::Value> = Vec::with_capacity(rows.len());
    let mut places: Vec<i64> = Vec::with_capacity(rows.len());
    let mut ids: Vec<i64> = Vec::with_capacity(rows.len());
    for row in rows {
        permits.push(row.try_get("permits")?);
        places.push(row.try_get("effective")?);
        ids.push(row.try_get("id")?);
    }
    Ok((permits, places, ids))
}

/// What step 2b (`permitq.place_batch_by_keys`) returns: each request's place once placed by
/// key, and the heads read again up to those places.
struct PlacedBatch {
    ranked: BTreeMap<i64, i64>,
    heads: Vec<(String, Head)>,
}

/// Step 2b, under the semaphore locks step 2 took: place the batch by key and read the heads
/// again (`permitq.place_batch_by_keys`).
/// The heads of the semaphores named in `full` are not read (see [`without_room`]).
async fn place_batch_by_keys(
    conn: &deadpool_postgres::Object,
    rows: &[tokio_postgres::Row],
    full: &[String],
) -> Result<PlacedBatch> {
    let (permits, places, ids) = batch_arrays(rows)?;
    let statement = conn.prepare_cached(sql::PLACE_BATCH_BY_KEYS).await?;
    let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] = [&permits, &places, &ids, &full];
    let mut placed = PlacedBatch {
        ranked: BTreeMap::new(),
        heads: Vec::new(),
    };
    for row in conn.query(&statement, &params).await? {
        match row_kind(&row)? {
            b'r' => {
                placed
                    .ranked
                    .insert(row.try_get("id")?, row.try_get("effective")?);
            }
            b'h' => placed.heads.push(head_from_row(&row)?),
            other => {
                return Err(Error::config(format!(
                    "permitq.place_batch_by_keys returned a row of kind {}: is the schema newer \
                     than this worker?",
                    char::from(other)
                )))
            }
        }
    }
    Ok(placed)
}

/// A head (`name`, `head_request_id`, `head_count`, `effective`), as step 2 and 2b return it.
fn head_from_row(row: &tokio_postgres::Row) -> Result<(String, Head)> {
    Ok((
        row.try_get("name")?,
        Head {
            request_id: row.try_get("head_request_id")?,
            count: row.try_get::<_, i32>("head_count")?.into(),
            effective: row.try_get("effective")?,
        },
    ))
}

/// The rows of step 2 (`permitq.lock_batch_and_heads`, or `permitq.next_batch`'s rows of the
/// same kinds): the locked semaphores, the heads among the waiting requests, and whether one
/// of the semaphores is keyed and the batch not placed by key yet (and placing would move one of
/// its requests).
#[derive(Default)]
struct LockedBatch {
    locked: Vec<(String, SemaphoreView)>,
    heads: Vec<(String, Head)>,
    keyed: bool,
    /// Placing the batch by key would move one of its requests back
    /// (`permitq.batch_moves_back_by_key`).
    moves_back: bool,
}

impl LockedBatch {
    /// Reads one row of kind `s` (a semaphore), `h` (a head) or `k` (a keyed semaphore); `from`
    /// names the function, for the error a row of another kind is.
    fn read(&mut self, row: &tokio_postgres::Row, from: &str) -> Result<()> {
        match row_kind(row)? {
            b's' => self.locked.push(semaphore_view_from_row(row)?),
            b'h' => self.heads.push(head_from_row(row)?),
            b'k' => {
                self.keyed = true;
                self.moves_back |= row.try_get::<_, Option<bool>>("active")?.unwrap_or(true);
            }
            other => {
                return Err(Error::config(format!(
                    "{from} returned a row of kind {}: is the schema newer than this worker?",
                    char::from(other)
                )))
            }
        }
        Ok(())
    }

    /// The locked semaphores by name, each with the head first in line among the heads on it.
    fn semaphores(&self) -> BTreeMap<String, SemaphoreView> {
        with_heads(self.locked.clone(), &self.heads)
    }
}

/// The `kind` of a row of `permitq.next_batch` or `permitq.lock_batch_and_heads` (a `"char"`).
fn row_kind(row: &tokio_postgres::Row) -> Result<u8> {
    Ok(u8::from_ne_bytes(
        row.try_get::<_, i8>("kind")?.to_ne_bytes(),
    ))
}

/// A semaphore as `permitq.lock_batch_semaphores` returns it (`name`, `capacity` .. `active`),
/// without its head.
fn semaphore_view_from_row(row: &tokio_postgres::Row) -> Result<(String, SemaphoreView)> {
    // No capacity: an instance its template may not make.
    let capacity: Option<i32> = row.try_get("capacity")?;
    Ok((
        row.try_get("name")?,
        SemaphoreView {
            capacity: capacity.unwrap_or(0).into(),
            used: row.try_get::<_, Option<i64>>("used")?.unwrap_or(0),
            fair: row.try_get::<_, Option<bool>>("fair")?.unwrap_or(false),
            head: None,
            refused: capacity.is_none(),
            parent: row.try_get("parent")?,
            guarantee: row
                .try_get::<_, Option<i32>>("guarantee")?
                .unwrap_or(0)
                .into(),
            active: row.try_get::<_, Option<bool>>("active")?.unwrap_or(false),
        },
    ))
}

/// The locked semaphores by name, each with the head first in line among `heads` on it.
fn with_heads(
    locked: Vec<(String, SemaphoreView)>,
    heads: &[(String, Head)],
) -> BTreeMap<String, SemaphoreView> {
    let mut semaphores: BTreeMap<String, SemaphoreView> = locked.into_iter().collect();
    for (name, head) in heads {
        let head = *head;
        if let Some(s) = semaphores.get_mut(name) {
            if s.head.is_none_or(|h| head.rank() < h.rank()) {
                s.head = Some(head);
            }
        }
    }
    semaphores
}

/// Step 3: the decision as the database takes it.
struct Outcome {
    granted: Vec<i64>,
    errored: Vec<i64>,
    codes: Vec<&'static str>,
    /// Left waiting for the first time: they join the semaphores' queues.
    queued: Vec<i64>,
    /// What the nested ones take (request id → semaphore → count): they hold it, or queue on it.
    charges: serde_json::Value,
    /// What each failed one hit (request id → [`crate::ErrorDetail`]).
    details: serde_json::Value,
}

impl Outcome {
    fn of(decision: &Decision, batch: &ClaimedBatch) -> Outcome {
        let unexamined = &batch.unexamined;
        let (mut errored, mut codes) = (Vec::new(), Vec::new());
        for (id, v) in &decision.verdicts {
            if let Verdict::Fail(code) = v {
                errored.push(*id);
                codes.push(code.as_str());
            }
        }
        Outcome {
            granted: decision.ids(|v| *v == Verdict::Grant),
            errored,
            codes,
            queued: decision
                .ids(|v| *v == Verdict::Wait)
                .into_iter()
                .filter(|id| unexamined.contains_key(id))
                .collect(),
            charges: decision
                .charges
                .iter()
                .map(|(id, taken)| (id.to_string(), serde_json::json!(taken)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
            details: decision
                .details
                .iter()
                .map(|(id, detail)| {
                    let mut detail = detail.clone();
                    if let Some(problem) = batch.problems.get(id) {
                        detail.problem = Some(problem.clone());
                    }
                    (id.to_string(), serde_json::json!(detail))
                })
                .collect::<serde_json::Map<_, _>>()
                .into(),
        }
    }

    /// What the batch did, out of `candidates` requests.
    fn counts(&self, candidates: usize) -> PassOutcome {
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        PassOutcome {
            batches: 1,
            granted: count(self.granted.len()),
            errored: count(self.errored.len()),
            waiting: count(candidates - self.granted.len() - self.errored.len()),
            queued: count(self.queued.len()),
        }
    }
}

/// Metrics and logs of a committed batch.
fn record(started: Instant, done: &PassOutcome, outcome: &Outcome, batch: &ClaimedBatch) {
    metrics::histogram!("permitq_batch_seconds").record(started.elapsed().as_secs_f64());
    metrics::counter!("permitq_grants_total").increment(done.granted);
    for id in &outcome.granted {
        metrics::histogram!("permitq_grant_wait_seconds").record(batch.ages[id]);
    }
    for code in &outcome.codes {
        metrics::counter!("permitq_request_errors_total", "code" => *code).increment(1);
    }
    if tracing::enabled!(tracing::Level::DEBUG) {
        for id in &outcome.granted {
            tracing::debug!(external_id = %batch.external_ids[id], request_id = id, "granted");
        }
        for (id, code) in outcome.errored.iter().zip(&outcome.codes) {
            tracing::debug!(external_id = %batch.external_ids[id], request_id = id, code, "failed");
        }
    }
    tracing::trace!(
        granted = done.granted,
        errored = done.errored,
        waiting = done.waiting,
        "batch committed"
    );
}
