//! [`Client`], every operation of the SQL API from Rust: producers and holders (submit, wait,
//! heartbeat, release), operators (capacity, revoke, usage, holders, waiters) and fencing.
//!
//! Every statement here runs as the *unnamed* statement with its parameter types given
//! (`query_typed`): one round trip, and no named prepared statement left on the server
//! connection. So a `Client` works through a transaction-mode pooler (PgBouncer), where the next
//! transaction may run on another server connection that already has, or lacks, a statement of
//! that name (`prepared statement "s0" already exists`, 42P05).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use deadpool_postgres::Pool;
use tokio::sync::{broadcast::error::RecvError, OnceCell};
use tokio_postgres::types::Type;

use crate::db;
use crate::error::{Error, Result};
use crate::explain::{self, Explanation};
use crate::lease::Lease;
use crate::listener::{Listener, ListenerEvent};
use crate::presence::{Granting, WorkerSeen};
use crate::rules::{duration_problem, priority_problem};
use crate::sql;
use crate::types::{
    CapacityChange, PermitRequest, ReleaseOutcome, Request, Semaphore, SemaphoreSettings, State,
};
use crate::usage::{self, Holder, SemaphoreUsage, Waiter};

/// How long a wait runs before it asks, once, whether any worker runs.
const SAY_NOTHING_GRANTING_AFTER: Duration = Duration::from_secs(3);

/// How often [`Client::wait_settled`] re-reads the status when no notification arrives.
const STATUS_POLL: Duration = Duration::from_millis(250);

/// How long an `acquire` that gave up waits for its request's cancellation.
const CANCEL_WITHIN: Duration = Duration::from_secs(2);

/// Notifications of `permitq_events`, as one waiting call receives them.
type Events = tokio::sync::broadcast::Receiver<ListenerEvent>;

/// A handle to a permitq database. Cheap to clone: clones share the pool and the one listening
/// connection, so make one per process and clone it into its tasks (every `Client` that
/// [`Client::connect`] makes listens on a connection of its own, and each grant wakes every
/// listener).
///
/// ```no_run
/// # async fn demo() -> permitq::Result<()> {
/// use std::time::Duration;
/// let client = permitq::Client::connect("postgres://localhost/app").await?;
/// client.set_capacity("gpu", 4, None).await?;
/// let submitted = client.submit(&permitq::Request::new("job-1").permit("gpu", 1)).await?;
/// let settled = client.wait_settled(&submitted.external_id, Duration::from_secs(5)).await?;
/// println!("{:?}", settled.map(|r| r.state));
/// client.release("job-1").await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("pool", &self.inner.pool.status())
            .finish_non_exhaustive()
    }
}

struct Inner {
    pool: Pool,
    config: tokio_postgres::Config,
    /// The server, for connection errors ([`db::target`]).
    target: String,
    events: OnceCell<Listener>,
}

impl Client {
    /// Connects to `url` with a pool of up to 16 connections (made lazily).
    pub async fn connect(url: &str) -> Result<Client> {
        Client::connect_with_pool_size(url, 16).await
    }

    /// Connects to `url` with a pool of up to `max_connections` connections (made lazily): as
    /// many as the tasks that call it at once, for many concurrent producers in one process.
    pub async fn connect_with_pool_size(url: &str, max_connections: usize) -> Result<Client> {
        let config = db::parse_config(url)?;
        let pool = db::pool(config.clone(), max_connections.max(1))?;
        Ok(Client::new(pool, config))
    }

    /// A client over `pool`; `config` is used for the LISTEN connection.
    fn new(pool: Pool, config: tokio_postgres::Config) -> Client {
        Client {
            inner: Arc::new(Inner {
                pool,
                target: db::target(&config),
                config,
                events: OnceCell::new(),
            }),
        }
    }

    /// A pooled connection; a failure to connect names the server.
    pub(crate) async fn conn(&self) -> Result<deadpool_postgres::Object> {
        self.inner
            .pool
            .get()
            .await
            .map_err(|e| Error::from(e).reaching(&self.inner.target))
    }

    /// Whether anything is granting: how many workers run, and when one was last seen. See
    /// [`Granting::warning`] for what to tell a user when none does.
    pub async fn granting(&self) -> Result<Granting> {
        let conn = self.conn().await?;
        Granting::from_row(&conn.query_typed_one(sql::GRANTING, &[]).await?)
    }

    /// The workers seen in the last hour, live first: id, host, version, last seen.
    pub async fn workers(&self) -> Result<Vec<WorkerSeen>> {
        let conn = self.conn().await?;
        conn.query_typed(sql::WORKERS, &[])
            .await?
            .iter()
            .map(WorkerSeen::from_row)
            .collect()
    }

