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
    /// While it waits: its share of the grants while the keys shown wait, in whole percent (in
    /// proportion to the weights of the keys shown that wait; these add up to 100). `None` for a
    /// login that reads only its own requests: it sees its own keys alone.
    pub share_percent: Option<i64>,
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

/// Whole percentages in proportion to `weights` that add up to 100 (largest remainder first,
/// among equals the first; all 0 when every weight is 0): rounded each on its own, three equal
/// keys showed 33% each (99%), and six equal keys 17% each (102%).
fn percent_shares(weights: &[i64]) -> Vec<i64> {
    let total: i64 = weights.iter().sum();
    if total <= 0 {
        return vec![0; weights.len()];
    }
    let mut shares: Vec<i64> = weights.iter().map(|w| w * 100 / total).collect();
    let mut by_remainder: Vec<usize> = (0..weights.len()).collect();
    by_remainder.sort_by_key(|&i| (std::cmp::Reverse(weights[i] * 100 % total), i));
    let short = 100 - shares.iter().sum::<i64>();
    for &i in by_remainder
        .iter()
        .take(usize::try_from(short).unwrap_or(0))
    {
        shares[i] += 1;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::percent_shares;

    #[test]
    fn key_shares_add_up_to_a_hundred_in_proportion_to_the_weights() {
        assert_eq!(percent_shares(&[1, 1, 1]), vec![34, 33, 33]);
        assert_eq!(percent_shares(&[1, 2]), vec![33, 67]);
        assert_eq!(percent_shares(&[1, 0, 3]), vec![25, 0, 75]);
        assert_eq!(percent_shares(&[0, 0]), vec![0, 0]);
        assert_eq!(percent_shares(&[]), Vec::<i64>::new());
        for weights in [vec![7, 3, 1, 1, 1], vec![1; 20], vec![1000, 1, 1]] {
            let shares = percent_shares(&weights);
            assert_eq!(shares.iter().sum::<i64>(), 100, "{weights:?}: {shares:?}");
            let total: i64 = weights.iter().sum();
            for (w, s) in weights.iter().zip(&shares) {
                assert!(
                    (s * total - w * 100).abs() < total,
                    "{weights:?}: {shares:?}"
                );
            }
        }
    }
}
