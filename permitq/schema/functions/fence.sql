-- Fencing for downstream writes kept in this database (table permitq.fence_token).

-- The fence, for both signatures: true, and remembered, when `token` was issued by permitq to a
-- request that holds its permits now (acquired, lease not run out), holds a permit of
-- `semaphore` (named, or below it; NULL: any, the deprecated signature), is the caller's own (or
-- the caller is an admin), and is >= the highest token seen for `resource`; false otherwise, and
-- then nothing is recorded. So a stale, released, expired, forged or someone else's token
-- changes nothing (a producer holding nothing cannot fence others out), and a holder whose lease
-- ran out is fenced even before anyone else writes. `bind`: the resource is (or becomes) guarded
-- by `semaphore`; fencing a guarded resource with another semaphore is 22023. One statement:
-- atomic under concurrency.
CREATE OR REPLACE FUNCTION permitq.fence_checked(semaphore text, resource text, token bigint,
                                                 bind boolean) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_column
DECLARE
    accepted boolean;
    guarded_by text;
BEGIN
    IF fence_checked.resource IS NULL OR fence_checked.resource = '' THEN
        RAISE EXCEPTION 'invalid resource: must not be empty' USING ERRCODE = '22023';
    END IF;
    IF length(fence_checked.resource) > permitq.rule_max_name_length() THEN
        RAISE EXCEPTION 'invalid resource: must be at most % characters, got %',
            permitq.rule_max_name_length(), length(fence_checked.resource) USING ERRCODE = '22023';
    END IF;
    IF fence_checked.token IS NULL THEN
        RAISE EXCEPTION 'invalid token: must not be null' USING ERRCODE = '22023';
    END IF;
    SELECT f.semaphore INTO guarded_by FROM permitq.fence_token f
    WHERE f.resource = fence_checked.resource;
    IF guarded_by IS NOT NULL AND guarded_by IS DISTINCT FROM fence_checked.semaphore THEN
        RAISE EXCEPTION 'invalid semaphore: resource % is guarded by semaphore %, not %',
            fence_checked.resource, guarded_by, coalesce(fence_checked.semaphore, 'any')
            USING ERRCODE = '22023',
                  HINT = format('fence it with permitq.fence(%L, %L, token)', guarded_by,
                                fence_checked.resource);
    END IF;
    INSERT INTO permitq.fence_token AS f (resource, token, semaphore)
    SELECT $2, $3, CASE WHEN bind THEN $1 END
    WHERE EXISTS (SELECT 1 FROM permitq.permit_request r
                  WHERE r.fencing_token = fence_checked.token AND r.state = 'acquired'
                    AND (fence_checked.semaphore IS NULL
                         OR coalesce(r.charged, r.permits) ? fence_checked.semaphore)
                    AND permitq.may_act_on(r.submitted_by)
                    -- The grace is read only for a lease past its expires_at (CASE: in order).
                    AND CASE WHEN r.expires_at IS NULL OR r.expires_at > now() THEN true
                             ELSE NOT permitq.lease_run_out(r.expires_at, r.ttl,
                                                            permitq.lease_grace_since()) END)
    ON CONFLICT (resource) DO UPDATE
        SET token = EXCLUDED.token, updated_at = now(),
            semaphore = coalesce(EXCLUDED.semaphore, f.semaphore)
        WHERE f.token <= EXCLUDED.token
    RETURNING true INTO accepted;
    RETURN coalesce(accepted, false);
END $$;

-- permitq.fence(semaphore, resource, token): the fence of a write to `resource`, guarded by
-- `semaphore` (the first fence binds them).
CREATE OR REPLACE FUNCTION permitq.fence(semaphore text, resource text, token bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    IF fence.semaphore IS NULL OR fence.semaphore = '' THEN
        RAISE EXCEPTION 'invalid semaphore: must not be empty (the semaphore that guards %)',
            fence.resource USING ERRCODE = '22023';
    END IF;
    RETURN permitq.fence_checked(fence.semaphore, fence.resource, fence.token, true);
END $$;
GRANT EXECUTE ON FUNCTION permitq.fence(text, text, bigint) TO permitq_producer, permitq_admin;

-- permitq.fence(resource, token): deprecated, kept for one release (a NOTICE says so). The
-- resource's guarding semaphore when it has one, else any the token's request holds; the token
-- must be the caller's own (or the caller an admin), as above.
CREATE OR REPLACE FUNCTION permitq.fence(resource text, token bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    RAISE NOTICE 'permitq.fence(resource, token) is deprecated: use permitq.fence(semaphore, resource, token)';
    RETURN permitq.fence_checked(
        (SELECT f.semaphore FROM permitq.fence_token f WHERE f.resource = fence.resource),
        fence.resource, fence.token, false);
END $$;
GRANT EXECUTE ON FUNCTION permitq.fence(text, bigint) TO permitq_producer, permitq_admin;
