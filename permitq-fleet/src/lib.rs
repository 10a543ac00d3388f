//! Runs of permitq and what they did: a database to run on ([`database`]), a fleet of
//! in-process workers ([`WorkerFleet`]), and reports read back from the database (outcomes,
//! submit → acquired latency, exact peak use, invariant violations). `permitq demo`, `bench`
//! and `chaos` use it, and so do the tests.

mod fleet;
mod report;
mod sql;

pub use fleet::{database, WorkerFleet};
pub use permitq_embedded_pg::{error, Error, Result};
pub use report::{
    collect, invariant_violations, quantile, queue_and_grants, Percentiles, RunReport,
};

/// A dedicated connection LISTENing on `channel`; yields every payload, in commit order.
pub async fn listen(
    url: &str,
    channel: &str,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<String>,
) {
    use futures_util::StreamExt;
    let (client, mut connection) = url
        .parse::<tokio_postgres::Config>()
        .unwrap()
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(msg)) = stream.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = msg {
                let _ = tx.send(n.payload().to_string());
            }
        }
    });
    client
        .batch_execute(&format!("LISTEN {channel}"))
        .await
        .unwrap();
    (client, rx)
}
