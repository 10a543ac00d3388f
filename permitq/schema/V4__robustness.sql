-- V4: bounded input, failure isolation, least privilege.
--
-- 1. Bounds. `ttl`, `wait` and a heartbeat's `extend` are at most 10 years, written as 3653 days
--    (humantime's `10y` is 3652.5 days; PostgreSQL compares '10 years' as 3600): every timestamp a
--    worker or a sweep computes from them (created_at + wait, acquired_at + ttl, now() + extend)
--    then stays far inside PostgreSQL's range. Counts are 1..2147483647 and `used` only grows by
--    grants that fit a capacity (an int), so no sum overflows either.
-- 2. Failure isolation. A request the worker cannot decide or write is settled alone as
--    `error` / `invalid` (permitq.settle_invalid); the batch it was in is retried without it.
-- 3. status() returns no row for an unknown id.
-- 4. Least privilege: roles permitq_producer, permitq_worker, permitq_admin (NOLOGIN), every
--    function SECURITY DEFINER with a pinned search_path, and exactly the grants each role needs.

-- 1. Bounds ------------------------------------------------------------------------------------

-- Why an interval is out of bounds, or NULL when it is fine (NULL itself is fine: a default).
CREATE FUNCTION permitq.interval_problem(value interval, zero_allowed boolean) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN value IS NULL THEN NULL
        WHEN zero_allowed AND value < interval '0' THEN format('must not be negative, got %s', value)
        WHEN NOT zero_allowed AND value <= interval '0' THEN format('must be positive, got %s', value)
        WHEN value > interval '3653 days' THEN format('must be at most 10 years (3653 days), got %s', value)
    END
$$;

-- Why a stored request cannot be decided, or NULL. What the worker checks on every request it
-- has not examined yet: rows written past the constraints (triggers off, or before V4) included.
CREATE FUNCTION permitq.request_problem(r permitq.permit_request) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT coalesce('permits: ' || permitq.permits_problem(r.permits),
                    'ttl: ' || permitq.interval_problem(r.ttl, false),
                    'wait: ' || permitq.interval_problem(r.wait, true))
$$;

CREATE OR REPLACE FUNCTION permitq.before_request_insert() RETURNS trigger
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    problem text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.permits IS DISTINCT FROM OLD.permits THEN
            RAISE EXCEPTION 'permits of a request cannot change' USING ERRCODE = '23514',
                CONSTRAINT = 'permit_request_permits_valid';
        END IF;
        RETURN NEW;
    END IF;
    problem := permitq.permits_problem(NEW.permits);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "permit_request" violates check constraint "permit_request_permits_valid"'
            USING ERRCODE = '23514', CONSTRAINT = 'permit_request_permits_valid', DETAIL = problem;
    END IF;
    problem := permitq.interval_problem(NEW.ttl, false);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid ttl: %', problem USING ERRCODE = '22023';
    END IF;
    problem := permitq.interval_problem(NEW.wait, true);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid wait: %', problem USING ERRCODE = '22023';
    END IF;
    IF NEW.state <> 'new' OR NEW.fencing_token IS NOT NULL OR NEW.acquired_at IS NOT NULL
       OR NEW.examined THEN
        RAISE EXCEPTION 'invalid permit_request: new requests must be inserted in state new'
            USING ERRCODE = '22023';
    END IF;
    NEW.created_at := clock_timestamp();
    -- wait = 0 is fail fast, decided when a worker first sees it: no deadline to sweep.
    NEW.wait_until := CASE WHEN NEW.wait > interval '0' THEN NEW.created_at + NEW.wait END;
    RETURN NEW;
END $$;

-- The same bounds as CHECK constraints, for writes that bypass the trigger. NOT VALID: rows
-- already stored are not re-checked here (the worker settles them as `invalid`).
ALTER TABLE permitq.permit_request
    DROP CONSTRAINT permit_request_ttl_valid,
    DROP CONSTRAINT permit_request_wait_valid,
    DROP CONSTRAINT permit_request_error_code_valid;
ALTER TABLE permitq.permit_request
    ADD CONSTRAINT permit_request_ttl_valid
        CHECK (ttl > interval '0' AND ttl <= interval '3653 days') NOT VALID,
    ADD CONSTRAINT permit_request_wait_valid
        CHECK (wait >= interval '0' AND wait <= interval '3653 days') NOT VALID,
    ADD CONSTRAINT permit_request_error_code_valid CHECK (error_code IN
        ('unknown_semaphore', 'exceeds_capacity', 'no_capacity', 'timeout', 'cancelled', 'invalid'));

CREATE OR REPLACE FUNCTION permitq.heartbeat(external_id text, extend interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    request permitq.permit_request;
    new_expiry timestamptz;
    problem text;
BEGIN
    problem := permitq.interval_problem(extend, false);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid extend: %', problem USING ERRCODE = '22023';
    END IF;
    SELECT * INTO request FROM permitq.permit_request r WHERE r.external_id = $1 FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'lease lost: request % is unknown', $1 USING ERRCODE = '55000';
    END IF;
    IF request.state <> 'acquired' THEN
        RAISE EXCEPTION 'lease lost: request % is %', $1,
            concat_ws(' ', request.state, request.error_code, request.release_reason)
            USING ERRCODE = '55000';
    END IF;
    IF request.expires_at IS NOT NULL AND request.expires_at <= now() THEN
        RAISE EXCEPTION 'lease lost: request % expired at %', $1, request.expires_at
            USING ERRCODE = '55000';
    END IF;
    -- A stored ttl out of bounds (written before V4) extends by the bound.
    new_expiry := now() + coalesce(extend, least(request.ttl, interval '3653 days'));
    UPDATE permitq.permit_request r SET expires_at = new_expiry, heartbeat_at = now()
    WHERE r.id = request.id;
    RETURN new_expiry;
END $$;

-- 2. Failure isolation -------------------------------------------------------------------------

-- Worker step 1, as in V3, plus `problem`: for requests no worker has examined yet, why the
-- request cannot be decided (the worker fails it as `invalid`), else NULL.
DROP FUNCTION permitq.claim_batch(bigint, bigint);
CREATE FUNCTION permitq.claim_batch(cursor bigint, batch_size bigint)
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET enable_seqscan = off AS $$
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
               s.capacity - s.used
                 + coalesce((SELECT sum(p.count) FROM permitq.pending_release p
                             WHERE p.semaphore = s.name), 0) AS free
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

-- Worker, isolating a failed batch: claim these requests (still `new`) one set at a time, with
-- the columns of claim_batch. Lock order step 1, like claim_batch.
CREATE FUNCTION permitq.claim_requests(ids bigint[])
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text)
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           CASE WHEN NOT r.examined THEN permitq.request_problem(r) END, r.external_id
    FROM permitq.permit_request r
    WHERE r.id = ANY(ids) AND r.state = 'new'
    ORDER BY r.id
    FOR UPDATE SKIP LOCKED
$$;

-- Worker: a request that failed a batch on its own. Ends it as `error` / `invalid` (out-of-bound
-- intervals are cleared so that the row satisfies the constraints), drops its waiter rows, sends
-- its event. Takes only the request's row lock. Returns its external_id (NULL if no longer new).
CREATE FUNCTION permitq.settle_invalid(request_id bigint) RETURNS text
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    settled text;
BEGIN
    UPDATE permitq.permit_request r
    SET state = 'error', error_code = 'invalid', settled_at = clock_timestamp(),
        ttl = CASE WHEN permitq.interval_problem(r.ttl, false) IS NULL THEN r.ttl END,
        wait = CASE WHEN permitq.interval_problem(r.wait, true) IS NULL THEN r.wait END
    WHERE r.id = request_id AND r.state = 'new'
    RETURNING r.external_id INTO settled;
    IF settled IS NOT NULL THEN
        DELETE FROM permitq.waiter w WHERE w.request_id = settle_invalid.request_id;
        PERFORM permitq.notify_events(ARRAY[request_id]);
    END IF;
    RETURN settled;
END $$;

-- Heads, as in V3, reading unexamined rows defensively: one of them may hold anything.
CREATE OR REPLACE FUNCTION permitq.semaphore_heads(semaphore_ids bigint[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET enable_seqscan = off AS $$
BEGIN
    RETURN QUERY
    SELECT s.name, w.request_id, w.count
    FROM unnest(semaphore_ids) AS locked(id)
    JOIN permitq.semaphore s ON s.id = locked.id
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count FROM permitq.waiter wt
        WHERE wt.semaphore_id = locked.id AND wt.request_id <> ALL(batch_ids)
        ORDER BY wt.semaphore_id, wt.request_id
        LIMIT 1
    ) w;
    RETURN QUERY
    SELECT e.key, r.id,
           CASE WHEN jsonb_typeof(e.value) = 'number'
                     AND e.value::numeric BETWEEN 1 AND 2147483647
                THEN e.value::numeric::int ELSE 1 END
    FROM permitq.permit_request r
    CROSS JOIN LATERAL jsonb_each(CASE WHEN jsonb_typeof(r.permits) = 'object'
                                       THEN r.permits ELSE '{}'::jsonb END) e
    JOIN permitq.semaphore s ON s.name = e.key
    WHERE r.state = 'new' AND NOT r.examined AND r.id < newest_id AND r.id <> ALL(batch_ids)
      AND s.id = ANY(semaphore_ids);
END $$;

-- 2b. Events chunked by size, not by count: a notification's payload must stay under 8000 bytes,
-- and 40 events with 255-character external_ids did not (the batch's NOTIFY failed with 22023
-- and the whole batch with it). A chunk starts before 6000 bytes and one event is at most ~1,700
-- (an external_id of 255 characters, each escaped as \uXXXX), so every chunk fits.
CREATE OR REPLACE FUNCTION permitq.notify_events(request_ids bigint[]) RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    payload text;
BEGIN
    FOR payload IN
        SELECT '[' || string_agg(e.event, ',' ORDER BY e.id) || ']'
        FROM (SELECT e.id, e.event,
                     (sum(octet_length(e.event) + 1) OVER (ORDER BY e.id) - octet_length(e.event) - 1)
                         / 6000 AS chunk
              FROM (SELECT r.id, json_build_object(
                           'external_id', r.external_id,
                           'state', r.state,
                           'error_code', r.error_code,
                           'release_reason', r.release_reason,
                           'fencing_token', r.fencing_token,
                           'expires_at', r.expires_at)::text AS event
                    FROM permitq.permit_request r WHERE r.id = ANY(request_ids)) e) e
        GROUP BY e.chunk
    LOOP
        PERFORM pg_notify('permitq_events', payload);
    END LOOP;
END $$;

-- 3. status: no row for an unknown id ----------------------------------------------------------

DROP FUNCTION permitq.status(text);
CREATE FUNCTION permitq.status(external_id text) RETURNS SETOF permitq.permit_request
LANGUAGE sql SET plan_cache_mode = force_custom_plan STABLE AS $$
    SELECT * FROM permitq.permit_request r WHERE r.external_id = $1
$$;

-- 4. Least privilege ---------------------------------------------------------------------------

-- The roles, created when missing. They are cluster-wide, so another database's migration may
-- create one at the same moment: that race is not an error.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['permitq_producer', 'permitq_worker', 'permitq_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN NULL;
                WHEN insufficient_privilege THEN
                    RAISE EXCEPTION 'permitq migrate needs the roles permitq_producer, permitq_worker and permitq_admin, and % may not create roles', current_user
                        USING ERRCODE = '42501',
                              HINT = 'run migrate once as a role with CREATEROLE, or have a DBA run: CREATE ROLE permitq_producer NOLOGIN; CREATE ROLE permitq_worker NOLOGIN; CREATE ROLE permitq_admin NOLOGIN;';
            END;
        END IF;
    END LOOP;
END $$;

-- The entry points (what the roles below may call, and the trigger functions, which fire for
-- whoever writes the table) run as their owner, the role that migrated, with a search_path
-- nobody else can write to (CVE-2018-1058); the bodies name every permitq object with its
-- schema. The internal helpers they call run as the caller, which inside an entry point is the
-- owner with that search_path already: they carry no SET clauses, because every SET costs a
-- configuration save and restore per call (measured: the per-row checks in a claim of 100
-- requests cost a third of the drain rate with them). Nobody else may call a helper: EXECUTE is
-- revoked from PUBLIC below.
DO $$
DECLARE
    f record;
    entry_points text[] := ARRAY[
        'submit', 'status', 'release', 'cancel', 'heartbeat', 'fence', 'set_capacity', 'revoke',
        'claim_batch', 'claim_requests', 'lock_and_fold', 'fold_releases', 'semaphore_heads',
        'apply_decision', 'settle_invalid', 'sweep_wait_deadlines', 'sweep_expired', 'sweep_stale',
        'revoke_owners', 'delete_settled', 'delete_capacity_changes',
        'before_request_insert', 'wake_workers_after_insert', 'audit_capacity'];
BEGIN
    FOR f IN SELECT p.oid::regprocedure AS signature, p.proname AS name
             FROM pg_catalog.pg_proc p
             JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'permitq' AND p.prokind = 'f'
    LOOP
        IF f.name = ANY(entry_points) THEN
            EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off', f.signature);
        ELSE
            EXECUTE format('ALTER FUNCTION %s SECURITY INVOKER RESET ALL', f.signature);
        END IF;
    END LOOP;
END $$;

REVOKE ALL ON SCHEMA permitq FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA permitq FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA permitq FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA permitq FROM PUBLIC;
GRANT USAGE ON SCHEMA permitq TO permitq_producer, permitq_worker, permitq_admin;

-- Everyone may read the queue and the semaphores (and watch events: LISTEN needs no grant).
GRANT SELECT ON permitq.semaphore, permitq.permit_request, permitq.permit, permitq.capacity_change,
    permitq.semaphore_usage, permitq.holders, permitq.waiters, permitq.schema_migration
    TO permitq_producer, permitq_worker, permitq_admin;
GRANT EXECUTE ON FUNCTION permitq.status(text) TO permitq_producer, permitq_worker, permitq_admin;

-- Producers: submit (or a plain INSERT of the request columns), release or cancel, heartbeat,
-- fence. Nothing else writes.
GRANT EXECUTE ON FUNCTION
    permitq.submit(text, jsonb, text, interval, interval),
    permitq.release(text),
    permitq.cancel(text),
    permitq.heartbeat(text, interval),
    permitq.fence(text, bigint)
    TO permitq_producer, permitq_admin;
GRANT INSERT (external_id, permits, owner, ttl, wait) ON permitq.permit_request
    TO permitq_producer, permitq_admin;

-- Workers: the claim loop, the sweeps and retention, and their own wake-up row.
GRANT EXECUTE ON FUNCTION
    permitq.claim_batch(bigint, bigint),
    permitq.claim_requests(bigint[]),
    permitq.lock_and_fold(text[]),
    permitq.fold_releases(),
    permitq.semaphore_heads(bigint[], bigint[], bigint),
    permitq.apply_decision(text, bigint[], bigint[], text[], bigint[]),
    permitq.settle_invalid(bigint),
    permitq.sweep_wait_deadlines(integer),
    permitq.sweep_expired(integer),
    permitq.sweep_stale(interval, integer),
    permitq.revoke_owners(text[], integer),
    permitq.delete_settled(interval, integer),
    permitq.delete_capacity_changes(interval, integer)
    TO permitq_worker;
GRANT SELECT ON permitq.pending_release TO permitq_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON permitq.worker_wake TO permitq_worker;

-- Administrators: capacity, revoke, retention, on top of what producers may do.
GRANT EXECUTE ON FUNCTION
    permitq.set_capacity(text, integer, boolean),
    permitq.revoke(text),
    permitq.delete_settled(interval, integer),
    permitq.delete_capacity_changes(interval, integer)
    TO permitq_admin;

