//! Adaptive capacity: the algorithms (pure functions of one cadence's reports) and the
//! workers' cadence that applies them (schema/functions/adaptive.sql has the protocol).
//!
//! Each cadence, for each adaptive semaphore, the reports since the last one become
//! [`Signals`], and [`next_capacity`] turns them and the semaphore's current capacity into the
//! next one, always within its floor and ceiling:
//! Requests report once per cadence each (a later report of the same request replaces its
//! earlier one unless it says less), so a holder weighs as its grants do, not as its calls.
//! - **AIMD** (additive increase, multiplicative decrease): when two reports, or a tenth of the
//!   `ok` and `overloaded` ones, say `overloaded`, the capacity goes to 90% (at least one less);
//!   otherwise, when `ok` reports outnumber `failed` ones and at least half the capacity is in
//!   use, it grows by one.
//! - **Gradient** (after Netflix's Gradient2): a long-term latency (the latency without load:
//!   down to a lower cadence's by a fifth at most, up by 1% of the difference a cadence)
//!   against this cadence's mean: up to 1.05× the long one (no queueing) the capacity grows by
//!   its square root, up to 1.2× it holds, past that it shrinks by their ratio (at most
//!   halved); smoothed (a fifth of the way a cadence); overloads lower it as AIMD does. Where
//!   latency rose last (the knee) it grows by less, down to a quarter of the step at the knee,
//!   until it is a tenth past it. A latency of 0 is no measurement.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Result;

/// How an adaptive semaphore turns its holders' reports into its capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Algorithm {
    /// Additive increase, multiplicative decrease, from `overloaded` (and `failed`) reports.
    Aimd,
    /// From latency as well: shrinks as it rises past the long-term latency.
    Gradient,
}

impl Algorithm {
    /// Its name in SQL and on the command line: `aimd`, `gradient`.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Aimd => "aimd",
            Algorithm::Gradient => "gradient",
        }
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "aimd" => Ok(Algorithm::Aimd),
            "gradient" => Ok(Algorithm::Gradient),
            other => Err(format!(
                "unknown adaptive algorithm {other:?}: use aimd (from overloaded reports) or \
                 gradient (from latency as well); to make a semaphore fixed again, `permitq \
                 semaphore set NAME CAPACITY --no-adaptive` (SQL: adaptive => 'false')"
            )),
        }
    }
}

/// How a holder's use of the resource went, as it reports it on release or while it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum Outcome {
    /// It worked.
    Ok,
    /// The resource pushed back: a 429, a timeout, a pool exhausted.
    Overloaded,
    /// It failed for another reason.
    Failed,
}

impl Outcome {
    /// Its name in SQL and on the command line: `ok`, `overloaded`, `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Overloaded => "overloaded",
            Outcome::Failed => "failed",
        }
    }
}

impl std::str::FromStr for Outcome {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "ok" => Ok(Outcome::Ok),
            "overloaded" => Ok(Outcome::Overloaded),
            "failed" => Ok(Outcome::Failed),
            other => Err(format!(
                "unknown outcome {other:?}: ok, overloaded (a 429, a timeout, a pool exhausted) \
                 or failed"
            )),
        }
    }
}

/// An adaptive semaphore's settings, as `permitq.adaptive_limit` holds them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AdaptiveLimit {
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The lowest capacity it sets.
    pub floor: i32,
    /// The highest capacity it sets.
    pub ceiling: i32,
}

impl AdaptiveLimit {
    /// Adapts by `algorithm` between `floor` and `ceiling`.
    pub fn new(algorithm: Algorithm, floor: i32, ceiling: i32) -> AdaptiveLimit {
        AdaptiveLimit {
            algorithm,
            floor,
            ceiling,
        }
    }
}

/// One cadence's reports for one semaphore, and its state when they were read.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[non_exhaustive]
pub struct Signals {
    /// `ok` reports.
    pub ok: i64,
    /// `overloaded` reports.
    pub overloaded: i64,
    /// `failed` reports.
    pub failed: i64,
    /// The 90th percentile latency of the `ok` reports that gave one, in milliseconds.
    pub latency_ms: Option<f64>,
    /// Permits held (the workers' count).
    pub used: i64,
}

