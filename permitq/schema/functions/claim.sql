-- Worker step 1 (lock order step 1): claim what could be granted now, FOR UPDATE SKIP LOCKED.
-- The row lock is the claim: waiting requests are not rewritten on every pass, and a worker
-- that dies simply drops its locks, leaving its rows `new` (so the `in_progress` state is never
-- committed). Each row comes with what the decision needs: `problem` (why an unexamined row
-- cannot be decided, else NULL: it fails as `invalid`) and `effective`, its place in line
-- (functions/queue_order.sql).

-- A pass's batch, in two parts:
--   fresh: pending requests no worker has examined yet, best placed first
--          (permit_request_unexamined_place_idx), after the pass's cursor, the place in line of
--          the last one claimed (a line in the sand: rows another worker holds are passed over,
--          not waited for). In place order, a backlog of mixed priorities is examined in the
--          order it is granted in, and nothing unclaimed is ahead of the batch but what other
--          workers hold (functions/heads.sql);
--   ready: the first waiters in line of each semaphore that has waiters and room now (found
--          per semaphore that has waiters, however many semaphores there are)
--          (permitq.free_room, functions/rate_windows.sql, and no more than its ancestors have):
--          of its first batch_size, those whose count there fits, at most min(batch_size, free);
--          and up to batch_size waiters whose count the capacity no longer covers (they fail as
--          exceeds_capacity). Work per semaphore with waiters is at most 2 × batch_size waiters
--          read, however long its line and however many priority levels it has.
-- The caller sorts the rows.
-- Planned once (plan_cache_mode = force_generic_plan, as every entry point of the grant path):
-- PL/pgSQL otherwise kept making a custom plan of `ready` on every call while any request waited,
-- since its custom plans look cheaper than the generic one; the planning cost more than the run.
CREATE OR REPLACE FUNCTION permitq.claim_batch(cursor bigint, batch_size bigint)
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text,
               effective bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET enable_seqscan = off
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    ready bigint[];
    -- Where each waits: its waiter rows' place (a keyed semaphore may have placed it later
    -- than its arrival: functions/fairness.sql).
    ready_places bigint[];
