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
-- their template's capacity, fairness and window. In name order, with ON CONFLICT DO NOTHING:
-- two workers making the same instance end with one row (the second waits for the first's
-- insert, then locks the committed row), and no request naming an instance gets
-- `unknown_semaphore`.
CREATE OR REPLACE FUNCTION permitq.make_instances(names text[]) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.semaphore t WHERE t.is_template) THEN
        RETURN;
    END IF;
    INSERT INTO permitq.semaphore (name, capacity, fair, template, per)
    SELECT n.name, t.capacity, t.fair, t.name, t.per
    FROM (SELECT DISTINCT x AS name FROM unnest(names) x) n
    CROSS JOIN LATERAL permitq.template_for(n.name) t
    WHERE t.name IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = n.name)
    ORDER BY n.name
    ON CONFLICT ON CONSTRAINT semaphore_name_key DO NOTHING;
END $$;
