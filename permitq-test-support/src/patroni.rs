//! A high-availability cluster run by real tools: etcd (one member) and Patroni managing three
//! PostgreSQL members on loopback, each with its own port and REST API (and a scope of its own,
//! so clusters never meet in etcd). Patroni decides on promotion and manages
//! `synchronous_mode` itself; the tests only
//! inject faults (SIGKILL of a member's Patroni and PostgreSQL, a switchover) and read the
//! cluster through the REST API. Debian's `patroni` (3.0) and `etcd-server` (3.4).

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::server_user::as_server_user;

/// One Patroni member: its process (group), and its PostgreSQL and REST ports.
#[derive(Debug)]
struct Member {
    name: String,
    child: Option<Child>,
    pg_port: u16,
    rest_port: u16,
}

/// etcd and three Patroni members; everything is stopped and removed when dropped.
#[derive(Debug)]
pub struct PatroniCluster {
    dir: PathBuf,
    etcd: Child,
    etcd_port: u16,
    members: Vec<Member>,
    synchronous: bool,
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

fn free_port() -> u16 {
    permitq_embedded_pg::free_port().expect("a free port")
}

/// The pid in `data`'s postmaster.pid, if that process is alive and still works in `data`
/// (so a pid the system reused is never taken for it).
fn postmaster_of(data: &std::path::Path) -> Option<u32> {
    let text = std::fs::read_to_string(data.join("postmaster.pid")).ok()?;
    let pid: u32 = text.lines().next()?.trim().parse().ok()?;
    if pid < 2 {
        return None;
    }
    let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).ok()?;
    (cwd == std::fs::canonicalize(data).ok()?).then_some(pid)
}

