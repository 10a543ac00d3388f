//! A throwaway PostgreSQL cluster from the system's binaries ([`EmbeddedPostgres`]), a bed of
//! network namespaces ([`NetworkBed`]) to run it and permitq workers on hosts of their own, and a
//! Patroni + etcd cluster ([`PatroniCluster`]), on loopback or on a bed. `permitq demo`, `bench`
//! and `chaos` start them, and so do the tests.

mod embedded;
mod netns;
mod patroni;

pub use embedded::{
    find_bin_dir, free_port, server_user, EmbeddedPostgres, StopMode, THROWAWAY_SETTINGS,
};
pub use netns::NetworkBed;
pub use patroni::{PatroniCluster, PatroniOptions, PATRONI_TTL};

/// Errors: anything, boxed, with a message.
pub type Error = Box<dyn std::error::Error + Send + Sync>;
/// Results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error with `message`.
pub fn error(message: impl Into<String>) -> Error {
    message.into().into()
}

/// A plain connection to `url` (a `postgres://` URL or `key=value` string), driven on a task.
pub async fn try_connect(url: &str) -> Result<tokio_postgres::Client> {
    let config: tokio_postgres::Config = url.parse()?;
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}
