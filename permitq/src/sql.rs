//! Every query the Rust side sends, in one place. The long ones live in `src/sql/*.sql` with a
//! comment each; the SQL API they call is in `schema/`.
//!
//! Lock order (see `schema/migrations/V1__baseline.sql`): request rows first, then semaphore rows
//! in ascending id. [`CLAIM_BATCH`] is step 1 for the worker, [`LOCK_BATCH_AND_HEADS`] step 2;
//! [`NEXT_BATCH`] runs both, in that order, in one call.

use std::sync::LazyLock;

/// The channel that wakes workers (coalesced: once per statement or transaction).
pub(crate) const WORK_CHANNEL: &str = "permitq_work";
/// The channel producers wait on: outcomes of requests (acquired, error, released).
pub(crate) const EVENTS_CHANNEL: &str = "permitq_events";

/// Migrations: the lock that serializes `migrate` runs, to the end of the run's transaction
/// (self-conflicting; readers of the table are not blocked).
pub(crate) const MIGRATION_LOCK: &str =
    "LOCK TABLE permitq.schema_migration IN SHARE ROW EXCLUSIVE MODE";
/// Migrations: the bookkeeping tables, created when missing: the versioned migrations applied
/// and the schema files applied, each with its checksum. The schema is created only when
/// missing: `CREATE SCHEMA IF NOT EXISTS` checks the CREATE privilege on the database first,
/// which a role that merely owns the schema lacks.
/// DDL runs only when something is missing: an ALTER that finds nothing to do would still wait
/// for every reader of the table. `lock_timeout` bounds how long the run waits for a lock (and
/// how long traffic queues behind a migration that waits): it is retried.
pub(crate) const MIGRATION_TABLES: &str = "SET LOCAL client_min_messages = warning;
     SET LOCAL lock_timeout = '5s';
     DO $$ BEGIN
         IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = 'permitq') THEN
             CREATE SCHEMA permitq;
         END IF;
     END $$;
     CREATE TABLE IF NOT EXISTS permitq.schema_migration (
         version    integer PRIMARY KEY,
         name       text NOT NULL,
         applied_at timestamptz NOT NULL DEFAULT now(),
         checksum   bytea
     );
     DO $$ BEGIN
         IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                        WHERE attrelid = 'permitq.schema_migration'::regclass
                          AND attname = 'checksum' AND NOT attisdropped) THEN
             ALTER TABLE permitq.schema_migration ADD COLUMN checksum bytea;
         END IF;
     END $$;
     CREATE TABLE IF NOT EXISTS permitq.schema_file (
         path       text PRIMARY KEY,
         checksum   bytea NOT NULL,
         applied_at timestamptz NOT NULL DEFAULT now()
     );";
/// Migrations: what is applied, with the recorded checksums.
pub(crate) const APPLIED_MIGRATIONS: &str =
    "SELECT version, name, checksum FROM permitq.schema_migration ORDER BY version";
/// Migrations: the checksum of a file (SHA-256, computed by the server).
pub(crate) const CHECKSUM: &str = "SELECT sha256(convert_to($1::text, 'UTF8'))";
/// Migrations: record one as applied, with its checksum.
pub(crate) const RECORD_MIGRATION: &str = "INSERT INTO permitq.schema_migration \
     (version, name, checksum) VALUES ($1, $2, sha256(convert_to($3::text, 'UTF8')))";
/// Migrations: forget the pre-release migrations once their schema is upgraded in place.
pub(crate) const FORGET_PRERELEASE_MIGRATIONS: &str = "DELETE FROM permitq.schema_migration";
/// Migrations: whether the database records another checksum for a schema file, or none.
pub(crate) const SCHEMA_FILE_CHANGED: &str =
    "SELECT NOT EXISTS (SELECT 1 FROM permitq.schema_file \
     WHERE path = $1 AND checksum = sha256(convert_to($2::text, 'UTF8')))";
/// Migrations: record a schema file as applied, with its checksum.
pub(crate) const RECORD_SCHEMA_FILE: &str = "INSERT INTO permitq.schema_file (path, checksum) \
     VALUES ($1, sha256(convert_to($2::text, 'UTF8'))) ON CONFLICT (path) DO UPDATE \
     SET checksum = EXCLUDED.checksum, applied_at = now()";
