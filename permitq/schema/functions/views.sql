-- What operators and producers read: granted permits, exact usage, holders and waiters. A
-- producer reads its own requests only, through every view as through the table (the views
-- run as their owner, so they filter by `submitted_by` themselves); operators, workers and
-- admins read them all (permitq.reads_every_request). The views that filter so are
-- security_barrier views: a caller's own condition (a function that raises, say) is applied only
-- to the rows the filter kept, so it cannot see the others'. Counts per semaphore
-- (semaphore_usage) are everyone's.
-- CREATE OR REPLACE VIEW may only add columns at the end; a change that does more drops the
-- view first, here.

-- One row per semaphore a granted request took from (held, or released since): those it names
-- and their ancestors (functions/nesting.sql).
CREATE OR REPLACE VIEW permitq.permit WITH (security_barrier = true) AS
SELECT r.id AS request_id,
       e.key AS semaphore,
       e.value::int AS count,
       CASE WHEN r.state = 'acquired' THEN 'acquired' ELSE 'released' END AS state,
       r.acquired_at,
       r.released_at
FROM permitq.permit_request r
CROSS JOIN LATERAL jsonb_each(coalesce(r.charged, r.permits)) e
WHERE r.acquired_at IS NOT NULL
  AND permitq.may_read(r.submitted_by);

-- Exact figures per semaphore: capacity, `used` (the workers' running count, which may run
-- ahead until releases are folded), held (the sum of acquired permits), how many requests wait
-- on it and since when the oldest waits, grants so far, and for a rate-limited semaphore its
-- window, the permits granted in it and when the window next has room, whether it is a
-- template or made from one, its parent and guarantee, and whether its capacity adapts. A parent's `held` counts what is
-- held below it, and its `waiting` the requests waiting below it once a worker has examined
-- them (until then they count where they name).
-- Cost: the waiters are counted from the narrow lines (permitq.waiter) and the requests no
-- worker has examined yet (permit_request_unexamined_idx), never from the waiting requests'
-- own rows and JSON; no call per semaphore, so many semaphores cost no more than before.
CREATE OR REPLACE VIEW permitq.semaphore_usage AS
SELECT s.name,
       s.capacity,
       s.used,
       coalesce(h.held, 0)::bigint AS held,
       w.waiting::integer AS waiting,
       w.oldest_wait_since,
       s.fair,
       s.granted,
       s.per,
       permitq.in_window(s) AS in_window,
       permitq.window_opens_at(s) AS window_opens_at,
       s.is_template,
       s.template,
       s.parent,
       s.guarantee,
       -- An adaptive semaphore's algorithm and bounds (functions/adaptive.sql); NULL: fixed.
       a.algorithm AS adaptive,
       a.floor AS adaptive_floor,
       a.ceiling AS adaptive_ceiling,
       -- Its line served by fairness key (functions/fairness.sql).
       EXISTS (SELECT 1 FROM permitq.keyed_semaphore k WHERE k.semaphore_id = s.id)
           AS fairness_keys
FROM permitq.semaphore s
LEFT JOIN permitq.adaptive_limit a ON a.semaphore_id = s.id
LEFT JOIN (SELECT e.key AS name, sum(e.value::int) AS held
           FROM permitq.permit_request r
           CROSS JOIN LATERAL jsonb_each(coalesce(r.charged, r.permits)) e
           WHERE r.state = 'acquired' GROUP BY e.key) h ON h.name = s.name
LEFT JOIN (SELECT e.key AS name, count(*) AS waiting, min(r.created_at) AS oldest_wait_since
           FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(r.permits) e
           WHERE r.state = 'new' AND NOT r.examined GROUP BY e.key) u ON u.name = s.name
LEFT JOIN (SELECT wt.semaphore_id, count(*) AS waiting,
                  min(wt.created_at - coalesce(wt.place_offset, interval '0')) AS oldest
           FROM permitq.waiter wt GROUP BY wt.semaphore_id) line ON line.semaphore_id = s.id
CROSS JOIN LATERAL (
    SELECT coalesce(u.waiting, 0) + coalesce(line.waiting, 0) AS waiting,
           least(u.oldest_wait_since, line.oldest) AS oldest_wait_since) w;

-- Who holds what (on a parent, what is held below it).
CREATE OR REPLACE VIEW permitq.holders WITH (security_barrier = true) AS
SELECT e.key AS semaphore, r.external_id, r.owner, e.value::int AS count, r.acquired_at,
       r.expires_at, r.fencing_token
FROM permitq.permit_request r CROSS JOIN LATERAL jsonb_each(coalesce(r.charged, r.permits)) e
WHERE r.state = 'acquired'
  AND permitq.may_read(r.submitted_by);

