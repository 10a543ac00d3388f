-- Retention, in small batches so that production traffic never queues behind a long delete.

-- Deletes up to batch_size settled requests (and their waiter rows, by cascade) that settled
-- more than older_than ago, and up to batch_size fence rows untouched as long, remembering the
-- highest token among them; and up to batch_size fairness keys' finish tags that say nothing.
CREATE OR REPLACE FUNCTION permitq.delete_settled(older_than interval, batch_size integer) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
    SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
DECLARE
    n integer;
    highest bigint;
BEGIN
    WITH doomed AS (
        SELECT id FROM permitq.permit_request
        WHERE state IN ('released', 'error') AND settled_at < now() - older_than
        ORDER BY settled_at
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    ),
    deleted AS (
        DELETE FROM permitq.permit_request r USING doomed WHERE r.id = doomed.id
        RETURNING r.fencing_token
    )
    SELECT count(*), max(fencing_token) INTO n, highest FROM deleted;
    -- And the fence rows untouched as long, unless a request holding now has their token: a
    -- token of a request that no longer holds fences nothing anyway (permitq.fence), so only
    -- concurrent holders of one semaphore lose an order between their writes, after a week.
    WITH doomed AS (
        SELECT f.semaphore, f.resource FROM permitq.fence_token f
        WHERE f.updated_at < now() - older_than
          AND NOT EXISTS (SELECT 1 FROM permitq.permit_request r
                          WHERE r.fencing_token = f.token AND r.state = 'acquired')
        ORDER BY f.updated_at
        LIMIT batch_size
        FOR UPDATE SKIP LOCKED
    ),
    deleted AS (
        DELETE FROM permitq.fence_token f USING doomed
        WHERE f.semaphore = doomed.semaphore AND f.resource = doomed.resource
        RETURNING f.token
    )
    SELECT greatest(highest, max(token)) INTO highest FROM deleted;
    -- Their tokens stay known: a sequence set back later is still seen as behind them
    -- (functions/fencing_tokens.sql).
    IF highest IS NOT NULL THEN
        UPDATE permitq.token_epoch t SET token_floor = highest
        WHERE t.token_floor < highest;
    END IF;
    -- And fairness keys' finish tags the virtual time has passed, whose places have passed too:
    -- they say nothing more than no row (functions/fairness.sql), whenever they are deleted, so
    -- no lock orders this.
    -- (Those of a semaphore no longer served by key, or deleted, say nothing either.)
    DELETE FROM permitq.key_finish f
    WHERE (f.semaphore_id, f.fairness_key) IN (
        SELECT g.semaphore_id, g.fairness_key FROM permitq.key_finish g
        LEFT JOIN permitq.keyed_semaphore k ON k.semaphore_id = g.semaphore_id
        WHERE k.semaphore_id IS NULL OR (g.finish <= k.virtual_time AND g.placed_until < now())
        LIMIT batch_size)
      AND f.finish <= coalesce((SELECT k.virtual_time FROM permitq.keyed_semaphore k
                                WHERE k.semaphore_id = f.semaphore_id), 'infinity')
      AND f.placed_until < now();
    RETURN n;
END $$;
GRANT EXECUTE ON FUNCTION permitq.delete_settled(interval, integer) TO permitq_worker, permitq_admin;

-- The capacity audit's retention, in batches like delete_settled.
CREATE OR REPLACE FUNCTION permitq.delete_capacity_changes(older_than interval, batch_size integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
    SET plan_cache_mode = force_custom_plan SET enable_sort = off AS $$
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
GRANT EXECUTE ON FUNCTION permitq.delete_capacity_changes(interval, integer) TO permitq_worker, permitq_admin;
