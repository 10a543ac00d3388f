//! How a request ended, in words: [`ErrorDetail`] (the `error_detail` column) and
//! [`PermitRequest::outcome`], the one rendering the CLI, the status page and `explain` share.

use serde::{Deserialize, Serialize};

use crate::types::{ErrorCode, PermitRequest, ReleaseReason, State};

/// What an errored request hit, stored beside its [`ErrorCode`] (`permit_request.error_detail`,
/// a JSON object). Each field is set where it applies to the code:
///
/// | code | fields |
/// |---|---|
/// | `unknown_semaphore` | `semaphore` (the name not found), `named` (when it is a missing parent of that one), `similar` |
/// | `exceeds_capacity` | `semaphore`, `count`, `capacity`, `named` (when the bound is a parent's), `per` (a rate limit's window), `adaptive` (its bounds, when the workers move its capacity), `lowered_from`, `lowered_by`, `lowered_at_ms` (its last change lowered it below the count) |
/// | `no_capacity` | `semaphore`, `count`, `capacity`, `free`, `named`, `per`; `turn_kept_on` |
/// | `too_many_instances` | `semaphore`, `template`, `capacity` (the template's), `max_instances`, `instances`, `new_instances`, `idle_instances`, `parent`, `guarantee` and `parent_needs` (nested) |
/// | `invalid` | `problem` |
/// | `timeout` | `semaphore`, `count`, `capacity`, `free` where it had no room; `turn_kept_on` |
/// | `cancelled` | `revoked_by` (an admin's revoke); `turn_kept_on` |
/// | (a release `stale`) | `max_hold_ms` |
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct ErrorDetail {
    /// The semaphore whose bound the request hit, or the name that was not found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub semaphore: Option<String>,
    /// When `semaphore` is an ancestor (nested limits): the semaphore the request named below it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub named: Option<String>,
    /// What the request takes from `semaphore`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<i64>,
    /// The capacity of `semaphore` when the request was decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity: Option<i64>,
    /// The room free on `semaphore` when the request was decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free: Option<i64>,
    /// When `semaphore` is a rate limit: its window (`1m`), and `capacity` is grants in it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per: Option<String>,
    /// The template that could not make `semaphore`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// That template's bound on its instances.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_instances: Option<i64>,
    /// How many instances that template has (more than `max_instances` after the bound was
    /// lowered below them: they stay until deleted or idle).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instances: Option<i64>,
    /// How many instances of that template the request names that it did not have yet, when
    /// more than one (together they pass the bound); absent: one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_instances: Option<i64>,
    /// That template's parent, when its instances are nested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// What each of its instances is guaranteed of `parent`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guarantee: Option<i64>,
    /// The template's instances that hold nothing and have no waiters (at most 3): deleting one
    /// makes room for a new instance.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub idle_instances: Vec<String>,
    /// The capacity `parent` would need for one more guaranteed instance, when it has less.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_needs: Option<i64>,
    /// Existing semaphores or templates whose names are nearest the one not found.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub similar: Vec<String>,
    /// When `semaphore` is adaptive (an `exceeds_capacity`): its bounds, since its capacity
    /// moves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub adaptive: Option<AdaptiveBound>,
    /// Why a stored row could not be decided.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The admin login whose `permitq revoke` ended it: for `cancelled`, while it waited; for a
    /// release `revoked`, while it held (none: its owner cancelled it, or an owner-liveness
    /// sweep revoked it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub revoked_by: Option<String>,
    /// For `exceeds_capacity`: the capacity `semaphore` had before its last change lowered it
    /// below the count (by hand, not by the adaptive workers: `adaptive` says theirs), who
    /// lowered it, and when (ms since the epoch): a request that waited sees why it now fails.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lowered_from: Option<i64>,
    /// Who lowered it (with `lowered_from`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lowered_by: Option<String>,
    /// When it was lowered, in ms since the epoch (with `lowered_from`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lowered_at_ms: Option<i64>,
    /// For a release `stale`: the `--max-hold` it was held past, in milliseconds (the worker's
    /// whose sweep released it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_hold_ms: Option<i64>,
    /// For `cancelled` and `timeout`: the semaphores served by fairness key where it had taken
    /// its key's turn. That turn stays taken until the line passes it, so its key's next
    /// request there is placed behind it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub turn_kept_on: Vec<String>,
}