/// Migrations, last: a function is private unless its file grants it (a new function is
/// executable by PUBLIC by default). The rules stay public: the CHECK constraints that call them
/// run as whoever writes the table.
pub(crate) const FUNCTIONS_PRIVATE: &str = "DO $$
     DECLARE
         f regprocedure;
     BEGIN
         FOR f IN SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
                  WHERE p.pronamespace = 'permitq'::regnamespace AND p.proname NOT LIKE 'rule\\_%'
         LOOP
             EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
         END LOOP;
     END $$";
/// Migrations and worker start-up: move the fencing token epoch past every token issued, should
/// the timeline or the sequence have gone back (a restore, `pg_upgrade`, logical replication).
/// Hardening: the advisory-lock functions PUBLIC may execute.
pub(crate) const PUBLIC_ADVISORY_LOCKS: &str = "SELECT p.oid::regprocedure::text \
     FROM pg_catalog.pg_proc p \
     WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.proname LIKE 'pg\\_%advisory%' \
       AND has_function_privilege('public', p.oid, 'EXECUTE') ORDER BY 1";
/// Hardening: whether PUBLIC may create temporary tables in this database (each takes a slot of
/// the shared lock table until its transaction ends), and the database's name as an identifier.
pub(crate) const PUBLIC_TEMP: &str =
    "SELECT has_database_privilege('public', current_database(), 'TEMPORARY'), \
     quote_ident(current_database())";
/// Hardening: max_locks_per_transaction, and the shared lock table's slots.
pub(crate) const LOCK_TABLE_SIZE: &str = "SELECT current_setting('max_locks_per_transaction')::int, \
     current_setting('max_locks_per_transaction')::int8 * (current_setting('max_connections')::int8 \
       + current_setting('max_prepared_transactions')::int8)";
/// Hardening: each login that is a producer (and neither admin nor worker), its connection limit
/// and its idle_in_transaction_session_timeout (its own setting in this database or anywhere,
/// else the database's, else the server's).
pub(crate) const PRODUCER_LOGINS: &str = "SELECT r.rolname::text, r.rolconnlimit, \
       coalesce((SELECT split_part(c, '=', 2) FROM pg_catalog.pg_db_role_setting s, unnest(s.setconfig) c \
                 WHERE s.setrole = r.oid AND s.setdatabase IN (0, (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database())) \
                   AND c LIKE 'idle\\_in\\_transaction\\_session\\_timeout=%' ORDER BY s.setdatabase DESC LIMIT 1), \
                (SELECT split_part(c, '=', 2) FROM pg_catalog.pg_db_role_setting s, unnest(s.setconfig) c \
                 WHERE s.setrole = 0 AND s.setdatabase = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
                   AND c LIKE 'idle\\_in\\_transaction\\_session\\_timeout=%' LIMIT 1), \
                nullif((SELECT reset_val FROM pg_catalog.pg_settings WHERE name = 'idle_in_transaction_session_timeout'), '0')) \
     FROM pg_catalog.pg_roles r \
     WHERE r.rolcanlogin AND NOT r.rolsuper \
       AND pg_has_role(r.oid, 'permitq_producer', 'MEMBER') \
       AND NOT pg_has_role(r.oid, 'permitq_admin', 'MEMBER') \
       AND NOT pg_has_role(r.oid, 'permitq_worker', 'MEMBER') \
     ORDER BY 1";
/// Operator: every token drawn from now on is above $1; returns the epoch in force.
pub(crate) const RAISE_TOKEN_FLOOR: &str = "SELECT permitq.raise_token_floor($1)";
pub(crate) const RAISE_TOKEN_EPOCH: &str = "SELECT permitq.raise_token_epoch()";
/// Migrate: which of these roles ($1) are missing, and whether this login may create roles.
pub(crate) const ROLES_MISSING: &str = "SELECT coalesce(array_agg(r ORDER BY r) \
       FILTER (WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r)), '{}'), \
     (SELECT rolsuper OR rolcreaterole FROM pg_catalog.pg_roles WHERE rolname = current_user) \
     FROM unnest($1::text[]) r";
/// Migrate, refused a privilege: this login, the database's owner, the permitq schema's (NULL
/// when there is none yet) and the database's name.
pub(crate) const MIGRATE_OWNERS: &str = "SELECT current_user::text, \
     pg_catalog.pg_get_userbyid(d.datdba)::text, \
     (SELECT pg_catalog.pg_get_userbyid(n.nspowner)::text FROM pg_catalog.pg_namespace n \
      WHERE n.nspname = 'permitq'), current_database()::text \
     FROM pg_catalog.pg_database d WHERE d.datname = current_database()";
