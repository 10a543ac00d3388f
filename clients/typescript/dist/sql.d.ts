/** Every statement the client sends, named (the contract test prepares each one). */
export declare const SQL: {
    readonly submit: "SELECT id::text, external_id, permits, owner, state, error_code, error_detail, release_reason, fencing_token::text, acquired_at, expires_at, released_at, extract(epoch FROM ttl)::float8 AS ttl, extract(epoch FROM wait)::float8 AS wait, priority, fairness_key, fairness_weight FROM permitq.submit($1, $2::jsonb, owner => $3, ttl => make_interval(secs => $4),\n                                               wait => make_interval(secs => $5), priority => $6,\n                                               fairness_key => $7, fairness_weight => $8)";
    readonly status: "SELECT id::text, external_id, permits, owner, state, error_code, error_detail, release_reason, fencing_token::text, acquired_at, expires_at, released_at, extract(epoch FROM ttl)::float8 AS ttl, extract(epoch FROM wait)::float8 AS wait, priority, fairness_key, fairness_weight FROM permitq.status($1)";
    readonly statusAndBarrier: "SELECT id::text, external_id, permits, owner, state, error_code, error_detail, release_reason, fencing_token::text, acquired_at, expires_at, released_at, extract(epoch FROM ttl)::float8 AS ttl, extract(epoch FROM wait)::float8 AS wait, priority, fairness_key, fairness_weight, current_setting('synchronous_standby_names') <> '' OR pg_is_in_recovery() AS barrier\n                     FROM permitq.status($1)";
    readonly release: "SELECT permitq.release($1) AS outcome";
    readonly releaseReporting: "SELECT permitq.release($1, $2, make_interval(secs => $3::float8)) AS outcome";
    readonly heartbeat: "SELECT permitq.heartbeat($1, make_interval(secs => $2)) AS until";
    readonly report: "SELECT permitq.report($1, $2, make_interval(secs => $3::float8)) AS kept";
    readonly explain: "SELECT request, state, outcome, semaphore, needs, capacity, free, shortfall, position::int,\n                   permits_ahead::int, reason, holders, extract(epoch FROM estimated_wait)::float8 AS estimated,\n                   fairness\n            FROM permitq.explain($1)";
    readonly setCapacity: "SELECT name, capacity, used::int FROM permitq.set_capacity($1, $2, fair => $3,\n                  per => make_interval(secs => $4), max_instances => $5, parent => $6, guarantee => $7)";
    readonly setCapacityAdaptive: "SELECT name, capacity, used::int FROM permitq.set_capacity($1, $2, fair => $3,\n                  per => make_interval(secs => $4), max_instances => $5, parent => $6, guarantee => $7,\n                  adaptive => $8::jsonb)";
    readonly confirmDurable: "SELECT permitq.confirm_durable()";
    readonly granting: "SELECT live_workers, extract(epoch FROM clock_timestamp() - last_seen)::float8 AS seen_ago, current_database()::text AS database FROM permitq.granting()";
    readonly leaseHeartbeat: "SELECT permitq.heartbeat($1, NULL)";
};
