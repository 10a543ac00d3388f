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
/// When the request has a TTL, a background task heartbeats every third of it. If a heartbeat
/// is refused (SQLSTATE 55000: the lease expired, was revoked or released) or none has succeeded
/// for a whole TTL, the lease is *lost*: [`Lease::is_lost`] turns true and [`Lease::lost`]
/// resolves. A holder must then stop touching the protected resource; use
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
            tokio::spawn(heartbeat_loop(client, external_id, ttl, lost_tx))
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

async fn heartbeat_loop(
    client: Client,
    external_id: String,
    ttl: Duration,
    lost: watch::Sender<Option<String>>,
) {
    let every = (ttl / HEARTBEAT_FRACTION).max(Duration::from_millis(10));
    let mut confirmed_until = Instant::now() + ttl;
    loop {
        tokio::time::sleep(every).await;
        match client.heartbeat(&external_id, None).await {
            Ok(_) => confirmed_until = Instant::now() + ttl,
            Err(e) if e.code() == Some(&SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE) => {
                lost.send_replace(Some(e.to_string()));
                return;
            }
            Err(e) => {
                if Instant::now() >= confirmed_until {
                    lost.send_replace(Some(format!("no heartbeat succeeded for a whole TTL: {e}")));
                    return;
                }
                tracing::warn!(%external_id, error = %e, "heartbeat failed; retrying");
            }
        }
    }
}
