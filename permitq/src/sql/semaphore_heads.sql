-- The waiting requests outside our batch that fair semaphores must keep room for (see
-- permitq.semaphore_heads in schema/functions/heads.sql). Sent in the same round trip as
-- lock_batch_semaphores, after it: the server runs them in order, so the heads are read once the
-- locks are held. $1: the batch's semaphore names; $2: per name, the lowest place in line of the
-- batch's requests there; $3: the batch's request ids.
SELECT semaphore, request_id, count, effective FROM permitq.semaphore_heads($1, $2, $3)
