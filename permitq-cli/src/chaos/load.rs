//! The chaos load: clients with their own connections submitting random requests, holding,
//! heartbeating and releasing, with racing duplicate submits and some deliberate cancels. Every
//! operation is recorded.
//!
//! A client never gives up on a request by itself: it waits until the request is granted or
//! fails (a `wait` runs out in the database), so the checkers judge liveness and starvation on
//! what the database did, not on a client's patience. When the load stops, requests still
//! waiting are left to the run's drain.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use super::history::{outcome_of_error, History, Op, OpKind, Outcome};
use super::SEMAPHORES;
use permitq::Client;
use permitq::{Request, State};

/// Clients beside the random ones that submit only requests on the keyed semaphore
/// ([`keyed_request`]): the random clients' requests, seed for seed, stay what they were.
pub(crate) const KEYED_CLIENTS: usize = 3;

/// Runs one client until `stop`, with its own pool: random requests, or (`keyed`) requests on
/// the keyed semaphore alone.
pub(crate) async fn client_loop(
    id: usize,
    url: String,
    seed: u64,
    keyed: bool,
    history: History,
    stop: Arc<AtomicBool>,
) {
    let mut rng = fastrand::Rng::with_seed(seed ^ (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let Ok(client) = Client::connect(&url).await else {
        return;
    };
    let Ok(twin) = Client::connect(&url).await else {
        return;
    };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let external_id = format!("c{id}-{n}");
        let request = if keyed {
            keyed_request(&mut rng, external_id)
        } else {
            random_request(&mut rng, external_id)
        };
        // Some submits race a duplicate of themselves from a second connection.
        let duplicate = rng.u8(..8) == 0;
        let (first, second) = if duplicate {
            let (a, b) = tokio::join!(
                submit_until_known(&client, id, &request, &history),
                submit_until_known(&twin, id, &request, &history)
            );
            (a, b)
        } else {
            (
                submit_until_known(&client, id, &request, &history).await,
                true,
            )
        };
        if !(first || second) {
            continue; // definitely not submitted
        }
        // From here on the request may exist: it is released once granted, cancelled when the
        // client changes its mind, or deliberately abandoned to its TTL, so no permit leaks out
        // of the run.
        let cancel_after = (request.wait.is_none() && rng.u8(..20) == 0)
            .then(|| Duration::from_millis(rng.u64(50..500)));
        match wait_settled(&client, &request.external_id, cancel_after, &stop).await {
            Waited::Settled(State::Acquired) => {
                hold_and_release(&client, id, &request, &history, &mut rng).await
            }
            Waited::Settled(_) => {
                // Failed: releasing it must change nothing (it says `not_acquired`).
                release_until_known(&client, id, &request.external_id, &history).await
            }
            Waited::CancelDue => {
                release_until_known(&client, id, &request.external_id, &history).await
            }
            Waited::LoadStopped => return,
        }
    }
}

/// Borrowers at the root of the nested tree, beside the random clients: each holds one permit of
/// the root itself for 300 ms, again and again. Three of them want more of the root than the
/// pool's guarantee leaves while the pool is active (two at most), so the reserve binds all
/// through a run, and a bug that drops it shows at once (the *guarantees* checker).
pub(crate) const ROOT_BORROWERS: usize = 3;

/// Runs one root borrower until `stop`.
pub(crate) async fn borrower_loop(id: usize, url: String, history: History, stop: Arc<AtomicBool>) {
    let Ok(client) = Client::connect(&url).await else {
        return;
    };
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let request = Request::new(format!("b{id}-{n}")).permit(super::NESTED_ROOT.0, 1);
        if !submit_until_known(&client, id, &request, &history).await {
            continue;
        }
        match wait_settled(&client, &request.external_id, None, &stop).await {
            Waited::Settled(State::Acquired) => {
                tokio::time::sleep(Duration::from_millis(300)).await;
                release_until_known(&client, id, &request.external_id, &history).await;
            }
            Waited::Settled(_) | Waited::CancelDue => {
                release_until_known(&client, id, &request.external_id, &history).await;
            }
            Waited::LoadStopped => return,
        }
    }
}

/// How waiting for a request ended.
enum Waited {
    /// It left `new` in this state (or is unknown: `Error`, never granted).
    Settled(State),
    /// The client's deliberate cancel is due.
    CancelDue,
    /// The load stopped first.
    LoadStopped,
}

