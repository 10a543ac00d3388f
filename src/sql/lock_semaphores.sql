-- Lock every semaphore the claimed batch names. $1 the names.
-- Lock order step 2: FOR UPDATE in ascending id (the row locks are taken above the sort, so in
-- this order). release, set_capacity and every sweep lock semaphores in the same order, which is
-- what keeps the whole system deadlock-free. The rows returned are the latest committed versions,
-- so `used` is exact for as long as this transaction runs.
SELECT id, name, capacity, used, fair
FROM permitq.semaphore
WHERE name = ANY($1)
ORDER BY id
FOR UPDATE
