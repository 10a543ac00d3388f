-- Leases: a holder with a ttl heartbeats to keep its permits.

-- A promotion (or a restore into another cluster) leaves holders a grace of one ttl: no lease runs
-- out before one ttl after permitq first saw the new timeline, as etcd extends its leases when
-- its leader changes. Holders could not heartbeat while there was no primary, and with an
-- asynchronous standby their last heartbeats may be gone; so the lease a holder was last told
-- (at most one ttl past the moment it was told, which is before the promotion) is always
-- honoured. Extending a lease grants nothing: safety is untouched, and a holder that did die
-- keeps its permits at most one ttl longer.

-- When the grace began: the moment a worker first saw this timeline and cluster (recorded by
-- permitq.record_lease_grace), '-infinity' when none is due. Reads only, and takes no lock: a
-- session (a producer's open transaction, say) cannot hold it up or stretch it. Until a worker
-- has recorded a new timeline, the grace begins now: later, so longer, which is safe.
CREATE OR REPLACE FUNCTION permitq.lease_grace_since() RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    recorded permitq.lease_grace;
BEGIN
    SELECT * INTO recorded FROM permitq.lease_grace;
    IF NOT FOUND THEN
        RETURN '-infinity';
    END IF;
    IF recorded.timeline = permitq.wal_timeline() AND recorded.system_id = permitq.system_id() THEN
        RETURN recorded.since;
    END IF;
    RETURN now();
END $$;
GRANT EXECUTE ON FUNCTION permitq.lease_grace_since() TO permitq_producer, permitq_worker, permitq_admin;

-- Worker (every lease sweep, first): records when it first saw this timeline and cluster, so the
-- grace after a promotion is counted from then. Only workers write the row (producers may read
-- it, and cannot lock it), so no one else's open transaction delays the record.
CREATE OR REPLACE FUNCTION permitq.record_lease_grace() RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    UPDATE permitq.lease_grace g
    SET timeline = permitq.wal_timeline(), system_id = permitq.system_id(), since = now()
    WHERE g.timeline <> permitq.wal_timeline() OR g.system_id <> permitq.system_id();
END $$;
GRANT EXECUTE ON FUNCTION permitq.record_lease_grace() TO permitq_worker;

-- The rule: a lease has run out when its expires_at has passed and so has the grace since
-- `grace_since` (permitq.lease_grace_since(), read once by the caller). NULL expires_at: no
-- lease, never runs out.
CREATE OR REPLACE FUNCTION permitq.lease_run_out(expires_at timestamptz, ttl interval,
                                                 grace_since timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT expires_at <= now()
       AND now() >= grace_since + least(coalesce(ttl, interval '0'), permitq.rule_max_duration())
$$;

-- permitq.heartbeat: pushes expires_at to now() + (extend, else the request's ttl). Raises 55000
-- when the request is not acquired or its lease has already run out: the holder has lost its
-- permits and must stop.
CREATE OR REPLACE FUNCTION permitq.heartbeat(external_id text, extend interval DEFAULT NULL)
RETURNS timestamptz
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    request permitq.permit_request;
    new_expiry timestamptz;
    problem text;
BEGIN
    problem := permitq.interval_problem(extend, false);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid extend: %', problem USING ERRCODE = '22023';
    END IF;
    SELECT * INTO request FROM permitq.permit_request r WHERE r.external_id = $1 FOR UPDATE;
    IF NOT FOUND THEN
        -- 55000 as every lost lease (a holder stops), worded so that a mistyped id reads as one.
        RAISE EXCEPTION 'no request named %: none was submitted under that external_id (check it), or retention removed it after it ended, or a failover lost it with the primary''s unreplicated tail; no lease of it is held', $1
            USING ERRCODE = '55000';
    END IF;
    PERFORM permitq.check_owner(request, 'heartbeat it');
    IF request.state IN ('new', 'in_progress') THEN
        RAISE EXCEPTION 'no lease yet: request % is still waiting to be granted', $1
            USING ERRCODE = '55000',
                  HINT = format('heartbeat once it is acquired; `permitq status %s` (or a client''s status) shows when it is, and an acquire or `permitq submit --await` waits for it',
                                permitq.shell_word($1));
    END IF;
    IF request.state = 'error' THEN
        RAISE EXCEPTION 'no lease: request % ended without a grant (error %)', $1, request.error_code
            USING ERRCODE = '55000',
                  HINT = '`permitq status` says why; submit a new request (a new external_id) to try again';
    END IF;
    IF request.state = 'released' THEN
        RAISE EXCEPTION 'lease lost: request % was %', $1,
            CASE request.release_reason
                WHEN 'released' THEN 'released by its holder'
                WHEN 'expired' THEN 'released: its lease expired with no heartbeat in time'
                WHEN 'revoked' THEN coalesce('revoked by ' || (request.error_detail ->> 'revoked_by'),
                                             'revoked by an admin') || ' (`permitq revoke`)'
                WHEN 'stale' THEN 'released: held past the workers'' --max-hold'
                ELSE 'released (' || coalesce(request.release_reason, 'no reason') || ')' END
            USING ERRCODE = '55000',
                  HINT = 'stop using the resource; submit a new request to hold it again';
    END IF;
    -- (The grace is read only for a lease past its expires_at: nested, so in that order.)
    IF request.expires_at IS NOT NULL AND request.expires_at <= now() THEN
        IF permitq.lease_run_out(request.expires_at, request.ttl, permitq.lease_grace_since()) THEN
            RAISE EXCEPTION 'lease lost: request % expired at %', $1, request.expires_at
                USING ERRCODE = '55000';
        END IF;
    END IF;
    -- Held until released (no ttl) and no extension asked: no lease to extend, none made.
    IF extend IS NULL AND request.ttl IS NULL THEN
        RETURN NULL;
    END IF;
    -- A stored ttl out of bounds (a row written past the constraints) extends by the bound.
    new_expiry := now() + coalesce(extend, least(request.ttl, permitq.rule_max_duration()));
    UPDATE permitq.permit_request r SET expires_at = new_expiry, heartbeat_at = now()
    WHERE r.id = request.id;
    RETURN new_expiry;
END $$;
GRANT EXECUTE ON FUNCTION permitq.heartbeat(text, interval) TO permitq_producer, permitq_admin;