/// What an algorithm keeps from one cadence to the next.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Memory {
    /// The gradient's long-term latency, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long_latency_ms: Option<f64>,
    /// The gradient's unrounded estimate of the capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<f64>,
    /// The gradient's *knee*: where it went back to when latency last rose past its tolerance
    /// (or reports said `overloaded`). It grows no further than the knee, more slowly near it;
    /// the knee rises by a tenth after eight cadences near it in a row without
    /// queueing (the resource grew).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub knee: Option<f64>,
    /// Cadences in a row near the knee without queueing.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub calm: u32,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Cadences near the knee without queueing, in a row, before the knee rises by a tenth.
pub(crate) const CALM_CADENCES: u32 = 8;

/// How far above its long-term latency a cadence's may be before the gradient lowers the
/// capacity: a little queueing is allowed, not much.
pub const TOLERANCE: f64 = 1.2;
/// Up to how far above it a cadence's counts as no queueing, where the gradient grows.
pub const QUEUEING: f64 = 1.05;

impl Signals {
    /// Whether the `overloaded` reports call for a decrease: two of them, or a tenth of the
    /// reports that speak of the load, `ok` and `overloaded` (a request reports once per
    /// cadence, so one holder's reports weigh as its grants do, and a single stray one among
    /// many does not move the capacity). `failed` reports say nothing of the load: counted
    /// here, more of them would dilute an overload and keep a capacity it should lower.
    #[must_use]
    pub fn overloaded(&self) -> bool {
        let reports = self.ok + self.overloaded;
        self.overloaded >= 2
            || (self.overloaded > 0 && self.overloaded.saturating_mul(10) >= reports)
    }
}

/// The decrease on `overloaded`: to 90%, at least one less.
fn decreased(capacity: f64) -> f64 {
    (capacity * 0.9).min(capacity - 1.0)
}

/// The gradient's target in a cadence without queueing while the capacity is in use: its
/// estimate grown by the square root of it; with a knee, by less within a quarter of it below
/// (a quarter of the step at it) and never past it. Near the knee (within a tenth), such a
/// cadence counts as calm, and [`CALM_CADENCES`] in a row raise the knee by a tenth: a resource
/// that grew is followed a tenth at a time, each step earned by calm at the last one. (A knee
/// forgotten once the estimate passed it let the estimate wander above where latency rose when
/// the calls in flight lagged the capacity: the steps out of the band.)
fn grown(estimate: f64, knee: &mut Option<f64>, calm: &mut u32) -> f64 {
    let step = estimate.sqrt();
    let Some(k) = *knee else {
        return estimate + step;
    };
    let k = if estimate >= k * 0.9 {
        *calm += 1;
        if *calm >= CALM_CADENCES {
            *calm = 0;
            *knee = Some(k * 1.1);
            k * 1.1
        } else {
            k
        }
    } else {
        k
    };
    (estimate + step * ((k - estimate) / (0.25 * k)).clamp(0.25, 1.0)).min(k.max(estimate))
}

