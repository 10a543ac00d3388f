-- The place in line on a fair semaphore, and the queue's priority levels.
--
-- The head is the waiting request first in line: the highest *effective* priority, and among
-- equals the oldest (lowest id). The effective priority is the priority plus one per aging step
-- (rule_aging_step_us) waited. Comparing two requests a and b at any instant t,
--     p(a) + (t - created(a)) / step > p(b) + (t - created(b)) / step
--     <=>  created(a) - step * p(a) < created(b) - step * p(b)
-- so the order does not depend on t: rule_place_in_line is that static key (higher first, in
-- microseconds), waiting never reorders two requests, and a request of priority p is never
-- overtaken by one submitted more than (p' - p) steps after it: the starvation bound. With every
-- priority 0 the order is FIFO by arrival.

-- The place-in-line key, higher first: priority * step - created_at, in microseconds, is
-- permitq.rule_place_in_line (generated with the other rules from permitq/src/rules.rs, before the
-- migrations, which index the unexamined requests by it).

-- The priority levels present in semaphore $1's queue, highest first (a loose index scan of
-- waiter_line_idx: work per level, not per waiter).
CREATE OR REPLACE FUNCTION permitq.waiter_levels(bigint) RETURNS SETOF smallint
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE lv(priority) AS (
        (SELECT w.priority FROM permitq.waiter w WHERE w.semaphore_id = $1
         ORDER BY w.priority DESC LIMIT 1)
        UNION ALL
        SELECT (SELECT w.priority FROM permitq.waiter w
                WHERE w.semaphore_id = $1 AND w.priority < lv.priority
                ORDER BY w.priority DESC LIMIT 1)
        FROM lv WHERE lv.priority IS NOT NULL
    )
    SELECT lv.priority FROM lv WHERE lv.priority IS NOT NULL
$$;

-- The semaphores that have waiters, in id order (a loose index scan of waiter_line_idx: work
-- per semaphore that has waiters, not per semaphore).
CREATE OR REPLACE FUNCTION permitq.waited_semaphores() RETURNS SETOF bigint
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE waited(id) AS (
        (SELECT w.semaphore_id FROM permitq.waiter w ORDER BY w.semaphore_id LIMIT 1)
        UNION ALL
        SELECT (SELECT w.semaphore_id FROM permitq.waiter w
                WHERE w.semaphore_id > waited.id ORDER BY w.semaphore_id LIMIT 1)
        FROM waited WHERE waited.id IS NOT NULL
    )
    SELECT waited.id FROM waited WHERE waited.id IS NOT NULL
$$;
