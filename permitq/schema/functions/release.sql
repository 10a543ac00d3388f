-- Giving permits back: release, cancel and revoke by external_id, and the one release path the
-- sweeps share.
--
-- Release takes no semaphore lock. It is a one-way state change on the request's own row plus
-- one permitq.pending_release row per semaphore (fan-out rows); workers fold those into
-- semaphore.used under the semaphore lock, in batches, in the same transaction as their grants
-- (functions/batch_semaphores.sql). So `used` may run ahead of the exact held count between a
-- release and the next fold; it never under-counts.

-- Gives the permits of acquired requests back. Precondition: the caller's transaction holds
-- the row locks of these requests (lock order step 1). Marks them released, records one
-- pending_release row per semaphore it took from (the first one announces the event), and wakes
-- a sleeping worker to fold them unless an earlier release already did
-- (permitq.wake_workers_for_release). Used by release, revoke and every sweep. Returns how many
-- it released.
CREATE OR REPLACE FUNCTION permitq.release_locked(request_ids bigint[], reason text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    released bigint[];
    freed text[];
BEGIN
    WITH r AS (
        UPDATE permitq.permit_request r
        SET state = 'released', release_reason = reason, released_at = clock_timestamp(),
            settled_at = clock_timestamp()
        -- By id alone, the state tested on the rows found (a CASE, which no index predicate
        -- matches): given `state = 'acquired'`, a plan trusting statistics taken while little was
        -- held reads a partial index of every holder, for each release.
        WHERE r.id = ANY(request_ids) AND CASE WHEN r.state = 'acquired' THEN true END
        -- What the grant took, ancestors included (functions/nesting.sql).
        RETURNING r.id, coalesce(r.charged, r.permits) AS charged
    ),
    rows AS (
        INSERT INTO permitq.pending_release (request_id, semaphore, count, announce)
        SELECT r.id, e.key, e.value::int, row_number() OVER (PARTITION BY r.id ORDER BY e.key) = 1
        FROM r CROSS JOIN LATERAL jsonb_each(r.charged) e
        RETURNING request_id, semaphore
    )
    SELECT array_agg(DISTINCT request_id), array_agg(DISTINCT semaphore) INTO released, freed
    FROM rows;
    IF released IS NOT NULL THEN
        PERFORM permitq.wake_workers_for_release(freed, released);
    END IF;
    RETURN coalesce(array_length(released, 1), 0);
END $$;

-- Ends one request for its holder or an operator: gives the permits back when it is acquired
-- (recording `reason`), cancels it when it is still waiting. Returns released | already_released
-- | cancelled | not_acquired | unknown. Idempotent. Locks only the request's own row. Only the
-- request's owner or an admin (functions/ownership.sql) may, except a revoke (admins only).
CREATE OR REPLACE FUNCTION permitq.release_request(external_id text, reason text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    request permitq.permit_request;
BEGIN
    -- Lock order step 1: the request row. If a worker is deciding it right now, this waits for
    -- that transaction and then sees its outcome.
    SELECT * INTO request FROM permitq.permit_request r WHERE r.external_id = $1 FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    IF reason <> 'revoked' THEN
        PERFORM permitq.check_owner(request, 'release or cancel it');
    END IF;
    CASE request.state
        WHEN 'acquired' THEN
            PERFORM permitq.release_locked(ARRAY[request.id], reason);
            -- A revoke names the admin login that took it back (an owner-liveness sweep's
            -- revoke names nobody), for its holder's heartbeat, `status` and `explain`.
            IF reason = 'revoked' THEN
                UPDATE permitq.permit_request r
                SET error_detail = jsonb_build_object('revoked_by', session_user::text)
                WHERE r.id = request.id;
            END IF;
            RETURN 'released';
        WHEN 'new' THEN
            -- A revoke names the login that ended it (session_user: the login, not this
            -- SECURITY DEFINER function's owner), so its history is not a plain cancel.
            -- Where it had taken its key's turn, that turn stays taken (functions/fairness.sql).
            UPDATE permitq.permit_request r
            SET state = 'error', error_code = 'cancelled', settled_at = clock_timestamp(),
                error_detail = nullif(CASE WHEN reason = 'revoked'
                                           THEN jsonb_build_object('revoked_by', session_user::text)
                                           ELSE '{}' END
                                      || coalesce((SELECT k.detail FROM permitq.turns_kept(ARRAY[request.id]) k),
                                                  '{}'), '{}')
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

-- permitq.release: the holder gives its permits back, or cancels a request still waiting.
-- With `outcome` (ok, overloaded, failed; `latency` when measured) it also reports how its use
-- went to the adaptive semaphores it held (functions/adaptive.sql); a repeated release reports
-- nothing again (it returns already_released), so a retry makes no duplicate.
-- (The entry points are PL/pgSQL, which keeps its plans per session: a LANGUAGE sql function
-- with SET clauses is never inlined, so it would be parsed and planned on every call.)
CREATE OR REPLACE FUNCTION permitq.release(external_id text, outcome text DEFAULT NULL,
                                           latency interval DEFAULT NULL) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_variable
DECLARE
    said text;
    problem text;
BEGIN
    IF outcome IS NULL THEN
        IF latency IS NOT NULL THEN
            RAISE EXCEPTION 'invalid latency: it is reported with an outcome (ok, overloaded or failed): give outcome too'
                USING ERRCODE = '22023';
        END IF;
        RETURN permitq.release_request(external_id, 'released');
    END IF;
    problem := permitq.report_problem(outcome, latency);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION '%', problem USING ERRCODE = '22023';
    END IF;
    said := permitq.release_request(external_id, 'released');
    IF said = 'released' THEN
        PERFORM permitq.record_report(r.id, coalesce(r.charged, r.permits), outcome, latency)
        FROM permitq.permit_request r WHERE r.external_id = release.external_id;
    END IF;
    RETURN said;
END $$;
GRANT EXECUTE ON FUNCTION permitq.release(text, text, interval) TO permitq_producer, permitq_admin;

-- permitq.cancel: the same as release, under the name a producer that gives up looks for.
CREATE OR REPLACE FUNCTION permitq.cancel(external_id text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN permitq.release(external_id);
END $$;
GRANT EXECUTE ON FUNCTION permitq.cancel(text) TO permitq_producer, permitq_admin;

-- permitq.revoke: an operator takes a held request's permits away (release_reason = 'revoked');
-- a request still waiting is cancelled. Returns what release returns, `revoked` for `released`.
CREATE OR REPLACE FUNCTION permitq.revoke(external_id text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    outcome text;
BEGIN
    outcome := permitq.release_request(external_id, 'revoked');
    RETURN CASE outcome WHEN 'released' THEN 'revoked' ELSE outcome END;
END $$;
GRANT EXECUTE ON FUNCTION permitq.revoke(text) TO permitq_admin;