/// An adaptive semaphore's bounds in an [`ErrorDetail`]: the workers move its capacity between
/// `floor` and `ceiling`, so a request above `floor` may end in `exceeds_capacity` after a
/// back-off.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct AdaptiveBound {
    /// Its algorithm (`aimd`, `gradient`).
    pub algorithm: String,
    /// The lowest capacity the workers set: a request of at most this always fits.
    pub floor: i64,
    /// The highest capacity the workers set.
    pub ceiling: i64,
    /// The capacity the workers backed it off from, when theirs was its last change.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub from: Option<i64>,
}

impl ErrorDetail {
    /// Reads the stored JSON; anything unreadable is no detail.
    pub(crate) fn from_json(value: Option<serde_json::Value>) -> Option<ErrorDetail> {
        value.and_then(|v| serde_json::from_value(v).ok())
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        *self == ErrorDetail::default()
    }

    /// For a request that stopped waiting with fairness key `fairness_key`, what it still costs
    /// its key, as words that continue a sentence: `; its turn on gpu stays taken ...` (empty
    /// where it took no turn: [`ErrorDetail::turn_kept_on`]).
    pub fn turn_kept_words(&self, fairness_key: Option<&str>) -> String {
        turn_kept(&self.turn_kept_on, fairness_key)
    }
}

impl PermitRequest {
    /// How the request ended, in one line, with what to do about it for an error:
    /// `error exceeds_capacity: gpu=5 but gpu has capacity 4; ...`, `released (expired)`,
    /// `acquired`. `None` while it waits.
    pub fn outcome(&self) -> Option<String> {
        match self.state {
            State::New | State::InProgress => None,
            State::Acquired => Some("acquired".to_string()),
            State::Released => Some(match self.release_reason {
                // Who ended it, when it was not its holder.
                Some(ReleaseReason::Expired) => {
                    "released (expired): its lease ran out with no heartbeat in time".to_string()
                }
                Some(ReleaseReason::Stale) => format!(
                    "released (stale): held longer than the workers' --max-hold{}",
                    self.error_detail
                        .as_ref()
                        .and_then(|d| d.max_hold_ms)
                        .and_then(|ms| u64::try_from(ms).ok())
                        .map_or(String::new(), |ms| format!(
                            " ({})",
                            humantime::format_duration(std::time::Duration::from_millis(ms))
                        ))
                ),
                Some(ReleaseReason::Revoked) => match self
                    .error_detail
                    .as_ref()
                    .and_then(|d| d.revoked_by.as_ref())
                {
                    Some(admin) => {
                        format!("released (revoked): {admin} took it back (`permitq revoke`)")
                    }
                    None => "released (revoked): an admin took it back (`permitq revoke`), or a \
                             worker embedded in an application found its owner gone (the Rust \
                             library's `permitq::OwnerLiveness`)"
                        .to_string(),
                },
                Some(ReleaseReason::Released) => "released (by its holder)".to_string(),
                None => "released".to_string(),
            }),
            State::Error => Some(match self.error_code {
                Some(code) => format!("error {code}: {}", self.error_explained(code)),
                None => "error".to_string(),
            }),
        }
    }

