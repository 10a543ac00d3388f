//! `permitq semaphore show NAME`: one semaphore as text.

use std::time::SystemTime;

use crate::http::Detail;

/// How long ago `t` was, shortly (`12.3s`, `4.0m`, `2.5h`).
pub(crate) fn ago(t: Option<SystemTime>) -> String {
    let Some(secs) = t.and_then(|t| SystemTime::now().duration_since(t).ok()) else {
        return "-".to_string();
    };
    short_seconds(secs.as_secs_f64())
}

/// `s` seconds, shortly (`12.3s`, `4.0m`, `2.5h`), as `semaphore show`, `explain` and `top` say
/// a duration.
pub(crate) fn short_seconds(s: f64) -> String {
    if s < 120.0 {
        format!("{s:.1}s")
    } else if s < 7200.0 {
        format!("{:.1}m", s / 60.0)
    } else {
        format!("{:.1}h", s / 3600.0)
    }
}

/// How long until `t`, shortly (`in 12.3s`); `now` once it passed.
pub(crate) fn until(t: SystemTime) -> String {
    match t.duration_since(SystemTime::now()) {
        Ok(d) => format!("in {}", ago(SystemTime::now().checked_sub(d))),
        Err(_) => "now".to_string(),
    }
}

/// Where a semaphore comes from: `template` for a template, `from tenant:*` for an instance made
/// from one, nothing for a plain semaphore.
pub(crate) fn origin(is_template: bool, template: Option<&str>) -> Option<String> {
    match (is_template, template) {
        (true, _) => Some("template".to_string()),
        (false, Some(t)) => Some(format!("from {t}")),
        (false, None) => None,
    }
}

/// A rate-limited semaphore's window: the permits granted in it, and when a spent one opens
/// (`3 / 3 granted per 1m, window spent: opens in 41.0s`); nothing for a concurrency semaphore.
pub(crate) fn window(u: &permitq::SemaphoreUsage) -> Option<String> {
    let per = u.per?;
    let mut window = format!(
        "{} / {} granted per {}",
        u.in_window,
        u.capacity,
        humantime::format_duration(per)
    );
    if let Some(opens) = u.window_opens_at {
        window.push_str(&format!(", window spent: opens {}", until(opens)));
    }
    Some(window)
}

/// Where it is nested: `in pool, guaranteed 2` (nothing for a semaphore without a parent).
pub(crate) fn nesting(u: &permitq::SemaphoreUsage) -> Option<String> {
    let parent = u.parent.as_ref()?;
    Some(if u.guarantee > 0 {
        format!("in {parent}, guaranteed {}", u.guarantee)
    } else {
        format!("in {parent}")
    })
}

/// What kind of semaphore it is, in a few words: its [`origin`], [`nesting`] and [`window`].
pub(crate) fn kind(u: &permitq::SemaphoreUsage) -> String {
    [
        origin(u.is_template, u.template.as_deref()),
        nesting(u),
        window(u),
        u.adaptive.as_ref().map(|a| {
            format!(
                "adaptive ({}, {} to {})",
                a.algorithm.as_str(),
                a.floor,
                a.ceiling
            )
        }),
        u.fairness_keys
            .then(|| "served by fairness key".to_string()),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join("; ")
}

/// [`kind`] in the fewest words, for `top`'s narrow column: `per 1m, opens 41s`, `in gpus, 2
/// guaranteed`, `instance` (the use column shows a rate limit's grants in its window).
pub(crate) fn short_kind(u: &permitq::SemaphoreUsage) -> String {
    let origin = if u.is_template {
        Some("template".to_string())
    } else {
        u.template.as_ref().map(|_| "instance".to_string())
    };
    let nesting = u.parent.as_ref().map(|parent| {
        if u.guarantee > 0 {
            format!("in {parent}, {} guaranteed", u.guarantee)
        } else {
            format!("in {parent}")
        }
    });
    let window = u.per.map(|per| {
        let mut w = format!("per {}", humantime::format_duration(per));
        // As explain and semaphore show say it (`opens in 4.8s`), not cut to whole seconds.
        if let Some(opens) = u.window_opens_at {
            w.push_str(&format!(", opens {}", until(opens)));
        }
        w
    });
    let adaptive = u
        .adaptive
        .as_ref()
        .map(|a| format!("adaptive {}", a.algorithm.as_str()));
    let keyed = u.fairness_keys.then(|| "by key".to_string());
    [origin, nesting, window, adaptive, keyed]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join("; ")
}

/// Whether anything is granting: the live workers, as `semaphore show`, `top` and the status
/// page show them.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Presence {
    /// Live workers, and when one was last seen.
    pub(crate) granting: permitq::Granting,
    /// The workers seen in the last hour, live first.
    pub(crate) workers: Vec<permitq::WorkerSeen>,
    /// When no worker runs: that nothing is granting, and what to do.
    pub(crate) nothing_granting: Option<String>,
}

impl Presence {
    pub(crate) async fn read(client: &permitq::Client) -> permitq::Result<Presence> {
        let granting = client.granting().await?;
        Ok(Presence {
            nothing_granting: granting.warning(),
            granting,
            workers: client.workers().await?,
        })
    }

    /// One line: `workers: w-1 on db1 (0.1.0, seen 1s ago), ...`, or that nothing is granting.
    pub(crate) fn summary(&self) -> String {
        self.line(|w| {
            format!(
                "{} on {} ({}, seen {} ago)",
                w.worker_id,
                w.host,
                w.version,
                ago(w.seen_at)
            )
        })
    }

    /// [`Presence::summary`] in a line of 80 columns: the live workers' ids and hosts.
    pub(crate) fn short_summary(&self) -> String {
        self.line(|w| format!("{}@{}", w.worker_id, w.host))
    }

