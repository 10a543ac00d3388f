-- Fencing tokens that never go backwards: across a promotion, `pg_upgrade`, a dump and restore
-- into a new cluster, and an upgrade by logical replication. A token is
--
--     epoch << 48  |  nextval(fencing_token_seq)
--
-- drawn in grant order under the semaphore locks (functions/decision_outcome.sql). The epoch is
-- the row of permitq.token_epoch plus the WAL timelines begun since it was written: a promotion
-- starts a higher timeline, so every token issued after it exceeds every token issued before it
-- on any server, whatever a standby's copy of the sequence says. `pg_upgrade`, a restore and a
-- cutover by logical replication land on another cluster (another system identifier), at
-- timeline 1, possibly with a sequence gone back. A restore into another database of the same
-- cluster, or in place (`pg_restore --clean`), keeps the cluster and the timeline but makes the
-- database or the sequence anew (another OID); and a sequence set back (`setval`, a reset) is
-- behind a token already issued. In each case permitq.raise_token_epoch (run by `migrate`, by
-- every worker at start-up, and by the first grant batch that notices: permitq.tokens_went_back)
-- moves the epoch past every token issued, stored in a request, remembered by a fence or
-- recorded when retention deleted its request. What no copy can see: tokens another copy issued
-- after the dump it was restored from, when that copy is the only one left with them and the
-- restored one is on the same database and sequence; `permitq tokens raise --above N` is the
-- operator's step then. 48 bits leave
-- 2.8 * 10^14 grants per epoch; epochs run
-- to 32767 (each promotion, upgrade or restore uses one), so tokens stay positive, and exact in
-- a JSON double up to epoch 31.

-- The timeline WAL is being written on: the first 8 hex digits of the current WAL file's name.
-- (Fails during recovery, where nothing is granted anyway.)
-- (Both PL/pgSQL: a grant batch calls them, and a SQL function would be parsed at every call.)
CREATE OR REPLACE FUNCTION permitq.wal_timeline() RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RETURN ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint;
END $$;

-- The cluster this is (pg_upgrade, initdb and a new cluster replicated into give another).
CREATE OR REPLACE FUNCTION permitq.system_id() RETURNS bigint
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT system_identifier FROM pg_catalog.pg_control_system());
END $$;

-- The database this is (a restore into another database of the cluster makes another).
CREATE OR REPLACE FUNCTION permitq.database_oid() RETURNS oid
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = current_database());
END $$;

-- Whether the tokens could go back from what `recorded` says: another cluster, an older
-- timeline, another database or token sequence (a restore), or a sequence behind a token
-- already issued (set back), or below the recorded floor (the tokens of requests retention
-- deleted, or what an operator raised it to).
-- max(fencing_token) reads the last entry of permit_request_fencing_token_key.
CREATE OR REPLACE FUNCTION permitq.tokens_went_back(recorded permitq.token_epoch,
                                                     current_timeline bigint) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    RETURN current_timeline < recorded.timeline
        OR recorded.system_id <> permitq.system_id()
        OR recorded.database_oid IS DISTINCT FROM permitq.database_oid()
        OR recorded.sequence_oid IS DISTINCT FROM 'permitq.fencing_token_seq'::regclass::oid
        OR ((recorded.epoch + greatest(current_timeline - recorded.timeline, 0)) << 48)
           + (SELECT s.last_value - (NOT s.is_called)::int FROM permitq.fencing_token_seq s)
           < greatest(recorded.token_floor,
                      (SELECT max(r.fencing_token) FROM permitq.permit_request r));
END $$;

-- The high bits of the tokens a grant batch draws now. When the tokens could go back
-- (permitq.tokens_went_back: restored, upgraded, replicated into, or the sequence set back,
-- under a running worker), the epoch is raised first.
CREATE OR REPLACE FUNCTION permitq.token_epoch() RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    recorded permitq.token_epoch;
    current_timeline bigint := permitq.wal_timeline();
    epoch_now bigint;
BEGIN
    SELECT * INTO recorded FROM permitq.token_epoch;
    IF permitq.tokens_went_back(recorded, current_timeline) THEN
        PERFORM permitq.raise_token_epoch();
        SELECT * INTO recorded FROM permitq.token_epoch;
    END IF;
    epoch_now := recorded.epoch + (current_timeline - recorded.timeline);
    IF epoch_now > 32767 THEN
        RAISE EXCEPTION 'fencing token epoch % is past 32767: tokens would overflow', epoch_now
            USING ERRCODE = '54000';
    END IF;
    RETURN epoch_now << 48;
END $$;

-- Moves the epoch past every token issued (stored in a request, or remembered by a fence) when
-- the cluster, the timeline or the sequence went back (a restore, `pg_upgrade`, logical
-- replication), else records the current timeline's epoch. Returns the epoch in force.
CREATE OR REPLACE FUNCTION permitq.raise_token_epoch() RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
DECLARE
    recorded permitq.token_epoch;
    current_timeline bigint := permitq.wal_timeline();
    highest bigint;
    -- The last value drawn (after `setval(.., false)` the next one is last_value itself).
    sequence_at bigint := (SELECT s.last_value - (NOT s.is_called)::int FROM permitq.fencing_token_seq s);
    new_epoch bigint;
BEGIN
    SELECT * INTO recorded FROM permitq.token_epoch FOR UPDATE;
    highest := greatest((SELECT max(r.fencing_token) FROM permitq.permit_request r),
                        (SELECT max(f.token) FROM permitq.fence_token f),
                        nullif(recorded.token_floor, 0));
    new_epoch := recorded.epoch + greatest(current_timeline - recorded.timeline, 0);
    -- A token issued past what this epoch and the sequence drew last, another cluster, or
    -- another database or sequence than the one recorded (a restore; unrecorded before V8).
    IF highest IS NOT NULL AND highest > (new_epoch << 48) + sequence_at
       OR current_timeline < recorded.timeline
       OR recorded.system_id <> permitq.system_id()
       OR recorded.database_oid <> permitq.database_oid()
       OR recorded.sequence_oid <> 'permitq.fencing_token_seq'::regclass::oid THEN
        new_epoch := greatest(new_epoch, coalesce(highest >> 48, 0)) + 1;
    END IF;
    UPDATE permitq.token_epoch t
    SET epoch = new_epoch, timeline = current_timeline, system_id = permitq.system_id(),
        database_oid = permitq.database_oid(),
        sequence_oid = 'permitq.fencing_token_seq'::regclass::oid;
    RETURN new_epoch;
END $$;
GRANT EXECUTE ON FUNCTION permitq.raise_token_epoch() TO permitq_worker;

-- Operator (`permitq tokens raise --above N`): every token drawn from now on is above `above`,
-- for a token another copy issued that this one cannot see (see the top of this file). Returns
-- the epoch in force; raising to a floor already passed changes nothing.
CREATE OR REPLACE FUNCTION permitq.raise_token_floor(above bigint) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp SET jit = off AS $$
BEGIN
    IF above IS NULL OR above < 0 OR above >= (32767::bigint << 48) THEN
        RAISE EXCEPTION 'invalid above: must be a fencing token, 0 to %', (32767::bigint << 48) - 1
            USING ERRCODE = '22023';
    END IF;
    UPDATE permitq.token_epoch t SET token_floor = above WHERE t.token_floor < above;
    RETURN permitq.raise_token_epoch();
END $$;
GRANT EXECUTE ON FUNCTION permitq.raise_token_floor(bigint) TO permitq_admin;
