//! A throwaway PostgreSQL cluster from the system's binaries, for `permitq demo` and the tests.
//!
//! `initdb` and `postgres` refuse to run as root, so when this process is root the cluster runs
//! as the `postgres` OS user (the child processes get its uid and gid; no sudo needed). The
//! server runs in its own process group, so a Ctrl-C in the terminal does not reach it, and a
//! small guard process removes it when this process exits by any means: it waits for EOF on a
//! pipe from us, then stops the server (`-m immediate`) and deletes the directory. Dropping the
//! [`EmbeddedPostgres`] does the same at once.

use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::Result;

/// The server settings of test clusters: no flushes (no OS crash is simulated, so WAL written
/// survives a kill; synchronous commit stays on).
pub const THROWAWAY_SETTINGS: [(&str, &str); 2] = [("fsync", "off"), ("full_page_writes", "off")];

/// How to stop the server (`pg_ctl stop -m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopMode {
    /// Disconnect clients, checkpoint, stop.
    Fast,
    /// Abort at once, like a crash: recovery runs at the next start.
    Immediate,
}

/// A running throwaway cluster, removed on drop.
#[derive(Debug)]
pub struct EmbeddedPostgres {
    root: PathBuf,
    data: PathBuf,
    bin: PathBuf,
    port: u16,
    run_as: Option<(u32, u32)>,
    guard: Option<Child>,
    settings: Vec<(String, String)>,
    /// The network namespace the server runs in (see [`crate::NetworkBed`]), if any.
    namespace: Option<String>,
    /// `listen_addresses`.
    listen: String,
    /// Left running on drop (see [`EmbeddedPostgres::keep`]).
    kept: bool,
}

impl EmbeddedPostgres {
    /// Creates and starts a cluster on a free loopback port (blocking; a few seconds), with
    /// `fsync=off` (see [`EmbeddedPostgres::start_server`]): for tests.
    pub fn start() -> Result<EmbeddedPostgres> {
        EmbeddedPostgres::start_with(&THROWAWAY_SETTINGS)
    }

    /// Like [`EmbeddedPostgres::start`], with these server settings instead of the test ones
    /// (`permitq bench` runs with `fsync=on`, the default, because fsync off hides exactly the
    /// commit costs it measures).
    pub fn start_with(settings: &[(&str, &str)]) -> Result<EmbeddedPostgres> {
        EmbeddedPostgres::prepare(settings)?.init_and_start()
    }

    /// Like [`EmbeddedPostgres::start`], in network namespace `namespace`, listening on
    /// `address` (and on its Unix socket: [`EmbeddedPostgres::socket_config`]).
    pub fn start_in_namespace(namespace: &str, address: &str) -> Result<EmbeddedPostgres> {
        let mut pg = EmbeddedPostgres::prepare(&THROWAWAY_SETTINGS)?;
        pg.namespace = Some(namespace.to_string());
        pg.listen = address.to_string();
        pg.init_and_start()
    }