    /// `workers (N): ` and each live worker as `describe` writes it, or that nothing is granting.
    fn line(&self, describe: impl Fn(&permitq::WorkerSeen) -> String) -> String {
        if let Some(warning) = &self.nothing_granting {
            return warning.clone();
        }
        let live: Vec<String> = self
            .workers
            .iter()
            .filter(|w| w.live)
            .map(describe)
            .collect();
        format!("workers ({}): {}", live.len(), live.join(", "))
    }
}

/// Prints usage, holders, waiters and recent capacity changes.
pub(crate) fn print(d: &Detail, sees_all: bool) {
    let u = &d.usage;
    // A rate limit bounds grants per window, not what is held: its capacity is on the kind line.
    // A template holds nothing itself: the capacity is each instance's.
    let held = if u.is_template {
        format!("capacity {} for each instance", u.capacity)
    } else if u.per.is_some() {
        format!("{} held", u.held)
    } else {
        // `used` is the workers' count: ahead of what is held by the releases not counted back
        // yet. Over capacity: lowered below what is held, which revokes nothing.
        let used = if u.used > u.held {
            format!(
                " (used {}: {} released, counted back by the next worker pass)",
                u.used,
                u.used - u.held
            )
        } else {
            String::new()
        };
        let over = if u.held > u.capacity {
            " (over capacity: set below what is held, by a lowered capacity or a removed rate \
             window; nothing is revoked)"
        } else {
            ""
        };
        format!("{} / {} held{used}{over}", u.held, u.capacity)
    };
    outln!(
        "{}  {held}, {} waiting, oldest wait {}, {}",
        u.name,
        u.waiting,
        ago(u.oldest_wait_since),
        if u.fair { "fair" } else { "greedy" }
    );
    let kind = kind(u);
    if !kind.is_empty() {
        outln!("  {kind}");
    }
    if let Some(i) = &d.instances {
        outln!(
            "  {} of at most {} instances (max_instances), which hold {} and have {} waiting \
             (the counts above are the template's own: it holds nothing itself)",
            i.count,
            i.max_instances,
            i.held,
            i.waiting
        );
        if !i.names.is_empty() {
            let more = i.count - i.names.len();
            let more = if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            };
            outln!("  instances: {}{more}", i.names.join(", "));
        }
    }
    if !d.children.is_empty() {
        let children: Vec<String> = d
            .children
            .iter()
            .map(|c| {
                let guarantee = if c.guarantee > 0 {
                    format!(", guarantee {}", c.guarantee)
                } else {
                    String::new()
                };
                // A template's own row holds nothing: what its instances hold is what counts.
                match c.instances {
                    Some(n) => format!(
                        "{} (template: {n} {}, {} used; each capacity {}{guarantee})",
                        quoted_name(&c.name),
                        if n == 1 { "instance" } else { "instances" },
                        c.used,
                        c.capacity
                    ),
                    None => format!(
                        "{} (capacity {}{guarantee}, {} used)",
                        quoted_name(&c.name),
                        c.capacity,
                        c.used
                    ),
                }
            })
            .collect();
        outln!("  children: {}", children.join(", "));
    }
    outln!("  {}", d.presence.summary());
    // A producer login sees its own requests only: say what it does not see.
    let shown: i64 = d.holders.iter().map(|h| h.count).sum();
    let hidden = if u.per.is_none() && u.held > shown {
        let more = u.held - shown;
        format!(
            "; {more} more {} held by other logins' requests, not shown to this one",
            if more == 1 { "permit" } else { "permits" }
        )
    } else {
        String::new()
    };
    outln!("\nholders ({}{hidden}):", d.holders.len());
    if !d.holders.is_empty() {
        outln!(
            "  {:<32} {:<16} {:>6} {:>10} {:>14} {:>8}",
            "external_id",
            "owner",
            "count",
            "held for",
            "lease",
            "token"
        );
    }
    for h in &d.holders {
        outln!(
            "  {:<32} {:<16} {:>6} {:>10} {:>14} {:>8}",
            h.external_id,
            h.owner.as_deref().unwrap_or("-"),
            h.count,
            ago(h.acquired_at),
            lease_end(h.expires_at),
            h.fencing_token.map_or("-".to_string(), |t| t.to_string())
        );
    }
    // A login that reads every request sees every waiter: the note is for producers.
    if u.waiting == 0 {
        outln!("\nwaiters: none");
    } else {
        outln!(
            "\nwaiters ({} of {} shown, in the order the workers grant them{}):",
            d.waiters.len(),
            u.waiting,
            if sees_all {
                ""
            } else {
                "; this producer login sees its own"
            }
        );
    }
    // On a semaphore served by key, each waiter's key too: whose turn it takes.
    let keyed = d.usage.fairness_keys;
    if !d.waiters.is_empty() {
        outln!(
            "  {:>4} {:<32} {:<16} {:>6} {:>8} {:>10}{}",
            "pos",
            "external_id",
            "owner",
            "count",
            "priority",
            "waiting",
            if keyed { "  fairness key" } else { "" }
        );
    }
    // Each waiter's aging too (one per AGING_STEP waited, as explain says it), which is what
    // puts an older request of lower priority ahead of a later one of higher.
    let now = SystemTime::now();
    let aged = |w: &permitq::Waiter| -> i64 {
        let waited = w
            .waiting_since
            .and_then(|t| now.duration_since(t).ok())
            .unwrap_or_default();
        i64::try_from(waited.as_secs() / permitq::AGING_STEP.as_secs().max(1)).unwrap_or(0)
    };
    let shows_aging = d.waiters.iter().any(|w| aged(w) > 0);
    for w in &d.waiters {
        let priority = if shows_aging && aged(w) > 0 {
            format!("{} (+{})", w.priority, aged(w))
        } else {
            w.priority.to_string()
        };
        let key = if keyed {
            format!("  {}", key_or_none(w.fairness_key.as_deref()))
        } else {
            String::new()
        };
        outln!(
            "  {:>4} {:<32} {:<16} {:>6} {:>8} {:>10}{key}",
            w.position,
            w.external_id,
            w.owner.as_deref().unwrap_or("-"),
            w.count,
            priority,
            ago(w.waiting_since)
        );
    }
    if shows_aging {
        outln!(
            "  (+N: aged by its wait, one per {}s waited; an older request of lower priority goes \
             ahead once aging lifts it above a later one's)",
            permitq::AGING_STEP.as_secs()
        );
    }
    // Served by fairness key: each key's share, so that the order above can be read. A
    // template serves no line itself: each instance is a line with its own keys.
    if d.usage.fairness_keys && d.usage.is_template {
        outln!(
            "\nfairness keys: each instance is a line of its own, with its own keys' turns \
             (`permitq semaphore show INSTANCE` shows its keys)"
        );
    } else if d.usage.fairness_keys {
        outln!(
            "\nfairness keys ({}):",
            if d.key_shares.is_empty() {
                "none yet".to_string()
            } else if !sees_all {
                // A producer login: its own keys alone, so no shares.
                format!(
                    "your {} shown, most waiting first; shares and how far back are for \
                     operators, who see every key",
                    d.key_shares.len()
                )
            } else {
                format!("{} shown, most waiting first", d.key_shares.len())
            }
        );
        if !d.key_shares.is_empty() {
            outln!(
                "  keys that wait take turns in proportion to their weights; each request's turn \
                 is its own count ÷ its own weight, and the weight shown is the largest among a \
                 key's waiting requests (its holders' when none waits). Shares are of the turns to come: requests already placed \
                 keep their places, so a key placed earlier is served those first (the waiters \
                 above are in that order)"
            );
        }
        for k in &d.key_shares {
            let share = k
                .share_percent
                .map(|share| format!(", {share}% of the turns to come"))
                .unwrap_or_default();
            // Turns taken that the line has not passed: the share starts after them.
            let back = match k.placed_back {
                Some(back) => format!(
                    "; its next request is placed {} after its arrival, later in line (its \
                     turns reach that far past the line's turn, the start of the latest turn \
                     granted)",
                    short_seconds(back.as_secs_f64())
                ),
                None if sees_all => "; its next request is placed at its arrival".to_string(),
                None => String::new(),
            };
            if k.waiting == 0 && k.held == 0 {
                // Listed for its turns alone (a login that reads every request sees these).
                outln!("  {:<24} nothing waiting or held{back}", key_label(k));
                continue;
            }
            outln!(
                "  {:<24} weight {:<4} waiting {} ({} permit{}), holds {}{share}{back}",
                key_label(k),
                k.weight,
                k.waiting,
                k.waiting_permits,
                if k.waiting_permits == 1 { "" } else { "s" },
                k.held
            );
        }
        for pair in keys_alike(&d.key_shares) {
            outln!(
                "  note: {pair} are different keys (keys are compared exactly, case and spaces \
                 included): check what your producers send"
            );
        }
    }
    if let Some(e) = &d.first_in_line {
        outln!("\nwhy the first in line waits:");
        for line in explanation(e) {
            outln!("  {line}");
        }
    }
    // An adaptive semaphore's capacity over time: each change's new capacity, oldest first;
    // then only the latest changes in full.
    let mut changes = &d.capacity_history[..];
    if let Some(a) = &d.usage.adaptive {
        outln!(
            "\nadaptive ({}): the workers set its capacity between {} and {} from what its \
             holders report (`permitq release ID --outcome ok|overloaded|failed{}`)",
            a.algorithm.as_str(),
            a.floor,
            a.ceiling,
            // The gradient compares the ok reports' latency: without it, it reads only counts.
            if a.algorithm.as_str() == "gradient" {
                " --latency 30ms"
            } else {
                ""
            }
        );
        let trace: Vec<String> = changes
            .iter()
            .filter(|c| !c.deleted)
            .map(|c| c.new_capacity.to_string())
            .collect();
        outln!(
            "capacity over its last {} changes, oldest first: {}",
            trace.len(),
            trace.join(" ")
        );
        // What the last cadence with reports counted, also when it kept the capacity (no
        // audit row then), and the rule it followed.
        match &d.last_reports {
            Some(r) => {
                let n = |key: &str| r[key].as_i64().unwrap_or(0);
                let (from, to) = (n("from"), n("to"));
                outln!(
                    "last reports counted {} ago: {} ok, {} overloaded, {} failed{}, {} in use: {}",
                    humantime::format_duration(std::time::Duration::from_secs_f64(
                        r["ago_s"].as_f64().unwrap_or(0.0).clamp(0.0, 1e9).round()
                    )),
                    n("ok"),
                    n("overloaded"),
                    n("failed"),
                    latency_words(r),
                    n("used"),
                    if from == to {
                        kept_words(r, a)
                    } else {
                        format!("{from} -> {to}")
                    }
                );
            }
            None => outln!("no reports counted yet"),
        }
        outln!(
            "{}",
            match a.algorithm {
                permitq::Algorithm::Aimd =>
                    "(aimd: 90% when two reports, or a tenth of the ok and overloaded ones, \
                    say overloaded; +1 when more say ok than failed and half the capacity is in \
                    use)",
                _ =>
                    "(gradient: grows while latency stays near its unloaded level and half the \
                    capacity is in use, holds up to 1.2x it, shrinks past; overloads as aimd)",
            }
        );
        changes = &changes[changes.len().saturating_sub(10)..];
    }
    outln!("\ncapacity changes (latest {}):", changes.len());
    for c in changes {
        outln!(
            "  {} {} by {}{}",
            c.changed_at
                .map(|t| humantime::format_rfc3339_seconds(t).to_string())
                .unwrap_or_default(),
            capacity_change(c, u.template.as_deref()),
            c.changed_by,
            c.inputs.as_ref().map_or(String::new(), change_inputs)
        );
    }
}

