-- Isolating a failed batch: claim these requests again, one at a time (see
-- permitq.claim_requests in schema/functions/claim.sql), with the columns of claim_batch.sql.
-- Lock order step 1, FOR UPDATE SKIP LOCKED. $1 the ids.
SELECT id, permits, fail_fast, deadline_passed, examined, age_seconds, problem, external_id,
       effective
FROM permitq.claim_requests($1)
