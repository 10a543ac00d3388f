-- Waking workers (channel permitq_work) and telling producers outcomes (permitq_events).
--
-- Wake-ups are coalesced: workers record in permitq.worker_wake whether they sleep, and
-- producers NOTIFY only when one does (PostgreSQL serializes the commits of notifying
-- transactions, so a NOTIFY per request would cap the commit rate). The protocol, with the
-- advisory key rule_wake_lock_key():
--   caller: takes the key in SHARE mode (held to the end of its transaction, after its commit
--           is visible), then reads worker_wake in a fresh snapshot; NOTIFYs only if a worker
--           sleeps.
--   worker, before sleeping: commits sleeping = true, then takes the key in EXCLUSIVE mode
--           without waiting and lets it go at once, then runs one more pass. Getting the key
--           means every caller that could have read sleeping = false has finished, so that pass
--           sees its rows; callers after the commit read true and notify. When the key is busy
--           the worker does not sleep: it polls (producers are active).
-- Callers in REPEATABLE READ or SERIALIZABLE read an older snapshot, so they always notify.

-- Wakes the workers if any is asleep. Called by every transaction that may make work for them
-- (submit, plain INSERT, release, cancel).
CREATE OR REPLACE FUNCTION permitq.wake_workers() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM pg_notify('permitq_work', '');
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(permitq.rule_wake_lock_key());
    IF EXISTS (SELECT 1 FROM permitq.worker_wake WHERE sleeping AND awake_by > now()) THEN
        PERFORM pg_notify('permitq_work', '');
    END IF;
END $$;

-- Sends the outcomes of these requests on permitq_events as JSON arrays, chunked by size: a
-- notification's payload must stay under 8000 bytes. A chunk starts before 6000 bytes and one
-- event is at most ~1,700 (a 255-character external_id, each character escaped as \uXXXX), so
-- every chunk fits.
CREATE OR REPLACE FUNCTION permitq.notify_events(request_ids bigint[]) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    payload text;
BEGIN
    FOR payload IN
        SELECT '[' || string_agg(e.event, ',' ORDER BY e.id) || ']'
        FROM (SELECT e.id, e.event,
                     (sum(octet_length(e.event) + 1) OVER (ORDER BY e.id) - octet_length(e.event) - 1)
                         / 6000 AS chunk
              FROM (SELECT r.id, json_build_object(
                           'external_id', r.external_id,
                           'state', r.state,
                           'error_code', r.error_code,
                           'release_reason', r.release_reason,
                           'fencing_token', r.fencing_token,
                           'expires_at', r.expires_at)::text AS event
                    FROM permitq.permit_request r WHERE r.id = ANY(request_ids)) e) e
        GROUP BY e.chunk
    LOOP
        PERFORM pg_notify('permitq_events', payload);
    END LOOP;
END $$;
