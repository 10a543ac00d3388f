-- A semaphore can be deleted (permitq.delete_semaphore, functions/set_capacity.sql): the capacity
-- audit keeps a row for it, `deleted`, with the bounds it had (its new_* columns). False in every
-- row before this version.
ALTER TABLE permitq.capacity_change
    ADD COLUMN deleted boolean NOT NULL DEFAULT false;