    /// Creates or upgrades the schema (see [`crate::migrate`]). Returns what it applied.
    pub async fn migrate(&self) -> Result<crate::migrate::Migrated> {
        let mut conn = db::connect(&self.inner.config)
            .await
            .map_err(|e| e.reaching(&self.inner.target))?;
        crate::migrate::migrate(&mut conn).await
    }

    /// `e`, saying where it looked when the schema was missing there (a URL naming the wrong
    /// database reads as an unmigrated one), and naming this client's login in a refusal.
    pub(crate) fn located(&self, e: Error) -> Error {
        if e.is_missing_schema() {
            e.looked_in(self.database())
        } else {
            // A refusal names this client's login in the GRANT it gives.
            e.for_login(db::login(&self.inner.config).as_deref())
        }
    }

    /// Where this client works, as messages name it: `database app at 127.0.0.1:5432 as app`.
    #[must_use]
    pub fn database(&self) -> String {
        db::place(&self.inner.config)
    }

    /// Whether the database's schema is exactly the one this build expects (every migration
    /// and schema file applied unchanged, none newer): false when `permitq migrate` has not run
    /// yet, or another version did.
    pub async fn schema_is_current(&self) -> Result<bool> {
        let conn = self.conn().await?;
        match crate::migrate::is_current(&conn).await {
            Err(e) if e.is_missing_schema() => Ok(false),
            other => other,
        }
    }

    /// Submits a request (idempotent by `external_id`) and wakes the workers.
    pub async fn submit(&self, request: &Request) -> Result<PermitRequest> {
        if let Some(problem) = duration_problem(request.ttl, false) {
            return Err(Error::invalid("ttl", problem));
        }
        if let Some(problem) = duration_problem(request.wait, true) {
            return Err(Error::invalid("wait", problem));
        }
        if let Some(problem) = priority_problem(request.priority) {
            return Err(Error::invalid("priority", problem));
        }
        let conn = self.conn().await?;
        let row = conn
            .query_typed_one(
                sql::SUBMIT.as_str(),
                &[
                    (&request.external_id, Type::TEXT),
                    (&request.permits_json(), Type::JSONB),
                    (&request.owner, Type::TEXT),
                    (&request.ttl.map(sql::interval), Type::TEXT),
                    (&request.wait.map(sql::interval), Type::TEXT),
                    (&request.priority, Type::INT2),
                    (&request.fairness_key, Type::TEXT),
                    (&request.fairness_weight, Type::INT4),
                ],
            )
            .await
            .map_err(|e| self.located(e.into()))?;
        let submitted = db::request_from_row(&row)?;
        tracing::debug!(external_id = %submitted.external_id, state = %submitted.state, "submitted");
        Ok(submitted)
    }

