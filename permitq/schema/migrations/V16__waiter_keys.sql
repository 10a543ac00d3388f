-- `permitq.first_waiters` returns one column more (`fairness_key`: each waiter's key, so that
-- `semaphore show`, the status page and the API say whose request stands where on a semaphore
-- served by key), so its file cannot replace it in place: dropped here, made again by
-- functions/views.sql with its grant. Callers name the columns they read, so a client of the
-- release before reads the new function unchanged. (The `permitq.waiters` view gains the same
-- column at its end, in place.)
DROP FUNCTION IF EXISTS permitq.first_waiters(text, integer);
