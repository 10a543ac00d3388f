//! Connections: configuration, pools, row decoding and retry backoff.

use std::collections::BTreeMap;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::{Config, NoTls, Row};

use crate::error::{Error, Result};
use crate::types::{CapacityChange, PermitRequest, Semaphore};

/// What to do when a URL or a server asks for TLS: permitq connects without it.
pub(crate) const TLS_NOT_SPOKEN: &str =
    "permitq connects without TLS (sslmode disable or prefer): take sslmode=require or verify-* \
     out of the URL, or let the server accept unencrypted connections from here (a `host` line \
     in pg_hba.conf, not `hostssl`), on a network you trust or through a TLS tunnel";

/// Parses a `postgres://` URL or `key=value` connection string.
///
/// Unless the URL sets them, connections use TCP keepalives (idle 10 s, then every 5 s, 3
/// probes) and `tcp_user_timeout` 30 s: a server that vanishes without closing the socket (a
/// partition) is noticed in well under a minute instead of the kernel's two hours. Workers ask
/// the server for the same on its side ([`SERVER_KEEPALIVES`]). Unless the URL sets it,
/// `application_name` is `permitq`, so the capacity audit and `pg_stat_activity` show who
/// connected. A URL without a host (`postgres:///app`) uses the local server's Unix socket, and
/// one without a password takes `PGPASSWORD` when it is set. A
/// URL that does not parse is invalid input (field `database URL`).
pub(crate) fn parse_config(url: &str) -> Result<Config> {
    let url = &with_env_port(url);
    let mut config = url.parse::<Config>().map_err(|e| {
        if url.contains("sslmode=verify") {
            return Error::invalid("database URL", format!("{e}: {TLS_NOT_SPOKEN}"));
        }
        // What was wrong in it: another scheme, or an unknown option or a bad value
        // (tokio-postgres says which in the error's source).
        // More than one @ before the query: a user or password with one in it (or with a /).
        let authority = url
            .split_once("://")
            .map_or("", |(_, rest)| rest.split('?').next().unwrap_or(""));
        // A scheme: before `://`, or before a `:` in what is not key=value pairs.
        let scheme = url.split_once("://").map(|(scheme, _)| scheme).or_else(|| {
            url.split_once(':')
                .map(|(scheme, _)| scheme)
                .filter(|s| !url.contains('=') && !s.is_empty())
                .filter(|s| {
                    s.chars()
                        .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
                })
        });
        let what = match (scheme, std::error::Error::source(&e)) {
            (Some(scheme), _) if !matches!(scheme, "postgres" | "postgresql") => {
                format!(" ({scheme}: is not PostgreSQL's scheme: use postgres://)")
            }
            (Some(scheme), _) if !url.contains("://") => {
                format!(" ({scheme}: is followed by //, as in {scheme}://host/database)")
            }
            (_, cause) if authority.matches('@').count() > 1 => format!(
                "{}: a password (or user name) with an @, :, / or # in it must be \
                 percent-encoded in the URL (@ as %40, : as %3A, / as %2F, # as %23)",
                cause.map(|c| format!(" ({c})")).unwrap_or_default()
            ),
            (_, Some(cause)) => format!(" ({cause})"),
            _ => String::new(),
        };
        Error::invalid(
            "database URL",
            format!(
                "{e}{what}: expected postgres://user[:password]@host[:port]/database (e.g. \
                     postgres://app@localhost:5432/app, or postgres:///app for the local \
                     socket), or key=value pairs (host=localhost dbname=app user=app)"
            ),
        )
    })?;
    // Refused here, not tried: permitq has no TLS to offer the server.
    if config.get_ssl_mode() == tokio_postgres::config::SslMode::Require {
        return Err(Error::invalid(
            "database URL",
            format!("sslmode=require: {TLS_NOT_SPOKEN}"),
        ));
    }
    if config.get_application_name().is_none() {
        config.application_name("permitq");
    }
    if config.get_password().is_none() {
        // As libpq does: a password the URL leaves out may come from the environment.
        if let Some(password) = std::env::var_os("PGPASSWORD") {
            config.password(password.as_encoded_bytes());
        }
    }
    // As libpq does: what the URL leaves out may come from PGUSER, PGDATABASE, PGPORT, PGHOST.
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    if let (None, Some(user)) = (config.get_user(), env("PGUSER")) {
        config.user(&user);
    }
    if let (None, Some(dbname)) = (config.get_dbname(), env("PGDATABASE")) {
        config.dbname(&dbname);
    }
    if let (true, Some(port)) = (config.get_ports().is_empty(), env("PGPORT")) {
        let port = port.parse().map_err(|_| {
            Error::invalid("PGPORT", format!("expected a port number, got {port:?}"))
        })?;
        config.port(port);
    }
    if let (true, true, Some(hosts)) = (
        config.get_hosts().is_empty(),
        config.get_hostaddrs().is_empty(),
        env("PGHOST"),
    ) {
        for host in hosts.split(',') {
            if host.starts_with('/') {
                config.host_path(host);
            } else {
                config.host(host);
            }
        }
    }
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        // As libpq does: the local server's Unix socket, else localhost (`postgres:///app`).
        // A socket that is there now is the server (its errors are the answer: no fallback to
        // localhost, where pg_hba.conf may want a password). None there (the server is down):
        // every candidate, tried in this order at each connection, so that a server that comes
        // up later is found on its socket.
        let port = config.get_ports().first().copied().unwrap_or(5432);
        match DEFAULT_SOCKET_DIRS.iter().find(|dir| {
            std::path::Path::new(dir)
                .join(format!(".s.PGSQL.{port}"))
                .exists()
        }) {
            Some(dir) => {
                config.host_path(dir);
            }
            None => {
                for dir in DEFAULT_SOCKET_DIRS {
                    config.host_path(dir);
                }
                config.host("localhost");
            }
        }
    }
    if !url.contains("keepalives") {
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
    }
    if !url.contains("tcp_user_timeout") {
        config.tcp_user_timeout(Duration::from_secs(30));
    }
    Ok(config)
}

