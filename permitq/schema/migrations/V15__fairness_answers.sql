-- `permitq.explain` returns one column more (`fairness`: what its fairness key did to its place
-- on a keyed semaphore), and `permitq.key_shares` one more (`placed_back`: how far back a key's
-- next request goes), so their files cannot replace them in place: dropped here, made again by
-- functions/explain.sql and functions/fairness.sql with their grants. Callers name the columns
-- they read, so a client of the release before reads the new functions unchanged.
DROP FUNCTION IF EXISTS permitq.explain(text);
DROP FUNCTION IF EXISTS permitq.key_shares(text);