/// What moved an audited change, in words: a setting kept outside the semaphore's row (` (made
/// adaptive: gradient, 2 to 50)`, ` (served by fairness key from here on)`), or an adaptive
/// cadence's inputs (` (from 3 ok, 1 overloaded, 0 failed, latency 20ms, 6 in use)`).
pub(crate) fn change_inputs(inputs: &serde_json::Value) -> String {
    let mut said = Vec::new();
    match &inputs["adaptive"] {
        serde_json::Value::Bool(false) => said.push("made fixed: no longer adaptive".to_string()),
        serde_json::Value::Object(a) => said.push(format!(
            "made adaptive: {}, {} to {}",
            a.get("algorithm").and_then(|v| v.as_str()).unwrap_or("?"),
            a.get("floor").map_or("?".to_string(), ToString::to_string),
            a.get("ceiling")
                .map_or("?".to_string(), ToString::to_string)
        )),
        _ => {}
    }
    match &inputs["fairness_keys"] {
        serde_json::Value::Bool(true) => {
            said.push("served by fairness key from here on".to_string())
        }
        serde_json::Value::Bool(false) => said.push(
            "no longer served by fairness key: priority and arrival order from here on".to_string(),
        ),
        _ => {}
    }
    // A cadence's change (its reports), not a setting's.
    if inputs.get("ok").is_some() {
        let n = |key: &str| inputs[key].as_i64().unwrap_or(0);
        let latency = latency_words(inputs);
        said.push(format!(
            "from {} ok, {} overloaded, {} failed{latency}, {} in use{}",
            n("ok"),
            n("overloaded"),
            n("failed"),
            n("used"),
            change_rule(inputs)
        ));
    }
    if said.is_empty() {
        String::new()
    } else {
        format!(" ({})", said.join("; "))
    }
}