/// `url` with `PGPORT` written in for each host that names no port, as libpq reads it (the URL
/// parser fills in 5432 itself, so the environment could not be told apart from it later).
fn with_env_port(url: &str) -> std::borrow::Cow<'_, str> {
    let Some(port) = std::env::var("PGPORT").ok().filter(|p| !p.is_empty()) else {
        return url.into();
    };
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.into();
    };
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let (userinfo, hosts) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    if hosts.is_empty() || tail.contains("port=") {
        return url.into();
    }
    let hosts: Vec<String> = hosts
        .split(',')
        .map(|h| {
            let has_port = if h.starts_with('[') {
                h.contains("]:")
            } else {
                h.contains(':')
            };
            if has_port || h.is_empty() {
                h.to_string()
            } else {
                format!("{h}:{port}")
            }
        })
        .collect();
    let userinfo = userinfo.map_or(String::new(), |u| format!("{u}@"));
    format!("{scheme}://{userinfo}{}{tail}", hosts.join(",")).into()
}

/// The server(s) `config` connects to, for messages: `localhost:5432`, or the socket path.
pub(crate) fn target(config: &Config) -> String {
    let ports = config.get_ports();
    config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            match host {
                tokio_postgres::config::Host::Tcp(h) => format!("{h}:{port}"),
                tokio_postgres::config::Host::Unix(dir) => {
                    format!("{}/.s.PGSQL.{port}", dir.display())
                }
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The login `config` connects as: the URL's user, else libpq's default, the OS user (None
/// when that is not known either).
pub(crate) fn login(config: &Config) -> Option<String> {
    config
        .get_user()
        .map(str::to_string)
        .or_else(|| std::env::var("USER").ok())
}

/// Where a connection works, as messages name it: `database app at 127.0.0.1:5432 as app`.
pub(crate) fn place(config: &Config) -> String {
    let user = login(config).unwrap_or_else(|| "(the OS user)".to_string());
    format!(
        "database {} at {} as {user}",
        config.get_dbname().unwrap_or(&user),
        target(config)
    )
}

/// Where a URL without a host looks for the local server's socket (Debian's, then the
/// upstream default), before falling back to localhost.
const DEFAULT_SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// Server-side keepalives and `tcp_user_timeout` (ms) for worker sessions, so that the server
/// also drops the session of a worker host that vanished (sent as startup options, which
/// connection poolers such as PgBouncer may not accept: producers' connections do not send them).
pub(crate) const SERVER_KEEPALIVES: [(&str, &str); 4] = [
    ("tcp_keepalives_idle", "10"),
    ("tcp_keepalives_interval", "5"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "30000"),
];

/// Adds `-c name=value` server settings to a config's `options`, keeping any already there.
pub(crate) fn with_settings(mut config: Config, settings: &[(&str, String)]) -> Config {
    let mut options = config.get_options().unwrap_or_default().to_string();
    for (name, value) in settings {
        if !options.is_empty() {
            options.push(' ');
        }
        options.push_str(&format!("-c {name}={value}"));
    }
    config.options(&options);
    config
}

/// A connection pool over `config`. Connections are created lazily.
pub(crate) fn pool(mut config: Config, max_size: usize) -> Result<Pool> {
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_secs(5));
    }
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(max_size)
        .runtime(Runtime::Tokio1)
        .wait_timeout(Some(Duration::from_secs(30)))
        .create_timeout(Some(Duration::from_secs(10)))
        .build()
        .map_err(|e| Error::config(format!("cannot build connection pool: {e}")))
}

/// Connects one dedicated connection (not pooled) and drives it on a task.
pub(crate) async fn connect(config: &Config) -> Result<tokio_postgres::Client> {
    let (client, connection) = config.connect(NoTls).await?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "dedicated connection ended");
        }
    });
    Ok(client)
}