    /// Submits `request` and waits up to `timeout` for it to be granted, returning a [`Lease`]
    /// that heartbeats in the background (when the request has a TTL). If it ends in `error`, or
    /// is still waiting at the timeout (it is then cancelled), the error's
    /// [`Error::not_granted`] holds the request as it ended.
    ///
    /// Dropped while it waits (a `select!` or an outer timeout gave up on it), it cancels the
    /// request in the background, so that nothing is granted to a caller that has gone.
    ///
    /// A database that does not answer (down, restarting, failing over) is retried until the
    /// timeout, the submit included (it is idempotent); the first retry logs one warning.
    pub async fn acquire(&self, request: &Request, timeout: Duration) -> Result<Lease> {
        let deadline = Instant::now() + timeout;
        // Subscribed before the submit: its answer is then the first read of the wait.
        let mut events = self.subscribe_events(timeout).await;
        let mut retry = Retry::until(deadline);
        let submitted = loop {
            match self.submit(request).await {
                Ok(submitted) => break submitted,
                Err(e) => retry.pause_or_fail(e).await?,
            }
        };
        let mut cancel_if_dropped = CancelIfDropped {
            client: self,
            external_id: &request.external_id,
            armed: true,
        };
        let settled = self
            .wait_settled_on(
                &mut events,
                &mut retry,
                &request.external_id,
                deadline,
                Some(submitted),
                true,
            )
            .await;
        cancel_if_dropped.armed = false;
        let settled = match settled {
            Ok(settled) => settled,
            // The database did not answer until the deadline: cancel the request if it answers
            // now, or say that it may still wait (an unconfirmed grant, on a primary waiting for
            // a lost standby, would hang the cancel: it is left to the caller).
            Err(e) if e.is_connection() && !e.is_unconfirmed() => {
                return Err(match self.cancel_within(&request.external_id).await {
                    Ok(_) => e,
                    Err(_) => e.left_waiting(&request.external_id),
                });
            }
            Err(e) => return Err(e),
        };
        let (settled, gave_up) = match settled {
            Some(r) if r.state == State::New => {
                // Give up: cancel, unless it was granted in the meantime; say why it waited.
                if let Err(e) = self.cancel_within(&request.external_id).await {
                    return Err(e.left_waiting(&request.external_id));
                }
                let why = match self.granting().await.ok().and_then(|g| g.warning()) {
                    Some(warning) => format!(
                        "; {warning} (this request is cancelled: acquire again under a new \
                         external_id once one runs)"
                    ),
                    None => {
                        let names: Vec<&str> = request.permits.keys().map(String::as_str).collect();
                        format!(
                            "; {} had no room for it in that time (`permitq semaphore show {}` \
                             shows who holds them: a producer login sees its own holders, an \
                             operator login every one)",
                            names.join(", "),
                            names
                                .first()
                                .map_or("NAME".to_string(), |n| crate::shell_word(n))
                        )
                    }
                };
                let gave_up = format!(
                    "still waiting after {}, so acquire cancelled it{why}",
                    humantime::format_duration(timeout)
                );
                (self.status(&request.external_id).await?, Some(gave_up))
            }
            other => (other, None),
        };
        match settled {
            Some(r) if r.state == State::Acquired => Ok(Lease::start(self.clone(), r)),
            Some(r) => Err(Error::refused(r, gave_up)),
            None => Err(Error::config(format!(
                "request {} vanished",
                request.external_id
            ))),
        }
    }

    /// The request with this `external_id`, if any.
    pub async fn status(&self, external_id: &str) -> Result<Option<PermitRequest>> {
        read_status(&self.conn().await?, external_id)
            .await
            .map_err(|e| self.located(e))
    }

    /// [`Client::status`], and once the request has left `new`, a commit on the same
    /// connection that reaches the synchronous standbys, if the server has any
    /// ([`sql::DURABILITY_BARRIER`]), before the row is returned.
    async fn durable_status(
        &self,
        external_id: &str,
        deadline: Instant,
    ) -> Result<Option<PermitRequest>> {
        // Abandoned while the barrier waits (a primary without its standby), the connection
        // leaves the pool.
        let mut conn = Checkout(Some(self.conn().await?));
        let (row, confirm) = read_status_and_barrier(&conn, external_id)
            .await
            .map_err(|e| self.located(e))?;
        if confirm
            && row
                .as_ref()
                .is_some_and(|r| r.state != State::New && r.state != State::InProgress)
        {
            let until = deadline.max(Instant::now() + Duration::from_secs(1));
            // The simple protocol: it answers after the commit (the extended one may hand over
            // the row before the commit waits for the standby).
            let barrier = conn.batch_execute(sql::DURABILITY_BARRIER);
            match tokio::time::timeout_at(until.into(), barrier).await {
                Ok(done) => {
                    done?;
                }
                Err(_) => return Err(Error::unconfirmed(external_id)),
            }
        }
        conn.finished();
        Ok(row)
    }

    /// [`Client::release`] for an `acquire` that gave up, within [`CANCEL_WITHIN`]: a database
    /// that does not answer must not keep the caller past its deadline for long.
    async fn cancel_within(&self, external_id: &str) -> Result<ReleaseOutcome> {
        match tokio::time::timeout(CANCEL_WITHIN, self.release(external_id)).await {
            Ok(outcome) => outcome,
            Err(_) => Err(Error::config(format!(
                "cancelling request {external_id} got no answer within {}",
                humantime::format_duration(CANCEL_WITHIN)
            ))),
        }
    }

    /// Gives a held request's permits back, or cancels it while it waits. Idempotent.
    pub async fn release(&self, external_id: &str) -> Result<ReleaseOutcome> {
        self.outcome(sql::RELEASE, external_id).await
    }

    /// Operator revoke: releases a held request with reason `revoked` (cancels a waiting one).
    pub async fn revoke(&self, external_id: &str) -> Result<ReleaseOutcome> {
        self.outcome(sql::REVOKE, external_id).await
    }

