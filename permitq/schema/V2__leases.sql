-- Leases, maintenance and fencing: heartbeats, the sweeps the workers run, operator revoke,
-- retention, the capacity audit and fence tokens for downstream writes.
--
-- The sweeps take their rows oldest first from a partial index. They run with enable_sort = off:
-- right after a bulk load, before ANALYZE, the planner would otherwise sort every candidate row
-- to pick the oldest 1,000 (seen: 28 ms per batch growing with the backlog, against 8 ms).
--
-- Every sweep locks its requests FOR UPDATE SKIP LOCKED (lock order step 1) and releases through
-- permitq.release_locked (step 2, semaphores in id order), so a sweep run twice, or by two workers
-- at once, releases each request exactly once.

-- permitq.heartbeat: pushes expires_at to now() + (extend, else the request's ttl). Raises 55000
-- when the request is not acquired or its lease has already run out: the holder has lost its
-- permits and must stop.
CREATE FUNCTION permitq.heartbeat(external_id text, extend interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    request permitq.permit_request;
    new_expiry timestamptz;
BEGIN
    IF extend IS NOT NULL AND extend <= interval '0' THEN
        RAISE EXCEPTION 'invalid extend: must be positive, got %', extend USING ERRCODE = '22023';
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
    new_expiry := now() + coalesce(extend, request.ttl);
    UPDATE permitq.permit_request r SET expires_at = new_expiry, heartbeat_at = now()
    WHERE r.id = request.id;
    RETURN new_expiry;
END $$;

-- permitq.revoke: an operator takes a held request's permits away (release_reason = 'revoked');
-- a request still waiting is cancelled. Returns what permitq.release returns, with `revoked` in
-- place of `released`.
CREATE FUNCTION permitq.revoke(external_id text) RETURNS text
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$
    SELECT CASE outcome WHEN 'released' THEN 'revoked' ELSE outcome END
    FROM permitq.release_request($1, 'revoked') AS outcome
$$;

-- Sweep: fails waiting requests whose `wait` ran out (error_code = 'timeout'). Rows a worker is
-- deciding right now are skipped; that worker applies the same deadline itself.
CREATE FUNCTION permitq.sweep_wait_deadlines(batch_size integer) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
DECLARE
    n integer;
BEGIN
    WITH due AS (
        SELECT id FROM permitq.permit_request
        WHERE state = 'new' AND wait_until <= now()
        ORDER BY wait_until
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    UPDATE permitq.permit_request r
    SET state = 'error', error_code = 'timeout', settled_at = clock_timestamp()
    FROM due WHERE r.id = due.id;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 THEN
        -- A timed-out head of a fair semaphore no longer holds capacity back.
        PERFORM pg_notify('permitq_work', '');
    END IF;
    RETURN n;
END $$;

-- Sweep: leases whose expires_at has passed (TTL with no heartbeat): release_reason = 'expired'.
-- The condition is re-checked on the locked row version, so a heartbeat that committed a moment
-- ago wins over the sweep.
CREATE FUNCTION permitq.sweep_expired(batch_size integer) RETURNS integer
LANGUAGE sql SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
    SELECT coalesce(permitq.release_locked(array_agg(id), 'expired'), 0)
    FROM (SELECT id FROM permitq.permit_request
          WHERE state = 'acquired' AND expires_at <= now()
          ORDER BY expires_at LIMIT batch_size
          FOR UPDATE SKIP LOCKED) due
$$;

-- Sweep: requests held longer than max_hold (the worker's --max-hold): release_reason = 'stale'.
CREATE FUNCTION permitq.sweep_stale(max_hold interval, batch_size integer) RETURNS integer
LANGUAGE sql SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
    SELECT coalesce(permitq.release_locked(array_agg(id), 'stale'), 0)
    FROM (SELECT id FROM permitq.permit_request
          WHERE state = 'acquired' AND acquired_at <= now() - max_hold
          ORDER BY acquired_at LIMIT batch_size
          FOR UPDATE SKIP LOCKED) due
$$;

-- Sweep: requests whose owner the liveness hook reported dead: release_reason = 'revoked'.
CREATE FUNCTION permitq.revoke_owners(owners text[], batch_size integer) RETURNS integer
LANGUAGE sql SET plan_cache_mode = force_custom_plan AS $$
    SELECT coalesce(permitq.release_locked(array_agg(id), 'revoked'), 0)
    FROM (SELECT id FROM permitq.permit_request
          WHERE state = 'acquired' AND owner = ANY(owners)
          ORDER BY id LIMIT batch_size
          FOR UPDATE SKIP LOCKED) due
$$;

-- Retention: deletes up to batch_size settled requests (and, by cascade, their permits) that
-- settled more than older_than ago. Small batches keep each transaction short, so production
-- traffic never queues behind a long delete.
CREATE FUNCTION permitq.delete_settled(older_than interval, batch_size integer) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
DECLARE
    n integer;
BEGIN
    WITH doomed AS (
        SELECT id FROM permitq.permit_request
        WHERE state IN ('released', 'error') AND settled_at < now() - older_than
        ORDER BY settled_at
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    )
    DELETE FROM permitq.permit_request r USING doomed WHERE r.id = doomed.id;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Audit of every capacity change, creation included (old_capacity NULL).
CREATE TABLE permitq.capacity_change (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    semaphore        text NOT NULL,
    old_capacity     integer,
    new_capacity     integer NOT NULL,
    old_fair         boolean,
    new_fair         boolean NOT NULL,
    changed_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    changed_by       text NOT NULL DEFAULT current_user,
    application_name text DEFAULT current_setting('application_name', true)
);
CREATE INDEX capacity_change_semaphore_idx ON permitq.capacity_change (semaphore, id);
CREATE INDEX capacity_change_changed_at_idx ON permitq.capacity_change (changed_at);

-- Audits creation and every UPDATE that sets capacity or fair (set_capacity or a hand-written
-- UPDATE), even when the value stays the same. Changes to `used` are not audited.
CREATE FUNCTION permitq.audit_capacity() RETURNS trigger
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
BEGIN
    INSERT INTO permitq.capacity_change (semaphore, old_capacity, new_capacity, old_fair, new_fair)
    VALUES (NEW.name,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.capacity END, NEW.capacity,
            CASE WHEN TG_OP = 'UPDATE' THEN OLD.fair END, NEW.fair);
    RETURN NULL;
END $$;

CREATE TRIGGER semaphore_created AFTER INSERT ON permitq.semaphore
    FOR EACH ROW EXECUTE FUNCTION permitq.audit_capacity();
CREATE TRIGGER semaphore_capacity_changed AFTER UPDATE OF capacity, fair ON permitq.semaphore
    FOR EACH ROW EXECUTE FUNCTION permitq.audit_capacity();

-- Retention of the audit, in batches like delete_settled.
CREATE FUNCTION permitq.delete_capacity_changes(older_than interval, batch_size integer)
RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
DECLARE
    n integer;
BEGIN
    DELETE FROM permitq.capacity_change c
    WHERE c.id IN (SELECT id FROM permitq.capacity_change
                   WHERE changed_at < now() - older_than
                   ORDER BY changed_at LIMIT batch_size);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Fencing for downstream writes kept in this database: the highest token seen per resource.
CREATE TABLE permitq.fence_token (
    resource   text PRIMARY KEY CONSTRAINT fence_token_resource_valid CHECK (resource <> ''),
    token      bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- permitq.fence: true, and remembered, when `token` >= the highest token seen for `resource`;
-- false otherwise. One statement: atomic under concurrency.
CREATE FUNCTION permitq.fence(resource text, token bigint) RETURNS boolean
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
#variable_conflict use_column
DECLARE
    accepted boolean;
BEGIN
    IF fence.resource IS NULL OR fence.resource = '' THEN
        RAISE EXCEPTION 'invalid resource: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF fence.token IS NULL THEN
        RAISE EXCEPTION 'invalid token: must not be null' USING ERRCODE = '22023';
    END IF;
    INSERT INTO permitq.fence_token AS f (resource, token) VALUES ($1, $2)
    ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
        WHERE f.token <= EXCLUDED.token
    RETURNING true INTO accepted;
    RETURN coalesce(accepted, false);
END $$;
