//! A multi-host test bed from network namespaces (needs root and `ip`): one namespace per host,
//! each with its own address on a private bridge that lives in a hub namespace of its own, so
//! the bed's traffic never reaches this machine's own network namespace or its interfaces.
//!
//! Hosts talk over their bed addresses; the test itself reaches PostgreSQL over its Unix socket
//! (a file, which namespaces do not separate), or joins the bed as a host of its own
//! ([`NetworkBed::link_here`]: producers on a host that a partition of another host cuts off). A partition takes a host's link to the bridge
//! down: its packets are dropped both ways and its sockets stay open, as when a cable or a
//! switch port dies. Processes started on a host are killed and every namespace and interface
//! is removed when the bed is dropped (a panicking test included); a bed left behind by a
//! process that was killed outright is removed by the next bed created.

use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use crate::Result;

/// Prefix of every namespace a bed creates: `pqbed<pid>x<n>-<host>`.
const PREFIX: &str = "pqbed";
/// The bed's subnet: RFC 2544's benchmarking range, which no real network routes.
const SUBNET: &str = "198.18.";

/// A set of hosts (network namespaces) on one private bridge.
#[derive(Debug)]
pub struct NetworkBed {
    tag: String,
    /// The bed's subnet prefix, `198.18.N.`.
    subnet: String,
    hosts: Vec<Host>,
    children: Mutex<Vec<Child>>,
}

#[derive(Debug)]
struct Host {
    name: String,
    namespace: String,
    address: String,
    /// The hub-side end of the host's veth pair (what a partition takes down).
    hub_link: String,
}

impl NetworkBed {
    /// Creates the hosts, named `hosts`, with addresses 198.18.N.1, 198.18.N.2, ... in order
    /// (N distinguishes the beds of concurrent tests).
    pub fn new(hosts: &[&str]) -> Result<NetworkBed> {
        remove_orphaned_beds();
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tag = format!("{PREFIX}{}x{n}", std::process::id());
        let subnet = format!("{SUBNET}{}.", 1 + (std::process::id() * 7 + n) % 250);
        let mut bed = NetworkBed {
            tag: tag.clone(),
            subnet: subnet.clone(),
            hosts: Vec::new(),
            children: Mutex::new(Vec::new()),
        };
        let hub = bed.hub();
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for (i, name) in hosts.iter().enumerate() {
            let namespace = format!("{tag}-{name}");
            // Interface names are at most 15 bytes: made in the hub, then one end moved.
            let (hub_link, host_link) = (format!("pqh{n}x{i}"), format!("pqn{n}x{i}"));
            let host = Host {
                name: (*name).to_string(),
                address: format!("{subnet}{}", i + 1),
                namespace,
                hub_link,
            };
            ip(&["netns", "add", &host.namespace])?;
            // Recorded at once: from here on, drop removes it.
            let (ns, address, hub_link) = (
                host.namespace.clone(),
                host.address.clone(),
                host.hub_link.clone(),
            );
            bed.hosts.push(host);
            ip(&[
                "-n", &hub, "link", "add", &hub_link, "type", "veth", "peer", "name", &host_link,
                "netns", &ns,
            ])?;
            ip(&["-n", &hub, "link", "set", &hub_link, "master", "br0", "up"])?;
            ip(&["-n", &ns, "link", "set", &host_link, "name", "eth0"])?;
            ip(&[
                "-n",
                &ns,
                "addr",
                "add",
                &format!("{address}/24"),
                "dev",
                "eth0",
            ])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        }
        Ok(bed)
    }

    fn hub(&self) -> String {
        format!("{}-hub", self.tag)
    }

    fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name} in this bed"))
    }

    /// The namespace of host `name` (for `ip netns exec`).
    pub fn namespace(&self, name: &str) -> &str {
        &self.host(name).namespace
    }

    /// The address of host `name` on the bed.
    pub fn address(&self, name: &str) -> &str {
        &self.host(name).address
    }

    /// A command that runs `program` on host `name`.
    pub fn command(&self, name: &str, program: &str) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", self.namespace(name), program]);
        cmd
    }

    /// Starts `cmd` (from [`NetworkBed::command`]) in its own process group, owned by the bed:
    /// it is killed when the bed is dropped. Returns its pid (`ip netns exec` execs the
    /// program, so the pid is the program's).
    pub fn spawn(&self, mut cmd: Command) -> Result<u32> {
        use std::os::unix::process::CommandExt;
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| crate::error(format!("cannot start a process on the bed: {e}")))?;
        let pid = child.id();
        self.children
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(child);
        Ok(pid)
    }

    /// Links this process's own network namespace to the bed as one more host, at address
    /// `198.18.N.250` (returned): this process then reaches every host by its bed address, and
    /// a partition of a host cuts it off from this process too. The link lives in the hub's
    /// namespace and is removed with it, so it never outlives the bed.
    pub fn link_here(&self) -> Result<String> {
        let n = self.tag.rsplit('x').next().unwrap_or("0");
        let (here, hub_end) = (
            format!("pql{}x{n}", std::process::id()),
            format!("pqh{n}xl"),
        );
        let address = format!("{}250", self.subnet);
        ip(&[
            "link",
            "add",
            &here,
            "type",
            "veth",
            "peer",
            "name",
            &hub_end,
            "netns",
            &self.hub(),
        ])?;
        ip(&[
            "-n",
            &self.hub(),
            "link",
            "set",
            &hub_end,
            "master",
            "br0",
            "up",
        ])?;
        ip(&["addr", "add", &format!("{address}/24"), "dev", &here])?;
        ip(&["link", "set", &here, "up"])?;
        Ok(address)
    }

    /// Cuts host `name` off the bridge: every packet to and from it is dropped from now on;
    /// its sockets stay open and nothing tells either end.
    pub fn partition(&self, name: &str) -> Result<()> {
        ip(&[
            "-n",
            &self.hub(),
            "link",
            "set",
            &self.host(name).hub_link,
            "down",
        ])
    }

    /// Reconnects host `name`.
    pub fn heal(&self, name: &str) -> Result<()> {
        ip(&[
            "-n",
            &self.hub(),
            "link",
            "set",
            &self.host(name).hub_link,
            "up",
        ])
    }

    /// Makes host `name`'s link slow, both ways: a token bucket of `kbit` kbit/s whose queue
    /// holds up to a second of traffic, so packets wait (latency that varies with the load: a
    /// congested link) and beyond that are dropped. (This kernel has no `netem`; `tbf` is what
    /// it offers for delay.)
    pub fn slow_link(&self, name: &str, kbit: u32) -> Result<()> {
        let host = self.host(name);
        let rate = format!("{kbit}kbit");
        let hub = self.hub();
        for (ns, dev) in [
            (host.namespace.as_str(), "eth0"),
            (hub.as_str(), host.hub_link.as_str()),
        ] {
            tc(&[
                "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", &rate, "burst",
                "4kb", "latency", "1s",
            ])?;
        }
        Ok(())
    }

    /// Gives host `name` its normal link back.
    pub fn clear_link(&self, name: &str) -> Result<()> {
        let host = self.host(name);
        let hub = self.hub();
        for (ns, dev) in [
            (host.namespace.as_str(), "eth0"),
            (hub.as_str(), host.hub_link.as_str()),
        ] {
            tc(&["-n", ns, "qdisc", "del", "dev", dev, "root"])?;
        }
        Ok(())
    }
}

impl Drop for NetworkBed {
    fn drop(&mut self) {
        let mut children = self
            .children
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for child in children.iter_mut() {
            // The whole process group: whatever the program started too.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.wait();
        }
        let mut namespaces: Vec<String> = self.hosts.iter().map(|h| h.namespace.clone()).collect();
        namespaces.push(self.hub());
        for ns in namespaces {
            remove_namespace(&ns);
        }
    }
}

/// Kills what still runs in namespace `ns` and deletes it (its interfaces go with it).
fn remove_namespace(ns: &str) {
    if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
        for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
    }
    let _ = Command::new("ip")
        .args(["netns", "del", ns])
        .stderr(Stdio::null())
        .status();
}

/// Removes the namespaces of beds whose test process no longer runs.
fn remove_orphaned_beds() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(ns) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = ns
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('x').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            remove_namespace(ns);
        }
    }
}

fn ip(args: &[&str]) -> Result<()> {
    run("ip", args)
}

fn tc(args: &[&str]) -> Result<()> {
    run("tc", args)
}

fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| crate::error(format!("cannot run {program} (iproute2): {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    Err(crate::error(format!(
        "{program} {} failed: {} (network namespaces need root)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    )))
}
