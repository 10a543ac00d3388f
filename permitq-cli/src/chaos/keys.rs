//! The fairness rule, extended to fairness keys: on the run's keyed semaphore, the start tags
//! the workers gave follow start-time fair queuing with each request's own key and weight.
//!
//! The checker cannot read the tags from the final state (a waiter row, which keeps its start
//! tag, is deleted when it is granted; a request granted by the batch that examined it never had
//! one), and it must not take the workers' word for a request's key. So the run records, by
//! triggers it installs on the database under test (never the product's), every move of a key's
//! finish tag and of a keyed semaphore's virtual time, in commit order on each semaphore (the
//! triggers fire under the batch's semaphore lock, and a rolled-back batch takes its rows with
//! it). The rule then replays each batch: in the batch that first examined them, the requests
//! of key k on semaphore s move k's finish tag from `max(V, F)` (V the virtual time the batch
//! found, F the key's finish tag before it) by exactly the sum of their turns, `step × count /
//! weight`, with the key and weight read from the requests themselves. A worker that ignores
//! keys, or weights, or tags nothing, moves other keys' tags, or other amounts, or none. The one
//! batch that may move no tag is one that granted everything it examined there at once, one
//! request per key (a worker places a batch only when placing would move a request or the order
//! mattered: functions/fairness.sql); it moves none of them then.
//!
//! Grants in the order of the places the tags give are the integration tests' to check (the
//! head-of-line rule here reads arrival order, so it leaves the keyed semaphore out; the load's
//! keyed requests name nothing else, so no other line sees their places).

use crate::error::Result;

/// Installs the audit: a table of moves and the triggers that write it, and the virtual times
/// of the semaphores already keyed. Run before the workers start.
pub(crate) const INSTALL: &str = "
CREATE TABLE public.chaos_key_audit (
    seq bigserial PRIMARY KEY,
    -- The transaction's start: a batch's decided_at and examined_at.
    batch_start timestamptz NOT NULL DEFAULT now(),
    kind text NOT NULL CHECK (kind IN ('finish', 'virtual_time')),
    semaphore_id bigint NOT NULL,
    fairness_key text,
    old_tag timestamptz,
    new_tag timestamptz NOT NULL);
CREATE FUNCTION public.chaos_audit_finish() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.chaos_key_audit (kind, semaphore_id, fairness_key, old_tag, new_tag)
    VALUES ('finish', NEW.semaphore_id, NEW.fairness_key,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.finish END, NEW.finish);
    RETURN NULL;
END $$;
CREATE FUNCTION public.chaos_audit_virtual_time() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.chaos_key_audit (kind, semaphore_id, new_tag)
    VALUES ('virtual_time', NEW.semaphore_id, NEW.virtual_time);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE ON permitq.key_finish
    FOR EACH ROW EXECUTE FUNCTION public.chaos_audit_finish();
CREATE TRIGGER chaos_audit AFTER INSERT OR UPDATE OF virtual_time ON permitq.keyed_semaphore
    FOR EACH ROW EXECUTE FUNCTION public.chaos_audit_virtual_time();
";

/// Each batch that examined requests on a keyed semaphore, and each key whose finish tag a
/// batch moved, where the move is not the sum of the turns of that key's requests the batch
/// examined: (semaphore, batch start, key, requests, expected move µs, actual move µs).
/// `$1`: the aging step in µs (a permit's turn at weight 1).
const REPLAY: &str = "
WITH moved AS (
    SELECT a.batch_start, a.semaphore_id, a.fairness_key, min(a.seq) AS first_seq,
           (array_agg(a.old_tag ORDER BY a.seq))[1] AS first_old,
           (array_agg(a.new_tag ORDER BY a.seq DESC))[1] AS last_new
    FROM public.chaos_key_audit a WHERE a.kind = 'finish'
    GROUP BY 1, 2, 3),
