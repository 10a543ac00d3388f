-- V8: semaphore templates (limits per key).
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

CREATE OR REPLACE FUNCTION permitq.set_capacity(name text, capacity integer, fair boolean DEFAULT NULL)
RETURNS permitq.semaphore
LANGUAGE plpgsql AS $$
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
    IF set_capacity.name = '*' THEN
        RAISE EXCEPTION 'invalid name: a template needs a prefix before its *' USING ERRCODE = '22023';
    END IF;
    IF set_capacity.capacity IS NULL OR set_capacity.capacity < 0 THEN
        RAISE EXCEPTION 'invalid capacity: must be a non-negative integer, got %',
            coalesce(set_capacity.capacity::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    INSERT INTO permitq.semaphore AS s (name, capacity, fair, is_template)
    VALUES (set_capacity.name, set_capacity.capacity, coalesce(set_capacity.fair, true),
            right(set_capacity.name, 1) = '*')
    ON CONFLICT ON CONSTRAINT semaphore_name_key DO UPDATE
        SET capacity = EXCLUDED.capacity,
            fair = coalesce(set_capacity.fair, s.fair),
            updated_at = now()
    RETURNING * INTO result;
    IF result.is_template THEN
        -- Its instances follow (in id order, the lock order of semaphore rows).
        PERFORM 1 FROM permitq.semaphore s WHERE s.template = result.name ORDER BY s.id FOR UPDATE;
        UPDATE permitq.semaphore s
        SET capacity = result.capacity, fair = result.fair, updated_at = now()
        WHERE s.template = result.name;
    END IF;
    PERFORM pg_notify('permitq_work', '');
    RETURN result;
END $$;

-- Worker step 2, as in V3, plus: instances of templates are made first for the names that match
-- no semaphore, and templates are never returned (a request naming one is unknown_semaphore).
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
        INSERT INTO permitq.semaphore (name, capacity, fair, template)
        SELECT n.name, t.capacity, t.fair, t.name
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
    SELECT s.id, s.name, s.capacity, s.used, s.fair FROM permitq.semaphore s
    WHERE s.name = ANY(names) AND NOT s.is_template
    ORDER BY s.id;
END $$;

-- Sweep: removes up to `batch_size` instances of templates that hold nothing (`used` = 0 under
-- their lock, nothing left to fold), have nobody waiting, and saw no grant, fold or change for
-- `idle`. Returns how many. A request that names one later makes it again.
CREATE FUNCTION permitq.sweep_idle_instances(idle interval, batch_size integer) RETURNS integer
LANGUAGE plpgsql SET plan_cache_mode = force_custom_plan AS $$
DECLARE
    n integer;
BEGIN
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
      AND NOT EXISTS (SELECT 1 FROM permitq.pending_release p WHERE p.semaphore = s.name);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END $$;

-- Entry points run as their owner with a pinned path (see V4); the sweep is the workers'.
ALTER FUNCTION permitq.set_capacity(text, integer, boolean)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.lock_and_fold(text[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.sweep_idle_instances(interval, integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
REVOKE EXECUTE ON FUNCTION permitq.sweep_idle_instances(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION permitq.sweep_idle_instances(interval, integer) TO permitq_worker, permitq_admin;
REVOKE EXECUTE ON FUNCTION permitq.template_for(text) FROM PUBLIC;