/// Waits until the request leaves `new`, riding out connection errors, until a deliberate
/// cancel is due or the load stops.
async fn wait_settled(
    client: &Client,
    external_id: &str,
    cancel_after: Option<Duration>,
    stop: &AtomicBool,
) -> Waited {
    let started = std::time::Instant::now();
    loop {
        if stop.load(Ordering::Relaxed) {
            return Waited::LoadStopped;
        }
        let mut slice = Duration::from_millis(500);
        if let Some(after) = cancel_after {
            let left = after.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Waited::CancelDue;
            }
            slice = slice.min(left);
        }
        match client.wait_settled(external_id, slice).await {
            Ok(Some(r)) if r.state != State::New => return Waited::Settled(r.state),
            Ok(Some(_)) => {}
            Ok(None) => return Waited::Settled(State::Error),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// A request on the keyed semaphore alone (so that no other line sees the place its key gives
/// it), with one of the fairness keys and its weight, or none (a key of its own); some with a
/// wait, some at another priority.
fn keyed_request(rng: &mut fastrand::Rng, external_id: String) -> Request {
    let (name, capacity) = super::KEYED;
    let mut request =
        Request::new(external_id).permit(name, rng.i64(1..=i64::from(capacity).min(2)));
    if let Some((key, weight)) = super::FAIRNESS_KEYS.get(rng.usize(..=super::FAIRNESS_KEYS.len()))
    {
        request = request.fairness_key(*key).fairness_weight(*weight);
    }
    if rng.u8(..6) == 0 {
        request.priority = rng.i16(-2..=2);
    }
    if rng.u8(..6) == 0 {
        request.wait = Some(Duration::from_millis(rng.u64(100..1500)));
    }
    request
}

fn random_request(rng: &mut fastrand::Rng, external_id: String) -> Request {
    let mut request = Request::new(external_id);
    let fair: Vec<&(&str, i32, bool)> = SEMAPHORES.iter().filter(|s| s.2).collect();
    if rng.u8(..10) == 0 {
        // A large request on one fair semaphore: the head the stream must not starve.
        let (name, capacity, _) = fair[rng.usize(..fair.len())];
        request = request.permit(*name, i64::from(*capacity).max(2) - 1);
    } else {
        let how_many = rng.usize(1..=4);
        for (name, capacity, _) in rng.choose_multiple(SEMAPHORES.iter(), how_many) {
            let count = rng.i64(1..=i64::from(*capacity).clamp(1, 2));
            request = request.permit(*name, count);
        }
    }
    // A key of the per-key template, and the rate-limited semaphore, in some of them.
    if rng.u8(..5) == 0 {
        request = request.permit(format!("c-key:k{}", rng.usize(..super::KEYS)), 1);
    }
    // Nested limits: a tenant of the pool in a third of them, alone in half of those (the
    // tenant, the pool and the root decide it); the pool or the root named directly in a few.
    let tenant = rng.u8(..3) == 0;
    if tenant && rng.bool() {
        request = Request::new(request.external_id);
    }
    if tenant {
        let name = format!(
            "{}t{}",
            super::TENANT_TEMPLATE.0.trim_end_matches('*'),
            rng.usize(..super::TENANTS)
        );
        request = request.permit(name, 1);
    } else if rng.u8(..15) == 0 {
        let name = if rng.bool() {
            super::NESTED_POOL.0
        } else {
            super::NESTED_ROOT.0
        };
        request = request.permit(name, 1);
    }
    // A fifth take from the rate-limited parent, through one of its children.
    if rng.u8(..5) == 0 {
        request = request.permit(super::RATE_CHILDREN[rng.usize(..2)], 1);
    }
    // A third name the rate-limited semaphore: demand near its limit, so its window binds
    // (and a planted bug that ignores the window overshoots it in every run).
    if rng.u8(..3) == 0 {
        request = request.permit(super::RATE_LIMITED.0, 1);
    }
    // Mostly priority 0 (FIFO), some ahead or behind.
    if rng.u8(..5) == 0 {
        request.priority = rng.i16(-3..=3);
    }
    request.wait = match rng.u8(..10) {
        0 => Some(Duration::ZERO),
        1..=3 => Some(Duration::from_millis(rng.u64(100..1500))),
        _ => None,
    };
    if rng.u8(..3) == 0 {
        request.ttl = Some(Duration::from_millis(rng.u64(300..1500)));
    }
    request
}

fn now() -> SystemTime {
    SystemTime::now()
}

/// Submits until the outcome is known (ok or fail); an indeterminate submit is retried with the
/// same external_id. Returns false only when it definitely failed.
async fn submit_until_known(
    client: &Client,
    id: usize,
    request: &Request,
    history: &History,
) -> bool {
    for _ in 0..50 {
        let invoked = now();
        let outcome = match client.submit(request).await {
            Ok(r) => Outcome::Ok(r.id.to_string()),
            Err(e) => outcome_of_error(&e),
        };
        let done = !matches!(outcome, Outcome::Info(_));
        let ok = matches!(outcome, Outcome::Ok(_));
        history.record(Op {
            client: id,
            kind: OpKind::Submit,
            key: request.external_id.clone(),
            arg: 0,
            invoked,
            completed: now(),
            outcome,
        });
        if done {
            return ok;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    true
}

/// Releases until the database answers (up to ~2 minutes of retries: a holder that gave up
/// earlier would leak its permits, which is the load generator's fault, not the system's).
async fn release_until_known(client: &Client, id: usize, external_id: &str, history: &History) {
    for _ in 0..1200 {
        let invoked = now();
        let result = client.release(external_id).await;
        if record_release(history, id, external_id, invoked, result) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Records a release invoked at `invoked` that ended with `result`; true when the database
/// answered.
fn record_release(
    history: &History,
    id: usize,
    external_id: &str,
    invoked: SystemTime,
    result: permitq::Result<permitq::ReleaseOutcome>,
) -> bool {
    let outcome = match result {
        Ok(o) => Outcome::Ok(o.to_string()),
        Err(e) => outcome_of_error(&e),
    };
    let done = matches!(outcome, Outcome::Ok(_));
    history.record(Op {
        client: id,
        kind: OpKind::Release,
        key: external_id.to_string(),
        arg: 0,
        invoked,
        completed: now(),
        outcome,
    });
    done
}

/// The least TTL of a holder that works under a [`permitq::Lease`]: its guard stops it a tenth
/// of the TTL (here at least 100 ms) before the lease's end, room for a busy machine's timers.
const LEASE_HOLDER_MIN_TTL: Duration = Duration::from_secs(1);
/// How long one slice of a lease holder's work lasts: it checks the lease before each.
const WORK_SLICE: Duration = Duration::from_millis(10);

/// A holder that uses the [`permitq::Lease`] guard, as the README tells users to: it works in
/// slices while the lease is not lost, for up to 2.5 TTLs (so past the first TTL it relies on
/// the guard's heartbeats), and stops at the lost signal. The span it worked is recorded
/// ([`OpKind::Work`]): the *leases* checker holds it to the lease the database kept.
async fn work_under_lease(
    client: &Client,
    id: usize,
    request: &Request,
    ttl: Duration,
    history: &History,
    rng: &mut fastrand::Rng,
) {
    // The request is granted: acquiring it again (an idempotent submit) returns its lease.
    let Ok(lease) = client.acquire(request, Duration::from_secs(5)).await else {
        return release_until_known(client, id, &request.external_id, history).await;
    };
    let began = now();
    let until = std::time::Instant::now() + ttl.mul_f64(rng.f64() * 2.5);
    let mut worked_until = began;
    let mut lost = false;
    while std::time::Instant::now() < until {
        if lease.is_lost() {
            lost = true;
            break;
        }
        // Works from here for one slice.
        worked_until = now() + WORK_SLICE;
        tokio::time::sleep(WORK_SLICE).await;
    }
    history.record(Op {
        client: id,
        kind: OpKind::Work,
        key: request.external_id.clone(),
        arg: lease.fencing_token(),
        invoked: began,
        completed: worked_until,
        outcome: Outcome::Ok(if lost { "lost" } else { "done" }.to_string()),
    });
    let invoked = now();
    let result = lease.release().await;
    if !record_release(history, id, &request.external_id, invoked, result) {
        release_until_known(client, id, &request.external_id, history).await;
    }
}

async fn hold_and_release(
    client: &Client,
    id: usize,
    request: &Request,
    history: &History,
    rng: &mut fastrand::Rng,
) {
    if request.ttl.is_some() && rng.u8(..4) == 0 {
        return; // This holder "dies": no heartbeat, no release. The lease sweep must reclaim it.
    }
    if let Some(ttl) = request.ttl.filter(|ttl| *ttl >= LEASE_HOLDER_MIN_TTL) {
        if rng.bool() {
            return work_under_lease(client, id, request, ttl, history, rng).await;
        }
    }
    let hold = Duration::from_millis(rng.u64(0..400));
    let beats = if request.ttl.is_some() && rng.bool() {
        2
    } else {
        0
    };
    for _ in 0..beats {
        tokio::time::sleep(hold / 3).await;
        let invoked = now();
        let outcome = match client.heartbeat(&request.external_id, None).await {
            Ok(_) => Outcome::Ok(String::new()),
            Err(e) => outcome_of_error(&e),
        };
        history.record(Op {
            client: id,
            kind: OpKind::Heartbeat,
            key: request.external_id.clone(),
            arg: 0,
            invoked,
            completed: now(),
            outcome,
        });
    }
    tokio::time::sleep(hold / 3).await;
    release_until_known(client, id, &request.external_id, history).await;
    if rng.u8(..5) == 0 {
        // Releases are idempotent: a second one must change nothing.
        release_until_known(client, id, &request.external_id, history).await;
    }
}
