-- permitq core schema: semaphores, the permit-request queue, granted permits, and the SQL API
-- (submit, status, release, set_capacity).
--
-- Lock order, used by every transaction that changes a semaphore's `used`:
--   1. permit_request rows (the worker claims them FOR UPDATE SKIP LOCKED; release and the sweeps
--      lock the one request, or a batch of them, first);
--   2. then semaphore rows, FOR UPDATE, in ascending semaphore id.
-- One global order means the worker, release, set_capacity and the sweeps cannot deadlock each
-- other; `used` only ever changes under the semaphore's row lock, so it stays exact.

-- Functions that read tables run with plan_cache_mode = force_custom_plan. PL/pgSQL caches a
-- generic plan per statement per session; one made while the queue was tiny (a sequential scan
-- is cheapest then) stays in a long-lived worker session after a burst grows the table, until
-- ANALYZE invalidates it. Measured with `permitq bench`: 100,000 rows inserted at once tripled
-- grant latency until ANALYZE ran. A custom plan per call sees the table's real size.

CREATE SCHEMA IF NOT EXISTS permitq;

-- Why a permits object is invalid, or NULL when it is valid. Shared by the CHECK constraint (plain
-- INSERTs) and permitq.submit (which turns it into SQLSTATE 22023), so both paths agree.
CREATE FUNCTION permitq.permits_problem(p jsonb) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    entry record;
    n int := 0;
    count_value numeric;
BEGIN
    IF p IS NULL THEN
        RETURN 'must not be null';
    END IF;
    IF jsonb_typeof(p) <> 'object' THEN
        RETURN format('must be a JSON object {"semaphore": count, ...}, got %s', jsonb_typeof(p));
    END IF;
    FOR entry IN SELECT key, value FROM jsonb_each(p) LOOP
        n := n + 1;
        IF entry.key = '' THEN
            RETURN 'semaphore name must not be empty';
        END IF;
        IF length(entry.key) > 255 THEN
            RETURN 'semaphore name must be at most 255 characters';
        END IF;
        IF jsonb_typeof(entry.value) <> 'number' THEN
            RETURN format('count for %s must be an integer, got %s', entry.key, entry.value);
        END IF;
        count_value := entry.value::numeric;
        IF count_value <> trunc(count_value) THEN
            RETURN format('count for %s must be an integer, got %s', entry.key, entry.value);
        END IF;
        IF count_value < 1 OR count_value > 2147483647 THEN
            RETURN format('count for %s must be between 1 and 2147483647, got %s', entry.key, entry.value);
        END IF;
    END LOOP;
    IF n = 0 THEN
        RETURN 'must name at least one semaphore';
    END IF;
    IF n > 64 THEN
        RETURN format('must name at most 64 semaphores, got %s', n);
    END IF;
    RETURN NULL;
END $$;