/// The next capacity of a semaphore at `capacity` with these `signals`, within `floor` and
/// `ceiling` (a ceiling below the floor counts as the floor), and the memory for the next
/// cadence. A pure function: never above the ceiling nor below the floor; more `overloaded`
/// reports, or a higher latency, never give a higher capacity.
pub fn next_capacity(
    algorithm: Algorithm,
    signals: &Signals,
    capacity: i32,
    floor: i32,
    ceiling: i32,
    memory: Memory,
) -> (i32, Memory) {
    let floor = floor.max(1);
    let ceiling = ceiling.max(floor);
    let bound = |x: f64| x.clamp(f64::from(floor), f64::from(ceiling));
    let current = bound(f64::from(capacity));
    let in_use = signals.used.saturating_mul(2) >= i64::from(capacity);
    let (next, memory) = match algorithm {
        Algorithm::Aimd => {
            let next = if signals.overloaded() {
                decreased(current)
            } else if signals.ok > signals.failed && in_use {
                current + 1.0
            } else {
                current
            };
            (next, Memory::default())
        }
        Algorithm::Gradient => {
            // Its own estimate, unless the capacity was set by hand since.
            let own = memory.estimate.map(bound).filter(|e| e.floor() == current);
            let estimate = own.unwrap_or(current);
            // Set by hand since: its knee goes with its estimate.
            let memory = if own.is_some() {
                memory
            } else {
                Memory {
                    knee: None,
                    calm: 0,
                    ..memory
                }
            };
            let short = signals.latency_ms.filter(|l| l.is_finite() && *l > 0.0);
            let long = match (memory.long_latency_ms, short) {
                (None, s) => s,
                // The latency without load: down to a lower one (by a fifth at most a cadence,
                // so that a burst of tiny latencies does not reset it), up only slowly (1% of the
                // difference a cadence), so that latency raised by load does not become the
                // baseline.
                (Some(long), Some(s)) if s < long => Some(s.max(long * 0.8)),
                (Some(long), Some(s)) => Some(long * 0.99 + s * 0.01),
                (Some(long), None) => Some(long),
            };
            let (mut knee, mut calm) = (memory.knee, memory.calm);
            let next = if signals.overloaded() {
                // Back by a tenth, and that is the knee.
                calm = 0;
                let lower = decreased(estimate);
                knee = Some(lower);
                lower
            } else {
                match (long, short) {
                    (Some(long), Some(short)) if short > 0.0 && long > 0.0 => {
                        // No queueing: grow (up to the knee), when in use; a little: hold;
                        // more: shrink by how far past the tolerance it is (at most halved),
                        // and that is the knee.
                        let ratio = short / long;
                        let target = if ratio <= QUEUEING {
                            if in_use {
                                grown(estimate, &mut knee, &mut calm)
                            } else {
                                estimate
                            }
                        } else if ratio <= TOLERANCE {
                            calm = 0;
                            estimate
                        } else {
                            calm = 0;
                            let lower = estimate * (TOLERANCE / ratio).max(0.5);
                            knee = Some(lower);
                            lower
                        };
                        estimate * 0.8 + target * 0.2
                    }
                    _ => estimate,
                }
            };
            let next = bound(next);
            (
                next,
                Memory {
                    long_latency_ms: long,
                    estimate: Some(next),
                    knee,
                    calm,
                },
            )
        }
    };
    // Rounded down: a capacity grows once its estimate reaches the next whole permit.
    let next = bound(next).floor();
    #[allow(clippy::cast_possible_truncation)]
    let next = next as i32;
    (next, memory)
}

/// One adaptive semaphore's change in a cadence.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Adapted {
    pub name: String,
    pub from: i32,
    pub to: i32,
}

/// One cadence: takes the due adaptive semaphores and their reports, and applies each one's
/// next capacity, in one transaction. Nothing when none is due or another session has the turn.
pub(crate) async fn adapt_once(
    pool: &deadpool_postgres::Pool,
    cadence: Duration,
) -> Result<Vec<Adapted>> {
    let mut conn = pool.get().await?;
    let tx = conn.transaction().await?;
    let rows = tx
        .query(
            crate::sql::ADAPTIVE_TURN,
            &[&format!("{} milliseconds", cadence.as_millis())],
        )
        .await?;
    let mut adapted = Vec::new();
    for row in rows {
        let algorithm: String = row.try_get("algorithm")?;
        let Ok(algorithm) = algorithm.parse::<Algorithm>() else {
            continue;
        };
        let signals = Signals {
            ok: row.try_get("ok")?,
            overloaded: row.try_get("overloaded")?,
            failed: row.try_get("failed")?,
            latency_ms: row.try_get("latency_ms")?,
            used: row.try_get("used")?,
        };
        let memory: serde_json::Value = row.try_get("memory")?;
        let memory: Memory = serde_json::from_value(memory).unwrap_or_default();
        let capacity: i32 = row.try_get("capacity")?;
        let (next, memory) = next_capacity(
            algorithm,
            &signals,
            capacity,
            row.try_get("floor")?,
            row.try_get("ceiling")?,
            memory,
        );
        let inputs = serde_json::json!({
            "ok": signals.ok,
            "overloaded": signals.overloaded,
            "failed": signals.failed,
            "latency_ms": signals.latency_ms,
            "used": signals.used,
            "long_latency_ms": memory.long_latency_ms,
        });
        let set: Option<i32> = tx
            .query_one(
                crate::sql::ADAPTIVE_APPLY,
                &[
                    &row.try_get::<_, i64>("semaphore_id")?,
                    &next,
                    &serde_json::to_value(memory).unwrap_or_default(),
                    &inputs,
                ],
            )
            .await?
            .try_get(0)?;
        if let Some(to) = set.filter(|to| *to != capacity) {
            adapted.push(Adapted {
                name: row.try_get("name")?,
                from: capacity,
                to,
            });
        }
    }
    tx.commit().await?;
    Ok(adapted)
}

