-- Steps 1 and 2 of a batch in one round trip (see permitq.next_batch in
-- schema/functions/next_batch.sql): claim (lock order step 1, FOR UPDATE SKIP LOCKED), lock the
-- batch's semaphores in ascending id and fold their releases (step 2), read the heads. Rows of
-- kind 'r' are the claimed requests (the columns of claim_batch.sql), 's' the semaphores and 'h'
-- the heads, 'k' the batch's keyed semaphores (those of lock_batch_and_heads.sql); `ranked`, a
-- claimed request's place once a keyed semaphore placed it (functions/fairness.sql). $1 cursor,
-- $2 batch size, $3 whether to place by key now (false: the worker calls
-- place_batch_by_keys.sql when the order matters).
SELECT kind, id, permits, fail_fast, deadline_passed, examined, age_seconds, problem,
       external_id, effective, semaphore_id, name, capacity, used, fair, parent, guarantee,
       active, head_request_id, head_count, ranked
FROM permitq.next_batch($1, $2, $3)