/// Readiness: whether exactly these versions ($1) are applied and these files ($2, bodies $3)
/// applied unchanged.
pub(crate) const SCHEMA_IS_CURRENT: &str =
    "SELECT (SELECT coalesce(array_agg(version ORDER BY version), '{}') \
     FROM permitq.schema_migration) = $1::int4[] \
     AND (SELECT count(*) FROM unnest($2::text[], $3::text[]) AS f(path, body) \
          JOIN permitq.schema_file s ON s.path = f.path \
           AND s.checksum = sha256(convert_to(f.body, 'UTF8'))) = cardinality($2::text[])";

/// Worker: claim what could be granted (unexamined requests after a cursor, and the first
/// waiters of semaphores with room), FOR UPDATE SKIP LOCKED.
pub(crate) const CLAIM_BATCH: &str = include_str!("sql/claim_batch.sql");
/// Worker: steps 1 and 2 in one round trip: claim a batch, lock its semaphores (folding their
/// releases) and read their heads; rows told apart by `kind`.
pub(crate) const NEXT_BATCH: &str = include_str!("sql/next_batch.sql");
/// Worker, isolating a failed batch: claim these requests again (one at a time).
pub(crate) const CLAIM_REQUESTS: &str = include_str!("sql/claim_requests.sql");
/// Worker: settle a request that failed a batch on its own as `error` / `invalid`; returns its
/// external_id (NULL when it is no longer `new`).
pub(crate) const SETTLE_INVALID: &str = "SELECT permitq.settle_invalid($1, $2)";
/// Worker, for a batch claimed stepwise: make its missing template instances, lock its
/// semaphores in id order, fold pending releases into `used`, and read the semaphores as the
/// decision sees them, then the heads (step 2 of [`NEXT_BATCH`] on its own).
pub(crate) const LOCK_BATCH_AND_HEADS: &str = include_str!("sql/lock_batch_and_heads.sql");
/// Worker, when the decision on arrival order granted less than the whole batch, or something
/// waited, on a batch naming a keyed semaphore: place the batch by key and read the heads again
/// (the decision is taken again on them).
pub(crate) const PLACE_BATCH_BY_KEYS: &str = include_str!("sql/place_batch_by_keys.sql");
/// Worker, when it claimed nothing: fold pending releases (and send their events).
pub(crate) const FOLD_RELEASES: &str = "SELECT permitq.fold_releases()";
/// Worker: say whether it is asleep (waiting for a notification), and until when that holds
/// if it dies (see permitq.wake_workers in schema/functions/notifications.sql).
pub(crate) const WORKER_SLEEPING: &str = "INSERT INTO permitq.worker_wake AS w \
     (worker_id, sleeping, awake_by) VALUES ($1, $2, now() + $3::text::interval) \
     ON CONFLICT (worker_id) DO UPDATE SET sleeping = EXCLUDED.sleeping, awake_by = EXCLUDED.awake_by";
/// Worker, just out of work: is anything waiting for it (an unexamined request, a release to
/// fold)? Two index probes, no transaction.
pub(crate) const WORK_WAITING: &str = "SELECT EXISTS (SELECT 1 FROM permitq.permit_request \
     WHERE state = 'new' AND NOT examined) OR EXISTS (SELECT 1 FROM permitq.pending_release)";
/// Worker, after a fold of its own and once the wake gate is free: is any release left to fold?
/// (One index probe, no transaction; see permitq.wake_workers_for_release.)
pub(crate) const RELEASES_PENDING: &str = "SELECT EXISTS (SELECT 1 FROM permitq.pending_release)";
/// Worker, stopping: forget whether it sleeps, and say it no longer runs (its row stays an hour,
/// so that readers can say when a worker was last seen).
pub(crate) const WORKER_GONE: &str =
    "WITH wake AS (DELETE FROM permitq.worker_wake WHERE worker_id = $1) \
     UPDATE permitq.worker_seen SET live_until = now() WHERE worker_id = $1";
