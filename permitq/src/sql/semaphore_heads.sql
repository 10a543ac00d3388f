-- The waiters outside our batch that fair semaphores must keep room for (see
-- permitq.semaphore_heads_named in schema/functions/heads.sql). Sent in the same round trip as
-- lock_batch_semaphores.sql, after it: the server runs them in order, so the heads are read
-- under the locks.
-- $1 the batch's semaphore names, $2 our batch's request ids, $3 our batch's newest id.
SELECT semaphore, request_id, count, effective FROM permitq.semaphore_heads_named($1, $2, $3)
