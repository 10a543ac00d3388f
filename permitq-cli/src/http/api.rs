//! The read-only JSON API: `GET /api/semaphores` (every semaphore's usage) and
//! `GET /api/semaphores/{name}` (usage, holders, the first 100 waiters, the last 20 capacity
//! changes; 404 for an unknown name).

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

/// The first waiters shown for one semaphore.
const WAITERS_SHOWN: i64 = 100;
/// The latest capacity changes shown for one semaphore.
const HISTORY_SHOWN: usize = 20;

fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_string(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

fn database_error(e: &permitq::Error) -> Response {
    json(
        StatusCode::SERVICE_UNAVAILABLE,
        &serde_json::json!({ "error": crate::error::one_line(&e.to_string()) }),
    )
}

pub(super) async fn semaphores(State(state): State<super::State>) -> Response {
    match state.client.usage().await {
        Ok(usage) => json(StatusCode::OK, &usage),
        Err(e) => database_error(&e),
    }
}

pub(super) async fn semaphore(
    State(state): State<super::State>,
    Path(name): Path<String>,
) -> Response {
    match detail(&state.client, &name).await {
        Ok(Some(detail)) => json(StatusCode::OK, &detail),
        Ok(None) => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({ "error": format!("no semaphore named {name:?}") }),
        ),
        Err(e) => database_error(&e),
    }
}

/// One semaphore in full, as `semaphore show --json` prints it too.
#[derive(Debug, Serialize)]
pub(crate) struct Detail {
    pub(crate) usage: permitq::SemaphoreUsage,
    pub(crate) holders: Vec<permitq::Holder>,
    pub(crate) waiters: Vec<permitq::Waiter>,
    pub(crate) capacity_history: Vec<permitq::CapacityChange>,
}

/// Usage, holders, waiters and recent capacity changes of `name`, or None when unknown.
pub(crate) async fn detail(
    client: &permitq::Client,
    name: &str,
) -> permitq::Result<Option<Detail>> {
    let Some(usage) = client.usage().await?.into_iter().find(|s| s.name == name) else {
        return Ok(None);
    };
    let mut history = client.capacity_history(name).await?;
    let keep_from = history.len().saturating_sub(HISTORY_SHOWN);
    history.drain(..keep_from);
    Ok(Some(Detail {
        usage,
        holders: client.holders(name).await?,
        waiters: client.waiters(name, WAITERS_SHOWN).await?,
        capacity_history: history,
    }))
}
