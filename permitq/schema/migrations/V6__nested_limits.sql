-- Nested limits (functions/nesting.sql): a semaphore may have a parent, and a grant on it also
-- takes its count from every ancestor. A child may be guaranteed a share of its parent.
ALTER TABLE permitq.semaphore
    -- The parent's name: a plain semaphore, never a template nor an instance, which are the only
    -- rows ever deleted (set_capacity checks it under the nesting gate; a foreign key would take
    -- KEY SHARE locks on parents that the workers hold, in an order of its own).
    ADD COLUMN parent text,
    -- The share of its parent this semaphore is guaranteed while it is active (holds permits or
    -- has waiters): the parent keeps that much room for it.
    ADD COLUMN guarantee integer NOT NULL DEFAULT 0
        CONSTRAINT semaphore_guarantee_valid CHECK (guarantee >= 0);
-- A parent's children, for its guarantees and reserve.
CREATE INDEX semaphore_parent_idx ON permitq.semaphore (parent, id) WHERE parent IS NOT NULL;

-- What a grant took, ancestors included (semaphore name → count), when that differs from
-- `permits`: releases give back exactly this, wherever the semaphores' parents are now.
ALTER TABLE permitq.permit_request ADD COLUMN charged jsonb;

-- The audit records the tree too (functions/capacity_audit.sql).
ALTER TABLE permitq.capacity_change
    ADD COLUMN old_parent text,
    ADD COLUMN new_parent text,
    ADD COLUMN old_guarantee integer,
    ADD COLUMN new_guarantee integer;

-- Functions whose signature changes here; their files make them again.
DROP FUNCTION IF EXISTS permitq.apply_decision(text, bigint[], bigint[], text[], bigint[]);
DROP FUNCTION IF EXISTS permitq.set_capacity(text, integer, boolean, interval, integer);
DROP FUNCTION IF EXISTS permitq.lock_batch_semaphores(text[]);

-- The gate permitq.set_capacity passes (a table lock of a table nobody may read): changes of
-- the tree (parents, guarantees, capacities) are made one at a time, so two of them cannot
-- together make a cycle or promise more than a parent holds. It holds no rows.
CREATE TABLE permitq.nesting_gate ();
DROP FUNCTION IF EXISTS permitq.explain(text);
