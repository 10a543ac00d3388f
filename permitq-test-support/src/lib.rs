//! Test support for permitq (not published, used only by tests): one PostgreSQL per test binary
//! and a freshly migrated database per test, in-process workers, waiting on a condition with a
//! deadline, the invariant check every concurrency test runs, and PgBouncer in front of the
//! server. Re-exports the throwaway cluster and the Patroni + etcd cluster
//! (`permitq-embedded-pg`) and the run reports (`permitq-fleet`) the tests also use.

mod pgbouncer;
mod server_user;
mod testdb;

pub use pgbouncer::PgBouncer;

pub use permitq_embedded_pg::{
    error, find_bin_dir, try_connect, EmbeddedPostgres, Error, NetworkBed, PatroniCluster,
    PatroniOptions, Result, StopMode, PATRONI_TTL, THROWAWAY_SETTINGS,
};
pub use permitq_fleet::{
    collect, database, invariant_violations, listen, quantile, queue_and_grants, Percentiles,
    RunReport, WorkerFleet,
};
/// A new, empty directory of this run's own under the temp directory (`permitq-NAME-<uuid>`),
/// for a test's files and logs: two runs on one machine never share one.
pub fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("permitq-{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("create a scratch directory");
    dir
}

/// A server on loopback that asks every client for a password (as one with md5 or scram in
/// pg_hba.conf does) and goes no further; its port.
pub fn password_asking_server() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        while let Ok((mut socket, _)) = listener.accept() {
            let mut startup = [0u8; 512];
            let _ = socket.read(&mut startup);
            // AuthenticationCleartextPassword.
            let _ = socket.write_all(&[b'R', 0, 0, 0, 8, 0, 0, 0, 3]);
            let _ = socket.read(&mut startup);
        }
    });
    port
}

pub use testdb::{
    as_user, check_invariants, connect, db_of, event_ids, init_logging, quiet_config,
    requests_by_id, semaphore, semaphore_locked, settled_state, signal, state_of,
    unexamined_requests, until_marker, user_of, wait_folded, wait_until, with_dbname,
    RunningWorker, TestDb,
};
