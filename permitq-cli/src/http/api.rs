//! The read-only JSON API: `GET /api/semaphores` (every semaphore's usage),
//! `GET /api/semaphores/{name}` (usage, holders, the first 100 waiters, why the first in line
//! waits, the last 20 capacity changes; 404 for an unknown name) and
//! `GET /api/requests/{external_id}/explain` (why a request waits; 404 for an unknown one).

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// The first waiters shown for one semaphore.
const WAITERS_SHOWN: i64 = 100;
/// The latest capacity changes shown for one semaphore.
const HISTORY_SHOWN: usize = 20;
/// The capacity changes of an adaptive semaphore the detail holds: its plot's points.
pub(crate) const ADAPTIVE_HISTORY_SHOWN: usize = 200;

pub(super) fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn database_error(e: &str) -> Response {
    json(
        StatusCode::SERVICE_UNAVAILABLE,
        &serde_json::json!({ "error": crate::error::one_line(e) }),
    )
}

pub(super) async fn semaphores(State(state): State<super::State>) -> Response {
    match state.overview().await {
        Ok(overview) => json(StatusCode::OK, &overview.0),
        Err(e) => database_error(&e),
    }
}

pub(super) async fn semaphore(
    State(state): State<super::State>,
    Path(name): Path<String>,
) -> Response {
    // The overview (reused) knows every semaphore: an unknown name costs no read, and a known
    // one's usage row and the workers come from it.
    let overview = match state.overview().await {
        Ok(overview) => overview,
        Err(e) => return database_error(&e),
    };
    let detail = match overview.0.iter().find(|s| s.name == name) {
        Some(usage) => state
            .detail(usage, &overview.0, &overview.1)
            .await
            .map(Some),
        None => Ok(None),
    };
    match detail.as_ref().map(Option::as_deref) {
        Ok(Some(detail)) => json(StatusCode::OK, detail),
        Ok(None) => {
            // As the CLI says it: the names nearest, or where the list is.
            let similar = state
                .client
                .similar_semaphores(&name)
                .await
                .unwrap_or_default();
            let hint = if similar.is_empty() {
                " (GET /api/semaphores lists them all)".to_string()
            } else {
                format!("; did you mean {}?", similar.join(" or "))
            };
            json(
                StatusCode::NOT_FOUND,
                &serde_json::json!({ "error": format!("no semaphore named {name:?}{hint}") }),
            )
        }
        Err(e) => database_error(e),
    }
}

pub(super) async fn explain(
    State(state): State<super::State>,
    Path(external_id): Path<String>,
) -> Response {
    match state.client.explain(&external_id).await {
        Ok(Some(explanation)) => json(StatusCode::OK, &explanation),
        Ok(None) => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({ "error": format!(
                "no request named {external_id:?}: none was submitted under that external_id \
                 (check it), or retention removed it after it ended; a server run as a producer \
                 login sees only that login's requests"
            ) }),
        ),
        Err(e) => database_error(&state.reader.said(&e)),
    }
}

/// One semaphore in full, as `semaphore show --json` prints it too.
#[derive(Debug, Serialize)]
pub(crate) struct Detail {
    pub(crate) usage: permitq::SemaphoreUsage,
    pub(crate) holders: Vec<permitq::Holder>,
    pub(crate) waiters: Vec<permitq::Waiter>,
    /// Why the first in line waits (`permitq.explain` of the waiter at position 1).
    pub(crate) first_in_line: Option<permitq::Explanation>,
    pub(crate) capacity_history: Vec<permitq::CapacityChange>,
    /// What each change of `capacity_history` set, in its order and in words, as `semaphore
    /// show` says it (`capacity 4 -> 8`, `fair -> greedy`).
    pub(crate) capacity_changes: Vec<String>,
    /// For a template: the most instances it may make, and how many it has now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) instances: Option<Instances>,
    /// For a parent (nested limits): its children, by name (a template's instances through
    /// the template), at most [`INSTANCES_NAMED`].
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) children: Vec<Child>,
    /// For an adaptive semaphore: what its last cadence with reports counted, and what it set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) last_reports: Option<serde_json::Value>,
    /// For a semaphore served by fairness key: each key's share now, most waiting first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) key_shares: Vec<permitq::KeyShare>,
    /// The workers, and whether anything is granting.
    #[serde(flatten)]
    pub(crate) presence: crate::show::Presence,
}

