-- The producer's entry: submit a request, read it back.

-- permitq.submit: validate, insert idempotently by external_id, wake a sleeping worker. The
-- insert trigger (functions/request_triggers.sql) checks ttl and wait and wakes the worker. The same external_id with the same parameters returns the existing
-- row unchanged; with different parameters it raises 23505. Never two rows: the unique key
-- decides. `priority` is an integer so that `priority => 10` needs no cast; stored as smallint.
CREATE OR REPLACE FUNCTION permitq.submit(
    external_id text,
    permits jsonb,
    owner text DEFAULT NULL,
    ttl interval DEFAULT NULL,
    wait interval DEFAULT NULL,
    priority integer DEFAULT 0,
    fairness_key text DEFAULT NULL,
    fairness_weight integer DEFAULT NULL
) RETURNS permitq.permit_request
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
#variable_conflict use_column
DECLARE
    problem text;
    existing permitq.permit_request;
BEGIN
    IF submit.external_id IS NULL OR submit.external_id = '' THEN
        RAISE EXCEPTION 'invalid external_id: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(submit.external_id) > permitq.rule_max_name_length() THEN
        RAISE EXCEPTION 'invalid external_id: must be at most % characters, got %',
            permitq.rule_max_name_length(), length(submit.external_id) USING ERRCODE = '22023';
    END IF;
    IF length(submit.owner) > permitq.rule_max_name_length() THEN
        RAISE EXCEPTION 'invalid owner: must be at most % characters, got %',
            permitq.rule_max_name_length(), length(submit.owner) USING ERRCODE = '22023';
    END IF;
    problem := permitq.permits_problem(submit.permits);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid permits: %', problem USING ERRCODE = '22023';
    END IF;
    IF submit.priority IS NULL
       OR submit.priority NOT BETWEEN permitq.rule_priority_min() AND permitq.rule_priority_max() THEN
        RAISE EXCEPTION 'invalid priority: must be between % and %, got %',
            permitq.rule_priority_min(), permitq.rule_priority_max(),
            coalesce(submit.priority::text, 'NULL') USING ERRCODE = '22023';
    END IF;
    IF submit.fairness_key = ''
       OR length(submit.fairness_key) > permitq.rule_max_fairness_key_length() THEN
        RAISE EXCEPTION 'invalid fairness_key: must be 1 to % characters, got %',
            permitq.rule_max_fairness_key_length(), length(submit.fairness_key)
            USING ERRCODE = '22023',
            HINT = 'name the tenant (or caller) whose share it counts in; leave it out for none';
    END IF;
    IF submit.fairness_weight NOT BETWEEN permitq.rule_fairness_weight_min()
                                      AND permitq.rule_fairness_weight_max() THEN
        RAISE EXCEPTION 'invalid fairness_weight: must be between % and %, got %',
            permitq.rule_fairness_weight_min(), permitq.rule_fairness_weight_max(),
            submit.fairness_weight USING ERRCODE = '22023',
            HINT = 'a key of weight 2 is served twice as much as one of weight 1 while both wait';
    END IF;
    LOOP
        INSERT INTO permitq.permit_request (external_id, permits, owner, ttl, wait, priority,
                                            fairness_key, fairness_weight)
        VALUES (submit.external_id, submit.permits, submit.owner, submit.ttl, submit.wait,
                submit.priority::smallint, submit.fairness_key, submit.fairness_weight)
        ON CONFLICT ON CONSTRAINT permit_request_external_id_key DO NOTHING
        RETURNING * INTO existing;
        IF FOUND THEN
            RETURN existing;
        END IF;
        SELECT * INTO existing FROM permitq.permit_request r WHERE r.external_id = submit.external_id;
        IF FOUND THEN
            IF permitq.may_act_on(existing.submitted_by) IS NOT TRUE THEN
                RAISE EXCEPTION 'external_id % already exists', submit.external_id
                    USING ERRCODE = '23505',
                          HINT = 'external ids are one namespace for the whole database, shared by '
                                 'every producer: prefix yours with your service''s name '
                                 '(billing:job-42), and submit under a new one';
            END IF;
            IF existing.permits = submit.permits
               AND existing.owner IS NOT DISTINCT FROM submit.owner
               AND existing.ttl IS NOT DISTINCT FROM submit.ttl
               AND existing.wait IS NOT DISTINCT FROM submit.wait
               AND existing.priority = submit.priority
               AND existing.fairness_key IS NOT DISTINCT FROM submit.fairness_key
               -- (No weight is weight 1.)
               AND coalesce(existing.fairness_weight, 1) = coalesce(submit.fairness_weight, 1) THEN
                RETURN existing;
            END IF;
            RAISE EXCEPTION 'external_id % already exists with different parameters (%)', submit.external_id,
                concat_ws(', ',
                    CASE WHEN existing.permits <> submit.permits THEN 'permits' END,
                    CASE WHEN existing.owner IS DISTINCT FROM submit.owner THEN 'owner' END,
                    CASE WHEN existing.ttl IS DISTINCT FROM submit.ttl THEN 'ttl' END,
                    CASE WHEN existing.wait IS DISTINCT FROM submit.wait THEN 'wait' END,
                    CASE WHEN existing.priority <> submit.priority THEN 'priority' END,
                    CASE WHEN existing.fairness_key IS DISTINCT FROM submit.fairness_key
                         THEN 'fairness_key' END,
                    CASE WHEN coalesce(existing.fairness_weight, 1) <> coalesce(submit.fairness_weight, 1)
                         THEN 'fairness_weight' END)
                || CASE WHEN (existing.permits <> submit.permits)::int
                             + (existing.owner IS DISTINCT FROM submit.owner)::int
                             + (existing.ttl IS DISTINCT FROM submit.ttl)::int
                             + (existing.wait IS DISTINCT FROM submit.wait)::int
                             + (existing.priority <> submit.priority)::int
                             + (existing.fairness_key IS DISTINCT FROM submit.fairness_key)::int
                             + (coalesce(existing.fairness_weight, 1) <> coalesce(submit.fairness_weight, 1))::int > 1
                        THEN ' differ' ELSE ' differs' END
                USING ERRCODE = '23505',
                      DETAIL = format('the existing request asked permits %s, owner %s, ttl %s, wait %s, priority %s%s; this submit asked %s; its state now: %s',
                          existing.permits, coalesce(existing.owner, 'none'),
                          coalesce(permitq.human_duration(existing.ttl), 'none (no lease)'),
                          coalesce(permitq.human_duration(existing.wait), 'none (waits until granted)'),
                          existing.priority,
                          CASE WHEN existing.fairness_key IS NOT NULL
                               THEN format(', fairness key %s (weight %s)', permitq.shown_key(existing.fairness_key),
                                           coalesce(existing.fairness_weight, 1)) END,
                          -- What differs, as this submit asked it.
                          concat_ws(', ',
                              CASE WHEN existing.permits <> submit.permits
                                   THEN 'permits ' || submit.permits::text END,
                              CASE WHEN existing.owner IS DISTINCT FROM submit.owner
                                   THEN 'owner ' || coalesce(submit.owner, 'none') END,
                              CASE WHEN existing.ttl IS DISTINCT FROM submit.ttl
                                   THEN 'ttl ' || coalesce(permitq.human_duration(submit.ttl), 'none (no lease)') END,
                              CASE WHEN existing.wait IS DISTINCT FROM submit.wait
                                   THEN 'wait ' || coalesce(permitq.human_duration(submit.wait), 'none (waits until granted)') END,
                              CASE WHEN existing.priority <> submit.priority
                                   THEN 'priority ' || submit.priority END,
                              CASE WHEN existing.fairness_key IS DISTINCT FROM submit.fairness_key
                                   THEN coalesce('fairness key ' || permitq.shown_key(submit.fairness_key),
                                                 'no fairness key') END,
                              CASE WHEN coalesce(existing.fairness_weight, 1) <> coalesce(submit.fairness_weight, 1)
                                   THEN 'fairness weight ' || coalesce(submit.fairness_weight, 1) END),
                          -- `released` alone when its holder released it, not `released (released)`.
                          concat_ws(' ', existing.state, existing.error_code,
                                    '(' || nullif(existing.release_reason, 'released') || ')')),
                      HINT = 'a new request needs a new external_id; the same parameters return the existing one';
        END IF;
        -- The conflicting row was deleted (retention) between the two statements: insert again.
    END LOOP;
