-- Each worker's --max-hold beside its liveness row (functions/workers.sql): `explain` says when
-- a holder without a lease is released as stale, and that none is while no running worker has
-- one. NULL: the worker has none, or is of a release before (it writes the columns it knows).
ALTER TABLE permitq.worker_seen ADD COLUMN IF NOT EXISTS max_hold interval;