/// Which rule moved the capacity at a cadence (docs/concepts.md, adaptive capacity), by the
/// algorithms' own definitions: `: overloaded (two reports or a tenth), back by a tenth`.
fn change_rule(inputs: &serde_json::Value) -> String {
    if report_signals(inputs).overloaded() {
        ": overloaded (two reports or a tenth said so), so back by a tenth".to_string()
    } else if latency_ratio(inputs).is_some_and(|x| x > permitq::TOLERANCE) {
        format!(
            ": latency past {}x the unloaded, so back off by how far past",
            permitq::TOLERANCE
        )
    } else {
        String::new()
    }
}

/// A cadence's report counts (`ok`, `overloaded`, `failed` in its inputs or last reports), as
/// the algorithms read them.
fn report_signals(r: &serde_json::Value) -> permitq::Signals {
    let n = |key: &str| r[key].as_i64().unwrap_or(0);
    let mut signals = permitq::Signals::default();
    (signals.ok, signals.overloaded, signals.failed) = (n("ok"), n("overloaded"), n("failed"));
    signals
}

/// A cadence's latency over the gradient's unloaded one, when both were measured.
fn latency_ratio(r: &serde_json::Value) -> Option<f64> {
    r["latency_ms"]
        .as_f64()
        .zip(r["long_latency_ms"].as_f64().filter(|l| *l > 0.0))
        .map(|(ms, long)| ms / long)
}

/// A cadence's latency, and the gradient's unloaded latency it was compared with:
/// `, p90 latency 40ms, 4.0x the unloaded 10ms`.
fn latency_words(inputs: &serde_json::Value) -> String {
    let Some(ms) = inputs["latency_ms"].as_f64() else {
        return String::new();
    };
    match inputs["long_latency_ms"].as_f64().filter(|l| *l > 0.0) {
        // The first measured (or a new low) is the unloaded latency itself, from then on.
        Some(long) if (ms - long).abs() < 0.5 => format!(
            ", p90 latency {ms:.0}ms, the unloaded latency now (later cadences are compared \
             with it)"
        ),
        Some(long) => format!(
            ", p90 latency {ms:.0}ms, {:.1}x the unloaded {long:.0}ms",
            ms / long
        ),
        None => format!(", p90 latency {ms:.0}ms"),
    }
}

