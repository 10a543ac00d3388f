-- The operator's entry: create or change a semaphore, a template, or a rate limit.

-- permitq.set_capacity: create or change a semaphore and wake the workers. Lowering capacity
-- below `used` revokes nothing; new grants wait until `used` drops below the new capacity.
-- A name ending in `*` makes a template (functions/templates.sql): its instances follow its
-- changes. `per`: NULL keeps the semaphore's window (none for a new one); a positive interval
-- makes it rate-limited (functions/rate_windows.sql); '0' makes it a concurrency semaphore
-- again. `max_instances` (templates only; NULL keeps it) bounds the instances a template makes
-- (default rule_max_instances()). `parent` (NULL keeps it, '' removes it and its guarantee)
-- nests the semaphore under another, and `guarantee` (NULL keeps it, 0 for a new one) is its
-- guaranteed share of that parent (functions/nesting.sql); a template's instances carry both.
-- `adaptive` (NULL keeps it) lets the workers set the capacity from its holders' reports:
-- `{"algorithm": "aimd" | "gradient", "floor": F, "ceiling": C}` (functions/adaptive.sql, where
-- permitq.set_adaptive checks it; `capacity` is where it starts), or `false` to fix it again.
CREATE OR REPLACE FUNCTION permitq.set_capacity(name text, capacity integer, fair boolean DEFAULT NULL,
                                                per interval DEFAULT NULL,
                                                max_instances integer DEFAULT NULL,
                                                parent text DEFAULT NULL,
                                                guarantee integer DEFAULT NULL,
                                                adaptive jsonb DEFAULT NULL)
