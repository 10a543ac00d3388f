-- When a worker first examined each request, and when the transaction that granted or failed it
-- began: what operators ask ("was it ever looked at?") and what the fault suite's checkers judge
-- liveness and fairness by. Written by permitq.apply_decision and permitq.settle_invalid.
ALTER TABLE permitq.permit_request
    ADD COLUMN examined_at timestamptz,
    ADD COLUMN decided_at timestamptz;