    /// Why it failed with `code`, from its `error_detail`, and what to do next.
    fn error_explained(&self, code: ErrorCode) -> String {
        let d = self.error_detail.clone().unwrap_or_default();
        let name = d.semaphore.clone().unwrap_or_else(|| "?".to_string());
        // `named=N`, as the request asked.
        let asked = |named: &str| match self.permits.get(named) {
            Some(count) => format!("{named}={count}"),
            None => named.to_string(),
        };
        // Where it found no room: `gpu=2, 0 of 4 free` (or a rate window's grants left),
        // `, kept for requests ahead in line` when there was room enough for it.
        let no_room = |name: &String| {
            let (count, free) = (d.count.unwrap_or(0), d.free.unwrap_or(0));
            let capacity = d.capacity.unwrap_or(0);
            let at = match &d.named {
                Some(named) => format!("{} takes {count} from its parent {name}", asked(named)),
                None => format!("{name}={count}"),
            };
            let left = match &d.per {
                Some(per) => format!("{free} of {capacity} grants left in its {per} rate window"),
                None => format!("{free} of {capacity} free"),
            };
            if free >= count {
                format!("{at}, {left}, kept for requests ahead in line")
            } else {
                format!("{at}, {left}")
            }
        };
        match code {
            ErrorCode::UnknownSemaphore if d.named.is_none() && name.ends_with('*') => format!(
                "{name} is a template, which is never granted itself: name an instance of it \
                 ({}NAME, made at its first grant), under a new external_id",
                name.trim_end_matches('*')
            ),
            ErrorCode::UnknownSemaphore => {
                let what = match &d.named {
                    Some(named) => format!("{named}'s parent {name} does not exist"),
                    None => format!("no semaphore named {name}, and no template matches it"),
                };
                match d.similar.as_slice() {
                    [] => format!(
                        "{what}; create it with `permitq semaphore set {} CAPACITY` (or a \
                         template NAME* that matches it), then submit again under a new \
                         external_id",
                        shell_word(&name)
                    ),
                    similar => format!(
                        "{what}; did you mean {}? (submit again under a new external_id; or, if \
                         {name} is a new one, create it first: `permitq semaphore set {} \
                         CAPACITY`)",
                        similar.join(" or "),
                        shell_word(&name)
                    ),
                }
            }
            ErrorCode::ExceedsCapacity => {
                let (count, capacity) = (d.count.unwrap_or(0), d.capacity.unwrap_or(0));
                // At a parent, what the request takes there may be more than `named` asks (the
                // parent itself, or other children, named too): then it is the sum.
                let in_all = d
                    .named
                    .as_ref()
                    .is_some_and(|named| self.permits.get(named).copied() != Some(count));
                let at = match &d.named {
                    Some(named) if in_all => format!(
                        "with {}, the request takes {count} in all from {name} (what it asks \
                         there and below it), which",
                        asked(named)
                    ),
                    Some(named) => {
                        format!(
                            "{} takes {count} from its parent {name}, which",
                            asked(named)
                        )
                    }
                    None => format!("{name}={count} but {name}"),
                };
                let bound = match &d.per {
                    Some(per) => format!("allows {capacity} grants per {per}"),
                    None => format!("has capacity {capacity}"),
                };
                // Lowered below it: by whom, and whether while the request waited.
                let bound = match (d.lowered_from, &d.lowered_by, d.lowered_at_ms) {
                    (Some(from), Some(by), Some(at_ms)) => {
                        let at = u64::try_from(at_ms)
                            .ok()
                            .map(|ms| std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms));
                        let while_waiting = at
                            .zip(self.created_at)
                            .is_some_and(|(at, created)| at > created);
                        format!(
                            "{bound} (lowered from {from} by {by}{}{})",
                            at.map_or(String::new(), |at| format!(
                                " at {}",
                                humantime::format_rfc3339_seconds(at)
                            )),
                            if while_waiting {
                                ", after this request was submitted"
                            } else {
                                ""
                            }
                        )
                    }
                    _ => bound,
                };
                // An instance's capacity is set on its template (a change there reaches it).
                let set = match &d.template {
                    Some(template) if d.named.is_none() => format!("'{template}'"),
                    _ => name.clone(),
                };
                if let Some(adaptive) = &d.adaptive {
                    return adaptive_exceeded(&at, &name, count, capacity, adaptive);
                }
                let ask = match (capacity > 0, in_all) {
                    (true, true) => format!("ask for at most {capacity} there in all, or "),
                    (true, false) => format!("ask for at most {capacity}, or "),
                    (false, _) => String::new(),
                };
                format!(
                    "{at} {bound}: it can never be granted; {ask}raise the capacity (`permitq \
                     semaphore set {set} {count}`); then submit again under a new external_id"
                )
            }
            ErrorCode::NoCapacity => format!(
                "{}; it was submitted to fail fast (wait 0): submit again, under a new \
                 external_id, with a longer --wait to queue{}",
                no_room(&name),
                turn_kept(&d.turn_kept_on, self.fairness_key.as_deref())
            ),
            ErrorCode::Timeout => {
                let within = self.wait.map_or(String::new(), |wait| {
                    format!(" of {}", humantime::format_duration(wait))
                });
                let why = if d.semaphore.is_some() {
                    // Room kept for the line: the waiters ahead held it, not the holders.
                    let lists = if d.free.unwrap_or(0) >= d.count.unwrap_or(0) {
                        "the waiters, in line order"
                    } else {
                        "the holders"
                    };
                    format!(
                        "when it ran out, {} (`permitq semaphore show {}` lists {lists})",
                        no_room(&name),
                        shell_word(&name)
                    )
                } else if self.examined_at.is_none() {
                    // No batch ever read it: no worker ran while it waited (the deadline sweep
                    // of one that started later ended it).
                    "no worker examined it while it waited: none was running, or none reached \
                     it in time (`permitq workers` lists those seen; `permitq worker` starts \
                     one)"
                        .to_string()
                } else {
                    "no semaphore it names was short of room when it ran out: requests ahead of \
                     it in line took the room first (a fair semaphore keeps room for the first \
                     in line; `permitq semaphore show` lists the line), or no worker was running \
                     while it waited"
                        .to_string()
                };
                format!(
                    "not granted within its wait{within}: {why}; submit again under a new \
                     external_id, with a longer --wait{}",
                    turn_kept(&d.turn_kept_on, self.fairness_key.as_deref())
                )
            }
            ErrorCode::Cancelled => match &d.revoked_by {
                Some(admin) => format!(
                    "revoked by {admin} (`permitq revoke`) while it was still waiting; submit \
                     again under a new external_id if it is still wanted{}",
                    turn_kept(&d.turn_kept_on, self.fairness_key.as_deref())
                ),
                None => format!(
                    "released while it was still waiting{}",
                    turn_kept(&d.turn_kept_on, self.fairness_key.as_deref())
                ),
            },
            ErrorCode::TooManyInstances => match (&d.template, d.max_instances) {
                (Some(template), Some(bound)) => too_many_instances(&name, template, bound, &d),
                _ => format!("{name} would be one instance too many of its template"),
            },
            ErrorCode::Invalid => format!(
                "the stored row cannot be decided: {}",
                d.problem.as_deref().unwrap_or("written around the checks")
            ),
        }
    }
}

