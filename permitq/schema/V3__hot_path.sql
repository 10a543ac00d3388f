-- Hot semaphores and deep queues.
--
-- 1. Release takes no semaphore lock. A holder's release is a one-way state change on its own
--    request row plus one row per semaphore in permitq.pending_release (fan-out rows, seeds 001
--    and 003). Workers fold those rows into semaphore.used under the semaphore lock, in batches,
--    in the same transaction as their grants. So `used` may run ahead of the exact held count
--    between a release and the next fold; it never under-counts. permitq.semaphore_usage has the
--    exact figures.
-- 2. Wake-ups are coalesced. Workers record in permitq.worker_wake whether they are asleep;
--    submit, release and cancel NOTIFY permitq_work only when one is (PostgreSQL serializes the
--    commits of notifying transactions, so a NOTIFY per request caps the commit rate). See
--    permitq.wake_workers for the protocol that makes this safe.
-- 3. Events are batched: one permitq_events notification carries a JSON array of up to 40
--    outcomes. Workers send them for their own transactions; the outcomes of releases and
--    cancels are sent by the worker that folds them. The per-row state trigger is gone.
-- 4. A pass looks only at what could be granted: requests no worker has examined yet, and the
--    first waiters of semaphores that have room (permitq.claim_batch). Semaphores that are full
--    cost nothing per pass, however long their queues.
-- 5. permitq.permit is a view over granted requests (no row written per semaphore at grant and
--    release), and the permits CHECK runs on INSERT only (a trigger), not on every UPDATE.
--
-- Lock order is unchanged: request rows first, then semaphore rows in ascending id. Release and
-- cancel lock only their own request row.

-- 5. permit: a view. The CHECK on permits becomes an insert trigger (permits never change).
DROP TABLE permitq.permit;
CREATE VIEW permitq.permit AS
SELECT r.id AS request_id,
       e.key AS semaphore,
       e.value::int AS count,
       CASE WHEN r.state = 'acquired' THEN 'acquired' ELSE 'released' END AS state,
       r.acquired_at,
       r.released_at
FROM permitq.permit_request r
CROSS JOIN LATERAL jsonb_each(r.permits) e
WHERE r.acquired_at IS NOT NULL;

ALTER TABLE permitq.permit_request DROP CONSTRAINT permit_request_permits_valid;

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

CREATE TRIGGER permit_request_permits_unchanged BEFORE UPDATE OF permits ON permitq.permit_request
    FOR EACH ROW EXECUTE FUNCTION permitq.before_request_insert();

-- 1. Releases not yet folded into semaphore.used. `semaphore` NULL: a cancel, only an event to
-- send. `announce`: the one row per request whose fold sends the request's event.
CREATE TABLE permitq.pending_release (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id bigint NOT NULL,
    semaphore  text,
    count      integer NOT NULL DEFAULT 0,
    announce   boolean NOT NULL
);
CREATE INDEX pending_release_semaphore_idx ON permitq.pending_release (semaphore);

-- 2. Which workers are asleep (waiting for a notification). Unlogged: it is not data, a worker
-- re-registers after a crash restart, and writing it costs no WAL flush.
-- A row whose `awake_by` has passed belongs to a worker that died asleep (a sleeping worker wakes
-- at least every poll interval and writes its row again), so it no longer counts.
CREATE UNLOGGED TABLE permitq.worker_wake (
    worker_id  text PRIMARY KEY,
    sleeping   boolean NOT NULL,
    awake_by   timestamptz NOT NULL
);

-- Wakes the workers if any is asleep. Called by every transaction that may make work for them
-- (submit, plain INSERT, release, cancel). The protocol, with advisory key 0x70710100:
--   caller: takes the key in SHARE mode (held to the end of its transaction, after its commit
--           is visible), then reads worker_wake in a fresh snapshot; NOTIFYs only if a worker
--           sleeps.
--   worker, before sleeping: commits sleeping = true, then takes the key in EXCLUSIVE mode
--           without waiting (pg_try_advisory_lock) and lets it go at once, then runs one more
--           pass. Getting the key means every caller that could have read sleeping = false has
--           finished, so that pass sees its rows; callers after the commit read true and notify.
--           When the key is busy the worker does not sleep: it polls (producers are active).
-- Callers in REPEATABLE READ or SERIALIZABLE read an older snapshot, so they always notify.
CREATE FUNCTION permitq.wake_workers() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pg_notify('permitq_work', '');
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1886454016);
    IF EXISTS (SELECT 1 FROM permitq.worker_wake WHERE sleeping AND awake_by > now()) THEN
        PERFORM pg_notify('permitq_work', '');
    END IF;