    async fn outcome(&self, query: &str, external_id: &str) -> Result<ReleaseOutcome> {
        // Abandoned midway (an acquire's bounded cancel, on a link that died without a word),
        // the connection leaves the pool.
        let mut conn = Checkout(Some(self.conn().await?));
        let row = conn
            .query_typed_one(query, &[(&external_id, Type::TEXT)])
            .await;
        conn.finished();
        let text: String = row.map_err(|e| self.located(e.into()))?.get(0);
        tracing::debug!(%external_id, outcome = %text, "released");
        Ok(text.parse()?)
    }

    /// Extends the lease to now + `extend` (or the request's ttl). Returns the new expiry (None
    /// for a request without TTL). Fails with SQLSTATE 55000 when the lease is lost.
    pub async fn heartbeat(
        &self,
        external_id: &str,
        extend: Option<Duration>,
    ) -> Result<Option<SystemTime>> {
        if let Some(problem) = duration_problem(extend, false) {
            return Err(Error::invalid("extend", problem));
        }
        // A heartbeat abandoned midway (the lease's attempt timed out on a dead link) must not
        // leave its connection in the pool for the next one to hang on.
        let mut conn = Checkout(Some(self.conn().await?));
        let row = conn
            .query_typed_one(
                sql::HEARTBEAT,
                &[
                    (&external_id, Type::TEXT),
                    (&extend.map(sql::interval), Type::TEXT),
                ],
            )
            .await;
        conn.finished();
        Ok(row.map_err(|e| self.located(e.into()))?.get(0))
    }

    /// Waits until the request leaves `new`, or `timeout` passes, and returns it as it is then
    /// (still `new` on timeout; `None` for an unknown id). Listens on `permitq_events` (whose
    /// payloads name request ids only) and re-reads the status when its id is named, and every
    /// 250 ms, so a lost notification only costs latency.
    ///
    /// With synchronous replication, an outcome is returned only once it has reached the
    /// synchronous standby: on a primary that lost its standby in a failover, a grant can be
    /// visible locally and then be discarded when the primary is demoted. Such an outcome is
    /// never reported; once `timeout` passes (at least a second for the confirmation) the call
    /// fails with a connection error ([`Error::is_connection`]): ask again. A database that does
    /// not answer is asked again until `timeout` too (the first retry logs one warning).
    pub async fn wait_settled(
        &self,
        external_id: &str,
        timeout: Duration,
    ) -> Result<Option<PermitRequest>> {
        let deadline = Instant::now() + timeout;
        let mut events = self.subscribe_events(timeout).await;
        let mut retry = Retry::until(deadline);
        self.wait_settled_on(&mut events, &mut retry, external_id, deadline, None, false)
            .await
    }

    /// A receiver of `permitq_events`, its LISTEN connection started (or its start awaited up
    /// to `timeout`, at most a second: a notification lost before then costs a poll, not the
    /// outcome).
    async fn subscribe_events(&self, timeout: Duration) -> Events {
        let listener = self
            .inner
            .events
            .get_or_init(|| async {
                Listener::start(self.inner.config.clone(), &[sql::EVENTS_CHANNEL])
            })
            .await;
        let events = listener.subscribe();
        if !listener.is_connected() {
            listener
                .wait_connected(timeout.min(Duration::from_secs(1)))
                .await;
        }
        events
    }

    /// [`Client::wait_settled`] on `events`, subscribed before `known` was read (the submit's
    /// answer, when the caller has it: a request still waiting then needs no second read).
    /// `warn_nothing_granting`: after a few seconds of waiting, log once that no worker runs,
    /// if none does (an `acquire` would otherwise be silent until its timeout).
    async fn wait_settled_on(
        &self,
        events: &mut Events,
        retry: &mut Retry,
        external_id: &str,
        deadline: Instant,
        known: Option<PermitRequest>,
        warn_nothing_granting: bool,
    ) -> Result<Option<PermitRequest>> {
        let mut known = known.filter(|r| r.state == State::New || r.state == State::InProgress);
        let started = Instant::now();
        let mut asked_granting = !warn_nothing_granting;
        loop {
            // Subscribed before reading: a change after this read is also a notification.
            let current = match known.take() {
                Some(waiting) => Some(waiting),
                None => match self.durable_status(external_id, deadline).await {
                    Ok(current) => current,
                    Err(e) => {
                        retry.pause_or_fail(e).await?;
                        continue;
                    }
                },
            };
            let request_id = match &current {
                Some(r) if r.state == State::New || r.state == State::InProgress => r.id,
                _ => return Ok(current),
            };
            let now = Instant::now();
            if now >= deadline {
                return Ok(current);
            }
            // Waiting a while: whether anything grants at all, said once (a wait with no worker
            // running would otherwise be silent until its timeout).
            if !asked_granting && started.elapsed() >= SAY_NOTHING_GRANTING_AFTER {
                asked_granting = true;
                if let Some(warning) = self.granting().await.ok().and_then(|g| g.warning()) {
                    tracing::warn!("permitq: {external_id} waits, and {warning}");
                }
            }
            let poll_at = now + STATUS_POLL.min(deadline - now);
            loop {
                let event = tokio::select! {
                    e = events.recv() => e,
                    _ = tokio::time::sleep_until(poll_at.into()) => break,
                };
                match event {
                    Ok(ListenerEvent::Notification { payload, .. }) => {
                        if event_is_for(&payload, request_id) {
                            break;
                        }
                    }
                    Ok(ListenerEvent::Connected) | Err(RecvError::Lagged(_)) => break,
                    Err(RecvError::Closed) => {
                        tokio::time::sleep_until(poll_at.into()).await;
                        break;
                    }
                }
            }
        }
    }

