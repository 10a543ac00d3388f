-- Tokens never go backwards whatever is restored where (functions/fencing_tokens.sql). The epoch
-- row also records the database and the token sequence it was written for: a restore into
-- another database of the cluster, or in place with `pg_restore --clean`, makes both anew, so
-- the copy moves its epoch on although the cluster and the timeline are the same. And a floor
-- every token drawn must be above: the highest token of the requests retention deleted (a
-- sequence set back after the rows that held its tokens are gone is still seen), or what an
-- operator raised it to (`permitq tokens raise --above N`).
ALTER TABLE permitq.token_epoch
    ADD COLUMN database_oid    oid,
    ADD COLUMN sequence_oid    oid,
    ADD COLUMN token_floor bigint NOT NULL DEFAULT 0;
UPDATE permitq.token_epoch
SET database_oid = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database()),
    sequence_oid = 'permitq.fencing_token_seq'::regclass::oid;

-- Retention deletes fence rows untouched for as long as settled requests are kept
-- (functions/retention.sql), oldest first.
CREATE INDEX fence_token_updated_idx ON permitq.fence_token (updated_at);

-- A fenced resource is guarded by one semaphore (functions/fence.sql): the first fence that
-- names one binds it; NULL for a resource only the two-argument fence has used.
ALTER TABLE permitq.fence_token ADD COLUMN semaphore text;

-- Reads follow ownership: producers read only their own requests, through every view as through
-- the table; operators (`permitq serve`, `top`) read all, and write nothing: a role of their own.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'permitq_operator') THEN
        BEGIN
            CREATE ROLE permitq_operator NOLOGIN;
        EXCEPTION
            WHEN duplicate_object OR unique_violation THEN NULL;
            WHEN insufficient_privilege THEN
                RAISE EXCEPTION 'permitq migrate needs the role permitq_operator, and % may not create roles', current_user
                    USING ERRCODE = '42501',
                          HINT = 'run migrate once as a role with CREATEROLE, or have a DBA run: CREATE ROLE permitq_operator NOLOGIN;';
        END;
    END IF;
END $$;
GRANT USAGE ON SCHEMA permitq TO permitq_operator;
GRANT SELECT ON permitq.semaphore, permitq.permit_request, permitq.capacity_change,
    permitq.schema_migration, permitq.schema_file, permitq.token_epoch, permitq.notify_skipped_seq
    TO permitq_operator;
ALTER POLICY permit_request_read ON permitq.permit_request
    USING (submitted_by = session_user
           OR (SELECT pg_catalog.pg_has_role(session_user, 'permitq_admin', 'MEMBER')
                   OR pg_catalog.pg_has_role(session_user, 'permitq_worker', 'MEMBER')
                   OR pg_catalog.pg_has_role(session_user, 'permitq_operator', 'MEMBER')));