END $$;

-- Inserts wake a sleeping worker once per statement. No transition table: a statement that
-- inserted nothing (ON CONFLICT DO NOTHING) may wake one for nothing, which is harmless.
DROP TRIGGER permit_request_after_insert ON permitq.permit_request;
DROP FUNCTION permitq.notify_work_inserted();
CREATE FUNCTION permitq.wake_workers_after_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM permitq.wake_workers();
    RETURN NULL;
END $$;
CREATE TRIGGER permit_request_after_insert AFTER INSERT ON permitq.permit_request
    FOR EACH STATEMENT EXECUTE FUNCTION permitq.wake_workers_after_insert();

-- 3. Events. Sends the outcomes of these requests on permitq_events as JSON arrays of at most 40
-- objects (a notification's payload is limited to 8000 bytes).
CREATE FUNCTION permitq.notify_events(request_ids bigint[]) RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    payload text;
BEGIN
    FOR payload IN
        SELECT json_agg(json_build_object(
                   'external_id', r.external_id,
                   'state', r.state,
                   'error_code', r.error_code,
                   'release_reason', r.release_reason,
                   'fencing_token', r.fencing_token,
                   'expires_at', r.expires_at) ORDER BY r.id)::text
        FROM (SELECT r.*, (row_number() OVER (ORDER BY r.id) - 1) / 40 AS chunk
              FROM permitq.permit_request r WHERE r.id = ANY(request_ids)) r
        GROUP BY r.chunk
    LOOP
        PERFORM pg_notify('permitq_events', payload);
    END LOOP;
END $$;

-- The per-row trigger that sent one event per state change (and dropped waiter rows) is gone:
-- the functions that change states do both, set-based: the worker's apply_decision and the
-- deadline sweep send their outcomes at once; releases and cancels leave them to the fold.
-- (A hand-written UPDATE of `state` sends no event.)
DROP TRIGGER permit_request_state_changed ON permitq.permit_request;
DROP FUNCTION permitq.after_request_settled();

-- 1. Gives the permits of acquired requests back, without any semaphore lock. Precondition: the
-- caller's transaction holds the row locks of these requests (lock order step 1). Marks them
-- released, records one pending_release row per semaphore (the first one announces the event),
-- and wakes a sleeping worker to fold them. Used by release, revoke and every sweep.
CREATE OR REPLACE FUNCTION permitq.release_locked(request_ids bigint[], reason text) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    released bigint[];
BEGIN
    WITH r AS (
        UPDATE permitq.permit_request r
        SET state = 'released', release_reason = reason, released_at = clock_timestamp(),
            settled_at = clock_timestamp()
        WHERE r.id = ANY(request_ids) AND r.state = 'acquired'
        RETURNING r.id, r.permits
    ),
    rows AS (
        INSERT INTO permitq.pending_release (request_id, semaphore, count, announce)
        SELECT r.id, e.key, e.value::int, row_number() OVER (PARTITION BY r.id ORDER BY e.key) = 1
        FROM r CROSS JOIN LATERAL jsonb_each(r.permits) e
        RETURNING request_id
    )
    SELECT array_agg(DISTINCT request_id) INTO released FROM rows;
    IF released IS NOT NULL THEN
        PERFORM permitq.wake_workers();
    END IF;
    RETURN coalesce(array_length(released, 1), 0);
END $$;

-- Ends one request for its holder or an operator: gives the permits back when it is acquired
-- (recording `reason`), cancels it when it is still waiting. Returns released | already_released
-- | cancelled | not_acquired | unknown. Idempotent. Locks only the request's own row.
CREATE OR REPLACE FUNCTION permitq.release_request(external_id text, reason text) RETURNS text
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
            DELETE FROM permitq.waiter w WHERE w.request_id = request.id;
            INSERT INTO permitq.pending_release (request_id, announce) VALUES (request.id, true);
            -- It may have been the head of a fair semaphore: others may go now.
            PERFORM permitq.wake_workers();
            RETURN 'cancelled';
        WHEN 'released' THEN
            RETURN 'already_released';
        ELSE
            RETURN 'not_acquired';
    END CASE;
END $$;

-- Timed-out waiters: a worker's transaction, so it sends their events itself, and wakes the
-- others (a timed-out head of a fair semaphore no longer holds capacity back).
CREATE OR REPLACE FUNCTION permitq.sweep_wait_deadlines(batch_size integer) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
DECLARE
    ids bigint[];
BEGIN
    WITH due AS (
        SELECT id FROM permitq.permit_request
        WHERE state = 'new' AND wait_until <= now()
        ORDER BY wait_until
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    ),
    failed AS (
        UPDATE permitq.permit_request r
        SET state = 'error', error_code = 'timeout', settled_at = clock_timestamp()
        FROM due WHERE r.id = due.id
        RETURNING r.id
    )
    SELECT array_agg(id) INTO ids FROM failed;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM permitq.waiter w WHERE w.request_id = ANY(ids);
    PERFORM permitq.notify_events(ids);
    PERFORM pg_notify('permitq_work', '');
    RETURN cardinality(ids);
END $$;

-- 4. Worker step 1: claim what could be granted now, FOR UPDATE SKIP LOCKED, in two parts.
--   fresh: pending requests no worker has examined yet, in id order after the pass's cursor
--          (a line in the sand: rows another worker holds are passed over, not waited for);
--   ready: the first waiters of each semaphore that has room now (capacity - used + releases
--          not folded yet = free), at most min(batch_size, free) of them, whose count there
--          fits. A full semaphore contributes nothing, however many wait on it.
-- Rows come back in id order within each part; the caller sorts the union.
CREATE FUNCTION permitq.claim_batch(cursor bigint, batch_size bigint)
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    ready bigint[];
BEGIN
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8
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
        -- A probe per semaphore (LIMIT keeps the planner from turning it into a scan of every
        -- waiter).
        WHERE (SELECT true FROM permitq.waiter w WHERE w.semaphore_id = s.id LIMIT 1)
    )
    SELECT array_agg(DISTINCT w.request_id) INTO ready
    FROM room
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count FROM permitq.waiter wt
        WHERE wt.semaphore_id = room.id
        ORDER BY wt.semaphore_id, wt.request_id   -- the primary key's order
        -- Each grant takes at least one permit: no more than `free` of them can go now.
        LIMIT least(batch_size, room.free)
    ) w
    WHERE room.free > 0 AND w.count <= room.free;
    IF ready IS NULL THEN
        RETURN;
    END IF;
    -- By primary key: the ids are few, the queue may be long.
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8
    FROM permitq.permit_request r
    WHERE r.id = ANY(ready) AND r.state = 'new' AND r.examined
    ORDER BY r.id
    FOR UPDATE SKIP LOCKED;