/// What a request that stopped waiting still costs its fairness key `key`: the turn it took on
/// the semaphores served by key `on` (empty: none), in words that continue a sentence.
fn turn_kept(on: &[String], key: Option<&str>) -> String {
    if on.is_empty() {
        return String::new();
    }
    // Quoted where it could be mistaken for another key, as the answers show keys.
    let key = key.map_or(
        " (it has none: the requests without one share one key)".to_string(),
        |k| format!(" {}", crate::fairness::shown_key(k)),
    );
    format!(
        "; its turn on {} stays taken for its fairness key{key} until the line passes it, so \
         the key's next request there is placed behind it (each try placed in line takes a turn, \
         a refused fail-fast try too; `permitq explain` of the next one says how far back it is \
         placed)",
        on.join(", ")
    )
}

/// `exceeds_capacity` on an adaptive semaphore: the workers moved its capacity (or its ceiling
/// is the bound), and what to ask for instead. `at` opens the sentence (`calls=8 but calls`).
fn adaptive_exceeded(at: &str, name: &str, count: i64, capacity: i64, a: &AdaptiveBound) -> String {
    let bounds = format!(
        "adaptive, {} from {} to {}",
        a.algorithm, a.floor, a.ceiling
    );
    if count > a.ceiling {
        return format!(
            "{at} is {bounds} (its capacity is {capacity} now): it can never be granted; ask for \
             at most {}, or raise its ceiling (`permitq semaphore set {} {capacity} \
             --adaptive {} --floor {} --ceiling {count}`); then submit again under a new \
             external_id",
            a.ceiling,
            shell_word(name),
            a.algorithm,
            a.floor
        );
    }
    // Set below its floor by hand (`semaphore set` without `--adaptive`): the next cadence
    // brings it back within its bounds, where this request fits.
    if count <= a.floor {
        return format!(
            "{at} has capacity {capacity} now, below its floor {} ({bounds}): it was set by \
             hand, and the workers bring it back within its bounds at their next cadence; \
             submit again under a new external_id (`permitq semaphore show {}` shows the \
             capacity)",
            a.floor,
            shell_word(name)
        );
    }
    let moved = match a.from {
        Some(from) => format!(
            "has capacity {capacity} now: the workers backed it off from {from} ({bounds}) on \
             its holders' reports, and it may grow back"
        ),
        None => format!("has capacity {capacity} now ({bounds}: the workers move it)"),
    };
    // A floor raised to the ceiling leaves it nothing to adapt: said.
    let fixed = if count == a.ceiling {
        format!(": with floor and ceiling equal it stays at {count}, no longer adapting")
    } else {
        String::new()
    };
    format!(
        "{at} {moved}; a request is decided against the capacity it finds, so ask for at most \
         {} (its floor, which always fits), or raise the floor (`permitq semaphore set {} \
         {count} --adaptive {} --floor {count} --ceiling {}`{fixed}); then submit again under a \
         new external_id",
        a.floor,
        shell_word(name),
        a.algorithm,
        a.ceiling
    )
}