/// Why a cadence with reports kept the capacity, by the rules of docs/concepts.md (adaptive
/// capacity): `kept 8: aimd grows only when more reports say ok than failed`.
fn kept_words(r: &serde_json::Value, a: &permitq::AdaptiveLimit) -> String {
    let n = |key: &str| r[key].as_i64().unwrap_or(0);
    let (to, ok, overloaded, failed, used) =
        (n("to"), n("ok"), n("overloaded"), n("failed"), n("used"));
    // The reports a tenth of which back off: those that speak of the load.
    let reports = ok + overloaded;
    // The algorithms' own rule (permitq::Signals::overloaded).
    let backs_off = report_signals(r).overloaded();
    let (tolerance, queueing) = (permitq::TOLERANCE, permitq::QUEUEING);
    let ratio = latency_ratio(r);
    let why = if backs_off {
        format!("at its floor {}, where backing off stops", a.floor)
    } else if to >= i64::from(a.ceiling) {
        format!("at its ceiling {}", a.ceiling)
    } else if overloaded == 1 && ok <= failed {
        format!(
            "one overloaded report of {reports} ok and overloaded (under a tenth) moves \
             nothing, and it grows only when more reports say ok than failed"
        )
    } else if a.algorithm == permitq::Algorithm::Aimd && ok <= failed {
        "it grows only when more reports say ok than failed".to_string()
    } else if used * 2 < to {
        // The rule every algorithm shares.
        format!(
            "it grows only while at least half of it ({}) is held when the cadence runs ({used} \
             was; permits released before it count no more)",
            (to + 1) / 2
        )
    } else if a.algorithm == permitq::Algorithm::Aimd {
        return format!("kept {to}");
    } else {
        match ratio {
            None => "gradient moves on latency (and overloaded reports), and no ok report gave \
                     a latency"
                .to_string(),
            Some(x) if x > tolerance && to <= i64::from(a.floor) => format!(
                "at its floor {}, though latency is {x:.2}x the unloaded (past {tolerance}x it \
                 backs off)",
                a.floor
            ),
            Some(x) if x > tolerance => format!(
                "latency is {x:.2}x the unloaded, past {tolerance}x: it is backing off, its estimate a \
                 fifth of the way a cadence, and the capacity drops once that passes a whole \
                 permit"
            ),
            Some(x) if x > queueing => {
                format!("latency at {x:.2}x the unloaded, within the {tolerance}x it holds at")
            }
            Some(_) => "it grows a fraction of a permit a cadence (less near where it last \
                        backed off), and a capacity rises once that reaches a whole permit"
                .to_string(),
        }
    };
    format!("kept {to}: {why}")
}

/// What one audited change set, in words: `created: capacity 4, fair, per 1m` at creation,
/// else each bound that moved (`capacity 4 -> 8; max_instances - -> 20`), or that nothing did.
pub(crate) fn capacity_change(c: &permitq::CapacityChange, template: Option<&str>) -> String {
    fn opt<T: ToString>(v: Option<T>) -> String {
        v.map_or("-".to_string(), |v| v.to_string())
    }
    let per = |p: Option<std::time::Duration>| opt(p.map(humantime::format_duration));
    let fairness = |fair: bool| if fair { "fair" } else { "greedy" };
    if c.deleted {
        return format!("deleted (it had capacity {})", c.new_capacity);
    }
    let Some(old_capacity) = c.old_capacity else {
        let mut parts = vec![
            format!("capacity {}", c.new_capacity),
            fairness(c.new_fair).to_string(),
        ];
        if let Some(parent) = &c.new_parent {
            parts.push(format!(
                "in {parent}, guaranteed {}",
                c.new_guarantee.unwrap_or(0)
            ));
        }
        if c.new_per.is_some() {
            parts.push(format!("per {}", per(c.new_per)));
        }
        if let Some(m) = c.new_max_instances {
            parts.push(format!("max_instances {m}"));
        }
        return format!("created: {}", parts.join(", "));
    };
    let mut moved = Vec::new();
    if old_capacity != c.new_capacity {
        moved.push(format!("capacity {old_capacity} -> {}", c.new_capacity));
    }
    if c.old_fair.is_some_and(|f| f != c.new_fair) {
        moved.push(format!(
            "{} -> {}",
            fairness(!c.new_fair),
            fairness(c.new_fair)
        ));
    }
    if c.old_parent != c.new_parent {
        moved.push(format!(
            "parent {} -> {}",
            opt(c.old_parent.as_deref()),
            opt(c.new_parent.as_deref())
        ));
    }
    if c.old_guarantee.unwrap_or(0) != c.new_guarantee.unwrap_or(0) {
        moved.push(format!(
            "guarantee {} -> {}",
            opt(c.old_guarantee),
            opt(c.new_guarantee)
        ));
    }
    if c.old_max_instances != c.new_max_instances {
        moved.push(format!(
            "max_instances {} -> {}",
            opt(c.old_max_instances),
            opt(c.new_max_instances)
        ));
    }
    if c.old_per != c.new_per {
        moved.push(format!("per {} -> {}", per(c.old_per), per(c.new_per)));
    }
    // A setting kept outside the row changed (adaptive, fairness keys): what, says its inputs.
    let setting = c
        .inputs
        .as_ref()
        .is_some_and(|i| i.get("adaptive").is_some() || i.get("fairness_keys").is_some());
    if moved.is_empty() {
        match template {
            _ if setting => format!("capacity {} (unchanged)", c.new_capacity),
            // An instance is set again by every change of its template.
            Some(template) => format!(
                "capacity {} (set again by a change of template {template}, unchanged here)",
                c.new_capacity
            ),
            None => format!("capacity {} (set again, unchanged)", c.new_capacity),
        }
    } else {
        moved.join("; ")
    }
}