pub(crate) fn request_from_row(row: &Row) -> Result<PermitRequest> {
    let permits: serde_json::Value = row.try_get("permits")?;
    let permits: BTreeMap<String, i64> = permits_from_json(&permits).into_iter().collect();
    let micros = |name: &str| -> Result<Option<Duration>> { Ok(from_micros(row.try_get(name)?)) };
    let parse_opt = |name: &str| -> Result<Option<String>> { Ok(row.try_get(name)?) };
    Ok(PermitRequest {
        id: row.try_get("id")?,
        external_id: row.try_get("external_id")?,
        permits,
        owner: row.try_get("owner")?,
        ttl: micros("ttl_us")?,
        wait: micros("wait_us")?,
        priority: row.try_get("priority")?,
        fairness_key: row.try_get("fairness_key")?,
        fairness_weight: row.try_get("fairness_weight")?,
        state: row.try_get::<_, String>("state")?.parse()?,
        error_code: parse_opt("error_code")?.map(|s| s.parse()).transpose()?,
        error_detail: crate::outcome::ErrorDetail::from_json(row.try_get("error_detail")?),
        release_reason: parse_opt("release_reason")?
            .map(|s| s.parse())
            .transpose()?,
        fencing_token: row.try_get("fencing_token")?,
        worker_id: row.try_get("worker_id")?,
        created_at: row.try_get("created_at")?,
        acquired_at: row.try_get("acquired_at")?,
        expires_at: row.try_get("expires_at")?,
        heartbeat_at: row.try_get("heartbeat_at")?,
        released_at: row.try_get("released_at")?,
        settled_at: row.try_get("settled_at")?,
        examined_at: row.try_get("examined_at")?,
        decided_at: row.try_get("decided_at")?,
        submitted_by: row.try_get("submitted_by")?,
    })
}

