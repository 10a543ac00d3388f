-- V8: the features of "beyond the peers": semaphore templates (limits per key), rate-limited
-- semaphores and priorities. One migration, so that each function they change is written once.
--
-- 1. Templates.
--
-- `permitq.set_capacity('tenant:*', 5)` defines a template: a semaphore row whose name ends in
-- one `*` (`is_template`). A request naming a semaphore that does not exist, say `tenant:acme`,
-- gets an *instance* made from the most specific template whose prefix (the name without its `*`)
-- the name starts with: the longest such prefix wins (`tenant:eu:*` over `tenant:*`). Instances
-- are ordinary semaphores (audited, listed, changed with set_capacity), and remember their
-- template in `template`.
--
-- * Created by the worker, in the transaction that decides the request, before it locks the
--   batch's semaphores (permitq.lock_and_fold): INSERT ... ON CONFLICT (name) DO NOTHING, in name
--   order, so two workers creating the same instance end with one row (the second waits for the
--   first's insert, then locks the committed row), and no request naming an instance gets
--   `unknown_semaphore`.
-- * A template itself is never granted: a request naming `tenant:*` gets `unknown_semaphore`.
-- * Changing a template's capacity or fairness changes every instance made from it, in the same
--   transaction (each change audited); an instance changed on its own keeps its value until the
--   template changes again.
-- * Instances with nothing held, nothing waiting and no grant or release for a while are removed
--   by the workers' sweep (permitq.sweep_idle_instances; `--idle-instance-after`, default 1 h);
--   the next request naming one makes it again.
--
-- 2. Rate limits.
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
--
-- 3. Priorities.
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

-- 1. Templates: tables.
-- A template is made by set_capacity with a name ending in `*` (a semaphore of such a name made
-- before V8 stays a plain semaphore).
ALTER TABLE permitq.semaphore
    ADD COLUMN is_template boolean NOT NULL DEFAULT false,
    ADD COLUMN template text;
CREATE INDEX semaphore_template_idx ON permitq.semaphore (name) WHERE is_template;
CREATE INDEX semaphore_instance_idx ON permitq.semaphore (template, updated_at) WHERE template IS NOT NULL;

-- The most specific template for `semaphore_name`, if any.
CREATE FUNCTION permitq.template_for(semaphore_name text) RETURNS permitq.semaphore
LANGUAGE sql STABLE AS $$
    SELECT t.* FROM permitq.semaphore t
    WHERE t.is_template AND starts_with(semaphore_name, left(t.name, -1))
      AND semaphore_name NOT LIKE '%*'
    ORDER BY length(t.name) DESC
    LIMIT 1
$$;

-- 2. Rate limits: tables.
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

-- 3. Priorities: tables.
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

-- set_capacity makes a template of a name ending in `*` (its instances follow its changes), and
-- gains `per`: NULL keeps the semaphore's window (none for a new one); a positive interval makes
-- it rate-limited; '0' makes it a concurrency semaphore again.
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

-- Worker step 2, as in V3, plus: instances of templates are made first for the names that match
-- no semaphore (with their template's capacity, fairness and window); templates are never
-- returned (a request naming one is unknown_semaphore); a rate-limited semaphore's `used` is the
-- permits granted in its window.
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

-- Sweep: removes up to `batch_size` instances of templates that hold nothing (`used` = 0 under
-- their lock, nothing left to fold), have nobody waiting, and saw no grant, fold or change for
-- `idle`. Returns how many. A request that names one later makes it again.
-- It also removes the grants that left their window, every round (at least once a second).
CREATE FUNCTION permitq.sweep_idle_instances(idle interval, batch_size integer) RETURNS integer
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

-- Entry points run as their owner with a pinned path (see V4); the sweep is the workers'.
ALTER FUNCTION permitq.lock_and_fold(text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.sweep_idle_instances(interval, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION permitq.sweep_idle_instances(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.sweep_idle_instances(interval, integer) TO permitq_worker, permitq_admin;
REVOKE EXECUTE ON FUNCTION permitq.template_for(text) FROM PUBLIC;
ALTER FUNCTION permitq.next_window_opening()
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION permitq.next_window_opening() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.next_window_opening() TO permitq_worker;
REVOKE EXECUTE ON FUNCTION permitq.in_window(permitq.semaphore) FROM PUBLIC;

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

-- Worker step 1: as in V4, plus each request's effective priority; the "ready" part takes the
-- first waiters of every priority level of a semaphore with room, a rate-limited semaphore's room
-- being what its window leaves.
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

-- Worker step 3: as in V7, plus grants on rate-limited semaphores are logged in rate_grant at
-- their acquired_at, and a new waiter's priority and created_at go into the queue.
CREATE OR REPLACE FUNCTION permitq.apply_decision(
    worker text,
    granted bigint[],
    errored bigint[],
    error_codes text[],
    waiting bigint[]
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    -- The high bits of this batch's tokens: its timeline (see V7).
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