    /// Creates or changes a semaphore (and writes the capacity audit).
    pub async fn set_capacity(
        &self,
        name: &str,
        capacity: i32,
        fair: Option<bool>,
    ) -> Result<Semaphore> {
        let settings = SemaphoreSettings {
            fair,
            ..SemaphoreSettings::new()
        };
        self.set_semaphore(name, capacity, &settings).await
    }

    /// Creates or changes a rate-limited semaphore: at most `grants` permits granted in any
    /// window of length `per` (sliding, on the database clock), whether holders release early
    /// or hold on. A name ending in `*` makes a template of rate-limited semaphores. `per` zero
    /// removes the window: a concurrency semaphore of capacity `grants` again.
    pub async fn set_rate_limit(
        &self,
        name: &str,
        grants: i32,
        per: Duration,
        fair: Option<bool>,
    ) -> Result<Semaphore> {
        let settings = SemaphoreSettings {
            fair,
            per: Some(per),
            ..SemaphoreSettings::new()
        };
        self.set_semaphore(name, grants, &settings).await
    }

    /// Creates or changes a semaphore with any of its settings: fairness, a rate window, a
    /// parent it is nested in and its guaranteed share of that parent. A grant on a nested
    /// semaphore also takes from its parent and every ancestor. A template's instances carry
    /// all of them.
    pub async fn set_semaphore(
        &self,
        name: &str,
        capacity: i32,
        settings: &SemaphoreSettings,
    ) -> Result<Semaphore> {
        if let Some(problem) = duration_problem(settings.per, true) {
            return Err(Error::invalid("per", problem));
        }
        let mut conn = self.conn().await?;
        let per = settings.per.map(sql::interval);
        // set_capacity's `adaptive`: {"algorithm", "floor", "ceiling"}, or false.
        let adaptive = settings.adaptive.as_ref().map(|limit| match limit {
            Some(l) => serde_json::json!({
                "algorithm": l.algorithm.as_str(),
                "floor": l.floor,
                "ceiling": l.ceiling,
            })
            .to_string(),
            None => "false".to_string(),
        });
        let mut params: Vec<(&(dyn tokio_postgres::types::ToSql + Sync), Type)> = vec![
            (&name, Type::TEXT),
            (&capacity, Type::INT4),
            (&settings.fair, Type::BOOL),
            (&per, Type::TEXT),
            (&settings.parent, Type::TEXT),
            (&settings.guarantee, Type::INT4),
            (&settings.max_instances, Type::INT4),
        ];
        let query = match &adaptive {
            Some(adaptive) => {
                params.push((adaptive, Type::TEXT));
                sql::SET_CAPACITY_ADAPTIVE
            }
            None => sql::SET_CAPACITY,
        };
        // With the fairness keys, in one transaction: a refusal of either changes nothing.
        let tx = conn
            .transaction()
            .await
            .map_err(|e| self.located(e.into()))?;
        // Keys off first (so that the same call may make it greedy), on after (it must be
        // there, and fair).
        if settings.fairness_keys == Some(false) {
            tx.execute(sql::SET_FAIRNESS_KEYS, &[&name, &false])
                .await
                .map_err(|e| self.located(e.into()))?;
        }
        let row = tx
            .query_typed_one(query, &params)
            .await
            .map_err(|e| self.located(e.into()))?;
        if settings.fairness_keys == Some(true) {
            tx.execute(sql::SET_FAIRNESS_KEYS, &[&name, &true])
                .await
                .map_err(|e| self.located(e.into()))?;
        }
        tx.commit().await.map_err(|e| self.located(e.into()))?;
        db::semaphore_from_row(&row)
    }

