//! The public data types: requests, their states and outcomes, semaphores.

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime};

use serde::ser::Serializer;
use serde::Serialize;

macro_rules! string_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The value as the database and the CLI spell it.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownValue;
            fn from_str(s: &str) -> std::result::Result<$name, UnknownValue> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(UnknownValue { kind: stringify!($name), value: other.to_string() }),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }
    };
}

/// A string that names no value of one of this crate's enums (`State`, `ErrorCode`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownValue {
    kind: &'static str,
    value: String,
}

impl UnknownValue {
    /// The enum that was parsed, e.g. `"State"`.
    pub fn kind(&self) -> &'static str {
        self.kind
    }
}

impl fmt::Display for UnknownValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "unknown {} value {:?}", self.kind, self.value)
    }
}

impl std::error::Error for UnknownValue {}

string_enum! {
    /// Where a request is in its life: `new` → `acquired` → `released`, or → `error`.
    State {
        /// Waiting to be granted.
        New => "new",
        /// Being decided: the row lock a worker's open transaction holds while it claims the
        /// request. Never committed, so never read from the database (a worker that dies
        /// leaves the request `new`); kept so the states match the SQL API's contract.
        InProgress => "in_progress",
        /// Granted: the holder owns the permits.
        Acquired => "acquired",
        /// Permits given back (see [`ReleaseReason`]).
        Released => "released",
        /// Never granted (see [`ErrorCode`]).
        Error => "error",
    }
}

string_enum! {
    /// Why a request ended in `error`.
    ErrorCode {
        /// A named semaphore does not exist.
        UnknownSemaphore => "unknown_semaphore",
        /// A count is larger than its semaphore's capacity: it could never be granted.
        ExceedsCapacity => "exceeds_capacity",
        /// `wait = 0` (fail fast) and there was no room at that moment.
        NoCapacity => "no_capacity",
        /// It waited `wait` and was not granted.
        Timeout => "timeout",
        /// Released or cancelled while still waiting.
        Cancelled => "cancelled",
        /// The stored row cannot be decided (written past the constraints: permits that are not
        /// an object of positive counts, a ttl or wait out of bounds) or failed a worker's batch
        /// on its own. Settled so that it cannot stall the queue.
        Invalid => "invalid",
        /// It names a semaphore that would be a new instance of a template that already has as
        /// many instances as it may (`max_instances`, else [`crate::MAX_INSTANCES`]).
        TooManyInstances => "too_many_instances",
    }
}

string_enum! {
    /// Why an acquired request was released.
    ReleaseReason {
        /// By its holder.
        Released => "released",
        /// Its TTL passed with no heartbeat.
        Expired => "expired",
        /// Held longer than a worker's `--max-hold`.
        Stale => "stale",
        /// By an operator or the owner-liveness hook.
        Revoked => "revoked",
    }
}

string_enum! {
    /// What `permitq.release` did.
    ReleaseOutcome {
        /// It was acquired; its permits are back.
        Released => "released",
        /// It had been released already.
        AlreadyReleased => "already_released",
        /// It was still waiting; it is now `error`/`cancelled`.
        Cancelled => "cancelled",
        /// It had ended in `error`; nothing to give back.
        NotAcquired => "not_acquired",
        /// No request has this external_id.
        Unknown => "unknown",
        /// It was acquired and an operator took its permits away (`permitq.revoke`).
        Revoked => "revoked",
    }
}

