-- V10: priorities.
--
-- `permitq.submit(..., priority => N)` (an integer from -100 to 100, default 0, higher first).
-- On a fair semaphore the head is the waiting request first in line: the highest *effective*
-- priority, and among equals the oldest (lowest id). The effective priority is the priority plus
-- one per 10 seconds waited. Comparing two requests a and b at any instant t,
--     p(a) + (t - created(a)) / 10 s > p(b) + (t - created(b)) / 10 s
--     <=>  created(a) - 10 s * p(a) < created(b) - 10 s * p(b)
-- so the order does not depend on t: permitq.effective_priority is that static key (higher
-- first, in microseconds), waiting never reorders two requests, and a request of priority p is
-- never overtaken by one submitted more than (p' - p) * 10 s after it: the starvation bound.
-- With every priority 0 the order is FIFO by arrival, as before. Greedy semaphores grant whatever
-- fits, first in line first among a batch.
--
-- The queue (permitq.waiter) keeps each waiter's priority and created_at, with an index in line
-- order per priority level; the heads and the claim's "ready" part read the first waiters of each
-- level present (a loose index scan: work per level, not per waiter).

ALTER TABLE permitq.permit_request ADD COLUMN priority smallint NOT NULL DEFAULT 0;
ALTER TABLE permitq.permit_request ADD CONSTRAINT permit_request_priority_valid
    CHECK (priority BETWEEN -100 AND 100) NOT VALID;
GRANT INSERT (priority) ON permitq.permit_request TO permitq_producer, permitq_admin;

ALTER TABLE permitq.waiter
    ADD COLUMN priority smallint NOT NULL DEFAULT 0,
    ADD COLUMN created_at timestamptz;
UPDATE permitq.waiter w SET created_at = r.created_at
FROM permitq.permit_request r WHERE r.id = w.request_id;
ALTER TABLE permitq.waiter ALTER COLUMN created_at SET NOT NULL;
CREATE INDEX waiter_line_idx ON permitq.waiter (semaphore_id, priority DESC, request_id);
-- Unexamined requests by priority (the heads' look at younger requests of a higher priority).
CREATE INDEX permit_request_unexamined_priority_idx ON permitq.permit_request (priority)
    WHERE state = 'new' AND NOT examined;

-- The place in line, higher first: 10 s per priority step ahead of its arrival, in microseconds
-- (priority * 10 s - created_at). Priority plus one per 10 s waited orders requests the same at
-- every instant, without rounding.
CREATE FUNCTION permitq.effective_priority(priority smallint, created_at timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT $1::bigint * 10000000 - (extract(epoch FROM $2) * 1000000)::bigint
$$;

-- The priority levels present in semaphore $1's queue, highest first (a loose index scan).
CREATE FUNCTION permitq.waiter_levels(bigint) RETURNS SETOF smallint
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE lv(priority) AS (
        (SELECT w.priority FROM permitq.waiter w WHERE w.semaphore_id = $1
         ORDER BY w.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT w.priority FROM permitq.waiter w
                WHERE w.semaphore_id = $1 AND w.priority < lv.priority
                ORDER BY w.priority DESC LIMIT 1)
        FROM lv WHERE lv.priority IS NOT NULL
    )
    SELECT lv.priority FROM lv WHERE lv.priority IS NOT NULL
$$;

-- submit gains `priority`.
DROP FUNCTION permitq.submit(text, jsonb, text, interval, interval);
CREATE FUNCTION permitq.submit(
    external_id text,
    permits jsonb,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    wait interval DEFAULT NULL,
    -- integer, so that `priority => 10` needs no cast; stored as a smallint.
    priority integer DEFAULT 0
) RETURNS permitq.permit_request
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    problem text;
    existing permitq.permit_request;
BEGIN
    IF submit.external_id IS NULL OR submit.external_id = '' THEN
        RAISE EXCEPTION 'invalid external_id: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(submit.external_id) > 255 THEN
        RAISE EXCEPTION 'invalid external_id: must be at most 255 characters, got %',
            length(submit.external_id) USING ERRCODE = '22023';
    END IF;
    problem := permitq.permits_problem(submit.permits);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid permits: %', problem USING ERRCODE = '22023';
    END IF;
    IF submit.ttl IS NOT NULL AND submit.ttl <= interval '0' THEN
        RAISE EXCEPTION 'invalid ttl: must be positive, got %', submit.ttl USING ERRCODE = '22023';
    END IF;
    IF submit.priority IS NULL OR submit.priority NOT BETWEEN -100 AND 100 THEN
        RAISE EXCEPTION 'invalid priority: must be between -100 and 100, got %',
            coalesce(submit.priority::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    IF submit.wait IS NOT NULL AND submit.wait < interval '0' THEN
        RAISE EXCEPTION 'invalid wait: must not be negative, got %', submit.wait
            USING ERRCODE = '22023';
    END IF;
    LOOP
        INSERT INTO permitq.permit_request (external_id, permits, owner, ttl, wait, priority)
        VALUES (submit.external_id, submit.permits, submit.owner, submit.ttl, submit.wait,
                submit.priority::smallint)
        ON CONFLICT ON CONSTRAINT permit_request_external_id_key DO NOTHING
        RETURNING * INTO existing;
        IF FOUND THEN
            RETURN existing;
        END IF;
        SELECT * INTO existing FROM permitq.permit_request r WHERE r.external_id = submit.external_id;
        IF FOUND THEN
            IF existing.permits = submit.permits
               AND existing.owner IS NOT DISTINCT FROM submit.owner
               AND existing.ttl IS NOT DISTINCT FROM submit.ttl
               AND existing.wait IS NOT DISTINCT FROM submit.wait
               AND existing.priority = submit.priority THEN
                RETURN existing;
            END IF;
            RAISE EXCEPTION 'external_id % already exists with different parameters', submit.external_id
                USING ERRCODE = '23505',
                      DETAIL = format('existing: permits=%s owner=%s ttl=%s wait=%s priority=%s',
                          existing.permits, existing.owner, existing.ttl, existing.wait,
                          existing.priority);
        END IF;
        -- The conflicting row was deleted (retention) between the two statements: insert again.
    END LOOP;
END $$;

-- Worker step 1: as in V9, plus each request's effective priority; the "ready" part takes the
-- first waiters of every priority level of a semaphore with room.
DROP FUNCTION permitq.claim_batch(bigint, bigint);
CREATE FUNCTION permitq.claim_batch(cursor bigint, batch_size bigint)
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text,
               effective bigint)
LANGUAGE plpgsql AS $$
DECLARE
    ready bigint[];
BEGIN
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           permitq.request_problem(r), r.external_id,
           permitq.effective_priority(r.priority, r.created_at)
    FROM permitq.permit_request r
    WHERE r.state = 'new' AND NOT r.examined AND r.id > cursor
    ORDER BY r.id
    LIMIT batch_size
    FOR UPDATE SKIP LOCKED;

    IF NOT EXISTS (SELECT 1 FROM permitq.waiter) THEN
        RETURN;
    END IF;
    WITH room AS (
        SELECT s.id,
               CASE WHEN s.per IS NOT NULL THEN s.capacity - permitq.in_window(s)
                    ELSE s.capacity - s.used
                         + coalesce((SELECT sum(p.count) FROM permitq.pending_release p
                                     WHERE p.semaphore = s.name), 0) END AS free
        FROM permitq.semaphore s
        WHERE (SELECT true FROM permitq.waiter w WHERE w.semaphore_id = s.id LIMIT 1)
    )
    SELECT array_agg(DISTINCT w.request_id) INTO ready
    FROM room
    -- Every priority level of its queue, and the first waiters of each (the decision puts them
    -- in line).
    CROSS JOIN LATERAL permitq.waiter_levels(room.id) AS level(priority)
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count FROM permitq.waiter wt
        WHERE wt.semaphore_id = room.id AND wt.priority = level.priority
        ORDER BY wt.semaphore_id, wt.priority DESC, wt.request_id   -- waiter_line_idx
        -- Each grant takes at least one permit: no more than `free` of them can go now.
        LIMIT least(batch_size, room.free)
    ) w
    WHERE room.free > 0 AND w.count <= room.free;
    IF ready IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           NULL::text, r.external_id,
           permitq.effective_priority(r.priority, r.created_at)
    FROM permitq.permit_request r
    WHERE r.id = ANY(ready) AND r.state = 'new' AND r.examined
    ORDER BY r.id
    FOR UPDATE SKIP LOCKED;
END $$;

DROP FUNCTION permitq.claim_requests(bigint[]);
CREATE FUNCTION permitq.claim_requests(ids bigint[])
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text,
               effective bigint)
LANGUAGE sql AS $$
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           CASE WHEN NOT r.examined THEN permitq.request_problem(r) END, r.external_id,
           permitq.effective_priority(r.priority, r.created_at)
    FROM permitq.permit_request r
    WHERE r.id = ANY(ids) AND r.state = 'new'
    ORDER BY r.id
    FOR UPDATE SKIP LOCKED
$$;

-- The heads: per locked semaphore, the first waiter outside the batch of every priority level
-- (the caller keeps the one first in line), and the requests no worker has examined yet that may
-- be ahead of the batch's: the older ones (as before), and younger ones of a higher priority than
-- the lowest of the batch (or than 0): a younger request of priority p can only be ahead of a
-- candidate of priority q < p. (A batch with negative priorities thereby reads the unexamined
-- requests of priority 0 too.)
DROP FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint);
DROP FUNCTION permitq.semaphore_heads(bigint[], bigint[], bigint);
CREATE FUNCTION permitq.semaphore_heads(semaphore_ids bigint[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer, effective bigint)
LANGUAGE plpgsql AS $$
DECLARE
    floor_priority smallint := least(0, (SELECT min(r.priority) FROM permitq.permit_request r
                                         WHERE r.id = ANY(batch_ids)));
BEGIN
    RETURN QUERY
    SELECT s.name, w.request_id, w.count, permitq.effective_priority(w.priority, w.created_at)
    FROM unnest(semaphore_ids) AS locked(id)
    JOIN permitq.semaphore s ON s.id = locked.id
    CROSS JOIN LATERAL permitq.waiter_levels(locked.id) AS level(priority)
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count, wt.priority, wt.created_at FROM permitq.waiter wt
        WHERE wt.semaphore_id = locked.id AND wt.priority = level.priority
          AND wt.request_id <> ALL(batch_ids)
        ORDER BY wt.semaphore_id, wt.priority DESC, wt.request_id   -- waiter_line_idx
        LIMIT 1
    ) w;
    RETURN QUERY
    SELECT e.key, r.id,
           CASE WHEN jsonb_typeof(e.value) = 'number'
                     AND e.value::numeric BETWEEN 1 AND 2147483647
                THEN e.value::numeric::int ELSE 1 END,
           permitq.effective_priority(r.priority, r.created_at)
    FROM permitq.permit_request r
    CROSS JOIN LATERAL jsonb_each(CASE WHEN jsonb_typeof(r.permits) = 'object'
                                       THEN r.permits ELSE '{}'::jsonb END) e
    JOIN permitq.semaphore s ON s.name = e.key
    WHERE r.state = 'new' AND NOT r.examined
      AND (r.id < newest_id OR r.priority > floor_priority)
      AND r.id <> ALL(batch_ids)
      AND s.id = ANY(semaphore_ids);