CREATE TABLE permitq.semaphore (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name       text NOT NULL UNIQUE
               CONSTRAINT semaphore_name_valid CHECK (name <> '' AND length(name) <= 255),
    capacity   integer NOT NULL CONSTRAINT semaphore_capacity_valid CHECK (capacity >= 0),
    -- Sum of counts of this semaphore's acquired permits. Changed only under this row's lock.
    used       integer NOT NULL DEFAULT 0 CONSTRAINT semaphore_used_valid CHECK (used >= 0),
    fair       boolean NOT NULL DEFAULT true,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE permitq.permit_request (
    -- Also the FIFO order of the queue.
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    external_id    text NOT NULL
                   CONSTRAINT permit_request_external_id_key UNIQUE
                   CONSTRAINT permit_request_external_id_valid
                       CHECK (external_id <> '' AND length(external_id) <= 255),
    permits        jsonb NOT NULL
                   CONSTRAINT permit_request_permits_valid CHECK (permitq.permits_problem(permits) IS NULL),
    owner          text,
    ttl            interval CONSTRAINT permit_request_ttl_valid CHECK (ttl > interval '0'),
    wait           interval CONSTRAINT permit_request_wait_valid CHECK (wait >= interval '0'),
    state          text NOT NULL DEFAULT 'new'
                   CONSTRAINT permit_request_state_valid
                       CHECK (state IN ('new', 'in_progress', 'acquired', 'released', 'error')),
    error_code     text CONSTRAINT permit_request_error_code_valid CHECK (error_code IN
                       ('unknown_semaphore', 'exceeds_capacity', 'no_capacity', 'timeout', 'cancelled')),
    release_reason text CONSTRAINT permit_request_release_reason_valid CHECK (release_reason IN
                       ('released', 'expired', 'stale', 'revoked')),
    fencing_token  bigint,
    -- Set once a worker has looked at the request and left it waiting; see permitq.waiter.
    examined       boolean NOT NULL DEFAULT false,
    -- The worker that granted or failed the request.
    worker_id      text,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- created_at + wait (NULL for wait = 0), a column so the deadline sweep can use an index.
    wait_until     timestamptz,
    acquired_at    timestamptz,
    expires_at     timestamptz,
    heartbeat_at   timestamptz,
    released_at    timestamptz,
    -- When the request reached `error` or `released`; retention counts from here.
    settled_at     timestamptz,
    CONSTRAINT permit_request_state_fields CHECK (
        (state = 'error') = (error_code IS NOT NULL)
        AND (state = 'released') = (release_reason IS NOT NULL)
        AND (state IN ('acquired', 'released')) = (acquired_at IS NOT NULL AND fencing_token IS NOT NULL)
        AND (state = 'released') = (released_at IS NOT NULL)
        AND (state IN ('released', 'error')) = (settled_at IS NOT NULL)
    )
);

-- Fencing tokens: one global sequence, drawn at grant time under the semaphore locks.
CREATE SEQUENCE permitq.fencing_token_seq AS bigint;
CREATE UNIQUE INDEX permit_request_fencing_token_key
    ON permitq.permit_request (fencing_token) WHERE fencing_token IS NOT NULL;

-- The queue. Partial, so it holds only the backlog however many settled rows pile up: the claim
-- query reads it in id order and stays cheap.
CREATE INDEX permit_request_pending_idx ON permitq.permit_request (id) WHERE state = 'new';
-- Pending requests no worker has looked at yet (fairness across workers, see permitq.waiter).
CREATE INDEX permit_request_unexamined_idx
    ON permitq.permit_request (id) WHERE state = 'new' AND NOT examined;
-- Wait deadlines, for the timeout sweep.
CREATE INDEX permit_request_wait_until_idx
    ON permitq.permit_request (wait_until) WHERE state = 'new' AND wait_until IS NOT NULL;
-- Held permits: lease expiry and --max-hold sweeps.
CREATE INDEX permit_request_expires_at_idx
    ON permitq.permit_request (expires_at) WHERE state = 'acquired' AND expires_at IS NOT NULL;
CREATE INDEX permit_request_acquired_at_idx
    ON permitq.permit_request (acquired_at) WHERE state = 'acquired';
-- Retention.
CREATE INDEX permit_request_settled_at_idx
    ON permitq.permit_request (settled_at) WHERE state IN ('released', 'error');

-- One row per semaphore of a granted request.
CREATE TABLE permitq.permit (
    request_id  bigint NOT NULL REFERENCES permitq.permit_request (id) ON DELETE CASCADE,
    semaphore   text NOT NULL REFERENCES permitq.semaphore (name),
    count       integer NOT NULL CONSTRAINT permit_count_valid CHECK (count > 0),
    state       text NOT NULL CONSTRAINT permit_state_valid CHECK (state IN ('acquired', 'released')),
    acquired_at timestamptz NOT NULL,
    released_at timestamptz,
    PRIMARY KEY (request_id, semaphore),
    CONSTRAINT permit_state_fields CHECK ((state = 'released') = (released_at IS NOT NULL))
);
CREATE INDEX permit_held_idx ON permitq.permit (semaphore) WHERE state = 'acquired';

-- Fairness across workers. When a worker leaves a request waiting for the first time, it records
-- the request's place in the queue of every semaphore it names. The oldest waiter of a fair
-- semaphore is its head: later requests may take capacity there only if what remains still covers
-- the head's count. Rows are written under the semaphore's lock and removed by trigger the moment
-- the request leaves `new`, so whoever holds a semaphore's lock sees its true head.
CREATE TABLE permitq.waiter (
    semaphore_id bigint NOT NULL REFERENCES permitq.semaphore (id),
    request_id   bigint NOT NULL REFERENCES permitq.permit_request (id) ON DELETE CASCADE,
    count        integer NOT NULL,
    PRIMARY KEY (semaphore_id, request_id)
);
CREATE INDEX waiter_request_idx ON permitq.waiter (request_id);

-- New rows start as `new`, whatever path inserted them, and carry their wait deadline.
CREATE FUNCTION permitq.before_request_insert() RETURNS trigger
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
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

CREATE TRIGGER permit_request_before_insert BEFORE INSERT ON permitq.permit_request
    FOR EACH ROW EXECUTE FUNCTION permitq.before_request_insert();

-- Wakes the workers once per INSERT statement that added rows (not once per row).
CREATE FUNCTION permitq.notify_work_inserted() RETURNS trigger
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM inserted) THEN
        PERFORM pg_notify('permitq_work', '');
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER permit_request_after_insert AFTER INSERT ON permitq.permit_request
    REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION permitq.notify_work_inserted();

