-- Lock order step 2 for a batch claimed stepwise (see permitq.lock_batch_and_heads in
-- schema/functions/next_batch.sql): make the batch's missing template instances, lock its
-- semaphores (with their ancestors) in ascending id, fold the pending releases, then read the
-- heads. Rows of kind 's' are the semaphores, 'h' the heads. $1 the claimed requests' permits,
-- $2 their places in line, $3 their ids, in one order. Rows of kind 'k' are the batch's keyed
-- semaphores: as after permitq.next_batch, the worker decides on arrival order first and places
-- the batch by key (place_batch_by_keys.sql) when the order matters (functions/fairness.sql).
SELECT kind, semaphore_id, name, capacity, used, fair, parent, guarantee, active,
       head_request_id, head_count, effective
FROM permitq.lock_batch_and_heads($1, $2, $3, false)
