//! Who may read what, and how many at once.
//!
//! `/healthz` and `/readyz` are always open (probes). `/metrics` holds per-semaphore counts and no
//! request: open, unless a token is set. The status page and `/api/*` show requests (external
//! ids, owners, tokens): with a token they need it, as `Authorization: Bearer TOKEN` or HTTP
//! Basic with the token as password (what a browser sends after its prompt); without one they
//! are served only on a loopback address, or with `--http-no-auth` (behind a proxy that
//! authenticates). Everything is read-only: there is no route that writes.
//!
//! A request limit bounds the database reads the endpoints make: at most `max_concurrent`
//! requests are served at once, and a request beyond that is answered 429 at once, so a flood of
//! clients cannot take the database's time from the workers. Probes are not limited: `/healthz`
//! reads nothing, and `/readyz` answers from a result at most a second old.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;

/// How the endpoints are guarded.
#[derive(Debug, Clone)]
pub(crate) struct Access {
    /// The token that reads everything; `None`: no token.
    token: Option<Arc<str>>,
    /// Without a token: whether the pages showing requests are served (a loopback address, or
    /// `--http-no-auth`).
    open_without_token: bool,
    /// The request limit.
    slots: Arc<tokio::sync::Semaphore>,
}

/// What kind of data an endpoint shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exposure {
    /// `/healthz`, `/readyz`.
    Probe,
    /// `/metrics`: counts per semaphore.
    Counts,
    /// The page and `/api/*`: requests.
    Requests,
}

impl Access {
    /// Guarded by `token` (if any); without one, pages showing requests are served only when
    /// `open_without_token`. At most `max_concurrent` requests at once.
    pub(crate) fn new(
        token: Option<String>,
        open_without_token: bool,
        max_concurrent: usize,
    ) -> Access {
        Access {
            token: token.map(Arc::from),
            open_without_token,
            slots: Arc::new(tokio::sync::Semaphore::new(max_concurrent.max(1))),
        }
    }

    /// Whether `request` carries the token: `Bearer TOKEN`, or Basic with TOKEN as password.
    fn authenticated(&self, request: &Request) -> bool {
        let Some(token) = &self.token else {
            return false;
        };
        let Some(given) = request
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
        else {
            return false;
        };
        // The scheme is case-insensitive (RFC 9110): `bearer` as well as `Bearer`.
        let (scheme, credentials) = given.split_once(' ').unwrap_or((given, ""));
        let presented = if scheme.eq_ignore_ascii_case("bearer") {
            credentials.trim().to_string()
        } else if scheme.eq_ignore_ascii_case("basic") {
            let basic = credentials;
            let Ok(decoded) = base64::engine::general_purpose::STANDARD.decode(basic.trim()) else {
                return false;
            };
            let decoded = String::from_utf8_lossy(&decoded).to_string();
            decoded
                .split_once(':')
                .map_or(String::new(), |(_, password)| password.to_string())
        } else {
            return false;
        };
        constant_time_eq(presented.as_bytes(), token.as_bytes())
    }
}

fn exposure(path: &str) -> Exposure {
    match path {
        "/healthz" | "/readyz" => Exposure::Probe,
        "/metrics" => Exposure::Counts,
        _ => Exposure::Requests,
    }
}

/// Compares without stopping at the first difference (the time says nothing of the token).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The middleware: refuses what the caller may not read (401), and what exceeds the limit (429).
pub(crate) async fn guard(
    axum::extract::State(access): axum::extract::State<Access>,
    request: Request,
    next: Next,
) -> Response {
    let exposure = exposure(request.uri().path());
    let needs_token = match exposure {
        Exposure::Probe => false,
        Exposure::Counts => access.token.is_some(),
        Exposure::Requests => access.token.is_some() || !access.open_without_token,
    };
    if needs_token && !access.authenticated(&request) {
        let sent = request.headers().get(header::AUTHORIZATION);
        // A value with no scheme before it (`Authorization: TOKEN`): the token may be right.
        let no_scheme = sent
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| !v.trim().contains(' '));
        let why = if access.token.is_some() && no_scheme {
            "the Authorization header has no scheme: send `Authorization: Bearer TOKEN` (or HTTP \
             Basic with the token as password)\n"
        } else if access.token.is_some() && sent.is_some() {
            "the token sent is not the one given to permitq with --http-token-file (send \
             `Authorization: Bearer TOKEN`, or HTTP Basic with the token as password)\n"
        } else if access.token.is_some() {
            "this endpoint needs the token given to permitq with --http-token-file: send \
             `Authorization: Bearer TOKEN` (or HTTP Basic with the token as password)\n"
        } else {
            "this endpoint shows requests and this server listens beyond loopback without a \
             token: start it with --http-token-file FILE (or --http-no-auth behind a proxy that \
             authenticates)\n"
        };
        let mut response = (StatusCode::UNAUTHORIZED, why).into_response();
        if access.token.is_some() {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"permitq\", charset=\"UTF-8\""),
            );
        }
        return response;
    }
    // Probes never wait for a slot: a flood of requests must not make a pod look dead
    // (`/readyz` reads the database at most once a second, see readyz).
    if exposure == Exposure::Probe {
        return next.run(request).await;
    }
    let Ok(_slot) = access.slots.clone().try_acquire_owned() else {
        let mut response = (
            StatusCode::TOO_MANY_REQUESTS,
            "too many requests at once: try again in a second (--http-max-concurrent)\n",
        )
            .into_response();
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        return response;
    };
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(path: &str, authorization: Option<&str>) -> Request {
        let mut builder = axum::http::Request::builder().uri(path);
        if let Some(a) = authorization {
            builder = builder.header(header::AUTHORIZATION, a);
        }
        builder.body(axum::body::Body::empty()).unwrap()
    }

    #[test]
    fn the_token_is_accepted_as_bearer_or_basic_password_and_nothing_else() {
        let access = Access::new(Some("s3cret".into()), false, 4);
        let basic = |user_password: &str| {
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(user_password)
            )
        };
        assert!(access.authenticated(&request("/", Some("Bearer s3cret"))));
        assert!(access.authenticated(&request("/", Some("bearer s3cret"))));
        assert!(access.authenticated(&request("/", Some(&basic("any:s3cret")))));
        for wrong in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("Token s3cret"),
            Some("Basic !!!"),
        ] {
            assert!(!access.authenticated(&request("/", wrong)), "{wrong:?}");
        }
        assert!(!access.authenticated(&request("/", Some(&basic("s3cret")))));
        assert!(!access.authenticated(&request("/", Some(&basic("s3cret:x")))));
        let no_token = Access::new(None, true, 4);
        assert!(!no_token.authenticated(&request("/", Some("Bearer "))));
    }

    #[test]
    fn probes_are_open_and_metrics_only_need_a_token_when_one_is_set() {
        assert_eq!(exposure("/healthz"), Exposure::Probe);
        assert_eq!(exposure("/readyz"), Exposure::Probe);
        assert_eq!(exposure("/metrics"), Exposure::Counts);
        for path in [
            "/",
            "/rows",
            "/api/semaphores",
            "/api/semaphores/x",
            "/nope",
        ] {
            assert_eq!(exposure(path), Exposure::Requests, "{path}");
        }
    }
}
