-- Lock every semaphore the claimed batch names, in ascending id: lock order step 2
-- (see permitq.lock_semaphores in schema/V1__core.sql). $1 the names.
SELECT id, name, capacity, used, fair FROM permitq.lock_semaphores($1)
