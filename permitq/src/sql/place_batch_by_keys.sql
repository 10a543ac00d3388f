-- Worker step 2b, when the decision on arrival order needed the order (see
-- permitq.place_batch_by_keys in schema/functions/next_batch.sql): place the batch's unexamined
-- requests by key, under the semaphore locks step 2 took, and read the heads again (not on
-- the semaphores without room, $4). Rows of kind 'r' are a request's id and the place the
-- decision ranks it by (`effective`), 'h' the heads. $1 the claimed requests' permits, $2 their
-- places in line, $3 their ids, in one order.
SELECT kind, id, name, head_request_id, head_count, effective
FROM permitq.place_batch_by_keys($1, $2, $3, $4)
