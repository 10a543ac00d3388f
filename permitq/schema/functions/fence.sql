-- Fencing for downstream writes kept in this database (table permitq.fence_token).

-- The fence, for both signatures: true, and remembered, when `token` was issued by permitq to a
-- request that holds its permits now (acquired, lease not run out), holds a permit of
-- `semaphore` (named, or below it; NULL: any, the deprecated signature), is the caller's own (or
-- the caller is an admin), and is >= the highest token seen for `resource` under `semaphore`;
-- false otherwise, and then nothing is recorded. So a stale, released, expired, forged or
-- someone else's token changes nothing (a producer holding nothing cannot fence others out), and
-- a holder whose lease ran out is fenced even before anyone else writes. Fences are kept per
-- (semaphore, resource): the holders of one semaphore fence one another, and a holder of another
-- cannot touch them. The deprecated signature keeps its own, under the semaphore ''. One
-- statement: atomic under concurrency.
CREATE OR REPLACE FUNCTION permitq.fence_checked(semaphore text, resource text, token bigint)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
#variable_conflict use_column
DECLARE
    accepted boolean;
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
    INSERT INTO permitq.fence_token AS f (semaphore, resource, token)
    SELECT coalesce($1, ''), $2, $3
    WHERE EXISTS (SELECT 1 FROM permitq.permit_request r
                  WHERE r.fencing_token = fence_checked.token AND r.state = 'acquired'
                    AND (fence_checked.semaphore IS NULL
                         OR coalesce(r.charged, r.permits) ? fence_checked.semaphore)
                    AND permitq.may_act_on(r.submitted_by)
                    -- The grace is read only for a lease past its expires_at (CASE: in order).
                    AND CASE WHEN r.expires_at IS NULL OR r.expires_at > now() THEN true
                             ELSE NOT permitq.lease_run_out(r.expires_at, r.ttl,
                                                            permitq.lease_grace_since()) END)
    ON CONFLICT (semaphore, resource) DO UPDATE
        SET token = EXCLUDED.token, updated_at = now()
        WHERE f.token <= EXCLUDED.token
    RETURNING true INTO accepted;
    -- Refused, naming a semaphore nothing has: a typo, not a stale holder, so say so (on the
    -- refused path only; an instance its template would make counts as known).
    IF accepted IS NULL AND fence_checked.semaphore IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM permitq.semaphore s WHERE s.name = fence_checked.semaphore)
       AND (permitq.template_for(fence_checked.semaphore)).name IS NULL THEN
        RAISE EXCEPTION 'invalid semaphore %: no semaphore or template has that name%; name the semaphore that guards % (one the token''s request holds)',
            fence_checked.semaphore,
            coalesce('; did you mean ' || nullif(array_to_string(
                permitq.similar_semaphore_names(fence_checked.semaphore), ' or '), '') || '?', ''),
            fence_checked.resource
            USING ERRCODE = '22023';
    END IF;
    IF accepted IS NULL THEN
        PERFORM permitq.fence_refusal_notice(fence_checked.semaphore, fence_checked.resource,
                                             fence_checked.token);
    END IF;
    RETURN coalesce(accepted, false);
END $$;

-- Why a fence refused a token, as a NOTICE (on the refused path only, read after the refusal:
-- it explains, it decides nothing): no request of the caller's has the token (stale, forged or
-- another login's: not told apart, so that nothing leaks), its request no longer holds (and
-- how it ended), its lease ran out, it does not hold that semaphore, or a later token was
-- seen for the resource (a later holder wrote; the later token is not shown).
CREATE OR REPLACE FUNCTION permitq.fence_refusal_notice(semaphore text, resource text, token bigint)
RETURNS void
LANGUAGE plpgsql STABLE SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_variable
DECLARE
    r permitq.permit_request;
    held text;
BEGIN
    SELECT * INTO r FROM permitq.permit_request x
    WHERE x.fencing_token = token AND permitq.may_act_on(x.submitted_by);
    IF NOT FOUND THEN
        RAISE NOTICE 'fence refused: no request of yours holds token % (it is another login''s, or made up)', token;
        RETURN;
    END IF;
    held := (SELECT string_agg(k, ', ' ORDER BY k) FROM jsonb_object_keys(coalesce(r.charged, r.permits)) k);
    IF r.state <> 'acquired' THEN
        RAISE NOTICE 'fence refused: token % is request %''s, which is %: it holds nothing now; take a new permit and write with its token',
            token, r.external_id,
            r.state || CASE WHEN r.release_reason IS DISTINCT FROM 'released'
                            THEN ' (' || r.release_reason || ')' ELSE '' END;
    ELSIF r.expires_at IS NOT NULL AND r.expires_at <= now()
          AND permitq.lease_run_out(r.expires_at, r.ttl, permitq.lease_grace_since()) THEN
        RAISE NOTICE 'fence refused: the lease of request % ran out % ago (ttl %): heartbeat it more often than its ttl, or take a new permit',
            r.external_id, permitq.human_duration(now() - r.expires_at), permitq.human_duration(r.ttl);
    ELSIF semaphore IS NOT NULL AND NOT coalesce(r.charged, r.permits) ? semaphore THEN
        RAISE NOTICE 'fence refused: request % holds % (%), not %: fence with the semaphore that guards % and that it holds',
            r.external_id, CASE WHEN held LIKE '%,%' THEN 'these' ELSE 'this' END, held, semaphore, resource;
    ELSE
        -- (The highest token is not shown: it may be another login's.)
        RAISE NOTICE 'fence refused: token % is below the highest seen for % under %: a later holder has written since; this holder is stale and must stop writing',
            token, resource, coalesce(semaphore, '(any semaphore)');
    END IF;
END $$;

-- permitq.fence(semaphore, resource, token): the fence of a write to `resource`, guarded by
-- `semaphore`.
CREATE OR REPLACE FUNCTION permitq.fence(semaphore text, resource text, token bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    IF fence.semaphore IS NULL OR fence.semaphore = '' THEN
        RAISE EXCEPTION 'invalid semaphore: must not be empty (the semaphore that guards %)',
            fence.resource USING ERRCODE = '22023';
    END IF;
    RETURN permitq.fence_checked(fence.semaphore, fence.resource, fence.token);
END $$;
GRANT EXECUTE ON FUNCTION permitq.fence(text, text, bigint) TO permitq_producer, permitq_admin;

-- permitq.fence(resource, token): deprecated, kept for one release (a NOTICE says so). Any
-- semaphore the token's request holds; the token must be the caller's own (or the caller an
-- admin), as above; its fences are its own (semaphore '').
CREATE OR REPLACE FUNCTION permitq.fence(resource text, token bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    RAISE NOTICE 'permitq.fence(resource, token) is deprecated: use permitq.fence(semaphore, resource, token)';
    RETURN permitq.fence_checked(NULL, fence.resource, fence.token);
END $$;
GRANT EXECUTE ON FUNCTION permitq.fence(text, bigint) TO permitq_producer, permitq_admin;
