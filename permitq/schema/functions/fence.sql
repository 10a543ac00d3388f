-- Fencing for downstream writes kept in this database (table permitq.fence_token).

-- permitq.fence: true, and remembered, when `token` was issued by permitq to a request that holds
-- its permits now (acquired, lease not run out) and is >= the highest token seen for `resource`;
-- false otherwise, and then nothing is recorded. So a stale, released, expired or forged token
-- changes nothing (a forged high token locks nobody out), and a holder whose lease ran out is
-- fenced even before anyone else writes. One statement: atomic under concurrency.
CREATE OR REPLACE FUNCTION permitq.fence(resource text, token bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_column
DECLARE
    accepted boolean;
BEGIN
    IF fence.resource IS NULL OR fence.resource = '' THEN
        RAISE EXCEPTION 'invalid resource: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(fence.resource) > permitq.rule_max_name_length() THEN
        RAISE EXCEPTION 'invalid resource: must be at most % characters, got %',
            permitq.rule_max_name_length(), length(fence.resource) USING ERRCODE = '22023';
    END IF;
    IF fence.token IS NULL THEN
        RAISE EXCEPTION 'invalid token: must not be null' USING ERRCODE = '22023';
    END IF;
    INSERT INTO permitq.fence_token AS f (resource, token)
    SELECT $1, $2
    WHERE EXISTS (SELECT 1 FROM permitq.permit_request r
                  WHERE r.fencing_token = fence.token AND r.state = 'acquired'
                    -- The grace is read only for a lease past its expires_at (CASE: in order).
                    AND CASE WHEN r.expires_at IS NULL OR r.expires_at > now() THEN true
                             ELSE NOT permitq.lease_run_out(r.expires_at, r.ttl,
                                                            permitq.lease_grace_since()) END)
    ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
        WHERE f.token <= EXCLUDED.token
    RETURNING true INTO accepted;
    RETURN coalesce(accepted, false);
END $$;
GRANT EXECUTE ON FUNCTION permitq.fence(text, bigint) TO permitq_producer, permitq_admin;
