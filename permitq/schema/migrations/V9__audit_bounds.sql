-- The capacity audit records every bound an operator sets (functions/capacity_audit.sql): a
-- template's max_instances and a rate limit's window too. NULL before this version, and where
-- the semaphore has none.
ALTER TABLE permitq.capacity_change
    ADD COLUMN old_max_instances integer,
    ADD COLUMN new_max_instances integer,
    ADD COLUMN old_per           interval,
    ADD COLUMN new_per           interval;

-- A fence is kept per (semaphore, resource) (functions/fence.sql): holders of one semaphore fence
-- one another, and no other semaphore's holder can take a resource name from them (the first
-- fence bound a resource to its semaphore for good, so any holder could squat a name). The
-- deprecated two-argument fence keeps its rows under the semaphore ''.
UPDATE permitq.fence_token SET semaphore = '' WHERE semaphore IS NULL;
ALTER TABLE permitq.fence_token
    ALTER COLUMN semaphore SET DEFAULT '',
    ALTER COLUMN semaphore SET NOT NULL,
    DROP CONSTRAINT fence_token_pkey,
    ADD CONSTRAINT fence_token_pkey PRIMARY KEY (semaphore, resource);
DROP FUNCTION IF EXISTS permitq.fence_checked(text, text, bigint, boolean);
