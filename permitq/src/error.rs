//! The crate's one error type.

use std::fmt;

pub use tokio_postgres::error::SqlState;

/// An error from permitq.
///
/// Opaque on purpose: ask it what you need. [`Error::code`] gives the SQLSTATE when the database
/// raised it (`22023` invalid input, `23505` same `external_id` with other parameters, `55000` lease
/// lost, ...), [`Error::is_connection`] tells a lost or refused connection apart, and
/// [`Error::is_retryable`] says whether running the same transaction again may succeed.
pub struct Error {
    kind: Kind,
    /// What its message says beside the kind (boxed: an error stays small to return).
    about: Box<About>,
}

/// What an [`Error`]'s message says beside its kind.
#[derive(Debug, Default)]
struct About {
    /// The server a connection error was about (`localhost:5432`), for its message.
    target: Option<String>,
    /// The request an `acquire` submitted and could not cancel when it gave up (the database
    /// did not answer): it may still wait, and be granted with nobody to hold it.
    left_waiting: Option<String>,
    /// Where a missing schema was looked for (`database app at host:5432 as app`).
    looked_in: Option<String>,
    /// The login a refusal (42501) is about, named in the GRANT its message gives.
    login: Option<String>,
}

#[derive(Debug)]
enum Kind {
    Db(tokio_postgres::Error),
    Pool(deadpool_postgres::PoolError),
    InvalidInput {
        field: &'static str,
        message: String,
    },
    Config(String),
    /// The request as it ended, and when `acquire` gave up waiting: after how long, and why
    /// nothing granted it (no worker), if known.
    NotGranted(Box<crate::types::PermitRequest>, Option<String>),
    /// An outcome read on a primary that did not confirm it reached the synchronous standby.
    Unconfirmed(String),
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn invalid(field: &'static str, message: impl Into<String>) -> Error {
        Error {
            about: Box::default(),
            kind: Kind::InvalidInput {
                field,
                message: message.into(),
            },
        }
    }

    pub(crate) fn config(message: impl Into<String>) -> Error {
        Error {
            about: Box::default(),
            kind: Kind::Config(message.into()),
        }
    }

    pub(crate) fn unconfirmed(external_id: &str) -> Error {
        Error {
            about: Box::default(),
            kind: Kind::Unconfirmed(external_id.to_string()),
        }
    }

    /// A connection error, or the server refusing the login (a password, pg_hba.conf, no such
    /// role or database), said with the server it was about (see [`crate::db::target`]).
    pub(crate) fn reaching(mut self, target: &str) -> Error {
        let refused_login = self
            .code()
            .is_some_and(|c| refusal_hint(c.code()).is_some());
        let configuration = self.as_postgres().is_some_and(is_configuration);
        if (self.is_connection() || refused_login || configuration) && self.about.target.is_none() {
            self.about.target = Some(target.to_string());
        }
        self
    }

    /// `request` ended without a grant; `gave_up` says how long `acquire` waited before it
    /// cancelled it, and why nothing granted it when that is known.
    pub(crate) fn refused(request: crate::types::PermitRequest, gave_up: Option<String>) -> Error {
        Error {
            about: Box::default(),
            kind: Kind::NotGranted(Box::new(request), gave_up),
        }
    }

    /// For [`crate::Client::acquire`]: the request as it ended when it was not granted (state
    /// `error`, with its code).
    pub fn not_granted(&self) -> Option<&crate::types::PermitRequest> {
        match &self.kind {
            Kind::NotGranted(r, _) => Some(r),
            _ => None,
        }
    }

    /// The underlying `tokio_postgres` error, when there is one.
    pub fn as_postgres(&self) -> Option<&tokio_postgres::Error> {
        match &self.kind {
            Kind::Db(e) => Some(e),
            Kind::Pool(deadpool_postgres::PoolError::Backend(e)) => Some(e),
            _ => None,
        }
    }

    /// The SQLSTATE the database raised, if this is a database error.
    pub fn code(&self) -> Option<&SqlState> {
        self.as_postgres().and_then(|e| e.code())
    }

    /// The field named by an invalid-input error, caught either here or by the database (22023).
    pub fn invalid_field(&self) -> Option<&str> {
        match &self.kind {
            Kind::InvalidInput { field, .. } => Some(field),
            _ => None,
        }
    }