BEGIN
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           permitq.request_problem(r), r.external_id,
           permitq.rule_place_in_line(r.priority, r.created_at)
    FROM permitq.permit_request r
    WHERE r.state = 'new' AND NOT r.examined
      AND permitq.rule_place_in_line(r.priority, r.created_at) < cursor
    ORDER BY permitq.rule_place_in_line(r.priority, r.created_at) DESC
    LIMIT batch_size
    FOR UPDATE SKIP LOCKED;

    IF NOT EXISTS (SELECT 1 FROM permitq.waiter) THEN
        RETURN;
    END IF;
    WITH room AS (
        SELECT s.id, s.capacity,
               least(permitq.free_room(s),
                     -- Nested: no more than its ancestors have (functions/nesting.sql).
                     (SELECT min(permitq.free_room(a))
                      FROM permitq.ancestors(ARRAY[s.name]) x
                      JOIN permitq.semaphore a ON a.name = x.ancestor
                      WHERE x.depth > 0 AND s.parent IS NOT NULL)) AS free
        FROM permitq.waited_semaphores() AS waited(id)
        JOIN permitq.semaphore s ON s.id = waited.id
    )
    SELECT array_agg(y.request_id), array_agg(y.place) INTO ready, ready_places
    FROM (SELECT x.request_id, max(x.place) AS place FROM (
        -- The first of its line (waiter_place_idx, in line order), at most batch_size looked
        -- at, of which those whose count fits, no more than `free` of them (each grant takes at
        -- least one permit): the decision puts them in line.
        SELECT fit.request_id, permitq.rule_place_in_line(fit.priority, fit.created_at) AS place
        FROM room
        CROSS JOIN LATERAL (
            SELECT w.request_id, w.priority, w.created_at
            FROM (SELECT wt.request_id, wt.count, wt.priority, wt.created_at
                  FROM permitq.waiter wt
                  -- A full one is not read at all (a one-time filter).
                  WHERE wt.semaphore_id = room.id AND room.free > 0
                  ORDER BY wt.semaphore_id,
                           permitq.rule_place_in_line(wt.priority, wt.created_at) DESC,
                           wt.request_id -- waiter_place_idx
                  LIMIT batch_size) w
            WHERE room.free > 0 AND w.count <= room.free
              -- Nor one that another of its semaphores has no room for now (its waiter row
              -- there, waiter_request_idx): claimed, it could only be decided again to wait,
              -- by every batch. A release there notifies the workers, and the next pass sees it.
              -- (A scalar subquery, looked up per candidate: as NOT EXISTS it was planned as an
              -- anti-join over every waiter.)
              AND NOT coalesce((SELECT bool_or(o.count > permitq.free_room(s2))
                                FROM permitq.waiter o
                                JOIN permitq.semaphore s2 ON s2.id = o.semaphore_id
                                WHERE o.request_id = w.request_id
                                  AND o.semaphore_id <> room.id), false)
            ORDER BY permitq.rule_place_in_line(w.priority, w.created_at) DESC, w.request_id
            -- `free` is below 0 while a capacity lowered under what is held: LIMIT refuses a
            -- negative count (2201W), which would fail every pass.
            LIMIT greatest(least(batch_size, room.free), 0)
        ) fit
        UNION ALL
        -- A waiter whose count its semaphore's capacity no longer covers (lowered while it
        -- waited) is decided: it fails as exceeds_capacity, as it would have at its submit,
        -- instead of keeping a fair line's room for ever. Found by count (waiter_count_idx),
        -- room or not: one index read per semaphore with waiters, empty unless the capacity
        -- was lowered below a waiter's count.
        SELECT big.request_id, permitq.rule_place_in_line(big.priority, big.created_at)
        FROM room
        CROSS JOIN LATERAL (
            SELECT wt.request_id, wt.priority, wt.created_at FROM permitq.waiter wt
            WHERE wt.semaphore_id = room.id AND wt.count > room.capacity
            ORDER BY wt.semaphore_id, wt.count DESC -- waiter_count_idx
            LIMIT batch_size
        ) big
    ) x GROUP BY x.request_id) y;
    IF ready IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           NULL::text, r.external_id, q.place
    FROM permitq.permit_request r
    JOIN unnest(ready, ready_places) AS q(id, place) ON q.id = r.id
    WHERE r.state = 'new' AND r.examined
    ORDER BY r.id
    FOR UPDATE OF r SKIP LOCKED;
END $$;
GRANT EXECUTE ON FUNCTION permitq.claim_batch(bigint, bigint) TO permitq_worker;

-- Isolating a failed batch: claim exactly these requests (still `new`), with the columns of
-- claim_batch.
CREATE OR REPLACE FUNCTION permitq.claim_requests(ids bigint[])
RETURNS TABLE (id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text,
               effective bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
    SELECT r.id, r.permits, coalesce(r.wait = interval '0', false),
           coalesce(r.wait_until <= now(), false), r.examined,
           extract(epoch FROM clock_timestamp() - r.created_at)::float8,
           CASE WHEN NOT r.examined THEN permitq.request_problem(r) END, r.external_id,
           -- An examined one where it waits (its waiter rows: functions/fairness.sql).
           coalesce((SELECT max(permitq.rule_place_in_line(w.priority, w.created_at))
                     FROM permitq.waiter w WHERE w.request_id = r.id AND r.examined),
                    permitq.rule_place_in_line(r.priority, r.created_at))
    FROM permitq.permit_request r
    WHERE r.id = ANY(ids) AND r.state = 'new'
    ORDER BY r.id
    FOR UPDATE SKIP LOCKED
$$;
GRANT EXECUTE ON FUNCTION permitq.claim_requests(bigint[]) TO permitq_worker;
