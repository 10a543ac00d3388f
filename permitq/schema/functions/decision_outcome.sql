-- Worker step 3: write what the decision said, set-based, and send the outcomes.

-- A batch's outcome. Precondition: the caller's transaction holds the row locks of all these
-- requests (claimed FOR UPDATE SKIP LOCKED) and, in id order, the locks of every semaphore they
-- name (lock_batch_semaphores). Acts only on requests still `new`: one already decided is left
-- as it is (no second token, nothing counted twice). `charges`: for each request (by id) whose
-- semaphores have parents, what it takes, ancestors included (functions/nesting.sql); the others
-- take their `permits`. `error_details`: for each failed request (by id), what the decision saw
-- (the semaphore, the count, the bound), completed by permitq.completed_error_detail and stored
-- as its `error_detail`; a caller that sends none (a worker of the release before) stores the
-- codes alone. Returns false when the outcomes' events could not be sent (see
-- permitq.notify): the outcomes are written all the same.
CREATE OR REPLACE FUNCTION permitq.apply_decision(
    worker text,
    granted bigint[],
    errored bigint[],
    error_codes text[],
    waiting bigint[],
    charges jsonb,
    error_details jsonb DEFAULT '{}'
) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    -- The high bits of this batch's tokens (functions/fencing_tokens.sql).
    epoch bigint := CASE WHEN cardinality(granted) > 0 THEN permitq.token_epoch() ELSE 0 END;
    settled bigint[] := '{}';
    now_granted bigint[];
    over_capacity text;
    -- The rate-limited semaphores this batch's grants counted in.
    windowed bigint[];
    keyed boolean := EXISTS (SELECT 1 FROM permitq.keyed_semaphore);