/// Worker, every [`crate::worker::SEEN_EVERY`] beside its claim loop: it is alive ($1 id, $2 host,
/// $3 version, $4 pid, $5 how long the row counts as live, $6 its --max-hold or NULL). See
/// schema/functions/workers.sql.
pub(crate) const WORKER_SEEN: &str = "INSERT INTO permitq.worker_seen AS w \
     (worker_id, host, version, pid, started_at, seen_at, live_until, max_hold) \
     VALUES ($1, $2, $3, $4, now(), now(), now() + $5::text::interval, $6::text::interval) \
     ON CONFLICT (worker_id) DO UPDATE SET host = EXCLUDED.host, version = EXCLUDED.version, \
     pid = EXCLUDED.pid, seen_at = EXCLUDED.seen_at, live_until = EXCLUDED.live_until, \
     max_hold = EXCLUDED.max_hold";
/// Anyone: the least --max-hold of the running workers, in seconds (NULL: none has one); see
/// schema/functions/workers.sql.
pub(crate) const LEAST_MAX_HOLD: &str =
    "SELECT extract(epoch FROM min(w.max_hold))::float8 FROM permitq.workers w WHERE w.live";
/// Worker, before sleeping: true when no producer that may have seen it awake is still in
/// flight (the wake gate is free in EXCLUSIVE mode; taken and let go with this statement).
pub(crate) const WAKE_GATE_FREE: &str = "SELECT permitq.wake_gate_free()";
/// Retention: rows of workers that died (asleep, or not seen), long ago.
pub(crate) const DELETE_DEAD_WORKERS: &str =
    "WITH wake AS (DELETE FROM permitq.worker_wake WHERE awake_by < now() - interval '1 hour') \
     DELETE FROM permitq.worker_seen WHERE live_until < now() - interval '1 hour'";
/// Anyone: whether anything is granting (live workers, the last seen); see
/// schema/functions/workers.sql.
pub(crate) const GRANTING: &str =
    "SELECT live_workers, last_seen, current_database()::text AS database FROM permitq.granting()";
/// Worker, at start: whether this login may work (member of permitq_worker, or with the
/// privileges of the role that owns the permitq schema, which owns every function a worker
/// calls; or a superuser), and its name.
pub(crate) const MAY_WORK: &str = "SELECT pg_catalog.pg_has_role(session_user, 'permitq_worker', \
     'MEMBER') OR coalesce(pg_catalog.pg_has_role(session_user, (SELECT n.nspowner FROM \
     pg_catalog.pg_namespace n WHERE n.nspname = 'permitq'), 'USAGE'), false), \
     session_user::text";
/// Operators: the workers seen in the last hour, live first.
pub(crate) const WORKERS: &str =
    "SELECT worker_id, host, version, pid, started_at, seen_at, live, \
     stopped_at FROM permitq.workers ORDER BY live DESC, worker_id";
/// Worker: write a batch's outcome.
pub(crate) const APPLY_DECISION: &str = include_str!("sql/apply_decision.sql");

/// Columns of `permitq.permit_request` as [`crate::types::PermitRequest`] reads them.
pub(crate) const REQUEST_COLUMNS: &str = include_str!("sql/request_columns.sql");

/// Client: submit (validates, idempotent, wakes workers). Intervals travel as text.
pub(crate) static SUBMIT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {REQUEST_COLUMNS} FROM permitq.submit($1, $2, $3, $4::text::interval, $5::text::interval, $6::int2, $7, $8)"
    )
});

/// Client: one request by external_id.
pub(crate) static STATUS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {REQUEST_COLUMNS}, {BARRIER_DOES_SOMETHING} AS barrier \
         FROM permitq.permit_request WHERE external_id = $1"
    )
});

/// Whether [`DURABILITY_BARRIER`] would do anything in this session: `permitq.confirm_durable`
/// waits only where synchronous standbys are named, and refuses on a standby. Read beside the
/// status, so that a server without synchronous standbys skips the barrier's round trip.
const BARRIER_DOES_SOMETHING: &str =
    "(pg_catalog.current_setting('synchronous_standby_names') <> '' OR pg_catalog.pg_is_in_recovery())";

