//! The command line's errors and exit codes.

use std::fmt;

use permitq::SqlState;

/// Exit code: runtime error.
pub(crate) const EXIT_RUNTIME: u8 = 1;
/// Exit code: usage error, or input rejected as invalid.
pub(crate) const EXIT_USAGE: u8 = 2;
/// Exit code: the request ended in `error` (or the lease is lost).
pub(crate) const EXIT_NOT_GRANTED: u8 = 3;
/// Exit code: still `new` when `--await` ran out.
pub(crate) const EXIT_STILL_WAITING: u8 = 4;
/// Exit code: no such request or semaphore.
pub(crate) const EXIT_NOT_FOUND: u8 = 5;
/// Exit code: `submit --await` stopped by SIGINT or SIGTERM (its request cancelled), as a shell
/// reports a process ended by SIGINT.
pub(crate) const EXIT_INTERRUPTED: u8 = 130;

/// What can go wrong running a command; each maps to one exit code and one line on stderr.
#[derive(Debug)]
pub(crate) enum CliError {
    /// From the library (the database included).
    Permitq(permitq::Error),
    /// Bad arguments the CLI itself rejects.
    Usage {
        field: &'static str,
        message: String,
    },
    /// A required input that was not given (exit 2, like an invalid one).
    Missing { field: &'static str, hint: String },
    /// No semaphore by that name; the nearest existing names.
    NoSemaphore {
        name: String,
        similar: Vec<String>,
        /// `name` is a request's external_id (one this login reads): given where a semaphore
        /// belongs.
        request: bool,
    },
    /// No request by that name among those this login may read (`status`, `explain`);
    /// `sees_all`: the login reads every producer's requests.
    NotVisible {
        name: String,
        sees_all: bool,
        similar: Vec<String>,
        /// `name` is a semaphore's: given where a request's id belongs.
        semaphore: bool,
    },
    /// Anything else at run time (demo, bench and chaos tooling, I/O).
    Runtime(String),
}

pub(crate) type Result<T, E = CliError> = std::result::Result<T, E>;

impl CliError {
    pub(crate) fn usage(field: &'static str, message: impl Into<String>) -> CliError {
        CliError::Usage {
            field,
            message: message.into(),
        }
    }

    pub(crate) fn runtime(message: impl Into<String>) -> CliError {
        CliError::Runtime(message.into())
    }

    /// The database refused the permitq schema itself to this login: it has no permitq role.
    pub(crate) fn is_schema_refused(&self) -> bool {
        let CliError::Permitq(e) = self else {
            return false;
        };
        schema_refused(e)
    }

    /// 2 for input rejected as invalid (by the CLI or the database, SQLSTATE 22023, or an
    /// external_id already taken, 23505: retrying will not help), 5 for not found, else 1.
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage { .. } | CliError::Missing { .. } => EXIT_USAGE,
            CliError::NoSemaphore { .. } | CliError::NotVisible { .. } => EXIT_NOT_FOUND,
            CliError::Permitq(e)
                if e.invalid_field().is_some()
                    || e.code() == Some(&SqlState::INVALID_PARAMETER_VALUE)
                    || e.code() == Some(&SqlState::UNIQUE_VIOLATION) =>
            {
                EXIT_USAGE
            }
            _ => EXIT_RUNTIME,
        }
    }
}

