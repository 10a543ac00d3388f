-- Claim what could be granted now (see permitq.claim_batch in schema/functions/claim.sql): pending
-- requests no worker has examined yet after the cursor, in id order, and the first waiters of
-- semaphores that have room. Lock order step 1, FOR UPDATE SKIP LOCKED: rows another worker holds
-- are passed over, not waited for. The row lock is the claim: waiting requests are not rewritten
-- on every pass, and a worker that dies simply drops its locks, leaving its rows `new`.
-- `problem` is why an unexamined row cannot be decided (it is failed as `invalid`), else NULL.
-- $1 cursor (the newest unexamined id this pass has claimed), $2 batch size.
SELECT id, permits, fail_fast, deadline_passed, examined, age_seconds, problem, external_id,
       effective
FROM permitq.claim_batch($1, $2)