/// A parent's child: its settings and what it uses; for a template, over its instances.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Child {
    pub(crate) name: String,
    pub(crate) capacity: i64,
    pub(crate) guarantee: i64,
    /// What it holds (a template: its instances together), releases not yet counted back
    /// included.
    pub(crate) used: i64,
    /// For a template: how many instances it has.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) instances: Option<usize>,
}

/// A template's instances: how many it has, the most it may make, and the first few by name.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Instances {
    pub(crate) count: usize,
    pub(crate) max_instances: i64,
    /// The first [`INSTANCES_NAMED`] instances in name order.
    pub(crate) names: Vec<String>,
    /// What its instances hold, and their requests waiting (a template holds nothing itself).
    pub(crate) held: i64,
    pub(crate) waiting: i64,
}

/// How many of a template's instances, or of a parent's children, `semaphore show` names.
const INSTANCES_NAMED: usize = 10;

/// Usage, holders, waiters and recent capacity changes of `name`, or None when unknown.
pub(crate) async fn detail(
    client: &permitq::Client,
    name: &str,
) -> permitq::Result<Option<Detail>> {
    let all = client.usage().await?;
    let Some(usage) = all.iter().find(|s| s.name == name).cloned() else {
        return Ok(None);
    };
    let presence = crate::show::Presence::read(client).await?;
    detail_of(client, usage, &all, presence).await.map(Some)
}

/// [`detail`] of the semaphore whose usage row, every semaphore's (`all`, for its children)
/// and the workers were read already.
pub(super) async fn detail_of(
    client: &permitq::Client,
    usage: permitq::SemaphoreUsage,
    all: &[permitq::SemaphoreUsage],
    presence: crate::show::Presence,
) -> permitq::Result<Detail> {
    let name = usage.name.as_str();
    let mut history = client.capacity_history(name).await?;
    // An adaptive semaphore's changes draw its capacity over time: more of them.
    let shown = if usage.adaptive.is_some() {
        ADAPTIVE_HISTORY_SHOWN
    } else {
        HISTORY_SHOWN
    };
    let keep_from = history.len().saturating_sub(shown);
    history.drain(..keep_from);
    let waiters = client.waiters(name, WAITERS_SHOWN).await?;
    let first_in_line = match waiters.iter().find(|w| w.position == 1) {
        Some(w) => client.explain(&w.external_id).await?,
        None => None,
    };
    let mut children: Vec<Child> = all
        .iter()
        .filter(|s| s.parent.as_deref() == Some(name) && s.template.is_none())
        .map(|s| {
            let instances: Vec<&permitq::SemaphoreUsage> = all
                .iter()
                .filter(|i| s.is_template && i.template.as_deref() == Some(s.name.as_str()))
                .collect();
            Child {
                name: s.name.clone(),
                capacity: s.capacity,
                guarantee: s.guarantee,
                used: s.used + instances.iter().map(|i| i.used).sum::<i64>(),
                instances: s.is_template.then_some(instances.len()),
            }
        })
        .collect();
    children.sort_by(|a, b| a.name.cmp(&b.name));
    children.truncate(INSTANCES_NAMED);
    let instances = if usage.is_template {
        // Its instances' usage rows (read already); the semaphore rows for its bound alone.
        let of_it: Vec<&permitq::SemaphoreUsage> = all
            .iter()
            .filter(|i| i.template.as_deref() == Some(name))
            .collect();
        let mut names: Vec<String> = of_it.iter().map(|i| i.name.clone()).collect();
        names.sort();
        names.truncate(INSTANCES_NAMED);
        Some(Instances {
            count: of_it.len(),
            names,
            held: of_it.iter().map(|i| i.held).sum(),
            waiting: of_it.iter().map(|i| i.waiting).sum(),
            max_instances: client
                .semaphores()
                .await?
                .iter()
                .find(|s| s.name == name)
                .and_then(|s| s.max_instances)
                .unwrap_or(i64::from(permitq::MAX_INSTANCES)),
        })
    } else {
        None
    };
    let last_reports = match usage.adaptive {
        Some(_) => client.last_adaptive_reports(name).await?,
        None => None,
    };
    let key_shares = if usage.fairness_keys {
        client.key_shares(name).await?
    } else {
        Vec::new()
    };
    let capacity_changes = history
        .iter()
        .map(|c| crate::show::capacity_change(c, usage.template.as_deref()))
        .collect();
    Ok(Detail {
        last_reports,
        key_shares,
        instances,
        holders: client.holders(name).await?,
        usage,
        waiters,
        first_in_line,
        capacity_changes,
        capacity_history: history,
        children,
        presence,
    })
}