impl fmt::Display for CliError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CliError::Permitq(e) if e.is_missing_schema() => write!(
                f,
                "the permitq schema is missing or out of date: run `permitq migrate` ({})",
                e.as_postgres()
                    .and_then(|p| p.as_db_error())
                    .map_or_else(String::new, |db| db.message().to_string())
            ),
            CliError::Permitq(e) => write!(f, "{e}"),
            CliError::Usage { field, message } => write!(f, "invalid {field}: {message}"),
            CliError::Missing { field, hint } => write!(f, "no {field} given: {hint}"),
            CliError::NoSemaphore {
                name,
                request: true,
                ..
            } => {
                let id = crate::show::quoted_name(name);
                write!(
                    f,
                    "no semaphore named {name:?} ({name} is a request's external_id: `permitq \
                     status {id}` shows it, `permitq explain {id}` why it waits; `permitq \
                     semaphore list` shows the semaphores)"
                )
            }
            CliError::NoSemaphore { name, similar, .. } if similar.is_empty() => write!(
                f,
                "no semaphore named {name:?} (`permitq semaphore list` shows them all)"
            ),
            CliError::NoSemaphore { name, similar, .. } => match template_matching(name, similar) {
                // A name of a template with no instance now: not a typo, nothing made yet.
                Some(template) => write!(
                    f,
                    "no semaphore named {name:?} now: the template {template} makes it for the \
                     first request that names it (and the workers remove it again once idle); \
                     `permitq semaphore show {}` lists the instances there are",
                    crate::show::quoted_name(template)
                ),
                None => write!(
                    f,
                    "no semaphore named {name:?}; did you mean {}?",
                    // (A suggestion may be words: `lab:NAME (an instance of the template lab:*)`.)
                    similar.join(" or ")
                ),
            },
            // A near id first (most often a typo); else what "not found" may mean.
            CliError::NotVisible {
                name,
                sees_all,
                similar,
                ..
            } if !similar.is_empty() => write!(
                f,
                "no request named {name:?}{}; did you mean {}?",
                if *sees_all {
                    ""
                } else {
                    " among this login's own"
                },
                // Each id as a shell takes it (`'id with spaces'`).
                similar
                    .iter()
                    .map(|id| crate::show::quoted_name(id))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
            CliError::NotVisible {
                name,
                sees_all: true,
                ..
            } => write!(
                f,
                "no request named {name:?}: none was submitted under that external_id, or it \
                 ended long enough ago that retention removed it"
            ),
            CliError::NotVisible { name, .. } => write!(
                f,
                "no request named {name:?} among this login's own: this login submitted none \
                 under that external_id, or retention removed it (a producer login sees only the \
                 requests it submitted; one that another login submitted is that login's, and \
                 `permitq release` refuses it as another role's; an operator login sees all)"
            ),
            CliError::Runtime(m) => write!(f, "{m}"),
        }?;
        // `permitq revoke gpu=1`: a semaphore's NAME=COUNT where a request's id belongs.
        // `permitq release gpu`: a semaphore's name.
        if let CliError::NotVisible {
            name, semaphore, ..
        } = self
        {
            if name.contains('=') {
                write!(
                    f,
                    " (this command takes a request's external_id, the ID given to `permitq \
                     submit ID NAME=COUNT`, not NAME=COUNT; `permitq semaphore show NAME` lists \
                     a semaphore's holders and their ids)"
                )?;
            } else if *semaphore {
                write!(
                    f,
                    " ({name} is a semaphore: this command takes a request's external_id, the \
                     ID given to `permitq submit ID {name}=COUNT`; `permitq semaphore show \
                     {name}` lists its holders and their ids)"
                )?;
            }
        }
        Ok(())
    }
}

impl std::error::Error for CliError {}

impl From<permitq::Error> for CliError {
    fn from(e: permitq::Error) -> CliError {
        CliError::Permitq(e)
    }
}

impl From<permitq_embedded_pg::Error> for CliError {
    fn from(e: permitq_embedded_pg::Error) -> CliError {
        match e.downcast::<permitq::Error>() {
            Ok(e) => CliError::Permitq(*e),
            Err(e) => CliError::Runtime(e.to_string()),
        }
    }
}

impl From<tokio_postgres::Error> for CliError {
    fn from(e: tokio_postgres::Error) -> CliError {
        CliError::Permitq(e.into())
    }
}

impl From<std::io::Error> for CliError {
    fn from(e: std::io::Error) -> CliError {
        CliError::Runtime(e.to_string())
    }
}

/// Whether the database refused the permitq schema itself to the login: it has no permitq role.
pub(crate) fn schema_refused(e: &permitq::Error) -> bool {
    e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE)
        && e.as_postgres()
            .and_then(|p| p.as_db_error())
            .is_some_and(|d| d.message().starts_with("permission denied for schema"))
}

/// What to tell `login`, which has no permitq role at all, when `who` ("this command",
/// "serve") needs `role` (`also`: what else would do): the role and the GRANT, by name.
pub(crate) fn no_permitq_role(login: &str, who: &str, role: &str, also: &str) -> String {
    format!(
        "the login {login} has no permitq role (permission denied for schema permitq): {who} \
         needs {role}{also}; a DBA runs GRANT {role} TO {login}, or use a login that has it"
    )
}

/// A library message as the CLI says it: the library's errors name its Rust API beside the
/// command (`run `permitq migrate` (or `Client::migrate`)`); a CLI user has only the command.
pub(crate) fn for_the_cli(message: &str) -> String {
    message.replace(" (or `Client::migrate`)", "")
}

/// `s` on one line: runs of whitespace (newlines included) become one space.
pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl From<deadpool_postgres::PoolError> for CliError {
    fn from(e: deadpool_postgres::PoolError) -> CliError {
        CliError::Permitq(e.into())
    }
}

/// The template a suggestion says `name` is an instance of (`lab:NAME (an instance of the
/// template lab:*)`), when `name` matches it.
fn template_matching<'a>(name: &str, similar: &'a [String]) -> Option<&'a str> {
    similar.iter().find_map(|s| {
        let (_, template) = s.split_once(" (an instance of the template ")?;
        let template = template.strip_suffix(')')?;
        name.starts_with(template.trim_end_matches('*'))
            .then_some(template)
    })
}
