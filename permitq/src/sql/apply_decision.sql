-- Write a batch's outcome in one round trip (see permitq.apply_decision in
-- schema/functions/decision_outcome.sql).
-- $1 worker id, $2 granted ids, $3 errored ids, $4 their error codes, $5 waiting ids,
-- $6 what the nested ones take, by request id, $7 the failed ones' details, by request id.
SELECT permitq.apply_decision($1, $2, $3, $4, $5, $6, $7)
