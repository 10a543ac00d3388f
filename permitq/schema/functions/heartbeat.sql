-- Leases: a holder with a ttl heartbeats to keep its permits.

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
        RAISE EXCEPTION 'lease lost: request % is unknown', $1 USING ERRCODE = '55000';
    END IF;
    PERFORM permitq.check_owner(request, 'heartbeat it');
    IF request.state <> 'acquired' THEN
        RAISE EXCEPTION 'lease lost: request % is %', $1,
            concat_ws(' ', request.state, request.error_code, request.release_reason)
            USING ERRCODE = '55000';
    END IF;
    IF request.expires_at IS NOT NULL AND request.expires_at <= now() THEN
        RAISE EXCEPTION 'lease lost: request % expired at %', $1, request.expires_at
            USING ERRCODE = '55000';
    END IF;
    -- A stored ttl out of bounds (a row written past the constraints) extends by the bound.
    new_expiry := now() + coalesce(extend, least(request.ttl, permitq.rule_max_duration()));
    UPDATE permitq.permit_request r SET expires_at = new_expiry, heartbeat_at = now()
    WHERE r.id = request.id;
    RETURN new_expiry;
END $$;
GRANT EXECUTE ON FUNCTION permitq.heartbeat(text, interval) TO permitq_producer, permitq_admin;