/// The (name, count) pairs of a permits object. Counts are integers by the table's CHECK
/// constraint; JSON like `2.0` is read as 2.
pub(crate) fn permits_from_json(permits: &serde_json::Value) -> Vec<(String, i64)> {
    permits
        .as_object()
        .map(|o| {
            o.iter()
                .map(|(k, v)| {
                    // A whole float such as `2.0` (valid by the CHECK) reads as 2.
                    let count = v.as_i64().or_else(|| {
                        v.as_f64()
                            .filter(|f| f.fract() == 0.0)
                            .and_then(|f| format!("{f:.0}").parse().ok())
                    });
                    (k.clone(), count.unwrap_or(i64::MAX))
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(crate) fn semaphore_from_row(row: &Row) -> Result<Semaphore> {
    Ok(Semaphore {
        name: row.try_get(0)?,
        capacity: row.try_get(1)?,
        used: row.try_get(2)?,
        fair: row.try_get(3)?,
        is_template: row.try_get(4)?,
        template: row.try_get(5)?,
        per: from_micros(row.try_get(6)?),
        parent: row.try_get(7)?,
        guarantee: row.try_get(8)?,
        max_instances: row.try_get(9)?,
    })
}

/// An interval the queries send as microseconds (`None` stays `None`; negative reads as 0).
pub(crate) fn from_micros(us: Option<i64>) -> Option<Duration> {
    us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

pub(crate) fn capacity_change_from_row(row: &Row) -> Result<CapacityChange> {
    Ok(CapacityChange {
        semaphore: row.try_get(0)?,
        old_capacity: row.try_get(1)?,
        new_capacity: row.try_get(2)?,
        old_fair: row.try_get(3)?,
        new_fair: row.try_get(4)?,
        changed_at: row.try_get(5)?,
        changed_by: row.try_get(6)?,
        application_name: row.try_get(7)?,
        old_parent: row.try_get(8)?,
        new_parent: row.try_get(9)?,
        old_guarantee: row.try_get(10)?,
        new_guarantee: row.try_get(11)?,
        old_max_instances: row.try_get(12)?,
        new_max_instances: row.try_get(13)?,
        old_per: from_micros(row.try_get(14)?),
        new_per: from_micros(row.try_get(15)?),
        deleted: row.try_get(16)?,
        inputs: row.try_get(17)?,
    })
}

/// Exponential backoff with full jitter, for retries and reconnects.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    base: Duration,
    max: Duration,
    attempt: u32,
}

impl Backoff {
    /// Starts at `base`, doubles per attempt, never above `max`.
    pub(crate) fn new(base: Duration, max: Duration) -> Backoff {
        Backoff {
            base,
            max,
            attempt: 0,
        }
    }

    /// The next delay: uniform in [ceiling/2, ceiling], ceiling = min(max, base * 2^attempt).
    pub(crate) fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1 << self.attempt.min(16))
            .min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = ceiling / 2;
        half + half.mul_f64(fastrand::f64())
    }

    /// How many delays were handed out since the last reset.
    pub(crate) fn attempts(&self) -> u32 {
        self.attempt
    }

    /// Back to `base` after a success.
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_url_without_a_host_gets_the_local_server() {
        // Every candidate, in libpq's order, tried at each connection: a server down when the
        // URL was read is found on its socket once it is up.
        let config = super::parse_config("postgres:///app").unwrap();
        let expected = super::DEFAULT_SOCKET_DIRS
            .iter()
            .map(|dir| format!("{dir}/.s.PGSQL.5432"))
            .find(|socket| std::path::Path::new(socket).exists())
            .unwrap_or_else(|| {
                "/var/run/postgresql/.s.PGSQL.5432,/tmp/.s.PGSQL.5432,localhost:5432".to_string()
            });
        assert_eq!(super::target(&config), expected);
        assert_eq!(config.get_dbname(), Some("app"));
        assert_eq!(config.get_application_name(), Some("permitq"));
        let config = super::parse_config("postgres://h/app?application_name=mine").unwrap();
        assert_eq!(config.get_application_name(), Some("mine"));
        // The only test in this binary that reads or writes PGPORT and PGHOST.
        std::env::set_var("PGPORT", "5510");
        std::env::set_var("PGHOST", "/run/pg");
        let from_env = super::parse_config("postgres:///app").unwrap();
        let in_url = super::parse_config("postgres://h:5433/app").unwrap();
        let host_only = super::parse_config("postgres://u:p@h,[::1]/app?sslmode=disable").unwrap();
        std::env::remove_var("PGPORT");
        std::env::remove_var("PGHOST");
        assert_eq!(super::target(&from_env), "/run/pg/.s.PGSQL.5510");
        assert_eq!(super::target(&in_url), "h:5433", "the URL wins");
        assert_eq!(
            super::target(&host_only),
            "h:5510,::1:5510",
            "a host without a port"
        );
    }

    #[test]
    fn a_password_the_url_leaves_out_comes_from_pgpassword() {
        // The only test in this binary that reads or writes PGPASSWORD.
        std::env::set_var("PGPASSWORD", "from-env");
        let without = super::parse_config("postgres://u@h/app").unwrap();
        let with = super::parse_config("postgres://u:in-url@h/app").unwrap();
        std::env::remove_var("PGPASSWORD");
        assert_eq!(without.get_password(), Some(&b"from-env"[..]));
        assert_eq!(with.get_password(), Some(&b"in-url"[..]));
    }
}
