-- V9: rate-limited semaphores.
--
-- `permitq.set_capacity('api', 100, per => '1 minute')`: at most 100 permits granted in any
-- window of one minute (sliding), whatever the holders do: a grant counts against the semaphore
-- from its `acquired_at` for `per`, whether it is released earlier or held longer. Each grant on
-- a rate-limited semaphore is logged in permitq.rate_grant; the worker's view of such a semaphore
-- (permitq.lock_and_fold, permitq.claim_batch) has `used` = the permits granted in the window
-- ending now, so the pure decision and the fairness rule apply unchanged, in the same
-- all-or-nothing requests as concurrency semaphores, with `wait`, and with templates.
--
-- The window is measured on the database clock. The worker counts grants with `acquired_at >
-- now() - per`, `now()` being its transaction's start, before any of its grants: it may count a
-- grant a moment longer than needed, never shorter, so no window of length `per` ever holds more
-- than the capacity (every earlier grant on the semaphore committed before the worker got its
-- lock).
--
-- The `used` column of a rate-limited semaphore keeps counting held permits (grants add,
-- releases are folded off), like any other; the view permitq.semaphore_usage shows the window's
-- count as `in_window`.

ALTER TABLE permitq.semaphore ADD COLUMN per interval
    CONSTRAINT semaphore_per_valid CHECK (per > interval '0' AND per <= interval '3653 days');

CREATE TABLE permitq.rate_grant (
    semaphore_id bigint NOT NULL REFERENCES permitq.semaphore (id) ON DELETE CASCADE,
    granted_at   timestamptz NOT NULL,
    count        integer NOT NULL
);
CREATE INDEX rate_grant_window_idx ON permitq.rate_grant (semaphore_id, granted_at);
-- The rate-limited semaphores, few among many (template instances): found without a scan by the
-- checks on every grant batch and every worker nap.
CREATE INDEX semaphore_rate_limited_idx ON permitq.semaphore (id) WHERE per IS NOT NULL;

-- Permits granted on `s` in the window ending at the caller's transaction start (0 for a
-- concurrency semaphore).
CREATE FUNCTION permitq.in_window(s permitq.semaphore) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN s.per IS NULL THEN 0 ELSE
        (SELECT coalesce(sum(g.count), 0)::integer FROM permitq.rate_grant g
         WHERE g.semaphore_id = s.id AND g.granted_at > now() - s.per) END
$$;

-- set_capacity gains `per`: NULL keeps the semaphore's window (none for a new one); a positive
-- interval makes it rate-limited; '0' makes it a concurrency semaphore again.
DROP FUNCTION permitq.set_capacity(text, integer, boolean);
CREATE FUNCTION permitq.set_capacity(name text, capacity integer, fair boolean DEFAULT NULL,
                                     per interval DEFAULT NULL)
RETURNS permitq.semaphore
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    result permitq.semaphore;
    problem text;
