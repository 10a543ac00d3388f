-- Lock order step 2: make the batch's missing template instances, lock its semaphores (with
-- their ancestors) in ascending id, fold the pending releases, and read the semaphores as the
-- decision sees them, with the guaranteed children of the locked ones (see
-- permitq.lock_batch_semaphores in schema/functions/batch_semaphores.sql). $1 the names.
SELECT id, name, capacity, used, fair, parent, guarantee, active
FROM permitq.lock_batch_semaphores($1)
