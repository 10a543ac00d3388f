-- Fencing tokens that never go backwards across a promotion. A token is
--
--     timeline << 48  |  nextval(fencing_token_seq)
--
-- where `timeline` is the WAL timeline the server writes on. A promotion starts a new, higher
-- timeline, so every token issued after it exceeds every token issued before it on any server
-- of the cluster, whatever a standby's copy of the sequence says. Within a timeline the order is
-- the sequence's, drawn in grant order under the semaphore locks (functions/apply_decision.sql).
-- 48 bits leave 2.8 * 10^14 grants per timeline; tokens stay below 2^53, exact in a JSON double,
-- up to timeline 31.

-- The timeline WAL is being written on: the first 8 hex digits of the current WAL file's name.
-- (Fails during recovery, where nothing is granted anyway.)
CREATE OR REPLACE FUNCTION permitq.wal_timeline() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint
$$;

-- The high bits of the tokens a grant batch draws now.
CREATE OR REPLACE FUNCTION permitq.token_epoch() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT permitq.wal_timeline() << 48
$$;