    /// True when the connection to the database failed or was lost: the operation may or may not
    /// have taken effect if it was a commit, and a retry needs a new connection.
    /// So is an outcome the server did not confirm as replicated to its synchronous standby
    /// (a primary cut off in a failover): ask again, on the new primary.
    pub fn is_connection(&self) -> bool {
        match &self.kind {
            Kind::Pool(deadpool_postgres::PoolError::Timeout(_)) | Kind::Unconfirmed(_) => true,
            _ => match self.as_postgres() {
                // A setting the URL lacks (a password the server asks for) or gets wrong is not
                // a connection that may come back: retrying it would only wait out a deadline.
                Some(e) if is_configuration(e) => false,
                Some(e) => {
                    e.is_closed()
                        || e.as_db_error().is_none()
                        || matches!(
                            e.code(),
                            Some(c) if c.code().starts_with("08")
                                || *c == SqlState::ADMIN_SHUTDOWN
                                || *c == SqlState::CRASH_SHUTDOWN
                                || *c == SqlState::CANNOT_CONNECT_NOW
                        )
                }
                None => false,
            },
        }
    }

    /// True for errors where running the same transaction again may succeed: serialization
    /// failures, deadlocks, lock timeouts, statement cancellation and lost connections.
    pub fn is_retryable(&self) -> bool {
        if self.is_connection() {
            return true;
        }
        matches!(
            self.code(),
            Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED
                || *c == SqlState::LOCK_NOT_AVAILABLE
                || *c == SqlState::QUERY_CANCELED
                || *c == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
        )
    }

    /// True when the permitq schema is missing or older than this build: run `permitq migrate`.
    /// (A column this build reads that the schema lacks, as `explain`'s `fairness` before
    /// migration 15, is an older schema too: every statement the library sends is its own.)
    pub fn is_missing_schema(&self) -> bool {
        matches!(
            self.code(),
            Some(c) if *c == SqlState::INVALID_SCHEMA_NAME
                || *c == SqlState::UNDEFINED_TABLE
                || *c == SqlState::UNDEFINED_FUNCTION
                || *c == SqlState::UNDEFINED_COLUMN
        )
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_kind(f)?;
        if let Some(place) = &self.about.looked_in {
            write!(
                f,
                " (looked in {place}: if permitq was migrated into another database, fix the URL \
                 instead)"
            )?;
        }
        if let Some(id) = &self.about.left_waiting {
            write!(
                f,
                "; request {id} was submitted and could not be cancelled, so it may still be \
                 waiting: once the database answers, cancel it (`permitq release {id}`, or \
                 `Client::release`), or it may be granted with nobody to use it"
            )?;
        }
        Ok(())
    }
}

impl Error {
    /// An outcome the synchronous standby did not confirm ([`Error::is_connection`] too).
    pub(crate) fn is_unconfirmed(&self) -> bool {
        matches!(self.kind, Kind::Unconfirmed(_))
    }

    /// This error, naming `login` in the GRANT a refusal gives (instead of `<your login>`).
    pub(crate) fn for_login(mut self, login: Option<&str>) -> Error {
        if self.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
            self.about.login = login.map(str::to_string);
        }
        self
    }

    /// This error, saying where the schema was looked for (see [`crate::Client::database`]).
    pub(crate) fn looked_in(mut self, place: String) -> Error {
        self.about.looked_in = Some(place);
        self
    }

    /// This error, from an `acquire` that gave up and could not cancel `external_id`.
    pub(crate) fn left_waiting(mut self, external_id: &str) -> Error {
        self.about.left_waiting = Some(external_id.to_string());
        self
    }

    fn fmt_kind(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_missing_schema() {
            let detail = self
                .as_postgres()
                .and_then(|p| p.as_db_error())
                .map_or_else(String::new, |db| db.message().to_string());
            return write!(
                f,
                "the permitq schema is missing or out of date: run `permitq migrate` (or `Client::migrate`) first ({detail})"
            );
        }
        match &self.kind {
            Kind::InvalidInput { field, message } => write!(f, "invalid {field}: {message}"),
            Kind::Config(m) => write!(f, "{m}"),
            Kind::NotGranted(r, Some(gave_up)) => {
                write!(f, "request {} was not granted: {gave_up}", r.external_id)
            }
            Kind::NotGranted(r, None) => match r.outcome() {
                Some(outcome) => write!(f, "request {} was not granted: {outcome}", r.external_id),
                None => write!(f, "request {} was not granted ({})", r.external_id, r.state),
            },
            Kind::Pool(deadpool_postgres::PoolError::Timeout(_)) => {
                write!(f, "timed out waiting for a database connection")
            }
            Kind::Pool(deadpool_postgres::PoolError::Backend(e)) | Kind::Db(e) => {
                if let (Some(target), None) = (&self.about.target, e.as_db_error()) {
                    if format!("{e:?}").contains("password missing") {
                        // The server that answered: the last tried.
                        let last = target.rsplit(',').next().unwrap_or(target);
                        write!(f, "PostgreSQL at {last} asks for a password: ")?;
                    } else if let Some((_, last)) = target.rsplit_once(',') {
                        // Several servers are tried in turn: the error is the last one's.
                        write!(
                            f,
                            "cannot reach PostgreSQL at any of {} (tried in that order); the \
                             last, {last}: ",
                            target.replace(',', ", ")
                        )?;
                    } else {
                        write!(f, "cannot reach PostgreSQL at {target}: ")?;
                    }
                }
                fmt_postgres(e, self.about.login.as_deref(), f)?;
                if let Some(target) = &self.about.target {
                    f.write_str(&connection_hint(e, target))?;
                }
                Ok(())
            }
            Kind::Pool(e) => write!(f, "database pool: {e}"),
            Kind::Unconfirmed(id) => write!(
                f,
                "the outcome of request {id} did not reach the synchronous standby in time: this \
                 primary may have lost its standby in a failover; ask again"
            ),
        }
    }
}