impl crate::Client {
    /// Makes `name` adaptive (`Some`): from now on the workers set its capacity from its
    /// holders' reports, within the limit's floor and ceiling (the capacity is brought within
    /// them at once); or fixed again at its current capacity (`None`). Admins only; not for
    /// templates, instances or rate limits.
    pub async fn set_adaptive(
        &self,
        name: &str,
        limit: Option<&AdaptiveLimit>,
    ) -> Result<Option<AdaptiveLimit>> {
        let conn = self.conn().await?;
        let rows = conn
            .query(
                crate::sql::SET_ADAPTIVE,
                &[
                    &name,
                    &limit.map(|l| l.algorithm.as_str()),
                    &limit.map(|l| l.floor),
                    &limit.map(|l| l.ceiling),
                ],
            )
            .await
            .map_err(|e| self.located(e.into()))?;
        rows.first().map(limit_from_row).transpose()
    }

    /// The adaptive settings of `name`; `None` when its capacity is fixed (or it does not exist).
    pub async fn adaptive(&self, name: &str) -> Result<Option<AdaptiveLimit>> {
        let conn = self.conn().await?;
        let rows = conn
            .query(crate::sql::ADAPTIVE_OF, &[&name])
            .await
            .map_err(|e| self.located(e.into()))?;
        rows.first().map(limit_from_row).transpose()
    }

    /// What the last cadence with reports on `name` counted, as JSON: `ok`, `overloaded`,
    /// `failed`, `latency_ms`, `used`, `at` (and `ago_s`), and the capacity `from` and `to` (the same when it
    /// kept it, which writes no audit row). `None` before any, or when it does not adapt.
    pub async fn last_adaptive_reports(&self, name: &str) -> Result<Option<serde_json::Value>> {
        let conn = self.conn().await?;
        let rows = conn
            .query(crate::sql::ADAPTIVE_LAST_REPORTS, &[&name])
            .await
            .map_err(|e| self.located(e.into()))?;
        Ok(rows.first().and_then(|r| r.get(0)))
    }

    /// Releases as [`crate::Client::release`] does, and reports how the holder's use went for
    /// the adaptive semaphores it held (`latency`: how long its calls took, if measured). A
    /// repeated release reports nothing again.
    pub async fn release_reporting(
        &self,
        external_id: &str,
        outcome: Outcome,
        latency: Option<Duration>,
    ) -> Result<crate::ReleaseOutcome> {
        let conn = self.conn().await?;
        let text: String = conn
            .query_one(
                crate::sql::RELEASE_REPORTING,
                &[
                    &external_id,
                    &outcome.as_str(),
                    &latency.map(crate::sql::interval),
                ],
            )
            .await
            .map_err(|e| self.located(e.into()))?
            .get(0);
        Ok(text.parse()?)
    }

    /// Reports how the holder's use went so far, while it still holds. Whether the report was
    /// kept: `false` when no request has the id, when it is not held (waiting, or ended), or when
    /// none of the semaphores it holds is adaptive.
    pub async fn report(
        &self,
        external_id: &str,
        outcome: Outcome,
        latency: Option<Duration>,
    ) -> Result<bool> {
        let conn = self.conn().await?;
        Ok(conn
            .query_one(
                crate::sql::REPORT,
                &[
                    &external_id,
                    &outcome.as_str(),
                    &latency.map(crate::sql::interval),
                ],
            )
            .await
            .map_err(|e| self.located(e.into()))?
            .get(0))
    }
}