-- Every transition to acquired, error or released: drop the request's waiter rows (it waits no
-- more) and tell producers on `permitq_events`.
CREATE FUNCTION permitq.after_request_settled() RETURNS trigger
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    IF OLD.state = 'new' THEN
        DELETE FROM permitq.waiter WHERE request_id = NEW.id;
    END IF;
    PERFORM pg_notify('permitq_events', json_build_object(
        'external_id', NEW.external_id,
        'state', NEW.state,
        'error_code', NEW.error_code,
        'release_reason', NEW.release_reason,
        'fencing_token', NEW.fencing_token)::text);
    RETURN NULL;
END $$;

CREATE TRIGGER permit_request_state_changed AFTER UPDATE OF state ON permitq.permit_request
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state AND NEW.state IN ('acquired', 'error', 'released'))
    EXECUTE FUNCTION permitq.after_request_settled();

-- permitq.submit: validate, insert idempotently by external_id, wake the workers (the insert
-- trigger does that). The same external_id with the same parameters returns the existing row
-- unchanged; with different parameters it raises 23505. Never two rows: the unique key decides.
CREATE FUNCTION permitq.submit(
    external_id text,
    permits jsonb,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    wait interval DEFAULT NULL
) RETURNS permitq.permit_request
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
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
    IF submit.wait IS NOT NULL AND submit.wait < interval '0' THEN
        RAISE EXCEPTION 'invalid wait: must not be negative, got %', submit.wait
            USING ERRCODE = '22023';
    END IF;
    LOOP
        INSERT INTO permitq.permit_request (external_id, permits, owner, ttl, wait)
        VALUES (submit.external_id, submit.permits, submit.owner, submit.ttl, submit.wait)
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
               AND existing.wait IS NOT DISTINCT FROM submit.wait THEN
                RETURN existing;
            END IF;
            RAISE EXCEPTION 'external_id % already exists with different parameters', submit.external_id
                USING ERRCODE = '23505',
                      DETAIL = format('existing: permits=%s owner=%s ttl=%s wait=%s',
                          existing.permits, existing.owner, existing.ttl, existing.wait);
        END IF;
        -- The conflicting row was deleted (retention) between the two statements: insert again.
    END LOOP;
END $$;

-- permitq.status: the request row, or NULL for an unknown external_id.
CREATE FUNCTION permitq.status(external_id text) RETURNS permitq.permit_request
LANGUAGE sql SET plan_cache_mode = force_custom_plan STABLE AS $$
    SELECT * FROM permitq.permit_request r WHERE r.external_id = $1
$$;