/// After reading an outcome (a status, or a notification on `permitq_events`), run this on the
/// same connection before acting on it, as a simple query (`batch_execute`; with the extended
/// protocol the row may arrive before the implicit commit has waited): `permitq.confirm_durable`,
/// whose commit waits until the synchronous standbys, if any, have everything the read saw. On
/// a primary that lost its standby in a failover, where a grant can be visible and then be
/// discarded when the primary is demoted, it never returns successfully.
/// [`crate::Client::wait_settled`] (and so `acquire`) runs it itself.
pub const DURABILITY_BARRIER: &str = "SELECT permitq.confirm_durable()";

/// Worker, an adaptive cadence's first step: the due semaphores and their reports (taken).
pub(crate) const ADAPTIVE_TURN: &str = "SELECT * FROM permitq.adaptive_turn($1::text::interval)";
/// Worker, its second: the capacity an algorithm chose for one of them.
pub(crate) const ADAPTIVE_APPLY: &str = "SELECT permitq.adaptive_apply($1, $2, $3, $4)";

/// Admin: make a semaphore adaptive ($2 the algorithm, NULL: fixed again).
pub(crate) const SET_ADAPTIVE: &str =
    "SELECT algorithm, floor, ceiling FROM permitq.set_adaptive($1, $2, $3, $4)";
/// The adaptive settings of a semaphore.
pub(crate) const ADAPTIVE_OF: &str = "SELECT a.algorithm, a.floor, a.ceiling \
     FROM permitq.adaptive_limit a JOIN permitq.semaphore s ON s.id = a.semaphore_id \
     WHERE s.name = $1";
/// The last cadence with reports of an adaptive semaphore (its inputs, when, from and to).
pub(crate) const ADAPTIVE_LAST_REPORTS: &str = "SELECT a.last_reports \
     || jsonb_build_object('ago_s', extract(epoch FROM now() - (a.last_reports ->> 'at')::timestamptz)) \
     FROM permitq.adaptive_limit a JOIN permitq.semaphore s ON s.id = a.semaphore_id \
     WHERE s.name = $1";
/// Holder: release with a report of how its use went.
pub(crate) const RELEASE_REPORTING: &str = "SELECT permitq.release($1, $2, $3::text::interval)";
/// Holder: a report while it holds.
pub(crate) const REPORT: &str = "SELECT permitq.report($1, $2, $3::text::interval)";

/// Why a request waits (`permitq.explain`): one row per semaphore, or its outcome.
pub(crate) const EXPLAIN: &str =
    "SELECT request, state, outcome, semaphore, needs, capacity, free, \
     shortfall, position, permits_ahead, reason, holders, \
     extract(epoch FROM estimated_wait)::float8, via, kept, \
     extract(epoch FROM now() - last_released_at)::float8, fairness FROM permitq.explain($1)";

/// Client: release (or cancel) by external_id.
pub(crate) const RELEASE: &str = "SELECT permitq.release($1)";
/// Operator: revoke by external_id.
pub(crate) const REVOKE: &str = "SELECT permitq.revoke($1)";
/// Holder: extend the lease.
pub(crate) const HEARTBEAT: &str = "SELECT permitq.heartbeat($1, $2::text::interval)";
/// Columns of `permitq.semaphore` as [`crate::types::Semaphore`] reads them (by position, see
/// `db::semaphore_from_row`).
macro_rules! semaphore_columns {
    () => {
        "name, capacity::int8, used::int8, fair, is_template, template, \
         (extract(epoch FROM per) * 1000000)::int8, parent, guarantee::int8, max_instances::int8"
    };
}
/// Operator: create or change a semaphore.
pub(crate) const SET_CAPACITY: &str = concat!(
    "SELECT ",
    semaphore_columns!(),
    " FROM permitq.set_capacity($1, $2, $3, $4::text::interval, $7, $5, $6)"
);
/// [`SET_CAPACITY`] with `adaptive` ($8): only when the settings name it, so that a change
/// without it also works on a schema from before adaptive capacity (a rolling upgrade).
pub(crate) const SET_CAPACITY_ADAPTIVE: &str = concat!(
    "SELECT ",
    semaphore_columns!(),
    " FROM permitq.set_capacity($1, $2, $3, $4::text::interval, $7, $5, $6, $8::text::jsonb)"
);
/// Admin: delete a semaphore nothing uses (no row: there was none by that name).
pub(crate) const DELETE_SEMAPHORE: &str = concat!(
    "SELECT ",
    semaphore_columns!(),
    " FROM permitq.delete_semaphore($1) WHERE name IS NOT NULL"
);
/// All semaphores.
pub(crate) const LIST_SEMAPHORES: &str = concat!(
    "SELECT ",
    semaphore_columns!(),
    " FROM permitq.semaphore ORDER BY name"
);
/// Producers and the CLI: what to say of each of $1 (names) that no semaphore or template has.
pub(crate) const UNKNOWN_NAMES: &str = "SELECT a FROM unnest($1::text[]) n, \
     permitq.unknown_name_answer(n) a WHERE a IS NOT NULL";

