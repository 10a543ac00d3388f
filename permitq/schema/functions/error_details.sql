-- What an errored request records beside its code (`permit_request.error_detail`, read by
-- types::ErrorDetail). The decision (src/decision.rs, `failure_detail`) names the semaphore, the
-- count and the bound it saw; the worker's apply adds what only the database knows:
--   unknown_semaphore: `similar`, the existing names nearest the one not found;
--   too_many_instances: `template`, its `capacity` and `max_instances`, its instances holding
--   nothing (`idle_instances`), and `parent_needs` when one more would not fit its parent.

-- Up to 3 of `candidates` nearest `wanted`, nearest first: the same name in another case, then
-- names that contain it or that it contains (a template's `*` aside), then the same letters in
-- another order (two swapped: `wiat-1` for `wait-1`), then those sharing at least half of its
-- letter pairs. The one rule of "did you mean", for semaphore names and request ids.
CREATE OR REPLACE FUNCTION permitq.nearest_names(wanted text, candidates text[]) RETURNS text[]
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    WITH w AS (
        SELECT lower(left(wanted, 128)) AS name,
               (SELECT string_agg(ch, '' ORDER BY ch)
                FROM regexp_split_to_table(lower(left(wanted, 128)), '') ch) AS letters
    ),
    pairs AS (
        SELECT DISTINCT substr(w.name, i, 2) AS pair
        FROM w, generate_series(1, greatest(length(w.name) - 1, 1)) i
    ),
    scored AS (
        SELECT c.name,
               CASE WHEN c.lowered = w.name THEN 3
                    WHEN strpos(c.lowered, w.name) > 0 OR strpos(w.name, rtrim(c.lowered, '*')) > 0
                        THEN 2
                    WHEN length(c.lowered) = length(w.name)
                         AND (SELECT string_agg(ch, '' ORDER BY ch)
                              FROM regexp_split_to_table(c.lowered, '') ch) = w.letters
                        THEN 1
                    ELSE 0 END AS rank,
               (SELECT count(DISTINCT substr(c.lowered, i, 2))
                FROM generate_series(1, greatest(length(c.lowered) - 1, 1)) i
                WHERE substr(c.lowered, i, 2) IN (SELECT pair FROM pairs))::float8
               / greatest((SELECT count(*) FROM pairs), length(c.lowered) - 1, 1) AS shared
        FROM (SELECT x AS name, lower(left(x, 128)) AS lowered
              FROM unnest(candidates) x WHERE x <> wanted) c, w
    )
    SELECT coalesce(array_agg(name ORDER BY rank DESC, shared DESC, name), '{}')
    FROM (SELECT name, rank, shared FROM scored
          WHERE rank > 0 OR shared >= 0.5
          ORDER BY rank DESC, shared DESC, name LIMIT 3) nearest
$$;

-- Up to 3 existing semaphore or template names nearest `semaphore_name` (permitq.nearest_names),
-- nearest first. Instances are left out (their template's instance form is named instead,
-- `lab:NAME (an instance of the template lab:*)`). Cost: bounded, at most 1,000 names compared,
-- only when a request fails with unknown_semaphore or a name is not found.
-- (As its owner: permitq.nearest_names is not granted to the logins that ask.)
CREATE OR REPLACE FUNCTION permitq.similar_semaphore_names(semaphore_name text) RETURNS text[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    -- A template is offered as the instance name it makes, since a template itself is never
    -- granted: `lab:NAME (an instance of the template lab:*)`.
    SELECT coalesce(array_agg(CASE WHEN right(n, 1) = '*'
                                   THEN format('%sNAME (an instance of the template %s)',
                                               left(n, -1), n)
                                   ELSE n END ORDER BY o), '{}')
    FROM unnest(permitq.nearest_names(semaphore_name, ARRAY(
             SELECT s.name FROM permitq.semaphore s
             WHERE s.template IS NULL ORDER BY s.name LIMIT 1000))) WITH ORDINALITY x(n, o)
$$;
-- Also what `semaphore show` and `history` suggest for a name that is not there.
GRANT EXECUTE ON FUNCTION permitq.similar_semaphore_names(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Up to 3 external_ids nearest `external_id` among those of the latest 1,000 requests that this
-- login reads (permitq.may_read: its own, for a producer), nearest first: what `permitq status`,
-- `explain`, `heartbeat` and `release` suggest for an id no request has. Bounded: 1,000 rows of a
-- backward scan of the primary key, whoever submitted them (under row security, a producer
-- with few requests would scan the whole table), only when an id is not found.
CREATE OR REPLACE FUNCTION permitq.similar_request_ids(external_id text) RETURNS text[]
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT permitq.nearest_names(similar_request_ids.external_id, ARRAY(
        SELECT x.external_id
        FROM (SELECT r.external_id, r.submitted_by FROM permitq.permit_request r
              ORDER BY r.id DESC LIMIT 1000) x
        WHERE permitq.may_read(x.submitted_by)))
$$;
GRANT EXECUTE ON FUNCTION permitq.similar_request_ids(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- What to tell whoever submitted a request naming `semaphore_name` when no semaphore or template
-- has that name (a worker will fail it with unknown_semaphore), with the nearest names; NULL when
-- one has it (an instance is made by its template at the grant). Said by `permitq explain` and
-- by `permitq submit` at once, while the name can still be created.
CREATE OR REPLACE FUNCTION permitq.unknown_name_answer(semaphore_name text) RETURNS text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    -- A near name first (most often a typo): submitted again naming it, as a worker's
    -- unknown_semaphore says; else the name created in time.
    SELECT CASE WHEN x.similar IS NOT NULL
        THEN format('no semaphore or template is named %s; did you mean %s? A worker fails the '
                    'request with unknown_semaphore: submit again naming it, under a new '
                    'external_id (or create %s with `permitq semaphore set %s CAPACITY` before a '
                    'worker examines it)',
                    semaphore_name, x.similar, semaphore_name, permitq.shell_word(semaphore_name))
        ELSE format('no semaphore or template is named %s: a worker fails the request with '
                    'unknown_semaphore; create it (`permitq semaphore set %s CAPACITY`) before a '
                    'worker examines it, or submit again under a new external_id',
                    semaphore_name, permitq.shell_word(semaphore_name)) END
    FROM (SELECT nullif(array_to_string(permitq.similar_semaphore_names(semaphore_name), ' or '), '')
                 AS similar) x
    WHERE NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = semaphore_name)
      AND (permitq.template_for(semaphore_name)).name IS NULL
$$;
GRANT EXECUTE ON FUNCTION permitq.unknown_name_answer(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- A duration as `semaphore show` writes it: `250ms`, `8.9s`, `1m`, `1h30m`, `2d`.
CREATE OR REPLACE FUNCTION permitq.human_duration(d interval) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN x.s IS NULL THEN NULL
        WHEN x.s < 1 THEN round(x.s * 1000)::text || 'ms'
        WHEN x.s < 60 THEN trim_scale(round(x.s, 1))::text || 's'
        ELSE concat(nullif(floor(x.s / 86400), 0)::text || 'd',
                    nullif(floor(mod(x.s, 86400) / 3600), 0)::text || 'h',
                    nullif(floor(mod(x.s, 3600) / 60), 0)::text || 'm',
                    nullif(floor(mod(x.s, 60)), 0)::text || 's')
    END
    FROM (SELECT extract(epoch FROM d) AS s) x
$$;

-- Where a request that waits has no room now, as the detail of its timeout: the first semaphore
-- it takes from (what it names, then their ancestors, nearest first; `named` the one below a
-- parent) whose room (permitq.free_room) is less than its count there. '{}' when it has room
-- everywhere: it waited behind requests ahead in line, or its wait ran out first. The worker's
-- own timeouts carry the decision's detail, which counts the same way (src/decision.rs).
CREATE OR REPLACE FUNCTION permitq.wait_detail(permits jsonb) RETURNS jsonb
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT coalesce((
        SELECT jsonb_strip_nulls(jsonb_build_object(
                   'semaphore', t.name, 'named', t.via, 'count', t.count,
                   'capacity', s.capacity, 'free', greatest(permitq.free_room(s), 0)))
        FROM permitq.taken_by(permits) t
        JOIN permitq.semaphore s ON s.name = t.name
        WHERE t.count > permitq.free_room(s)
        ORDER BY t.depth, t.name
        LIMIT 1), '{}')
$$;

-- A failed request's detail, completed: `detail` as the decision gave it, plus `similar` for
-- unknown_semaphore, `per` (the window) for a rate-limited semaphore's no_capacity and
-- exceeds_capacity (and `template` for an instance's, `adaptive` for an adaptive one's
-- exceeds_capacity), and for too_many_instances the template's
-- `capacity`, `max_instances` and `instances` (how many it has), `idle_instances`,
-- `new_instances` (how many of the request's `permits` it does not have yet, when more than
-- one), and its
-- `parent`, `guarantee` and `parent_needs` when nested. The instances this transaction made for
-- its batch (permitq.make_instances) are not counted as the template's: a failed request's go
-- again (permitq.drop_unused_instances_made).
-- (Before the request's permits were an argument, the function took two.)
DROP FUNCTION IF EXISTS permitq.completed_error_detail(text, jsonb);
CREATE OR REPLACE FUNCTION permitq.completed_error_detail(code text, detail jsonb, permits jsonb)
RETURNS jsonb
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    template permitq.semaphore;
    made text[];
    had bigint;
    made_here bigint;
    new_instances bigint;
BEGIN
    detail := coalesce(detail, '{}');
    IF code = 'unknown_semaphore' AND detail ? 'semaphore' THEN
        RETURN detail || jsonb_build_object(
            'similar', to_jsonb(permitq.similar_semaphore_names(detail ->> 'semaphore')));
    ELSIF code IN ('no_capacity', 'exceeds_capacity', 'timeout') AND detail ? 'semaphore' THEN
        -- A rate-limited semaphore's bound is grants per window: say which window. An
        -- instance's capacity is its template's: name the template, where it is changed. An
        -- adaptive one's capacity moves: for exceeds_capacity, its bounds, and the capacity the
        -- workers backed it off from when their change was the last one (`from`).
        RETURN detail || coalesce((SELECT jsonb_strip_nulls(jsonb_build_object(
                                              'per', permitq.human_duration(s.per),
                                              'template', s.template,
                                              'adaptive', CASE WHEN code = 'exceeds_capacity' THEN (
                    SELECT jsonb_strip_nulls(jsonb_build_object(
                               'algorithm', a.algorithm, 'floor', a.floor, 'ceiling', a.ceiling,
                               'from', (SELECT c.old_capacity
                                        FROM (SELECT c.* FROM permitq.capacity_change c
                                              WHERE c.semaphore = s.name
                                              ORDER BY c.id DESC LIMIT 1) c
                                        WHERE c.changed_by LIKE 'adaptive (%'
                                          AND c.old_capacity > c.new_capacity)))
                    FROM permitq.adaptive_limit a WHERE a.semaphore_id = s.id) END,
                                              -- Lowered by hand below the count by its last
                                              -- change: from what, by whom, when.
                                              'lowered_from', l.old_capacity,
                                              'lowered_by', l.changed_by,
                                              'lowered_at_ms', (extract(epoch FROM l.changed_at) * 1000)::bigint))
                                   FROM permitq.semaphore s
                                   LEFT JOIN LATERAL (
                                       SELECT c.old_capacity, c.changed_by, c.changed_at
                                       FROM (SELECT c.* FROM permitq.capacity_change c
                                             WHERE c.semaphore = s.name
                                             ORDER BY c.id DESC LIMIT 1) c
                                       WHERE code = 'exceeds_capacity'
                                         AND c.changed_by NOT LIKE 'adaptive (%'
                                         AND c.old_capacity >= (detail ->> 'count')::bigint
                                         AND c.new_capacity < (detail ->> 'count')::bigint) l ON true
                                   WHERE s.name = detail ->> 'semaphore'),
                                  '{}');
    ELSIF code = 'too_many_instances' AND detail ? 'semaphore' THEN
        template := permitq.template_for(detail ->> 'semaphore');
        IF template.name IS NOT NULL THEN
            made := permitq.instances_made();
            SELECT count(*) FILTER (WHERE i.name <> ALL(made)), count(*) FILTER (WHERE i.name = ANY(made))
            INTO had, made_here
            FROM permitq.semaphore i WHERE i.template = template.name;
            -- The request's instances of it that it had not made before this batch: one more
            -- than the bound leaves, or several.
            SELECT count(*) INTO new_instances
            FROM jsonb_object_keys(coalesce(permits, '{}')) n
            WHERE (permitq.template_for(n)).name = template.name
              AND NOT EXISTS (SELECT 1 FROM permitq.semaphore i
                              WHERE i.name = n AND i.name <> ALL(made));
            -- What to do about it: the instances holding nothing (a delete frees a place), and
            -- what the parent would need for these guaranteed instances. Released permits not
            -- folded yet count as free (the delete waits for the fold).
            RETURN detail || jsonb_strip_nulls(jsonb_build_object(
                'template', template.name,
                'capacity', template.capacity,
                'max_instances', coalesce(template.max_instances, permitq.rule_max_instances()),
                'instances', had,
                -- Said when several: one is the usual case, and needs no word.
                'new_instances', CASE WHEN new_instances > 1 THEN new_instances END,
                'parent', template.parent,
                'guarantee', nullif(template.guarantee, 0),
                'idle_instances', (SELECT nullif(jsonb_agg(i.name ORDER BY i.name), '[]')
                                   FROM (SELECT i.name FROM permitq.semaphore i
                                         WHERE i.template = template.name
                                           AND i.name <> ALL(made)
                                           AND i.used <= coalesce((SELECT sum(p.count)
                                                                   FROM permitq.pending_release p
                                                                   WHERE p.semaphore = i.name), 0)
                                           AND NOT EXISTS (SELECT 1 FROM permitq.waiter w
                                                           WHERE w.semaphore_id = i.id)
                                         ORDER BY i.name LIMIT 3) i),
                'parent_needs', (SELECT n.needs
                                 FROM permitq.semaphore p
                                 CROSS JOIN LATERAL (SELECT permitq.promised_to_children(p.name)
                                                            - template.guarantee * made_here
                                                            + template.guarantee * greatest(new_instances, 1)
                                                            AS needs) n
                                 WHERE p.name = template.parent AND template.guarantee > 0
                                   AND n.needs > p.capacity)));
        END IF;
    END IF;
    RETURN detail;
END $$;

-- What to tell whoever submitted a request of `permits` that a worker will fail, said at once,
-- while it can be fixed: each name no semaphore or template has (unknown_name_answer); a
-- template named itself (never granted: unknown_semaphore); the first semaphore, or parent, or
-- template of an instance not made yet, whose capacity is below what the request takes there
-- (exceeds_capacity). Nothing when none holds. Said by `permitq submit`.
CREATE OR REPLACE FUNCTION permitq.answers_at_submit(permits jsonb) RETURNS SETOF text
LANGUAGE sql STABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT a FROM jsonb_object_keys(permits) n, permitq.unknown_name_answer(n) a
    WHERE a IS NOT NULL
    UNION ALL
    SELECT format('%s is a template, which is never granted itself: a worker fails the request '
                  'with unknown_semaphore; submit again naming an instance of it (%sNAME, made at '
                  'its first grant), under a new external_id', s.name, left(s.name, -1))
    FROM jsonb_object_keys(permits) n JOIN permitq.semaphore s ON s.name = n AND s.is_template
    UNION ALL
    (SELECT format('%s %s, less than the %s it %s there: a worker fails the request with '
                   'exceeds_capacity; %sraise the capacity first (`permitq semaphore set %s %s`), '
                   'before a worker examines it',
                   CASE WHEN t.via IS NULL THEN x.name
                        ELSE format('%s''s parent %s', t.via, x.name) END,
                   CASE WHEN x.per IS NULL THEN format('has capacity %s', x.capacity)
                        ELSE format('allows %s grants per %s', x.capacity,
                                    permitq.human_duration(x.per)) END,
                   t.count, CASE WHEN t.via IS NULL THEN 'asks' ELSE 'takes' END,
                   CASE WHEN x.capacity > 0
                        THEN format('ask for at most %s under a new external_id, or ', x.capacity)
                        ELSE '' END,
                   -- An instance's capacity is its template's: the one to raise.
                   permitq.shell_word(coalesce(x.template, x.name)),
                   t.count)
     FROM permitq.taken_by(permits) t
     CROSS JOIN LATERAL (
         SELECT coalesce(s.name, t.name) AS name, coalesce(s.capacity, tp.capacity) AS capacity,
                coalesce(s.per, tp.per) AS per, coalesce(s.template, tp.name) AS template
         FROM (SELECT 1) one
         LEFT JOIN permitq.semaphore s ON s.name = t.name AND NOT s.is_template
         LEFT JOIN LATERAL (SELECT * FROM permitq.template_for(t.name)) tp
                ON s.name IS NULL AND tp.name IS NOT NULL) x
     WHERE t.count > x.capacity
     ORDER BY t.depth, t.name
     LIMIT 1)
$$;
GRANT EXECUTE ON FUNCTION permitq.answers_at_submit(jsonb)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;
