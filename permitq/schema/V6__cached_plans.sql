-- V6: cached plans on the hot path.
--
-- Profiled with `perf` during `permitq bench --only cycle` (16 clients, fsync on): 54% of the
-- box's CPU was in PostgreSQL backends and ~40% of that was planning (GetCachedPlan →
-- pg_plan_query) and parsing SQL-language function bodies (fmgr_sql → raw_parser), because the
-- functions on every request's path ran with `plan_cache_mode = force_custom_plan` (re-plan every
-- statement on every call) and two were SECURITY DEFINER `LANGUAGE sql` functions (never inlined,
-- so parsed and planned on every call). The box has two cores, so CPU is what bounds the cycle.
--
-- Every statement in these functions is a lookup by primary key, unique key or a partial index
-- on a constant (`state = 'new'`), with arrays of ids as parameters: their generic plans are the
-- custom ones, so PostgreSQL's default (`auto`: custom for five calls, then generic when it is no
-- dearer) is right. The queue lookups keep `enable_seqscan = off` (V3), so a generic plan cannot
-- become a scan of a long queue either. The sweeps and retention keep force_custom_plan: they
-- run a few times a minute, with `now()`-relative ranges whose selectivity does matter.

ALTER FUNCTION permitq.submit(text, jsonb, text, interval, interval) RESET plan_cache_mode;
ALTER FUNCTION permitq.before_request_insert() RESET plan_cache_mode;
ALTER FUNCTION permitq.heartbeat(text, interval) RESET plan_cache_mode;
ALTER FUNCTION permitq.fence(text, bigint) RESET plan_cache_mode;
ALTER FUNCTION permitq.claim_batch(bigint, bigint) RESET plan_cache_mode;
ALTER FUNCTION permitq.lock_and_fold(text[]) RESET plan_cache_mode;
ALTER FUNCTION permitq.fold_releases() RESET plan_cache_mode;
ALTER FUNCTION permitq.semaphore_heads(bigint[], bigint[], bigint) RESET plan_cache_mode;
ALTER FUNCTION permitq.apply_decision(text, bigint[], bigint[], text[], bigint[]) RESET plan_cache_mode;

-- status and the worker's heads lookup as PL/pgSQL, which keeps its plans per session.
CREATE OR REPLACE FUNCTION permitq.status(external_id text) RETURNS SETOF permitq.permit_request
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN QUERY SELECT * FROM permitq.permit_request r WHERE r.external_id = status.external_id;
END $$;

CREATE OR REPLACE FUNCTION permitq.semaphore_heads_named(names text[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer)
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY
    SELECT h.semaphore, h.request_id, h.count
    FROM permitq.semaphore_heads(
        ARRAY(SELECT s.id FROM permitq.semaphore s WHERE s.name = ANY(names) ORDER BY s.id),
        batch_ids, newest_id) h;
END $$;

-- CREATE OR REPLACE reset these (see V4): entry points run as their owner, path pinned. Their
-- grants stay.
ALTER FUNCTION permitq.status(text)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
ALTER FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
