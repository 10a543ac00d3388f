-- The grant turn: one worker at a time runs grant batches (functions/next_batch.sql,
-- permitq.take_grant_turn). A table lock, as permitq.wake_gate: no rows, and no role but the
-- schema's owner may lock it (a producer cannot hold the turn to stall the workers).
CREATE TABLE permitq.grant_turn ();
