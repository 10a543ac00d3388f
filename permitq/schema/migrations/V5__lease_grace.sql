-- Leases across a promotion: the timeline (and cluster) permitq last saw, and when it first saw
-- it. A lease does not run out until one ttl after that (functions/heartbeat.sql,
-- permitq.lease_run_out): holders could not heartbeat while no primary was there. At install
-- no grace is due.
CREATE TABLE permitq.lease_grace (
    one         boolean PRIMARY KEY DEFAULT true CHECK (one),
    timeline    bigint NOT NULL,
    system_id   bigint NOT NULL,
    since       timestamptz NOT NULL
);
INSERT INTO permitq.lease_grace (timeline, system_id, since)
SELECT ('x' || substr(pg_catalog.pg_walfile_name(pg_catalog.pg_current_wal_insert_lsn()), 1, 8))::bit(32)::bigint,
       (SELECT system_identifier FROM pg_catalog.pg_control_system()),
       '-infinity';
GRANT SELECT ON permitq.lease_grace TO permitq_producer, permitq_worker, permitq_admin;