/// A permit request to submit: the semaphores and counts it needs, all or nothing.
///
/// ```
/// use std::time::Duration;
/// let request = permitq::Request::new("job-42")
///     .permit("gpu", 2)
///     .permit("licence", 1)
///     .ttl(Duration::from_secs(30))
///     .wait(Duration::from_secs(10));
/// assert_eq!(request.permits.len(), 2);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
#[non_exhaustive]
pub struct Request {
    /// Client-chosen idempotency key, 1..=255 characters.
    pub external_id: String,
    /// Semaphore name → count, 1 to 64 entries, counts ≥ 1.
    pub permits: BTreeMap<String, i64>,
    /// Who will hold it (free text; the owner-liveness hook is asked about it).
    pub owner: Option<String>,
    /// Lease length: once granted, it is released as `expired` unless heartbeated within this.
    pub ttl: Option<Duration>,
    /// How long it may wait for capacity: `None` forever, `Some(ZERO)` fail fast.
    pub wait: Option<Duration>,
    /// Higher first on fair semaphores (-100 to 100, default 0); see [`crate::AGING_STEP`].
    pub priority: i16,
    /// The tenant (or caller) whose share it counts in on semaphores served by fairness key
    /// (1 to [`crate::MAX_FAIRNESS_KEY_LENGTH`] characters); none is a key of its own.
    pub fairness_key: Option<String>,
    /// Its key's weight there ([`crate::FAIRNESS_WEIGHT_RANGE`], 1 when none is given): while
    /// keys wait, each is served in proportion to its weight.
    pub fairness_weight: Option<i32>,
}

impl Request {
    /// A request with no permits yet.
    pub fn new(external_id: impl Into<String>) -> Request {
        Request {
            external_id: external_id.into(),
            permits: BTreeMap::new(),
            owner: None,
            ttl: None,
            wait: None,
            priority: 0,
            fairness_key: None,
            fairness_weight: None,
        }
    }

    /// Adds `count` permits of semaphore `name`.
    pub fn permit(mut self, name: impl Into<String>, count: i64) -> Request {
        self.permits.insert(name.into(), count);
        self
    }

    /// Sets the owner.
    pub fn owner(mut self, owner: impl Into<String>) -> Request {
        self.owner = Some(owner.into());
        self
    }

    /// Sets the lease TTL.
    pub fn ttl(mut self, ttl: Duration) -> Request {
        self.ttl = Some(ttl);
        self
    }

    /// Sets how long it may wait (`Duration::ZERO`: fail fast).
    pub fn wait(mut self, wait: Duration) -> Request {
        self.wait = Some(wait);
        self
    }

    /// Sets its priority: higher first on fair semaphores, within [`crate::PRIORITY_RANGE`].
    pub fn priority(mut self, priority: i16) -> Request {
        self.priority = priority;
        self
    }

    /// Sets its fairness key: on a semaphore served by key, it shares the line with other keys
    /// rather than waiting behind their backlogs.
    pub fn fairness_key(mut self, key: impl Into<String>) -> Request {
        self.fairness_key = Some(key.into());
        self
    }

    /// Sets its fairness key's weight (with [`Request::fairness_key`]).
    pub fn fairness_weight(mut self, weight: i32) -> Request {
        self.fairness_weight = Some(weight);
        self
    }

    /// The permits as the JSON object the SQL API takes.
    pub fn permits_json(&self) -> serde_json::Value {
        serde_json::Value::Object(
            self.permits
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
                .collect(),
        )
    }
}