/// What to check when the server refused a connection with SQLSTATE `code`.
fn refusal_hint(code: &str) -> Option<&'static str> {
    Some(match code {
        "28P01" => {
            "check the password (in the URL, postgres://user:password@host/db, or PGPASSWORD) \
             and the user name: the server does not say which is wrong"
        }
        "28000" => "the server's pg_hba.conf does not let this user in from here, or no such role",
        "3D000" => "no such database: create it (createdb), or name another in the URL",
        "57P03" => "the server is starting up or shutting down: try again in a moment",
        _ => return None,
    })
}

/// What to check after a connection error to `target`, by its likely cause.
fn connection_hint(e: &tokio_postgres::Error, target: &str) -> String {
    let text = format!("{e:?}").to_lowercase();
    let cause = if let Some(db) = e.as_db_error() {
        // A pg_hba.conf that lets this user in only over TLS says "SSL off" or "no encryption".
        let message = db.message().to_lowercase();
        if message.contains("ssl off") || message.contains("no encryption") {
            return format!(" ({}; server {target})", crate::db::TLS_NOT_SPOKEN);
        }
        match refusal_hint(db.code().code()) {
            Some(hint) => hint,
            None => return String::new(),
        }
    } else if text.contains("tls") {
        crate::db::TLS_NOT_SPOKEN
    } else if text.contains("read only")
        || text.contains("allow writes")
        || text.contains("hot standby")
    {
        "the server is up, but not the kind the URL's target_session_attrs asks for: \
         read-write (the default) finds the primary, which permitq needs; running again will not \
         help"
    } else if text.contains("connection refused")
        && target
            .rsplit(',')
            .next()
            .is_some_and(|t| t.starts_with("localhost:"))
    {
        "is PostgreSQL running on this machine, on that port? The URL names the host and port \
         (a URL without a host tries the sockets in /var/run/postgresql and /tmp, then \
         localhost)"
    } else if text.contains("connection refused") {
        "is PostgreSQL running, and listening on that host and port? The URL names them"
    } else if text.contains("no such file") && target.split(',').any(|t| !t.starts_with('/')) {
        "no server socket there: is PostgreSQL running on this machine? The URL names both a \
         host and a socket directory (?host=/dir): keep the one the server listens on"
    } else if text.contains("no such file") {
        "no server socket there: is PostgreSQL running on this machine? Name a host in the URL \
         (postgres://user@host/db) to use TCP"
    } else if text.contains("timed out") || text.contains("timeout") {
        "the server did not answer in time: is the host reachable from here (address, firewall)?"
    } else if (text.contains("failed to lookup") || text.contains("name or service not known"))
        && target.contains('@')
    {
        "the host name does not resolve, and it holds an @: a password (or user name) with an @ \
         in it ends at that @. Percent-encode it in the URL (@ as %40, : as %3A, / as %2F)"
    } else if text.contains("failed to lookup") || text.contains("name or service not known") {
        "the host name does not resolve: check the host in the URL"
    } else if text.contains("password missing") {
        return String::new();
    } else {
        "the connection failed or was lost: is PostgreSQL up? Submitting again under the same \
         external_id is safe (submit is idempotent)"
    };
    if e.as_db_error().is_some() {
        // The server answered: the message did not name it yet.
        format!(" ({cause}; server {target})")
    } else {
        format!(" ({cause})")
    }
}