RETURNS permitq.semaphore
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_column
DECLARE
    result permitq.semaphore;
    problem text;
    -- Its keyed rows (it, or a template's instances) when this call makes it greedy.
    keyed_names text;
    keyed_itself boolean;
    old_parent text;
BEGIN
    IF set_capacity.name IS NULL OR set_capacity.name = '' THEN
        RAISE EXCEPTION 'invalid name: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(set_capacity.name) > permitq.rule_max_name_length() THEN
        RAISE EXCEPTION 'invalid name: must be at most % characters', permitq.rule_max_name_length()
            USING ERRCODE = '22023';
    END IF;
    -- Names match exactly, so a space at either end makes a second semaphore no one means to
    -- name (one made before this rule can still be changed).
    IF set_capacity.name ~ '^\s|\s$'
       AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = set_capacity.name) THEN
        RAISE EXCEPTION 'invalid name: %: a space (or tab, newline) at its start or end; names match exactly: use %',
            quote_literal(set_capacity.name), quote_literal(btrim(set_capacity.name, E' \t\n\r'))
            USING ERRCODE = '22023';
    END IF;
    IF set_capacity.name = '*' THEN
        RAISE EXCEPTION 'invalid name: a template needs a prefix before its *' USING ERRCODE = '22023';
    END IF;
    IF set_capacity.capacity IS NULL OR set_capacity.capacity < 0 THEN
        RAISE EXCEPTION 'invalid capacity: must be a non-negative integer, got %',
            coalesce(set_capacity.capacity::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    IF set_capacity.max_instances IS NOT NULL AND right(set_capacity.name, 1) <> '*' THEN
        RAISE EXCEPTION 'invalid max_instances: only a template (a name ending in *) makes instances'
            USING ERRCODE = '22023';
    END IF;
    IF set_capacity.max_instances < 0 THEN
        RAISE EXCEPTION 'invalid max_instances: must not be negative, got %', set_capacity.max_instances
            USING ERRCODE = '22023';
    END IF;
    problem := permitq.interval_problem(set_capacity.per, true);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid per: %', problem USING ERRCODE = '22023';
    END IF;
    IF set_capacity.guarantee < 0 THEN
        RAISE EXCEPTION 'invalid guarantee: must not be negative, got %', set_capacity.guarantee
            USING ERRCODE = '22023';
    END IF;
    IF set_capacity.adaptive IS NOT NULL AND set_capacity.adaptive <> 'false'::jsonb
       AND (jsonb_typeof(set_capacity.adaptive) <> 'object'
            OR NOT set_capacity.adaptive ?& ARRAY['algorithm', 'floor', 'ceiling']
            OR jsonb_typeof(set_capacity.adaptive -> 'floor') <> 'number'
            OR jsonb_typeof(set_capacity.adaptive -> 'ceiling') <> 'number'
            OR (SELECT count(*) FROM jsonb_object_keys(set_capacity.adaptive)) <> 3) THEN
        RAISE EXCEPTION 'invalid adaptive: %: give {"algorithm": "aimd" or "gradient", "floor": N, "ceiling": N}, or false to fix the capacity again',
            set_capacity.adaptive USING ERRCODE = '22023';
    END IF;
    -- Changes of the tree one at a time (functions/nesting.sql); taken before any row lock.
    LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE;
    IF nullif(set_capacity.parent, '') IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = set_capacity.parent) THEN
        -- A near name first (most often a typo), as everywhere a name is not found.
        RAISE EXCEPTION 'invalid nesting of %: parent % does not exist: %',
            set_capacity.name, set_capacity.parent,
            (SELECT CASE WHEN x.similar <> ''
                         THEN format('did you mean %s? (or create %s first: `permitq semaphore set %s CAPACITY`)',
                                     x.similar, set_capacity.parent,
                                     permitq.shell_word(set_capacity.parent))
                         ELSE format('create it first (`permitq semaphore set %s CAPACITY`)',
                                     permitq.shell_word(set_capacity.parent)) END
             FROM (SELECT array_to_string(permitq.similar_semaphore_names(set_capacity.parent),
                                          ' or ') AS similar) x)
            USING ERRCODE = '22023';
    END IF;
    IF (set_capacity.parent IS NOT NULL OR set_capacity.guarantee IS NOT NULL)
       AND EXISTS (SELECT 1 FROM permitq.semaphore s
                   WHERE s.name = set_capacity.name AND s.template IS NOT NULL) THEN
        RAISE EXCEPTION 'invalid nesting of %: an instance takes its parent and guarantee from its template',
            set_capacity.name USING ERRCODE = '22023';
    END IF;
    SELECT s.parent INTO old_parent FROM permitq.semaphore s WHERE s.name = set_capacity.name;
    INSERT INTO permitq.semaphore AS s (name, capacity, fair, is_template, per, max_instances,
                                        parent, guarantee)
    VALUES (set_capacity.name, set_capacity.capacity, coalesce(set_capacity.fair, true),
            right(set_capacity.name, 1) = '*', nullif(set_capacity.per, interval '0'),
            set_capacity.max_instances, nullif(set_capacity.parent, ''),
            coalesce(set_capacity.guarantee, 0))
    ON CONFLICT ON CONSTRAINT semaphore_name_key DO UPDATE
        SET capacity = EXCLUDED.capacity,
            fair = coalesce(set_capacity.fair, s.fair),
            per = CASE WHEN set_capacity.per IS NULL THEN s.per
                       ELSE nullif(set_capacity.per, interval '0') END,
            max_instances = coalesce(set_capacity.max_instances, s.max_instances),
            parent = CASE WHEN set_capacity.parent IS NULL THEN s.parent
                          ELSE nullif(set_capacity.parent, '') END,
            -- Out of its parent, a semaphore has no guarantee (unless one is given: refused).
            guarantee = coalesce(set_capacity.guarantee,
                                 CASE WHEN set_capacity.parent = '' THEN 0 END, s.guarantee),
            updated_at = now()
    RETURNING * INTO result;
    IF result.is_template THEN
        -- Its instances follow (in id order, the lock order of semaphore rows); locked before the
        -- check, so that none takes a grant between the check and the change.
        PERFORM 1 FROM permitq.semaphore s WHERE s.template = result.name ORDER BY s.id FOR UPDATE;
    END IF;
    -- Greedy serves no line, and a keyed semaphore's line is served across keys: both at once
    -- would leave `explain` and the position saying one thing and the decision another. Refused
    -- when this call makes it (or, for a template, its keyed instances) greedy; a semaphore left
    -- both by an earlier version is not refused for other changes.
    IF set_capacity.fair = false THEN
        -- What is keyed: it, and (a template) its instances, named.
        SELECT string_agg(permitq.shell_word(x.name), ', ' ORDER BY x.name)
                   FILTER (WHERE x.id <> result.id),
               bool_or(x.id = result.id)
        INTO keyed_names, keyed_itself
        FROM permitq.semaphore x JOIN permitq.keyed_semaphore k ON k.semaphore_id = x.id
        WHERE x.id = result.id OR x.template = result.name;
        IF keyed_itself OR keyed_names IS NOT NULL THEN
            keyed_names := concat_ws(' and ', CASE WHEN keyed_itself THEN 'it' END,
                                     'its instances ' || keyed_names)
                           || CASE WHEN keyed_itself AND keyed_names IS NULL THEN ' is' ELSE ' are' END;
            RAISE EXCEPTION 'invalid greedy semaphore %: % served by fairness key (its line is served across the keys, in turn), and a greedy semaphore serves no line',
                result.name,
                keyed_names
                USING ERRCODE = '22023',
                HINT = CASE WHEN result.is_template
                    THEN format('turn its keys off in the same command, which turns off its instances'' too: `permitq semaphore set %s %s --greedy --no-fairness-keys` (with a client older than the database: `--no-fairness-keys` first, then `--greedy`)',
                                permitq.shell_word(result.name), result.capacity)
                    ELSE format('turn its keys off in the same command: `permitq semaphore set %s %s --greedy --no-fairness-keys` (with a client older than the database: `--no-fairness-keys` first, then `--greedy`)',
                                permitq.shell_word(result.name), result.capacity) END;
        END IF;
    END IF;
    problem := permitq.nesting_problem(result, result.parent IS DISTINCT FROM old_parent);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid nesting of %: %', result.name, problem USING ERRCODE = '22023';
    END IF;
    IF result.is_template THEN
        UPDATE permitq.semaphore s
        SET capacity = result.capacity, fair = result.fair, per = result.per,
            parent = result.parent, guarantee = result.guarantee, updated_at = now()
        WHERE s.template = result.name;
    END IF;
    IF set_capacity.adaptive IS NOT NULL THEN
        PERFORM permitq.set_adaptive(result.name,
                                     CASE WHEN set_capacity.adaptive <> 'false'::jsonb
                                          THEN set_capacity.adaptive ->> 'algorithm' END,
                                     (set_capacity.adaptive ->> 'floor')::numeric::integer,
                                     (set_capacity.adaptive ->> 'ceiling')::numeric::integer);
        -- Brought within its bounds.
        SELECT * INTO result FROM permitq.semaphore s WHERE s.id = result.id;
    END IF;
    PERFORM permitq.notify('permitq_work', '');
    RETURN result;