BEGIN
    IF set_capacity.name IS NULL OR set_capacity.name = '' THEN
        RAISE EXCEPTION 'invalid name: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(set_capacity.name) > 255 THEN
        RAISE EXCEPTION 'invalid name: must be at most 255 characters' USING ERRCODE = '22023';
    END IF;
    IF set_capacity.name = '*' THEN
        RAISE EXCEPTION 'invalid name: a template needs a prefix before its *' USING ERRCODE = '22023';
    END IF;
    IF set_capacity.capacity IS NULL OR set_capacity.capacity < 0 THEN
        RAISE EXCEPTION 'invalid capacity: must be a non-negative integer, got %',
            coalesce(set_capacity.capacity::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    problem := permitq.interval_problem(set_capacity.per, true);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid per: %', problem USING ERRCODE = '22023';
    END IF;
    INSERT INTO permitq.semaphore AS s (name, capacity, fair, is_template, per)
    VALUES (set_capacity.name, set_capacity.capacity, coalesce(set_capacity.fair, true),
            right(set_capacity.name, 1) = '*', nullif(set_capacity.per, interval '0'))
    ON CONFLICT ON CONSTRAINT semaphore_name_key DO UPDATE
        SET capacity = EXCLUDED.capacity,
            fair = coalesce(set_capacity.fair, s.fair),
            per = CASE WHEN set_capacity.per IS NULL THEN s.per
                       ELSE nullif(set_capacity.per, interval '0') END,
            updated_at = now()
    RETURNING * INTO result;
    IF result.is_template THEN
        -- Its instances follow (in id order, the lock order of semaphore rows).
        PERFORM 1 FROM permitq.semaphore s WHERE s.template = result.name ORDER BY s.id FOR UPDATE;
        UPDATE permitq.semaphore s
        SET capacity = result.capacity, fair = result.fair, per = result.per, updated_at = now()
        WHERE s.template = result.name;
    END IF;
    PERFORM pg_notify('permitq_work', '');
    RETURN result;
END $$;
ALTER FUNCTION permitq.set_capacity(text, integer, boolean, interval)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION permitq.set_capacity(text, integer, boolean, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.set_capacity(text, integer, boolean, interval) TO permitq_admin;

-- Worker step 2, as in V8, plus: instances inherit their template's window, and a rate-limited
-- semaphore's `used` is the permits granted in its window.
CREATE OR REPLACE FUNCTION permitq.lock_and_fold(names text[])
RETURNS TABLE (id bigint, name text, capacity integer, used integer, fair boolean)
LANGUAGE plpgsql AS $$
DECLARE
    locked text[];
    also text[];
    announced bigint[];
BEGIN
    IF EXISTS (SELECT 1 FROM permitq.semaphore t WHERE t.is_template) THEN
        -- In name order: two workers making the same instances wait for each other in one order.
        INSERT INTO permitq.semaphore (name, capacity, fair, template, per)
        SELECT n.name, t.capacity, t.fair, t.name, t.per
        FROM (SELECT DISTINCT x AS name FROM unnest(names) x) n
        CROSS JOIN LATERAL permitq.template_for(n.name) t
        WHERE t.name IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = n.name)
        ORDER BY n.name
        ON CONFLICT ON CONSTRAINT semaphore_name_key DO NOTHING;
    END IF;

    SELECT array_agg(l.name) INTO locked FROM (
        SELECT s.name FROM permitq.semaphore s
        WHERE s.name = ANY(names) AND NOT s.is_template
        ORDER BY s.id
        FOR UPDATE
    ) l;
    IF EXISTS (SELECT 1 FROM permitq.pending_release) THEN
        SELECT array_agg(l.name) INTO also FROM (
            SELECT s.name FROM permitq.semaphore s
            WHERE s.name IN (SELECT p.semaphore FROM permitq.pending_release p
                             WHERE p.semaphore IS NOT NULL)
              AND s.name <> ALL(coalesce(locked, '{}'))
            ORDER BY s.id
            FOR UPDATE SKIP LOCKED
        ) l;
        locked := coalesce(locked, '{}') || coalesce(also, '{}');

        WITH folded AS (
            DELETE FROM permitq.pending_release p
            WHERE p.semaphore = ANY(locked)
               OR p.id IN (SELECT c.id FROM permitq.pending_release c
                           WHERE c.semaphore IS NULL FOR UPDATE SKIP LOCKED)
            RETURNING p.request_id, p.semaphore, p.count, p.announce
        ),
        give_back AS (
            UPDATE permitq.semaphore s
            SET used = s.used - t.total, updated_at = now()
            FROM (SELECT f.semaphore, sum(f.count) AS total FROM folded f
                  WHERE f.semaphore IS NOT NULL GROUP BY f.semaphore) t
            WHERE s.name = t.semaphore
        )
        SELECT array_agg(f.request_id) FILTER (WHERE f.announce) INTO announced FROM folded f;

        IF announced IS NOT NULL THEN
            PERFORM permitq.notify_events(announced);
        END IF;
    END IF;

    RETURN QUERY
    SELECT s.id, s.name, s.capacity,
           CASE WHEN s.per IS NULL THEN s.used ELSE permitq.in_window(s) END, s.fair
    FROM permitq.semaphore s
    WHERE s.name = ANY(names) AND NOT s.is_template
    ORDER BY s.id;
END $$;

-- Worker step 1, as in V4, plus: a rate-limited semaphore's room is what its window leaves.
CREATE OR REPLACE FUNCTION permitq.claim_batch(cursor bigint, batch_size bigint)
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text)
LANGUAGE plpgsql AS $$
DECLARE
    ready bigint[];
