-- The requests waiting on our locked semaphores that are not in our batch, oldest first per
-- semaphore: the heads fair semaphores must keep room for.
-- $1 locked semaphore ids, $2 our batch's request ids, $3 our batch's newest id.
-- Runs as its own statement after the locks are held: in READ COMMITTED it then sees everything
-- committed by the previous holders of those locks (a snapshot taken before waiting would not).
--
-- Part 1: each semaphore's oldest recorded waiter (permitq.waiter, written under the lock).
SELECT s.name, w.request_id, w.count
FROM unnest($1::bigint[]) AS locked(id)
JOIN permitq.semaphore s ON s.id = locked.id
CROSS JOIN LATERAL (
    SELECT request_id, count FROM permitq.waiter
    WHERE semaphore_id = locked.id AND request_id <> ALL($2)
    ORDER BY request_id
    LIMIT 1
) w
UNION ALL
-- Part 2: older pending requests no worker has examined yet (another worker holds them right
-- now, or they were committed after our claim). Until someone examines them they count as
-- waiting, so a concurrent batch cannot slip past an older request it has not seen.
SELECT e.key, r.id, e.value::int
FROM permitq.permit_request r
CROSS JOIN LATERAL jsonb_each(r.permits) e
JOIN permitq.semaphore s ON s.name = e.key
WHERE r.state = 'new' AND NOT r.examined AND r.id < $3 AND r.id <> ALL($2)
  AND s.id = ANY($1)
