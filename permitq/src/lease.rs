//! [`Lease`]: a granted request held by this process, heartbeated in the background.

use std::time::{Duration, Instant};

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::Client;
use crate::error::{Result, SqlState};
use crate::types::{PermitRequest, ReleaseOutcome};

/// Heartbeats are sent every `ttl / HEARTBEAT_FRACTION`.
const HEARTBEAT_FRACTION: u32 = 3;

/// A granted request held by this process, from [`Client::acquire`].
///
/// When the request has a TTL, a background task heartbeats every third of it. Each confirmed
/// heartbeat extends the lease to at least the time it was *sent* plus the TTL (the database
/// extends it from when it runs the heartbeat, later). A watchdog declares the lease *lost* a
/// safety margin (a tenth of the TTL, at least 20 ms) before that confirmed end, without waiting
/// for a heartbeat call that hangs on a dead link; so does a refused heartbeat (SQLSTATE 55000:
/// the lease expired, was revoked or released). Then [`Lease::is_lost`] turns true and
/// [`Lease::lost`] resolves. A holder must then stop touching the protected resource; use
/// [`Lease::fencing_token`] with downstream stores so that a write it still sends is rejected.
///
/// **Drop:** dropping a lease stops the heartbeats and, if it was not released explicitly and a
/// tokio runtime is still running, spawns a best-effort `permitq.release`. Nothing waits for that
/// release and its errors are only logged; if it never runs (runtime shutting down, process
/// killed) the TTL, `--max-hold` or the liveness hook reclaims the permits. Call
/// [`Lease::release`] to know the outcome.
#[must_use = "dropping a Lease releases it at once; hold it while you use the resource"]
pub struct Lease {
    client: Client,
    request: PermitRequest,
    lost: watch::Receiver<Option<String>>,
    heartbeat: Option<JoinHandle<()>>,
    released: bool,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("external_id", &self.request.external_id)
            .field("fencing_token", &self.request.fencing_token)
            .field("lost", &*self.lost.borrow())
            .finish_non_exhaustive()
    }
}

impl Lease {
    pub(crate) fn start(client: Client, request: PermitRequest) -> Lease {
        let (lost_tx, lost) = watch::channel(None);
        let heartbeat = request.ttl.map(|ttl| {
            let (client, external_id) = (client.clone(), request.external_id.clone());
            // The grant's lease runs to acquired_at + ttl, on the database's clock: what of it is
            // left, read on this host's clock (a grant "in the future" counts from now).
            let since_grant = request
                .acquired_at
                .and_then(|at| std::time::SystemTime::now().duration_since(at).ok())
                .unwrap_or_default();
            let confirmed_until = Instant::now() + ttl.saturating_sub(since_grant);
            tokio::spawn(heartbeat_loop(
                client,
                external_id,
                ttl,
                confirmed_until,
                lost_tx,
            ))
        });
        Lease {
            client,
            request,
            lost,
            heartbeat,
            released: false,
        }
    }

    /// The request as it was granted.
    pub fn request(&self) -> &PermitRequest {
        &self.request
    }

    /// The client-chosen id.
    pub fn external_id(&self) -> &str {
        &self.request.external_id
    }

    /// The fencing token: pass it to downstream writes, which reject tokens lower than the
    /// highest they have seen.
    pub fn fencing_token(&self) -> i64 {
        self.request.fencing_token.unwrap_or_default()
    }

    /// Whether the lease is known to be lost.
    pub fn is_lost(&self) -> bool {
        self.lost.borrow().is_some()
    }

    /// Resolves when the lease is lost, with the reason. A lease without TTL has no heartbeat
    /// to notice a loss, so for it this never resolves.
    pub async fn lost(&self) -> String {
        let mut rx = self.lost.clone();
        let reason = rx.wait_for(|l| l.is_some()).await.map(|r| r.clone());
        match reason {
            Ok(reason) => reason.unwrap_or_default(),
            Err(_) => std::future::pending().await,
        }
    }

    /// Releases the permits and reports what happened (`released`, or `already_released` when
    /// the lease had been lost and reclaimed).
    pub async fn release(mut self) -> Result<ReleaseOutcome> {
        self.released = true;
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        self.client.release(&self.request.external_id).await
    }

    /// Reports how the use went so far, while it still holds (beside its heartbeats), for the
    /// adaptive semaphores it holds ([`crate::Client::report`]): whether the report was kept.
    pub async fn report(&self, outcome: crate::Outcome, latency: Option<Duration>) -> Result<bool> {
        self.client
            .report(&self.request.external_id, outcome, latency)
            .await
    }

