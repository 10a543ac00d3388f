-- The one definition of a batch's semaphores: the keys of its requests' permits (of those
-- that are JSON objects: any other is `invalid` and names none), each with the lowest of
-- `places` (the batch's places in line, in the order of `permits`) among the requests naming it:
-- the heads' bound.
CREATE OR REPLACE FUNCTION permitq.batch_bounds(permits jsonb[], places bigint[])
RETURNS TABLE (name text, bound bigint)
LANGUAGE sql IMMUTABLE AS $$
    SELECT k, min(c.place)
    FROM unnest(permits, places) c(permits, place)
    CROSS JOIN LATERAL jsonb_object_keys(
        CASE WHEN jsonb_typeof(c.permits) = 'object' THEN c.permits ELSE '{}' END) k
    GROUP BY k
$$;

-- Worker step 2 for a claimed batch: lock its semaphores and fold their releases
-- (permitq.lock_batch_semaphores, lock order step 2), then read their heads
-- (permitq.semaphore_heads). Two statements, in this order, so that in READ COMMITTED the heads
-- are read with a snapshot taken once the semaphore locks are held (a single statement would
-- read them as of before the lock waits). The batch's semaphores and bounds are
-- permitq.batch_bounds'. `permits`, `places` and `ids` are the claimed requests', in one
-- order. Rows of kind 's': a locked semaphore (semaphore_id .. active, as
-- lock_batch_semaphores); 'h': a head (name, head_request_id, head_count, effective, as
-- semaphore_heads).
--
-- Keyed semaphores (functions/fairness.sql): with `place_keys`, the batch's unexamined requests
-- are placed by key under the locks just taken, and the heads read up to the places they got.
-- Without it, nothing is placed and a row of kind 'k' (semaphore_id, name, and in `active`
-- whether placing would move one of the batch's requests back there:
-- permitq.batch_moves_back_by_key) says each keyed semaphore of the batch: the worker decides on
-- arrival order first, and places the batch (permitq.place_batch_by_keys) only when placing
-- would move a request or that order mattered (see there). Called by
-- permitq.next_batch, and by the worker directly when it claimed stepwise (isolating a failed
-- batch).
CREATE OR REPLACE FUNCTION permitq.lock_batch_and_heads(
    permits jsonb[], places bigint[], ids bigint[], place_keys boolean)
RETURNS TABLE (kind "char", semaphore_id bigint, name text, capacity integer, used bigint,
               fair boolean, parent text, guarantee integer, active boolean,
               head_request_id bigint, head_count integer, effective bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    names text[];
    bounds bigint[];
BEGIN
    -- For permitq.next_batch's `ranked` (in the order of `ids`): this batch's places alone.
    PERFORM set_config('permitq.ranked_places', '', true);
    SELECT array_agg(b.name ORDER BY b.name), array_agg(b.bound ORDER BY b.name)
    INTO names, bounds
    FROM permitq.batch_bounds(lock_batch_and_heads.permits, lock_batch_and_heads.places) b;
    IF names IS NULL THEN
        RETURN;
    END IF;

    RETURN QUERY
    SELECT 's'::"char", l.id, l.name, l.capacity, l.used, l.fair, l.parent, l.guarantee,
           l.active, NULL::bigint, NULL::integer, NULL::bigint
    FROM permitq.lock_batch_semaphores(names) l;

    -- Keyed semaphores place the batch's unexamined requests, under the locks just taken
    -- (functions/fairness.sql): the heads' bounds are the places they got. Only where one of
    -- the batch's semaphores is keyed: a batch beside keyed semaphores reads no tags.
    IF NOT place_keys THEN
        RETURN QUERY
        SELECT 'k'::"char", m.semaphore_id, m.name, NULL::integer, NULL::bigint, NULL::boolean,
               NULL::text, NULL::integer, m.moves_back, NULL::bigint, NULL::integer,
               NULL::bigint
        FROM permitq.batch_moves_back_by_key(lock_batch_and_heads.ids, names) m;
    ELSIF EXISTS (SELECT 1 FROM permitq.keyed_semaphore k
                  JOIN permitq.semaphore s ON s.id = k.semaphore_id
                  WHERE s.name = ANY(names)) THEN
        places := permitq.place_by_keys(lock_batch_and_heads.ids, places);
        SELECT array_agg(b.bound ORDER BY b.name) INTO bounds
        FROM permitq.batch_bounds(lock_batch_and_heads.permits, places) b;
        PERFORM set_config('permitq.ranked_places', places::text, true);
    END IF;

    RETURN QUERY
    SELECT 'h'::"char", NULL::bigint, h.semaphore, NULL::integer, NULL::bigint, NULL::boolean,
           NULL::text, NULL::integer, NULL::boolean, h.request_id, h.count, h.effective
    FROM permitq.semaphore_heads(names, bounds, lock_batch_and_heads.ids) h;
END $$;
GRANT EXECUTE ON FUNCTION permitq.lock_batch_and_heads(jsonb[], bigint[], bigint[], boolean)
    TO permitq_worker;

-- Workers of the release before call it without `place_keys`: they always place by key.
CREATE OR REPLACE FUNCTION permitq.lock_batch_and_heads(permits jsonb[], places bigint[],
                                                        ids bigint[])
RETURNS TABLE (kind "char", semaphore_id bigint, name text, capacity integer, used bigint,
               fair boolean, parent text, guarantee integer, active boolean,
               head_request_id bigint, head_count integer, effective bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM permitq.lock_batch_and_heads($1, $2, $3, true)
$$;
GRANT EXECUTE ON FUNCTION permitq.lock_batch_and_heads(jsonb[], bigint[], bigint[])
    TO permitq_worker;

-- Worker step 2b, after a decision on arrival order (permitq.lock_batch_and_heads without
-- `place_keys`) that needed the order: place the batch's unexamined requests by key
-- (permitq.place_by_keys, under the semaphore locks the batch holds), then read the heads again
-- up to the places they got. Rows of kind 'r': a request (id) and the place the decision ranks
-- it by (`effective`); 'h': a head, as lock_batch_and_heads returns them, except on the
-- semaphores named in `full` (those the locks found with no room: nothing is granted there
-- whatever waits ahead, and past places moved back the heads' read is the batch's dearest
-- statement, up to a thousand requests not examined yet). The decision is taken again on these.
-- When placing would move no request, and the decision on arrival order granted the whole
-- batch with nothing waiting, the worker does not call this, and no tag moves (fair queuing
-- orders a line; there was none: functions/fairness.sql).
CREATE OR REPLACE FUNCTION permitq.place_batch_by_keys(permits jsonb[], places bigint[],
                                                       ids bigint[], full text[])
RETURNS TABLE (kind "char", id bigint, name text, head_request_id bigint, head_count integer,
               effective bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    names text[];
    bounds bigint[];
BEGIN
    places := permitq.place_by_keys(place_batch_by_keys.ids, places);
    SELECT array_agg(b.name ORDER BY b.name), array_agg(b.bound ORDER BY b.name)
    INTO names, bounds
    FROM permitq.batch_bounds(place_batch_by_keys.permits, places) b
    WHERE b.name <> ALL(place_batch_by_keys.full);
    RETURN QUERY
    SELECT 'r'::"char", c.id, NULL::text, NULL::bigint, NULL::integer, c.place
    FROM unnest(place_batch_by_keys.ids, places) AS c(id, place);
    IF names IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT 'h'::"char", NULL::bigint, h.semaphore, h.request_id, h.count, h.effective
    FROM permitq.semaphore_heads(names, bounds, place_batch_by_keys.ids) h;
END $$;
GRANT EXECUTE ON FUNCTION permitq.place_batch_by_keys(jsonb[], bigint[], bigint[], text[])
    TO permitq_worker;

-- Worker steps 1 and 2 in one call, one round trip: claim a batch (permitq.claim_batch, lock
-- order step 1), then lock its semaphores, fold their releases and read their heads
-- (permitq.lock_batch_and_heads, lock order step 2). The results come back as one set of rows,
-- told apart by `kind`:
--   'r': a claimed request (id .. effective, as claim_batch returns them), and `ranked`, the
--        place the decision ranks it by (its `effective` unless a keyed semaphore placed it:
--        functions/fairness.sql);
--   's', 'h', 'k': a locked semaphore, a head and a keyed semaphore, as lock_batch_and_heads
--        returns them (`place_keys` is its).
-- No rows: nothing could be claimed; nothing was locked.
CREATE OR REPLACE FUNCTION permitq.next_batch(cursor bigint, batch_size bigint,
                                              place_keys boolean)
RETURNS TABLE (kind "char", id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text,
               effective bigint, semaphore_id bigint, name text, capacity integer, used bigint,
               fair boolean, parent text, guarantee integer, active boolean,
               head_request_id bigint, head_count integer, ranked bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    ids bigint[];
    permits_of jsonb[];
    fail_fast_of boolean[];
    deadline_passed_of boolean[];
    examined_of boolean[];
    ages float8[];
    problems text[];
    external_ids text[];
    places bigint[];
    ranked_places bigint[];
BEGIN
    SELECT array_agg(c.id), array_agg(c.permits), array_agg(c.fail_fast),
           array_agg(c.deadline_passed), array_agg(c.examined), array_agg(c.age_seconds),
           array_agg(c.problem), array_agg(c.external_id), array_agg(c.effective)
    INTO ids, permits_of, fail_fast_of, deadline_passed_of, examined_of, ages, problems,
         external_ids, places
    FROM permitq.claim_batch(next_batch.cursor, next_batch.batch_size) c;
    IF ids IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY
    SELECT l.kind, NULL::bigint, NULL::jsonb, NULL::boolean, NULL::boolean, NULL::boolean,
           NULL::float8, NULL::text, NULL::text, l.effective,
           l.semaphore_id, l.name, l.capacity, l.used, l.fair, l.parent, l.guarantee, l.active,
           l.head_request_id, l.head_count, NULL::bigint
    FROM permitq.lock_batch_and_heads(permits_of, places, ids, next_batch.place_keys) l;

    -- `effective` is the place the claim read (an unexamined request's arrival: the caller's
    -- cursor); `ranked` the place the decision ranks it by, once a keyed semaphore placed it:
    -- as permitq.place_by_keys returned them to the heads, kept by lock_batch_and_heads
    -- (empty when none of the batch's semaphores is keyed).
    ranked_places := coalesce(nullif(current_setting('permitq.ranked_places', true), '')::bigint[],
                              places);
    RETURN QUERY
    SELECT 'r'::"char", c.id, c.permits, c.fail_fast, c.deadline_passed, c.examined, c.age,
           c.problem, c.external_id, c.place, NULL::bigint, NULL::text, NULL::integer,
           NULL::bigint, NULL::boolean, NULL::text, NULL::integer, NULL::boolean, NULL::bigint,
           NULL::integer, c.ranked
    FROM unnest(ids, permits_of, fail_fast_of, deadline_passed_of, examined_of, ages, problems,
                external_ids, places, ranked_places)
         AS c(id, permits, fail_fast, deadline_passed, examined, age, problem, external_id, place,
              ranked);
END $$;
GRANT EXECUTE ON FUNCTION permitq.next_batch(bigint, bigint, boolean) TO permitq_worker;

-- Workers of the release before call it without `place_keys`: they always place by key.
CREATE OR REPLACE FUNCTION permitq.next_batch(cursor bigint, batch_size bigint)
RETURNS TABLE (kind "char", id bigint, permits jsonb, fail_fast boolean, deadline_passed boolean,
               examined boolean, age_seconds float8, problem text, external_id text,
               effective bigint, semaphore_id bigint, name text, capacity integer, used bigint,
               fair boolean, parent text, guarantee integer, active boolean,
               head_request_id bigint, head_count integer, ranked bigint)
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM permitq.next_batch($1, $2, true)
$$;
GRANT EXECUTE ON FUNCTION permitq.next_batch(bigint, bigint) TO permitq_worker;
