//! The LISTEN side: one dedicated connection per [`Listener`], outside any pool.
//!
//! Pools (deadpool) drive their connections themselves, drop notifications and run `UNLISTEN *`
//! when recycling, so LISTEN gets its own `tokio_postgres` connection, driven with
//! `poll_message`. When it drops (server restart, `pg_terminate_backend`, network), the listener
//! reconnects with jittered backoff and then emits [`ListenerEvent::Connected`]: notifications
//! sent while it was away are lost, so subscribers must re-scan (the worker runs a full pass).

use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{broadcast, watch};
use tokio::task::JoinHandle;
use tokio_postgres::{AsyncMessage, Config, NoTls};

use crate::db::Backoff;

/// What a listener reports to its subscribers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ListenerEvent {
    /// (Re)connected and listening. Anything sent while disconnected was missed: re-scan.
    Connected,
    /// A notification on one of the channels.
    Notification {
        /// The channel.
        channel: String,
        /// The payload.
        payload: String,
    },
}

/// A LISTEN connection that keeps itself alive.
pub(crate) struct Listener {
    events: broadcast::Sender<ListenerEvent>,
    connected: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

impl Listener {
    /// Starts listening on `channels` in the background.
    pub(crate) fn start(config: Config, channels: &[&str]) -> Listener {
        let (events, _) = broadcast::channel(4096);
        let (connected_tx, connected) = watch::channel(false);
        let channels: Vec<String> = channels.iter().map(|c| c.to_string()).collect();
        let task = tokio::spawn(run(config, channels, events.clone(), connected_tx));
        Listener {
            events,
            connected,
            task,
        }
    }

    /// A receiver of every event from now on.
    pub(crate) fn subscribe(&self) -> broadcast::Receiver<ListenerEvent> {
        self.events.subscribe()
    }

    /// Follows whether the connection is up and listening.
    pub(crate) fn connected(&self) -> watch::Receiver<bool> {
        self.connected.clone()
    }

    /// Whether the connection is up and listening right now.
    pub(crate) fn is_connected(&self) -> bool {
        *self.connected.borrow()
    }

    /// Waits until connected, or `timeout`; returns whether it is connected.
    pub(crate) async fn wait_connected(&self, timeout: Duration) -> bool {
        let mut rx = self.connected.clone();
        tokio::time::timeout(timeout, rx.wait_for(|c| *c))
            .await
            .is_ok_and(|r| r.is_ok())
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(
    config: Config,
    channels: Vec<String>,
    events: broadcast::Sender<ListenerEvent>,
    connected: watch::Sender<bool>,
) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(5));
    loop {
        // One line per outage: the first failure after the connection was up warns, the
        // retries that follow are debug lines.
        let was_up = *connected.borrow();
        match listen_once(&config, &channels, &events, &connected, &mut backoff).await {
            Ok(()) => tracing::warn!("LISTEN connection closed; reconnecting"),
            Err(e) if was_up || *connected.borrow() => {
                tracing::warn!(error = %crate::Error::from(e), "LISTEN connection failed; reconnecting")
            }
            Err(e) => {
                tracing::debug!(error = %crate::Error::from(e), "LISTEN connection failed again; reconnecting")
            }
        }
        connected.send_replace(false);
        metrics::counter!("permitq_listener_reconnects_total").increment(1);
        tokio::time::sleep(backoff.next_delay()).await;
    }
}

async fn listen_once(
    config: &Config,
    channels: &[String],
    events: &broadcast::Sender<ListenerEvent>,
    connected: &watch::Sender<bool>,
    backoff: &mut Backoff,
) -> Result<(), tokio_postgres::Error> {
    let (client, mut connection) = config.connect(NoTls).await?;
    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
    let sql: String = channels.iter().map(|c| format!("LISTEN {c};")).collect();
    // The connection must be driven while LISTEN runs, so issue it from a task.
    let mut listen = tokio::spawn(async move {
        let result = client.batch_execute(&sql).await;
        (client, result)
    });
    let mut client = None;
    loop {
        tokio::select! {
            msg = messages.next() => match msg {
                Some(Ok(AsyncMessage::Notification(n))) => {
                    let _ = events.send(ListenerEvent::Notification {
                        channel: n.channel().to_string(),
                        payload: n.payload().to_string(),
                    });
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e),
                None => return Ok(()),
            },
            joined = &mut listen, if client.is_none() => {
                let (c, result) = joined.expect("LISTEN task panicked");
                result?;
                // Keep the client alive: dropping it would close the connection.
                client = Some(c);
                backoff.reset();
                connected.send_replace(true);
                let _ = events.send(ListenerEvent::Connected);
                tracing::debug!(channels = channels.join(","), "listening");
            }
        }
    }
}