/// The answer to `too_many_instances`: which instances could go, and what raising the bound
/// takes (a nested template's parent may have to grow first).
fn too_many_instances(name: &str, template: &str, bound: i64, d: &ErrorDetail) -> String {
    let show = format!(
        "`permitq semaphore show {}` lists them",
        shell_word(template)
    );
    let free_one = match d.idle_instances.first() {
        Some(idle) => {
            let verb = if d.idle_instances.len() == 1 {
                "holds"
            } else {
                "hold"
            };
            format!(
                "{} {verb} nothing: delete one (`permitq semaphore delete {}`), or let the \
                 workers remove an instance idle for --idle-instance-after (1h by default)",
                d.idle_instances.join(", "),
                shell_word(idle)
            )
        }
        None => "each holds permits or has waiters: once one is idle, delete it (`permitq \
                 semaphore delete NAME`) or the workers remove an instance idle for \
                 --idle-instance-after (1h by default)"
            .to_string(),
    };
    let capacity = d
        .capacity
        .map_or_else(|| "CAPACITY".to_string(), |c| c.to_string());
    // A bound lowered below the instances there are: one more than those it has. A request
    // naming several new ones: all of them.
    let instances = d.instances.unwrap_or(bound);
    let new = d.new_instances.unwrap_or(1).max(1);
    let raise = format!(
        "`permitq semaphore set {} {capacity} --max-instances {}`",
        shell_word(template),
        (instances + new).max(bound + 1)
    );
    let has = if instances > bound {
        format!(
            "has {instances} instances, more than its max_instances of {bound} (lowered below \
             them: they stay until deleted or idle, and no new one is made while {bound} or \
             more remain)"
        )
    } else {
        format!("has its max_instances of {bound} already")
    };
    let raise = match (&d.parent, d.guarantee, d.parent_needs) {
        (Some(parent), Some(g), Some(needs)) => format!(
            "or raise the bound: each instance is guaranteed {g} of {parent}, so {parent} needs \
             capacity {needs} first (`permitq semaphore set {} {needs}`), then {raise}",
            shell_word(parent)
        ),
        (Some(parent), Some(g), None) if g > 0 => format!(
            "or raise the bound ({raise}; each instance is guaranteed {g} of {parent}, so N × \
             {g} must fit in {parent}'s capacity beside its other children's guarantees)"
        ),
        _ => format!("or raise the bound ({raise})"),
    };
    // Room for some of the new instances it names, not for all: ask for fewer, or raise.
    if new > 1 && instances < bound {
        let fewer = bound - instances;
        return format!(
            "the request names {new} new instances of template {template}, which has {instances} \
             of its max_instances of {bound} ({show}): together they pass the bound; ask for at \
             most {fewer} new instance{} of it, {raise}; then submit again under a new \
             external_id",
            if fewer == 1 { "" } else { "s" }
        );
    }
    // A bound of 0 with no instance: nothing to delete; it makes none until raised.
    if bound == 0 && instances == 0 {
        return format!(
            "{name} would be a new instance of template {template}, whose max_instances is 0: \
             it makes no instance at all; {raise}; then submit again under a new external_id"
        );
    }
    format!(
        "{name} would be a new instance of template {template}, which {has} ({show}); \
         {free_one}; {raise}; then submit again under a new external_id"
    )
}

