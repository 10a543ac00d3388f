//! A high-availability cluster run by real tools: etcd (1 or 3 members) and Patroni managing
//! three PostgreSQL members, with `synchronous_mode` on or off. On loopback, or with a
//! [`NetworkBed`] each member and each etcd member on a host of its own (`pg1`..`pg3`,
//! `etcd1`..), so that a host can be partitioned. Patroni decides on promotion and manages
//! replication itself; callers only inject faults (SIGKILL of a member's Patroni, of its
//! PostgreSQL, or both; a partition; a switchover) and read the cluster through the REST API.
//! Debian's `patroni` (3.0) and `etcd-server` (3.4). Every process is killed and the directory
//! removed when the cluster is dropped.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{error, find_bin_dir, free_port, server_user, NetworkBed, Result};

/// The shape of a cluster.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct PatroniOptions {
    /// Patroni's `synchronous_mode`: a commit is acknowledged once a standby has it, and only
    /// that standby may be promoted.
    pub synchronous: bool,
    /// etcd members: 1 or 3.
    pub etcd_members: usize,
}

impl PatroniOptions {
    /// `synchronous_mode` on or off, one etcd member.
    #[must_use]
    pub fn new(synchronous: bool) -> PatroniOptions {
        PatroniOptions {
            synchronous,
            etcd_members: 1,
        }
    }

    /// With `n` etcd members (1 or 3).
    #[must_use]
    pub fn etcd_members(mut self, n: usize) -> PatroniOptions {
        self.etcd_members = n;
        self
    }

    /// The `bootstrap:` section of the members' Patroni configuration (YAML): the cluster-wide
    /// settings Patroni writes to etcd, `synchronous_mode` among them.
    #[must_use]
    pub fn bootstrap(&self) -> String {
        format!(
            "bootstrap:\n  dcs:\n    ttl: {PATRONI_TTL}\n    loop_wait: {LOOP_WAIT}\n\
             \x20   retry_timeout: {RETRY_TIMEOUT}\n    synchronous_mode: {sync}\n\
             \x20   maximum_lag_on_failover: 1048576\n\
             \x20   postgresql:\n      use_pg_rewind: true\n      parameters:\n\
             \x20       max_connections: 200\n        wal_log_hints: 'on'\n\
             \x20       max_wal_senders: 10\n        max_replication_slots: 10\n\
             \x20 initdb:\n    - encoding: UTF8\n    - auth: trust\n\
             \x20 pg_hba:\n    - local all all trust\n    - host all all 0.0.0.0/0 trust\n\
             \x20   - host replication all 0.0.0.0/0 trust\n",
            sync = self.synchronous
        )
    }

    /// The bed hosts a cluster of this shape runs on: `pg1`..`pg3`, then `etcd1`...
    #[must_use]
    pub fn hosts(&self) -> Vec<String> {
        (1..=3)
            .map(|i| format!("pg{i}"))
            .chain((1..=self.etcd_members).map(|i| format!("etcd{i}")))
            .collect()
    }
}

/// Patroni's timing, written into the cluster's configuration (seconds): the leader key's
/// `ttl`, the HA loop's `loop_wait`, and `retry_timeout` for DCS and PostgreSQL calls.
pub const PATRONI_TTL: u64 = 10;
const LOOP_WAIT: u64 = 1;
const RETRY_TIMEOUT: u64 = 4;

/// One process of the cluster: its child, host (on a bed) and address. For an etcd member,
/// `pg_port` is its peer port and `rest_port` its client port.
#[derive(Debug)]
struct Member {
    name: String,
    host: Option<String>,
    address: String,
    child: Option<Child>,
    pg_port: u16,
    rest_port: u16,
}

/// etcd and three Patroni members.
#[derive(Debug)]
pub struct PatroniCluster {
    dir: PathBuf,
    bed: Option<Arc<NetworkBed>>,
    etcd: Vec<Member>,
    members: Vec<Member>,
    options: PatroniOptions,
}

/// SIGKILL to process group `pgid`. (`kill -KILL -PGID` without `--` is not parsed as a group
/// by procps: always pass `--`, and never a group below 2.)
fn kill_group(pgid: u32) {
    if pgid > 1 {
        let _ = Command::new("kill")
            .args(["-s", "KILL", "--", &format!("-{pgid}")])
            .stderr(Stdio::null())
            .status();
    }
}

