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
        -- Served by fairness key when its template is (functions/fairness.sql), from its first
        -- request on.
        WITH made AS (
            INSERT INTO permitq.semaphore (name, capacity, fair, template, per, parent, guarantee)
            VALUES (missing.instance, missing.capacity, missing.fair, missing.template, missing.per,
                    missing.parent, missing.guarantee)
            ON CONFLICT ON CONSTRAINT semaphore_name_key DO NOTHING
            RETURNING id
        )
        INSERT INTO permitq.keyed_semaphore (semaphore_id)
        SELECT made.id FROM made
        WHERE missing.keyed;
    END LOOP;
    RETURN refused;
END $$;
