-- The capacity audit records every bound an operator sets (functions/capacity_audit.sql): a
-- template's max_instances and a rate limit's window too. NULL before this version, and where
-- the semaphore has none.
ALTER TABLE permitq.capacity_change
    ADD COLUMN old_max_instances integer,
    ADD COLUMN new_max_instances integer,
    ADD COLUMN old_per           interval,
    ADD COLUMN new_per           interval;