fn limit_from_row(row: &tokio_postgres::Row) -> Result<AdaptiveLimit> {
    let algorithm: String = row.try_get(0)?;
    Ok(AdaptiveLimit {
        algorithm: algorithm
            .parse()
            .map_err(|e: String| crate::Error::invalid("algorithm", e))?,
        floor: row.try_get(1)?,
        ceiling: row.try_get(2)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn signals(ok: i64, overloaded: i64, latency_ms: Option<f64>, used: i64) -> Signals {
        Signals {
            ok,
            overloaded,
            failed: 0,
            latency_ms,
            used,
        }
    }

    #[test]
    fn aimd_grows_by_one_in_use_and_backs_off_on_overload() {
        let m = Memory::default();
        let aimd = |s: &Signals, c| next_capacity(Algorithm::Aimd, s, c, 2, 50, m).0;
        assert_eq!(aimd(&signals(10, 0, None, 8), 10), 11);
        assert_eq!(aimd(&signals(10, 0, None, 2), 10), 10, "idle: no growth");
        assert_eq!(aimd(&signals(9, 1, None, 10), 10), 9, "a tenth overloaded");
        assert_eq!(
            aimd(&signals(10, 1, None, 10), 10),
            11,
            "one, under a tenth: not"
        );
        assert_eq!(aimd(&signals(100, 2, None, 10), 10), 9, "two: yes");
        assert_eq!(aimd(&signals(0, 1, None, 40), 40), 36);
        assert_eq!(
            aimd(&signals(0, 0, None, 0), 10),
            10,
            "no reports: unchanged"
        );
        assert_eq!(aimd(&signals(0, 5, None, 2), 2), 2, "never below the floor");
        assert_eq!(
            aimd(&signals(9, 0, None, 50), 50),
            50,
            "never above the ceiling"
        );
        let failing = Signals {
            failed: 10,
            ..signals(3, 0, None, 10)
        };
        assert_eq!(aimd(&failing, 10), 10, "failures hold it");
    }

    #[test]
    fn gradient_grows_while_latency_holds_and_shrinks_as_it_rises() {
        let mut memory = Memory::default();
        let mut capacity = 4;
        for _ in 0..20 {
            (capacity, memory) = next_capacity(
                Algorithm::Gradient,
                &signals(20, 0, Some(10.0), i64::from(capacity)),
                capacity,
                2,
                100,
                memory,
            );
        }
        assert!(capacity > 10, "it grew: {capacity}");
        let before = capacity;
        for _ in 0..10 {
            (capacity, memory) = next_capacity(
                Algorithm::Gradient,
                &signals(20, 0, Some(60.0), i64::from(capacity)),
                capacity,
                2,
                100,
                memory,
            );
        }
        assert!(
            capacity < before,
            "latency 6x: it shrank from {before} to {capacity}"
        );
    }

    #[test]
    fn gradient_stops_at_the_knee_and_raises_it_after_calm_there() {
        // Latency rose where it went back to 20: the knee. Growing again from 16 without
        // queueing, it takes smaller steps near 20 than it did far below it, and stops there
        // until enough calm cadences there raise the knee by a tenth.
        let at = |estimate: f64, knee: Option<f64>, calm: u32| Memory {
            long_latency_ms: Some(10.0),
            estimate: Some(estimate),
            knee,
            calm,
        };
        let calm_cadence = |memory: Memory| {
            #[allow(clippy::cast_possible_truncation)]
            let capacity = memory.estimate.unwrap().floor() as i32;
            next_capacity(
                Algorithm::Gradient,
                &signals(20, 0, Some(10.0), i64::from(capacity)),
                capacity,
                1,
                100,
                memory,
            )
            .1
        };
        let growth = |m: Memory| calm_cadence(m).estimate.unwrap() - m.estimate.unwrap();
        let free = growth(at(17.0, None, 0));
        let near = growth(at(19.0, Some(20.0), 0));
        assert!(
            near < free * 0.5,
            "near the knee {near}, without one {free}"
        );
        assert!(
            (growth(at(10.0, Some(20.0), 0)) - growth(at(10.0, None, 0))).abs() < 1e-9,
            "far below: whole growth"
        );
        // At the knee: no further, however many calm cadences, until the last of them.
        let mut memory = at(20.0, Some(20.0), 0);
        for n in 1..CALM_CADENCES {
            memory = calm_cadence(memory);
            assert!(memory.estimate.unwrap() <= 20.0, "{memory:?}");
            assert_eq!((memory.knee, memory.calm), (Some(20.0), n));
        }
        memory = calm_cadence(memory);
        assert!(
            (memory.knee.unwrap() - 22.0).abs() < 1e-9,
            "raised by a tenth: {memory:?}"
        );
        assert_eq!(memory.calm, 0);
        assert!(memory.estimate.unwrap() > 20.0);
        // A cadence with a little queueing breaks the run of calm ones.
        let (_, held) = next_capacity(
            Algorithm::Gradient,
            &signals(20, 0, Some(11.5), 20),
            20,
            1,
            100,
            at(20.0, Some(20.0), 5),
        );
        assert_eq!((held.knee, held.calm), (Some(20.0), 0));
        // Latency past the tolerance: back by how far past it is, and that is the knee.
        let (_, memory) = next_capacity(
            Algorithm::Gradient,
            &signals(20, 0, Some(15.0), 30),
            30,
            1,
            100,
            at(30.5, None, 0),
        );
        // (The ratio is to the long-term latency after this cadence's 1% moved it: 10.05.)
        assert!(
            (memory.knee.unwrap() - 30.5 * 1.2 / (15.0 / 10.05)).abs() < 1e-9,
            "{memory:?}"
        );
        // Overloaded: back by a tenth, the knee there.
        let (_, memory) = next_capacity(
            Algorithm::Gradient,
            &signals(20, 5, Some(10.0), 30),
            30,
            1,
            100,
            at(30.0, None, 0),
        );
        assert!((memory.knee.unwrap() - 27.0).abs() < 1e-9, "{memory:?}");
        // A capacity set by hand since drops the knee with the estimate.
        let (_, memory) = next_capacity(
            Algorithm::Gradient,
            &signals(20, 0, Some(10.0), 40),
            40,
            1,
            100,
            at(20.0, Some(20.0), 3),
        );
        assert_eq!((memory.knee, memory.calm), (None, 0));
    }

    fn any_algorithm() -> impl Strategy<Value = Algorithm> {
        prop_oneof![Just(Algorithm::Aimd), Just(Algorithm::Gradient)]
    }

    fn any_memory() -> impl Strategy<Value = Memory> {
        (
            proptest::option::of(0.1f64..1000.0),
            proptest::option::of(0.0f64..200.0),
            proptest::option::of(0.0f64..200.0),
            0..CALM_CADENCES + 2,
        )
            .prop_map(|(long_latency_ms, estimate, knee, calm)| Memory {
                long_latency_ms,
                estimate,
                knee,
                calm,
            })
    }

    proptest! {
        #[test]
        fn within_its_floor_and_ceiling(
            algorithm in any_algorithm(),
            (ok, overloaded, failed, used) in (0i64..1000, 0i64..10, 0i64..100, 0i64..300),
            latency in proptest::option::of(0.0f64..10_000.0),
            capacity in 0i32..300,
            (floor, span) in (1i32..100, 0i32..100),
            memory in any_memory(),
        ) {
            let s = Signals { ok, overloaded, failed, latency_ms: latency, used };
            let (next, _) = next_capacity(algorithm, &s, capacity, floor, floor + span, memory);
            prop_assert!((floor..=floor + span).contains(&next), "{next} outside {floor}..={}", floor + span);
        }

        #[test]
        fn more_overloads_or_more_latency_never_raise_it(
            algorithm in any_algorithm(),
            // Few reports as often as many: where one `overloaded` is a tenth of them.
            (ok, overloaded, used) in (prop_oneof![0i64..20, 0i64..1000], 0i64..10, 0i64..300),
            (latency, more_latency) in (0.1f64..1000.0, 0.0f64..1000.0),
            extra in 1i64..10,
            capacity in 1i32..200,
            memory in any_memory(),
        ) {
            let at = |overloaded, latency| {
                next_capacity(algorithm, &signals(ok, overloaded, Some(latency), used), capacity, 1, 200, memory).0
            };
            prop_assert!(at(overloaded + extra, latency) <= at(overloaded, latency));
            prop_assert!(at(overloaded, latency + more_latency) <= at(overloaded, latency));
        }

        #[test]
        fn more_failed_reports_never_raise_it(
            algorithm in any_algorithm(),
            // Few reports as often as many: where one `overloaded` is a tenth of them.
            (ok, overloaded, failed, used) in (prop_oneof![0i64..20, 0i64..1000], 0i64..4, 0i64..20, 0i64..300),
            latency in 0.1f64..1000.0,
            extra in 1i64..20,
            capacity in 1i32..200,
            memory in any_memory(),
        ) {
            let at = |failed| {
                let s = Signals { failed, ..signals(ok, overloaded, Some(latency), used) };
                next_capacity(algorithm, &s, capacity, 1, 200, memory).0
            };
            prop_assert!(at(failed + extra) <= at(failed));
        }
    }
}
