-- Claim the next batch of pending requests after the cursor, in FIFO (id) order.
-- $1 cursor (last id seen in this pass), $2 batch size.
-- Lock order step 1. SKIP LOCKED: rows another worker holds are passed over, not waited for; the
-- cursor is a line in the sand, so this pass never walks back to them (the next pass starts at 0).
-- The row lock is the claim: waiting requests are not rewritten on every pass, and a worker that
-- dies simply drops its locks, leaving its rows `new` for the others.
SELECT id,
       permits,
       coalesce(wait = interval '0', false) AS fail_fast,
       coalesce(wait_until <= now(), false) AS deadline_passed,
       examined,
       extract(epoch FROM clock_timestamp() - created_at)::float8 AS age_seconds
FROM permitq.permit_request
WHERE state = 'new' AND id > $1
ORDER BY id
LIMIT $2
FOR UPDATE SKIP LOCKED