/// `word` (a semaphore name, an external_id) as it is typed in a shell, for the commands
/// messages suggest: as is, or in single quotes when it has other characters than ASCII
/// letters, digits and `-_.:/@` (a template's `*`, a space). The schema's
/// `permitq.shell_word` is the same rule, for the messages written there.
#[must_use]
pub fn shell_word(word: &str) -> String {
    if !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/@".contains(c))
    {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::ErrorDetail;
    use crate::types::{ErrorCode, PermitRequest, ReleaseReason, State};

    /// A request of `gpu=2` that failed `no_capacity` with `free` of 4 free.
    fn failed_fast(free: i64) -> PermitRequest {
        PermitRequest {
            id: 1,
            external_id: "r".into(),
            permits: [("gpu".to_string(), 2)].into(),
            owner: None,
            ttl: None,
            wait: Some(std::time::Duration::ZERO),
            priority: 0,
            fairness_key: None,
            fairness_weight: None,
            submitted_by: None,
            state: State::Error,
            error_code: Some(ErrorCode::NoCapacity),
            error_detail: Some(ErrorDetail {
                semaphore: Some("gpu".into()),
                count: Some(2),
                capacity: Some(4),
                free: Some(free),
                ..ErrorDetail::default()
            }),
            release_reason: None,
            fencing_token: None,
            worker_id: None,
            created_at: None,
            acquired_at: None,
            expires_at: None,
            heartbeat_at: None,
            released_at: None,
            settled_at: None,
            examined_at: None,
            decided_at: None,
        }
    }

    /// A template whose max_instances is 0 and that has no instance: nothing to delete; the
    /// answer says it makes none until the bound is raised.
    #[test]
    fn too_many_instances_of_a_template_bound_to_none_says_it_makes_none() {
        let mut r = failed_fast(0);
        r.error_code = Some(ErrorCode::TooManyInstances);
        r.permits = [("T:x".to_string(), 1)].into();
        r.error_detail = Some(ErrorDetail {
            semaphore: Some("T:x".into()),
            template: Some("T:*".into()),
            capacity: Some(1),
            max_instances: Some(0),
            instances: Some(0),
            ..ErrorDetail::default()
        });
        let said = r.outcome().unwrap();
        assert!(
            said.contains(
                "T:x would be a new instance of template T:*, whose max_instances is 0: it \
                 makes no instance at all; or raise the bound (`permitq semaphore set 'T:*' 1 \
                 --max-instances 1`)"
            ) && !said.contains("each holds permits"),
            "{said}"
        );
    }

    /// On an adaptive semaphore, an exceeds_capacity after the workers backed it off says so,
    /// that it may grow back, and to ask at most the floor; above the ceiling, to raise that.
    #[test]
    fn exceeds_capacity_on_an_adaptive_semaphore_says_the_workers_moved_it() {
        let mut r = failed_fast(0);
        r.error_code = Some(ErrorCode::ExceedsCapacity);
        r.permits = [("calls".to_string(), 8)].into();
        let adaptive = super::AdaptiveBound {
            algorithm: "aimd".into(),
            floor: 2,
            ceiling: 10,
            from: Some(8),
        };
        r.error_detail = Some(ErrorDetail {
            semaphore: Some("calls".into()),
            count: Some(8),
            capacity: Some(7),
            adaptive: Some(adaptive.clone()),
            ..ErrorDetail::default()
        });
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains(
                "calls=8 but calls has capacity 7 now: the workers backed it off from 8 \
                 (adaptive, aimd from 2 to 10) on its holders' reports, and it may grow back; \
                 a request is decided against the capacity it finds, so ask for at most 2 (its \
                 floor, which always fits), or raise the floor (`permitq semaphore set calls 8 \
                 --adaptive aimd --floor 8 --ceiling 10`)"
            ),
            "{outcome}"
        );
        assert!(!outcome.contains("never"), "{outcome}");
        // Raising the floor to the ceiling fixes it: said.
        r.permits = [("calls".to_string(), 10)].into();
        if let Some(d) = r.error_detail.as_mut() {
            d.count = Some(10);
        }
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains(
                "raise the floor (`permitq semaphore set calls 10 --adaptive aimd --floor 10 \
                 --ceiling 10`: with floor and ceiling equal it stays at 10, no longer adapting)"
            ),
            "{outcome}"
        );
        r.permits = [("calls".to_string(), 12)].into();
        r.error_detail = Some(ErrorDetail {
            semaphore: Some("calls".into()),
            count: Some(12),
            capacity: Some(7),
            adaptive: Some(super::AdaptiveBound {
                from: None,
                ..adaptive
            }),
            ..ErrorDetail::default()
        });
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains(
                "calls=12 but calls is adaptive, aimd from 2 to 10 (its capacity is 7 now): it \
                 can never be granted; ask for at most 10, or raise its ceiling (`permitq \
                 semaphore set calls 7 --adaptive aimd --floor 2 --ceiling 12`)"
            ),
            "{outcome}"
        );
        r.permits = [("calls".to_string(), 2)].into();
        r.error_detail = Some(ErrorDetail {
            semaphore: Some("calls".into()),
            count: Some(2),
            capacity: Some(1),
            adaptive: Some(super::AdaptiveBound {
                algorithm: "aimd".into(),
                floor: 2,
                ceiling: 10,
                from: None,
            }),
            ..ErrorDetail::default()
        });
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains(
                "calls=2 but calls has capacity 1 now, below its floor 2 (adaptive, aimd from 2 \
                 to 10): it was set by hand, and the workers bring it back within its bounds at \
                 their next cadence"
            ),
            "{outcome}"
        );
    }

    /// At a parent, a request that names it (or other children) too takes the sum there: said
    /// as the sum, not as the named child's.
    #[test]
    fn exceeds_capacity_at_a_parent_says_what_the_request_takes_there_in_all() {
        let mut r = failed_fast(0);
        r.error_code = Some(ErrorCode::ExceedsCapacity);
        r.permits = [("lab:x".to_string(), 6), ("accel".to_string(), 3)].into();
        r.error_detail = Some(ErrorDetail {
            semaphore: Some("accel".into()),
            named: Some("lab:x".into()),
            count: Some(9),
            capacity: Some(8),
            ..ErrorDetail::default()
        });
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains(
                "with lab:x=6, the request takes 9 in all from accel (what it asks there and \
                 below it), which has capacity 8: it can never be granted; ask for at most 8 \
                 there in all, or raise"
            ),
            "{outcome}"
        );
        // Named alone, the child's count is what it takes there.
        r.permits = [("lab:x".to_string(), 9)].into();
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains("lab:x=9 takes 9 from its parent accel, which has capacity 8"),
            "{outcome}"
        );
    }

    /// A release the holder did not make says who made it.
    #[test]
    fn a_release_not_by_its_holder_says_who_ended_it() {
        let mut r = failed_fast(0);
        r.state = State::Released;
        r.error_code = None;
        for (reason, says) in [
            (
                ReleaseReason::Stale,
                "released (stale): held longer than the workers' --max-hold",
            ),
            (
                ReleaseReason::Expired,
                "released (expired): its lease ran out",
            ),
            (ReleaseReason::Revoked, "released (revoked): an admin"),
            (ReleaseReason::Released, "released (by its holder)"),
        ] {
            r.release_reason = Some(reason);
            let outcome = r.outcome().unwrap();
            assert!(outcome.starts_with(says), "{outcome}");
        }
    }

    /// Room enough for it, from exactly enough up, was kept for requests ahead; less is not.
    #[test]
    fn no_capacity_says_when_the_room_was_kept_for_requests_ahead() {
        for free in [2, 3] {
            let outcome = failed_fast(free).outcome().unwrap();
            assert!(
                outcome.contains(&format!(
                    "{free} of 4 free, kept for requests ahead in line"
                )),
                "{outcome}"
            );
        }
        let outcome = failed_fast(1).outcome().unwrap();
        assert!(outcome.contains("gpu=2, 1 of 4 free;"), "{outcome}");
        assert!(!outcome.contains("kept for"), "{outcome}");
    }

    /// A request naming more new instances than the bound leaves is told so, and the bound
    /// that takes them all; not to delete instances that its own batch made.
    #[test]
    fn too_many_new_instances_in_one_request_say_how_many_and_the_bound_for_all() {
        let mut r = failed_fast(0);
        r.error_code = Some(ErrorCode::TooManyInstances);
        r.permits = [("q:a", 1), ("q:b", 1), ("q:c", 1)]
            .map(|(n, c)| (n.to_string(), c))
            .into();
        r.error_detail = Some(ErrorDetail {
            semaphore: Some("q:c".into()),
            template: Some("q:*".into()),
            capacity: Some(1),
            max_instances: Some(2),
            instances: Some(0),
            new_instances: Some(3),
            ..ErrorDetail::default()
        });
        let outcome = r.outcome().unwrap();
        assert!(
            outcome.contains(
                "the request names 3 new instances of template q:*, which has 0 of its \
                 max_instances of 2 (`permitq semaphore show 'q:*'` lists them): together they \
                 pass the bound; ask for at most 2 new instances of it, or raise the bound \
                 (`permitq semaphore set 'q:*' 1 --max-instances 3`)"
            ),
            "{outcome}"
        );
        assert!(!outcome.contains("delete"), "{outcome}");
    }

    /// A timeout points at what held the room: the waiters ahead when there was room enough
    /// for it, else the holders.
    #[test]
    fn a_timeout_points_at_the_waiters_when_the_room_was_kept_for_them() {
        for (free, lists) in [(3, "the waiters, in line order"), (1, "the holders")] {
            let mut r = failed_fast(free);
            r.error_code = Some(ErrorCode::Timeout);
            r.wait = Some(std::time::Duration::from_secs(1));
            let outcome = r.outcome().unwrap();
            assert!(
                outcome.contains(&format!("(`permitq semaphore show gpu` lists {lists})")),
                "{outcome}"
            );
        }
    }
}
