-- Worker, after step 2: the heads, the waiting requests outside the caller's batch that fair
-- semaphores keep room for. The head of a fair semaphore is its waiting request first in line
-- (functions/queue_order.sql): a later request may take capacity there only if what remains
-- still covers the head's count. Read as its own statement after the locks are held, so that in
-- READ COMMITTED it sees everything the previous holders of those locks committed.
--
-- Waiting requests are of two kinds:
--   recorded: examined and left waiting (permitq.waiter). Per semaphore, the first in line
--             outside the batch (waiter_place_idx: the batch's own waiters are read past, at
--             most a batch of them, however many priority levels the line has);
--   unexamined: committed but not examined yet (another worker holds them right now, or they
--             were committed after the caller's claim, or the backlog is longer than a batch).
--             Until someone examines them they count as waiting, so a batch cannot slip past a
--             request it has not seen. Only those that can be ahead of the batch matter: per
--             semaphore, those placed ahead of the batch's last request there, or level with it
--             (`bounds`, the lowest rule_place_in_line of the batch's requests on each of
--             `names`; among equals the lower id is ahead, and the decision compares exactly). They are
--             read from permit_request_unexamined_place_idx, best placed first, at most
--             `scan_limit` of them for the whole batch: work per batch does not grow with the
--             backlog. Where the scan stopped short of a semaphore's bound, what lies beyond is
--             unknown, and the semaphore gets a stand-in head there (request 0, count
--             2147483647): nothing of the batch behind that place is granted on it now. It is
--             examined, joins the queue, and goes when the requests ahead of it have been
--             examined in turn. Unexamined rows are read defensively: one may hold anything.
CREATE OR REPLACE FUNCTION permitq.semaphore_heads(names text[], bounds bigint[], batch_ids bigint[])
RETURNS TABLE (semaphore text, request_id bigint, count integer, effective bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET enable_seqscan = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    scan_limit constant integer := 1000;
    floor_place bigint := (SELECT min(b) FROM unnest(bounds) b);
    nested boolean := EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.parent IS NOT NULL);
    -- A template with a parent: its instances not made yet have ancestors too.
    nested_templates boolean := EXISTS (SELECT 1 FROM permitq.semaphore s
                                        WHERE s.is_template AND s.parent IS NOT NULL);
BEGIN
    -- Nested limits (functions/nesting.sql): the ancestors have lines too (waiter rows of the
    -- requests below them), each bounded by the lowest bound below it. An unexamined request
    -- is in the line of every ancestor of what it names (for an instance not made yet, of its
    -- template's parent), with what it would take there: it may name a child the batch does
    -- not (a sibling of the batch's), and be ahead on the parent they share.
    IF nested THEN
        SELECT array_agg(c.ancestor), array_agg(c.bound) INTO names, bounds
        FROM (SELECT a.ancestor, min(b.bound) AS bound
              FROM unnest(names, bounds) AS b(name, bound)
              JOIN permitq.ancestors(names) a ON a.name = b.name
              GROUP BY a.ancestor) c;
    END IF;

    RETURN QUERY
    SELECT s.name, w.request_id, w.count, permitq.rule_place_in_line(w.priority, w.created_at)
    FROM unnest(names) AS n(name)
    JOIN permitq.semaphore s ON s.name = n.name AND s.fair AND NOT s.is_template
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count, wt.priority, wt.created_at FROM permitq.waiter wt
        WHERE wt.semaphore_id = s.id AND wt.request_id <> ALL(batch_ids)
        ORDER BY wt.semaphore_id, permitq.rule_place_in_line(wt.priority, wt.created_at) DESC,
                 wt.request_id -- waiter_place_idx: past at most the batch's own waiters
        LIMIT 1
    ) w;

    -- Nothing unexamined ahead of the batch but its own requests, and fewer of those than
    -- `scan_limit` (so no stand-in either): the query below returns nothing; its plan's start-up
    -- alone was most of a busy line's heads, batch after batch.
    IF cardinality(batch_ids) < scan_limit AND NOT EXISTS (
        SELECT 1 FROM permitq.permit_request r
        WHERE r.state = 'new' AND NOT r.examined
          AND permitq.rule_place_in_line(r.priority, r.created_at) >= floor_place
          AND r.id <> ALL(batch_ids)) THEN
        RETURN;
    END IF;

    RETURN QUERY
    WITH ahead AS (
        SELECT r.id, r.permits, permitq.rule_place_in_line(r.priority, r.created_at) AS place,
               row_number() OVER (ORDER BY permitq.rule_place_in_line(r.priority, r.created_at) DESC) AS n
        FROM permitq.permit_request r
        WHERE r.state = 'new' AND NOT r.examined
          AND permitq.rule_place_in_line(r.priority, r.created_at) >= floor_place
        ORDER BY permitq.rule_place_in_line(r.priority, r.created_at) DESC -- unexamined_place_idx
        LIMIT scan_limit
    ),
    stopped_short AS (
        SELECT a.place FROM ahead a WHERE a.n = scan_limit
    ),
    -- With nested limits only (`nested` gates these: a one-time filter), what each names, read
    -- defensively (a count that is not one counts as 1), and what that takes from each
    -- ancestor, summed over its children.
    named AS (
        SELECT a.id, a.place, e.key AS name,
               CASE WHEN jsonb_typeof(e.value) = 'number'
                         AND (e.value #>> '{}')::numeric BETWEEN 1 AND 2147483647
                    THEN (e.value #>> '{}')::numeric::int ELSE 1 END AS count
        FROM ahead a
        CROSS JOIN LATERAL jsonb_each(CASE WHEN jsonb_typeof(a.permits) = 'object'
                                           THEN a.permits ELSE '{}'::jsonb END) e
        WHERE nested AND a.id <> ALL(batch_ids)
    ),
    -- A template's instances not made yet (a worker makes them at the grant), each name once,
    -- with its template's parent: their chain is that parent's.
    unmade AS MATERIALIZED (
        SELECT u.name, t.parent
        FROM (SELECT DISTINCT y.name FROM named y WHERE nested_templates) u
        CROSS JOIN LATERAL (SELECT t.parent FROM permitq.template_for(u.name) t) t
        WHERE t.parent IS NOT NULL
          AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = u.name)
    ),
    lined AS MATERIALIZED (
        SELECT x.id, x.place, x.name, x.count FROM named x
        UNION ALL
        SELECT x.id, x.place, an.ancestor, x.count
        FROM named x
        -- (`WHERE nested`, a one-time filter: not called at all otherwise, as its argument,
        -- a subquery, keeps it from being inlined: parsed and planned at every call.)
        JOIN (SELECT * FROM permitq.ancestors(ARRAY(SELECT DISTINCT y.name FROM named y))
              WHERE nested) an
          ON an.name = x.name AND an.depth > 0
        UNION ALL
        SELECT x.id, x.place, an.ancestor, x.count
        FROM named x
        JOIN unmade um ON um.name = x.name
        JOIN (SELECT * FROM permitq.ancestors(ARRAY(SELECT DISTINCT p.parent FROM unmade p))
              WHERE nested_templates) an
          ON an.name = um.parent
    )
    -- On a semaphore served by fairness key (functions/fairness.sql), the head not examined yet
    -- keeps the room of every request not examined yet ahead of the batch that was read (at
    -- most `scan_limit`; the stand-in past them adds nothing): their keys' turns are not known
    -- until a worker examines them (a newcomer key is owed the next grant), so nothing is
    -- granted past them that would leave less.
    SELECT DISTINCT ON (b.name) b.name, h.id,
           CASE WHEN EXISTS (SELECT 1 FROM permitq.keyed_semaphore k WHERE k.semaphore_id = s.id)
                THEN least(sum(CASE WHEN h.id = 0 THEN 0 ELSE h.count END)
                               OVER (PARTITION BY b.name), 2147483647)::integer
                ELSE h.count END,
           h.place
    FROM unnest(names, bounds) AS b(name, bound)
    JOIN permitq.semaphore s ON s.name = b.name AND s.fair AND NOT s.is_template
    CROSS JOIN LATERAL (
        -- Without nesting: the requests that name it.
        SELECT a.id,
               CASE WHEN jsonb_typeof(a.permits -> b.name) = 'number'
                         AND (a.permits ->> b.name)::numeric BETWEEN 1 AND 2147483647
                    THEN (a.permits ->> b.name)::numeric::int ELSE 1 END AS count,
               a.place
        FROM ahead a
        WHERE NOT nested AND a.place >= b.bound AND a.id <> ALL(batch_ids)
          AND jsonb_typeof(a.permits) = 'object' AND a.permits ? b.name
        UNION ALL
        SELECT l.id, least(sum(l.count), 2147483647)::int, l.place
        FROM lined l
        WHERE l.place >= b.bound AND l.name = b.name
        GROUP BY l.id, l.place
        UNION ALL
        SELECT 0, 2147483647, c.place FROM stopped_short c WHERE c.place >= b.bound
    ) h
    ORDER BY b.name, h.place DESC, h.id;
END $$;
GRANT EXECUTE ON FUNCTION permitq.semaphore_heads(text[], bigint[], bigint[]) TO permitq_worker;