-- Who waits, in each semaphore's queue order as the workers rank it: position 1 is the head,
-- the request first in line by priority and aging (permitq.rule_place_in_line, the rule of
-- functions/queue_order.sql), then by id. On a fair semaphore only backfill that leaves the
-- head's room goes before it; a greedy one grants whatever fits.
-- A semaphore's line, as the workers and permitq.first_waiters see it: the requests a worker
-- examined there (permitq.waiter, on a parent also those waiting below it, with what they take
-- from it), and the requests no worker has examined yet that name it.
-- (Positions are counted among every waiter, then a producer's own are kept.) Cost: filtered by
-- semaphore, that semaphore's line (waiter_line_idx) and the unexamined requests; never the
-- rest of the backlog.
CREATE OR REPLACE VIEW permitq.waiters WITH (security_barrier = true) AS
SELECT w.semaphore, w.external_id, w.owner, w.count, w.position, w.waiting_since, w.deadline,
       w.priority, w.fairness_key
FROM (SELECT l.semaphore, r.external_id, r.owner, l.count, r.fairness_key,
             -- Where it waits (`placed`: a keyed semaphore may have placed it later than its
             -- arrival, functions/fairness.sql).
             row_number() OVER (PARTITION BY l.semaphore
                                ORDER BY permitq.rule_place_in_line(r.priority, l.placed) DESC,
                                         r.id)
                 AS position,
             r.created_at AS waiting_since, r.wait_until AS deadline, r.priority, r.submitted_by
      FROM (SELECT s.name AS semaphore, wt.request_id, wt.count, wt.created_at AS placed
            FROM permitq.waiter wt JOIN permitq.semaphore s ON s.id = wt.semaphore_id
            UNION ALL
            SELECT e.key, u.id, e.value::int, u.created_at
            FROM permitq.permit_request u CROSS JOIN LATERAL jsonb_each(u.permits) e
            WHERE u.state = 'new' AND NOT u.examined) l
      JOIN permitq.permit_request r ON r.id = l.request_id AND r.state = 'new') w
WHERE permitq.may_read(w.submitted_by);

-- The first `n` (at most 1000) waiters of semaphore `name` in line order, as `waiters` ranks
-- them, with their positions; on a parent, those waiting below it once a worker has examined
-- them (its line). A producer sees its own (positions counted among all). What `semaphore show`,
-- `top` and the HTTP API list. Cost: per priority level of its line the first `n` (a loose
-- index scan of waiter_line_idx), and among the requests no worker has examined yet the best
-- placed 10000 naming it (permit_request_unexamined_place_idx, read until they are found: the
-- workers keep that backlog short): never the examined backlog.
CREATE OR REPLACE FUNCTION permitq.first_waiters(name text, n integer)
RETURNS TABLE (semaphore text, external_id text, owner text, count integer, "position" bigint,
               waiting_since timestamptz, deadline timestamptz, priority smallint,
               fairness_key text)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET enable_seqscan = off AS $$
    WITH s AS (SELECT s.id, s.name FROM permitq.semaphore s WHERE s.name = first_waiters.name),
    line AS (
        SELECT w.request_id, w.count, w.created_at AS placed FROM s
        CROSS JOIN LATERAL permitq.waiter_levels(s.id) lv(priority)
        CROSS JOIN LATERAL (
            SELECT wt.request_id, wt.count, wt.created_at FROM permitq.waiter wt
            WHERE wt.semaphore_id = s.id AND wt.priority = lv.priority
            ORDER BY wt.semaphore_id, wt.priority DESC, wt.created_at, wt.request_id
            LIMIT least(first_waiters.n, 1000)) w
        UNION ALL
        -- Those naming it, filtered before the limit (a backlog elsewhere leaves none out).
        SELECT u.id, (u.permits ->> first_waiters.name)::int, u.created_at
        FROM (SELECT r.id, r.permits, r.created_at FROM permitq.permit_request r
              WHERE r.state = 'new' AND NOT r.examined AND r.permits ? first_waiters.name
              ORDER BY permitq.rule_place_in_line(r.priority, r.created_at) DESC
              LIMIT 10000) u
    ),
    ranked AS (
        SELECT r.external_id, r.owner, line.count, r.created_at, r.wait_until, r.priority,
               r.fairness_key, r.submitted_by,
               row_number() OVER (ORDER BY permitq.rule_place_in_line(r.priority, line.placed)
                                           DESC, r.id) AS position
        FROM line
        CROSS JOIN LATERAL (SELECT * FROM permitq.permit_request pr
                            WHERE pr.id = line.request_id AND pr.state = 'new' LIMIT 1) r
        ORDER BY position
        LIMIT least(first_waiters.n, 1000)
    )
    SELECT first_waiters.name, ranked.external_id, ranked.owner, ranked.count, ranked.position,
           ranked.created_at, ranked.wait_until, ranked.priority, ranked.fairness_key
    FROM ranked
    WHERE permitq.may_read(ranked.submitted_by)
    ORDER BY ranked.position
$$;
GRANT EXECUTE ON FUNCTION permitq.first_waiters(text, integer)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

GRANT SELECT ON permitq.permit, permitq.semaphore_usage, permitq.holders, permitq.waiters
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;