/// Client: what a worker will fail a request of these permits with (functions/error_details.sql).
pub(crate) const ANSWERS_AT_SUBMIT: &str = "SELECT a FROM permitq.answers_at_submit($1) a";
/// Operator: serve semaphore $1's line by fairness key ($2), or not (functions/fairness.sql).
pub(crate) const SET_FAIRNESS_KEYS: &str = "SELECT permitq.set_fairness_keys($1, $2)";
/// Each fairness key's share of semaphore $1 (functions/fairness.sql).
pub(crate) const KEY_SHARES: &str = "SELECT fairness_key, weight, waiting, waiting_permits, held, \
     extract(epoch FROM placed_back)::float8 FROM permitq.key_shares($1)";
/// The existing semaphore or template names nearest $1, nearest first (at most 3).
pub(crate) const SIMILAR_SEMAPHORES: &str = "SELECT permitq.similar_semaphore_names($1)";

/// Client: the external_ids nearest one not found, among those this login reads.
pub(crate) const SIMILAR_REQUESTS: &str = "SELECT permitq.similar_request_ids($1)";
/// The login this session runs as (what `submitted_by` records).
pub(crate) const LOGIN: &str = "SELECT session_user::text";
/// Whether this login reads every producer's requests (functions/ownership.sql).
pub(crate) const READS_EVERY_REQUEST: &str = "SELECT permitq.reads_every_request()";
/// The capacity audit of one semaphore, oldest first.
pub(crate) const CAPACITY_HISTORY: &str =
    "SELECT semaphore, old_capacity::int8, new_capacity::int8, \
     old_fair, new_fair, changed_at, changed_by, application_name, \
     old_parent, new_parent, old_guarantee::int8, new_guarantee::int8, \
     old_max_instances::int8, new_max_instances::int8, \
     (extract(epoch FROM old_per) * 1000000)::int8, (extract(epoch FROM new_per) * 1000000)::int8, \
     deleted, inputs FROM permitq.capacity_change WHERE semaphore = $1 ORDER BY id";
/// Operators: every semaphore's usage.
pub(crate) const USAGE: &str = "SELECT name, capacity::int8, used::int8, held::int8, \
     waiting::int8, oldest_wait_since, fair, granted, in_window::int8, \
     (extract(epoch FROM per) * 1000000)::int8, window_opens_at, is_template, template, \
     parent, guarantee::int8, adaptive, adaptive_floor, adaptive_ceiling, fairness_keys \
     FROM permitq.semaphore_usage ORDER BY name";
/// Operators: the holders of one semaphore.
pub(crate) const HOLDERS: &str = "SELECT semaphore, external_id, owner, count::int8, \
     acquired_at, expires_at, fencing_token FROM permitq.holders WHERE semaphore = $1 \
     ORDER BY acquired_at, external_id";
/// Operators: the first waiters of one semaphore, in queue order (the workers' place in line).
pub(crate) const WAITERS: &str = "SELECT semaphore, external_id, owner, count::int8, \
     position, waiting_since, deadline, priority, fairness_key FROM permitq.first_waiters($1, $2::int4)";
/// Downstream fencing check.
pub(crate) const FENCE: &str = "SELECT permitq.fence($1, $2, $3)";

/// Sweeps: each takes its task's turn for its transaction first, so one worker at a time runs
/// it; false when another session holds it.
pub(crate) const TAKE_TURN: &str = "SELECT permitq.take_turn($1)";
/// Worker, each sweep round: how full the cluster's NOTIFY queue is (0 to 1), and the
/// notifications permitq skipped so far because it was filling up.
pub(crate) const NOTIFY_HEALTH: &str = "SELECT pg_notification_queue_usage(), \
     (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM permitq.notify_skipped_seq)";
