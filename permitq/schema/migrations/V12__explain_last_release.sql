-- `permitq.explain` returns one column more (`last_released_at`: the last release its estimate
-- was made from), so its file cannot replace it in place: dropped here, made again by
-- functions/explain.sql with its grants.
DROP FUNCTION IF EXISTS permitq.explain(text);
