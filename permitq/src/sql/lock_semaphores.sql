-- Lock every semaphore the claimed batch names, and every semaphore with pending releases, in
-- ascending id (lock order step 2), then fold the pending releases into `used` (see
-- permitq.lock_and_fold in schema/V3__hot_path.sql). Returns the batch's semaphores after the
-- fold. $1 the names.
SELECT id, name, capacity, used, fair FROM permitq.lock_and_fold($1)