END $$;
GRANT EXECUTE ON FUNCTION permitq.submit(text, jsonb, text, interval, interval, integer, text,
                                         integer)
    TO permitq_producer, permitq_admin;

-- permitq.status: the request row; no row for an unknown external_id, nor for another role's
-- request unless the session reads every request (functions/ownership.sql).
CREATE OR REPLACE FUNCTION permitq.status(external_id text) RETURNS SETOF permitq.permit_request
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY SELECT * FROM permitq.permit_request r
    WHERE r.external_id = status.external_id
      AND permitq.may_read(r.submitted_by);
END $$;
GRANT EXECUTE ON FUNCTION permitq.status(text)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- permitq.confirm_durable: run it after reading an outcome (`status`, `await_settled`, an event
-- on permitq_events), on the same connection and in a transaction of its own, before acting on
-- the outcome. With synchronous standbys configured, its commit waits until they have its WAL
-- message, and so everything this server committed before it: what the read saw, whatever the
-- session's synchronous_commit. A primary cut off from its standby in a failover can show a
-- grant that its demotion then discards; there this never returns successfully. On a standby it
-- raises 25006. Without synchronous standbys it writes nothing. Send it as a
-- simple query (psql does) or end its transaction with COMMIT: through the extended protocol
-- the result may arrive before the implicit commit has waited.
CREATE OR REPLACE FUNCTION permitq.confirm_durable() RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF pg_catalog.pg_is_in_recovery() THEN
        RAISE EXCEPTION 'this server is a standby: what was read here may not be on a primary yet'
            USING ERRCODE = '25006';
    END IF;
    IF pg_catalog.current_setting('synchronous_standby_names') <> '' THEN
        -- Whatever the session set (off, local): this commit waits for the standbys. (No SET
        -- clause on this function, so the setting lasts until the commit.)
        PERFORM pg_catalog.set_config('synchronous_commit', 'on', true);
        PERFORM pg_catalog.pg_logical_emit_message(true, 'permitq', '');
    END IF;
    RETURN true;
