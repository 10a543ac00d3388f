-- Which workers run: each writes its row of permitq.worker_seen every few seconds beside its
-- claim loop (src/worker.rs, `WORKER_SEEN`), never on the grant path, and ends it (`live_until`) when it
-- stops cleanly. When no row is live, nothing is granting: `explain`, `semaphore show`, `top`, the
-- status page, `/readyz` and `submit --await` say so.

-- Every worker seen in the last hour, live first: one whose row is past `live_until` died or
-- cannot reach the database; `max_hold`, its --max-hold (NULL: none, or a worker of a release
-- before migration 17); `stopped_at`, when it stopped cleanly: a stop ends its row's life at once
-- (src/sql.rs WORKER_GONE), within a few seconds of its last sign of life, while a live row's
-- reaches 8 s past it.
CREATE OR REPLACE VIEW permitq.workers AS
SELECT w.worker_id, w.host, w.version, w.pid, w.started_at, w.seen_at,
       w.live_until > now() AS live, w.max_hold,
       CASE WHEN w.live_until < w.seen_at + interval '5 seconds' THEN w.live_until END AS stopped_at
FROM permitq.worker_seen w
WHERE w.seen_at > now() - interval '1 hour';
GRANT SELECT ON permitq.workers TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- Whether anything is granting: the live workers, and when any worker was last seen (NULL: none
-- in the last hour). One row; any permitq role may call it. A worker of a release before this
-- file writes no worker_seen row; during a rolling upgrade it counts by its wake row
-- (functions/notifications.sql) while that row's `awake_by` holds.
CREATE OR REPLACE FUNCTION permitq.granting(OUT live_workers integer, OUT last_seen timestamptz)
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT (SELECT count(*) FROM permitq.worker_seen w WHERE w.live_until > now())::integer
           + (SELECT count(*) FROM permitq.worker_wake k
              WHERE k.awake_by > now()
                AND NOT EXISTS (SELECT 1 FROM permitq.worker_seen w
                                WHERE w.worker_id = k.worker_id))::integer,
           (SELECT max(w.seen_at) FROM permitq.worker_seen w)
$$;
GRANT EXECUTE ON FUNCTION permitq.granting()
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;
