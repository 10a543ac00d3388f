-- The sweeps the workers run beside the claim loop: wait deadlines, expired leases, --max-hold,
-- owners the liveness hook reports dead, and idle template instances.
--
-- Each takes its rows oldest first from a partial index, locks them FOR UPDATE SKIP LOCKED
-- (lock order step 1), re-checks its condition on the locked version and releases through
-- permitq.release_locked, so a sweep run twice, or by two workers at once, ends each request
-- exactly once. They run with enable_sort = off (right after a bulk load, before ANALYZE, the
-- planner would otherwise sort every candidate to pick the oldest) and plan each call
-- (force_custom_plan): their now()-relative ranges make selectivity matter.

-- A worker's turn at a maintenance task for its transaction (a row of
-- permitq.maintenance_turn, locked without waiting); false when another session holds it.
CREATE OR REPLACE FUNCTION permitq.take_turn(task text) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    PERFORM 1 FROM permitq.maintenance_turn t WHERE t.task = take_turn.task FOR UPDATE SKIP LOCKED;
    RETURN FOUND;
END $$;
GRANT EXECUTE ON FUNCTION permitq.take_turn(text) TO permitq_worker, permitq_admin;

-- Waiting requests whose `wait` ran out: error_code = 'timeout', error_detail where it had no
-- room (permitq.wait_detail). Rows a worker is deciding
-- right now are skipped; that worker applies the same deadline itself. Sends their events and
-- wakes the others (a timed-out head of a fair semaphore no longer holds capacity back).
CREATE OR REPLACE FUNCTION permitq.sweep_wait_deadlines(batch_size integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
    SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
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
    -- The turns their keys took that stay taken (functions/fairness.sql), where any is keyed.
    kept AS (
        SELECT k.request_id, k.detail
        FROM permitq.turns_kept((SELECT array_agg(due.id) FROM due)) k
        WHERE EXISTS (SELECT 1 FROM permitq.keyed_semaphore)
    ),
    failed AS (
        UPDATE permitq.permit_request r
        SET state = 'error', error_code = 'timeout', settled_at = clock_timestamp(),
            -- What held it back, while that can still be read (explain no longer can).
            error_detail = permitq.completed_error_detail('timeout', permitq.wait_detail(r.permits),
                                                          r.permits)
                           || coalesce(kept.detail, '{}')
        FROM due LEFT JOIN kept ON kept.request_id = due.id
        WHERE r.id = due.id
        RETURNING r.id
    )
    SELECT array_agg(id) INTO ids FROM failed;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM permitq.waiter w WHERE w.request_id = ANY(ids);
    PERFORM permitq.notify_events(ids);
    PERFORM permitq.notify('permitq_work', '');
    RETURN cardinality(ids);
END $$;
GRANT EXECUTE ON FUNCTION permitq.sweep_wait_deadlines(integer) TO permitq_worker;

-- Leases that ran out (TTL with no heartbeat, past the grace after a promotion:
-- permitq.lease_run_out, the grace recorded first): release_reason = 'expired'. The condition is re-checked on the locked
-- row version, so a heartbeat that committed a moment ago wins over the sweep.
CREATE OR REPLACE FUNCTION permitq.sweep_expired(batch_size integer) RETURNS integer
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
    SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
    SELECT permitq.record_lease_grace();
    SELECT coalesce(permitq.release_locked(array_agg(id), 'expired'), 0)
    FROM (SELECT id FROM permitq.permit_request
          WHERE state = 'acquired' AND expires_at <= now()
            AND permitq.lease_run_out(expires_at, ttl, (SELECT permitq.lease_grace_since()))
          ORDER BY expires_at LIMIT batch_size
          FOR UPDATE SKIP LOCKED) due
$$;
GRANT EXECUTE ON FUNCTION permitq.sweep_expired(integer) TO permitq_worker;

-- Requests held longer than max_hold (the worker's --max-hold): release_reason = 'stale', and
-- the bound in `error_detail` (`max_hold_ms`), for `status` and `explain` to say.
CREATE OR REPLACE FUNCTION permitq.sweep_stale(max_hold interval, batch_size integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
    SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
DECLARE
    ids bigint[];
    n integer;
BEGIN
    SELECT array_agg(id) INTO ids
    FROM (SELECT id FROM permitq.permit_request
          WHERE state = 'acquired' AND acquired_at <= now() - max_hold
          ORDER BY acquired_at LIMIT batch_size
          FOR UPDATE SKIP LOCKED) due;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    n := coalesce(permitq.release_locked(ids, 'stale'), 0);
    UPDATE permitq.permit_request r
    SET error_detail = coalesce(r.error_detail, '{}')
                       || jsonb_build_object('max_hold_ms', (extract(epoch FROM max_hold) * 1000)::bigint)
    WHERE r.id = ANY(ids) AND r.release_reason = 'stale';
    RETURN n;
END $$;
GRANT EXECUTE ON FUNCTION permitq.sweep_stale(interval, integer) TO permitq_worker;

-- Requests whose owner the liveness hook reported dead: release_reason = 'revoked'.
CREATE OR REPLACE FUNCTION permitq.revoke_owners(owners text[], batch_size integer) RETURNS integer
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
    SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
    SELECT coalesce(permitq.release_locked(array_agg(id), 'revoked'), 0)
    FROM (SELECT id FROM permitq.permit_request
          WHERE state = 'acquired' AND owner = ANY(owners)
          ORDER BY id LIMIT batch_size
          FOR UPDATE SKIP LOCKED) due
$$;
GRANT EXECUTE ON FUNCTION permitq.revoke_owners(text[], integer) TO permitq_worker;

-- Removes up to `batch_size` instances of templates that hold nothing (`used` = 0 under their
-- lock, nothing left to fold), have nobody waiting, and saw no grant, fold or change for
-- `idle`. Returns how many. A request that names one later makes it again. It also removes
-- the grants that left their window, every round.
CREATE OR REPLACE FUNCTION permitq.sweep_idle_instances(idle interval, batch_size integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    n integer;
BEGIN
    -- All of them at once (a batch limit would let a semaphore granting faster than the sweep
    -- runs outgrow it): per semaphore, a range of its window index.
    DELETE FROM permitq.rate_bucket b
    USING permitq.semaphore s
    -- Those permitq.in_window no longer counts.
    WHERE s.id = b.semaphore_id AND b.ends_at <= now() - coalesce(s.per, interval '0');
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
      AND permitq.in_window(s) = 0;
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;
GRANT EXECUTE ON FUNCTION permitq.sweep_idle_instances(interval, integer) TO permitq_worker, permitq_admin;
