//! PgBouncer in front of the test server, in transaction pooling mode: what many managed
//! PostgreSQL offerings put in front of applications. Debian's `pgbouncer` (1.18: no prepared
//! statements across transactions in this mode).

use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running PgBouncer; stopped (and its directory removed) when dropped.
#[derive(Debug)]
pub struct PgBouncer {
    child: Child,
    dir: PathBuf,
    port: u16,
    upstream: tokio_postgres::Config,
}

impl PgBouncer {
    /// Starts PgBouncer in `pool_mode` (`transaction` or `session`) in front of the server of
    /// `upstream_url`, with `pool_size` server connections per database and user. Any client
    /// user name is accepted; it connects upstream as the URL's user and password. Runs as the
    /// `postgres` OS user when root (PgBouncer refuses to run as root). Panics when it cannot
    /// start (the test then fails, naming the missing `pgbouncer` package).
    pub fn start(upstream_url: &str, pool_mode: &str, pool_size: u32) -> PgBouncer {
        let upstream: tokio_postgres::Config = upstream_url.parse().expect("a URL");
        let host = match upstream.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "127.0.0.1".to_string(),
        };
        let upstream_port = upstream.get_ports().first().copied().unwrap_or(5432);
        let user = upstream.get_user().unwrap_or("postgres").to_string();
        let password = upstream
            .get_password()
            .map(|p| format!(" password={}", String::from_utf8_lossy(p)))
            .unwrap_or_default();
        let port = permitq_embedded_pg::free_port().expect("a free port");
        let dir = std::env::temp_dir().join(format!("permitq-pgbouncer-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let config = format!(
            "[databases]\n\
             * = host={host} port={upstream_port} user={user}{password}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = any\n\
             pool_mode = {pool_mode}\n\
             default_pool_size = {pool_size}\n\
             max_client_conn = 200\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {log}\n\
             pidfile = {pid}\n",
            log = dir.join("pgbouncer.log").display(),
            pid = dir.join("pgbouncer.pid").display(),
        );
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(&ini, config).unwrap();
        let mut cmd = Command::new("pgbouncer");
        cmd.arg(&ini)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0);
        crate::server_user::as_server_user(&mut cmd, &dir);
        let child = cmd
            .spawn()
            .expect("pgbouncer (Debian's pgbouncer package, installed by scripts/test)");
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            let log = std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default();
            assert!(Instant::now() < deadline, "pgbouncer did not start: {log}");
            std::thread::sleep(Duration::from_millis(50));
        }
        PgBouncer {
            child,
            dir,
            port,
            upstream,
        }
    }

    /// A URL of database `db` through PgBouncer.
    pub fn url(&self, db: &str) -> String {
        let user = self.upstream.get_user().unwrap_or("postgres");
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