BEGIN
    -- What a nested request takes covers at least what it names, in positive counts (the
    -- decision adds the ancestors): `used` never under-counts what a grant holds.
    IF charges <> '{}' AND EXISTS (
        SELECT 1 FROM jsonb_each(charges) c
        JOIN permitq.permit_request r ON r.id = c.key::bigint
        WHERE jsonb_typeof(c.value) <> 'object'
           OR EXISTS (SELECT 1 FROM jsonb_each(r.permits) e
                      WHERE coalesce((c.value ->> e.key)::numeric, 0) < (e.value::text)::numeric)
           OR EXISTS (SELECT 1 FROM jsonb_each(c.value) t
                      WHERE jsonb_typeof(t.value) <> 'number' OR (t.value::text)::numeric < 1)
    ) THEN
        RAISE EXCEPTION 'charges must cover each request''s permits in positive counts'
            USING ERRCODE = '22023';
    END IF;
    -- And a grant takes from every ancestor of what it names (whoever calls this: a parent left
    -- out of `charges` would not count it). Checked only where something is nested.
    IF cardinality(granted) > 0
       AND EXISTS (SELECT 1 FROM permitq.semaphore WHERE parent IS NOT NULL)
       AND EXISTS (
        SELECT 1 FROM permitq.permit_request r
        CROSS JOIN LATERAL permitq.ancestors(ARRAY(SELECT jsonb_object_keys(r.permits))) a
        WHERE r.id = ANY(granted) AND r.state = 'new' AND a.depth > 0
          AND NOT (coalesce(charges -> r.id::text, r.permits) ? a.ancestor)
    ) THEN
        RAISE EXCEPTION 'charges must take from every ancestor of the semaphores a grant names'
            USING ERRCODE = '22023';
    END IF;
    -- Failures first: their settled_at then precedes the batch's acquired_at, so a history
    -- checker never mistakes a request failed in this batch for one still waiting at the grants.
    -- decided_at is the transaction's start: every request committed before it was visible to
    -- the batch's reads of the heads.
    IF cardinality(errored) > 0 THEN
        WITH failed AS (
            UPDATE permitq.permit_request r
            SET state = 'error', error_code = e.code,
                -- A timeout's key keeps the turn it took, and so does a refused fail-fast
                -- try's (functions/fairness.sql): said in its detail.
                error_detail = CASE WHEN k.detail IS NULL
                                    THEN permitq.completed_error_detail(e.code, error_details -> e.id::text,
                                                                        r.permits)
                                    ELSE permitq.completed_error_detail(e.code, error_details -> e.id::text,
                                                                        r.permits)
                                         || k.detail END,
                settled_at = clock_timestamp(),
                worker_id = worker, examined_at = coalesce(r.examined_at, now()),
                decided_at = now()
            FROM unnest(errored, error_codes) AS e(id, code)
            LEFT JOIN (SELECT t.request_id, t.detail FROM permitq.turns_kept(errored) t
                       WHERE keyed) k ON k.request_id = e.id AND e.code IN ('timeout', 'no_capacity')
            WHERE r.id = e.id AND r.state = 'new'
            RETURNING r.id
        )
        SELECT coalesce(array_agg(id), '{}') INTO settled FROM failed;
    END IF;

    IF cardinality(granted) > 0 THEN
        -- Tokens and timestamps are drawn in the order of `granted`, the decision's (first in
        -- line first: priority, aging, then arrival), after the locks are held, so token order,
        -- acquired_at order and line order agree (volatile output columns are computed after
        -- the ORDER BY).
        WITH g AS (
            SELECT g.id, epoch | nextval('permitq.fencing_token_seq') AS token, clock_timestamp() AS at
            FROM unnest(granted) WITH ORDINALITY AS g(id, n)
            ORDER BY g.n
        ),
        done AS (
            UPDATE permitq.permit_request r
            SET state = 'acquired', fencing_token = g.token, acquired_at = g.at,
                expires_at = g.at + r.ttl, worker_id = worker,
                examined_at = coalesce(r.examined_at, now()), decided_at = now(),
                charged = charges -> r.id::text
            FROM g
            WHERE r.id = g.id AND r.state = 'new'
            RETURNING r.id, coalesce(r.charged, r.permits) AS permits, r.acquired_at
        ),
        counted AS (
            UPDATE permitq.semaphore s
            SET used = s.used + t.total, granted = s.granted + t.grants, updated_at = now()
            FROM (SELECT e.key AS semaphore, sum(e.value::int) AS total, count(*) AS grants
                  FROM done CROSS JOIN LATERAL jsonb_each(done.permits) e GROUP BY e.key) t
            WHERE s.name = t.semaphore
            RETURNING s.name, s.per IS NULL AND s.used > s.capacity AS over
        ),
        -- Grants on rate-limited semaphores count in their windows' buckets
        -- (functions/rate_windows.sql).
        windows AS (
            INSERT INTO permitq.rate_bucket AS b (semaphore_id, ends_at, count)
            SELECT s.id, permitq.rate_bucket_end(done.acquired_at, s.per), sum(e.value::int)
            FROM done
            CROSS JOIN LATERAL jsonb_each(done.permits) e
            JOIN permitq.semaphore s ON s.name = e.key
            WHERE s.per IS NOT NULL
            GROUP BY 1, 2
            ON CONFLICT (semaphore_id, ends_at) DO UPDATE SET count = b.count + EXCLUDED.count
            RETURNING b.semaphore_id
        )
        SELECT array_agg(id), (SELECT string_agg(c.name, ', ' ORDER BY c.name) FROM counted c WHERE c.over),
               (SELECT array_agg(DISTINCT w.semaphore_id) FROM windows w)
        INTO now_granted, over_capacity, windowed FROM done;
        -- Defence in depth, whoever calls this (a worker login's own SQL included): no grant
        -- puts a semaphore, at any level it takes from, over its capacity. A worker's decision
        -- never asks it (`used` is what its batch locked and folded, plus these grants), so
        -- this refuses the whole batch, not its requests.
        -- A rate limit's bound is its window: of the rate limits these grants counted in, any
        -- whose window is now over (the buckets written above, seen by this next statement).
        IF over_capacity IS NULL AND windowed IS NOT NULL THEN
            SELECT string_agg(s.name, ', ' ORDER BY s.name) INTO over_capacity
            FROM permitq.semaphore s
            WHERE s.id = ANY(windowed)
              AND permitq.in_window(s) > s.capacity;
        END IF;
        IF over_capacity IS NOT NULL THEN
            RAISE EXCEPTION 'refusing grants that would put % over capacity', over_capacity
                USING ERRCODE = '55000',
                      HINT = 'only a worker''s decision may grant: run `permitq worker`';
        END IF;
        settled := settled || coalesce(now_granted, '{}');
    END IF;

    IF cardinality(waiting) > 0 THEN
        -- Requests left waiting for the first time take their place in each semaphore's queue.
        -- Where it waits: its arrival, or later if a keyed semaphore placed it, with its start
        -- tag there (functions/fairness.sql).
        INSERT INTO permitq.waiter (semaphore_id, request_id, count, priority, created_at,
                                    place_offset, start_tag)
        SELECT s.id, r.id, e.value::int, r.priority,
               permitq.placed_at(r.created_at, o.place_offset), o.place_offset, t.start_tag
        FROM permitq.permit_request r
        CROSS JOIN LATERAL jsonb_each(coalesce(charges -> r.id::text, r.permits)) e
        JOIN permitq.semaphore s ON s.name = e.key
        -- (Read only where a semaphore is served by key: a one-time filter.)
        LEFT JOIN (SELECT DISTINCT b.request_id, b.place_offset FROM permitq.batch_tags() b
                   WHERE keyed) o ON o.request_id = r.id
        LEFT JOIN (SELECT b.request_id, b.semaphore_id, b.start_tag FROM permitq.batch_tags() b
                   WHERE keyed) t ON t.request_id = r.id AND t.semaphore_id = s.id
        WHERE r.id = ANY(waiting) AND NOT r.examined AND r.state = 'new'
        ON CONFLICT DO NOTHING;

        UPDATE permitq.permit_request r SET examined = true, examined_at = now()
        WHERE r.id = ANY(waiting) AND NOT r.examined AND r.state = 'new';
    END IF;

    -- Instances made for this batch that none of it uses (functions/templates.sql).
    IF cardinality(errored) > 0 THEN
        PERFORM permitq.drop_unused_instances_made();
    END IF;

    IF cardinality(settled) > 0 THEN
        -- Keyed semaphores: the virtual time moves to what was granted (functions/fairness.sql).
        IF keyed AND now_granted IS NOT NULL THEN
            PERFORM permitq.advance_virtual_time(now_granted);
        END IF;
        -- They wait no more.
        DELETE FROM permitq.waiter w WHERE w.request_id = ANY(settled);
        RETURN permitq.notify_events(settled);
    END IF;
    RETURN true;
END $$;
GRANT EXECUTE ON FUNCTION permitq.apply_decision(text, bigint[], bigint[], text[], bigint[], jsonb,
    jsonb) TO permitq_worker;

-- A request that failed a batch on its own: ends it as `error` / `invalid` (out-of-bound
-- intervals are cleared so that the row satisfies the constraints), drops its waiter rows, sends
-- its event. `problem`: why (the error the batch met), kept in `error_detail`. Takes only the
-- request's row lock. Returns its external_id (NULL if no longer new).
CREATE OR REPLACE FUNCTION permitq.settle_invalid(request_id bigint, problem text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    settled text;
BEGIN
    UPDATE permitq.permit_request r
    SET state = 'error', error_code = 'invalid', settled_at = clock_timestamp(),
        error_detail = jsonb_strip_nulls(jsonb_build_object('problem', left(problem, 1000))),
        examined_at = coalesce(r.examined_at, now()), decided_at = now(),
        ttl = CASE WHEN permitq.interval_problem(r.ttl, false) IS NULL THEN r.ttl END,
        wait = CASE WHEN permitq.interval_problem(r.wait, true) IS NULL THEN r.wait END
    WHERE r.id = request_id AND r.state = 'new'
    RETURNING r.external_id INTO settled;
    IF settled IS NOT NULL THEN
        DELETE FROM permitq.waiter w WHERE w.request_id = settle_invalid.request_id;
        PERFORM permitq.notify_events(ARRAY[request_id]);
    END IF;
    RETURN settled;
END $$;
GRANT EXECUTE ON FUNCTION permitq.settle_invalid(bigint, text) TO permitq_worker;
