-- Rate-limited semaphores: `set_capacity('api', 100, per => '1 minute')` grants at most 100
-- permits in any window of one minute (sliding), whatever the holders do: a grant counts from its
-- `acquired_at` for `per`, released early or held longer. Each grant on such a semaphore is
-- logged in permitq.rate_grant (functions/apply_decision.sql), and the worker's view of the
-- semaphore has `used` = the permits granted in the window ending now
-- (functions/batch_semaphores.sql), so the pure decision, fairness, all-or-nothing and `wait`
-- apply unchanged.
--
-- The window is measured on the database clock from the worker's transaction start, before any
-- of its grants: a grant may count a moment longer than needed, never shorter, so no window of
-- length `per` ever holds more than the capacity. `used` itself keeps counting held permits.

-- Permits granted on `s` in the window ending at the caller's transaction start (0 for a
-- concurrency semaphore).
CREATE OR REPLACE FUNCTION permitq.in_window(s permitq.semaphore) RETURNS integer
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN s.per IS NULL THEN 0 ELSE
        (SELECT coalesce(sum(g.count), 0)::integer FROM permitq.rate_grant g
         WHERE g.semaphore_id = s.id AND g.granted_at > now() - s.per) END
$$;

-- When the next window of a rate-limited semaphore that has waiters opens (a worker going to
-- sleep wakes then, not a poll interval later). NULL: none.
CREATE OR REPLACE FUNCTION permitq.next_window_opening() RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
    SELECT min(g.granted_at + s.per)
    FROM permitq.semaphore s
    JOIN permitq.rate_grant g ON g.semaphore_id = s.id
    WHERE s.per IS NOT NULL AND g.granted_at > now() - s.per
      AND EXISTS (SELECT 1 FROM permitq.waiter w WHERE w.semaphore_id = s.id)
$$;
GRANT EXECUTE ON FUNCTION permitq.next_window_opening() TO permitq_worker;
