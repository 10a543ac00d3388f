-- V5: what operators watch.
--
-- `semaphore.granted`: grants so far (a counter kept by the same UPDATE that adds to `used`), so
-- that `permitq top`, the status page and /metrics show grants per second without scanning
-- requests. `semaphore_usage` gains it as its last column.

ALTER TABLE permitq.semaphore ADD COLUMN granted bigint NOT NULL DEFAULT 0;

-- Worker step, after the decision: writes a batch's outcome set-based. Precondition: the
-- caller's transaction holds the row locks of all these requests (claimed FOR UPDATE SKIP LOCKED)
-- and, in id order, the locks of every semaphore they name. Sends the outcomes, batched.
CREATE OR REPLACE FUNCTION permitq.apply_decision(
    worker text,
    granted bigint[],
    errored bigint[],
    error_codes text[],
    waiting bigint[]
) RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    -- Failures first: their settled_at then precedes the batch's acquired_at, so a history
    -- checker never mistakes a request failed in this batch for one still waiting at the grants.
    IF cardinality(errored) > 0 THEN
        UPDATE permitq.permit_request r
        SET state = 'error', error_code = e.code, settled_at = clock_timestamp(), worker_id = worker
        FROM unnest(errored, error_codes) AS e(id, code)
        WHERE r.id = e.id;
    END IF;

    IF cardinality(granted) > 0 THEN
        -- Tokens and timestamps are drawn in id order, after the locks are held, so token order,
        -- acquired_at order and FIFO order agree (volatile output columns are computed after the
        -- ORDER BY).
        WITH g AS (
            SELECT id, nextval('permitq.fencing_token_seq') AS token, clock_timestamp() AS at
            FROM unnest(granted) AS id
            ORDER BY id
        ),
        done AS (
            UPDATE permitq.permit_request r
            SET state = 'acquired', fencing_token = g.token, acquired_at = g.at,
                expires_at = g.at + r.ttl, worker_id = worker
            FROM g
            WHERE r.id = g.id
            RETURNING r.permits
        )
        UPDATE permitq.semaphore s
        SET used = s.used + t.total, granted = s.granted + t.grants, updated_at = now()
        FROM (SELECT e.key AS semaphore, sum(e.value::int) AS total, count(*) AS grants
              FROM done CROSS JOIN LATERAL jsonb_each(done.permits) e GROUP BY e.key) t
        WHERE s.name = t.semaphore;
    END IF;

    IF cardinality(waiting) > 0 THEN
        -- Requests left waiting for the first time take their place in each semaphore's queue.
        INSERT INTO permitq.waiter (semaphore_id, request_id, count)
        SELECT s.id, r.id, e.value::int
        FROM permitq.permit_request r
        CROSS JOIN LATERAL jsonb_each(r.permits) e
        JOIN permitq.semaphore s ON s.name = e.key
        WHERE r.id = ANY(waiting) AND NOT r.examined
        ON CONFLICT DO NOTHING;

        UPDATE permitq.permit_request r SET examined = true
        WHERE r.id = ANY(waiting) AND NOT r.examined;
    END IF;

    IF cardinality(granted) + cardinality(errored) > 0 THEN
        -- They wait no more.
        DELETE FROM permitq.waiter w WHERE w.request_id = ANY(granted || errored);
        PERFORM permitq.notify_events(granted || errored);
    END IF;
END $$;

-- CREATE OR REPLACE reset these (see V4): the function runs as its owner, path pinned.
ALTER FUNCTION permitq.apply_decision(text, bigint[], bigint[], text[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;

CREATE OR REPLACE VIEW permitq.semaphore_usage AS
SELECT s.name,
       s.capacity,
       s.used,
       coalesce(h.held, 0)::integer AS held,
       coalesce(w.waiting, 0)::integer AS waiting,
       w.oldest_wait_since,
       s.fair,
       s.granted
FROM permitq.semaphore s
LEFT JOIN (SELECT e.key AS name, sum(e.value::int) AS held
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'acquired' GROUP BY e.key) h ON h.name = s.name
LEFT JOIN (SELECT e.key AS name, count(*) AS waiting, min(r.created_at) AS oldest_wait_since
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'new' GROUP BY e.key) w ON w.name = s.name;

-- Heads by semaphore name, so that the worker can send this query in the same round trip as
-- permitq.lock_and_fold (the server runs them in order: the heads are read after the locks).
CREATE FUNCTION permitq.semaphore_heads_named(names text[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer)
LANGUAGE sql AS $$
    SELECT h.semaphore, h.request_id, h.count
    FROM permitq.semaphore_heads(
        ARRAY(SELECT s.id FROM permitq.semaphore s WHERE s.name = ANY(names) ORDER BY s.id),
        batch_ids, newest_id) h
$$;
ALTER FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint) TO permitq_worker;