/// `GET path` on 127.0.0.1:`port`: the status code (0 when nothing answers).
fn http_status(port: u16, path: &str) -> u16 {
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return 0;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request = format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
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
    /// Starts etcd and three members (`synchronous_mode` on or off) and waits until one leads
    /// and, with `synchronous`, one is its synchronous standby. Panics when it cannot (the
    /// test fails, naming the packages).
    pub fn start(synchronous: bool) -> PatroniCluster {
        let etcd_port = free_port();
        let peer_port = free_port();
        let dir = std::env::temp_dir().join(format!("permitq-patroni-{etcd_port}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = Command::new("etcd");
        cmd.args([
            "--name",
            "e1",
            "--data-dir",
            dir.join("etcd").to_str().unwrap(),
            "--listen-client-urls",
            &format!("http://127.0.0.1:{etcd_port}"),
            "--advertise-client-urls",
            &format!("http://127.0.0.1:{etcd_port}"),
            "--listen-peer-urls",
            &format!("http://127.0.0.1:{peer_port}"),
            "--initial-advertise-peer-urls",
            &format!("http://127.0.0.1:{peer_port}"),
            "--initial-cluster",
            &format!("e1=http://127.0.0.1:{peer_port}"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
        as_server_user(&mut cmd, &dir);
        let etcd = cmd
            .spawn()
            .expect("etcd (Debian's etcd-server, installed by scripts/test)");
        let mut cluster = PatroniCluster {
            dir,
            etcd,
            etcd_port,
            members: Vec::new(),
            synchronous,
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while http_status(etcd_port, "/health") != 200 {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        for i in 1..=3 {
            let member = Member {
                name: format!("m{i}"),
                child: None,
                pg_port: free_port(),
                rest_port: free_port(),
            };
            cluster.write_config(&member);
            cluster.members.push(member);
            cluster.start_member(i - 1);
            if i == 1 {
                cluster.wait_for_leader(Duration::from_secs(90));
            }
        }
        let deadline = Instant::now() + Duration::from_secs(90);
        while !cluster.healthy() {
            assert!(
                Instant::now() < deadline,
                "the Patroni cluster did not become healthy: {}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        cluster
    }

    fn write_config(&self, m: &Member) {
        let data = self.dir.join(format!("data-{}", m.name));
        let config = format!(
            "scope: permitq-{etcd}\n\
             name: {name}\n\
             restapi:\n  listen: 127.0.0.1:{rest}\n  connect_address: 127.0.0.1:{rest}\n\
             etcd3:\n  hosts: 127.0.0.1:{etcd}\n\
             bootstrap:\n  dcs:\n    ttl: 10\n    loop_wait: 1\n    retry_timeout: 4\n\
             \x20   maximum_lag_on_failover: 1048576\n    synchronous_mode: {sync}\n\
             \x20   postgresql:\n      use_pg_rewind: true\n      parameters:\n\
             \x20       max_connections: 200\n        wal_log_hints: 'on'\n\
             \x20       max_wal_senders: 10\n        max_replication_slots: 10\n\
             \x20 initdb:\n    - encoding: UTF8\n    - auth: trust\n\
             \x20 pg_hba:\n    - local all all trust\n    - host all all 127.0.0.1/32 trust\n\
             \x20   - host replication all 127.0.0.1/32 trust\n\
             postgresql:\n  listen: 127.0.0.1:{pg}\n  connect_address: 127.0.0.1:{pg}\n\
             \x20 data_dir: {data}\n  bin_dir: {bin}\n  pgpass: {dir}/pgpass-{name}\n\
             \x20 authentication:\n    replication:\n      username: postgres\n\
             \x20   superuser:\n      username: postgres\n\
             \x20 parameters:\n    unix_socket_directories: {dir}\n",
            name = m.name,
            rest = m.rest_port,
            etcd = self.etcd_port,
            sync = self.synchronous,
            pg = m.pg_port,
            data = data.display(),
            bin = crate::find_bin_dir().unwrap().display(),
            dir = self.dir.display(),
        );
        std::fs::write(self.dir.join(format!("{}.yml", m.name)), config).unwrap();
    }

    fn start_member(&mut self, i: usize) {
        let name = self.members[i].name.clone();
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        let mut cmd = Command::new("patroni");
        cmd.arg(self.dir.join(format!("{name}.yml")))
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0);
        as_server_user(&mut cmd, &self.dir);
        self.members[i].child = Some(
            cmd.spawn()
                .expect("patroni (Debian's patroni, installed by scripts/test)"),
        );
    }

    /// Every member's Patroni log, for a failure message.
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

    /// The index of the member that leads now (its REST API answers 200 on `/leader`).
    pub fn leader(&self) -> Option<usize> {
        self.members
            .iter()
            .position(|m| m.child.is_some() && http_status(m.rest_port, "/leader") == 200)
    }

    /// Waits until some member leads; returns it.
    pub fn wait_for_leader(&self, timeout: Duration) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.leader() {
                return i;
            }
            assert!(Instant::now() < deadline, "no leader: {}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A leader, every other running member a streaming replica, and with `synchronous_mode`
    /// one of them the synchronous standby.
    pub fn healthy(&self) -> bool {
        let Some(leader) = self.leader() else {
            return false;
        };
        let replicas = self
            .members
            .iter()
            .enumerate()
            .filter(|(i, m)| *i != leader && m.child.is_some())
            .all(|(_, m)| http_status(m.rest_port, "/replica") == 200);
        let sync = !self.synchronous
            || self
                .members
                .iter()
                .any(|m| m.child.is_some() && http_status(m.rest_port, "/sync") == 200);
        replicas && sync
    }

    /// The URL of database `db` on whichever member is writable: every member, with
    /// `target_session_attrs=read-write`.
    pub fn url(&self, db: &str) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.pg_port))
            .collect();
        format!(
            "postgres://postgres@{}/{db}?target_session_attrs=read-write&connect_timeout=2",
            hosts.join(",")
        )
    }

    /// Kills member `i` outright: SIGKILL to its Patroni and its PostgreSQL (one process group),
    /// so its leader key runs out and Patroni promotes another member.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let pgid = child.id();
            kill_group(pgid);
            let _ = child.wait();
        }
        // Patroni starts the postmaster in a session of its own (setsid), so it outlives its
        // Patroni: kill it by its pid file, but only while that pid is still this member's
        // postmaster (its working directory is the data directory), never a reused pid.
        let data = self.dir.join(format!("data-{}", self.members[i].name));
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
        let _ = std::fs::remove_file(data.join("postmaster.pid"));
    }

    /// Starts member `i` again (it rejoins as a replica, rewound if needed).
    pub fn restart_member(&mut self, i: usize) {
        self.start_member(i);
    }

    /// `patronictl switchover` from the leader to another member (the synchronous standby with
    /// `synchronous_mode`), forced (no prompt); panics unless Patroni reports success.
    pub fn switchover(&self) {
        let leader = self.wait_for_leader(Duration::from_secs(30));
        // With synchronous_mode, Patroni hands over only to the synchronous standby.
        let candidate = (0..self.members.len())
            .find(|&i| {
                i != leader
                    && self.members[i].child.is_some()
                    && (!self.synchronous || http_status(self.members[i].rest_port, "/sync") == 200)
            })
            .expect("a candidate");
        let mut cmd = Command::new("patronictl");
        cmd.args([
            "-c",
            self.dir
                .join(format!("{}.yml", self.members[leader].name))
                .to_str()
                .unwrap(),
            "switchover",
            "--leader",
            &self.members[leader].name,
            "--candidate",
            &self.members[candidate].name,
            "--force",
        ])
        .stdin(Stdio::null());
        as_server_user(&mut cmd, &self.dir);
        let out = cmd.output().expect("patronictl");
        assert!(
            out.status.success() && String::from_utf8_lossy(&out.stdout).contains("Successfully"),
            "switchover: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
        kill_group(self.etcd.id());
        let _ = self.etcd.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