/// The pid in `data`'s postmaster.pid, if that process is alive and still works in `data`
/// (so a pid the system reused is never taken for it).
fn postmaster_of(data: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(data.join("postmaster.pid")).ok()?;
    let pid: u32 = text.lines().next()?.trim().parse().ok()?;
    if pid < 2 {
        return None;
    }
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok()?;
    (cwd == std::fs::canonicalize(data).ok()?).then_some(pid)
}

/// `GET path` on `address:port`: the status code (0 when nothing answers within a second).
fn http_status(address: &str, port: u16, path: &str) -> u16 {
    let Ok(addr) = format!("{address}:{port}").parse::<std::net::SocketAddr>() else {
        return 0;
    };
    let Ok(mut stream) = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else {
        return 0;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return 0;
    }
    let mut reply = String::new();
    let _ = stream.read_to_string(&mut reply);
    reply
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

impl PatroniCluster {
    /// Starts etcd and three members and waits until one leads, every other one replicates
    /// and, with `synchronous_mode`, one is the synchronous standby. With `bed` (which must
    /// have the hosts [`PatroniOptions::hosts`] names, and be linked to this process with
    /// [`NetworkBed::link_here`]), each runs on its own host.
    pub fn start(options: PatroniOptions, bed: Option<Arc<NetworkBed>>) -> Result<PatroniCluster> {
        if ![1, 3].contains(&options.etcd_members) {
            return Err(error("etcd runs with 1 or 3 members"));
        }
        let dir = std::env::temp_dir().join(format!(
            "permitq-patroni-{}-{}",
            std::process::id(),
            free_port()?
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        if let Some((uid, gid)) = server_user()? {
            std::os::unix::fs::chown(&dir, Some(uid), Some(gid))?;
        }
        let place = |name: String, host: String| -> Result<Member> {
            let (host, address) = match &bed {
                Some(b) => (Some(host.clone()), b.address(&host).to_string()),
                None => (None, "127.0.0.1".to_string()),
            };
            Ok(Member {
                name,
                host,
                address,
                child: None,
                pg_port: free_port()?,
                rest_port: free_port()?,
            })
        };
        let mut cluster = PatroniCluster {
            dir,
            bed: bed.clone(),
            etcd: Vec::new(),
            members: Vec::new(),
            options,
        };
        for i in 1..=options.etcd_members {
            cluster
                .etcd
                .push(place(format!("e{i}"), format!("etcd{i}"))?);
        }
        for i in 1..=3 {
            cluster
                .members
                .push(place(format!("m{i}"), format!("pg{i}"))?);
        }
        for i in 0..cluster.etcd.len() {
            cluster.start_etcd(i)?;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster
            .etcd
            .iter()
            .all(|e| http_status(&e.address, e.rest_port, "/health") == 200)
        {
            if Instant::now() > deadline {
                return Err(error("etcd did not start"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        for i in 0..3 {
            cluster.write_config(i)?;
            cluster.start_member(i)?;
            if i == 0 {
                cluster.wait_for_leader(Duration::from_secs(90))?;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        while !cluster.healthy() {
            if Instant::now() > deadline {
                return Err(error(format!(
                    "the Patroni cluster did not become healthy: {}",
                    cluster.logs()
                )));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(cluster)
    }

    /// A command for `program` on `member`'s host, as the server user.
    fn command(&self, member: &Member, program: &str) -> Result<Command> {
        let namespace = match (&self.bed, &member.host) {
            (Some(bed), Some(host)) => Some(bed.namespace(host)),
            _ => None,
        };
        let mut cmd = crate::embedded::command_as(program, server_user()?, namespace);
        let log = std::fs::File::create(self.dir.join(format!("{}.log", member.name)))?;
        cmd.current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0);
        Ok(cmd)
    }

    fn start_etcd(&mut self, i: usize) -> Result<()> {
        let e = &self.etcd[i];
        let peer = |m: &Member| format!("http://{}:{}", m.address, m.pg_port);
        let client = format!("http://{}:{}", e.address, e.rest_port);
        let initial: Vec<String> = self
            .etcd
            .iter()
            .map(|m| format!("{}={}", m.name, peer(m)))
            .collect();
        let mut cmd = self.command(e, "etcd")?;
        cmd.args([
            "--name",
            &e.name,
            "--data-dir",
            &self
                .dir
                .join(format!("etcd-{}", e.name))
                .display()
                .to_string(),
            "--listen-client-urls",
            &client,
            "--advertise-client-urls",
            &client,
            "--listen-peer-urls",
            &peer(e),
            "--initial-advertise-peer-urls",
            &peer(e),
            "--initial-cluster",
            &initial.join(","),
            "--initial-cluster-token",
            &format!("permitq-{}", self.dir.display()),
        ]);
        let child = cmd
            .spawn()
            .map_err(|e| error(format!("etcd (Debian's etcd-server): {e}")))?;
        self.etcd[i].child = Some(child);
        Ok(())
    }

    fn write_config(&self, i: usize) -> Result<()> {
        let m = &self.members[i];
        let etcd: Vec<String> = self
            .etcd
            .iter()
            .map(|e| format!("{}:{}", e.address, e.rest_port))
            .collect();
        let socket_dir = self.dir.join(format!("socket-{}", m.name));
        std::fs::create_dir_all(&socket_dir)?;
        if let Some((uid, gid)) = server_user()? {
            std::os::unix::fs::chown(&socket_dir, Some(uid), Some(gid))?;
        }
        let config = format!(
            "scope: permitq-{scope}\n\
             name: {name}\n\
             restapi:\n  listen: {addr}:{rest}\n  connect_address: {addr}:{rest}\n\
             etcd3:\n  hosts: {etcd}\n\
             {bootstrap}\
             postgresql:\n  listen: {addr}:{pg}\n  connect_address: {addr}:{pg}\n\
             \x20 data_dir: {data}\n  bin_dir: {bin}\n  pgpass: {dir}/pgpass-{name}\n\
             \x20 authentication:\n    replication:\n      username: postgres\n\
             \x20   superuser:\n      username: postgres\n\
             \x20 parameters:\n    unix_socket_directories: {socket}\n",
            scope = self.etcd[0].rest_port,
            name = m.name,
            addr = m.address,
            rest = m.rest_port,
            etcd = etcd.join(","),
            bootstrap = self.options.bootstrap(),
            pg = m.pg_port,
            data = self.data_dir(i).display(),
            bin = find_bin_dir()?.display(),
            dir = self.dir.display(),
            socket = socket_dir.display(),
        );
        std::fs::write(self.dir.join(format!("{}.yml", m.name)), config)?;
        Ok(())
    }

    fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.join(format!("data-{}", self.members[i].name))
    }

    fn start_member(&mut self, i: usize) -> Result<()> {
        let config = self.dir.join(format!("{}.yml", self.members[i].name));
        let mut cmd = self.command(&self.members[i], "patroni")?;
        cmd.arg(config);
        let child = cmd
            .spawn()
            .map_err(|e| error(format!("patroni (Debian's patroni): {e}")))?;
        self.members[i].child = Some(child);
        Ok(())
    }

    /// The last lines of every member's Patroni log, for a failure message.
    #[must_use]
    pub fn logs(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let log = std::fs::read_to_string(self.dir.join(format!("{}.log", m.name)))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(8).collect();
                format!(
                    "{}: {}",
                    m.name,
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// How many members there are (3).
    #[must_use]
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Never: a cluster has three members.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i`'s bed host (`pg1`..), on a bed.
    #[must_use]
    pub fn host(&self, i: usize) -> Option<&str> {
        self.members[i].host.as_deref()
    }

    /// Whether member `i`'s Patroni runs (it was not killed, or was restarted).
    #[must_use]
    pub fn is_running(&self, i: usize) -> bool {
        self.members[i].child.is_some()
    }

    /// The index of the member that leads now (its REST API answers 200 on `/leader`).
    #[must_use]
    pub fn leader(&self) -> Option<usize> {
        self.members.iter().position(|m| {
            m.child.is_some() && http_status(&m.address, m.rest_port, "/leader") == 200
        })
    }

    /// Waits until some member leads; returns it.
    pub fn wait_for_leader(&self, timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.leader() {
                return Ok(i);
            }
            if Instant::now() > deadline {
                return Err(error(format!("no leader: {}", self.logs())));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Whether member `i` is the synchronous standby.
    #[must_use]
    pub fn is_sync_standby(&self, i: usize) -> bool {
        let m = &self.members[i];
        m.child.is_some() && http_status(&m.address, m.rest_port, "/sync") == 200
    }

    /// A leader, every other running member a streaming replica, and with `synchronous_mode`
    /// one of them the synchronous standby.
    #[must_use]
    pub fn healthy(&self) -> bool {
        let Some(leader) = self.leader() else {
            return false;
        };
        let replicas = self
            .members
            .iter()
            .enumerate()
            .filter(|(i, m)| *i != leader && m.child.is_some())
            .all(|(_, m)| http_status(&m.address, m.rest_port, "/replica") == 200);
        let sync = !self.options.synchronous || (0..self.len()).any(|i| self.is_sync_standby(i));
        replicas && sync
    }

    /// The URL of database `db` on whichever member is writable: every member, with
    /// `target_session_attrs=read-write`.
    #[must_use]
    pub fn url(&self, db: &str) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}:{}", m.address, m.pg_port))
            .collect();
        format!(
            "postgres://postgres@{}/{db}?target_session_attrs=read-write&connect_timeout=2",
            hosts.join(",")
        )
    }

    /// SIGKILL to member `i`'s Patroni only. Its PostgreSQL runs on (Patroni starts it in a
    /// session of its own) and nobody renews the leader key.
    pub fn kill_patroni(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            kill_group(child.id());
            let _ = child.wait();
        }
    }

    /// SIGKILL to member `i`'s postmaster only (its Patroni notices and acts), by its pid file,
    /// and only while that pid is still this member's postmaster, never a reused pid.
    pub fn kill_postgres(&self, i: usize) {
        let data = self.data_dir(i);
        if let Some(pid) = postmaster_of(&data) {
            let _ = Command::new("kill")
                .args(["-s", "KILL", "--", &pid.to_string()])
                .stderr(Stdio::null())
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while postmaster_of(&data) == Some(pid) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Kills member `i` outright: its Patroni, then its PostgreSQL, so its leader key runs out
    /// and Patroni promotes another member.
    pub fn kill_member(&mut self, i: usize) {
        self.kill_patroni(i);
        self.kill_postgres(i);
        let _ = std::fs::remove_file(self.data_dir(i).join("postmaster.pid"));
    }

    /// Starts member `i`'s Patroni again: it takes over its PostgreSQL if that still runs
    /// (demoting it when another member leads), else starts it, rewound if needed.
    pub fn restart_member(&mut self, i: usize) -> Result<()> {
        if self.members[i].child.is_none() {
            self.start_member(i)?;
        }
        Ok(())
    }

    /// `patronictl switchover` from the leader to another member (the synchronous standby with
    /// `synchronous_mode`), forced (no prompt); an error unless Patroni reports success.
    pub fn switchover(&self) -> Result<()> {
        let leader = self.wait_for_leader(Duration::from_secs(30))?;
        // With synchronous_mode, Patroni hands over only to the synchronous standby.
        let candidate = (0..self.len())
            .find(|&i| {
                i != leader
                    && self.members[i].child.is_some()
                    && (!self.options.synchronous || self.is_sync_standby(i))
            })
            .ok_or_else(|| error("no candidate for a switchover"))?;
        let mut cmd = Command::new("patronictl");
        cmd.args([
            "-c",
            &self
                .dir
                .join(format!("{}.yml", self.members[leader].name))
                .display()
                .to_string(),
            "switchover",
            "--leader",
            &self.members[leader].name,
            "--candidate",
            &self.members[candidate].name,
            "--force",
        ])
        .stdin(Stdio::null());
        if let Some((uid, gid)) = server_user()? {
            cmd.uid(uid).gid(gid);
        }
        let out = cmd.output()?;
        if out.status.success() && String::from_utf8_lossy(&out.stdout).contains("Successfully") {
            Ok(())
        } else {
            Err(error(format!(
                "switchover: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )))
        }
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
        for e in &mut self.etcd {
            if let Some(mut child) = e.child.take() {
                kill_group(child.id());
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