-- Gives the permits of acquired requests back. Precondition: the caller's transaction holds the
-- row locks of these requests (lock order step 1) and they are `acquired`. Locks their semaphores
-- in id order (step 2), then returns the capacity, marks permits and requests released and wakes
-- the workers. Used by release, revoke and every sweep, so there is one release path.
CREATE FUNCTION permitq.release_locked(request_ids bigint[], reason text) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    released_count integer;
BEGIN
    PERFORM 1 FROM permitq.semaphore s
    WHERE s.name IN (SELECT p.semaphore FROM permitq.permit p
                     WHERE p.request_id = ANY(request_ids) AND p.state = 'acquired')
    ORDER BY s.id
    FOR UPDATE;

    UPDATE permitq.semaphore s
    SET used = s.used - t.total, updated_at = now()
    FROM (SELECT p.semaphore, sum(p.count) AS total FROM permitq.permit p
          WHERE p.request_id = ANY(request_ids) AND p.state = 'acquired'
          GROUP BY p.semaphore) t
    WHERE s.name = t.semaphore;

    UPDATE permitq.permit p SET state = 'released', released_at = clock_timestamp()
    WHERE p.request_id = ANY(request_ids) AND p.state = 'acquired';

    UPDATE permitq.permit_request r
    SET state = 'released', release_reason = reason, released_at = clock_timestamp(),
        settled_at = clock_timestamp()
    WHERE r.id = ANY(request_ids) AND r.state = 'acquired';
    GET DIAGNOSTICS released_count = ROW_COUNT;

    IF released_count > 0 THEN
        PERFORM pg_notify('permitq_work', '');
    END IF;
    RETURN released_count;
END $$;

-- Ends one request for its holder or an operator: gives the permits back when it is acquired
-- (recording `reason`), cancels it when it is still waiting. Returns released | already_released
-- | cancelled | not_acquired | unknown. Idempotent.
CREATE FUNCTION permitq.release_request(external_id text, reason text) RETURNS text
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    request permitq.permit_request;
BEGIN
    -- Lock order step 1: the request row. If a worker is deciding it right now, this waits for
    -- that transaction and then sees its outcome.
    SELECT * INTO request FROM permitq.permit_request r WHERE r.external_id = $1 FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    CASE request.state
        WHEN 'acquired' THEN
            PERFORM permitq.release_locked(ARRAY[request.id], reason);
            RETURN 'released';
        WHEN 'new' THEN
            UPDATE permitq.permit_request r
            SET state = 'error', error_code = 'cancelled', settled_at = clock_timestamp()
            WHERE r.id = request.id;
            -- It may have been the head of a fair semaphore: others may go now.
            PERFORM pg_notify('permitq_work', '');
            RETURN 'cancelled';
        WHEN 'released' THEN
            RETURN 'already_released';
        ELSE
            RETURN 'not_acquired';
    END CASE;
END $$;

-- permitq.release: the holder gives its permits back, or cancels a request still waiting.
-- Returns released | already_released | cancelled | not_acquired | unknown. Idempotent.
CREATE FUNCTION permitq.release(external_id text) RETURNS text
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$ SELECT permitq.release_request($1, 'released') $$;

-- permitq.cancel: the same as release, under the name a producer that gives up looks for.
CREATE FUNCTION permitq.cancel(external_id text) RETURNS text
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$ SELECT permitq.release($1) $$;