    /// Deletes a semaphore, template or instance that nothing uses, and records it in its
    /// capacity history. `None` when there is none by that name. Refused (SQLSTATE 55006, the
    /// message says what to do first) while it holds permits, has releases not folded yet or
    /// requests waiting, is a parent, or is a template with instances. Needs `permitq_admin`.
    pub async fn delete_semaphore(&self, name: &str) -> Result<Option<Semaphore>> {
        let conn = self.conn().await?;
        conn.query_typed_opt(sql::DELETE_SEMAPHORE, &[(&name, Type::TEXT)])
            .await?
            .as_ref()
            .map(db::semaphore_from_row)
            .transpose()
    }

    /// Every semaphore, by name.
    pub async fn semaphores(&self) -> Result<Vec<Semaphore>> {
        let conn = self.conn().await?;
        conn.query_typed(sql::LIST_SEMAPHORES, &[])
            .await?
            .iter()
            .map(db::semaphore_from_row)
            .collect()
    }

    /// The existing semaphore or template names nearest `name` (another case, containing it or
    /// sharing most of its letter pairs), nearest first, at most 3: what an `unknown_semaphore`
    /// error's `similar` holds.
    pub async fn similar_semaphores(&self, name: &str) -> Result<Vec<String>> {
        let conn = self.conn().await?;
        Ok(conn
            .query_typed_one(sql::SIMILAR_SEMAPHORES, &[(&name, Type::TEXT)])
            .await?
            .get(0))
    }

    /// The external_ids nearest `external_id` (another case, containing it or sharing most of
    /// its letter pairs) among the latest 1,000 requests this login reads, nearest first, at
    /// most 3: what to suggest for an id no request has.
    pub async fn similar_requests(&self, external_id: &str) -> Result<Vec<String>> {
        let conn = self.conn().await?;
        Ok(conn
            .query_typed_one(sql::SIMILAR_REQUESTS, &[(&external_id, Type::TEXT)])
            .await?
            .get(0))
    }

    /// For each of `names` that no semaphore or template has, what to tell the user: a worker
    /// will fail a request naming it with `unknown_semaphore`; the nearest names; how to create
    /// it. Empty when every name exists (or is an instance a template makes).
    pub async fn unknown_names(&self, names: &[&str]) -> Result<Vec<String>> {
        let conn = self.conn().await?;
        Ok(conn
            .query_typed(sql::UNKNOWN_NAMES, &[(&names, Type::TEXT_ARRAY)])
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect())
    }

    /// What a worker will fail a request of `permits` with, said before it examines it, while
    /// it can still be fixed: a name no semaphore or template has (as [`Client::unknown_names`]),
    /// a template named itself, a count beyond a semaphore's or a parent's capacity. Empty when
    /// none of these holds.
    pub async fn answers_at_submit(
        &self,
        permits: &std::collections::BTreeMap<String, i64>,
    ) -> Result<Vec<String>> {
        let conn = self.conn().await?;
        let permits = serde_json::to_value(permits).map_err(|e| Error::config(e.to_string()))?;
        Ok(conn
            .query_typed(sql::ANSWERS_AT_SUBMIT, &[(&permits, Type::JSONB)])
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect())
    }

    /// The login role this client runs as: what a request's `submitted_by` records.
    pub async fn login(&self) -> Result<String> {
        let conn = self.conn().await?;
        Ok(conn
            .query_one(sql::LOGIN, &[])
            .await
            .map_err(|e| self.located(e.into()))?
            .get(0))
    }

    /// Whether this login reads every producer's requests (an operator, worker or admin, or a
    /// superuser), or only those it submitted.
    pub async fn reads_every_request(&self) -> Result<bool> {
        let conn = self.conn().await?;
        Ok(conn
            .query_typed_one(sql::READS_EVERY_REQUEST, &[])
            .await?
            .get(0))
    }

    /// The capacity audit of one semaphore, oldest first.
    pub async fn capacity_history(&self, name: &str) -> Result<Vec<CapacityChange>> {
        let conn = self.conn().await?;
        conn.query_typed(sql::CAPACITY_HISTORY, &[(&name, Type::TEXT)])
            .await?
            .iter()
            .map(db::capacity_change_from_row)
            .collect()
    }

    /// Every semaphore with its exact use, waiting count and oldest wait, by name.
    pub async fn usage(&self) -> Result<Vec<SemaphoreUsage>> {
        let conn = self.conn().await?;
        conn.query_typed(sql::USAGE, &[])
            .await?
            .iter()
            .map(usage::usage_from_row)
            .collect()
    }