/// A row of `permitq.permit_request`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct PermitRequest {
    /// Queue position (FIFO order).
    pub id: i64,
    /// The client's idempotency key.
    pub external_id: String,
    /// Semaphore name → count.
    pub permits: BTreeMap<String, i64>,
    /// Who holds it.
    pub owner: Option<String>,
    /// Lease TTL, in seconds.
    #[serde(serialize_with = "ser_secs")]
    pub ttl: Option<Duration>,
    /// Wait bound, in seconds.
    #[serde(serialize_with = "ser_secs")]
    pub wait: Option<Duration>,
    /// Its priority (higher first on fair semaphores).
    pub priority: i16,
    /// Its fairness key, if it has one.
    pub fairness_key: Option<String>,
    /// Its fairness key's weight, if one was given (`None`: the default, 1; JSON says 1).
    #[serde(serialize_with = "ser_weight")]
    pub fairness_weight: Option<i32>,
    /// Current state.
    pub state: State,
    /// Set when `state` is `error`.
    pub error_code: Option<ErrorCode>,
    /// With `error_code`: what the request hit (the semaphore, the bound); see
    /// [`crate::ErrorDetail`] and [`PermitRequest::outcome`].
    pub error_detail: Option<crate::ErrorDetail>,
    /// Set when `state` is `released`.
    pub release_reason: Option<ReleaseReason>,
    /// Set at grant: unique and increasing in grant order.
    pub fencing_token: Option<i64>,
    /// The worker that decided it.
    pub worker_id: Option<String>,
    /// When it was submitted.
    #[serde(serialize_with = "ser_time")]
    pub created_at: Option<SystemTime>,
    /// When it was granted.
    #[serde(serialize_with = "ser_time")]
    pub acquired_at: Option<SystemTime>,
    /// When its lease runs out (TTL requests).
    #[serde(serialize_with = "ser_time")]
    pub expires_at: Option<SystemTime>,
    /// Last heartbeat.
    #[serde(serialize_with = "ser_time")]
    pub heartbeat_at: Option<SystemTime>,
    /// When it was released.
    #[serde(serialize_with = "ser_time")]
    pub released_at: Option<SystemTime>,
    /// When it reached `error` or `released`.
    #[serde(serialize_with = "ser_time")]
    pub settled_at: Option<SystemTime>,
    /// When a worker first examined it (granted, failed, or left it waiting in line).
    #[serde(serialize_with = "ser_time")]
    pub examined_at: Option<SystemTime>,
    /// When the worker transaction that granted or failed it began.
    #[serde(serialize_with = "ser_time")]
    pub decided_at: Option<SystemTime>,
    /// The login role that submitted it (it belongs to that role).
    pub submitted_by: Option<String>,
}

impl PermitRequest {
    /// True once the request has left `new`: granted, failed or released.
    pub fn is_settled(&self) -> bool {
        !matches!(self.state, State::New | State::InProgress)
    }
}

/// A row of `permitq.semaphore`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Semaphore {
    /// Unique name.
    pub name: String,
    /// How many permits may be held at once.
    pub capacity: i64,
    /// How many are held now.
    pub used: i64,
    /// Strict FIFO with safe backfill (`true`) or greedy (`false`).
    pub fair: bool,
    /// A template (its name ends in `*`): never granted itself; requests naming a semaphore that
    /// does not exist get an instance made from the most specific matching template.
    pub is_template: bool,
    /// For an instance, the template it was made from.
    pub template: Option<String>,
    /// For a rate-limited semaphore, the window: at most `capacity` permits are granted in any
    /// window of this length, whatever the holders do. `None`: a concurrency semaphore.
    #[serde(serialize_with = "ser_secs")]
    pub per: Option<Duration>,
    /// The semaphore it is nested in: a grant here also takes from the parent (and its
    /// ancestors).
    pub parent: Option<String>,
    /// Its guaranteed share of its parent while it holds permits or has waiters within it.
    pub guarantee: i64,
    /// For a template, the most instances it may make (`None`: the default bound,
    /// [`crate::MAX_INSTANCES`]).
    pub max_instances: Option<i64>,
}

/// How [`crate::Client::set_semaphore`] creates or changes a semaphore, beyond its capacity.
/// What is left unset keeps its current value (or the default, for a new semaphore).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
pub struct SemaphoreSettings {
    /// Strict FIFO with safe backfill (`true`, the default) or greedy.
    pub fair: Option<bool>,
    /// A rate limit's window (zero removes it).
    pub per: Option<Duration>,
    /// The parent to nest it in; `Some("")` takes it out of its parent.
    pub parent: Option<String>,
    /// Its guaranteed share of its parent.
    pub guarantee: Option<i32>,
    /// For a template: the most instances it makes.
    pub max_instances: Option<i32>,
    /// Adaptive (`Some(Some(limit))`), fixed again (`Some(None)`), or kept (`None`).
    pub adaptive: Option<Option<crate::AdaptiveLimit>>,
    /// Its line served by fairness key (`Some(true)`), by priority and arrival alone again
    /// (`Some(false)`), or kept (`None`).
    pub fairness_keys: Option<bool>,
}

