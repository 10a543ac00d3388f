-- Trust: nothing a stranger can block, requests owned by their producer, tokens that never go
-- backwards, bounded counts.

-- Who submitted each request (the session's login role): only it, or an admin, may release,
-- heartbeat or cancel it, and producers read only their own (row-level security below).
ALTER TABLE permitq.permit_request
    ADD COLUMN submitted_by text NOT NULL DEFAULT session_user,
    -- NOT VALID: a request stored before the bound keeps its owner; new ones are bounded.
    ADD CONSTRAINT permit_request_owner_valid
        CHECK (length(owner) <= permitq.rule_max_name_length()) NOT VALID;

-- The queue within a priority level in place-in-line order (functions/queue_order.sql):
-- created_at, then id. An id is drawn a moment before created_at, so two concurrent inserts can
-- have them in opposite orders; the decision ranks by created_at, and so must the heads.
DROP INDEX permitq.waiter_line_idx;
CREATE INDEX waiter_line_idx ON permitq.waiter (semaphore_id, priority DESC, created_at, request_id);

-- Functions and views whose signature changes here; their files make them again.
DROP VIEW IF EXISTS permitq.semaphore_usage;
DROP FUNCTION IF EXISTS permitq.apply_decision(text, bigint[], bigint[], text[], bigint[]);
DROP FUNCTION IF EXISTS permitq.notify_events(bigint[]);
DROP FUNCTION IF EXISTS permitq.lock_batch_semaphores(text[]);
DROP FUNCTION IF EXISTS permitq.make_instances(text[]);
DROP FUNCTION IF EXISTS permitq.set_capacity(text, integer, boolean, interval);

-- Held counts of a rate-limited semaphore are not bounded by its capacity (it bounds grants per
-- window): 64-bit, like `granted`.
ALTER TABLE permitq.semaphore ALTER COLUMN used TYPE bigint;

-- Producers and workers see their own requests; admins and workers see all. The table's owner
-- (every SECURITY DEFINER function, and the views) is not subject to it.
ALTER TABLE permitq.permit_request ENABLE ROW LEVEL SECURITY;
CREATE POLICY permit_request_read ON permitq.permit_request FOR SELECT
    USING (submitted_by = session_user
           OR (SELECT pg_catalog.pg_has_role(session_user, 'permitq_admin', 'MEMBER')
                   OR pg_catalog.pg_has_role(session_user, 'permitq_worker', 'MEMBER')));
CREATE POLICY permit_request_insert ON permitq.permit_request FOR INSERT
    WITH CHECK (submitted_by = session_user);
GRANT INSERT (submitted_by) ON permitq.permit_request TO permitq_producer, permitq_admin;

-- The gate producers pass while they decide whether to wake a sleeping worker (a table lock of
-- a table nobody may read, instead of an advisory key any role can take): see
-- functions/notifications.sql. It holds no rows.
CREATE TABLE permitq.wake_gate ();

-- One row per maintenance task: a worker runs one only while it holds the row's lock
-- (FOR UPDATE SKIP LOCKED), so one worker at a time runs each (functions/sweeps.sql).
CREATE TABLE permitq.maintenance_turn (
    task text PRIMARY KEY
);
INSERT INTO permitq.maintenance_turn (task) VALUES
    ('wait_deadlines'), ('expired'), ('stale'), ('liveness'), ('retention'), ('audit_retention'),
    ('idle_instances');

-- The epoch of fencing tokens (functions/fencing_tokens.sql): one row. Tokens issued before it
-- had the timeline as their epoch, so it starts at the timeline (or above every token still
-- stored or remembered by a fence), and the sequence goes on.
CREATE TABLE permitq.token_epoch (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    -- The epoch in force at timeline `timeline`; each later timeline adds one.
    epoch       bigint NOT NULL CHECK (epoch BETWEEN 1 AND 32767),
    timeline    bigint NOT NULL,
    -- The cluster it was recorded on: another one (restored, upgraded, replicated into) moves
    -- the epoch on.
    system_id   bigint NOT NULL
);
INSERT INTO permitq.token_epoch (epoch, timeline, system_id)
SELECT greatest(tl.id,
                coalesce((SELECT max(fencing_token) >> 48 FROM permitq.permit_request), 0),
                coalesce((SELECT max(token) >> 48 FROM permitq.fence_token), 0)),
       tl.id,
       (SELECT system_identifier FROM pg_catalog.pg_control_system())
FROM (SELECT ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint AS id) tl;

-- Notifications not sent because the cluster's NOTIFY queue was filling up (see
-- functions/notifications.sql), counted for the workers' metrics: a sequence, which counts
-- without locking anything (a row would serialize every skipping transaction behind it).
CREATE SEQUENCE permitq.notify_skipped_seq AS bigint;
GRANT SELECT ON permitq.notify_skipped_seq, permitq.token_epoch
    TO permitq_producer, permitq_worker, permitq_admin;

-- Instances per template: bounded, settable on the template (NULL: rule_max_instances()).
ALTER TABLE permitq.semaphore
    ADD COLUMN max_instances integer
        CONSTRAINT semaphore_max_instances_valid CHECK (max_instances >= 0);
