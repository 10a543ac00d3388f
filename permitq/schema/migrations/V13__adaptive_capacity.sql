-- Adaptive capacity (functions/adaptive.sql): a semaphore whose capacity the workers set, on a
-- fixed cadence, from the outcomes its holders report.

-- Which semaphores adapt, between what bounds, by which algorithm, and when a cadence last
-- applied its reports (a cadence deletes the reports it reads in the transaction that changes the
-- capacity: a worker dying mid-cadence loses none, two workers never apply the same one, and a
-- report committed late is applied by the next cadence).
CREATE TABLE permitq.adaptive_limit (
    semaphore_id    bigint PRIMARY KEY REFERENCES permitq.semaphore (id) ON DELETE CASCADE,
    algorithm       text NOT NULL CONSTRAINT adaptive_limit_algorithm_valid
                        CHECK (algorithm IN ('aimd', 'gradient')),
    floor           integer NOT NULL CONSTRAINT adaptive_limit_floor_valid CHECK (floor >= 1),
    ceiling         integer NOT NULL,
    CONSTRAINT adaptive_limit_bounds_valid CHECK (ceiling >= floor),
    applied_at      timestamptz NOT NULL DEFAULT now(),
    -- What the algorithm carries from one cadence to the next (a gradient's long-term latency).
    memory          jsonb NOT NULL DEFAULT '{}',
    -- The last cadence that had reports: its inputs, when, and the capacity before and after
    -- (a cadence that keeps the capacity writes no audit row; this says what it counted).
    last_reports    jsonb
);

-- The holders' reports: at most one per request and adaptive semaphore it held (a report while
-- it holds is replaced by the one at its release), so that a holder's weight is its grants, not
-- its calls. Deleted by the cadence that applies them, and with their semaphore.
CREATE TABLE permitq.outcome_report (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    semaphore_id bigint NOT NULL REFERENCES permitq.semaphore (id) ON DELETE CASCADE,
    request_id   bigint NOT NULL,
    outcome      text NOT NULL CONSTRAINT outcome_report_outcome_valid
                     CHECK (outcome IN ('ok', 'overloaded', 'failed')),
    latency_ms   real CONSTRAINT outcome_report_latency_valid CHECK (latency_ms >= 0),
    reported_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX outcome_report_semaphore_idx ON permitq.outcome_report (semaphore_id, id);
CREATE UNIQUE INDEX outcome_report_request_idx ON permitq.outcome_report (request_id, semaphore_id);

GRANT SELECT ON permitq.adaptive_limit
    TO permitq_producer, permitq_worker, permitq_admin, permitq_operator;

-- permitq.set_capacity gains `adaptive` (functions/set_capacity.sql): its file makes it again,
-- with its grants; calls naming the parameters it had, or giving them by position, still resolve.
DROP FUNCTION IF EXISTS permitq.set_capacity(text, integer, boolean, interval, integer, text, integer);

-- permitq.release gains `outcome` and `latency` (functions/release.sql, one definition); a call
-- with the external id alone still resolves.
DROP FUNCTION IF EXISTS permitq.release(text);

-- An adaptive change's inputs, beside its `changed_by` ('adaptive (aimd)').
ALTER TABLE permitq.capacity_change ADD COLUMN inputs jsonb;
