-- Semaphore templates: `set_capacity('tenant:*', 5)` defines one. A request naming a semaphore
-- that does not exist, say `tenant:acme`, gets an *instance* made from the most specific
-- template whose prefix (the name without its `*`) the name starts with: the longest prefix wins
-- (`tenant:eu:*` over `tenant:*`). A template itself is never granted (a request naming one is
-- `unknown_semaphore`). Instances are ordinary semaphores that remember their template; a
-- template's change applies to them (functions/set_capacity.sql), and idle ones are removed by
-- the workers' sweep (functions/sweeps.sql) and made again when named.

-- The most specific template for `semaphore_name`, if any.
CREATE OR REPLACE FUNCTION permitq.template_for(semaphore_name text) RETURNS permitq.semaphore
LANGUAGE sql STABLE AS $$
    SELECT t.* FROM permitq.semaphore t
    WHERE t.is_template AND starts_with(semaphore_name, left(t.name, -1))
      AND semaphore_name NOT LIKE '%*'
    ORDER BY length(t.name) DESC
    LIMIT 1
$$;

-- Worker, before locking a batch's semaphores: makes the missing instances of `names`, with
-- their template's capacity, fairness, window, parent and guarantee. The templates are locked
-- first (FOR NO KEY UPDATE, in id order): a change of a template's capacity (functions/set_capacity.sql) waits for
-- an instance being made, or the instance waits and takes the new capacity; and the count of a
-- template's instances is exact against its bound (`max_instances`, else
-- rule_max_instances()). Instances are made in name order, ON CONFLICT DO NOTHING: two workers
-- making the same one end with one row. Returns the names refused because their template has
-- as many instances as it may; NULL when there is no template at all.
CREATE OR REPLACE FUNCTION permitq.make_instances(names text[]) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    wanted text[];
    missing record;
    made_id bigint;
    refused text[] := '{}';
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.semaphore t WHERE t.is_template) THEN
        RETURN NULL;
    END IF;
    SELECT array_agg(DISTINCT n) INTO wanted FROM unnest(names) n
    WHERE NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = n);
    IF wanted IS NULL THEN
        RETURN refused;
    END IF;
    PERFORM 1 FROM permitq.semaphore t
    WHERE t.id IN (SELECT (permitq.template_for(n)).id FROM unnest(wanted) n)
    ORDER BY t.id
    FOR NO KEY UPDATE;
    -- Read after the locks: a template's new values, and instances another worker made meanwhile.
    FOR missing IN
        SELECT n AS instance, t.name AS template, t.capacity, t.fair, t.per, t.parent, t.guarantee,
               coalesce(t.max_instances, permitq.rule_max_instances()) AS bound,
               EXISTS (SELECT 1 FROM permitq.keyed_semaphore k WHERE k.semaphore_id = t.id) AS keyed
        FROM unnest(wanted) n
        CROSS JOIN LATERAL permitq.template_for(n) t
        WHERE t.name IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = n)
        ORDER BY n
    LOOP
        IF (SELECT count(*) FROM (SELECT 1 FROM permitq.semaphore s
                                  WHERE s.template = missing.template LIMIT missing.bound) i)
           >= missing.bound THEN
            refused := refused || missing.instance;
            CONTINUE;
        END IF;
        INSERT INTO permitq.semaphore (name, capacity, fair, template, per, parent, guarantee)
        VALUES (missing.instance, missing.capacity, missing.fair, missing.template, missing.per,
                missing.parent, missing.guarantee)
        ON CONFLICT ON CONSTRAINT semaphore_name_key DO NOTHING
        RETURNING id INTO made_id;
        CONTINUE WHEN made_id IS NULL;
        -- Served by fairness key when its template is (functions/fairness.sql), from its first
        -- request on.
        IF missing.keyed THEN
            INSERT INTO permitq.keyed_semaphore (semaphore_id) VALUES (made_id);
        END IF;
        -- Made by this transaction: removed again at its end if nothing uses it
        -- (permitq.drop_unused_instances_made).
        PERFORM set_config('permitq.made_instances',
                           (coalesce(nullif(current_setting('permitq.made_instances', true), ''),
                                     '[]')::jsonb || to_jsonb(missing.instance))::text, true);
    END LOOP;
    RETURN refused;
END $$;

-- The instances this transaction made for its batch (permitq.make_instances), not yet removed
-- again (permitq.drop_unused_instances_made); none: an empty array.
CREATE OR REPLACE FUNCTION permitq.instances_made() RETURNS text[]
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce(array_agg(m), '{}')
    FROM jsonb_array_elements_text(coalesce(nullif(current_setting('permitq.made_instances', true), ''),
                                            '[]')::jsonb) m
$$;

-- Worker, at the end of a batch (permitq.apply_decision): the instances this transaction made
-- (permitq.make_instances) that nothing uses once the batch is decided (every request naming
-- them failed: a count beyond the template's capacity, a deadline passed) are removed again, so
-- that a request refused on the spot takes none of the template's `max_instances`. The same
-- conditions as the idle sweep's (functions/sweeps.sql), under the lock the batch holds.
CREATE OR REPLACE FUNCTION permitq.drop_unused_instances_made() RETURNS void
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    made text[];
BEGIN
    made := permitq.instances_made();
    IF cardinality(made) = 0 THEN
        RETURN;
    END IF;
    PERFORM set_config('permitq.made_instances', '', true);
    WITH dropped AS (
        DELETE FROM permitq.semaphore s
        WHERE s.name = ANY(made) AND s.template IS NOT NULL AND s.used = 0
          AND NOT EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id)
          AND NOT EXISTS (SELECT 1 FROM permitq.pending_release p WHERE p.semaphore = s.name)
          AND permitq.in_window(s) = 0
        RETURNING s.name
    )
    -- Nobody saw it: its creation's audit row (this transaction's, functions/capacity_audit.sql)
    -- goes with it.
    DELETE FROM permitq.capacity_change c USING dropped
    WHERE c.semaphore = dropped.name AND c.old_capacity IS NULL AND NOT c.deleted
      AND c.xmin = pg_current_xact_id()::xid AND c.changed_at >= now();
END $$;
