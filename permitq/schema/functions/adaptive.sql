-- Adaptive capacity: a semaphore whose capacity the workers set from what its holders report.
--
-- A holder reports how its use of the resource went when it releases (`permitq.release(id,
-- outcome, latency)`): `ok`, `overloaded` (a 429, a timeout, a pool exhausted) or `failed`, with
-- an optional latency; one report row per adaptive semaphore the request held (ancestors
-- included). On a fixed cadence one worker takes a semaphore's turn (`adaptive_turn`: the
-- nesting gate, NOWAIT, then the adaptive row, SKIP LOCKED), deletes the reports it reads,
-- runs the algorithm (a pure function in Rust, permitq/src/adaptive.rs) and applies the new
-- capacity (`adaptive_apply`) in the same transaction: a worker that dies mid-cadence loses no
-- report (the delete rolls back), two workers never apply the same report, and a report
-- committed after the read is applied by the next cadence. Lowering revokes nothing, as a
-- `set_capacity` does not. Every change is audited with `changed_by` 'adaptive (ALGORITHM)' and
-- its inputs.
--
-- Lock order: the nesting gate (tree changes one at a time, as set_capacity; a capacity an
-- adaptive cadence lowers must still cover its children's guarantees), then the adaptive rows
-- in semaphore id order, then the semaphore row (as a worker's batch takes it).

-- The audit of an adaptive setting (made adaptive, its bounds, or fixed again): `inputs`
-- {"adaptive": SETTING} on a row of permitq.capacity_change (permitq.audit_setting).
CREATE OR REPLACE FUNCTION permitq.audit_adaptive(s permitq.semaphore, setting jsonb)
RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    SELECT permitq.audit_setting(s, jsonb_build_object('adaptive', setting))
$$;

-- permitq.set_adaptive: makes `name` adaptive between `floor` and `ceiling` by `algorithm`
-- ('aimd' or 'gradient'), or (algorithm NULL) fixed again at its current capacity. Admins only.
-- The capacity is brought within the bounds at once. Not for templates, instances or rate
-- limits. Returns the adaptive row (none when made fixed).
CREATE OR REPLACE FUNCTION permitq.set_adaptive(name text, algorithm text, floor integer DEFAULT NULL,
                                                ceiling integer DEFAULT NULL)
RETURNS SETOF permitq.adaptive_limit
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_variable
DECLARE
    s permitq.semaphore;
    children_guaranteed bigint;
BEGIN
    LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE;
    SELECT * INTO s FROM permitq.semaphore x WHERE x.name = set_adaptive.name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'no semaphore named %: create it first (`permitq semaphore set % CAPACITY`), then make it adaptive',
            name, permitq.shell_word(name) USING ERRCODE = '22023';
    END IF;
    IF algorithm IS NULL THEN
        DELETE FROM permitq.adaptive_limit a WHERE a.semaphore_id = s.id;
        IF FOUND THEN
            PERFORM permitq.audit_adaptive(s, 'false'::jsonb);
        END IF;
        DELETE FROM permitq.outcome_report r WHERE r.semaphore_id = s.id;
        RETURN;
    END IF;
    IF algorithm NOT IN ('aimd', 'gradient') THEN
        RAISE EXCEPTION 'invalid adaptive algorithm: %: use aimd (from overloaded and failed reports) or gradient (from latency as well)',
            algorithm USING ERRCODE = '22023';
    END IF;
    IF s.is_template OR s.template IS NOT NULL THEN
        RAISE EXCEPTION 'invalid adaptive semaphore %: % cannot adapt (its instances share one capacity, set by the template); use a plain semaphore',
            name, CASE WHEN s.is_template THEN 'a template' ELSE 'an instance of ' || s.template END
            USING ERRCODE = '22023';
    END IF;
    IF s.per IS NOT NULL THEN
        RAISE EXCEPTION 'invalid adaptive semaphore %: it is a rate limit (% per %), and a rate limit cannot be adaptive (an adaptive capacity bounds what is held, not grants per window): choose one; to keep it adaptive, drop the window (`--per 0`, or leave `--per` out when you create it)',
            name, s.capacity, permitq.human_duration(s.per) USING ERRCODE = '22023';
    END IF;
    IF floor IS NULL OR ceiling IS NULL OR floor < 1 OR ceiling < floor THEN
        RAISE EXCEPTION 'invalid adaptive bounds for %: floor % and ceiling %: need 1 <= floor <= ceiling',
            name, coalesce(floor::text, 'missing'), coalesce(ceiling::text, 'missing')
            USING ERRCODE = '22023';
    END IF;
    -- Never below what its children are promised (a template's guarantee once per instance it
    -- may make) nor its own guarantee in its parent: the nesting rules set_capacity keeps.
    children_guaranteed := greatest(permitq.promised_to_children(s.name), s.guarantee);
    IF floor < children_guaranteed THEN
        RAISE EXCEPTION 'invalid adaptive bounds for %: floor % is below the % %: raise the floor to % at least',
            name, floor, children_guaranteed,
            CASE WHEN s.guarantee >= permitq.promised_to_children(s.name)
                 THEN 'it is guaranteed in its parent' ELSE 'its children are guaranteed' END,
            children_guaranteed USING ERRCODE = '22023';
    END IF;
    IF s.capacity NOT BETWEEN floor AND ceiling THEN
        UPDATE permitq.semaphore x SET capacity = least(greatest(s.capacity, floor), ceiling),
                                       updated_at = now()
        WHERE x.id = s.id;
        PERFORM permitq.notify('permitq_work', '');
    END IF;
    -- Reports made before it adapted are not this algorithm's.
    DELETE FROM permitq.outcome_report r WHERE r.semaphore_id = s.id;
    SELECT * INTO s FROM permitq.semaphore x WHERE x.id = s.id;
    PERFORM permitq.audit_adaptive(s, jsonb_build_object('algorithm', algorithm, 'floor', floor,
                                                         'ceiling', ceiling));
    RETURN QUERY
    INSERT INTO permitq.adaptive_limit AS a (semaphore_id, algorithm, floor, ceiling)
    VALUES (s.id, algorithm, floor, ceiling)
    ON CONFLICT (semaphore_id) DO UPDATE
        SET algorithm = EXCLUDED.algorithm, floor = EXCLUDED.floor, ceiling = EXCLUDED.ceiling,
            memory = CASE WHEN a.algorithm = EXCLUDED.algorithm THEN a.memory ELSE '{}' END
    RETURNING a.*;
END $$;
GRANT EXECUTE ON FUNCTION permitq.set_adaptive(text, text, integer, integer) TO permitq_admin;

-- What a report may say: NULL when it is valid, else what is wrong and what is accepted.
CREATE OR REPLACE FUNCTION permitq.report_problem(outcome text, latency interval) RETURNS text
LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN outcome IS NULL OR outcome NOT IN ('ok', 'overloaded', 'failed') THEN
            format('invalid outcome %s: ok, overloaded (a 429, a timeout, a pool exhausted) or failed',
                   coalesce(quote_literal(outcome), 'NULL'))
        WHEN latency < interval '0' OR latency > interval '1 day' THEN
            format('invalid latency %s: from 0 to 1 day', latency)
    END
$$;

-- Records request `request_id`'s report for each adaptive semaphore `permits` holds (a request's
-- `charged`: its ancestors included): one report per request and semaphore until a cadence
-- applies it, however often it reports. A later report replaces an earlier one unless it says
-- less: ok < failed < overloaded, so that an `overloaded` heartbeat followed by an `ok` release
-- in the same cadence still counts as overloaded (a decrease is never lost to a later report).
-- Nothing for a request on no adaptive semaphore.
CREATE OR REPLACE FUNCTION permitq.record_report(request_id bigint, permits jsonb, outcome text,
                                                 latency interval)
RETURNS void LANGUAGE sql SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO permitq.outcome_report AS o (semaphore_id, request_id, outcome, latency_ms)
    SELECT a.semaphore_id, request_id, outcome, extract(epoch FROM latency) * 1000
    FROM jsonb_object_keys(permits) k
    JOIN permitq.semaphore s ON s.name = k
    JOIN permitq.adaptive_limit a ON a.semaphore_id = s.id
    ON CONFLICT (request_id, semaphore_id) DO UPDATE
        SET (outcome, latency_ms) = (
                SELECT CASE WHEN later THEN EXCLUDED.outcome ELSE o.outcome END,
                       CASE WHEN later THEN EXCLUDED.latency_ms ELSE o.latency_ms END
                FROM (SELECT array_position(ARRAY['ok', 'failed', 'overloaded'], EXCLUDED.outcome)
                             >= array_position(ARRAY['ok', 'failed', 'overloaded'], o.outcome)
                             AS later) x),
            reported_at = EXCLUDED.reported_at
$$;

-- permitq.report: a holder's report while it still holds (beside a heartbeat): how its use went
-- so far, replacing its earlier one until a cadence applies it unless it says less (one report
-- per request and semaphore a cadence: permitq.record_report). Only its owner (or an admin).
-- Returns whether the report was kept: false, with a NOTICE saying why, when no request has
-- the id, when it is not held (waiting or ended), or when none of the semaphores it holds is
-- adaptive (as the CLI says it).
CREATE OR REPLACE FUNCTION permitq.report(external_id text, outcome text, latency interval DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_variable
DECLARE
    problem text := permitq.report_problem(outcome, latency);
    r permitq.permit_request;
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION '%', problem USING ERRCODE = '22023';
    END IF;
    SELECT * INTO r FROM permitq.permit_request x WHERE x.external_id = report.external_id;
    IF NOT FOUND THEN
        RAISE NOTICE 'no report kept: no request has the external_id %', report.external_id;
        RETURN false;
    END IF;
    PERFORM permitq.check_owner(r, 'report on it');
    IF r.state <> 'acquired' THEN
        RAISE NOTICE 'no report kept: request % is %, and only a held request reports (its holder reports on release instead: release(external_id, outcome, latency))',
            r.external_id, r.state;
        RETURN false;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM jsonb_object_keys(coalesce(r.charged, r.permits)) k
                   JOIN permitq.semaphore s ON s.name = k
                   JOIN permitq.adaptive_limit a ON a.semaphore_id = s.id) THEN
        RAISE NOTICE 'no report kept: none of the semaphores request % holds (%) is adaptive',
            r.external_id,
            (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(coalesce(r.charged, r.permits)) k);
        RETURN false;
    END IF;
    PERFORM permitq.record_report(r.id, coalesce(r.charged, r.permits), outcome, latency);
    RETURN true;
END $$;
GRANT EXECUTE ON FUNCTION permitq.report(text, text, interval) TO permitq_producer, permitq_admin;

-- A worker's cadence, step 1: the adaptive semaphores due (none applied for `cadence`), locked
-- for this transaction, with the reports since their last cadence, deleted here (at most 100000
-- each; more wait for the next cadence). Nothing when another session holds the nesting gate
-- (a tree change, or another worker's cadence): this worker moves on, and tries next cadence.
CREATE OR REPLACE FUNCTION permitq.adaptive_turn(cadence interval)
RETURNS TABLE (semaphore_id bigint, name text, algorithm text, floor integer, ceiling integer,
               capacity integer, used bigint, memory jsonb, ok bigint, overloaded bigint,
               failed bigint, latency_ms float8, latency_reports bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_column
BEGIN
    IF NOT EXISTS (SELECT 1 FROM permitq.adaptive_limit a WHERE a.applied_at <= now() - cadence) THEN
        RETURN;
    END IF;
    BEGIN
        LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE NOWAIT;
    EXCEPTION WHEN lock_not_available THEN
        RETURN;
    END;
    RETURN QUERY
    WITH due AS (
        SELECT a.semaphore_id, a.algorithm, a.floor, a.ceiling, a.memory
        FROM permitq.adaptive_limit a
        WHERE a.applied_at <= now() - cadence
        ORDER BY a.semaphore_id
        FOR UPDATE SKIP LOCKED
    ),
    taken AS (
        DELETE FROM permitq.outcome_report r
        WHERE r.id IN (SELECT x.id FROM due d
                       CROSS JOIN LATERAL (SELECT o.id FROM permitq.outcome_report o
                                           WHERE o.semaphore_id = d.semaphore_id
                                           ORDER BY o.id LIMIT 100000) x)
        RETURNING r.semaphore_id, r.outcome, r.latency_ms
    )
    SELECT d.semaphore_id, s.name, d.algorithm, d.floor, d.ceiling, s.capacity, s.used, d.memory,
           count(t.outcome) FILTER (WHERE t.outcome = 'ok'),
           count(t.outcome) FILTER (WHERE t.outcome = 'overloaded'),
           count(t.outcome) FILTER (WHERE t.outcome = 'failed'),
           -- The 90th percentile of the `ok` reports' latencies (a latency of 0 is no
           -- measurement): queueing shows in it as soon as some of the calls meet it, which
           -- the mean hid while the calls in flight lagged the capacity (the hand-off between a
           -- release and the next grant), letting the gradient climb past the knee.
           percentile_cont(0.9) WITHIN GROUP (ORDER BY t.latency_ms)
               FILTER (WHERE t.outcome = 'ok' AND t.latency_ms > 0)::float8,
           count(t.latency_ms) FILTER (WHERE t.outcome = 'ok' AND t.latency_ms > 0)
    FROM due d
    JOIN permitq.semaphore s ON s.id = d.semaphore_id
    LEFT JOIN taken t ON t.semaphore_id = d.semaphore_id
    GROUP BY d.semaphore_id, s.name, d.algorithm, d.floor, d.ceiling, s.capacity, s.used, d.memory
    ORDER BY d.semaphore_id;
END $$;
GRANT EXECUTE ON FUNCTION permitq.adaptive_turn(interval) TO permitq_worker;

-- A worker's cadence, step 2 (same transaction as step 1): the algorithm's capacity for
-- `semaphore_id`, kept within its floor, its ceiling and its children's guarantees; audited as
-- 'adaptive (ALGORITHM)' with `inputs` when it changes; the memory kept for the next cadence.
-- Returns the capacity set.
CREATE OR REPLACE FUNCTION permitq.adaptive_apply(semaphore_id bigint, capacity integer,
                                                  memory jsonb, inputs jsonb)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_variable
DECLARE
    a permitq.adaptive_limit;
    s permitq.semaphore;
    lowest bigint;
    wanted integer;
BEGIN
    -- The lock order of adaptive_turn (already held there: free), whoever calls it.
    LOCK TABLE permitq.nesting_gate IN EXCLUSIVE MODE;
    SELECT * INTO a FROM permitq.adaptive_limit x WHERE x.semaphore_id = adaptive_apply.semaphore_id
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT * INTO s FROM permitq.semaphore x WHERE x.id = a.semaphore_id FOR UPDATE;
    -- What its children are promised and its own guarantee, as set_adaptive refuses below.
    lowest := greatest(a.floor, permitq.promised_to_children(s.name), s.guarantee);
    wanted := least(greatest(capacity, lowest), greatest(a.ceiling, lowest));
    IF wanted <> s.capacity THEN
        UPDATE permitq.semaphore x SET capacity = wanted, updated_at = now() WHERE x.id = s.id;
        -- The audit row its trigger just wrote (this transaction holds the semaphore's row, so
        -- no other change of it comes between): who, and from what.
        UPDATE permitq.capacity_change c
        SET changed_by = 'adaptive (' || a.algorithm || ')', inputs = adaptive_apply.inputs
        WHERE c.id = (SELECT max(x.id) FROM permitq.capacity_change x WHERE x.semaphore = s.name);
        IF wanted > s.capacity THEN
            PERFORM permitq.notify('permitq_work', '');
        END IF;
    END IF;
    UPDATE permitq.adaptive_limit x
    SET applied_at = now(), memory = adaptive_apply.memory,
        last_reports = CASE
            WHEN coalesce((inputs ->> 'ok')::bigint, 0) + coalesce((inputs ->> 'overloaded')::bigint, 0)
                 + coalesce((inputs ->> 'failed')::bigint, 0) > 0
            THEN inputs || jsonb_build_object('at', now(), 'from', s.capacity, 'to', wanted)
            ELSE x.last_reports END
    WHERE x.semaphore_id = a.semaphore_id;
    RETURN wanted;
END $$;
GRANT EXECUTE ON FUNCTION permitq.adaptive_apply(bigint, integer, jsonb, jsonb) TO permitq_worker;
