-- Fairness keys (functions/fairness.sql): within a semaphore that opts in, the line is served
-- across the requests' fairness keys (tenants) in proportion to their weights, by start-time
-- fair queuing, and in arrival order within a key.

-- What a request asked: its key (none is a key of its own) and its weight. Checked once, here.
ALTER TABLE permitq.permit_request
    ADD COLUMN fairness_key text
        CONSTRAINT permit_request_fairness_key_valid
            CHECK (fairness_key <> ''
                   AND length(fairness_key) <= permitq.rule_max_fairness_key_length()),
    ADD COLUMN fairness_weight integer
        CONSTRAINT permit_request_fairness_weight_valid
            CHECK (fairness_weight BETWEEN permitq.rule_fairness_weight_min()
                                       AND permitq.rule_fairness_weight_max());

-- The semaphores whose lines are served by key, each with its virtual time: the largest start
-- tag granted there (a key that was idle starts there, so it is not punished for what it used
-- alone, nor owed what it did not ask for).
CREATE TABLE permitq.keyed_semaphore (
    semaphore_id bigint PRIMARY KEY REFERENCES permitq.semaphore (id) ON DELETE CASCADE,
    virtual_time timestamptz NOT NULL DEFAULT clock_timestamp()
) WITH (fillfactor = 50);

-- Each key's finish tag on a keyed semaphore: where its next request starts, unless the
-- virtual time has passed it; and the latest place in line it gave one of the key's requests
-- (the key's next request is placed no earlier: arrival order within a key). A row at or behind
-- the virtual time whose place has passed says nothing more than no row, so such rows may be
-- deleted at any time (the retention sweep does).
-- (No foreign key: a check per row examined. permitq.set_fairness_keys deletes a semaphore's
-- rows when it stops serving by key, and retention those of a semaphore deleted since.)
CREATE TABLE permitq.key_finish (
    semaphore_id bigint NOT NULL,
    fairness_key text NOT NULL,
    finish       timestamptz NOT NULL,
    placed_until timestamptz NOT NULL,
    PRIMARY KEY (semaphore_id, fairness_key)
-- Room on each page for its rows' next versions: a batch rewrites them (HOT, no index entry).
) WITH (fillfactor = 50);

-- A waiter's created_at is where it stands in line: its arrival, moved back by `place_offset`
-- when a keyed semaphore placed the request (the same on each of its rows, and only there: the
-- request's own row is not rewritten for it); and its start tag there (a grant moves the
-- virtual time to it).
ALTER TABLE permitq.waiter ADD COLUMN place_offset interval, ADD COLUMN start_tag timestamptz;

GRANT SELECT ON permitq.keyed_semaphore, permitq.key_finish
    TO permitq_worker, permitq_admin, permitq_operator;

-- permitq.submit gains `fairness_key` and `fairness_weight` (functions/submit.sql makes it
-- again with its grants); calls by position or by the names it had still resolve.
DROP FUNCTION IF EXISTS permitq.submit(text, jsonb, text, interval, interval, integer);

-- A plain INSERT may name them too (the contract's insert point).
GRANT INSERT (fairness_key, fairness_weight) ON permitq.permit_request
    TO permitq_producer, permitq_admin;

-- permitq.next_batch returns each claimed request's `ranked` place too (functions/next_batch.sql
-- makes it again): its place in line once a keyed semaphore has placed it.
DROP FUNCTION IF EXISTS permitq.next_batch(bigint, bigint);
