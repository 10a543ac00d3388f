//! Fairness keys: what operators read of a semaphore served by key (the protocol is in
//! schema/functions/fairness.sql; the switch is [`crate::SemaphoreSettings::fairness_keys`]).

use serde::Serialize;

use crate::error::Result;

/// One fairness key's share of a semaphore served by key (a row of `permitq.key_shares`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct KeyShare {
    /// The key (`""`: the requests that name none, which share the line as one key).
    pub fairness_key: String,
    /// Its weight (the largest its requests asked; 1 when none did).
    pub weight: i32,
    /// Its requests waiting in line, and the permits they ask.
    pub waiting: i64,
    /// The permits its waiting requests ask.
    pub waiting_permits: i64,
    /// The permits its requests hold now.
    pub held: i64,
}

impl crate::Client {
    /// Each fairness key's share of semaphore `name` now, most waiting first (at most 20 keys;
    /// none unless it is served by key). A producer login sees its own requests' keys alone.
    pub async fn key_shares(&self, name: &str) -> Result<Vec<KeyShare>> {
        let conn = self.conn().await?;
        let rows = conn
            .query(crate::sql::KEY_SHARES, &[&name])
            .await
            .map_err(|e| self.located(e.into()))?;
        rows.iter()
            .map(|r| {
                Ok(KeyShare {
                    fairness_key: r.try_get(0)?,
                    weight: r.try_get(1)?,
                    waiting: r.try_get(2)?,
                    waiting_permits: r.try_get(3)?,
                    held: r.try_get(4)?,
                })
            })
            .collect()
    }
}
