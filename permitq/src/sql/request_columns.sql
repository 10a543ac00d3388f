-- The columns of permitq.permit_request as types::PermitRequest reads them; intervals travel as
-- microseconds (tokio-postgres has no interval type).
id, external_id, permits, owner,
(extract(epoch FROM ttl) * 1000000)::int8 AS ttl_us,
(extract(epoch FROM wait) * 1000000)::int8 AS wait_us,
priority, fairness_key, fairness_weight, state, error_code, release_reason, fencing_token, worker_id,
created_at, acquired_at, expires_at, heartbeat_at, released_at, settled_at, examined_at,
decided_at, error_detail, submitted_by