/// Sweep: wait deadlines → `timeout`.
pub(crate) const SWEEP_WAIT_DEADLINES: &str = "SELECT permitq.sweep_wait_deadlines($1)";
/// Sweep: TTL leases past expires_at → released as `expired`.
pub(crate) const SWEEP_EXPIRED: &str = "SELECT permitq.sweep_expired($1)";
/// Worker, going to sleep: when the next window of a rate-limited semaphore with waiters opens.
pub(crate) const NEXT_WINDOW_OPENING: &str =
    "SELECT extract(epoch FROM permitq.next_window_opening() - clock_timestamp())::float8";
/// Sweep: idle instances of templates, in batches, and grants that left their window (see
/// schema/functions/sweeps.sql).
pub(crate) const SWEEP_IDLE_INSTANCES: &str =
    "SELECT permitq.sweep_idle_instances($1::text::interval, $2)";
/// Sweep: held past --max-hold → released as `stale`.
pub(crate) const SWEEP_STALE: &str = "SELECT permitq.sweep_stale($1::text::interval, $2)";
/// Sweep, at debug level: the requests this transaction settled or released, to name them.
pub(crate) const SWEPT_REQUESTS: &str = "SELECT external_id, state, \
     coalesce(release_reason, error_code) FROM permitq.permit_request \
     WHERE xmin = pg_current_xact_id()::xid";
/// Sweep: owners of held requests, for the liveness hook.
pub(crate) const HELD_OWNERS: &str = "SELECT DISTINCT owner FROM permitq.permit_request \
     WHERE state = 'acquired' AND owner IS NOT NULL";
/// Sweep: release the requests of dead owners as `revoked`.
pub(crate) const REVOKE_OWNERS: &str = "SELECT permitq.revoke_owners($1, $2)";
/// Retention: delete a batch of settled requests.
pub(crate) const DELETE_SETTLED: &str = "SELECT permitq.delete_settled($1::text::interval, $2)";
/// Retention: delete a batch of capacity audit rows.
pub(crate) const DELETE_CAPACITY_CHANGES: &str =
    "SELECT permitq.delete_capacity_changes($1::text::interval, $2)";

/// A duration as PostgreSQL interval text.
pub(crate) fn interval(d: std::time::Duration) -> String {
    format!("{} microseconds", d.as_micros())
}