/// Why a request waits, as lines of text: per semaphore what is free and missing, its place in
/// line, the rule that holds it back, the holders and the estimated wait; or its outcome.
pub(crate) fn explanation(e: &permitq::Explanation) -> Vec<String> {
    if e.semaphores.is_empty() {
        let outcome = e.outcome.clone().unwrap_or_else(|| e.state.to_string());
        return vec![format!("{} is not waiting: {outcome}", e.external_id)];
    }
    let mut lines = vec![format!("{} waits ({})", e.external_id, e.state)];
    if let Some(warning) = &e.nothing_granting {
        lines.push(format!("  {warning}"));
    }
    for s in &e.semaphores {
        // A spent rate window: what is left is grants in the window, not permits released.
        let window = s.reason.starts_with("rate limit:");
        let free_of = |free, capacity| {
            if window {
                format!("{free} of {capacity} grants left in its rate window")
            } else {
                format!("{free} free of {capacity}")
            }
        };
        // Room a parent keeps for other children's guarantees is not this request's: it is
        // named before the shortfall, which counts it (needs + kept - free).
        // Within its own guarantee, a child may take that room too: said, so that the
        // shortfall adds up (needs - free).
        let kept = match s.kept {
            Some(k) if k > 0 && s.reason.starts_with("parent: within the guarantee") => format!(
                " ({k} of it kept for other children's guarantees, which this request, within \
                 its own guarantee, may take all the same)"
            ),
            Some(k) if k > 0 => format!(", {k} kept for other children's guarantees"),
            _ => String::new(),
        };
        // Its own shortfall, apart from the permits of those ahead of it in line (the reason
        // adds what they take here first).
        let behind = s.permits_ahead.is_some_and(|a| a > 0);
        let room = match (s.free, s.capacity, s.shortfall) {
            (Some(free), Some(capacity), Some(short)) if short > 0 => format!(
                "{}{kept}, short {short}{}",
                free_of(free, capacity),
                if behind { " for itself" } else { "" }
            ),
            (Some(free), Some(capacity), _) => format!("{}{kept}", free_of(free, capacity)),
            _ => "not there".to_string(),
        };
        let place = match (s.position, s.permits_ahead) {
            (Some(p), Some(a)) => format!(
                "; position {p}, {a} {} ahead of it in line",
                if a == 1 { "permit" } else { "permits" }
            ),
            _ => String::new(),
        };
        let via = s
            .via
            .as_ref()
            .map_or(String::new(), |v| format!(" (parent, through {v})"));
        lines.push(format!(
            "{}{via}: needs {}, {room}{place}",
            s.semaphore, s.needs
        ));
        lines.push(format!("  {}", s.reason));
        if let Some(fairness) = &s.fairness {
            lines.extend(fairness_sentences(fairness).map(|l| format!("  {l}")));
        }
        // A spent window waits for time, not for its holders; where it fits, its holders are not
        // what it waits for: neither is the answer.
        let short = s.shortfall.unwrap_or(0) > 0;
        if !s.holders.is_empty() && !window && short {
            let holders: Vec<String> = s
                .holders
                .iter()
                .map(|h| {
                    let lease = h.expires_at.map_or(", no lease".to_string(), |t| {
                        format!(", lease {}", lease_end(Some(t)))
                    });
                    format!(
                        "{} ({} for {}{lease})",
                        h.external_id,
                        h.count,
                        short_seconds(h.held_for_s)
                    )
                })
                .collect();
            lines.push(format!("  held by {}", holders.join(", ")));
        }
        // Holders without a lease end only by a release: no estimate says when.
        let unleased = !window
            && short
            && !s.holders.is_empty()
            && s.holders.iter().all(|h| h.expires_at.is_none());
        // Every holder shown was granted after the last release here.
        let all_held_since_last_release = s.since_last_release.is_some_and(|ago| {
            !s.holders.is_empty() && s.holders.iter().all(|h| h.held_for_s < ago.as_secs_f64())
        });
        if e.nothing_granting.is_some() && (short || s.estimated_wait.is_some()) {
            // No worker: neither releases nor lease ends grant it, so no estimate holds.
            lines.push("  no estimated wait: nothing grants it until a worker runs".to_string());
        } else if unleased && s.estimated_wait.is_none() {
            lines.push(format!(
                "  its holders have no lease: it waits until one releases (`permitq release ID` \
                 by its owner, or an admin's `permitq revoke ID`){}",
                stale_words(s, e.max_hold)
            ));
        } else if let Some(wait) = s.estimated_wait {
            lines.push(format!(
                "  estimated wait: about {} ({})",
                seconds(wait),
                if window {
                    "when its rate window opens".to_string()
                } else {
                    format!(
                        "from the rate of recent releases here{}, not from these holders' \
                         leases: a holder may release early, or heartbeat past its lease's end",
                        // Counted from that release: the rest of a span of `ago + wait`.
                        s.since_last_release.map_or(String::new(), |ago| format!(
                            ", the last {} ago: about {} from it, {} of that gone",
                            seconds(ago),
                            seconds(ago + wait),
                            seconds(ago)
                        ))
                    )
                }
            ));
        } else if let (false, true, Some(ago), true) = (
            window,
            short,
            s.since_last_release,
            all_held_since_last_release,
        ) {
            lines.push(format!(
                "  no estimated wait: its holders were all granted after the last release here \
                 ({} ago), so the rate of earlier releases says nothing of when they end; the \
                 holders' leases are above",
                seconds(ago)
            ));
        } else if let (false, true, Some(ago)) = (window, short, s.since_last_release) {
            // Releases came, then stopped for longer than they would have taken: their rate
            // says nothing of when the next comes.
            lines.push(format!(
                "  no estimated wait: nothing was released here for {}, longer than the recent \
                 releases took to make as much room (they have stopped, so their rate says \
                 nothing); {}",
                seconds(ago),
                if s.holders.is_empty() {
                    "it waits for the holders to release"
                } else {
                    "the holders' leases are above"
                }
            ));
        } else if short && !window && !s.holders.is_empty() {
            lines.push(
                "  no estimated wait yet: too few releases here recently (two at least) to estimate \
                 a rate from (the holders' leases are above)"
                    .to_string(),
            );
        }
        // Beside an estimate from releases, what the leases say: the two can be far apart.
        if let (false, true, None, Some(bound)) = (
            window,
            short,
            &e.nothing_granting,
            leases_bound(s, SystemTime::now()),
        ) {
            lines.push(format!(
                "  by the holders' leases: enough of them end in {} if none heartbeats (a \
                 heartbeat extends one; a release comes sooner)",
                seconds(bound)
            ));
        }
    }
    lines.extend(deadline_and_priority(e, SystemTime::now()));
    lines
}

