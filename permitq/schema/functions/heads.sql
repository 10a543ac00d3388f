-- Worker, after step 2: the heads, the waiters outside the caller's batch that fair semaphores
-- keep room for. The head of a fair semaphore is its waiter first in line
-- (functions/queue_order.sql): a later request may take capacity there only if what remains
-- still covers the head's count. Read as its own statement after the locks are held, so that
-- in READ COMMITTED it sees everything the previous holders of those locks committed.

-- Per locked semaphore, the first waiter outside the batch of every priority level (the caller
-- keeps the one first in line), and the requests no worker has examined yet that may be ahead
-- of the batch's (another worker holds them right now, or they were committed after the
-- caller's claim): the older ones, and younger ones of a higher priority than the lowest of the
-- batch (or than 0), since a younger request of priority p can only be ahead of a candidate of
-- priority q < p. Until someone examines them they count as waiting, so a concurrent batch
-- cannot slip past a request it has not seen. Unexamined rows are read defensively: one of
-- them may hold anything.
CREATE OR REPLACE FUNCTION permitq.semaphore_heads(semaphore_ids bigint[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer, effective bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off SET enable_seqscan = off AS $$
DECLARE
    floor_priority smallint := least(0, (SELECT min(r.priority) FROM permitq.permit_request r
                                         WHERE r.id = ANY(batch_ids)));
BEGIN
    RETURN QUERY
    SELECT s.name, w.request_id, w.count, permitq.effective_priority(w.priority, w.created_at)
    FROM unnest(semaphore_ids) AS locked(id)
    JOIN permitq.semaphore s ON s.id = locked.id
    CROSS JOIN LATERAL permitq.waiter_levels(locked.id) AS level(priority)
    CROSS JOIN LATERAL (
        SELECT wt.request_id, wt.count, wt.priority, wt.created_at FROM permitq.waiter wt
        WHERE wt.semaphore_id = locked.id AND wt.priority = level.priority
          AND wt.request_id <> ALL(batch_ids)
        ORDER BY wt.semaphore_id, wt.priority DESC, wt.created_at, wt.request_id -- waiter_line_idx
        LIMIT 1
    ) w;
    RETURN QUERY
    SELECT e.key, r.id,
           CASE WHEN jsonb_typeof(e.value) = 'number'
                     AND e.value::numeric BETWEEN 1 AND 2147483647
                THEN e.value::numeric::int ELSE 1 END,
           permitq.effective_priority(r.priority, r.created_at)
    FROM permitq.permit_request r
    CROSS JOIN LATERAL jsonb_each(CASE WHEN jsonb_typeof(r.permits) = 'object'
                                       THEN r.permits ELSE '{}'::jsonb END) e
    JOIN permitq.semaphore s ON s.name = e.key
    WHERE r.state = 'new' AND NOT r.examined
      AND (r.id < newest_id OR r.priority > floor_priority)
      AND r.id <> ALL(batch_ids)
      AND s.id = ANY(semaphore_ids);
END $$;
GRANT EXECUTE ON FUNCTION permitq.semaphore_heads(bigint[], bigint[], bigint) TO permitq_worker;

-- The same by semaphore name, so that the worker sends it in the same round trip as
-- lock_batch_semaphores (the server runs them in order: the heads are read after the locks).
CREATE OR REPLACE FUNCTION permitq.semaphore_heads_named(names text[], batch_ids bigint[], newest_id bigint)
RETURNS TABLE (semaphore text, request_id bigint, count integer, effective bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    RETURN QUERY
    SELECT h.semaphore, h.request_id, h.count, h.effective
    FROM permitq.semaphore_heads(
        ARRAY(SELECT s.id FROM permitq.semaphore s WHERE s.name = ANY(names) ORDER BY s.id),
        batch_ids, newest_id) h;
END $$;
GRANT EXECUTE ON FUNCTION permitq.semaphore_heads_named(text[], bigint[], bigint) TO permitq_worker;
