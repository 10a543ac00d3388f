-- Answers that say what to do: an errored request records the bound it hit, and workers record
-- that they are alive, so that "nothing is granting" can be said.

-- Set with `error_code`: a JSON object naming what the request hit (types::ErrorDetail): the
-- semaphore, the request's count there and the bound (capacity, template and max_instances),
-- the nearest existing names for an unknown one, or what made a stored row undecidable.
ALTER TABLE permitq.permit_request ADD COLUMN error_detail jsonb;

-- One row per running worker, written every few seconds by the worker beside its claim loop
-- (never on the grant path) and ended (`live_until = now()`) when it stops cleanly. A row whose `live_until` has
-- passed belongs to a worker that died or cannot reach the database. Unlogged: not data, written
-- again within seconds after a crash or a failover, and writing it costs no WAL flush.
CREATE UNLOGGED TABLE permitq.worker_seen (
    worker_id  text PRIMARY KEY,
    host       text NOT NULL,
    version    text NOT NULL,
    pid        integer NOT NULL,
    started_at timestamptz NOT NULL,
    seen_at    timestamptz NOT NULL,
    live_until timestamptz NOT NULL
);
GRANT SELECT, INSERT, UPDATE, DELETE ON permitq.worker_seen TO permitq_worker;

-- Functions whose signature changes here; their files make them again.
DROP FUNCTION IF EXISTS permitq.apply_decision(text, bigint[], bigint[], text[], bigint[], jsonb);
DROP FUNCTION IF EXISTS permitq.settle_invalid(bigint);