    /// Why the request waits: for each semaphore it names, what is free and missing, its place
    /// in line, who holds the permits, the rule that holds it back, and an estimated wait; for
    /// a request that no longer waits, its outcome. `None` for an unknown request (or another
    /// role's, for a producer).
    pub async fn explain(&self, external_id: &str) -> Result<Option<Explanation>> {
        let conn = self.conn().await?;
        let rows = conn
            .query_typed(sql::EXPLAIN, &[(&external_id, Type::TEXT)])
            .await
            .map_err(|e| self.located(e.into()))?;
        let Some(mut explanation) = explain::explanation_from_rows(&rows)? else {
            return Ok(None);
        };
        if matches!(explanation.state, State::New | State::InProgress) {
            // Whether anything grants, the workers' --max-hold and the request's own terms:
            // three reads, pipelined.
            let (granting, max_hold, status) = tokio::join!(
                conn.query_typed_one(sql::GRANTING, &[]),
                conn.query_typed_one(sql::LEAST_MAX_HOLD, &[]),
                read_status(&conn, external_id)
            );
            explanation.nothing_granting = Granting::from_row(&granting?)?.warning();
            if explanation.nothing_granting.is_some() {
                explanation.say_no_worker_examines();
            }
            explanation.max_hold = max_hold?
                .get::<_, Option<f64>>(0)
                .map(|s| Duration::from_secs_f64(s.max(0.0)));
            if let Some(r) = status? {
                explanation.wait_ends_at = r.created_at.zip(r.wait).map(|(at, wait)| at + wait);
                explanation.priority = Some(r.priority);
                let waited = r
                    .created_at
                    .and_then(|at| SystemTime::now().duration_since(at).ok())
                    .unwrap_or_default();
                explanation.aged_priority = Some(
                    f64::from(r.priority) + waited.as_secs_f64() / crate::AGING_STEP.as_secs_f64(),
                );
            }
        } else if let Some(r) = read_status(&conn, external_id).await? {
            // Released: how long it held, and since when (as `permitq.explain` says it too).
            let held = match (r.acquired_at, r.released_at) {
                (Some(from), Some(to)) => to.duration_since(from).ok().map(|held| {
                    let ago = SystemTime::now().duration_since(to).unwrap_or_default();
                    format!(
                        " after {:.1}s held, {:.1}s ago",
                        held.as_secs_f64(),
                        ago.as_secs_f64()
                    )
                }),
                _ => None,
            };
            explanation.outcome = r.outcome().map(|o| o + held.as_deref().unwrap_or(""));
            explanation.error_detail = r.error_detail;
        }
        Ok(Some(explanation))
    }

    /// Who holds permits of `semaphore`, oldest grant first.
    pub async fn holders(&self, semaphore: &str) -> Result<Vec<Holder>> {
        let conn = self.conn().await?;
        conn.query_typed(sql::HOLDERS, &[(&semaphore, Type::TEXT)])
            .await?
            .iter()
            .map(usage::holder_from_row)
            .collect()
    }

    /// The first `limit` (at most 1000) requests waiting on `semaphore`, in queue order; on a
    /// parent, those waiting below it that a worker has examined. A producer sees its own.
    pub async fn waiters(&self, semaphore: &str, limit: i64) -> Result<Vec<Waiter>> {
        let limit = limit.clamp(0, 1000);
        let conn = self.conn().await?;
        conn.query_typed(
            sql::WAITERS,
            &[(&semaphore, Type::TEXT), (&limit, Type::INT8)],
        )
        .await?
        .iter()
        .map(usage::waiter_from_row)
        .collect()
    }

    /// Fencing check for a downstream write to `resource`, kept in this database and guarded by
    /// `semaphore`: true (and remembered) when `token` is this login's request's, which holds a
    /// permit of `semaphore` now, and is at least the highest token seen for `resource`. The
    /// first fence of a resource binds it to `semaphore`; another semaphore is then refused
    /// (SQLSTATE 22023).
    pub async fn fence(&self, semaphore: &str, resource: &str, token: i64) -> Result<bool> {
        let conn = self.conn().await?;
        Ok(conn
            .query_typed_one(
                sql::FENCE,
                &[
                    (&semaphore, Type::TEXT),
                    (&resource, Type::TEXT),
                    (&token, Type::INT8),
                ],
            )
            .await?
            .get(0))
    }