END $$;
GRANT EXECUTE ON FUNCTION permitq.set_capacity(text, integer, boolean, interval, integer, text, integer, jsonb)
    TO permitq_admin;

-- permitq.delete_semaphore: delete a semaphore, template or instance nothing uses, and audit it
-- (a `deleted` row in permitq.capacity_change with the bounds it had). NULL when there is no such
-- semaphore. Refused (55006, naming what to do first) while it holds permits or has releases
-- not folded yet, while its rate window holds grants, while requests wait on it (examined or
-- not), while it is a parent, and for a template while it has instances. Locks: the nesting gate first (tree changes one at a time, as
-- set_capacity), then the semaphore's row, which a worker deciding a batch on it holds until it
-- commits: no grant slips in between the checks and the delete. A request submitted after it
-- fails with unknown_semaphore (naming the nearest names), unless a template makes it again.
CREATE OR REPLACE FUNCTION permitq.delete_semaphore(name text) RETURNS permitq.semaphore
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_variable
DECLARE
    s permitq.semaphore;
    waiting bigint;
    names text;
    n bigint;
BEGIN
    LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE;
    SELECT * INTO s FROM permitq.semaphore x WHERE x.name = delete_semaphore.name FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    -- Its children, an instance named by its template (which is what moves or goes).
    SELECT count(*), string_agg(c.name, ', ' ORDER BY c.name) INTO n, names
    FROM (SELECT DISTINCT coalesce(x.template, x.name) AS name FROM permitq.semaphore x
          WHERE x.parent = s.name ORDER BY 1 LIMIT 10) c;
    IF n > 0 THEN
        -- One child: the command itself, with its name and capacity.
        RAISE EXCEPTION '% is the parent of %: take % out (`permitq semaphore set % --no-parent`; a template''s instances follow it) or delete % first',
            s.name, names, CASE WHEN n = 1 THEN 'it' ELSE 'them' END,
            coalesce((SELECT format('%s %s', permitq.shell_word(c.name), c.capacity)
                      FROM permitq.semaphore c WHERE n = 1 AND c.name = names),
                     'NAME CAPACITY'),
            CASE WHEN n = 1 THEN 'it' ELSE 'them' END USING ERRCODE = '55006';
    END IF;
    SELECT count(*), string_agg(c.name, ', ' ORDER BY c.name) INTO n, names
    FROM (SELECT x.name FROM permitq.semaphore x WHERE x.template = s.name
          ORDER BY x.name LIMIT 10) c;
    IF n > 0 THEN
        RAISE EXCEPTION '% has instances: %; delete them first (`permitq semaphore delete NAME`; the workers remove an instance nothing uses after --idle-instance-after)',
            s.name, names USING ERRCODE = '55006';
    END IF;
    -- What passes by itself last: `used` counts releases not folded yet, so they are waited for
    -- before it is read as held.
    IF EXISTS (SELECT 1 FROM permitq.pending_release p WHERE p.semaphore = s.name) THEN
        RAISE EXCEPTION '% has releases the workers have not folded yet (they do within a second while one runs): try again then', s.name
            USING ERRCODE = '55006';
    END IF;
    IF s.used > 0 THEN
        RAISE EXCEPTION '% holds % %: release or revoke (`permitq revoke ID`) %, then delete it (`permitq semaphore show %` lists the holders)',
            s.name, s.used, CASE WHEN s.used = 1 THEN 'permit' ELSE 'permits' END,
            CASE WHEN s.used = 1 THEN 'it' ELSE 'them' END, permitq.shell_word(s.name)
            USING ERRCODE = '55006';
    END IF;
    -- A rate limit's window lives with it: deleting it early would let a new one grant the
    -- window's permits again (a template's instance is made again by any request).
    IF s.per IS NOT NULL AND permitq.in_window(s) > 0 THEN
        RAISE EXCEPTION '% granted % in its % rate window: deleting it would let the window''s grants be made again; try again once the window has no grants (in %)',
            s.name, permitq.in_window(s), permitq.human_duration(s.per),
            coalesce(permitq.human_duration(
                (SELECT max(b.ends_at) FROM permitq.rate_bucket b WHERE b.semaphore_id = s.id)
                + s.per - now()), 'a moment')
            USING ERRCODE = '55006';
    END IF;
    -- Waiting: examined (the line table) or not yet (their partial index), at most 10000 counted.
    SELECT count(*) INTO waiting
    FROM (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id
          UNION ALL
          (SELECT 1 FROM permitq.permit_request pr
           WHERE pr.state = 'new' AND NOT pr.examined AND pr.permits ? s.name
           LIMIT 10000)) x;
    IF waiting > 0 THEN
        RAISE EXCEPTION '% has % % waiting: release (cancel) them or let their wait run out, then delete it (`permitq semaphore show %` lists them)',
            s.name, waiting, CASE WHEN waiting = 1 THEN 'request' ELSE 'requests' END,
            permitq.shell_word(s.name) USING ERRCODE = '55006';
    END IF;
    DELETE FROM permitq.semaphore x WHERE x.id = s.id;
    PERFORM permitq.record_capacity_change(s, s, true);
    RETURN s;
END $$;
GRANT EXECUTE ON FUNCTION permitq.delete_semaphore(text) TO permitq_admin;