impl SemaphoreSettings {
    /// Nothing set: only the capacity changes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Its capacity set by the workers from its holders' reports, within the limit's bounds
    /// (`Some`), or fixed again (`None`); in the same change as the rest, so a refusal changes
    /// nothing.
    pub fn adaptive(mut self, limit: Option<crate::AdaptiveLimit>) -> Self {
        self.adaptive = Some(limit);
        self
    }

    /// Its line served across the requests' fairness keys in proportion to their weights
    /// (`true`; a fair semaphore only), or by priority and arrival alone (`false`).
    pub fn fairness_keys(mut self, keyed: bool) -> Self {
        self.fairness_keys = Some(keyed);
        self
    }

    /// Fair (head-of-line with safe backfill) or greedy.
    pub fn fair(mut self, fair: bool) -> Self {
        self.fair = Some(fair);
        self
    }

    /// Rate-limited: capacity counts permits granted in any window of `per` (zero removes it).
    pub fn per(mut self, per: Duration) -> Self {
        self.per = Some(per);
        self
    }

    /// Nested in `parent` (an existing plain semaphore); `""` takes it out of its parent.
    pub fn parent(mut self, parent: &str) -> Self {
        self.parent = Some(parent.to_string());
        self
    }

    /// Guaranteed `guarantee` permits of its parent while active.
    pub fn guarantee(mut self, guarantee: i32) -> Self {
        self.guarantee = Some(guarantee);
        self
    }

    /// For a template (a name ending in `*`): makes at most `max_instances` instances.
    pub fn max_instances(mut self, max_instances: i32) -> Self {
        self.max_instances = Some(max_instances);
        self
    }
}

/// A row of `permitq.capacity_change`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct CapacityChange {
    /// The semaphore.
    pub semaphore: String,
    /// Capacity before (None at creation).
    pub old_capacity: Option<i64>,
    /// Capacity after.
    pub new_capacity: i64,
    /// Fairness before (None at creation).
    pub old_fair: Option<bool>,
    /// Fairness after.
    pub new_fair: bool,
    /// When.
    #[serde(serialize_with = "ser_time")]
    pub changed_at: Option<SystemTime>,
    /// Database user.
    pub changed_by: String,
    /// The client's `application_name`.
    pub application_name: Option<String>,
    /// The parent before (None at creation, or without one; and in rows from before nesting).
    pub old_parent: Option<String>,
    /// The parent after.
    pub new_parent: Option<String>,
    /// The guarantee before (None at creation).
    pub old_guarantee: Option<i64>,
    /// The guarantee after (None in rows from before nesting).
    pub new_guarantee: Option<i64>,
    /// A template's bound on its instances before (None at creation, when unset, and in rows
    /// from before it was audited).
    pub old_max_instances: Option<i64>,
    /// A template's bound on its instances after (None when unset).
    pub new_max_instances: Option<i64>,
    /// A rate limit's window before (None at creation, for no rate limit, and in rows from
    /// before it was audited).
    #[serde(serialize_with = "ser_secs")]
    pub old_per: Option<Duration>,
    /// A rate limit's window after (None: no rate limit).
    #[serde(serialize_with = "ser_secs")]
    pub new_per: Option<Duration>,
    /// The semaphore was deleted ([`Client::delete_semaphore`](crate::Client::delete_semaphore));
    /// the `new_*` fields are the bounds it had.
    pub deleted: bool,
    /// For a change an adaptive cadence made (`changed_by` `adaptive (ALGORITHM)`): the reports
    /// and state it was made from (`ok`, `overloaded`, `failed`, `latency_ms`, `used`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inputs: Option<serde_json::Value>,
}

pub(crate) fn ser_secs<S: Serializer>(
    d: &Option<Duration>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

/// A fairness weight as it counts: the default, 1, where none was given.
fn ser_weight<S: Serializer>(w: &Option<i32>, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_i32(w.unwrap_or(1))
}

pub(crate) fn ser_time<S: Serializer>(
    t: &Option<SystemTime>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(&humantime::format_rfc3339_micros(*t).to_string()),
        None => s.serialize_none(),
    }
}
