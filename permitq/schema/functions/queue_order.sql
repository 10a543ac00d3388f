-- The place in line on a fair semaphore, and the queue's priority levels.
--
-- The head is the waiting request first in line: the highest *effective* priority, and among
-- equals the oldest (lowest id). The effective priority is the priority plus one per aging step
-- (rule_aging_step_us) waited. Comparing two requests a and b at any instant t,
--     p(a) + (t - created(a)) / step > p(b) + (t - created(b)) / step
--     <=>  created(a) - step * p(a) < created(b) - step * p(b)
-- so the order does not depend on t: effective_priority is that static key (higher first, in
-- microseconds), waiting never reorders two requests, and a request of priority p is never
-- overtaken by one submitted more than (p' - p) steps after it: the starvation bound. With every
-- priority 0 the order is FIFO by arrival.

-- The place-in-line key, higher first: priority * step - created_at, in microseconds.
CREATE OR REPLACE FUNCTION permitq.effective_priority(priority smallint, created_at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE AS $$
    SELECT $1::bigint * permitq.rule_aging_step_us() - (extract(epoch FROM $2) * 1000000)::bigint
$$;

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
