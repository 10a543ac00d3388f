-- The waiters outside our batch that fair semaphores must keep room for (see
-- permitq.semaphore_heads in schema/V1__core.sql). Its own statement, after the locks.
-- $1 locked semaphore ids, $2 our batch's request ids, $3 our batch's newest id.
SELECT semaphore, request_id, count FROM permitq.semaphore_heads($1, $2, $3)