BEGIN
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           permitq.request_problem(r), r.external_id
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
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count FROM permitq.waiter wt
        WHERE wt.semaphore_id = room.id
        ORDER BY wt.semaphore_id, wt.request_id
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
           NULL::text, r.external_id
    FROM permitq.permit_request r
    WHERE r.id = ANY(ready) AND r.state = 'new' AND r.examined
    ORDER BY r.id
    FOR UPDATE SKIP LOCKED;
END $$;

-- Worker step 3, as in V7, plus: grants on rate-limited semaphores are logged in rate_grant at
-- their acquired_at.
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

-- Grants that left their window: removed by the retention sweep (with idle instances), every
-- round (at least once a second).
CREATE OR REPLACE FUNCTION permitq.sweep_idle_instances(idle interval, batch_size integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    -- All of them at once (a batch limit would let a semaphore granting faster than the sweep
    -- runs outgrow it): per semaphore, a range of its window index.
    DELETE FROM permitq.rate_grant g
    USING permitq.semaphore s
    WHERE s.id = g.semaphore_id AND g.granted_at <= now() - coalesce(s.per, interval '0');
    WITH doomed AS (
        SELECT s.id FROM permitq.semaphore s
        WHERE s.template IS NOT NULL AND s.updated_at < now() - idle AND s.used = 0
        ORDER BY s.id
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM permitq.semaphore s USING doomed
    WHERE s.id = doomed.id AND s.used = 0
      AND NOT EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id)
      AND NOT EXISTS (SELECT 1 FROM permitq.pending_release p WHERE p.semaphore = s.name)
      -- A rate-limited instance also waits for its window to empty.
      AND NOT EXISTS (SELECT 1 FROM permitq.rate_grant g WHERE g.semaphore_id = s.id
                      AND g.granted_at > now() - s.per);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- When the next window of a rate-limited semaphore that has waiters opens (a worker that goes to
-- sleep wakes then, not a poll interval later). NULL: none.
CREATE FUNCTION permitq.next_window_opening() RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT min(g.granted_at + s.per)
    FROM permitq.semaphore s
    JOIN permitq.rate_grant g ON g.semaphore_id = s.id
    WHERE s.per IS NOT NULL AND g.granted_at > now() - s.per
      AND EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id)
$$;

-- What operators watch gains the window: `per` and `in_window` (permits granted in it).
CREATE OR REPLACE VIEW permitq.semaphore_usage AS
SELECT s.name,
       s.capacity,
       s.used,
       coalesce(h.held, 0)::integer AS held,
       coalesce(w.waiting, 0)::integer AS waiting,
       w.oldest_wait_since,
       s.fair,
       s.granted,
       s.per,
       -- permitq.in_window, written out: the view's owner reads rate_grant, not its caller.
       CASE WHEN s.per IS NULL THEN 0 ELSE
           (SELECT coalesce(sum(g.count), 0)::integer FROM permitq.rate_grant g
            WHERE g.semaphore_id = s.id AND g.granted_at > now() - s.per) END AS in_window
FROM permitq.semaphore s
LEFT JOIN (SELECT e.key AS name, sum(e.value::int) AS held
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'acquired' GROUP BY e.key) h ON h.name = s.name
LEFT JOIN (SELECT e.key AS name, count(*) AS waiting, min(r.created_at) AS oldest_wait_since
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'new' GROUP BY e.key) w ON w.name = s.name;

-- CREATE OR REPLACE reset these (see V4): entry points run as their owner, path pinned.
ALTER FUNCTION permitq.lock_and_fold(text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.claim_batch(bigint, bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET enable_seqscan = off;
ALTER FUNCTION permitq.apply_decision(text, bigint[], bigint[], text[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.sweep_idle_instances(interval, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.next_window_opening()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION permitq.next_window_opening() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.next_window_opening() TO permitq_worker;
REVOKE EXECUTE ON FUNCTION permitq.in_window(permitq.semaphore) FROM PUBLIC;