examined AS (
    SELECT r.examined_at AS batch_start, s.id AS semaphore_id,
           coalesce(r.fairness_key, '') AS fairness_key, count(*) AS requests,
           sum($1::int8 * (r.permits ->> s.name)::int8 / coalesce(r.fairness_weight, 1))::int8
               AS turns,
           -- Granted by the batch that examined it.
           bool_and(r.acquired_at IS NOT NULL AND r.decided_at = r.examined_at) AS granted
    FROM permitq.keyed_semaphore k
    JOIN permitq.semaphore s ON s.id = k.semaphore_id
    JOIN permitq.permit_request r ON r.permits ? s.name
    WHERE r.examined_at IS NOT NULL AND r.error_code IS DISTINCT FROM 'invalid'
      -- Failed by the batch that first examined it without waiting (its wait over already,
      -- or a count above the capacity): placed by no key, it takes no turn.
      AND NOT coalesce(r.wait_until <= r.examined_at, false)
      AND NOT coalesce(r.error_code = 'exceeds_capacity' AND r.decided_at = r.examined_at, false)
    GROUP BY 1, 2, 3),
joined AS (
    SELECT coalesce(m.batch_start, e.batch_start) AS batch_start,
           coalesce(m.semaphore_id, e.semaphore_id) AS semaphore_id,
           coalesce(m.fairness_key, e.fairness_key) AS fairness_key,
           coalesce(e.requests, 0) AS requests, coalesce(e.turns, 0) AS expected,
           m.first_seq, m.first_old, m.last_new,
           -- The batch granted all it examined there, one request per key, and moved no tag
           -- there: not placed.
           coalesce(bool_and(e.granted AND e.requests = 1) OVER w, false)
               AND NOT bool_or(m.last_new IS NOT NULL) OVER w AS unplaced
    FROM moved m FULL JOIN examined e
      ON e.batch_start = m.batch_start AND e.semaphore_id = m.semaphore_id
     AND e.fairness_key = m.fairness_key
    WINDOW w AS (PARTITION BY coalesce(m.batch_start, e.batch_start),
                              coalesce(m.semaphore_id, e.semaphore_id))),
replayed AS (
    SELECT j.*,
           (SELECT a.new_tag FROM public.chaos_key_audit a
            WHERE a.kind = 'virtual_time' AND a.semaphore_id = j.semaphore_id
              AND a.seq < j.first_seq
            ORDER BY a.seq DESC LIMIT 1) AS v
    FROM joined j)
SELECT s.name, (extract(epoch FROM r.batch_start) * 1000000)::int8, r.fairness_key, r.requests,
       r.expected,
       CASE WHEN r.last_new IS NULL THEN 0
            ELSE (extract(epoch FROM r.last_new - greatest(r.v, coalesce(r.first_old, r.v)))
                  * 1000000)::int8 END AS actual,
       r.unplaced
FROM replayed r JOIN permitq.semaphore s ON s.id = r.semaphore_id
ORDER BY r.batch_start";

/// What the replay found wrong, one line each (at most 20, then a count), and how many
/// (batch, key) moves it checked.
pub(crate) async fn replay(conn: &tokio_postgres::Client) -> Result<(Vec<String>, usize)> {
    let step = i64::try_from(permitq::AGING_STEP.as_micros()).unwrap_or(i64::MAX);
    let rows = conn.query(REPLAY, &[&step]).await?;
    let mut found = Vec::new();
    for r in &rows {
        let (name, at, key, requests, expected, actual): (String, i64, String, i64, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5));
        let unplaced: bool = r.get(6);
        if expected != actual && !unplaced {
            found.push(format!(
                "keys: {name}: the batch begun at {at} µs examined {requests} request(s) of \
                 fairness key {key:?}, whose turns add up to {expected} µs, but moved the key's \
                 finish tag by {actual} µs"
            ));
        }
    }
    Ok((found, rows.len()))
}