/// What the workers' `--max-hold` does for a request whose holders have no lease: when the
/// longest-held of them is released as stale, or that no running worker would.
fn stale_words(s: &permitq::SemaphoreWait, max_hold: Option<std::time::Duration>) -> String {
    let Some(max_hold) = max_hold else {
        return ", or a worker runs with --max-hold DUR, which releases holders held that long \
                as stale (none running has it)"
            .to_string();
    };
    let Some(oldest) = s
        .holders
        .iter()
        .max_by(|a, b| a.held_for_s.total_cmp(&b.held_for_s))
    else {
        return String::new();
    };
    let held = std::time::Duration::from_secs_f64(oldest.held_for_s.max(0.0));
    format!(
        ", or a worker's --max-hold {} releases a holder held that long as stale: {} (held {}) \
         in {}",
        humantime::format_duration(max_hold),
        oldest.external_id,
        seconds(held),
        seconds(max_hold.saturating_sub(held))
    )
}

/// A waiting request's own terms, after its semaphores: when its `wait` runs out (and whether
/// before the estimated wait), and its priority once aging has raised it.
fn deadline_and_priority(e: &permitq::Explanation, now: SystemTime) -> Vec<String> {
    let mut lines = Vec::new();
    // Past it, the semaphores' reasons say that it ran out.
    if let Some(left) = e.wait_ends_at.and_then(|t| t.duration_since(now).ok()) {
        let longest = e.semaphores.iter().filter_map(|s| s.estimated_wait).max();
        lines.push(format!(
            "its wait runs out in {}: then it fails with timeout{}",
            seconds(left),
            if longest.is_some_and(|w| w > left) {
                " (before the estimated wait above: submit again under a new external_id with a \
                 longer --wait, or none, if it must not time out)"
            } else {
                ""
            }
        ));
    }
    if let (Some(priority), Some(aged)) = (e.priority, e.aged_priority) {
        let step = permitq::AGING_STEP.as_secs();
        if aged - f64::from(priority) >= 1.0 {
            // Priorities are whole numbers: one above the floor of its aged priority goes ahead.
            let floor = aged.floor();
            lines.push(format!(
                "priority {priority}, aged to {floor:.0} by its wait (one per {step}s waited): a \
                 request submitted now goes ahead of it only with priority {} or more",
                floor + 1.0
            ));
        }
    }
    lines
}

/// A duration to a tenth of a second below 10 s (`0.1s`, `4.5s`), whole seconds above (`1m 5s`).
fn seconds(wait: std::time::Duration) -> String {
    if wait < std::time::Duration::from_secs(10) {
        format!("{:.1}s", wait.as_secs_f64())
    } else {
        // Rounded, not cut: 17.8 s is 18s (beside a window that "opens in 17.8s").
        let whole = (wait + std::time::Duration::from_millis(500)).as_secs();
        humantime::format_duration(std::time::Duration::from_secs(whole)).to_string()
    }
}

/// When enough of the holders' leases end, if none is extended, to free what the request and
/// those ahead of it need there (`shortfall` and `permits_ahead`): `None` when the holders shown
/// (at most 10, soonest lease end first) do not hold that much with leases.
fn leases_bound(s: &permitq::SemaphoreWait, now: SystemTime) -> Option<std::time::Duration> {
    let needed = s.shortfall.unwrap_or(0) + s.permits_ahead.unwrap_or(0);
    let mut freed = 0;
    for h in &s.holders {
        let end = h.expires_at?;
        freed += h.count;
        if freed >= needed {
            return Some(end.duration_since(now).unwrap_or_default());
        }
    }
    None
}

/// A holder's lease, as the holders table says it: `ends in 28s`, `ran out 3s ago` (not swept
/// yet: no longer held), or `none` (no ttl: held until released).
fn lease_end(expires_at: Option<SystemTime>) -> String {
    let Some(t) = expires_at else {
        return "none".to_string();
    };
    let now = SystemTime::now();
    match t.duration_since(now) {
        Ok(left) => format!("ends in {}s", left.as_secs()),
        Err(_) => format!(
            "ran out {}s ago",
            now.duration_since(t).unwrap_or_default().as_secs()
        ),
    }
}

/// `explain`'s fairness words a sentence a line: each sentence after the first opens with one of
/// the few openings `permitq.fairness_answer` writes (split there alone, so that a key with a
/// full stop in it stays whole).
fn fairness_sentences(fairness: &str) -> impl Iterator<Item = &str> {
    const OPENINGS: [&str; 4] = [
        ". Its key's requests that took",
        ". None of ",
        ". With its priority ",
        ". A request of a key ",
    ];
    let mut rest = fairness;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let cut = OPENINGS
            .iter()
            .filter_map(|o| rest.find(o))
            .min()
            .map_or(rest.len(), |at| at + 1);
        let (line, after) = rest.split_at(cut);
        rest = after.trim_start();
        Some(line)
    })
}

/// A fairness key as shown: the requests that name none share the key `(no key)`; a key that
/// could be mistaken for another (spaces at its ends or doubled, characters that do not print)
/// is quoted, as `permitq explain` quotes it: keys are compared exactly.
pub(crate) fn key_label(k: &permitq::KeyShare) -> String {
    key_or_none(Some(k.fairness_key.as_str()).filter(|key| !key.is_empty()))
}

/// A request's fairness key as shown, `(no key)` for none.
fn key_or_none(key: Option<&str>) -> String {
    key.map_or("(no key)".to_string(), permitq::shown_key)
}

