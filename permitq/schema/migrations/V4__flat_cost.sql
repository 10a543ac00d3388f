-- Flat cost: what a batch reads no longer grows with the backlog, the semaphores, or the grants
-- in a rate window.

-- The unexamined requests in place-in-line order (rule_place_in_line, functions/queue_order.sql):
-- workers claim them best placed first (functions/claim.sql), and a batch reads only those that
-- can be ahead of its own (functions/heads.sql). It replaces the indexes by id and by priority.
CREATE INDEX permit_request_unexamined_place_idx
    ON permitq.permit_request (permitq.rule_place_in_line(priority, created_at) DESC)
    WHERE state = 'new' AND NOT examined;
DROP INDEX permitq.permit_request_unexamined_priority_idx;
DROP INDEX permitq.permit_request_unexamined_idx;

-- Rate windows in buckets: a bucket holds the permits granted on one semaphore up to its
-- `ends_at` (functions/rate_windows.sql), so a window is at most ~65 rows however many grants
-- it holds. The logged grants carry over, each as a bucket ending when it was granted.
CREATE TABLE permitq.rate_bucket (
    semaphore_id bigint NOT NULL REFERENCES permitq.semaphore (id) ON DELETE CASCADE,
    ends_at      timestamptz NOT NULL,
    count        bigint NOT NULL,
    PRIMARY KEY (semaphore_id, ends_at)
);
INSERT INTO permitq.rate_bucket (semaphore_id, ends_at, count)
SELECT semaphore_id, granted_at, sum(count) FROM permitq.rate_grant GROUP BY 1, 2;
DROP FUNCTION IF EXISTS permitq.in_window(permitq.semaphore);
DROP VIEW IF EXISTS permitq.semaphore_usage;
DROP TABLE permitq.rate_grant;

-- Functions whose signature changes here, or that are gone; their files make the new ones.
DROP FUNCTION IF EXISTS permitq.semaphore_heads_named(text[], bigint[], bigint);
DROP FUNCTION IF EXISTS permitq.semaphore_heads(bigint[], bigint[], bigint);
DROP FUNCTION IF EXISTS permitq.effective_priority(smallint, timestamptz);

-- Queue tables: a request's partial-index entries (pending, unexamined) die when it is decided,
-- and scans of those indexes read them until a vacuum removes them. Vacuum them after a bounded
-- number of changes, not after a fifth of the table (the default), which grows with history.
ALTER TABLE permitq.permit_request
    SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 2000,
         autovacuum_vacuum_insert_scale_factor = 0.01, autovacuum_vacuum_insert_threshold = 2000);
ALTER TABLE permitq.waiter
    SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE permitq.pending_release
    SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