-- permitq.set_capacity: create or change a semaphore and wake the workers. Lowering capacity below
-- `used` revokes nothing; new grants wait until `used` drops below the new capacity.
CREATE FUNCTION permitq.set_capacity(name text, capacity integer, fair boolean DEFAULT NULL)
RETURNS permitq.semaphore
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    result permitq.semaphore;
BEGIN
    IF set_capacity.name IS NULL OR set_capacity.name = '' THEN
        RAISE EXCEPTION 'invalid name: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(set_capacity.name) > 255 THEN
        RAISE EXCEPTION 'invalid name: must be at most 255 characters' USING ERRCODE = '22023';
    END IF;
    IF set_capacity.capacity IS NULL OR set_capacity.capacity < 0 THEN
        RAISE EXCEPTION 'invalid capacity: must be a non-negative integer, got %',
            coalesce(set_capacity.capacity::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    INSERT INTO permitq.semaphore AS s (name, capacity, fair)
    VALUES (set_capacity.name, set_capacity.capacity, coalesce(set_capacity.fair, true))
    ON CONFLICT ON CONSTRAINT semaphore_name_key DO UPDATE
        SET capacity = EXCLUDED.capacity,
            fair = coalesce(set_capacity.fair, s.fair),
            updated_at = now()
    RETURNING * INTO result;
    PERFORM pg_notify('permitq_work', '');
    RETURN result;
END $$;

-- Worker step 2 of the lock order: lock every semaphore a claimed batch names, FOR UPDATE in
-- ascending id (the row locks are taken above the sort, so in this order). release,
-- set_capacity and every sweep lock semaphores in the same order, which keeps the whole system
-- deadlock-free. The rows returned are the latest committed versions, so `used` is exact for as
-- long as the caller's transaction runs.
CREATE FUNCTION permitq.lock_semaphores(names text[])
RETURNS TABLE (id bigint, name text, capacity integer, used integer, fair boolean)
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$
    SELECT s.id, s.name, s.capacity, s.used, s.fair
    FROM permitq.semaphore s
    WHERE s.name = ANY(names)
    ORDER BY s.id
    FOR UPDATE
$$;

-- Worker, after lock_semaphores: the requests waiting on the locked semaphores that are not in
-- the caller's batch, the heads fair semaphores must keep room for. Called as its own statement
-- after the locks are held: in READ COMMITTED it then sees everything the previous holders of
-- those locks committed (a snapshot taken before waiting for the locks would not).
CREATE FUNCTION permitq.semaphore_heads(semaphore_ids bigint[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer)
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$
    -- Each semaphore's oldest recorded waiter (permitq.waiter, written under the lock).
    SELECT s.name, w.request_id, w.count
    FROM unnest(semaphore_ids) AS locked(id)
    JOIN permitq.semaphore s ON s.id = locked.id
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count FROM permitq.waiter wt
        WHERE wt.semaphore_id = locked.id AND wt.request_id <> ALL(batch_ids)
        ORDER BY wt.request_id
        LIMIT 1
    ) w
    UNION ALL
    -- Older pending requests no worker has examined yet (another worker holds them right now,
    -- or they were committed after the caller's claim). Until someone examines them they count
    -- as waiting, so a concurrent batch cannot slip past an older request it has not seen.
    SELECT e.key, r.id, e.value::int
    FROM permitq.permit_request r
    CROSS JOIN LATERAL jsonb_each(r.permits) e
    JOIN permitq.semaphore s ON s.name = e.key
    WHERE r.state = 'new' AND NOT r.examined AND r.id < newest_id AND r.id <> ALL(batch_ids)
      AND s.id = ANY(semaphore_ids)
$$;

-- Worker step, after the decision: writes a batch's outcome set-based. Precondition: the
-- caller's transaction holds the row locks of all these requests (claimed FOR UPDATE SKIP LOCKED)
-- and, in id order, the locks of every semaphore they name.
CREATE FUNCTION permitq.apply_decision(
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
    UPDATE permitq.permit_request r
    SET state = 'error', error_code = e.code, settled_at = clock_timestamp(), worker_id = worker
    FROM unnest(errored, error_codes) AS e(id, code)
    WHERE r.id = e.id;

    -- Grants. Tokens and timestamps are drawn in id order, after the locks are held, so token
    -- order, acquired_at order and FIFO order agree (volatile output columns are computed after
    -- the ORDER BY).
    WITH g AS (
        SELECT id, nextval('permitq.fencing_token_seq') AS token, clock_timestamp() AS at
        FROM unnest(granted) AS id
        ORDER BY id
    )
    UPDATE permitq.permit_request r
    SET state = 'acquired', fencing_token = g.token, acquired_at = g.at,
        expires_at = g.at + r.ttl, worker_id = worker
    FROM g
    WHERE r.id = g.id;

    INSERT INTO permitq.permit (request_id, semaphore, count, state, acquired_at)
    SELECT r.id, e.key, e.value::int, 'acquired', r.acquired_at
    FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
    WHERE r.id = ANY(granted);

    UPDATE permitq.semaphore s
    SET used = s.used + t.total, updated_at = now()
    FROM (SELECT p.semaphore, sum(p.count) AS total FROM permitq.permit p
          WHERE p.request_id = ANY(granted) GROUP BY p.semaphore) t
    WHERE s.name = t.semaphore;

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
END $$;