/// A key as a reader takes it: lower case, spaces collapsed (two keys alike in this form are
/// still two keys).
pub(crate) fn alike_form(key: &str) -> String {
    key.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// Keys shown that differ only in case or in spaces at their ends, which read as one tenant
/// but are served as two (keys are compared exactly), as `"acme" and "Acme "`.
fn keys_alike(keys: &[permitq::KeyShare]) -> Vec<String> {
    let mut alike = Vec::new();
    for (i, a) in keys.iter().enumerate() {
        for b in &keys[i + 1..] {
            if alike_form(&a.fairness_key) == alike_form(&b.fairness_key) {
                alike.push(format!("{} and {}", key_label(a), key_label(b)));
            }
        }
    }
    alike
}

/// `name` as it is typed in a shell ([`permitq::shell_word`]).
pub(crate) fn quoted_name(name: &str) -> String {
    permitq::shell_word(name)
}

#[cfg(test)]
mod tests {
    use super::{change_inputs, fairness_sentences, kept_words, latency_words};
    use permitq::{AdaptiveLimit, Algorithm};
    use serde_json::json;

    /// Each reason a cadence with reports kept the capacity, by algorithm; and the unloaded
    /// latency a gradient compared a cadence's with.
    #[test]
    fn a_kept_capacity_says_why_and_a_latency_its_baseline() {
        let aimd = AdaptiveLimit::new(Algorithm::Aimd, 2, 20);
        let gradient = AdaptiveLimit::new(Algorithm::Gradient, 2, 20);
        let kept = |a: &AdaptiveLimit, r: serde_json::Value| kept_words(&r, a);
        let r = |ok: i64, overloaded: i64, failed: i64, used: i64, to: i64| json!({"ok": ok, "overloaded": overloaded, "failed": failed, "used": used, "to": to});
        assert_eq!(
            kept(&aimd, r(3, 0, 3, 8, 8)),
            "kept 8: it grows only when more reports say ok than failed"
        );
        assert_eq!(
            kept(&aimd, r(5, 0, 0, 3, 8)),
            "kept 8: it grows only while at least half of it (4) is held when the cadence runs \
             (3 was; permits released before it count no more)"
        );
        assert_eq!(
            kept(&aimd, r(5, 0, 0, 20, 20)),
            "kept 20: at its ceiling 20"
        );
        assert_eq!(
            kept(&aimd, r(0, 2, 0, 2, 2)),
            "kept 2: at its floor 2, where backing off stops"
        );
        assert!(kept(&aimd, r(10, 1, 12, 8, 8))
            .starts_with("kept 8: one overloaded report of 11 ok and overloaded (under a tenth)"));
        let mut calm = r(5, 0, 0, 8, 8);
        calm["latency_ms"] = json!(11.0);
        calm["long_latency_ms"] = json!(10.0);
        assert_eq!(
            kept(&gradient, calm.clone()),
            "kept 8: latency at 1.10x the unloaded, within the 1.2x it holds at"
        );
        assert_eq!(
            latency_words(&calm),
            ", p90 latency 11ms, 1.1x the unloaded 10ms"
        );
        calm["latency_ms"] = json!(10.0);
        assert!(kept(&gradient, calm).starts_with("kept 8: it grows a fraction of a permit"));
        assert!(kept(&gradient, r(5, 0, 0, 8, 8)).contains("no ok report gave a latency"));
        // Past 1.2x above the floor it is backing off, a part of a permit at a time.
        let mut slow = r(2, 0, 0, 5, 7);
        slow["latency_ms"] = json!(300.0);
        slow["long_latency_ms"] = json!(57.0);
        assert!(
            kept(&gradient, slow.clone())
                .starts_with("kept 7: latency is 5.26x the unloaded, past 1.2x: it is backing off"),
            "{}",
            kept(&gradient, slow.clone())
        );
        slow["to"] = json!(2);
        assert!(kept(&gradient, slow).starts_with("kept 2: at its floor 2, though latency"));
        assert_eq!(
            latency_words(&json!({"latency_ms": 40.0})),
            ", p90 latency 40ms"
        );
    }

    /// A cadence's change says which rule moved it, and a first latency that it is the
    /// unloaded one (not "1.0x the unloaded", which read as a comparison).
    #[test]
    fn a_cadence_change_says_which_rule_moved_it() {
        let inputs = |ok: i64, overloaded: i64, ms: f64, long: f64| {
            json!({"ok": ok, "overloaded": overloaded, "failed": 0, "used": 12,
                   "latency_ms": ms, "long_latency_ms": long})
        };
        assert_eq!(
            change_inputs(&inputs(2, 1, 452.0, 452.0)),
            " (from 2 ok, 1 overloaded, 0 failed, p90 latency 452ms, the unloaded latency now \
             (later cadences are compared with it), 12 in use: overloaded (two reports or a \
             tenth said so), so back by a tenth)"
        );
        assert!(change_inputs(&inputs(9, 0, 40.0, 10.0)).ends_with(
            "4.0x the unloaded 10ms, 12 in use: latency past 1.2x the unloaded, so back off by \
             how far past)"
        ));
        assert!(change_inputs(&inputs(9, 0, 10.0, 10.0)).ends_with(", 12 in use)"));
    }

    #[test]
    fn fairness_words_are_split_at_their_sentences_alone() {
        let said = "fairness key acme. inc, weight 1: placed 20s after its arrival, by its \
                    key's turns (a turn is 10s × count ÷ weight). Its key's requests that took \
                    their turns before it and still wait here: a-2 (their turns: 10s); more. With its priority 1 (1 \
                    turns, 10s, earlier) it stands 10s after its arrival. A request of a key \
                    with no turns outstanding at priority 1 goes behind it.";
        let lines: Vec<&str> = fairness_sentences(said).collect();
        assert_eq!(lines.len(), 4, "{lines:#?}");
        assert!(lines[0].starts_with("fairness key acme. inc, weight 1"));
        assert!(lines[0].ends_with("÷ weight)."));
        assert!(lines[1].starts_with("Its key's requests that took"));
        assert!(lines[2].starts_with("With its priority 1"));
        assert!(lines[3].starts_with("A request of a key") && lines[3].ends_with("behind it."));
    }
}
