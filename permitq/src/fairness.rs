//! Fairness keys: what operators read of a semaphore served by key (the protocol is in
//! schema/functions/fairness.sql; the switch is [`crate::SemaphoreSettings::fairness_keys`]).

use serde::Serialize;

use crate::error::Result;

/// One fairness key's share of a semaphore served by key (a row of `permitq.key_shares`).
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct KeyShare {
    /// The key (`""`: the requests that name none, which share the line as one key).
    pub fairness_key: String,
    /// Its weight: the largest its waiting requests asked (its holders', when none waits; 1
    /// when none asked one, or when it is listed for its turns alone: nothing waiting or held,
    /// `placed_back` set).
    pub weight: i32,
    /// Its requests waiting in line, and the permits they ask.
    pub waiting: i64,
    /// The permits its waiting requests ask.
    pub waiting_permits: i64,
    /// The permits its requests hold now.
    pub held: i64,
    /// While it waits: its share of the turns to come while the keys shown wait, in percent to a
    /// tenth, each rounded on its own (in proportion to the weights of the keys shown that wait:
    /// equal weights, equal shares; they add up to 100 within the rounding). Requests already
    /// placed keep their places: a key whose requests were placed earlier is served those first
    /// (see `placed_back`). `None` for a login that reads only its own requests: it sees its own
    /// keys alone.
    pub share_percent: Option<f64>,
    /// How far back a request of this key arriving now would be placed: the turns its requests
    /// have taken that the line has not passed yet (`None`: none, it would be placed at its
    /// arrival). While it is set, the key is served behind what the shares alone suggest.
    /// Seconds in JSON.
    #[serde(serialize_with = "crate::types::ser_secs")]
    pub placed_back: Option<std::time::Duration>,
}

/// A fairness key as the answers show it (the rule of the SQL `permitq.shown_key`): as it is
/// when it cannot be mistaken for another (printable ASCII words apart by single spaces), else
/// quoted as a JSON string. Keys are compared exactly: `acme ` is not `acme`.
#[must_use]
pub fn shown_key(key: &str) -> String {
    let plain = key
        .split(' ')
        .all(|word| !word.is_empty() && word.chars().all(|c| c.is_ascii_graphic()));
    if plain {
        key.to_string()
    } else {
        serde_json::Value::from(key).to_string()
    }
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
        let mut keys = rows
            .iter()
            .map(|r| {
                Ok(KeyShare {
                    fairness_key: r.try_get(0)?,
                    weight: r.try_get(1)?,
                    waiting: r.try_get(2)?,
                    waiting_permits: r.try_get(3)?,
                    held: r.try_get(4)?,
                    share_percent: None,
                    placed_back: r
                        .try_get::<_, Option<f64>>(5)?
                        .map(|s| std::time::Duration::from_secs_f64(s.max(0.0))),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let weights: Vec<i64> = keys
            .iter()
            .map(|k| {
                if k.waiting > 0 {
                    i64::from(k.weight)
                } else {
                    0
                }
            })
            .collect();
        // A producer sees its own keys alone: a share among them would mislead.
        let every_key = self.reads_every_request().await?;
        for (k, share) in keys.iter_mut().zip(percent_shares(&weights)) {
            k.share_percent = (every_key && k.waiting > 0).then_some(share);
        }
        Ok(keys)
    }
}

/// Percentages to a tenth in proportion to `weights`, each rounded on its own, so that equal
/// weights show equal shares (all 0 when every weight is 0). (Whole percentages forced to add up
/// to 100 showed two keys of equal weight as 9% and 8%.)
fn percent_shares(weights: &[i64]) -> Vec<f64> {
    let total: i64 = weights.iter().sum();
    if total <= 0 {
        return vec![0.0; weights.len()];
    }
    weights
        .iter()
        // Tenths of a percent, rounded half up, in whole numbers: exact.
        .map(|w| ((w * 2000 / total + 1) / 2) as f64 / 10.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::percent_shares;

    #[test]
    fn key_shares_are_in_proportion_to_the_weights_equal_for_equal_weights() {
        assert_eq!(percent_shares(&[1, 1, 1]), vec![33.3, 33.3, 33.3]);
        assert_eq!(percent_shares(&[1, 2]), vec![33.3, 66.7]);
        assert_eq!(percent_shares(&[1, 0, 3]), vec![25.0, 0.0, 75.0]);
        assert_eq!(percent_shares(&[1, 1, 10]), vec![8.3, 8.3, 83.3]);
        assert_eq!(percent_shares(&[0, 0]), vec![0.0, 0.0]);
        assert_eq!(percent_shares(&[]), Vec::<f64>::new());
        for weights in [
            vec![7, 3, 1, 1, 1],
            vec![1; 20],
            vec![1000, 1, 1],
            vec![1; 6],
        ] {
            let shares = percent_shares(&weights);
            let sum: f64 = shares.iter().sum();
            assert!(
                (sum - 100.0).abs() <= 0.05 * weights.len() as f64,
                "{weights:?}: {shares:?}"
            );
            let total: i64 = weights.iter().sum();
            for (w, s) in weights.iter().zip(&shares) {
                assert!(
                    (s - (w * 100) as f64 / total as f64).abs() <= 0.05 + 1e-9,
                    "{weights:?}: {shares:?}"
                );
            }
            for (a, b) in weights.iter().zip(&shares) {
                for (c, d) in weights.iter().zip(&shares) {
                    assert!(a != c || b == d, "{weights:?}: {shares:?}");
                }
            }
        }
    }
}