/// A permission error's message, with the permitq role that grants what was refused and the
/// GRANT to run for `login` (`<your login>` when not known).
fn role_hint(db: &tokio_postgres::error::DbError, login: Option<&str>) -> String {
    if db.code() != &SqlState::INSUFFICIENT_PRIVILEGE
        || !db.message().starts_with("permission denied for")
    {
        return String::new();
    }
    let object = db.message().rsplit(' ').next().unwrap_or_default();
    let role = match object {
        "set_capacity"
        | "delete_semaphore"
        | "revoke"
        | "revoke_owners"
        | "delete_settled"
        | "delete_capacity_changes"
        | "capacity_change"
        | "raise_token_floor" => "permitq_admin",
        "claim_batch"
        | "raise_token_epoch"
        | "apply_decision"
        | "lock_batch_semaphores"
        | "lock_batch_and_heads"
        | "next_batch"
        | "fold_releases"
        | "settle_invalid"
        | "worker_wake"
        | "worker_seen"
        | "sweep_leases"
        | "sweep_wait_deadlines"
        | "sweep_stale"
        | "take_turn"
        | "record_lease_grace"
        | "wake_gate_free" => "permitq_worker",
        // What a producer does; an admin may too, an operator or worker login may not.
        "submit" | "release" | "cancel" | "heartbeat" | "fence" | "confirm_durable"
        | "lease_grace_since" => "permitq_producer (or permitq_admin)",
        _ => {
            "permitq_producer (a producer's calls: submit, acquire, status, release, heartbeat, \
             explain), or permitq_operator (read-only: semaphore list and show, top, serve), \
             permitq_worker or permitq_admin, as the command needs"
        }
    };
    // One role named: the GRANT to run; a list: the GRANT of the one the command needs.
    let grant = if role.contains(',') {
        "that role"
    } else {
        role.split(' ').next().unwrap_or(role)
    };
    // Revoking is for another login's request: one's own is given back by a release.
    let own = match object {
        "revoke" => {
            "; to end a request this login submitted, `permitq release ID` (or release()) needs \
             no admin"
        }
        // A producer acts on its own requests alone.
        "release" | "cancel" | "heartbeat" => {
            "; a producer acts on its own requests alone: another login's request is released \
             by that login, or revoked by permitq_admin (`permitq revoke ID`)"
        }
        _ => "",
    };
    format!(
        "; this needs the role {role}: use a login that has it, or a DBA runs GRANT {grant} TO \
         {}{own}",
        login.unwrap_or("<your login>")
    )
}

/// `e`'s message; a refusal's GRANT names `login` when it is known.
fn fmt_postgres(
    e: &tokio_postgres::Error,
    login: Option<&str>,
    f: &mut fmt::Formatter<'_>,
) -> fmt::Result {
    if let Some(db) = e.as_db_error() {
        write!(f, "{}", db.message())?;
        if let Some(detail) = db.detail() {
            write!(f, ": {detail}")?;
        }
        if let Some(hint) = db.hint() {
            write!(f, " ({hint})")?;
        }
        write!(
            f,
            "{} (SQLSTATE {})",
            role_hint(db, login),
            db.code().code()
        )
    } else {
        // Connection-level errors: tokio_postgres's Display omits the cause ("error connecting
        // to server"), so append the source chain.
        let mut text = e.to_string();
        let mut source = std::error::Error::source(e);
        while let Some(s) = source {
            text.push_str(&format!(": {s}"));
            source = s.source();
        }
        f.write_str(&text)?;
        if text.contains("password missing") {
            write!(
                f,
                " (the server asks for a password: put it in the URL, \
                 postgres://user:password@host/db, or set PGPASSWORD; or, on the database's own \
                 machine, connect by its local socket, postgres:///DB, where PostgreSQL may know \
                 the OS user without one)"
            )?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Error({self}, {:?})", self.kind)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.kind {
            Kind::Db(e) => Some(e),
            Kind::Pool(e) => Some(e),
            _ => None,
        }
    }
}

impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Error {
        Error {
            kind: Kind::Db(e),
            about: Box::default(),
        }
    }
}

impl From<deadpool_postgres::PoolError> for Error {
    fn from(e: deadpool_postgres::PoolError) -> Error {
        Error {
            about: Box::default(),
            kind: Kind::Pool(e),
        }
    }
}

impl From<crate::types::UnknownValue> for Error {
    fn from(e: crate::types::UnknownValue) -> Error {
        Error::invalid(e.kind(), e.to_string())
    }
}

/// A `tokio_postgres` error about the connection's settings (`Kind::Config` or
/// `Kind::ConfigParse`, which it does not expose but in its `Debug`): a password missing, an
/// option it cannot use.
fn is_configuration(e: &tokio_postgres::Error) -> bool {
    format!("{e:?}").contains("kind: Config")
}

#[cfg(test)]
mod tests {
    use super::refusal_hint;

    /// Each refusal names its own cause: a wrong password the password, a rejected login the
    /// server's pg_hba.conf or the role.
    #[test]
    fn each_refusal_of_a_login_has_its_own_hint() {
        assert!(refusal_hint("28P01")
            .unwrap()
            .starts_with("check the password"));
        assert!(refusal_hint("28000").unwrap().contains("pg_hba.conf"));
        assert!(refusal_hint("3D000")
            .unwrap()
            .starts_with("no such database"));
        assert!(refusal_hint("57P03").unwrap().contains("starting up"));
        assert_eq!(refusal_hint("42501"), None);
    }
}
