-- Worker step 2 (lock order step 2): the semaphores of a claimed batch, locked in ascending id,
-- with the pending releases folded into `used`, as the decision sees them.

-- Folds pending releases (functions/release.sql) into `used`: those of the semaphores in
-- `locked` (the caller holds their locks), and of every other semaphore it can lock without
-- waiting (FOR UPDATE SKIP LOCKED, in id order: whoever holds one folds it), plus the cancels.
-- Deletes what it folds and sends the events of the requests the rows announce.
CREATE OR REPLACE FUNCTION permitq.fold_pending_releases(locked text[]) RETURNS void
LANGUAGE plpgsql SET enable_seqscan = off AS $$
DECLARE
    also text[];
    announced bigint[];
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.pending_release) THEN
        RETURN;
    END IF;
    -- Driven by the pending rows (pending_release_semaphore_idx), never by the semaphores:
    -- work per release, not per semaphore.
    SELECT array_agg(l.name) INTO also FROM (
        SELECT s.name
        FROM (SELECT DISTINCT p.semaphore FROM permitq.pending_release p
              WHERE p.semaphore IS NOT NULL AND p.semaphore <> ALL(locked)) w
        JOIN permitq.semaphore s ON s.name = w.semaphore
        ORDER BY s.id
        FOR UPDATE OF s SKIP LOCKED
    ) l;
    locked := locked || coalesce(also, '{}');

    WITH named AS (
        DELETE FROM permitq.pending_release p
        WHERE p.semaphore = ANY(locked)
        RETURNING p.request_id, p.semaphore, p.count, p.announce
    ),
    cancels AS (
        DELETE FROM permitq.pending_release p
        WHERE p.id IN (SELECT c.id FROM permitq.pending_release c
                       WHERE c.semaphore IS NULL FOR UPDATE SKIP LOCKED)
        RETURNING p.request_id, p.semaphore, p.count, p.announce
    ),
    folded AS (
        SELECT * FROM named UNION ALL SELECT * FROM cancels
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
END $$;

-- Locks the semaphores named (templates excepted) FOR UPDATE in ascending id: the row locks are
-- taken above the sort, so in this order, the lock order of semaphore rows everywhere. Returns
-- the names it locked.
CREATE OR REPLACE FUNCTION permitq.lock_named(names text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    locked text[];
BEGIN
    SELECT array_agg(l.name) INTO locked FROM (
        SELECT s.name FROM permitq.semaphore s
        WHERE s.name = ANY(names) AND NOT s.is_template
        ORDER BY s.id
        FOR UPDATE
    ) l;
    RETURN coalesce(locked, '{}');
END $$;

-- The worker's step 2 for a batch naming `names`, in one call:
--   1. make the missing template instances (functions/templates.sql), before any semaphore lock;
--   2. lock the named semaphores with their ancestors (permitq.nesting_lock_set,
--      functions/nesting.sql), in one statement (permitq.lock_named); templates are never locked
--      nor returned, so a request naming one is `unknown_semaphore`. An instance the idle sweep
--      removed between 1 and 2 (it held the row) is made again and locked (a newest id, so
--      still in ascending order, but its ancestors, and its template, are locked after it: a
--      change of those at that very moment may end in a deadlock, which the worker retries).
--      When the tree changed between reading it and locking (a semaphore moved, or given a
--      parent), what is locked is not all a grant takes: 40001, and the worker retries;
--   3. fold the pending releases of these and of every semaphore no one else holds;
--   4. return the locked semaphores as the decision sees them: `used` is the permits held, or
--      for a rate-limited semaphore the permits granted in its window; its parent, guarantee,
--      and whether it is active (for a guaranteed child: holds permits, or a request waits on it
--      within its unused guarantee; one beyond it borrows, and keeps no reserve); then
--      the guaranteed children of the locked semaphores, read and not locked, for the reserves:
--      their `used` less their releases not folded yet, exact however their folds interleave,
--      since it only grows by grants, which lock their parent first; and a row with NULL
--      capacity for each name refused because its template has as many instances as it may.
-- The rows are the latest committed versions, exact for as long as the caller's transaction
-- runs.
CREATE OR REPLACE FUNCTION permitq.lock_batch_semaphores(names text[])
RETURNS TABLE (id bigint, name text, capacity integer, used bigint, fair boolean, parent text,
               guarantee integer, active boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    refused text[] := permitq.make_instances(names);
    locked text[] := permitq.lock_named(permitq.nesting_lock_set(names));
    gone text[];
    nested boolean := EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.parent IS NOT NULL);
BEGIN
    IF refused IS NOT NULL THEN
        SELECT array_agg(n) INTO gone FROM unnest(names) n
        WHERE n <> ALL(locked) AND n <> ALL(refused) AND (permitq.template_for(n)).name IS NOT NULL;
        IF gone IS NOT NULL THEN
            refused := refused || permitq.make_instances(gone);
            locked := locked || permitq.lock_named(permitq.nesting_lock_set(gone));
        END IF;
    END IF;
    IF nested AND EXISTS (
        SELECT 1 FROM permitq.semaphore s
        WHERE s.name = ANY(permitq.nesting_lock_set(names)) AND NOT s.is_template
          AND s.name <> ALL(locked)
    ) THEN
        RAISE EXCEPTION 'the semaphores'' parents changed while a batch locked them'
            USING ERRCODE = '40001';
    END IF;

    PERFORM permitq.fold_pending_releases(locked);

    RETURN QUERY
    SELECT s.id, s.name, s.capacity,
           CASE WHEN s.per IS NULL THEN s.used ELSE permitq.in_window(s) END,
           s.fair, s.parent, s.guarantee,
           s.guarantee > 0
           AND (s.used > 0 OR EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id
                                      AND w.count <= s.guarantee - s.used)) -- waiter_count_idx
    FROM permitq.semaphore s
    WHERE s.name = ANY(locked)
    UNION ALL
    SELECT c.id, c.name, c.capacity,
           CASE WHEN c.per IS NULL THEN c.used - f.pending ELSE permitq.in_window(c) END,
           c.fair, c.parent, c.guarantee,
           c.used - f.pending > 0
           OR EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = c.id
                      AND w.count <= c.guarantee - (c.used - f.pending)) -- waiter_count_idx
    FROM permitq.semaphore c
    CROSS JOIN LATERAL (SELECT coalesce(sum(p.count), 0) AS pending FROM permitq.pending_release p
                        WHERE p.semaphore = c.name) f
    WHERE nested AND c.parent = ANY(locked) AND c.guarantee > 0 AND NOT c.is_template
      AND c.name <> ALL(locked)
    UNION ALL
    SELECT NULL, r, NULL, NULL, NULL, NULL, NULL, NULL FROM unnest(refused) r
    ORDER BY 1;
END $$;
GRANT EXECUTE ON FUNCTION permitq.lock_batch_semaphores(text[]) TO permitq_worker;

-- Worker, when it claimed nothing: fold the pending releases (and send their events), so `used`
-- and the producers waiting for `released` do not wait for the next grant.
CREATE OR REPLACE FUNCTION permitq.fold_releases() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    PERFORM permitq.fold_pending_releases('{}');
END $$;
GRANT EXECUTE ON FUNCTION permitq.fold_releases() TO permitq_worker;