    /// A `key=value` connection string for database `db` over the Unix socket, which works
    /// from any network namespace.
    pub fn socket_config(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db}",
            self.root.display(),
            self.port
        )
    }

    /// A new, empty cluster in the data directory.
    fn initdb(&self) -> Result<()> {
        self.run(
            "initdb",
            &[
                "-D",
                self.data_str(),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ],
        )
    }

    fn init_and_start(self) -> Result<EmbeddedPostgres> {
        let pg = self;
        pg.initdb()?;
        if pg.namespace.is_some() {
            // The bed's hosts connect from their own addresses (only the bed reaches this one).
            let mut hba = std::fs::OpenOptions::new()
                .append(true)
                .open(pg.data.join("pg_hba.conf"))?;
            writeln!(hba, "host all all 0.0.0.0/0 trust")?;
        }
        pg.start_server()?;
        Ok(pg)
    }

    /// Upgrades this cluster with `pg_upgrade` into a new one of the same binaries (a new data
    /// directory, `initdb` afresh, so a new system identifier and WAL starting again at timeline
    /// 1, as a major-version upgrade would), stops this one and starts the new one, which is
    /// returned (removed on drop like any other).
    pub fn upgrade(&self) -> Result<EmbeddedPostgres> {
        let new = EmbeddedPostgres::prepare(&self.settings_pairs())?;
        new.initdb()?;
        self.stop(StopMode::Fast)?;
        let (old_bin, new_bin) = (path_str(&self.bin), path_str(&new.bin));
        let (old_port, new_port) = (self.port.to_string(), new.port.to_string());
        new.run(
            "pg_upgrade",
            &[
                "-b",
                old_bin,
                "-B",
                new_bin,
                "-p",
                &old_port,
                "-P",
                &new_port,
                "-d",
                self.data_str(),
                "-D",
                new.data_str(),
                "-U",
                "postgres",
                "--no-sync",
            ],
        )?;
        new.start_server()?;
        Ok(new)
    }

    /// This cluster's server settings, as `prepare` takes them.
    fn settings_pairs(&self) -> Vec<(&str, &str)> {
        self.settings
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    /// Creates and starts a streaming standby of this cluster (`pg_basebackup -R`: it follows
    /// this server through `primary_conninfo`) on its own port, with these server settings. It
    /// is removed on drop like any other; [`EmbeddedPostgres::promote`] makes it a primary.
    ///
    /// For synchronous replication, start the primary with `synchronous_standby_names = '*'`
    /// and do not give the standby that setting (once promoted it would wait for a standby of
    /// its own).
    pub fn start_standby(&self, settings: &[(&str, &str)]) -> Result<EmbeddedPostgres> {
        let standby = EmbeddedPostgres::prepare(settings)?;
        let port = self.port.to_string();
        standby.run(
            "pg_basebackup",
            &[
                "-D",
                standby.data_str(),
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        )?;
        standby.start_server()?;
        Ok(standby)
    }

    /// Promotes this standby to a primary (`pg_ctl promote`, waiting until it accepts writes).
    pub fn promote(&self) -> Result<()> {
        self.run(
            "pg_ctl",
            &["-D", self.data_str(), "-w", "-t", "60", "promote"],
        )
    }

    /// A root directory, a free port and the cleanup guard; no cluster yet.
    fn prepare(settings: &[(&str, &str)]) -> Result<EmbeddedPostgres> {
        let bin = find_bin_dir()?;
        let run_as = server_user()?;
        let root =
            std::env::temp_dir().join(format!("permitq-pg-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&root)?;
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&root, Some(uid), Some(gid))?;
        }
        let port = free_port()?;
        let mut pg = EmbeddedPostgres {
            data: root.join("data"),
            root,
            bin,
            port,
            run_as,
            guard: None,
            settings: settings
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            namespace: None,
            listen: "127.0.0.1".to_string(),
            kept: false,
        };
        pg.guard = Some(pg.spawn_guard()?);
        Ok(pg)
    }

    /// The port the server listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for database `db` as the superuser `postgres`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// The server log.
    pub fn log_path(&self) -> PathBuf {
        self.root.join("postgres.log")
    }

    /// Stops the server, keeping its data (for restart tests).
    pub fn stop(&self, mode: StopMode) -> Result<()> {
        let mode = match mode {
            StopMode::Fast => "fast",
            StopMode::Immediate => "immediate",
        };
        self.run("pg_ctl", &["-D", self.data_str(), "-m", mode, "-w", "stop"])
    }

    /// Starts the server again after [`EmbeddedPostgres::stop`], on the same port.
    ///
    /// Tests run with `fsync=off` (no OS crash is simulated, so written WAL survives) but
    /// synchronous commit stays on: a commit acknowledged to a client survives
    /// `stop(Immediate)`, which the fault tests rely on.
    pub fn start_server(&self) -> Result<()> {
        let options = self.server_options();
        let log = self.log_path();
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data_str(),
                "-l",
                path_str(&log),
                "-w",
                "-t",
                "60",
                "-o",
                &options,
                "start",
            ],
        )
    }

    /// The shell command that starts a kept server (see [`EmbeddedPostgres::keep`]) again after
    /// it was stopped, on its port and socket directory (a plain `pg_ctl start` would take the
    /// default port).
    #[must_use]
    pub fn start_command(&self) -> String {
        let start = format!(
            "{} -D {} -l {} -w -o \"{}\" start",
            self.bin.join("pg_ctl").display(),
            self.data.display(),
            self.log_path().display(),
            self.server_options()
        );
        match self.run_as {
            Some(_) => format!("su postgres -s /bin/sh -c '{start}'"),
            None => start,
        }
    }

    /// The server's options (`pg_ctl -o`): its port, socket directory, listen address and
    /// settings.
    fn server_options(&self) -> String {
        let mut options = format!(
            "-p {} -k {} -c listen_addresses={} -c max_connections=400 -c shared_buffers=128MB",
            self.port,
            self.root.display(),
            self.listen
        );
        for (name, value) in &self.settings {
            options.push_str(&format!(" -c {name}={value}"));
        }
        options
    }

    fn data_str(&self) -> &str {
        path_str(&self.data)
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = command_as(
            self.bin.join(program),
            self.run_as,
            self.namespace.as_deref(),
        );
        cmd.process_group(0)
            .current_dir(&self.root)
            .env("LC_ALL", "C");
        cmd
    }

    fn run(&self, program: &str, args: &[&str]) -> Result<()> {
        let out = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| crate::error(format!("cannot run {program}: {e}")))?;
        if out.status.success() {
            return Ok(());
        }
        let log = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        Err(crate::error(format!(
            "{program} failed ({}): {} {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        )))
    }

    /// Leaves the server running after this process exits: the cleanup guard is stopped
    /// without running, and dropping this value no longer stops the server. Returns the shell
    /// command that stops the server and removes its directory, for the user to run.
    pub fn keep(&mut self) -> String {
        if let Some(mut guard) = self.guard.take() {
            // SIGKILL: the guard ignores INT, TERM and HUP, and stdin's EOF is what runs it.
            let _ = guard.kill();
            let _ = guard.wait();
        }
        self.kept = true;
        let stop = format!(
            "{} -D {} -m fast stop",
            self.bin.join("pg_ctl").display(),
            self.data.display()
        );
        let stop = match self.run_as {
            Some(_) => format!("su postgres -s /bin/sh -c '{stop}'"),
            None => stop,
        };
        format!("{stop} && rm -rf {}", self.root.display())
    }

    /// The dead man's switch: when our end of its stdin closes (we exit or drop), it stops the
    /// server and removes the directory.
    fn spawn_guard(&self) -> Result<Child> {
        let script = r#"trap '' INT TERM HUP; cat >/dev/null; "$0" -D "$1" -m immediate -w stop >/dev/null 2>&1; rm -rf "$2""#;
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(script)
            .arg(self.bin.join("pg_ctl"))
            .arg(&self.data)
            .arg(&self.root)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((uid, gid)) = self.run_as {
            cmd.uid(uid).gid(gid);
        }
        cmd.spawn()
            .map_err(|e| crate::error(format!("cannot start the cleanup guard: {e}")))
    }
}

impl Drop for EmbeddedPostgres {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        let _ = self.stop(StopMode::Fast);
        if let Some(mut guard) = self.guard.take() {
            if let Some(mut stdin) = guard.stdin.take() {
                let _ = stdin.flush();
            }
            let _ = guard.wait();
        }
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("temp paths are UTF-8")
}

/// The directory of the PostgreSQL server binaries (`initdb`, `pg_ctl`, `pg_dump`, ...):
/// `$PERMITQ_PG_BINDIR`, else the newest `/usr/lib/postgresql/*/bin`, else the directory of
/// `initdb` on PATH.
pub fn find_bin_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("PERMITQ_PG_BINDIR") {
        return Ok(PathBuf::from(dir));
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let version = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    if let Some((_, bin)) = versions.pop() {
        return Ok(bin);
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .find(|dir| dir.join("initdb").exists() && dir.join("pg_ctl").exists())
        .ok_or_else(|| {
            crate::error(
                "no PostgreSQL server binaries found (initdb, pg_ctl): install PostgreSQL, set \
                 PERMITQ_PG_BINDIR, or set DATABASE_URL to use a running server",
            )
        })
}

/// A command that runs `program` as `user` (`None`: this process's own user), in network
/// namespace `namespace` when given. `ip netns exec` needs root, so there the user changes
/// after it (setpriv, util-linux).
pub(crate) fn command_as(
    program: impl AsRef<std::ffi::OsStr>,
    user: Option<(u32, u32)>,
    namespace: Option<&str>,
) -> Command {
    match namespace {
        None => {
            let mut cmd = Command::new(program);
            if let Some((uid, gid)) = user {
                cmd.uid(uid).gid(gid);
            }
            cmd
        }
        Some(ns) => {
            let mut cmd = Command::new("ip");
            cmd.args(["netns", "exec", ns]);
            if let Some((uid, gid)) = user {
                cmd.args([
                    "setpriv",
                    &format!("--reuid={uid}"),
                    &format!("--regid={gid}"),
                    "--clear-groups",
                    "--",
                ]);
            }
            cmd.arg(program);
            cmd
        }
    }
}

/// The OS user (uid, gid) that server processes run as: `postgres` when this process is root
/// (PostgreSQL, PgBouncer and Patroni refuse root), `None` (this process's own) otherwise.
pub fn server_user() -> Result<Option<(u32, u32)>> {
    let root = std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false);
    if root {
        lookup_user("postgres").map(Some)
    } else {
        Ok(None)
    }
}

fn lookup_user(name: &str) -> Result<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() > 3 && f[0] == name)
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .ok_or_else(|| {
            crate::error(format!(
                "running as root, and PostgreSQL will not: no `{name}` OS user to run it as"
            ))
        })
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> Result<u16> {
    let socket = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(socket.local_addr()?.port())
}