END $$;

CREATE FUNCTION permitq.semaphore_heads_named(names text[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer, effective bigint)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT h.semaphore, h.request_id, h.count, h.effective
    FROM permitq.semaphore_heads(
        ARRAY(SELECT s.id FROM permitq.semaphore s WHERE s.name = ANY(names) ORDER BY s.id),
        batch_ids, newest_id) h;
END $$;

-- Worker step 3: as in V9, plus a new waiter's priority and created_at in the queue.
CREATE OR REPLACE FUNCTION permitq.apply_decision(
    worker text,
    granted bigint[],
    errored bigint[],
    error_codes text[],
    waiting bigint[]
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    -- The high bits of this batch's tokens: its timeline (see the top of this file).
    epoch bigint := CASE WHEN cardinality(granted) > 0 THEN permitq.wal_timeline() << 48 ELSE 0 END;
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
        -- Tokens (timeline in the high bits) and timestamps are drawn in id order, after the
        -- locks are held, so token order, acquired_at order and FIFO order agree (volatile
        -- output columns are computed after the ORDER BY).
        WITH g AS (
            SELECT id, epoch | nextval('permitq.fencing_token_seq') AS token, clock_timestamp() AS at
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

        IF EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.per IS NOT NULL) THEN
            INSERT INTO permitq.rate_grant (semaphore_id, granted_at, count)
            SELECT s.id, r.acquired_at, e.value::int
            FROM permitq.permit_request r
            CROSS JOIN LATERAL jsonb_each(r.permits) e
            JOIN permitq.semaphore s ON s.name = e.key
            WHERE r.id = ANY(apply_decision.granted) AND s.per IS NOT NULL;
        END IF;
    END IF;

    IF cardinality(waiting) > 0 THEN
        -- Requests left waiting for the first time take their place in each semaphore's queue.
        INSERT INTO permitq.waiter (semaphore_id, request_id, count, priority, created_at)
        SELECT s.id, r.id, e.value::int, r.priority, r.created_at
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

ALTER FUNCTION permitq.submit(text, jsonb, text, interval, interval, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.claim_batch(bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET enable_seqscan = off;
ALTER FUNCTION permitq.claim_requests(bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.semaphore_heads(bigint[], bigint[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET enable_seqscan = off;
ALTER FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.apply_decision(text, bigint[], bigint[], text[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION
    permitq.submit(text, jsonb, text, interval, interval, integer),
    permitq.claim_batch(bigint, bigint),
    permitq.claim_requests(bigint[]),
    permitq.semaphore_heads(bigint[], bigint[], bigint),
    permitq.semaphore_heads_named(text[], bigint[], bigint),
    permitq.effective_priority(smallint, timestamptz),
    permitq.waiter_levels(bigint)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.submit(text, jsonb, text, interval, interval, integer)
    TO permitq_producer, permitq_admin;
GRANT EXECUTE ON FUNCTION
    permitq.claim_batch(bigint, bigint),
    permitq.claim_requests(bigint[]),
    permitq.semaphore_heads(bigint[], bigint[], bigint),
    permitq.semaphore_heads_named(text[], bigint[], bigint)
    TO permitq_worker;
