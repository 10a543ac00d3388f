-- Brings a database migrated by a pre-release permitq (migrations V1 to V8, before the schema
-- had one file per function) to the baseline, in place: its tables already hold the baseline's
-- columns and indexes. `migrate` runs this once, instead of V1__baseline.sql, then applies every
-- file of schema/functions/ as on a fresh database.

-- Every view and function the old migrations made (their triggers go with them, by CASCADE);
-- the function files make them again. The rules (`rule_*`) were written just before this.
DROP VIEW permitq.permit, permitq.semaphore_usage, permitq.holders, permitq.waiters;
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
             WHERE p.pronamespace = 'permitq'::regnamespace AND p.proname NOT LIKE 'rule\_%'
    LOOP
        EXECUTE format('DROP FUNCTION %s CASCADE', f);
    END LOOP;
END $$;

-- The bounds, now read from the rules; validated (the old ones were partly NOT VALID).
ALTER TABLE permitq.semaphore
    DROP CONSTRAINT semaphore_name_valid,
    DROP CONSTRAINT semaphore_per_valid,
    ADD CONSTRAINT semaphore_name_valid
        CHECK (name <> '' AND length(name) <= permitq.rule_max_name_length()),
    ADD CONSTRAINT semaphore_per_valid
        CHECK (per > interval '0' AND per <= permitq.rule_max_duration());
ALTER TABLE permitq.permit_request
    DROP CONSTRAINT permit_request_external_id_valid,
    DROP CONSTRAINT permit_request_ttl_valid,
    DROP CONSTRAINT permit_request_wait_valid,
    DROP CONSTRAINT permit_request_state_valid,
    DROP CONSTRAINT permit_request_error_code_valid,
    DROP CONSTRAINT permit_request_release_reason_valid,
    DROP CONSTRAINT permit_request_priority_valid,
    ADD CONSTRAINT permit_request_external_id_valid
        CHECK (external_id <> '' AND length(external_id) <= permitq.rule_max_name_length()),
    ADD CONSTRAINT permit_request_ttl_valid
        CHECK (ttl > interval '0' AND ttl <= permitq.rule_max_duration()),
    ADD CONSTRAINT permit_request_wait_valid
        CHECK (wait >= interval '0' AND wait <= permitq.rule_max_duration()),
    ADD CONSTRAINT permit_request_state_valid CHECK (state = ANY (permitq.rule_states())),
    ADD CONSTRAINT permit_request_error_code_valid
        CHECK (error_code = ANY (permitq.rule_error_codes())),
    ADD CONSTRAINT permit_request_release_reason_valid
        CHECK (release_reason = ANY (permitq.rule_release_reasons())),
    ADD CONSTRAINT permit_request_priority_valid
        CHECK (priority BETWEEN permitq.rule_priority_min() AND permitq.rule_priority_max());

-- The new bookkeeping table is readable like the old one.
GRANT SELECT ON permitq.schema_file TO permitq_producer, permitq_worker, permitq_admin;
