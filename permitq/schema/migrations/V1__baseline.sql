-- The permitq tables, indexes, sequence, roles and table grants. DDL only: every function,
-- trigger and view is defined in schema/functions/, and the rules the CHECK constraints name
-- (`permitq.rule_*`) are written by `migrate` from the Rust constants in src/rules.rs.
--
-- Lock order, for every transaction that changes a semaphore's `used`:
--   1. permit_request rows (the worker claims them FOR UPDATE SKIP LOCKED; release and the sweeps
--      lock their own requests first);
--   2. then semaphore rows, FOR UPDATE, in ascending semaphore id.
-- One global order, so the worker, release, set_capacity and the sweeps cannot deadlock.

-- Semaphores, their templates (a name ending in `*`) and the instances made from them.
CREATE TABLE permitq.semaphore (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text NOT NULL UNIQUE
                CONSTRAINT semaphore_name_valid
                    CHECK (name <> '' AND length(name) <= permitq.rule_max_name_length()),
    capacity    integer NOT NULL CONSTRAINT semaphore_capacity_valid CHECK (capacity >= 0),
    -- Permits held, as the workers count them: grants add under this row's lock, releases are
    -- folded off later (pending_release), so it may run ahead of the exact held count, never
    -- behind it.
    used        integer NOT NULL DEFAULT 0 CONSTRAINT semaphore_used_valid CHECK (used >= 0),
    fair        boolean NOT NULL DEFAULT true,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    -- Grants so far (operators read its rate).
    granted     bigint NOT NULL DEFAULT 0,
    is_template boolean NOT NULL DEFAULT false,
    -- For an instance, the template it was made from.
    template    text,
    -- For a rate-limited semaphore, its window: at most `capacity` permits granted in any `per`.
    per         interval
                CONSTRAINT semaphore_per_valid
                    CHECK (per > interval '0' AND per <= permitq.rule_max_duration())
);
CREATE INDEX semaphore_template_idx ON permitq.semaphore (name) WHERE is_template;
CREATE INDEX semaphore_instance_idx ON permitq.semaphore (template, updated_at)
    WHERE template IS NOT NULL;
CREATE INDEX semaphore_rate_limited_idx ON permitq.semaphore (id) WHERE per IS NOT NULL;

-- The queue: one row per permit request, for its whole life.
CREATE TABLE permitq.permit_request (
    -- Arrival order.
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    external_id    text NOT NULL
                   CONSTRAINT permit_request_external_id_key UNIQUE
                   CONSTRAINT permit_request_external_id_valid
                       CHECK (external_id <> '' AND length(external_id) <= permitq.rule_max_name_length()),
    -- Checked on insert and frozen by trigger (functions/request_triggers.sql).
    permits        jsonb NOT NULL,
    owner          text,
    ttl            interval
                   CONSTRAINT permit_request_ttl_valid
                       CHECK (ttl > interval '0' AND ttl <= permitq.rule_max_duration()),
    wait           interval
                   CONSTRAINT permit_request_wait_valid
                       CHECK (wait >= interval '0' AND wait <= permitq.rule_max_duration()),
    state          text NOT NULL DEFAULT 'new'
                   CONSTRAINT permit_request_state_valid CHECK (state = ANY (permitq.rule_states())),
    error_code     text
                   CONSTRAINT permit_request_error_code_valid
                       CHECK (error_code = ANY (permitq.rule_error_codes())),
    release_reason text
                   CONSTRAINT permit_request_release_reason_valid
                       CHECK (release_reason = ANY (permitq.rule_release_reasons())),
    fencing_token  bigint,
    -- Set once a worker has looked at the request and left it waiting (it is then in `waiter`).
    examined       boolean NOT NULL DEFAULT false,
    -- The worker that granted or failed the request.
    worker_id      text,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- created_at + wait (NULL for wait = 0 or none), a column so the deadline sweep has an index.
    wait_until     timestamptz,
    acquired_at    timestamptz,
    expires_at     timestamptz,
    heartbeat_at   timestamptz,
    released_at    timestamptz,
    -- When the request reached `error` or `released`; retention counts from here.
    settled_at     timestamptz,
    priority       smallint NOT NULL DEFAULT 0
                   CONSTRAINT permit_request_priority_valid
                       CHECK (priority BETWEEN permitq.rule_priority_min() AND permitq.rule_priority_max()),
    CONSTRAINT permit_request_state_fields CHECK (
        (state = 'error') = (error_code IS NOT NULL)
        AND (state = 'released') = (release_reason IS NOT NULL)
        AND (state IN ('acquired', 'released')) = (acquired_at IS NOT NULL AND fencing_token IS NOT NULL)
        AND (state = 'released') = (released_at IS NOT NULL)
        AND (state IN ('released', 'error')) = (settled_at IS NOT NULL)
    )
);

