/** Every statement the client sends, named (the contract test prepares each one). */

const COLUMNS =
  "id::text, external_id, permits, owner, state, error_code, error_detail, release_reason, " +
  "fencing_token::text, acquired_at, expires_at, released_at, " +
  "extract(epoch FROM ttl)::float8 AS ttl, extract(epoch FROM wait)::float8 AS wait, priority, " +
  "fairness_key, fairness_weight";

export const SQL = {
  submit: `SELECT ${COLUMNS} FROM permitq.submit($1, $2::jsonb, owner => $3, ttl => make_interval(secs => $4),
                                               wait => make_interval(secs => $5), priority => $6,
                                               fairness_key => $7, fairness_weight => $8)`,
  status: `SELECT ${COLUMNS} FROM permitq.status($1)`,
  // And whether permitq.confirm_durable would do anything in this session (synchronous standbys
  // are named, or this is a standby, where it refuses): read beside the outcome an acquire waits
  // on, so that a server without synchronous standbys costs no extra round trip.
  statusAndBarrier: `SELECT ${COLUMNS}, current_setting('synchronous_standby_names') <> '' OR pg_is_in_recovery() AS barrier
                     FROM permitq.status($1)`,
  release: "SELECT permitq.release($1) AS outcome",
  releaseReporting: "SELECT permitq.release($1, $2, make_interval(secs => $3::float8)) AS outcome",
  heartbeat: "SELECT permitq.heartbeat($1, make_interval(secs => $2)) AS until",
  report: "SELECT permitq.report($1, $2, make_interval(secs => $3::float8)) AS kept",
  explain: `SELECT request, state, outcome, semaphore, needs, capacity, free, shortfall, position::int,
                   permits_ahead::int, reason, holders, extract(epoch FROM estimated_wait)::float8 AS estimated,
                   fairness
            FROM permitq.explain($1)`,
  setCapacity: `SELECT name, capacity, used::int FROM permitq.set_capacity($1, $2, fair => $3,
                  per => make_interval(secs => $4), max_instances => $5, parent => $6, guarantee => $7)`,
  // With `adaptive` only when it is given: a change without it works on a schema from before it.
  setCapacityAdaptive: `SELECT name, capacity, used::int FROM permitq.set_capacity($1, $2, fair => $3,
                  per => make_interval(secs => $4), max_instances => $5, parent => $6, guarantee => $7,
                  adaptive => $8::jsonb)`,
  confirmDurable: "SELECT permitq.confirm_durable()",
  granting:
    "SELECT live_workers, extract(epoch FROM clock_timestamp() - last_seen)::float8 AS seen_ago, current_database()::text AS database FROM permitq.granting()",
  leaseHeartbeat: "SELECT permitq.heartbeat($1, NULL)",
} as const;