END $$;

-- Worker step 2: lock the batch's semaphores FOR UPDATE in ascending id (lock order step 2),
-- and, without waiting (SKIP LOCKED: whoever holds one folds it), every other semaphore with
-- releases to fold. Then fold: delete the pending releases of the locked semaphores, take their
-- counts off `used`, and send the events of the requests they announce (and of cancels).
-- Returns the batch's semaphores after the fold.
CREATE FUNCTION permitq.lock_and_fold(names text[])
RETURNS TABLE (id bigint, name text, capacity integer, used integer, fair boolean)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    locked text[];
    also text[];
    announced bigint[];
BEGIN
    SELECT array_agg(l.name) INTO locked FROM (
        SELECT s.name FROM permitq.semaphore s
        WHERE s.name = ANY(names)
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
    SELECT s.id, s.name, s.capacity, s.used, s.fair FROM permitq.semaphore s
    WHERE s.name = ANY(names)
    ORDER BY s.id;
END $$;

-- Worker, when it claimed nothing: fold the pending releases (and send their events), so `used`
-- and the producers waiting for `released` do not wait for the next grant.
CREATE FUNCTION permitq.fold_releases() RETURNS void
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    PERFORM * FROM permitq.lock_and_fold('{}'::text[]);
END $$;

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
        SET used = s.used + t.total, updated_at = now()
        FROM (SELECT e.key AS semaphore, sum(e.value::int) AS total
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

-- Exact figures per semaphore: capacity, `used` (the workers' running count, which may run
-- ahead until releases are folded), held (the sum of acquired permits), how many requests wait
-- on it and since when the oldest waits.
CREATE VIEW permitq.semaphore_usage AS
SELECT s.name,
       s.capacity,
       s.used,
       coalesce(h.held, 0)::integer AS held,
       coalesce(w.waiting, 0)::integer AS waiting,
       w.oldest_wait_since,
       s.fair
FROM permitq.semaphore s
LEFT JOIN (SELECT e.key AS name, sum(e.value::int) AS held
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'acquired' GROUP BY e.key) h ON h.name = s.name
LEFT JOIN (SELECT e.key AS name, count(*) AS waiting, min(r.created_at) AS oldest_wait_since
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'new' GROUP BY e.key) w ON w.name = s.name;

-- Who holds what.
CREATE VIEW permitq.holders AS
SELECT e.key AS semaphore, r.external_id, r.owner, e.value::int AS count, r.acquired_at,
       r.expires_at, r.fencing_token
FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
WHERE r.state = 'acquired';

-- Who waits, in each semaphore's queue order (position 1 is the head).
CREATE VIEW permitq.waiters AS
SELECT e.key AS semaphore, r.external_id, r.owner, e.value::int AS count,
       row_number() OVER (PARTITION BY e.key ORDER BY r.id) AS position,
       r.created_at AS waiting_since, r.wait_until AS deadline
FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
WHERE r.state = 'new';

-- The wrappers called on every request were LANGUAGE sql functions with SET clauses: not inlined,
-- so PostgreSQL parsed and planned their bodies on every call. As PL/pgSQL they keep their plans.
CREATE OR REPLACE FUNCTION permitq.release(external_id text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    RETURN permitq.release_request(external_id, 'released');
END $$;

-- The same as release, under the name a producer that gives up looks for.
CREATE OR REPLACE FUNCTION permitq.cancel(external_id text) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    RETURN permitq.release(external_id);
END $$;

CREATE OR REPLACE FUNCTION permitq.revoke(external_id text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    outcome text;
BEGIN
    outcome := permitq.release_request(external_id, 'revoked');
    RETURN CASE outcome WHEN 'released' THEN 'revoked' ELSE outcome END;
END $$;

-- Worker, after lock_and_fold: the requests waiting on the locked semaphores that are not in the
-- caller's batch, the heads fair semaphores must keep room for (see V1 for the rule). Called as
-- its own statement after the locks are held, so it sees what the locks' previous holders
-- committed.
CREATE OR REPLACE FUNCTION permitq.semaphore_heads(semaphore_ids bigint[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer)
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    -- Each semaphore's oldest recorded waiter (permitq.waiter, written under the lock).
    RETURN QUERY
    SELECT s.name, w.request_id, w.count
    FROM unnest(semaphore_ids) AS locked(id)
    JOIN permitq.semaphore s ON s.id = locked.id
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count FROM permitq.waiter wt
        WHERE wt.semaphore_id = locked.id AND wt.request_id <> ALL(batch_ids)
        ORDER BY wt.semaphore_id, wt.request_id   -- the primary key's order
        LIMIT 1
    ) w;
    -- Older pending requests no worker has examined yet (another worker holds them right now,
    -- or they were committed after the caller's claim). Until someone examines them they count
    -- as waiting, so a concurrent batch cannot slip past an older request it has not seen.
    RETURN QUERY
    SELECT e.key, r.id, e.value::int
    FROM permitq.permit_request r
    CROSS JOIN LATERAL jsonb_each(r.permits) e
    JOIN permitq.semaphore s ON s.name = e.key
    WHERE r.state = 'new' AND NOT r.examined AND r.id < newest_id AND r.id <> ALL(batch_ids)
      AND s.id = ANY(semaphore_ids);
END $$;

-- Queue lookups by semaphore must walk the waiter primary key (semaphore_id, request_id), never
-- scan: with a long queue on one semaphore, the planner otherwise takes "the first waiter of
-- another semaphore" for a cheap LIMIT 1 over a scan of every waiter (seen: 5-10 ms per pass with
-- 100,000 waiters). The lookup by request (to drop a request's waiter rows) becomes a hash index,
-- which cannot offer that ordering, and the functions that read queues run without seq scans.
DROP INDEX permitq.waiter_request_idx;
CREATE INDEX waiter_request_idx ON permitq.waiter USING hash (request_id);
ALTER FUNCTION permitq.claim_batch(bigint, bigint) SET enable_seqscan = off;
ALTER FUNCTION permitq.semaphore_heads(bigint[], bigint[], bigint) SET enable_seqscan = off;

-- No JIT inside permitq's functions. Their statements are small, but a plan estimated for a
-- NULL or unknown array (a sweep with nothing due) can cross jit_above_cost, and compiling
-- costs ~200 ms where the statement itself takes microseconds (seen in `permitq bench`).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             JOIN pg_namespace n ON n.oid = p.pronamespace
             WHERE n.nspname = 'permitq' AND p.prokind = 'f'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET jit = off', f);
    END LOOP;
END $$;