-- Fencing tokens: timeline << 48 | this sequence (functions/apply_decision.sql); the sequence
-- stops at 2^48 - 1 rather than spill into the timeline's bits.
CREATE SEQUENCE permitq.fencing_token_seq AS bigint MAXVALUE 281474976710655;
CREATE UNIQUE INDEX permit_request_fencing_token_key
    ON permitq.permit_request (fencing_token) WHERE fencing_token IS NOT NULL;

-- Partial indexes, so each holds only the rows its reader wants however many settled rows pile up.
-- The backlog, and the part of it no worker has examined yet (the claim's "fresh" part).
CREATE INDEX permit_request_pending_idx ON permitq.permit_request (id) WHERE state = 'new';
CREATE INDEX permit_request_unexamined_idx
    ON permitq.permit_request (id) WHERE state = 'new' AND NOT examined;
CREATE INDEX permit_request_unexamined_priority_idx ON permitq.permit_request (priority)
    WHERE state = 'new' AND NOT examined;
-- Wait deadlines, lease expiry and --max-hold, for the sweeps.
CREATE INDEX permit_request_wait_until_idx
    ON permitq.permit_request (wait_until) WHERE state = 'new' AND wait_until IS NOT NULL;
CREATE INDEX permit_request_expires_at_idx
    ON permitq.permit_request (expires_at) WHERE state = 'acquired' AND expires_at IS NOT NULL;
CREATE INDEX permit_request_acquired_at_idx
    ON permitq.permit_request (acquired_at) WHERE state = 'acquired';
-- Retention.
CREATE INDEX permit_request_settled_at_idx
    ON permitq.permit_request (settled_at) WHERE state IN ('released', 'error');

-- Each semaphore's queue: the requests a worker examined and left waiting, written under the
-- semaphore's lock and removed the moment the request leaves `new`, so whoever holds the lock
-- sees the true head (functions/heads.sql). Keeps priority and created_at for the line order.
CREATE TABLE permitq.waiter (
    semaphore_id bigint NOT NULL REFERENCES permitq.semaphore (id),
    request_id   bigint NOT NULL REFERENCES permitq.permit_request (id) ON DELETE CASCADE,
    count        integer NOT NULL,
    priority     smallint NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL,
    PRIMARY KEY (semaphore_id, request_id)
);
-- By request (dropping a request's rows): a hash index, which cannot offer an ordering the
-- queue lookups could mistake for the primary key's.
CREATE INDEX waiter_request_idx ON permitq.waiter USING hash (request_id);
-- Line order within each priority level (the loose index scan of functions/queue_order.sql).
CREATE INDEX waiter_line_idx ON permitq.waiter (semaphore_id, priority DESC, request_id);

-- Releases not yet folded into semaphore.used. `semaphore` NULL: a cancel, only an event to
-- send. `announce`: the one row per request whose fold sends the request's event.
CREATE TABLE permitq.pending_release (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id bigint NOT NULL,
    semaphore  text,
    count      integer NOT NULL DEFAULT 0,
    announce   boolean NOT NULL
);
CREATE INDEX pending_release_semaphore_idx ON permitq.pending_release (semaphore);

-- Which workers are asleep (waiting for a notification); see functions/notifications.sql.
-- Unlogged: not data, re-registered after a crash, and writing it costs no WAL flush. A row
-- whose `awake_by` has passed belongs to a worker that died asleep.
CREATE UNLOGGED TABLE permitq.worker_wake (
    worker_id text PRIMARY KEY,
    sleeping  boolean NOT NULL,
    awake_by  timestamptz NOT NULL
);

-- Grants on rate-limited semaphores, for their windows.
CREATE TABLE permitq.rate_grant (
    semaphore_id bigint NOT NULL REFERENCES permitq.semaphore (id) ON DELETE CASCADE,
    granted_at   timestamptz NOT NULL,
    count        integer NOT NULL
);
CREATE INDEX rate_grant_window_idx ON permitq.rate_grant (semaphore_id, granted_at);

-- Audit of every capacity change, creation included (old_capacity NULL).
CREATE TABLE permitq.capacity_change (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    semaphore        text NOT NULL,
    old_capacity     integer,
    new_capacity     integer NOT NULL,
    old_fair         boolean,
    new_fair         boolean NOT NULL,
    changed_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    changed_by       text NOT NULL DEFAULT current_user,
    application_name text DEFAULT current_setting('application_name', true)
);
CREATE INDEX capacity_change_semaphore_idx ON permitq.capacity_change (semaphore, id);
CREATE INDEX capacity_change_changed_at_idx ON permitq.capacity_change (changed_at);

-- Fencing for downstream writes kept in this database: the highest token seen per resource.
CREATE TABLE permitq.fence_token (
    resource   text PRIMARY KEY CONSTRAINT fence_token_resource_valid CHECK (resource <> ''),
    token      bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- The roles, created when missing. They are cluster-wide, so another database's migration may
-- create one at the same moment: that race is not an error.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['permitq_producer', 'permitq_worker', 'permitq_admin'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = role_name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            EXCEPTION
                WHEN duplicate_object OR unique_violation THEN NULL;
                WHEN insufficient_privilege THEN
                    RAISE EXCEPTION 'permitq migrate needs the roles permitq_producer, permitq_worker and permitq_admin, and % may not create roles', current_user
                        USING ERRCODE = '42501',
                              HINT = 'run migrate once as a role with CREATEROLE, or have a DBA run: CREATE ROLE permitq_producer NOLOGIN; CREATE ROLE permitq_worker NOLOGIN; CREATE ROLE permitq_admin NOLOGIN;';
            END;
        END IF;
    END LOOP;
END $$;

-- Least privilege on tables. Functions are private unless their file grants them (migrate
-- revokes EXECUTE from PUBLIC on every function it writes); views grant in their file.
REVOKE ALL ON SCHEMA permitq FROM PUBLIC;
GRANT USAGE ON SCHEMA permitq TO permitq_producer, permitq_worker, permitq_admin;
-- Everyone may read the queue, the semaphores and the audit (and watch events: LISTEN needs no
-- grant).
GRANT SELECT ON permitq.semaphore, permitq.permit_request, permitq.capacity_change,
    permitq.schema_migration, permitq.schema_file
    TO permitq_producer, permitq_worker, permitq_admin;
-- Producers may also INSERT a request directly (the insert trigger checks it like submit).
GRANT INSERT (external_id, permits, owner, ttl, wait, priority) ON permitq.permit_request
    TO permitq_producer, permitq_admin;
-- Workers: their own wake-up row, and the pending releases (read to find work).
GRANT SELECT ON permitq.pending_release TO permitq_worker;
GRANT SELECT, INSERT, UPDATE, DELETE ON permitq.worker_wake TO permitq_worker;