    /// Operator (`permitq_admin`): every fencing token issued from now on is above `above`.
    /// For the one case permitq cannot see by itself: a copy that issued tokens after the dump
    /// this database was restored from, on the same database and token sequence (restore
    /// runbook in the README). Returns the token epoch in force (tokens are `epoch << 48 | n`).
    pub async fn raise_token_floor(&self, above: i64) -> Result<i64> {
        let conn = self.conn().await?;
        Ok(conn
            .query_typed_one(sql::RAISE_TOKEN_FLOOR, &[(&above, Type::INT8)])
            .await?
            .get(0))
    }
}

/// Whether a `permitq_events` payload (a JSON array of request ids) names `request_id`. An
/// unreadable payload counts as a match: re-reading the status is cheap.
fn event_is_for(payload: &str, request_id: i64) -> bool {
    match serde_json::from_str::<Vec<i64>>(payload) {
        Ok(ids) => ids.contains(&request_id),
        Err(_) => true,
    }
}

/// The request `external_id` as `conn` reads it (`None`: unknown, or another role's).
async fn read_status(
    conn: &deadpool_postgres::Object,
    external_id: &str,
) -> Result<Option<PermitRequest>> {
    Ok(read_status_and_barrier(conn, external_id).await?.0)
}

/// The request, and whether an outcome read here needs [`sql::DURABILITY_BARRIER`] before it is
/// acted on (read in the same statement: a server without synchronous standbys costs no second
/// round trip).
async fn read_status_and_barrier(
    conn: &deadpool_postgres::Object,
    external_id: &str,
) -> Result<(Option<PermitRequest>, bool)> {
    let Some(row) = conn
        .query_typed_opt(sql::STATUS.as_str(), &[(&external_id, Type::TEXT)])
        .await?
    else {
        return Ok((None, false));
    };
    Ok((Some(db::request_from_row(&row)?), row.try_get("barrier")?))
}

/// A pooled connection that goes back to the pool only if the call using it finished
/// ([`Checkout::finished`]). Dropped before that (the call's future was abandoned, say by a
/// timeout, maybe on a link that died without a word, or on a primary gone in a failover), it
/// is taken out of the pool and closed, and so are the pool's idle connections: made to the
/// same server, they would hang the next call the same way. New ones are made as needed.
struct Checkout(Option<deadpool_postgres::Object>);

impl Checkout {
    /// The call finished: the connection goes back to the pool.
    fn finished(&mut self) {
        self.0.take();
    }
}

impl std::ops::Deref for Checkout {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &Self::Target {
        self.0.as_ref().expect("a connection until finished")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(abandoned) = self.0.take() {
            if let Some(pool) = deadpool_postgres::Object::pool(&abandoned) {
                pool.retain(|_, _| false);
            }
            drop(deadpool_postgres::Object::take(abandoned));
        }
    }
}

/// Cancels a request whose [`Client::acquire`] was dropped while it waited (on the current tokio
/// runtime, in the background; without one, the request's own `wait` ends it).
/// Asking again an idempotent call while the database does not answer, until a deadline:
/// pauses of 50 ms, doubling to 1 s. Without it, an acquire fails at once when the database
/// restarts, and its caller cannot tell a database that is down from a busy semaphore.
struct Retry {
    deadline: Instant,
    pause: Duration,
    warned: bool,
}

impl Retry {
    const FIRST_PAUSE: Duration = Duration::from_millis(50);
    const LONGEST_PAUSE: Duration = Duration::from_secs(1);

    fn until(deadline: Instant) -> Self {
        Retry {
            deadline,
            pause: Self::FIRST_PAUSE,
            warned: false,
        }
    }

    /// `error` back when it is not a connection error or the deadline has passed; else the
    /// pause, cut short at the deadline for a last try (a warning at the first pause).
    async fn pause_or_fail(&mut self, error: Error) -> Result<()> {
        let now = Instant::now();
        if !error.is_connection() || now >= self.deadline {
            return Err(error);
        }
        if !self.warned {
            self.warned = true;
            tracing::warn!(
                "{error}; retrying until the deadline, {}s from now",
                (self.deadline - now).as_secs()
            );
        }
        tokio::time::sleep(self.pause.min(self.deadline - now)).await;
        self.pause = (self.pause * 2).min(Self::LONGEST_PAUSE);
        Ok(())
    }
}

struct CancelIfDropped<'a> {
    client: &'a Client,
    external_id: &'a str,
    armed: bool,
}

impl Drop for CancelIfDropped<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (client, external_id) = (self.client.clone(), self.external_id.to_string());
            runtime.spawn(async move {
                if let Err(e) = client.release(&external_id).await {
                    tracing::warn!(%external_id, error = %e,
                        "acquire was dropped while waiting and could not cancel its request");
                }
            });
        }
    }
}
