-- V7: fencing tokens that never go backwards across a failover.
--
-- Tokens came from one sequence. A sequence on an asynchronous standby can be behind the
-- primary's last issued value (the WAL that advanced it may not have reached the standby), so
-- after a promotion the same number could be issued again, and a downstream store would accept
-- a stale holder's token. Now a token is
--
--     timeline << 48  |  nextval(fencing_token_seq)
--
-- where `timeline` is the WAL timeline the server is writing on. A promotion always starts a new,
-- higher timeline, so every token issued after it is larger than every token issued before it on
-- any server of the cluster, whatever the sequence says. Within a timeline the order is the
-- sequence's, drawn in grant order under the semaphore locks as before. Tokens issued before
-- this migration (sequence values, below 2^48) stay below every new one.
--
-- 48 bits leave 2.8 * 10^14 grants per timeline (the sequence refuses to go past them rather than
-- spill into the timeline's bits); tokens stay below 2^53, exact in a JSON double, up to
-- timeline 31.

ALTER SEQUENCE permitq.fencing_token_seq MAXVALUE 281474976710655;

-- The timeline WAL is being written on: the first 8 hex digits of the current WAL file's name.
-- (Fails during recovery, where nothing is granted anyway.)
CREATE FUNCTION permitq.wal_timeline() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint
$$;
REVOKE EXECUTE ON FUNCTION permitq.wal_timeline() FROM PUBLIC;

CREATE OR REPLACE FUNCTION permitq.apply_decision(
    worker text,
    granted bigint[],
    errored bigint[],
    error_codes text[],
    waiting bigint[]
) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    -- The high bits of this batch's tokens: its timeline (see the top of this file).
    epoch bigint := CASE WHEN cardinality(granted) > 0 THEN permitq.wal_timeline() << 48 ELSE 0 END;
BEGIN
    -- Failures first: their settled_at then precedes the batch's acquired_at, so a history
    -- checker never mistakes a request failed in this batch for one still waiting at the grants.
    IF cardinality(errored) > 0 THEN
        UPDATE permitq.permit_request r
        SET state = 'error', error_code = e.code, settled_at = clock_timestamp(), worker_id = worker
        FROM unnest(errored, error_codes) AS e(id, code)
        WHERE r.id = e.id;
    END IF;

    IF cardinality(granted) > 0 THEN
        -- Tokens (timeline in the high bits) and timestamps are drawn in id order, after the
        -- locks are held, so token order, acquired_at order and FIFO order agree (volatile
        -- output columns are computed after the ORDER BY).
        WITH g AS (
            SELECT id, epoch | nextval('permitq.fencing_token_seq') AS token, clock_timestamp() AS at
            FROM unnest(granted) AS id
            ORDER BY id
        ),
        done AS (
            UPDATE permitq.permit_request r
            SET state = 'acquired', fencing_token = g.token, acquired_at = g.at,
                expires_at = g.at + r.ttl, worker_id = worker
            FROM g
            WHERE r.id = g.id
            RETURNING r.permits
        )
        UPDATE permitq.semaphore s
        SET used = s.used + t.total, granted = s.granted + t.grants, updated_at = now()
        FROM (SELECT e.key AS semaphore, sum(e.value::int) AS total, count(*) AS grants
              FROM done CROSS JOIN LATERAL jsonb_each(done.permits) e GROUP BY e.key) t
        WHERE s.name = t.semaphore;
    END IF;

    IF cardinality(waiting) > 0 THEN
        -- Requests left waiting for the first time take their place in each semaphore's queue.
        INSERT INTO permitq.waiter (semaphore_id, request_id, count)
        SELECT s.id, r.id, e.value::int
        FROM permitq.permit_request r
        CROSS JOIN LATERAL jsonb_each(r.permits) e
        JOIN permitq.semaphore s ON s.name = e.key
        WHERE r.id = ANY(waiting) AND NOT r.examined
        ON CONFLICT DO NOTHING;

        UPDATE permitq.permit_request r SET examined = true
        WHERE r.id = ANY(waiting) AND NOT r.examined;
    END IF;

    IF cardinality(granted) + cardinality(errored) > 0 THEN
        -- They wait no more.
        DELETE FROM permitq.waiter w WHERE w.request_id = ANY(granted || errored);
        PERFORM permitq.notify_events(granted || errored);
    END IF;
END $$;

-- CREATE OR REPLACE reset these (see V4): the function runs as its owner, path pinned.
ALTER FUNCTION permitq.apply_decision(text, bigint[], bigint[], text[], bigint[])
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off;
