-- Triggers on permit_request: whatever path inserts a request (submit or a plain INSERT), it is
-- checked like submit checks it, starts as `new` with its wait deadline, wakes a sleeping worker,
-- and its permits never change afterwards.

-- Before INSERT: check and initialise. Before UPDATE OF permits: refuse the change.
CREATE OR REPLACE FUNCTION permitq.before_request_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    problem text;
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF NEW.permits IS DISTINCT FROM OLD.permits THEN
            RAISE EXCEPTION 'permits of a request cannot change' USING ERRCODE = '23514',
                CONSTRAINT = 'permit_request_permits_valid';
        END IF;
        RETURN NEW;
    END IF;
    problem := permitq.permits_problem(NEW.permits);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'new row for relation "permit_request" violates check constraint "permit_request_permits_valid"'
            USING ERRCODE = '23514', CONSTRAINT = 'permit_request_permits_valid', DETAIL = problem;
    END IF;
    problem := permitq.interval_problem(NEW.ttl, false);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid ttl: %', problem USING ERRCODE = '22023';
    END IF;
    problem := permitq.interval_problem(NEW.wait, true);
    IF problem IS NOT NULL THEN
        RAISE EXCEPTION 'invalid wait: %', problem USING ERRCODE = '22023';
    END IF;
    IF NEW.state <> 'new' OR NEW.fencing_token IS NOT NULL OR NEW.acquired_at IS NOT NULL
       OR NEW.examined THEN
        RAISE EXCEPTION 'invalid permit_request: new requests must be inserted in state new'
            USING ERRCODE = '22023';
    END IF;
    -- A weight is a key's share.
    IF NEW.fairness_weight IS NOT NULL AND NEW.fairness_key IS NULL THEN
        RAISE EXCEPTION 'invalid fairness_weight: it is the weight of a fairness_key, and none was given'
            USING ERRCODE = '22023',
                  HINT = 'give the key too (fairness_key => ''tenant-a''), or leave the weight out';
    END IF;
    NEW.created_at := clock_timestamp();
    NEW.submitted_by := session_user;
    -- wait = 0 is fail fast, decided when a worker first sees it: no deadline to sweep.
    NEW.wait_until := CASE WHEN NEW.wait > interval '0' THEN NEW.created_at + NEW.wait END;
    RETURN NEW;
END $$;

CREATE OR REPLACE TRIGGER permit_request_before_insert BEFORE INSERT ON permitq.permit_request
    FOR EACH ROW EXECUTE FUNCTION permitq.before_request_insert();
CREATE OR REPLACE TRIGGER permit_request_permits_unchanged
    BEFORE UPDATE OF permits ON permitq.permit_request
    FOR EACH ROW EXECUTE FUNCTION permitq.before_request_insert();

-- After INSERT, once per statement: wake a sleeping worker. No transition table: a statement
-- that inserted nothing (ON CONFLICT DO NOTHING) may wake one for nothing, which is harmless.
CREATE OR REPLACE FUNCTION permitq.wake_workers_after_insert() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    PERFORM permitq.wake_workers();
    RETURN NULL;
END $$;

CREATE OR REPLACE TRIGGER permit_request_after_insert AFTER INSERT ON permitq.permit_request
    FOR EACH STATEMENT EXECUTE FUNCTION permitq.wake_workers_after_insert();