END $$;
GRANT EXECUTE ON FUNCTION permitq.confirm_durable() TO permitq_producer, permitq_worker, permitq_admin;

-- permitq.await_settled: waits until the request leaves `new` or `timeout` passes (at most 5 s a
-- call: call it again for longer), polling every 10 ms, and returns the row as it is then; no
-- row for an unknown id. For clients that cannot LISTEN. The call's statement holds a snapshot
-- while it waits, which holds back vacuum's horizon for the whole database: hence the bound.
-- Each poll sees what committed before it only in READ COMMITTED, and never the caller's own
-- uncommitted submit: call it in a transaction of its own.
CREATE OR REPLACE FUNCTION permitq.await_settled(external_id text, timeout interval DEFAULT '30 seconds')
RETURNS SETOF permitq.permit_request
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    deadline timestamptz;
    problem text := permitq.interval_problem(timeout, true);
    request permitq.permit_request;
BEGIN
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid timeout: %', problem USING ERRCODE = '22023';
    END IF;
    deadline := clock_timestamp() + least(timeout, interval '5 seconds');
    LOOP
        SELECT * INTO request FROM permitq.permit_request r
        WHERE r.external_id = await_settled.external_id
          AND permitq.may_read(r.submitted_by);
        IF NOT FOUND THEN
            RAISE NOTICE 'no request % among those this login may read: no row (submit it first, or check the id)',
                await_settled.external_id;
            RETURN;
        END IF;
        EXIT WHEN request.state <> 'new' OR clock_timestamp() >= deadline;
        PERFORM pg_sleep(0.01);
    END LOOP;
    IF request.state = 'new' AND timeout > interval '5 seconds' THEN
        -- Cut to the most one call waits: say so, or it reads as the whole timeout passed.
        RAISE NOTICE 'request % is still new after 5 s, the most one call waits (not the % asked): call again to wait longer',
            await_settled.external_id, permitq.human_duration(timeout);
    END IF;
    RETURN NEXT request;
END $$;
GRANT EXECUTE ON FUNCTION permitq.await_settled(text, interval)
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;