    /// Releases as [`Lease::release`] does, reporting how the use went for the adaptive
    /// semaphores it held ([`crate::Client::release_reporting`]).
    pub async fn release_reporting(
        mut self,
        outcome: crate::Outcome,
        latency: Option<Duration>,
    ) -> Result<ReleaseOutcome> {
        self.released = true;
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        self.client
            .release_reporting(&self.request.external_id, outcome, latency)
            .await
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        if self.released {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let (client, id) = (self.client.clone(), self.request.external_id.clone());
            runtime.spawn(async move {
                if let Err(e) = client.release(&id).await {
                    tracing::warn!(external_id = %id, error = %e, "release on drop failed");
                }
            });
        }
    }
}

/// How long before the confirmed end of a lease of `ttl` the watchdog declares it lost.
fn safety_margin(ttl: Duration) -> Duration {
    (ttl / 10).max(Duration::from_millis(20)).min(ttl / 2)
}

/// How long one heartbeat may take before it is abandoned and sent again on another
/// connection: half the time between heartbeats, at least 6 s (room to connect past a dead
/// host of a multi-host URL, 5 s each by default).
fn attempt_limit(every: Duration) -> Duration {
    (every / 2).max(Duration::from_secs(6))
}

/// How soon a failed heartbeat is sent again: a tenth of the time between heartbeats, between
/// 100 ms and a second.
fn retry_pause(every: Duration) -> Duration {
    (every / 10).clamp(Duration::from_millis(100), Duration::from_secs(1))
}

/// Heartbeats every `ttl / HEARTBEAT_FRACTION` and keeps the watchdog: the lease is lost at
/// `confirmed_until - safety_margin(ttl)` unless a heartbeat sent before then was confirmed,
/// whether or not a call is still waiting for the database. A heartbeat that fails, or does
/// not answer within [`attempt_limit`] (a link that died without a word, a primary gone in a
/// failover), is sent again soon on another connection, so a failover shorter than the ttl
/// costs no lease.
async fn heartbeat_loop(
    client: Client,
    external_id: String,
    ttl: Duration,
    mut confirmed_until: Instant,
    lost: watch::Sender<Option<String>>,
) {
    let every = (ttl / HEARTBEAT_FRACTION).max(Duration::from_millis(10));
    let margin = safety_margin(ttl);
    // The first heartbeat goes at once: from then on the lease's end is counted on this host's
    // clock alone (the grant's end mixes in the database's).
    let mut pause = Duration::ZERO;
    let give_up = |lost: &watch::Sender<Option<String>>, why: String| {
        tracing::warn!(%external_id, reason = %why, "lease lost");
        lost.send_replace(Some(why));
    };
    loop {
        let watchdog = tokio::time::sleep_until(
            confirmed_until
                .checked_sub(margin)
                .unwrap_or(confirmed_until)
                .into(),
        );
        tokio::pin!(watchdog);
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = &mut watchdog => {
                return give_up(&lost, "no heartbeat confirmed in time: the lease may run out".into());
            }
        }
        let sent = Instant::now();
        let attempt =
            tokio::time::timeout(attempt_limit(every), client.heartbeat(&external_id, None));
        tokio::select! {
            result = attempt => match result {
                Ok(Ok(_)) => {
                    confirmed_until = sent + ttl;
                    pause = every;
                }
                Ok(Err(e)) if e.code() == Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE) => {
                    return give_up(&lost, e.to_string());
                }
                Ok(Err(e)) => {
                    tracing::warn!(
                        %external_id, error = %e,
                        lease_holds_at_least_s = confirmed_until.saturating_duration_since(Instant::now()).as_secs_f64(),
                        "heartbeat failed; retrying (the lease holds at least lease_holds_at_least_s more)"
                    );
                    pause = retry_pause(every);
                }
                Err(_) => {
                    tracing::warn!(
                        %external_id,
                        lease_holds_at_least_s = confirmed_until.saturating_duration_since(Instant::now()).as_secs_f64(),
                        "heartbeat did not answer; retrying on another connection (the lease holds at least lease_holds_at_least_s more)"
                    );
                    pause = Duration::ZERO;
                }
            },
            () = &mut watchdog => {
                return give_up(
                    &lost,
                    "no heartbeat confirmed in time: the database did not answer".into(),
                );
            }
        }
    }
}