/// Every statement above that can be prepared, by name (the bookkeeping setup and
/// FUNCTIONS_PRIVATE are utility statements and run on every `migrate`).
#[cfg(test)]
fn all() -> Vec<(&'static str, String)> {
    let mut all: Vec<(&'static str, String)> = [
        ("APPLIED_MIGRATIONS", APPLIED_MIGRATIONS),
        ("CHECKSUM", CHECKSUM),
        ("RECORD_MIGRATION", RECORD_MIGRATION),
        ("FORGET_PRERELEASE_MIGRATIONS", FORGET_PRERELEASE_MIGRATIONS),
        ("SCHEMA_FILE_CHANGED", SCHEMA_FILE_CHANGED),
        ("RECORD_SCHEMA_FILE", RECORD_SCHEMA_FILE),
        ("SCHEMA_IS_CURRENT", SCHEMA_IS_CURRENT),
        ("SWEPT_REQUESTS", SWEPT_REQUESTS),
        ("USAGE", USAGE),
        ("HOLDERS", HOLDERS),
        ("WAITERS", WAITERS),
        ("CLAIM_REQUESTS", CLAIM_REQUESTS),
        ("SETTLE_INVALID", SETTLE_INVALID),
        ("NEXT_BATCH", NEXT_BATCH),
        ("CLAIM_BATCH", CLAIM_BATCH),
        ("LOCK_BATCH_AND_HEADS", LOCK_BATCH_AND_HEADS),
        ("PLACE_BATCH_BY_KEYS", PLACE_BATCH_BY_KEYS),
        ("FOLD_RELEASES", FOLD_RELEASES),
        ("WORKER_SLEEPING", WORKER_SLEEPING),
        ("WORKER_GONE", WORKER_GONE),
        ("WORKER_SEEN", WORKER_SEEN),
        ("GRANTING", GRANTING),
        ("LEAST_MAX_HOLD", LEAST_MAX_HOLD),
        ("WORKERS", WORKERS),
        ("WORK_WAITING", WORK_WAITING),
        ("WAKE_GATE_FREE", WAKE_GATE_FREE),
        ("RELEASES_PENDING", RELEASES_PENDING),
        ("DELETE_DEAD_WORKERS", DELETE_DEAD_WORKERS),
        ("APPLY_DECISION", APPLY_DECISION),
        ("RELEASE", RELEASE),
        ("REVOKE", REVOKE),
        ("HEARTBEAT", HEARTBEAT),
        ("SET_CAPACITY", SET_CAPACITY),
        ("SET_CAPACITY_ADAPTIVE", SET_CAPACITY_ADAPTIVE),
        ("DELETE_SEMAPHORE", DELETE_SEMAPHORE),
        ("LIST_SEMAPHORES", LIST_SEMAPHORES),
        ("SWEEP_IDLE_INSTANCES", SWEEP_IDLE_INSTANCES),
        ("NEXT_WINDOW_OPENING", NEXT_WINDOW_OPENING),
        ("CAPACITY_HISTORY", CAPACITY_HISTORY),
        ("SIMILAR_SEMAPHORES", SIMILAR_SEMAPHORES),
        ("SIMILAR_REQUESTS", SIMILAR_REQUESTS),
        ("UNKNOWN_NAMES", UNKNOWN_NAMES),
        ("ANSWERS_AT_SUBMIT", ANSWERS_AT_SUBMIT),
        ("ADAPTIVE_TURN", ADAPTIVE_TURN),
        ("ADAPTIVE_APPLY", ADAPTIVE_APPLY),
        ("SET_ADAPTIVE", SET_ADAPTIVE),
        ("ADAPTIVE_OF", ADAPTIVE_OF),
        ("ADAPTIVE_LAST_REPORTS", ADAPTIVE_LAST_REPORTS),
        ("SET_FAIRNESS_KEYS", SET_FAIRNESS_KEYS),
        ("LOGIN", LOGIN),
        ("KEY_SHARES", KEY_SHARES),
        ("RELEASE_REPORTING", RELEASE_REPORTING),
        ("REPORT", REPORT),
        ("MAY_WORK", MAY_WORK),
        ("FENCE", FENCE),
        ("TAKE_TURN", TAKE_TURN),
        ("NOTIFY_HEALTH", NOTIFY_HEALTH),
        ("RAISE_TOKEN_EPOCH", RAISE_TOKEN_EPOCH),
        ("RAISE_TOKEN_FLOOR", RAISE_TOKEN_FLOOR),
        ("ROLES_MISSING", ROLES_MISSING),
        ("MIGRATE_OWNERS", MIGRATE_OWNERS),
        ("PUBLIC_ADVISORY_LOCKS", PUBLIC_ADVISORY_LOCKS),
        ("PUBLIC_TEMP", PUBLIC_TEMP),
        ("LOCK_TABLE_SIZE", LOCK_TABLE_SIZE),
        ("PRODUCER_LOGINS", PRODUCER_LOGINS),
        ("SWEEP_WAIT_DEADLINES", SWEEP_WAIT_DEADLINES),
        ("SWEEP_EXPIRED", SWEEP_EXPIRED),
        ("SWEEP_STALE", SWEEP_STALE),
        ("HELD_OWNERS", HELD_OWNERS),
        ("REVOKE_OWNERS", REVOKE_OWNERS),
        ("DELETE_SETTLED", DELETE_SETTLED),
        ("DELETE_CAPACITY_CHANGES", DELETE_CAPACITY_CHANGES),
        ("DURABILITY_BARRIER", DURABILITY_BARRIER),
        ("EXPLAIN", EXPLAIN),
    ]
    .into_iter()
    .map(|(name, sql)| (name, sql.to_string()))
    .collect();
    all.push(("SUBMIT", SUBMIT.clone()));
    all.push(("STATUS", STATUS.clone()));
    for channel in [WORK_CHANNEL, EVENTS_CHANNEL] {
        all.push(("LISTEN", format!("LISTEN {channel}")));
    }
    all
}

#[cfg(test)]
mod tests {
    /// A typo in any statement fails here, against a migrated database, not in production.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_statement_prepares_against_a_migrated_database() {
        let db = permitq_test_support::TestDb::new().await;
        let conn = db.conn().await;
        let mut failed = Vec::new();
        for (name, sql) in super::all() {
            if let Err(e) = conn.prepare(&sql).await {
                failed.push(format!("{name}: {e:?}"));
            }
        }
        assert!(failed.is_empty(), "{failed:#?}");
    }
}
