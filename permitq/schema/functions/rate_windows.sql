-- Rate-limited semaphores: `set_capacity('api', 100, per => '1 minute')` grants at most 100
-- permits in any window of one minute (sliding), whatever the holders do: a grant counts from its
-- `acquired_at` for `per`, released early or held longer. The worker's view of such a semaphore
-- has `used` = the permits granted in the window ending now (functions/batch_semaphores.sql), so
-- the pure decision, fairness, all-or-nothing and `wait` apply unchanged. `used` itself keeps
-- counting held permits.
--
-- Grants are counted in buckets (permitq.rate_bucket, written by functions/decision_outcome.sql):
-- a grant at t adds its permits to its semaphore's bucket that ends at the first multiple of
-- per / 64 at or after t, and a bucket counts while `ends_at > now() - per`. So a grant counts
-- for at least `per`, never shorter (no window of length `per` ever holds more than the
-- capacity), and at most per + per / 64; and a window is at most 65 rows however many grants it
-- holds: the cost of a decision does not grow with them. The window is measured on the database
-- clock from the worker's transaction start, before any of its grants.

-- The end of the bucket of a grant at `granted_at` on a semaphore with window `per`.
CREATE OR REPLACE FUNCTION permitq.rate_bucket_end(granted_at timestamptz, per interval)
RETURNS timestamptz
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    at_us bigint := (extract(epoch FROM granted_at - timestamptz '1970-01-01 00:00:00+00') * 1000000)::bigint;
    width_us bigint := greatest(1, (extract(epoch FROM per) * 1000000)::bigint / 64);
BEGIN
    RETURN timestamptz '1970-01-01 00:00:00+00'
        + ((at_us + width_us - 1) / width_us * width_us) * interval '1 microsecond';
END $$;

-- Permits granted on `s` in the window ending at the caller's transaction start (0 for a
-- concurrency semaphore).
CREATE OR REPLACE FUNCTION permitq.in_window(s permitq.semaphore) RETURNS bigint
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF s.per IS NULL THEN
        RETURN 0;
    END IF;
    RETURN (SELECT coalesce(sum(b.count), 0) FROM permitq.rate_bucket b
            WHERE b.semaphore_id = s.id AND b.ends_at > now() - s.per);
END $$;
-- The semaphore_usage view calls it as its reader.
GRANT EXECUTE ON FUNCTION permitq.in_window(permitq.semaphore)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- The room a semaphore has: capacity - used + its releases not folded yet (they are as good as
-- free: the next batch on it folds them first), or what a rate window leaves. Below 0 when a
-- capacity was lowered below what is held. What a claim looks for (functions/claim.sql), what
-- `explain` shows as free and what a timeout's detail records (never below 0 there).
CREATE OR REPLACE FUNCTION permitq.free_room(s permitq.semaphore) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN s.per IS NOT NULL THEN s.capacity - permitq.in_window(s)
                ELSE s.capacity - s.used
                     + coalesce((SELECT sum(p.count) FROM permitq.pending_release p
                                 WHERE p.semaphore = s.name), 0) END
$$;

-- When the window of `s` next has room for `needs` permits: NULL when it has that room now, is
-- no rate limit, or never will (`needs` above its capacity); else when enough of its oldest
-- buckets have left the window that at most `capacity - needs` permits remain in it (after a
-- capacity was lowered, or for a count above one, that may take several).
CREATE OR REPLACE FUNCTION permitq.window_room_at(s permitq.semaphore, needs bigint)
RETURNS timestamptz
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF s.per IS NULL THEN
        RETURN NULL;
    END IF;
    -- One pass over the window's buckets, oldest first: `granted` is what the window holds
    -- (in_window's figure), `gone` what has left it once each bucket has.
    RETURN (SELECT min(leaving.ends_at) + s.per
            FROM (SELECT b.ends_at,
                         sum(b.count) OVER () AS granted,
                         sum(b.count) OVER (ORDER BY b.ends_at) AS gone
                  FROM permitq.rate_bucket b
                  WHERE b.semaphore_id = s.id AND b.ends_at > now() - s.per) leaving
            WHERE leaving.granted > s.capacity - needs
              AND leaving.granted - leaving.gone <= s.capacity - needs);
END $$;
GRANT EXECUTE ON FUNCTION permitq.window_room_at(permitq.semaphore, bigint)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- When the window of `s` next has room for one permit (see permitq.window_room_at).
CREATE OR REPLACE FUNCTION permitq.window_opens_at(s permitq.semaphore) RETURNS timestamptz
LANGUAGE sql STABLE AS $$
    SELECT permitq.window_room_at(s, 1)
$$;
-- The semaphore_usage view calls it as its reader.
GRANT EXECUTE ON FUNCTION permitq.window_opens_at(permitq.semaphore)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- When the next window of a rate-limited semaphore that has waiters opens (a worker going to
-- sleep wakes then, not a poll interval later). NULL: none.
CREATE OR REPLACE FUNCTION permitq.next_window_opening() RETURNS timestamptz
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
    SELECT min(b.ends_at + s.per)
    FROM permitq.waited_semaphores() AS waited(id)
    JOIN permitq.semaphore s ON s.id = waited.id
    JOIN permitq.rate_bucket b ON b.semaphore_id = s.id
    WHERE s.per IS NOT NULL AND b.ends_at > now() - s.per
$$;
GRANT EXECUTE ON FUNCTION permitq.next_window_opening() TO permitq_worker;
